//! `tbrdma doctor` with its transport and `--nccl` checks, as users run it: both ends of a lab
//! pair at once (each measures the link and serves the other), against a plain `tbrdma
//! pingpong` server, against nobody, and with the NCCL environment broken on purpose (wrong
//! plugin path, `NCCL_NET=Socket`, no link for the plugin), each failure with its fix.
//!
//! The lab tests need root and skip (saying so) without it. Figures are checked for being there
//! and sane, never against a time. The `--nccl` tests need the plugin built next to `tbrdma`
//! (`cargo test --workspace` does it) and skip with one line otherwise.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;
use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

const TBRDMA: &str = env!("CARGO_BIN_EXE_tbrdma");

/// One pair of busy-polling processes at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn lab(tag: &str, rails: u32) -> Option<(std::sync::MutexGuard<'static, ()>, Lab)> {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Lab::up(tag, 2, LabTopology::Pair, rails).map(|lab| (serial, lab))
}

fn show(o: &Output) -> String {
    format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `tbrdma lab exec RANK -- tbrdma ARGS`, with `env`.
fn in_rank(lab: &Lab, rank: usize, args: &[&str], env: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(TBRDMA);
    cmd.args([
        "lab",
        "exec",
        "--name",
        &lab.name,
        &rank.to_string(),
        "--",
        TBRDMA,
    ])
    .args(args)
    .env_remove("RUST_BACKTRACE")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn report(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("doctor --json: {e}\n{}", show(out)))
}

/// The checks whose name contains `part`.
fn checks<'a>(report: &'a Value, part: &str) -> Vec<&'a Value> {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["name"].as_str().unwrap_or("").contains(part))
        .collect()
}

/// The check named `part`, or else the one check whose name contains it.
fn one<'a>(report: &'a Value, part: &str) -> &'a Value {
    let found = checks(report, part);
    if let Some(exact) = found.iter().find(|c| c["name"] == part) {
        return exact;
    }
    assert_eq!(found.len(), 1, "one check named *{part}*: {report:#}");
    found[0]
}

fn status(check: &Value) -> &str {
    check["status"].as_str().unwrap_or("")
}

/// A measured check: passed, or warned with a reason and a fix (a loaded test machine may
/// make a link look slow), and carrying its figure.
fn assert_measured(check: &Value, figure: &str) {
    assert!(matches!(status(check), "pass" | "warn"), "{check:#}");
    if status(check) == "warn" {
        assert!(
            check["fix"].is_string(),
            "a warning says how to fix it: {check:#}"
        );
    }
    let detail = check["detail"].as_str().unwrap();
    assert!(detail.contains(figure), "{figure} in {detail}");
    let number: f64 = detail
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("a figure in {detail}"));
    assert!(number > 0.0 && number.is_finite(), "{detail}");
}

/// The plugin cargo built next to `tbrdma`, in a folder of its own under both names.
fn plugin_dir(tmp: &Path) -> Option<PathBuf> {
    let built = Path::new(TBRDMA)
        .parent()
        .unwrap()
        .join("libnccl_net_tbrdma.so");
    if !built.exists() {
        eprintln!(
            "skipping the --nccl part: {} not built (cargo build -p tbrdma-nccl)",
            built.display()
        );
        return None;
    }
    let dir = tmp.join("lib");
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["libnccl-net-tbrdma.so", "librccl-net-tbrdma.so"] {
        std::fs::copy(&built, dir.join(name)).unwrap();
    }
    Some(dir)
}

