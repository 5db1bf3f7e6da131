//! How verbs addressing maps onto tbrdma: which links are devices, what their GID is, how a
//! queue pair number names the peer's UDP port, and the session token both sides derive.
//!
//! - **Devices**: `TBRDMA_IBV_DEVICES` (comma-separated interface names or local IPv4
//!   addresses) or, without it, every interface driven by `thunderbolt-net`. Device `k` is
//!   named `tbrdma_<ifname>`.
//! - **GID 0** is the RoCE v2 IPv4-mapped address of the link, `::ffff:a.b.c.d`.
//! - **Port slots**: each process binds its data socket on a link to `base + slot` (`base` from
//!   `TBRDMA_IBV_PORT_BASE`, default [`DEFAULT_PORT_BASE`]; the first free slot of 255) and
//!   numbers its queue pairs `(slot + 1) << 16 | frames | index` (24 bits, never 0 or 1;
//!   `frames` is [`QPN_HEARS_FRAMES`] when the process runs the packet engine, and the index
//!   takes the 15 bits below it), so the peer finds the port, and whether to send it frames
//!   or UDP, from the QPN the application exchanged.
//! - **Token**: SHA-256 over both endpoints (address, port, QPN, sorted), keyed with
//!   `TBRDMA_IBV_PSK` when set (HMAC-SHA256); the first 8 bytes.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Default first UDP port of the per-process slots (not 4791, so tools that decode RoCE v2 do
/// not mistake tbrdma's datagrams for it).
pub const DEFAULT_PORT_BASE: u16 = 18700;
/// Port slots per link and host.
pub const PORT_SLOTS: u16 = 255;

/// A link presented as a verbs device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// Interface name.
    pub ifname: String,
    /// The device name applications see.
    pub name: String,
    /// Interface index (0 when unknown).
    pub ifindex: u32,
    /// MAC address (zeros when unknown).
    pub mac: [u8; 6],
}

impl Link {
    fn new(ifname: &str) -> Link {
        let name: String = format!("tbrdma_{ifname}").chars().take(63).collect();
        Link {
            ifname: ifname.to_string(),
            name,
            ifindex: nix::net::if_::if_nametoindex(ifname).unwrap_or(0),
            mac: read_mac(ifname),
        }
    }

    /// The link's IPv4 address now, if it has one.
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        interface_ipv4(&self.ifname)
    }

    /// Whether the interface is up, running and has an IPv4 address (the port is ACTIVE).
    pub fn is_active(&self) -> bool {
        let flags = std::fs::read_to_string(format!("/sys/class/net/{}/operstate", self.ifname))
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        // veth and thunderbolt-net report "up"; some virtual links "unknown" while working.
        (flags == "up" || flags == "unknown") && self.ipv4().is_some()
    }

    /// Node GUID: the EUI-64 of the MAC address.
    pub fn guid(&self) -> u64 {
        let m = self.mac;
        u64::from_be_bytes([m[0] ^ 2, m[1], m[2], 0xff, 0xfe, m[3], m[4], m[5]])
    }
}

/// GID 0 of a link with address `ip`.
pub fn gid_of(ip: Ipv4Addr) -> [u8; 16] {
    ip.to_ipv6_mapped().octets()
}

/// The IPv4 address inside an IPv4-mapped GID.
pub fn ipv4_of_gid(gid: &[u8; 16]) -> Option<Ipv4Addr> {
    std::net::Ipv6Addr::from(*gid).to_ipv4_mapped()
}

fn read_mac(ifname: &str) -> [u8; 6] {
    let text =
        std::fs::read_to_string(format!("/sys/class/net/{ifname}/address")).unwrap_or_default();
    let mut mac = [0u8; 6];
    for (slot, part) in mac.iter_mut().zip(text.trim().split(':')) {
        *slot = u8::from_str_radix(part, 16).unwrap_or(0);
    }
    mac
}

fn interface_ipv4(ifname: &str) -> Option<Ipv4Addr> {
    nix::ifaddrs::getifaddrs().ok()?.find_map(|ifa| {
        if ifa.interface_name != ifname {
            return None;
        }
        ifa.address
            .as_ref()
            .and_then(|a| a.as_sockaddr_in())
            .map(|sin| sin.ip())
    })
}

