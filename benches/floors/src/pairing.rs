//! A tbrdma ping-pong and its floor in lockstep, within the same two processes (issue 16).
//!
//! The test hosts change speed from one fraction of a second to the next, so a floor measured in
//! another pair of processes, even just before and after the engine case, judged the engine by
//! the host's mood (per-round ratios of one case spread by up to 1.9x). So the ping-pong's
//! processes also open its floor on the same cable, and both follow the same [`schedule`]: the
//! engine's warm-up, the floor's, then blocks of round trips of the floor and the engine in
//! turn, a floor block first and last. Each engine block is judged against the geometric mean of
//! the two floor blocks beside it, milliseconds away, and the ratio is the median over its
//! blocks ([`block_ratios`]). The floor and the engine never run at the same time: the side not
//! in its block is not polled (in caller mode the engine's keeper sends any acknowledgement it
//! holds meanwhile).
//!
//! This module owns the schedule and the block arithmetic; the ping-pongs themselves are
//! [`Pinger`]s and [`Echoer`]s: the floors of [`crate::udp`] and [`crate::frames`], and the
//! engine ping-pongs of `linkbench` and `tbrdma pingpong`.

use std::time::Duration;

/// How many round trips a paired (or lone) ping-pong runs, and in what blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Untimed round trips of each side before the first block.
    pub warmup: u64,
    /// Timed round trips of the engine.
    pub iters: u64,
    /// Round trips per block.
    pub block: u64,
}

impl Plan {
    /// Round trips in all (warm-up included) of a ping-pong run alone: its server echoes
    /// exactly this many.
    pub fn total(&self) -> u64 {
        self.warmup + self.iters
    }
}

/// The client of a ping-pong, one round trip at a time.
pub trait Pinger {
    /// Sends the next message and waits for all of its answer; returns the round trip.
    /// `warming`: a warm-up round trip, which may send its message again when the answer is
    /// late (the raw-frame floor's first frame meets an empty neighbour table and is dropped).
    fn round_trip(&mut self, warming: bool) -> anyhow::Result<Duration>;
}

/// The server of a ping-pong: answers the next message.
pub trait Echoer {
    /// Waits for the next message and answers it.
    fn echo(&mut self) -> anyhow::Result<()>;
}

/// Which ping-pong a stretch of the schedule runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The tbrdma case.
    Engine,
    /// Its floor.
    Floor,
}

/// A stretch of round trips of one side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stretch {
    /// Whose round trips.
    pub side: Side,
    /// How many.
    pub round_trips: u64,
    /// Timed (a block) or not (a warm-up).
    pub timed: bool,
}

/// The order both processes follow: `plan.warmup` round trips of the engine, then of the
/// floor, then floor and engine blocks of `plan.block` round trips in turn (the last engine
/// block takes what is left of `plan.iters`), a floor block first and last. Both sides compute
/// it from the same arguments, so no message ever says where they are.
pub fn schedule(plan: Plan) -> Vec<Stretch> {
    let Plan {
        warmup,
        iters,
        block,
    } = plan;
    let block = block.max(1);
    let stretch = |side, round_trips, timed| Stretch {
        side,
        round_trips,
        timed,
    };
    let mut out = Vec::new();
    if warmup > 0 {
        out.push(stretch(Side::Engine, warmup, false));
        out.push(stretch(Side::Floor, warmup, false));
    }
    let mut left = iters;
    while left > 0 {
        let n = left.min(block);
        out.push(stretch(Side::Floor, block, true));
        out.push(stretch(Side::Engine, n, true));
        left -= n;
    }
    out.push(stretch(Side::Floor, block, true));
    out
}

/// The median of a block's round trips and their mean, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockFigures {
    /// Median (the lower middle one of an even count).
    pub p50: f64,
    /// Mean.
    pub mean: f64,
}

impl BlockFigures {
    /// The figures of `nanos` (not empty: a block has at least one round trip).
    pub fn of(nanos: &mut [u64]) -> BlockFigures {
        nanos.sort_unstable();
        let p50 = nanos[(nanos.len() - 1) / 2] as f64;
        let mean = nanos.iter().map(|&n| n as f64).sum::<f64>() / nanos.len() as f64;
        BlockFigures { p50, mean }
    }
}

/// What a paired client measured beside its engine's round trips.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paired {
    /// Engine blocks.
    pub blocks: usize,
    /// Median of the floor blocks' medians, in nanoseconds.
    pub floor_p50: f64,
    /// Median over engine blocks of the block's p50 over the geometric mean of the p50s of the
    /// floor blocks before and after it.
    pub ratio_p50: f64,
    /// The same of the block's mean (against the floors' p50s).
    pub ratio_mean: f64,
}

/// The lower middle value (NaN when there is none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values
        .get(values.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(f64::NAN)
}

/// The case's ratios from its blocks: engine block `k` ran between floor blocks `k` and `k + 1`.
pub fn block_ratios(engine: &[BlockFigures], floor: &[BlockFigures]) -> Paired {
    let beside = |k: usize| (floor[k].p50 * floor[k + 1].p50).sqrt();
    let blocks = engine.len().min(floor.len().saturating_sub(1));
    Paired {
        blocks,
        floor_p50: median(floor.iter().map(|f| f.p50).collect()),
        ratio_p50: median((0..blocks).map(|k| engine[k].p50 / beside(k)).collect()),
        ratio_mean: median((0..blocks).map(|k| engine[k].mean / beside(k)).collect()),
    }
}

