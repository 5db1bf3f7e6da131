//! The point-to-point addressing scheme. Both ends of a cable compute the same /30 on their
//! own, from facts both can see: the two hosts' Thunderbolt UUIDs and the cable's rail number
//! among the cables joining them. No coordination, no DHCP, no state.
//!
//! The pool is IPv4 link-local space, 169.254.0.0/16, minus the first and last /24 that
//! RFC 3927 reserves: 254 × 64 = 16,256 /30 subnets. The slot is FNV-1a-64 of
//! `lower_uuid "/" higher_uuid "/" rail`, modulo 16,256; the host with the lower UUID takes
//! `.1` of the /30 and the other `.2`. Link-local addresses are never routed off the link,
//! which is what a cable is.

use std::net::Ipv4Addr;

/// Prefix length of every cable's subnet.
pub const PREFIX_LEN: u8 = 30;

/// Number of /30 subnets in the pool.
const SLOTS: u64 = 254 * 64;

/// The two addresses of one cable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CableAddresses {
    /// This end's address.
    pub local: Ipv4Addr,
    /// The other end's address.
    pub peer: Ipv4Addr,
    /// The /30 network both sit in.
    pub network: Ipv4Addr,
}

/// The addresses of the cable joining `local_uuid` to `peer_uuid`, rail `rail`, seen from
/// `local_uuid`'s end.
pub fn cable_addresses(local_uuid: &str, peer_uuid: &str, rail: u32) -> CableAddresses {
    let local = local_uuid.to_ascii_lowercase();
    let peer = peer_uuid.to_ascii_lowercase();
    let (low, high) = if local <= peer {
        (&local, &peer)
    } else {
        (&peer, &local)
    };
    let key = format!("{low}/{high}/{rail}");
    let slot = fnv1a64(key.as_bytes()) % SLOTS;
    let third = 1 + (slot / 64) as u8;
    let fourth = ((slot % 64) * 4) as u8;
    let network = Ipv4Addr::new(169, 254, third, fourth);
    let low_end = Ipv4Addr::new(169, 254, third, fourth + 1);
    let high_end = Ipv4Addr::new(169, 254, third, fourth + 2);
    if local == *low {
        CableAddresses {
            local: low_end,
            peer: high_end,
            network,
        }
    } else {
        CableAddresses {
            local: high_end,
            peer: low_end,
            network,
        }
    }
}

/// FNV-1a, 64 bit: tiny, stable across versions and platforms, which is all this needs.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ends_agree() {
        let a = "11111111-2222-3333-4444-555555555555";
        let b = "AAAAAAAA-2222-3333-4444-555555555555";
        for rail in 0..4 {
            let from_a = cable_addresses(a, b, rail);
            let from_b = cable_addresses(b, a, rail);
            assert_eq!(from_a.local, from_b.peer);
            assert_eq!(from_a.peer, from_b.local);
            assert_eq!(from_a.network, from_b.network);
            assert_eq!(from_a.local.octets()[3] & 3, 1, "lower UUID takes .1");
        }
        assert_ne!(
            cable_addresses(a, b, 0).network,
            cable_addresses(a, b, 1).network
        );
    }

    #[test]
    fn stays_in_the_unreserved_pool() {
        for i in 0..2000u32 {
            let n = cable_addresses("a", &format!("{i}"), i % 3)
                .network
                .octets();
            assert_eq!((n[0], n[1]), (169, 254));
            assert!((1..=254).contains(&n[2]));
            assert_eq!(n[3] % 4, 0);
        }
    }
}
