//! Datagram I/O backends: how bytes leave and reach one UDP socket bound to a link.
//!
//! Three backends implement [`DatagramIo`]: [`uring`] (io_uring: multishot receive into a
//! provided-buffer ring, batched submission), [`sockets`] (nonblocking `sendmmsg` /
//! `recvmmsg`) and [`packet`] (Ethernet frames through an `AF_PACKET` ring). [`open`] opens the
//! one asked for and falls back to sockets when it is missing or denied (ENOSYS, EPERM:
//! Docker's default seccomp profile; no `CAP_NET_RAW` for packet), logging why. They share the
//! system-call plumbing in `sys` and the meaning of a failed send in `send_error`; [`faults`]
//! wraps any of them in a faulty cable for tests and soak runs.

pub mod faults;
pub(crate) mod neighbours;
pub mod packet;
pub(crate) mod send_error;
pub mod sockets;
pub(crate) mod sys;
pub mod uring;

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

use crate::memory::Buffer;

/// Which backend moves the datagrams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EngineKind {
    /// io_uring (Linux 5.19+ for multishot receive and provided-buffer rings).
    Uring,
    /// Nonblocking `sendmmsg` / `recvmmsg` (any Linux).
    Sockets,
    /// Ethernet frames of tbrdma's own type on an `AF_PACKET` socket, received through a ring
    /// shared with the kernel (needs `CAP_NET_RAW` and IPv4 rails; both ends must use it).
    Packet,
}

impl EngineKind {
    /// The name users type (`--engine uring|sockets`).
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Uring => "uring",
            EngineKind::Sockets => "sockets",
            EngineKind::Packet => "packet",
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uring" | "io_uring" => Ok(EngineKind::Uring),
            "sockets" | "socket" => Ok(EngineKind::Sockets),
            "packet" | "af_packet" => Ok(EngineKind::Packet),
            other => Err(format!(
                "unknown engine {other:?}: use \"uring\", \"sockets\" or \"packet\""
            )),
        }
    }
}

/// The second part of a gathered datagram: `len` bytes of a registered region, sent from where
/// they lie (an iovec into the region's mapping) instead of being copied behind the header.
/// It holds the region's [`Buffer`] so the mapping outlives the send even if the region is
/// deregistered meanwhile.
#[derive(Clone, Debug)]
pub struct RegionPart {
    buffer: Arc<Buffer>,
    offset: usize,
    len: usize,
}

impl RegionPart {
    /// The `len` bytes of `buffer` at `offset`.
    ///
    /// # Panics
    /// If the range is outside the buffer.
    pub fn new(buffer: Arc<Buffer>, offset: usize, len: usize) -> RegionPart {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= buffer.len()),
            "region part outside its buffer"
        );
        RegionPart {
            buffer,
            offset,
            len,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Where the part starts in its buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Whether the part is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte, for an iovec: valid for `len` bytes as long as `self` lives.
    pub fn as_ptr(&self) -> *const u8 {
        self.buffer.ptr_at(self.offset)
    }

    /// Calls `f` with the bytes, in place.
    ///
    /// # Safety
    /// As for [`Buffer::with_slice`]: nothing writes the part while `f` runs.
    #[cfg(test)]
    pub(crate) unsafe fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        // SAFETY: passed on to the caller.
        unsafe { self.buffer.with_slice(self.offset, self.len, f) }
    }

    /// Calls `f` with the first `len` bytes (at most all of them), in place.
    ///
    /// # Safety
    /// As for [`Buffer::with_slice`]: nothing writes the part while `f` runs.
    pub(crate) unsafe fn with_prefix<R>(&self, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        // SAFETY: passed on to the caller.
        unsafe { self.buffer.with_slice(self.offset, len.min(self.len), f) }
    }

    /// Address of the first byte, for an iovec the kernel writes into: valid for `len` bytes
    /// as long as `self` lives (the mapping is writable).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.buffer.ptr_at(self.offset) as *mut u8
    }
}

