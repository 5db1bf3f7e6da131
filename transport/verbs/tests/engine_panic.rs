//! A bug in the engine (a panic in its loop, injected here with the fault plan's
//! `panic_after`) becomes flushed completions and an error on every later call, in both
//! progress modes: never a hang, a poisoned-lock panic in the application, or an abort.

use std::time::Duration;

use tbrdma_engine::io::faults::FaultPlan;
use tbrdma_verbs::*;

fn config(progress: Progress, faults: Option<FaultPlan>) -> DeviceConfig {
    DeviceConfig {
        engine: EngineConfig {
            progress,
            engine: EngineKind::Sockets,
            faults,
            ..Default::default()
        },
        port: 0,
    }
}

fn a_panic_in_the_engine_flushes_and_fails_every_later_call(progress: Progress) {
    // The server runs its own loop, so that only the client needs polling.
    let server_dev = Device::open("127.0.0.1", config(Progress::Thread, None)).unwrap();
    let server_pd = server_dev.alloc_pd();
    let target = server_pd
        .alloc_mr(1 << 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let server_cq = server_dev.create_cq(64);
    let listener = Listener::bind(&server_dev, 0).unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = std::thread::spawn(move || {
        let conn = listener
            .accept(
                &server_pd,
                &server_cq,
                &server_cq,
                &QpOptions::default(),
                Some(Duration::from_secs(20)),
            )
            .unwrap();
        (conn, server_cq)
    });
    // The client's engine panics on the 40th datagram it receives.
    let plan = FaultPlan::parse("panic_after=40").unwrap();
    let client_dev = Device::open("127.0.0.1", config(progress, Some(plan))).unwrap();
    let client_pd = client_dev.alloc_pd();
    let client_cq = client_dev.create_cq(64);
    let src = client_pd.alloc_mr(1 << 16, Access::LOCAL_WRITE).unwrap();
    let client = connect(
        &client_pd,
        addr,
        &client_cq,
        &client_cq,
        &QpOptions::default(),
    )
    .unwrap();
    let (_server_conn, _server_cq) = accept.join().unwrap();

    // A receive no message will match: it is in flight whenever the engine fails, so its flush
    // proves that what was in flight is flushed. The writes may all have completed just then:
    // once in about twenty runs beside the other test, no write was flushed (likely the keeper
    // taking over a caller descheduled between a completion and its next post).
    const PENDING_RECV: u64 = u64::MAX;
    client
        .qp
        .post_recv(&[RecvWr {
            wr_id: PENDING_RECV,
            local: src.sge(8192, 64),
        }])
        .unwrap();
    let mut recv_flushed = false;
    // Writes, eight in flight, until the engine fails; every one posted must complete.
    let mut posted = 0u64;
    let mut completed = 0u64;
    let mut flushed = 0u64;
    let mut post_error = None;
    let mut poll_errors = 0u64;
    let mut wcs = [Completion::default(); 16];
    let mut polls = 0u64;
    while post_error.is_none() || completed < posted || !recv_flushed {
        if post_error.is_none() && posted - completed < 8 {
            let wr = SendWr {
                wr_id: posted,
                local: src.sge(0, 4096),
                op: SendOp::Write {
                    remote: target.remote(0),
                },
            };
            match client.qp.post_send(&[wr]) {
                Ok(()) => posted += 1,
                Err(e) => post_error = Some(e.to_string()),
            }
        }
        match client_cq.poll(&mut wcs) {
            Ok(n) => {
                for wc in &wcs[..n] {
                    if wc.wc.wr_id == PENDING_RECV {
                        assert_eq!(wc.wc.status, WcStatus::Flushed, "{wc:?}");
                        recv_flushed = true;
                        continue;
                    }
                    completed += 1;
                    if wc.wc.status == WcStatus::Flushed {
                        flushed += 1;
                    } else {
                        assert_eq!(wc.wc.status, WcStatus::Success, "{wc:?}");
                    }
                }
            }
            Err(_) => poll_errors += 1,
        }
        polls += 1;
        assert!(
            polls < 20_000_000,
            "no end: posted {posted}, completed {completed}, post error {post_error:?}"
        );
        if progress == Progress::Thread {
            std::thread::yield_now();
        }
    }
    let post_error = post_error.unwrap();
    assert!(
        post_error.contains("engine failed") && post_error.contains("panic_after"),
        "the error names the failure: {post_error}"
    );
    // `recv_flushed` ended the loop: the receive in flight when it failed was flushed. The
    // writes flushed were in flight then too: at most the window.
    assert!(
        flushed <= 8,
        "{flushed} writes flushed, more than were in flight"
    );
    assert!(
        progress == Progress::Thread || poll_errors > 0,
        "in caller mode the poll that ran into the panic reports it"
    );
    // Later calls keep failing cleanly, and everything drops without a hang or an abort.
    let wr = RecvWr {
        wr_id: 1,
        local: src.sge(0, 64),
    };
    assert!(client.qp.post_recv(&[wr]).is_err());
    drop(client);
    drop(src);
    drop(client_cq);
    drop(client_dev);
}

#[test]
fn a_panic_in_the_engine_thread_flushes_and_fails_every_later_call() {
    a_panic_in_the_engine_flushes_and_fails_every_later_call(Progress::Thread);
}

#[test]
fn a_panic_in_a_callers_poll_flushes_and_fails_every_later_call() {
    a_panic_in_the_engine_flushes_and_fails_every_later_call(Progress::Caller);
}
