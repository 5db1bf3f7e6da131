//! Copy-saving loans between the application and the engine (sockets engine, caller progress):
//! a landing zone, where the write the application expects next is received straight into
//! place, and a send headroom, where the engine writes a datagram's header in front of its
//! payload so that both leave as one buffer. Both must change nothing the application sees but
//! the bytes it lent.

use std::time::{Duration, Instant};

use tbrdma_verbs::*;

mod common;
use common::{Pair, next_completion};

const REGION: usize = 1 << 20;

fn pair() -> Pair {
    common::pair(common::caller(), REGION, REGION, 64)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// What these tests do with a pair (an extension of the shared set-up).
trait Writes {
    fn write(&self, from: usize, to: usize, len: usize, imm: u32);
    fn target_bytes(&self, at: usize, len: usize) -> Vec<u8>;
    fn landed(&self) -> u64;
}

impl Writes for Pair {
    /// WRITE_WITH_IMM of `len` bytes from `src` at `from` to `target` at `to`; returns when both
    /// sides completed it.
    fn write(&self, from: usize, to: usize, len: usize, imm: u32) {
        self.server
            .qp
            .post_recv(&[RecvWr {
                wr_id: imm as u64,
                local: self.target.sge(0, 0),
            }])
            .unwrap();
        self.client
            .qp
            .post_send(&[SendWr {
                wr_id: imm as u64,
                local: self.src.sge(from, len),
                op: SendOp::WriteWithImm {
                    remote: self.target.remote(to),
                    imm,
                },
            }])
            .unwrap();
        let got = next_completion(&self.server_cq);
        assert_eq!(got.wc.imm, Some(imm));
        assert_eq!(got.wc.byte_len as usize, len);
        let sent = next_completion(&self.client_cq);
        assert_eq!(sent.wc.wr_id, imm as u64);
    }

    fn target_bytes(&self, at: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.target.read(at, &mut out);
        out
    }

    fn landed(&self) -> u64 {
        self.server_dev.engine_stats().landed_in_place
    }
}

#[test]
fn the_expected_write_lands_in_place_and_any_other_is_copied_out() {
    let p = pair();
    let data = pattern(REGION, 7);
    p.src.write(0, &data);
    let qp = &p.server.qp;

    // The expected write (one datagram): received into the zone, nothing copied. (Counts are
    // checked as "at least": under load a late acknowledgement can bring a retransmitted
    // duplicate, and a datagram that arrives in the zone before the write sends the write the
    // usual way; only the bytes are exact.)
    assert!(qp.expect_write(&p.target, 4096, 64 << 10, 0).unwrap());
    p.write(100, 4096, 16 << 10, 1);
    assert_eq!(p.target_bytes(4096, 16 << 10), data[100..100 + (16 << 10)]);
    let first = p.landed();
    assert!(first >= 1, "the payload was received in place");

    // A zone lent for another address: the write received there is copied out to where it
    // belongs, and nothing lands in place (no write was ever addressed to that zone).
    assert!(qp.expect_write(&p.target, 200_000, 64 << 10, 1).unwrap());
    p.write(50_000, 8192, 20_000, 2);
    assert_eq!(p.target_bytes(8192, 20_000), data[50_000..70_000]);
    assert_eq!(p.landed(), first);
    assert_eq!(p.target_bytes(200_000 + 20_000, 1000), vec![0; 1000]);

    // A write of several datagrams: the first lands in the zone, the rest are placed after it.
    assert!(qp.expect_write(&p.target, 300_000, 512 << 10, 2).unwrap());
    p.write(1000, 300_000, 200_000, 3);
    assert_eq!(p.target_bytes(300_000, 200_000), data[1000..201_000]);
    assert!(p.landed() >= first);

    // An application that has not seen every receive completion cannot lend: a write it has
    // not seen may lie in the zone.
    assert!(!qp.expect_write(&p.target, 4096, 4096, 2).unwrap());
    assert!(qp.expect_write(&p.target, 4096, 4096, 3).unwrap());
    p.write(0, 4096, 3000, 4);
    assert_eq!(p.target_bytes(4096, 3000), data[..3000]);
}

/// A receiver that learns of a plain WRITE by polling memory (`ib_write_lat`, `tbrdma
/// pingpong --op write`): it lends the zone, and reads it once `lending()` says the loan ended.
#[test]
fn a_memory_polling_receiver_reads_the_zone_once_the_loan_has_ended() {
    let p = pair();
    let qp = &p.server.qp;
    assert!(!qp.lending(), "nothing lent yet");
    // A refused loan (a receive completion the application has not seen) lends nothing.
    assert!(!qp.expect_write(&p.target, 4096, 4096, 1).unwrap());
    assert!(!qp.lending());

    for (round, len) in [(1u64, 16 << 10), (2, 200_000), (3, 8)] {
        let mut data = pattern(len, round as u8);
        let counter = len - 8;
        data[counter..].copy_from_slice(&round.to_le_bytes());
        p.src.write(0, &data);
        // Under LANDING_MIN the loan is refused and the write is copied as usual.
        let lent = len >= LANDING_MIN;
        assert_eq!(
            qp.lends_zones(len),
            lent,
            "lends_zones says what the loan will be"
        );
        assert_eq!(qp.expect_write(&p.target, 4096, len, 0).unwrap(), lent);
        assert_eq!(qp.lending(), lent, "lent until the write comes");
        p.client
            .qp
            .post_send(&[SendWr {
                wr_id: round,
                local: p.src.sge(0, len),
                op: SendOp::Write {
                    remote: p.target.remote(4096),
                },
            }])
            .unwrap();
        let mut buf = [Completion::default(); 4];
        let start = Instant::now();
        // Caller progress: polling the (empty) receive queue is what receives the write.
        while qp.lending() || p.target_bytes(4096 + counter, 8) != round.to_le_bytes() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "round {round}: still lent ({}) after 10 s",
                qp.lending()
            );
            assert_eq!(p.server_cq.poll(&mut buf).unwrap(), 0);
        }
        assert_eq!(p.target_bytes(4096, len), data, "round {round}");
        assert_eq!(next_completion(&p.client_cq).wc.wr_id, round);
    }
    assert!(p.landed() >= 1, "a write was received in place");
}

