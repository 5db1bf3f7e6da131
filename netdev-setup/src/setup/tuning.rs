//! The kernel settings a busy-polling user-space transport wants, and where each one lives.
//! `net.core.busy_poll`/`busy_read` are host-wide (only the initial namespace has them);
//! `rmem_max`/`wmem_max` are per network namespace on current kernels; the two NAPI knobs are
//! per interface, in sysfs.

/// How a target compares with the current value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Goal {
    /// The value must equal the target.
    Exactly,
    /// The value must be at least the target; a larger one is left alone.
    AtLeast,
}

/// One sysctl under `/proc/sys`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SysctlTarget {
    /// Dotted name, e.g. `net.core.busy_poll`.
    pub key: &'static str,
    /// Wanted value.
    pub value: u64,
    /// How to compare.
    pub goal: Goal,
    /// Why, for `doctor` and the docs.
    pub why: &'static str,
}

/// Microseconds a socket read or poll busy-waits for packets before sleeping.
pub const BUSY_POLL_US: u64 = 50;
/// Socket buffer ceiling: a few in-flight 64 KiB datagrams per rail need room.
pub const SOCKET_BUFFER_MAX: u64 = 64 << 20;
/// Interrupts deferred while busy-polling keeps finding work.
pub const NAPI_DEFER_HARD_IRQS: u64 = 2;
/// Nanoseconds before the deferred interrupt fires anyway.
pub const GRO_FLUSH_TIMEOUT_NS: u64 = 200_000;

/// Every sysctl setup manages.
pub const SYSCTLS: &[SysctlTarget] = &[
    SysctlTarget {
        key: "net.core.busy_poll",
        value: BUSY_POLL_US,
        goal: Goal::Exactly,
        why: "lets poll/epoll busy-wait on the link instead of sleeping until an interrupt",
    },
    SysctlTarget {
        key: "net.core.busy_read",
        value: BUSY_POLL_US,
        goal: Goal::Exactly,
        why: "lets blocking reads busy-wait on the link",
    },
    SysctlTarget {
        key: "net.core.rmem_max",
        value: SOCKET_BUFFER_MAX,
        goal: Goal::AtLeast,
        why: "allows large receive buffers (SO_RCVBUF)",
    },
    SysctlTarget {
        key: "net.core.wmem_max",
        value: SOCKET_BUFFER_MAX,
        goal: Goal::AtLeast,
        why: "allows large send buffers (SO_SNDBUF)",
    },
];

/// Per-interface sysfs knobs: (file name, wanted value).
pub const INTERFACE_KNOBS: &[(&str, u64)] = &[
    ("napi_defer_hard_irqs", NAPI_DEFER_HARD_IRQS),
    ("gro_flush_timeout", GRO_FLUSH_TIMEOUT_NS),
];

impl SysctlTarget {
    /// The file under `/proc/sys`.
    pub fn relative_path(&self) -> String {
        self.key.replace('.', "/")
    }

    /// True when `current` already satisfies the target.
    pub fn satisfied_by(&self, current: u64) -> bool {
        match self.goal {
            Goal::Exactly => current == self.value,
            Goal::AtLeast => current >= self.value,
        }
    }
}
