//! `linkbench`'s raw-frame floor in a lab it has just made: its first frame meets a neighbour
//! table with no entry for the peer and is dropped, and the floor must get past that by itself
//! (it used to fail its first size after 10 s of waiting).

use std::process::Command;

#[test]
fn the_frame_floor_survives_its_first_frame_being_dropped_in_a_fresh_lab() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipping: linkbench makes network namespaces, which needs root");
        return;
    }
    let iters = 30;
    let out = Command::new(env!("CARGO_BIN_EXE_linkbench"))
        .args(["--only", "frame-busy", "--rounds", "1", "--json"])
        .args(["--iters", &iters.to_string(), "--warmup", "5"])
        .output()
        .expect("linkbench runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "linkbench failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let cases = report["cases"].as_array().expect("a list of cases");
    let sizes: Vec<u64> = cases.iter().filter_map(|c| c["size"].as_u64()).collect();
    assert_eq!(sizes, [8, 4096, 16_384, 65_536], "{report}");
    for case in cases {
        assert_eq!(
            case["count"].as_u64(),
            Some(iters),
            "every round trip measured: {case}"
        );
        assert!(case["p50_ns"].as_u64().is_some_and(|p| p > 0), "{case}");
    }
}
