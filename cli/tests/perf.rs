//! `tbrdma pingpong`, `tbrdma bw` and `tbrdma devices` as a user runs them: server and client
//! in two network namespaces of a lab joined by a veth "cable" (MTU 65520), every operation,
//! a size sweep, `--verify`, `--json` parsed and checked for sane numbers, every engine, and
//! each failure with its one-line message and exit status.
//!
//! The lab tests need root and skip (saying so) without it. They never assert on timing, and run
//! one busy-polling pair at a time: the machine may have only 2 cores.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;
use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

const TBRDMA: &str = env!("CARGO_BIN_EXE_tbrdma");

/// One pair of busy-polling processes at a time.
static SERIAL: Mutex<()> = Mutex::new(());
/// A fresh side-channel port per run, so no run meets the previous one's sockets.
static PORT: AtomicU16 = AtomicU16::new(19_000);

fn port() -> String {
    PORT.fetch_add(1, Ordering::Relaxed).to_string()
}

fn lab(tag: &str) -> Option<(std::sync::MutexGuard<'static, ()>, Lab)> {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Lab::up(tag, 2, LabTopology::Pair, 1).map(|lab| (serial, lab))
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
    ]);
    cmd.args(args);
    cmd
}

/// A server in rank 0, started and listening.
struct Server {
    child: Child,
    stderr: JoinHandle<String>,
}

impl Server {
    fn start(lab: &Lab, args: &[&str]) -> Server {
        Server::start_with(lab, args, &[])
    }

