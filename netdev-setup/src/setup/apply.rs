//! Applying a plan: each step through netlink (links, addresses) or a single file write
//! (sysctls, sysfs knobs, persistent files). Stops at the first failure and names the step.

use std::io::ErrorKind;
use std::path::Path;

use crate::error::{NetdevError, Result};
use crate::netlink::Netlink;
use crate::setup::plan::Plan;
use crate::setup::step::Step;

/// Where sysctls and per-interface knobs are written.
#[derive(Debug, Clone)]
pub struct Roots<'a> {
    /// `/proc` (or a fake one).
    pub proc_root: &'a Path,
    /// `/sys` (or a fake one).
    pub sysfs_root: &'a Path,
}

/// Applies every step of `plan`, in order.
pub fn apply(plan: &Plan, roots: &Roots<'_>) -> Result<()> {
    let Some(first) = plan.steps.first() else {
        return Ok(());
    };
    if !nix::unistd::geteuid().is_root() {
        return Err(NetdevError::NeedsRoot {
            step: first.to_string(),
        });
    }
    let uses_netlink = plan.steps.iter().any(|s| {
        matches!(
            s,
            Step::LinkUp { .. }
                | Step::SetMtu { .. }
                | Step::AddAddress { .. }
                | Step::AddRoute { .. }
        )
    });
    let socket = if uses_netlink {
        Some(Netlink::open()?)
    } else {
        None
    };
    let netlink = || -> Result<&Netlink> { Ok(socket.as_ref().expect("opened when needed")) };
    for step in &plan.steps {
        match step {
            Step::LinkUp { interface } => netlink()?.set_up(interface)?,
            Step::SetMtu { interface, to, .. } => netlink()?.set_mtu(interface, *to)?,
            Step::AddAddress {
                interface,
                address,
                prefix_len,
                ..
            } => netlink()?.add_ipv4(interface, *address, *prefix_len)?,
            Step::AddRoute {
                destination,
                gateway,
                interface,
                ..
            } => netlink()?.replace_host_route(*destination, *gateway, interface)?,
            Step::Sysctl { key, to, .. } => {
                let path = roots.proc_root.join("sys").join(key.replace('.', "/"));
                write_value(&path, &to.to_string(), step)?;
            }
            Step::InterfaceKnob {
                interface,
                knob,
                to,
                ..
            } => {
                let path = roots
                    .sysfs_root
                    .join("class/net")
                    .join(interface)
                    .join(knob);
                write_value(&path, &to.to_string(), step)?;
            }
            Step::WriteFile { path, contents } => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| NetdevError::io("creating", dir, e))?;
                }
                write_value(path, contents, step)?;
                restrict_if_keyfile(path)?;
            }
        }
    }
    Ok(())
}

fn write_value(path: &Path, value: &str, step: &Step) -> Result<()> {
    std::fs::write(path, value).map_err(|e| match e.kind() {
        ErrorKind::PermissionDenied => NetdevError::NeedsRoot {
            step: step.to_string(),
        },
        _ => NetdevError::io("writing", path, e),
    })
}

/// NetworkManager ignores keyfiles that others can read.
fn restrict_if_keyfile(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if path.extension().is_some_and(|e| e == "nmconnection") {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| NetdevError::io("restricting", path, e))?;
    }
    Ok(())
}
