//! The system-call plumbing the datagram backends share: socket addresses in the kernel's
//! layout (`sockaddr_storage`, `sockaddr_ll`) and back, socket options, and message headers
//! (`msghdr`) for `sendmsg`, `sendmmsg`, `recvmmsg` and io_uring's message opcodes. Each is
//! written once here; the backends decide what to send and where.
//!
//! **This file contains `unsafe`**: reading the bytes of a socket address, and `setsockopt` /
//! `getsockopt` / `connect` on a borrowed descriptor.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, BorrowedFd};

/// Size of a `sockaddr_storage`: room for any address the kernel writes back.
pub(crate) const STORAGE_LEN: libc::socklen_t =
    std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;

/// An all-zero `sockaddr_storage` (family `AF_UNSPEC`).
pub(crate) fn empty_storage() -> libc::sockaddr_storage {
    // SAFETY: an all-zero sockaddr_storage is a valid value of that plain C struct.
    unsafe { std::mem::zeroed() }
}

/// `addr` in the kernel's layout, and how many of its bytes count.
pub(crate) fn to_storage(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    let sa = socket2::SockAddr::from(*addr);
    let mut storage = empty_storage();
    let len = (sa.len() as usize).min(std::mem::size_of::<libc::sockaddr_storage>());
    // SAFETY: `sa` holds `len` initialised bytes at `as_ptr`; `storage` is a distinct local
    // with room for them.
    unsafe {
        std::ptr::copy_nonoverlapping(
            sa.as_ptr() as *const u8,
            &mut storage as *mut _ as *mut u8,
            len,
        );
    }
    (storage, len as libc::socklen_t)
}

/// The IPv4 or IPv6 address in `storage` (`None` for any other family).
pub(crate) fn from_storage(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large and
            // aligned enough for; the borrow keeps it alive, and its bytes are initialised
            // (the crate's storages start as `empty_storage`, zeroed whole).
            let sin = unsafe { &*(storage as *const _ as *const libc::sockaddr_in) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for AF_INET6 and sockaddr_in6.
            let sin6 = unsafe { &*(storage as *const _ as *const libc::sockaddr_in6) };
            // The flow label as `socket2` and `std` store it (the field's raw value), so that
            // [`to_storage`] and this round-trip.
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// Decodes the `sockaddr_in` / `sockaddr_in6` bytes the kernel wrote into a buffer (an
/// io_uring receive buffer, say); `None` when they are too short for their family or of
/// another family.
pub(crate) fn parse(name: &[u8]) -> Option<SocketAddr> {
    let family = i32::from(u16::from_ne_bytes(name.get(0..2)?.try_into().ok()?));
    let needed = match family {
        libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>() - 8, // (sin_zero may be cut)
        libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
        _ => return None,
    };
    if name.len() < needed {
        return None;
    }
    let mut storage = empty_storage();
    let len = name.len().min(STORAGE_LEN as usize);
    // SAFETY: `len` bytes fit in `storage`, a distinct local; `name` has at least `len`.
    unsafe {
        std::ptr::copy_nonoverlapping(name.as_ptr(), &mut storage as *mut _ as *mut u8, len);
    }
    from_storage(&storage)
}

/// The link-layer address of frames of Ethernet type `ethertype` on interface `ifindex`, to
/// `mac` (for `sendmsg`) or to none (for `bind`).
pub(crate) fn link_addr(ifindex: i32, ethertype: u16, mac: Option<[u8; 6]>) -> libc::sockaddr_ll {
    // SAFETY: an all-zero sockaddr_ll is a valid value of that plain C struct.
    let mut ll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    ll.sll_family = libc::AF_PACKET as u16;
    ll.sll_protocol = ethertype.to_be();
    ll.sll_ifindex = ifindex;
    if let Some(mac) = mac {
        ll.sll_halen = 6;
        ll.sll_addr[..6].copy_from_slice(&mac);
    }
    ll
}

/// A message header naming `name_len` bytes of address at `name` (none when `name` is null)
/// and `iov_len` iovecs at `iov`, with no control data. Building it reads nothing; whoever
/// hands it to the kernel keeps what it points at alive and unmoved until the kernel is done.
pub(crate) fn msghdr(
    name: *mut libc::c_void,
    name_len: libc::socklen_t,
    iov: *mut libc::iovec,
    iov_len: usize,
) -> libc::msghdr {
    // SAFETY: an all-zero msghdr (null pointers, zero lengths) is a valid value.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    if !name.is_null() {
        hdr.msg_name = name;
        hdr.msg_namelen = name_len;
    }
    hdr.msg_iov = iov;
    hdr.msg_iovlen = iov_len as _;
    hdr
}

/// An empty message header (no address, no iovec), to be filled in place.
pub(crate) fn empty_msghdr() -> libc::msghdr {
    msghdr(std::ptr::null_mut(), 0, std::ptr::null_mut(), 0)
}

/// Receives one datagram (recvfrom(2)) into the `cap` bytes at `buf`, its sender's address
/// into `name`; returns the datagram's length (with `MSG_TRUNC` in `flags`, its whole length
/// even when `cap` held less).
///
/// # Safety
/// `buf..buf + cap` must be valid for writes during the call, and nothing else may read or
/// write it meanwhile.
pub(crate) unsafe fn recv_from(
    fd: BorrowedFd<'_>,
    buf: *mut u8,
    cap: usize,
    flags: libc::c_int,
    name: &mut libc::sockaddr_storage,
) -> io::Result<usize> {
    let mut name_len = STORAGE_LEN;
    // SAFETY: `buf` is the caller's contract; `fd` is live for the call and `name` is a live
    // sockaddr_storage of the size passed.
    let len = unsafe {
        libc::recvfrom(
            fd.as_raw_fd(),
            buf as *mut libc::c_void,
            cap,
            flags,
            name as *mut _ as *mut libc::sockaddr,
            &mut name_len,
        )
    };
    if len < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(len as usize)
    }
}