    /// [`Server::start`] with environment variables set for the server.
    fn start_with(lab: &Lab, args: &[&str], envs: &[(&str, &str)]) -> Server {
        let mut child = in_rank(lab, 0, args)
            .envs(envs.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the server");
        let (tx, rx) = mpsc::channel();
        let pipe = child.stderr.take().expect("server stderr");
        let stderr = std::thread::spawn(move || {
            let mut all = String::new();
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if line.starts_with("waiting for a client") {
                    let _ = tx.send(());
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        if rx.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = child.kill();
            let out = child.wait_with_output().expect("server output");
            panic!(
                "the server never listened: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        Server { child, stderr }
    }

    /// Waits for the server's exit: (success, stdout, stderr).
    fn finish(self) -> (bool, String, String) {
        let out = self.child.wait_with_output().expect("server output");
        let err = self.stderr.join().expect("server stderr");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            err,
        )
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.finish();
    }
}

fn client(lab: &Lab, args: &[&str]) -> Output {
    in_rank(lab, 1, args).output().expect("run the client")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs one server/client pair of `tool` with the same `args`; returns the client's output.
fn pair(lab: &Lab, tool: &str, args: &[&str]) -> Output {
    pair_with(lab, tool, args, &[])
}

/// [`pair`] with environment variables set for both sides.
fn pair_with(lab: &Lab, tool: &str, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let port = port();
    let server_ip = lab.address(0, 1, 0).to_string();
    let mut server_args = vec![tool, "--port", &port];
    server_args.extend_from_slice(args);
    let server = Server::start_with(lab, &server_args, envs);
    let mut client_args = vec![tool, &server_ip, "--port", &port];
    client_args.extend_from_slice(args);
    let out = in_rank(lab, 1, &client_args)
        .envs(envs.iter().copied())
        .output()
        .expect("run the client");
    let (ok, s_out, s_err) = server.finish();
    assert!(
        out.status.success(),
        "{tool} {args:?}: client failed:\n{}\n{}\nserver:\n{s_out}\n{s_err}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(ok, "{tool} {args:?}: server failed:\n{s_out}\n{s_err}");
    assert!(s_err.contains("served one run"), "{s_err}");
    assert!(s_out.is_empty(), "the server prints no results: {s_out}");
    out
}

/// Every stdout line parsed as JSON (so nothing else is on stdout).
fn json_lines(out: &Output) -> Vec<Value> {
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

fn check_latency(v: &Value, op: &str, bytes: u64, iters: u64) {
    assert_eq!(v["op"], op, "{v}");
    assert_eq!(v["bytes"].as_u64(), Some(bytes), "{v}");
    assert_eq!(v["iters"].as_u64(), Some(iters), "{v}");
    assert_eq!(v["verified"], true, "{v}");
    assert!(
        matches!(v["engine"].as_str(), Some("uring" | "sockets" | "packet")),
        "{v}"
    );
    let (min, max) = (num(v, "t_min_us"), num(v, "t_max_us"));
    let (typ, avg) = (num(v, "t_typical_us"), num(v, "t_avg_us"));
    let (p99, p999) = (num(v, "p99_us"), num(v, "p999_us"));
    assert!(min > 0.0 && min <= typ && typ <= max, "{v}");
    assert!(
        min <= avg && avg <= max && num(v, "t_stdev_us") >= 0.0,
        "{v}"
    );
    assert!(p99 >= min && p999 >= p99 && p999 <= max, "{v}");
}

fn check_bandwidth(v: &Value, op: &str, bytes: u64, iters: Option<u64>) {
    assert_eq!(v["op"], op, "{v}");
    assert_eq!(v["bytes"].as_u64(), Some(bytes), "{v}");
    if let Some(iters) = iters {
        assert_eq!(v["iters"].as_u64(), Some(iters), "{v}");
    }
    assert_eq!(v["verified"], true, "{v}");
    let (peak, avg) = (num(v, "bw_peak_mib_s"), num(v, "bw_avg_mib_s"));
    assert!(avg > 0.0 && peak >= avg, "{v}");
    assert!(num(v, "msg_rate_mpps") > 0.0, "{v}");
}

#[test]
fn every_pingpong_op_with_every_engine_verified_and_as_json() {
    let Some((_serial, lab)) = lab("pp") else {
        return;
    };
    for engine in ["uring", "sockets", "packet"] {
        for op in ["write", "send", "read", "atomic"] {
            let mut args = vec!["--op", op, "--engine", engine];
            args.extend(["--iters", "40", "--warmup", "4", "--verify", "--json"]);
            let sizes: &[u64] = if op == "atomic" {
                &[8]
            } else {
                args.extend(["--size", "8", "--size", "4096", "--size", "65536"]);
                &[8, 4096, 65536]
            };
            let out = pair(&lab, "pingpong", &args);
            let lines = json_lines(&out);
            assert_eq!(lines.len(), sizes.len(), "{engine}/{op}: {lines:?}");
            for (line, &size) in lines.iter().zip(sizes) {
                check_latency(line, op, size, 40);
            }
            let err = text(&out.stderr);
            assert!(
                err.contains(&format!("engine {}", lines[0]["engine"].as_str().unwrap())),
                "{err}"
            );
        }
    }
}

#[test]
fn pingpong_sweeps_two_bytes_to_eight_mebibytes_in_perftest_columns() {
    let Some((_serial, lab)) = lab("ps") else {
        return;
    };
    let out = pair(
        &lab,
        "pingpong",
        &["--all", "--iters", "3", "--warmup", "1", "--verify"],
    );
    let stdout = text(&out.stdout);
    let mut lines = stdout.lines();
    let header = lines.next().expect("a header");
    for column in [
        "#bytes",
        "#iterations",
        "t_min[usec]",
        "t_typical[usec]",
        "99.9% percentile[usec]",
    ] {
        assert!(header.contains(column), "{header}");
    }
    let sizes: Vec<u64> = lines
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(cols.len(), 9, "{l}");
            assert_eq!(cols[1], "3", "{l}");
            cols[0].parse().expect("a size")
        })
        .collect();
    let want: Vec<u64> = (1..=23).map(|p| 1u64 << p).collect();
    assert_eq!(sizes, want);
}

#[test]
fn pingpong_with_a_background_progress_thread() {
    let Some((_serial, lab)) = lab("pt") else {
        return;
    };
    for op in ["write", "send"] {
        let args = [
            "--op",
            op,
            "--progress",
            "thread",
            "--iters",
            "20",
            "--warmup",
            "2",
        ];
        let mut args = args.to_vec();
        args.extend(["--verify", "--json", "--engine", "sockets"]);
        let out = pair(&lab, "pingpong", &args);
        let lines = json_lines(&out);
        check_latency(&lines[0], op, 2, 20);
        assert!(
            text(&out.stderr).contains("thread progress"),
            "{}",
            text(&out.stderr)
        );
    }
}

/// `--paired-with floor`: tbrdma's ping-pong in lockstep with its engine's floor over the same
/// cable, as linkbench runs it (UDP for the sockets engine, raw frames for the packet engine).
/// Every line says which floor, in how many blocks, and tbrdma's ratios to it; the refusals
/// come before anything connects.
#[test]
fn pingpong_paired_with_its_floor_reports_its_ratios_block_by_block() {
    let Some((_serial, lab)) = lab("pp2") else {
        return;
    };
    for (engine, floor) in [("sockets", "udp"), ("packet", "frames")] {
        for op in ["write", "send"] {
            let mut args = vec!["--op", op, "--engine", engine, "--paired-with", "floor"];
            args.extend(["--iters", "300", "--warmup", "20", "--block", "100"]);
            args.extend(["--size", "8", "--size", "65536", "--verify", "--json"]);
            let out = pair(&lab, "pingpong", &args);
            let lines = json_lines(&out);
            assert_eq!(lines.len(), 2, "{engine}/{op}: {lines:?}");
            for (line, size) in lines.iter().zip([8, 65536]) {
                check_latency(line, op, size, 300);
                let paired = &line["paired"];
                assert_eq!(paired["floor"], floor, "{line}");
                // 300 round trips in blocks of 100, each between two floor blocks.
                assert_eq!(paired["blocks"].as_u64(), Some(3), "{line}");
                assert_eq!(paired["block"].as_u64(), Some(100), "{line}");
                for key in ["floor_typical_us", "ratio_typical", "ratio_avg"] {
                    let v = num(paired, key);
                    assert!(v.is_finite() && v > 0.0, "{key}: {line}");
                }
            }
        }
    }
    // As text: the ratios go on a comment line under the size's row.
    let args = ["--paired-with", "udp", "--iters", "200", "--block", "100"];
    let out = pair(&lab, "pingpong", &args);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("# paired with the udp floor in 2 blocks of 100"),
        "{stdout}"
    );
    let server_ip = lab.address(0, 1, 0).to_string();
    for (refused, why) in [
        (vec!["--op", "read"], "--paired-with pairs WRITE and SEND"),
        (vec!["--warmup", "0"], "--warmup of at least 1"),
    ] {
        let mut args = vec!["pingpong", &server_ip, "--paired-with", "floor"];
        args.extend(refused);
        one_line_failure(&client(&lab, &args), &[why]);
    }
}

/// `bw --paired-with tcp`: one TCP stream between the same two processes over the same cable
/// before and after tbrdma's run of each size; every line says what the streams made and
/// tbrdma's ratio to them. `--bidir` is refused before anything connects.
#[test]
fn bw_paired_with_one_tcp_stream_reports_its_ratio() {
    let Some((_serial, lab)) = lab("bw2") else {
        return;
    };
    for op in ["write", "send"] {
        let args = [
            "--op",
            op,
            "--paired-with",
            "tcp",
            "--size",
            "65536",
            "--size",
            "1048576",
            "--duration",
            "0.3",
            "--verify",
            "--json",
        ];
        let out = pair(&lab, "bw", &args);
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 2, "{op}: {lines:?}");
        for (line, size) in lines.iter().zip([65536, 1048576]) {
            check_bandwidth(line, op, size, None);
            let paired = &line["paired"];
            assert_eq!(paired["baseline"], "tcp", "{line}");
            for key in ["before_mib_s", "after_mib_s", "ratio"] {
                let v = num(paired, key);
                assert!(v.is_finite() && v > 0.0, "{key}: {line}");
            }
        }
    }
    let server_ip = lab.address(0, 1, 0).to_string();
    let args = ["bw", &server_ip, "--paired-with", "tcp", "--bidir"];
    one_line_failure(&client(&lab, &args), &["not with --bidir"]);
}

/// `pingpong --op write` sends payload and counter as one WRITE at every size and learns of
/// the peer's by polling the counter, its last word; over a cable whose receivers hold back a
/// third of the datagrams (`TBRDMA_FAULTS`, both sides), `--verify` checks every byte of every
/// message the moment its counter shows, at sizes of one, two and four datagrams.
#[test]
fn pingpong_write_verifies_every_byte_over_a_reordering_cable() {
    let Some((_serial, lab)) = lab("ppr") else {
        return;
    };
    for engine in ["sockets", "packet"] {
        let args = [
            "--op", "write", "--engine", engine, "--size", "16384", "--size", "65536", "--size",
            "200000", "--iters", "150", "--warmup", "5", "--verify", "--json",
        ];
        let faults = [("TBRDMA_FAULTS", "reorder=35%,reorder_by=300us,seed=3")];
        let out = pair_with(&lab, "pingpong", &args, &faults);
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 3, "{engine}: {lines:?}");
        for (line, size) in lines.iter().zip([16384, 65536, 200000]) {
            check_latency(line, "write", size, 150);
        }
    }
}

#[test]
fn bw_streams_every_op_over_several_connections_and_both_directions() {
    let Some((_serial, lab)) = lab("bw") else {
        return;
    };
    for engine in ["uring", "sockets", "packet"] {
        for op in ["write", "send", "read"] {
            let args = [
                "--op", op, "--engine", engine, "--size", "65536", "--size", "4096",
            ];
            let mut args = args.to_vec();
            args.extend(["--iters", "200", "--verify", "--json"]);
            let lines = json_lines(&pair(&lab, "bw", &args));
            assert_eq!(lines.len(), 2, "{lines:?}");
            check_bandwidth(&lines[0], op, 65536, Some(200));
            check_bandwidth(&lines[1], op, 4096, Some(200));
        }
    }
    // Two connections each way: the client reports both directions' messages.
    for op in ["write", "send"] {
        let args = [
            "--op", op, "--qps", "2", "--bidir", "--iters", "100", "--size", "8192",
        ];
        let mut args = args.to_vec();
        args.extend(["--verify", "--json"]);
        let lines = json_lines(&pair(&lab, "bw", &args));
        check_bandwidth(&lines[0], op, 8192, Some(2 * 2 * 100));
    }
    // A timed run, in perftest's text columns.
    let out = pair(&lab, "bw", &["--duration", "0.3", "--size", "4096"]);
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].contains("BW peak[MiB/sec]") && lines[0].contains("MsgRate[Mpps]"),
        "{stdout}"
    );
    let cols: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(cols.len(), 5, "{stdout}");
    assert_eq!(cols[0], "4096");
    assert!(cols[1].parse::<u64>().expect("iterations") > 0, "{stdout}");
}

