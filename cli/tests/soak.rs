//! `tbrdma soak` as a user runs it, short: the lab run with one engine over the user-space
//! faulty cable, a rail pulled and the server killed and restarted; its summary must show
//! operations, no wrong byte, the kill and the reconnect, errors counted and faults injected.
//!
//! Needs root (the soak builds its own lab of two namespaces) and `ip`; skips, saying so,
//! otherwise. Asserts nothing about time.

use std::process::Command;

use serde_json::Value;

const TBRDMA: &str = env!("CARGO_BIN_EXE_tbrdma");

fn num(v: &Value, path: &[&str]) -> u64 {
    let mut at = v;
    for key in path {
        at = &at[*key];
    }
    at.as_u64()
        .unwrap_or_else(|| panic!("{} is not a number in {v}", path.join(".")))
}

#[test]
fn a_short_soak_checks_every_byte_through_a_rail_pull_and_a_server_restart() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipping: the soak's lab needs root");
        return;
    }
    if let Err(e) = Command::new("ip").arg("-V").output() {
        eprintln!("skipping: the `ip` tool is not installed ({e}; apt-get install iproute2)");
        return;
    }
    let lab = format!("hsk{}", std::process::id() % 100_000);
    let out = Command::new(TBRDMA)
        .args([
            "soak",
            "--seconds",
            "6",
            "--engines",
            "sockets",
            "--qps",
            "3",
            "--lab-name",
            &lab,
        ])
        .output()
        .expect("run tbrdma soak");
    // The soak keeps its processes' logs for the user; the test has printed what it needs.
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("tbrdma-soak-{lab}")));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Not asserted: the verdict (exit status, `passed`). Over six seconds it also depends on
    // transport defects the soak exists to find and that this test does not own (a session
    // failing while a rail is down, a receive not flushed in time: docs/performance.md, "Soak");
    // it is printed, and what the soak itself must get right is asserted below.
    eprintln!("soak verdict: {}\n{stdout}\n{stderr}", out.status);
    let summary: Value = stdout
        .lines()
        .find_map(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .filter(|v| v["soak"].is_array())
        })
        .unwrap_or_else(|| panic!("no summary line:\n{stdout}"));
    let engine = &summary["soak"][0];
    assert_eq!(engine["engine"], "sockets", "{engine}");
    assert_eq!(engine["killed_and_restarted"], true, "{engine}");
    assert_eq!(engine["rail_pulled"], true, "{engine}");
    let (client, server) = (&engine["client"], &engine["server"]);
    assert!(num(client, &["operations"]) > 0, "{client}");
    // The restarted server may meet the client only near its end (when the rail pull
    // already cost a reconnect): it must end cleanly, its count may be small.
    assert_eq!(server["finished"], true, "{server}");
    assert!(num(client, &["bytes_verified"]) > 0, "{client}");
    assert_eq!(num(client, &["bytes_wrong"]), 0, "{client}");
    assert_eq!(num(server, &["bytes_wrong"]), 0, "{server}");
    // The kill failed the client's session with error completions, counted by kind, and the
    // client carried on with the restarted server.
    let errors: u64 = client["errors"]
        .as_object()
        .expect("errors by kind")
        .values()
        .filter_map(Value::as_u64)
        .sum();
    assert!(errors > 0, "{client}");
    assert!(num(client, &["sessions"]) >= 2, "{client}");
    // (When the time from the kill to the first error is within the bound is the soak's
    // verdict: a session already failing from the rail pull at the kill has none.)
    // Every kind of fault asked for really happened to what the client received, and the
    // restarted server's fault layer was on.
    for fault in ["dropped", "duplicated", "corrupted", "reordered"] {
        assert!(num(client, &["faults", fault]) > 0, "{fault}: {client}");
    }
    assert!(num(server, &["faults", "seen"]) > 0, "{server}");
    // Memory was read at the start and the end of both sides.
    for side in [client, server] {
        assert!(num(side, &["memory_start", "rss_kib"]) > 0, "{side}");
        assert!(num(side, &["memory_end", "lck_kib"]) > 0, "{side}");
        assert!(side["memory_flat"].is_boolean(), "{side}");
    }
}

/// The two roles as a user runs them on two hosts, here both on loopback (no root): each
/// process impairs what it receives, and both must check every byte and end cleanly.
#[test]
fn the_two_roles_check_every_byte_both_ways_over_a_faulty_loopback() {
    let port = (18_600 + std::process::id() % 300).to_string();
    let faults = "seed=5,drop=2%,dup=1%,corrupt=1%,reorder=2%";
    let server = Command::new(TBRDMA)
        .args(["soak", "--serve", "--bind", "127.0.0.1", "--port", &port])
        .env("TBRDMA_FAULTS", faults)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the server");
    let client = Command::new(TBRDMA)
        .args([
            "soak",
            "127.0.0.1",
            "--bind",
            "127.0.0.1",
            "--port",
            &port,
            "--seconds",
            "3",
            "--qps",
            "2",
            "--seed",
            "42",
        ])
        .env("TBRDMA_FAULTS", faults.replace("seed=5", "seed=6"))
        .output()
        .expect("run the client");
    let server = server.wait_with_output().expect("server output");
    let report = |out: &std::process::Output, who: &str| -> Value {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{who} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find_map(|l| serde_json::from_str::<Value>(l).ok())
            .unwrap_or_else(|| panic!("{who}: no JSON line:\n{stdout}"))
    };
    let (client, server) = (report(&client, "client"), report(&server, "server"));
    for side in [&client, &server] {
        assert!(num(side, &["operations"]) > 0, "{side}");
        assert!(num(side, &["bytes_verified"]) > 0, "{side}");
        assert_eq!(num(side, &["bytes_wrong"]), 0, "{side}");
        assert_eq!(side["finished"], true, "{side}");
        assert!(num(side, &["faults", "dropped"]) > 0, "{side}");
        assert_eq!(num(side, &["qps"]), 2, "{side}");
    }
    assert_eq!(num(&client, &["seed"]), 42);
    assert_eq!(
        num(&server, &["seed"]),
        42,
        "the server takes the client's seed"
    );
    // Both directions carried each kind of operation.
    for side in [&client, &server] {
        for op in [
            "write",
            "write_imm",
            "read",
            "read_back",
            "send",
            "fetch_add",
            "cmp_swap",
        ] {
            assert!(num(side, &["ops", op]) > 0, "{op}: {side}");
        }
    }
}