/// Receives one datagram (recvmsg(2)) into the buffers `iov` names, in order, its sender's
/// address into `name`; returns the datagram's length (with `MSG_TRUNC` in `flags`, its whole
/// length even when the buffers held less).
///
/// # Safety
/// Every iovec must name memory valid for writes during the call that nothing else reads or
/// writes meanwhile.
pub(crate) unsafe fn recv_msg(
    fd: BorrowedFd<'_>,
    iov: &mut [libc::iovec],
    flags: libc::c_int,
    name: &mut libc::sockaddr_storage,
) -> io::Result<usize> {
    let mut hdr = msghdr(
        name as *mut _ as *mut libc::c_void,
        STORAGE_LEN,
        iov.as_mut_ptr(),
        iov.len(),
    );
    // SAFETY: `hdr` points at `name` (a live sockaddr_storage of the size given) and at `iov`,
    // both borrowed for the call; the memory the iovecs name is the caller's contract.
    let len = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut hdr, flags) };
    if len < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(len as usize)
    }
}

/// The result of a system call that returns 0 or -1 with errno.
fn status(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets a socket option whose value is a C `int`.
pub(crate) fn setsockopt_int(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: the option's value is an `int`, as this function's contract says; the kernel
    // reads exactly that many bytes of `value`.
    unsafe { setsockopt(fd, level, name, &value) }
}

/// Sets a socket option to `value`.
///
/// # Safety
/// `T` must be the type the kernel expects for option `name` at `level`, and every pointer
/// inside `value` (a filter program's instructions, say) must be valid for the reads the
/// kernel makes through it during the call.
pub(crate) unsafe fn setsockopt<T>(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    value: &T,
) -> io::Result<()> {
    // SAFETY: `fd` is a live descriptor borrowed for the call; `value` is a live `T` whose
    // exact size is passed, which the kernel only reads (pointers inside it: the caller's
    // contract).
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            value as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    status(rc)
}

/// Reads a socket option whose value is a C `int`.
pub(crate) fn getsockopt_int(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is live for the call; `value` and `len` are locals the kernel writes at most
    // `len` bytes into.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            &mut value as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    status(rc).map(|()| value)
}

/// Dissolves a datagram socket's association (connect(2) to `AF_UNSPEC`), so that it sends
/// to and accepts datagrams from any address again.
pub(crate) fn disconnect(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: an all-zero sockaddr is a valid value of that plain C struct.
    let mut unspec: libc::sockaddr = unsafe { std::mem::zeroed() };
    unspec.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: `fd` is a live descriptor borrowed for the call; `unspec` is a sockaddr on this
    // frame whose exact size is passed, which the kernel only reads.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &unspec,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    status(rc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_kernel_writes_decode() {
        let flowed = SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::LOCALHOST, 7, 0x12345, 0));
        for addr in ["127.0.0.1:4791", "[::1]:4791", "[fe80::1%3]:9"] {
            let addr: SocketAddr = addr.parse().unwrap();
            for addr in [addr, flowed] {
                let (storage, len) = to_storage(&addr);
                assert_eq!(from_storage(&storage), Some(addr));
                let bytes = &storage_bytes(&storage)[..len as usize];
                assert_eq!(parse(bytes), Some(addr));
            }
        }
        assert_eq!(from_storage(&empty_storage()), None);
        assert_eq!(parse(&[]), None);
        assert_eq!(parse(&[2, 0, 1]), None);
        assert_eq!(parse(&[0xff; 28]), None);
    }

    fn storage_bytes(storage: &libc::sockaddr_storage) -> Vec<u8> {
        let mut copy = vec![0u8; STORAGE_LEN as usize];
        // SAFETY: `storage` came from `to_storage`, zeroed whole and then written: every byte
        // of it is initialised.
        unsafe {
            std::ptr::copy_nonoverlapping(
                storage as *const _ as *const u8,
                copy.as_mut_ptr(),
                copy.len(),
            )
        };
        copy
    }
}
