//! Result lines: perftest's columns as text, or one JSON object per size. Only results go to
//! stdout; everything else a run says goes to stderr.

use std::io::Write;

use serde::Serialize;

use crate::perf::paired::{PairedLine, StreamLine};
use crate::perf::stats::Latency;

/// `println!` that ignores a closed stdout (`tbrdma pingpong … | head`).
fn out(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

/// The latency table's header (perftest's, with its spelling).
pub fn latency_header(json: bool) {
    if !json {
        out(&format!(
            " {:<7} {:<11} {:<14} {:<14} {:<16} {:<14} {:<15} {:<22} {}",
            "#bytes",
            "#iterations",
            "t_min[usec]",
            "t_max[usec]",
            "t_typical[usec]",
            "t_avg[usec]",
            "t_stdev[usec]",
            "99% percentile[usec]",
            "99.9% percentile[usec]"
        ));
    }
}

#[derive(Serialize)]
struct LatencyJson<'a> {
    op: &'a str,
    engine: &'a str,
    bytes: usize,
    iters: u64,
    t_min_us: f64,
    t_max_us: f64,
    t_typical_us: f64,
    t_avg_us: f64,
    t_stdev_us: f64,
    p99_us: f64,
    p999_us: f64,
    verified: bool,
    /// `--paired-with`: the floor run beside tbrdma and tbrdma's ratios to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    paired: Option<&'a PairedLine>,
}

/// One size's latency line (and, with `--paired-with`, a comment line under it).
pub fn latency_line(
    json: bool,
    op: &str,
    engine: &str,
    bytes: usize,
    l: &Latency,
    verified: bool,
    paired: Option<&PairedLine>,
) {
    if json {
        let round = |v: f64| (v * 1000.0).round() / 1000.0;
        let line = LatencyJson {
            op,
            engine,
            bytes,
            iters: l.iters,
            t_min_us: round(l.min),
            t_max_us: round(l.max),
            t_typical_us: round(l.typical),
            t_avg_us: round(l.avg),
            t_stdev_us: round(l.stdev),
            p99_us: round(l.p99),
            p999_us: round(l.p999),
            verified,
            paired,
        };
        out(&serde_json::to_string(&line).expect("plain data serializes"));
    } else {
        out(&format!(
            " {:<7} {:<11} {:<14.2} {:<14.2} {:<16.2} {:<14.2} {:<15.2} {:<22.2} {:.2}",
            bytes, l.iters, l.min, l.max, l.typical, l.avg, l.stdev, l.p99, l.p999
        ));
        if let Some(p) = paired {
            out(&p.text());
        }
    }
}

/// Bandwidth of one size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bandwidth {
    /// Messages completed.
    pub iters: u64,
    /// Best 10 ms interval, MiB/s.
    pub peak_mib_s: f64,
    /// Whole run, MiB/s.
    pub avg_mib_s: f64,
    /// Messages per second, millions.
    pub msg_rate_mpps: f64,
}

/// The bandwidth table's header (perftest's).
pub fn bandwidth_header(json: bool) {
    if !json {
        out(&format!(
            " {:<10} {:<14} {:<19} {:<21} {}",
            "#bytes", "#iterations", "BW peak[MiB/sec]", "BW average[MiB/sec]", "MsgRate[Mpps]"
        ));
    }
}

#[derive(Serialize)]
struct BandwidthJson<'a> {
    op: &'a str,
    engine: &'a str,
    bytes: usize,
    iters: u64,
    bw_peak_mib_s: f64,
    bw_avg_mib_s: f64,
    msg_rate_mpps: f64,
    verified: bool,
    /// `--paired-with`: the baseline run before and after tbrdma and tbrdma's ratio to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    paired: Option<&'a StreamLine>,
    recovery: &'a Recovery,
}

/// What this side's connections resent during one size, and how its datagrams spread over the
/// cables: a bandwidth that falls short of the cable's says here whether datagrams were lost
/// (or thought lost) on the way.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// Packets sent again (tail probes included).
    pub retransmits: u64,
    /// Tail loss probes sent.
    pub tail_probes: u64,
    /// Retransmission timeouts that fired.
    pub timeouts: u64,
    /// Datagrams sent on each cable (one entry per rail).
    pub rail_datagrams: Vec<u64>,
}

impl Recovery {
    /// What happened between `earlier` (a snapshot of the same connections) and this one.
    pub fn since(&self, earlier: &Recovery) -> Recovery {
        Recovery {
            retransmits: self.retransmits.saturating_sub(earlier.retransmits),
            tail_probes: self.tail_probes.saturating_sub(earlier.tail_probes),
            timeouts: self.timeouts.saturating_sub(earlier.timeouts),
            rail_datagrams: self
                .rail_datagrams
                .iter()
                .enumerate()
                .map(|(i, n)| n.saturating_sub(earlier.rail_datagrams.get(i).copied().unwrap_or(0)))
                .collect(),
        }
    }

    /// The comment line under the size's row of the table.
    pub fn text(&self) -> String {
        let rails = match self.rail_datagrams.as_slice() {
            [_] | [] => String::new(),
            per_rail => format!(
                "; datagrams per rail {}",
                per_rail
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(" / ")
            ),
        };
        format!(
            "# this side resent {} packets (tail probes {}), timeouts {}{rails}",
            self.retransmits, self.tail_probes, self.timeouts
        )
    }
}

/// One size's bandwidth line and, under it, a comment line with what was resent (and with
/// `--paired-with`, one with the baseline).
#[allow(clippy::too_many_arguments)]
pub fn bandwidth_line(
    json: bool,
    op: &str,
    engine: &str,
    bytes: usize,
    b: &Bandwidth,
    verified: bool,
    paired: Option<&StreamLine>,
    recovery: &Recovery,
) {
    if json {
        let round = |v: f64| (v * 1000.0).round() / 1000.0;
        let line = BandwidthJson {
            op,
            engine,
            bytes,
            iters: b.iters,
            bw_peak_mib_s: round(b.peak_mib_s),
            bw_avg_mib_s: round(b.avg_mib_s),
            msg_rate_mpps: (b.msg_rate_mpps * 1e6).round() / 1e6,
            verified,
            paired,
            recovery,
        };
        out(&serde_json::to_string(&line).expect("plain data serializes"));
    } else {
        out(&format!(
            " {:<10} {:<14} {:<19.2} {:<21.2} {:.6}",
            bytes, b.iters, b.peak_mib_s, b.avg_mib_s, b.msg_rate_mpps
        ));
        out(&recovery.text());
        if let Some(p) = paired {
            out(&p.text());
        }
    }
}
