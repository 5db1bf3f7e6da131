//! The plan: the list of changes that would bring this host's links and kernel settings to
//! what tbrdma wants. Computing it reads state and changes nothing; an empty plan means the
//! host is already set up, which is what makes `setup` idempotent.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::cables::{Cable, cables};
use crate::error::Result;
use crate::inventory::Inventory;
use crate::setup::persist::{Persist, persist_files};
use crate::setup::step::Step;
use crate::setup::tuning::{INTERFACE_KNOBS, SYSCTLS};
// Where `doctor` reads current values from (it imports it from here).
use crate::setup::step::read_u64;

/// What to plan for.
#[derive(Debug, Clone)]
pub struct SetupOptions {
    /// MTU to set on every link instead of the driver's maximum.
    pub mtu: Option<u32>,
    /// Also write persistent configuration.
    pub persist: Option<Persist>,
    /// Where `/proc` is (tests use a fake one).
    pub proc_root: PathBuf,
    /// Root under which persistent files are written (`/` normally).
    pub persist_root: PathBuf,
    /// The cluster's hostfile, when this host should relay for ranks that share no cable (a
    /// ring of 4 or more): forwarding, loose reverse-path filtering and host routes
    /// (`setup::relay`).
    pub relay: Option<crate::hostfile::Hostfile>,
}

impl Default for SetupOptions {
    fn default() -> Self {
        Self {
            mtu: None,
            persist: None,
            proc_root: PathBuf::from("/proc"),
            persist_root: PathBuf::from("/"),
            relay: None,
        }
    }
}

/// The changes, plus notes on what was deliberately left alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Changes in the order they are applied.
    pub steps: Vec<Step>,
    /// Things the reader should know (skipped settings, foreign addresses).
    pub notes: Vec<String>,
}

impl Plan {
    /// True when nothing needs to change.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.steps.is_empty() {
            writeln!(f, "plan: nothing to do")?;
        } else {
            writeln!(f, "plan ({} steps):", self.steps.len())?;
            for (i, step) in self.steps.iter().enumerate() {
                writeln!(f, "  {:>2}. {step}", i + 1)?;
                if let Step::WriteFile { contents, .. } = step {
                    for line in contents.lines() {
                        writeln!(f, "        | {line}")?;
                    }
                }
            }
        }
        for note in &self.notes {
            writeln!(f, "  note: {note}")?;
        }
        Ok(())
    }
}

/// Computes the plan for `inventory`, reading current kernel settings under
/// `options.proc_root` and the sysfs values already in the inventory.
pub fn plan(inventory: &Inventory, options: &SetupOptions) -> Result<Plan> {
    let mut plan = Plan::default();
    if inventory.links.is_empty() {
        plan.notes.push(
            "no Thunderbolt links found: check the cable, `modprobe thunderbolt-net`, and `boltctl` authorisation (docs/setup.md)"
                .into(),
        );
        return Ok(plan);
    }
    let cables = cables(inventory)?;
    for link in &inventory.links {
        if !link.admin_up {
            plan.steps.push(Step::LinkUp {
                interface: link.interface.clone(),
            });
        }
        if let Some(to) = options.mtu.or(link.target_mtu) {
            if link.mtu != to {
                plan.steps.push(Step::SetMtu {
                    interface: link.interface.clone(),
                    from: link.mtu,
                    to,
                });
            }
        }
        match cables.iter().find(|c| c.interface == link.interface) {
            Some(cable) => plan_address(&mut plan, link, cable),
            None => plan.notes.push(format!(
                "{}: peer unknown, no address assigned (name it in a links file)",
                link.interface
            )),
        }
    }
    plan_sysctls(&mut plan, &options.proc_root);
    for link in &inventory.links {
        for &(knob, value) in INTERFACE_KNOBS {
            let current = match knob {
                "napi_defer_hard_irqs" => link.napi_defer_hard_irqs,
                _ => link.gro_flush_timeout,
            };
            match current {
                Some(from) if from != value => plan.steps.push(Step::InterfaceKnob {
                    interface: link.interface.clone(),
                    knob: knob.into(),
                    from,
                    to: value,
                }),
                Some(_) => {}
                None => plan.notes.push(format!(
                    "{}: no {knob} in sysfs (kernel older than 5.9?), skipped",
                    link.interface
                )),
            }
        }
    }
    if let Some(hostfile) = &options.relay {
        plan_relay(&mut plan, inventory, hostfile, &options.proc_root)?;
    }
    if let Some(persist) = options.persist {
        for (path, contents) in persist_files(persist, inventory, &cables, options.mtu)? {
            let path = options
                .persist_root
                .join(path.strip_prefix("/").unwrap_or(&path));
            if std::fs::read_to_string(&path).ok().as_deref() != Some(contents.as_str()) {
                plan.steps.push(Step::WriteFile { path, contents });
            }
        }
    }
    Ok(plan)
}

