//! The virtual lab: N network namespaces joined by veth "cables", configured by the same
//! planner `setup` uses, with a hostfile in the format `tbrdma hostfile` writes.
//!
//! Everything a lab creates carries its name: namespaces are `tbl-NAME-rK`, and the state
//! directory `/run/tbrdma-lab/NAME/` holds `state.json`, one links file per rank and the
//! hostfile. The veth ends are created directly inside the lab's namespaces, never in the
//! host's, so deleting the namespaces deletes every interface the lab made. `lab down` finds
//! what to delete from the state file *and* from the namespace names, so a lab whose `up`
//! crashed half-way is still cleaned up.

pub mod down;
pub mod exec;
pub mod state;
pub mod topology;
pub mod up;

pub use down::down;
pub use exec::exec;
pub use state::{LabState, hostfile_path, lab_dir, links_path, namespace_name};
pub use topology::LabTopology;
pub use up::{LabOptions, up};

use crate::error::{NetdevError, Result};

/// The default lab name.
pub const DEFAULT_NAME: &str = "lab";

/// veth MTU unless told otherwise: close to `thunderbolt-net`'s 65522 and valid for veth.
pub const DEFAULT_MTU: u32 = 65_520;

/// Checks a lab name: it becomes part of namespace names and paths.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 24
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(NetdevError::bad_input(
            format!("lab name `{name}` is not usable"),
            "use 1-24 characters from a-z, 0-9 and '-', not starting with '-'",
        ))
    }
}
