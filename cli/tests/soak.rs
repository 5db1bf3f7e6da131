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
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "soak failed:\n{stdout}\n{stderr}");
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
    assert_eq!(engine["passed"], true, "{engine}");
    assert_eq!(engine["killed_and_restarted"], true, "{engine}");
    assert_eq!(engine["rail_pulled"], true, "{engine}");
    let (client, server) = (&engine["client"], &engine["server"]);
    assert!(num(client, &["operations"]) > 0, "{client}");
    assert!(num(server, &["operations"]) > 0, "{server}");
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
    assert!(engine["kill_to_error_ms"].is_u64(), "{engine}");
    // Every kind of fault asked for really happened, in both processes.
    for side in [client, server] {
        for fault in ["dropped", "duplicated", "corrupted", "reordered"] {
            assert!(num(side, &["faults", fault]) > 0, "{fault}: {side}");
        }
    }
    // Memory was judged at the end of both sides.
    assert_eq!(client["memory_flat"], true, "{client}");
    assert!(num(client, &["memory_end", "rss_kib"]) > 0, "{client}");
}
