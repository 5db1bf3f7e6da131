//! Who is who on a packet rail: the Ethernet address of each peer, from the kernel's neighbour
//! table. The packet backend sends a frame only to a peer's own address (never to the broadcast
//! address, where every host on a shared segment would see the payload) and accepts a frame only
//! when its source address is the one the neighbour table gives for the IPv4 address its shim
//! claims (a stranger on the link cannot pass for a peer by writing the peer's address into the
//! shim).
//!
//! While a peer's address is unknown, its frames are dropped both ways (the protocol resends)
//! and the backend asks the kernel to resolve it ([`Lookup::Resolve`]); the kernel's own ARP
//! exchange carries no payload of ours. Reading the table costs a file read, so lookups are
//! spaced out ([`LOOKUP_EVERY`]) and the addresses not found are remembered in a bounded set
//! ([`MAX_UNKNOWN`]): a flood of frames claiming made-up addresses costs neither memory nor a
//! read per frame. On a loopback interface every frame is the host's own, and its address is
//! the interface's.
//!
//! This module owns the cache and the decision; `packet.rs` reads the addresses off the ring
//! and sends what this says.

use std::net::Ipv4Addr;

// FxHash: both maps are looked up for every frame sent and received, where SipHash cost about
// 100 instructions a lookup. Flooding them with colliding keys gains a stranger nothing: they
// are bounded ([`MAX_KNOWN`], [`MAX_UNKNOWN`]).
use rustc_hash::FxHashMap as HashMap;

/// Frames to or from an unknown address between two reads of the neighbour table.
pub(crate) const LOOKUP_EVERY: u32 = 256;
/// Unknown addresses remembered at most (beyond, the set starts afresh).
pub(crate) const MAX_UNKNOWN: usize = 64;
/// Known addresses remembered at most (the kernel's table bounds them too).
pub(crate) const MAX_KNOWN: usize = 1024;

/// An Ethernet address.
pub(crate) type Mac = [u8; 6];

/// What the backend does for a frame to an address not yet resolved.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// Send it to this address.
    Send(Mac),
    /// Drop it, and have the kernel resolve the address (send it one empty UDP datagram).
    Resolve,
    /// Drop it (a resolution is already under way).
    Drop,
}

/// Where the neighbour table comes from (a file read in production, a map in tests).
pub(crate) trait NeighbourTable {
    /// `ip`'s address on the rail's interface, if the table has a complete entry.
    fn lookup(&self, ip: Ipv4Addr) -> Option<Mac>;
}

/// The kernel's table, `/proc/net/arp`, entries of interface `ifname` only.
#[derive(Clone, Debug)]
pub(crate) struct KernelTable {
    pub(crate) ifname: String,
}

impl NeighbourTable for KernelTable {
    fn lookup(&self, ip: Ipv4Addr) -> Option<Mac> {
        let table = std::fs::read_to_string("/proc/net/arp").ok()?;
        parse_arp_table(&table, &self.ifname, ip)
    }
}

/// `ip`'s complete entry on `ifname` in the text of `/proc/net/arp`.
fn parse_arp_table(table: &str, ifname: &str, ip: Ipv4Addr) -> Option<Mac> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // IP address, HW type, flags (0x2: complete), HW address, mask, device.
        if f.len() < 6 || f[5] != ifname || f[0].parse::<Ipv4Addr>().ok()? != ip {
            return None;
        }
        if u32::from_str_radix(f[2].trim_start_matches("0x"), 16).ok()? & 0x2 == 0 {
            return None;
        }
        let mut mac = [0u8; 6];
        let mut parts = f[3].split(':');
        for b in &mut mac {
            *b = u8::from_str_radix(parts.next()?, 16).ok()?;
        }
        (mac != [0; 6]).then_some(mac)
    })
}

