//! The packet backend: tbrdma datagrams in Ethernet frames of their own type on the rail's
//! interface (an `AF_PACKET` socket), received through a ring the kernel shares with the
//! process (`PACKET_RX_RING`, `TPACKET_V2`). A poll reads the ring's next status word instead
//! of making a system call, and a frame skips the kernel's IP and UDP layers both ways: on the
//! lab's veth a 16 KiB exchange measured 4.2-5.0 µs against 8.0 for UDP in the same scratch
//! harness (docs/performance.md). Needs `CAP_NET_RAW` (root) and an IPv4 rail; otherwise
//! [`super::open`] falls back to the sockets backend and says why.
//!
//! Addressing stays the engine's: every frame starts with a 12-byte shim naming destination
//! and source as IPv4 address and port (those of the rail's UDP socket, which stays bound so
//! that no one else takes the port, but carries nothing). A classic BPF filter on the socket
//! keeps frames for other addresses or ports (other tbrdma processes on the interface) out of
//! the ring. Frames go only to the peer's MAC address from the kernel's neighbour table, and a
//! frame is taken only from the MAC address the table gives for the source its shim names
//! (`neighbours.rs` decides both): while the table has no entry, frames are dropped (the
//! protocol resends) and one empty UDP datagram to the peer makes the kernel resolve it.
//! Frames are never broadcast.
//!
//! Both ends of a connection must use this backend: a sockets or io_uring peer never sees
//! these frames, and the connection fails to establish.
//!
//! **This file contains `unsafe`**: the ring is memory shared with the kernel, read through
//! raw pointers under the ring's ownership protocol (a frame is the process's while its status
//! says so), and the system calls take raw pointers to buffers owned by `self` or the batch.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::neighbours::{KernelTable, Lookup, Mac, Neighbours};
use super::send_error::{Attempt, Next, SendFailures};
use super::sys;
use super::{DatagramIo, EngineKind, Landing, Received, TxBatch, wait_readable};

/// The Ethernet type of tbrdma frames: 0x88B5 is reserved for local experiments (IEEE 802).
pub const ETHERTYPE: u16 = 0x88b5;
/// Bytes of the address shim in front of every datagram.
pub const SHIM: usize = 12;
/// Frames in the receive ring, each holding one datagram of the largest size. Connections
/// advertise no larger a window (see `Engine::window_limit`), so a peer never sends more than
/// the ring holds. Few frames keep the ring warm in the cache: the kernel copies every frame in
/// and the placement copies it out, and with 128 frames of 68 KiB (8.7 MiB) both copies missed
/// the cache (a 256 KiB all-reduce took 1.3x as long as with sockets).
pub const RING_FRAMES: usize = 32;
/// Frames handed to the engine per receive call.
const BATCH: usize = 32;

/// `AF_PACKET` I/O on the interface of one rail.
#[derive(Debug)]
pub struct PacketIo {
    /// The rail's UDP socket: keeps the port, and carries only the empty datagrams that make
    /// the kernel resolve a peer's MAC address.
    socket: UdpSocket,
    fd: OwnedFd,
    ring: Ring,
    ifindex: i32,
    local: SocketAddrV4,
    neighbours: Neighbours<KernelTable>,
    /// Datagrams dropped, and whether a filter's drop was reported.
    failures: SendFailures,
    /// The last peer named (nothing is connected: see `set_peer`).
    peer: Option<SocketAddr>,
}

/// The receive ring: `frames` frames of `frame_size` bytes, mapped from the socket.
struct Ring {
    base: *mut u8,
    len: usize,
    frame_size: usize,
    frames: usize,
    next: usize,
}

// SAFETY: the mapping belongs to this value alone (nothing else holds `base`); moving the
// value to another thread moves its only user.
unsafe impl Send for Ring {}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("frames", &self.frames)
            .field("frame_size", &self.frame_size)
            .finish()
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are the mapping made in `PacketIo::new`, unmapped only here.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

impl Ring {
    /// Status word of frame `i` (the first field of its `tpacket2_hdr`), shared with the
    /// kernel.
    ///
    /// # Panics
    /// If there is no frame `i`.
    fn status(&self, i: usize) -> &AtomicU32 {
        assert!(i < self.frames, "frame {i} of {}", self.frames);
        // SAFETY: frame `i` lies inside the mapping (i < frames, checked) and starts on a
        // 16-byte boundary, so its first 4 bytes are an aligned u32 for as long as `self` lives;
        // the kernel writes it too, hence the atomic view.
        unsafe { &*(self.base.add(i * self.frame_size) as *const AtomicU32) }
    }

