//! Collectives between processes, each rank in its own lab namespace joined by veth "cables"
//! (MTU 65520): 2 ranks over one cable and over two, a 3-rank full mesh and a 4-rank ring run
//! every operation × type × operator × several counts against a locally computed reference and
//! must agree bit for bit on arbitrary inputs; a rank killed mid-collective makes the others
//! fail, naming it, without hanging. Needs root (skips otherwise).

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tbrdma_netdev::lab::{LabTopology, hostfile_path};
use tbrdma_tests::{Faults, Lab, faults_injected, finish, nftables_available};

const PEER: &str = env!("CARGO_BIN_EXE_tbrdma-coll-peer");

/// One world of busy-polling processes at a time: the machine may have only 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn spawn_all(lab: &Lab, scenario: &str, extra: &[String]) -> Vec<Child> {
    spawn_all_with(lab, scenario, extra, |_| Vec::new())
}

/// [`spawn_all`] with environment variables for each rank.
fn spawn_all_with(
    lab: &Lab,
    scenario: &str,
    extra: &[String],
    env: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<Child> {
    let hostfile = hostfile_path(&lab.name);
    (0..lab.hostfile.ranks.len())
        .map(|rank| {
            let mut args = vec![
                format!("hostfile={}", hostfile.display()),
                format!("rank={rank}"),
                format!("scenario={scenario}"),
            ];
            args.extend(extra.iter().cloned());
            lab.spawn_peer_with(PEER, rank, &args, &env(rank))
        })
        .collect()
}

fn check_suite(tag: &str, ranks: usize, topology: LabTopology, rails: u32, engine: &str) {
    let args = ["counts=0,1,7,3001".to_string(), format!("engine={engine}")];
    run_suite(tag, ranks, topology, rails, &args, Cable::Clean);
}

/// What the cables between the ranks do to datagrams.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cable {
    /// Nothing.
    Clean,
    /// The senders' kernels drop, duplicate and corrupt a share of the datagrams (nftables).
    Kernel(Faults),
    /// Each receiving engine's fault layer (`TBRDMA_FAULTS`) drops, duplicates, corrupts and
    /// reorders the same shares: no nftables needed.
    UserSpace(Faults),
}

/// Reordered per mille of the datagrams on a [`Cable::UserSpace`].
const REORDER: u64 = 20;

