//! One side of one case, run inside a lab namespace: `linkbench --child key=value…`.
//!
//! The child enters its namespace before anything else (while it has one thread, which
//! `unshare` of the mount namespace requires), pins itself to its CPU, raises its memlock
//! limit, then serves or measures. A server prints `ready` once its socket listens; a client
//! prints one `RESULT key=value…` line (and a tbrdma ping-pong's client a `PAIRED` line, its
//! ratios to the floor it ran in lockstep with, [`tbrdma_floors::pairing`]). Neither ever waits
//! forever: a case that stops making progress fails after [`tbrdma_floors::STALL`].

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use hdrhistogram::Histogram;
use tbrdma_floors::pairing::{Paired, Plan};

use crate::{Bench, Case, kernel, rdma};

/// Everything a child needs to know.
#[derive(Clone, Debug)]
pub struct ChildArgs {
    /// Namespace to enter.
    pub netns: String,
    /// Server or client.
    pub server: bool,
    /// The case.
    pub case: Case,
    /// This side's address on the cable.
    pub ip: IpAddr,
    /// The server's address and port (the client connects there; the server listens there).
    pub server_addr: SocketAddr,
    /// CPU to pin to.
    pub cpu: usize,
    /// Round trips before measuring.
    pub warmup: u64,
    /// Measured round trips.
    pub iters: u64,
    /// Length of a bandwidth case.
    pub duration: Duration,
    /// Round trips per block of a tbrdma ping-pong paired with its floor ([`tbrdma_floors::pairing`]).
    pub block: u64,
}

impl ChildArgs {
    /// The arguments that recreate `self` in a child.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--child".into(),
            format!("netns={}", self.netns),
            format!("role={}", if self.server { "server" } else { "client" }),
            format!("case={}", self.case.bench.name()),
            format!("size={}", self.case.size),
            format!("ip={}", self.ip),
            format!("server={}", self.server_addr),
            format!("cpu={}", self.cpu),
            format!("warmup={}", self.warmup),
            format!("iters={}", self.iters),
            format!("seconds={}", self.duration.as_secs_f64()),
            format!("block={}", self.block),
        ]
    }

    fn parse(args: &[String]) -> anyhow::Result<ChildArgs> {
        let map: HashMap<&str, &str> = args.iter().filter_map(|a| a.split_once('=')).collect();
        let get = |key: &str| {
            map.get(key)
                .copied()
                .ok_or_else(|| anyhow!("missing {key}="))
        };
        Ok(ChildArgs {
            netns: get("netns")?.to_string(),
            server: match get("role")? {
                "server" => true,
                "client" => false,
                other => bail!("unknown role {other:?}"),
            },
            case: Case {
                bench: Bench::parse(get("case")?)?,
                size: get("size")?.parse().context("size=")?,
            },
            ip: get("ip")?.parse().context("ip=")?,
            server_addr: get("server")?.parse().context("server=")?,
            cpu: get("cpu")?.parse().context("cpu=")?,
            warmup: get("warmup")?.parse().context("warmup=")?,
            iters: get("iters")?.parse().context("iters=")?,
            duration: Duration::from_secs_f64(get("seconds")?.parse().context("seconds=")?),
            block: get("block")?.parse().context("block=")?,
        })
    }

    /// Round trips in all (warm-up included): the server echoes exactly this many.
    pub fn total(&self) -> u64 {
        self.plan().total()
    }

    /// The case's round trips and blocks.
    pub fn plan(&self) -> Plan {
        Plan {
            warmup: self.warmup,
            iters: self.iters,
            block: self.block,
        }
    }

    /// Where the server of a tbrdma ping-pong serves its floor ([`tbrdma_floors::pairing`]): the case's
    /// address, [`FLOOR_PORT_OFFSET`] ports up.
    pub fn floor_addr(&self) -> anyhow::Result<SocketAddr> {
        let port = self
            .server_addr
            .port()
            .checked_add(FLOOR_PORT_OFFSET)
            .ok_or_else(|| anyhow!("port {} has no floor port", self.server_addr.port()))?;
        Ok(SocketAddr::new(self.server_addr.ip(), port))
    }
}

/// How far above a tbrdma case's port its paired floor listens (the parent keeps both in
/// range).
pub const FLOOR_PORT_OFFSET: u16 = 20_000;

