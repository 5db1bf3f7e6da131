//! Datagram I/O backends: how bytes leave and reach one UDP socket bound to a link.
//!
//! Two backends implement [`DatagramIo`]: [`uring`] (io_uring: multishot receive into a
//! provided-buffer ring, batched submission) and [`sockets`] (nonblocking `sendmmsg` /
//! `recvmmsg`). [`open`] picks io_uring when the kernel offers it and falls back to sockets
//! when it is missing or denied (ENOSYS, EPERM: Docker's default seccomp profile), logging why.

pub mod sockets;
pub mod uring;

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::BorrowedFd;
use std::time::Duration;

/// Which backend moves the datagrams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// io_uring (Linux 5.19+ for multishot receive and provided-buffer rings).
    Uring,
    /// Nonblocking `sendmmsg` / `recvmmsg` (any Linux).
    Sockets,
}

impl EngineKind {
    /// The name users type (`--engine uring|sockets`).
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Uring => "uring",
            EngineKind::Sockets => "sockets",
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uring" | "io_uring" => Ok(EngineKind::Uring),
            "sockets" | "socket" => Ok(EngineKind::Sockets),
            other => Err(format!(
                "unknown engine {other:?}: use \"uring\" or \"sockets\""
            )),
        }
    }
}

/// Datagrams waiting to be sent, in buffers the engine owns for its whole life (so a backend
/// may register them with the kernel once).
#[derive(Debug)]
pub struct TxBatch {
    bufs: Vec<Box<[u8]>>,
    lens: Vec<usize>,
    dests: Vec<SocketAddr>,
    used: usize,
}

impl TxBatch {
    /// `slots` buffers of `size` bytes each.
    pub fn new(slots: usize, size: usize) -> TxBatch {
        TxBatch {
            bufs: (0..slots)
                .map(|_| vec![0u8; size].into_boxed_slice())
                .collect(),
            lens: vec![0; slots],
            dests: vec![SocketAddr::from(([0, 0, 0, 0], 0)); slots],
            used: 0,
        }
    }

    /// The next free buffer, or `None` when the batch is full (send it first).
    pub fn next_buf(&mut self) -> Option<&mut [u8]> {
        self.bufs.get_mut(self.used).map(|b| &mut b[..])
    }

    /// Marks the buffer from [`Self::next_buf`] as holding `len` bytes for `dest`.
    pub fn commit(&mut self, len: usize, dest: SocketAddr) {
        self.lens[self.used] = len;
        self.dests[self.used] = dest;
        self.used += 1;
    }

    /// Moves the datagram committed last into `other` (another rail's batch), swapping buffers
    /// rather than copying bytes. `other` must have a free buffer.
    pub fn move_last_to(&mut self, other: &mut TxBatch) {
        assert!(
            self.used > 0 && !other.is_full(),
            "a datagram to move and room for it"
        );
        self.used -= 1;
        let i = self.used;
        std::mem::swap(&mut self.bufs[i], &mut other.bufs[other.used]);
        other.commit(self.lens[i], self.dests[i]);
    }

    /// Datagrams waiting.
    pub fn len(&self) -> usize {
        self.used
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.used == 0
    }

    /// Whether no buffer is free.
    pub fn is_full(&self) -> bool {
        self.used == self.bufs.len()
    }

    /// Datagram `i`: its bytes and destination.
    pub fn get(&self, i: usize) -> (&[u8], SocketAddr) {
        (&self.bufs[i][..self.lens[i]], self.dests[i])
    }

    /// Forgets every datagram (after sending).
    pub fn clear(&mut self) {
        self.used = 0;
    }

    /// Every buffer, for backends that register them with the kernel.
    pub fn buffers_mut(&mut self) -> impl Iterator<Item = &mut [u8]> {
        self.bufs.iter_mut().map(|b| &mut b[..])
    }
}

/// One UDP socket's datagram traffic.
pub trait DatagramIo: Send + std::fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> EngineKind;

    /// Sends every datagram in `batch` and clears it. A datagram the kernel refuses for lack
    /// of buffer space after a short retry is dropped and counted (the protocol retransmits it).
    fn send(&mut self, batch: &mut TxBatch) -> io::Result<()>;

    /// Hands every datagram that has arrived to `deliver`, without blocking; returns how many.
    fn recv(&mut self, deliver: &mut dyn FnMut(&[u8], SocketAddr)) -> io::Result<usize>;

    /// Blocks until a datagram may have arrived, `wake` became readable (another thread has
    /// work for the engine: it writes to that eventfd), or `timeout` passed. Spurious returns
    /// are fine; the caller does not read `wake`.
    fn wait(&mut self, timeout: Duration, wake: BorrowedFd<'_>) -> io::Result<()>;

    /// Datagrams dropped because the kernel had no room to send them.
    fn send_drops(&self) -> u64;

    /// Connects the socket to `peer`, the only address its connections talk to (datagrams to
    /// it then leave without an address, on the route the kernel cached), or with `None`
    /// returns it to accepting any address.
    fn set_peer(&mut self, peer: Option<SocketAddr>) -> io::Result<()>;
}

/// Opens the backend `preferred` on `socket`; io_uring falls back to sockets when the kernel
/// lacks it or denies it. Returns the backend and, on fallback, the reason.
///
/// `single_issuer`: the caller promises that every later call on the backend comes from the
/// thread calling `open`, which lets io_uring use `SINGLE_ISSUER` and `DEFER_TASKRUN`.
pub fn open(
    preferred: EngineKind,
    socket: UdpSocket,
    max_datagram: usize,
    single_issuer: bool,
) -> io::Result<(Box<dyn DatagramIo>, Option<String>)> {
    match preferred {
        EngineKind::Sockets => Ok((
            Box::new(sockets::SocketIo::new(socket, max_datagram)?),
            None,
        )),
        EngineKind::Uring => {
            match uring::UringIo::new(socket.try_clone()?, max_datagram, single_issuer) {
                Ok(io) => Ok((Box::new(io), None)),
                Err(e) => {
                    let why = format!("io_uring unavailable ({e}); using the sockets engine");
                    tracing::warn!("{why}");
                    Ok((
                        Box::new(sockets::SocketIo::new(socket, max_datagram)?),
                        Some(why),
                    ))
                }
            }
        }
    }
}
