//! The UDP floor: nonblocking sockets, the client sends and spins on `recv` (no sleep, no
//! poll), the server spins on `recv_from` and echoes. Nothing can be cheaper through the
//! kernel's UDP. A message larger than one unfragmented datagram (64 KiB) goes as the fewest
//! datagrams that carry it, and the server echoes once it has them all (as the raw-frame floor
//! does, [`crate::frames`]).

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

use crate::pairing::{Echoer, Pinger};
use crate::{check_stall, datagram_lengths};

/// Largest UDP payload the floor sends: the most an IPv4 packet of the lab's 65 520-byte MTU
/// carries after its 28 bytes of headers. A datagram of up to 65 507 bytes is legal, but beyond
/// this it leaves as two IP fragments, which the receiver reassembles: 6 µs more per round
/// trip at 65 507 bytes than two datagrams carrying 65 536 (2026-12-04), so that is no floor.
const UDP_MAX: usize = 65_492;

/// Spins between clock reads while waiting: reading the clock every spin would cost more than
/// the wait it checks.
const SPINS_PER_CHECK: u32 = 4096;

fn would_block(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::WouldBlock
}

fn udp_send(sock: &UdpSocket, data: &[u8], to: Option<SocketAddr>) -> anyhow::Result<()> {
    loop {
        let sent = match to {
            Some(addr) => sock.send_to(data, addr),
            None => sock.send(data),
        };
        match sent {
            Ok(n) if n == data.len() => return Ok(()),
            Ok(n) => bail!("sent {n} of {} bytes", data.len()),
            Err(e) if would_block(&e) => std::hint::spin_loop(),
            Err(e) => return Err(e).context("sending a UDP datagram"),
        }
    }
}

/// Calls the nonblocking `recv` until it returns a datagram, busy-polling; fails once
/// `since` is [`crate::STALL`] ago (checked every [`SPINS_PER_CHECK`] spins).
fn spin<T>(
    mut recv: impl FnMut() -> std::io::Result<T>,
    since: Instant,
    spins: &mut u32,
    what: &str,
) -> anyhow::Result<T> {
    loop {
        match recv() {
            Ok(got) => return Ok(got),
            Err(e) if would_block(&e) => {
                *spins += 1;
                if *spins % SPINS_PER_CHECK == 0 {
                    check_stall(since, what)?;
                }
            }
            Err(e) => return Err(e).with_context(|| format!("receiving a UDP datagram ({what})")),
        }
    }
}

/// The UDP floor's server: one nonblocking socket, a buffer per datagram of a message.
#[derive(Debug)]
pub struct UdpEchoer {
    sock: UdpSocket,
    bufs: Vec<Vec<u8>>,
    lens: Vec<usize>,
}

impl UdpEchoer {
    /// Binds `addr` for messages of `size` bytes.
    pub fn bind(addr: SocketAddr, size: usize) -> anyhow::Result<UdpEchoer> {
        let sock = UdpSocket::bind(addr).with_context(|| format!("binding UDP {addr}"))?;
        sock.set_nonblocking(true)?;
        let datagrams = datagram_lengths(size, UDP_MAX).len();
        Ok(UdpEchoer {
            sock,
            bufs: vec![vec![0u8; 65_536]; datagrams],
            lens: vec![0; datagrams],
        })
    }
}

impl Echoer for UdpEchoer {
    /// Busy-polls until every datagram of a message is in, then sends them all back.
    fn echo(&mut self) -> anyhow::Result<()> {
        let since = Instant::now();
        let mut spins = 0u32;
        let mut from = None;
        for (buf, len) in self.bufs.iter_mut().zip(&mut self.lens) {
            let (n, sender) = spin(
                || self.sock.recv_from(buf),
                since,
                &mut spins,
                "waiting for a datagram",
            )?;
            *len = n;
            from = Some(sender);
        }
        for (buf, &len) in self.bufs.iter().zip(&self.lens) {
            udp_send(&self.sock, &buf[..len], from)?;
        }
        Ok(())
    }
}

/// The UDP floor's client: a socket connected to the server, the message, a buffer for the
/// echo.
#[derive(Debug)]
pub struct UdpPinger {
    sock: UdpSocket,
    msg: Vec<u8>,
    lengths: Vec<usize>,
    buf: Vec<u8>,
}

impl UdpPinger {
    /// A socket on `ip` connected to `server`, for messages of `size` bytes.
    pub fn connect(ip: IpAddr, server: SocketAddr, size: usize) -> anyhow::Result<UdpPinger> {
        let sock = UdpSocket::bind(SocketAddr::new(ip, 0)).context("binding the UDP socket")?;
        sock.connect(server)?;
        sock.set_nonblocking(true)?;
        Ok(UdpPinger {
            sock,
            msg: vec![0xa5u8; size],
            lengths: datagram_lengths(size, UDP_MAX),
            buf: vec![0u8; 65_536],
        })
    }
}

impl Pinger for UdpPinger {
    /// Sends a message, spins on `recv` until all of its echo is back.
    fn round_trip(&mut self, _warming: bool) -> anyhow::Result<Duration> {
        let size = self.msg.len();
        let start = Instant::now();
        let mut at = 0;
        for &len in &self.lengths {
            udp_send(&self.sock, &self.msg[at..at + len], None)?;
            at += len;
        }
        let mut spins = 0u32;
        let mut echoed = 0;
        for _ in &self.lengths {
            echoed += spin(
                || self.sock.recv(&mut self.buf),
                start,
                &mut spins,
                "waiting for the echo",
            )?;
        }
        let rtt = start.elapsed();
        ensure!(echoed == size, "echo of {echoed} bytes for {size}");
        Ok(rtt)
    }
}
