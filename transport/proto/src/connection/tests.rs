//! Scenario tests of the connection over the simulated link, one behaviour each.

use std::time::Duration;

use crate::Config;
use crate::connection::{ConnectionError, ConnectionState, Event};
use crate::memory::{Access, Memory, Region};
use crate::sim::{LinkConfig, Pair, PairConfig};
use crate::time::Time;
use crate::work::{RecvWr, RemoteAddr, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion};

const RW: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);
const STEPS: u64 = 2_000_000;

fn pair_with(link: LinkConfig, config: Config) -> Pair {
    let pair = Pair::new(PairConfig {
        seed: 42,
        config_a: config.clone(),
        config_b: config,
        link,
    });
    assert_eq!(pair.a.conn.state(), ConnectionState::Established);
    assert_eq!(pair.b.conn.state(), ConnectionState::Established);
    pair
}

fn pair() -> Pair {
    pair_with(LinkConfig::default(), Config::default())
}

/// Posts a WRITE of `bytes` from a new region of `a` to a new region of `b`, which it returns.
fn post_write(p: &mut Pair, bytes: &[u8]) -> Region {
    let src = p.a.mem.alloc(bytes.len(), Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(bytes.len(), RW);
    p.a.mem.fill(&src, 0, bytes);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&src, 0, bytes.len() as u64),
        op: SendOp::Write {
            remote: remote(&dst, 0),
        },
    })
    .unwrap();
    dst
}

/// Posts a one-packet WRITE of `len` bytes of `byte` from `a` to a new region of `b` and
/// returns its datagram, as `a` sends it now (nothing is delivered), and the target region.
fn one_write_datagram(p: &mut Pair, len: usize, byte: u8) -> (Vec<u8>, Region) {
    let dst = post_write(p, &vec![byte; len]);
    let now = p.now;
    let mut writes: Vec<_> = transmit_all(&mut p.a, now)
        .into_iter()
        .filter(|d| crate::wire::decode(d).is_ok_and(|p| p.header.opcode.carries_data()))
        .collect();
    assert_eq!(writes.len(), 1, "one data packet");
    (writes.remove(0), dst)
}

/// WRITEs `len` bytes of `pattern(len, seed)` from `a` to a new region of `b`, drives the pair
/// until it is done and checks that the WRITE succeeded and the bytes arrived whole.
fn write_whole(p: &mut Pair, len: usize, seed: u8) {
    let dst = post_write(p, &pattern(len, seed));
    assert!(p.drive(STEPS));
    assert_eq!(only(p.a.take_completions()).status, WcStatus::Success);
    assert!(
        p.b.mem.bytes(&dst, 0, len) == &pattern(len, seed)[..],
        "memory differs"
    );
}

fn sge(region: &Region, offset: u64, len: u64) -> Sge {
    Sge {
        addr: region.addr + offset,
        len,
        lkey: region.lkey,
    }
}

fn remote(region: &Region, offset: u64) -> RemoteAddr {
    RemoteAddr {
        addr: region.addr + offset,
        rkey: region.rkey,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn only(mut wcs: Vec<WorkCompletion>) -> WorkCompletion {
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    wcs.pop().unwrap()
}

#[test]
fn write_of_every_size_class_lands() {
    for len in [0usize, 1, 8, 4096, 65_420, 65_421, 300_000, 3 << 20] {
        let mut p = pair();
        let src = p.a.mem.alloc(len.max(1), Access::LOCAL_WRITE);
        let dst = p.b.mem.alloc(len.max(1), RW);
        let data = pattern(len, 3);
        p.a.mem.fill(&src, 0, &data);
        let wr = SendWr {
            wr_id: 1,
            local: sge(&src, 0, len as u64),
            op: SendOp::Write {
                remote: remote(&dst, 0),
            },
        };
        p.a.post_send(wr).unwrap();
        assert!(p.drive(STEPS));
        let wc = only(p.a.take_completions());
        assert_eq!(
            (wc.status, wc.opcode, wc.byte_len),
            (WcStatus::Success, WcOpcode::RdmaWrite, len as u64)
        );
        assert!(p.b.mem.bytes(&dst, 0, len) == &data[..], "len {len}");
        assert!(
            p.b.take_completions().is_empty(),
            "a WRITE consumes no receive"
        );
    }
}

/// Only WRITEs go through `Memory::place_write`, each part with its whole message's length:
/// that is how the engine tells a WRITE it may stream past the caches from a receive or a READ
/// response, which the side that asked for it reads next.
#[test]
fn only_writes_are_placed_as_writes_with_their_message_length() {
    let mut p = pair();
    let src = p.a.mem.alloc(300_000, Access::LOCAL_WRITE);
    let rbuf = p.b.mem.alloc(300_000, RW);
    let dst = p.b.mem.alloc(300_000, RW);
    p.a.mem.fill(&src, 0, &pattern(300_000, 4));
    p.b.mem.fill(&dst, 0, &pattern(300_000, 5));
    p.b.post_recv(RecvWr {
        wr_id: 1,
        local: sge(&rbuf, 0, 300_000),
    })
    .unwrap();
    p.b.post_recv(RecvWr {
        wr_id: 2,
        local: sge(&rbuf, 0, 0),
    })
    .unwrap();
    let ops = [
        (300_000, SendOp::Send { imm: None }),
        (
            200_000,
            SendOp::Write {
                remote: remote(&dst, 1),
            },
        ),
        (
            100_000,
            SendOp::WriteWithImm {
                remote: remote(&dst, 3),
                imm: 9,
            },
        ),
        (
            150_000,
            SendOp::Read {
                remote: remote(&dst, 0),
            },
        ),
    ];
    for (i, (len, op)) in ops.into_iter().enumerate() {
        p.a.post_send(SendWr {
            wr_id: 10 + i as u64,
            local: sge(&src, 0, len),
            op,
        })
        .unwrap();
    }
    assert!(p.drive(STEPS));
    let done = p.a.take_completions();
    assert!(
        done.iter().all(|w| w.status == WcStatus::Success),
        "{done:?}"
    );
    assert_eq!(done.len(), 4);
    // The READ response landed on `a`, the SEND in a posted receive on `b`: neither as a write.
    assert!(p.a.mem.placed_as_writes.is_empty());
    assert_eq!(
        p.b.mem.placed_as_writes,
        [(200_000, 200_000), (100_000, 100_000)]
            .into_iter()
            .collect(),
        "only the two WRITEs' bytes, each with its message's length"
    );
}

#[test]
fn read_returns_remote_bytes() {
    let mut p = pair();
    let src = p.b.mem.alloc(200_000, RW);
    let dst = p.a.mem.alloc(200_000, Access::LOCAL_WRITE);
    let data = pattern(200_000, 9);
    p.b.mem.fill(&src, 0, &data);
    let wr = SendWr {
        wr_id: 5,
        local: sge(&dst, 100, 150_000),
        op: SendOp::Read {
            remote: remote(&src, 7),
        },
    };
    p.a.post_send(wr).unwrap();
    assert!(p.drive(STEPS));
    let wc = only(p.a.take_completions());
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (5, WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert!(
        p.a.mem.bytes(&dst, 100, 150_000) == &data[7..150_007],
        "memory differs"
    );
}

#[test]
fn send_with_imm_and_write_with_imm_consume_receives_in_order() {
    let mut p = pair();
    let src = p.a.mem.alloc(1000, Access::LOCAL_WRITE);
    let rbuf = p.b.mem.alloc(1000, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(1000, RW);
    p.a.mem.fill(&src, 0, &pattern(1000, 1));
    p.b.post_recv(RecvWr {
        wr_id: 100,
        local: sge(&rbuf, 0, 1000),
    })
    .unwrap();
    p.b.post_recv(RecvWr {
        wr_id: 101,
        local: sge(&rbuf, 0, 0),
    })
    .unwrap();
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&src, 0, 600),
        op: SendOp::Send { imm: Some(0xfeed) },
    })
    .unwrap();
    p.a.post_send(SendWr {
        wr_id: 2,
        local: sge(&src, 0, 1000),
        op: SendOp::WriteWithImm {
            remote: remote(&dst, 0),
            imm: 77,
        },
    })
    .unwrap();
    assert!(p.drive(STEPS));
    let a = p.a.take_completions();
    assert_eq!(
        a.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let b = p.b.take_completions();
    assert_eq!(b.len(), 2);
    assert_eq!(
        (b[0].wr_id, b[0].opcode, b[0].byte_len, b[0].imm),
        (100, WcOpcode::Recv, 600, Some(0xfeed))
    );
    assert_eq!(
        (b[1].wr_id, b[1].opcode, b[1].byte_len, b[1].imm),
        (101, WcOpcode::RecvRdmaWithImm, 1000, Some(77))
    );
    assert!(
        p.b.mem.bytes(&rbuf, 0, 600) == &pattern(1000, 1)[..600],
        "memory differs"
    );
    assert!(
        p.b.mem.bytes(&dst, 0, 1000) == &pattern(1000, 1)[..],
        "memory differs"
    );
}

/// The buffer a receiver may receive the next datagram into is the oldest receive's, once a
/// new message is due, while the peer's messages are SENDs; a WRITE_WITH_IMM turns the guess
/// off until the next SEND.
#[test]
fn the_next_receive_buffer_is_offered_while_the_peer_sends() {
    let mut p = pair();
    let src = p.a.mem.alloc(4000, Access::LOCAL_WRITE);
    let rbuf = p.b.mem.alloc(4000, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(4000, RW);
    let recv = |p: &mut Pair, id: u64, offset: u64, len: u64| {
        p.b.post_recv(RecvWr {
            wr_id: id,
            local: sge(&rbuf, offset, len),
        })
        .unwrap();
    };
    let send = |p: &mut Pair, id: u64, op: SendOp| {
        p.a.post_send(SendWr {
            wr_id: id,
            local: sge(&src, 0, 1000),
            op,
        })
        .unwrap();
        assert!(p.drive(STEPS));
        assert_eq!(p.a.take_completions().len(), 1);
        assert_eq!(p.b.take_completions().len(), 1);
    };
    assert_eq!(
        p.b.conn.next_receive_buffer(&p.b.mem, 1),
        None,
        "none posted"
    );
    recv(&mut p, 1, 100, 2000);
    assert_eq!(
        p.b.conn.next_receive_buffer(&p.b.mem, 1),
        Some((rbuf.id, 100..2100))
    );
    send(&mut p, 1, SendOp::Send { imm: None });
    assert_eq!(p.b.conn.next_receive_buffer(&p.b.mem, 1), None, "taken");

    recv(&mut p, 2, 0, 2000);
    send(
        &mut p,
        2,
        SendOp::WriteWithImm {
            remote: remote(&dst, 0),
            imm: 7,
        },
    );
    recv(&mut p, 3, 0, 2000);
    assert_eq!(
        p.b.conn.next_receive_buffer(&p.b.mem, 1),
        None,
        "the peer writes now"
    );
    send(&mut p, 3, SendOp::Send { imm: None });
    recv(&mut p, 4, 500, 1500);
    assert_eq!(
        p.b.conn.next_receive_buffer(&p.b.mem, 1),
        Some((rbuf.id, 500..2000)),
        "the peer sends again"
    );
    assert_eq!(
        p.b.conn.next_receive_buffer(&p.b.mem, 1501),
        None,
        "shorter than asked for"
    );
}

#[test]
fn atomics_return_the_original_and_apply_once() {
    let mut p = pair();
    let target = p.b.mem.alloc(64, RW);
    p.b.mem.fill(&target, 8, &10u64.to_le_bytes());
    let result = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    let ops = [
        SendOp::FetchAdd {
            remote: remote(&target, 8),
            add: 5,
        },
        SendOp::CmpSwap {
            remote: remote(&target, 8),
            compare: 15,
            swap: 100,
        },
        SendOp::CmpSwap {
            remote: remote(&target, 8),
            compare: 15,
            swap: 7,
        },
    ];
    for (i, op) in ops.into_iter().enumerate() {
        p.a.post_send(SendWr {
            wr_id: i as u64,
            local: sge(&result, 8 * i as u64, 8),
            op,
        })
        .unwrap();
    }
    assert!(p.drive(STEPS));
    assert!(
        p.a.take_completions()
            .iter()
            .all(|w| w.status == WcStatus::Success)
    );
    let word = |m: &crate::sim::SimMemory, r: &Region, off| {
        u64::from_le_bytes(m.bytes(r, off, 8).try_into().unwrap())
    };
    assert_eq!(word(&p.a.mem, &result, 0), 10);
    assert_eq!(word(&p.a.mem, &result, 8), 15);
    assert_eq!(
        word(&p.a.mem, &result, 16),
        100,
        "failed compare still returns the original"
    );
    assert_eq!(word(&p.b.mem, &target, 8), 100);
}

#[test]
fn fetch_add_executes_exactly_once_under_loss_and_duplication() {
    let link = LinkConfig {
        loss: 0.2,
        duplicate: 0.3,
        jitter: Duration::from_micros(20),
        ..LinkConfig::default()
    };
    let config = Config {
        max_retries: 30,
        ..Config::default()
    };
    let mut p = pair_with(link, config);
    let target = p.b.mem.alloc(8, RW);
    let result = p.a.mem.alloc(8 * 200, Access::LOCAL_WRITE);
    for i in 0..200u64 {
        let op = SendOp::FetchAdd {
            remote: remote(&target, 0),
            add: 1,
        };
        p.a.post_send(SendWr {
            wr_id: i,
            local: sge(&result, 8 * i, 8),
            op,
        })
        .unwrap();
    }
    assert!(p.drive(STEPS));
    let wcs = p.a.take_completions();
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
    assert_eq!(
        u64::from_le_bytes(p.b.mem.bytes(&target, 0, 8).try_into().unwrap()),
        200
    );
    // Each fetch saw a distinct value, in post order.
    for i in 0..200u64 {
        assert_eq!(
            u64::from_le_bytes(
                p.a.mem
                    .bytes(&result, 8 * i as usize, 8)
                    .try_into()
                    .unwrap()
            ),
            i
        );
    }
    assert!(
        p.a.conn.stats().retransmits > 0 && p.b.conn.stats().duplicates > 0,
        "faults were exercised"
    );
}

#[test]
fn send_without_receive_retries_then_fails_with_rnr() {
    let mut p = pair();
    let src = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    p.a.post_send(SendWr {
        wr_id: 9,
        local: sge(&src, 0, 64),
        op: SendOp::Send { imm: None },
    })
    .unwrap();
    p.a.post_send(SendWr {
        wr_id: 10,
        local: sge(&src, 0, 64),
        op: SendOp::Send { imm: None },
    })
    .unwrap();
    assert!(p.drive(STEPS));
    let wcs = p.a.take_completions();
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(9, WcStatus::RnrRetryExceeded), (10, WcStatus::Flushed)]
    );
    assert_eq!(p.a.conn.state(), ConnectionState::Error);
    assert_eq!(
        p.a.events.last(),
        Some(&Event::Failed(ConnectionError::RnrRetryExceeded))
    );
    assert!(p.b.conn.stats().rnr_naks_sent >= 7);
}

#[test]
fn send_succeeds_when_receive_is_posted_during_rnr_backoff() {
    let mut p = pair();
    let src = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    let rbuf = p.b.mem.alloc(64, Access::LOCAL_WRITE);
    p.a.post_send(SendWr {
        wr_id: 9,
        local: sge(&src, 0, 64),
        op: SendOp::Send { imm: None },
    })
    .unwrap();
    p.drive_until(STEPS, |p| p.b.conn.stats().rnr_naks_sent >= 2);
    p.b.post_recv(RecvWr {
        wr_id: 1,
        local: sge(&rbuf, 0, 64),
    })
    .unwrap();
    assert!(p.drive(STEPS));
    assert_eq!(only(p.a.take_completions()).status, WcStatus::Success);
    assert_eq!(only(p.b.take_completions()).status, WcStatus::Success);
}

#[test]
fn receive_too_small_fails_both_sides() {
    let mut p = pair();
    let src = p.a.mem.alloc(100, Access::LOCAL_WRITE);
    let rbuf = p.b.mem.alloc(100, Access::LOCAL_WRITE);
    p.b.post_recv(RecvWr {
        wr_id: 1,
        local: sge(&rbuf, 0, 10),
    })
    .unwrap();
    p.b.post_recv(RecvWr {
        wr_id: 2,
        local: sge(&rbuf, 0, 100),
    })
    .unwrap();
    p.a.post_send(SendWr {
        wr_id: 3,
        local: sge(&src, 0, 100),
        op: SendOp::Send { imm: None },
    })
    .unwrap();
    assert!(p.drive(STEPS));
    assert_eq!(
        only(p.a.take_completions()).status,
        WcStatus::RemoteInvalidRequest
    );
    let b = p.b.take_completions();
    assert_eq!(
        b.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::LocalLength), (2, WcStatus::Flushed)]
    );
    assert_eq!(p.b.conn.state(), ConnectionState::Error);
    assert_eq!(
        p.b.mem.bytes(&rbuf, 0, 100),
        &[0u8; 100][..],
        "nothing placed"
    );
}

