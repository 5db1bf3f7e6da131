//! Command-line options of `pingpong` and `bw`, and the subset of them both sides of a run must
//! agree on (exchanged as connection-manager private data and compared before anything runs).

use std::collections::BTreeMap;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// perftest's default port, so firewall rules written for perftest keep working.
pub const DEFAULT_PORT: u16 = 18515;

/// Largest size of the `--all` sweep: 8 MiB, as perftest's `-a`.
const SWEEP_MAX: usize = 8 << 20;

/// Where to connect or listen, and how the engine runs.
#[derive(Debug, Args, Clone)]
pub struct ConnectArgs {
    /// Server to connect to (IP or host name). Without it, listen and serve one run.
    pub server: Option<String>,
    /// TCP port of the connection manager (the side channel).
    #[arg(long, short = 'p', default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Local address of the link to use.
    #[arg(long, value_name = "IP", conflicts_with = "iface")]
    pub bind: Option<String>,
    /// Interface of the link to use (`thunderbolt0`).
    #[arg(long, value_name = "NAME")]
    pub iface: Option<String>,
    /// Datagram backend [default: packet for `pingpong` with caller progress, sockets
    /// otherwise]. Packet (Ethernet frames) falls back to sockets without root, and sends UDP
    /// to a peer that hears only UDP; io_uring falls back to sockets when the kernel refuses
    /// it. Each default is the fastest measured at what the tool measures (docs/cli.md,
    /// "Engines, progress, memory").
    #[arg(long, value_enum)]
    pub engine: Option<EngineArg>,
    /// Who runs the engine: `caller` spins in this thread (one core per process), `thread`
    /// adds a background engine thread.
    #[arg(long, value_enum, default_value_t = ProgressArg::Caller)]
    pub progress: ProgressArg,
    /// Seconds to wait for the connection and for any one iteration before giving up.
    #[arg(long, value_name = "S", default_value_t = 10.0)]
    pub timeout: f64,
    /// One JSON object per line per size on stdout, nothing else there.
    #[arg(long)]
    pub json: bool,
}

impl ConnectArgs {
    /// The timeout as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout.max(0.001))
    }
}

/// `--engine`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    /// io_uring (multishot receive, provided buffers).
    Uring,
    /// Nonblocking sendmmsg/recvmmsg.
    Sockets,
    /// Ethernet frames with a receive ring shared with the kernel (root; UDP to peers that
    /// hear only UDP).
    Packet,
}

/// What a tool measures, which decides its default engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measures {
    /// Round trips (`pingpong`).
    RoundTrips,
    /// Bandwidth (`bw`).
    Bandwidth,
}

impl EngineArg {
    /// The engine asked for, or the default for a tool that `measures` this with `progress`.
    /// The packet engine's round trip is the shortest with caller progress (0.6x the sockets
    /// engine's at 8 B); its bandwidth was 0.87x that of sockets over veth, whose frames the
    /// sending CPU also copies into the receiver's ring; with an engine thread, sockets
    /// measured fastest (io_uring did not beat it, and the packet engine was not measured).
    pub fn or_default_for(
        engine: Option<EngineArg>,
        progress: ProgressArg,
        measures: Measures,
    ) -> EngineArg {
        engine.unwrap_or(match (progress, measures) {
            (ProgressArg::Caller, Measures::RoundTrips) => EngineArg::Packet,
            _ => EngineArg::Sockets,
        })
    }
}

/// `--progress`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProgressArg {
    /// A background engine thread.
    Thread,
    /// The measuring thread runs the engine while it polls.
    Caller,
}

/// `--op` of `pingpong`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LatOp {
    /// RDMA WRITE into each other's memory, polled (ib_write_lat).
    Write,
    /// SEND/RECV (ib_send_lat).
    Send,
    /// RDMA READ by the client (ib_read_lat).
    Read,
    /// FETCH_ADD by the client (ib_atomic_lat).
    Atomic,
}

/// `--op` of `bw`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BwOp {
    /// RDMA WRITE (ib_write_bw).
    Write,
    /// SEND/RECV (ib_send_bw).
    Send,
    /// RDMA READ (ib_read_bw).
    Read,
}

/// Which message sizes to run.
#[derive(Debug, Args, Clone)]
pub struct SizeArgs {
    /// Message size in bytes (repeatable).
    #[arg(long, short = 's', value_name = "N", conflicts_with = "all")]
    pub size: Vec<usize>,
    /// Sweep sizes from 2 B to 8 MiB by powers of two.
    #[arg(long, short = 'a')]
    pub all: bool,
}