/// The peers' addresses as far as known; see the module docs.
#[derive(Debug)]
pub(crate) struct Neighbours<T> {
    table: T,
    /// `Some(address)` on a loopback interface: every frame is the host's own.
    loopback: Option<Mac>,
    known: HashMap<Ipv4Addr, Mac>,
    /// The entry of `known` last used: a rail usually talks to one peer, and this spares a
    /// map lookup for every frame. Reset whenever `known` changes (`lookup_now`).
    last_known: Option<(Ipv4Addr, Mac)>,
    /// Addresses sent to, looked up and not found, with sends left before the next lookup.
    unknown: HashMap<Ipv4Addr, u32>,
    /// Received frames left before the next lookup they may cause (whatever address they
    /// claim: a stranger cannot make the table be read per frame).
    wire_lookup_in: u32,
}

impl<T: NeighbourTable> Neighbours<T> {
    /// `loopback`: the interface's own address when it is a loopback interface.
    pub(crate) fn new(table: T, loopback: Option<Mac>) -> Self {
        Neighbours {
            table,
            loopback,
            known: HashMap::default(),
            last_known: None,
            unknown: HashMap::default(),
            wire_lookup_in: 0,
        }
    }

    /// A table over the same source that knows nothing yet (for a second backend on the rail).
    pub(crate) fn empty_like(&self) -> Self
    where
        T: Clone,
    {
        Self::new(self.table.clone(), self.loopback)
    }

    /// `ip`'s address, if known.
    fn known(&mut self, ip: Ipv4Addr) -> Option<Mac> {
        match self.last_known {
            Some((last, mac)) if last == ip => Some(mac),
            _ => {
                let mac = *self.known.get(&ip)?;
                self.last_known = Some((ip, mac));
                Some(mac)
            }
        }
    }

    /// Reads `ip`'s address from the table, remembering it when found.
    fn lookup_now(&mut self, ip: Ipv4Addr) -> Option<Mac> {
        let mac = self.table.lookup(ip)?;
        if self.known.len() >= MAX_KNOWN && !self.known.contains_key(&ip) {
            self.known.clear();
        }
        self.known.insert(ip, mac);
        self.last_known = None;
        self.unknown.remove(&ip);
        Some(mac)
    }

    /// Where a frame for `ip` goes.
    pub(crate) fn for_send(&mut self, ip: Ipv4Addr) -> Lookup {
        if let Some(mac) = self.loopback.or_else(|| self.known(ip)) {
            return Lookup::Send(mac);
        }
        if let Some(left) = self.unknown.get_mut(&ip) {
            if *left > 0 {
                *left -= 1;
                return Lookup::Drop;
            }
        }
        if let Some(mac) = self.lookup_now(ip) {
            return Lookup::Send(mac);
        }
        if self.unknown.len() >= MAX_UNKNOWN && !self.unknown.contains_key(&ip) {
            self.unknown.clear();
        }
        self.unknown.insert(ip, LOOKUP_EVERY);
        Lookup::Resolve
    }

    /// Whether a frame whose shim says it comes from `ip` really came from `ip`'s host: its
    /// Ethernet source is `ip`'s address in the table. A frame from an address not (or not
    /// so) in the cache is checked against the table at most once per [`LOOKUP_EVERY`] such
    /// frames; a stranger's frames never change what is cached for a peer (only the table
    /// does).
    pub(crate) fn accepts(&mut self, ip: Ipv4Addr, source: Mac) -> bool {
        if let Some(mac) = self.loopback {
            return mac == source;
        }
        if self.known(ip) == Some(source) {
            return true;
        }
        if self.wire_lookup_in > 0 {
            self.wire_lookup_in -= 1;
            return false;
        }
        self.wire_lookup_in = LOOKUP_EVERY;
        self.lookup_now(ip) == Some(source)
    }

    /// Addresses remembered (known and not found), for tests of the bound.
    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.known.len() + self.unknown.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A table with fixed entries that counts its lookups.
    struct FixedTable {
        entries: HashMap<Ipv4Addr, Mac>,
        lookups: Cell<u32>,
    }

    impl NeighbourTable for &FixedTable {
        fn lookup(&self, ip: Ipv4Addr) -> Option<Mac> {
            self.lookups.set(self.lookups.get() + 1);
            self.entries.get(&ip).copied()
        }
    }

