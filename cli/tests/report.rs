//! `tbrdma report` as users run it: `tbrdma report` serving in one rank of a lab pair with two
//! cables, `tbrdma report PEER --quick` in the other; report.json has both hosts and every
//! step's figures, the SVG plots and the HTML page exist, and headless Chromium renders the page
//! with each plot carrying its tbrdma series and the kernel floor beside it. Also: the server
//! refuses a plan it cannot run and drops garbage on its control channel with a clear error.
//!
//! The lab test needs root (skips otherwise); the browser part needs `chromium` (Debian's
//! package) and skips with one line without it. Figures are checked for being there and sane,
//! never against a time.

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

const TBRDMA: &str = env!("CARGO_BIN_EXE_tbrdma");

fn show(o: &Output) -> String {
    format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn in_rank(lab: &Lab, rank: usize, args: &[&str]) -> Command {
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
    cmd
}

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser"].into_iter().find(|b| {
        Command::new(b)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The page as Chromium's DOM after loading it, or None without Chromium.
fn render(page: &Path, scratch: &Path) -> Option<String> {
    let Some(browser) = chromium() else {
        eprintln!("skipping the browser check: no chromium (apt-get install -y chromium)");
        return None;
    };
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!(
            "--user-data-dir={}",
            scratch.join("chromium").display()
        ))
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("run chromium");
    assert!(out.status.success(), "chromium:\n{}", show(&out));
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The `<figure id=ID>` element's markup in `dom`.
fn figure<'a>(dom: &'a str, id: &str) -> &'a str {
    let start = dom
        .find(&format!("<figure id=\"{id}\""))
        .unwrap_or_else(|| panic!("figure {id} in the rendered page"));
    let end = dom[start..].find("</figure>").expect("figure closes") + start;
    &dom[start..end]
}

/// Coordinate pairs of every `<polyline points="…">` in `svg`.
fn polylines(svg: &str) -> Vec<usize> {
    svg.split("<polyline")
        .skip(1)
        .filter_map(|p| {
            let points = p.split("points=\"").nth(1)?.split('"').next()?;
            Some(points.split_whitespace().count())
        })
        .collect()
}

