//! Devices (one per link, one data socket each), protection domains and completion queues.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tbrdma_engine::cq::{Completion, CqShared};
use tbrdma_engine::io::EngineKind;
use tbrdma_engine::worker::{Engine, EngineConfig, Progress};

use crate::error::{Result, VerbsError};

/// How to open a device.
#[derive(Clone, Debug, Default)]
pub struct DeviceConfig {
    /// Engine settings (backend, progress mode, spin budget, CPU).
    pub engine: EngineConfig,
    /// UDP port of the data socket (0: any free port).
    pub port: u16,
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub engine: Engine,
    pub name: String,
    /// The local address of each rail; rail 0 carries connection setup.
    pub ips: Vec<IpAddr>,
}

/// An open link: a data socket bound to the link's address and the engine that serves it.
#[derive(Clone, Debug)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

/// Finds the IPv4 address of interface `name`.
fn interface_address(name: &str) -> Result<IpAddr> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| VerbsError::Io {
        context: "listing interfaces".into(),
        source: e.into(),
    })?;
    let mut seen = Vec::new();
    let mut found = false;
    for ifa in addrs {
        if !seen.contains(&ifa.interface_name) {
            seen.push(ifa.interface_name.clone());
        }
        if ifa.interface_name != name {
            continue;
        }
        found = true;
        if let Some(sin) = ifa.address.as_ref().and_then(|a| a.as_sockaddr_in()) {
            return Ok(IpAddr::V4(sin.ip()));
        }
    }
    if found {
        Err(VerbsError::NoAddress {
            name: name.to_string(),
        })
    } else {
        Err(VerbsError::NoSuchInterface {
            name: name.to_string(),
            available: seen.join(", "),
        })
    }
}

impl Device {
    /// Opens the link named by an interface name (`thunderbolt0`) or a local IP address.
    pub fn open(name_or_ip: &str, config: DeviceConfig) -> Result<Device> {
        Device::open_rails(&[name_or_ip], config)
    }