/// Runs the suite scenario with `args` on every rank of a new lab whose cables are `cable`;
/// every rank must pass every check and agree with rank 0.
fn run_suite(
    tag: &str,
    ranks: usize,
    topology: LabTopology,
    rails: u32,
    args: &[String],
    cable: Cable,
) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if matches!(cable, Cable::Kernel(_)) {
        if let Err(why) = nftables_available() {
            eprintln!("skipping: {why}");
            return;
        }
    }
    let Some(lab) = Lab::up(tag, ranks, topology, rails) else {
        return;
    };
    if let Cable::Kernel(faults) = cable {
        lab.impair(faults);
        if args.iter().any(|a| a == "engine=packet") {
            if let Err(why) = lab.impair_frames(faults) {
                eprintln!("skipping: {why}");
                return;
            }
        }
    }
    let children = spawn_all_with(&lab, "suite", args, |rank| match cable {
        // (A corrupting plan turns the data digest on by itself.)
        Cable::UserSpace(faults) => vec![(
            "TBRDMA_FAULTS",
            faults.user_space_plan(rank as u64 + 1, REORDER),
        )],
        // On veth the kernel neither computes nor checks UDP checksums and there is no link
        // CRC, so a cable that corrupts needs tbrdma's data digest (docs/wire-format.md).
        Cable::Kernel(faults) if faults.corrupt > 0 => {
            vec![(tbrdma_engine::worker::DATA_DIGEST_ENV, "1".to_string())]
        }
        _ => Vec::new(),
    });
    let outputs: Vec<_> = children.into_iter().map(finish).collect();
    // A failing rank's report shows every rank: the cause is often another rank's error.
    let report = |r: usize| {
        let all: Vec<_> = (0..outputs.len())
            .map(|q| format!("rank {q}:\n{}\n{}", outputs[q].1, outputs[q].2))
            .collect();
        format!("rank {r} failed\n{}", all.join("\n"))
    };
    let fingerprints = |out: &str| {
        out.lines()
            .filter(|l| l.starts_with("fingerprint "))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    for (r, (ok, out, _)) in outputs.iter().enumerate() {
        assert!(*ok, "{}", report(r));
        assert!(out.contains("all checks passed"), "{}", report(r));
        assert!(
            out.contains(&format!("{rails} rails")),
            "expected {rails} rails: {}",
            report(r)
        );
        // (io_uring may fall back to sockets on a kernel without it; the packet engine only
        // needs root, which these tests have.)
        if args.iter().any(|a| a == "engine=packet") {
            assert!(out.contains("packet engine"), "{}", report(r));
        }
        let fp = fingerprints(out);
        assert!(!fp.is_empty(), "{}", report(r));
        assert_eq!(
            fp,
            fingerprints(&outputs[0].1),
            "rank {r} disagrees with rank 0"
        );
    }
    match cable {
        Cable::Clean => {}
        Cable::Kernel(faults) => {
            // The rules really hit datagrams of every kind asked for.
            let done = lab.faults_done();
            eprintln!("{tag}: {done:?}");
            for (asked, hit, what) in [
                (faults.drop, done.drop, "dropped"),
                (faults.duplicate, done.duplicate, "duplicated"),
                (faults.corrupt, done.corrupt, "corrupted"),
            ] {
                assert!(asked == 0 || hit > 0, "no datagram was {what}: {done:?}");
            }
        }
        Cable::UserSpace(faults) => {
            // Every rank's fault layer ran, and hit datagrams of every kind asked for.
            let done = faults_injected(outputs.iter().map(|o| o.1.as_str()));
            eprintln!("{tag}: seen, dropped, duplicated, corrupted, reordered = {done:?}");
            for (r, (_, out, _)) in outputs.iter().enumerate() {
                assert!(out.contains("faults injected: "), "{}", report(r));
            }
            for (asked, hit, what) in [
                (faults.drop, done[1], "dropped"),
                (faults.duplicate, done[2], "duplicated"),
                (faults.corrupt, done[3], "corrupted"),
                (REORDER, done[4], "reordered"),
            ] {
                assert!(asked == 0 || hit > 0, "no datagram was {what}: {done:?}");
            }
        }
    }
}

#[test]
fn two_ranks_over_one_cable() {
    check_suite("c2", 2, LabTopology::Pair, 1, "sockets");
}

#[test]
fn two_ranks_over_two_cables() {
    // The io_uring engine here, the default sockets engine elsewhere.
    check_suite("c2r", 2, LabTopology::Pair, 2, "uring");
}

#[test]
fn two_ranks_with_the_packet_engine() {
    check_suite("c2p", 2, LabTopology::Pair, 1, "packet");
}

#[test]
fn four_ranks_in_a_ring_with_the_packet_engine() {
    // Kernel-relayed send/recv between ranks 0 and 2 (and 1 and 3) must still work: those
    // connections take the sockets engine (the kernels in between forward IP, not frames).
    check_suite("c4p", 4, LabTopology::Ring, 1, "packet");
}

#[test]
fn three_ranks_in_a_full_mesh() {
    check_suite("c3m", 3, LabTopology::Mesh, 1, "sockets");
}

#[test]
fn four_ranks_in_a_ring() {
    check_suite("c4r", 4, LabTopology::Ring, 1, "sockets");
}

/// The suite with the default slots (512 KiB: messages of several datagrams) while 2 % of the
/// datagrams are dropped, 1 % duplicated and 1 % corrupted (and, in user space, 2 % reordered):
/// the protocol resends what was lost or rejected and ignores copies, and nothing of a message
/// received in part may be overwritten meanwhile (a landing zone lent over one once corrupted
/// a ring all-reduce this way). By the senders' kernels (nftables; skipped without it) when
/// `kernel`, else by the receivers' engines (`TBRDMA_FAULTS`).
fn faulty_suite(
    tag: &str,
    ranks: usize,
    topology: LabTopology,
    rails: u32,
    engine: &str,
    kernel: bool,
) {
    let args = [
        "counts=7,70000".to_string(),
        format!("slot_bytes={}", 512 << 10),
        "slots=8".to_string(),
        format!("engine={engine}"),
    ];
    let faults = Faults {
        drop: 20,
        duplicate: 10,
        corrupt: 10,
    };
    let cable = if kernel {
        Cable::Kernel(faults)
    } else {
        Cable::UserSpace(faults)
    };
    run_suite(tag, ranks, topology, rails, &args, cable);
}