#[test]
fn a_landing_zone_needs_room_for_the_header_inside_the_region() {
    let p = pair();
    let qp = &p.server.qp;
    for (offset, len) in [(0, 100), (SEND_HEADROOM - 1, 100), (4096, REGION)] {
        match qp.expect_write(&p.target, offset, len, 0) {
            Err(e @ VerbsError::BadLanding { .. }) => {
                assert!(e.to_string().contains("header"), "{e}")
            }
            other => panic!("offset {offset}, {len} bytes: {other:?}"),
        }
    }
    // From another protection domain.
    let other = p
        .server_dev
        .alloc_pd()
        .alloc_mr(4096, Access::LOCAL_WRITE)
        .unwrap();
    assert!(matches!(
        qp.expect_write(&other, 1024, 100, 0),
        Err(VerbsError::BadLanding { .. })
    ));
}

#[test]
fn send_headroom_takes_the_bytes_in_front_of_a_request_and_nothing_else() {
    let p = pair();
    let data = pattern(REGION, 3);
    p.src.write(0, &data);
    let src_bytes = |at: usize, len: usize| {
        let mut out = vec![0u8; len];
        p.src.read(at, &mut out);
        out
    };

    // Off (the default): the region is only read.
    p.write(4096, 0, 16 << 10, 1);
    assert_eq!(p.target_bytes(0, 16 << 10), data[4096..4096 + (16 << 10)]);
    assert_eq!(
        src_bytes(0, REGION),
        data,
        "nothing written into the source"
    );

    p.client.qp.set_send_headroom(true).unwrap();
    // One datagram: its header sits in the headroom, and the datagram arrived intact.
    p.write(4096, 0, 16 << 10, 2);
    assert_eq!(p.target_bytes(0, 16 << 10), data[4096..4096 + (16 << 10)]);
    let front = src_bytes(4096 - SEND_HEADROOM, SEND_HEADROOM);
    assert_eq!(
        &front[..2],
        b"tB",
        "the header went in front of the payload"
    );
    assert_eq!(
        src_bytes(0, 4096 - SEND_HEADROOM),
        data[..4096 - SEND_HEADROOM]
    );
    assert_eq!(src_bytes(4096, REGION - 4096), data[4096..]);

    // Several datagrams: only the first has the request's headroom; the others' headers must
    // not land inside the payload in front of them.
    p.write(300_000, 100_000, 300_000, 3);
    assert_eq!(p.target_bytes(100_000, 300_000), data[300_000..600_000]);
    assert_eq!(src_bytes(300_000, 300_000), data[300_000..600_000]);
    assert_eq!(src_bytes(600_000, REGION - 600_000), data[600_000..]);

    // A small payload (copied behind the header in the engine) leaves the headroom alone.
    p.src.write(800_000 - SEND_HEADROOM, &data[..SEND_HEADROOM]);
    p.write(800_000, 0, 100, 4);
    assert_eq!(p.target_bytes(0, 100), data[800_000..800_100]);
    assert_eq!(
        src_bytes(800_000 - SEND_HEADROOM, SEND_HEADROOM),
        data[..SEND_HEADROOM]
    );
}

