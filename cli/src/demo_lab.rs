//! `tbrdma demo` on a virtual lab: two network namespaces joined by two veth "cables", the
//! perftest-style tools run between them exactly as a user runs them on real hosts (each side
//! a separate `tbrdma` process started with `tbrdma lab exec`), then the lab is removed. Last,
//! four namespaces cabled as a ring run an all-reduce across four hosts.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

fn tbrdma_in(lab: &str, rank: usize, args: &[String]) -> anyhow::Result<Command> {
    let exe = std::env::current_exe().context("finding the tbrdma binary")?;
    let mut cmd = Command::new(&exe);
    cmd.args(["lab", "exec", &rank.to_string(), "--name", lab, "--"])
        .arg(&exe)
        .args(args);
    Ok(cmd)
}

fn spawn(mut cmd: Command) -> anyhow::Result<Child> {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting a tbrdma process in the lab")
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Starts `first` (rank 0) and `second` (rank 1), prints the report of `report_rank`, and
/// fails with both sides' errors unless both succeed.
fn run_two(
    lab: &str,
    title: &str,
    first: &[String],
    second: &[String],
    report_rank: usize,
) -> anyhow::Result<()> {
    run_two_with_env(lab, title, first, second, report_rank, &[])
}

/// As [`run_two`], with `env` set in both processes.
fn run_two_with_env(
    lab: &str,
    title: &str,
    first: &[String],
    second: &[String],
    report_rank: usize,
    env: &[(&str, &str)],
) -> anyhow::Result<()> {
    let in_lab = |rank: usize, args: &[String]| -> anyhow::Result<Command> {
        let mut cmd = tbrdma_in(lab, rank, args)?;
        cmd.envs(env.iter().copied());
        Ok(cmd)
    };
    let rank0 = spawn(in_lab(0, first)?)?;
    // A client retries while its server starts listening.
    std::thread::sleep(Duration::from_millis(300));
    let rank1 = spawn(in_lab(1, second)?)?.wait_with_output()?;
    let rank0 = rank0.wait_with_output()?;
    let report = if report_rank == 0 { &rank0 } else { &rank1 };
    print!("{}", String::from_utf8_lossy(&report.stdout));
    if !rank0.status.success() || !rank1.status.success() {
        bail!(
            "{title} failed:\nrank 0: {}\nrank 1: {}",
            String::from_utf8_lossy(&rank0.stderr).trim(),
            String::from_utf8_lossy(&rank1.stderr).trim()
        );
    }
    Ok(())
}

/// One server/client run; prints the client's report.
fn run_pair(
    lab: &str,
    title: &str,
    server: Vec<String>,
    client: Vec<String>,
) -> anyhow::Result<()> {
    println!("\n== {title}");
    println!("   rank 0: tbrdma {}", server.join(" "));
    println!("   rank 1: tbrdma {}", client.join(" "));
    run_two(lab, title, &server, &client, 1)
}

/// Runs the lab demo.
pub fn run() -> anyhow::Result<()> {
    let name = format!("demo{}", std::process::id() % 10_000);
    println!(
        "tbrdma demo: two hosts as network namespaces, joined by two virtual cables (veth, MTU 65520)"
    );
    let (_guard, hostfile) = crate::lab_pair::up(&name)?;
    let addr = |rank: usize, rail: u32| {
        hostfile.ranks[rank]
            .links
            .iter()
            .find(|l| l.rail == rail)
            .map(|l| l.address.to_string())
            .unwrap_or_default()
    };
    println!(
        "lab {name}: hostfile {}",
        tbrdma_netdev::lab::hostfile_path(&name).display()
    );
    println!("   rank 0 cables: {} and {}", addr(0, 0), addr(0, 1));
    println!("   rank 1 cables: {} and {}", addr(1, 0), addr(1, 1));
    let (s0, c0) = (addr(0, 0), addr(1, 0));
    // Each size also runs the kernel's floor on the same cable in turn with tbrdma
    // (`--paired-with`), and says how far above it tbrdma is.
    let sizes = [
        "--size",
        "8",
        "--size",
        "4096",
        "--size",
        "65536",
        "--paired-with",
        "floor",
    ];
    for op in ["write", "send"] {
        let mut server = strings(&[
            "pingpong", "--bind", &s0, "--op", op, "--iters", "2000", "--verify",
        ]);
        server.extend(strings(&sizes));
        let mut client = strings(&[
            "pingpong", &s0, "--bind", &c0, "--op", op, "--iters", "2000", "--verify",
        ]);
        client.extend(strings(&sizes));
        run_pair(
            &name,
            &format!(
                "ping-pong, {op}, one-way latency in µs (like ib_{op}_lat), against the raw-frame floor on the same cable (the packet engine, the default)"
            ),
            server,
            client,
        )?;
    }
    // Hosts may differ: rank 1 runs the sockets engine, as a host without root falls back to,
    // and rank 0's packet engine sends it UDP (docs/verbs.md, "Frames where they reach").
    run_pair(
        &name,
        "ping-pong between a packet-engine host and one on UDP (as a host without root): the packet end sends it UDP",
        strings(&[
            "pingpong", "--bind", &s0, "--iters", "2000", "--verify", "--size", "8", "--size",
            "4096",
        ]),
        strings(&[
            "pingpong", &s0, "--bind", &c0, "--engine", "sockets", "--iters", "2000", "--verify",
            "--size", "8", "--size", "4096",
        ]),
    )?;
    for (op, title, paired) in [
        (
            "write",
            "bandwidth, 1 MiB RDMA WRITEs (like ib_write_bw), against one TCP stream on the same cable",
            &["--paired-with", "tcp"][..],
        ),
        (
            "send",
            "bandwidth, 1 MiB SENDs, each checked through the CRC-32C the engine built from its datagrams",
            &[][..],
        ),
    ] {
        let common = [
            "--op",
            op,
            "--size",
            "1048576",
            "--duration",
            "2",
            "--verify",
        ];
        let mut server = strings(&["bw", "--bind", &s0]);
        server.extend(strings(&common));
        server.extend(strings(paired));
        let mut client = strings(&["bw", &s0, "--bind", &c0]);
        client.extend(strings(&common));
        client.extend(strings(paired));
        run_pair(&name, title, server, client)?;
    }
    run_allreduce(&name)?;
    run_lossy_allreduce(&name)?;
    run_ring_of_four(&format!("{name}r"))?;
    super::verbs::run(&name, &hostfile)?;
    println!("\nevery tbrdma run above verified its results end to end");
    Ok(())
}

/// Both ranks run `tbrdma allreduce` (rank and hostfile come from `lab exec`); rank 0 reports.
fn run_allreduce(lab: &str) -> anyhow::Result<()> {
    let args = strings(&[
        "allreduce",
        "-b",
        "8",
        "-e",
        "1M",
        "-f",
        "8",
        "-d",
        "bf16",
        "--check",
    ]);
    println!(
        "\n== all-reduce of bf16 across both hosts, over both cables (like nccl-tests all_reduce_perf)"
    );
    println!("   ranks 0 and 1: tbrdma {}", args.join(" "));
    run_two(lab, "the all-reduce", &args, &args, 0)
}

/// Four hosts cabled as a ring (a second lab): the 16 KiB bf16 all-reduce of a 70B model's
/// decode step, in place as frameworks call it and checked, by recursive doubling (two
/// exchanges) and by the ring algorithm (six hops); rank 0 reports each.
fn run_ring_of_four(lab: &str) -> anyhow::Result<()> {
    println!(
        "\n== four hosts cabled as a ring (lab {lab}): a 16 KiB bf16 all-reduce in place, by recursive doubling (two exchanges), then by the ring algorithm (six hops)"
    );
    let _guard = crate::lab_pair::up_ring_of_four(lab)?;
    for algo in ["doubling", "ring"] {
        let args = strings(&[
            "allreduce",
            "-b",
            "16K",
            "-e",
            "16K",
            "-n",
            "2000",
            "-d",
            "bf16",
            "--in-place",
            "--check",
            "--algo",
            algo,
        ]);
        println!("   ranks 0 to 3: tbrdma {}", args.join(" "));
        let others = (1..4)
            .map(|rank| spawn(tbrdma_in(lab, rank, &args)?))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let rank0 = spawn(tbrdma_in(lab, 0, &args)?)?.wait_with_output()?;
        let mut failed = Vec::new();
        for (k, child) in others.into_iter().enumerate() {
            let out = child.wait_with_output()?;
            if !out.status.success() {
                failed.push(format!(
                    "rank {}: {}",
                    k + 1,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        print!("{}", String::from_utf8_lossy(&rank0.stdout));
        if !rank0.status.success() {
            failed.insert(
                0,
                format!("rank 0: {}", String::from_utf8_lossy(&rank0.stderr).trim()),
            );
        }
        if !failed.is_empty() {
            bail!(
                "the all-reduce on the ring of four ({algo}) failed:\n{}",
                failed.join("\n")
            );
        }
    }
    Ok(())
}

/// A 64 KiB all-reduce while each rank's engine drops 1 % of the datagrams it receives (the
/// engine's user-space faulty cable, `TBRDMA_FAULTS`): the results are still checked, and the
/// report's comment line shows the recovery (tail loss probes repair a lost last datagram in
/// about 2 ms instead of a 20 ms retransmission timeout; docs/semantics.md).
fn run_lossy_allreduce(lab: &str) -> anyhow::Result<()> {
    let args = strings(&[
        "allreduce",
        "-b",
        "64K",
        "-e",
        "64K",
        "-n",
        "1000",
        "--check",
    ]);
    let faults = "drop=1%";
    println!(
        "\n== the same all-reduce at 64 KiB over cables that lose 1 % of the datagrams (mean, median, p99, recovery)"
    );
    println!(
        "   ranks 0 and 1: TBRDMA_FAULTS={faults} tbrdma {}",
        args.join(" ")
    );
    run_two_with_env(
        lab,
        "the lossy all-reduce",
        &args,
        &args,
        0,
        &[("TBRDMA_FAULTS", faults)],
    )
}
