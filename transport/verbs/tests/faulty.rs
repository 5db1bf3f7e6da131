//! Every operation over a faulty cable made in user space (the engine's fault layer: loss,
//! duplicates, corruption and reordering on both sides), on loopback, with no root and no
//! nftables: each request completes successfully and every byte is where it belongs. Run with
//! caller progress and with assisted thread progress (the libibverbs library's: application
//! threads and a non-spinning engine thread share the sockets), the latter on the sockets
//! engine and on the packet engine, whose two backends share one receive ring (root; without
//! it that run falls back to sockets).

use std::time::{Duration, Instant};

use tbrdma_engine::io::faults::{FaultPlan, injected};
use tbrdma_verbs::*;

const REGION: usize = 8 << 20;
// Where each operation of the test puts its bytes: odd offsets, far enough apart for the
// largest size.
const AT_WRITE: usize = 100;
const AT_WRITE_IMM: usize = 2_000_003;
const AT_SEND: usize = 4_000_005;
const AT_READ: usize = 6_000_007;
/// Where the WRITEs a reader learns of by polling their last word go (8-byte aligned).
const AT_FLAGGED: usize = 4096;

/// The cable of most tests here: a bit of every fault.
const EVERY_FAULT: &str = "drop=3%,dup=2%,corrupt=2%,reorder=3%,reorder_by=300us";

/// Who runs the loop, and on which engine.
#[derive(Clone, Copy)]
enum Mode {
    Caller,
    Assisted(EngineKind),
}

fn faulty(seed: u64, faults: &str, mode: Mode) -> DeviceConfig {
    let assisted = matches!(mode, Mode::Assisted(_));
    let plan = FaultPlan::parse(&format!("seed={seed},{faults}")).unwrap();
    DeviceConfig {
        engine: EngineConfig {
            progress: if assisted {
                Progress::Thread
            } else {
                Progress::Caller
            },
            assist: assisted,
            spin: if assisted {
                Duration::ZERO
            } else {
                EngineConfig::default().spin
            },
            engine: match mode {
                Mode::Caller => EngineKind::Sockets,
                Mode::Assisted(engine) => engine,
            },
            faults: Some(plan),
            ..Default::default()
        },
        port: 0,
    }
}

struct Side {
    dev: Device,
    conn: Connected,
    cq: CompletionQueue,
    mr: MemoryRegion,
}

fn pair(mode: Mode) -> (Side, Side) {
    pair_over(EVERY_FAULT, mode)
}

fn pair_over(faults: &str, mode: Mode) -> (Side, Side) {
    let access =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let server_dev = Device::open("127.0.0.1", faulty(11, faults, mode)).unwrap();
    if let Mode::Assisted(engine) = mode
        && nix::unistd::geteuid().is_root()
    {
        assert_eq!(
            server_dev.engine_kind(),
            engine,
            "fell back to another engine"
        );
    }
    let server_pd = server_dev.alloc_pd();
    let server_mr = server_pd.alloc_mr(REGION, access).unwrap();
    let server_cq = server_dev.create_cq(256);
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
    let client_dev = Device::open("127.0.0.1", faulty(22, faults, mode)).unwrap();
    let client_pd = client_dev.alloc_pd();
    let client_cq = client_dev.create_cq(256);
    let client_mr = client_pd.alloc_mr(REGION, access).unwrap();
    let conn = connect(
        &client_pd,
        addr,
        &client_cq,
        &client_cq,
        &QpOptions::default(),
    )
    .unwrap();
    let (server_conn, server_cq) = accept.join().unwrap();
    (
        Side {
            dev: server_dev,
            conn: server_conn,
            cq: server_cq,
            mr: server_mr,
        },
        Side {
            dev: client_dev,
            conn,
            cq: client_cq,
            mr: client_mr,
        },
    )
}

