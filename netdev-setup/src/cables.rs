//! Cables: links with a known peer, numbered into rails and given their addresses. The
//! planner, `doctor` and hostfile discovery all see the same cables because they all come
//! from here.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use crate::addressing::{CableAddresses, cable_addresses};
use crate::error::{NetdevError, Result};
use crate::inventory::{HostIdentity, Inventory, Link};

/// A link whose other end is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cable {
    /// Local interface.
    pub interface: String,
    /// The host at the other end.
    pub peer: HostIdentity,
    /// Index among the cables to the same peer.
    pub rail: u32,
    /// Both ends' addresses.
    pub addresses: CableAddresses,
}

/// Numbers the cables of `inventory` and computes their addresses.
///
/// Cables to the same peer without an explicit rail are numbered by local Thunderbolt port
/// (then interface name). Both hosts number the same way, so their rails match when the
/// cables join like-numbered ports; `doctor` reports a peer unreachable when they do not.
pub fn cables(inventory: &Inventory) -> Result<Vec<Cable>> {
    let Some(host) = &inventory.host else {
        return Ok(Vec::new());
    };
    let mut by_peer: BTreeMap<&str, Vec<&Link>> = BTreeMap::new();
    for link in &inventory.links {
        if let Some(peer) = &link.peer {
            by_peer.entry(peer.uuid.as_str()).or_default().push(link);
        }
    }
    let mut out = Vec::new();
    for links in by_peer.values_mut() {
        links.sort_by(|a, b| (&a.port, &a.interface).cmp(&(&b.port, &b.interface)));
        for (position, link) in links.iter().enumerate() {
            let peer = link.peer.clone().expect("grouped by peer");
            let rail = link.rail.unwrap_or(position as u32);
            let local_uuid = link.local_uuid.as_deref().unwrap_or(&host.uuid);
            let addresses = cable_addresses(local_uuid, &peer.uuid, rail);
            out.push(Cable {
                interface: link.interface.clone(),
                peer,
                rail,
                addresses,
            });
        }
    }
    out.sort_by(|a, b| a.interface.cmp(&b.interface));
    check_no_collision(&out)?;
    Ok(out)
}

fn check_no_collision(cables: &[Cable]) -> Result<()> {
    let mut seen: BTreeMap<Ipv4Addr, &str> = BTreeMap::new();
    for cable in cables {
        if let Some(other) = seen.insert(cable.addresses.network, &cable.interface) {
            return Err(NetdevError::bad_input(
                format!(
                    "{} and {other} hash to the same subnet {}/30 (or name the same rail twice)",
                    cable.interface, cable.addresses.network
                ),
                "give the cables distinct rails in a links file (--links); see docs/setup.md",
            ));
        }
    }
    Ok(())
}