/// Each protection failure: the requester gets a remote-access error, the target is untouched
/// byte for byte, and the responder's connection enters the error state.
#[test]
fn protection_failures_touch_no_byte() {
    type Case = fn(&mut Pair, &Region, &Region) -> SendOp;
    let cases: [(&str, Case); 7] = [
        ("unknown rkey", |_, _, dst| SendOp::Write {
            remote: RemoteAddr {
                addr: dst.addr,
                rkey: dst.rkey ^ 0x5a5a,
            },
        }),
        ("lkey used as rkey", |_, _, dst| SendOp::Write {
            remote: RemoteAddr {
                addr: dst.addr,
                rkey: dst.lkey,
            },
        }),
        ("write past the end", |_, _, dst| SendOp::Write {
            remote: remote(dst, 4096 - 100),
        }),
        ("write before the start", |_, _, dst| SendOp::Write {
            remote: RemoteAddr {
                addr: dst.addr - 1,
                rkey: dst.rkey,
            },
        }),
        ("write without REMOTE_WRITE", |p, _, _| {
            let ro =
                p.b.mem
                    .alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_READ);
            SendOp::Write {
                remote: remote(&ro, 0),
            }
        }),
        ("atomic without REMOTE_ATOMIC", |p, _, _| {
            let ro =
                p.b.mem
                    .alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
            SendOp::FetchAdd {
                remote: remote(&ro, 0),
                add: 1,
            }
        }),
        ("revoked region", |p, _, dst| {
            p.b.mem.deregister(dst);
            SendOp::Write {
                remote: remote(dst, 0),
            }
        }),
    ];
    for (name, make) in cases {
        let mut p = pair();
        let src = p.a.mem.alloc(4096, Access::LOCAL_WRITE);
        p.a.mem.fill(&src, 0, &pattern(4096, 1));
        let dst = p.b.mem.alloc(4096, RW);
        p.b.mem.fill(&dst, 0, &pattern(4096, 2));
        let op = make(&mut p, &src, &dst);
        let before = snapshot(&p);
        let len = if matches!(op, SendOp::FetchAdd { .. }) {
            8
        } else {
            200
        };
        p.a.post_send(SendWr {
            wr_id: 1,
            local: sge(&src, 0, len),
            op,
        })
        .unwrap();
        p.a.post_send(SendWr {
            wr_id: 2,
            local: sge(&src, 0, 8),
            op: SendOp::Write {
                remote: remote(&dst, 0),
            },
        })
        .unwrap();
        assert!(p.drive(STEPS), "{name}");
        let wcs = p.a.take_completions();
        assert_eq!(
            wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            vec![(1, WcStatus::RemoteAccess), (2, WcStatus::Flushed)],
            "{name}"
        );
        assert!(snapshot(&p) == before, "{name}: target memory changed");
        assert_eq!(p.b.conn.state(), ConnectionState::Error, "{name}");
        assert_eq!(p.a.conn.state(), ConnectionState::Error, "{name}");
    }

    fn snapshot(p: &Pair) -> Vec<Vec<u8>> {
        use crate::memory::Memory;
        p.b.mem
            .table()
            .regions()
            .map(|r| p.b.mem.bytes(r, 0, r.len as usize).to_vec())
            .collect()
    }
}

#[test]
fn read_without_permission_and_misaligned_atomic_are_refused() {
    let mut p = pair();
    let wo = p.b.mem.alloc(
        64,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
    );
    let dst = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&dst, 0, 8),
        op: SendOp::Read {
            remote: remote(&wo, 0),
        },
    })
    .unwrap();
    assert!(p.drive(STEPS));
    assert_eq!(only(p.a.take_completions()).status, WcStatus::RemoteAccess);

    let mut p = pair();
    let t = p.b.mem.alloc(64, RW);
    let dst = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&dst, 0, 8),
        op: SendOp::FetchAdd {
            remote: remote(&t, 4),
            add: 1,
        },
    })
    .unwrap();
    assert!(p.drive(STEPS));
    assert_eq!(
        only(p.a.take_completions()).status,
        WcStatus::RemoteInvalidRequest
    );
    assert_eq!(p.b.mem.bytes(&t, 0, 64), &[0u8; 64][..]);
}

#[test]
fn bad_local_key_fails_in_order_after_earlier_requests() {
    let mut p = pair();
    let src = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(64, RW);
    let ok = SendWr {
        wr_id: 1,
        local: sge(&src, 0, 8),
        op: SendOp::Write {
            remote: remote(&dst, 0),
        },
    };
    let bad = SendWr {
        wr_id: 2,
        local: Sge {
            lkey: src.lkey ^ 1,
            ..sge(&src, 0, 8)
        },
        ..ok
    };
    p.a.post_send(ok).unwrap();
    p.a.post_send(bad).unwrap();
    p.a.post_send(SendWr { wr_id: 3, ..ok }).unwrap();
    assert!(p.drive(STEPS));
    let wcs = p.a.take_completions();
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::LocalProtection),
            (3, WcStatus::Flushed)
        ]
    );
}

#[test]
fn posting_to_a_failed_connection_flushes() {
    let mut p = pair();
    p.a.conn.close(p.now);
    let src = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    p.a.post_send(SendWr {
        wr_id: 4,
        local: sge(&src, 0, 8),
        op: SendOp::Send { imm: None },
    })
    .unwrap();
    p.a.post_recv(RecvWr {
        wr_id: 5,
        local: sge(&src, 0, 8),
    })
    .unwrap();
    let wcs = p.a.take_completions();
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(4, WcStatus::Flushed), (5, WcStatus::Flushed)]
    );
}