/// Exactly one line on stderr, containing every one of `needles`; a failing exit status.
fn one_line_failure(out: &Output, needles: &[&str]) -> String {
    let err = text(&out.stderr);
    assert!(!out.status.success(), "should fail: {err}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "one line on stderr, got: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{needle:?} not in: {err}");
    }
    err
}

#[test]
fn failures_say_what_went_wrong_in_one_line() {
    let Some((_serial, lab)) = lab("pf") else {
        return;
    };
    let server_ip = lab.address(0, 1, 0).to_string();

    // Nobody listening at the server's address.
    let p = port();
    let out = client(&lab, &["pingpong", &server_ip, "--port", &p]);
    one_line_failure(
        &out,
        &[
            "no tbrdma listener",
            &server_ip,
            "start the server side first",
        ],
    );

    // No route to the server from the client's namespace.
    let out = client(&lab, &["pingpong", "10.99.99.1", "--port", &p]);
    one_line_failure(&out, &["cannot reach 10.99.99.1", "unreachable"]);

    // Server and client disagree: both refuse, naming the option and both values.
    let p = port();
    let server = Server::start(&lab, &["pingpong", "--port", &p, "--size", "8"]);
    let out = client(
        &lab,
        &["pingpong", &server_ip, "--port", &p, "--size", "4096"],
    );
    one_line_failure(&out, &["options differ", "--size (server 8, client 4096)"]);
    let (ok, _, s_err) = server.finish();
    assert!(
        !ok && s_err.contains("--size (server 8, client 4096)"),
        "{s_err}"
    );

    // The other tool on the server.
    let p = port();
    let server = Server::start(&lab, &["bw", "--port", &p]);
    let out = client(&lab, &["pingpong", &server_ip, "--port", &p]);
    one_line_failure(&out, &["the peer runs `tbrdma bw`"]);
    let _ = server.finish();

    // Something listens but never answers: timed out after --timeout seconds.
    let p = port();
    let (listening_tx, listening_rx) = mpsc::channel();
    let namespace = lab.namespace(0);
    let addr = format!("{server_ip}:{p}");
    let silent = std::thread::spawn(move || {
        tbrdma_netdev::netns::enter_current_thread(&namespace).expect("enter the namespace");
        let listener = TcpListener::bind(&addr).expect("bind the silent listener");
        listening_tx.send(()).expect("tell the test");
        let (_conn, _) = listener.accept().expect("accept");
        std::thread::sleep(Duration::from_secs(3));
    });
    listening_rx.recv().expect("the silent listener");
    let out = client(
        &lab,
        &["pingpong", &server_ip, "--port", &p, "--timeout", "1"],
    );
    one_line_failure(
        &out,
        &["timed out after 1 seconds", "sent no tbrdma answer"],
    );
    silent.join().expect("silent listener");

    // The server dies mid-run: the client stops with one line, not a hang.
    let p = port();
    let long = ["--iters", "100000000", "--warmup", "0"];
    let mut server_args = vec!["pingpong", "--port", &p];
    server_args.extend(long);
    let server = Server::start(&lab, &server_args);
    let mut client_args = vec![
        "pingpong",
        &server_ip,
        "--port",
        &p,
        "--timeout",
        "2",
        "--json",
    ];
    client_args.extend(long);
    let mut running = in_rank(&lab, 1, &client_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the client");
    let mut err_lines = BufReader::new(running.stderr.take().expect("stderr")).lines();
    let first = err_lines.next().and_then(Result::ok).unwrap_or_default();
    assert!(first.starts_with("connected to"), "{first}");
    std::thread::sleep(Duration::from_millis(300));
    server.kill();
    let rest: Vec<String> = err_lines.map_while(Result::ok).collect();
    let status = running.wait().expect("client exit");
    assert_eq!(status.code(), Some(1), "{rest:?}");
    assert_eq!(rest.len(), 1, "{rest:?}");
    assert!(
        rest[0].contains("RetryExceeded") || rest[0].contains("timed out after 2 seconds"),
        "{rest:?}"
    );
}

#[test]
fn bw_with_rails_uses_both_cables_to_the_peer() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("br", 2, LabTopology::Pair, 2) else {
        return;
    };
    let args = [
        "--rails", "--size", "1048576", "--iters", "40", "--verify", "--json",
    ];
    let out = pair(&lab, "bw", &args);
    check_bandwidth(&json_lines(&out)[0], "write", 1 << 20, Some(40));
    let err = text(&out.stderr);
    assert!(err.contains("2 rails"), "{err}");
}

