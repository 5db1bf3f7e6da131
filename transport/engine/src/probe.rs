//! The kernel feature probe: which of the kernel facilities the engine can use here, and why
//! not when it cannot. Plain data for `tbrdma doctor` and logs; the CLI formats it as JSON.
//!
//! Every answer comes from trying the thing (setting up small rings, registering, setting a
//! socket option on a throwaway socket, one datagram over loopback), never from the kernel
//! version alone, which backports and seccomp make unreliable. The whole probe takes a few
//! milliseconds and never panics.

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use io_uring::types::Napi;
use io_uring::{IoUring, Probe, opcode};

use crate::io::DatagramIo;
use crate::io::uring::{UringConfig, UringIo, try_provided_buffer_ring};
use crate::socket;

/// One kernel facility.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Feature {
    /// Whether the engine can use it on this machine.
    pub available: bool,
    /// The first mainline release that has it, e.g. `"6.0"`.
    pub since: &'static str,
    /// What was observed: the error when unavailable, a detail otherwise.
    pub detail: String,
}

impl Feature {
    fn yes(since: &'static str, detail: impl Into<String>) -> Feature {
        Feature {
            available: true,
            since,
            detail: detail.into(),
        }
    }

    fn no(since: &'static str, detail: impl Into<String>) -> Feature {
        Feature {
            available: false,
            since,
            detail: detail.into(),
        }
    }

    fn from_result(since: &'static str, result: Result<String, String>) -> Feature {
        match result {
            Ok(detail) => Feature::yes(since, detail),
            Err(detail) => Feature::no(since, detail),
        }
    }
}

/// What the running kernel offers the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    /// `uname -r`.
    pub kernel_release: String,
    /// Major and minor version parsed from the release, when it parses.
    pub kernel_version: Option<(u32, u32)>,
    /// io_uring itself: a ring can be set up.
    pub io_uring: Feature,
    /// Multishot `recvmsg` into provided buffers.
    pub multishot_recvmsg: Feature,
    /// Provided-buffer rings (`IORING_REGISTER_PBUF_RING`).
    pub provided_buffer_ring: Feature,
    /// Zero-copy `sendmsg` (`IORING_OP_SENDMSG_ZC`).
    pub send_zero_copy: Feature,
    /// `IORING_SETUP_SINGLE_ISSUER`.
    pub single_issuer: Feature,
    /// `IORING_SETUP_DEFER_TASKRUN`.
    pub defer_taskrun: Feature,
    /// `IORING_REGISTER_NAPI` busy-poll registration.
    pub napi_registration: Feature,
    /// The `SO_BUSY_POLL` socket option (beyond `net.core.busy_read`).
    pub so_busy_poll: Feature,
    /// The `SO_PREFER_BUSY_POLL` socket option.
    pub so_prefer_busy_poll: Feature,
}

impl KernelFeatures {
    /// Every feature with its display name, in a fixed order.
    pub fn features(&self) -> [(&'static str, &Feature); 9] {
        [
            ("io_uring", &self.io_uring),
            ("multishot_recvmsg", &self.multishot_recvmsg),
            ("provided_buffer_ring", &self.provided_buffer_ring),
            ("send_zero_copy", &self.send_zero_copy),
            ("single_issuer", &self.single_issuer),
            ("defer_taskrun", &self.defer_taskrun),
            ("napi_registration", &self.napi_registration),
            ("so_busy_poll", &self.so_busy_poll),
            ("so_prefer_busy_poll", &self.so_prefer_busy_poll),
        ]
    }

    /// Whether the io_uring engine can run (ring, multishot receive, buffer ring).
    pub fn uring_usable(&self) -> bool {
        self.io_uring.available
            && self.multishot_recvmsg.available
            && self.provided_buffer_ring.available
    }
}

impl fmt::Display for KernelFeatures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "kernel {}", self.kernel_release)?;
        for (name, feature) in self.features() {
            let yes = if feature.available { "yes" } else { "no" };
            let line = format!(
                "{name:<21} {yes:<3}  since Linux {:<5} {}",
                feature.since, feature.detail
            );
            writeln!(f, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn parse_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Why io_uring setup failed, in words.
fn explain_setup_error(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ENOSYS) => format!("{e}: kernel built without io_uring (CONFIG_IO_URING)"),
        Some(libc::EPERM) => match read_trimmed("/proc/sys/kernel/io_uring_disabled").as_deref() {
            Some("2") => format!("{e}: disabled by sysctl kernel.io_uring_disabled=2"),
            Some("1") => {
                format!("{e}: kernel.io_uring_disabled=1 and not in kernel.io_uring_group")
            }
            _ => format!("{e}: denied (seccomp profile, e.g. Docker's default)"),
        },
        _ => e.to_string(),
    }
}

const NEEDS_URING: &str = "io_uring unusable";

