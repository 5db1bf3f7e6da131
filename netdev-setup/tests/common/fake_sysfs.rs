//! Builds fake sysfs and procfs trees shaped like a real host's: a Thunderbolt domain under a
//! PCI controller, one XDomain (remote host) per cable with a `thunderbolt-net` service, and
//! the netdev under it, linked from `class/net`. Detection must not tell them from the real
//! thing.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// A fake `/sys` and `/proc` in a temporary directory.
pub struct FakeHost {
    dir: tempfile::TempDir,
}

/// How a fake interface starts out.
pub struct IfaceState {
    pub up: bool,
    pub mtu: u32,
}

impl IfaceState {
    pub const FRESH: IfaceState = IfaceState {
        up: true,
        mtu: 1500,
    };
    pub const DOWN: IfaceState = IfaceState {
        up: false,
        mtu: 1500,
    };
}

const CONTROLLER: &str = "devices/pci0000:00/0000:00:0d.2";
const SECOND_CONTROLLER: &str = "devices/pci0000:00/0000:00:0d.3";

impl FakeHost {
    /// A host with Thunderbolt UUID `uuid` (pass `None` for a host without Thunderbolt).
    pub fn new(uuid: Option<&str>) -> Self {
        let host = FakeHost {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        fs::create_dir_all(host.sys().join("class/net")).unwrap();
        for (key, value) in [
            ("busy_poll", "0"),
            ("busy_read", "0"),
            ("rmem_max", "212992"),
            ("wmem_max", "212992"),
        ] {
            write(&host.proc().join("sys/net/core").join(key), value);
        }
        write(
            &host.proc().join("sys/kernel/osrelease"),
            "6.8.0-45-generic",
        );
        if let Some(uuid) = uuid {
            let domain = host.sys().join(CONTROLLER).join("domain0");
            write(&domain.join("0-0/unique_id"), uuid);
            let bus = host.sys().join("bus/thunderbolt/devices");
            fs::create_dir_all(&bus).unwrap();
            symlink(&domain, bus.join("domain0")).unwrap();
            symlink(domain.join("0-0"), bus.join("0-0")).unwrap();
            fs::create_dir_all(host.sys().join("bus/thunderbolt/drivers/thunderbolt-net")).unwrap();
        }
        host
    }

    pub fn sys(&self) -> PathBuf {
        self.dir.path().join("sys")
    }

    pub fn proc(&self) -> PathBuf {
        self.dir.path().join("proc")
    }

    /// A second USB4 host router (domain 1, its own UUID), as on hosts whose two ports sit on
    /// separate controllers.
    pub fn second_router(&self, uuid: &str) {
        let domain = self.sys().join(SECOND_CONTROLLER).join("domain1");
        write(&domain.join("1-0/unique_id"), uuid);
        let bus = self.sys().join("bus/thunderbolt/devices");
        symlink(&domain, bus.join("domain1")).unwrap();
        symlink(domain.join("1-0"), bus.join("1-0")).unwrap();
    }

    /// A cable in port `port` (route `0-PORT`) to host `peer_uuid` called `peer_name`.
    pub fn cable(
        &self,
        interface: &str,
        port: u8,
        peer_uuid: &str,
        peer_name: &str,
        state: IfaceState,
    ) {
        self.cable_on(0, interface, port, peer_uuid, peer_name, state);
    }

    /// A cable on router `domain` (0 or 1).
    pub fn cable_on(
        &self,
        domain: u8,
        interface: &str,
        port: u8,
        peer_uuid: &str,
        peer_name: &str,
        state: IfaceState,
    ) {
        let controller = if domain == 0 {
            CONTROLLER
        } else {
            SECOND_CONTROLLER
        };
        let xdomain = self
            .sys()
            .join(controller)
            .join(format!("domain{domain}/{domain}-0/{domain}-{port}"));
        write(&xdomain.join("unique_id"), peer_uuid);
        write(&xdomain.join("device_name"), peer_name);
        write(&xdomain.join("vendor_name"), "Linux");
        let service = xdomain.join(format!("{domain}-{port}.0"));
        fs::create_dir_all(&service).unwrap();
        symlink(
            self.sys().join("bus/thunderbolt/drivers/thunderbolt-net"),
            service.join("driver"),
        )
        .unwrap();
        self.netdev(&service, interface, state);
    }

    /// A non-Thunderbolt NIC.
    pub fn plain_nic(&self, interface: &str) {
        let device = self.sys().join("devices/pci0000:00/0000:00:03.0/virtio0");
        fs::create_dir_all(self.sys().join("bus/virtio/drivers/virtio_net")).unwrap();
        fs::create_dir_all(&device).unwrap();
        let _ = symlink(
            self.sys().join("bus/virtio/drivers/virtio_net"),
            device.join("driver"),
        );
        self.netdev(&device, interface, IfaceState::FRESH);
    }

    fn netdev(&self, device: &Path, interface: &str, state: IfaceState) {
        let dir = device.join("net").join(interface);
        write(&dir.join("mtu"), &state.mtu.to_string());
        write(
            &dir.join("flags"),
            if state.up { "0x1003" } else { "0x1002" },
        );
        write(&dir.join("operstate"), if state.up { "up" } else { "down" });
        write(&dir.join("napi_defer_hard_irqs"), "0");
        write(&dir.join("gro_flush_timeout"), "0");
        symlink(device, dir.join("device")).unwrap();
        symlink(&dir, self.sys().join("class/net").join(interface)).unwrap();
    }
}

fn write(path: &Path, contents: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, format!("{contents}\n")).unwrap();
}
