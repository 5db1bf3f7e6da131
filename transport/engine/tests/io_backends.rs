//! The datagram backends over loopback: every size arrives intact from the right address,
//! `wait` returns on data, on the wake descriptor and on timeout, and `io::open` always yields
//! a working backend. The io_uring cases are skipped (with a message) where the kernel probe
//! says io_uring is unusable.
//!
//! Nothing here asserts on time. Waits are long hang guards, and every burst fits in the
//! receiver's socket buffer before it is drained, so loopback never drops a datagram.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tbrdma_engine::io::packet::{PacketIo, RING_FRAMES};
use tbrdma_engine::io::sockets::SocketIo;
use tbrdma_engine::io::uring::{UringConfig, UringIo};
use tbrdma_engine::io::{DatagramIo, EngineKind, Received, RegionPart, TxBatch, open, open_pair};
use tbrdma_engine::memory::Buffer;
use tbrdma_engine::probe::probe;
use tbrdma_engine::socket::{bind_udp, buffer_sizes};

const MAX_DATAGRAM: usize = 65000;
const SIZES: &[usize] = &[
    1, 2, 3, 63, 64, 100, 512, 1000, 1024, 1472, 1500, 4096, 8192, 9000, 16384, 32768, 50000, 65000,
];
/// Upper bound on any single wait for data: a hang guard, not a performance expectation.
const HANG_GUARD: Duration = Duration::from_secs(120);

fn uring_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        let features = probe();
        if !features.uring_usable() {
            println!("skipping io_uring cases: the kernel probe says io_uring is unusable here:\n{features}");
        }
        features.uring_usable()
    })
}

fn kinds() -> Vec<EngineKind> {
    if uring_usable() {
        vec![EngineKind::Sockets, EngineKind::Uring]
    } else {
        vec![EngineKind::Sockets]
    }
}

fn socket_at(ip: SocketAddr) -> UdpSocket {
    bind_udp(ip, 4 << 20, 4 << 20).expect("bind a loopback UDP socket")
}

fn backend(kind: EngineKind, socket: UdpSocket) -> Box<dyn DatagramIo> {
    match kind {
        EngineKind::Sockets => {
            Box::new(SocketIo::new(socket, MAX_DATAGRAM).expect("sockets backend"))
        }
        EngineKind::Uring => {
            Box::new(UringIo::new(socket, MAX_DATAGRAM, true).expect("io_uring backend"))
        }
        EngineKind::Packet => {
            Box::new(PacketIo::new(socket, MAX_DATAGRAM).expect("packet backend"))
        }
        other => panic!("no case for the {other:?} backend here"),
    }
}

/// Recognisable bytes for datagram `seq` of `len` bytes.
fn payload(seq: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (seq.wrapping_mul(131) ^ j.wrapping_mul(7) ^ (j >> 8)) as u8)
        .collect()
}

/// A wake descriptor nobody writes to.
fn idle_wake() -> (UnixDatagram, UnixDatagram) {
    UnixDatagram::pair().expect("socketpair")
}

/// Receives until `expected` is empty, checking bytes and source address.
fn receive_all(rx: &mut dyn DatagramIo, expected: &mut HashMap<Vec<u8>, usize>, from: SocketAddr) {
    let (wake, _keep) = idle_wake();
    let start = Instant::now();
    while expected.values().any(|&n| n > 0) {
        assert!(
            start.elapsed() < HANG_GUARD,
            "datagrams missing after the hang guard: {} left",
            expected.len()
        );
        let mut wrong = Vec::new();
        rx.recv(&mut None, &mut |datagram: Received<'_>, src| {
            let bytes = &datagram.to_vec()[..];
            if src != from {
                wrong.push(format!(
                    "datagram of {} bytes from {src}, expected {from}",
                    bytes.len()
                ));
                return;
            }
            match expected.get_mut(bytes) {
                Some(n) if *n > 0 => *n -= 1,
                _ => wrong.push(format!("unexpected datagram of {} bytes", bytes.len())),
            }
        })
        .expect("recv");
        assert!(wrong.is_empty(), "{wrong:?}");
        expected.retain(|_, n| *n > 0);
        if !expected.is_empty() {
            rx.wait(Duration::from_millis(100), wake.as_fd())
                .expect("wait");
        }
    }
}

