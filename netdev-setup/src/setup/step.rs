//! The vocabulary of `setup`: one [`Step`] is one change, planned by `plan` (and `relay`) and
//! carried out by `apply`; [`read_u64`] reads the current value a step would change from.

use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// One change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Set `IFF_UP`.
    LinkUp {
        /// Interface.
        interface: String,
    },
    /// Change the MTU.
    SetMtu {
        /// Interface.
        interface: String,
        /// Current MTU.
        from: u32,
        /// New MTU.
        to: u32,
    },
    /// Add the cable's point-to-point address.
    AddAddress {
        /// Interface.
        interface: String,
        /// This end's address.
        address: Ipv4Addr,
        /// Prefix length.
        prefix_len: u8,
        /// The other end's address, for the reader.
        peer_address: Ipv4Addr,
        /// The other end's host name, for the reader.
        peer_name: String,
    },
    /// Write a sysctl.
    Sysctl {
        /// Dotted key.
        key: String,
        /// Current value.
        from: u64,
        /// New value.
        to: u64,
    },
    /// Write a per-interface sysfs knob.
    InterfaceKnob {
        /// Interface.
        interface: String,
        /// File name under `class/net/IFACE/`.
        knob: String,
        /// Current value.
        from: u64,
        /// New value.
        to: u64,
    },
    /// Add a host route to another rank's cable address through a neighbour (relaying in a
    /// ring, see `setup::relay`).
    AddRoute {
        /// The address (a /32).
        destination: Ipv4Addr,
        /// The neighbour's address on the cable the packets leave by.
        gateway: Ipv4Addr,
        /// That cable's interface.
        interface: String,
        /// The rank that owns the address, for the reader.
        owner: usize,
        /// The neighbour's rank, for the reader.
        via: usize,
    },
    /// Write a persistent configuration file.
    WriteFile {
        /// Absolute path.
        path: PathBuf,
        /// Full contents.
        contents: String,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::LinkUp { interface } => write!(f, "bring {interface} up"),
            Step::SetMtu {
                interface,
                from,
                to,
            } => {
                write!(f, "set MTU of {interface}: {from} -> {to}")
            }
            Step::AddAddress {
                interface,
                address,
                prefix_len,
                peer_address,
                peer_name,
            } => write!(
                f,
                "add {address}/{prefix_len} to {interface} (peer {peer_name} at {peer_address})"
            ),
            Step::Sysctl { key, from, to } => write!(f, "set {key}: {from} -> {to}"),
            Step::InterfaceKnob {
                interface,
                knob,
                from,
                to,
            } => {
                write!(f, "set {interface} {knob}: {from} -> {to}")
            }
            Step::AddRoute {
                destination,
                gateway,
                interface,
                owner,
                via,
            } => write!(
                f,
                "route {destination}/32 (rank {owner}) via {gateway} dev {interface} (rank {via})"
            ),
            Step::WriteFile { path, .. } => write!(f, "write {}", path.display()),
        }
    }
}

/// Reads a file holding one unsigned number.
pub fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}
