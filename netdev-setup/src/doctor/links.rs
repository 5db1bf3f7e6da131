//! Checks of the links themselves: present, up, MTU, address, peer reachable.

use std::time::Duration;

use crate::addressing::PREFIX_LEN;
use crate::cables::cables;
use crate::doctor::{Check, DoctorOptions, LinkUnderTest, Status};
use crate::error::Result;
use crate::inventory::Inventory;

const SETUP: &str = "run `sudo tbrdma setup`";

/// ICMP echoes per link; the fastest is the kernel's floor the transport is compared with.
const ECHOES: usize = 10;

/// The link checks, and the links whose address is in place (for the transport probe).
pub(super) fn checks(
    inventory: &Inventory,
    options: &DoctorOptions,
) -> Result<(Vec<Check>, Vec<LinkUnderTest>)> {
    let mut out = Vec::new();
    let mut under_test = Vec::new();
    if inventory.links.is_empty() {
        out.push(
            Check::new("links present", Status::Fail, "no Thunderbolt network interfaces found")
                .fix("plug in the cable, `sudo modprobe thunderbolt-net`, and authorise the peer with `boltctl` (docs/setup.md)"),
        );
        return Ok((out, under_test));
    }
    let names: Vec<&str> = inventory
        .links
        .iter()
        .map(|l| l.interface.as_str())
        .collect();
    out.push(Check::new("links present", Status::Pass, names.join(", ")));
    let cables = cables(inventory)?;
    for link in &inventory.links {
        let name = &link.interface;
        let up = link.admin_up && matches!(link.operstate.as_str(), "up" | "unknown");
        out.push(if up {
            Check::new(
                format!("{name} up"),
                Status::Pass,
                format!("operstate {}", link.operstate),
            )
        } else {
            Check::new(
                format!("{name} up"),
                Status::Fail,
                format!(
                    "admin {}, operstate {}",
                    if link.admin_up { "up" } else { "down" },
                    link.operstate
                ),
            )
            .fix(SETUP)
        });
        if let Some(target) = link.target_mtu {
            out.push(if link.mtu >= target {
                Check::new(format!("{name} MTU"), Status::Pass, link.mtu.to_string())
            } else {
                Check::new(
                    format!("{name} MTU"),
                    Status::Warn,
                    format!("{} (can be {target}; small MTUs cost throughput)", link.mtu),
                )
                .fix(SETUP)
            });
        }
        let Some(cable) = cables.iter().find(|c| &c.interface == name) else {
            out.push(
                Check::new(
                    format!("{name} address"),
                    Status::Warn,
                    "peer unknown, no address expected",
                )
                .fix("name the link in a links file (--links, docs/setup.md)"),
            );
            continue;
        };
        let wanted = (cable.addresses.local, PREFIX_LEN);
        let has_address = link.addresses.contains(&wanted);
        out.push(if has_address {
            Check::new(
                format!("{name} address"),
                Status::Pass,
                format!("{}/{PREFIX_LEN}", wanted.0),
            )
        } else if !options.live {
            Check::new(
                format!("{name} address"),
                Status::Skip,
                "not the live system (--sysfs-root): addresses unknown",
            )
        } else {
            Check::new(
                format!("{name} address"),
                Status::Fail,
                format!("missing {}/{PREFIX_LEN}", wanted.0),
            )
            .fix(SETUP)
        });
        let check_name = format!(
            "{name} reaches {} ({})",
            cable.peer.name, cable.addresses.peer
        );
        if !options.live || !has_address {
            out.push(Check::new(
                check_name,
                Status::Skip,
                "needs the live system and the link's address",
            ));
            continue;
        }
        let mut link_under_test = LinkUnderTest {
            interface: name.clone(),
            local: cable.addresses.local,
            peer: cable.addresses.peer,
            peer_name: cable.peer.name.clone(),
            icmp_rtt_us: None,
            link_gbps: None,
            busy_poll_off: Vec::new(),
        };
        let echo = crate::ping::ping(name, cable.addresses.peer, Duration::from_secs(1));
        if let Ok(Some(first)) = &echo {
            let fastest = (1..ECHOES)
                .filter_map(|_| {
                    crate::ping::ping(name, cable.addresses.peer, Duration::from_secs(1))
                        .ok()
                        .flatten()
                })
                .fold(*first, Duration::min);
            link_under_test.icmp_rtt_us = Some(fastest.as_secs_f64() * 1e6);
        }
        under_test.push(link_under_test);
        out.push(match echo {
            Ok(Some(rtt)) => Check::new(check_name, Status::Pass, format!("ICMP echo in {} µs", rtt.as_micros())),
            Ok(None) => Check::new(check_name, Status::Fail, "no ICMP echo reply within 1 s").fix(
                "run `sudo tbrdma setup` on the peer too; if both are set up, the cables are crossed: swap them (docs/setup.md)",
            ),
            Err(e) => Check::new(check_name, Status::Skip, e.to_string()).fix("run doctor as root to ping peers"),
        });
    }
    Ok((out, under_test))
}