#[test]
fn close_reaches_the_peer() {
    let mut p = pair();
    let rbuf = p.b.mem.alloc(64, Access::LOCAL_WRITE);
    p.b.post_recv(RecvWr {
        wr_id: 1,
        local: sge(&rbuf, 0, 64),
    })
    .unwrap();
    p.a.conn.close(p.now);
    assert!(p.drive(STEPS));
    assert_eq!(
        p.b.events.last(),
        Some(&Event::Failed(ConnectionError::ClosedByPeer))
    );
    assert_eq!(only(p.b.take_completions()).status, WcStatus::Flushed);
}

#[test]
fn link_cut_for_good_fails_everything_within_the_retry_budget() {
    let mut p = pair();
    let src = p.a.mem.alloc(1 << 20, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(1 << 20, RW);
    let rbuf = p.b.mem.alloc(64, Access::LOCAL_WRITE);
    p.b.post_recv(RecvWr {
        wr_id: 77,
        local: sge(&rbuf, 0, 64),
    })
    .unwrap();
    let cut_at = p.now + Duration::from_micros(50);
    p.link_config_mut().outages.push((cut_at, None));
    for i in 0..10 {
        p.a.post_send(SendWr {
            wr_id: i,
            local: sge(&src, 0, 1 << 20),
            op: SendOp::Write {
                remote: remote(&dst, 0),
            },
        })
        .unwrap();
    }
    assert!(p.drive(STEPS));
    let wcs = p.a.take_completions();
    let statuses: Vec<WcStatus> = wcs.iter().map(|w| w.status).collect();
    let first_error = statuses
        .iter()
        .position(|s| *s != WcStatus::Success)
        .expect("some request failed");
    assert_eq!(statuses[first_error], WcStatus::RetryExceeded);
    assert!(
        statuses[first_error + 1..]
            .iter()
            .all(|s| *s == WcStatus::Flushed),
        "{statuses:?}"
    );
    assert_eq!(wcs.len(), 10);
    let budget = Config::default().retry_budget();
    assert!(
        p.now <= cut_at + budget + Config::default().idle_timeout,
        "failed at {:?}",
        p.now
    );
    assert_eq!(
        p.a.events.last(),
        Some(&Event::Failed(ConnectionError::RetryExceeded))
    );
    // The passive side, with nothing outstanding, notices the silence by keep-alive.
    let failed_at = p.now;
    p.advance(Config::default().idle_timeout, STEPS);
    assert_eq!(p.b.conn.state(), ConnectionState::Error);
    assert_eq!(
        p.b.events.last(),
        Some(&Event::Failed(ConnectionError::PeerSilent))
    );
    assert!(p.now <= failed_at + Config::default().idle_timeout);
    assert_eq!(only(p.b.take_completions()).status, WcStatus::Flushed);
}

#[test]
fn a_short_outage_is_survived() {
    let mut p = pair();
    let src = p.a.mem.alloc(1 << 20, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(1 << 20, RW);
    p.a.mem.fill(&src, 0, &pattern(1 << 20, 4));
    let start = p.now;
    p.link_config_mut()
        .outages
        .push((start, Some(start + Duration::from_millis(20))));
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&src, 0, 1 << 20),
        op: SendOp::Write {
            remote: remote(&dst, 0),
        },
    })
    .unwrap();
    assert!(p.drive(STEPS));
    assert_eq!(only(p.a.take_completions()).status, WcStatus::Success);
    assert!(
        p.b.mem.bytes(&dst, 0, 1 << 20) == &pattern(1 << 20, 4)[..],
        "memory differs"
    );
    assert!(p.link_stats().lost_in_outage > 0);
}

#[test]
fn idle_connection_survives_on_keepalives_and_detects_a_silent_peer() {
    let mut p = pair();
    p.advance(Duration::from_secs(10), STEPS);
    assert_eq!(
        p.a.conn.state(),
        ConnectionState::Established,
        "keep-alives keep an idle link up"
    );
    assert_eq!(p.b.conn.state(), ConnectionState::Established);
    let now = p.now;
    p.link_config_mut().outages.push((now, None));
    p.advance(Duration::from_secs(10), STEPS);
    assert_eq!(
        p.a.events.last(),
        Some(&Event::Failed(ConnectionError::PeerSilent))
    );
    assert_eq!(
        p.b.events.last(),
        Some(&Event::Failed(ConnectionError::PeerSilent))
    );
}

#[test]
fn handshake_to_nobody_times_out() {
    let link = LinkConfig {
        outages: vec![(Time::ZERO, None)],
        ..LinkConfig::default()
    };
    let mut p = Pair::new(PairConfig {
        link,
        ..PairConfig::default()
    });
    p.drive(STEPS);
    assert_eq!(
        p.a.events,
        vec![Event::Failed(ConnectionError::ConnectTimeout)]
    );
    assert_eq!(
        p.b.events,
        vec![Event::Failed(ConnectionError::ConnectTimeout)]
    );
}

#[test]
fn sender_never_exceeds_the_receivers_window() {
    let config = Config {
        window: 4,
        max_datagram: 1500,
        ..Config::default()
    };
    let link = LinkConfig {
        latency: Duration::from_micros(100),
        ..LinkConfig::default()
    };
    let mut p = pair_with(link, config);
    let src = p.a.mem.alloc(200_000, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(200_000, RW);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&src, 0, 200_000),
        op: SendOp::Write {
            remote: remote(&dst, 0),
        },
    })
    .unwrap();
    // What the window bounds: the packets on their way that the receiver has not had yet
    // (a resent copy of one it has takes none of its window).
    let mut max_in_flight = 0;
    p.drive_until(STEPS, |p| {
        let expected = p.b.conn.rx.expected();
        let new_to_b = p
            .psns_in_flight_towards_b()
            .into_iter()
            .filter(|psn| !psn.before(expected))
            .count();
        max_in_flight = max_in_flight.max(new_to_b);
        p.a.conn.outstanding_sends() == 0
    });
    assert!(
        max_in_flight <= 4,
        "{max_in_flight} packets in flight with a window of 4"
    );
    assert!(max_in_flight >= 3, "the window is used");
    assert_eq!(p.b.conn.stats().out_of_order_dropped, 0);
}

#[test]
fn corrupted_and_foreign_datagrams_are_dropped() {
    let link = LinkConfig {
        corrupt: 0.3,
        ..LinkConfig::default()
    };
    // The simulated link corrupts undetected, so the payload needs the digest.
    let config = Config {
        max_retries: 30,
        data_digest: true,
        ..Config::default()
    };
    let mut p = pair_with(link, config);
    write_whole(&mut p, 1 << 20, 8);
    assert!(p.b.conn.stats().corrupted > 0);
}

#[test]
fn write_after_read_does_not_overtake_it() {
    let config = Config {
        max_datagram: 1472,
        ..Config::default()
    };
    let mut p = pair_with(LinkConfig::default(), config);
    let src = p.b.mem.alloc(2 << 20, RW);
    let dst = p.a.mem.alloc(2 << 20, Access::LOCAL_WRITE);
    let data = pattern(2 << 20, 9);
    p.b.mem.fill(&src, 0, &data);
    let wr = SendWr {
        wr_id: 5,
        local: sge(&dst, 0, 240319),
        op: SendOp::Read {
            remote: remote(&src, 721287),
        },
    };
    p.a.post_send(wr).unwrap();
    let w = SendWr {
        wr_id: 6,
        local: sge(&dst, 1000000, 1),
        op: SendOp::Write {
            remote: remote(&src, 901505),
        },
    };
    p.a.post_send(w).unwrap();
    let settled = p.drive(STEPS);
    let wcs = p.a.take_completions();
    assert!(
        settled,
        "{:?} {:?} {:?} {:?} {:?}",
        p.now,
        p.a.conn.stats(),
        wcs,
        p.a.conn.outstanding_sends(),
        p.b.conn.stats()
    );
    let got = p.a.mem.bytes(&dst, 0, 240319);
    let want = &data[721287..721287 + 240319];
    let diff = got.iter().zip(want).position(|(a, b)| a != b);
    assert_eq!(diff, None, "{:?}", p.a.take_completions());
}

/// Drives `p` until its eight WRITEs of 1 MiB from `a` have completed, and checks that they
/// succeeded and that `dst` holds `data`.
fn drive_to_eight_written(p: &mut Pair, dst: &Region, data: &[u8]) {
    assert!(p.drive(STEPS));
    let wcs = p.a.take_completions();
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert_eq!(wcs.len(), 8);
    assert!(p.b.mem.bytes(dst, 0, 8 << 20) == data, "memory differs");
}

