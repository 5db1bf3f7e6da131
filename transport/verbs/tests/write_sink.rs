//! Write sinks (`MemoryRegion::write_sink`, `WriteSink::run`): while `run`'s body runs, the
//! WRITE packets landing entirely inside the sunk range go to the sink's function instead of
//! into the region; everything else, and everything once `run` returns, is stored as usual.
//! Over real sockets (sockets engine, caller progress, loopback).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use tbrdma_verbs::*;

mod common;
use common::{Pair, next_completion};

const REGION: usize = 1 << 20;
const AT: usize = 4096;
const SUNK: usize = 256 << 10;

fn pair() -> Pair {
    let p = common::pair(common::caller(), REGION, REGION, 64);
    let bytes: Vec<u8> = (0..REGION)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add((i >> 8) as u8))
        .collect();
    p.src.write(0, &bytes);
    p
}

fn src_bytes(p: &Pair, at: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    p.src.read(at, &mut out);
    out
}

fn target_bytes(p: &Pair, at: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    p.target.read(at, &mut out);
    out
}

/// WRITE_WITH_IMM of `len` bytes from the client's `src` at `from` to the server's `target` at
/// `to`; returns when both sides completed it (the server's polls place it).
fn write(p: &Pair, from: usize, to: usize, len: usize) {
    p.server
        .qp
        .post_recv(&[RecvWr {
            wr_id: 0,
            local: p.target.sge(0, 0),
        }])
        .unwrap();
    p.client
        .qp
        .post_send(&[SendWr {
            wr_id: 1,
            local: p.src.sge(from, len),
            op: SendOp::WriteWithImm {
                remote: p.target.remote(to),
                imm: 7,
            },
        }])
        .unwrap();
    let got = next_completion(&p.server_cq);
    assert_eq!(got.wc.byte_len as usize, len);
    next_completion(&p.client_cq);
}

#[test]
fn a_sink_takes_the_writes_inside_its_range_and_only_while_it_runs() {
    let p = pair();
    let sink = p.target.write_sink(AT..AT + SUNK);
    let mut taken = vec![0u8; SUNK];
    let mut covered = 0usize;
    let calls = AtomicUsize::new(0);
    let mut place = |at: usize, bytes: &[u8]| {
        taken[at..at + bytes.len()].copy_from_slice(bytes);
        covered += bytes.len();
        calls.fetch_add(1, Relaxed);
        true
    };
    let (installed, ()) = sink.run(&mut place, || {
        // A message of several packets, all inside the range.
        write(&p, 0, AT, SUNK);
        assert!(calls.load(Relaxed) > 1, "one packet for {SUNK} bytes?");
        // One reaching past the range's end: stored as usual, none of it sunk.
        let before = calls.load(Relaxed);
        write(&p, 0, AT + SUNK - 1024, 8192);
        assert_eq!(calls.load(Relaxed), before);
    });
    assert!(installed);
    assert_eq!(covered, SUNK, "every packet went to the sink once");
    assert_eq!(taken, src_bytes(&p, 0, SUNK), "the sink got the payloads");
    assert!(
        target_bytes(&p, AT, SUNK - 1024).iter().all(|&b| b == 0),
        "what the sink took was not stored"
    );
    assert_eq!(
        target_bytes(&p, AT + SUNK - 1024, 8192),
        src_bytes(&p, 0, 8192)
    );
    // Once `run` returned, the range is the region's again.
    let before = calls.load(Relaxed);
    write(&p, 8192, AT, 4096);
    assert_eq!(calls.load(Relaxed), before);
    assert_eq!(target_bytes(&p, AT, 4096), src_bytes(&p, 8192, 4096));
}

#[test]
fn what_the_sink_declines_is_stored() {
    let p = pair();
    let seen = AtomicUsize::new(0);
    let first_len = AtomicUsize::new(0);
    let mut place = |at: usize, bytes: &[u8]| {
        seen.fetch_add(bytes.len(), Relaxed);
        // Takes the first packet only.
        if at == 0 {
            first_len.store(bytes.len(), Relaxed);
        }
        at == 0
    };
    let (installed, ()) = p
        .target
        .write_sink(AT..AT + SUNK)
        .run(&mut place, || write(&p, 0, AT, SUNK));
    assert!(installed);
    assert_eq!(seen.load(Relaxed), SUNK);
    let first = first_len.load(Relaxed);
    assert!(0 < first && first < SUNK, "several packets");
    let stored = target_bytes(&p, AT, SUNK);
    let sent = src_bytes(&p, 0, SUNK);
    assert!(stored[..first].iter().all(|&b| b == 0), "taken: not stored");
    assert_eq!(stored[first..], sent[first..], "declined: stored");
}

#[test]
fn one_sink_per_protection_domain_and_only_inside_the_region() {
    let p = pair();
    let mut never = |_: usize, _: &[u8]| -> bool { panic!("nothing is written") };
    let (installed, ()) = p
        .target
        .write_sink(REGION - 10..REGION + 10)
        .run(&mut never, || {});
    assert!(!installed, "a range past the region's end");
    let mut outer = |_: usize, _: &[u8]| true;
    let (outer_installed, inner_installed) = p.target.write_sink(0..4096).run(&mut outer, || {
        let mut inner = |_: usize, _: &[u8]| true;
        p.target.write_sink(8192..12288).run(&mut inner, || {}).0
    });
    assert!(outer_installed);
    assert!(
        !inner_installed,
        "a second sink in the same protection domain"
    );
    // And once the first has gone, another can run.
    let mut again = |_: usize, _: &[u8]| true;
    assert!(p.target.write_sink(0..4096).run(&mut again, || {}).0);
}

#[test]
fn a_body_that_panics_leaves_no_sink_behind() {
    let p = pair();
    let calls = AtomicUsize::new(0);
    let mut place = |_: usize, _: &[u8]| {
        calls.fetch_add(1, Relaxed);
        true
    };
    let sink = p.target.write_sink(AT..AT + SUNK);
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        sink.run(&mut place, || panic!("the body fails"));
    }));
    assert!(panicked.is_err());
    write(&p, 0, AT, 4096);
    assert_eq!(calls.load(Relaxed), 0, "the sink is gone");
    assert_eq!(target_bytes(&p, AT, 4096), src_bytes(&p, 0, 4096));
}
