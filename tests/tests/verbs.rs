//! The verbs API between two processes in two network namespaces joined by a veth pair
//! (MTU 65520), as a user runs it: every operation with data checked by hash, sizes from 1 B to
//! 16 MiB, 64 outstanding requests, protection violations, a killed peer, the memlock error.
//! The sockets and io_uring engines run the same suite (the packet engine's multi-process tests
//! are in `collectives.rs`). Needs root (skips otherwise).

use std::io::{BufRead, BufReader};
use std::sync::Mutex;

use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::{Lab, finish};

const PEER: &str = env!("CARGO_BIN_EXE_tbrdma-test-peer");
const PORT: u16 = 18_700;

/// One pair of busy-polling processes at a time: the machine may have only 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn args(pairs: &[(&str, String)]) -> Vec<String> {
    pairs.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// Runs server (rank 0) and client (rank 1) and returns their outputs.
fn run_pair(
    lab: &Lab,
    scenario: &str,
    engine: &str,
    progress: &str,
    extra: &[(&str, String)],
) -> ((bool, String, String), (bool, String, String)) {
    run_sides(lab, scenario, engine, (1, engine), progress, extra)
}

/// Runs a server on rank 0 with `server_engine` and a client on `client_rank` (its namespace
/// and its address towards rank 0, or rank 0's own) with its engine.
fn run_sides(
    lab: &Lab,
    scenario: &str,
    server_engine: &str,
    (client_rank, client_engine): (usize, &str),
    progress: &str,
    extra: &[(&str, String)],
) -> ((bool, String, String), (bool, String, String)) {
    let (engine, server_ip) = (server_engine, lab.address(0, 1, 0));
    let client_ip = match client_rank {
        0 => server_ip,
        rank => lab.address(rank, 0, 0),
    };
    let mut server_args = vec![
        ("role", "server".to_string()),
        ("scenario", scenario.to_string()),
        ("ip", server_ip.to_string()),
        ("port", PORT.to_string()),
        ("engine", engine.to_string()),
        ("progress", progress.to_string()),
    ];
    server_args.extend(extra.iter().cloned());
    let mut client_args = vec![
        ("role", "client".to_string()),
        ("scenario", scenario.to_string()),
        ("ip", client_ip.to_string()),
        ("server", format!("{server_ip}:{PORT}")),
        ("engine", client_engine.to_string()),
        ("progress", progress.to_string()),
    ];
    client_args.extend(extra.iter().cloned());
    let server = lab.spawn_peer(PEER, 0, &args(&server_args));
    let client = lab.spawn_peer(PEER, client_rank, &args(&client_args));
    let c = finish(client);
    let s = finish(server);
    (s, c)
}

fn check_ops(engine: &str, progress: &str, tag: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up(tag, 2, LabTopology::Pair, 1) else {
        return;
    };
    let ((s_ok, s_out, s_err), (c_ok, c_out, c_err)) = run_pair(&lab, "ops", engine, progress, &[]);
    assert!(
        c_ok,
        "client failed:\n{c_out}\n{c_err}\nserver:\n{s_out}\n{s_err}"
    );
    assert!(s_ok, "server failed:\n{s_out}\n{s_err}");
    assert!(
        c_out.contains("write+read 16777216 bytes: hash ok"),
        "{c_out}"
    );
    assert!(c_out.contains("all checks passed"), "{c_out}");
    assert!(
        c_out.contains(&format!("engine {engine}")) || c_out.contains("using the sockets engine"),
        "{c_out}"
    );
}

#[test]
fn every_operation_and_size_over_veth_with_the_sockets_engine() {
    check_ops("sockets", "caller", "vs");
}

#[test]
fn every_operation_and_size_over_veth_with_the_uring_engine() {
    check_ops("uring", "caller", "vu");
}

#[test]
fn every_operation_with_a_background_progress_thread() {
    check_ops("sockets", "thread", "vt");
}

