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
        /// Round trips of a millisecond or more.
        over_1ms: u64,
    },
    /// Bytes in a time.
    Bandwidth { bytes: u64, nanos: u64 },
    /// The case failed (the record says why).
    Failed,
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
                over_1ms: get("over_1ms")? as u64,
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
            Outcome::Failed => "FAILED".into(),
        }
    }

    fn p50(&self) -> Option<f64> {
        match *self {
            Outcome::RoundTrips { p50, .. } => Some(p50 as f64),
            Outcome::Bandwidth { .. } | Outcome::Failed => None,
        }
    }

    fn mib_per_s(&self) -> f64 {
        match *self {
            Outcome::Bandwidth { bytes, nanos } => {
                bytes as f64 / (1 << 20) as f64 / (nanos.max(1) as f64 / 1e9)
            }
            Outcome::RoundTrips { .. } | Outcome::Failed => f64::NAN,
        }
    }
}

fn us(nanos: u64) -> f64 {
    nanos as f64 / 1000.0
}

/// The tbrdma client's protocol counters for one case.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    /// Datagrams the client sent.
    pub sent: u64,
    /// Datagrams it received.
    pub received: u64,
    /// Of those sent, explicit ACKs.
    pub acks: u64,
    /// Retransmitted packets.
    pub retransmits: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
    /// Packets received twice.
    pub duplicates: u64,
    /// Packets received and discarded (out of order, corrupted, malformed, foreign).
    pub dropped: u64,
}

impl Counters {
    /// Parses a child's `STATS` line (without the prefix).
    pub fn parse(line: &str) -> Counters {
        let map: HashMap<&str, u64> = line
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
            .collect();
        let get = |k: &str| map.get(k).copied().unwrap_or_default();
        Counters {
            sent: get("sent"),
            received: get("received"),
            acks: get("acks"),
            retransmits: get("retransmits"),
            timeouts: get("timeouts"),
            duplicates: get("duplicates"),
            dropped: get("dropped"),
        }
    }
}

/// One case's results.
#[derive(Clone, Debug)]
pub struct Record {
    /// The case.
    pub case: Case,
    /// What it measured.
    pub outcome: Outcome,
    /// tbrdma cases: the client's counters.
    pub counters: Option<Counters>,
    /// Why it failed, when it did.
    pub error: Option<String>,
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
    pub records: Vec<Record>,
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
        if self.value.is_nan() {
            return "FAILED";
        }
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
    run.records
        .iter()
        .find(|r| r.case.bench == bench && r.case.size == size)
        .map(|r| r.outcome)
}

fn ratios(run: &Run) -> Vec<Ratio> {
    let mut out = Vec::new();
    for (size, udp_size) in [(8, 8), (4096, 4096), (65_536, 65_507)] {
        let udp = find(run, Bench::UdpFloor, udp_size).and_then(|o| o.p50());
        let tcp = find(run, Bench::TcpBlocking, size).and_then(|o| o.p50());
        let targeted = size == 8;
        for engine in [EngineKind::Uring, EngineKind::Sockets] {
            for bench in [Bench::Send(engine), Bench::Write(engine)] {
                let Some(ours) = find(run, bench, size).map(|o| o.p50().unwrap_or(f64::NAN)) else {
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
        "load average: {} before, {} after (the two spinning processes of this benchmark add \
         about 2; more than that before the start means another job shared the cores)",
        run.load_before, run.load_after
    );
    let _ = writeln!(
        s,
        "\n{:<18} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9}  client datagrams",
        "case", "size B", "p50 µs", "p99 µs", "mean µs", "max µs", ">=1 ms", "MiB/s",
    );
    let per_iteration = run.options.iters + run.options.warmup;
    for record in &run.records {
        let (case, outcome) = (&record.case, &record.outcome);
        let counters = record.counters.map_or(String::new(), |c| {
            let per = match outcome {
                Outcome::RoundTrips { .. } => format!(
                    "{:.2} out/{:.2} in per round trip",
                    c.sent as f64 / per_iteration as f64,
                    c.received as f64 / per_iteration as f64
                ),
                Outcome::Bandwidth { bytes, .. } => format!(
                    "{:.1} out/{:.2} in per MiB",
                    c.sent as f64 / (*bytes as f64 / (1 << 20) as f64),
                    c.received as f64 / (*bytes as f64 / (1 << 20) as f64)
                ),
                Outcome::Failed => String::new(),
            };
            format!(
                "{per}, {} acks, {} retransmits, {} timeouts, {} duplicates, {} discarded",
                c.acks, c.retransmits, c.timeouts, c.duplicates, c.dropped
            )
        });
        match *outcome {
            Outcome::RoundTrips {
                p50,
                p99,
                mean,
                max,
                over_1ms,
                ..
            } => {
                let _ = writeln!(
                    s,
                    "{:<18} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8} {:>9}  {counters}",
                    case.bench.name(),
                    case.size,
                    us(p50),
                    us(p99),
                    mean / 1000.0,
                    us(max),
                    over_1ms,
                    "-"
                );
            }
            Outcome::Bandwidth { .. } => {
                let _ = writeln!(
                    s,
                    "{:<18} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9.0}  {counters}",
                    case.bench.name(),
                    case.size,
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    outcome.mib_per_s()
                );
            }
            Outcome::Failed => {
                let _ = writeln!(
                    s,
                    "{:<18} {:>8}   FAILED: {}",
                    case.bench.name(),
                    case.size,
                    record.error.as_deref().unwrap_or("?").replace('\n', " / ")
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
        .records
        .iter()
        .map(|record| {
            let (case, outcome) = (&record.case, &record.outcome);
            let counters = record.counters.map_or(String::new(), |c| {
                format!(
                    ",\"client_sent\":{},\"client_received\":{},\"client_acks\":{},\
                     \"retransmits\":{},\"timeouts\":{},\"duplicates\":{},\"discarded\":{}",
                    c.sent, c.received, c.acks, c.retransmits, c.timeouts, c.duplicates, c.dropped
                )
            });
            let body = match *outcome {
                Outcome::RoundTrips {
                    count,
                    p50,
                    p99,
                    mean,
                    min,
                    max,
                    over_1ms,
                } => format!(
                    "\"count\":{count},\"p50_ns\":{p50},\"p99_ns\":{p99},\"mean_ns\":{mean:.0},\
                     \"min_ns\":{min},\"max_ns\":{max},\"over_1ms\":{over_1ms}"
                ),
                Outcome::Bandwidth { bytes, nanos } => format!(
                    "\"bytes\":{bytes},\"nanos\":{nanos},\"mib_per_s\":{:.1}",
                    outcome.mib_per_s()
                ),
                Outcome::Failed => format!(
                    "\"error\":{}",
                    json_str(record.error.as_deref().unwrap_or("?"))
                ),
            };
            format!(
                "{{\"case\":{},\"size\":{},{body}{counters}}}",
                json_str(&case.bench.name()),
                case.size
            )
        })
        .collect();
    let ratios: Vec<String> = ratios(run)
        .iter()
        .map(|r| {
            format!(
                "{{\"ratio\":{},\"value\":{},\"target\":{},\"verdict\":{}}}",
                json_str(&r.label),
                if r.value.is_nan() {
                    "null".to_string()
                } else {
                    format!("{:.3}", r.value)
                },
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
