//! What a report says about one host: name, kernel, CPU, glibc, the links (`tbrdma devices
//! --json`) and the settings that move the figures (busy-poll sysctls, memlock, tbrdma's
//! environment variables).

use std::process::Command;

use serde_json::{Map, Value, json};

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn cpu_model() -> Option<String> {
    read("/proc/cpuinfo")?.lines().find_map(|l| {
        l.strip_prefix("model name")?
            .split_once(':')
            .map(|(_, v)| v.trim().to_owned())
    })
}

fn memlock() -> Value {
    use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit};
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, _)) if soft == RLIM_INFINITY => json!("unlimited"),
        Ok((soft, _)) => json!(soft),
        Err(_) => Value::Null,
    }
}

/// This host, as a JSON object.
pub fn describe() -> Value {
    let mut sysctls = Map::new();
    for key in ["busy_poll", "busy_read", "rmem_max", "wmem_max"] {
        let value = read(&format!("/proc/sys/net/core/{key}")).map_or(Value::Null, Value::String);
        sysctls.insert(format!("net.core.{key}"), value);
    }
    let env: Map<String, Value> = std::env::vars()
        .filter(|(k, _)| k.starts_with("TBRDMA_") || k.starts_with("NCCL_"))
        .map(|(k, v)| (k, Value::String(v)))
        .collect();
    let links = Command::new(std::env::current_exe().unwrap_or_else(|_| "tbrdma".into()))
        .args(["devices", "--json"])
        .output()
        .ok()
        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
        .unwrap_or(Value::Null);
    json!({
        "hostname": nix::unistd::gethostname().ok().map(|h| h.to_string_lossy().into_owned()),
        "kernel": read("/proc/sys/kernel/osrelease"),
        "cpu": cpu_model(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).ok(),
        "glibc": Command::new("ldd").arg("--version").output().ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).lines().next().map(str::to_owned)),
        "links": links,
        "settings": {
            "sysctls": sysctls,
            "memlock_bytes": memlock(),
            "environment": env,
        },
    })
}
