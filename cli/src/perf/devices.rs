//! `tbrdma devices`: the links tbrdma can use, like `ibv_devices` + `ibv_devinfo`. Lists the
//! Thunderbolt links detection finds (or those a links file names, as the lab sets up), plus
//! every up non-loopback interface with an IPv4 address, with what netlink and sysfs say about
//! each, and the engine features the kernel probe finds. It only reads.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;

use clap::Args;
use serde::Serialize;
use tbrdma_engine::probe::{self, KernelFeatures};
use tbrdma_netdev::detect::Detector;
use tbrdma_netdev::inventory::{Link, THUNDERBOLT_NET_DRIVER};
use tbrdma_netdev::links_file::{LINKS_ENV, LinksFile};
use tbrdma_netdev::netlink::Netlink;

/// `tbrdma devices`.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  tbrdma devices
  tbrdma devices --json | jq '.devices[].interface'
  tbrdma lab exec 0 -- tbrdma devices     # inside rank 0 of the lab")]
pub struct DevicesArgs {
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct DeviceInfo {
    interface: String,
    driver: String,
    thunderbolt: bool,
    /// Detection (Thunderbolt or a links file) names it as a cable.
    detected_link: bool,
    state: String,
    mtu: u32,
    addresses: Vec<String>,
    speed_mbps: Option<u64>,
}

#[derive(Debug, Serialize)]
struct FeatureJson {
    available: bool,
    since: &'static str,
    detail: String,
}

#[derive(Debug, Serialize)]
struct KernelJson {
    release: String,
    engine: &'static str,
    features: std::collections::BTreeMap<&'static str, FeatureJson>,
}

#[derive(Debug, Serialize)]
struct DevicesJson {
    devices: Vec<DeviceInfo>,
    kernel: KernelJson,
}

fn read_sys(interface: &str, file: &str) -> Option<String> {
    std::fs::read_to_string(Path::new("/sys/class/net").join(interface).join(file))
        .ok()
        .map(|s| s.trim().to_string())
}

/// The driver sysfs names; `virtual` for an interface without a device (veth, bridges).
fn driver_of(interface: &str) -> Option<String> {
    let dir = Path::new("/sys/class/net").join(interface);
    if !dir.exists() {
        return None;
    }
    match std::fs::read_link(dir.join("device/driver")) {
        Ok(target) => target.file_name().map(|n| n.to_string_lossy().into_owned()),
        Err(_) if !dir.join("device").exists() => Some("virtual".to_string()),
        Err(_) => None,
    }
}

/// The links detection finds: Thunderbolt cables, or those a links file names (the lab's).
fn detected_links() -> Vec<Link> {
    let mut detector = Detector::new("/sys");
    if let Some(path) = std::env::var_os(LINKS_ENV) {
        match LinksFile::load(Path::new(&path)) {
            Ok(file) => detector.links_file = Some(file),
            Err(e) => eprintln!("ignoring {LINKS_ENV}: {e}"),
        }
    }
    match detector.detect() {
        Ok(inventory) => inventory.links,
        Err(e) => {
            eprintln!("link detection failed: {e}");
            Vec::new()
        }
    }
}

fn collect() -> anyhow::Result<Vec<DeviceInfo>> {
    let detected = detected_links();
    let netlink = Netlink::open()?;
    let mut devices = Vec::new();
    for state in netlink.links()? {
        let addrs = netlink.ipv4_addresses(state.index)?;
        let found = detected.iter().find(|l| l.interface == state.name);
        let usable = state.up && !addrs.is_empty() && !addrs.iter().all(|(a, _)| a.is_loopback());
        if found.is_none() && !usable {
            continue;
        }
        let driver = driver_of(&state.name)
            .or_else(|| found.and_then(|l| l.driver.clone()))
            .unwrap_or_else(|| "unknown".to_string());
        let operstate = read_sys(&state.name, "operstate")
            .unwrap_or_else(|| if state.up { "up" } else { "down" }.to_string());
        let speed = read_sys(&state.name, "speed")
            .and_then(|s| s.parse::<i64>().ok())
            .filter(|&s| s > 0)
            .map(|s| s as u64);
        devices.push(DeviceInfo {
            interface: state.name.clone(),
            thunderbolt: driver == THUNDERBOLT_NET_DRIVER,
            driver,
            detected_link: found.is_some(),
            state: operstate,
            mtu: state.mtu,
            addresses: addrs.iter().map(|(a, p)| format!("{a}/{p}")).collect(),
            speed_mbps: speed,
        });
    }
    devices.sort_by(|a, b| (!a.detected_link, &a.interface).cmp(&(!b.detected_link, &b.interface)));
    Ok(devices)
}

/// Where a server listens when given neither `--bind` nor `--iface`: the first detected link
/// with an address, else the only usable interface.
pub fn default_listen_address() -> Option<Ipv4Addr> {
    let devices = collect().ok()?;
    let first = |d: &DeviceInfo| {
        d.addresses
            .first()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
    };
    if let Some(ip) = devices.iter().filter(|d| d.detected_link).find_map(first) {
        return Some(ip);
    }
    match devices.as_slice() {
        [only] => first(only),
        _ => None,
    }
}

/// Every link to the peer reached through `local` (an interface name or one of its addresses):
/// the addresses to open as rails, `local`'s first, then the others by rail index (the order
/// both hosts see). A link whose peer is unknown has no siblings.
pub fn rails_with(local: &str) -> anyhow::Result<Vec<String>> {
    let links = detected_links();
    let matches =
        |l: &Link| l.interface == local || l.addresses.iter().any(|(a, _)| a.to_string() == local);
    let Some(first) = links.iter().find(|l| matches(l)) else {
        anyhow::bail!(
            "--rails: {local} is not on a detected link (a Thunderbolt cable, or one a links file names); see `tbrdma devices`"
        );
    };
    let address = |l: &Link| l.addresses.first().map(|(a, _)| a.to_string());
    let mut names = vec![address(first).unwrap_or_else(|| local.to_string())];
    let mut others: Vec<&Link> = links
        .iter()
        .filter(|l| l.interface != first.interface && first.peer.is_some() && l.peer == first.peer)
        .collect();
    others.sort_by(|a, b| (a.rail, &a.port, &a.interface).cmp(&(b.rail, &b.port, &b.interface)));
    names.extend(others.into_iter().filter_map(address));
    Ok(names)
}

fn engine_name(kernel: &KernelFeatures) -> &'static str {
    if kernel.uring_usable() {
        "uring"
    } else {
        "sockets"
    }
}

