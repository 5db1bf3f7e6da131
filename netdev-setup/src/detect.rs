//! Detection: reads a sysfs tree (the real `/sys` or a fake one in tests) to find
//! `thunderbolt-net` interfaces, the XDomain peer at the other end of each cable and this
//! host's own Thunderbolt UUID. Interfaces named in a links file are read the same way. It
//! never changes anything; addresses come from netlink and only when detection runs live.
//!
//! The sysfs layout it relies on (Linux `drivers/thunderbolt`, `drivers/net/thunderbolt`):
//! `class/net/thunderbolt0/device` links to the XDomain *service* (`…/domain0/0-0/0-1/0-1.0`),
//! whose `driver` is `thunderbolt-net`; its parent is the XDomain (`0-1`) with the remote
//! host's `unique_id` and `device_name`; the domain's root switch (`0-0`) holds the UUID this
//! host shows on that cable. A host with two USB4 host routers has two domains and two UUIDs;
//! the lowest names the host, and each cable is addressed with its own router's.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{NetdevError, Result};
use crate::inventory::{HostIdentity, Inventory, Link, THUNDERBOLT_MAX_MTU};
use crate::links_file::LinksFile;

/// Where detection looks and what it includes.
#[derive(Debug, Clone)]
pub struct Detector {
    /// The sysfs root (`/sys` normally).
    pub sysfs_root: PathBuf,
    /// Also ask netlink for addresses and maximum MTUs (the tree is the running kernel's).
    pub live: bool,
    /// Cables named by hand; when set, only these interfaces are links.
    pub links_file: Option<LinksFile>,
    /// When non-empty, only these interfaces are considered.
    pub only: Vec<String>,
}

impl Detector {
    /// A detector for `sysfs_root`; live when it is the real `/sys`.
    pub fn new(sysfs_root: impl Into<PathBuf>) -> Self {
        let sysfs_root = sysfs_root.into();
        let live = sysfs_root == Path::new("/sys");
        Self {
            sysfs_root,
            live,
            links_file: None,
            only: Vec::new(),
        }
    }

    /// Finds this host's links.
    pub fn detect(&self) -> Result<Inventory> {
        let mut inventory = match &self.links_file {
            Some(file) => self.detect_links_file(file)?,
            None => self.detect_thunderbolt()?,
        };
        if !self.only.is_empty() {
            inventory.links.retain(|l| self.only.contains(&l.interface));
            for name in &self.only {
                if !inventory.links.iter().any(|l| &l.interface == name) {
                    return Err(NetdevError::bad_input(
                        format!("--interface {name}: no such Thunderbolt link"),
                        "run `tbrdma setup --dry-run` to list links, or name non-Thunderbolt interfaces in a links file (--links)",
                    ));
                }
            }
        }
        if self.live {
            crate::netlink::fill_live_state(&mut inventory.links)?;
        }
        inventory
            .links
            .sort_by(|a, b| a.interface.cmp(&b.interface));
        Ok(inventory)
    }

    fn class_net(&self) -> PathBuf {
        self.sysfs_root.join("class/net")
    }