/// Polls both sides (caller progress: each poll drives its device) until `want_server` and
/// `want_client` completions arrived; all must be successful.
fn complete(
    server: &Side,
    client: &Side,
    want_server: usize,
    want_client: usize,
) -> Vec<Completion> {
    let mut got_server = Vec::new();
    let mut got_client = Vec::new();
    let mut buf = [Completion::default(); 8];
    let start = Instant::now();
    while got_server.len() < want_server || got_client.len() < want_client {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "stuck: server {got_server:?}, client {got_client:?}"
        );
        let n = server.cq.poll(&mut buf).unwrap();
        got_server.extend_from_slice(&buf[..n]);
        let n = client.cq.poll(&mut buf).unwrap();
        got_client.extend_from_slice(&buf[..n]);
    }
    for c in got_server.iter().chain(&got_client) {
        assert_eq!(c.wc.status, WcStatus::Success, "{c:?}");
    }
    assert_eq!(
        (got_server.len(), got_client.len()),
        (want_server, want_client)
    );
    got_client
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

fn bytes(mr: &MemoryRegion, at: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    mr.read(at, &mut out);
    out
}

/// A reader that learns of each WRITE by polling its last word, as `ib_write_lat` and `tbrdma
/// pingpong --op write` do, over a cable that holds back a third of the datagrams so that later
/// ones overtake them: a message's last datagram is placed only after all its others
/// (docs/semantics.md, "Visibility"), so whenever the reader sees the word, the whole WRITE is
/// in place. Caller progress: datagrams are placed only inside the reader's own polls, so the
/// memory it checks cannot change under it.
#[test]
fn a_writes_last_word_shows_only_once_the_whole_write_is_in_place() {
    let (server, client) = pair_over("reorder=35%,reorder_by=300us", Mode::Caller);
    // Several datagrams per WRITE; the word is the last 8 bytes.
    let len = 200_000usize;
    let mut buf = [Completion::default(); 8];
    for k in 1..=150u64 {
        let mut data = pattern(len, k);
        data[len - 8..].copy_from_slice(&k.to_le_bytes());
        client.mr.write(0, &data);
        client
            .conn
            .qp
            .post_send(&[SendWr {
                wr_id: k,
                local: client.mr.sge(0, len),
                op: SendOp::Write {
                    remote: server.mr.remote(AT_FLAGGED),
                },
            }])
            .unwrap();
        let start = Instant::now();
        loop {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "WRITE {k} never showed"
            );
            assert_eq!(server.cq.poll(&mut buf).unwrap(), 0);
            if server.mr.load_u64(AT_FLAGGED + len - 8) == k {
                assert!(
                    bytes(&server.mr, AT_FLAGGED, len) == data,
                    "WRITE {k}: the last word showed before the rest of the WRITE"
                );
                break;
            }
            // The writer's engine runs only in its polls too: its retransmissions need them.
            let n = client.cq.poll(&mut buf).unwrap();
            assert!(buf[..n].iter().all(|c| c.wc.status == WcStatus::Success));
        }
        complete(&server, &client, 0, 1);
    }
    let stats = server.conn.qp.stats();
    assert!(
        stats.out_of_order_stashed > 0,
        "no last datagram ever came early: {stats:?}"
    );
}

#[test]
fn every_operation_is_exact_over_a_faulty_cable() {
    every_operation_is_exact(Mode::Caller);
}

#[test]
fn every_operation_is_exact_over_a_faulty_cable_with_assisted_thread_progress() {
    every_operation_is_exact(Mode::Assisted(EngineKind::Sockets));
}

#[test]
fn every_operation_is_exact_over_a_faulty_cable_assisted_on_the_packet_engine() {
    every_operation_is_exact(Mode::Assisted(EngineKind::Packet));
}