/// Sends `sizes` (one datagram each, in order) from `tx` to `to` in bursts that fit the
/// receiver's socket buffer, receiving each burst before the next.
fn exchange(
    tx: &mut dyn DatagramIo,
    from: SocketAddr,
    rx: &mut dyn DatagramIo,
    to: SocketAddr,
    rcvbuf: usize,
    sizes: &[usize],
) {
    let mut batch = TxBatch::new(32, MAX_DATAGRAM);
    // Each datagram costs its length plus skb overhead in the receive queue; stay well inside.
    let budget = rcvbuf / 4;
    let mut seq = 0;
    while seq < sizes.len() {
        let mut expected: HashMap<Vec<u8>, usize> = HashMap::new();
        let mut bytes = 0;
        while seq < sizes.len() && (bytes == 0 || bytes + sizes[seq] + 1024 <= budget) {
            let data = payload(seq, sizes[seq]);
            let buf = batch.next_buf().expect("room in the batch");
            buf[..data.len()].copy_from_slice(&data);
            batch.commit(data.len(), to);
            *expected.entry(data).or_default() += 1;
            bytes += sizes[seq] + 1024;
            seq += 1;
            if batch.is_full() {
                tx.send(&mut batch).expect("send");
            }
        }
        if !batch.is_empty() {
            tx.send(&mut batch).expect("send");
        }
        assert!(batch.is_empty(), "send must clear the batch");
        receive_all(rx, &mut expected, from);
    }
    assert_eq!(
        tx.send_drops(),
        0,
        "loopback with room in the socket buffer drops nothing"
    );
}

fn every_size_round_trips(ip: SocketAddr) {
    for tx_kind in kinds() {
        for rx_kind in kinds() {
            let tx_socket = socket_at(ip);
            let rx_socket = socket_at(ip);
            let from = tx_socket.local_addr().unwrap();
            let to = rx_socket.local_addr().unwrap();
            let rcvbuf = buffer_sizes(&rx_socket).unwrap().0;
            let mut tx = backend(tx_kind, tx_socket);
            let mut rx = backend(rx_kind, rx_socket);
            // Every size alone, then every size three times over in mixed bursts.
            for &size in SIZES {
                exchange(tx.as_mut(), from, rx.as_mut(), to, rcvbuf, &[size]);
            }
            let mixed: Vec<usize> = SIZES
                .iter()
                .chain(SIZES.iter().rev())
                .chain(SIZES)
                .copied()
                .collect();
            exchange(tx.as_mut(), from, rx.as_mut(), to, rcvbuf, &mixed);
            println!("{} -> {} over {ip}: ok", tx_kind.name(), rx_kind.name());
        }
    }
}