/// Two cables each slower than the host (a token bucket at 4 Gbit/s with a 2 MB queue in
/// front, as a Thunderbolt cable's wire is slower than the CPU that feeds it), both engines:
/// the transfer uses both cables, the queues never overflow (the UDP socket's send buffer says
/// "wait" first), and the sender resends next to nothing. Before, each cable's gaps seen on
/// the other (one queue a little longer than the other) were answered by resending everything
/// after them: a fifth to a quarter of the datagrams went twice; and the 16 MiB send buffer let
/// the queue overflow, dropping up to half. Skips without `tc` or the kernel's `tbf`.
#[test]
fn bw_over_two_cables_slower_than_the_host_resends_next_to_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("rl", 2, LabTopology::Pair, 2) else {
        return;
    };
    if let Err(why) = lab.limit_rate("4gbit") {
        eprintln!("skipping: {why}");
        return;
    }
    for engine in ["sockets", "packet"] {
        let args = [
            "--engine", engine, "--rails", "--size", "1048576", "--iters", "300", "--verify",
            "--json",
        ];
        let out = pair(&lab, "bw", &args);
        let line = &json_lines(&out)[0];
        check_bandwidth(line, "write", 1 << 20, Some(300));
        let recovery = &line["recovery"];
        let per_rail: Vec<u64> = recovery["rail_datagrams"]
            .as_array()
            .unwrap_or_else(|| panic!("datagrams per rail: {line}"))
            .iter()
            .map(|n| n.as_u64().expect("a count"))
            .collect();
        let total: u64 = per_rail.iter().sum();
        assert!(
            per_rail.len() == 2 && per_rail.iter().all(|&n| n > total / 4),
            "{engine}: both cables carried the transfer: {line}"
        );
        let resent = recovery["retransmits"].as_u64().expect("retransmits");
        assert!(
            resent * 20 < total,
            "{engine}: {resent} of {total} datagrams resent: {line}"
        );
    }
    assert_eq!(lab.rate_limit_drops(), 0, "no cable's queue overflowed");
}

