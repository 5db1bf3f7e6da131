//! `tbrdma doctor --nccl`: would NCCL and RCCL, started with this environment, load tbrdma's
//! plugin and use it? The file name each loader tries (`NCCL_NET_PLUGIN` semantics of
//! docs/nccl.md and the design notes, section 1.4), where `dlopen` would find it, whether it
//! loads, exports its tables and `init`s (in a child: `nccl_probe`), `NCCL_NET`, and the
//! locked-memory limit the plugin's pinned buffers need. Every failure carries its fix.

use std::path::{Path, PathBuf};
use std::process::Command;

use tbrdma_netdev::doctor::{Check, Status};

use crate::doctor::nccl_probe::Found;
use crate::install::PLUGIN_NAME;

/// Pinned memory per connection: 512 KiB of receive bounce buffers and 256 KiB of send
/// staging (shim/nccl's comm.rs), rounded up.
const PINNED_PER_CONNECTION: u64 = 1 << 20;
/// Connections of a large job: 32 channels × 2 directions × 4 peers.
const CONNECTIONS_PLANNED: u64 = 256;

const ENV_FILE_FIX: &str = "`. PREFIX/share/tbrdma/env.sh` (written by `tbrdma install`)";

/// Which loader.
#[derive(Debug, Clone, Copy)]
enum Loader {
    Nccl,
    Rccl,
}

impl Loader {
    fn name(self) -> &'static str {
        match self {
            Loader::Nccl => "NCCL",
            Loader::Rccl => "RCCL",
        }
    }
    fn prefix(self) -> &'static str {
        match self {
            Loader::Nccl => "libnccl-net",
            Loader::Rccl => "librccl-net",
        }
    }
}

/// The names `loader` passes to `dlopen`, in order, for this `NCCL_NET_PLUGIN` (unset: the
/// unsuffixed default; a comma-separated list as NCCL ≥ 2.27; a path or `lib*.so` as given,
/// anything else as given and then `<prefix>-X.so`).
fn candidates(loader: Loader, plugin: Option<&str>) -> Vec<String> {
    let Some(list) = plugin else {
        return vec![format!("{}.so", loader.prefix())];
    };
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        out.push(entry.to_owned());
        let literal = entry.contains('/') || (entry.starts_with("lib") && entry.ends_with(".so"));
        if !literal {
            out.push(format!("{}-{entry}.so", loader.prefix()));
        }
    }
    out
}

/// Where `dlopen(name)` would find `name`: a path as given; a bare name on `LD_LIBRARY_PATH`,
/// in the linker cache (`ldconfig -p`), then in the default folders.
fn resolve(name: &str, env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return p.is_file().then_some(p);
    }
    let mut dirs: Vec<PathBuf> = env("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    if let Some(cached) = ldconfig_cache(name) {
        dirs.push(cached.parent().map(Path::to_path_buf).unwrap_or_default());
    }
    for d in [
        "/lib64",
        "/usr/lib64",
        "/lib",
        "/usr/lib",
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

fn ldconfig_cache(name: &str) -> Option<PathBuf> {
    let out = Command::new("ldconfig").arg("-p").output().ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let (lib, path) = l.trim().split_once(" => ")?;
        (lib.split_whitespace().next()? == name).then(|| PathBuf::from(path.trim()))
    })
}