/// Where the next datagram of a socket may be received: straight into a registered region,
/// where the message the engine expects next will put its payload. When the datagram is that
/// message's packet, its payload is then already in place and the engine copies nothing;
/// anything else is copied out of the zone and handled as usual. Two kinds ([`Expect`]): a
/// zone the application lends for a WRITE, and the buffer of the oldest posted receive.
#[derive(Clone, Debug)]
pub struct Landing {
    /// The queue pair the message is for.
    pub qpn: u32,
    /// The bytes to receive into (see [`Expect`] for what they hold).
    pub zone: RegionPart,
    /// The region the zone lies in, for watching placements into it.
    pub region: tbrdma_proto::RegionId,
    /// What the zone is for.
    pub expect: Expect,
}

/// What a [`Landing`] zone expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A WRITE, in a zone the application lends (see `QueuePair::expect_write` in
    /// tbrdma-verbs) until a write lands there or the next receive completion of its queue
    /// pair: [`tbrdma_proto::wire::MAX_HEADER_LEN`] bytes for the header, then room for one
    /// datagram's payload, whose first byte the peer names by `rkey` and `addr`.
    Write {
        /// Remote key of the zone's first payload byte, as the peer names it.
        rkey: u32,
        /// Its address, as the peer names it.
        addr: u64,
    },
    /// The first packet of a SEND for the oldest receive posted on the queue pair: the zone is
    /// that receive's buffer (the transport's until the receive completes), and the headers
    /// ([`tbrdma_proto::wire::SEND_HEADER_LEN`] bytes) are received apart from it.
    Send,
}

impl Landing {
    /// Whether the `len`-byte datagram that starts with `head` is the expected message's
    /// packet, so that its payload lies where it belongs (the checksum and everything else are
    /// still checked when it is decoded; this only decides whether to copy it out first).
    pub fn is_expected(&self, head: &[u8], len: usize) -> bool {
        match self.expect {
            Expect::Write { rkey, addr } => tbrdma_proto::wire::peek_write_target(head)
                .is_some_and(|t| {
                    t.dest_qpn == self.qpn
                        && t.rkey == rkey
                        && t.addr == addr
                        && tbrdma_proto::wire::MAX_HEADER_LEN + t.payload_len == len
                }),
            Expect::Send => {
                tbrdma_proto::wire::peek_send_start(head).is_some_and(|(dest_qpn, payload_len)| {
                    dest_qpn == self.qpn
                        && tbrdma_proto::wire::SEND_HEADER_LEN + payload_len == len
                        && payload_len <= self.zone.len()
                })
            }
        }
    }
}

/// A datagram as a backend received it: in one piece (`tail` empty), or in two, its headers in
/// `head` and its payload in `tail` (a SEND received into its receive's buffer, see
/// [`Expect::Send`]).
#[derive(Clone, Copy, Debug)]
pub struct Received<'a> {
    /// The datagram, or its headers.
    pub head: &'a [u8],
    /// The rest: empty, or the payload.
    pub tail: &'a [u8],
}