/// The packet engine sends its frames only to the peer's own Ethernet address, on every rail:
/// never to the broadcast address, where every host on a shared segment would see the payload.
/// Rail 1 is the case that broadcast before: the side channel runs over rail 0 only, so
/// nothing had made the kernel resolve the peer's address on rail 1, and every frame there went
/// to ff:ff:ff:ff:ff:ff. Counted by nftables on each cable's egress; skips without nft.
#[test]
fn the_packet_engine_never_broadcasts_a_frame() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if let Err(why) = tbrdma_tests::nftables_available() {
        eprintln!("skipping: {why}");
        return;
    }
    let Some(lab) = Lab::up("nb", 2, LabTopology::Pair, 2) else {
        return;
    };
    if let Err(why) = lab.watch_frames() {
        eprintln!("skipping: {why}");
        return;
    }
    let args = [
        "--engine", "packet", "--rails", "--size", "1048576", "--iters", "20", "--verify", "--json",
    ];
    let out = pair(&lab, "bw", &args);
    let line = &json_lines(&out)[0];
    if line["engine"].as_str() != Some("packet") {
        eprintln!("skipping: the packet engine is not available here: {line}");
        return;
    }
    check_bandwidth(line, "write", 1 << 20, Some(20));
    let (frames, broadcast) = lab.frames_sent();
    assert!(frames > 40, "the watch saw the run's frames: {frames}");
    assert_eq!(
        broadcast, 0,
        "{broadcast} of {frames} frames were broadcast"
    );
}

