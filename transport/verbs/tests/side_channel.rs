//! The connection manager's side channel against strangers and against hosts with another
//! cluster secret, over real loopback sockets: a stranger that connects and sends nothing, or
//! sends garbage, neither delays nor ends the real peer's setup; with a secret, a peer without
//! it, with another one, or replaying a recorded handshake is refused, naming the setting.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tbrdma_verbs::*;

mod common;
use common::{Server, caller};

fn secret(s: &str) -> Auth {
    Auth::with_secret(Secret::new(s.as_bytes()).unwrap())
}

/// Options with `auth`, a long setup timeout on the server (what a stranger could hold it
/// for, before the fix) and a short one on the client.
fn server_opts(auth: Auth) -> QpOptions {
    QpOptions {
        timeout: Duration::from_secs(60),
        auth,
        ..QpOptions::default()
    }
}

fn client_opts(auth: Auth) -> QpOptions {
    QpOptions {
        timeout: Duration::from_secs(10),
        auth,
        ..QpOptions::default()
    }
}

/// Accepts on `listener` (on a thread, waiting up to `wait`) while `client` runs here.
fn accept_while<T>(
    server: Server,
    opts: QpOptions,
    wait: Duration,
    client: impl FnOnce(SocketAddr) -> T,
) -> (Result<Connected>, T) {
    let Server {
        dev: _dev,
        pd,
        cq,
        listener,
        ..
    } = server;
    let addr = listener.local_addr().unwrap();
    let accept = std::thread::spawn(move || listener.accept(&pd, &cq, &cq, &opts, Some(wait)));
    let got = client(addr);
    (accept.join().unwrap(), got)
}

fn connect_with(addr: SocketAddr, opts: &QpOptions) -> Result<Connected> {
    let dev = Device::open("127.0.0.1", caller()).unwrap();
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(16);
    connect(&pd, addr, &cq, &cq, opts)
}

/// Before, the listener read the first client's hello with the whole setup timeout: a stranger
/// that connected and said nothing held it for that long (here 60 s), and the real client,
/// which allows 10 s, failed waiting for its answer.
#[test]
fn a_silent_stranger_does_not_delay_the_real_peers_setup() {
    let server = common::server(caller(), 4096, 16);
    let (accepted, client) = accept_while(
        server,
        server_opts(Auth::Disabled),
        Duration::from_secs(60),
        |addr| {
            let _silent = TcpStream::connect(addr).unwrap();
            // The listener takes the stranger first.
            std::thread::sleep(Duration::from_millis(100));
            connect_with(addr, &client_opts(Auth::Disabled))
        },
    );
    client.expect("the real client connects past the silent stranger");
    accepted.expect("the listener accepts the real client");
}

/// Before, garbage from a stranger ended the accept with an error (which the NCCL plugin's
/// acceptor reports to NCCL as a failed accept).
#[test]
fn garbage_from_a_stranger_does_not_end_the_accept() {
    let server = common::server(caller(), 4096, 16);
    let (accepted, client) = accept_while(
        server,
        server_opts(Auth::Disabled),
        Duration::from_secs(60),
        |addr| {
            let mut junk = TcpStream::connect(addr).unwrap();
            junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n........................")
                .unwrap();
            let mut sink = Vec::new();
            let _ = junk.read_to_end(&mut sink);
            connect_with(addr, &client_opts(Auth::Disabled))
        },
    );
    client.expect("the real client connects after the junk");
    accepted.expect("the listener accepts the real client");
}

/// A flood of silent strangers, more than the listener reads at once: the oldest are closed
/// to make room, so the real client that comes last still gets through (had the extra ones been
/// refused instead, it would wait behind the strangers' 60 s deadlines).
#[test]
fn a_flood_of_silent_strangers_does_not_lock_the_real_peer_out() {
    let server = common::server(caller(), 4096, 16);
    let (accepted, client) = accept_while(
        server,
        server_opts(Auth::Disabled),
        Duration::from_secs(60),
        |addr| {
            let strangers: Vec<TcpStream> = (0..MAX_PENDING + 8)
                .map(|_| TcpStream::connect(addr).unwrap())
                .collect();
            std::thread::sleep(Duration::from_millis(200));
            let got = connect_with(addr, &client_opts(Auth::Disabled));
            drop(strangers);
            got
        },
    );
    client.expect("the real client gets through the flood");
    accepted.unwrap();
}

