//! The hostfile: which hosts form the cluster, in which rank order, over which links, in which
//! topology. Built from one [`HostRecord`] per host, by discovery on real hosts and directly by
//! the lab, through the same [`Hostfile::from_records`], so both produce identical files.
//! The JSON form is documented in `docs/hostfile.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::Ipv4Addr;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{NetdevError, Result};

/// Version of the JSON format written in `version`.
pub const FORMAT_VERSION: u32 = 1;

/// What one host knows about itself: enough for every other host to place it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HostRecord {
    /// Thunderbolt UUID.
    pub uuid: String,
    /// Host name.
    pub name: String,
    /// Other UUIDs this host shows on some cables (one per extra USB4 host router).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// Its cables.
    pub links: Vec<RecordLink>,
}

impl HostRecord {
    /// True when a peer that sees `uuid` at the end of a cable is looking at this host.
    pub fn answers_to(&self, uuid: &str) -> bool {
        self.uuid == uuid || self.aliases.iter().any(|a| a == uuid)
    }
}

/// One cable as its host sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RecordLink {
    /// Local interface.
    pub interface: String,
    /// Local address.
    pub address: Ipv4Addr,
    /// Prefix length.
    pub prefix_len: u8,
    /// UUID the other end shows on this cable (its host's UUID or one of its aliases).
    pub peer_uuid: String,
    /// Address of the other end.
    pub peer_address: Ipv4Addr,
    /// Rail among the cables to that peer.
    pub rail: u32,
}

/// The shape of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TopologyKind {
    /// One host, no cables.
    Single,
    /// Two hosts.
    Pair,
    /// Three or more hosts, each cabled to every other.
    Mesh,
    /// Four or more hosts in a cycle, each cabled to two neighbours.
    Ring,
    /// Anything else (a chain, a star, …).
    Other,
}

impl fmt::Display for TopologyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            TopologyKind::Single => "single",
            TopologyKind::Pair => "pair",
            TopologyKind::Mesh => "mesh",
            TopologyKind::Ring => "ring",
            TopologyKind::Other => "other",
        };
        f.write_str(name)
    }
}

/// Topology and rails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// The shape.
    pub kind: TopologyKind,
    /// Cables between every pair of neighbours (the fewest, if they differ).
    pub rails: u32,
}

/// The cluster's hostfile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hostfile {
    /// Format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// Shape of the cluster.
    pub topology: Topology,
    /// One entry per host, `ranks[i].rank == i`.
    pub ranks: Vec<Rank>,
}

/// One host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rank {
    /// Rank number.
    pub rank: usize,
    /// Host name.
    pub host: String,
    /// Thunderbolt UUID.
    pub uuid: String,
    /// Its cables, ordered by peer rank then rail.
    pub links: Vec<RankLink>,
}

/// One cable seen from a rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLink {
    /// Local interface on this rank's host.
    pub interface: String,
    /// This rank's address on the cable.
    pub address: Ipv4Addr,
    /// Prefix length.
    pub prefix_len: u8,
    /// The rank at the other end.
    pub peer: usize,
    /// That rank's address on the cable.
    pub peer_address: Ipv4Addr,
    /// Rail among the cables between the two.
    pub rail: u32,
}