#[test]
fn too_little_memlock_prints_the_limit_and_the_fix() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipping: dropping to an unprivileged user needs root");
        return;
    }
    let have = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !have("prlimit") || !have("setpriv") {
        eprintln!("skipping: needs prlimit and setpriv (util-linux)");
        return;
    }
    // The unprivileged user may not reach the build directory: run a world-readable copy.
    let copy = std::env::temp_dir().join(format!("tbrdma-memlock-{}", std::process::id()));
    std::fs::copy(TBRDMA, &copy).expect("copy the binary");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // A 1 MiB hard limit that the unprivileged user cannot raise, and a 4 MiB region: the
    // regions are allocated before connecting, so no server is needed.
    let out = Command::new("prlimit")
        .args([
            "--memlock=1048576:1048576",
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ])
        .arg(&copy)
        .args([
            "pingpong",
            "127.0.0.1",
            "--bind",
            "127.0.0.1",
            "--engine",
            "sockets",
            "--size",
            "4194304",
        ])
        .output()
        .expect("run prlimit");
    let _ = std::fs::remove_file(&copy);
    one_line_failure(&out, &["RLIMIT_MEMLOCK", "ulimit -l unlimited"]);
}

#[test]
fn every_command_has_help_with_an_example() {
    for tool in ["pingpong", "bw", "devices"] {
        let out = Command::new(TBRDMA)
            .args([tool, "--help"])
            .output()
            .expect("help");
        let help = text(&out.stdout);
        assert!(
            out.status.success() && help.contains("Example"),
            "{tool}: {help}"
        );
    }
    let help = text(
        &Command::new(TBRDMA)
            .args(["pingpong", "--help"])
            .output()
            .expect("help")
            .stdout,
    );
    for flag in [
        "--op",
        "--size",
        "--all",
        "--iters",
        "--warmup",
        "--port",
        "--bind",
        "--iface",
        "--engine",
        "--progress",
        "--verify",
        "--json",
        "--timeout",
    ] {
        assert!(help.contains(flag), "{flag} missing from pingpong --help");
    }
}

#[test]
fn devices_lists_the_lab_cable_and_the_engine_features() {
    let Some((_serial, lab)) = lab("dv") else {
        return;
    };
    let out = in_rank(&lab, 0, &["devices", "--json"])
        .output()
        .expect("devices");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let cable = lab.interface(0, 1, 0);
    let dev = v["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .find(|d| d["interface"] == cable.as_str())
        .unwrap_or_else(|| panic!("{cable} not listed: {v}"));
    assert_eq!(dev["state"], "up", "{dev}");
    assert_eq!(dev["mtu"].as_u64(), Some(65520), "{dev}");
    assert_eq!(dev["detected_link"], true, "{dev}");
    let addr = format!("{}/", lab.address(0, 1, 0));
    assert!(
        dev["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a.as_str().unwrap().starts_with(&addr)),
        "{dev}"
    );
    assert!(
        v["kernel"]["features"]["io_uring"]["available"].is_boolean(),
        "{v}"
    );
    let text_out = in_rank(&lab, 0, &["devices"]).output().expect("devices");
    let listing = text(&text_out.stdout);
    assert!(
        listing.contains(&cable) && listing.contains("engine on these links"),
        "{listing}"
    );
}