#[test]
fn datagrams_of_every_size_arrive_intact_ipv4() {
    every_size_round_trips(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
}

#[test]
fn datagrams_of_every_size_arrive_intact_ipv6() {
    if UdpSocket::bind(SocketAddr::from((Ipv6Addr::LOCALHOST, 0))).is_err() {
        println!("skipping: no IPv6 loopback here");
        return;
    }
    every_size_round_trips(SocketAddr::from((Ipv6Addr::LOCALHOST, 0)));
}

#[test]
fn many_small_datagrams_in_full_batches() {
    let sizes: Vec<usize> = (0..2000).map(|i| 1 + (i * 37) % 1400).collect();
    for tx_kind in kinds() {
        for rx_kind in kinds() {
            let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
            let (tx_socket, rx_socket) = (socket_at(ip), socket_at(ip));
            let (from, to) = (
                tx_socket.local_addr().unwrap(),
                rx_socket.local_addr().unwrap(),
            );
            let rcvbuf = buffer_sizes(&rx_socket).unwrap().0;
            let mut tx = backend(tx_kind, tx_socket);
            let mut rx = backend(rx_kind, rx_socket);
            exchange(tx.as_mut(), from, rx.as_mut(), to, rcvbuf, &sizes);
        }
    }
}

/// A receive call hands over a batch at most, however many wait: the engine transmits (its
/// acknowledgements among others) and reads its other rails between calls. A sockets backend
/// that drained its socket held every acknowledgement for milliseconds in a bulk transfer.
#[test]
fn a_receive_takes_a_batch_at_most_when_more_wait() {
    const WAITING: usize = 300;
    let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let (tx_socket, rx_socket) = (socket_at(ip), socket_at(ip));
    let to = rx_socket.local_addr().unwrap();
    for i in 0..WAITING {
        tx_socket.send_to(&payload(i, 100), to).expect("send");
    }
    let mut rx = backend(EngineKind::Sockets, rx_socket);
    let (wake, _keep) = idle_wake();
    let (mut total, mut calls, mut largest) = (0, 0, 0);
    let start = Instant::now();
    while total < WAITING {
        assert!(start.elapsed() < HANG_GUARD, "{total} of {WAITING} arrived");
        let got = rx.recv(&mut None, &mut |_, _| {}).expect("recv");
        if got == 0 {
            rx.wait(Duration::from_millis(100), wake.as_fd())
                .expect("wait");
        }
        total += got;
        calls += 1;
        largest = largest.max(got);
    }
    assert_eq!(total, WAITING);
    assert!(
        largest <= 64,
        "one call took {largest} of the {WAITING} datagrams waiting ({calls} calls)"
    );
}

/// More datagrams wait than the provided-buffer ring holds: the multishot receive ends with
/// ENOBUFS and must be re-armed without losing any.
#[test]
fn uring_receive_survives_running_out_of_buffers() {
    if !uring_usable() {
        return;
    }
    let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let (tx_socket, rx_socket) = (socket_at(ip), socket_at(ip));
    let (from, to) = (
        tx_socket.local_addr().unwrap(),
        rx_socket.local_addr().unwrap(),
    );
    let config = UringConfig {
        single_issuer: true,
        rx_buffers: 4,
        ..UringConfig::default()
    };
    let rx_io = UringIo::with_config(rx_socket, MAX_DATAGRAM, config).expect("io_uring backend");
    let buffers = rx_io.setup().rx_buffers.0;
    let mut rx = rx_io;
    let mut tx = backend(EngineKind::Sockets, tx_socket);
    // Many times more datagrams than buffers, all sent before any recv.
    let count = 160;
    let mut batch = TxBatch::new(32, MAX_DATAGRAM);
    let mut expected: HashMap<Vec<u8>, usize> = HashMap::new();
    for seq in 0..count {
        let data = payload(seq, 200);
        batch.next_buf().unwrap()[..200].copy_from_slice(&data);
        batch.commit(200, to);
        *expected.entry(data).or_default() += 1;
        if batch.is_full() {
            tx.send(&mut batch).unwrap();
        }
    }
    tx.send(&mut batch).unwrap();
    // Let the kernel fill every buffer before the first recv.
    let (wake, _keep) = idle_wake();
    rx.wait(Duration::from_millis(20), wake.as_fd()).unwrap();
    receive_all(&mut rx, &mut expected, from);
    println!(
        "{count} datagrams through {buffers} buffers; receive re-armed {} times",
        rx.receive_rearms()
    );
}

#[test]
fn uring_zero_copy_sends_arrive_intact() {
    if !uring_usable() {
        return;
    }
    let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let (tx_socket, rx_socket) = (socket_at(ip), socket_at(ip));
    let (from, to) = (
        tx_socket.local_addr().unwrap(),
        rx_socket.local_addr().unwrap(),
    );
    let rcvbuf = buffer_sizes(&rx_socket).unwrap().0;
    let config = UringConfig {
        single_issuer: true,
        zero_copy_threshold: Some(1000),
        ..UringConfig::default()
    };
    let tx_io = UringIo::with_config(tx_socket, MAX_DATAGRAM, config).expect("io_uring backend");
    if tx_io.setup().zero_copy_threshold.is_none() {
        println!("skipping: no SENDMSG_ZC here");
        return;
    }
    let mut tx: Box<dyn DatagramIo> = Box::new(tx_io);
    let mut rx = backend(EngineKind::Sockets, rx_socket);
    let mixed: Vec<usize> = SIZES.iter().chain(SIZES.iter().rev()).copied().collect();
    exchange(tx.as_mut(), from, rx.as_mut(), to, rcvbuf, &mixed);
}

#[test]
fn wait_returns_when_data_is_already_there() {
    for kind in kinds() {
        let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let (tx, rx_socket) = (socket_at(ip), socket_at(ip));
        let to = rx_socket.local_addr().unwrap();
        let mut rx = backend(kind, rx_socket);
        tx.send_to(b"ready", to).unwrap();
        let (wake, _keep) = idle_wake();
        let mut got = 0;
        while got == 0 {
            rx.wait(HANG_GUARD, wake.as_fd()).unwrap();
            got += rx
                .recv(&mut None, &mut |datagram: Received<'_>, _| {
                    let bytes = &datagram.to_vec()[..];
                    assert_eq!(bytes, b"ready")
                })
                .unwrap();
        }
    }
}

