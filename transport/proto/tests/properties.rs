//! Property tests of the protocol core over the simulated network: random operation mixes in
//! both directions, random faults, and a reference model that predicts every byte and every
//! completion.

use std::time::Duration;

use proptest::prelude::*;
use tbrdma_proto::sim::{Endpoint, LinkConfig, Pair, PairConfig};
use tbrdma_proto::{
    Access, Config, ConnectionState, Queue, RecvWr, Region, RemoteAddr, SendOp, SendWr, Sge, Time,
    WcOpcode, WcStatus, WorkCompletion,
};

/// Bytes each side's regions hold; the largest operation fits with room to spare.
const REGION: usize = 5 << 20;
/// Room per receive buffer.
const RECV_SLOT: usize = 4 << 20;
/// Atomics hit the first eight words of the target region.
const ATOMIC_SLOTS: u64 = 8;

#[derive(Clone, Debug)]
enum Op {
    Write {
        len: usize,
        src: usize,
        dst: usize,
        imm: Option<u32>,
    },
    Send {
        len: usize,
        src: usize,
        imm: Option<u32>,
    },
    Read {
        len: usize,
        src: usize,
        dst: usize,
    },
    FetchAdd {
        slot: u64,
        add: u64,
        dst: usize,
    },
    CmpSwap {
        slot: u64,
        hit: bool,
        swap: u64,
        dst: usize,
    },
}

fn len_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..64,
        6 => 64usize..5000,
        3 => 5000usize..200_000,
        1 => 200_000usize..(4 << 20),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let off = 0usize..(REGION - (4 << 20));
    let dst8 = (0usize..1000).prop_map(|d| d * 8);
    prop_oneof![
        4 => (len_strategy(), off.clone(), off.clone(), proptest::option::of(any::<u32>()))
            .prop_map(|(len, src, dst, imm)| Op::Write { len, src, dst, imm }),
        2 => (len_strategy(), off.clone(), proptest::option::of(any::<u32>()))
            .prop_map(|(len, src, imm)| Op::Send { len: len.min(RECV_SLOT), src, imm }),
        3 => (len_strategy(), off.clone(), off).prop_map(|(len, src, dst)| Op::Read { len, src, dst }),
        2 => (0..ATOMIC_SLOTS, any::<u64>(), dst8.clone()).prop_map(|(slot, add, dst)| Op::FetchAdd { slot, add, dst }),
        1 => (0..ATOMIC_SLOTS, any::<bool>(), any::<u64>(), dst8).prop_map(|(slot, hit, swap, dst)| Op::CmpSwap { slot, hit, swap, dst }),
    ]
}

#[derive(Clone, Debug)]
struct Faults {
    loss: f64,
    duplicate: f64,
    corrupt: f64,
    jitter_us: u64,
    max_datagram: usize,
}

fn faults_strategy() -> impl Strategy<Value = Faults> {
    (
        0.0..0.15f64,
        0.0..0.1f64,
        0.0..0.05f64,
        0u64..60,
        prop_oneof![Just(1472usize), Just(9000), Just(65492)],
    )
        .prop_map(
            |(loss, duplicate, corrupt, jitter_us, max_datagram)| Faults {
                loss,
                duplicate,
                corrupt,
                jitter_us,
                max_datagram,
            },
        )
}

/// One side's view of the regions its requests use.
struct Side {
    src: Region,
    dst: Region,
    /// On the peer: the target of writes, reads and atomics.
    target: Region,
    /// On the peer: receive buffers for sends.
    recv: Region,
}