/// A write whose first datagram has been placed while its second is still due: a zone lent
/// over the first datagram's bytes would receive the second there and overwrite them (the
/// corruption a lost, resent last datagram caused in a 4-rank ring all-reduce). The loan is
/// refused until the write completes (a zone elsewhere is not), and the write arrives whole.
#[test]
fn no_zone_is_lent_over_a_write_partly_received() {
    // No keeper ticks during the test: only the polls below move the server's engine.
    let p = common::pair(
        common::caller_with_keeper(Duration::from_secs(3600)),
        REGION,
        REGION,
        64,
    );
    let data = pattern(REGION, 11);
    p.src.write(0, &data);
    let (to, len) = (8192, 100_000); // two datagrams on loopback
    let qp = &p.server.qp;
    qp.post_recv(&[RecvWr {
        wr_id: 5,
        local: p.target.sge(0, 0),
    }])
    .unwrap();
    // Whatever the set-up left to send (an acknowledgement held for the next poll) goes
    // first, then an empty poll: the next one receives a single datagram, the write's first.
    for _ in 0..3 {
        p.client_dev.progress().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        p.server_dev.progress().unwrap();
    }
    p.server_dev.progress().unwrap();
    let before = qp.stats().packets_received;
    p.client
        .qp
        .post_send(&[SendWr {
            wr_id: 5,
            local: p.src.sge(0, len),
            op: SendOp::WriteWithImm {
                remote: p.target.remote(to),
                imm: 5,
            },
        }])
        .unwrap();
    p.client_dev.progress().unwrap();
    // Receive the first datagram only.
    let start = Instant::now();
    while qp.stats().packets_received == before {
        assert!(start.elapsed() < Duration::from_secs(10), "nothing arrived");
        std::thread::sleep(Duration::from_millis(1));
        p.server_dev.progress().unwrap();
    }
    assert_eq!(
        qp.stats().packets_received,
        before + 1,
        "the set-up needs the write half received"
    );
    assert!(
        !qp.expect_write(&p.target, to, len, 0).unwrap(),
        "a zone over a write partly received is refused"
    );
    // Elsewhere it may be lent: the second datagram is received there and copied out.
    assert!(qp.expect_write(&p.target, 600_000, len, 0).unwrap());
    let got = next_completion(&p.server_cq);
    assert_eq!(got.wc.imm, Some(5));
    assert_eq!(p.target_bytes(to, len), data[..len]);
    assert!(qp.expect_write(&p.target, to, len, 1).unwrap());
}

/// Posts a receive of `len` bytes at `at` of the server's target and sends `data` into it from
/// the client's source; returns the server's completion (not checked) once both sides have one.
fn send_into(p: &Pair, at: usize, len: usize, data: &[u8], id: u64) -> Completion {
    p.src.write(0, data);
    p.server
        .qp
        .post_recv(&[RecvWr {
            wr_id: id,
            local: p.target.sge(at, len),
        }])
        .unwrap();
    p.client
        .qp
        .post_send(&[SendWr {
            wr_id: id,
            local: p.src.sge(0, data.len()),
            op: SendOp::Send { imm: None },
        }])
        .unwrap();
    let mut buf = [Completion::default(); 1];
    let start = Instant::now();
    let got = loop {
        assert!(start.elapsed() < Duration::from_secs(10), "no receive");
        if p.server_cq.poll(&mut buf).unwrap() == 1 {
            break buf[0];
        }
    };
    while p.client_cq.poll(&mut buf).unwrap() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no send completion"
        );
    }
    got
}

