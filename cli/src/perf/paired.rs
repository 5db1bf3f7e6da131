//! `--paired-with`: the baseline that runs beside tbrdma in the same two processes over the same
//! cable, and what the run says of it: for `tbrdma pingpong` the floor of its engine, in turn
//! with tbrdma's ping-pong block by block; for `tbrdma bw` one TCP stream, before and after
//! tbrdma's run of each size.
//!
//! The floors and the schedule are `linkbench`'s own ([`tbrdma_floors`]), so that the ratio a
//! user sees on a cable is the one the benchmark judges (issue 16). The server's floor listens
//! on the run's `--port` + 1, on its link's address; it is bound at the start of each size,
//! before the server answers the size's first message, and the client's floor speaks only after
//! the warm-up of tbrdma's ping-pong, so it is always there (hence at least one warm-up round
//! trip: the raw-frame floor's first frame may also find the neighbour table empty and be
//! resent, which only a warm-up may do).

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Serialize;
use tbrdma_floors::frames::{FrameEchoer, FramePinger};
use tbrdma_floors::pairing::{Echoer, Paired, Pinger};
use tbrdma_floors::tcp::Streamed;
use tbrdma_floors::udp::{UdpEchoer, UdpPinger};
use tbrdma_verbs::EngineKind;

use crate::perf::options::{BwArgs, BwOp, FloorArg, LatOp, PingpongArgs};

/// A floor's kind, once `floor` is resolved against the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    /// Busy-polled UDP.
    Udp,
    /// Raw frames over `AF_PACKET`.
    Frames,
}

impl Floor {
    /// The floor `arg` names for a run of `engine`.
    pub fn of(arg: FloorArg, engine: EngineKind) -> Floor {
        match (arg, engine) {
            (FloorArg::Floor, EngineKind::Packet) | (FloorArg::Frames, _) => Floor::Frames,
            (FloorArg::Floor, _) | (FloorArg::Udp, _) => Floor::Udp,
        }
    }

    /// Its name in the run's lines.
    pub fn name(self) -> &'static str {
        match self {
            Floor::Udp => "udp",
            Floor::Frames => "frames",
        }
    }
}

/// Refuses `pingpong --paired-with` where it cannot run, before anything connects.
pub fn check_pingpong_args(args: &PingpongArgs) -> anyhow::Result<()> {
    if args.paired_with.is_none() {
        return Ok(());
    }
    if !matches!(args.op, LatOp::Write | LatOp::Send) {
        bail!(
            "--paired-with pairs WRITE and SEND ping-pongs, not --op {:?}",
            args.op
        );
    }
    if args.warmup == 0 {
        bail!(
            "--paired-with needs --warmup of at least 1 (the floor starts after tbrdma's warm-up)"
        );
    }
    if args.block == 0 {
        bail!("--block must be at least 1");
    }
    floor_port(args.connect.port)?;
    Ok(())
}

/// Refuses `bw --paired-with` where it cannot run, before anything connects.
pub fn check_bw_args(args: &BwArgs) -> anyhow::Result<()> {
    if args.paired_with.is_none() {
        return Ok(());
    }
    if !matches!(args.op, BwOp::Write | BwOp::Send) {
        bail!(
            "--paired-with pairs WRITE and SEND streams, not --op {:?}",
            args.op
        );
    }
    if args.bidir {
        bail!("--paired-with runs one TCP stream, one way: not with --bidir");
    }
    floor_port(args.connect.port)?;
    Ok(())
}

/// How long each TCP stream of `bw --paired-with tcp` lasts: `--duration`, or a second.
pub fn stream_duration(args: &BwArgs) -> Duration {
    Duration::from_secs_f64(args.duration.unwrap_or(1.0).max(0.001))
}

/// The server's TCP listener for `bw --paired-with tcp`, on `ip` (its link's address), bound
/// before the client can connect to tbrdma (so it is there for the client's first stream).
pub fn stream_listener(ip: IpAddr, port: u16) -> anyhow::Result<TcpListener> {
    let addr = SocketAddr::new(ip, floor_port(port)?);
    TcpListener::bind(addr).with_context(|| format!("binding the TCP stream's listener on {addr}"))
}

/// Where the client's TCP streams go: the server's address, its port one up.
pub fn stream_addr(server: SocketAddr) -> anyhow::Result<SocketAddr> {
    Ok(SocketAddr::new(server.ip(), floor_port(server.port())?))
}

