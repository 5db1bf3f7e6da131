//! Where the two ends of each direct connection lie (see [`crate::direct`]), worked out from
//! the hostfile alone when the communicator is built: the communicator keeps the plan, and
//! `direct` connects along it on first use. Nothing here touches the network.

use std::net::Ipv4Addr;

use tbrdma_netdev::hostfile::{Hostfile, TopologyKind};
use tbrdma_netdev::setup::relay::ring_path;

/// The two ends of a direct connection, seen from this rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DirectEnds {
    /// This rank's address (on the cable to the first hop towards the peer).
    pub local: Ipv4Addr,
    /// The peer's address (on the cable to the first hop of its route back).
    pub peer: Ipv4Addr,
}

/// Rank `a`'s address on the cable to the first hop of its route to `b`.
fn end_address(hostfile: &Hostfile, a: usize, b: usize) -> Option<Ipv4Addr> {
    let via = *ring_path(hostfile.ranks.len(), a, b).get(1)?;
    hostfile.ranks[a]
        .links
        .iter()
        .filter(|l| l.peer == via)
        .min_by_key(|l| l.rail)
        .map(|l| l.address)
}

/// The ends of a direct connection to every rank not `cabled` to `rank`, in a ring (elsewhere
/// there is no route to relay along).
pub(crate) fn plan_ends(
    hostfile: &Hostfile,
    rank: usize,
    cabled: &[bool],
) -> Vec<Option<DirectEnds>> {
    let n = hostfile.ranks.len();
    (0..n)
        .map(|p| {
            if p == rank || cabled[p] || hostfile.topology.kind != TopologyKind::Ring {
                return None;
            }
            Some(DirectEnds {
                local: end_address(hostfile, rank, p)?,
                peer: end_address(hostfile, p, rank)?,
            })
        })
        .collect()
}