impl Hostfile {
    /// Builds the hostfile from every host's record (in any order).
    ///
    /// Ranks: in a ring, rank 0 is the lowest UUID and ranks follow the cycle towards its
    /// lower-UUID neighbour, so neighbouring ranks are cabled; otherwise ranks are in UUID
    /// order. Rails between two ranks are numbered by (record rail, cable subnet), which both
    /// ends know, so hosts with several USB4 routers (whose cables each start at rail 0) still
    /// get distinct rails.
    pub fn from_records(records: &[HostRecord]) -> Result<Self> {
        let mut by_uuid: BTreeMap<&str, &HostRecord> = BTreeMap::new();
        let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
        for record in records {
            // Records may come from other hosts (discovery): their names end up in files.
            crate::names::check_host_name("host name", &record.name)?;
            for uuid in std::iter::once(&record.uuid).chain(&record.aliases) {
                crate::names::check_host_name("host UUID", uuid)?;
            }
            for link in &record.links {
                crate::names::check_interface_name(&link.interface)?;
                crate::names::check_host_name("peer UUID", &link.peer_uuid)?;
            }
            by_uuid.insert(&record.uuid, record);
            for uuid in std::iter::once(&record.uuid).chain(&record.aliases) {
                if owner.insert(uuid, &record.uuid).is_some() {
                    return Err(NetdevError::bad_input(
                        format!("two hosts claim UUID {uuid}"),
                        "every host needs its own Thunderbolt UUID (links file `host.uuid`)",
                    ));
                }
            }
        }
        let mut neighbours: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        let mut cable_count: BTreeMap<(&str, &str), u32> = BTreeMap::new();
        for record in by_uuid.values() {
            neighbours.entry(&record.uuid).or_default();
            for link in &record.links {
                let Some(peer) = owner.get(link.peer_uuid.as_str()) else {
                    return Err(NetdevError::bad_input(
                        format!(
                            "{} ({}) has a cable to unknown host {}",
                            record.name, link.interface, link.peer_uuid
                        ),
                        "run discovery on every host, or drop that cable",
                    ));
                };
                if *peer == record.uuid.as_str() {
                    return Err(NetdevError::bad_input(
                        format!(
                            "{} ({}) has a cable to itself ({})",
                            record.name, link.interface, link.peer_uuid
                        ),
                        "run discovery again, or fix that host's record",
                    ));
                }
                neighbours.entry(&record.uuid).or_default().insert(peer);
                *cable_count.entry((&record.uuid, peer)).or_default() += 1;
            }
        }
        // A cable has two ends: records that disagree (one host lists a cable its peer does
        // not) are not a cluster, and would send the ring walk below round a cycle for good.
        for (host, peers) in &neighbours {
            if let Some(peer) = peers.iter().find(|p| !neighbours[**p].contains(host)) {
                return Err(NetdevError::bad_input(
                    format!(
                        "inconsistent host records: {} lists a cable to {}, which lists none back",
                        by_uuid[host].name, by_uuid[peer].name
                    ),
                    "run discovery on every host again (each must see its cables up), or fix the records",
                ));
            }
        }
        let kind = topology_kind(&neighbours);
        let rails = cable_count.values().copied().min().unwrap_or(0);
        let order = match kind {
            TopologyKind::Ring => ring_order(&neighbours).ok_or_else(|| {
                NetdevError::bad_input(
                    "the host records describe two hosts per cable set but no single ring",
                    "run discovery on every host again, or fix the records",
                )
            })?,
            _ => neighbours.keys().copied().collect(),
        };
        let rank_of: BTreeMap<&str, usize> = order
            .iter()
            .enumerate()
            .map(|(rank, uuid)| (*uuid, rank))
            .collect();
        let ranks = order
            .iter()
            .enumerate()
            .map(|(rank, uuid)| {
                let record = by_uuid[uuid];
                let mut links: Vec<(RankLink, (u32, Ipv4Addr))> = record
                    .links
                    .iter()
                    .map(|l| {
                        let network = Ipv4Addr::from(u32::from(l.address) & !0b11);
                        let link = RankLink {
                            interface: l.interface.clone(),
                            address: l.address,
                            prefix_len: l.prefix_len,
                            peer: rank_of[owner[l.peer_uuid.as_str()]],
                            peer_address: l.peer_address,
                            rail: 0,
                        };
                        (link, (l.rail, network))
                    })
                    .collect();
                links.sort_by_key(|(l, key)| (l.peer, *key));
                let mut links: Vec<RankLink> = links.into_iter().map(|(l, _)| l).collect();
                for i in 0..links.len() {
                    let same_peer_before = links[..i].iter().filter(|l| l.peer == links[i].peer);
                    links[i].rail = same_peer_before.count() as u32;
                }
                Rank {
                    rank,
                    host: record.name.clone(),
                    uuid: record.uuid.clone(),
                    links,
                }
            })
            .collect();
        Ok(Hostfile {
            version: FORMAT_VERSION,
            topology: Topology { kind, rails },
            ranks,
        })
    }