#[test]
fn wait_returns_when_data_arrives_later() {
    for kind in kinds() {
        let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let (tx, rx_socket) = (socket_at(ip), socket_at(ip));
        let to = rx_socket.local_addr().unwrap();
        let mut rx = backend(kind, rx_socket);
        let (wake, _keep) = idle_wake();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            tx.send_to(b"later", to).unwrap();
        });
        let mut got = 0;
        while got == 0 {
            rx.wait(HANG_GUARD, wake.as_fd()).unwrap();
            got += rx
                .recv(&mut None, &mut |datagram: Received<'_>, _| {
                    let bytes = &datagram.to_vec()[..];
                    assert_eq!(bytes, b"later")
                })
                .unwrap();
        }
        sender.join().unwrap();
    }
}

#[test]
fn wait_returns_when_woken() {
    for kind in kinds() {
        let rx_socket = socket_at(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        let mut rx = backend(kind, rx_socket);
        // Already readable.
        let (wake, waker) = idle_wake();
        waker.send(b"x").unwrap();
        rx.wait(HANG_GUARD, wake.as_fd()).unwrap();
        // Becomes readable while waiting, on a different descriptor.
        let (wake2, waker2) = idle_wake();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            waker2.send(b"x").unwrap();
            waker2
        });
        rx.wait(HANG_GUARD, wake2.as_fd()).unwrap();
        let _waker2 = writer.join().unwrap();
    }
}

