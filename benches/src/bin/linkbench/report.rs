//! The results: one table of every case, then the ratios the targets name, as text or JSON.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Duration;

use anyhow::{Context, anyhow};
use tbrdma_verbs::EngineKind;

use crate::run::{CLIENT_CPU, SERVER_CPU};
use crate::{Bench, Case, Options};

/// What one case gave.
#[derive(Clone, Copy, Debug)]
pub enum Outcome {
    /// Round trips, in nanoseconds.
    RoundTrips {
        count: u64,
        p50: u64,
        p99: u64,
        mean: f64,
        min: u64,
        max: u64,
    },
    /// Bytes in a time.
    Bandwidth { bytes: u64, nanos: u64 },
}

impl Outcome {
    /// Parses a child's `RESULT` line (without the prefix).
    pub fn parse(line: &str) -> anyhow::Result<Outcome> {
        let map: HashMap<&str, &str> = line
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let get = |key: &str| -> anyhow::Result<f64> {
            map.get(key)
                .ok_or_else(|| anyhow!("no {key} in {line:?}"))?
                .parse::<f64>()
                .with_context(|| format!("{key} in {line:?}"))
        };
        if map.contains_key("bytes") {
            Ok(Outcome::Bandwidth {
                bytes: get("bytes")? as u64,
                nanos: get("nanos")? as u64,
            })
        } else {
            Ok(Outcome::RoundTrips {
                count: get("count")? as u64,
                p50: get("p50")? as u64,
                p99: get("p99")? as u64,
                mean: get("mean")?,
                min: get("min")? as u64,
                max: get("max")? as u64,
            })
        }
    }

    /// One line for the progress log.
    pub fn short(&self) -> String {
        match *self {
            Outcome::RoundTrips { p50, p99, .. } => {
                format!("p50 {:.1} µs, p99 {:.1} µs", us(p50), us(p99))
            }
            Outcome::Bandwidth { .. } => format!("{:.0} MiB/s", self.mib_per_s()),
        }
    }

    fn p50(&self) -> Option<f64> {
        match *self {
            Outcome::RoundTrips { p50, .. } => Some(p50 as f64),
            Outcome::Bandwidth { .. } => None,
        }
    }

    fn mib_per_s(&self) -> f64 {
        match *self {
            Outcome::Bandwidth { bytes, nanos } => {
                bytes as f64 / (1 << 20) as f64 / (nanos.max(1) as f64 / 1e9)
            }
            Outcome::RoundTrips { .. } => 0.0,
        }
    }
}

fn us(nanos: u64) -> f64 {
    nanos as f64 / 1000.0
}

/// Everything one run produced.
#[derive(Debug)]
pub struct Run {
    /// The lab's name.
    pub lab: String,
    /// Server (rank 0) address.
    pub server_ip: IpAddr,
    /// Client (rank 1) address.
    pub client_ip: IpAddr,
    /// `/proc/loadavg` before the lab came up.
    pub load_before: String,
    /// And after the last case.
    pub load_after: String,
    /// Wall time of the whole run.
    pub elapsed: Duration,
    /// The options.
    pub options: Options,
    /// Every case, in run order.
    pub outcomes: Vec<(Case, Outcome)>,
}

/// A comparison the targets name, or one given for information.
struct Ratio {
    label: String,
    value: f64,
    /// `(limit, at_most)`: the target, if there is one.
    target: Option<(f64, bool)>,
}

impl Ratio {
    fn verdict(&self) -> &'static str {
        match self.target {
            Some((limit, true)) if self.value <= limit => "PASS",
            Some((limit, false)) if self.value >= limit => "PASS",
            Some(_) => "MISS",
            None => "info",
        }
    }

    fn target_text(&self) -> String {
        match self.target {
            Some((limit, true)) => format!("<= {limit:.2}"),
            Some((limit, false)) => format!(">= {limit:.2}"),
            None => "-".into(),
        }
    }
}

fn find(run: &Run, bench: Bench, size: usize) -> Option<Outcome> {
    run.outcomes
        .iter()
        .find(|(c, _)| c.bench == bench && c.size == size)
        .map(|(_, o)| *o)
}

fn ratios(run: &Run) -> Vec<Ratio> {
    let mut out = Vec::new();
    for (size, udp_size) in [(8, 8), (4096, 4096), (65_536, 65_507)] {
        let udp = find(run, Bench::UdpFloor, udp_size).and_then(|o| o.p50());
        let tcp = find(run, Bench::TcpBlocking, size).and_then(|o| o.p50());
        let targeted = size == 8;
        for engine in [EngineKind::Uring, EngineKind::Sockets] {
            for bench in [Bench::Send(engine), Bench::Write(engine)] {
                let Some(ours) = find(run, bench, size).and_then(|o| o.p50()) else {
                    continue;
                };
                if let Some(udp) = udp {
                    out.push(Ratio {
                        label: format!("{bench} {size} B p50 / udp-busy {udp_size} B p50"),
                        value: ours / udp,
                        target: targeted.then_some((1.2, true)),
                    });
                }
                if let Some(tcp) = tcp {
                    out.push(Ratio {
                        label: format!("{bench} {size} B p50 / tcp-nodelay {size} B p50"),
                        value: ours / tcp,
                        target: targeted.then_some((0.6, true)),
                    });
                }
            }
        }
    }
    let stream = find(run, Bench::TcpStream, 1 << 20).map(|o| o.mib_per_s());
    for engine in [EngineKind::Uring, EngineKind::Sockets] {
        let bench = Bench::WriteBandwidth(engine);
        if let (Some(ours), Some(tcp)) = (find(run, bench, 1 << 20), stream) {
            out.push(Ratio {
                label: format!("{bench} 1 MiB / tcp-stream 1 MiB"),
                value: ours.mib_per_s() / tcp,
                target: Some((1.0, false)),
            });
        }
    }
    out
}