#[test]
fn two_rails_stripe_and_survive_one_going_down() {
    let mut p = Pair::with_rails(
        PairConfig {
            seed: 9,
            ..PairConfig::default()
        },
        2,
    );
    assert_eq!(p.a.conn.state(), ConnectionState::Established);
    let src = p.a.mem.alloc(8 << 20, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(8 << 20, RW);
    let data = pattern(8 << 20, 6);
    p.a.mem.fill(&src, 0, &data);
    for i in 0..8u64 {
        let wr = SendWr {
            wr_id: i,
            local: sge(&src, i << 20, 1 << 20),
            op: SendOp::Write {
                remote: remote(&dst, i << 20),
            },
        };
        p.a.post_send(wr).unwrap();
    }
    // Let a few megabytes flow over both rails, then cut rail 1 for good.
    p.drive_until(STEPS, |p| p.rail_stats(1).sent > 20);
    let now = p.now;
    p.rail_config_mut(1).outages.push((now, None));
    drive_to_eight_written(&mut p, &dst, &data);
    let (sent, failovers) = p.a.conn.path_stats();
    assert!(
        sent[0] > 0 && sent[1] > 0,
        "both rails carried traffic: {sent:?}"
    );
    assert!(
        failovers >= 1 && !p.a.conn.path_is_up(1),
        "rail 1 declared down"
    );
    // Restore the rail: probes find it and striping resumes.
    p.rail_config_mut(1).outages.clear();
    p.advance(Duration::from_millis(300), STEPS);
    assert!(p.a.conn.path_is_up(1), "rail 1 back up after probing");
}

/// `count` WRITEs of `1 << shift` bytes striped over two rails, rail 1 `skew` slower than rail
/// 0 and `rail0_loss` of rail 0's datagrams lost; checks that all complete and land, and
/// returns what the sender and the receiver counted, and what each rail lost.
fn stripe_over_a_slow_rail(
    (count, shift): (u64, u32),
    skew: Duration,
    rail0_loss: f64,
    seed: u64,
) -> Striped {
    let mut p = Pair::with_rails(
        PairConfig {
            seed,
            ..PairConfig::default()
        },
        2,
    );
    assert_eq!(p.a.conn.state(), ConnectionState::Established);
    p.rail_config_mut(1).latency += skew;
    p.rail_config_mut(0).loss = rail0_loss;
    let len = (count << shift) as usize;
    let src = p.a.mem.alloc(len, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(len, RW);
    let data = pattern(len, 11);
    p.a.mem.fill(&src, 0, &data);
    for i in 0..count {
        p.a.post_send(SendWr {
            wr_id: i,
            local: sge(&src, i << shift, 1 << shift),
            op: SendOp::Write {
                remote: remote(&dst, i << shift),
            },
        })
        .unwrap();
    }
    assert!(p.drive(STEPS));
    let wcs = p.a.take_completions();
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert_eq!(wcs.len() as u64, count);
    assert!(p.b.mem.bytes(&dst, 0, len) == data, "memory differs");
    Striped {
        sender: *p.a.conn.stats(),
        receiver: *p.b.conn.stats(),
        lost: [p.rail_stats(0).lost, p.rail_stats(1).lost],
    }
}

/// What [`stripe_over_a_slow_rail`] counted.
struct Striped {
    sender: crate::Stats,
    receiver: crate::Stats,
    lost: [u64; 2],
}

/// Eight WRITEs of 1 MiB: 16 full packets each.
const EIGHT_MIB: (u64, u32) = (8, 20);
/// 128 WRITEs of 64 KiB: a full packet and a short tail each, one on each rail.
const SMALL_WRITES: (u64, u32) = (128, 16);

/// Over lossless rails: nothing was resent but tail probes (a probe may go when the last
/// packet took the slower rail: it is not answered loss), and no timeout fired.
fn assert_nothing_resent_but_probes(stats: &crate::Stats) {
    assert_eq!(
        stats.retransmits - stats.tail_probes,
        0,
        "nothing was lost: {stats:?}"
    );
    assert_eq!(stats.timeouts, 0, "{stats:?}");
}

#[test]
fn a_slower_rail_is_reordering_not_loss() {
    // Rail 1 a quarter of a millisecond behind rail 0: the receiver sees gaps at every message
    // boundary and reports them, and each is a packet still on rail 1.
    let stats = stripe_over_a_slow_rail(EIGHT_MIB, Duration::from_micros(250), 0.0, 5).sender;
    assert!(
        stats.naks_for_reordering > 0,
        "the receiver reported gaps: {stats:?}"
    );
    assert_nothing_resent_but_probes(&stats);
}

#[test]
fn a_loss_on_the_faster_rail_is_not_answered_by_resending_the_slower_one() {
    // 2 % of rail 0's datagrams lost, and rail 1 a quarter of a millisecond behind. Answering
    // every gap report with a go-back resent the 128 datagrams of the transfer about ten times
    // over (1 093-1 294 resends for 37-59 lost, these seeds); resending only what a later
    // packet on the same rail shows lost, 1-277. (Most of those are datagrams the receiver
    // itself dropped while its stash of early packets was full.)
    for seed in 0..4 {
        let Striped {
            sender: stats,
            lost,
            ..
        } = stripe_over_a_slow_rail(EIGHT_MIB, Duration::from_micros(250), 0.02, seed);
        assert!(lost[0] > 0, "seed {seed}: rail 0 lost datagrams");
        assert!(
            stats.retransmits < 3 * 128,
            "seed {seed}: {} resent for {lost:?} lost: {stats:?}",
            stats.retransmits
        );
    }
}

#[test]
fn a_tail_probe_on_the_slower_rail_is_no_sign_of_loss_on_it() {
    // Half a millisecond of skew: the tail probe fires before rail 1's packets arrive and
    // goes out on rail 1. When the first copy of the probed packet arrives, it is no sign
    // that the packets sent on rail 1 before the probe are lost: they may be behind it, and
    // were. Counting it as one resent 596 packets of these 256. (The links are lossless, so
    // the seed changes nothing.)
    let stats = stripe_over_a_slow_rail(SMALL_WRITES, Duration::from_micros(500), 0.0, 0).sender;
    assert!(stats.tail_probes > 0, "a probe went: {stats:?}");
    assert_nothing_resent_but_probes(&stats);
}

#[test]
fn two_rails_hold_early_packets_for_each_rail() {
    // A millisecond of skew: rail 0 brings 33-64 packets of later messages before each gap on
    // rail 1 fills. A stash of 32 for the connection threw 106 of them away, and 140 were
    // resent, after 3 timeouts; 32 per rail keeps them all. (Lossless links: the seed changes
    // nothing.)
    let Striped {
        sender, receiver, ..
    } = stripe_over_a_slow_rail(SMALL_WRITES, Duration::from_millis(1), 0.0, 0);
    assert!(
        receiver.out_of_order_stashed > 32,
        "more than 32 came early: {receiver:?}"
    );
    assert_eq!(receiver.out_of_order_dropped, 0, "{receiver:?}");
    assert_nothing_resent_but_probes(&sender);
}

#[test]
fn tiny_datagrams_still_carry_acks() {
    // A small datagram limit must shorten the ACK's selective blocks, never overflow it.
    let config = Config {
        max_datagram: 80,
        window: 64,
        ..Config::default()
    };
    let link = LinkConfig {
        loss: 0.3,
        jitter: Duration::from_micros(50),
        mtu: 80,
        ..LinkConfig::default()
    };
    let mut p = Pair::new(PairConfig {
        seed: 0,
        config_a: config.clone(),
        config_b: Config {
            max_retries: 30,
            ..config
        },
        link,
    });
    if p.a.conn.state() != ConnectionState::Established {
        panic!("the handshake failed: the test needs an established pair");
    }
    let src = p.a.mem.alloc(1600, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(1600, RW);
    for i in 0..4 {
        let wr = SendWr {
            wr_id: i,
            local: sge(&src, 400 * i, 400),
            op: SendOp::Write {
                remote: remote(&dst, 400 * i),
            },
        };
        p.a.post_send(wr).unwrap();
    }
    p.drive(STEPS);
}

/// Ping-pong of 64 KiB WRITEs (two packets each), each side answering as soon as the data
/// lands (before acknowledgements settle), with delays that now and then exceed the
/// retransmission timeout (spurious timeouts, as a paused VM produces): never a failure.
#[test]
fn pingpong_of_two_packet_writes_survives_spurious_timeouts() {
    for (seed, jitter_us) in [(0u64, 0u64), (1, 300), (2, 1500), (3, 1500)] {
        let link = LinkConfig {
            jitter: Duration::from_micros(jitter_us),
            ..LinkConfig::default()
        };
        let mut p = Pair::new(PairConfig {
            seed,
            config_a: Config::default(),
            config_b: Config::default(),
            link,
        });
        let a_buf = p.a.mem.alloc(65536, RW);
        let b_buf = p.b.mem.alloc(65536, RW);
        for i in 1..=400u64 {
            let from_a = i % 2 == 1;
            let (src, dst) = if from_a {
                (&a_buf, &b_buf)
            } else {
                (&b_buf, &a_buf)
            };
            let wr = SendWr {
                wr_id: i,
                local: sge(src, 0, 65536),
                op: SendOp::Write {
                    remote: remote(dst, 0),
                },
            };
            if from_a {
                p.a.mem.fill(&a_buf, 65528, &i.to_le_bytes());
                p.a.post_send(wr).unwrap();
            } else {
                p.b.mem.fill(&b_buf, 65528, &i.to_le_bytes());
                p.b.post_send(wr).unwrap();
            }
            let landed = p.drive_until(STEPS, |p| {
                let mem = if from_a {
                    p.b.mem.bytes(&b_buf, 65528, 8)
                } else {
                    p.a.mem.bytes(&a_buf, 65528, 8)
                };
                mem == i.to_le_bytes()
            });
            let failed = [&p.a.events, &p.b.events]
                .iter()
                .any(|e| e.iter().any(|ev| matches!(ev, Event::Failed(_))));
            assert!(
                landed && !failed,
                "seed {seed} iteration {i}: {:?} {:?}\n{:?}\n{:?}",
                p.a.events,
                p.b.events,
                p.a.conn.stats(),
                p.b.conn.stats()
            );
        }
        assert!(p.drive(STEPS));
        for wc in
            p.a.take_completions()
                .iter()
                .chain(p.b.take_completions().iter())
        {
            assert_eq!(wc.status, WcStatus::Success, "seed {seed}");
        }
    }
}

#[test]
fn writes_the_peer_acknowledged_in_its_close_complete_successfully() {
    let mut p = pair();
    let src = p.a.mem.alloc(4096, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(4096, RW);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&src, 0, 4096),
        op: SendOp::Write {
            remote: remote(&dst, 0),
        },
    })
    .unwrap();
    // Deliver the WRITE to b, but not b's ACK: b closes at once, and its CLOSE carries the
    // cumulative acknowledgement.
    p.a.mem.fill(&src, 4095, &[7]);
    p.drive_until(STEPS, |p| p.b.mem.bytes(&dst, 4095, 1) == [7]);
    p.b.conn.close(p.now);
    p.drive(STEPS);
    let wcs = p.a.take_completions();
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success)]
    );
    assert_eq!(
        p.a.events.last(),
        Some(&Event::Failed(ConnectionError::ClosedByPeer))
    );
}

#[test]
fn an_in_order_stream_is_acknowledged_every_ack_every_packets() {
    // One 64-packet message over a perfect link, one packet handled per transmit pass (as a
    // receiver that keeps up with the stream does): about one ACK per `ack_every` packets, not
    // one per packet.
    let config = Config {
        max_datagram: 1024,
        ..Config::default()
    };
    let mut p = pair_with(LinkConfig::default(), config.clone());
    let len = 64 * config.max_payload() as usize;
    let a_buf = p.a.mem.alloc(len, RW);
    let b_buf = p.b.mem.alloc(len, RW);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&a_buf, 0, len as u64),
        op: SendOp::Write {
            remote: remote(&b_buf, 0),
        },
    })
    .unwrap();
    assert!(p.drive(STEPS));
    assert_eq!(p.a.take_completions()[0].status, WcStatus::Success);
    let acks = p.b.conn.stats().acks_sent;
    assert!(
        acks <= 64 / u64::from(config.ack_every) + 1,
        "{acks} ACKs for 64 in-order packets"
    );
}

#[test]
fn a_released_hold_sends_the_ack_without_waiting_for_its_time() {
    // A hold far longer than any retransmission timeout: only the release can end it.
    let config = Config {
        ack_hold: Duration::from_secs(100),
        ..Config::default()
    };
    let mut p = pair_with(LinkConfig::default(), config);
    let a_buf = p.a.mem.alloc(64, RW);
    let b_buf = p.b.mem.alloc(64, RW);
    p.a.mem.fill(&a_buf, 0, &[7; 8]);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&a_buf, 0, 8),
        op: SendOp::Write {
            remote: remote(&b_buf, 0),
        },
    })
    .unwrap();
    assert!(p.drive_until(STEPS, |p| p.b.mem.bytes(&b_buf, 0, 8) == [7; 8]));
    assert!(p.b.conn.ack_held(), "the ACK waits for a reply");
    assert_eq!(p.b.conn.stats().acks_sent, 0);
    p.b.conn.release_held_ack();
    assert!(!p.b.conn.ack_held());
    assert!(p.drive_until(STEPS, |p| p.b.conn.stats().acks_sent > 0));
    assert!(p.drive(STEPS));
    let wcs = p.a.take_completions();
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success)]
    );
    assert_eq!(
        p.a.conn.stats().retransmits,
        0,
        "released before any timeout"
    );
}