    /// The frame's header, when the kernel has handed it to the process.
    fn ready(&self, i: usize) -> Option<libc::tpacket2_hdr> {
        if self.status(i).load(Ordering::Acquire) & libc::TP_STATUS_USER == 0 {
            return None;
        }
        // SAFETY: the frame is the process's (status says so, read with Acquire above), so the
        // kernel does not write its header until it is handed back; the header is plain data
        // at the frame's start, inside the mapping.
        Some(unsafe {
            std::ptr::read_volatile(self.base.add(i * self.frame_size) as *const libc::tpacket2_hdr)
        })
    }

    /// Bytes `offset..offset + len` of frame `i`, if the frame is the process's (`None` while
    /// the kernel owns it, or when the range is outside the frame).
    fn bytes(&self, i: usize, offset: usize, len: usize) -> Option<&[u8]> {
        if self.status(i).load(Ordering::Acquire) & libc::TP_STATUS_USER == 0 {
            return None;
        }
        (offset.checked_add(len)? <= self.frame_size).then(|| {
            // SAFETY: the range lies inside frame `i` (checked above), which the process owns
            // (its status says so, read with Acquire above) until `release(i)`, which needs
            // `&mut self` and so waits for the borrow returned here: the kernel does not write
            // it meanwhile.
            unsafe { std::slice::from_raw_parts(self.base.add(i * self.frame_size + offset), len) }
        })
    }

    /// Hands frame `i` back to the kernel (`&mut`: no view of its bytes may outlive this).
    fn release(&mut self, i: usize) {
        self.status(i)
            .store(libc::TP_STATUS_KERNEL, Ordering::Release);
    }
}

/// The interface holding `ip`: its name, index, and its own MAC address when it is a
/// loopback interface.
fn interface_of(ip: Ipv4Addr) -> io::Result<(String, i32, Option<Mac>)> {
    let addrs: Vec<_> = nix::ifaddrs::getifaddrs()
        .map_err(io::Error::from)?
        .collect();
    for a in &addrs {
        let Some(sin) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) else {
            continue;
        };
        if sin.ip() == ip {
            let name = a.interface_name.clone();
            let index = nix::net::if_::if_nametoindex(name.as_str()).map_err(io::Error::from)?;
            let loopback = a
                .flags
                .contains(nix::net::if_::InterfaceFlags::IFF_LOOPBACK)
                .then(|| {
                    addrs
                        .iter()
                        .filter(|l| l.interface_name == name)
                        .find_map(|l| l.address.as_ref()?.as_link_addr()?.addr())
                        .unwrap_or([0; 6])
                });
            return Ok((name, index as i32, loopback));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no interface has the address {ip}"),
    ))
}

/// The classic BPF program that passes only frames whose shim names `local` as destination.
fn filter_for(local: SocketAddrV4) -> [libc::sock_filter; 6] {
    let op = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    const LD_W_ABS: u16 = 0x20;
    const LD_H_ABS: u16 = 0x28;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    [
        op(LD_W_ABS, 0, 0, 0),
        op(JEQ_K, 0, 3, u32::from(*local.ip())),
        op(LD_H_ABS, 0, 0, 4),
        op(JEQ_K, 0, 1, u32::from(local.port())),
        op(RET_K, 0, 0, u32::MAX),
        op(RET_K, 0, 0, 0),
    ]
}