    fn detect_thunderbolt(&self) -> Result<Inventory> {
        let class_net = self.class_net();
        let mut links = Vec::new();
        let entries = match fs::read_dir(&class_net) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Inventory {
                    host: None,
                    host_uuids: Vec::new(),
                    links,
                });
            }
            Err(e) => return Err(NetdevError::io("listing", &class_net, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| NetdevError::io("listing", &class_net, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(service) = fs::canonicalize(class_net.join(&name).join("device")).ok() else {
                continue;
            };
            let driver = driver_of(&service);
            if driver.as_deref() != Some(crate::inventory::THUNDERBOLT_NET_DRIVER) {
                continue;
            }
            let mut link = self.read_interface(&name)?;
            link.driver = driver;
            if let Some(xdomain) = service.parent() {
                link.port = xdomain
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned());
                link.peer = read_identity(xdomain);
                link.local_uuid = root_switch_uuid(xdomain);
            }
            link.target_mtu = Some(THUNDERBOLT_MAX_MTU);
            links.push(link);
        }
        let mut host_uuids = self.domain_uuids();
        host_uuids.extend(links.iter().filter_map(|l| l.local_uuid.clone()));
        host_uuids.sort();
        host_uuids.dedup();
        let host = host_uuids.first().map(|uuid| HostIdentity {
            uuid: uuid.clone(),
            name: local_host_name(),
        });
        Ok(Inventory {
            host,
            host_uuids,
            links,
        })
    }

    /// The UUIDs of every Thunderbolt domain's root switch (`N-0`): one per host router. A
    /// host with two USB4 routers (two ports on separate controllers) has two, and shows its
    /// peers a different one on each cable; the lowest names the host.
    fn domain_uuids(&self) -> Vec<String> {
        let devices = self.sysfs_root.join("bus/thunderbolt/devices");
        fs::read_dir(devices)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| is_root_switch(&e.file_name().to_string_lossy()))
            .filter_map(|e| read_trimmed(&e.path().join("unique_id")))
            .map(|u| u.to_ascii_lowercase())
            .collect()
    }

    fn detect_links_file(&self, file: &LinksFile) -> Result<Inventory> {
        let mut links = Vec::new();
        for explicit in &file.links {
            if !self.class_net().join(&explicit.interface).exists() {
                return Err(NetdevError::bad_input(
                    format!(
                        "links file names {}, which does not exist",
                        explicit.interface
                    ),
                    "fix the interface name in the links file (see `ip link`)",
                ));
            }
            let mut link = self.read_interface(&explicit.interface)?;
            link.peer = Some(explicit.peer.clone());
            link.rail = Some(explicit.rail);
            link.target_mtu = explicit.mtu;
            links.push(link);
        }
        let host_uuids = vec![file.host.uuid.clone()];
        Ok(Inventory {
            host: Some(file.host.clone()),
            host_uuids,
            links,
        })
    }

    /// Reads the per-interface files every netdev has.
    fn read_interface(&self, name: &str) -> Result<Link> {
        let dir = self.class_net().join(name);
        let flags = read_trimmed(&dir.join("flags"))
            .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
            .unwrap_or(0);
        let mtu = read_trimmed(&dir.join("mtu"))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let driver = fs::canonicalize(dir.join("device"))
            .ok()
            .and_then(|d| driver_of(&d));
        Ok(Link {
            interface: name.to_owned(),
            driver,
            peer: None,
            port: None,
            local_uuid: None,
            rail: None,
            admin_up: flags & 0x1 != 0,
            operstate: read_trimmed(&dir.join("operstate")).unwrap_or_else(|| "unknown".into()),
            mtu,
            target_mtu: None,
            addresses: Vec::new(),
            napi_defer_hard_irqs: read_trimmed(&dir.join("napi_defer_hard_irqs"))
                .and_then(|s| s.parse().ok()),
            gro_flush_timeout: read_trimmed(&dir.join("gro_flush_timeout"))
                .and_then(|s| s.parse().ok()),
        })
    }
}

/// The name of the driver bound to a device directory.
fn driver_of(device: &Path) -> Option<String> {
    let target = fs::read_link(device.join("driver")).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

/// An XDomain's remote host: `unique_id` and `device_name`.
fn read_identity(xdomain: &Path) -> Option<HostIdentity> {
    let uuid = read_trimmed(&xdomain.join("unique_id"))?.to_ascii_lowercase();
    let name = read_trimmed(&xdomain.join("device_name")).unwrap_or_else(|| uuid.clone());
    Some(HostIdentity { uuid, name })
}

/// Walks up from an XDomain to its domain's root switch (`N-0`) and reads its `unique_id`,
/// which is the UUID this host presents to the peer on that cable.
fn root_switch_uuid(xdomain: &Path) -> Option<String> {
    xdomain.ancestors().skip(1).find_map(|dir| {
        if is_root_switch(dir.file_name()?.to_str()?) {
            read_trimmed(&dir.join("unique_id")).map(|s| s.to_ascii_lowercase())
        } else {
            None
        }
    })
}

/// `0-0`, `1-0`, …: a domain's host router.
fn is_root_switch(name: &str) -> bool {
    name.split_once('-').is_some_and(|(domain, route)| {
        route == "0" && !domain.is_empty() && domain.chars().all(|c| c.is_ascii_digit())
    })
}

fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

/// This machine's host name, as a peer would see it.
pub fn local_host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|n| n.into_string().ok())
        .unwrap_or_else(|| "localhost".into())
}