#[test]
fn a_held_ack_rides_on_the_reply() {
    for (hold, expect_acks) in [(Duration::ZERO, true), (Duration::from_micros(10), false)] {
        let config = Config {
            ack_hold: hold,
            ..Config::default()
        };
        let mut p = pair_with(LinkConfig::default(), config);
        let a_buf = p.a.mem.alloc(64, RW);
        let b_buf = p.b.mem.alloc(64, RW);
        p.a.post_send(SendWr {
            wr_id: 1,
            local: sge(&a_buf, 0, 8),
            op: SendOp::Write {
                remote: remote(&b_buf, 0),
            },
        })
        .unwrap();
        // b answers as soon as the data lands, as a ping-pong does.
        p.a.mem.fill(&a_buf, 0, &[9; 8]);
        assert!(p.drive_until(STEPS, |p| p.b.mem.bytes(&b_buf, 0, 8) == [9; 8]));
        // One transmit pass goes by before the reply is posted (the application noticing).
        p.step();
        p.b.post_send(SendWr {
            wr_id: 2,
            local: sge(&b_buf, 8, 8),
            op: SendOp::Write {
                remote: remote(&a_buf, 8),
            },
        })
        .unwrap();
        assert!(p.drive(STEPS));
        assert_eq!(
            p.b.conn.stats().acks_sent > 0,
            expect_acks,
            "hold {hold:?}: {:?}",
            p.b.conn.stats()
        );
        let wcs: Vec<_> =
            p.a.take_completions()
                .into_iter()
                .chain(p.b.take_completions())
                .collect();
        assert!(
            wcs.len() == 2 && wcs.iter().all(|w| w.status == WcStatus::Success),
            "{wcs:?}"
        );
    }
}

/// One side of a connection driven by hand, with its memory.
struct HandSide {
    conn: crate::Connection,
    mem: crate::sim::SimMemory,
    completions: Vec<WorkCompletion>,
}

/// Two identical connection pairs fed the same inputs in lockstep: pair 0 sends with
/// `poll_transmit_path` (payloads copied), pair 1 with `poll_transmit_gather` (payloads from
/// `gather_from` bytes left in memory and read back here as the second part). Every datagram of
/// pair 1, assembled, must equal pair 0's byte for byte; the same datagrams are dropped in both
/// (every `drop_every`-th), so retransmissions are compared too.
struct Lockstep {
    now: Time,
    pairs: [[HandSide; 2]; 2],
    gather_from: usize,
    drop_every: u64,
    datagrams: u64,
    gathered: u64,
}

impl Lockstep {
    fn new(config: Config, gather_from: usize, drop_every: u64) -> Lockstep {
        use crate::connection::{ConnectParams, Connection};
        use crate::seq::Psn;
        let params = |local_qpn, remote_qpn, initial_psn| ConnectParams {
            token: 0x5eed,
            local_qpn,
            remote_qpn,
            initial_psn: Psn(initial_psn),
        };
        let side = |active: bool, seed: u64| {
            let conn = if active {
                Connection::connect(config.clone(), params(1, 2, u32::MAX - 20), Time::ZERO)
            } else {
                Connection::accept(config.clone(), params(2, 1, 77), Time::ZERO)
            };
            HandSide {
                conn,
                mem: crate::sim::SimMemory::new(seed),
                completions: Vec::new(),
            }
        };
        let pair = || [side(true, 1), side(false, 2)];
        Lockstep {
            now: Time::ZERO,
            pairs: [pair(), pair()],
            gather_from,
            drop_every,
            datagrams: 0,
            gathered: 0,
        }
    }

    /// Runs `f` on both copies of side `s` (0: the active side).
    fn both<R: PartialEq + std::fmt::Debug>(
        &mut self,
        s: usize,
        mut f: impl FnMut(&mut HandSide) -> R,
    ) -> R {
        let r0 = f(&mut self.pairs[0][s]);
        let r1 = f(&mut self.pairs[1][s]);
        assert_eq!(r0, r1, "the two copies diverged");
        r0
    }

    /// Moves every datagram due, in both directions; returns whether any moved.
    fn exchange(&mut self) -> bool {
        let mut moved = false;
        let mut buf_copied = vec![0u8; 65_536];
        let mut buf_gathered = vec![0u8; 65_536];
        for s in 0..2 {
            loop {
                let now = self.now;
                let copied = {
                    let side = &mut self.pairs[0][s];
                    side.conn
                        .poll_transmit_path(now, &mut buf_copied, &side.mem)
                };
                let gathered = {
                    let side = &mut self.pairs[1][s];
                    side.conn.poll_transmit_gather(
                        now,
                        &mut buf_gathered,
                        &side.mem,
                        self.gather_from,
                    )
                };
                let (copied, gathered) = match (copied, gathered) {
                    (None, None) => break,
                    (Some(c), Some(g)) => (c, g),
                    other => panic!("one copy sent and the other did not: {other:?}"),
                };
                moved = true;
                self.datagrams += 1;
                let mut datagram = buf_gathered[..gathered.len].to_vec();
                if let Some(payload) = gathered.payload {
                    assert!(payload.len >= self.gather_from && payload.len > 0);
                    self.gathered += 1;
                    self.pairs[1][s].mem.with_bytes(
                        payload.region,
                        payload.offset,
                        payload.len,
                        &mut |bytes| datagram.extend_from_slice(bytes),
                    );
                }
                assert_eq!(gathered.datagram_len(), datagram.len());
                assert_eq!((copied.1, gathered.path), (0, 0));
                assert!(
                    datagram[..] == buf_copied[..copied.0],
                    "datagram {} differs ({} vs {} bytes)",
                    self.datagrams,
                    datagram.len(),
                    copied.0
                );
                let packet = crate::wire::decode(&datagram).expect("a datagram that decodes");
                let data = packet.ext.segment().map_or(0, |_| packet.payload.len());
                assert_eq!(
                    gathered.payload.is_some(),
                    data > 0 && data >= self.gather_from,
                    "{data} payload bytes, gathered from {}",
                    self.gather_from
                );
                if self.datagrams % self.drop_every == 0 {
                    continue;
                }
                for (k, bytes) in [(0, &buf_copied[..copied.0]), (1, &datagram[..])] {
                    let peer = &mut self.pairs[k][1 - s];
                    peer.conn.handle_datagram(now, bytes, &mut peer.mem);
                }
            }
        }
        for s in 0..2 {
            self.both(s, |side| {
                while let Some(wc) = side.conn.poll_completion() {
                    side.completions.push(wc);
                }
                side.completions.len()
            });
        }
        moved
    }

    /// Exchanges datagrams and runs deadlines until `done` holds on pair 0.
    fn run(&mut self, mut done: impl FnMut(&[HandSide; 2]) -> bool) {
        for _ in 0..100_000 {
            if done(&self.pairs[0]) {
                return;
            }
            if self.exchange() {
                continue;
            }
            let deadline = self.pairs[0]
                .iter()
                .filter_map(|side| side.conn.poll_timeout())
                .min()
                .expect("a deadline while work is outstanding");
            self.now = self.now.max(deadline);
            for s in 0..2 {
                let now = self.now;
                self.both(s, |side| side.conn.handle_timeout(now));
            }
        }
        panic!("lockstep run did not finish");
    }
}

#[test]
fn gathered_datagrams_are_byte_identical_to_copied_ones() {
    // Payloads of 960 bytes per packet (1000 rounded down to a multiple of 64), so that
    // messages span many packets cheaply.
    let config = Config {
        max_datagram: crate::wire::MAX_HEADER_LEN + 1000,
        ..Config::default()
    };
    for (gather_from, drop_every) in [(0, 7), (1, 5), (500, 11), (960, 3), (usize::MAX, 7)] {
        let mut l = Lockstep::new(config.clone(), gather_from, drop_every);
        l.run(|p| {
            p.iter()
                .all(|side| side.conn.state() == ConnectionState::Established)
        });
        let (a, b) = (0, 1);
        let len = 20_000usize;
        let src = l.both(a, |side| {
            side.mem
                .alloc(len, Access::LOCAL_WRITE | Access::REMOTE_READ)
        });
        let dst = l.both(b, |side| side.mem.alloc(len, RW));
        let rbuf = l.both(b, |side| side.mem.alloc(len, Access::LOCAL_WRITE));
        let readback = l.both(a, |side| side.mem.alloc(len, Access::LOCAL_WRITE));
        l.both(a, |side| side.mem.fill(&src, 0, &pattern(len, 1)));
        l.both(b, |side| side.mem.fill(&dst, 0, &pattern(len, 2)));
        let mut posted = 0;
        // WRITEs at odd offsets and lengths around the packet size, one of several packets.
        for (i, (offset, n)) in [(3, 1), (0, 999), (17, 1000), (1, 1001), (5, 5000), (0, 0)]
            .into_iter()
            .enumerate()
        {
            let wr = SendWr {
                wr_id: i as u64,
                local: sge(&src, offset, n),
                op: SendOp::Write {
                    remote: remote(&dst, 10_000 + offset),
                },
            };
            l.both(a, |side| side.conn.post_send(wr, &side.mem).unwrap());
            posted += 1;
        }
        // SEND with immediate data into a posted receive, spanning three packets.
        l.both(b, |side| {
            side.conn
                .post_recv(RecvWr {
                    wr_id: 100,
                    local: sge(&rbuf, 0, len as u64),
                })
                .unwrap()
        });
        let wr = SendWr {
            wr_id: 10,
            local: sge(&src, 33, 2500),
            op: SendOp::Send { imm: Some(9) },
        };
        l.both(a, |side| side.conn.post_send(wr, &side.mem).unwrap());
        // READ: the responses come from b's memory, at an odd offset.
        let wr = SendWr {
            wr_id: 11,
            local: sge(&readback, 0, 3333),
            op: SendOp::Read {
                remote: remote(&dst, 5),
            },
        };
        l.both(a, |side| side.conn.post_send(wr, &side.mem).unwrap());
        posted += 2;
        l.run(|p| p[0].completions.len() == posted && p[1].completions.len() == 1);
        for side in &l.pairs[1] {
            let wcs = &side.completions;
            assert!(
                wcs.iter().all(|wc| wc.status == WcStatus::Success),
                "{wcs:?}"
            );
        }
        assert!(l.pairs[1][a].mem.bytes(&readback, 0, 3333) == &pattern(len, 2)[5..3338]);
        assert!(l.pairs[1][b].mem.bytes(&rbuf, 0, 2500) == &pattern(len, 1)[33..2533]);
        assert!(
            l.pairs[1][b].mem.bytes(&dst, 10_005, 5000) == &pattern(len, 1)[5..5005],
            "WRITE data"
        );
        assert!(
            l.pairs[1][a].conn.stats().retransmits + l.pairs[1][b].conn.stats().retransmits > 0,
            "drops caused retransmissions"
        );
        match gather_from {
            usize::MAX => assert_eq!(l.gathered, 0),
            _ => assert!(l.gathered > 10, "{} gathered", l.gathered),
        }
    }
}

/// Every datagram `from` has to send now, taken straight from its connection (no link).
fn transmit_all(from: &mut crate::sim::Endpoint, now: Time) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 70_000];
    while let Some(n) = from.conn.poll_transmit(now, &mut buf, &from.mem) {
        out.push(buf[..n].to_vec());
    }
    out
}