/// Runs the client's side of the schedule: hands every timed engine round trip to
/// `each_engine_round_trip` (for the engine's own figures) and returns the paired ratios.
pub fn run_client(
    engine: &mut dyn Pinger,
    floor: &mut dyn Pinger,
    plan: Plan,
    each_engine_round_trip: &mut dyn FnMut(Duration),
) -> anyhow::Result<Paired> {
    let (mut engine_blocks, mut floor_blocks) = (Vec::new(), Vec::new());
    for stretch in schedule(plan) {
        let pinger: &mut dyn Pinger = match stretch.side {
            Side::Engine => engine,
            Side::Floor => floor,
        };
        let mut nanos = Vec::with_capacity(stretch.round_trips as usize);
        for _ in 0..stretch.round_trips {
            let rtt = pinger.round_trip(!stretch.timed)?;
            if stretch.timed {
                nanos.push((rtt.as_nanos() as u64).max(1));
            }
        }
        if !stretch.timed {
            continue;
        }
        if stretch.side == Side::Engine {
            for &n in &nanos {
                each_engine_round_trip(Duration::from_nanos(n));
            }
        }
        let figures = BlockFigures::of(&mut nanos);
        match stretch.side {
            Side::Engine => engine_blocks.push(figures),
            Side::Floor => floor_blocks.push(figures),
        }
    }
    Ok(block_ratios(&engine_blocks, &floor_blocks))
}

/// Runs the server's side of the same schedule.
pub fn run_server(
    engine: &mut dyn Echoer,
    floor: &mut dyn Echoer,
    plan: Plan,
) -> anyhow::Result<()> {
    for stretch in schedule(plan) {
        let echoer: &mut dyn Echoer = match stretch.side {
            Side::Engine => engine,
            Side::Floor => floor,
        };
        for _ in 0..stretch.round_trips {
            echoer.echo()?;
        }
    }
    Ok(())
}

/// A ping-pong alone (a floor's own case): `plan.warmup` round trips, then `plan.iters` timed
/// ones, each handed to `each` (`plan.block` is not used).
pub fn run_alone(
    pinger: &mut dyn Pinger,
    plan: Plan,
    each: &mut dyn FnMut(Duration),
) -> anyhow::Result<()> {
    for i in 0..plan.total() {
        let warming = i < plan.warmup;
        let rtt = pinger.round_trip(warming)?;
        if !warming {
            each(rtt);
        }
    }
    Ok(())
}

/// The server of a ping-pong alone: answers every message of [`run_alone`].
pub fn serve_alone(echoer: &mut dyn Echoer, plan: Plan) -> anyhow::Result<()> {
    for _ in 0..plan.total() {
        echoer.echo()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_puts_every_engine_block_between_two_floor_blocks() {
        let plan = |warmup, iters, block| Plan {
            warmup,
            iters,
            block,
        };
        let s = schedule(plan(100, 1_100, 500));
        let shape: Vec<(Side, u64, bool)> =
            s.iter().map(|s| (s.side, s.round_trips, s.timed)).collect();
        assert_eq!(
            shape,
            [
                (Side::Engine, 100, false),
                (Side::Floor, 100, false),
                (Side::Floor, 500, true),
                (Side::Engine, 500, true),
                (Side::Floor, 500, true),
                (Side::Engine, 500, true),
                (Side::Floor, 500, true),
                (Side::Engine, 100, true),
                (Side::Floor, 500, true),
            ]
        );
        let engine: u64 = s
            .iter()
            .filter(|s| s.side == Side::Engine && s.timed)
            .map(|s| s.round_trips)
            .sum();
        assert_eq!(engine, 1_100);
        // No warm-up, a block of zero taken as one.
        assert_eq!(schedule(plan(0, 2, 0)).len(), 5);
    }

    #[test]
    fn each_block_is_judged_against_the_floor_blocks_beside_it() {
        let f = |p50: f64| BlockFigures { p50, mean: p50 };
        // The host halves its speed after the first block: the floor goes 4 → 16 µs.
        let floor = [f(4.0), f(16.0), f(16.0)];
        let engine = [
            BlockFigures {
                p50: 10.0,
                mean: 12.0,
            },
            BlockFigures {
                p50: 24.0,
                mean: 32.0,
            },
        ];
        let paired = block_ratios(&engine, &floor);
        assert_eq!(paired.blocks, 2);
        assert_eq!(paired.floor_p50, 16.0);
        // Blocks: 10 / sqrt(4·16) = 1.25 and 24 / 16 = 1.5; the lower middle one.
        assert_eq!(paired.ratio_p50, 1.25);
        assert_eq!(paired.ratio_mean, 1.5);
        // Figures of a block: lower middle median.
        let mut nanos = [5, 1, 4, 2];
        assert_eq!(
            BlockFigures::of(&mut nanos),
            BlockFigures {
                p50: 2.0,
                mean: 3.0
            }
        );
    }
}
