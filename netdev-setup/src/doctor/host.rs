//! Checks of the host around the links: io_uring, memlock, busy-poll settings, kernel version
//! against the engine's features, CPU frequency governor, the Thunderbolt controller's IRQs.

use std::fs;
use std::path::Path;

use crate::doctor::{Check, DoctorOptions, Status};
use crate::inventory::Inventory;
use crate::setup::step::read_u64;
use crate::setup::tuning::{INTERFACE_KNOBS, SYSCTLS};

/// Engine features and the kernel that has each (io_uring unless said otherwise).
const KERNEL_FEATURES: &[((u32, u32), &str)] = &[
    ((5, 19), "provided-buffer rings"),
    ((6, 0), "multishot receive and zero-copy send"),
    ((6, 1), "DEFER_TASKRUN rings"),
    ((6, 9), "NAPI busy-poll registration"),
];

/// Locked memory below this makes registering buffers fail early.
const MEMLOCK_WANTED: u64 = 1 << 30;

pub(super) fn checks(inventory: &Inventory, options: &DoctorOptions) -> Vec<Check> {
    let mut out = Vec::new();
    if options.live {
        out.push(io_uring());
        out.push(memlock());
    }
    out.extend(busy_poll(inventory, &options.proc_root));
    out.push(kernel(&options.proc_root));
    out.push(governor(&options.sysfs_root));
    out.push(irq_affinity(&options.sysfs_root, &options.proc_root));
    out
}

fn io_uring() -> Check {
    match io_uring::IoUring::new(8) {
        Ok(_) => Check::new("io_uring", Status::Pass, "a ring can be created"),
        Err(e) => Check::new("io_uring", Status::Warn, format!("blocked: {e}; tbrdma falls back to its slower socket engine"))
            .fix("set kernel.io_uring_disabled=0, or in a container use a seccomp profile that allows io_uring_setup"),
    }
}

fn memlock() -> Check {
    use nix::sys::resource::{Resource, getrlimit};
    let Ok((soft, _)) = getrlimit(Resource::RLIMIT_MEMLOCK) else {
        return Check::new("memlock limit", Status::Skip, "getrlimit failed");
    };
    let unlimited = soft == nix::sys::resource::RLIM_INFINITY;
    if unlimited || soft >= MEMLOCK_WANTED {
        let shown = if unlimited {
            "unlimited".to_string()
        } else {
            format!("{} MiB", soft >> 20)
        };
        Check::new("memlock limit", Status::Pass, shown)
    } else {
        Check::new(
            "memlock limit",
            Status::Warn,
            format!("{} KiB; pinned buffers need more", soft >> 10),
        )
        .fix(
            "add `* - memlock unlimited` to /etc/security/limits.d/90-tbrdma.conf and log in again",
        )
    }
}

fn busy_poll(inventory: &Inventory, proc_root: &Path) -> Vec<Check> {
    let mut out = Vec::new();
    for target in SYSCTLS {
        let path = proc_root.join("sys").join(target.relative_path());
        out.push(match read_u64(&path) {
            Some(v) if target.satisfied_by(v) => {
                Check::new(target.key, Status::Pass, v.to_string())
            }
            Some(v) => Check::new(
                target.key,
                Status::Warn,
                format!("{v}, want {}: {}", target.value, target.why),
            )
            .fix("run `sudo tbrdma setup` (in the host namespace: it is host-wide)"),
            None => Check::new(
                target.key,
                Status::Skip,
                "not visible here (host-wide; inside a network namespace?)",
            ),
        });
    }
    for link in &inventory.links {
        for &(knob, value) in INTERFACE_KNOBS {
            let current = if knob == "napi_defer_hard_irqs" {
                link.napi_defer_hard_irqs
            } else {
                link.gro_flush_timeout
            };
            let name = format!("{} {knob}", link.interface);
            out.push(match current {
                Some(v) if v == value => Check::new(name, Status::Pass, v.to_string()),
                Some(v) => Check::new(name, Status::Warn, format!("{v}, want {value}"))
                    .fix("run `sudo tbrdma setup`"),
                None => Check::new(name, Status::Skip, "not in sysfs (kernel older than 5.9?)"),
            });
        }
    }
    out
}

/// The busy-poll sysctls not set as `tbrdma setup` sets them, as `key=value` (empty when all
/// are, or when they are not visible here).
pub(super) fn busy_poll_off(proc_root: &Path) -> Vec<String> {
    SYSCTLS
        .iter()
        .filter(|target| target.key.contains("busy_"))
        .filter_map(|target| {
            let v = read_u64(&proc_root.join("sys").join(target.relative_path()))?;
            (!target.satisfied_by(v)).then(|| format!("{}={v}", target.key))
        })
        .collect()
}

