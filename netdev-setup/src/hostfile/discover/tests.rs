//! Discovery over loopback: 127.0.0.1 and 127.0.0.2 play the two ends of a cable (all of
//! 127/8 is this host), a socket on 127.0.0.3 or a spoofed port plays the stranger.

use std::net::Ipv4Addr;

use super::*;

fn cable(local: [u8; 4], peer: [u8; 4], peer_uuid: &str) -> RecordLink {
    RecordLink {
        interface: "tb0".into(),
        address: Ipv4Addr::from(local),
        prefix_len: 30,
        peer_uuid: peer_uuid.into(),
        peer_address: Ipv4Addr::from(peer),
        rail: 0,
    }
}

fn host_a() -> HostRecord {
    HostRecord {
        uuid: "host-a".into(),
        name: "a".into(),
        aliases: Vec::new(),
        links: vec![cable([127, 0, 0, 1], [127, 0, 0, 2], "host-b")],
    }
}

fn host_b() -> HostRecord {
    HostRecord {
        uuid: "host-b".into(),
        name: "b".into(),
        aliases: Vec::new(),
        links: vec![cable([127, 0, 0, 2], [127, 0, 0, 1], "host-a")],
    }
}

fn free_udp_port() -> u16 {
    // Free on both ends' addresses: try until one is.
    loop {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = s.local_addr().unwrap().port();
        if UdpSocket::bind(("127.0.0.2", port)).is_ok()
            && UdpSocket::bind(("127.0.0.3", port)).is_ok()
        {
            return port;
        }
    }
}

fn options(port: u16, timeout: Duration, auth: Auth) -> DiscoveryOptions {
    DiscoveryOptions {
        port,
        timeout,
        interval: Duration::from_millis(20),
        linger_rounds: 5,
        auth,
    }
}

fn secret(s: &str) -> Auth {
    Auth::with_secret(Secret::new(s.as_bytes()).unwrap())
}

fn both(
    auth_a: Auth,
    auth_b: Auth,
    timeout: Duration,
) -> (Result<Vec<HostRecord>>, Result<Vec<HostRecord>>) {
    let port = free_udp_port();
    let (oa, ob) = (
        options(port, timeout, auth_a),
        options(port, timeout, auth_b),
    );
    let b = std::thread::spawn(move || discover(&host_b(), &ob));
    let a = discover(&host_a(), &oa);
    (a, b.join().unwrap())
}

#[test]
fn two_hosts_find_each_other_with_the_same_secret_or_none() {
    for (auth_a, auth_b) in [
        (Auth::Disabled, Auth::Disabled),
        (
            secret("a-cluster-secret-of-some-length"),
            secret("a-cluster-secret-of-some-length"),
        ),
    ] {
        let (a, b) = both(auth_a, auth_b, Duration::from_secs(30));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a, b);
        assert_eq!(a, vec![host_a(), host_b()]);
    }
}

#[test]
fn another_secret_or_none_is_refused_naming_the_setting() {
    let key = "a-cluster-secret-of-some-length";
    for (auth_a, auth_b) in [
        (secret(key), secret("another-secret-of-some-length")),
        (secret(key), Auth::Disabled),
        (Auth::Disabled, secret(key)),
    ] {
        let case = format!("{auth_a:?} / {auth_b:?}");
        let (a, b) = both(auth_a, auth_b, Duration::from_secs(2));
        for (side, r) in [("a", a), ("b", b)] {
            let e = r.expect_err(&case).to_string();
            assert!(
                e.contains("refused") && e.contains("TBRDMA_SECRET"),
                "{case}: {side}: {e}"
            );
        }
    }
}

/// The datagram host B would send A once their views agree, echoing `echo` and tagged with
/// `key` (if any).
fn forged_from_b(key: Option<&Secret>, echo: Option<String>) -> Vec<u8> {
    let merged = BTreeMap::from([
        ("host-a".to_string(), host_a()),
        ("host-b".to_string(), host_b()),
    ]);
    let message = Message {
        from: "host-b".into(),
        digest: digest_of(&merged),
        nonce: "11".repeat(NONCE_LEN),
        echo,
        view: vec![host_b()],
    };
    let json = serde_json::to_vec(&message).unwrap();
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&[VERSION, u8::from(key.is_some())]);
    match key {
        Some(key) => bytes.extend_from_slice(&key.tag(&[TAG_LABEL, &json])),
        None => bytes.extend_from_slice(&[0; TAG_LEN]),
    }
    bytes.extend_from_slice(&json);
    bytes
}