/// `packet` re-encoded with `ext` and `payload` instead of its own (a hostile peer's forgery:
/// it passed the handshake, so it knows the token and the sequence numbers).
fn forge(packet: &crate::wire::Packet<'_>, ext: crate::wire::Ext, payload: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; crate::wire::MAX_HEADER_LEN + payload.len()];
    let n = crate::wire::write_header(&mut buf, &packet.header, &ext, payload.len());
    buf.truncate(n);
    buf.extend_from_slice(payload);
    crate::wire::seal(&mut buf);
    buf
}

/// A later packet of a message must say what its first said (length, opcode class, target,
/// immediate): a peer may not stretch a SEND past the receive it was checked against, or
/// steer a WRITE's later packets elsewhere. Such packets are dropped as malformed, touch no
/// byte, and the genuine ones still complete the message.
#[test]
fn a_later_packet_that_contradicts_its_message_is_dropped_and_touches_nothing() {
    use crate::wire::{Ext, decode};
    let mut p = pair();
    let mp = u64::from(Config::default().max_payload());
    let len = mp + 100; // Two packets.
    let src = p.a.mem.alloc(4 * mp as usize, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(4 * mp as usize, RW);
    p.a.mem.fill(&src, 0, &pattern(len as usize, 3));
    p.b.mem.fill(&dst, 0, &vec![0xee; 4 * mp as usize]);
    p.b.post_recv(RecvWr {
        wr_id: 9,
        local: sge(&dst, 0, len),
    })
    .unwrap();
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&src, 0, len),
        op: SendOp::Send { imm: Some(5) },
    })
    .unwrap();
    let now = p.now;
    let datagrams = transmit_all(&mut p.a, now);
    let data: Vec<&Vec<u8>> = datagrams
        .iter()
        .filter(|d| matches!(decode(d).map(|p| p.ext), Ok(Ext::Send(_))))
        .collect();
    assert_eq!(data.len(), 2, "a two-packet SEND");
    let (first, second) = (data[0], data[1]);
    p.b.conn.handle_datagram(now, first, &mut p.b.mem);
    let genuine = decode(second).unwrap();
    let Ext::Send(seg) = genuine.ext else {
        unreachable!()
    };
    let stretched = crate::wire::Segment {
        msg_len: 2 * mp,
        ..seg
    };
    let other_imm = crate::wire::Segment {
        imm_or_req: 6,
        ..seg
    };
    let forgeries = [
        // Claims a longer message, so that its full-size payload runs past the receive.
        forge(&genuine, Ext::Send(stretched), &vec![0x66; mp as usize]),
        // Another immediate.
        forge(&genuine, Ext::Send(other_imm), genuine.payload),
        // A WRITE's packet inside the SEND.
        forge(
            &genuine,
            Ext::Write(
                seg,
                crate::wire::Remote {
                    rkey: dst.rkey,
                    addr: dst.addr + 2 * mp,
                },
            ),
            genuine.payload,
        ),
    ];
    let malformed = p.b.conn.stats().malformed;
    for forged in &forgeries {
        p.b.conn.handle_datagram(now, forged, &mut p.b.mem);
    }
    assert_eq!(p.b.conn.stats().malformed, malformed + 3);
    assert!(p.b.take_completions().is_empty(), "nothing completed");
    assert!(
        p.b.mem.bytes(&dst, len as usize, 3 * mp as usize - 100)
            == &vec![0xee; 3 * mp as usize - 100][..],
        "bytes past the posted receive were written"
    );
    // The genuine packet completes the message, exactly.
    p.b.conn.handle_datagram(now, second, &mut p.b.mem);
    let wc = only(p.b.take_completions());
    assert_eq!(
        (wc.status, wc.byte_len, wc.imm),
        (WcStatus::Success, len, Some(5))
    );
    assert!(p.b.mem.bytes(&dst, 0, len as usize) == &pattern(len as usize, 3)[..]);
    assert!(p.b.mem.bytes(&dst, len as usize, 100) == &[0xee; 100][..]);
}

/// What the receiver keeps for a message in progress is bounded by its window, not by the
/// length the message's first packet claims (a peer could otherwise make it allocate a flag
/// for every packet of a multi-gigabyte write, and walk them all for every ACK).
#[test]
fn a_message_claiming_millions_of_packets_costs_no_more_than_the_window() {
    use crate::wire::{Ext, decode};
    let config = Config {
        max_datagram: crate::wire::MAX_HEADER_LEN + 8, // 8-byte payloads.
        window: 64,
        ..Config::default()
    };
    let mut p = pair_with(LinkConfig::default(), config);
    let big = 16 << 20; // 2 Mi packets of 8 bytes.
    let src = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    let dst = p.b.mem.alloc(big, RW);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&src, 0, 16),
        op: SendOp::Write {
            remote: remote(&dst, 0),
        },
    })
    .unwrap();
    let now = p.now;
    let datagrams = transmit_all(&mut p.a, now);
    let first = datagrams
        .iter()
        .find_map(|d| decode(d).ok().filter(|p| matches!(p.ext, Ext::Write(..))))
        .expect("the write's first packet");
    let Ext::Write(seg, target) = first.ext else {
        unreachable!()
    };
    // The same first packet, claiming the whole 16 MiB region.
    let claim = crate::wire::Segment {
        msg_len: big as u64,
        ..seg
    };
    let forged = forge(&first, Ext::Write(claim, target), first.payload);
    p.b.conn.handle_datagram(now, &forged, &mut p.b.mem);
    assert!(
        p.b.conn.rx.message_in_progress().is_some(),
        "the claim was taken"
    );
    let kept = p.b.conn.rx.tracked_packets();
    assert!(kept <= 64, "{kept} packets tracked for one message");
}

/// Values a peer chooses in its handshake and NAKs have ceilings: a window of 2^32 packets
/// is lowered to [`crate::config::MAX_WINDOW`] (sequence numbers compare within half their
/// space), and a receiver-not-ready NAK asking for an hour's pause is shortened to
/// `max_rnr_delay`, so the connection still fails within a bounded (simulated) time.
#[test]
fn peer_chosen_windows_and_delays_are_clamped() {
    let hostile = Config {
        window: u32::MAX,
        rnr_delay: Duration::from_secs(3600),
        ..Config::default()
    };
    let mut p = Pair::new(PairConfig {
        seed: 7,
        config_a: Config::default(),
        config_b: hostile,
        link: LinkConfig::default(),
    });
    assert_eq!(p.a.conn.state(), ConnectionState::Established);
    assert_eq!(p.a.conn.tx.peer_window(), crate::config::MAX_WINDOW);
    assert!(p.b.conn.config.window <= crate::config::MAX_WINDOW);

    // No receive posted at b: every retry meets a NAK asking for an hour.
    let src = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    p.a.post_send(SendWr {
        wr_id: 1,
        local: sge(&src, 0, 64),
        op: SendOp::Send { imm: None },
    })
    .unwrap();
    let start = p.now;
    assert!(p.drive(STEPS));
    assert_eq!(
        only(p.a.take_completions()).status,
        WcStatus::RnrRetryExceeded
    );
    let took = Duration::from_nanos(p.now.0 - start.0);
    let bound = Config::default().max_rnr_delay * (Config::default().max_rnr_retries + 1)
        + Config::default().retry_budget() * 2;
    assert!(
        took <= bound,
        "failed after {took:?} of simulated time (bound {bound:?})"
    );
}

/// A message that would span more than a quarter of the sequence space is refused when
/// posted (8-byte payloads: 2^30 packets is 8 GiB).
#[test]
fn a_message_longer_than_the_sequence_space_allows_is_refused_at_post() {
    let config = Config {
        max_datagram: crate::wire::MAX_HEADER_LEN + 8,
        ..Config::default()
    };
    let mut p = pair_with(LinkConfig::default(), config);
    let src = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    let huge = Sge {
        addr: src.addr,
        len: 8 << 30 | 1,
        lkey: src.lkey,
    };
    let err =
        p.a.post_send(SendWr {
            wr_id: 1,
            local: huge,
            op: SendOp::Send { imm: None },
        })
        .unwrap_err();
    assert!(err.to_string().contains("2^30 packets"), "{err}");
}

#[test]
fn a_pulled_rail_under_random_loss_fails_over_without_giving_up() {
    // Random loss on the live rail must not be blamed on it for good: the connection keeps
    // going on the rail that works, whichever rail a lost packet went over.
    for seed in 0..20 {
        let link = LinkConfig {
            loss: 0.02,
            duplicate: 0.01,
            ..LinkConfig::default()
        };
        let mut p = Pair::with_rails(
            PairConfig {
                seed,
                link,
                ..PairConfig::default()
            },
            2,
        );
        let src = p.a.mem.alloc(8 << 20, Access::LOCAL_WRITE);
        let dst = p.b.mem.alloc(8 << 20, RW);
        let data = pattern(8 << 20, 6);
        p.a.mem.fill(&src, 0, &data);
        for i in 0..8u64 {
            let wr = SendWr {
                wr_id: i,
                local: sge(&src, i << 20, 1 << 20),
                op: SendOp::Write {
                    remote: remote(&dst, i << 20),
                },
            };
            p.a.post_send(wr).unwrap();
        }
        p.drive_until(STEPS, |p| p.rail_stats(1).sent > 20);
        let now = p.now;
        p.rail_config_mut(1).outages.push((now, None));
        assert!(p.drive(STEPS), "seed {seed}: did not settle");
        let wcs = p.a.take_completions();
        assert!(
            wcs.iter().all(|w| w.status == WcStatus::Success),
            "seed {seed}: {wcs:?}"
        );
        assert_eq!(wcs.len(), 8, "seed {seed}");
        assert!(p.b.mem.bytes(&dst, 0, 8 << 20) == &data[..], "seed {seed}");
    }
}

#[test]
fn a_read_response_resent_after_its_region_went_never_carries_other_bytes() {
    // The responder's application frees the region a READ is reading from while the
    // response is in flight, and the response is lost: the resent packets must not carry
    // whatever happens to be in the transmit buffer. The READ fails, or returns exactly
    // the region's bytes, never anything else.
    for seed in 0..8 {
        let mut p = Pair::new(PairConfig {
            seed,
            ..PairConfig::default()
        });
        let src = p.b.mem.alloc(150_000, RW);
        let dst = p.a.mem.alloc(150_000, Access::LOCAL_WRITE);
        let data = pattern(150_000, 3);
        p.b.mem.fill(&src, 0, &data);
        // An earlier, unrelated transfer leaves its bytes in b's transmit buffers.
        let other = p.b.mem.alloc(150_000, Access::LOCAL_WRITE);
        let other_dst = p.a.mem.alloc(150_000, RW);
        p.b.mem.fill(&other, 0, &pattern(150_000, 99));
        p.b.post_send(SendWr {
            wr_id: 1,
            local: sge(&other, 0, 150_000),
            op: SendOp::Write {
                remote: remote(&other_dst, 0),
            },
        })
        .unwrap();
        assert!(p.drive(STEPS));
        p.b.take_completions();
        // Everything sent from just after the request (so the first response) is lost.
        let now = p.now;
        p.link_config_mut().outages.push((
            now + Duration::from_micros(1),
            Some(now + Duration::from_millis(3)),
        ));
        p.a.post_send(SendWr {
            wr_id: 5,
            local: sge(&dst, 0, 150_000),
            op: SendOp::Read {
                remote: remote(&src, 0),
            },
        })
        .unwrap();
        let sent_before = p.b.conn.stats().packets_sent;
        p.drive_until(STEPS, |p| p.b.conn.stats().packets_sent > sent_before);
        p.b.mem.free(&src);
        p.drive(STEPS);
        let wc = only(p.a.take_completions());
        assert_eq!(wc.wr_id, 5);
        if wc.status == WcStatus::Success {
            assert!(
                p.a.mem.bytes(&dst, 0, 150_000) == &data[..],
                "seed {seed}: a successful READ returned bytes that were not the region's"
            );
        } else {
            assert_eq!(wc.status, WcStatus::RemoteAccess, "seed {seed}");
        }
    }
}