/// Probes the running kernel.
pub fn probe() -> KernelFeatures {
    let kernel_release =
        read_trimmed("/proc/sys/kernel/osrelease").unwrap_or_else(|| "unknown".to_string());
    let kernel_version = parse_version(&kernel_release);
    let (so_busy_poll, so_prefer_busy_poll) = probe_busy_poll();

    let ring = match IoUring::new(8) {
        Ok(ring) => ring,
        Err(e) => {
            let no = |since| Feature::no(since, NEEDS_URING);
            return KernelFeatures {
                kernel_release,
                kernel_version,
                io_uring: Feature::no("5.1", explain_setup_error(&e)),
                multishot_recvmsg: no("6.0"),
                provided_buffer_ring: no("5.19"),
                send_zero_copy: no("6.1"),
                single_issuer: no("6.0"),
                defer_taskrun: no("6.1"),
                napi_registration: no("6.9"),
                so_busy_poll,
                so_prefer_busy_poll,
            };
        }
    };

    let mut ops = Probe::new();
    let ops = match ring.submitter().register_probe(&mut ops) {
        Ok(()) => Some(ops),
        Err(_) => None,
    };
    let supported = |code: u8| ops.as_ref().is_some_and(|p| p.is_supported(code));

    let send_zero_copy = if supported(opcode::SendMsgZc::CODE) {
        Feature::yes("6.1", "SENDMSG_ZC and SEND_ZC")
    } else if supported(opcode::SendZc::CODE) {
        Feature::no("6.1", "SEND_ZC only (6.0); SENDMSG_ZC missing")
    } else if ops.is_none() {
        Feature::no("6.1", "opcode probe (5.6) failed")
    } else {
        Feature::no("6.1", "opcode SENDMSG_ZC unsupported")
    };

    let single_issuer = Feature::from_result(
        "6.0",
        IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder()
            .setup_single_issuer()
            .build(4)
            .map(|_| String::new())
            .map_err(|e| format!("setup refused: {e}")),
    );
    let defer_taskrun = Feature::from_result(
        "6.1",
        IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(4)
            .map(|_| String::new())
            .map_err(|e| format!("setup refused: {e}")),
    );

    let mut napi = Napi::new().set_busy_poll_timeout(1);
    let napi_registration = Feature::from_result(
        "6.9",
        match ring.submitter().register_napi(&mut napi) {
            Ok(()) => {
                let mut old = Napi::new();
                let _ = ring.submitter().unregister_napi(&mut old);
                Ok(String::new())
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Err(format!("register refused: {e} (kernel older than 6.9)"))
            }
            Err(e) => Err(format!("register refused: {e}")),
        },
    );

    let provided_buffer_ring = Feature::from_result(
        "5.19",
        try_provided_buffer_ring(&ring)
            .map(|()| String::new())
            .map_err(|e| format!("register refused: {e}")),
    );
    drop(ring);

    let multishot_recvmsg = if provided_buffer_ring.available {
        Feature::from_result("6.0", probe_multishot())
    } else {
        Feature::no("6.0", "needs provided-buffer rings")
    };

    KernelFeatures {
        kernel_release,
        kernel_version,
        io_uring: Feature::yes("5.1", ""),
        multishot_recvmsg,
        provided_buffer_ring,
        send_zero_copy,
        single_issuer,
        defer_taskrun,
        napi_registration,
        so_busy_poll,
        so_prefer_busy_poll,
    }
}

/// One datagram over loopback through the io_uring engine: arrives, and the multishot receive
/// stays armed afterwards.
fn probe_multishot() -> Result<String, String> {
    let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let rx = UdpSocket::bind(localhost).map_err(|e| format!("loopback socket: {e}"))?;
    let tx = UdpSocket::bind(localhost).map_err(|e| format!("loopback socket: {e}"))?;
    let to = rx.local_addr().map_err(|e| e.to_string())?;
    let config = UringConfig {
        napi_busy_poll_usecs: 0,
        ..UringConfig::default()
    };
    let mut io = UringIo::with_config(rx, 64, config).map_err(|e| e.to_string())?;
    tx.send_to(b"probe", to)
        .map_err(|e| format!("loopback send: {e}"))?;
    let deadline = Instant::now() + Duration::from_millis(200);
    let mut got = 0;
    while got == 0 && Instant::now() < deadline {
        got += io
            .recv(&mut None, &mut |_, _| {})
            .map_err(|e| format!("multishot recvmsg: {e}"))?;
        if got == 0 {
            // The sender's socket stands in for the wake descriptor: it never becomes readable.
            io.wait(Duration::from_millis(5), tx.as_fd())
                .map_err(|e| e.to_string())?;
        }
    }
    if got == 0 {
        Err("no datagram arrived over loopback within 200 ms".to_string())
    } else if !io.receive_armed() {
        Err("the receive ended after one datagram (no multishot)".to_string())
    } else {
        Ok(String::new())
    }
}

/// `SO_BUSY_POLL` and `SO_PREFER_BUSY_POLL` on a throwaway socket.
fn probe_busy_poll() -> (Feature, Feature) {
    let socket = match UdpSocket::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))) {
        Ok(s) => s,
        Err(e) => {
            let why = format!("cannot open a UDP socket: {e}");
            return (Feature::no("3.11", why.clone()), Feature::no("5.11", why));
        }
    };
    let busy_read = read_trimmed("/proc/sys/net/core/busy_read").unwrap_or_else(|| "?".to_string());
    let busy = match socket::set_busy_poll(&socket, 50) {
        Ok(()) => Feature::yes(
            "3.11",
            format!("50 µs accepted (net.core.busy_read={busy_read})"),
        ),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => Feature::no(
            "3.11",
            format!("{e}: values above net.core.busy_read={busy_read} need CAP_NET_ADMIN"),
        ),
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => Feature::no(
            "3.11",
            format!("{e}: kernel built without CONFIG_NET_RX_BUSY_POLL"),
        ),
        Err(e) => Feature::no("3.11", e.to_string()),
    };
    let prefer = match socket::set_prefer_busy_poll(&socket, true) {
        Ok(()) => Feature::yes("5.11", ""),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            Feature::no("5.11", format!("{e}: needs CAP_NET_ADMIN"))
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {
            Feature::no("5.11", format!("{e}: kernel older than 5.11"))
        }
        Err(e) => Feature::no("5.11", e.to_string()),
    };
    (busy, prefer)
}
