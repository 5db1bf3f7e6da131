//! What detection found: this host's identity and its links, with their current state. Plain
//! data; detection fills it in, the planner and `doctor` read it.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// The Linux driver name of Thunderbolt/USB4 networking.
pub const THUNDERBOLT_NET_DRIVER: &str = "thunderbolt-net";

/// The largest MTU `thunderbolt-net` accepts (`TBNET_MAX_MTU` in `drivers/net/thunderbolt`).
pub const THUNDERBOLT_MAX_MTU: u32 = 65522;

/// Who a host is: the Thunderbolt UUID (stable, unique, seen identically by its peers) and a
/// human name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIdentity {
    /// Lower-case UUID, as the Thunderbolt bus reports it.
    pub uuid: String,
    /// The host name (XDomain `device_name` as the peer sees it).
    pub name: String,
}

/// One network interface that is (or stands in for) a cable to a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Interface name, e.g. `thunderbolt0`.
    pub interface: String,
    /// The kernel driver bound to it, if sysfs says.
    pub driver: Option<String>,
    /// The host at the other end, when known.
    pub peer: Option<HostIdentity>,
    /// The local Thunderbolt port the cable is in (XDomain device name, e.g. `0-1`); orders
    /// several cables to the same peer.
    pub port: Option<String>,
    /// The UUID this host shows the peer on this cable: its Thunderbolt domain's, which
    /// differs between cables on separate USB4 host routers. `None`: the host's UUID.
    pub local_uuid: Option<String>,
    /// Explicit rail index among the cables to the same peer (links file); overrides `port`.
    pub rail: Option<u32>,
    /// Administratively up (`IFF_UP`).
    pub admin_up: bool,
    /// `operstate` as sysfs spells it (`up`, `down`, `lowerlayerdown`, …).
    pub operstate: String,
    /// Current MTU.
    pub mtu: u32,
    /// The MTU setup should set: the driver's maximum unless told otherwise.
    pub target_mtu: Option<u32>,
    /// IPv4 addresses with prefix lengths; only filled in when detection runs live.
    pub addresses: Vec<(Ipv4Addr, u8)>,
    /// `napi_defer_hard_irqs`, if the file exists.
    pub napi_defer_hard_irqs: Option<u64>,
    /// `gro_flush_timeout` in nanoseconds, if the file exists.
    pub gro_flush_timeout: Option<u64>,
}

impl Link {
    /// True when the kernel driver is `thunderbolt-net`.
    pub fn is_thunderbolt(&self) -> bool {
        self.driver.as_deref() == Some(THUNDERBOLT_NET_DRIVER)
    }
}

/// This host and its links.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    /// This host, when it could be determined (no Thunderbolt domain and no links file: none).
    pub host: Option<HostIdentity>,
    /// Every UUID this host answers to (one per Thunderbolt domain), sorted; `host.uuid` is
    /// the first.
    pub host_uuids: Vec<String>,
    /// Links, sorted by interface name.
    pub links: Vec<Link>,
}
