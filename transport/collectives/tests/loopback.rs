//! Ranks as threads of one process, every link on 127.0.0.1: the whole suite of operations ×
//! types × operators × counts for 2 ranks (one and two rails), a 3-rank mesh and a 4-rank ring,
//! checked against the local reference, and the ranks' results compared bit for bit. Needs no
//! root; the namespace tests in `tests/tests/collectives.rs` run the same suite over veth.

use std::net::Ipv4Addr;
use std::sync::Mutex;
use std::time::Duration;

use tbrdma_collectives::check::{SuiteReport, suite};
use tbrdma_collectives::{CollError, CommOptions, Communicator, Hostfile, ReduceOp, TopologyKind};
use tbrdma_netdev::hostfile::{Rank, RankLink, Topology};

/// Busy-polling ranks share 2 cores: one world at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn loopback_hostfile(world: usize, kind: TopologyKind, rails: u32) -> Hostfile {
    let pairs: Vec<(usize, usize)> = match kind {
        TopologyKind::Ring => (0..world).map(|k| (k, (k + 1) % world)).collect(),
        _ => (0..world)
            .flat_map(|a| (a + 1..world).map(move |b| (a, b)))
            .collect(),
    };
    let lo = Ipv4Addr::LOCALHOST;
    let ranks = (0..world)
        .map(|r| {
            let mut links = Vec::new();
            for &(a, b) in &pairs {
                let peer = if a == r {
                    b
                } else if b == r {
                    a
                } else {
                    continue;
                };
                for rail in 0..rails {
                    links.push(RankLink {
                        interface: "lo".into(),
                        address: lo,
                        prefix_len: 8,
                        peer,
                        peer_address: lo,
                        rail,
                    });
                }
            }
            links.sort_by_key(|l| (l.peer, l.rail));
            Rank {
                rank: r,
                host: format!("h{r}"),
                uuid: format!("u{r}"),
                links,
            }
        })
        .collect();
    Hostfile {
        version: 1,
        topology: Topology { kind, rails },
        ranks,
    }
}

fn options(port_base: u16) -> CommOptions {
    CommOptions {
        // Small slots, so that a few thousand elements already pipeline over many chunks.
        slot_bytes: 4096,
        slots: 4,
        one_shot_max: 2048,
        port_base,
        timeout: Duration::from_secs(20),
        ..CommOptions::default()
    }
}