fn every_operation_is_exact(mode: Mode) {
    let (server, client) = pair(mode);
    // The last is one that the engine places with streaming stores
    // (`tbrdma_engine::memory::STREAMING_MESSAGE_MIN`), of a length that is no multiple of 64.
    let sizes = [
        1usize,
        8,
        4000,
        16 << 10,
        64 << 10,
        300_000,
        tbrdma_engine::memory::STREAMING_MESSAGE_MIN as usize + 4093,
    ];
    for round in 0..3u64 {
        for (i, &len) in sizes.iter().enumerate() {
            let seed = round * 100 + i as u64;
            let tag = format!("round {round}, {len} bytes");

            // WRITE, then WRITE_WITH_IMM into another place.
            let data = pattern(len, seed);
            client.mr.write(0, &data);
            client
                .conn
                .qp
                .post_send(&[SendWr {
                    wr_id: 1,
                    local: client.mr.sge(0, len),
                    op: SendOp::Write {
                        remote: server.mr.remote(AT_WRITE),
                    },
                }])
                .unwrap();
            complete(&server, &client, 0, 1);
            assert!(bytes(&server.mr, AT_WRITE, len) == data, "{tag}: WRITE");

            server
                .conn
                .qp
                .post_recv(&[RecvWr {
                    wr_id: 2,
                    local: server.mr.sge(0, 0),
                }])
                .unwrap();
            let data = pattern(len, seed + 1);
            client.mr.write(0, &data);
            client
                .conn
                .qp
                .post_send(&[SendWr {
                    wr_id: 3,
                    local: client.mr.sge(0, len),
                    op: SendOp::WriteWithImm {
                        remote: server.mr.remote(AT_WRITE_IMM),
                        imm: seed as u32,
                    },
                }])
                .unwrap();
            complete(&server, &client, 1, 1);
            assert!(
                bytes(&server.mr, AT_WRITE_IMM, len) == data,
                "{tag}: WRITE_WITH_IMM"
            );

            // SEND into a posted receive.
            let data = pattern(len, seed + 2);
            client.mr.write(0, &data);
            server
                .conn
                .qp
                .post_recv(&[RecvWr {
                    wr_id: 4,
                    local: server.mr.sge(AT_SEND, len),
                }])
                .unwrap();
            client
                .conn
                .qp
                .post_send(&[SendWr {
                    wr_id: 5,
                    local: client.mr.sge(0, len),
                    op: SendOp::Send { imm: None },
                }])
                .unwrap();
            complete(&server, &client, 1, 1);
            assert!(bytes(&server.mr, AT_SEND, len) == data, "{tag}: SEND");

            // READ back what the server holds.
            let data = pattern(len, seed + 3);
            server.mr.write(AT_WRITE, &data);
            client
                .conn
                .qp
                .post_send(&[SendWr {
                    wr_id: 6,
                    local: client.mr.sge(AT_READ, len),
                    op: SendOp::Read {
                        remote: server.mr.remote(AT_WRITE),
                    },
                }])
                .unwrap();
            complete(&server, &client, 0, 1);
            assert!(bytes(&client.mr, AT_READ, len) == data, "{tag}: READ");
        }
        // Atomics: a hundred adds land exactly once each, duplicates notwithstanding.
        server.mr.write(8, &0u64.to_le_bytes());
        for k in 0..100u64 {
            client
                .conn
                .qp
                .post_send(&[SendWr {
                    wr_id: 7,
                    local: client.mr.sge(64, 8),
                    op: SendOp::FetchAdd {
                        remote: server.mr.remote(8),
                        add: 3,
                    },
                }])
                .unwrap();
            complete(&server, &client, 0, 1);
            let old = u64::from_le_bytes(bytes(&client.mr, 64, 8).try_into().unwrap());
            assert_eq!(old, 3 * k, "round {round}: FETCH_ADD {k} saw {old}");
        }
        let total = u64::from_le_bytes(bytes(&server.mr, 8, 8).try_into().unwrap());
        assert_eq!(total, 300, "round {round}: every add applied exactly once");
    }

    // The cable really was faulty, in every way asked for.
    let done = injected();
    eprintln!("faults: {done}");
    assert!(done.dropped > 0, "{done}");
    assert!(done.duplicated > 0, "{done}");
    assert!(done.corrupted > 0, "{done}");
    assert!(done.reordered > 0, "{done}");
    // Corrupted datagrams were caught by the checksum, not accepted.
    let (s, c) = (server.conn.qp.stats(), client.conn.qp.stats());
    let rejected = server.dev.engine_stats().foreign_datagrams
        + client.dev.engine_stats().foreign_datagrams
        + s.corrupted
        + c.corrupted
        + s.malformed
        + c.malformed;
    assert!(rejected > 0, "no corrupted datagram was rejected");
    assert!(
        s.duplicates + c.duplicates > 0,
        "no duplicate was recognised"
    );
    assert!(s.retransmits + c.retransmits > 0, "nothing was resent");
}
