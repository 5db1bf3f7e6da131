//! ICMP echo over one named interface: the reachability check `doctor` runs per cable and the
//! lab tests use between neighbours. A raw socket (root) bound to the interface, so the probe
//! goes over that cable and no other route.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicU16, Ordering};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::error::{NetdevError, Result};

/// Distinguishes concurrent probes from this process: a raw socket sees every echo reply.
static NEXT_SEQUENCE: AtomicU16 = AtomicU16::new(1);

/// Sends one echo request to `peer` out of `interface` and waits up to `timeout` for the
/// reply. Returns the round-trip time, or `None` when no reply came.
pub fn ping(interface: &str, peer: Ipv4Addr, timeout: Duration) -> Result<Option<Duration>> {
    let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4)).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            NetdevError::NeedsRoot {
                step: format!("ping {peer} over {interface} (raw ICMP socket)"),
            }
        } else {
            NetdevError::io("opening", "raw ICMP socket", e)
        }
    })?;
    socket
        .bind_device(Some(interface.as_bytes()))
        .map_err(|e| NetdevError::io("binding ICMP socket to", interface, e))?;
    let identifier = (std::process::id() as u16) ^ 0x7462;
    let sequence = NEXT_SEQUENCE.fetch_add(1, Ordering::Relaxed);
    let request = echo_request(identifier, sequence);
    let start = Instant::now();
    socket
        .send_to(&request, &SockAddr::from(SocketAddrV4::new(peer, 0)))
        .map_err(|e| NetdevError::io("sending ICMP echo over", interface, e))?;
    let mut socket = socket;
    let mut buf = [0u8; 1500];
    while let Some(left) = timeout.checked_sub(start.elapsed()) {
        if left.is_zero() {
            break;
        }
        socket
            .set_read_timeout(Some(left))
            .map_err(|e| NetdevError::io("configuring", "ICMP socket", e))?;
        let len = match socket.read(&mut buf) {
            Ok(len) => len,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break;
            }
            Err(e) => return Err(NetdevError::io("receiving over", interface, e)),
        };
        if is_reply(&buf[..len], peer, identifier, sequence) {
            return Ok(Some(start.elapsed()));
        }
    }
    Ok(None)
}

fn echo_request(identifier: u16, sequence: u16) -> Vec<u8> {
    let mut packet = vec![8, 0, 0, 0];
    packet.extend_from_slice(&identifier.to_be_bytes());
    packet.extend_from_slice(&sequence.to_be_bytes());
    packet.extend_from_slice(b"tbrdma-doctor");
    let checksum = internet_checksum(&packet);
    packet[2..4].copy_from_slice(&checksum.to_be_bytes());
    packet
}

/// A raw IPv4 socket hands us the IP header too.
fn is_reply(datagram: &[u8], peer: Ipv4Addr, identifier: u16, sequence: u16) -> bool {
    let Some(&first) = datagram.first() else {
        return false;
    };
    let header_len = usize::from(first & 0x0f) * 4;
    if datagram.len() < header_len + 8 || header_len < 20 {
        return false;
    }
    let source = Ipv4Addr::new(datagram[12], datagram[13], datagram[14], datagram[15]);
    let icmp = &datagram[header_len..];
    source == peer
        && icmp[0] == 0
        && icmp[4..6] == identifier.to_be_bytes()
        && icmp[6..8] == sequence.to_be_bytes()
}

fn internet_checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|pair| u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_of_request_verifies() {
        let packet = echo_request(0x1234, 7);
        assert_eq!(internet_checksum(&packet), 0);
    }
}
