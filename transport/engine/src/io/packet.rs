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
//! that no one else takes the port, and carries what goes over UDP: see below). A classic BPF
//! filter on the socket keeps frames for other addresses or ports (other tbrdma processes on
//! the interface) out of the ring. Frames go only to the peer's MAC address from the kernel's neighbour table, and a
//! frame is taken only from the MAC address the table gives for the source its shim names
//! (`neighbours.rs` decides both): while the table has no entry, frames are dropped (the
//! protocol resends) and one empty UDP datagram to the peer makes the kernel resolve it.
//! Frames are never broadcast.
//!
//! Frames reach only hosts on the rail's own link that run this backend too. Everyone else
//! gets UDP from the rail's socket, which this backend then also receives on (`by_udp`
//! decides): a peer whose connection manager said it hears only UDP (a sockets or
//! io_uring engine, a host without root), a peer off the interface's subnet (relayed by a
//! host in between), and this rail's own address on a link that does not loop frames back.
//!
//! Assisted thread mode (`EngineConfig::assist`) opens two backends over one rail
//! ([`PacketIo::new_pair`]): the engine thread's and the application's. They share the packet
//! socket and its ring (behind a lock: the ring's cursor and the frames it hands back are one
//! reader's at a time), and each has its own duplicate of the UDP socket.
//!
//! **This file contains `unsafe`**: the ring is memory shared with the kernel, read through
//! raw pointers under the ring's ownership protocol (a frame is the process's while its status
//! says so), and the system calls take raw pointers to buffers owned by `self` or the batch.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

use super::neighbours::{KernelTable, Lookup, Mac, Neighbours};
use super::send_error::{Attempt, Next, SendFailures};
use super::sockets::SocketIo;
use super::sys;
use super::{DatagramIo, EngineKind, Landing, Received, TxBatch, wait_either_readable};

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
/// While no peer is known to use UDP, one receive call in this many reads the UDP socket
/// anyway, should the two ends disagree on who is reached how (netmasks that differ): a busy
/// poll of frames pays one system call per this many polls (about 50 µs of them).
const UDP_CHECK_EVERY: u32 = 1024;

/// `AF_PACKET` I/O on the interface of one rail.
#[derive(Debug)]
pub struct PacketIo {
    /// The rail's UDP socket: keeps the port, carries the empty datagrams that make the kernel
    /// resolve a peer's MAC address, and the datagrams of peers frames do not reach.
    socket: UdpSocket,
    /// Receives on `socket` what peers reached over UDP send.
    udp: SocketIo,
    fd: OwnedFd,
    ring: RxRing,
    ifindex: i32,
    local: SocketAddrV4,
    /// The interface's netmask: frames reach only addresses inside it.
    netmask: u32,
    /// The interface loops frames back (`lo`): this rail's own address is reachable by frames.
    loops_back: bool,
    /// Peers that hear only UDP (see [`DatagramIo::set_peer_carriers`]).
    udp_peers: Vec<SocketAddr>,
    /// Some peer is reached over UDP (see [`Self::by_udp`]; or a datagram already went over
    /// UDP): every receive call reads the UDP socket too, not only one in [`UDP_CHECK_EVERY`].
    udp_live: bool,
    /// Receive calls since the UDP socket was last read.
    polls_since_udp: u32,
    neighbours: Neighbours<KernelTable>,
    /// Datagrams dropped, and whether a filter's drop was reported.
    failures: SendFailures,
    /// The last peer named (nothing is connected: see `set_peer`).
    peer: Option<SocketAddr>,
}

/// The receive ring as one backend holds it: its own, or shared with the other backend over
/// the same rail (assisted thread mode, [`PacketIo::new_pair`]), which is one reader at a
/// time. A backend alone pays no lock per poll.
#[derive(Debug)]
enum RxRing {
    Own(Ring),
    Shared(Arc<Mutex<Ring>>),
}

impl RxRing {
    /// Runs `f` on the ring; `None` while the other backend is reading it (a poll that finds
    /// nothing: that backend delivers what is there).
    fn with<R>(&mut self, f: impl FnOnce(&mut Ring) -> R) -> Option<R> {
        match self {
            RxRing::Own(ring) => Some(f(ring)),
            RxRing::Shared(ring) => match ring.try_lock() {
                Ok(mut ring) => Some(f(&mut ring)),
                // (A panic while reading leaves a ring whose cursor is still a frame index.)
                Err(TryLockError::Poisoned(poisoned)) => Some(f(&mut poisoned.into_inner())),
                Err(TryLockError::WouldBlock) => None,
            },
        }
    }
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

/// The interface holding an address: its name, index, the address' netmask, and its own MAC
/// address when it is a loopback interface.
struct Interface {
    name: String,
    index: i32,
    netmask: u32,
    loopback: Option<Mac>,
}

/// The interface holding `ip`.
fn interface_of(ip: Ipv4Addr) -> io::Result<Interface> {
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
            let netmask = a
                .netmask
                .as_ref()
                .and_then(|m| m.as_sockaddr_in())
                .map_or(u32::MAX, |m| u32::from(m.ip()));
            return Ok(Interface {
                name,
                index: index as i32,
                netmask,
                loopback,
            });
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
        Self::open(socket, max_datagram, false)
    }