/// Runs `tbrdma devices`.
pub fn run(args: DevicesArgs) -> anyhow::Result<()> {
    let devices = collect()?;
    let kernel = probe::probe();
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let json = DevicesJson {
            devices,
            kernel: KernelJson {
                release: kernel.kernel_release.clone(),
                engine: engine_name(&kernel),
                features: kernel
                    .features()
                    .into_iter()
                    .map(|(name, f)| {
                        (
                            name,
                            FeatureJson {
                                available: f.available,
                                since: f.since,
                                detail: f.detail.clone(),
                            },
                        )
                    })
                    .collect(),
            },
        };
        let _ = writeln!(stdout, "{}", serde_json::to_string(&json)?);
        return Ok(());
    }
    let _ = writeln!(
        stdout,
        "{:<16} {:<16} {:<8} {:<6} {:<11} addresses",
        "interface", "driver", "state", "mtu", "speed"
    );
    if devices.is_empty() {
        let _ = writeln!(
            stdout,
            "(none: no Thunderbolt link and no up interface with an IPv4 address; see `tbrdma setup`)"
        );
    }
    for d in &devices {
        let speed = d
            .speed_mbps
            .map_or("-".to_string(), |s| format!("{s} Mb/s"));
        let mark = if d.detected_link {
            ""
        } else {
            "  (not a detected link)"
        };
        let _ = writeln!(
            stdout,
            "{:<16} {:<16} {:<8} {:<6} {:<11} {}{mark}",
            d.interface,
            d.driver,
            d.state,
            d.mtu,
            speed,
            d.addresses.join(",")
        );
    }
    let napi = if kernel.napi_registration.available {
        "io_uring NAPI busy-poll"
    } else if kernel.so_busy_poll.available {
        "SO_BUSY_POLL busy-poll"
    } else {
        "no busy-poll"
    };
    let _ = writeln!(
        stdout,
        "\nengine on these links: {} ({napi})\n{kernel}",
        engine_name(&kernel)
    );
    Ok(())
}
