//! A ping-pong whose ping and reply travel on two queue pairs between the same two devices, as
//! NCCL's send and receive comms do: the acknowledgement each side owes rides in the datagram
//! of the other queue pair (`TxBatch::commit_coalescing`), so each message costs one datagram,
//! not two, and every message arrives intact. Caller progress (the plugin's default),
//! loopback, no root.

use std::time::{Duration, Instant};

use tbrdma_verbs::*;

const ROUNDS: usize = 500;
const SIZE: usize = 64;

fn caller() -> DeviceConfig {
    DeviceConfig {
        engine: EngineConfig {
            progress: Progress::Caller,
            engine: EngineKind::Sockets,
            ..Default::default()
        },
        port: 0,
    }
}

/// One end of one queue pair.
struct End {
    conn: Connected,
    cq: CompletionQueue,
    mr: MemoryRegion,
}

fn end(pd: &ProtectionDomain, conn: Connected, cq: CompletionQueue) -> End {
    End {
        conn,
        cq,
        mr: pd.alloc_mr(1 << 16, Access::LOCAL_WRITE).unwrap(),
    }
}

/// Queue pair `from` → `to`: `from` connects, `to` accepts on a thread.
fn queue_pair(from: (&Device, &ProtectionDomain), to: (&Device, &ProtectionDomain)) -> (End, End) {
    let listener = Listener::bind(to.0, 0).unwrap();
    let addr = listener.local_addr().unwrap();
    let (to_pd, to_cq) = (to.1.clone(), to.0.create_cq(2048));
    let accept = std::thread::spawn(move || {
        let conn = listener
            .accept(
                &to_pd,
                &to_cq,
                &to_cq,
                &QpOptions::default(),
                Some(Duration::from_secs(20)),
            )
            .unwrap();
        (conn, to_cq)
    });
    let cq = from.0.create_cq(2048);
    let conn = connect(from.1, addr, &cq, &cq, &QpOptions::default()).unwrap();
    let (to_conn, to_cq) = accept.join().unwrap();
    (end(from.1, conn, cq), end(to.1, to_conn, to_cq))
}

fn post_recv(e: &End) {
    e.conn
        .qp
        .post_recv(&[RecvWr {
            wr_id: 1,
            local: e.mr.sge(0, SIZE),
        }])
        .unwrap();
}

fn send(e: &End, round: usize) {
    e.mr.write(1024, &pattern(round));
    e.conn
        .qp
        .post_send(&[SendWr {
            wr_id: 2,
            local: e.mr.sge(1024, SIZE),
            op: SendOp::Send { imm: None },
        }])
        .unwrap();
}

fn pattern(round: usize) -> Vec<u8> {
    (0..SIZE).map(|i| (i * 7 + round) as u8).collect()
}

/// Polls until the receive completes; checks its bytes. The send's own completion may come
/// along (both use one completion queue).
fn receive(e: &End, round: usize) {
    let start = Instant::now();
    let mut buf = [Completion::default(); 4];
    loop {
        let n = e.cq.poll(&mut buf).unwrap();
        let mut got = false;
        for c in &buf[..n] {
            assert_eq!(c.wc.status, WcStatus::Success, "{c:?}");
            got |= c.wc.opcode == WcOpcode::Recv;
        }
        if got {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "round {round}: nothing arrived"
        );
    }
    let mut bytes = vec![0u8; SIZE];
    e.mr.read(0, &mut bytes);
    assert_eq!(bytes, pattern(round), "round {round}");
}

/// Takes the sender's completions (queued on a completion queue of their own, larger than
/// the run's sends) until all `n` have come, each a success: every send was acknowledged.
fn sends_completed(e: &End, n: usize) {
    let mut buf = [Completion::default(); 64];
    let (start, mut got) = (Instant::now(), 0);
    while got < n {
        let k = e.cq.poll(&mut buf).unwrap();
        for c in &buf[..k] {
            assert_eq!(c.wc.status, WcStatus::Success, "{c:?}");
        }
        got += k;
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{got} of {n} sends acknowledged"
        );
    }
}

#[test]
fn each_side_of_a_ping_pong_over_two_queue_pairs_sends_one_datagram_per_message() {
    let (dev_a, dev_b) = (
        Device::open("127.0.0.1", caller()).unwrap(),
        Device::open("127.0.0.1", caller()).unwrap(),
    );
    let (pd_a, pd_b) = (dev_a.alloc_pd(), dev_b.alloc_pd());
    // Pings go a → b on one queue pair, replies b → a on the other.
    let (ping_tx, ping_rx) = queue_pair((&dev_a, &pd_a), (&dev_b, &pd_b));
    let (reply_tx, reply_rx) = queue_pair((&dev_b, &pd_b), (&dev_a, &pd_a));
    post_recv(&ping_rx);
    post_recv(&reply_rx);
    // A first round trip outside the count (the connections' set-up traffic is over).
    send(&ping_tx, 0);
    receive(&ping_rx, 0);
    post_recv(&ping_rx);
    send(&reply_tx, 0);
    receive(&reply_rx, 0);
    post_recv(&reply_rx);
    let (before_a, before_b) = (dev_a.engine_stats(), dev_b.engine_stats());
    for round in 1..=ROUNDS {
        send(&ping_tx, round);
        receive(&ping_rx, round);
        // Reply first, then post the next receive (a ping that comes first waits for it in
        // the receive-not-ready retries).
        send(&reply_tx, round);
        post_recv(&ping_rx);
        receive(&reply_rx, round);
        post_recv(&reply_rx);
        // One more engine pass before the next ping, as NCCL's proxy polls again before it
        // posts (this completion queue is empty, so the poll runs one): it must not send the
        // reply's acknowledgement by itself (the ping carries it).
        assert_eq!(
            reply_rx.cq.poll(&mut [Completion::default(); 1]).unwrap(),
            0
        );
    }
    let (after_a, after_b) = (dev_a.engine_stats(), dev_b.engine_stats());
    sends_completed(&ping_tx, ROUNDS + 1);
    sends_completed(&reply_tx, ROUNDS + 1);
    for (who, before, after) in [("a", before_a, after_a), ("b", before_b, after_b)] {
        let datagrams = after.datagrams_sent - before.datagrams_sent;
        let coalesced = after.packets_coalesced - before.packets_coalesced;
        // One message per round from each side; without the acknowledgement riding along,
        // each round costs a second datagram (about 2 * ROUNDS).
        assert!(
            datagrams <= ROUNDS as u64 * 13 / 10,
            "{who}: {datagrams} datagrams for {ROUNDS} messages ({coalesced} packets coalesced)"
        );
        assert!(
            coalesced >= ROUNDS as u64 / 2,
            "{who}: only {coalesced} acknowledgements rode with a message"
        );
    }
}