/// What a client measured.
#[derive(Debug)]
pub enum Measured {
    /// Round trips of the measured iterations.
    RoundTrips(RoundTrips),
    /// A tbrdma ping-pong's round trips, and its ratios to the floor run in lockstep with it.
    Paired(RoundTrips, Paired),
    /// Bytes moved in a time.
    Bandwidth { bytes: u64, elapsed: Duration },
}

/// Round-trip times in nanoseconds.
#[derive(Debug)]
pub struct RoundTrips(Histogram<u64>);

impl RoundTrips {
    /// An empty record.
    pub fn new() -> RoundTrips {
        RoundTrips(Histogram::new(3).expect("3 significant figures is valid"))
    }

    /// Records one round trip.
    pub fn record(&mut self, rtt: Duration) {
        // An auto-resizing histogram accepts any value.
        let _ = self.0.record((rtt.as_nanos() as u64).max(1));
    }
}

/// Tells the parent the server listens.
pub fn ready() {
    println!("ready");
}

fn pin(cpu: usize) -> anyhow::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).with_context(|| format!("CPU {cpu}"))?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .with_context(|| format!("pinning to CPU {cpu}"))
}

fn run(args: &ChildArgs) -> anyhow::Result<()> {
    pin(args.cpu)?;
    // The bandwidth case pins 32 MiB per side. Root may raise its limit when it holds
    // CAP_SYS_RESOURCE; without it, CAP_IPC_LOCK alone lets root pin beyond the limit, and
    // without either the allocation fails with an error that says so.
    let inf = nix::sys::resource::RLIM_INFINITY;
    let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK, inf, inf);
    let measured = match (args.case.bench, args.server) {
        (Bench::UdpFloor, true) => return kernel::udp_server(args),
        (Bench::UdpFloor, false) => kernel::udp_client(args)?,
        (Bench::FrameFloor, true) => return kernel::frame_server(args),
        (Bench::FrameFloor, false) => kernel::frame_client(args)?,
        (Bench::TcpBlocking, true) => return kernel::tcp_server(args),
        (Bench::TcpBlocking, false) => kernel::tcp_client(args)?,
        (Bench::TcpStream, true) => return kernel::stream_server(args),
        (Bench::TcpStream, false) => kernel::stream_client(args)?,
        (Bench::Send(_), true) => return rdma::send_server(args),
        (Bench::Send(_), false) => rdma::send_client(args)?,
        (Bench::Write(_), true) => return rdma::write_server(args),
        (Bench::Write(_), false) => rdma::write_client(args)?,
        (Bench::WriteBandwidth(_), true) => return rdma::bandwidth_server(args),
        (Bench::WriteBandwidth(_), false) => rdma::bandwidth_client(args)?,
    };
    match measured {
        Measured::RoundTrips(rtts) => print_round_trips(&rtts),
        Measured::Paired(rtts, paired) => {
            print_round_trips(&rtts);
            println!(
                "PAIRED blocks={} floor_p50={:.0} ratio_p50={:.4} ratio_mean={:.4}",
                paired.blocks, paired.floor_p50, paired.ratio_p50, paired.ratio_mean
            );
        }
        Measured::Bandwidth { bytes, elapsed } => {
            println!("RESULT bytes={bytes} nanos={}", elapsed.as_nanos())
        }
    }
    Ok(())
}

fn print_round_trips(RoundTrips(h): &RoundTrips) {
    println!(
        "RESULT count={} p50={} p99={} mean={:.0} min={} max={} over_1ms={}",
        h.len(),
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.mean(),
        h.min(),
        h.max(),
        h.count_between(1_000_000, u64::MAX)
    );
}

/// Entry point of `linkbench --child …`.
pub fn main(argv: &[String]) -> ExitCode {
    let args = match ChildArgs::parse(argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("linkbench child: {e:#}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = tbrdma_netdev::netns::enter_current_thread(&args.netns) {
        eprintln!("linkbench child: entering namespace {}: {e}", args.netns);
        return ExitCode::from(2);
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "linkbench {} {} {} B: {e:#}",
                if args.server { "server" } else { "client" },
                args.case.bench,
                args.case.size
            );
            ExitCode::FAILURE
        }
    }
}