    /// Opens several links to the same peers as one device with several rails (two cables
    /// between two hosts): connections stripe large messages over every rail and carry on over
    /// the others when one goes down. Both hosts must list their rails in the same order
    /// (cable 1 first).
    pub fn open_rails(names: &[&str], config: DeviceConfig) -> Result<Device> {
        if names.is_empty() {
            return Err(VerbsError::NoSuchInterface {
                name: String::new(),
                available: "(no interface given)".into(),
            });
        }
        let mut ips = Vec::with_capacity(names.len());
        for name in names {
            ips.push(match name.parse::<IpAddr>() {
                Ok(ip) => ip,
                Err(_) => interface_address(name)?,
            });
        }
        let binds: Vec<SocketAddr> = ips
            .iter()
            .enumerate()
            .map(|(i, ip)| SocketAddr::new(*ip, if i == 0 { config.port } else { 0 }))
            .collect();
        let engine = Engine::start(&binds, config.engine).map_err(|e| {
            if e.raw_os_error() == Some(libc_eaddrnotavail()) {
                VerbsError::AddressNotLocal {
                    addr: ips
                        .iter()
                        .map(|ip| ip.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                }
            } else {
                VerbsError::Io {
                    context: format!("opening the data sockets on {binds:?}"),
                    source: e,
                }
            }
        })?;
        Ok(Device {
            inner: Arc::new(DeviceInner {
                engine,
                name: names.join("+"),
                ips,
            }),
        })
    }

    /// The name or address it was opened by.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The link's local address.
    pub fn ip(&self) -> IpAddr {
        self.inner.ips[0]
    }

    /// The data sockets' addresses, one per rail.
    pub fn data_addrs(&self) -> &[SocketAddr] {
        self.inner.engine.local_addrs()
    }

    /// Number of rails.
    pub fn rails(&self) -> usize {
        self.inner.ips.len()
    }

    /// The data socket's address.
    pub fn data_addr(&self) -> SocketAddr {
        self.inner.engine.local_addr()
    }

    /// The backend in use.
    pub fn engine_kind(&self) -> EngineKind {
        self.inner.engine.kind()
    }

    /// Whether this device carries its datagrams as Ethernet frames (the packet engine)
    /// rather than UDP: a peer must do the same to hear it.
    pub fn carries_frames(&self) -> bool {
        self.engine_kind() == EngineKind::Packet
    }

    /// Whether every queue pair of this device asks for data digests
    /// (`EngineConfig::data_digest`, `TBRDMA_DATA_DIGEST`, or a fault plan that corrupts);
    /// a queue pair's own `Config::data_digest`, or its peer's, can ask too.
    pub fn asks_data_digest(&self) -> bool {
        self.inner.engine.asks_data_digest()
    }

    /// Engine counters (datagrams dropped as foreign, busy iterations, sleeps).
    pub fn engine_stats(&self) -> tbrdma_engine::worker::EngineStats {
        self.inner.engine.stats()
    }

    /// What the kernel offered at start-up (io_uring features, busy-poll), with versions.
    pub fn kernel_features(&self) -> &tbrdma_engine::probe::KernelFeatures {
        self.inner.engine.kernel_features()
    }

    /// Why the preferred backend was not used, if it was not.
    pub fn engine_fallback(&self) -> Option<&str> {
        self.inner.engine.fallback_reason()
    }

    /// Who drives progress.
    pub fn progress_mode(&self) -> Progress {
        self.inner.engine.config().progress
    }

    /// Whether polling runs the engine (caller mode, or assisted thread mode; see
    /// `EngineConfig::assist`).
    pub fn polls_progress(&self) -> bool {
        self.inner.engine.polls_progress()
    }

    /// Caller mode: runs the engine once. Thread mode: does nothing.
    pub fn progress(&self) -> Result<bool> {
        self.inner
            .engine
            .progress()
            .map_err(VerbsError::io("engine progress"))
    }

    /// A new protection domain: its regions are reachable only through its queue pairs.
    pub fn alloc_pd(&self) -> crate::ProtectionDomain {
        crate::ProtectionDomain {
            device: self.clone(),
            id: self.inner.engine.add_protection_domain(),
        }
    }

    /// A completion queue with room for `capacity` completions.
    pub fn create_cq(&self, capacity: usize) -> CompletionQueue {
        CompletionQueue {
            device: self.clone(),
            shared: Arc::new(CqShared::new(capacity)),
        }
    }
}

fn libc_eaddrnotavail() -> i32 {
    nix::errno::Errno::EADDRNOTAVAIL as i32
}

/// A completion queue (`ibv_cq`).
#[derive(Clone, Debug)]
pub struct CompletionQueue {
    pub(crate) device: Device,
    pub(crate) shared: Arc<CqShared>,
}

impl CompletionQueue {
    /// Moves up to `out.len()` completions into `out` and returns how many. In caller mode
    /// this also runs the engine once, so polling is what makes progress: when the queue is
    /// empty, and when completions are waiting but the engine has not run for
    /// [`tbrdma_engine::worker::CALLER_PASS_OVERDUE`] (an application slow to work through its
    /// completions still acknowledges what arrives meanwhile).
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        if self.shared.is_empty() {
            self.device.progress()?;
        } else if self.device.inner.engine.pass_overdue() {
            // The completions already queued are delivered whatever this pass meets: an engine
            // that failed reports it at the poll that finds the queue empty (the flushed
            // completions come first).
            let _ = self.device.progress();
        }
        self.shared
            .poll(out)
            .map_err(|lost| VerbsError::CqOverflow { lost })
    }

    /// Moves up to `out.len()` completions that are already queued into `out`, running no
    /// engine pass (what a poll that already found some uses to fill the rest of its buffer).
    pub fn poll_queued(&self, out: &mut [Completion]) -> Result<usize> {
        self.shared
            .poll(out)
            .map_err(|lost| VerbsError::CqOverflow { lost })
    }

    /// Capacity.
    pub fn capacity(&self) -> usize {
        self.shared.capacity()
    }
}