impl SizeArgs {
    /// The sizes, `default` when none was given.
    pub fn sizes(&self, default: usize) -> anyhow::Result<Vec<usize>> {
        let sizes = if self.all {
            std::iter::successors(Some(2usize), |s| (*s < SWEEP_MAX).then_some(s * 2)).collect()
        } else if self.size.is_empty() {
            vec![default]
        } else {
            self.size.clone()
        };
        if let Some(bad) = sizes.iter().find(|&&s| s == 0 || s > 1 << 30) {
            anyhow::bail!("--size {bad}: sizes must be between 1 byte and 1 GiB");
        }
        Ok(sizes)
    }
}

/// `tbrdma pingpong`.
#[derive(Debug, Args, Clone)]
#[command(after_help = "\
Examples:
  tbrdma pingpong                          # on host A: serve one run
  tbrdma pingpong 10.0.0.1 --op write -a   # on host B: WRITE latency, 2 B to 8 MiB
  tbrdma pingpong 10.0.0.1 --op send --size 8 --size 4096 --verify --json
  tbrdma pingpong --paired-with floor      # on host A, then on host B:
  tbrdma pingpong 10.0.0.1 --paired-with floor -s 8 -s 16384 -n 20000")]
pub struct PingpongArgs {
    /// Operation to time.
    #[arg(long, value_enum, default_value_t = LatOp::Write)]
    pub op: LatOp,
    #[command(flatten)]
    pub sizes: SizeArgs,
    /// Measured iterations per size.
    #[arg(long, short = 'n', default_value_t = 1000)]
    pub iters: u64,
    /// Unmeasured iterations before them.
    #[arg(long, default_value_t = 100)]
    pub warmup: u64,
    /// Every payload carries a pattern the receiver checks; a mismatch fails the run.
    #[arg(long)]
    pub verify: bool,
    /// Also runs a floor, the cheapest ping-pong the kernel allows on the same cable, in the
    /// same two processes: blocks of `--block` round trips of the floor and of tbrdma in turn,
    /// and each tbrdma block is judged against the floor blocks beside it (what `linkbench`
    /// judges). `floor`: the engine's own (raw frames for the packet engine, UDP otherwise);
    /// `udp`: busy-polled UDP sockets; `frames`: raw Ethernet frames over AF_PACKET (root).
    /// WRITE and SEND only; give it to both sides. The server's floor listens on --port + 1.
    #[arg(long = "paired-with", value_enum, value_name = "FLOOR")]
    pub paired_with: Option<FloorArg>,
    /// Round trips per block with `--paired-with` (tbrdma's and the floor's).
    #[arg(long, value_name = "N", default_value_t = 500)]
    pub block: u64,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

/// `--paired-with` of `pingpong`: which floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FloorArg {
    /// The engine's own floor: frames for the packet engine, UDP for the others.
    Floor,
    /// Busy-polled nonblocking UDP sockets.
    Udp,
    /// Raw Ethernet frames over AF_PACKET, received through a ring (root).
    Frames,
}

/// `tbrdma bw`.
#[derive(Debug, Args, Clone)]
#[command(after_help = "\
Examples:
  tbrdma bw                                  # on host A: serve one run
  tbrdma bw 10.0.0.1 --op write --size 65536 --duration 5
  tbrdma bw 10.0.0.1 --op send --qps 4 --bidir --json
  tbrdma bw --paired-with tcp              # on host A, then on host B:
  tbrdma bw 10.0.0.1 --op write --size 1048576 --duration 2 --verify --paired-with tcp")]
pub struct BwArgs {
    /// Operation to stream.
    #[arg(long, value_enum, default_value_t = BwOp::Write)]
    pub op: BwOp,
    #[command(flatten)]
    pub sizes: SizeArgs,
    /// Messages per queue pair and size (ignored with --duration).
    #[arg(long, short = 'n', default_value_t = 5000)]
    pub iters: u64,
    /// Stream for S seconds per size instead of a number of messages.
    #[arg(long, value_name = "S")]
    pub duration: Option<f64>,
    /// Outstanding requests per queue pair.
    #[arg(long, short = 't', default_value_t = 128)]
    pub tx_depth: usize,
    /// Queue pairs (connections) to stream over at once.
    #[arg(long, short = 'q', default_value_t = 1)]
    pub qps: usize,
    /// Both sides stream at once; the reported bandwidth is the sum.
    #[arg(long, short = 'b')]
    pub bidir: bool,
    /// Use every link to the peer as one device (stripes large messages over the cables):
    /// the link to SERVER (or --bind/--iface) first, then the others to the same host.
    #[arg(long)]
    pub rails: bool,
    /// Check every SEND's payload, and each WRITE or READ region at the end of a size.
    #[arg(long)]
    pub verify: bool,
    /// Also runs a baseline between the same two processes over the same cable, before and
    /// after tbrdma's run of each size, and reports tbrdma's average over the baseline's.
    /// `tcp`: one TCP stream writing blocks of the size (what iperf3 measures), for
    /// `--duration` seconds (1 without it) each time. WRITE and SEND in one direction only (not
    /// with --bidir); give it to both sides. The server's stream listens on --port + 1.
    #[arg(long = "paired-with", value_enum, value_name = "BASELINE")]
    pub paired_with: Option<StreamBaselineArg>,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

/// `--paired-with` of `bw`: which baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StreamBaselineArg {
    /// One TCP stream, blocking writes, the reader counting.
    Tcp,
}