#[test]
fn wait_returns_on_timeout() {
    for kind in kinds() {
        let rx_socket = socket_at(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        let mut rx = backend(kind, rx_socket);
        let (wake, _keep) = idle_wake();
        rx.wait(Duration::from_millis(10), wake.as_fd()).unwrap();
        rx.wait(Duration::ZERO, wake.as_fd()).unwrap();
        assert_eq!(
            rx.recv(&mut None, &mut |_, _| panic!("nothing was sent"))
                .unwrap(),
            0
        );
    }
}

#[test]
fn open_uring_yields_a_working_backend() {
    let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let (tx_socket, rx_socket) = (socket_at(ip), socket_at(ip));
    let (from, to) = (
        tx_socket.local_addr().unwrap(),
        rx_socket.local_addr().unwrap(),
    );
    let rcvbuf = buffer_sizes(&rx_socket).unwrap().0;
    let (mut rx, why) = open(EngineKind::Uring, rx_socket, MAX_DATAGRAM, true).expect("open");
    if uring_usable() {
        assert_eq!(
            rx.kind(),
            EngineKind::Uring,
            "fell back although the probe says usable: {why:?}"
        );
        assert!(why.is_none());
    } else {
        assert_eq!(rx.kind(), EngineKind::Sockets);
        assert!(why.is_some(), "a fallback says why");
    }
    let (mut tx, _) = open(EngineKind::Uring, tx_socket, MAX_DATAGRAM, false).expect("open");
    exchange(tx.as_mut(), from, rx.as_mut(), to, rcvbuf, SIZES);
}

#[test]
fn probe_never_panics_and_names_every_feature() {
    let features = probe();
    let text = features.to_string();
    for (name, feature) in features.features() {
        assert!(text.contains(name), "{name} missing from:\n{text}");
        assert!(!feature.since.is_empty());
    }
    println!("{text}");
}

/// A datagram to a closed port brings back an ICMP error that the kernel reports on a later
/// call of the sending socket (when connected: unconnected sockets never see them without
/// IP_RECVERR); neither sending nor receiving may fail or lose data over it.
#[test]
fn stale_icmp_errors_are_ignored() {
    for kind in kinds() {
        let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let closed = socket_at(ip).local_addr().unwrap(); // Dropped at once: the port is closed.
        let (a_socket, c_socket) = (socket_at(ip), socket_at(ip));
        let (a, c) = (
            a_socket.local_addr().unwrap(),
            c_socket.local_addr().unwrap(),
        );
        let rcvbuf = buffer_sizes(&c_socket).unwrap().0;
        a_socket.connect(closed).unwrap();
        let a_handle = a_socket.try_clone().unwrap();
        let mut a_io = backend(kind, a_socket);
        let mut c_io = backend(kind, c_socket);
        let poke_closed_port = |a_io: &mut dyn DatagramIo| {
            let mut batch = TxBatch::new(1, 64);
            batch.next_buf().unwrap()[..4].copy_from_slice(b"void");
            batch.commit(4, closed);
            a_io.send(&mut batch)
                .expect("a send to a closed port is not an error");
        };
        for _ in 0..3 {
            // The error is pending on `a`: its next send must not fail.
            poke_closed_port(a_io.as_mut());
            exchange(a_io.as_mut(), a, c_io.as_mut(), c, rcvbuf, &[100, 2000]);
        }
        // Connected to `c` with the error pending: its receive must not fail either.
        poke_closed_port(a_io.as_mut());
        a_handle.connect(c).unwrap();
        exchange(c_io.as_mut(), c, a_io.as_mut(), a, rcvbuf, &[100, 2000]);
        exchange(a_io.as_mut(), a, c_io.as_mut(), c, rcvbuf, &[100, 2000]);
    }
}

/// The engine is `Send`: dropping a single-issuer ring on another thread (where the kernel
/// refuses its synchronous cancel) must neither panic nor let the kernel write into freed
/// buffers (they are leaked instead).
#[test]
fn uring_dropped_on_another_thread() {
    if !uring_usable() {
        return;
    }
    let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let (tx, rx_socket) = (socket_at(ip), socket_at(ip));
    let to = rx_socket.local_addr().unwrap();
    let rx = UringIo::new(rx_socket, MAX_DATAGRAM, true).expect("io_uring backend");
    std::thread::spawn(move || drop(rx)).join().unwrap();
    // Datagrams to the closed socket go nowhere.
    let _ = tx.send_to(b"after", to);
}

/// Caller progress shares the ring between threads (no single issuer). With `COOP_TASKRUN` a
/// receive's completion runs as task work of the thread that armed it, which a sleeping thread
/// is woken for but a thread computing in user space runs only at its next kernel entry (a
/// timer tick away). So a backend opened on one thread and polled on another moves its receive
/// to the poller (once), and receives there; dropping it afterwards on the opening thread,
/// while the poller is alive and idle, must not hang either.
#[test]
fn a_uring_ring_opened_on_one_thread_receives_when_polled_on_another() {
    if !uring_usable() {
        return;
    }
    let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let (tx_socket, rx_socket) = (socket_at(ip), socket_at(ip));
    let to = rx_socket.local_addr().unwrap();
    // Opened (and the receive armed) here, on the test's thread.
    let rx = UringIo::new(rx_socket, MAX_DATAGRAM, false).expect("io_uring backend");
    println!("setup: {:?}", rx.setup().flags);
    let (back_tx, back_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let poller = std::thread::spawn(move || {
        let mut rx = rx;
        // Let the opener block first.
        std::thread::sleep(Duration::from_millis(200));
        tx_socket.send_to(b"hello", to).unwrap();
        let deadline = Instant::now() + HANG_GUARD;
        let mut got = Vec::new();
        while got.is_empty() {
            rx.recv(&mut None, &mut |data: Received<'_>, _| {
                got.extend_from_slice(&data.to_vec())
            })
            .unwrap();
            assert!(
                Instant::now() < deadline,
                "the poller never saw the datagram"
            );
        }
        assert_eq!(got, b"hello");
        back_tx.send(rx).unwrap();
        // Stay alive and idle while the opener drops the backend.
        let _ = done_rx.recv();
    });
    // This thread blocks (never enters io_uring) until the poller has its datagram.
    let rx = back_rx.recv().expect("the poller hands the backend back");
    if rx.setup().flags.contains("COOP_TASKRUN") {
        assert_eq!(
            rx.receive_takeovers(),
            1,
            "the poller took the receive over"
        );
    }
    drop(rx);
    done_tx.send(()).unwrap();
    poller.join().unwrap();
}

/// Two packet backends on loopback addresses (sender, its address, receiver, its address), or
/// `None` without root: `open` then falls back to sockets and says why, which is checked.
#[allow(clippy::type_complexity)]
fn packet_pair() -> Option<(
    Box<dyn DatagramIo>,
    SocketAddr,
    Box<dyn DatagramIo>,
    SocketAddr,
)> {
    let ip = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let (tx_socket, rx_socket) = (socket_at(ip), socket_at(ip));
    let (from, to) = (
        tx_socket.local_addr().unwrap(),
        rx_socket.local_addr().unwrap(),
    );
    let (tx, why) = open(EngineKind::Packet, tx_socket, MAX_DATAGRAM, false).expect("open");
    if let Some(why) = why {
        assert_eq!(tx.kind(), EngineKind::Sockets);
        assert!(why.contains("packet engine"), "{why}");
        println!("skipping: {why}");
        return None;
    }
    let (rx, _) = open(EngineKind::Packet, rx_socket, MAX_DATAGRAM, false).expect("open");
    assert_eq!(
        (tx.kind(), rx.kind()),
        (EngineKind::Packet, EngineKind::Packet)
    );
    Some((tx, from, rx, to))
}

/// The packet backend over `lo`: every size arrives intact from the right address, in full
/// batches of small ones too, and `wait` returns on data. Needs root (`CAP_NET_RAW`); without
/// it `open` falls back to sockets and says why, which is checked instead.
#[test]
fn packet_backend_moves_every_size_and_wakes_on_data() {
    let Some((mut tx, from, mut rx, to)) = packet_pair() else {
        return;
    };
    // The receive ring holds RING_FRAMES frames whatever their size (a fuller burst is
    // dropped, for the protocol to resend): `exchange` counts 1 KiB and more per datagram
    // against a quarter of the budget, so bursts stay a few frames short of it.
    let ring_budget = 4 * (RING_FRAMES - 4) * 1024;
    for &size in SIZES {
        exchange(tx.as_mut(), from, rx.as_mut(), to, ring_budget, &[size]);
    }
    let small: Vec<usize> = (0..2000).map(|i| 1 + (i * 37) % 1400).collect();
    exchange(tx.as_mut(), from, rx.as_mut(), to, ring_budget, &small);

    // `wait` returns at once when a frame waits in the ring.
    let (_wake_rx, wake_tx) = idle_wake();
    let mut batch = TxBatch::new(1, MAX_DATAGRAM);
    batch.next_buf().unwrap()[..5].copy_from_slice(b"hello");
    batch.commit(5, to);
    tx.send(&mut batch).unwrap();
    let start = Instant::now();
    while start.elapsed() < HANG_GUARD {
        rx.wait(HANG_GUARD, wake_tx.as_fd()).unwrap();
        let mut got = Vec::new();
        if rx
            .recv(&mut None, &mut |d: Received<'_>, f| {
                got.push((d.to_vec(), f))
            })
            .unwrap()
            > 0
        {
            assert_eq!(got, vec![(b"hello".to_vec(), from)]);
            return;
        }
    }
    panic!("no frame within the hang guard");
}