#[test]
fn a_quick_report_between_two_hosts_renders_with_data() {
    let Some(lab) = Lab::up("h18r", 2, LabTopology::Pair, 2) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("report");
    let server = in_rank(&lab, 0, &["report", "--port", "18621"])
        .spawn()
        .expect("report server");
    std::thread::sleep(Duration::from_millis(300));
    let peer = lab.address(0, 1, 0).to_string();
    let client = in_rank(
        &lab,
        1,
        &[
            "report",
            &peer,
            "--quick",
            "--port",
            "18621",
            "--out",
            out_dir.to_str().unwrap(),
        ],
    )
    .output()
    .expect("report client");
    let server = server.wait_with_output().unwrap();
    assert!(
        client.status.success(),
        "client:\n{}\nserver:\n{}",
        show(&client),
        show(&server)
    );
    assert!(server.status.success(), "server:\n{}", show(&server));
    assert!(show(&server).contains("served one report"));

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).unwrap())
            .unwrap();
    for side in ["client", "server"] {
        let m = &report[side];
        assert!(
            m["kernel"].as_str().is_some_and(|k| !k.is_empty()),
            "{side}: {m:#}"
        );
        let links = m["links"]["devices"].as_array().expect("links");
        assert_eq!(links.len(), 2, "two cables on {side}: {m:#}");
        assert!(m["settings"]["memlock_bytes"] != Value::Null);
    }
    let steps = report["steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
    for want in [
        "latency_write",
        "latency_send",
        "latency_read",
        "bandwidth_1_rail",
        "bandwidth_all_rails",
        "allreduce_tbrdma",
        "allreduce_tcp_ring",
        "floor_udp_one_way",
        "floor_udp_exchange",
        "tp_Llama-3.1-8B",
        "tp_Llama-3.1-70B",
    ] {
        assert!(names.contains(&want), "{want} in {names:?}");
    }
    for s in steps {
        assert_eq!(s["ok"], true, "{s:#}");
        let rows = s["rows"].as_array().unwrap();
        assert!(!rows.is_empty(), "{s:#}");
    }
    for s in steps
        .iter()
        .filter(|s| s["name"].as_str().unwrap().starts_with("latency_"))
    {
        for r in s["rows"].as_array().unwrap() {
            let t = r["t_typical_us"].as_f64().unwrap();
            assert!(t > 0.0 && t.is_finite(), "{r}");
        }
        assert_eq!(
            s["rows"].as_array().unwrap().len(),
            4,
            "four sizes in the quick sweep"
        );
    }
    for id in ["latency", "bandwidth", "allreduce"] {
        let svg = std::fs::read_to_string(out_dir.join(format!("{id}.svg"))).unwrap();
        assert!(svg.contains("<svg"), "{id}.svg");
    }

    let Some(dom) = render(&out_dir.join("report.html"), tmp.path()) else {
        return;
    };
    // Each plot: its tbrdma series and at least one kernel floor, every line with data points.
    for (id, series) in [("latency", 4), ("bandwidth", 3), ("allreduce", 3)] {
        let fig = figure(&dom, id);
        assert!(
            fig.contains(&format!("data-series=\"{series}\"")),
            "{id}: {fig:.400}"
        );
        assert!(fig.contains("<svg"), "{id} has its plot inline");
        assert!(fig.contains("kernel"), "{id} shows a kernel floor");
        let lines = polylines(fig);
        let with_data = lines.iter().filter(|&&n| n >= 3).count();
        assert!(
            with_data >= series,
            "{id}: {series} lines with 3+ points each, got {lines:?}"
        );
    }
    assert!(dom.contains("Llama-3.1-70B"), "the tensor-parallel table");
    assert!(dom.contains("id=\"report-data\""), "report.json embedded");
}

#[test]
fn the_server_refuses_what_it_cannot_run_and_drops_garbage() {
    // A client with a hostfile asks for the collective runs; a server without one refuses.
    let tmp = tempfile::tempdir().unwrap();
    let hostfile = tmp.path().join("hostfile.json");
    std::fs::write(&hostfile, "{}").unwrap();
    let server = Command::new(TBRDMA)
        .args(["report", "--bind", "127.0.0.1", "--port", "18622"])
        .env_remove("TBRDMA_HOSTFILE")
        .env_remove("TBRDMA_RANK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let client = Command::new(TBRDMA)
        .args([
            "report",
            "127.0.0.1",
            "--port",
            "18622",
            "--quick",
            "--rank",
            "0",
            "--hostfile",
        ])
        .arg(&hostfile)
        .arg("--out")
        .arg(tmp.path().join("out"))
        .output()
        .unwrap();
    let server = server.wait_with_output().unwrap();
    assert!(!client.status.success());
    assert!(
        show(&client).contains("no hostfile on the serving host"),
        "{}",
        show(&client)
    );
    assert!(!server.status.success());
    assert!(
        !tmp.path().join("out").exists(),
        "nothing written for a refused report"
    );

    // Garbage instead of a plan: a clear error, no panic.
    let server = Command::new(TBRDMA)
        .args(["report", "--bind", "127.0.0.1", "--port", "18623"])
        .env_remove("RUST_BACKTRACE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stream = (0..50)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            TcpStream::connect("127.0.0.1:18623").ok()
        })
        .expect("the server listens");
    stream
        .write_all(b"{\"msg\":\"start\",\"step\":99999999999999999999}\n")
        .unwrap();
    let server = server.wait_with_output().unwrap();
    assert!(!server.status.success());
    let text = show(&server);
    assert!(
        text.contains("unreadable message") || text.contains("did not start with its plan"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
}
