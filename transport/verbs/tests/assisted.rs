//! Assisted thread progress (`EngineConfig::assist`, the libibverbs library's mode) when the
//! application stops calling: send posts queued for a poll that never comes still go out (the
//! engine thread sends them), and a target that never calls the library at all, only reads its
//! memory and posts replies, is served by its engine thread; a burst of posts longer than the
//! poll window still leaves in batches; a quiet target's engine thread receives a stream
//! awake; one device's two sets of backends keep sending when its socket is connected to one
//! peer and then disconnected for a second; an idle pair keeps no core busy. Loopback.
//!
//! Every test runs on both engines that assist: sockets, and packet, whose two backends share
//! one receive ring (root; without it the packet engine falls back to sockets, so the packet
//! runs then repeat the sockets ones).

use std::time::{Duration, Instant};

use tbrdma_verbs::*;

const REGION: usize = 1 << 20;
const SLOT: usize = 4096;

/// The tests here run one at a time: each measures how an engine thread behaves when the
/// application stops calling, which the busy threads of another test would disturb on a
/// small host (a poll window lapsing while a descheduled thread waits for a core).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs the test function `$name` on each engine, as `$name::sockets` and `$name::packet`.
macro_rules! on_each_engine {
    ($name:ident) => {
        mod $name {
            #[test]
            fn sockets() {
                super::$name(tbrdma_verbs::EngineKind::Sockets)
            }
            #[test]
            fn packet() {
                super::$name(tbrdma_verbs::EngineKind::Packet)
            }
        }
    };
}

/// An assisted device on loopback running `engine` (as root, checked to be that engine).
fn open_device(engine: EngineKind) -> Device {
    let config = DeviceConfig {
        engine: EngineConfig {
            progress: Progress::Thread,
            assist: true,
            spin: Duration::ZERO,
            engine,
            ..Default::default()
        },
        port: 0,
    };
    let dev = Device::open("127.0.0.1", config).unwrap();
    if nix::unistd::geteuid().is_root() {
        assert_eq!(
            dev.engine_kind(),
            engine,
            "the device fell back to another engine"
        );
    }
    dev
}

struct Side {
    conn: Connected,
    cq: CompletionQueue,
    mr: MemoryRegion,
    _dev: Device,
}

const ACCESS: Access = Access::LOCAL_WRITE.union(Access::REMOTE_WRITE);

/// A server device that accepts one connection, on a thread: its address, and the thread.
fn listen_once(engine: EngineKind) -> (std::net::SocketAddr, std::thread::JoinHandle<Side>) {
    let dev = open_device(engine);
    let pd = dev.alloc_pd();
    let mr = pd.alloc_mr(REGION, ACCESS).unwrap();
    let cq = dev.create_cq(1024);
    let listener = Listener::bind(&dev, 0).unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = std::thread::spawn(move || {
        let conn = listener
            .accept(
                &pd,
                &cq,
                &cq,
                &QpOptions::default(),
                Some(Duration::from_secs(20)),
            )
            .unwrap();
        Side {
            conn,
            cq,
            mr,
            _dev: dev,
        }
    });
    (addr, accept)
}

/// A client on `dev` (a fresh region and completion queue) connected to `addr`.
fn connect_to(dev: &Device, addr: std::net::SocketAddr) -> Side {
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(1024);
    let mr = pd.alloc_mr(REGION, ACCESS).unwrap();
    let conn = connect(&pd, addr, &cq, &cq, &QpOptions::default()).unwrap();
    Side {
        conn,
        cq,
        mr,
        _dev: dev.clone(),
    }
}

fn pair(engine: EngineKind) -> (Side, Side) {
    let (addr, accept) = listen_once(engine);
    let client = connect_to(&open_device(engine), addr);
    (accept.join().unwrap(), client)
}

fn slot_pattern(slot: usize, round: u8) -> Vec<u8> {
    (0..SLOT)
        .map(|i| (i as u8).wrapping_mul(31) ^ slot as u8 ^ round.wrapping_mul(97))
        .collect()
}