fn probe(path: &Path) -> Result<(Found, String), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .arg("nccl-probe")
        .arg(path)
        .output()
        .map_err(|e| format!("cannot run the probe: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    let found = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| serde_json::from_str::<Found>(l).ok());
    match found {
        Some(f) => Ok((f, stderr)),
        None => Err(format!(
            "the probe died ({}) loading {}: {}",
            out.status,
            path.display(),
            stderr.lines().last().unwrap_or("no message")
        )),
    }
}

/// Every `--nccl` check, reading the environment through `env`.
pub fn checks(env: &dyn Fn(&str) -> Option<String>) -> Vec<Check> {
    let mut out = Vec::new();
    let plugin = env("NCCL_NET_PLUGIN");
    out.push(match plugin.as_deref() {
        None => Check::new(
            "NCCL_NET_PLUGIN",
            Status::Fail,
            "unset: NCCL loads libnccl-net.so and RCCL librccl-net.so (or libnccl-net.so), which tbrdma does not install",
        )
        .fix(format!("export NCCL_NET_PLUGIN={PLUGIN_NAME}, or {ENV_FILE_FIX}")),
        Some(v) if v.trim().eq_ignore_ascii_case("none") => Check::new(
            "NCCL_NET_PLUGIN",
            Status::Fail,
            "`none`: NCCL ≥ 2.28 loads no external plugin",
        )
        .fix(format!("export NCCL_NET_PLUGIN={PLUGIN_NAME}")),
        Some(v) => Check::new("NCCL_NET_PLUGIN", Status::Pass, v.to_owned()),
    });
    out.push(match env("NCCL_NET") {
        None => Check::new(
            "NCCL_NET",
            Status::Warn,
            "unset: if the plugin fails, NCCL silently falls back to IB or TCP sockets",
        )
        .fix(format!("export NCCL_NET={PLUGIN_NAME}")),
        Some(v) if v.trim().eq_ignore_ascii_case(PLUGIN_NAME) => {
            Check::new("NCCL_NET", Status::Pass, v)
        }
        Some(v) => Check::new(
            "NCCL_NET",
            Status::Fail,
            format!("`{v}` selects another network: NCCL and RCCL will not use tbrdma"),
        )
        .fix(format!("export NCCL_NET={PLUGIN_NAME} (or unset it)")),
    });
    let mut probed: Option<PathBuf> = None;
    for loader in [Loader::Nccl, Loader::Rccl] {
        let names = candidates(loader, plugin.as_deref());
        let check = format!("{} finds the plugin", loader.name());
        let found = names.iter().find_map(|n| resolve(n, env).map(|p| (n, p)));
        let Some((name, path)) = found else {
            out.push(
                Check::new(
                    check,
                    Status::Fail,
                    format!("tries {}: none found on LD_LIBRARY_PATH, in the linker cache or the system folders", names.join(", ")),
                )
                .fix(format!("`sudo tbrdma install` (both file names), then {ENV_FILE_FIX} to put its lib/ on LD_LIBRARY_PATH")),
            );
            continue;
        };
        out.push(Check::new(
            check,
            Status::Pass,
            format!("{name} → {}", path.display()),
        ));
        out.extend(load_checks(loader, &path, probed.is_none()));
        probed.get_or_insert(path);
    }
    out.push(memlock());
    out
}

/// Loads `path` in a child; with `init`, reports `init` and `devices` as a check of its own.
fn load_checks(loader: Loader, path: &Path, init: bool) -> Vec<Check> {
    let name = format!("{} plugin loads", loader.name());
    let (found, stderr) = match probe(path) {
        Ok(f) => f,
        Err(e) => {
            return vec![Check::new(name, Status::Fail, e).fix("reinstall with `tbrdma install`; report a crash with the output of `tbrdma nccl-probe PATH`")];
        }
    };
    if !found.loaded {
        let error = found.error.unwrap_or_default();
        let fix = if error.contains("GLIBC_") {
            "this build needs a newer glibc (see share/tbrdma/GLIBC): build from source here (docs/install.md)"
        } else {
            "reinstall with `tbrdma install`"
        };
        return vec![Check::new(name, Status::Fail, format!("dlopen: {error}")).fix(fix)];
    }
    if found.name.as_deref() != Some(PLUGIN_NAME) {
        return vec![Check::new(
            name,
            Status::Fail,
            format!(
                "{} is another plugin (ncclNet_t.name {:?}, tables {:?})",
                path.display(),
                found.name.unwrap_or_default(),
                found.tables
            ),
        )
        .fix(format!("export NCCL_NET_PLUGIN={PLUGIN_NAME} and install tbrdma's plugin with `tbrdma install`"))];
    }
    let versions: Vec<&str> = found
        .tables
        .iter()
        .map(|t| t.trim_start_matches("ncclNetPlugin_"))
        .collect();
    let mut out = vec![Check::new(
        name,
        Status::Pass,
        format!(
            "dlopen ok; exports {}; name {PLUGIN_NAME}",
            versions.join(", ")
        ),
    )];
    if init {
        let check = "NCCL plugin init";
        let why = stderr.lines().last().unwrap_or("").to_owned();
        out.push(match (found.init, found.devices) {
            (Some(0), Some(n)) if n > 0 => Check::new(check, Status::Pass, format!("init ok; {n} device(s)")),
            (Some(0), Some(_)) => Check::new(check, Status::Fail, format!("init ok but no devices: NCCL disables the plugin. {why}"))
                .fix("set TBRDMA_IFACES to the links' interfaces or addresses (`tbrdma devices` lists them)"),
            (rc, _) => Check::new(
                check,
                Status::Fail,
                format!("init failed (ncclResult_t {}): {why}{}", rc.map_or("?".into(), |r| r.to_string()), found.error.map(|e| format!(" {e}")).unwrap_or_default()),
            )
            .fix("set TBRDMA_IFACES to the links' interfaces or addresses (`tbrdma devices` lists them) and check them with `tbrdma doctor`"),
        });
    }
    out
}

fn memlock() -> Check {
    use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit};
    const NAME: &str = "memlock for the plugin";
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_MEMLOCK) else {
        return Check::new(NAME, Status::Skip, "getrlimit failed");
    };
    let wanted = PINNED_PER_CONNECTION * CONNECTIONS_PLANNED;
    let show = |v: u64| {
        if v == RLIM_INFINITY {
            "unlimited".to_owned()
        } else {
            format!("{} KiB", v >> 10)
        }
    };
    let fix = if hard == RLIM_INFINITY || hard >= wanted {
        "`ulimit -l unlimited` in the job script (the hard limit allows it)"
    } else {
        "docker/podman: `--ulimit memlock=-1:-1`; bare metal: `* - memlock unlimited` in /etc/security/limits.d/90-tbrdma.conf and log in again"
    };
    let connections = if soft == RLIM_INFINITY {
        u64::MAX
    } else {
        soft / PINNED_PER_CONNECTION
    };
    if soft == RLIM_INFINITY || soft >= wanted {
        Check::new(
            NAME,
            Status::Pass,
            format!(
                "{} (the plugin pins about 1 MiB per connection)",
                show(soft)
            ),
        )
    } else if connections < 8 {
        Check::new(
            NAME,
            Status::Fail,
            format!("{} (hard {}): room for {connections} connections at about 1 MiB pinned each; a job needs 2 per channel and peer", show(soft), show(hard)),
        )
        .fix(fix)
    } else {
        Check::new(
            NAME,
            Status::Warn,
            format!("{} (hard {}): room for {connections} connections; large jobs open up to {CONNECTIONS_PLANNED}", show(soft), show(hard)),
        )
        .fix(fix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_follow_the_loaders() {
        assert_eq!(candidates(Loader::Nccl, None), ["libnccl-net.so"]);
        assert_eq!(
            candidates(Loader::Rccl, Some("tbrdma")),
            ["tbrdma", "librccl-net-tbrdma.so"]
        );
        assert_eq!(
            candidates(Loader::Nccl, Some("/opt/x/libnccl-net-tbrdma.so")),
            ["/opt/x/libnccl-net-tbrdma.so"]
        );
        assert_eq!(
            candidates(Loader::Nccl, Some("ofi,tbrdma")),
            [
                "ofi",
                "libnccl-net-ofi.so",
                "tbrdma",
                "libnccl-net-tbrdma.so"
            ]
        );
    }

    #[test]
    fn nccl_net_naming_another_network_fails_with_its_fix() {
        let env = |k: &str| match k {
            "NCCL_NET" => Some("Socket".to_owned()),
            "NCCL_NET_PLUGIN" => Some("/nonexistent/libnccl-net-tbrdma.so".to_owned()),
            _ => None,
        };
        let checks = checks(&env);
        let net = checks.iter().find(|c| c.name == "NCCL_NET").unwrap();
        assert_eq!(net.status, Status::Fail);
        assert!(net.fix.as_deref().unwrap().contains("NCCL_NET=tbrdma"));
        let found = checks
            .iter()
            .find(|c| c.name == "NCCL finds the plugin")
            .unwrap();
        assert_eq!(found.status, Status::Fail);
    }
}