    /// Two backends over the rail of `socket` (see the module docs): one packet socket and
    /// ring, read by one of them at a time, and a duplicate of the UDP socket each.
    pub fn new_pair(socket: UdpSocket, max_datagram: usize) -> io::Result<(PacketIo, PacketIo)> {
        let first = Self::open(socket, max_datagram, true)?;
        let second = first.twin(max_datagram)?;
        Ok((first, second))
    }

    /// A second backend over this one's sockets and shared ring.
    fn twin(&self, max_datagram: usize) -> io::Result<PacketIo> {
        let RxRing::Shared(ring) = &self.ring else {
            return Err(io::Error::other(
                "a packet backend's own ring cannot be shared",
            ));
        };
        let socket = self.socket.try_clone()?;
        Ok(PacketIo {
            udp: SocketIo::new(socket.try_clone()?, max_datagram)?,
            socket,
            fd: self.fd.try_clone()?,
            ring: RxRing::Shared(Arc::clone(ring)),
            ifindex: self.ifindex,
            local: self.local,
            netmask: self.netmask,
            loops_back: self.loops_back,
            udp_peers: Vec::new(),
            udp_live: false,
            polls_since_udp: 0,
            neighbours: self.neighbours.empty_like(),
            failures: SendFailures::default(),
            peer: None,
        })
    }

