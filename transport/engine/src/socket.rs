//! Socket options for the UDP socket bound to a link: buffer sizes (forced past the sysctl caps
//! when the process may) and busy-polling (`SO_BUSY_POLL`, `SO_PREFER_BUSY_POLL`).
//!
//! Every function reports what the kernel did; none decides policy. A refused option is an
//! `Err` for the caller to log, never a panic: busy-polling above `net.core.busy_read` needs
//! CAP_NET_ADMIN, and forcing buffer sizes needs CAP_NET_ADMIN too.
//!
//! The system calls themselves are in `io/sys.rs`, shared with the datagram backends.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsFd;

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::io::sys;

/// `SO_PREFER_BUSY_POLL` (Linux 5.11); the libc crate does not export it for every target.
#[cfg(not(target_arch = "sparc64"))]
const SO_PREFER_BUSY_POLL: libc::c_int = 69;
#[cfg(target_arch = "sparc64")]
const SO_PREFER_BUSY_POLL: libc::c_int = 0x48;

fn clamp_int(value: usize) -> libc::c_int {
    libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX)
}

/// Sets `SO_BUSY_POLL` (Linux 3.11): a blocking receive on this socket busy-polls the device
/// queue for up to `usecs` µs before sleeping. Values above `net.core.busy_read` need
/// CAP_NET_ADMIN (EPERM otherwise); kernels built without `CONFIG_NET_RX_BUSY_POLL` answer
/// ENOPROTOOPT.
pub fn set_busy_poll(socket: &impl AsFd, usecs: u32) -> io::Result<()> {
    sys::setsockopt_int(
        socket.as_fd(),
        libc::SOL_SOCKET,
        libc::SO_BUSY_POLL,
        clamp_int(usecs as usize),
    )
}

/// The socket's `SO_BUSY_POLL` value in µs.
pub fn busy_poll(socket: &impl AsFd) -> io::Result<u32> {
    sys::getsockopt_int(socket.as_fd(), libc::SOL_SOCKET, libc::SO_BUSY_POLL)
        .map(|v| v.max(0) as u32)
}

/// Sets `SO_PREFER_BUSY_POLL` (Linux 5.11): with `napi_defer_hard_irqs` and
/// `gro_flush_timeout` set on the device, busy-polling sockets keep interrupts masked while
/// they poll. Enabling it needs CAP_NET_ADMIN (EPERM otherwise).
pub fn set_prefer_busy_poll(socket: &impl AsFd, prefer: bool) -> io::Result<()> {
    sys::setsockopt_int(
        socket.as_fd(),
        libc::SOL_SOCKET,
        SO_PREFER_BUSY_POLL,
        libc::c_int::from(prefer),
    )
}

/// The socket's `SO_PREFER_BUSY_POLL` value.
pub fn prefer_busy_poll(socket: &impl AsFd) -> io::Result<bool> {
    sys::getsockopt_int(socket.as_fd(), libc::SOL_SOCKET, SO_PREFER_BUSY_POLL).map(|v| v != 0)
}

/// The receive and send buffer sizes the kernel granted, in bytes (Linux reports twice the
/// requested value: half is bookkeeping overhead).
pub fn buffer_sizes(socket: &impl AsFd) -> io::Result<(usize, usize)> {
    let rcv = sys::getsockopt_int(socket.as_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF)?;
    let snd = sys::getsockopt_int(socket.as_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF)?;
    Ok((rcv.max(0) as usize, snd.max(0) as usize))
}

/// Sets one buffer size: the `*FORCE` option first (ignores `net.core.{r,w}mem_max`, needs
/// CAP_NET_ADMIN), then the ordinary one (silently capped by the sysctl).
fn set_buffer(
    socket: &Socket,
    force: libc::c_int,
    normal: libc::c_int,
    bytes: usize,
) -> io::Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    match sys::setsockopt_int(socket.as_fd(), libc::SOL_SOCKET, force, clamp_int(bytes)) {
        Ok(()) => Ok(()),
        Err(_) => sys::setsockopt_int(socket.as_fd(), libc::SOL_SOCKET, normal, clamp_int(bytes)),
    }
}

/// A UDP socket bound to `addr` with receive and send buffers of at least `rcvbuf` / `sndbuf`
/// bytes where the kernel allows (0 keeps the default). Forcing past the sysctl caps is tried
/// first; the sizes actually obtained are logged and can be read with [`buffer_sizes`]. A size
/// the kernel caps is not an error.
/// Connects the UDP socket to `peer` (the kernel then routes and demultiplexes its datagrams
/// from cached state, and drops datagrams from anyone else), or with `None` dissolves the
/// association so that it accepts datagrams from any address again.
pub fn set_udp_peer(socket: &UdpSocket, peer: Option<SocketAddr>) -> io::Result<()> {
    if let Some(peer) = peer {
        return socket.connect(peer);
    }
    sys::disconnect(socket.as_fd())
}

/// Binds a UDP socket to `addr` with the given buffer sizes. Port 0 picks a free port, and the
/// socket is then bound to that port by number: Linux forgets an automatically chosen port
/// when a connected UDP socket is disconnected (see [`set_udp_peer`]), a number given to
/// `bind` it keeps.
pub fn bind_udp(addr: SocketAddr, rcvbuf: usize, sndbuf: usize) -> io::Result<UdpSocket> {
    let new_socket = || -> io::Result<Socket> {
        let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        set_buffer(&socket, libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, rcvbuf)?;
        set_buffer(&socket, libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, sndbuf)?;
        Ok(socket)
    };
    let mut bound = addr;
    let mut attempt = 0;
    let socket = loop {
        if addr.port() == 0 {
            // Let the kernel pick a free port, then bind to it by number.
            bound.set_port(UdpSocket::bind(addr)?.local_addr()?.port());
        }
        let socket = new_socket()?;
        match socket.bind(&SockAddr::from(bound)) {
            Ok(()) => break socket,
            // Another process took the port in between: pick another.
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && addr.port() == 0 && attempt < 8 => {
                attempt += 1
            }
            Err(e) => return Err(e),
        }
    };
    let socket: UdpSocket = socket.into();
    match buffer_sizes(&socket) {
        Ok((rcv, snd)) => {
            tracing::debug!(%addr, requested_rcvbuf = rcvbuf, requested_sndbuf = sndbuf, rcvbuf = rcv, sndbuf = snd, "bound UDP socket");
            if rcv < rcvbuf || snd < sndbuf {
                tracing::info!(
                    %addr,
                    "socket buffers smaller than requested (rcvbuf {rcv} < {rcvbuf} or sndbuf {snd} < {sndbuf}); \
                     raise net.core.rmem_max / wmem_max or run with CAP_NET_ADMIN"
                );
            }
        }
        Err(e) => tracing::debug!(%addr, "cannot read socket buffer sizes: {e}"),
    }
    Ok(socket)
}