#[test]
fn both_ends_running_doctor_measure_the_link_and_the_plugin_checks_pass() {
    // Two cables: each doctor serves on both while it measures them one by one.
    let Some((_serial, lab)) = lab("h18d", 2) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let plugin = plugin_dir(tmp.path());
    let port = ("TBRDMA_DOCTOR_PORT", "18611".to_string());
    let peer = in_rank(&lab, 0, &["doctor", "--json"], std::slice::from_ref(&port))
        .spawn()
        .expect("doctor on rank 0");
    let mut env = vec![
        port.clone(),
        ("TBRDMA_IFACES", lab.address(1, 0, 0).to_string()),
    ];
    let mut args = vec!["doctor", "--json"];
    if let Some(dir) = &plugin {
        env.push(("LD_LIBRARY_PATH", dir.display().to_string()));
        env.push(("NCCL_NET_PLUGIN", "tbrdma".into()));
        env.push(("NCCL_NET", "tbrdma".into()));
        args.push("--nccl");
    }
    let me = in_rank(&lab, 1, &args, &env)
        .output()
        .expect("doctor on rank 1");
    let peer = peer.wait_with_output().expect("doctor on rank 0");
    for (rank, out) in [(0, &peer), (1, &me)] {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
        let r = report(out);
        let pings = checks(&r, "tbrdma ping-pong with");
        let bandwidths = checks(&r, "tbrdma bandwidth to");
        assert_eq!(
            (pings.len(), bandwidths.len()),
            (2, 2),
            "one of each per cable: {r:#}"
        );
        for c in pings {
            assert_measured(c, "one-way");
            assert!(
                c["detail"]
                    .as_str()
                    .unwrap()
                    .contains("kernel ICMP round trip"),
                "{c:#}"
            );
        }
        for c in bandwidths {
            assert_measured(c, "MiB/s");
        }
    }
    if plugin.is_some() {
        let r = report(&me);
        for name in [
            "NCCL_NET_PLUGIN",
            "NCCL_NET",
            "NCCL finds the plugin",
            "NCCL plugin loads",
            "NCCL plugin init",
            "RCCL finds the plugin",
            "RCCL plugin loads",
        ] {
            let c = one(&r, name);
            assert_eq!(status(c), "pass", "{c:#}");
        }
        assert!(
            one(&r, "NCCL plugin loads")["detail"]
                .as_str()
                .unwrap()
                .contains("v11, v10, v9, v8")
        );
        assert!(
            one(&r, "NCCL plugin init")["detail"]
                .as_str()
                .unwrap()
                .contains("1 device")
        );
        assert!(
            one(&r, "RCCL finds")["detail"]
                .as_str()
                .unwrap()
                .contains("librccl-net-tbrdma.so")
        );
    }
}

#[test]
fn a_pingpong_server_gives_latency_only_and_no_peer_fails_with_its_fix() {
    let Some((_serial, lab)) = lab("h18s", 1) else {
        return;
    };
    let server_ip = lab.address(0, 1, 0).to_string();
    let server = in_rank(
        &lab,
        0,
        &["pingpong", "--bind", &server_ip, "--port", "18612"],
        &[],
    )
    .spawn()
    .expect("pingpong server");
    let env = [
        ("TBRDMA_DOCTOR_PORT", "18612".to_string()),
        ("TBRDMA_DOCTOR_PEER_WAIT", "3".to_string()),
    ];
    let out = in_rank(&lab, 1, &["doctor", "--json"], &env)
        .output()
        .unwrap();
    let served = server.wait_with_output().unwrap();
    assert!(
        served.status.success(),
        "the server served one run:\n{}",
        show(&served)
    );
    let r = report(&out);
    assert_measured(one(&r, "tbrdma ping-pong with"), "one-way");
    let bw = one(&r, "tbrdma bandwidth to");
    assert_eq!(status(bw), "skip", "{bw:#}");
    assert!(
        bw["fix"]
            .as_str()
            .unwrap()
            .contains("run `tbrdma doctor` on"),
        "{bw:#}"
    );

    // Nobody at the other end: the check fails and says what to run there.
    std::thread::sleep(Duration::from_millis(200));
    let out = in_rank(&lab, 1, &["doctor", "--json"], &env)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a failed check fails doctor:\n{}",
        show(&out)
    );
    let r = report(&out);
    let pp = one(&r, "tbrdma ping-pong with");
    assert_eq!(status(pp), "fail", "{pp:#}");
    assert!(
        pp["detail"].as_str().unwrap().contains("no ping-pong"),
        "{pp:#}"
    );
    let fix = pp["fix"].as_str().unwrap();
    assert!(
        fix.contains("tbrdma doctor") && fix.contains(&server_ip),
        "{fix}"
    );
}