/// A packet-engine end and a sockets end, either way round, and two packet-engine ends on the
/// same address of one host: every operation and size, carried over UDP, for frames reach
/// neither (the sockets end hears only UDP; a frame to one's own address would leave the host
/// on the cable). No frame crosses the cable. Skips without root or nftables' egress hook.
#[test]
fn packet_ends_fall_back_to_udp_where_frames_do_not_reach() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("vm", 2, LabTopology::Pair, 1) else {
        return;
    };
    if let Err(why) = lab.watch_frames() {
        println!("skipping: {why}");
        return;
    }
    for (server, client) in [
        ("packet", (1, "sockets")),
        ("sockets", (1, "packet")),
        ("packet", (0, "packet")),
    ] {
        let ((s_ok, s_out, s_err), (c_ok, c_out, c_err)) =
            run_sides(&lab, "ops", server, client, "caller", &[]);
        let case = format!("server {server}, client {client:?}");
        assert!(
            c_ok && s_ok,
            "{case}: client:\n{c_out}\n{c_err}\nserver:\n{s_out}\n{s_err}"
        );
        assert!(c_out.contains("all checks passed"), "{case}: {c_out}");
        for (side, engine, out) in [("server", server, &s_out), ("client", client.1, &c_out)] {
            assert!(
                out.contains(&format!("engine {engine}")),
                "{case}: {side}: {out}"
            );
        }
        assert_eq!(lab.frames_sent(), (0, 0), "{case}: frames on the cable");
    }
}

#[test]
fn remote_access_violations_leave_the_target_untouched() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("va", 2, LabTopology::Pair, 1) else {
        return;
    };
    for engine in ["sockets", "uring"] {
        for violation in ["badkey", "oob", "noflag", "otherconn"] {
            let ((s_ok, s_out, s_err), (c_ok, c_out, c_err)) = run_pair(
                &lab,
                "access",
                engine,
                "caller",
                &[("violation", violation.to_string())],
            );
            assert!(
                c_ok,
                "{engine}/{violation}: client:\n{c_out}\n{c_err}\nserver:\n{s_out}\n{s_err}"
            );
            assert!(s_ok, "{engine}/{violation}: server:\n{s_out}\n{s_err}");
            assert!(c_out.contains("completed with RemoteAccess"), "{c_out}");
            assert!(c_out.contains("post after error: Flushed"), "{c_out}");
            assert!(
                s_out.contains("target untouched") && s_out.contains("read-only region untouched"),
                "{engine}/{violation}: {s_out}"
            );
        }
    }
}

#[test]
fn a_killed_peer_yields_error_completions() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("vk", 2, LabTopology::Pair, 1) else {
        return;
    };
    for engine in ["sockets", "uring"] {
        let server_ip = lab.address(0, 1, 0);
        let common = |role: &str, ip: String| {
            args(&[
                ("role", role.to_string()),
                ("scenario", "kill".to_string()),
                ("ip", ip),
                ("port", PORT.to_string()),
                ("server", format!("{server_ip}:{PORT}")),
                ("engine", engine.to_string()),
                ("progress", "caller".to_string()),
            ])
        };
        let mut server = lab.spawn_peer(PEER, 0, &common("server", server_ip.to_string()));
        let mut client =
            lab.spawn_peer(PEER, 1, &common("client", lab.address(1, 0, 0).to_string()));
        let mut lines = BufReader::new(client.stdout.take().expect("client stdout")).lines();
        let mut seen = Vec::new();
        for line in lines.by_ref() {
            let line = line.expect("client output");
            seen.push(line.clone());
            if line == "streaming" {
                break;
            }
        }
        assert_eq!(
            seen.last().map(String::as_str),
            Some("streaming"),
            "client never streamed: {seen:?}"
        );
        server.kill().expect("kill the server");
        let _ = server.wait();
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let status = client.wait().expect("client exit");
        let mut err = String::new();
        if let Some(mut e) = client.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        assert!(
            status.success(),
            "{engine}: client after the kill:\n{rest:?}\n{err}"
        );
        assert!(
            rest.iter()
                .any(|l| l.starts_with("error completion RetryExceeded")),
            "{rest:?}"
        );
    }
}