    fn open(socket: UdpSocket, max_datagram: usize, shared: bool) -> io::Result<PacketIo> {
        let local = match socket.local_addr()? {
            SocketAddr::V4(a) if !a.ip().is_unspecified() => a,
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("the packet engine needs a rail bound to an IPv4 address, not {other}"),
                ));
            }
        };
        let Interface {
            name: ifname,
            index: ifindex,
            netmask,
            loopback,
        } = interface_of(*local.ip())?;
        let udp = SocketIo::new(socket.try_clone()?, max_datagram)?;
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
            udp,
            fd,
            ring: if shared {
                RxRing::Shared(Arc::new(Mutex::new(ring)))
            } else {
                RxRing::Own(ring)
            },
            ifindex,
            local,
            netmask,
            loops_back: loopback.is_some(),
            udp_peers: Vec::new(),
            udp_live: false,
            polls_since_udp: 0,
            neighbours: Neighbours::new(KernelTable { ifname }, loopback),
            failures: SendFailures::default(),
            peer: None,
        })
    }

    /// Whether a datagram for `to` goes over UDP rather than as a frame: `to` told us it hears
    /// only UDP, lies off this interface's subnet (a frame is not routed), or is this rail's
    /// own address on a link that does not loop frames back (the frame would leave the host).
    fn by_udp(&self, to: SocketAddrV4) -> bool {
        frames_miss(*self.local.ip(), self.netmask, self.loops_back, *to.ip())
            || (!self.udp_peers.is_empty() && self.udp_peers.contains(&SocketAddr::V4(to)))
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

/// Whether frames from `local` (netmask `netmask`, on an interface that loops frames back or
/// not) cannot reach `to`, which must then get UDP.
fn frames_miss(local: Ipv4Addr, netmask: u32, loops_back: bool, to: Ipv4Addr) -> bool {
    let (local, to) = (u32::from(local), u32::from(to));
    (local ^ to) & netmask != 0 || (to == local && !loops_back)
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
            let udp = self.by_udp(to);
            let mac = if udp { None } else { self.mac_for(to) };
            if !udp && mac.is_none() {
                self.failures.count_drop();
                continue;
            }
            self.udp_live |= udp;
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
            let iov_len = if part.iov_len > 0 { 3 } else { 2 };
            // (Each filled only for its carrier: the link address for a frame, the socket
            // address for a UDP datagram.)
            let (mut ll, mut name) = (None, None);
            // Over UDP the datagram goes without the shim, to the peer's address; as a frame,
            // behind it, to the peer's MAC address.
            let (fd, msg) = if udp {
                let (name, name_len) = name.insert(sys::to_storage(&dest));
                let msg = sys::msghdr(
                    name as *mut _ as *mut libc::c_void,
                    *name_len,
                    iov[1..].as_mut_ptr(),
                    iov_len - 1,
                );
                (self.socket.as_raw_fd(), msg)
            } else {
                let ll = ll.insert(sys::link_addr(self.ifindex, ETHERTYPE, mac));
                let msg = sys::msghdr(
                    ll as *mut _ as *mut libc::c_void,
                    std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
                    iov.as_mut_ptr(),
                    iov_len,
                );
                (self.fd.as_raw_fd(), msg)
            };
            let mut attempt = Attempt::default();
            loop {
                // SAFETY: `msg` points at `ll` or `name`, at `iov` and through it at `head`,
                // the batch's buffer and the region part (which the batch keeps alive), all
                // alive and unmoved for the call; the kernel only reads them.
                let rc = unsafe { libc::sendmsg(fd, &msg, 0) };
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
        landing: &mut Option<Landing>,
        deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
    ) -> io::Result<usize> {
        let frames = self.recv_frames(deliver);
        self.polls_since_udp += 1;
        if !self.udp_live && self.polls_since_udp < UDP_CHECK_EVERY {
            return Ok(frames);
        }
        self.polls_since_udp = 0;
        // A landing zone takes only the call's first datagram: once frames were delivered (one
        // of them may have been placed in the zone), what UDP brings goes through the usual
        // buffers.
        let landing = if frames == 0 { landing } else { &mut None };
        Ok(frames + self.udp.recv(landing, deliver)?)
    }

    fn wait(&mut self, timeout: Duration, wake: BorrowedFd<'_>) -> io::Result<()> {
        // (`None`: the other backend is reading the ring, so there is something to do.)
        if self.ring.with(|ring| ring.ready(ring.next).is_none()) != Some(true) {
            return Ok(());
        }
        // A datagram on the UDP socket wakes this too, and the next receive call reads it
        // whether or not some peer is known to use UDP (else the wait would return at once
        // again and again).
        self.polls_since_udp = UDP_CHECK_EVERY;
        wait_either_readable(self.fd.as_fd(), self.socket.as_fd(), wake, timeout)
    }

    fn send_drops(&self) -> u64 {
        self.failures.drops() + self.udp.send_drops()
    }

    fn set_peer(&mut self, peer: Option<SocketAddr>) -> io::Result<()> {
        // Nothing to connect (the UDP socket is shared by every peer reached over UDP): look
        // the peer's MAC address up now rather than at its first datagram.
        if let Some(SocketAddr::V4(p)) = peer
            && !self.by_udp(p)
        {
            self.mac_for(p);
        }
        self.peer = peer;
        Ok(())
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }

    fn set_peer_carriers(&mut self, peers: &[(SocketAddr, bool)]) {
        self.udp_peers.clear();
        self.udp_peers
            .extend(peers.iter().filter(|(_, frames)| !frames).map(|(p, _)| *p));
        self.udp_live |= peers.iter().any(|&(p, _)| match p {
            SocketAddr::V4(p) => self.by_udp(p),
            SocketAddr::V6(_) => false,
        });
    }
}

impl PacketIo {
    /// Hands the frames waiting in the ring to `deliver` (at most [`BATCH`]).
    fn recv_frames(&mut self, deliver: &mut dyn FnMut(Received<'_>, SocketAddr)) -> usize {
        // The shim's first half names the destination: this rail's address and port.
        let to_us = shim(self.local, self.local);
        let neighbours = &mut self.neighbours;
        self.ring
            .with(|ring| {
                let mut total = 0;
                while total < BATCH {
                    let i = ring.next;
                    let Some(hdr) = ring.ready(i) else {
                        break;
                    };
                    let data = ring.bytes(i, usize::from(hdr.tp_net), hdr.tp_snaplen as usize);
                    let source = ring.bytes(i, SLL_OFFSET, SLL_LEN).and_then(unicast_source);
                    let whole = data.filter(|_| hdr.tp_snaplen == hdr.tp_len);
                    if let (Some((datagram, from)), Some(mac)) =
                        (whole.and_then(|f| parse_frame(f, &to_us)), source)
                    {
                        // Only from the host that owns the source the shim names.
                        let genuine = match from {
                            SocketAddr::V4(v4) => neighbours.accepts(*v4.ip(), mac),
                            SocketAddr::V6(_) => false,
                        };
                        if genuine {
                            deliver(Received::whole(datagram), from);
                        }
                    }
                    ring.release(i);
                    // (Not `%`: a division per frame.)
                    ring.next = if i + 1 == ring.frames { 0 } else { i + 1 };
                    total += 1;
                }
                total
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_miss_peers_off_the_subnet_and_this_address_on_a_cable() {
        let mask = u32::from(Ipv4Addr::new(255, 255, 255, 252));
        let me = Ipv4Addr::new(10, 77, 0, 1);
        // The other end of a /30 cable: frames.
        assert!(!frames_miss(me, mask, false, Ipv4Addr::new(10, 77, 0, 2)));
        // A host behind it (relayed) and this host's own address: UDP.
        assert!(frames_miss(me, mask, false, Ipv4Addr::new(10, 77, 0, 6)));
        assert!(frames_miss(me, mask, false, me));
        // On `lo` frames loop back: this address too.
        let lo = Ipv4Addr::LOCALHOST;
        assert!(!frames_miss(
            lo,
            u32::from(Ipv4Addr::new(255, 0, 0, 0)),
            true,
            lo
        ));
    }
}
