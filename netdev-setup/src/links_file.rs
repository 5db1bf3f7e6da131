//! The links file: names interfaces that are not Thunderbolt (veth in the lab, or any other
//! NIC a user wants to treat as a cable) together with the identities sysfs would otherwise
//! provide. The lab writes one per rank; users can write their own (`--links FILE`).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{NetdevError, Result};
use crate::inventory::HostIdentity;

/// Environment variable that points `setup`, `doctor` and `hostfile` at a links file;
/// `tbrdma lab exec` sets it so commands inside a lab rank see that rank's cables.
pub const LINKS_ENV: &str = "TBRDMA_LINKS";

/// A host identity and the cables it has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinksFile {
    /// This host.
    pub host: HostIdentity,
    /// Its cables.
    pub links: Vec<ExplicitLink>,
}

/// One cable named by hand.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExplicitLink {
    /// The local interface.
    pub interface: String,
    /// The host at the other end.
    pub peer: HostIdentity,
    /// Which of the cables to this peer this is (0, 1, …); both ends must agree.
    pub rail: u32,
    /// MTU to set; defaults to the interface's maximum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
}

impl LinksFile {
    /// Reads and checks a links file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::names::read_small_file(path)?;
        let file: LinksFile = serde_json::from_str(&text).map_err(|source| NetdevError::Json {
            path: path.to_owned(),
            what: "links file (see docs/setup.md)",
            source,
        })?;
        file.check()?;
        Ok(file)
    }

    /// Writes the file as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).expect("links file serializes");
        std::fs::write(path, text + "\n").map_err(|e| NetdevError::io("writing", path, e))
    }

    fn check(&self) -> Result<()> {
        use crate::names::{check_host_name, check_interface_name};
        check_host_name("links file: host name", &self.host.name)?;
        check_host_name("links file: host UUID", &self.host.uuid)?;
        let mut seen = std::collections::BTreeSet::new();
        for link in &self.links {
            check_interface_name(&link.interface)?;
            check_host_name("links file: peer name", &link.peer.name)?;
            check_host_name("links file: peer UUID", &link.peer.uuid)?;
            if !seen.insert((&link.peer.uuid, link.rail)) {
                return Err(NetdevError::bad_input(
                    format!(
                        "links file names rail {} to peer {} twice",
                        link.rail, link.peer.uuid
                    ),
                    "give each cable to the same peer its own rail number (0, 1, …)",
                ));
            }
            if link.peer.uuid.eq_ignore_ascii_case(&self.host.uuid) {
                return Err(NetdevError::bad_input(
                    format!(
                        "links file: {} has this host's own UUID as peer",
                        link.interface
                    ),
                    "set `peer.uuid` to the UUID of the host at the other end of the cable",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(interface: &str, peer_name: &str) -> String {
        serde_json::json!({
            "host": {"uuid": "0000aaaa-0000-4000-8000-000000000001", "name": "me"},
            "links": [{
                "interface": interface,
                "peer": {"uuid": "0000aaaa-0000-4000-8000-000000000002", "name": peer_name},
                "rail": 0
            }]
        })
        .to_string()
    }

    /// A links file is read by root tools that join its interface names into paths under /etc
    /// and /sys and into config files: a name that could escape them is refused on load.
    #[test]
    fn a_links_file_naming_an_unsafe_interface_or_host_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("links.json");
        std::fs::write(&path, file("veth0", "peer")).unwrap();
        assert_eq!(LinksFile::load(&path).unwrap().links[0].interface, "veth0");
        for (interface, peer) in [
            ("../../../etc/evil", "peer"),
            ("eth0\n[Network]", "peer"),
            ("eth*", "peer"),
            ("veth0", "peer\nDNS=1.2.3.4"),
        ] {
            std::fs::write(&path, file(interface, peer)).unwrap();
            let err = LinksFile::load(&path).unwrap_err().to_string();
            assert!(err.contains("not usable"), "{interface:?}: {err}");
        }
    }
}