/// `tbrdma doctor --nccl --json` on this host with exactly `env` for the NCCL variables.
fn nccl_doctor(env: &[(&str, String)]) -> Value {
    // An empty sysfs: no links, so only the host and plugin checks have anything to say.
    let sysfs = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(TBRDMA);
    cmd.args(["doctor", "--nccl", "--json", "--sysfs-root"])
        .arg(sysfs.path());
    for k in [
        "NCCL_NET_PLUGIN",
        "NCCL_NET",
        "LD_LIBRARY_PATH",
        "TBRDMA_IFACES",
        "TBRDMA_LINKS",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    // No links here ("links present" fails), so doctor fails either way; the report is on stdout.
    assert!(!out.status.success());
    report(&out)
}

#[test]
fn broken_nccl_setups_fail_with_their_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(dir) = plugin_dir(tmp.path()) else {
        return;
    };
    let lib = ("LD_LIBRARY_PATH", dir.display().to_string());
    let plugin = ("NCCL_NET_PLUGIN", "tbrdma".to_string());
    let net = ("NCCL_NET", "tbrdma".to_string());

    // A path that does not exist.
    let r = nccl_doctor(&[
        (
            "NCCL_NET_PLUGIN",
            "/nonexistent/libnccl-net-tbrdma.so".into(),
        ),
        net.clone(),
    ]);
    let c = one(&r, "NCCL finds the plugin");
    assert_eq!(status(c), "fail", "{c:#}");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/libnccl-net-tbrdma.so")
    );
    assert!(c["fix"].as_str().unwrap().contains("tbrdma install"));

    // Unset: the loaders look for the unsuffixed default, which tbrdma does not install.
    let r = nccl_doctor(&[lib.clone(), net.clone()]);
    let c = one(&r, "NCCL_NET_PLUGIN");
    assert_eq!(status(c), "fail", "{c:#}");
    assert!(
        c["fix"]
            .as_str()
            .unwrap()
            .contains("NCCL_NET_PLUGIN=tbrdma")
    );

    // The library folder not on LD_LIBRARY_PATH.
    let r = nccl_doctor(&[plugin.clone(), net.clone()]);
    let c = one(&r, "NCCL finds the plugin");
    assert_eq!(status(c), "fail", "{c:#}");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains("libnccl-net-tbrdma.so"),
        "{c:#}"
    );

    // NCCL_NET naming another network.
    let r = nccl_doctor(&[lib.clone(), plugin.clone(), ("NCCL_NET", "Socket".into())]);
    let c = one(&r, "NCCL_NET");
    assert_eq!(status(c), "fail", "{c:#}");
    assert!(c["detail"].as_str().unwrap().contains("Socket"));
    assert!(c["fix"].as_str().unwrap().contains("NCCL_NET=tbrdma"));
    // Found and loaded all the same.
    assert_eq!(status(one(&r, "NCCL plugin loads")), "pass", "{r:#}");

    // A link the plugin cannot use: init fails, and the fix names TBRDMA_IFACES.
    let r = nccl_doctor(&[lib, plugin, net, ("TBRDMA_IFACES", "192.0.2.77".into())]);
    let c = one(&r, "NCCL plugin init");
    assert_eq!(status(c), "fail", "{c:#}");
    assert!(
        c["fix"].as_str().unwrap().contains("TBRDMA_IFACES"),
        "{c:#}"
    );

    // Another library under tbrdma's name is not taken for it.
    let other = tmp.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let capi = Path::new(TBRDMA).parent().unwrap().join("libtbrdma.so");
    if std::fs::copy(&capi, other.join("libnccl-net-tbrdma.so")).is_ok() {
        let r = nccl_doctor(&[
            ("LD_LIBRARY_PATH", other.display().to_string()),
            ("NCCL_NET_PLUGIN", "tbrdma".into()),
            ("NCCL_NET", "tbrdma".into()),
        ]);
        let c = one(&r, "NCCL plugin loads");
        assert_eq!(status(c), "fail", "{c:#}");
        assert!(
            c["detail"].as_str().unwrap().contains("another plugin"),
            "{c:#}"
        );
    }
}