    /// The JSON text (pretty, with a trailing newline).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("hostfile serializes") + "\n"
    }

    /// Parses JSON text and checks it is consistent.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let hostfile: Hostfile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if hostfile.version != FORMAT_VERSION {
            return Err(format!(
                "version {} (this tbrdma reads {FORMAT_VERSION})",
                hostfile.version
            ));
        }
        for (i, rank) in hostfile.ranks.iter().enumerate() {
            if rank.rank != i {
                return Err(format!("ranks[{i}] says rank {}", rank.rank));
            }
            let names = crate::names::check_host_name("host name", &rank.host)
                .and_then(|()| crate::names::check_host_name("host UUID", &rank.uuid))
                .and_then(|()| {
                    rank.links
                        .iter()
                        .try_for_each(|l| crate::names::check_interface_name(&l.interface))
                });
            if let Err(e) = names {
                return Err(format!("rank {i}: {e}"));
            }
            if let Some(bad) = rank.links.iter().find(|l| l.peer >= hostfile.ranks.len()) {
                return Err(format!(
                    "rank {i} has a link to rank {}, which does not exist",
                    bad.peer
                ));
            }
        }
        Ok(hostfile)
    }

    /// Reads a hostfile.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::names::read_small_file(path)?;
        Self::parse(&text).map_err(|problem| {
            NetdevError::bad_input(
                format!("{}: not a valid hostfile: {problem}", path.display()),
                "regenerate it with `tbrdma hostfile` (format: docs/hostfile.md)",
            )
        })
    }

    /// Writes a hostfile.
    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_json()).map_err(|e| NetdevError::io("writing", path, e))
    }
}

fn topology_kind(neighbours: &BTreeMap<&str, BTreeSet<&str>>) -> TopologyKind {
    let n = neighbours.len();
    if n <= 1 {
        return TopologyKind::Single;
    }
    let connected = is_connected(neighbours);
    if !connected {
        return TopologyKind::Other;
    }
    if n == 2 {
        return TopologyKind::Pair;
    }
    if neighbours.values().all(|set| set.len() == n - 1) {
        return TopologyKind::Mesh;
    }
    if n >= 4 && neighbours.values().all(|set| set.len() == 2) {
        return TopologyKind::Ring;
    }
    TopologyKind::Other
}

fn is_connected(neighbours: &BTreeMap<&str, BTreeSet<&str>>) -> bool {
    let Some(start) = neighbours.keys().next() else {
        return true;
    };
    let mut seen = BTreeSet::from([*start]);
    let mut stack = vec![*start];
    while let Some(host) = stack.pop() {
        for next in &neighbours[host] {
            if seen.insert(next) {
                stack.push(next);
            }
        }
    }
    seen.len() == neighbours.len()
}

/// Walks a ring from its lowest UUID towards that host's lower-UUID neighbour. `None` unless
/// the walk comes back to its start after visiting every host once: at most one step per host,
/// whatever the records say.
fn ring_order<'a>(neighbours: &BTreeMap<&'a str, BTreeSet<&'a str>>) -> Option<Vec<&'a str>> {
    let start = *neighbours.keys().next()?;
    let mut order = vec![start];
    let mut seen = BTreeSet::from([start]);
    let mut previous = start;
    let mut current = *neighbours[start].iter().next()?;
    while current != start {
        if !seen.insert(current) || order.len() >= neighbours.len() {
            return None;
        }
        order.push(current);
        let next = *neighbours.get(current)?.iter().find(|n| **n != previous)?;
        previous = current;
        current = next;
    }
    (order.len() == neighbours.len()).then_some(order)
}