impl<'a> Received<'a> {
    /// A datagram in one piece.
    pub fn whole(bytes: &'a [u8]) -> Received<'a> {
        Received {
            head: bytes,
            tail: &[],
        }
    }

    /// Its bytes, in one piece.
    pub fn to_vec(&self) -> Vec<u8> {
        [self.head, self.tail].concat()
    }
}

/// Datagrams waiting to be sent, in buffers the engine owns for its whole life (so a backend
/// may register them with the kernel once). A datagram is the bytes in its buffer, optionally
/// followed by a [`RegionPart`] (a gathered datagram: header in the buffer, payload in
/// registered memory); backends send both parts as one datagram (two iovecs).
#[derive(Debug)]
pub struct TxBatch {
    bufs: Vec<Box<[u8]>>,
    lens: Vec<usize>,
    dests: Vec<SocketAddr>,
    parts: Vec<Option<RegionPart>>,
    /// Whether datagram `i` holds nothing but ACK packets (see [`Self::commit_coalescing`]).
    acks_only: Vec<bool>,
    used: usize,
    /// Packets appended to a datagram already in the batch, over the batch's life.
    coalesced: u64,
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
            parts: vec![None; slots],
            acks_only: vec![false; slots],
            used: 0,
            coalesced: 0,
        }
    }

    /// The next free buffer, or `None` when the batch is full (send it first).
    pub fn next_buf(&mut self) -> Option<&mut [u8]> {
        self.bufs.get_mut(self.used).map(|b| &mut b[..])
    }

    /// Marks the buffer from [`Self::next_buf`] as holding a `len`-byte datagram for `dest`.
    pub fn commit(&mut self, len: usize, dest: SocketAddr) {
        self.commit_parts(len, dest, None);
    }

    /// Marks the buffer from [`Self::next_buf`] as holding the first `len` bytes of a datagram
    /// for `dest`, whose remaining bytes, if any, are `part`.
    pub fn commit_parts(&mut self, len: usize, dest: SocketAddr, part: Option<RegionPart>) {
        self.lens[self.used] = len;
        self.dests[self.used] = dest;
        self.parts[self.used] = part;
        self.acks_only[self.used] = false;
        self.used += 1;
    }

    /// Marks the buffer from [`Self::next_buf`] as holding one whole `len`-byte packet for
    /// `dest`, and puts it behind the last datagram for `dest` when that one is wholly in its
    /// buffer, has room, and either it or this packet is nothing but acknowledgements;
    /// otherwise it becomes a datagram of its own, as with [`Self::commit`]. So the ACK that one
    /// connection owes rides in the datagram another connection sends to the same peer (NCCL
    /// pairs a send and a receive queue pair between two processes, and each one's data is the
    /// other's only reply). The receiver splits the datagram (`tbrdma_proto::wire::packet_len`).
    /// Only the last datagram for `dest` is extended, so the peer gets its packets in the order
    /// they were committed.
    pub fn commit_coalescing(&mut self, len: usize, dest: SocketAddr) {
        let is_ack = tbrdma_proto::wire::is_ack(&self.bufs[self.used][..len]);
        if let Some(j) = self.last_for(dest)
            && (is_ack || self.acks_only[j])
            && self.room_in(j) >= len
        {
            let (earlier, next) = self.bufs.split_at_mut(self.used);
            earlier[j][self.lens[j]..self.lens[j] + len].copy_from_slice(&next[0][..len]);
            self.lens[j] += len;
            self.acks_only[j] &= is_ack;
            self.coalesced += 1;
            return;
        }
        self.commit(len, dest);
        self.acks_only[self.used - 1] = is_ack;
    }

    /// Whether [`Self::commit_coalescing`] would put an ACK of `len` bytes for `dest` into a
    /// datagram already in the batch.
    pub fn can_carry_ack(&self, dest: SocketAddr, len: usize) -> bool {
        self.last_for(dest).is_some_and(|j| self.room_in(j) >= len)
    }

    /// Packets that [`Self::commit_coalescing`] put into a datagram already in the batch, over
    /// the batch's life.
    pub fn coalesced(&self) -> u64 {
        self.coalesced
    }

    /// The last datagram for `dest`, if any.
    fn last_for(&self, dest: SocketAddr) -> Option<usize> {
        (0..self.used).rev().find(|&j| self.dests[j] == dest)
    }

    /// Bytes that can still go behind datagram `j`: none when part of it is in a region.
    fn room_in(&self, j: usize) -> usize {
        if self.parts[j].is_some() {
            0
        } else {
            self.bufs[j].len() - self.lens[j]
        }
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
        let part = self.parts[i].take();
        other.commit_parts(self.lens[i], self.dests[i], part);
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

    /// Datagram `i`: the bytes in its buffer (all of it, unless [`Self::part`] has the rest)
    /// and its destination.
    pub fn get(&self, i: usize) -> (&[u8], SocketAddr) {
        (&self.bufs[i][..self.lens[i]], self.dests[i])
    }

    /// The second part of datagram `i`, if it has one.
    pub fn part(&self, i: usize) -> Option<&RegionPart> {
        self.parts[i].as_ref()
    }

    /// Datagram `i` as iovecs for the kernel: its buffer, then its region part (empty when it
    /// has none). The pointers stay valid while the batch holds the datagram.
    pub fn iovecs(&self, i: usize) -> [libc::iovec; 2] {
        let (data, _) = self.get(i);
        let (part, part_len) = self.parts[i]
            .as_ref()
            .map_or((std::ptr::null(), 0), |p| (p.as_ptr(), p.len()));
        [
            libc::iovec {
                iov_base: data.as_ptr() as *mut libc::c_void,
                iov_len: data.len(),
            },
            libc::iovec {
                iov_base: part as *mut libc::c_void,
                iov_len: part_len,
            },
        ]
    }

    /// Copies datagram `i`'s region part behind the bytes in its buffer, so that the datagram
    /// lies in one buffer; returns whether it did. Nothing changes for a datagram without a
    /// part, one wholly in its region (a header in the headroom), or one its buffer cannot hold.
    pub fn inline_part(&mut self, i: usize) -> bool {
        let (Some(part), len) = (self.parts[i].as_ref(), self.lens[i]) else {
            return false;
        };
        if len == 0 {
            return false;
        }
        let Some(behind) = self.bufs[i].get_mut(len..len + part.len) else {
            return false;
        };
        part.buffer.read(part.offset, behind);
        self.lens[i] += part.len;
        self.parts[i] = None;
        true
    }

    /// Length of datagram `i` on the wire (both parts).
    pub fn datagram_len(&self, i: usize) -> usize {
        self.lens[i] + self.parts[i].as_ref().map_or(0, RegionPart::len)
    }

    /// Forgets every datagram (after sending), letting go of the regions they pointed into.
    pub fn clear(&mut self) {
        for part in &mut self.parts[..self.used] {
            *part = None;
        }
        self.used = 0;
    }

    /// Every buffer, for backends that register them with the kernel.
    pub fn buffers_mut(&mut self) -> impl Iterator<Item = &mut [u8]> {
        self.bufs.iter_mut().map(|b| &mut b[..])
    }
}

