//! Named network namespaces, in the same place and form as `ip netns` keeps them (a bind
//! mount of the namespace under `/run/netns/NAME`), so `ip netns exec` works on them too.
//! Creating, entering and deleting them uses nix's safe wrappers for `unshare`, `setns` and
//! `mount`; this crate has no `unsafe`.
//!
//! Entering happens per thread: a network namespace belongs to a thread, so [`run_in`] runs
//! its closure on a fresh thread that enters the namespace and gets a private mount namespace
//! with its own `/sys`, exactly as `ip netns exec` sets up a child. The caller's thread and
//! every other thread stay where they were.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};

use crate::error::{NetdevError, Result};

/// Where named namespaces live.
pub const NETNS_DIR: &str = "/run/netns";

/// The bind-mount path of a named namespace.
pub fn path_of(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

/// Creates an empty network namespace called `name`. Fails if one exists.
pub fn create(name: &str) -> Result<()> {
    std::fs::create_dir_all(NETNS_DIR).map_err(|e| NetdevError::io("creating", NETNS_DIR, e))?;
    make_netns_dir_shared(name)?;
    let path = path_of(name);
    File::options()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| NetdevError::io("creating", &path, e))?;
    let bind = std::thread::scope(|scope| {
        scope
            .spawn(|| -> nix::Result<()> {
                // The new namespace is this thread's only; the bind mount keeps it alive after
                // the thread exits.
                unshare(CloneFlags::CLONE_NEWNET)?;
                mount(
                    Some("/proc/thread-self/ns/net"),
                    &path,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
            })
            .join()
            .expect("namespace thread does not panic")
    });
    bind.map_err(|source| {
        let _ = std::fs::remove_file(&path);
        if source == nix::Error::EPERM {
            NetdevError::NeedsRoot {
                step: format!("create network namespace {name}"),
            }
        } else {
            NetdevError::Namespace {
                name: name.into(),
                action: "create",
                source,
            }
        }
    })
}

/// Makes `/run/netns` a shared mount, as `ip netns add` does. Every thread or process that
/// enters a namespace gets a copy of the mount table, with a bind mount of *every* named
/// namespace in it; were those copies private, a long-running `lab exec` would keep other
/// labs' namespaces (and their interfaces) alive after `lab down`. Shared here and slave in the
/// copies, an unmount here reaches them all.
fn make_netns_dir_shared(name: &str) -> Result<()> {
    let shared = || {
        mount(
            None::<&str>,
            NETNS_DIR,
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    let result = match shared() {
        // Not a mount point yet: bind it onto itself first.
        Err(nix::Error::EINVAL) => mount(
            Some(NETNS_DIR),
            NETNS_DIR,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .and_then(|()| shared()),
        other => other,
    };
    result.map_err(|source| match source {
        nix::Error::EPERM => NetdevError::NeedsRoot {
            step: format!("create network namespace {name}"),
        },
        source => NetdevError::Namespace {
            name: name.into(),
            action: "share /run/netns",
            source,
        },
    })
}

/// Deletes a named namespace: unmounts and removes its file. The kernel frees it (and every
/// interface still in it) once no process is inside.
pub fn delete(name: &str) -> Result<()> {
    let path = path_of(name);
    match umount2(&path, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
        Err(source) => {
            return Err(NetdevError::Namespace {
                name: name.into(),
                action: "unmount",
                source,
            });
        }
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NetdevError::io("removing", &path, e)),
    }
}

/// Names of the namespaces in `/run/netns`, sorted.
pub fn list() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Opens a named namespace (for `setns` or to hand its fd to netlink).
pub fn open(name: &str) -> Result<File> {
    let path = path_of(name);
    File::open(&path).map_err(|e| NetdevError::io("opening namespace", &path, e))
}

/// Moves the calling thread into namespace `name`, with a private mount namespace whose
/// `/sys` shows that network namespace's interfaces.
pub fn enter_current_thread(name: &str) -> Result<()> {
    let file = open(name)?;
    let fail = |action, source| NetdevError::Namespace {
        name: name.into(),
        action,
        source,
    };
    setns(&file, CloneFlags::CLONE_NEWNET).map_err(|e| fail("enter", e))?;
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| fail("unshare mounts", e))?;
    // Keep our remount of /sys from propagating back to the host's mount namespace.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_SLAVE | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| fail("make mounts private", e))?;
    let _ = umount2("/sys", MntFlags::MNT_DETACH);
    mount(
        Some("sysfs"),
        "/sys",
        Some("sysfs"),
        MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| fail("mount sysfs", e))
}

/// Runs `f` on a new thread inside namespace `name` (see the module docs) and returns its
/// result.
pub fn run_in<T: Send>(name: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                enter_current_thread(name)?;
                f()
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Processes whose network namespace is `name`.
pub fn pids_in(name: &str) -> Vec<nix::unistd::Pid> {
    let Ok(target) = std::fs::metadata(path_of(name)) else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(ns) = std::fs::metadata(entry.path().join("ns/net")) else {
            continue;
        };
        if ns.ino() == target.ino() && ns.dev() == target.dev() {
            pids.push(nix::unistd::Pid::from_raw(pid));
        }
    }
    pids
}