/// Sends `datagram` to A's discovery socket from `from`, every 20 ms until `stop`.
fn keep_sending(
    from: SocketAddr,
    to: SocketAddr,
    datagram: Vec<u8>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let socket = UdpSocket::bind(from).unwrap();
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let _ = socket.send_to(&datagram, to);
            std::thread::sleep(Duration::from_millis(20));
        }
    })
}

/// Host B never runs; a stranger sends A exactly what B would. Before, A took it from any
/// source and finished discovery with the stranger's record for B; now only B's own address
/// and port count, and A times out naming the silent cable.
#[test]
fn a_record_from_another_source_than_its_host_does_not_count() {
    let port = free_udp_port();
    let to = SocketAddr::from(([127, 0, 0, 1], port));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let strangers = [
        keep_sending(
            SocketAddr::from(([127, 0, 0, 3], port)),
            to,
            forged_from_b(None, None),
            stop.clone(),
        ),
        keep_sending(
            SocketAddr::from(([127, 0, 0, 2], 0)),
            to,
            forged_from_b(None, None),
            stop.clone(),
        ),
    ];
    let r = discover(
        &host_a(),
        &options(port, Duration::from_secs(2), Auth::Disabled),
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for s in strangers {
        s.join().unwrap();
    }
    let e = r.expect_err("a stranger's record was taken").to_string();
    assert!(e.contains("no answer over tb0"), "{e}");
}

/// With a secret, a datagram B tagged in an earlier run (it echoes a nonce A no longer has),
/// replayed from B's own address, does not count: A times out.
#[test]
fn a_datagram_replayed_from_an_earlier_run_does_not_count() {
    let key = Secret::new(b"a-cluster-secret-of-some-length").unwrap();
    let port = free_udp_port();
    let to = SocketAddr::from(([127, 0, 0, 1], port));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let recorded = forged_from_b(Some(&key), Some("22".repeat(NONCE_LEN)));
    let replay = keep_sending(
        SocketAddr::from(([127, 0, 0, 2], port)),
        to,
        recorded,
        stop.clone(),
    );
    let r = discover(
        &host_a(),
        &options(port, Duration::from_secs(2), Auth::with_secret(key)),
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    replay.join().unwrap();
    assert!(r.is_err(), "a replayed datagram was taken: {r:?}");
}

/// A neighbour relaying more hosts than a cluster has: the view stops at the bound.
#[test]
fn a_view_grows_no_further_than_the_bound() {
    let mut node = Node {
        local_uuid: "host-a".into(),
        view: BTreeMap::from([("host-a".to_string(), host_a())]),
        nonce: "00".repeat(NONCE_LEN),
        secret: None,
    };
    let addr = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), 9);
    let mut peer = Peer {
        addr,
        uuid: "host-b".into(),
        digest: None,
        nonce: None,
        refused: None,
    };
    for batch in 0..10 {
        let mut view = vec![host_b()];
        view.extend((0..100).map(|i| HostRecord {
            uuid: format!("filler-{batch}-{i}"),
            name: "x".into(),
            aliases: Vec::new(),
            links: Vec::new(),
        }));
        let message = Message {
            from: "host-b".into(),
            digest: 0,
            nonce: "11".repeat(NONCE_LEN),
            echo: None,
            view,
        };
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&[VERSION, 0]);
        bytes.extend_from_slice(&[0; TAG_LEN]);
        bytes.extend_from_slice(&serde_json::to_vec(&message).unwrap());
        node.receive(&mut peer, SocketAddr::V4(addr), &bytes);
    }
    assert_eq!(node.view.len(), MAX_HOSTS);
    assert_eq!(node.view["host-b"], host_b());
}
