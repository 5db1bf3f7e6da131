//! `tbrdma hostfile --from FILE --format mlx|env` through the binary, on the hostfile of a lab
//! pair with two cables (root; skips without it), and its errors on input it cannot use.

use std::process::Command;

use serde_json::Value;
use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

const TBRDMA: &str = env!("CARGO_BIN_EXE_tbrdma");

#[test]
fn the_lab_hostfile_converts_to_mlx_and_per_host_environments() {
    let Some(lab) = Lab::up("h18h", 2, LabTopology::Pair, 2) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let from = tmp.path().join("hostfile.json");
    std::fs::write(&from, lab.hostfile.to_json()).unwrap();

    let mlx_path = tmp.path().join("mlx.json");
    let out = Command::new(TBRDMA)
        .args(["hostfile", "--format", "mlx", "--from"])
        .arg(&from)
        .arg("-o")
        .arg(&mlx_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mlx: Value = serde_json::from_str(&std::fs::read_to_string(&mlx_path).unwrap()).unwrap();
    let hosts = mlx.as_array().unwrap();
    assert_eq!(hosts.len(), 2);
    for (rank, host) in hosts.iter().enumerate() {
        let want: Vec<String> = (0..2)
            .map(|rail| lab.address(rank, 1 - rank, rail).to_string())
            .collect();
        let got: Vec<&str> = host["ips"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(got, want, "rank {rank}");
    }

    // Rank 1's environment, sourced inside rank 1's namespace: VLLM_HOST_IP is local and
    // MASTER_ADDR is routed over the cable the bootstrap variables name.
    let env = tmp.path().join("env.sh");
    let out = Command::new(TBRDMA)
        .args(["hostfile", "--format", "env", "--rank", "1", "--from"])
        .arg(&from)
        .arg("-o")
        .arg(&env)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("ip")
        .args(["netns", "exec", &lab.namespace(1), "sh", "-c"])
        .arg(format!(
            ". '{}' && ip route get \"$MASTER_ADDR\" from \"$VLLM_HOST_IP\" | grep -q \" dev $GLOO_SOCKET_IFNAME \" && echo \"$MASTER_ADDR $TBRDMA_IFACES\"",
            env.display()
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert_eq!(
        line,
        format!(
            "{} {},{}",
            lab.address(0, 1, 0),
            lab.address(1, 0, 0),
            lab.address(1, 0, 1)
        )
    );
}

#[test]
fn env_without_a_rank_and_a_garbage_hostfile_fail_with_a_message() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, b"\x00\xffnot json").unwrap();
    let out = Command::new(TBRDMA)
        .args(["hostfile", "--format", "mlx", "-o", "-", "--from"])
        .arg(&bad)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));

    let good = tmp.path().join("hostfile.json");
    let hf = r#"{"version":1,"topology":{"kind":"single","rails":0},"ranks":[{"rank":0,"host":"a","uuid":"u","links":[]}]}"#;
    std::fs::write(&good, hf).unwrap();
    let out = Command::new(TBRDMA)
        .args(["hostfile", "--format", "env", "-o", "-", "--from"])
        .arg(&good)
        .env_remove("TBRDMA_RANK")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("pass --rank"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