/// The human-readable report.
pub fn table(run: &Run) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nlinkbench: one veth pair (MTU 65520) between lab namespaces {lab}-r0 ({server}) and \
         {lab}-r1 ({client})",
        lab = format_args!("tbl-{}", run.lab),
        server = run.server_ip,
        client = run.client_ip,
    );
    let _ = writeln!(
        s,
        "cores: server (rank 0) pinned to CPU {SERVER_CPU}, client (rank 1) pinned to CPU \
         {CLIENT_CPU}, one thread each; tbrdma in caller progress mode (the polling thread runs \
         the engine)"
    );
    let _ = writeln!(
        s,
        "iterations: {} measured after {} warm-up per latency case; bandwidth cases {:.1} s; \
         run took {:.0} s",
        run.options.iters,
        run.options.warmup,
        run.options.duration.as_secs_f64(),
        run.elapsed.as_secs_f64()
    );
    let _ = writeln!(
        s,
        "load average: {} before, {} after",
        run.load_before, run.load_after
    );
    let _ = writeln!(
        s,
        "\n{:<18} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "case", "size B", "p50 µs", "p99 µs", "mean µs", "max µs", "MiB/s"
    );
    for (case, outcome) in &run.outcomes {
        match *outcome {
            Outcome::RoundTrips {
                p50,
                p99,
                mean,
                max,
                ..
            } => {
                let _ = writeln!(
                    s,
                    "{:<18} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9}",
                    case.bench.name(),
                    case.size,
                    us(p50),
                    us(p99),
                    mean / 1000.0,
                    us(max),
                    "-"
                );
            }
            Outcome::Bandwidth { .. } => {
                let _ = writeln!(
                    s,
                    "{:<18} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9.0}",
                    case.bench.name(),
                    case.size,
                    "-",
                    "-",
                    "-",
                    "-",
                    outcome.mib_per_s()
                );
            }
        }
    }
    let _ = writeln!(
        s,
        "\n{:<56} {:>7} {:>8} {:>7}",
        "ratio", "value", "target", "verdict"
    );
    for r in ratios(run) {
        let _ = writeln!(
            s,
            "{:<56} {:>7.2} {:>8} {:>7}",
            r.label,
            r.value,
            r.target_text(),
            r.verdict()
        );
    }
    s
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The same as JSON (one object).
pub fn json(run: &Run) -> String {
    let cases: Vec<String> = run
        .outcomes
        .iter()
        .map(|(case, outcome)| {
            let body = match *outcome {
                Outcome::RoundTrips {
                    count,
                    p50,
                    p99,
                    mean,
                    min,
                    max,
                } => format!(
                    "\"count\":{count},\"p50_ns\":{p50},\"p99_ns\":{p99},\"mean_ns\":{mean:.0},\
                     \"min_ns\":{min},\"max_ns\":{max}"
                ),
                Outcome::Bandwidth { bytes, nanos } => format!(
                    "\"bytes\":{bytes},\"nanos\":{nanos},\"mib_per_s\":{:.1}",
                    outcome.mib_per_s()
                ),
            };
            format!(
                "{{\"case\":{},\"size\":{},{body}}}",
                json_str(&case.bench.name()),
                case.size
            )
        })
        .collect();
    let ratios: Vec<String> = ratios(run)
        .iter()
        .map(|r| {
            format!(
                "{{\"ratio\":{},\"value\":{:.3},\"target\":{},\"verdict\":{}}}",
                json_str(&r.label),
                r.value,
                json_str(&r.target_text()),
                json_str(r.verdict())
            )
        })
        .collect();
    format!(
        "{{\"lab\":{},\"server_cpu\":{SERVER_CPU},\"client_cpu\":{CLIENT_CPU},\
         \"iters\":{},\"warmup\":{},\"bandwidth_seconds\":{},\"load_before\":{},\
         \"load_after\":{},\"elapsed_s\":{:.1},\"cases\":[{}],\"ratios\":[{}]}}",
        json_str(&run.lab),
        run.options.iters,
        run.options.warmup,
        run.options.duration.as_secs_f64(),
        json_str(&run.load_before),
        json_str(&run.load_after),
        run.elapsed.as_secs_f64(),
        cases.join(","),
        ratios.join(",")
    )
}