/// A connection that fails, or is closed, while a SEND into one of its receives is half
/// received completes that receive too (as flushed, before the receives still queued): the
/// receive left the queue with the message's first packet, and used to be forgotten with the
/// message (found by the soak: a posted receive with no completion after a peer was killed).
#[test]
fn a_receive_holding_a_half_received_message_is_flushed_when_the_connection_ends() {
    use crate::wire::{Ext, decode};
    for end in ["peer silent", "closed"] {
        let mut p = pair();
        let mp = u64::from(Config::default().max_payload());
        let len = mp + 100; // Two packets.
        let src = p.a.mem.alloc(2 * mp as usize, Access::LOCAL_WRITE);
        let dst = p.b.mem.alloc(4 * mp as usize, RW);
        for wr_id in [9, 10] {
            p.b.post_recv(RecvWr {
                wr_id,
                local: sge(&dst, (wr_id - 9) * 2 * mp, 2 * mp),
            })
            .unwrap();
        }
        p.a.post_send(SendWr {
            wr_id: 1,
            local: sge(&src, 0, len),
            op: SendOp::Send { imm: None },
        })
        .unwrap();
        let now = p.now;
        let datagrams = transmit_all(&mut p.a, now);
        let first = datagrams
            .iter()
            .find(|d| matches!(decode(d).map(|p| p.ext), Ok(Ext::Send(_))))
            .expect("the SEND's first packet");
        // Only the first packet arrives; then the cable goes for good.
        p.b.conn.handle_datagram(now, first, &mut p.b.mem);
        assert!(p.b.take_completions().is_empty());
        match end {
            "peer silent" => {
                let cut_at = p.now;
                p.link_config_mut().outages.push((cut_at, None));
                p.advance(2 * Config::default().idle_timeout, STEPS);
                assert_eq!(p.b.conn.state(), ConnectionState::Error, "{end}");
            }
            _ => p.b.conn.close(p.now),
        }
        let wcs = p.b.take_completions();
        let got: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            got,
            vec![(9, WcStatus::Flushed), (10, WcStatus::Flushed)],
            "{end}: every posted receive completes, in order"
        );
    }
}

/// A receiver whose application reposts its few receives slowly, with its connection running
/// meanwhile (as the engine does), behind a sender that posted far more SENDs than that.
/// Checks that every message arrived intact and in order, and that receive credit kept the
/// sender from being refused more than one message at a time: the only SENDs that may meet a
/// receiver-not-ready NAK are those sent without credit when nothing was outstanding, so
/// nothing behind a refused one is thrown away and resent, and no timeout fires. (Without
/// credit: over a thousand packets resent, 15 timeouts, 300 packets dropped out of order.)
fn slow_receiver_run(bidirectional: bool) {
    const SLOTS: usize = 3;
    const MESSAGES: usize = 40;
    // Two packets per message with the default payload.
    const LEN: usize = 100_000;
    let mut p = pair();
    let src = p.a.mem.alloc(LEN * MESSAGES, Access::LOCAL_WRITE);
    for m in 0..MESSAGES {
        p.a.mem.fill(&src, m * LEN, &pattern(LEN, m as u8));
    }
    let dst = p.b.mem.alloc(LEN * SLOTS, Access::LOCAL_WRITE);
    let send = |p: &mut Pair, m: usize| {
        p.a.post_send(SendWr {
            wr_id: m as u64,
            local: sge(&src, (m * LEN) as u64, LEN as u64),
            op: SendOp::Send { imm: None },
        })
        .unwrap();
    };
    let recv = |p: &mut Pair, slot: usize| {
        p.b.post_recv(RecvWr {
            wr_id: slot as u64,
            local: sge(&dst, (slot * LEN) as u64, LEN as u64),
        })
        .unwrap();
    };
    // The other direction, when asked: B streams small SENDs into A's receives all along, so
    // that B's acknowledgements ride on its own packets instead of ACKs carrying its limit.
    let back_src = p.b.mem.alloc(64, Access::LOCAL_WRITE);
    let back_dst = p.a.mem.alloc(64, Access::LOCAL_WRITE);
    let mut back_sent = 0u64;
    // One exchange first: before the receiver's first ACK, nothing holds a sender back.
    recv(&mut p, 0);
    send(&mut p, 0);
    assert!(p.drive(STEPS));
    assert_eq!(only(p.b.take_completions()).status, WcStatus::Success);
    p.a.take_completions();
    for slot in 0..SLOTS {
        recv(&mut p, slot);
    }
    for m in 1..MESSAGES {
        send(&mut p, m);
    }
    let mut received = 1;
    while received < MESSAGES {
        if bidirectional {
            for _ in 0..2 {
                p.a.post_recv(RecvWr {
                    wr_id: 1000 + back_sent,
                    local: sge(&back_dst, 0, 64),
                })
                .unwrap();
                p.b.post_send(SendWr {
                    wr_id: 1000 + back_sent,
                    local: sge(&back_src, 0, 64),
                    op: SendOp::Send { imm: None },
                })
                .unwrap();
                back_sent += 1;
            }
        }
        assert!(
            p.drive_until(STEPS, |p| p.b.pending_completions() > 0),
            "message {received} never arrived"
        );
        // The application is slow: the connection runs on while it works on the message.
        p.advance(Duration::from_micros(300), STEPS);
        for wc in p.b.take_completions() {
            if wc.wr_id >= 1000 {
                assert_eq!(wc.status, WcStatus::Success);
                continue;
            }
            assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, LEN as u64));
            let slot = wc.wr_id as usize;
            assert_eq!(
                p.b.mem.bytes(&dst, slot * LEN, LEN),
                &pattern(LEN, received as u8)[..],
                "message {received} in slot {slot}"
            );
            received += 1;
            recv(&mut p, slot);
        }
    }
    assert!(p.drive(STEPS));
    let sent: Vec<_> =
        p.a.take_completions()
            .into_iter()
            .filter(|wc| wc.wr_id < 1000)
            .collect();
    assert_eq!(sent.len(), MESSAGES - 1);
    assert!(sent.iter().all(|wc| wc.status == WcStatus::Success));
    let (a, b) = (p.a.conn.stats(), p.b.conn.stats());
    assert_eq!(b.out_of_order_dropped, 0, "{b:?}");
    assert_eq!(a.timeouts, 0, "{a:?}");
    let packets_per_message = 2;
    assert!(
        a.retransmits <= b.rnr_naks_sent * packets_per_message,
        "only refused messages were resent: {a:?} {b:?}"
    );
}

#[test]
fn a_sender_deeper_than_the_receive_queue_waits_for_credit_instead_of_being_refused() {
    slow_receiver_run(false);
}

#[test]
fn receive_credit_is_renewed_when_acknowledgements_ride_on_data() {
    slow_receiver_run(true);
}

/// With `Config::message_crc`, every receive completion carries the CRC-32C of its message's
/// bytes, built from the datagrams' CRCs, whatever order they were placed in and however
/// often they were resent; without it, none does.
#[test]
fn receive_completions_carry_the_crc_of_their_message_under_loss_and_reordering() {
    use crate::wire::crc_algebra::crc32c;
    let link = LinkConfig {
        loss: 0.05,
        duplicate: 0.05,
        jitter: Duration::from_micros(40),
        // Small datagrams: most messages span many packets.
        mtu: 1500,
        ..LinkConfig::default()
    };
    for message_crc in [true, false] {
        let config = Config {
            max_datagram: 1500 - 28,
            max_retries: 30,
            message_crc,
            ..Config::default()
        };
        let mut p = pair_with(link.clone(), config.clone());
        let payload = config.max_payload() as usize;
        let sizes = [
            0,
            1,
            7,
            payload - 1,
            payload,
            payload + 1,
            3 * payload,
            10 * payload + 17,
            40_000,
        ];
        let total: usize = sizes.iter().sum();
        let src = p.a.mem.alloc(total, Access::LOCAL_WRITE);
        let rbuf = p.b.mem.alloc(total, Access::LOCAL_WRITE);
        let dst = p.b.mem.alloc(total, RW);
        p.a.mem.fill(&src, 0, &pattern(total, 9));
        let mut at = 0u64;
        let mut expected = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            let data = &pattern(total, 9)[at as usize..at as usize + len];
            expected.push((2 * i as u64, crc32c(data)));
            expected.push((2 * i as u64 + 1, crc32c(data)));
            for k in 0..2 {
                p.b.post_recv(RecvWr {
                    wr_id: 2 * i as u64 + k,
                    local: sge(&rbuf, at, len as u64),
                })
                .unwrap();
            }
            p.a.post_send(SendWr {
                wr_id: 2 * i as u64,
                local: sge(&src, at, len as u64),
                op: SendOp::Send { imm: None },
            })
            .unwrap();
            p.a.post_send(SendWr {
                wr_id: 2 * i as u64 + 1,
                local: sge(&src, at, len as u64),
                op: SendOp::WriteWithImm {
                    remote: remote(&dst, at),
                    imm: i as u32,
                },
            })
            .unwrap();
            at += len as u64;
        }
        assert!(p.drive(STEPS));
        assert!(
            p.a.take_completions()
                .iter()
                .all(|w| w.status == WcStatus::Success)
        );
        let got: Vec<(u64, Option<u32>)> =
            p.b.take_completions()
                .iter()
                .map(|w| {
                    assert_eq!(w.status, WcStatus::Success, "{w:?}");
                    (w.wr_id, w.payload_crc)
                })
                .collect();
        let want: Vec<(u64, Option<u32>)> = expected
            .iter()
            .map(|&(id, crc)| (id, message_crc.then_some(crc)))
            .collect();
        assert_eq!(got, want, "message_crc {message_crc}");
        assert_eq!(
            p.b.mem.bytes(&rbuf, 0, total),
            p.b.mem.bytes(&dst, 0, total)
        );
        let stats = p.b.conn.stats();
        assert!(
            stats.out_of_order_placed > 0 && stats.duplicates > 0,
            "reordering and duplicates were exercised: {stats:?}"
        );
    }
}

/// A WRITE of the first `len` bytes of `src` to the start of `dst`.
fn write_wr(wr_id: u64, src: &Region, dst: &Region, len: u64) -> SendWr {
    SendWr {
        wr_id,
        local: sge(src, 0, len),
        op: SendOp::Write {
            remote: remote(dst, 0),
        },
    }
}