fn plan_relay(
    plan: &mut Plan,
    inventory: &Inventory,
    hostfile: &crate::hostfile::Hostfile,
    proc_root: &Path,
) -> Result<()> {
    let Some(rank) = hostfile
        .ranks
        .iter()
        .find(|r| inventory.host_uuids.contains(&r.uuid))
        .map(|r| r.rank)
    else {
        plan.notes.push(
            "relay: this host is not in the hostfile (no rank has its UUID); no routes planned"
                .into(),
        );
        return Ok(());
    };
    if hostfile.topology.kind != crate::hostfile::TopologyKind::Ring {
        plan.notes.push(format!(
            "relay: a {} shares a cable between every two ranks; nothing to relay",
            hostfile.topology.kind
        ));
        return Ok(());
    }
    let existing = crate::netlink::Netlink::open()?.ipv4_host_routes()?;
    let steps = crate::setup::relay::relay_steps(hostfile, rank, proc_root, &existing);
    if let Some(undo) = crate::setup::relay::undo_hint(&steps) {
        plan.notes.push(format!(
            "relay: rank {rank} forwards for the ranks it is between and routes to the ranks it has no cable to; to undo: {undo}"
        ));
    }
    plan.steps.extend(steps);
    Ok(())
}

fn plan_address(plan: &mut Plan, link: &crate::inventory::Link, cable: &Cable) {
    let wanted = (cable.addresses.local, crate::addressing::PREFIX_LEN);
    if !link.addresses.contains(&wanted) {
        plan.steps.push(Step::AddAddress {
            interface: link.interface.clone(),
            address: wanted.0,
            prefix_len: wanted.1,
            peer_address: cable.addresses.peer,
            peer_name: cable.peer.name.clone(),
        });
    }
    for &(address, prefix) in &link.addresses {
        if (address, prefix) != wanted {
            plan.notes.push(format!(
                "{}: also has {address}/{prefix}, not from this plan; left alone",
                link.interface
            ));
        }
    }
}

fn plan_sysctls(plan: &mut Plan, proc_root: &Path) {
    for target in SYSCTLS {
        let path = proc_root.join("sys").join(target.relative_path());
        match read_u64(&path) {
            Some(current) if !target.satisfied_by(current) && !is_writable(&path) => {
                plan.notes.push(format!(
                    "{} is {current}, but host-wide and read-only here (a network namespace?): set it from the host",
                    target.key
                ))
            }
            Some(current) if !target.satisfied_by(current) => plan.steps.push(Step::Sysctl {
                key: target.key.into(),
                from: current,
                to: target.value,
            }),
            Some(_) => {}
            None => plan.notes.push(format!(
                "{} is not visible here (host-wide, and this is a network namespace?): skipped",
                target.key
            )),
        }
    }
}

/// Child network namespaces show some host-wide sysctls read-only (mode 0444).
fn is_writable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o222 != 0)
}