/// The Thunderbolt link rate under `interface` in Gbit/s: the XDomain's lanes × lane speed (the
/// slower direction), when sysfs has them (a veth in the lab has none).
pub(super) fn link_gbps(sysfs_root: &Path, interface: &str) -> Option<f64> {
    let device =
        fs::canonicalize(sysfs_root.join("class/net").join(interface).join("device")).ok()?;
    let speed = |dir: &Path, dirn: &str| -> Option<f64> {
        let text = fs::read_to_string(dir.join(format!("{dirn}_speed"))).ok()?;
        let gbps: f64 = text.split_whitespace().next()?.parse().ok()?;
        let lanes: f64 = fs::read_to_string(dir.join(format!("{dirn}_lanes")))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        Some(gbps * lanes)
    };
    device
        .ancestors()
        .take(3)
        .find_map(|dir| Some(speed(dir, "rx")?.min(speed(dir, "tx")?)))
}

fn kernel(proc_root: &Path) -> Check {
    let release = fs::read_to_string(proc_root.join("sys/kernel/osrelease")).unwrap_or_default();
    let release = release.trim();
    let Some(version) = parse_version(release) else {
        return Check::new(
            "kernel version",
            Status::Skip,
            format!("cannot parse `{release}`"),
        );
    };
    let missing: Vec<String> = KERNEL_FEATURES
        .iter()
        .filter(|(needs, _)| version < *needs)
        .map(|((major, minor), what)| format!("{what} ({major}.{minor}+)"))
        .collect();
    if missing.is_empty() {
        Check::new(
            "kernel version",
            Status::Pass,
            format!("{release}: every engine feature available"),
        )
    } else {
        Check::new(
            "kernel version",
            Status::Warn,
            format!("{release} lacks {}", missing.join(", ")),
        )
        .fix("upgrade to Linux 6.9 or newer (Fedora and Ubuntu 24.10+ ship it)")
    }
}

/// `6.18.44-fc` → (6, 18).
pub(super) fn parse_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn governor(sysfs_root: &Path) -> Check {
    let cpus = sysfs_root.join("devices/system/cpu");
    let mut governors: Vec<String> = fs::read_dir(&cpus)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_prefix("cpu")
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter_map(|e| fs::read_to_string(e.path().join("cpufreq/scaling_governor")).ok())
        .map(|g| g.trim().to_owned())
        .collect();
    governors.sort();
    governors.dedup();
    match governors.as_slice() {
        [] => Check::new(
            "CPU governor",
            Status::Skip,
            "no cpufreq in sysfs (virtual machine?)",
        ),
        [only] if only == "performance" => Check::new("CPU governor", Status::Pass, "performance"),
        _ => Check::new(
            "CPU governor",
            Status::Warn,
            format!(
                "{}: clocks drop between polls, adding latency",
                governors.join(", ")
            ),
        )
        .fix("sudo cpupower frequency-set -g performance"),
    }
}

fn irq_affinity(sysfs_root: &Path, proc_root: &Path) -> Check {
    const NAME: &str = "Thunderbolt IRQ affinity";
    let domains = sysfs_root.join("bus/thunderbolt/devices");
    let controllers: Vec<_> = fs::read_dir(&domains)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("domain"))
        .filter_map(|e| {
            fs::canonicalize(e.path())
                .ok()?
                .parent()
                .map(Path::to_path_buf)
        })
        .collect();
    if controllers.is_empty() {
        return Check::new(NAME, Status::Skip, "no Thunderbolt controller");
    }
    let online =
        fs::read_to_string(sysfs_root.join("devices/system/cpu/online")).unwrap_or_default();
    let mut spread = Vec::new();
    let mut pinned = Vec::new();
    for controller in controllers {
        for irq in fs::read_dir(controller.join("msi_irqs"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let irq = irq.file_name().to_string_lossy().into_owned();
            let list =
                fs::read_to_string(proc_root.join("irq").join(&irq).join("smp_affinity_list"))
                    .unwrap_or_default();
            if list.trim() == online.trim() {
                spread.push(irq);
            } else {
                pinned.push(format!("{irq}→{}", list.trim()));
            }
        }
    }
    if spread.is_empty() {
        Check::new(
            NAME,
            Status::Pass,
            if pinned.is_empty() {
                "no MSI IRQs listed".into()
            } else {
                pinned.join(", ")
            },
        )
    } else {
        Check::new(
            NAME,
            Status::Warn,
            format!(
                "IRQs {} may run on any CPU, including tbrdma's polling cores",
                spread.join(", ")
            ),
        )
        .fix(format!(
            "pin them off tbrdma's cores, e.g. `echo 0 | sudo tee /proc/irq/{}/smp_affinity_list`",
            spread[0]
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_kernel_releases() {
        assert_eq!(super::parse_version("6.18.44-fc-v595"), Some((6, 18)));
        assert_eq!(super::parse_version("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(super::parse_version("garbage"), None);
    }
}