/// A SEND's first datagram is received straight into the buffer of the receive it is for
/// (the headers apart, in the engine's buffer); anything else that arrives while a receive is
/// posted is copied out and handled as usual, and nothing outside a posted buffer is written.
#[test]
fn a_send_is_received_into_the_posted_buffer_and_anything_else_is_copied_out() {
    let p = pair();
    let guard = pattern(REGION, 99);
    p.target.write(0, &guard);

    // One datagram, into a larger buffer: in place, and only its bytes changed. (Landings are
    // counted over up to ten SENDs: under load a retransmitted duplicate can arrive first and
    // be the datagram received into the buffer; only the bytes are exact every time.)
    let data = pattern(16 << 10, 1);
    for _ in 0..10 {
        let got = send_into(&p, 4096, 64 << 10, &data, 1);
        assert_eq!(got.wc.status, WcStatus::Success);
        assert_eq!(got.wc.byte_len as usize, data.len());
        assert!(p.target_bytes(4096, data.len()) == data, "the SEND's bytes");
        assert!(
            p.target_bytes(0, 4096) == guard[..4096],
            "bytes before the buffer"
        );
        if p.landed() >= 1 {
            break;
        }
    }
    let first = p.landed();
    assert!(first >= 1, "no SEND of ten was received in place");

    // A WRITE_WITH_IMM while a 64 KiB receive is posted: received into that receive's buffer,
    // it is copied out, consumes the receive and lands where it is addressed; nothing outside
    // the receive's buffer and the write's target changed.
    p.server
        .qp
        .post_recv(&[RecvWr {
            wr_id: 2,
            local: p.target.sge(100_000, 64 << 10),
        }])
        .unwrap();
    let write = pattern(20_000, 2);
    p.src.write(0, &write);
    p.client
        .qp
        .post_send(&[SendWr {
            wr_id: 2,
            local: p.src.sge(0, write.len()),
            op: SendOp::WriteWithImm {
                remote: p.target.remote(200_000),
                imm: 2,
            },
        }])
        .unwrap();
    let got = next_completion(&p.server_cq);
    assert_eq!((got.wc.wr_id, got.wc.imm), (2, Some(2)));
    next_completion(&p.client_cq);
    assert!(p.target_bytes(200_000, write.len()) == write, "the write");
    let outside = 100_000 + (64 << 10);
    assert!(p.target_bytes(20_480, 100_000 - 20_480) == guard[20_480..100_000]);
    assert!(p.target_bytes(outside, 200_000 - outside) == guard[outside..200_000]);
    assert_eq!(p.landed(), first, "a write is not a SEND");

    // After a write the engine expects writes: the next SEND is received the usual way, and
    // those after it (several datagrams) have their first datagram received in place.
    let long = pattern(200_000, 3);
    for round in 3..13 {
        let got = send_into(&p, 300_000, 256 << 10, &long, round);
        assert_eq!(got.wc.status, WcStatus::Success);
        assert!(p.target_bytes(300_000, long.len()) == long, "round {round}");
        if round == 3 {
            assert_eq!(p.landed(), first, "received the usual way");
        } else if p.landed() > first {
            break;
        }
    }
    assert!(
        p.landed() > first,
        "no first datagram of nine SENDs was received in place"
    );
    let end = 300_000 + (256 << 10);
    assert!(p.target_bytes(end, REGION - end) == guard[end..]);

    // Too long for the buffer: the receive fails as verbs says, and not a byte past the
    // buffer was written (the kernel put the datagram's rest in the engine's buffer).
    let too_long = pattern(12_000, 4);
    let got = send_into(&p, 700_000, 9000, &too_long, 20);
    assert_eq!(got.wc.status, WcStatus::LocalLength);
    let past = 700_000 + 9000;
    assert!(
        p.target_bytes(past, 4096) == guard[past..past + 4096],
        "bytes past the receive's buffer were written"
    );
}