#[test]
fn two_ranks_on_a_faulty_cable_stay_exact() {
    faulty_suite("f2", 2, LabTopology::Pair, 1, "sockets", true);
}

#[test]
fn two_ranks_on_two_faulty_cables_stay_exact() {
    faulty_suite("f2r", 2, LabTopology::Pair, 2, "uring", true);
}

#[test]
fn two_ranks_with_the_packet_engine_on_a_faulty_cable_stay_exact() {
    faulty_suite("f2p", 2, LabTopology::Pair, 1, "packet", true);
}

#[test]
fn four_ranks_in_a_ring_of_faulty_cables_stay_exact() {
    faulty_suite("f4r", 4, LabTopology::Ring, 1, "sockets", true);
}

#[test]
fn two_ranks_on_a_user_space_faulty_cable_stay_exact() {
    faulty_suite("u2", 2, LabTopology::Pair, 1, "sockets", false);
}

#[test]
fn two_ranks_on_two_user_space_faulty_cables_stay_exact() {
    faulty_suite("u2r", 2, LabTopology::Pair, 2, "uring", false);
}

#[test]
fn two_ranks_with_the_packet_engine_on_a_user_space_faulty_cable_stay_exact() {
    faulty_suite("u2p", 2, LabTopology::Pair, 1, "packet", false);
}

#[test]
fn four_ranks_in_a_ring_of_user_space_faulty_cables_stay_exact() {
    faulty_suite("u4r", 4, LabTopology::Ring, 1, "sockets", false);
}

#[test]
fn three_ranks_meet_by_rendezvous_without_a_hostfile() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("crv", 3, LabTopology::Mesh, 1) else {
        return;
    };
    // Each rank reaches rank 0 over its own cable to it, as PyTorch's MASTER_ADDR would over a
    // management network.
    let children: Vec<Child> = (0..3)
        .map(|rank| {
            let to = if rank == 0 { 1 } else { rank };
            let args = vec![
                format!("rendezvous={}:29511", lab.address(0, to, 0)),
                format!("world=3"),
                format!("rank={rank}"),
                "scenario=suite".to_string(),
                "counts=3001".to_string(),
            ];
            lab.spawn_peer(PEER, rank, &args)
        })
        .collect();
    for (rank, (ok, out, err)) in children.into_iter().map(finish).enumerate() {
        assert!(ok, "rank {rank}:\n{out}\n{err}");
        assert!(out.contains("mesh topology"), "rank {rank}:\n{out}");
        assert!(out.contains("all checks passed"), "rank {rank}:\n{out}");
    }
}

/// IPv4 datagrams rank `rank`'s kernel has forwarded so far (`Ip: ForwDatagrams`).
fn forwarded(lab: &Lab, rank: usize) -> u64 {
    tbrdma_netdev::netns::run_in(&lab.namespace(rank), || {
        let snmp = std::fs::read_to_string("/proc/thread-self/net/snmp")
            .map_err(|e| tbrdma_netdev::NetdevError::io("reading", "snmp", e))?;
        let mut lines = snmp.lines().filter(|l| l.starts_with("Ip:"));
        let (names, values) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
        let at = names
            .split_whitespace()
            .position(|n| n == "ForwDatagrams")
            .expect("ForwDatagrams in /proc/net/snmp");
        Ok(values
            .split_whitespace()
            .nth(at)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0))
    })
    .expect("read the namespace's IP counters")
}

