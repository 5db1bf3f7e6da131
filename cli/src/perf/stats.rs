//! Latency statistics: raw samples for the exact minimum, maximum, mean and deviation, an HDR
//! histogram for the percentiles (three significant digits, as quinn's perf tool records).

use hdrhistogram::Histogram;

/// Latency of one size, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latency {
    /// Samples.
    pub iters: u64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// Median (perftest's "typical").
    pub typical: f64,
    /// Mean.
    pub avg: f64,
    /// Standard deviation.
    pub stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

/// Collects samples in nanoseconds.
#[derive(Debug)]
pub struct Samples {
    raw: Vec<u64>,
    histogram: Histogram<u64>,
}

impl Samples {
    /// Room for `n` samples.
    pub fn with_capacity(n: usize) -> Samples {
        Samples {
            raw: Vec::with_capacity(n),
            histogram: Histogram::new(3).expect("3 significant digits is valid"),
        }
    }

    /// Adds one sample.
    pub fn record(&mut self, ns: u64) {
        self.raw.push(ns);
        // Auto-resizing histogram: recording cannot fail for a u64.
        let _ = self.histogram.record(ns.max(1));
    }

    /// The statistics, each sample divided by `divisor` (2 for one-way from a round trip).
    pub fn summary(&self, divisor: f64) -> Option<Latency> {
        if self.raw.is_empty() {
            return None;
        }
        let us = |ns: f64| ns / 1000.0 / divisor;
        let n = self.raw.len() as f64;
        let mean = self.raw.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = self
            .raw
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        let min = *self.raw.iter().min().expect("not empty") as f64;
        let max = *self.raw.iter().max().expect("not empty") as f64;
        // The histogram rounds to 3 digits; clamp so min <= percentiles <= max holds exactly.
        let q = |q: f64| (self.histogram.value_at_quantile(q) as f64).clamp(min, max);
        Some(Latency {
            iters: self.raw.len() as u64,
            min: us(min),
            max: us(max),
            typical: us(q(0.5)),
            avg: us(mean),
            stdev: us(var.sqrt()),
            p99: us(q(0.99)),
            p999: us(q(0.999)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_way_halves_every_figure_and_keeps_the_order() {
        let mut s = Samples::with_capacity(100);
        for v in 1..=100u64 {
            s.record(v * 1000);
        }
        let l = s.summary(2.0).unwrap();
        assert_eq!(l.iters, 100);
        assert_eq!(l.min, 0.5);
        assert_eq!(l.max, 50.0);
        assert!((l.typical - 25.0).abs() < 0.1, "{l:?}");
        assert!(l.min <= l.typical && l.typical <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max);
    }
}
