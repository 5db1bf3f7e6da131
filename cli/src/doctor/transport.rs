//! `tbrdma doctor`'s transport check on one link: a short `tbrdma pingpong` (WRITE, 2 bytes,
//! pingpong's defaults so a bare `tbrdma pingpong` server on the peer matches) and a short
//! `tbrdma bw` (WRITE, 64 KiB, half a second) with the host at the other end, which runs
//! `tbrdma doctor` at the same time (or serves with `tbrdma pingpong`: then latency only).
//!
//! Each measurement is this same `tbrdma` binary run as a child with `--json`, so the doctor
//! measures exactly what a user would rerun by hand, and its own side serves the peer's doctor
//! the same way. The figures are judged against floors measured in the same run: the fastest
//! ICMP echo over the link (the kernel's round trip) and, on Thunderbolt, the link rate sysfs
//! reports. A slow link is a warning that says why and how to fix it.

use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use tbrdma_netdev::doctor::{Check, LinkUnderTest, Status};

use crate::perf::options::DEFAULT_PORT;

/// Bytes per message of the bandwidth run.
const BW_SIZE: &str = "65536";
/// Seconds of the bandwidth run.
const BW_SECONDS: &str = "0.5";

/// How the probe runs; from the environment so tests and odd setups can change it.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Side-channel port on both ends (`TBRDMA_DOCTOR_PORT`, default perftest's 18515).
    pub port: u16,
    /// How long to wait for the peer to serve (`TBRDMA_DOCTOR_PEER_WAIT`, seconds, default 15).
    pub peer_wait: Duration,
}

impl Settings {
    /// Reads `TBRDMA_DOCTOR_PORT` and `TBRDMA_DOCTOR_PEER_WAIT`.
    pub fn from_env() -> Settings {
        let get = |k: &str| std::env::var(k).ok();
        Settings {
            port: get("TBRDMA_DOCTOR_PORT")
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_PORT),
            peer_wait: Duration::from_secs_f64(
                get("TBRDMA_DOCTOR_PEER_WAIT")
                    .and_then(|v| v.parse::<f64>().ok())
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .unwrap_or(15.0),
            ),
        }
    }
}

fn tbrdma() -> std::path::PathBuf {
    std::env::current_exe().unwrap_or_else(|_| "tbrdma".into())
}

fn pingpong_args() -> Vec<String> {
    vec!["pingpong".into()]
}

fn bw_args() -> Vec<String> {
    ["bw", "--size", BW_SIZE, "--duration", BW_SECONDS]
        .map(String::from)
        .to_vec()
}

/// This side's servers for the peer's doctor: a pingpong run, then a bw run, one child each.
struct Serving {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Serving {
    fn start(local: Ipv4Addr, settings: &Settings) -> Serving {
        let stop = Arc::new(AtomicBool::new(false));
        let current: Arc<Mutex<Option<Child>>> = Arc::default();
        let port = settings.port.to_string();
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                for tool in [pingpong_args(), bw_args()] {
                    let child = Command::new(tbrdma())
                        .args(&tool)
                        .args(["--bind", &local.to_string(), "--port", &port, "--json"])
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn();
                    let Ok(child) = child else { return };
                    *current.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
                    loop {
                        let mut slot = current.lock().unwrap_or_else(|e| e.into_inner());
                        let child = slot.as_mut().expect("set above");
                        if stop.load(Ordering::Relaxed) {
                            let _ = child.kill();
                            let _ = child.wait();
                            return;
                        }
                        if !matches!(child.try_wait(), Ok(None)) {
                            break;
                        }
                        drop(slot);
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })
        };
        Serving { stop, thread }
    }