/// What the peer's memory and this side's memory must end up as.
struct Model {
    src: Vec<u8>,
    dst: Vec<u8>,
    target: Vec<u8>,
    recv: Vec<u8>,
    send_completions: Vec<(u64, WcOpcode, u64)>,
    recv_completions: Vec<(u64, WcOpcode, u64, Option<u32>)>,
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn word(bytes: &[u8], slot: u64) -> u64 {
    let at = slot as usize * 8;
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// Registers `from`'s regions (and its targets at `to`), fills them, and returns the work
/// requests with the model of their effect.
fn setup(
    from: &mut Endpoint,
    to: &mut Endpoint,
    ops: &[Op],
    seed: u64,
) -> (Side, Model, Vec<SendWr>, Vec<RecvWr>) {
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let side = Side {
        src: from.mem.alloc(REGION, Access::LOCAL_WRITE),
        dst: from.mem.alloc(REGION, Access::LOCAL_WRITE),
        target: to.mem.alloc(REGION, all),
        recv: to.mem.alloc(
            RECV_SLOT
                * ops
                    .iter()
                    .filter(|o| matches!(o, Op::Send { .. } | Op::Write { imm: Some(_), .. }))
                    .count()
                    .max(1),
            Access::LOCAL_WRITE,
        ),
    };
    let mut m = Model {
        src: pattern(REGION, seed),
        dst: pattern(REGION, seed + 1),
        target: pattern(REGION, seed + 2),
        recv: vec![0; side.recv.len as usize],
        send_completions: Vec::new(),
        recv_completions: Vec::new(),
    };
    from.mem.fill(&side.src, 0, &m.src);
    from.mem.fill(&side.dst, 0, &m.dst);
    to.mem.fill(&side.target, 0, &m.target);
    let sge = |r: &Region, off: usize, len: usize| Sge {
        addr: r.addr + off as u64,
        len: len as u64,
        lkey: r.lkey,
    };
    let remote = |r: &Region, off: usize| RemoteAddr {
        addr: r.addr + off as u64,
        rkey: r.rkey,
    };
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let wr_id = i as u64;
        let mut consume_recv = |m: &mut Model, len: usize, opcode, imm, data: Option<&[u8]>| {
            let slot = recvs.len();
            recvs.push(RecvWr {
                wr_id: 1000 + slot as u64,
                local: sge(&side.recv, slot * RECV_SLOT, RECV_SLOT),
            });
            if let Some(data) = data {
                m.recv[slot * RECV_SLOT..slot * RECV_SLOT + len].copy_from_slice(data);
            }
            m.recv_completions
                .push((1000 + slot as u64, opcode, len as u64, imm));
        };
        let (local, op_, opcode, byte_len) = match *op {
            Op::Write { len, src, dst, imm } => {
                let data = m.src[src..src + len].to_vec();
                m.target[dst..dst + len].copy_from_slice(&data);
                let op_ = match imm {
                    Some(imm) => {
                        consume_recv(&mut m, len, WcOpcode::RecvRdmaWithImm, Some(imm), None);
                        SendOp::WriteWithImm {
                            remote: remote(&side.target, dst),
                            imm,
                        }
                    }
                    None => SendOp::Write {
                        remote: remote(&side.target, dst),
                    },
                };
                (sge(&side.src, src, len), op_, WcOpcode::RdmaWrite, len)
            }
            Op::Send { len, src, imm } => {
                let data = m.src[src..src + len].to_vec();
                consume_recv(&mut m, len, WcOpcode::Recv, imm, Some(&data));
                (
                    sge(&side.src, src, len),
                    SendOp::Send { imm },
                    WcOpcode::Send,
                    len,
                )
            }
            Op::Read { len, src, dst } => {
                let data = m.target[src..src + len].to_vec();
                m.dst[dst..dst + len].copy_from_slice(&data);
                (
                    sge(&side.dst, dst, len),
                    SendOp::Read {
                        remote: remote(&side.target, src),
                    },
                    WcOpcode::RdmaRead,
                    len,
                )
            }
            Op::FetchAdd { slot, add, dst } => {
                let old = word(&m.target, slot);
                m.target[slot as usize * 8..slot as usize * 8 + 8]
                    .copy_from_slice(&old.wrapping_add(add).to_le_bytes());
                m.dst[dst..dst + 8].copy_from_slice(&old.to_le_bytes());
                (
                    sge(&side.dst, dst, 8),
                    SendOp::FetchAdd {
                        remote: remote(&side.target, slot as usize * 8),
                        add,
                    },
                    WcOpcode::FetchAdd,
                    8,
                )
            }
            Op::CmpSwap {
                slot,
                hit,
                swap,
                dst,
            } => {
                let old = word(&m.target, slot);
                let compare = if hit {
                    old
                } else {
                    old ^ 0x8000_0000_0000_0001
                };
                if hit {
                    m.target[slot as usize * 8..slot as usize * 8 + 8]
                        .copy_from_slice(&swap.to_le_bytes());
                }
                m.dst[dst..dst + 8].copy_from_slice(&old.to_le_bytes());
                let op_ = SendOp::CmpSwap {
                    remote: remote(&side.target, slot as usize * 8),
                    compare,
                    swap,
                };
                (sge(&side.dst, dst, 8), op_, WcOpcode::CmpSwap, 8)
            }
        };
        sends.push(SendWr {
            wr_id,
            local,
            op: op_,
        });
        m.send_completions.push((wr_id, opcode, byte_len as u64));
    }
    (side, m, sends, recvs)
}

fn config(faults: &Faults) -> Config {
    Config {
        max_datagram: faults.max_datagram,
        max_retries: 16,
        // The simulated link corrupts undetected (a real one's CRC would drop the frame), so
        // payloads need the digest there; clean links run without it, as by default.
        data_digest: faults.corrupt > 0.0,
        ..Config::default()
    }
}

fn lossy_pair(seed: u64, faults: &Faults) -> Pair {
    let link = LinkConfig {
        loss: faults.loss,
        duplicate: faults.duplicate,
        corrupt: faults.corrupt,
        jitter: Duration::from_micros(faults.jitter_us),
        mtu: faults.max_datagram,
        ..LinkConfig::default()
    };
    Pair::new(PairConfig {
        seed,
        config_a: config(faults),
        config_b: config(faults),
        link,
    })
}

fn summary(
    wcs: &[WorkCompletion],
    queue: Queue,
) -> Vec<(u64, WcStatus, WcOpcode, u64, Option<u32>)> {
    wcs.iter()
        .filter(|w| w.queue == queue)
        .map(|w| (w.wr_id, w.status, w.opcode, w.byte_len, w.imm))
        .collect()
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, max_shrink_iters: 200, ..ProptestConfig::default() })]

    /// Under loss, duplication, corruption and reordering, every request in both directions
    /// completes exactly once, in order, successfully, and memory on both sides ends exactly
    /// as the reference model says.
    #[test]
    fn random_operations_over_a_lossy_link_match_the_model(
        seed in any::<u64>(),
        faults in faults_strategy(),
        ops_a in proptest::collection::vec(op_strategy(), 0..24),
        ops_b in proptest::collection::vec(op_strategy(), 0..12),
        batches in 1usize..4,
    ) {
        let mut p = lossy_pair(seed, &faults);
        prop_assert_eq!(p.a.conn.state(), ConnectionState::Established);
        let (side_a, model_a, sends_a, recvs_a) = { let (a, b) = (&mut p.a, &mut p.b); setup(a, b, &ops_a, seed) };
        let (side_b, model_b, sends_b, recvs_b) = { let (a, b) = (&mut p.a, &mut p.b); setup(b, a, &ops_b, seed ^ 0xffff) };
        for wr in recvs_a { p.b.post_recv(wr).unwrap(); }
        for wr in recvs_b { p.a.post_recv(wr).unwrap(); }
        // Post in batches, letting the link run in between, so requests meet traffic in flight.
        let chunk_a = sends_a.len().div_ceil(batches).max(1);
        let chunk_b = sends_b.len().div_ceil(batches).max(1);
        let mut ca = sends_a.chunks(chunk_a);
        let mut cb = sends_b.chunks(chunk_b);
        for _ in 0..batches {
            for wr in ca.next().unwrap_or(&[]) { p.a.post_send(*wr).unwrap(); }
            for wr in cb.next().unwrap_or(&[]) { p.b.post_send(*wr).unwrap(); }
            let until = p.steps() + 50;
            p.drive_until(1_000_000, |p| p.steps() >= until);
        }
        prop_assert!(p.drive(20_000_000), "did not settle within the step bound");
        prop_assert_eq!(p.a.conn.state(), ConnectionState::Established, "a: {:?}", p.a.events);
        prop_assert_eq!(p.b.conn.state(), ConnectionState::Established, "b: {:?}", p.b.events);

        let wcs_a = p.a.take_completions();
        let wcs_b = p.b.take_completions();
        for (wcs, model, name) in [(&wcs_a, &model_a, "a"), (&wcs_b, &model_b, "b")] {
            let expected: Vec<_> = model.send_completions.iter().map(|&(id, op, len)| (id, WcStatus::Success, op, len, None)).collect();
            prop_assert_eq!(summary(wcs, Queue::Send), expected, "send completions of {}", name);
        }
        for (wcs, model, name) in [(&wcs_b, &model_a, "b"), (&wcs_a, &model_b, "a")] {
            let expected: Vec<_> = model.recv_completions.iter().map(|&(id, op, len, imm)| (id, WcStatus::Success, op, len, imm)).collect();
            prop_assert_eq!(summary(wcs, Queue::Recv), expected, "receive completions of {}", name);
        }
        for (from, to, side, model, name) in [(&p.a, &p.b, &side_a, &model_a, "a->b"), (&p.b, &p.a, &side_b, &model_b, "b->a")] {
            let check = |got: &[u8], want: &[u8], what: &str| -> Result<(), TestCaseError> {
                prop_assert!(first_difference(got, want).is_none(), "{} {}: first difference at byte {:?}", name, what, first_difference(got, want));
                Ok(())
            };
            check(to.mem.bytes(&side.target, 0, REGION), &model.target, "target")?;
            check(from.mem.bytes(&side.dst, 0, REGION), &model.dst, "read/atomic results")?;
            check(from.mem.bytes(&side.src, 0, REGION), &model.src, "source (must be untouched)")?;
            check(to.mem.bytes(&side.recv, 0, side.recv.len as usize), &model.recv, "receive buffers")?;
        }
    }

    /// With the link cut for good at a random moment, every request still completes: a prefix
    /// succeeds, then one fails with retry exceeded and the rest are flushed, within the retry
    /// budget.
    #[test]
    fn a_link_cut_for_good_fails_every_request_within_the_budget(
        seed in any::<u64>(),
        ops in proptest::collection::vec(op_strategy(), 1..16),
        cut_after_us in 0u64..3000,
    ) {
        let faults = Faults { loss: 0.0, duplicate: 0.0, corrupt: 0.0, jitter_us: 0, max_datagram: 65492 };
        let mut p = lossy_pair(seed, &faults);
        let (_side, _model, sends, recvs) = { let (a, b) = (&mut p.a, &mut p.b); setup(a, b, &ops, seed) };
        for wr in recvs { p.b.post_recv(wr).unwrap(); }
        let cut: Time = p.now + Duration::from_micros(cut_after_us);
        p.link_config_mut().outages.push((cut, None));
        for wr in &sends { p.a.post_send(*wr).unwrap(); }
        prop_assert!(p.drive(20_000_000));
        let budget = config(&faults).retry_budget();
        // Packets queued on the link before the cut still arrive (up to a window's worth at 10 Gbit/s,
        // ~7 ms), and the budget counts from the last sign of life.
        prop_assert!(p.now <= cut + budget + Duration::from_millis(10), "settled at {:?}, cut at {:?}, budget {:?}", p.now, cut, budget);
        let wcs: Vec<_> = p.a.take_completions().into_iter().filter(|w| w.queue == Queue::Send).collect();
        prop_assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), (0..ops.len() as u64).collect::<Vec<_>>());
        let statuses: Vec<WcStatus> = wcs.iter().map(|w| w.status).collect();
        let ok = statuses.iter().take_while(|s| **s == WcStatus::Success).count();
        if ok < statuses.len() {
            prop_assert_eq!(statuses[ok], WcStatus::RetryExceeded, "{:?}", statuses);
            prop_assert!(statuses[ok + 1..].iter().all(|s| *s == WcStatus::Flushed), "{:?}", statuses);
            prop_assert_eq!(p.a.conn.state(), ConnectionState::Error);
        }
    }
}
