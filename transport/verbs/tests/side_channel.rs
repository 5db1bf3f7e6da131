//! The connection manager's side channel against strangers and against hosts with another
//! cluster secret, over real loopback sockets: a stranger that connects and sends nothing, or
//! sends garbage, neither delays nor ends the real peer's setup; nor does one that speaks the
//! protocol (no secret set) and stalls after its hello; a listener sets up several clients at
//! once; with a secret, a peer without it, with another one, or replaying a recorded handshake
//! is refused, naming the setting.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tbrdma_proto::codec::{Put, SliceWriter};
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

/// A stranger that speaks the protocol, with no secret set: it authenticates (there is nothing
/// to prove), sends a well-formed hello naming a data socket that never answers (bound, never
/// read) and then says nothing more. Dropping it closes both.
struct Stalled {
    _side_channel: TcpStream,
    _data: UdpSocket,
}

/// Server options under which a stalled stranger could hold a client's setup `hold` long: the
/// setup timeout, and the idle timeout after which the passive side of a link handshake gives up.
fn holding(hold: Duration) -> QpOptions {
    QpOptions {
        config: Config {
            idle_timeout: hold,
            ..Config::default()
        },
        timeout: hold,
        auth: Auth::Disabled,
        ..QpOptions::default()
    }
}

/// Connects a [`Stalled`] stranger to the listener at `addr`. The hello is built here by hand,
/// in the layout documented in `transport/verbs/src/cm.rs`.
fn stall(addr: SocketAddr) -> Stalled {
    let data = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut tcp = TcpStream::connect(addr).unwrap();
    auth::client(&mut tcp, None, "tbrdma-cm").expect("no secret on either side");
    let mut hello = Vec::new();
    hello.put_u32(0); // The body's length, below.
    hello.put_bytes(b"tbCM");
    hello.put_u16(1); // Version.
    hello.put_u8(1); // A hello.
    hello.put_u8(1); // One rail:
    hello.put_socket_addr(data.local_addr().unwrap());
    hello.put_u32(0x00ab_cdef); // Queue pair number.
    hello.put_u32(1500); // Largest datagram.
    hello.put_u64(0); // Token (a hello has none).
    hello.put_u32(0); // No private data.
    hello.put_u8(0); // UDP.
    let body = (hello.len() - 4) as u32;
    SliceWriter::new(&mut hello[..4]).put_u32(body);
    tcp.write_all(&hello).unwrap();
    Stalled {
        _side_channel: tcp,
        _data: data,
    }
}

/// Before, the listener answered a hello and then waited for that client's handshake over the
/// link for the whole setup timeout (here 60 s) before it looked at the next: a stranger that
/// sent a well-formed hello and never shook hands held it that long, and the real client, which
/// allows 10 s, failed waiting for its answer.
#[test]
fn a_stranger_that_stalls_after_its_hello_does_not_delay_the_real_peer() {
    let server = common::server(caller(), 4096, 16);
    let (accepted, (client, _stranger)) = accept_while(
        server,
        holding(Duration::from_secs(60)),
        Duration::from_secs(60),
        |addr| {
            let stranger = stall(addr);
            // The listener answers the stranger first.
            std::thread::sleep(Duration::from_millis(200));
            (connect_with(addr, &client_opts(Auth::Disabled)), stranger)
        },
    );
    let client = client.expect("the real client connects past the stalled stranger");
    let accepted = accepted.expect("the listener accepts the real client");
    assert_eq!(accepted.peer, client.qp.device().data_addr());
    assert_eq!(accepted.qp.state(), ConnectionState::Established);
}

/// Two real clients set up at once: the first `accept` that answers them returns one, and the
/// other's setup goes on and completes meanwhile (a server with an engine thread, so the link handshake needs no
/// accept call), so both clients' `connect` succeed before the second `accept`, which returns
/// the other. Before, the second client's hello waited unanswered for an accept call, and its
/// `connect` timed out.
#[test]
fn two_clients_at_once_are_both_set_up_and_returned_by_two_accepts() {
    let thread = DeviceConfig {
        engine: EngineConfig {
            progress: Progress::Thread,
            ..caller().engine
        },
        port: 0,
    };
    let Server {
        dev: _dev,
        pd,
        cq,
        listener,
        ..
    } = common::server(thread, 4096, 16);
    let addr = listener.local_addr().unwrap();
    let clients: Vec<_> = (0..2)
        .map(|_| std::thread::spawn(move || connect_with(addr, &client_opts(Auth::Disabled))))
        .collect();
    let opts = server_opts(Auth::Disabled);
    // Both wait in the listener's backlog: an accept that does not wait takes them together
    // and starts reading their hellos (nobody is set up yet, so it returns), and the next
    // answers both.
    std::thread::sleep(Duration::from_millis(200));
    let e = listener
        .accept(&pd, &cq, &cq, &opts, Some(Duration::ZERO))
        .expect_err("no client is set up yet");
    assert!(matches!(e, VerbsError::Timeout { .. }), "{e}");
    std::thread::sleep(Duration::from_millis(500));
    let wait = Some(Duration::from_secs(10));
    let first = listener
        .accept(&pd, &cq, &cq, &opts, wait)
        .expect("the first");
    let clients: Vec<Connected> = clients
        .into_iter()
        .map(|c| c.join().unwrap().expect("each client connects"))
        .collect();
    let second = listener
        .accept(&pd, &cq, &cq, &opts, wait)
        .expect("the second");
    let mut got = vec![first.peer, second.peer];
    let mut want: Vec<SocketAddr> = clients.iter().map(|c| c.qp.device().data_addr()).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
}

/// A stranger that stalls after its hello ends no accept: an accept that finds no other client
/// reports the usual "waiting for a client" timeout (what the NCCL plugin and the collectives
/// take for "no client yet"), the stranger is dropped at its deadline during a later accept,
/// which still returns the real client that comes after, and the timeout of the next names it.
/// Before, the first accept waited out the stranger's deadline and failed with its handshake
/// timeout.
#[test]
fn a_stalled_candidate_makes_no_accept_fail() {
    let Server {
        dev: _dev,
        pd,
        cq,
        listener,
        ..
    } = common::server(caller(), 4096, 16);
    let addr = listener.local_addr().unwrap();
    let opts = QpOptions {
        timeout: Duration::from_secs(2),
        ..holding(Duration::from_secs(60))
    };
    // (On a thread: its authentication is answered once an accept takes it.)
    let stranger = std::thread::spawn(move || stall(addr));
    let e = listener
        .accept(&pd, &cq, &cq, &opts, Some(Duration::from_millis(300)))
        .expect_err("nobody but the stranger");
    let _stranger = stranger.join().unwrap();
    assert!(
        matches!(&e, VerbsError::Timeout { what, .. } if what.starts_with("waiting for a client")),
        "{e}"
    );
    let client = std::thread::spawn(move || {
        // After the stranger's deadline.
        std::thread::sleep(Duration::from_secs(3));
        connect_with(addr, &client_opts(Auth::Disabled))
    });
    let accepted = listener
        .accept(&pd, &cq, &cq, &opts, Some(Duration::from_secs(30)))
        .expect("the real client, after the stranger was dropped");
    let client = client.join().unwrap().expect("the real client connects");
    assert_eq!(accepted.peer, client.qp.device().data_addr());
    let e = listener
        .accept(&pd, &cq, &cq, &opts, Some(Duration::from_millis(100)))
        .expect_err("nobody left");
    assert!(
        matches!(&e, VerbsError::Timeout { what, .. }
            if what.starts_with("waiting for a client") && what.contains("handshake over the link")),
        "{e}"
    );
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
