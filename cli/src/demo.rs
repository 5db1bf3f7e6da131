//! `tbrdma demo`: as root, two namespaces joined by two virtual cables running the
//! perftest-style tools between them (`demo_lab.rs`), then perftest itself over the
//! libibverbs-compatible library when it is installed (`demo_verbs.rs`); with `--sim` (or without root), two
//! endpoints of the protocol core through the simulated lossy link, reporting every completion,
//! what the link did to the traffic, how the protocol recovered, and whether memory ended up
//! right.

#[path = "demo_lab.rs"]
mod lab;
#[path = "demo_verbs.rs"]
mod verbs;

use std::time::Duration;

use anyhow::{Context, bail};
use tbrdma_proto::sim::{LinkConfig, Pair, PairConfig};
use tbrdma_proto::{
    Access, Config, ConnectionState, RecvWr, Region, RemoteAddr, SendOp, SendWr, Sge, WcStatus,
    WorkCompletion,
};

/// Options of `tbrdma demo`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  sudo tbrdma demo\n  tbrdma demo --sim --loss 0.05 --corrupt 0.01 --seed 7"
)]
pub struct DemoArgs {
    /// Run the protocol core over a simulated lossy link instead of a namespace lab (the
    /// default without root).
    #[arg(long)]
    sim: bool,
    /// Probability that the link loses a datagram.
    #[arg(long, default_value_t = 0.05)]
    loss: f64,
    /// Probability that the link delivers a datagram twice.
    #[arg(long, default_value_t = 0.02)]
    duplicate: f64,
    /// Probability that the link flips bits in a datagram.
    #[arg(long, default_value_t = 0.01)]
    corrupt: f64,
    /// Random extra delay per datagram, in microseconds (reorders traffic).
    #[arg(long, default_value_t = 20)]
    jitter_us: u64,
    /// Seed of the simulation: the same seed replays the same run.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

const MIB: usize = 1 << 20;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(131).wrapping_add(seed))
        .collect()
}

fn sge(region: &Region, offset: usize, len: usize) -> Sge {
    Sge {
        addr: region.addr + offset as u64,
        len: len as u64,
        lkey: region.lkey,
    }
}

fn remote(region: &Region, offset: usize) -> RemoteAddr {
    RemoteAddr {
        addr: region.addr + offset as u64,
        rkey: region.rkey,
    }
}

fn describe(wc: &WorkCompletion) -> String {
    let imm = wc.imm.map(|i| format!(" imm={i:#x}")).unwrap_or_default();
    format!(
        "wr {:>3} {:?} {:?} {} bytes{imm}",
        wc.wr_id, wc.opcode, wc.status, wc.byte_len
    )
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.sim {
        return run_sim(args);
    }
    if !nix::unistd::Uid::effective().is_root() {
        println!(
            "(not root: the two-namespace demo needs root, so this is the simulated one; `sudo tbrdma demo` for the real thing)\n"
        );
        return run_sim(args);
    }
    lab::run()
}

