//! A peer that lies to the receive comm: the sending end is a bare queue pair driven by hand
//! (127.0.0.1, caller progress), which asks for a clear-to-send as a real sender does and then
//! writes more bytes than the CTS offered. The rkey it was given covers NCCL's whole
//! registration, so the transport lets the bytes land inside it; the receive comm must fail the
//! receive (and the connection) rather than report the larger size to NCCL.

use std::time::{Duration, Instant};

use tbrdma_verbs::{
    Access, Completion, QpOptions, QueuePair, RecvWr, RemoteAddr, SendOp, SendWr, WcOpcode,
    WcStatus,
};

use super::{CQ_CAPACITY, CTS_LEN, Cts, EAGER_MAX, RTS, Registration};
use crate::error::NetError;

/// Size of the receive NCCL posts (a rendezvous one), and of its registration (larger, as
/// NCCL's buffers are).
const POSTED: u64 = 4 * EAGER_MAX;
const REGISTERED: usize = 4 * POSTED as usize;

#[test]
fn a_write_longer_than_the_cts_offered_fails_the_receive() {
    let (dev, pd, server, acceptor) = super::wire_tests::receiver_on_loopback("liar");
    // The liar: a bare queue pair with a buffer for the CTS and the bytes it will write.
    let scq = dev.create_cq(CQ_CAPACITY);
    let c = tbrdma_verbs::connect(&pd, server, &scq, &scq, &QpOptions::default()).expect("connect");
    let liar: QueuePair = c.qp;
    let lmr = pd
        .alloc_mr(REGISTERED, Access::LOCAL_WRITE)
        .expect("liar's region");
    liar.post_recv(&[RecvWr {
        wr_id: 1,
        local: lmr.sge(0, CTS_LEN),
    }])
    .expect("post the CTS receive");
    let recv = acceptor.join().expect("acceptor");

    // NCCL registers a buffer and posts a receive smaller than it.
    let mr = recv
        .pd()
        .alloc_mr(REGISTERED, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("NCCL's buffer");
    let addr = mr.addr();
    let handle = recv.regs.lock().unwrap().insert(Registration {
        addr,
        len: REGISTERED as u64,
        mr,
    });
    let slot = recv
        .irecv(addr, POSTED, handle)
        .expect("irecv")
        .expect("a request slot");

    // Message 0: a request-to-send, as a sender of a large message does.
    liar.post_send(&[SendWr {
        wr_id: 2,
        local: lmr.sge(0, 0),
        op: SendOp::Send { imm: Some(RTS) },
    }])
    .expect("RTS");
    let start = Instant::now();
    let mut got = Vec::new();
    let cts = loop {
        assert!(recv.test(slot).expect("test before the write").is_none());
        let mut buf = [Completion::default(); 4];
        let n = scq.poll(&mut buf).expect("poll");
        got.extend_from_slice(&buf[..n]);
        if let Some(c) = got.iter().find(|c| c.wc.opcode == WcOpcode::Recv) {
            assert_eq!(c.wc.status, WcStatus::Success);
            let mut bytes = [0u8; CTS_LEN];
            lmr.read(0, &mut bytes);
            break Cts::decode(&bytes).expect("a CTS");
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no CTS: {got:?}");
    };
    assert_eq!((cts.seq, cts.size, cts.addr), (0, POSTED, addr));

    // The lie: twice what the CTS offered, still inside NCCL's registration.
    let lie = 2 * POSTED as usize;
    lmr.write(0, &vec![0xa5; lie]);
    liar.post_send(&[SendWr {
        wr_id: 3,
        local: lmr.sge(0, lie),
        op: SendOp::WriteWithImm {
            remote: RemoteAddr {
                addr: cts.addr,
                rkey: cts.rkey,
            },
            imm: 0,
        },
    }])
    .expect("the long write");
    let start = Instant::now();
    let outcome = loop {
        match recv.test(slot) {
            Ok(None) => {}
            other => break other,
        }
        let _ = scq.poll(&mut [Completion::default(); 4]);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the receive never ended"
        );
    };
    match outcome {
        Err(NetError::Remote { detail, .. }) => {
            assert!(detail.contains("claims"), "{detail}")
        }
        other => panic!("a write beyond the CTS must fail the receive, got {other:?}"),
    }
}
