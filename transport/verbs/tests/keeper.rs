//! Caller progress with held acknowledgements: an application that stops polling right after
//! it received a message (as NCCL's proxy does when it has nothing else in flight) must not
//! leave the sender waiting. The engine's keeper sends the acknowledgement it still holds.

use std::time::{Duration, Instant};

use tbrdma_verbs::*;

mod common;

/// Polls `cq` (which drives its device) until a completion arrives or `limit` passes.
fn next_completion(cq: &CompletionQueue, limit: Duration) -> Option<Completion> {
    let mut buf = [Completion::default(); 1];
    let start = Instant::now();
    while start.elapsed() < limit {
        if cq.poll(&mut buf).unwrap() == 1 {
            return Some(buf[0]);
        }
    }
    None
}

#[test]
fn a_receiver_that_stops_polling_still_completes_the_senders_write() {
    receiver_goes_quiet(EngineConfig::default().keeper_period);
}

/// The collectives' setting: a keeper that checks every 10 ms (their connections' retransmission
/// floor is 20 ms; here the sender keeps the default 1 ms and retransmits a few times, which the
/// acknowledgement the keeper sends covers as well).
#[test]
fn a_keeper_with_a_longer_period_still_completes_the_senders_write() {
    receiver_goes_quiet(Duration::from_millis(10));
}

fn receiver_goes_quiet(keeper_period: Duration) {
    let common::Pair {
        server_dev,
        server,
        server_cq,
        target,
        client_cq,
        src,
        client,
        client_dev: _client_dev,
    } = common::pair(common::caller_with_keeper(keeper_period), 4096, 4096, 16);
    src.write(0, b"held");

    for round in 0..3 {
        server
            .qp
            .post_recv(&[RecvWr {
                wr_id: round,
                local: target.sge(0, 0),
            }])
            .unwrap();
        client
            .qp
            .post_send(&[SendWr {
                wr_id: round,
                local: src.sge(0, 4),
                op: SendOp::WriteWithImm {
                    remote: target.remote(0),
                    imm: round as u32,
                },
            }])
            .unwrap();
        // The receiver takes its completion, and with it the engine holds the acknowledgement
        // for a reply to carry; then it goes quiet: no poll, no post, for the rest of the round.
        let got = next_completion(&server_cq, Duration::from_secs(5)).expect("the write arrived");
        assert_eq!(got.wc.status, WcStatus::Success);
        assert_eq!(got.wc.imm, Some(round as u32));
        // The sender's write completes all the same, and successfully: nothing but the keeper
        // can answer it now (polling the sender's queue runs only the sender's engine). Without
        // it the sender would retransmit into a socket nobody reads and fail with RetryExceeded.
        let sent = next_completion(&client_cq, Duration::from_secs(5))
            .expect("the sender's write completes while the receiver is quiet");
        assert_eq!(sent.wc.status, WcStatus::Success, "round {round}: {sent:?}");
        assert_eq!(sent.wc.wr_id, round);
        let mut landed = [0u8; 4];
        target.read(0, &mut landed);
        assert_eq!(&landed, b"held");
    }
    drop(server_dev);
}
