//! The stand-in for a model's compute between collectives (`allreduce --gap-us`, `tp-bench
//! --compute-us`): a busy core, not a sleeping one, as a rank's is while it computes, and
//! optionally memory written first, as a layer streams its weights through the caches.
//!
//! Benchmarks that time calls back to back (nccl-tests, and every target of issue 16) never
//! see what such compute does to the next call: caches evicted, and on a VM a host that treats
//! a busy vCPU differently (docs/performance.md, "Compute between calls against the kernel's
//! floor under the same compute").

use std::time::{Duration, Instant};

/// A stretch of busy work, run between timed calls.
pub struct Compute {
    length: Duration,
    /// Written once per stretch (empty: the stretch only spins).
    touch: Vec<u8>,
    round: u8,
}

impl Compute {
    /// Spins `micros` µs after first writing `touch_mib` MiB.
    pub fn new(micros: u64, touch_mib: usize) -> Compute {
        Compute {
            length: Duration::from_micros(micros),
            touch: vec![0; touch_mib << 20],
            round: 0,
        }
    }

    /// Whether a stretch does anything.
    pub fn is_active(&self) -> bool {
        !self.length.is_zero() || !self.touch.is_empty()
    }

    /// Writes the touch buffer (one byte per cache line is enough to own every line), then
    /// spins until the stretch's length has passed since it began.
    pub fn run(&mut self) {
        if !self.is_active() {
            return;
        }
        let until = Instant::now() + self.length;
        self.round = self.round.wrapping_add(1);
        for line in self.touch.chunks_mut(64) {
            line[0] = self.round;
        }
        std::hint::black_box(&self.touch);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}
