//! `linkbench` runs each tbrdma ping-pong in lockstep with its floor, in the same two processes,
//! and judges it by the blocks' ratios (issue 16): every engine case reports its blocks and a
//! finite ratio, whichever floor its engine has (UDP for sockets, raw frames for packet).

use std::process::Command;

#[test]
fn every_engine_ping_pong_reports_its_ratio_to_the_floor_run_in_lockstep() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipping: linkbench makes network namespaces, which needs root");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_linkbench"))
        .args([
            "--only",
            "send-sockets,write-packet",
            "--rounds",
            "1",
            "--json",
        ])
        .args(["--iters", "40", "--warmup", "5", "--block", "10"])
        .output()
        .expect("linkbench runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "linkbench failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(report["block"].as_u64(), Some(10), "{report}");
    let cases = report["cases"].as_array().expect("a list of cases");
    // Two engine cases at each of the four sizes, and no floor of their own: each pairs itself.
    assert_eq!(cases.len(), 8, "{report}");
    for case in cases {
        assert_eq!(
            case["count"].as_u64(),
            Some(40),
            "every timed round trip: {case}"
        );
        let paired = &case["paired"];
        // 40 round trips in blocks of 10.
        assert_eq!(paired["blocks"].as_u64(), Some(4), "{case}");
        for key in ["floor_p50_ns", "ratio_p50", "ratio_mean"] {
            let value = paired[key].as_f64().unwrap_or(f64::NAN);
            assert!(value.is_finite() && value > 0.0, "{key} in {case}");
        }
    }
    let ratios = report["ratios"].as_array().expect("a list of ratios");
    let judged: Vec<&serde_json::Value> = ratios
        .iter()
        .filter(|r| {
            r["ratio"]
                .as_str()
                .is_some_and(|l| l.ends_with("p50, paired"))
        })
        .collect();
    assert_eq!(judged.len(), 8, "{report}");
    for ratio in judged {
        assert!(
            matches!(ratio["verdict"].as_str(), Some("PASS" | "MISS")),
            "{ratio}"
        );
        let label = ratio["ratio"].as_str().unwrap_or_default();
        let floor = if label.contains("packet") {
            "frame-busy"
        } else {
            "udp-busy"
        };
        assert!(label.contains(floor), "{label}");
    }
}