/// The two packet backends of one rail (assisted thread mode, `io::open_pair`) share its
/// receive ring: whichever reads gets each frame, the other never sees it again, and both
/// send. Needs root, like the tests above.
#[test]
fn a_pair_of_packet_backends_shares_one_ring_and_each_frame_arrives_once() {
    let Some((mut peer, peer_addr, _, _)) = packet_pair() else {
        return;
    };
    let rail = socket_at(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
    let rail_addr = rail.local_addr().unwrap();
    let (mut first, mut second, why) =
        open_pair(EngineKind::Packet, rail, MAX_DATAGRAM).expect("open a pair");
    assert_eq!(why, None);
    assert_eq!(
        (first.kind(), second.kind()),
        (EngineKind::Packet, EngineKind::Packet)
    );
    let ring_budget = 4 * (RING_FRAMES - 4) * 1024;
    let sizes: Vec<usize> = (0..200).map(|i| 1 + (i * 53) % 3000).collect();
    let nothing_left = |io: &mut dyn DatagramIo, what: &str| {
        let mut extra = 0;
        io.recv(&mut None, &mut |_: Received<'_>, _| extra += 1)
            .expect("recv");
        assert_eq!(
            extra, 0,
            "{what} found {extra} frames the other had delivered"
        );
    };
    for round in 0..4 {
        // Alternate which of the two reads: the other finds nothing after it.
        let (reader, other) = if round % 2 == 0 {
            (first.as_mut(), second.as_mut())
        } else {
            (second.as_mut(), first.as_mut())
        };
        exchange(
            peer.as_mut(),
            peer_addr,
            reader,
            rail_addr,
            ring_budget,
            &sizes,
        );
        nothing_left(other, "the backend that did not read");
        nothing_left(reader, "the backend that read");
    }
    // Both send from the rail's address.
    exchange(
        first.as_mut(),
        rail_addr,
        peer.as_mut(),
        peer_addr,
        ring_budget,
        &sizes,
    );
    exchange(
        second.as_mut(),
        rail_addr,
        peer.as_mut(),
        peer_addr,
        ring_budget,
        &sizes,
    );
}

/// The packet backend sends a datagram whose payload lies in a registered region (a header in
/// the batch's buffer, the rest gathered from where it lies) intact at every size, the sizes
/// around 2 KiB included. Needs root, like the test above.
#[test]
fn packet_backend_sends_gathered_datagrams_intact_at_every_size() {
    let Some((mut tx, from, mut rx, to)) = packet_pair() else {
        return;
    };
    const HEADER: usize = 40;
    let region = Arc::new(Buffer::allocate(1 << 20, false).expect("a region"));
    let fill = payload(99, region.len());
    region.write(0, &fill);
    let sizes: Vec<usize> = (0..3)
        .flat_map(|_| SIZES.iter().copied())
        .chain([2047, 2048, 2049, 2048 - 12, 2048 - 13])
        .filter(|&s| s > HEADER)
        .collect();
    let mut batch = TxBatch::new(4, MAX_DATAGRAM);
    for (seq, &size) in sizes.iter().enumerate() {
        let header = payload(seq, HEADER);
        let offset = (seq * 4099) % (region.len() - size);
        let part = RegionPart::new(region.clone(), offset, size - HEADER);
        let mut whole = header.clone();
        whole.extend_from_slice(&fill[offset..offset + size - HEADER]);
        batch.next_buf().expect("room")[..HEADER].copy_from_slice(&header);
        batch.commit_parts(HEADER, to, Some(part));
        tx.send(&mut batch).expect("send");
        let mut expected = HashMap::from([(whole, 1)]);
        receive_all(rx.as_mut(), &mut expected, from);
    }
    assert_eq!(tx.send_drops(), 0);
}