fn interface_with_ipv4(ip: Ipv4Addr) -> Option<String> {
    nix::ifaddrs::getifaddrs().ok()?.find_map(|ifa| {
        let a = ifa.address.as_ref()?.as_sockaddr_in()?.ip();
        (a == ip).then(|| ifa.interface_name.clone())
    })
}

/// The links this process presents, from `TBRDMA_IBV_DEVICES` or the thunderbolt-net
/// interfaces. Names that match nothing are skipped (a warning on stderr).
pub fn discover() -> Vec<Link> {
    let mut links: Vec<Link> = Vec::new();
    match std::env::var("TBRDMA_IBV_DEVICES") {
        Ok(list) => {
            for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let ifname = match item.parse::<Ipv4Addr>() {
                    Ok(ip) => interface_with_ipv4(ip),
                    Err(_) => std::path::Path::new("/sys/class/net")
                        .join(item)
                        .exists()
                        .then(|| item.to_string()),
                };
                match ifname {
                    Some(n) if !links.iter().any(|l| l.ifname == n) => links.push(Link::new(&n)),
                    Some(_) => {}
                    None => eprintln!(
                        "tbrdma libibverbs: TBRDMA_IBV_DEVICES names {item:?}, which is neither an interface nor a local IPv4 address here; skipped"
                    ),
                }
            }
        }
        Err(_) => {
            let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let driver = std::fs::read_link(e.path().join("device/driver")).ok()?;
                    (driver.file_name()? == "thunderbolt-net").then_some(name)
                })
                .collect();
            names.sort();
            links.extend(names.iter().map(|n| Link::new(n)));
        }
    }
    links
}

/// First UDP port of the slots.
pub fn port_base() -> u16 {
    std::env::var("TBRDMA_IBV_PORT_BASE")
        .ok()
        .and_then(|v| v.parse::<u16>().ok())
        .filter(|b| b.checked_add(PORT_SLOTS).is_some())
        .unwrap_or(DEFAULT_PORT_BASE)
}

/// The bit of a queue pair number that says its process receives Ethernet frames (the packet
/// engine): a peer sends it frames only then, else UDP (see [`qpn_of`]).
pub const QPN_HEARS_FRAMES: u32 = 0x8000;
/// Largest queue pair index of a process (the bits below [`QPN_HEARS_FRAMES`]).
pub const MAX_QP_INDEX: u16 = 0x7fff;

/// Queue pair number `index` (1..=[`MAX_QP_INDEX`]) of the process in `slot`, with
/// [`QPN_HEARS_FRAMES`] when the process receives frames. A verbs application exchanges it
/// with its peer, so it carries what the connection manager's carrier byte would.
pub fn qpn_of(slot: u16, index: u16, hears_frames: bool) -> u32 {
    let frames = if hears_frames { QPN_HEARS_FRAMES } else { 0 };
    (u32::from(slot) + 1) << 16 | frames | u32::from(index & MAX_QP_INDEX)
}

/// Whether the process that owns queue pair `qpn` receives Ethernet frames.
pub fn hears_frames(qpn: u32) -> bool {
    qpn & QPN_HEARS_FRAMES != 0
}

/// The UDP port of the process that owns queue pair `qpn`, if `qpn` is one of ours.
pub fn port_of_qpn(base: u16, qpn: u32) -> Option<u16> {
    let slot = qpn >> 16;
    if qpn > 0x00ff_ffff
        || slot == 0
        || slot > u32::from(PORT_SLOTS)
        || qpn & u32::from(MAX_QP_INDEX) == 0
    {
        return None;
    }
    base.checked_add(slot as u16 - 1)
}