fn write(side: &Side, wr_id: u64, local_at: usize, remote: RemoteAddr, len: usize) {
    side.conn
        .qp
        .post_send(&[SendWr {
            wr_id,
            local: side.mr.sge(local_at, len),
            op: SendOp::Write { remote },
        }])
        .unwrap();
}

/// Reads `mr` at `at` until it holds `want` (the memory polling of perftest's latency tests).
fn wait_for_bytes(mr: &MemoryRegion, at: usize, want: &[u8], what: &str) {
    let start = Instant::now();
    let mut got = vec![0u8; want.len()];
    loop {
        mr.read(at, &mut got);
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what}: never arrived"
        );
        std::hint::spin_loop();
    }
}

fn poll_n(cq: &CompletionQueue, n: usize) {
    let mut got = 0;
    let mut buf = [Completion::default(); 16];
    let start = Instant::now();
    while got < n {
        let k = cq.poll(&mut buf).unwrap();
        for c in &buf[..k] {
            assert_eq!(c.wc.status, WcStatus::Success, "{c:?}");
        }
        got += k;
        assert!(start.elapsed() < Duration::from_secs(20), "{got} of {n}");
    }
}

on_each_engine!(posts_queued_for_a_poll_that_never_comes_are_still_sent);
/// The client polls (so that its posts are batched for its next poll), posts one WRITE per
/// call, more than a batch's worth, then stops calling: every one of them lands.
fn posts_queued_for_a_poll_that_never_comes_are_still_sent(engine: EngineKind) {
    let _serial = serial();
    let (server, client) = pair(engine);
    const WRITES: usize = 70;
    for slot in 0..WRITES {
        client.mr.write(slot * SLOT, &slot_pattern(slot, 1));
    }
    // One exchange first, polled, so that the client counts as polling.
    write(&client, 0, 0, server.mr.remote(0), 8);
    poll_n(&client.cq, 1);
    for slot in 0..WRITES {
        write(
            &client,
            slot as u64 + 1,
            slot * SLOT,
            server.mr.remote(slot * SLOT),
            SLOT,
        );
    }
    // No call from either side from here on: the server reads its memory.
    for slot in 0..WRITES {
        wait_for_bytes(
            &server.mr,
            slot * SLOT,
            &slot_pattern(slot, 1),
            &format!("WRITE {slot}"),
        );
    }
    poll_n(&client.cq, WRITES);
}

on_each_engine!(a_burst_of_posts_longer_than_the_poll_window_still_leaves_in_batches);
/// After a poll, the client posts 128 WRITEs, one per call, each after about 5 µs of its own
/// work (as a program's loop would), so that the burst lasts three times the poll window
/// (`ASSISTED_POLL_WINDOW`, 200 µs): it still leaves in batches. When the window ran from the
/// poll alone, every post after the first 200 µs was a system call of its own.
fn a_burst_of_posts_longer_than_the_poll_window_still_leaves_in_batches(engine: EngineKind) {
    let _serial = serial();
    let (server, client) = pair(engine);
    const WRITES: usize = 128;
    write(&client, 0, 0, server.mr.remote(0), 8);
    poll_n(&client.cq, 1);
    let before = client._dev.engine_stats();
    for i in 0..WRITES {
        let work = Instant::now();
        while work.elapsed() < Duration::from_micros(5) {
            std::hint::spin_loop();
        }
        write(&client, i as u64 + 1, 0, server.mr.remote(SLOT), 8);
    }
    let after = client._dev.engine_stats();
    poll_n(&client.cq, WRITES);
    let batches = after.send_batches - before.send_batches;
    let datagrams = after.datagrams_sent - before.datagrams_sent;
    // (Up to a batch's worth may still wait for the next poll. The packet engine's window is
    // its ring, 32 frames: the rest waits for acknowledgements, which only a poll receives
    // while the window is open.)
    let window = match client._dev.engine_kind() {
        EngineKind::Packet => tbrdma_engine::io::packet::RING_FRAMES,
        _ => WRITES,
    };
    let expected = (WRITES / 2).min(window) as u64;
    assert!(
        datagrams >= expected,
        "only {datagrams} of {WRITES} WRITEs left during the burst (expected {expected})"
    );
    assert!(
        batches * 4 <= datagrams,
        "{datagrams} datagrams left in {batches} batches: the burst was not batched"
    );
}

