//! Persistent configuration: the files that make a reboot (or a re-plug) come back to what
//! `setup` applied, for systemd-networkd or NetworkManager. Only file contents are produced
//! here; the plan decides whether each needs writing and `apply` writes it.
//!
//! Interfaces are matched by name, which `thunderbolt-net` hands out in probe order: after
//! re-cabling, run `tbrdma setup --persist …` again.

use std::fmt::Write as _;
use std::path::PathBuf;

use crate::cables::Cable;
use crate::error::Result;
use crate::inventory::Inventory;
use crate::setup::tuning::{INTERFACE_KNOBS, SYSCTLS};

/// Which network manager owns the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Persist {
    /// systemd-networkd `.network` files (Ubuntu Server, Arch, …).
    Networkd,
    /// NetworkManager keyfiles (Fedora, Ubuntu Desktop, …).
    Nm,
}

/// Every file to write, as (absolute path, contents). `mtu` is the MTU asked for on every link
/// (`SetupOptions::mtu`); without it each link keeps its target or current MTU.
pub fn persist_files(
    persist: Persist,
    inventory: &Inventory,
    cables: &[Cable],
    mtu: Option<u32>,
) -> Result<Vec<(PathBuf, String)>> {
    let mut files = Vec::new();
    for link in &inventory.links {
        let mtu = mtu.or(link.target_mtu).unwrap_or(link.mtu);
        let address = cables
            .iter()
            .find(|c| c.interface == link.interface)
            .map(|c| format!("{}/{}", c.addresses.local, crate::addressing::PREFIX_LEN));
        let name = &link.interface;
        // The name becomes part of a path under /etc and a line of a config file.
        crate::names::check_interface_name(name)?;
        let (path, contents) = match persist {
            Persist::Networkd => {
                let mut text = format!(
                    "# Written by `tbrdma setup --persist networkd`.\n[Match]\nName={name}\n\n[Link]\nMTUBytes={mtu}\n\n[Network]\nLinkLocalAddressing=no\n"
                );
                if let Some(address) = &address {
                    let _ = writeln!(text, "Address={address}");
                }
                (
                    format!("/etc/systemd/network/50-tbrdma-{name}.network"),
                    text,
                )
            }
            Persist::Nm => {
                let mut text = format!(
                    "# Written by `tbrdma setup --persist nm`.\n[connection]\nid=tbrdma-{name}\ntype=ethernet\ninterface-name={name}\nautoconnect=true\n\n[ethernet]\nmtu={mtu}\n\n[ipv4]\n"
                );
                match &address {
                    Some(address) => {
                        let _ = writeln!(text, "method=manual\naddress1={address}");
                    }
                    None => text.push_str("method=disabled\n"),
                }
                text.push_str("\n[ipv6]\nmethod=disabled\n");
                (
                    format!("/etc/NetworkManager/system-connections/tbrdma-{name}.nmconnection"),
                    text,
                )
            }
        };
        files.push((PathBuf::from(path), contents));
    }
    let mut sysctl = String::from("# Written by `tbrdma setup --persist`.\n");
    for target in SYSCTLS {
        let _ = writeln!(sysctl, "{} = {}", target.key, target.value);
    }
    files.push((PathBuf::from("/etc/sysctl.d/90-tbrdma.conf"), sysctl));
    let mut udev =
        String::from("# Written by `tbrdma setup --persist`: NAPI knobs for busy-polling.\n");
    let attrs: Vec<String> = INTERFACE_KNOBS
        .iter()
        .map(|(knob, value)| format!("ATTR{{{knob}}}=\"{value}\""))
        .collect();
    let _ = writeln!(
        udev,
        "ACTION==\"add\", SUBSYSTEM==\"net\", DRIVERS==\"thunderbolt-net\", {}",
        attrs.join(", ")
    );
    for link in inventory.links.iter().filter(|l| !l.is_thunderbolt()) {
        let _ = writeln!(
            udev,
            "ACTION==\"add\", SUBSYSTEM==\"net\", KERNEL==\"{}\", {}",
            link.interface,
            attrs.join(", ")
        );
    }
    files.push((PathBuf::from("/etc/udev/rules.d/90-tbrdma.rules"), udev));
    Ok(files)
}
