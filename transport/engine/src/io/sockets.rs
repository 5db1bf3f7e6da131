//! The plain-socket backend: nonblocking `sendmmsg` / `recvmmsg` on one UDP socket, batches
//! of up to 32 datagrams per system call; a gathered datagram (header and a region part, see
//! [`super::RegionPart`]) goes out as one message with two iovecs. Works on every Linux and inside containers whose
//! seccomp profile denies io_uring. A poll whose engine has a landing zone receives its first
//! datagram straight into it ([`super::Landing`]: a zone lent for a WRITE, header and payload
//! together; or the buffer of the next receive, the headers apart in front of it); a datagram
//! wholly in a region (its header in a send headroom) leaves with one plain send(2).
//!
//! **This file contains `unsafe`**: the system calls take raw pointers and message headers that
//! point into buffers on this function's stack frame, owned by `self`, or in registered regions
//! (a gathered datagram's part, a landing zone) that the caller keeps alive.

use std::io;
use std::mem::MaybeUninit;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use tbrdma_proto::wire::{MAX_HEADER_LEN, SEND_HEADER_LEN};

use super::send_error::{Attempt, Next, SendFailures, is_stale_icmp};
use super::sys::{self, STORAGE_LEN as NAME_LEN};
use super::{DatagramIo, EngineKind, Expect, Landing, Received, TxBatch, wait_readable};

/// Datagrams per system call.
const BATCH: usize = 32;

/// A lone datagram to the connected peer of up to this many bytes whose payload was gathered
/// from its region (`EngineConfig::gather_threshold`) has the payload copied behind its header
/// and leaves with send(2), from one buffer: on veth that measured faster than sendmsg(2) of
/// the two parts (a ping-pong's round trip, `scripts/linkbench-ab.py`: 4 KiB WRITE and SEND
/// 8.5 % less, 6 KiB 6-15 % less; 8 and 12 KiB no different; 16 KiB 14 % more, the copy then
/// costing more than the second iovec). Batches keep their gathered parts: there the copy is
/// what gathering saves.
const LONE_COPY_MAX: usize = 8 * 1024;

/// Nonblocking socket I/O.
#[derive(Debug)]
pub struct SocketIo {
    socket: UdpSocket,
    rx: RxHeaders,
    /// Datagrams the last receive call returned (0: the socket was empty), which sizes the
    /// next call (see `recv`).
    last_batch: usize,
    /// Whether a datagram went out since the last receive call returned any: the next one
    /// received is then most likely the answer, alone (see `recv`).
    sent_since_recv: bool,
    /// The address the socket is connected to, if any.
    peer: Option<SocketAddr>,
    /// Datagrams dropped, and whether a filter's drop was reported.
    failures: SendFailures,
}

/// The receive side's `recvmmsg` headers, built once: each points at its own buffer and
/// address slot, all on the heap so that moving the `SocketIo` moves none of them. Rebuilding
/// (and zeroing) 32 headers on every poll of an empty socket was a measurable share of the
/// busy-poll loop.
struct RxHeaders {
    bufs: Vec<Box<[u8]>>,
    names: Box<[libc::sockaddr_storage]>,
    /// Never read here: kept alive because the headers point into it.
    _iovs: Box<[libc::iovec]>,
    msgs: Box<[libc::mmsghdr]>,
}

// SAFETY: the raw pointers inside `iovs` and `msgs` point only into `bufs`, `names` and `iovs`,
// heap allocations owned by the same value and never shared; sending the whole value to
// another thread moves their sole owner with them.
unsafe impl Send for RxHeaders {}

impl std::fmt::Debug for RxHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxHeaders")
            .field("slots", &self.bufs.len())
            .finish()
    }
}

impl RxHeaders {
    fn new(max_datagram: usize) -> RxHeaders {
        let mut bufs: Vec<Box<[u8]>> = (0..BATCH)
            .map(|_| vec![0u8; max_datagram + 1].into_boxed_slice())
            .collect();
        let mut names: Box<[libc::sockaddr_storage]> =
            (0..BATCH).map(|_| sys::empty_storage()).collect();
        let mut iovs: Box<[libc::iovec]> = bufs
            .iter_mut()
            .map(|buf| libc::iovec {
                iov_base: buf.as_mut_ptr() as *mut _,
                iov_len: buf.len(),
            })
            .collect();
        let msgs: Box<[libc::mmsghdr]> = (0..BATCH)
            .map(|i| libc::mmsghdr {
                msg_hdr: sys::msghdr(
                    &mut names[i] as *mut _ as *mut libc::c_void,
                    NAME_LEN,
                    &mut iovs[i],
                    1,
                ),
                msg_len: 0,
            })
            .collect();
        RxHeaders {
            bufs,
            names,
            _iovs: iovs,
            msgs,
        }
    }
}