/// Runs `f` on every rank of a loopback world (one thread each) and returns their results.
fn run_world<T: Send + 'static>(
    hostfile: Hostfile,
    opts: CommOptions,
    f: impl Fn(&mut Communicator) -> Result<T, CollError> + Send + Sync + Copy + 'static,
) -> Vec<Result<T, CollError>> {
    let world = hostfile.ranks.len();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let hf = hostfile.clone();
            let opts = opts.clone();
            std::thread::spawn(move || {
                let mut comm = Communicator::new(&hf, rank, opts)?;
                f(&mut comm)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

fn check_world(world: usize, kind: TopologyKind, rails: u32, port_base: u16) {
    check_world_with(
        world,
        kind,
        rails,
        options(port_base),
        &[0, 1, 5, 1000, 5003],
    );
}

fn check_world_with(
    world: usize,
    kind: TopologyKind,
    rails: u32,
    opts: CommOptions,
    counts: &'static [usize],
) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let hf = loopback_hostfile(world, kind, rails);
    let results = run_world(hf, opts, move |comm| suite(comm, counts, 42));
    let errors: Vec<String> = results
        .iter()
        .enumerate()
        .filter_map(|(r, res)| res.as_ref().err().map(|e| format!("rank {r}: {e}")))
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let reports: Vec<SuiteReport> = results.into_iter().map(Result::unwrap).collect();
    for (r, rep) in reports.iter().enumerate() {
        assert!(rep.failures.is_empty(), "rank {r}: {:#?}", rep.failures);
        assert!(rep.passed > 100, "rank {r} ran only {} checks", rep.passed);
        assert_eq!(
            rep.fingerprints, reports[0].fingerprints,
            "rank {r} disagrees with rank 0 on arbitrary inputs"
        );
    }
}

#[test]
fn two_ranks_one_rail() {
    check_world(2, TopologyKind::Pair, 1, 21_000);
}

#[test]
fn two_ranks_two_rails() {
    check_world(2, TopologyKind::Pair, 2, 21_100);
}

#[test]
fn three_ranks_mesh() {
    check_world(3, TopologyKind::Mesh, 1, 21_200);
}

#[test]
fn four_ranks_ring() {
    check_world(4, TopologyKind::Ring, 1, 21_300);
}

/// Messages that are lent to the reduction in several 16 KiB pieces (`Channel::
/// view_oldest_range`), the last one partial: 100 KiB slots, and a count whose chunks are no
/// multiple of the piece. Two ranks (one-shot and ring) and a three-rank mesh, whose one-shot
/// reduction views two peers' pieces at once.
#[test]
fn slots_of_several_view_pieces() {
    let opts = |port_base| CommOptions {
        slot_bytes: 100 << 10,
        ..options(port_base)
    };
    check_world_with(2, TopologyKind::Pair, 1, opts(21_600), &[60_001]);
    check_world_with(3, TopologyKind::Mesh, 1, opts(21_700), &[60_001]);
}

/// A two-rank one-shot all-reduce of one slot reduces the peer's packets as they arrive
/// (`Communicator::reduced_on_arrival`) whenever its call is in time for them, and the
/// results stay exact: every type, operator and form of the suite, in messages of one packet
/// and of several (256 KiB slots, 64 KiB datagrams on loopback).
#[test]
fn two_ranks_reduce_the_peers_packets_as_they_arrive() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let opts = CommOptions {
        slot_bytes: 256 << 10,
        one_shot_max: 256 << 10,
        ..options(21_800)
    };
    let hf = loopback_hostfile(2, TopologyKind::Pair, 1);
    let results = run_world(hf, opts, |comm| {
        let report = suite(comm, &[1000, 30_000], 43)?;
        let reduced = comm.reduced_on_arrival();
        // In place too (as tensor-parallel frameworks call it): 16 KiB of f32, each rank's
        // values known, so every call's sum is.
        let rank = comm.rank() as f32;
        for call in 0..100 {
            let mut buf: Vec<f32> = (0..4096).map(|i| (i + call) as f32 + rank).collect();
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            for (i, v) in buf.iter().enumerate() {
                assert_eq!(
                    *v,
                    (2 * (i + call)) as f32 + 1.0,
                    "call {call}, element {i}"
                );
            }
        }
        let in_place = comm.reduced_on_arrival() - reduced;
        Ok((report, reduced, in_place))
    });
    let mut fingerprints = None;
    for (r, res) in results.into_iter().enumerate() {
        let (report, reduced, in_place) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(
            in_place > 0,
            "rank {r} reduced nothing in place as it arrived"
        );
        assert!(
            report.failures.is_empty(),
            "rank {r}: {:#?}",
            report.failures
        );
        assert!(
            report.passed > 100,
            "rank {r} ran only {} checks",
            report.passed
        );
        assert!(reduced > 0, "rank {r} reduced nothing as it arrived");
        let fp = fingerprints.get_or_insert_with(|| report.fingerprints.clone());
        assert_eq!(&report.fingerprints, fp, "rank {r} disagrees with rank 0");
    }
}

#[test]
fn a_rank_with_other_options_is_named() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let hf = loopback_hostfile(2, TopologyKind::Pair, 1);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let hf = hf.clone();
            let mut opts = options(21_400);
            opts.timeout = Duration::from_secs(5);
            if rank == 1 {
                opts.slots = 8;
            }
            std::thread::spawn(move || Communicator::new(&hf, rank, opts).map(|_| ()))
        })
        .collect();
    let errors: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap_err().to_string())
        .collect();
    assert!(
        errors[0].contains("rank 1 disagrees on the slots per neighbour: it has 8, rank 0 has 4"),
        "{errors:?}"
    );
    // Rank 1 may see the digest or, if rank 0 hung up first, the closed connection.
    assert!(errors[1].contains("rank 0"), "{errors:?}");
}

#[test]
fn a_rank_that_leaves_mid_collective_is_named_by_the_others() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let hf = loopback_hostfile(3, TopologyKind::Mesh, 1);
    let mut opts = options(21_500);
    opts.timeout = Duration::from_secs(5);
    let results = run_world(hf, opts, |comm| {
        let mut buf = vec![1.0f32; 50_000];
        comm.all_reduce_in_place(&mut buf, tbrdma_collectives::ReduceOp::Sum)?;
        if comm.rank() == 2 {
            // Leaves: dropping the communicator closes its queue pairs mid-way through the
            // others' next collective.
            return Ok(());
        }
        comm.all_reduce_in_place(&mut buf, tbrdma_collectives::ReduceOp::Sum)
    });
    assert!(results[2].is_ok());
    for (r, result) in results.iter().take(2).enumerate() {
        let err = result.as_ref().unwrap_err().to_string();
        assert!(err.contains("rank 2"), "rank {r}: {err}");
    }
}
