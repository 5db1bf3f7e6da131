//! Where a lab keeps its files, what `state.json` records, and the names it gives things.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{NetdevError, Result};
use crate::lab::LabTopology;

/// Parent of every lab's state directory.
pub const STATE_ROOT: &str = "/run/tbrdma-lab";

/// What `lab up` built (written before it builds anything, updated when done).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabState {
    /// Lab name.
    pub name: String,
    /// Number of ranks.
    pub ranks: usize,
    /// Topology.
    pub topology: LabTopology,
    /// Cables between each pair of neighbours.
    pub rails: u32,
    /// veth MTU.
    pub mtu: u32,
    /// Namespaces the lab owns.
    pub namespaces: Vec<String>,
    /// `creating` until `up` finished, then `up`.
    pub status: String,
}

/// The lab's state directory.
pub fn lab_dir(name: &str) -> PathBuf {
    Path::new(STATE_ROOT).join(name)
}

/// The lab's hostfile.
pub fn hostfile_path(name: &str) -> PathBuf {
    lab_dir(name).join("hostfile.json")
}

/// Rank `rank`'s links file.
pub fn links_path(name: &str, rank: usize) -> PathBuf {
    lab_dir(name).join(format!("rank{rank}.links.json"))
}

/// Rank `rank`'s namespace.
pub fn namespace_name(name: &str, rank: usize) -> String {
    format!("tbl-{name}-r{rank}")
}

/// True when `namespace` is one of lab `name`'s (`tbl-NAME-r<digits>`): exact, so lab `a`
/// never matches lab `a-2`'s namespaces.
pub fn is_lab_namespace(name: &str, namespace: &str) -> bool {
    namespace
        .strip_prefix(&format!("tbl-{name}-r"))
        .is_some_and(|rank| !rank.is_empty() && rank.chars().all(|c| c.is_ascii_digit()))
}

/// The interface in rank `from`'s namespace for rail `rail` of the cable to rank `to`.
pub fn interface_name(to: usize, rail: u32) -> String {
    format!("tbl-p{to}-{rail}")
}

impl LabState {
    /// Reads a lab's state, or `None` if it has none.
    pub fn load(name: &str) -> Result<Option<Self>> {
        let path = lab_dir(name).join("state.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|source| NetdevError::Json {
                    path,
                    what: "lab state file",
                    source,
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(NetdevError::io("reading", path, e)),
        }
    }

    /// Writes the state file.
    pub fn save(&self) -> Result<()> {
        let dir = lab_dir(&self.name);
        std::fs::create_dir_all(&dir).map_err(|e| NetdevError::io("creating", &dir, e))?;
        let path = dir.join("state.json");
        let text = serde_json::to_string_pretty(self).expect("state serializes");
        std::fs::write(&path, text).map_err(|e| NetdevError::io("writing", path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lab_namespaces_match_exactly() {
        assert!(is_lab_namespace("lab", "tbl-lab-r0"));
        assert!(is_lab_namespace("lab", "tbl-lab-r12"));
        assert!(
            !is_lab_namespace("lab", "tbl-lab-2-r0"),
            "lab-2 is another lab"
        );
        assert!(!is_lab_namespace("lab", "tbl-lab-r"));
        assert!(!is_lab_namespace("lab", "tbl-lab-rx"));
        assert!(!is_lab_namespace("lab", "other"));
    }

    #[test]
    fn interface_names_fit_ifnamsiz() {
        assert!(interface_name(63, 7).len() < 16);
    }
}