on_each_engine!(the_engine_thread_of_a_quiet_target_receives_a_stream_awake);
/// A target whose application has stopped calling (perftest's bandwidth servers wait in a
/// TCP read while the client writes): its engine thread receives the client's stream awake,
/// busy-polling between datagrams, instead of sleeping after each and being woken by the next
/// (a wake-up the sender's CPU pays for, datagram by datagram).
fn the_engine_thread_of_a_quiet_target_receives_a_stream_awake(engine: EngineKind) {
    let _serial = serial();
    let (server, client) = pair(engine);
    const WRITES: usize = 512;
    // The server's application makes no call from here on: it is quiet after
    // ASSISTED_QUIET_AFTER (1 ms).
    std::thread::sleep(Duration::from_millis(5));
    let before = server._dev.engine_stats();
    let mut posted = 0;
    let mut completed = 0;
    let mut buf = [Completion::default(); 16];
    while completed < WRITES {
        while posted < WRITES && posted - completed < 64 {
            write(&client, posted as u64, 0, server.mr.remote(SLOT), SLOT);
            posted += 1;
        }
        completed += client.cq.poll(&mut buf).unwrap();
    }
    let after = server._dev.engine_stats();
    let sleeps = after.sleeps - before.sleeps;
    assert!(
        sleeps * 8 < WRITES as u64,
        "the target's engine thread slept {sleeps} times during a stream of {WRITES} WRITEs"
    );
}