/// The session token of the connection between `a` and `b` (each: data socket and QPN), the
/// same on both sides. With a pre-shared key, only holders of the key can compute it.
pub fn token(a: (SocketAddrV4, u32), b: (SocketAddrV4, u32), psk: Option<&[u8]>) -> u64 {
    let (lo, hi) = if (a.0.ip().octets(), a.0.port(), a.1) <= (b.0.ip().octets(), b.0.port(), b.1) {
        (a, b)
    } else {
        (b, a)
    };
    let mut msg = Vec::with_capacity(32);
    msg.extend_from_slice(b"tbrdma-ibv-token-v1");
    for (addr, qpn) in [lo, hi] {
        msg.extend_from_slice(&addr.ip().octets());
        msg.extend_from_slice(&addr.port().to_be_bytes());
        msg.extend_from_slice(&qpn.to_be_bytes());
    }
    let digest: [u8; 32] = match psk {
        Some(key) => {
            let mut mac =
                Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts keys of any length");
            mac.update(&msg);
            mac.finalize().into_bytes().into()
        }
        None => Sha256::digest(&msg).into(),
    };
    u64::from_be_bytes(digest[..8].try_into().expect("8 of 32 bytes"))
}

/// Which side sends CONNECT: the one with the smaller (address, port, QPN).
pub fn is_active(local: (SocketAddrV4, u32), remote: (SocketAddrV4, u32)) -> bool {
    (local.0.ip().octets(), local.0.port(), local.1)
        < (remote.0.ip().octets(), remote.0.port(), remote.1)
}

/// The peer's data socket for a destination GID and QPN, or why there is none.
pub fn peer_of(base: u16, dgid: &[u8; 16], dest_qpn: u32) -> Result<SocketAddr, &'static str> {
    let ip = ipv4_of_gid(dgid).ok_or("the destination GID is not an IPv4-mapped address")?;
    let port = port_of_qpn(base, dest_qpn)
        .ok_or("the destination QPN is not one of a tbrdma verbs library")?;
    Ok(SocketAddr::V4(SocketAddrV4::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qpns_carry_the_port_slot_and_the_carrier_and_are_24_bits() {
        assert_eq!(qpn_of(0, 1, false), 0x1_0001);
        assert_eq!(qpn_of(0, 1, true), 0x1_8001);
        for frames in [false, true] {
            assert_eq!(port_of_qpn(18700, qpn_of(0, 1, frames)), Some(18700));
            assert_eq!(
                port_of_qpn(18700, qpn_of(254, MAX_QP_INDEX, frames)),
                Some(18954)
            );
            assert!(qpn_of(254, MAX_QP_INDEX, frames) <= 0x00ff_ffff);
            assert_eq!(hears_frames(qpn_of(3, 77, frames)), frames);
        }
        for bad in [0, 1, 0x7fff, 0xffff, 0x1_0000, 0x1_8000, 0x100_0001] {
            assert_eq!(port_of_qpn(18700, bad), None, "{bad:#x}");
        }
    }

    #[test]
    fn tokens_agree_on_both_sides_and_depend_on_every_input_and_the_key() {
        let a = ("10.0.0.1:18700".parse().unwrap(), 0x1_0001);
        let b = ("10.0.0.2:18701".parse().unwrap(), 0x2_0005);
        assert_eq!(token(a, b, None), token(b, a, None));
        assert_eq!(token(a, b, Some(b"k")), token(b, a, Some(b"k")));
        assert_ne!(token(a, b, None), token(a, b, Some(b"k")));
        assert_ne!(token(a, b, Some(b"k")), token(a, b, Some(b"l")));
        let c = ("10.0.0.2:18701".parse().unwrap(), 0x2_0006);
        assert_ne!(token(a, b, None), token(a, c, None));
        assert!(is_active(a, b) != is_active(b, a));
    }

    #[test]
    fn gids_are_ipv4_mapped() {
        let ip: Ipv4Addr = "169.254.1.2".parse().unwrap();
        let gid = gid_of(ip);
        assert_eq!(&gid[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(ipv4_of_gid(&gid), Some(ip));
        assert_eq!(ipv4_of_gid(&[0xfe; 16]), None);
        assert!(peer_of(18700, &gid, 0x3_0001).is_ok());
        assert!(peer_of(18700, &gid, 7).is_err());
    }
}