impl SocketIo {
    /// Wraps a bound socket (made nonblocking here).
    pub fn new(socket: UdpSocket, max_datagram: usize) -> io::Result<SocketIo> {
        socket.set_nonblocking(true)?;
        Ok(SocketIo {
            socket,
            rx: RxHeaders::new(max_datagram),
            last_batch: 0,
            sent_since_recv: false,
            peer: None,
            failures: SendFailures::default(),
        })
    }
}

/// What [`recv_into_zone`] and [`recv_into_receive`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Landed {
    /// The socket was empty.
    Nothing,
    /// A datagram, delivered (in place or from a copy), or dropped as nothing tbrdma sends.
    Delivered,
    /// A datagram longer than the zone: cut, and dropped.
    TooLong,
}

/// The length a nonblocking receive returned, `None` when the socket was empty.
fn length_unless_empty(received: io::Result<usize>) -> io::Result<Option<usize>> {
    match received {
        Ok(len) => Ok(Some(len)),
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Receives one datagram into `zone` with recvfrom(2) and delivers it: in place when it is the
/// expected write, otherwise copied into `spare` first (so that the zone's bytes are never
/// lent out while the protocol may place another payload over them).
///
/// # Safety
/// The zone's bytes must be the engine's for the call: nothing else reads or writes them (the
/// application lent them, see [`Landing`]).
unsafe fn recv_into_zone(
    fd: BorrowedFd<'_>,
    zone: &Landing,
    spare: &mut [u8],
    name: &mut libc::sockaddr_storage,
    deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
) -> io::Result<Landed> {
    let cap = zone.zone.len();
    // SAFETY: the zone is `cap` writable bytes of a region mapping that `zone` keeps alive, and
    // nothing else reads or writes them during the call (this function's contract).
    let received = unsafe {
        sys::recv_from(
            fd,
            zone.zone.as_mut_ptr(),
            cap,
            libc::MSG_DONTWAIT | libc::MSG_TRUNC,
            name,
        )
    };
    let Some(len) = length_unless_empty(received)? else {
        return Ok(Landed::Nothing);
    };
    // With MSG_TRUNC the length is the datagram's, even when the zone held less of it.
    if len > cap {
        return Ok(Landed::TooLong);
    }
    let Some(from) = sys::from_storage(name) else {
        return Ok(Landed::Delivered);
    };
    // The three views below are sound for one reason: the kernel has finished writing the
    // zone (recvmsg returned), the engine holds its state lock (placements into regions take
    // it), and the application does not touch a landing zone it lent until the receive
    // completes (`Engine::expect_write`). Delivering a datagram that is already in its place
    // copies nothing over it.
    // SAFETY: see above.
    let expected = unsafe {
        zone.zone
            .with_prefix(len.min(MAX_HEADER_LEN), |head| zone.is_expected(head, len))
    };
    if expected {
        // SAFETY: see above.
        unsafe {
            zone.zone
                .with_prefix(len, |bytes| deliver(Received::whole(bytes), from))
        };
    } else {
        // SAFETY: see above.
        unsafe {
            zone.zone
                .with_prefix(len, |bytes| spare[..len].copy_from_slice(bytes))
        };
        deliver(Received::whole(&spare[..len]), from);
    }
    Ok(Landed::Delivered)
}

/// Receives one datagram with recvmsg(2) in three pieces: its first [`SEND_HEADER_LEN`] bytes
/// into `spare`, the next ones into the receive buffer `zone` names, the rest (if any) into
/// `spare` again, right after where the zone's share would go. When it is the expected SEND's
/// first packet ([`Expect::Send`]), it is delivered in two pieces, its payload already in the
/// receive's buffer; otherwise the zone's share is copied into `spare` between the other two,
/// and the datagram is delivered from there in one piece.
///
/// # Safety
/// The zone's bytes must be the engine's for the call: nothing else reads or writes them (they
/// are the buffer of a posted receive, which the application leaves to the transport until the
/// receive completes).
unsafe fn recv_into_receive(
    fd: BorrowedFd<'_>,
    zone: &Landing,
    spare: &mut [u8],
    name: &mut libc::sockaddr_storage,
    deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
) -> io::Result<Landed> {
    // (A `spare` shorter than the headers, from a configured datagram size no link has, only
    // means nothing is expected: every datagram is then copied out.)
    let head = SEND_HEADER_LEN.min(spare.len());
    let cap = zone.zone.len().min(spare.len() - head);
    let (front, back) = spare.split_at_mut(head + cap);
    let mut iov = [
        libc::iovec {
            iov_base: front.as_mut_ptr() as *mut _,
            iov_len: head,
        },
        libc::iovec {
            iov_base: zone.zone.as_mut_ptr() as *mut _,
            iov_len: cap,
        },
        libc::iovec {
            iov_base: back.as_mut_ptr() as *mut _,
            iov_len: back.len(),
        },
    ];
    // SAFETY: the first and last iovecs are `spare`'s, borrowed mutably for the call; the
    // middle one is `cap` bytes of the zone, inside its region's mapping (which `zone` keeps
    // alive), which nothing else reads or writes during the call (this function's contract).
    let received =
        unsafe { sys::recv_msg(fd, &mut iov, libc::MSG_DONTWAIT | libc::MSG_TRUNC, name) };
    let Some(len) = length_unless_empty(received)? else {
        return Ok(Landed::Nothing);
    };
    // One byte more than the largest datagram tbrdma sends (as the plain path's buffers are):
    // a datagram that fills them may have been cut, and is not ours.
    if len >= spare.len() {
        return Ok(Landed::Delivered);
    }
    let Some(from) = sys::from_storage(name) else {
        return Ok(Landed::Delivered);
    };
    if len <= head {
        deliver(Received::whole(&spare[..len]), from);
        return Ok(Landed::Delivered);
    }
    let payload = len - head;
    // The views of the zone below are sound as in `recv_into_zone`: the kernel has finished
    // writing it, the engine holds its state lock, and the application leaves a posted
    // receive's buffer alone until it completes.
    if payload <= cap && zone.is_expected(&spare[..head], len) {
        // SAFETY: see above.
        unsafe {
            zone.zone.with_prefix(payload, |tail| {
                deliver(
                    Received {
                        head: &spare[..head],
                        tail,
                    },
                    from,
                )
            })
        };
    } else {
        let in_zone = payload.min(cap);
        // SAFETY: see above.
        unsafe {
            zone.zone.with_prefix(in_zone, |bytes| {
                spare[head..head + in_zone].copy_from_slice(bytes)
            })
        };
        deliver(Received::whole(&spare[..len]), from);
    }
    Ok(Landed::Delivered)
}

impl DatagramIo for SocketIo {
    fn kind(&self) -> EngineKind {
        EngineKind::Sockets
    }

    fn send(&mut self, batch: &mut TxBatch) -> io::Result<()> {
        self.sent_since_recv |= !batch.is_empty();
        let fd = self.socket.as_raw_fd();
        let mut start = 0;
        while start < batch.len() {
            let n = (batch.len() - start).min(BATCH);
            let mut names =
                [MaybeUninit::<(libc::sockaddr_storage, libc::socklen_t)>::uninit(); BATCH];
            // Two iovecs per datagram: the buffer, then the region part of a gathered one.
            let mut iovs = [MaybeUninit::<[libc::iovec; 2]>::uninit(); BATCH];
            let mut msgs = [MaybeUninit::<libc::mmsghdr>::uninit(); BATCH];
            let lone_to_peer = n == 1 && self.peer == Some(batch.get(start).1);
            if lone_to_peer && batch.datagram_len(start) <= LONE_COPY_MAX {
                batch.inline_part(start);
            }
            // One datagram to the connected peer in one buffer (a ping-pong's) goes out with
            // plain send(2) below, which needs no message header: building one cost about 200
            // instructions per datagram.
            let plain_send =
                lone_to_peer && (batch.part(start).is_none() || batch.get(start).0.is_empty());
            for i in (0..n).filter(|_| !plain_send) {
                let dest = batch.get(start + i).1;
                let part = batch.part(start + i);
                names[i].write(sys::to_storage(&dest));
                iovs[i].write(batch.iovecs(start + i));
                // SAFETY: both were initialised just above.
                let (name, iov) =
                    unsafe { (names[i].assume_init_mut(), iovs[i].assume_init_mut()) };
                // To the connected peer no address is given: the kernel's cached route is
                // used instead of a lookup per datagram.
                let to = if self.peer != Some(dest) {
                    &mut name.0 as *mut _ as *mut libc::c_void
                } else {
                    std::ptr::null_mut()
                };
                let iov_len = if part.is_some() { 2 } else { 1 };
                let hdr = sys::msghdr(to, name.1, iov.as_mut_ptr(), iov_len);
                msgs[i].write(libc::mmsghdr {
                    msg_hdr: hdr,
                    msg_len: 0,
                });
            }
            let mut done = 0;
            let mut attempt = Attempt::default();
            while done < n {
                let sent = if lone_to_peer {
                    let rc = if let (Some(part), true) =
                        (batch.part(start), batch.get(start).0.is_empty())
                    {
                        // A datagram wholly in a region (its header in the headroom in front of
                        // the payload): plain send(2) of that one buffer.
                        // SAFETY: `part` points at `part.len()` bytes of a region buffer that the
                        // batch keeps alive for the call; the kernel only reads them.
                        unsafe { libc::send(fd, part.as_ptr() as *const _, part.len(), 0) }
                    } else if batch.part(start).is_none() {
                        // One datagram to the connected peer (a ping-pong's): plain send(2),
                        // which spares the kernel copying in a message header.
                        let (data, _) = batch.get(start);
                        // SAFETY: `data` is a live buffer of the batch and its exact length is
                        // passed; the kernel only reads it.
                        unsafe { libc::send(fd, data.as_ptr() as *const _, data.len(), 0) }
                    } else {
                        // A gathered one: its two parts with one sendmsg(2), no address.
                        // SAFETY: `msgs[0]` was initialised above (this is not `plain_send`);
                        // its header points at `iovs[0]`
                        // (the batch's buffer and the region part, which the batch keeps alive)
                        // and names no address, all alive and unmoved for the call.
                        unsafe { libc::sendmsg(fd, &msgs[0].assume_init_ref().msg_hdr, 0) }
                    };
                    if rc >= 0 { 1 } else { -1 }
                } else {
                    // SAFETY: `msgs[done..n]` are initialised headers (several datagrams, or
                    // one not for the connected peer: not `plain_send`) pointing at `names`,
                    // `iovs`, the batch's buffers and its region parts (whose `Arc`s the batch
                    // holds), all alive and unmoved for the call.
                    unsafe {
                        libc::sendmmsg(fd, msgs[done].as_mut_ptr(), (n - done) as libc::c_uint, 0)
                    }
                };
                if sent >= 0 {
                    done += sent as usize;
                    attempt = Attempt::default();
                    continue;
                }
                let err = io::Error::last_os_error();
                match self
                    .failures
                    .after(err.raw_os_error().unwrap_or(0), &mut attempt)
                {
                    Next::Again => std::hint::spin_loop(),
                    Next::Drop => {
                        // Lost (the protocol's retransmission, on another rail if there is
                        // one, takes over): go on with the next datagram.
                        done += 1;
                        attempt = Attempt::default();
                    }
                    Next::Fail => return Err(err),
                }
            }
            start += n;
        }
        batch.clear();
        Ok(())
    }

    fn recv(
        &mut self,
        landing: &mut Option<Landing>,
        deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
    ) -> io::Result<usize> {
        let fd = self.socket.as_raw_fd();
        let mut total = 0;
        let rx = &mut self.rx;
        loop {
            // Asking for 32 datagrams when one arrives makes the kernel look for a second one
            // before returning: an extra pass on the critical path of every ping-pong. So the
            // first call after an empty poll asks for one datagram, with plain recvfrom (which
            // also spares the kernel copying in a message header), and hands it over at once;
            // the next asks for a full batch (in a stream it finds them). So does the first
            // call after a send when the last one found a lone datagram: that is an exchange
            // (a ping-pong, or a collective whose ranks send to each other and then wait),
            // whose answer may already be queued before the poll that takes it, and recvmmsg
            // measured 0.7 µs slower than recvfrom there for a 16 KiB datagram.
            let single = self.last_batch == 0 || (self.last_batch == 1 && self.sent_since_recv);
            // A landing zone takes the first datagram of the call, alone; the rest, if any,
            // come the usual way.
            if let (0, Some(zone)) = (total, landing.as_ref()) {
                let landed = match zone.expect {
                    // SAFETY: the zone is the engine's landing zone, lent by the application
                    // until a write lands there or its queue pair completes a receive; it
                    // promised (`QueuePair::expect_write` in tbrdma-verbs) not to touch the
                    // bytes meanwhile.
                    Expect::Write { .. } => unsafe {
                        recv_into_zone(
                            self.socket.as_fd(),
                            zone,
                            &mut rx.bufs[0],
                            &mut rx.names[0],
                            deliver,
                        )
                    },
                    // SAFETY: the zone is the buffer of the oldest receive posted on its queue
                    // pair, which the application does not touch until the receive completes
                    // (the verbs contract on posted buffers, docs/semantics.md), and which
                    // the engine found under the state lock it still holds.
                    Expect::Send => unsafe {
                        recv_into_receive(
                            self.socket.as_fd(),
                            zone,
                            &mut rx.bufs[0],
                            &mut rx.names[0],
                            deliver,
                        )
                    },
                };
                match landed {
                    Ok(Landed::Nothing) => {
                        self.last_batch = 0;
                        return Ok(0);
                    }
                    Ok(landed) => {
                        if landed == Landed::TooLong {
                            *landing = None;
                        }
                        total = 1;
                        if single {
                            self.last_batch = 1;
                            self.sent_since_recv = false;
                            return Ok(1);
                        }
                        continue;
                    }
                    Err(e)
                        if e.raw_os_error() == Some(libc::EINTR)
                            || e.raw_os_error().is_some_and(is_stale_icmp) =>
                    {
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            let got = if single {
                let buf = &mut rx.bufs[0];
                // SAFETY: `buf` is a live allocation owned by `rx`, its exact size is passed,
                // and nothing else touches it during the call.
                let received = unsafe {
                    sys::recv_from(
                        self.socket.as_fd(),
                        buf.as_mut_ptr(),
                        buf.len(),
                        libc::MSG_DONTWAIT,
                        &mut rx.names[0],
                    )
                };
                if let Ok(len) = received {
                    // Recorded as recvmmsg would have, for the delivery below. A datagram that
                    // fills the buffer (one byte more than the largest tbrdma sends) may have
                    // been cut.
                    let msg = &mut rx.msgs[0];
                    msg.msg_len = len as libc::c_uint;
                    msg.msg_hdr.msg_flags = if len >= buf.len() { libc::MSG_TRUNC } else { 0 };
                    1
                } else {
                    -1 // (errno still holds the error: read below, as after recvmmsg)
                }
            } else {
                // SAFETY: every header points at its own buffer, iovec and address slot, heap
                // allocations owned by `rx` that live and stay put for the duration of the call.
                unsafe {
                    libc::recvmmsg(
                        fd,
                        rx.msgs.as_mut_ptr(),
                        BATCH as libc::c_uint,
                        libc::MSG_DONTWAIT,
                        std::ptr::null_mut(),
                    )
                }
            };
            if got < 0 {
                let err = io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EAGAIN) {
                    if total == 0 {
                        self.last_batch = 0;
                    }
                    return Ok(total);
                }
                if err.raw_os_error() == Some(libc::EINTR)
                    || err.raw_os_error().is_some_and(is_stale_icmp)
                {
                    continue;
                }
                return Err(err);
            }
            let got = got as usize;
            for i in 0..got {
                let msg = &mut rx.msgs[i];
                let truncated = msg.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
                let len = msg.msg_len as usize;
                // The kernel shrank the address length to what it wrote: restore it for the
                // next call.
                msg.msg_hdr.msg_namelen = NAME_LEN;
                if truncated {
                    continue; // Larger than any datagram tbrdma sends: not ours.
                }
                if let Some(from) = sys::from_storage(&rx.names[i]) {
                    deliver(Received::whole(&rx.bufs[i][..len]), from);
                }
            }
            total += got;
            self.last_batch = got;
            self.sent_since_recv = false;
            // One batch per call, even when it came full and more wait: the engine transmits
            // between calls, and reads the other rails. Draining the socket instead held every
            // acknowledgement while a bulk transfer kept it full (a sender's first window of
            // 8 MiB, 64 KiB datagrams, went unacknowledged for 2.2 ms, past its 1 ms timeout),
            // and read a whole rail's queue before the next rail's (docs/performance.md, "One
            // batch per receive").
            return Ok(total);
        }
    }

    fn wait(&mut self, timeout: Duration, wake: BorrowedFd<'_>) -> io::Result<()> {
        wait_readable(self.socket.as_fd(), wake, timeout)
    }

    fn send_drops(&self) -> u64 {
        self.failures.drops()
    }

    fn set_peer(&mut self, peer: Option<SocketAddr>) -> io::Result<()> {
        crate::socket::set_udp_peer(&self.socket, peer)?;
        self.peer = peer;
        Ok(())
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }
}