/// What both sides of a run must agree on, by option name (as the user types it).
pub type Agreed = BTreeMap<String, String>;

impl PingpongArgs {
    /// Options the peer must share.
    pub fn agreed(&self, sizes: &[usize]) -> Agreed {
        let mut m = Agreed::new();
        m.insert("--op".into(), format!("{:?}", self.op).to_lowercase());
        m.insert("--size".into(), join(sizes));
        m.insert("--iters".into(), self.iters.to_string());
        m.insert("--warmup".into(), self.warmup.to_string());
        m.insert("--verify".into(), self.verify.to_string());
        let paired = self.paired_with.map_or("none".into(), |f| {
            format!("{f:?}, blocks of {}", self.block).to_lowercase()
        });
        m.insert("--paired-with".into(), paired);
        m
    }
}

impl BwArgs {
    /// Options the peer must share.
    pub fn agreed(&self, sizes: &[usize]) -> Agreed {
        let mut m = Agreed::new();
        m.insert("--op".into(), format!("{:?}", self.op).to_lowercase());
        m.insert("--size".into(), join(sizes));
        m.insert("--iters".into(), self.iters.to_string());
        m.insert(
            "--duration".into(),
            self.duration.map_or("none".into(), |d| d.to_string()),
        );
        m.insert("--tx-depth".into(), self.tx_depth.to_string());
        m.insert("--qps".into(), self.qps.to_string());
        m.insert("--bidir".into(), self.bidir.to_string());
        m.insert("--verify".into(), self.verify.to_string());
        let paired = self
            .paired_with
            .map_or("none".into(), |b| format!("{b:?}").to_lowercase());
        m.insert("--paired-with".into(), paired);
        m
    }
}

fn join(sizes: &[usize]) -> String {
    let v: Vec<String> = sizes.iter().map(usize::to_string).collect();
    v.join(",")
}

/// The options that differ, as `--size (server 8, client 4096)`; empty when they agree.
pub fn differences(server: &Agreed, client: &Agreed) -> Vec<String> {
    let mut keys: Vec<&String> = server.keys().chain(client.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| server.get(*k) != client.get(*k))
        .map(|k| {
            let show = |m: &Agreed| m.get(k).cloned().unwrap_or_else(|| "unset".into());
            format!("{k} (server {}, client {})", show(server), show(client))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_runs_from_two_bytes_to_eight_mebibytes() {
        let args = SizeArgs {
            size: vec![],
            all: true,
        };
        let sizes = args.sizes(2).unwrap();
        assert_eq!(sizes.first(), Some(&2));
        assert_eq!(sizes.last(), Some(&(8 << 20)));
        assert_eq!(sizes.len(), 23);
    }

    #[test]
    fn the_default_engine_is_the_fastest_for_the_progress_mode() {
        use EngineArg::*;
        use Measures::*;
        let default = |progress, measures| EngineArg::or_default_for(None, progress, measures);
        assert_eq!(default(ProgressArg::Caller, RoundTrips), Packet);
        assert_eq!(default(ProgressArg::Caller, Bandwidth), Sockets);
        assert_eq!(default(ProgressArg::Thread, RoundTrips), Sockets);
        let asked = EngineArg::or_default_for(Some(Uring), ProgressArg::Caller, RoundTrips);
        assert_eq!(asked, Uring);
    }

    #[test]
    fn differences_name_each_option_with_both_values() {
        let mut a = Agreed::new();
        a.insert("--size".into(), "8".into());
        a.insert("--op".into(), "write".into());
        let mut b = a.clone();
        b.insert("--size".into(), "4096".into());
        assert_eq!(differences(&a, &b), vec!["--size (server 8, client 4096)"]);
        assert!(differences(&a, &a).is_empty());
    }
}