/// The protocol core over the simulated lossy link.
fn run_sim(args: DemoArgs) -> anyhow::Result<()> {
    for (name, p) in [
        ("--loss", args.loss),
        ("--duplicate", args.duplicate),
        ("--corrupt", args.corrupt),
    ] {
        if !(0.0..0.5).contains(&p) {
            bail!("{name} {p} is out of range: give a probability from 0 to 0.5 (0.05 means 5 %)");
        }
    }
    let link = LinkConfig {
        loss: args.loss,
        duplicate: args.duplicate,
        corrupt: args.corrupt,
        jitter: Duration::from_micros(args.jitter_us),
        ..LinkConfig::default()
    };
    println!("tbrdma demo: two endpoints of the protocol core over a simulated 10 Gbit/s cable");
    println!(
        "link: {:.0}% loss, {:.0}% duplication, {:.0}% corruption, up to {} µs jitter, seed {}",
        args.loss * 100.0,
        args.duplicate * 100.0,
        args.corrupt * 100.0,
        args.jitter_us,
        args.seed
    );
    let config = Config {
        max_retries: 12,
        // A simulated cable corrupts without the CRC a real link checks, so the payloads
        // carry tbrdma's own (docs/wire-format.md, "What the CRC covers").
        data_digest: args.corrupt > 0.0,
        ..Config::default()
    };
    let mut p = Pair::new(PairConfig {
        seed: args.seed,
        config_a: config.clone(),
        config_b: config,
        link,
    });
    if p.a.conn.state() != ConnectionState::Established {
        bail!("the simulated handshake failed at this loss rate: lower --loss or --corrupt");
    }
    println!(
        "connected: payload {} bytes per datagram\n",
        p.a.conn.max_payload()
    );

    // Host A owns a source buffer; host B exposes a region for one-sided access.
    let rw =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let a_src = p.a.mem.alloc(4 * MIB, Access::LOCAL_WRITE);
    let a_dst = p.a.mem.alloc(4 * MIB, Access::LOCAL_WRITE);
    let b_region = p.b.mem.alloc(4 * MIB + 64, rw);
    let b_recv = p.b.mem.alloc(64 * 1024, Access::LOCAL_WRITE);
    let data = pattern(4 * MIB, 7);
    p.a.mem.fill(&a_src, 0, &data);

    p.b.post_recv(RecvWr {
        wr_id: 100,
        local: sge(&b_recv, 0, 64 * 1024),
    })?;
    let counter = 4 * MIB;
    let mut wrs = vec![
        SendWr {
            wr_id: 1,
            local: sge(&a_src, 0, 4 * MIB),
            op: SendOp::Write {
                remote: remote(&b_region, 0),
            },
        },
        SendWr {
            wr_id: 2,
            local: sge(&a_dst, 0, 4 * MIB),
            op: SendOp::Read {
                remote: remote(&b_region, 0),
            },
        },
        SendWr {
            wr_id: 3,
            local: sge(&a_src, 0, 40_000),
            op: SendOp::Send { imm: Some(0xcafe) },
        },
    ];
    for i in 0..100 {
        wrs.push(SendWr {
            wr_id: 10 + i,
            local: sge(&a_dst, 8 * i as usize, 8),
            op: SendOp::FetchAdd {
                remote: remote(&b_region, counter),
                add: 1,
            },
        });
    }
    let posted = wrs.len();
    for wr in wrs {
        p.a.post_send(wr).context("posting a work request")?;
    }
    println!(
        "posted: WRITE 4 MiB, READ 4 MiB back, SEND 40000 B with immediate, 100 × FETCH_ADD on one counter"
    );
    if !p.drive(50_000_000) {
        bail!(
            "the simulation did not settle within its step bound (a protocol bug: please report it with --seed {})",
            args.seed
        );
    }
    let wcs_a = p.a.take_completions();
    let wcs_b = p.b.take_completions();
    for wc in wcs_a.iter().take(4).chain(wcs_a.last()) {
        println!("  A completed {}", describe(wc));
    }
    println!(
        "  A completed … {} completions in all, in post order",
        wcs_a.len()
    );
    for wc in &wcs_b {
        println!("  B completed {}", describe(wc));
    }

    let mut problems = Vec::new();
    if wcs_a.len() != posted || wcs_a.iter().any(|w| w.status != WcStatus::Success) {
        problems.push("not every request completed successfully".to_string());
    }
    if wcs_a.iter().map(|w| w.wr_id).collect::<Vec<_>>() != {
        let mut ids = vec![1, 2, 3];
        ids.extend(10..110);
        ids
    } {
        problems.push("completions out of post order".to_string());
    }
    if p.b.mem.bytes(&b_region, 0, 4 * MIB) != &data[..] {
        problems.push("B's region differs from what A wrote".to_string());
    }
    if p.a.mem.bytes(&a_dst, 100 * 8, 4 * MIB - 800) != &data[800..] {
        problems.push("the READ brought back different bytes".to_string());
    }
    if p.b.mem.bytes(&b_recv, 0, 40_000) != &data[..40_000] {
        problems.push("the SEND's payload differs".to_string());
    }
    let final_counter = u64::from_le_bytes(p.b.mem.bytes(&b_region, counter, 8).try_into()?);
    if final_counter != 100 {
        problems.push(format!(
            "the counter is {final_counter}, not 100: an atomic ran twice or not at all"
        ));
    }

    let link = p.link_stats();
    let (sa, sb) = (p.a.conn.stats(), p.b.conn.stats());
    println!(
        "\nwhat the link did: {} datagrams offered, {} lost, {} duplicated, {} corrupted",
        link.sent, link.lost, link.duplicated, link.corrupted
    );
    println!(
        "how the protocol coped: {} retransmissions ({} of them tail loss probes), {} timeouts, {} corrupt datagrams dropped by CRC, {} duplicates suppressed, {} packets placed ahead of a gap",
        sa.retransmits + sb.retransmits,
        sa.tail_probes + sb.tail_probes,
        sa.timeouts + sb.timeouts,
        sa.corrupted + sb.corrupted,
        sa.duplicates + sb.duplicates,
        sa.out_of_order_placed + sb.out_of_order_placed,
    );
    println!("simulated time: {:.3} ms", p.now.as_nanos() as f64 / 1e6);

    // Finally, unplug the cable: everything outstanding must fail, loudly and in bounded time.
    let cut = p.now;
    p.link_config_mut().outages.push((cut, None));
    for i in 0..3 {
        p.a.post_send(SendWr {
            wr_id: 200 + i,
            local: sge(&a_src, 0, MIB),
            op: SendOp::Write {
                remote: remote(&b_region, 0),
            },
        })?;
    }
    p.drive(50_000_000);
    println!("\ncable pulled with 3 WRITEs outstanding:");
    for wc in p.a.take_completions() {
        println!("  A completed {}", describe(&wc));
    }
    println!(
        "  A failed after {:.1} ms (retry budget {:.1} ms): {:?}",
        (p.now - cut).as_secs_f64() * 1e3,
        p.a.conn.retry_budget().as_secs_f64() * 1e3,
        p.a.events.last()
    );

    if problems.is_empty() {
        println!(
            "\nverified: every byte, every completion, exactly-once atomics (counter = {final_counter})"
        );
        Ok(())
    } else {
        bail!("verification failed: {}", problems.join("; "))
    }
}