/// A one-packet WRITE from `a` whose datagram (`lose_data`) or whose acknowledgement (not
/// `lose_data`) the link loses; returns the simulated time from the post until the WRITE
/// completed at `a`, and `a`'s counters.
fn tail_loss_run(config: Config, lose_data: bool) -> (Duration, crate::connection::Stats) {
    let mut p = pair_with(LinkConfig::default(), config);
    let a_buf = p.a.mem.alloc(4096, RW);
    let b_buf = p.b.mem.alloc(4096, RW);
    // A first exchange, so the round trip has been sampled.
    p.a.post_send(write_wr(1, &a_buf, &b_buf, 4096)).unwrap();
    assert!(p.drive(STEPS));
    assert_eq!(p.a.take_completions().len(), 1);
    p.a.mem.fill(&a_buf, 0, &[9; 4096]);
    let posted = p.now;
    p.a.post_send(write_wr(2, &a_buf, &b_buf, 4096)).unwrap();
    if lose_data {
        // The next step transmits the WRITE: everything sent at this instant is lost.
        p.link_config_mut().outages = vec![(p.now, Some(p.now + Duration::from_nanos(1)))];
    } else {
        assert!(p.drive_until(STEPS, |p| p.b.mem.bytes(&b_buf, 0, 4096) == [9; 4096]));
        // The next step transmits B's acknowledgement.
        p.link_config_mut().outages = vec![(p.now, Some(p.now + Duration::from_nanos(1)))];
    }
    assert!(p.drive_until(STEPS, |p| p.a.pending_completions() > 0));
    let took = p.now.saturating_since(posted);
    let wc = only(p.a.take_completions());
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    assert_eq!(p.b.mem.bytes(&b_buf, 0, 4096), [9; 4096]);
    assert!(p.link_stats().lost_in_outage >= 1, "the loss was injected");
    (took, *p.a.conn.stats())
}

#[test]
fn a_lost_last_datagram_is_repaired_by_the_tail_probe_before_any_timeout() {
    let config = Config::default();
    let (took, stats) = tail_loss_run(config.clone(), true);
    assert_eq!(stats.tail_probes, 1, "{stats:?}");
    assert_eq!(stats.timeouts, 0, "{stats:?}");
    assert!(
        took < config.initial_rto,
        "repaired after {took:?}, the retransmission floor is {:?}",
        config.initial_rto
    );
    assert!(took >= config.tail_probe_floor, "{took:?}");
}

#[test]
fn a_lost_acknowledgement_is_recovered_by_the_tail_probe_before_any_timeout() {
    let config = Config::default();
    let (took, stats) = tail_loss_run(config.clone(), false);
    assert_eq!(stats.tail_probes, 1, "{stats:?}");
    assert_eq!(stats.timeouts, 0, "{stats:?}");
    assert!(took < config.initial_rto, "recovered after {took:?}");
}

#[test]
fn a_probe_floor_at_the_retransmission_ceiling_leaves_recovery_to_the_timeout() {
    let config = Config {
        tail_probe_floor: Config::default().max_rto,
        ..Config::default()
    };
    let (took, stats) = tail_loss_run(config.clone(), true);
    assert_eq!(stats.tail_probes, 0, "{stats:?}");
    assert_eq!(stats.timeouts, 1, "{stats:?}");
    assert!(took >= config.initial_rto, "{took:?}");
}

#[test]
fn the_tail_probe_waits_out_the_peers_acknowledgement_hold() {
    // The peer holds each ACK for a reply for 500 µs (and no reply comes): a probe any sooner
    // would resend a datagram that arrived.
    let config = Config {
        ack_hold: Duration::from_micros(500),
        initial_rto: Duration::from_millis(5),
        ..Config::default()
    };
    let mut p = pair_with(LinkConfig::default(), config);
    let a_buf = p.a.mem.alloc(64, RW);
    let b_buf = p.b.mem.alloc(64, RW);
    for i in 1..=20u64 {
        p.a.post_send(write_wr(i, &a_buf, &b_buf, 64)).unwrap();
        assert!(p.drive(STEPS));
    }
    assert_eq!(p.a.take_completions().len(), 20);
    let stats = p.a.conn.stats();
    assert_eq!((stats.tail_probes, stats.retransmits), (0, 0), "{stats:?}");
}

/// Data digests are used both ways when either side asks (or wants message CRCs, which are
/// built from them): the side that asks gets digested payloads from a peer that did not.
#[test]
fn either_side_asking_for_data_digests_turns_them_on_both_ways() {
    let ask = |data_digest, message_crc| Config {
        data_digest,
        message_crc,
        ..Config::default()
    };
    for (a, b, expected) in [
        (ask(false, false), ask(false, false), false),
        (ask(true, false), ask(false, false), true),
        (ask(false, false), ask(true, false), true),
        (ask(false, false), ask(false, true), true),
        (ask(true, false), ask(true, false), true),
    ] {
        let mut p = Pair::new(PairConfig {
            seed: 7,
            config_a: a.clone(),
            config_b: b.clone(),
            link: LinkConfig::default(),
        });
        assert_eq!(p.a.conn.uses_data_digest(), expected, "{a:?} / {b:?}");
        assert_eq!(p.b.conn.uses_data_digest(), expected, "{a:?} / {b:?}");
        // The flag on the data packets says so, and the CRC covers the payload exactly then.
        let (write, _) = one_write_datagram(&mut p, 100, 7);
        let packet = crate::wire::decode(&write).unwrap();
        assert_eq!(packet.header.data_digest(), expected);
        assert_eq!(
            crate::wire::crc_stops_at(&write).is_none(),
            expected,
            "the CRC covers the payload"
        );
    }
}

/// Over a link that corrupts undetected, the side that asked for digests receives intact data
/// from a peer that did not ask.
#[test]
fn the_receiver_asking_for_digests_is_enough_over_a_corrupting_link() {
    let mut p = Pair::new(PairConfig {
        seed: 11,
        config_a: Config {
            max_retries: 30,
            ..Config::default()
        },
        config_b: Config {
            max_retries: 30,
            data_digest: true,
            ..Config::default()
        },
        link: LinkConfig {
            corrupt: 0.3,
            ..LinkConfig::default()
        },
    });
    write_whole(&mut p, 1 << 20, 12);
    assert!(p.b.conn.stats().corrupted > 0);
}

/// On a connection that agreed on digests, a data packet without one (a peer that ignores the
/// agreement) is dropped before it touches memory; with one, the same packet lands.
#[test]
fn a_data_packet_without_the_agreed_digest_is_dropped() {
    use crate::wire::{FLAG_DATA_DIGEST, decode};
    let config = Config {
        data_digest: true,
        ..Config::default()
    };
    let mut p = pair_with(LinkConfig::default(), config);
    let (write, dst) = one_write_datagram(&mut p, 64, 0x42);
    let now = p.now;
    let genuine = decode(&write).unwrap();
    let mut undigested = genuine;
    undigested.header.flags &= !FLAG_DATA_DIGEST;
    let forged = forge(&undigested, genuine.ext, genuine.payload);
    let corrupted = p.b.conn.stats().corrupted;
    p.b.conn.handle_datagram(now, &forged, &mut p.b.mem);
    assert_eq!(p.b.conn.stats().corrupted, corrupted + 1);
    assert!(
        p.b.mem.bytes(&dst, 0, 64) == &[0u8; 64][..],
        "the payload was placed"
    );
    p.b.conn.handle_datagram(now, &write, &mut p.b.mem);
    assert!(p.b.mem.bytes(&dst, 0, 64) == &[0x42u8; 64][..]);
}

/// A retransmission timeout that was spurious (a round trip above the timeout: acknowledgements
/// late, not lost, as when a busy host deschedules the peer) resends the oldest packet, not the
/// flight (F-RTO): the acknowledgements that come back show the originals arrived. Both with
/// acknowledgements that cover the flight at once and with ones that come in pieces.
/// The sender's statistics after a 64-packet WRITE in flights of 16, acknowledged every
/// `ack_every` packets, over a link whose round trip (1.2 ms) is longer than the first
/// timeout (1 ms, no round trip sampled yet).
fn write_over_a_slow_link(ack_every: u32) -> crate::Stats {
    let config = Config {
        max_datagram: 1500,
        window: 16,
        ack_every,
        ..Config::default()
    };
    let link = LinkConfig {
        latency: Duration::from_micros(600),
        ..LinkConfig::default()
    };
    let mut p = pair_with(link, config);
    write_whole(&mut p, 64 * 1400, 21);
    *p.a.conn.stats()
}

#[test]
fn a_spurious_timeout_resends_one_packet_not_the_flight() {
    for ack_every in [16, 4] {
        let stats = write_over_a_slow_link(ack_every);
        assert!(
            stats.timeouts >= 1,
            "ack_every {ack_every}: no timeout: {stats:?}"
        );
        assert!(
            stats.retransmits <= stats.timeouts,
            "ack_every {ack_every}: one packet per timeout, not the flight of 16: {stats:?}"
        );
    }
}

/// A round trip longer than the first timeout (1 ms, before any sample): the first flight
/// times out spuriously, and Karn's rule keeps that flight's timing out of the estimator. The
/// spurious timeout's own answer is sampled instead (it can only over-estimate: the original
/// went first), so the timeout learns the round trip and the later flights do not time out.
#[test]
fn a_spurious_timeout_still_teaches_the_round_trip() {
    let stats = write_over_a_slow_link(Config::default().ack_every);
    assert_eq!(
        stats.timeouts, 1,
        "only the first flight, sent before any sample, times out: {stats:?}"
    );
}

/// The last packet of a message is placed only once all the others are: a reader that polls a
/// flag in a WRITE's last bytes (`ib_write_lat`, `tbrdma pingpong --op write`) must not see it
/// while an earlier packet is still missing. Delivered last-first-middle, the last packet's
/// bytes stay untouched until the middle one has been placed, then all three are in.
#[test]
fn the_last_packet_of_a_message_is_placed_after_all_the_others() {
    use crate::wire::decode;
    let mut p = pair();
    let mp = Config::default().max_payload() as usize;
    let len = 2 * mp + 100; // Three packets; the last carries 100 bytes.
    let dst = post_write(&mut p, &pattern(len, 5));
    let now = p.now;
    let writes: Vec<Vec<u8>> = transmit_all(&mut p.a, now)
        .into_iter()
        .filter(|d| decode(d).is_ok_and(|p| p.header.opcode.carries_data()))
        .collect();
    assert_eq!(writes.len(), 3, "three data packets");
    let last = 2 * mp..len;
    let untouched = |p: &Pair| p.b.mem.bytes(&dst, last.start, 100) == &[0u8; 100][..];
    p.b.conn.handle_datagram(now, &writes[2], &mut p.b.mem);
    assert!(untouched(&p), "the last packet was placed first");
    p.b.conn.handle_datagram(now, &writes[0], &mut p.b.mem);
    assert!(
        untouched(&p),
        "the last packet was placed before the middle one"
    );
    assert!(p.b.mem.bytes(&dst, 0, mp) == &pattern(len, 5)[..mp]);
    p.b.conn.handle_datagram(now, &writes[1], &mut p.b.mem);
    assert!(
        p.b.mem.bytes(&dst, 0, len) == &pattern(len, 5)[..],
        "the whole WRITE is in place"
    );
    assert_eq!(p.b.conn.stats().out_of_order_stashed, 1);
    // The sender learns it all arrived: its WRITE completes with nothing resent.
    assert!(p.drive(STEPS));
    assert_eq!(only(p.a.take_completions()).status, WcStatus::Success);
    assert_eq!(p.a.conn.stats().retransmits, 0);
}
