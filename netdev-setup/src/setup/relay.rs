//! Relaying between ranks that share no cable (a ring of 4 or more: ranks 0 and 2), by the
//! kernels of the hosts in between: each host forwards IPv4 between its cables
//! (`net.ipv4.ip_forward = 1`), has a host route (/32) to every address of every other rank
//! that is not on one of its own cables, via the neighbour on the shorter way round the ring
//! (ties go up, as the collectives' `route` does: [`ring_path`]), and filters reverse paths
//! loosely (`rp_filter = 2`), because on a tie the two directions go opposite ways round.
//!
//! Link-local (169.254/16) addresses are forwarded like any other by Linux; only the
//! addresses' scope changes, and no other host ever sees them. The lab applies this to every
//! namespace of a ring; `tbrdma setup --relay HOSTFILE` plans it for a real host.

use std::net::Ipv4Addr;
use std::path::Path;

use crate::hostfile::{Hostfile, TopologyKind};
use crate::setup::step::{Step, read_u64};

/// The sysctl that makes a host forward IPv4 between its interfaces (per network namespace).
pub const IP_FORWARD: &str = "net.ipv4.ip_forward";
/// Reverse-path filtering for every interface (the effective value is the larger of this and
/// the interface's own): 1 strict, 2 loose.
pub const RP_FILTER_ALL: &str = "net.ipv4.conf.all.rp_filter";

/// The path from `src` to `dst` around a ring of `n`, the shorter way (ties go up, towards
/// `src + 1`), both ends included.
pub fn ring_path(n: usize, src: usize, dst: usize) -> Vec<usize> {
    let mut path = vec![src];
    if n == 0 || src == dst {
        return path;
    }
    let up = (dst + n - src) % n <= n / 2;
    let mut k = src;
    while k != dst {
        k = if up { (k + 1) % n } else { (k + n - 1) % n };
        path.push(k);
    }
    path
}

/// One host route a rank needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayRoute {
    /// A cable address of another rank.
    pub destination: Ipv4Addr,
    /// The rank that owns it.
    pub owner: usize,
    /// The neighbour the packets go to first.
    pub via: usize,
    /// That neighbour's address on the cable to it.
    pub gateway: Ipv4Addr,
    /// This rank's interface on that cable.
    pub interface: String,
}

/// The host routes rank `rank` of `hostfile` needs to reach every cable address of every other
/// rank; empty unless the topology is a ring (in a pair or a mesh every rank shares a cable with
/// every other). Addresses on this rank's own cables are left to the kernel's connected routes.
pub fn relay_routes(hostfile: &Hostfile, rank: usize) -> Vec<RelayRoute> {
    let n = hostfile.ranks.len();
    if hostfile.topology.kind != TopologyKind::Ring || rank >= n {
        return Vec::new();
    }
    let me = &hostfile.ranks[rank];
    let on_my_cable = |a: Ipv4Addr| {
        me.links
            .iter()
            .any(|l| same_subnet(a, l.address, l.prefix_len))
    };
    let mut routes = Vec::new();
    for other in hostfile.ranks.iter().filter(|r| r.rank != rank) {
        let via = ring_path(n, rank, other.rank)[1];
        let Some(first) = me
            .links
            .iter()
            .filter(|l| l.peer == via)
            .min_by_key(|l| l.rail)
        else {
            continue;
        };
        for link in &other.links {
            if on_my_cable(link.address)
                || routes
                    .iter()
                    .any(|r: &RelayRoute| r.destination == link.address)
            {
                continue;
            }
            routes.push(RelayRoute {
                destination: link.address,
                owner: other.rank,
                via,
                gateway: first.peer_address,
                interface: first.interface.clone(),
            });
        }
    }
    routes
}

fn same_subnet(a: Ipv4Addr, b: Ipv4Addr, prefix_len: u8) -> bool {
    let mask = u32::MAX
        .checked_shl(32 - u32::from(prefix_len.min(32)))
        .unwrap_or(0);
    u32::from(a) & mask == u32::from(b) & mask
}

/// The steps that make rank `rank` relay and reach every rank: forwarding on, reverse-path
/// filtering loose where it is strict on a cable, and each missing route. `existing` holds the
/// host routes already there, as (destination, gateway); `proc_root` is where `/proc` is.
pub fn relay_steps(
    hostfile: &Hostfile,
    rank: usize,
    proc_root: &Path,
    existing: &[(Ipv4Addr, Ipv4Addr)],
) -> Vec<Step> {
    let routes = relay_routes(hostfile, rank);
    if routes.is_empty() {
        return Vec::new();
    }
    let mut steps = Vec::new();
    let sys = proc_root.join("sys/net/ipv4");
    let forward = read_u64(&sys.join("ip_forward")).unwrap_or(0);
    if forward != 1 {
        steps.push(Step::Sysctl {
            key: IP_FORWARD.into(),
            from: forward,
            to: 1,
        });
    }
    // Strict filtering (1) on a cable would drop a tie's replies, which come back the other
    // way round; the effective value is max(all, interface), so all = 2 makes every cable loose.
    let all = read_u64(&sys.join("conf/all/rp_filter")).unwrap_or(0);
    let strict = hostfile.ranks[rank]
        .links
        .iter()
        .any(|l| read_u64(&sys.join("conf").join(&l.interface).join("rp_filter")) == Some(1));
    if all == 1 || (all == 0 && strict) {
        steps.push(Step::Sysctl {
            key: RP_FILTER_ALL.into(),
            from: all,
            to: 2,
        });
    }
    for route in routes {
        if !existing.contains(&(route.destination, route.gateway)) {
            steps.push(Step::AddRoute {
                destination: route.destination,
                gateway: route.gateway,
                interface: route.interface,
                owner: route.owner,
                via: route.via,
            });
        }
    }
    steps
}

/// How to undo what [`relay_steps`] applied, for the log.
pub fn undo_hint(steps: &[Step]) -> Option<String> {
    let mut undo = Vec::new();
    for step in steps {
        match step {
            Step::Sysctl { key, from, .. } if key == IP_FORWARD || key == RP_FILTER_ALL => {
                undo.push(format!("sysctl -w {key}={from}"));
            }
            Step::AddRoute {
                destination,
                interface,
                ..
            } => undo.push(format!("ip route del {destination}/32 dev {interface}")),
            _ => {}
        }
    }
    (!undo.is_empty()).then(|| undo.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_go_the_shorter_way_and_ties_go_up() {
        assert_eq!(ring_path(4, 0, 2), [0, 1, 2]);
        assert_eq!(ring_path(4, 2, 0), [2, 3, 0]);
        assert_eq!(ring_path(4, 1, 3), [1, 2, 3]);
        assert_eq!(ring_path(4, 3, 1), [3, 0, 1]);
        assert_eq!(ring_path(5, 0, 3), [0, 4, 3]);
        assert_eq!(ring_path(5, 0, 2), [0, 1, 2]);
        assert_eq!(ring_path(4, 0, 1), [0, 1]);
        assert_eq!(ring_path(4, 1, 1), [1]);
    }

    #[test]
    fn subnets_compare_under_the_prefix() {
        let a = Ipv4Addr::new(169, 254, 3, 5);
        assert!(same_subnet(a, Ipv4Addr::new(169, 254, 3, 6), 30));
        assert!(!same_subnet(a, Ipv4Addr::new(169, 254, 3, 9), 30));
        assert!(same_subnet(a, Ipv4Addr::new(1, 2, 3, 4), 0));
    }
}