/// What a size's `bw --paired-with tcp` says of its TCP streams.
#[derive(Debug, Clone, Serialize)]
pub struct StreamLine {
    /// The baseline (`tcp`).
    pub baseline: &'static str,
    /// The stream before tbrdma's run, MiB/s.
    pub before_mib_s: f64,
    /// The stream after it, MiB/s.
    pub after_mib_s: f64,
    /// tbrdma's average over the geometric mean of the two.
    pub ratio: f64,
}

impl StreamLine {
    /// The line of tbrdma's average `tbrdma_mib_s` between streams `before` and `after`.
    pub fn new(before: &Streamed, after: &Streamed, tbrdma_mib_s: f64) -> StreamLine {
        let round = |v: f64| (v * 1000.0).round() / 1000.0;
        let (b, a) = (before.mib_per_s(), after.mib_per_s());
        StreamLine {
            baseline: "tcp",
            before_mib_s: round(b),
            after_mib_s: round(a),
            ratio: round(tbrdma_mib_s / (b * a).sqrt()),
        }
    }

    /// The comment line under the size's row of the table.
    pub fn text(&self) -> String {
        format!(
            "# paired with one TCP stream, before and after: {:.2} and {:.2} MiB/s; tbrdma's \
             average / their geometric mean {:.2}",
            self.before_mib_s, self.after_mib_s, self.ratio
        )
    }
}

/// The port of the server's floor or stream: the run's, one up.
fn floor_port(port: u16) -> anyhow::Result<u16> {
    match port.checked_add(1) {
        Some(p) if port != 0 => Ok(p),
        _ => {
            bail!("--paired-with needs a --port between 1 and 65534 (the floor listens one above)")
        }
    }
}

/// The server's floor for messages of `size` bytes, on `ip` (its link's address).
pub fn echoer(floor: Floor, ip: IpAddr, port: u16, size: usize) -> anyhow::Result<Box<dyn Echoer>> {
    let addr = SocketAddr::new(ip, floor_port(port)?);
    Ok(match floor {
        Floor::Udp => Box::new(UdpEchoer::bind(addr, size)?),
        Floor::Frames => {
            Box::new(FrameEchoer::open(addr, size).context("the raw-frame floor (root, IPv4)")?)
        }
    })
}

/// The client's floor for messages of `size` bytes, from `ip` to the server at `server`.
pub fn pinger(
    floor: Floor,
    ip: IpAddr,
    server: SocketAddr,
    size: usize,
) -> anyhow::Result<Box<dyn Pinger>> {
    let to = SocketAddr::new(server.ip(), floor_port(server.port())?);
    Ok(match floor {
        Floor::Udp => Box::new(UdpPinger::connect(ip, to, size)?),
        Floor::Frames => {
            Box::new(FramePinger::open(ip, to, size).context("the raw-frame floor (root, IPv4)")?)
        }
    })
}

/// What a size's run says of its floor: in microseconds one-way like the latency line, and
/// the ratios block by block.
#[derive(Debug, Clone, Serialize)]
pub struct PairedLine {
    /// The floor (`udp`, `frames`).
    pub floor: &'static str,
    /// Blocks of tbrdma's round trips; the floor ran one more.
    pub blocks: usize,
    /// Round trips per block.
    pub block: u64,
    /// The median of the floor blocks' medians, one-way.
    pub floor_typical_us: f64,
    /// The median over tbrdma's blocks of its median over the geometric mean of the medians of
    /// the floor blocks before and after it.
    pub ratio_typical: f64,
    /// The same of tbrdma's mean.
    pub ratio_avg: f64,
}

impl PairedLine {
    /// The line of `paired`, with round trips divided by `one_way` (2 for WRITE and SEND).
    pub fn new(floor: Floor, block: u64, paired: &Paired, one_way: f64) -> PairedLine {
        let round = |v: f64| (v * 1000.0).round() / 1000.0;
        PairedLine {
            floor: floor.name(),
            blocks: paired.blocks,
            block,
            floor_typical_us: round(paired.floor_p50 / 1000.0 / one_way),
            ratio_typical: round(paired.ratio_p50),
            ratio_avg: round(paired.ratio_mean),
        }
    }

    /// The comment line under the size's row of the table.
    pub fn text(&self) -> String {
        format!(
            "# paired with the {} floor in {} blocks of {}: its t_typical {:.2} usec; block by \
             block, tbrdma's t_typical / it {:.2}, t_avg / it {:.2} (medians over blocks)",
            self.floor,
            self.blocks,
            self.block,
            self.floor_typical_us,
            self.ratio_typical,
            self.ratio_avg
        )
    }
}
