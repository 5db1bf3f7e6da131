//! `lab down`: removes every namespace of a lab, and the interfaces and processes inside, and
//! its state directory. It derives what to remove from the state file and from the namespace
//! names, and touches nothing else.

use crate::error::{NetdevError, Result};
use crate::lab::check_name;
use crate::lab::state::{LabState, is_lab_namespace, lab_dir};
use crate::netlink::Netlink;
use crate::netns;

/// Removes lab `name`. Returns 0 when nothing of it was there, otherwise the number of
/// namespaces removed (at least 1, so a lab with only a stale state directory counts).
pub fn down(name: &str) -> Result<usize> {
    check_name(name)?;
    let mut namespaces: Vec<String> = netns::list()
        .into_iter()
        .filter(|ns| is_lab_namespace(name, ns))
        .collect();
    if let Some(state) = LabState::load(name).ok().flatten() {
        namespaces.extend(
            state
                .namespaces
                .into_iter()
                .filter(|ns| is_lab_namespace(name, ns)),
        );
    }
    namespaces.sort();
    namespaces.dedup();
    let dir = lab_dir(name);
    if namespaces.is_empty() && !dir.exists() {
        return Ok(0);
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(NetdevError::NeedsRoot {
            step: format!("lab down (delete lab {name}'s namespaces)"),
        });
    }
    let mut removed = 0;
    for namespace in &namespaces {
        if !netns::path_of(namespace).exists() {
            continue;
        }
        kill_processes_in(namespace);
        // Deleting the veths ourselves makes removal synchronous; the kernel would otherwise
        // free them a little later, when the namespace goes.
        let _ = netns::run_in(namespace, || {
            let netlink = Netlink::open()?;
            for link in netlink.links()? {
                if link.name.starts_with("tbl-") {
                    let _ = netlink.delete(&link.name);
                }
            }
            Ok(())
        });
        netns::delete(namespace)?;
        removed += 1;
    }
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(NetdevError::io("removing", dir, e)),
    }
    Ok(removed.max(1))
}

/// Kills what `lab exec` left running in a lab namespace; nothing outside it is touched.
fn kill_processes_in(namespace: &str) {
    let me = nix::unistd::getpid();
    let pids: Vec<_> = netns::pids_in(namespace)
        .into_iter()
        .filter(|p| *p != me)
        .collect();
    for pid in &pids {
        let _ = nix::sys::signal::kill(*pid, nix::sys::signal::Signal::SIGKILL);
    }
    for _ in 0..50 {
        if netns::pids_in(namespace).iter().all(|p| *p == me) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
