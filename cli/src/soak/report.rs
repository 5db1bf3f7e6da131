//! What one side of a soak counted, its final JSON line and its human summary.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::memory::{self, Memory};

/// One failure of a whole session (every queue pair torn down, then a reconnect).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Failure {
    /// When the first error completion (or error) was seen, in ms since the Unix epoch (the
    /// orchestrator compares it with the moment it killed the peer).
    pub at_unix_ms: u64,
    /// What it was: a completion status name, or `post`, `poll`.
    pub first: String,
}

/// Everything one side reports.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Tally {
    /// `client` or `server`.
    pub role: String,
    /// Engine actually running.
    pub engine: String,
    /// Seed of the operation mix.
    pub seed: u64,
    /// Queue pairs per session.
    pub qps: usize,
    /// Seconds from start to end.
    pub seconds: f64,
    /// Successful send-queue operations (a WRITE and its READ back are two).
    pub operations: u64,
    /// The same, by operation.
    pub ops: BTreeMap<String, u64>,
    /// Messages received (SEND, SEND_WITH_IMM, WRITE_WITH_IMM) and checked.
    pub received: u64,
    /// Bytes compared with what they must be and found right.
    pub bytes_verified: u64,
    /// Bytes compared and found wrong (must be 0).
    pub bytes_wrong: u64,
    /// Error completions and errors, by status name.
    pub errors: BTreeMap<String, u64>,
    /// Session failures, in order.
    pub failures: Vec<Failure>,
    /// Sessions that were established.
    pub sessions: u64,
    /// Connection attempts that failed (peer not there yet).
    pub connect_failures: u64,
    /// Whether the last session ended with both sides' DONE.
    pub finished: bool,
    /// Memory at start, after the warm-up, at the end, and the largest seen.
    pub memory_start: Memory,
    /// After the warm-up (the first session's first seconds).
    pub memory_warm: Memory,
    /// At the end, with the last session still up.
    pub memory_end: Memory,
    /// Largest reading.
    pub memory_peak: Memory,
    /// Whether the end is within 10 % + 8 MiB (RSS) and 1 % (VmLck) of the warm reading.
    pub memory_flat: bool,
    /// What the user-space faulty cable did in this process.
    pub faults: BTreeMap<String, u64>,
    /// `Config::retry_budget()` of the connections, ms.
    pub retry_budget_ms: u64,
    /// `Config::idle_timeout` of the connections, ms.
    pub idle_timeout_ms: u64,
}

impl Tally {
    /// Counts one successful operation.
    pub fn op(&mut self, name: &str) {
        self.operations += 1;
        *self.ops.entry(name.to_string()).or_default() += 1;
    }

    /// Counts one error of kind `kind`.
    pub fn error(&mut self, kind: &str) {
        *self.errors.entry(kind.to_string()).or_default() += 1;
    }

    /// All errors.
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Takes the end reading and judges it.
    pub fn close_memory(&mut self) {
        self.memory_end = Memory::now();
        self.memory_peak = self.memory_peak.max(self.memory_end);
        if self.memory_warm == Memory::default() {
            self.memory_warm = self.memory_end;
        }
        self.memory_flat = memory::is_flat(self.memory_warm, self.memory_end);
    }

    /// Human summary, several lines.
    pub fn human(&self) -> String {
        let mib = |k: u64| k as f64 / 1024.0;
        let kinds = |m: &BTreeMap<String, u64>| {
            if m.is_empty() {
                "none".to_string()
            } else {
                m.iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        format!(
            "soak {role} ({engine}, {qps} QPs, seed {seed}): {secs:.1} s, {ops} operations, {recv} messages received\n\
             \x20 bytes verified {ver}, bytes wrong {wrong}\n\
             \x20 by operation: {by_op}\n\
             \x20 errors: {errs}; sessions {sessions}, failures {fails}, connect retries {cf}; finished cleanly: {fin}\n\
             \x20 RSS {rs:.1} -> warm {rw:.1} -> end {re:.1} MiB (peak {rp:.1}); VmLck {ls:.1} -> warm {lw:.1} -> end {le:.1} MiB; flat: {flat}\n\
             \x20 faults injected: {faults}",
            role = self.role,
            engine = self.engine,
            qps = self.qps,
            seed = self.seed,
            secs = self.seconds,
            ops = self.operations,
            recv = self.received,
            ver = self.bytes_verified,
            wrong = self.bytes_wrong,
            by_op = kinds(&self.ops),
            errs = kinds(&self.errors),
            sessions = self.sessions,
            fails = self.failures.len(),
            cf = self.connect_failures,
            fin = self.finished,
            rs = mib(self.memory_start.rss_kib),
            rw = mib(self.memory_warm.rss_kib),
            re = mib(self.memory_end.rss_kib),
            rp = mib(self.memory_peak.rss_kib),
            ls = mib(self.memory_start.lck_kib),
            lw = mib(self.memory_warm.lck_kib),
            le = mib(self.memory_end.lck_kib),
            flat = self.memory_flat,
            faults = kinds(&self.faults),
        )
    }
}

/// The fault layer's tallies by name.
pub fn injected_faults() -> BTreeMap<String, u64> {
    let f = tbrdma_verbs::faults::injected();
    [
        ("seen", f.seen),
        ("dropped", f.dropped),
        ("lost_in_outage", f.lost_in_outage),
        ("duplicated", f.duplicated),
        ("corrupted", f.corrupted),
        ("reordered", f.reordered),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
