//! The collectives test peer: one rank of a multi-process collectives test, run inside its lab
//! namespace.
//!
//! `tbrdma-coll-peer NETNS key=value…` with keys `hostfile` (path), `rank`, `scenario`
//! (`suite`: every operation × type × operator × count against the local reference, printing
//! `passed N`, one `fingerprint …` line per arbitrary-input result and `all checks passed`;
//! `loop`: all-reduces until one fails, printing `looping` once the first succeeded;
//! `relay`: on a ring of 4, an all-reduce, then rank 0 and rank 2 swap messages, and so do
//! rank 3 and rank 1, while the ranks in between call nothing, then an all-reduce again,
//! printing `relay verified` when every message arrived intact),
//! `counts` (comma-separated element counts), `rails` (cables per neighbour to use),
//! `slot_bytes` and `slots` (4096 and 4 unless given: small slots, many chunks),
//! `timeout` (seconds), `engine` (sockets|uring|packet); `rendezvous` (rank 0's ip:port) and `world` meet by rendezvous
//! instead of reading the hostfile. Exits 0 only when every check passed. With the
//! `TBRDMA_FAULTS` environment variable set (the engine's user-space faulty cable) it ends by
//! printing `faults injected: seen=… dropped=…`.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use tbrdma_collectives::check::suite;
use tbrdma_collectives::{CommOptions, Communicator, ReduceOp};

fn run(args: &HashMap<String, String>) -> anyhow::Result<()> {
    let get = |k: &str| args.get(k).ok_or_else(|| anyhow!("missing {k}="));
    let rank: usize = get("rank")?.parse().context("rank")?;
    let number = |k: &str, default: usize| args.get(k).map_or(Ok(default), |v| v.parse());
    let opts = CommOptions {
        // Small slots by default: a few thousand elements already pipeline over many chunks.
        slot_bytes: number("slot_bytes", 4096)?,
        slots: number("slots", 4)?,
        one_shot_max: 2048,
        max_rails: args.get("rails").map_or(Ok(0), |r| r.parse())?,
        timeout: Duration::from_secs(args.get("timeout").map_or(Ok(20), |t| t.parse())?),
        engine: args
            .get("engine")
            .map_or(Ok(CommOptions::default().engine), |e| e.parse())
            .map_err(|e: String| anyhow!(e))?,
        ..CommOptions::default()
    };
    let mut comm = match args.get("rendezvous") {
        Some(addr) => {
            let world = get("world")?.parse().context("world")?;
            Communicator::from_rendezvous(addr.parse().context("rendezvous")?, rank, world, opts)?
        }
        None => Communicator::from_hostfile(get("hostfile")?.as_ref(), rank, opts)?,
    };
    println!(
        "rank {rank} of {} ({} topology, {} rails, {} engine)",
        comm.world_size(),
        comm.topology(),
        comm.rails(),
        comm.engine().name()
    );
    match get("scenario")?.as_str() {
        "suite" => {
            let counts: Vec<usize> = get("counts")?
                .split(',')
                .map(str::parse)
                .collect::<Result<_, _>>()?;
            let report = suite(&mut comm, &counts, 42)?;
            println!("passed {}", report.passed);
            for f in &report.fingerprints {
                println!("fingerprint {f}");
            }
            for f in &report.failures {
                println!("WRONG {f}");
            }
            if !report.failures.is_empty() {
                bail!("{} checks failed", report.failures.len());
            }
            println!("all checks passed");
            // Linger before closing: a rank that is still finishing the final barrier must not
            // see its neighbours' connections close under it.
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        "loop" => {
            let mut buf = vec![1.0f32; 256 << 10];
            for i in 0..1_000_000u64 {
                comm.all_reduce_in_place(&mut buf, ReduceOp::Max)?;
                if i == 0 {
                    println!("looping");
                }
            }
            bail!("the loop ended without a failure");
        }
        "relay" => relay(&mut comm, rank)?,
        other => bail!("unknown scenario {other:?}"),
    }
    Ok(())
}

/// Rank 0 ↔ rank 2 and rank 3 ↔ rank 1 on a ring of 4, each message relayed by the kernel of
/// a rank in between, which is not told about it (it only joins the all-reduces around).
fn relay(comm: &mut Communicator, rank: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        comm.world_size() == 4,
        "the relay scenario needs a ring of 4"
    );
    let mut x = vec![rank as f32 + 1.0; 1000];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
    anyhow::ensure!(x.iter().all(|&v| v == 10.0), "all-reduce before: {}", x[0]);
    let message = |from: usize, to: usize, len: usize| -> Vec<u8> {
        (0..len)
            .map(|i| (i * 31 + from * 7 + to * 3 + len) as u8)
            .collect()
    };
    let partner = [2, 3, 0, 1][rank];
    // Rank 0 and rank 3 send first; their partners answer. Sizes from empty to many slots.
    for len in [0, 1, 5000, 100_000] {
        let sends_first = rank == 0 || rank == 3;
        for turn in 0..2 {
            if (turn == 0) == sends_first {
                comm.send_bytes(partner, &message(rank, partner, len))?;
            } else {
                let mut got = vec![0u8; len];
                comm.recv_bytes(partner, &mut got)?;
                anyhow::ensure!(
                    got == message(partner, rank, len),
                    "message of {len} bytes from rank {partner} corrupted"
                );
            }
        }
        println!(
            "swapped {len} bytes with rank {partner} via {:?}",
            comm.route(rank, partner)?
        );
    }
    let mut x = vec![rank as f32; 1000];
    comm.all_reduce_in_place(&mut x, ReduceOp::Max)?;
    anyhow::ensure!(x.iter().all(|&v| v == 3.0), "all-reduce after: {}", x[0]);
    comm.barrier()?;
    println!("relay verified");
    std::thread::sleep(Duration::from_millis(300));
    Ok(())
}

fn main() -> ExitCode {
    let mut argv = std::env::args().skip(1);
    let Some(netns) = argv.next() else {
        eprintln!("usage: tbrdma-coll-peer NETNS key=value…");
        return ExitCode::from(2);
    };
    let args: HashMap<String, String> = argv
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    if let Err(e) = tbrdma_netdev::netns::enter_current_thread(&netns) {
        eprintln!("error: entering namespace {netns}: {e}");
        return ExitCode::from(2);
    }
    // Root may raise its own memlock limit; every neighbour's slots are pinned.
    let inf = nix::sys::resource::RLIM_INFINITY;
    let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK, inf, inf);
    let result = run(&args);
    // What the user-space faulty cable (TBRDMA_FAULTS) did, for the test to check.
    let faults = tbrdma_engine::io::faults::injected();
    if faults.seen > 0 {
        println!("faults injected: {faults}");
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