#[test]
fn too_little_memlock_names_the_limit_and_the_fix() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("vm", 2, LabTopology::Pair, 1) else {
        return;
    };
    let child = lab.spawn_peer(
        PEER,
        0,
        &args(&[
            ("scenario", "memlock".to_string()),
            ("ip", lab.address(0, 1, 0).to_string()),
            ("engine", "sockets".to_string()),
        ]),
    );
    let (ok, out, err) = finish(child);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("memlock error"), "{out}");
}

#[test]
fn two_rails_stripe_and_survive_one_going_down() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("vr", 2, LabTopology::Pair, 2) else {
        return;
    };
    for engine in ["sockets", "uring"] {
        let ips = |rank: usize| {
            format!(
                "{},{}",
                lab.address(rank, 1 - rank, 0),
                lab.address(rank, 1 - rank, 1)
            )
        };
        let server_ip = lab.address(0, 1, 0);
        let server = lab.spawn_peer(
            PEER,
            0,
            &args(&[
                ("role", "server".to_string()),
                ("scenario", "rails".to_string()),
                ("ip", ips(0)),
                ("port", PORT.to_string()),
                ("engine", engine.to_string()),
            ]),
        );
        let mut client = lab.spawn_peer(
            PEER,
            1,
            &args(&[
                ("role", "client".to_string()),
                ("scenario", "rails".to_string()),
                ("ip", ips(1)),
                ("server", format!("{server_ip}:{PORT}")),
                ("engine", engine.to_string()),
            ]),
        );
        let mut lines = BufReader::new(client.stdout.take().expect("stdout")).lines();
        let mut seen = Vec::new();
        for line in lines.by_ref() {
            let line = line.expect("client output");
            seen.push(line.clone());
            if line.starts_with("streaming") {
                break;
            }
        }
        assert!(
            seen.last().is_some_and(|l| l.starts_with("streaming")),
            "{engine}: client never streamed: {seen:?}"
        );
        // Both rails carried the first write (it is striped): "streaming on 2 rails: [a, b]".
        let counts: Vec<u64> = seen
            .last()
            .and_then(|l| l.split('[').nth(1))
            .map(|l| {
                l.trim_end_matches(']')
                    .split(", ")
                    .filter_map(|n| n.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            counts.len() == 2 && counts.iter().all(|&c| c > 0),
            "{engine}: not striped over both rails: {seen:?}"
        );
        // Pull cable 2 on the client's side, mid-transfer.
        let interface = lab.interface(1, 0, 1);
        let status = std::process::Command::new("ip")
            .args([
                "-n",
                &lab.namespace(1),
                "link",
                "set",
                "dev",
                &interface,
                "down",
            ])
            .status()
            .expect("run ip");
        assert!(status.success(), "taking {interface} down failed");
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let status = client.wait().expect("client exit");
        let mut err = String::new();
        if let Some(mut e) = client.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        let (_, s_out, s_err) = finish(server);
        assert!(
            status.success(),
            "{engine}: {seen:?}\n{rest:?}\n{err}\nserver: {s_out}\n{s_err}"
        );
        assert!(rest.iter().any(|l| l == "target verified"), "{rest:?}");
        let summary = rest
            .iter()
            .find(|l| l.contains("datagrams per rail"))
            .expect("summary");
        assert!(
            !summary.ends_with("rails declared down 0"),
            "rail 2 was never declared down: {summary}"
        );
        // Bring the cable back for the next engine.
        let _ = std::process::Command::new("ip")
            .args([
                "-n",
                &lab.namespace(1),
                "link",
                "set",
                "dev",
                &interface,
                "up",
            ])
            .status();
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

#[test]
fn a_peer_without_a_route_is_reported_unreachable() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("vn", 2, LabTopology::Pair, 1) else {
        return;
    };
    // TEST-NET-3: the namespace has no route to it, so nothing leaves the host.
    let child = lab.spawn_peer(
        PEER,
        1,
        &args(&[
            ("scenario", "unreachable".to_string()),
            ("ip", lab.address(1, 0, 0).to_string()),
            ("server", "203.0.113.1:18700".to_string()),
            ("engine", "sockets".to_string()),
        ]),
    );
    let (ok, out, err) = finish(child);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("cannot reach 203.0.113.1:18700"), "{out}");
}
