//! `tbrdma pingpong --paired-with`: the floor that runs beside tbrdma's ping-pong, in the same
//! two processes over the same cable, and what the run says of it.
//!
//! The floors and the schedule are `linkbench`'s own ([`tbrdma_floors`]), so that the ratio a
//! user sees on a cable is the one the benchmark judges (issue 16). The server's floor listens
//! on the run's `--port` + 1, on its link's address; it is bound at the start of each size,
//! before the server answers the size's first message, and the client's floor speaks only after
//! the warm-up of tbrdma's ping-pong, so it is always there (hence at least one warm-up round
//! trip: the raw-frame floor's first frame may also find the neighbour table empty and be
//! resent, which only a warm-up may do).

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, bail};
use serde::Serialize;
use tbrdma_floors::frames::{FrameEchoer, FramePinger};
use tbrdma_floors::pairing::{Echoer, Paired, Pinger};
use tbrdma_floors::udp::{UdpEchoer, UdpPinger};
use tbrdma_verbs::EngineKind;

use crate::perf::options::{FloorArg, LatOp, PingpongArgs};

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

/// Refuses `--paired-with` where it cannot run, before anything connects.
pub fn check_args(args: &PingpongArgs) -> anyhow::Result<()> {
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

/// The port of the server's floor: the run's, one up.
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
