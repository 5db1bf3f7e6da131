//! `linkbench`: tbrdma's engine against the kernel's sockets over one veth pair (issue 3).
//!
//! One command, as root: `cargo run --release -p tbrdma-benches --bin linkbench`. It creates a
//! lab of two namespaces joined by one veth pair (MTU 65520), runs every case by starting
//! itself twice (a server in rank 0's namespace pinned to CPU 1, a client in rank 1's pinned to
//! CPU 0), prints one table and the ratios against the targets of issue 3,
//! and always takes the lab down (on error, panic and SIGINT/SIGTERM too).
//!
//! The whole list of cases runs `--rounds` times (3 by default), interleaved: round 1 runs every
//! case in order, then round 2 runs them all again, and so on, so that the machine's drift
//! between cases hits every system alike. Each tbrdma ping-pong runs in lockstep with its floor
//! in the same two processes, in blocks of `--block` round trips ([`tbrdma_floors::pairing`]), and its ratio to
//! the floor in a round is the median over its blocks of each block against the floor blocks
//! beside it: the test hosts change speed within fractions of a second, so even a floor run
//! just before and after the case, in other processes, judged the engine by the host's mood
//! (per-round ratios of one case spanned up to 1.9x). The floors also run alone, once per size
//! and round, for the table. The table shows, per case, the run with the median figure (p50, or
//! MiB/s for bandwidth) and lists every run's; each ratio is computed within each round and
//! reported as the median of those.
//!
//! The parent owns the lab and the child processes; the children ([`child`]) own one case each
//! and report it on one `RESULT` line. The kernel baselines live in [`kernel`], the tbrdma
//! cases in [`rdma`], the table in [`report`].

mod child;
mod kernel;
mod rdma;
mod report;
mod run;

use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use tbrdma_verbs::EngineKind;

/// What one case measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bench {
    /// Nonblocking UDP ping-pong, both sides busy-polling `recv`: the floor the kernel allows.
    UdpFloor,
    /// Busy-polled ping-pong of raw Ethernet frames over `AF_PACKET` with a receive ring: the
    /// floor of the packet engine.
    FrameFloor,
    /// Blocking TCP ping-pong with `TCP_NODELAY`.
    TcpBlocking,
    /// tbrdma SEND ping-pong on pre-posted receives.
    Send(EngineKind),
    /// tbrdma WRITE ping-pong, each side spinning on a sequence word in its own region.
    Write(EngineKind),
    /// One TCP stream, 1 MiB blocking writes.
    TcpStream,
    /// tbrdma WRITEs of 1 MiB, 32 outstanding, one direction.
    WriteBandwidth(EngineKind),
}

impl Bench {
    /// The name used on the command line between parent and child, and in the table.
    pub fn name(self) -> String {
        match self {
            Bench::UdpFloor => "udp-busy".into(),
            Bench::FrameFloor => "frame-busy".into(),
            Bench::TcpBlocking => "tcp-nodelay".into(),
            Bench::Send(e) => format!("send-{}", e.name()),
            Bench::Write(e) => format!("write-{}", e.name()),
            Bench::TcpStream => "tcp-stream".into(),
            Bench::WriteBandwidth(e) => format!("write-bw-{}", e.name()),
        }
    }

    fn parse(name: &str) -> anyhow::Result<Bench> {
        let engine = |s: &str| s.parse::<EngineKind>().map_err(|e| anyhow!(e));
        Ok(match name {
            "udp-busy" => Bench::UdpFloor,
            "frame-busy" => Bench::FrameFloor,
            "tcp-nodelay" => Bench::TcpBlocking,
            "tcp-stream" => Bench::TcpStream,
            _ => {
                if let Some(e) = name.strip_prefix("write-bw-") {
                    Bench::WriteBandwidth(engine(e)?)
                } else if let Some(e) = name.strip_prefix("send-") {
                    Bench::Send(engine(e)?)
                } else if let Some(e) = name.strip_prefix("write-") {
                    Bench::Write(engine(e)?)
                } else {
                    bail!("unknown case {name:?}")
                }
            }
        })
    }

    /// The floor an engine is compared with: the UDP spin floor for the engines that use UDP
    /// sockets, the raw-frame floor for the packet engine.
    pub fn floor_of(engine: EngineKind) -> Bench {
        match engine {
            EngineKind::Packet => Bench::FrameFloor,
            _ => Bench::UdpFloor,
        }
    }

    /// Whether it measures bandwidth (otherwise round trips).
    pub fn is_bandwidth(self) -> bool {
        matches!(self, Bench::TcpStream | Bench::WriteBandwidth(_))
    }
}

impl fmt::Display for Bench {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// One case: what and with how many bytes per message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Case {
    /// What is measured.
    pub bench: Bench,
    /// Bytes per message.
    pub size: usize,
}

/// Command-line options of the parent.
#[derive(Clone, Debug)]
pub struct Options {
    /// Measured round trips per latency case.
    pub iters: u64,
    /// Round trips before measuring.
    pub warmup: u64,
    /// Length of each bandwidth case.
    pub duration: Duration,
    /// Print JSON instead of the table.
    pub json: bool,
    /// Run only the cases whose name contains one of these (all when empty).
    pub only: Vec<String>,
    /// How many times the whole list of selected cases runs, interleaved (at least 1).
    pub rounds: usize,
    /// Round trips per block of a tbrdma ping-pong and of its floor ([`tbrdma_floors::pairing`]).
    pub block: u64,
}

const USAGE: &str = "usage: linkbench [--iters N] [--warmup N] [--seconds S] [--only A,B]
                 [--rounds N] [--block N] [--json]
  Run as root. Measures tbrdma SEND/WRITE round trips and WRITE bandwidth against busy-polling
  UDP, blocking TCP (TCP_NODELAY) and one TCP stream, over one veth pair.
  --iters N     measured round trips per latency case (default 10000)
  --warmup N    round trips before measuring (default 1000)
  --seconds S   length of each bandwidth case (default 2)
  --only A,B    run only the cases whose name contains A or B (e.g. udp,send-uring)
  --rounds N    run the selected cases N times, interleaved (default 3); the table shows each
                case's median round and the ratios are medians of per-round ratios (with an
                even N, the lower of the two middle values)
  --block N     round trips per block of a tbrdma ping-pong and of its floor, run in turn in
                the same processes (default 500); an engine's ratio to its floor is the median
                over its blocks of each against the floor blocks beside it
  --json        print the results as JSON instead of the table";

fn parse_options(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        iters: 10_000,
        warmup: 1_000,
        duration: Duration::from_secs(2),
        json: false,
        only: Vec::new(),
        rounds: 3,
        block: 500,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| anyhow!("{name} needs a value\n{USAGE}"))
                .cloned()
        };
        match arg.as_str() {
            "--iters" => options.iters = value("--iters")?.parse().context("--iters")?,
            "--warmup" => options.warmup = value("--warmup")?.parse().context("--warmup")?,
            "--seconds" => {
                options.duration =
                    Duration::from_secs_f64(value("--seconds")?.parse().context("--seconds")?)
            }
            "--rounds" => options.rounds = value("--rounds")?.parse().context("--rounds")?,
            "--block" => options.block = value("--block")?.parse().context("--block")?,
            "--json" => options.json = true,
            "--only" => {
                options.only = value("--only")?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    if options.iters == 0 {
        bail!("--iters must be at least 1");
    }
    if options.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if options.block == 0 {
        bail!("--block must be at least 1");
    }
    Ok(options)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return child::main(&args[1..]);
    }
    let result = parse_options(&args).and_then(|options| run::parent(&options));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("linkbench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