#[test]
fn the_same_secret_on_both_sides_connects() {
    let server = common::server(caller(), 4096, 16);
    let key = "a-cluster-secret-of-some-length";
    let (accepted, client) = accept_while(
        server,
        server_opts(secret(key)),
        Duration::from_secs(60),
        |addr| connect_with(addr, &client_opts(secret(key))),
    );
    client.unwrap();
    accepted.unwrap();
}

/// A client without the server's secret, or with another, is refused with a message naming
/// `TBRDMA_SECRET`; the listener drops it, keeps waiting, and names the refusal when its own
/// wait ends. The same for a server without a secret and a client with one.
#[test]
fn a_different_or_missing_secret_is_refused_naming_the_setting() {
    let cases = [
        (secret("a-cluster-secret-of-some-length"), Auth::Disabled),
        (
            secret("a-cluster-secret-of-some-length"),
            secret("another-secret-of-some-length"),
        ),
        (Auth::Disabled, secret("a-cluster-secret-of-some-length")),
    ];
    for (server_auth, client_auth) in cases {
        let case = format!("server {server_auth:?}, client {client_auth:?}");
        let server = common::server(caller(), 4096, 16);
        let (accepted, client) = accept_while(
            server,
            server_opts(server_auth),
            Duration::from_secs(3),
            |addr| connect_with(addr, &client_opts(client_auth)),
        );
        let e = client.expect_err(&case);
        assert!(matches!(e, VerbsError::Handshake { .. }), "{case}: {e:?}");
        assert!(e.to_string().contains("TBRDMA_SECRET"), "{case}: {e}");
        let e = accepted.expect_err(&case);
        assert!(
            matches!(e, VerbsError::Timeout { .. }) && e.to_string().contains("TBRDMA_SECRET"),
            "{case}: {e}"
        );
    }
}

/// Forwards one connection from a port of its own to `server`, keeping what the client sent.
fn recording_proxy(server: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = proxy.local_addr().unwrap();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let record = sent.clone();
    std::thread::spawn(move || {
        let (mut client, _) = proxy.accept().unwrap();
        let mut upstream = TcpStream::connect(server).unwrap();
        let (mut c2, mut u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut u2, &mut c2);
        });
        let mut buf = [0u8; 4096];
        while let Ok(n) = client.read(&mut buf) {
            if n == 0 || upstream.write_all(&buf[..n]).is_err() {
                break;
            }
            record.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        let _ = upstream.shutdown(std::net::Shutdown::Write);
        let _ = back.join();
    });
    (addr, sent)
}

/// An eavesdropper that recorded a member's whole side-channel conversation and plays it back
/// gets nothing: the server's fresh nonce makes the recorded proof worthless.
#[test]
fn a_replayed_handshake_is_refused() {
    let key = "a-cluster-secret-of-some-length";
    let server = common::server(caller(), 4096, 16);
    let Server {
        dev: _dev,
        pd,
        cq,
        listener,
        ..
    } = server;
    let addr = listener.local_addr().unwrap();
    let (proxy, sent) = recording_proxy(addr);
    let listener = Arc::new(listener);
    let accept = {
        let (listener, pd, cq) = (listener.clone(), pd.clone(), cq.clone());
        std::thread::spawn(move || {
            listener.accept(
                &pd,
                &cq,
                &cq,
                &server_opts(secret(key)),
                Some(Duration::from_secs(60)),
            )
        })
    };
    let member = connect_with(proxy, &client_opts(secret(key))).expect("through the proxy");
    accept.join().unwrap().expect("the member is accepted");
    drop(member);
    let recorded = sent.lock().unwrap().clone();
    assert!(!recorded.is_empty());
    // The replay, on a new connection, straight to the listener.
    let mut replay = TcpStream::connect(addr).unwrap();
    replay.write_all(&recorded).unwrap();
    let e = listener
        .accept(
            &pd,
            &cq,
            &cq,
            &server_opts(secret(key)),
            Some(Duration::from_secs(3)),
        )
        .expect_err("the replay was accepted");
    assert!(
        matches!(e, VerbsError::Timeout { .. }) && e.to_string().contains("replayed"),
        "{e}"
    );
}