on_each_engine!(one_device_sends_to_one_peer_then_to_two);
/// One assisted device talks to one peer (its socket is then connected to it), then to a
/// second (the socket is disconnected): the application's polls and the engine thread, each
/// with its own backends over the socket, both go on sending to both peers, before and after
/// the application stops calling. Every byte lands.
fn one_device_sends_to_one_peer_then_to_two(engine: EngineKind) {
    let _serial = serial();
    let client_dev = open_device(engine);
    let (addr, accept) = listen_once(engine);
    let first = connect_to(&client_dev, addr);
    let first_server = accept.join().unwrap();
    let burst = |client: &Side, server: &Side, round: u8, poll: bool| {
        for slot in 0..8 {
            client.mr.write(slot * SLOT, &slot_pattern(slot, round));
            write(
                client,
                slot as u64,
                slot * SLOT,
                server.mr.remote(slot * SLOT),
                SLOT,
            );
        }
        if poll {
            poll_n(&client.cq, 8);
        }
    };
    let landed = |server: &Side, round: u8| {
        for slot in 0..8 {
            let what = format!("round {round}, slot {slot}");
            wait_for_bytes(&server.mr, slot * SLOT, &slot_pattern(slot, round), &what);
        }
    };
    burst(&first, &first_server, 1, true);
    landed(&first_server, 1);
    let (addr, accept) = listen_once(engine);
    let second = connect_to(&client_dev, addr);
    let second_server = accept.join().unwrap();
    for round in 2..6 {
        // Rounds 3 and 5 end without a poll: the engine thread sends what the posts left.
        let poll = round % 2 == 0;
        burst(&first, &first_server, round, poll);
        burst(&second, &second_server, round, poll);
        landed(&first_server, round);
        landed(&second_server, round);
        if !poll {
            poll_n(&first.cq, 8);
            poll_n(&second.cq, 8);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // No datagram was lost on the way (loopback, a few kilobytes at a time), as one sent
    // without an address to a socket the other set had disconnected would be (EDESTADDRREQ).
    // (Resends of datagrams that did arrive, after a late acknowledgement, count on both
    // sides.)
    std::thread::sleep(Duration::from_millis(5));
    for (client, server, name) in [
        (&first, &first_server, "first"),
        (&second, &second_server, "second"),
    ] {
        let (sent, received) = (client.conn.qp.stats(), server.conn.qp.stats());
        assert_eq!(
            sent.packets_sent, received.packets_received,
            "{name} peer: the client sent {sent:?}, the server received {received:?}"
        );
    }
}

on_each_engine!(an_idle_pair_keeps_no_core_busy);
/// An assisted pair left alone for 2 s (no call; keep-alives only) keeps no core busy: a
/// quiet engine thread spins only after passes that did something, and a wake-up that finds
/// nothing to do does not spin.
fn an_idle_pair_keeps_no_core_busy(engine: EngineKind) {
    let _serial = serial();
    let (server, client) = pair(engine);
    write(&client, 0, 0, server.mr.remote(0), 8);
    poll_n(&client.cq, 1);
    let (cpu_before, since) = (cpu_time(), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    let (cpu, idle) = (cpu_time() - cpu_before, since.elapsed());
    assert!(
        cpu < idle / 4,
        "{cpu:?} of CPU in {idle:?} with both sides idle"
    );
    write(&client, 1, 0, server.mr.remote(0), 8);
    poll_n(&client.cq, 1);
}

/// User and system time of this process.
fn cpu_time() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let usage = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let time = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    time(usage.user_time()) + time(usage.system_time())
}

on_each_engine!(a_target_that_never_calls_is_served_by_its_engine_thread);
/// A ping-pong of WRITEs in which the server never polls: it reads its memory for the
/// client's write and answers with a WRITE of its own (as `ib_write_lat` does, minus its
/// completion polls). The client polls its completions. Every round's bytes arrive on both
/// sides.
fn a_target_that_never_calls_is_served_by_its_engine_thread(engine: EngineKind) {
    let _serial = serial();
    let (server, client) = pair(engine);
    const ROUNDS: u8 = 200;
    let (to_server, to_client) = (server.mr.remote(0), client.mr.remote(SLOT));
    let server_thread = std::thread::spawn(move || {
        for round in 1..=ROUNDS {
            wait_for_bytes(
                &server.mr,
                0,
                &slot_pattern(0, round),
                &format!("round {round} at the server"),
            );
            server.mr.write(SLOT, &slot_pattern(1, round));
            write(&server, round as u64, SLOT, to_client, SLOT);
        }
        server
    });
    for round in 1..=ROUNDS {
        client.mr.write(0, &slot_pattern(0, round));
        write(&client, round as u64, 0, to_server, SLOT);
        poll_n(&client.cq, 1);
        wait_for_bytes(
            &client.mr,
            SLOT,
            &slot_pattern(1, round),
            &format!("round {round} at the client"),
        );
    }
    let server = server_thread.join().unwrap();
    // The server's completions were produced all along; none failed.
    poll_n(&server.cq, ROUNDS as usize);
}

on_each_engine!(a_ping_pong_of_multi_packet_writes_polled_as_ib_write_lat_does);
/// `ib_write_lat`'s rhythm with messages of several packets: each side posts a WRITE, polls
/// its send queue until it completes, then reads its memory for the peer's WRITE. The
/// acknowledgement that completes a side's poll rides on the first packet of the peer's
/// reply, so the rest of the reply arrives after that poll (the poll goes on receiving it for
/// a while, then leaves it to the engine thread). Every byte of every round arrives.
fn a_ping_pong_of_multi_packet_writes_polled_as_ib_write_lat_does(engine: EngineKind) {
    let _serial = serial();
    let (server, client) = pair(engine);
    const LEN: usize = 200_000;
    const ROUNDS: u8 = 50;
    let (to_server, to_client) = (server.mr.remote(0), client.mr.remote(LEN));
    let pattern = |round: u8, side: u8| -> Vec<u8> {
        (0..LEN)
            .map(|i| (i as u8) ^ (i >> 8) as u8 ^ round.wrapping_mul(31) ^ side)
            .collect()
    };
    let server_thread = std::thread::spawn(move || {
        for round in 1..=ROUNDS {
            wait_for_bytes(&server.mr, 0, &pattern(round, 0), "client's WRITE");
            server.mr.write(LEN, &pattern(round, 1));
            write(&server, round as u64, LEN, to_client, LEN);
            poll_n(&server.cq, 1);
        }
    });
    for round in 1..=ROUNDS {
        client.mr.write(0, &pattern(round, 0));
        write(&client, round as u64, 0, to_server, LEN);
        poll_n(&client.cq, 1);
        wait_for_bytes(&client.mr, LEN, &pattern(round, 1), "server's WRITE");
    }
    server_thread.join().unwrap();
}
