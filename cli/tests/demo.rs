//! `tbrdma demo` as a user runs it: the README's run command must keep working.

use std::process::Command;

fn tbrdma_bin() -> &'static str {
    env!("CARGO_BIN_EXE_tbrdma")
}

#[test]
fn demo_verifies_a_lossy_run() {
    let out = Command::new(tbrdma_bin())
        .args(["demo", "--sim", "--seed", "3"])
        .output()
        .expect("run tbrdma demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("verified: every byte"), "{stdout}");
    assert!(
        stdout.contains("RetryExceeded"),
        "pulling the cable must fail the outstanding writes:\n{stdout}"
    );
    // The lossy link really lost and corrupted traffic, and the protocol really recovered.
    let lost: u64 = stdout
        .split("datagrams offered, ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("a loss count");
    assert!(lost > 0, "{stdout}");
}

#[test]
fn demo_rejects_an_impossible_loss_rate_with_a_fix() {
    let out = Command::new(tbrdma_bin())
        .args(["demo", "--sim", "--loss", "2"])
        .output()
        .expect("run tbrdma demo");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--loss 2 is out of range") && stderr.contains("from 0 to 0.5"),
        "{stderr}"
    );
}