/// Blocks until `fd` or `wake` is readable or `timeout` passed (a signal ends it early, which
/// is fine: callers treat every return as "maybe").
pub(crate) fn wait_readable(
    fd: std::os::fd::BorrowedFd<'_>,
    wake: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> io::Result<()> {
    wait_any_readable([fd, wake], timeout)
}

/// Blocks until `fd`, `other` or `wake` is readable or `timeout` passes (as
/// [`wait_readable`]): a backend that receives on two descriptors.
pub(crate) fn wait_either_readable(
    fd: std::os::fd::BorrowedFd<'_>,
    other: std::os::fd::BorrowedFd<'_>,
    wake: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> io::Result<()> {
    wait_any_readable([fd, other, wake], timeout)
}

/// Blocks until `wake` alone is readable or `timeout` passes (as [`wait_readable`]).
pub(crate) fn wait_readable_one(
    wake: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> io::Result<()> {
    wait_any_readable([wake], timeout)
}

fn wait_any_readable<const N: usize>(
    fds: [std::os::fd::BorrowedFd<'_>; N],
    timeout: std::time::Duration,
) -> io::Result<()> {
    use nix::poll::{PollFd, PollFlags, ppoll};
    let mut fds = fds.map(|fd| PollFd::new(fd, PollFlags::POLLIN));
    match ppoll(
        &mut fds,
        Some(nix::sys::time::TimeSpec::from_duration(timeout)),
        None,
    ) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// One UDP socket's datagram traffic.
pub trait DatagramIo: Send + std::fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> EngineKind;

    /// Sends every datagram in `batch` and clears it. A datagram the kernel refuses for lack
    /// of buffer space after a short retry is dropped and counted (the protocol retransmits it).
    fn send(&mut self, batch: &mut TxBatch) -> io::Result<()>;

    /// Hands the datagrams that have arrived to `deliver`, at most a batch of them (the engine
    /// transmits between calls, and a caller that finds some calls again), without blocking;
    /// returns how many.
    /// A backend may receive the first one into `landing` (see [`Landing`]), and clears it
    /// when a datagram too long for the zone arrived there (that datagram is lost: the
    /// protocol resends it, then through the usual buffers).
    fn recv(
        &mut self,
        landing: &mut Option<Landing>,
        deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
    ) -> io::Result<usize>;

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

    /// The peer the last [`Self::set_peer`] on this backend named. Two backends over one
    /// socket (assisted thread mode) each know only their own: the state compares it with the
    /// association it wants before every transmit pass (see `State::apply_bindings`).
    fn peer(&self) -> Option<SocketAddr>;

    /// Every connection's peer data socket, and whether the peer takes Ethernet frames (its
    /// connection manager said so): a backend that sends frames sends the others UDP from its
    /// socket instead, and reads that socket too while some peer is reached over UDP.
    /// Backends that only carry UDP ignore it.
    fn set_peer_carriers(&mut self, _peers: &[(SocketAddr, bool)]) {}
}

/// One set of backends, one per rail, as a transmit pass uses them, with the last change of
/// the state's wanted socket associations this set has applied (`State::apply_bindings`: a
/// pass compares one number instead of every rail's association).
#[derive(Debug)]
pub(crate) struct Rails {
    ios: Vec<Box<dyn DatagramIo>>,
    /// The `State::bindings_version` this set last brought its sockets to; `None`: never.
    pub(crate) bindings_applied: Option<u64>,
}

impl Rails {
    pub(crate) fn new(ios: Vec<Box<dyn DatagramIo>>) -> Rails {
        Rails {
            ios,
            bindings_applied: None,
        }
    }
}

impl std::ops::Deref for Rails {
    type Target = [Box<dyn DatagramIo>];
    fn deref(&self) -> &Self::Target {
        &self.ios
    }
}

impl std::ops::DerefMut for Rails {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.ios
    }
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
        EngineKind::Packet => match packet::PacketIo::new(socket.try_clone()?, max_datagram) {
            Ok(io) => Ok((Box::new(io), None)),
            Err(e) => {
                let why = packet_fallback(&e);
                Ok((
                    Box::new(sockets::SocketIo::new(socket, max_datagram)?),
                    Some(why),
                ))
            }
        },
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

/// Two backends over one socket (the engine thread's, then the application's) and, on
/// fallback, the reason: see [`open_pair`].
pub type BackendPair = (Box<dyn DatagramIo>, Box<dyn DatagramIo>, Option<String>);

/// Two backends over one `socket` for assisted thread mode: the engine thread's, then the
/// application's (`EngineConfig::assist`). The sockets backend runs each over its own
/// duplicate of the socket; the packet backend shares its packet socket and ring between the
/// two (`PacketIo::new_pair`) and falls back to sockets as [`open`] does. io_uring has no
/// such pair (an `Unsupported` error).
pub fn open_pair(
    preferred: EngineKind,
    socket: UdpSocket,
    max_datagram: usize,
) -> io::Result<BackendPair> {
    let sockets_pair = |socket: UdpSocket| -> io::Result<_> {
        let first: Box<dyn DatagramIo> =
            Box::new(sockets::SocketIo::new(socket.try_clone()?, max_datagram)?);
        let second: Box<dyn DatagramIo> = Box::new(sockets::SocketIo::new(socket, max_datagram)?);
        Ok((first, second))
    };
    match preferred {
        EngineKind::Sockets => {
            let (first, second) = sockets_pair(socket)?;
            Ok((first, second, None))
        }
        EngineKind::Packet => match packet::PacketIo::new_pair(socket.try_clone()?, max_datagram) {
            Ok((first, second)) => Ok((Box::new(first), Box::new(second), None)),
            Err(e) => {
                let why = packet_fallback(&e);
                let (first, second) = sockets_pair(socket)?;
                Ok((first, second, Some(why)))
            }
        },
        EngineKind::Uring => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "io_uring backends do not run in pairs (assisted thread mode)",
        )),
    }
}

/// Why the packet engine could not open (`e`), said once, for a fallback to sockets.
fn packet_fallback(e: &io::Error) -> String {
    let hint = if e.raw_os_error() == Some(libc::EPERM) {
        " (it needs CAP_NET_RAW: run as root, or give the program that capability)"
    } else {
        ""
    };
    let why = format!("the packet engine is unavailable: {e}{hint}; using the sockets engine");
    tracing::warn!("{why}");
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(len: usize) -> Arc<Buffer> {
        let buffer = Arc::new(Buffer::allocate(len, false).expect("a small pinned buffer"));
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
        buffer.write(0, &bytes);
        buffer
    }

    fn commit(batch: &mut TxBatch, head: &[u8], dest: SocketAddr, part: Option<RegionPart>) {
        let buf = batch.next_buf().expect("room");
        buf[..head.len()].copy_from_slice(head);
        batch.commit_parts(head.len(), dest, part);
    }

    #[test]
    fn a_part_is_inlined_only_when_its_buffer_holds_it_behind_a_header() {
        let buffer = region(4096);
        let dest: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let mut batch = TxBatch::new(4, 64);
        commit(
            &mut batch,
            b"head",
            dest,
            Some(RegionPart::new(Arc::clone(&buffer), 100, 60)),
        );
        commit(
            &mut batch,
            b"head",
            dest,
            Some(RegionPart::new(Arc::clone(&buffer), 100, 61)),
        );
        commit(
            &mut batch,
            b"",
            dest,
            Some(RegionPart::new(Arc::clone(&buffer), 0, 10)),
        );
        commit(&mut batch, b"plain", dest, None);

        assert!(batch.inline_part(0), "4 + 60 bytes fit the 64-byte buffer");
        let expected: Vec<u8> = b"head"
            .iter()
            .copied()
            .chain((100..160).map(|i| (i * 7 + 1) as u8))
            .collect();
        assert_eq!(batch.get(0), (&expected[..], dest));
        assert!(batch.part(0).is_none());
        assert_eq!(batch.datagram_len(0), 64);

        assert!(!batch.inline_part(1), "4 + 61 bytes do not fit");
        assert!(!batch.inline_part(2), "wholly in its region already");
        assert!(!batch.inline_part(3), "no part");
        assert_eq!(
            (
                batch.datagram_len(1),
                batch.datagram_len(2),
                batch.datagram_len(3)
            ),
            (65, 10, 5)
        );
        assert_eq!(
            Arc::strong_count(&buffer),
            3,
            "the inlined part let go of the region"
        );
    }

    #[test]
    fn two_part_entries_move_between_batches_and_release_their_regions() {
        let buffer = region(4096);
        let (a, b): (SocketAddr, SocketAddr) =
            ("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
        let mut first = TxBatch::new(4, 64);
        let mut other = TxBatch::new(4, 64);
        commit(&mut first, b"plain", a, None);
        commit(
            &mut first,
            b"head",
            b,
            Some(RegionPart::new(Arc::clone(&buffer), 100, 1000)),
        );
        assert_eq!(Arc::strong_count(&buffer), 2, "the batch holds the region");
        assert_eq!((first.datagram_len(0), first.datagram_len(1)), (5, 1004));
        assert!(first.part(0).is_none());

        // The two-part datagram moves with its region part; the plain one stays.
        first.move_last_to(&mut other);
        assert_eq!((first.len(), other.len()), (1, 1));
        assert_eq!(first.get(0), (&b"plain"[..], a));
        assert_eq!(other.get(0), (&b"head"[..], b));
        let part = other.part(0).expect("the part moved along");
        assert_eq!((part.len(), other.datagram_len(0)), (1000, 1004));
        // SAFETY: nothing else uses the test's buffer.
        unsafe {
            part.with_bytes(|bytes| {
                let expected: Vec<u8> = (100..1100).map(|i| (i * 7 + 1) as u8).collect();
                assert_eq!(bytes, &expected[..]);
            })
        };
        assert_eq!(Arc::strong_count(&buffer), 2);

        // A plain datagram committed into the slot the moved one left carries no stale part.
        commit(&mut first, b"again", a, None);
        assert!(first.part(1).is_none());
        assert_eq!(first.datagram_len(1), 5);

        other.clear();
        assert_eq!(Arc::strong_count(&buffer), 1, "clear lets go of the region");
        first.clear();
        assert!(first.is_empty() && other.is_empty());
    }

    /// A packet of `len` bytes whose opcode byte is `opcode` (all `is_ack` looks at).
    fn packet(opcode: tbrdma_proto::wire::Opcode, fill: u8, len: usize) -> Vec<u8> {
        let mut p = vec![fill; len];
        p[3] = opcode as u8;
        p
    }

    fn commit_coalescing(batch: &mut TxBatch, bytes: &[u8], dest: SocketAddr) {
        batch.next_buf().expect("room")[..bytes.len()].copy_from_slice(bytes);
        batch.commit_coalescing(bytes.len(), dest);
    }

    #[test]
    fn acknowledgements_join_the_last_datagram_for_their_peer_and_nothing_else_does() {
        use tbrdma_proto::wire::Opcode::{Ack, Send};
        let (a, b): (SocketAddr, SocketAddr) =
            ("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
        let mut batch = TxBatch::new(8, 256);
        let data_a = packet(Send, 1, 100);
        let ack_a = packet(Ack, 2, 40);
        commit_coalescing(&mut batch, &data_a, a);
        // An ACK rides behind the data for its peer, not behind another peer's.
        commit_coalescing(&mut batch, &packet(Send, 3, 50), b);
        assert!(batch.can_carry_ack(a, 40));
        commit_coalescing(&mut batch, &ack_a, a);
        assert_eq!(batch.len(), 2);
        assert_eq!(
            batch.get(0),
            (&[data_a.clone(), ack_a.clone()].concat()[..], a)
        );
        // Two data packets stay apart...
        let more_a = packet(Send, 4, 60);
        commit_coalescing(&mut batch, &more_a, a);
        assert_eq!(batch.len(), 3);
        // ...but data may follow a datagram of ACKs only, and then nothing but ACKs joins it.
        let c: SocketAddr = "10.0.0.3:3".parse().unwrap();
        let ack_c = packet(Ack, 6, 40);
        let data_c = packet(Send, 7, 100);
        commit_coalescing(&mut batch, &ack_c, c);
        commit_coalescing(&mut batch, &data_c, c);
        assert_eq!(batch.len(), 4);
        assert_eq!(batch.get(3), (&[ack_c, data_c].concat()[..], c));
        commit_coalescing(&mut batch, &packet(Send, 8, 10), c);
        assert_eq!(batch.len(), 5, "data behind data stays apart");
        // No room: a datagram of its own.
        assert!(!batch.can_carry_ack(a, 200));
        commit_coalescing(&mut batch, &packet(Ack, 9, 200), a);
        assert_eq!(batch.len(), 6);
        assert_eq!(batch.coalesced(), 2);
        // Never behind a datagram whose payload is in a region.
        let buffer = region(4096);
        let mut batch = TxBatch::new(4, 256);
        batch.next_buf().unwrap()[..10].copy_from_slice(&[1; 10]);
        batch.commit_parts(10, a, Some(RegionPart::new(buffer, 0, 1000)));
        assert!(!batch.can_carry_ack(a, 40));
        commit_coalescing(&mut batch, &ack_a, a);
        assert_eq!(batch.len(), 2);
        assert_eq!(batch.coalesced(), 0);
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_region_part_must_lie_inside_its_buffer() {
        let _ = RegionPart::new(region(100), 50, 51);
    }

    /// Both backends send gathered datagrams as one datagram each, alone and in batches.
    #[test]
    fn backends_send_both_parts_as_one_datagram() {
        let buffer = region(200_000);
        // Room for a whole batch of 60 KB datagrams.
        let receiver = crate::socket::bind_udp("127.0.0.1:0".parse().unwrap(), 8 << 20, 1 << 20)
            .expect("a loopback socket");
        receiver.set_nonblocking(false).unwrap();
        receiver
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let dest = receiver.local_addr().unwrap();
        for kind in [EngineKind::Sockets, EngineKind::Uring] {
            let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
            let Ok((mut io, fallback)) = open(kind, socket, 65_535, false) else {
                panic!("cannot open {kind:?}");
            };
            if fallback.is_some() {
                continue; // No io_uring here: the sockets case covers the rest.
            }
            for connected in [false, true] {
                io.set_peer(connected.then_some(dest)).unwrap();
                // One datagram alone (the single-send path; with and without bytes in the
                // batch's buffer), then a mixed batch.
                for (count, lone_in_region) in [(1usize, false), (1, true), (7, false)] {
                    let mut batch = TxBatch::new(8, 128);
                    let mut expected = Vec::new();
                    for i in 0..count {
                        // Datagram 2 (and 5) is wholly in the region, as a send headroom
                        // makes it: no bytes in the batch's buffer.
                        let head = if i % 3 == 2 || lone_in_region {
                            Vec::new()
                        } else {
                            vec![i as u8 + 1; 10 + i]
                        };
                        let part = (i % 3 != 1).then(|| {
                            RegionPart::new(Arc::clone(&buffer), 333 * i, 60_000 - 5000 * i)
                        });
                        let mut datagram = head.clone();
                        if let Some(p) = &part {
                            // SAFETY: nothing writes the test's buffer meanwhile.
                            unsafe { p.with_bytes(|bytes| datagram.extend_from_slice(bytes)) };
                        }
                        expected.push(datagram);
                        commit(&mut batch, &head, dest, part);
                    }
                    io.send(&mut batch).unwrap();
                    assert!(batch.is_empty());
                    let mut buf = vec![0u8; 65_536];
                    for datagram in &expected {
                        let n = receiver.recv(&mut buf).expect("a datagram");
                        assert!(buf[..n] == datagram[..], "{kind:?}: datagram differs");
                    }
                }
            }
            io.set_peer(None).unwrap();
            assert_eq!(Arc::strong_count(&buffer), 1);
        }
    }
}

/// A backend for unit tests: sends nothing anywhere, never receives, and remembers the
/// carriers it was last told (see [`DatagramIo::set_peer_carriers`]).
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct NullIo {
    pub(crate) carriers: Arc<std::sync::Mutex<Vec<(SocketAddr, bool)>>>,
}

#[cfg(test)]
impl DatagramIo for NullIo {
    fn kind(&self) -> EngineKind {
        EngineKind::Sockets
    }
    fn send(&mut self, batch: &mut TxBatch) -> io::Result<()> {
        batch.clear();
        Ok(())
    }
    fn recv(
        &mut self,
        _landing: &mut Option<Landing>,
        _deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
    ) -> io::Result<usize> {
        Ok(0)
    }
    fn wait(&mut self, _timeout: Duration, _wake: BorrowedFd<'_>) -> io::Result<()> {
        Ok(())
    }
    fn send_drops(&self) -> u64 {
        0
    }
    fn set_peer(&mut self, _peer: Option<SocketAddr>) -> io::Result<()> {
        Ok(())
    }
    fn peer(&self) -> Option<SocketAddr> {
        None
    }
    fn set_peer_carriers(&mut self, peers: &[(SocketAddr, bool)]) {
        *self.carriers.lock().unwrap() = peers.to_vec();
    }
}
