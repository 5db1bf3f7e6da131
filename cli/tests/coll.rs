//! `tbrdma allreduce` (with its baselines), `allgather`, `reducescatter`, `broadcast` and
//! `tp-bench` as a user runs them: the same command in both ranks of a lab pair (`lab exec` sets
//! the hostfile and the rank), `--check` verifying every iteration, `--json` parsed and checked
//! for the nccl-tests keys and sane numbers, and a wrong transport named with the choices.
//!
//! Needs root for the lab (skips, saying so, without it). Never asserts on timing; one pair of
//! busy-polling ranks at a time, since the machine may have only 2 cores.

use std::process::{Command, Output};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU16, Ordering};

use serde_json::Value;
use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

const TBRDMA: &str = env!("CARGO_BIN_EXE_tbrdma");

/// A JSON all-reduce of 16 KiB, the start of most commands here.
const ALLREDUCE_16K: [&str; 6] = ["allreduce", "-b", "16K", "-e", "16K", "--json"];

/// One pair of busy-polling ranks at a time.
static SERIAL: Mutex<()> = Mutex::new(());
/// Fresh connection-manager ports per run (each run uses a few from its base).
static PORT: AtomicU16 = AtomicU16::new(21_000);

fn lab(tag: &str) -> Option<(std::sync::MutexGuard<'static, ()>, Lab)> {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Lab::up(tag, 2, LabTopology::Pair, 1).map(|lab| (serial, lab))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `args` in both ranks at once (each with the same fresh `--port`); returns both outputs.
fn both(lab: &Lab, args: &[&str]) -> [Output; 2] {
    both_with_env(lab, args, &[])
}

/// [`both`], with `env` set for both ranks.
fn both_with_env(lab: &Lab, args: &[&str], env: &[(&str, &str)]) -> [Output; 2] {
    let port = PORT.fetch_add(50, Ordering::Relaxed).to_string();
    let spawn = |rank: usize| {
        Command::new(TBRDMA)
            .args(["lab", "exec", "--name", &lab.name, &rank.to_string(), "--"])
            .arg(TBRDMA)
            .args(args)
            .args(["--port", &port])
            .envs(env.iter().copied())
            .output()
    };
    let (r0, r1) = std::thread::scope(|s| {
        let one = s.spawn(|| spawn(1));
        let zero = spawn(0);
        (zero, one.join().expect("rank 1's thread"))
    });
    [r0.expect("run rank 0"), r1.expect("run rank 1")]
}

/// Both ranks succeeded; rank 0's stdout lines parsed as JSON (rank 1 prints nothing).
fn rows(outs: &[Output; 2], what: &str) -> Vec<Value> {
    for (rank, out) in outs.iter().enumerate() {
        assert!(
            out.status.success(),
            "{what}: rank {rank} failed:\n{}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
    assert!(
        text(&outs[1].stdout).trim().is_empty(),
        "{what}: only rank 0 reports: {}",
        text(&outs[1].stdout)
    );
    text(&outs[0].stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {l}")))
        .collect()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

/// An nccl-tests row: the keys the issue names, for `size` bytes of `dtype`, nothing wrong.
fn check_row(v: &Value, size: u64, dtype: &str, redop: &str) {
    let width = match dtype {
        "f32" | "i32" => 4,
        "bf16" | "f16" => 2,
        _ => 8,
    };
    assert_eq!(v["size"].as_u64(), Some(size), "{v}");
    assert_eq!(v["count"].as_u64(), Some(size / width), "{v}");
    assert_eq!(v["type"], dtype, "{v}");
    assert_eq!(v["redop"], redop, "{v}");
    assert_eq!(v["wrong"].as_u64(), Some(0), "{v}");
    let (time, median) = (num(v, "time_us"), num(v, "time_us_median"));
    assert!(time > 0.0 && median > 0.0, "{v}");
    if let Some(p99) = v["time_us_p99"].as_f64() {
        assert!(p99 >= median, "{v}");
    }
    let (alg, bus) = (num(v, "algbw_gbs"), num(v, "busbw_gbs"));
    assert!(alg > 0.0 && bus > 0.0, "{v}");
}

#[test]
fn allreduce_sweeps_sizes_checks_every_iteration_and_prints_nccl_tests_rows() {
    let Some((_serial, lab)) = lab("callred") else {
        return;
    };
    let args = [
        "allreduce",
        "-b",
        "8",
        "-e",
        "64K",
        "-f",
        "32",
        "-d",
        "bf16",
        "-o",
        "max",
        "--check",
        "--json",
        "-n",
        "5",
        "-w",
        "1",
    ];
    let rows = rows(&both(&lab, &args), "allreduce");
    let sizes: Vec<u64> = rows.iter().filter_map(|v| v["size"].as_u64()).collect();
    assert_eq!(sizes, [8, 256, 8192], "-b 8 -e 64K -f 32");
    for (v, size) in rows.iter().zip(sizes) {
        check_row(v, size, "bf16", "max");
        // Two ranks: bus bandwidth = algorithm bandwidth × 2(n-1)/n = × 1.
        assert!(
            (num(v, "busbw_gbs") - num(v, "algbw_gbs")).abs() < 1e-9,
            "{v}"
        );
    }
    // The table form: the header, a row and its median line.
    let out = both(&lab, &["allreduce", "-b", "4K", "-e", "4K", "-n", "5"]);
    let table = text(&out[0].stdout);
    assert!(
        out[0].status.success() && out[1].status.success(),
        "{table}"
    );
    assert!(
        table.contains("busbw(GB/s)") && table.contains("#wrong"),
        "{table}"
    );
    assert!(table.contains("#   median per call"), "{table}");
    // As root (the lab needs it) the default engine is the packet engine.
    assert!(table.contains(", packet engine,"), "{table}");
}

/// `--in-place`, as frameworks call the all-reduce: every call checked (the buffer is refilled
/// before each), and the row says it ran in place; refused where it means nothing.
#[test]
fn allreduce_in_place_checks_every_call() {
    let Some((_serial, lab)) = lab("cinpl") else {
        return;
    };
    let args = [
        "allreduce",
        "-b",
        "16K",
        "-e",
        "16K",
        "-d",
        "f32,bf16",
        "--in-place",
        "--check",
        "--json",
        "-n",
        "50",
        "-w",
        "2",
    ];
    let rows = rows(&both(&lab, &args), "allreduce --in-place");
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (v, dtype) in rows.iter().zip(["f32", "bf16"]) {
        check_row(v, 16384, dtype, "sum");
        assert_eq!(v["in_place"], Value::Bool(true), "{v}");
    }
    let tcp = both(&lab, &["allreduce", "--in-place", "--transport", "tcp"]);
    assert!(!tcp[0].status.success(), "--in-place with the TCP ring");
    assert!(
        text(&tcp[0].stderr).contains("--in-place: tbrdma only"),
        "{}",
        text(&tcp[0].stderr)
    );
}

/// Every tbrdma row counts the loss recovery of its timed calls: none where nothing was lost is
/// not asserted (a slow poll may time out), but losses the fault layer makes must show.
#[test]
fn allreduce_rows_count_the_retransmissions_that_loss_causes() {
    let Some((_serial, lab)) = lab("crecov") else {
        return;
    };
    let one_size = ["allreduce", "-b", "64K", "-e", "64K", "--check", "--json"];
    let args = [&one_size[..], &["-n", "40", "-w", "2"]].concat();
    let lossy = rows(
        &both_with_env(&lab, &args, &[("TBRDMA_FAULTS", "drop=10%,seed=7")]),
        "allreduce with 10% loss",
    );
    assert_eq!(lossy.len(), 1);
    check_row(&lossy[0], 65536, "f32", "sum");
    let recovery = &lossy[0]["recovery"];
    let count = |key: &str| recovery[key].as_u64();
    // A 64 KiB all-reduce is a message of two datagrams each way: at 10 % loss about one call
    // in four loses a last datagram, which the tail loss probe repairs.
    assert!(
        count("retransmits").is_some_and(|n| n > 0)
            && count("tail_probes").is_some_and(|n| n > 0)
            && count("tail_probes") <= count("retransmits")
            && count("timeouts").is_some(),
        "{}",
        lossy[0]
    );
    // The baselines have no such counters.
    let tcp = [&args[..], &["--transport", "tcp"]].concat();
    let rows_tcp = rows(&both(&lab, &tcp), "tcp ring");
    assert!(rows_tcp[0].get("recovery").is_none(), "{}", rows_tcp[0]);
    assert!(num(&rows_tcp[0], "time_us_p99") > 0.0, "{}", rows_tcp[0]);
    // With compute between the calls (a spin that first writes 1 MiB), both still check out,
    // and the gap stays outside the timed region: timed with it, every call would take at least
    // the 50 ms gap; without it a 64 KiB call takes microseconds, and about 5 ms on a 2-core
    // host whose cores two other busy processes share (measured), so the bound has a margin
    // of ten.
    let gap = [
        "-n",
        "10",
        "-w",
        "1",
        "--gap-us",
        "50000",
        "--gap-touch-mib",
        "1",
    ];
    for (what, transport) in [
        ("tbrdma with gaps", "tbrdma"),
        ("tcp ring with gaps", "tcp"),
    ] {
        let gapped = [&one_size[..], &gap[..], &["--transport", transport]].concat();
        let row = &rows(&both(&lab, &gapped), what)[0];
        check_row(row, 65536, "f32", "sum");
        assert!(num(row, "time_us_median") < 50_000.0, "{what}: {row}");
    }
}

#[test]
fn the_tcp_ring_and_udp_baselines_run_over_the_same_cable() {
    let Some((_serial, lab)) = lab("cbase") else {
        return;
    };
    let common = [&ALLREDUCE_16K[..], &["-n", "20", "-w", "2"]].concat();
    let tcp = [&common[..], &["--transport", "tcp", "--check", "-d", "f16"]].concat();
    let rows_tcp = rows(&both(&lab, &tcp), "tcp ring");
    assert_eq!(rows_tcp.len(), 1);
    check_row(&rows_tcp[0], 16384, "f16", "sum");
    for floor in ["udp-floor", "udp-exchange"] {
        let args = [&common[..], &["--transport", floor]].concat();
        let rows = rows(&both(&lab, &args), floor);
        assert_eq!(rows.len(), 1, "{floor}");
        check_row(&rows[0], 16384, "f32", "sum");
    }
    // The exchange floor takes the same compute between its exchanges as the all-reduces do
    // (20 exchanges after 50 ms stretches: at least 1 s), outside what it times.
    let gapped = [
        &common[..],
        &["--transport", "udp-exchange", "--gap-us", "50000"],
    ]
    .concat();
    let started = std::time::Instant::now();
    let gapped_rows = rows(&both(&lab, &gapped), "udp-exchange with gaps");
    assert!(started.elapsed() >= std::time::Duration::from_secs(1));
    let row = &gapped_rows[0];
    assert!(num(row, "time_us_median") < 50_000.0, "{row}");
    // A transport that does not exist is named, with the choices.
    let out = both(
        &lab,
        &[&common[..], &["--transport", "carrier-pigeon"]].concat(),
    );
    let err = text(&out[0].stderr);
    assert!(!out[0].status.success(), "{err}");
    assert!(
        err.contains("carrier-pigeon") && err.contains("udp-exchange"),
        "{err}"
    );
}

/// `--paired-with udp-exchange` times tbrdma's all-reduce in blocks between blocks of the
/// exchange, in the same processes over the same cable, and reports both and their ratios
/// block by block; every call is still checked. Any other baseline is refused by name.
#[test]
fn allreduce_paired_with_the_udp_exchange_reports_both_block_by_block() {
    let Some((_serial, lab)) = lab("cpair") else {
        return;
    };
    let plain = [&ALLREDUCE_16K[..], &["--check", "-n", "230", "-w", "5"]].concat();
    let args = [
        &plain[..],
        &["--paired-with", "udp-exchange", "--block", "50"],
    ]
    .concat();
    let got = rows(&both(&lab, &args), "paired all-reduce");
    assert_eq!(got.len(), 1);
    let row = &got[0];
    check_row(row, 16384, "f32", "sum");
    let paired = &row["paired"];
    assert_eq!(paired["baseline"], "udp-exchange", "{row}");
    // 230 calls in blocks of 50: four full blocks and one of 30.
    assert_eq!(paired["blocks"].as_u64(), Some(5), "{row}");
    assert_eq!(paired["block"].as_u64(), Some(50), "{row}");
    for key in ["baseline_us", "ratio_mean", "ratio_median"] {
        let v = num(paired, key);
        assert!(v.is_finite() && v > 0.0, "{key} in {row}");
    }
    // Without the option there is no pairing in the row.
    let plain = rows(&both(&lab, &plain), "plain all-reduce");
    assert!(plain[0].get("paired").is_none(), "{}", plain[0]);
    // Only the exchange can be paired.
    let mut tcp = args.clone();
    let at = tcp
        .iter()
        .position(|&a| a == "udp-exchange")
        .expect("the baseline");
    tcp[at] = "tcp";
    let out = both(&lab, &tcp);
    let err = text(&out[0].stderr);
    assert!(!out[0].status.success(), "{err}");
    assert!(
        err.contains("--paired-with") && err.contains("udp-exchange"),
        "{err}"
    );
}

#[test]
fn the_other_collectives_and_tp_bench_report_what_they_measured() {
    let Some((_serial, lab)) = lab("cother") else {
        return;
    };
    for tool in ["allgather", "reducescatter", "broadcast"] {
        let args = [
            tool, "-b", "4K", "-e", "4K", "-d", "f32", "--check", "--json", "-n", "5",
        ];
        let rows = rows(&both(&lab, &args), tool);
        assert_eq!(rows.len(), 1, "{tool}");
        let redop = if tool == "reducescatter" {
            "sum"
        } else {
            "none"
        };
        assert_eq!(rows[0]["wrong"].as_u64(), Some(0), "{tool}: {}", rows[0]);
        assert_eq!(rows[0]["redop"], redop, "{tool}: {}", rows[0]);
        assert!(num(&rows[0], "time_us") > 0.0, "{tool}: {}", rows[0]);
    }
    let args = [
        "tp-bench", "--hidden", "1024", "--layers", "4", "--tokens", "3", "--dtype", "bf16",
        "--json",
    ];
    let tp_rows = rows(&both(&lab, &args), "tp-bench");
    assert_eq!(tp_rows.len(), 1);
    let v = &tp_rows[0];
    assert_eq!(v["ranks"].as_u64(), Some(2), "{v}");
    // 1024 bf16 values per all-reduce, two all-reduces per layer.
    assert_eq!(v["bytes_per_allreduce"].as_u64(), Some(2048), "{v}");
    assert_eq!(v["allreduces_per_token"].as_u64(), Some(8), "{v}");
    let mean = num(v, "allreduce_us_mean");
    assert!(
        mean > 0.0 && num(v, "allreduce_us_p99") >= num(v, "allreduce_us_median"),
        "{v}"
    );
    // The ceiling is what the communication time per token allows, no more.
    let per_token_s = num(v, "comm_ms_per_token") / 1e3;
    assert!(
        (num(v, "tokens_per_s_ceiling") * per_token_s - 1.0).abs() < 1e-6,
        "{v}"
    );
    assert!(num(v, "token_ms") > 0.0, "{v}");
    // With 25 ms of compute before each of the 8 all-reduces a token takes at least 200 ms, the
    // all-reduces themselves are timed without it, and tokens/s is what the step time allows.
    // (A timed all-reduce still waits for the peer's compute to end: with two other busy
    // processes on the 2 cores their median was 2.4 ms after 2 ms of compute, hence the long
    // compute and the bound's margin.)
    let computed = [
        &args[..],
        &["--compute-us", "25000", "--compute-touch-mib", "1"],
    ]
    .concat();
    let computed_rows = rows(&both(&lab, &computed), "tp-bench with compute");
    let v = &computed_rows[0];
    assert_eq!(v["compute_us_per_allreduce"].as_u64(), Some(25_000), "{v}");
    assert!(num(v, "token_ms") >= 200.0, "{v}");
    assert!(num(v, "allreduce_us_median") < 25_000.0, "{v}");
    assert!(
        (num(v, "tokens_per_s") * num(v, "token_ms") / 1e3 - 1.0).abs() < 1e-6,
        "{v}"
    );
}