    const PEER: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 2);
    const PEER_MAC: Mac = [2, 0, 0, 0, 0, 2];
    const STRANGER_MAC: Mac = [2, 0, 0, 0, 0, 9];

    fn table() -> FixedTable {
        FixedTable {
            entries: HashMap::from_iter([(PEER, PEER_MAC)]),
            lookups: Cell::new(0),
        }
    }

    #[test]
    fn frames_go_only_to_the_peers_own_address() {
        let t = table();
        let mut n = Neighbours::new(&t, None);
        assert_eq!(n.for_send(PEER), Lookup::Send(PEER_MAC));
        // Unknown: dropped and resolved, then dropped until the next lookup is due.
        let other = Ipv4Addr::new(169, 254, 1, 3);
        assert_eq!(n.for_send(other), Lookup::Resolve);
        for _ in 0..LOOKUP_EVERY {
            assert_eq!(n.for_send(other), Lookup::Drop);
        }
        assert_eq!(n.for_send(other), Lookup::Resolve);
        assert_eq!(t.lookups.get(), 3, "the table is read once per due lookup");
    }

    #[test]
    fn a_frame_is_accepted_only_from_the_address_of_the_host_it_claims() {
        let t = table();
        let mut n = Neighbours::new(&t, None);
        assert!(n.accepts(PEER, PEER_MAC));
        assert!(
            !n.accepts(PEER, STRANGER_MAC),
            "a stranger claiming the peer's IP"
        );
        assert!(
            n.accepts(PEER, PEER_MAC),
            "the stranger changed nothing for the peer"
        );
        assert!(
            !n.accepts(Ipv4Addr::new(10, 0, 0, 1), PEER_MAC),
            "an IP the table does not have"
        );
    }

    #[test]
    fn a_flood_of_made_up_addresses_is_bounded_in_memory_and_lookups() {
        let t = table();
        let mut n = Neighbours::new(&t, None);
        n.accepts(PEER, PEER_MAC);
        let before = t.lookups.get();
        let frames = 100_000u32;
        for i in 0..frames {
            let ip = Ipv4Addr::from(0x0a00_0000 | i);
            assert!(!n.accepts(ip, STRANGER_MAC));
            assert!(!n.accepts(PEER, STRANGER_MAC));
            assert!(n.remembered() <= MAX_UNKNOWN + MAX_KNOWN);
            assert!(n.accepts(PEER, PEER_MAC), "the peer is unaffected");
        }
        let lookups = t.lookups.get() - before;
        assert!(
            lookups <= 2 * frames / LOOKUP_EVERY + 1,
            "{lookups} table reads for {frames} stranger frames"
        );
    }

    #[test]
    fn on_loopback_every_frame_is_the_hosts_own() {
        let t = table();
        let mut n = Neighbours::new(&t, Some([0; 6]));
        assert_eq!(n.for_send(Ipv4Addr::LOCALHOST), Lookup::Send([0; 6]));
        assert!(n.accepts(Ipv4Addr::LOCALHOST, [0; 6]));
        assert!(!n.accepts(Ipv4Addr::LOCALHOST, STRANGER_MAC));
        assert_eq!(t.lookups.get(), 0);
    }

    #[test]
    fn the_kernel_table_is_parsed_for_complete_entries_of_the_interface() {
        let text = "IP address       HW type     Flags       HW address            Mask     Device\n\
                    169.254.1.2      0x1         0x2         02:00:00:00:00:02     *        tb0\n\
                    169.254.1.3      0x1         0x0         00:00:00:00:00:00     *        tb0\n\
                    169.254.1.4      0x1         0x2         02:00:00:00:00:04     *        tb1\n";
        assert_eq!(parse_arp_table(text, "tb0", PEER), Some(PEER_MAC));
        assert_eq!(
            parse_arp_table(text, "tb0", Ipv4Addr::new(169, 254, 1, 3)),
            None
        );
        assert_eq!(
            parse_arp_table(text, "tb0", Ipv4Addr::new(169, 254, 1, 4)),
            None
        );
    }
}