#[test]
fn send_recv_between_ranks_without_a_cable_is_relayed_by_the_kernel_in_between() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("crl", 4, LabTopology::Ring, 1) else {
        return;
    };
    let before: Vec<u64> = (0..4).map(|r| forwarded(&lab, r)).collect();
    let children = spawn_all(&lab, "relay", &[]);
    for (rank, (ok, out, err)) in children.into_iter().map(finish).enumerate() {
        assert!(ok, "rank {rank}:\n{out}\n{err}");
        assert!(out.contains("relay verified"), "rank {rank}:\n{out}");
    }
    // 0 → 2 goes 0-1-2 and back 2-3-0 (ties go up); 3 → 1 goes 3-0-1 and back 1-2-3: every
    // rank's kernel relays for one of the pairs, while its process only ran the all-reduces.
    for (rank, before) in before.into_iter().enumerate() {
        let relayed = forwarded(&lab, rank) - before;
        assert!(
            relayed > 20,
            "rank {rank}'s kernel forwarded {relayed} datagrams"
        );
    }
}

#[test]
fn a_ring_whose_middle_rank_does_not_forward_fails_fast_naming_the_fix() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("crn", 4, LabTopology::Ring, 1) else {
        return;
    };
    // Rank 1 stops forwarding: 0 → 2 (which goes 0-1-2) has no path.
    tbrdma_netdev::netns::run_in(&lab.namespace(1), || {
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "0")
            .map_err(|e| tbrdma_netdev::NetdevError::io("writing", "ip_forward", e))
    })
    .expect("turn forwarding off");
    let start = Instant::now();
    let children = spawn_all(&lab, "relay", &["timeout=8".to_string()]);
    let deadline = start + Duration::from_secs(40);
    for (rank, child) in children.into_iter().enumerate() {
        let (ok, out, err) =
            wait_until(child, deadline).unwrap_or_else(|| panic!("rank {rank} hung"));
        assert!(!ok, "rank {rank} succeeded?\n{out}\n{err}");
        if rank == 0 || rank == 2 {
            let other = 2 - rank;
            assert!(
                err.contains(&format!("connecting rank {rank} to rank {other}"))
                    && err.contains(&format!("ranks {rank} and {other} share no cable"))
                    && err.contains("tbrdma setup --relay")
                    && err.contains("TBRDMA_RELAY=ranks"),
                "rank {rank}:\n{out}\n{err}"
            );
        }
        eprintln!("rank {rank}: {}", err.trim());
    }
    // The probe's bound (3 s), not the 8 s timeout, ends ranks 0 and 2.
    eprintln!("all ranks ended after {:?}", start.elapsed());
}

/// Waits for `child` up to `deadline`; kills it and returns None if it is still running.
fn wait_until(mut child: Child, deadline: Instant) -> Option<(bool, String, String)> {
    loop {
        match child.try_wait().expect("try_wait") {
            Some(_) => return Some(finish(child)),
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

#[test]
fn a_rank_killed_mid_collective_is_named_by_every_other_rank() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("ck", 4, LabTopology::Ring, 1) else {
        return;
    };
    let victim = 2;
    let mut children = spawn_all(&lab, "loop", &["timeout=4".to_string()]);
    let stdout = children[victim].stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let started = lines.any(|l| l.is_ok_and(|l| l == "looping"));
    assert!(started, "rank {victim} never completed an all-reduce");
    children[victim].kill().expect("kill the victim");
    let _ = children[victim].wait();
    // The others must fail on their own: the retransmission budget (half the 4 s collective
    // timeout) and the timeout itself bound it; 40 s means a hang.
    let deadline = Instant::now() + Duration::from_secs(40);
    for (rank, child) in children.into_iter().enumerate() {
        if rank == victim {
            continue;
        }
        let (ok, out, err) = wait_until(child, deadline)
            .unwrap_or_else(|| panic!("rank {rank} hung after rank {victim} was killed"));
        assert!(!ok, "rank {rank} succeeded?\n{out}\n{err}");
        eprintln!("rank {rank}: {}", err.trim());
        assert!(
            err.contains(&format!("rank {victim} failed")),
            "rank {rank} does not name rank {victim}:\n{out}\n{err}"
        );
    }
}