impl PacketIo {
    /// Opens a packet socket on the interface of `socket`'s (IPv4) address, with a receive
    /// ring for datagrams up to `max_datagram` bytes.
    pub fn new(socket: UdpSocket, max_datagram: usize) -> io::Result<PacketIo> {
        let local = match socket.local_addr()? {
            SocketAddr::V4(a) if !a.ip().is_unspecified() => a,
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("the packet engine needs a rail bound to an IPv4 address, not {other}"),
                ));
            }
        };
        let (ifname, ifindex, loopback) = interface_of(*local.ip())?;
        // SAFETY: plain socket(2); the result is checked before it is wrapped.
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                i32::from(ETHERTYPE.to_be()),
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor just opened and owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let filter = filter_for(local);
        let prog = libc::sock_fprog {
            len: filter.len() as u16,
            filter: filter.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: SO_ATTACH_FILTER takes a sock_fprog, whose `filter` points at `len`
        // instructions in `filter`, alive on this frame for the call (the kernel copies them).
        unsafe { sys::setsockopt(fd.as_fd(), libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &prog)? };
        // TPACKET_V2: one datagram per frame, handed over at once (V3 retires whole blocks, late).
        sys::setsockopt_int(
            fd.as_fd(),
            libc::SOL_PACKET,
            libc::PACKET_VERSION,
            libc::tpacket_versions::TPACKET_V2 as libc::c_int,
        )?;
        // Our own frames are not looped back into our ring (Linux 4.20+; older kernels only
        // cost a copy, which the filter then drops).
        let _ = sys::setsockopt_int(
            fd.as_fd(),
            libc::SOL_PACKET,
            libc::PACKET_IGNORE_OUTGOING,
            1,
        );
        // (Not PACKET_QDISC_BYPASS: it would also bypass tc and nftables' egress hook, which
        // users' firewalls and the fault-injection tests rely on; veth and thunderbolt-net
        // have no queue to skip anyway.)
        // A frame: the kernel's header and address, alignment, then the datagram and its shim.
        let page = 4096;
        let frame_size = (libc::TPACKET2_HDRLEN + 64 + SHIM + max_datagram).next_multiple_of(page);
        let req = libc::tpacket_req {
            tp_block_size: frame_size as u32,
            tp_block_nr: RING_FRAMES as u32,
            tp_frame_size: frame_size as u32,
            tp_frame_nr: RING_FRAMES as u32,
        };
        // SAFETY: PACKET_RX_RING takes a tpacket_req, plain numbers with no pointer inside.
        unsafe { sys::setsockopt(fd.as_fd(), libc::SOL_PACKET, libc::PACKET_RX_RING, &req)? };
        let len = frame_size * RING_FRAMES;
        // SAFETY: maps the ring the kernel just allocated for this socket, shared, at an
        // address of the kernel's choosing; checked before use.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ring = Ring {
            base: base as *mut u8,
            len,
            frame_size,
            frames: RING_FRAMES,
            next: 0,
        };
        let ll = sys::link_addr(ifindex, ETHERTYPE, None);
        // SAFETY: `ll` is a live sockaddr_ll of the size passed; the kernel only reads it.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &ll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(PacketIo {
            socket,
            fd,
            ring,
            ifindex,
            local,
            neighbours: Neighbours::new(KernelTable { ifname }, loopback),
            failures: SendFailures::default(),
            peer: None,
        })
    }

    /// Where frames for `to` go: its MAC address, or nowhere (`None`: dropped) until the
    /// neighbour table has it, which an empty UDP datagram to `to` asks the kernel to find.
    fn mac_for(&mut self, to: SocketAddrV4) -> Option<Mac> {
        match self.neighbours.for_send(*to.ip()) {
            Lookup::Send(mac) => Some(mac),
            Lookup::Resolve => {
                // The kernel resolves the address to send this (its ARP request carries
                // nothing of ours); the peer's UDP socket, bound by its backend, drops it.
                let _ = self.socket.send_to(&[], to);
                None
            }
            Lookup::Drop => None,
        }
    }
}

/// Where the kernel's `sockaddr_ll` (the frame's source) lies in a ring frame: right before
/// the end of the `TPACKET2_HDRLEN` bytes of header.
const SLL_OFFSET: usize = libc::TPACKET2_HDRLEN - std::mem::size_of::<libc::sockaddr_ll>();
/// The bytes of `sockaddr_ll` read: family, protocol, index, type, packet type, address
/// length, then the first 8 bytes of address.
const SLL_LEN: usize = 20;

/// The source MAC address in a frame's `sockaddr_ll`, if the frame was sent to this host
/// alone (`PACKET_HOST`: not broadcast or multicast) by an Ethernet address.
fn unicast_source(sll: &[u8]) -> Option<Mac> {
    let (pkttype, halen) = (*sll.get(10)?, *sll.get(11)?);
    if pkttype != libc::PACKET_HOST || halen != 6 {
        return None;
    }
    sll.get(12..18)?.try_into().ok()
}

/// The shim: destination address and port, source address and port, network byte order.
fn shim(to: SocketAddrV4, from: SocketAddrV4) -> [u8; SHIM] {
    let mut s = [0u8; SHIM];
    s[0..4].copy_from_slice(&to.ip().octets());
    s[4..6].copy_from_slice(&to.port().to_be_bytes());
    s[6..10].copy_from_slice(&from.ip().octets());
    s[10..12].copy_from_slice(&from.port().to_be_bytes());
    s
}

/// Splits a received frame (what follows the Ethernet header) into the datagram and its
/// sender, if it is addressed to `to_us` (a shim whose first half names this rail) and carries
/// a datagram. Whatever the frame holds: `None` or a sub-slice, never a panic.
pub fn parse_frame<'a>(frame: &'a [u8], to_us: &[u8; SHIM]) -> Option<(&'a [u8], SocketAddr)> {
    if frame.len() <= SHIM || frame[..6] != to_us[..6] {
        return None;
    }
    let ip = Ipv4Addr::new(frame[6], frame[7], frame[8], frame[9]);
    let port = u16::from_be_bytes([frame[10], frame[11]]);
    Some((&frame[SHIM..], SocketAddr::new(IpAddr::V4(ip), port)))
}