    /// Waits until the peer has run both measurements against us, or `deadline`.
    fn wait_served(&self, deadline: Instant) {
        while !self.thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Gives the peer until `deadline` to finish its runs against us, then stops serving.
    fn finish(self, deadline: Instant) {
        self.wait_served(deadline);
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}

/// Runs `tbrdma <tool> PEER --json` until it succeeds or `deadline` passes (the peer may not
/// be serving yet); returns its JSON line or the last error line.
fn measure(
    tool: &[String],
    link: &LinkUnderTest,
    settings: &Settings,
    deadline: Instant,
) -> Result<Value, String> {
    loop {
        let out = Command::new(tbrdma())
            .args(tool)
            .arg(link.peer.to_string())
            .args([
                "--bind",
                &link.local.to_string(),
                "--port",
                &settings.port.to_string(),
                "--timeout",
                "5",
                "--json",
            ])
            .stdin(Stdio::null())
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let text = String::from_utf8_lossy(&o.stdout);
                return text
                    .lines()
                    .rev()
                    .find_map(|l| serde_json::from_str::<Value>(l).ok())
                    .ok_or_else(|| format!("no result line in {text:?}"));
            }
            Ok(o) if Instant::now() >= deadline => {
                return Err(String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("failed without a message")
                    .to_owned());
            }
            Ok(_) => {}
            Err(e) => return Err(format!("cannot run {}: {e}", tbrdma().display())),
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The transport checks of every link. This side serves on all of them for the whole run,
/// so a peer that tests its cables in another order still finds a server on each.
pub fn checks(links: &[LinkUnderTest], settings: &Settings) -> Vec<Check> {
    let serving: Vec<Serving> = links
        .iter()
        .map(|l| Serving::start(l.local, settings))
        .collect();
    let mut out = Vec::new();
    for (link, serving) in links.iter().zip(&serving) {
        // Two doctors measuring each other at once would each time the other's busy-polling
        // server against its own: the end with the lower address goes first, the other once it
        // has served it (or, when the peer is no doctor, once it has waited long enough).
        if link.local > link.peer {
            serving.wait_served(Instant::now() + settings.peer_wait);
        }
        let deadline = Instant::now() + settings.peer_wait;
        let latency = measure(&pingpong_args(), link, settings, deadline);
        // The bandwidth run needs a doctor on the peer; a plain `tbrdma pingpong` server has
        // gone.
        let bandwidth = latency.is_ok().then(|| {
            let deadline = Instant::now() + settings.peer_wait.min(Duration::from_secs(5));
            measure(&bw_args(), link, settings, deadline)
        });
        out.push(judge_latency(link, &latency));
        if let Some(bandwidth) = bandwidth {
            out.push(judge_bandwidth(link, &bandwidth));
        }
    }
    let deadline = Instant::now() + settings.peer_wait;
    for s in serving {
        s.finish(deadline);
    }
    out
}

fn judge_latency(link: &LinkUnderTest, result: &Result<Value, String>) -> Check {
    let name = format!(
        "{} tbrdma ping-pong with {} ({})",
        link.interface, link.peer_name, link.peer
    );
    let value = match result {
        Err(e) => {
            return Check::new(name, Status::Fail, format!("no ping-pong: {e}")).fix(format!(
                "run `tbrdma doctor` (or `tbrdma pingpong --bind {}`) on {} at the same time",
                link.peer, link.peer_name
            ));
        }
        Ok(v) => v,
    };
    let Some(one_way) = value["t_typical_us"].as_f64() else {
        return Check::new(name, Status::Fail, format!("unreadable result {value}"));
    };
    let engine = value["engine"].as_str().unwrap_or("?");
    let mut detail = format!("one-way {one_way:.1} µs (WRITE, 2 B, {engine} engine)");
    let Some(icmp) = link.icmp_rtt_us else {
        return Check::new(name, Status::Pass, detail);
    };
    detail.push_str(&format!("; kernel ICMP round trip {icmp:.1} µs"));
    // A user-space one-way trip should cost about half the kernel's round trip plus the
    // engine's own work; several times the whole round trip means something is in the way.
    let expected = (icmp * 2.0).max(icmp + 25.0);
    if one_way <= expected {
        return Check::new(name, Status::Pass, detail);
    }
    let (why, fix) = if !link.busy_poll_off.is_empty() {
        (
            format!(
                "busy polling is off ({}): each datagram waits for an interrupt",
                link.busy_poll_off.join(", ")
            ),
            "run `sudo tbrdma setup` (sets the busy-poll sysctls and the link's NAPI settings)"
                .to_owned(),
        )
    } else {
        (
            "the polling threads share CPUs or run at low clocks".to_owned(),
            "use the performance governor (see the CPU governor check) and leave two cores idle for tbrdma".to_owned(),
        )
    };
    Check::new(
        name,
        Status::Warn,
        format!("{detail}: slower than expected (≤ {expected:.0} µs); {why}"),
    )
    .fix(fix)
}

fn judge_bandwidth(link: &LinkUnderTest, result: &Result<Value, String>) -> Check {
    let name = format!("{} tbrdma bandwidth to {}", link.interface, link.peer_name);
    let value = match result {
        Err(e) => {
            return Check::new(
                name,
                Status::Skip,
                format!("the peer served only the ping-pong ({e})"),
            )
            .fix(format!(
                "run `tbrdma doctor` on {} at the same time to measure bandwidth",
                link.peer_name
            ));
        }
        Ok(v) => v,
    };
    let Some(mib_s) = value["bw_avg_mib_s"].as_f64() else {
        return Check::new(name, Status::Fail, format!("unreadable result {value}"));
    };
    let gbps = mib_s * 8.0 * 1.048_576 / 1000.0;
    let detail =
        format!("{mib_s:.0} MiB/s = {gbps:.2} Gbit/s (WRITE, 64 KiB messages, one queue pair)");
    let Some(rate) = link.link_gbps else {
        return Check::new(
            name,
            Status::Pass,
            format!("{detail}; no link rate in sysfs to compare"),
        );
    };
    let detail = format!("{detail} on a {rate:.0} Gbit/s link");
    // thunderbolt-net moves one frame per interrupt or poll: a quarter of the link rate is
    // what a healthy host reaches with one queue pair.
    if gbps >= rate / 4.0 {
        return Check::new(name, Status::Pass, detail);
    }
    let fix = if rate < 40.0 {
        "the link trained below 40 Gbit/s (one lane, or a USB 3 cable): use a Thunderbolt 4/USB4 40 Gbit/s cable and reseat it"
    } else if !link.busy_poll_off.is_empty() {
        "run `sudo tbrdma setup` (busy polling is off)"
    } else {
        "check the CPU governor and IRQ affinity checks below; try `tbrdma bw --rails` for several cables"
    };
    Check::new(
        name,
        Status::Warn,
        format!("{detail}: under a quarter of the link rate"),
    )
    .fix(fix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(icmp: Option<f64>, gbps: Option<f64>, off: &[&str]) -> LinkUnderTest {
        LinkUnderTest {
            interface: "tb0".into(),
            local: Ipv4Addr::new(10, 0, 0, 1),
            peer: Ipv4Addr::new(10, 0, 0, 2),
            peer_name: "b".into(),
            icmp_rtt_us: icmp,
            link_gbps: gbps,
            busy_poll_off: off.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn a_slow_ping_pong_names_busy_polling_when_it_is_off() {
        let slow = Ok(serde_json::json!({"t_typical_us": 200.0, "engine": "sockets"}));
        let c = judge_latency(&link(Some(20.0), None, &["net.core.busy_poll=0"]), &slow);
        assert_eq!(c.status, Status::Warn);
        assert!(c.detail.contains("busy polling is off"), "{}", c.detail);
        assert!(c.fix.unwrap().contains("tbrdma setup"));
        let fast = Ok(serde_json::json!({"t_typical_us": 15.0, "engine": "sockets"}));
        assert_eq!(
            judge_latency(&link(Some(20.0), None, &[]), &fast).status,
            Status::Pass
        );
    }

    #[test]
    fn half_rate_links_and_missing_peers_say_what_to_do() {
        let slow = Ok(serde_json::json!({"bw_avg_mib_s": 300.0}));
        let c = judge_bandwidth(&link(None, Some(20.0), &[]), &slow);
        assert_eq!(c.status, Status::Warn);
        assert!(c.fix.unwrap().contains("cable"));
        let none = judge_latency(&link(None, None, &[]), &Err("refused".into()));
        assert_eq!(none.status, Status::Fail);
        assert!(none.fix.unwrap().contains("tbrdma doctor"));
    }
}
