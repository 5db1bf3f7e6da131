//! Pinned memory comes back: a region dropped while a receive still named it is unpinned once
//! that receive's queue pair goes (thread progress: the engine removes the queue pair once its
//! CLOSE is out). Before, the region's bytes stayed pinned for the life of the device. One test
//! in this binary, so that the process's locked memory is this test's alone.

use std::time::{Duration, Instant};

use tbrdma_verbs::*;

mod common;

/// The process's locked memory, in KiB (`VmLck`).
fn locked_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmLck in /proc/self/status")
}

#[test]
fn a_region_dropped_under_a_posted_receive_is_unpinned_when_its_queue_pair_goes() {
    const LEN: usize = 64 << 20;
    let thread = DeviceConfig {
        engine: EngineConfig {
            progress: Progress::Thread,
            engine: EngineKind::Sockets,
            ..Default::default()
        },
        port: 0,
    };
    let _ = nix::sys::resource::setrlimit(
        nix::sys::resource::Resource::RLIMIT_MEMLOCK,
        nix::sys::resource::RLIM_INFINITY,
        nix::sys::resource::RLIM_INFINITY,
    );
    let before = locked_kib();
    let pair = std::panic::catch_unwind(|| common::pair(thread, LEN, 4096, 16));
    let Ok(common::Pair {
        server_dev: _server_dev,
        server,
        server_cq: _server_cq,
        target,
        client_dev: _client_dev,
        client: _client,
        client_cq: _client_cq,
        src: _src,
    }) = pair
    else {
        eprintln!("skipping: cannot pin a 64 MiB region here (memlock limit)");
        return;
    };
    let pinned = locked_kib();
    assert!(
        pinned >= before + (LEN as u64 >> 10),
        "{before} -> {pinned} KiB"
    );
    server
        .qp
        .post_recv(&[RecvWr {
            wr_id: 1,
            local: target.sge(0, LEN),
        }])
        .unwrap();
    // The application lets go of the region first (its keys are revoked, its bytes stay: the
    // receive names them), then of the queue pair.
    drop(target);
    drop(server);
    let start = Instant::now();
    while locked_kib() > pinned - (LEN as u64 >> 10) / 2 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "still {} KiB locked (was {pinned} with the region, {before} before)",
            locked_kib()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