/// The shim a frame for `local` starts with (its source half is `local` too: only the first
/// half is compared on receipt).
pub fn shim_for(local: SocketAddrV4) -> [u8; SHIM] {
    shim(local, local)
}

impl DatagramIo for PacketIo {
    fn kind(&self) -> EngineKind {
        EngineKind::Packet
    }

    fn send(&mut self, batch: &mut TxBatch) -> io::Result<()> {
        for i in 0..batch.len() {
            let dest = batch.get(i).1;
            let SocketAddr::V4(to) = dest else {
                // An IPv6 peer cannot be reached from an IPv4 rail: lost, as on a wrong route.
                self.failures.count_drop();
                continue;
            };
            let Some(mac) = self.mac_for(to) else {
                self.failures.count_drop();
                continue;
            };
            let head = shim(to, self.local);
            let [buffer, part] = batch.iovecs(i);
            let mut iov = [
                libc::iovec {
                    iov_base: head.as_ptr() as *mut _,
                    iov_len: SHIM,
                },
                buffer,
                part,
            ];
            let mut ll = sys::link_addr(self.ifindex, ETHERTYPE, Some(mac));
            let msg = sys::msghdr(
                &mut ll as *mut _ as *mut libc::c_void,
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
                iov.as_mut_ptr(),
                if part.iov_len > 0 { 3 } else { 2 },
            );
            let mut attempt = Attempt::default();
            loop {
                // SAFETY: `msg` points at `ll`, `iov` and through it at `head`, the batch's
                // buffer and the region part (which the batch keeps alive), all alive and
                // unmoved for the call; the kernel only reads them.
                let rc = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, 0) };
                if rc >= 0 {
                    break;
                }
                let err = io::Error::last_os_error();
                match self
                    .failures
                    .after(err.raw_os_error().unwrap_or(0), &mut attempt)
                {
                    Next::Again => std::hint::spin_loop(),
                    // Buffer full for too long, interface down, or filtered: lost, resent by
                    // the protocol.
                    Next::Drop => break,
                    Next::Fail => {
                        batch.clear();
                        return Err(err);
                    }
                }
            }
        }
        batch.clear();
        Ok(())
    }

    fn recv(
        &mut self,
        _landing: &mut Option<Landing>,
        deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
    ) -> io::Result<usize> {
        // The shim's first half names the destination: this rail's address and port.
        let to_us = shim(self.local, self.local);
        let mut total = 0;
        while total < BATCH {
            let i = self.ring.next;
            let Some(hdr) = self.ring.ready(i) else {
                break;
            };
            let data = self
                .ring
                .bytes(i, usize::from(hdr.tp_net), hdr.tp_snaplen as usize);
            let source = self
                .ring
                .bytes(i, SLL_OFFSET, SLL_LEN)
                .and_then(unicast_source);
            let whole = data.filter(|_| hdr.tp_snaplen == hdr.tp_len);
            if let (Some((datagram, from)), Some(mac)) =
                (whole.and_then(|f| parse_frame(f, &to_us)), source)
            {
                // Only from the host that owns the source the shim names.
                let genuine = match from {
                    SocketAddr::V4(v4) => self.neighbours.accepts(*v4.ip(), mac),
                    SocketAddr::V6(_) => false,
                };
                if genuine {
                    deliver(Received::whole(datagram), from);
                }
            }
            self.ring.release(i);
            // (Not `%`: a division per frame.)
            self.ring.next = if i + 1 == self.ring.frames { 0 } else { i + 1 };
            total += 1;
        }
        Ok(total)
    }

    fn wait(&mut self, timeout: Duration, wake: BorrowedFd<'_>) -> io::Result<()> {
        if self.ring.ready(self.ring.next).is_some() {
            return Ok(());
        }
        wait_readable(self.fd.as_fd(), wake, timeout)
    }

    fn send_drops(&self) -> u64 {
        self.failures.drops()
    }

    fn set_peer(&mut self, peer: Option<SocketAddr>) -> io::Result<()> {
        // Nothing to connect: look the peer's MAC address up now rather than at its first
        // datagram.
        if let Some(SocketAddr::V4(p)) = peer {
            self.mac_for(p);
        }
        self.peer = peer;
        Ok(())
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }
}
