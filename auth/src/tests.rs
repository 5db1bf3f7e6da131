//! The handshake over real loopback sockets, and the secret's settings.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use super::*;

fn secret(s: &str) -> Secret {
    Secret::new(s.as_bytes()).unwrap()
}

/// Runs the server side on one thread and the client side here, over loopback.
fn exchange(
    server_secret: Option<Secret>,
    client_secret: Option<Secret>,
) -> (Result<(), AuthError>, Result<(), AuthError>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        super::server(
            &mut DeadlineStream::new(&stream, deadline),
            server_secret.as_ref(),
            "test",
        )
    });
    let stream = TcpStream::connect(addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let client = super::client(
        &mut DeadlineStream::new(&stream, deadline),
        client_secret.as_ref(),
        "test",
    );
    (server.join().unwrap(), client)
}

#[test]
fn the_same_secret_or_none_on_both_sides_is_accepted() {
    let (s, c) = exchange(
        Some(secret("0123456789abcdef-cluster")),
        Some(secret("0123456789abcdef-cluster")),
    );
    s.unwrap();
    c.unwrap();
    let (s, c) = exchange(None, None);
    s.unwrap();
    c.unwrap();
}

fn assert_refused_naming_the_setting(side: &str, r: Result<(), AuthError>) {
    let e = r.expect_err(side);
    assert!(matches!(e, AuthError::Refused(_)), "{side}: {e:?}");
    assert!(e.to_string().contains("TBRDMA_SECRET"), "{side}: {e}");
}

#[test]
fn a_different_or_missing_secret_is_refused_on_both_sides_naming_the_setting() {
    for (server, client) in [
        (Some("0123456789abcdef-one"), Some("0123456789abcdef-two")),
        (Some("0123456789abcdef-one"), None),
        (None, Some("0123456789abcdef-two")),
    ] {
        let (s, c) = exchange(server.map(secret), client.map(secret));
        assert_refused_naming_the_setting("server", s);
        assert_refused_naming_the_setting("client", c);
    }
}

/// A stream that keeps a copy of everything written through it.
struct Recording<'a> {
    inner: DeadlineStream<'a>,
    sent: Vec<u8>,
}

impl Read for Recording<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner.read(buf)
    }
}

impl Write for Recording<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.sent.extend_from_slice(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[test]
fn a_recorded_handshake_replayed_to_the_server_is_refused() {
    let key = "0123456789abcdef-cluster";
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let key = secret(key);
        (0..2)
            .map(|_| {
                let (stream, _) = listener.accept().unwrap();
                let deadline = Instant::now() + Duration::from_secs(30);
                super::server(
                    &mut DeadlineStream::new(&stream, deadline),
                    Some(&key),
                    "test",
                )
            })
            .collect::<Vec<_>>()
    });
    // A legitimate client, whose bytes an eavesdropper records.
    let stream = TcpStream::connect(addr).unwrap();
    let mut recording = Recording {
        inner: DeadlineStream::new(&stream, Instant::now() + Duration::from_secs(30)),
        sent: Vec::new(),
    };
    super::client(&mut recording, Some(&secret(key)), "test").unwrap();
    assert_eq!(recording.sent.len(), HELLO_LEN + PROOF_LEN);
    // The eavesdropper replays them to a new connection, without the secret.
    let mut replay = TcpStream::connect(addr).unwrap();
    replay.write_all(&recording.sent).unwrap();
    let mut answer = [0u8; ANSWER_LEN];
    replay.read_exact(&mut answer).unwrap();
    let results = server.join().unwrap();
    assert!(results[0].is_ok(), "{:?}", results[0]);
    let e = results[1].as_ref().expect_err("the replay was accepted");
    assert!(matches!(e, AuthError::Refused(_)), "{e:?}");
}

#[test]
fn a_peer_that_trickles_bytes_is_cut_off_at_the_total_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let slow = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        // Half a preamble, then a byte now and then: each read alone would succeed.
        s.write_all(&b"tbAU\x01\x00"[..]).unwrap();
        for _ in 0..200 {
            if s.write_all(&[0]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let (stream, _) = listener.accept().unwrap();
    let deadline = Instant::now() + Duration::from_millis(200);
    let e = super::server(&mut DeadlineStream::new(&stream, deadline), None, "test").unwrap_err();
    match e {
        AuthError::Io { source, .. } => {
            assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{source}")
        }
        other => panic!("{other:?}"),
    }
    drop(stream);
    slow.join().unwrap();
}

#[test]
fn garbage_is_a_protocol_error_not_a_refusal() {
    for bytes in [
        &b"GET / HTTP/1.1\r\n\r\n..................."[..],
        b"tbAU\x09",
    ] {
        let e = decode_hello(bytes).unwrap_err();
        assert!(matches!(e, AuthError::Protocol(_)), "{e:?}");
    }
}

#[test]
fn a_secret_file_others_can_read_is_refused_naming_the_fix() {
    let dir = std::env::temp_dir().join(format!("tbrdma-auth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("secret");
    std::fs::write(&path, "0123456789abcdef-from-a-file\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = Secret::from_settings(None, Some(path.clone().into())).unwrap_err();
    assert!(
        e.to_string().contains("TBRDMA_SECRET_FILE") && e.to_string().contains("chmod 600"),
        "{e}"
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let from_file = Secret::from_settings(None, Some(path.clone().into()))
        .unwrap()
        .unwrap();
    // The final newline is not part of the secret.
    let direct = secret("0123456789abcdef-from-a-file");
    assert_eq!(from_file.tag(&[b"x"]), direct.tag(&[b"x"]));
    let both = Secret::from_settings(Some("0123456789abcdef".into()), Some(path.into()));
    assert!(both.unwrap_err().to_string().contains("set only one"));
    let short = Secret::from_settings(Some("short".into()), None).unwrap_err();
    assert!(short.to_string().contains("TBRDMA_SECRET"), "{short}");
    assert!(Secret::from_settings(None, None).unwrap().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}
