//! Discovery records for made-up clusters, as every host would report them.

use tbrdma_netdev::addressing::cable_addresses;
use tbrdma_netdev::hostfile::{HostRecord, RecordLink};

/// Records for hosts `uuids` cabled along `edges` (index pairs), `rails` cables each.
pub fn records(uuids: &[&str], edges: &[(usize, usize)], rails: u32) -> Vec<HostRecord> {
    let mut records: Vec<HostRecord> = uuids
        .iter()
        .map(|u| HostRecord {
            uuid: (*u).into(),
            name: format!("host-{u}"),
            aliases: Vec::new(),
            links: Vec::new(),
        })
        .collect();
    for &(a, b) in edges {
        for rail in 0..rails {
            for (from, to) in [(a, b), (b, a)] {
                let addresses = cable_addresses(uuids[from], uuids[to], rail);
                let interface = format!("thunderbolt{}", records[from].links.len());
                records[from].links.push(RecordLink {
                    interface,
                    address: addresses.local,
                    prefix_len: 30,
                    peer_uuid: uuids[to].into(),
                    peer_address: addresses.peer,
                    rail,
                });
            }
        }
    }
    records
}
