//! How an engine runs: [`EngineConfig`] and who drives its loop ([`Progress`]), with the
//! defaults and the measurements behind them. Read by every part of the engine, owned by none.

use std::time::Duration;

use tbrdma_proto::Config;

use crate::io::EngineKind;
use crate::io::faults::FaultPlan;
use crate::keeper::KEEPER_HOLD;

/// Who runs the progress loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// A background thread (one-sided operations progress with no application call).
    Thread,
    /// The application, inside `poll_cq` and `post_*`.
    Caller,
}

impl std::str::FromStr for Progress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "thread" => Ok(Progress::Thread),
            "caller" => Ok(Progress::Caller),
            other => Err(format!(
                "unknown progress mode {other:?}: use \"thread\" or \"caller\""
            )),
        }
    }
}

/// How an engine runs.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Preferred backend (io_uring falls back to sockets when unavailable). Sockets by default:
    /// io_uring measured slower in both progress modes (caller: 1.6-1.8x the UDP floor against
    /// 1.1-1.35x from 8 B to 16 KiB; thread: 650-700 MiB/s against 650-1050 for 1 MiB WRITEs;
    /// docs/performance.md, issue 16), and docs/verbs.md says which front end defaults to what.
    pub engine: EngineKind,
    /// Who drives progress.
    pub progress: Progress,
    /// Thread mode: how long to busy-poll after the last activity before sleeping. Short by
    /// default so that two processes on a 2-core machine, each with an application thread and
    /// an engine thread, do not starve each other.
    pub spin: Duration,
    /// Longest single sleep (deadlines of connections wake it earlier).
    pub max_sleep: Duration,
    /// Thread mode: pin the engine thread to this CPU.
    pub cpu: Option<usize>,
    /// Largest datagram on the link (MTU minus IP and UDP headers).
    pub max_datagram: usize,
    /// UDP socket receive buffer to ask for: a window of 64 KiB datagrams must fit (what the
    /// kernel grants bounds the advertised window).
    pub receive_buffer: usize,
    /// UDP socket send buffer to ask for ([`DEFAULT_SEND_BUFFER`]).
    pub send_buffer: usize,
    /// Caller mode, and thread mode when assisted ([`Self::assist`]): hold the acknowledgement
    /// of a just-completed message for a reply to carry, on its queue pair or on another to
    /// the same peer (see the module docs of `worker.rs` for when a hold ends). The keeper
    /// thread (caller mode) or the hold's own deadline (250 µs in caller mode, 100 µs assisted,
    /// run by the engine thread) bounds the hold when the application stops calling.
    pub hold_acks: bool,
    /// Caller mode: period of the keeper's alarm (see the engine docs, `keeper.rs`); held acknowledgements
    /// go out at most this plus 100 µs after the application's last poll. Keep it under half
    /// the peers' smallest retransmission timeout ([`Config::initial_rto`]), or an application
    /// that pauses makes its peers retransmit for nothing.
    pub keeper_period: Duration,
    /// Caller mode: when the application has stopped calling, the keeper runs the whole loop
    /// in its place (receive, acknowledgements, keep-alives, retransmissions), blocking in the
    /// backend's wait between passes (no spinning), until the application calls again. Without
    /// it the keeper only sends held acknowledgements, and a connection nobody polls fails
    /// after [`Config::idle_timeout`]. NCCL's proxy thread stops calling between collectives,
    /// so the NCCL plugin turns it on (docs/nccl.md, "Progress"); see `keeper.rs`.
    pub keeper_takeover: bool,
    /// Thread mode, sockets and packet engines: the application's threads run the loop too. A
    /// post sends at once and a poll of an empty completion queue receives, through a second
    /// backend over the same sockets (and, with the packet engine, the same receive ring:
    /// `io::open_pair`), so an application that keeps calling waits for no
    /// thread to be scheduled; the engine thread (which should then not spin, see
    /// [`Self::spin`]) wakes only for what arrives while nobody calls, such as one-sided
    /// operations aimed at an application polling its memory. A post does not wake the engine
    /// thread, so its sleeps are kept under [`ASSISTED_MAX_SLEEP`]: a deadline a post set is
    /// late by at most that. io_uring ignores it. The libibverbs library turns it on.
    pub assist: bool,
    /// Data packets whose payload is at least this many bytes are sent as gathered datagrams:
    /// the header from the engine's buffer and the payload straight from the registered region
    /// (two iovecs), saving a user-space copy of every payload byte; smaller payloads are
    /// copied behind the header. `None` copies everything. See [`DEFAULT_GATHER_THRESHOLD`].
    pub gather_threshold: Option<usize>,
    /// Faults to inflict on received datagrams (a faulty cable in user space, for tests and
    /// soak runs: see [`crate::io::faults`]). `None` reads the `TBRDMA_FAULTS` environment
    /// variable, and a healthy link when it is unset.
    pub faults: Option<FaultPlan>,
    /// Ask every connection of this engine for data digests (a CRC-32C over every payload as
    /// well as every header, [`Config::data_digest`]), whatever each queue pair's own
    /// configuration says. `None` reads the `TBRDMA_DATA_DIGEST` environment variable (`1` or
    /// `0`), off when it is unset. Always on while [`Self::faults`] corrupts datagrams: that
    /// cable corrupts without the link CRC a real one has.
    pub data_digest: Option<bool>,
}

/// The environment variable [`EngineConfig::data_digest`] reads when it is `None`.
pub const DATA_DIGEST_ENV: &str = "TBRDMA_DATA_DIGEST";

impl EngineConfig {
    /// Whether this engine's connections ask for data digests: [`Self::data_digest`], or the
    /// environment when that is `None`, or a fault plan in [`Self::faults`] (resolved from
    /// the environment first, see `Engine::start`) that corrupts.
    pub(crate) fn asks_data_digest(&self) -> Result<bool, String> {
        let asked = match self.data_digest {
            Some(on) => on,
            None => match std::env::var(DATA_DIGEST_ENV) {
                Ok(value) => parse_switch(&value)
                    .ok_or_else(|| format!("{DATA_DIGEST_ENV}={value:?}: use 1 or 0"))?,
                Err(_) => false,
            },
        };
        Ok(asked || self.faults.as_ref().is_some_and(|plan| plan.corrupt > 0.0))
    }
}

/// `1`/`on`/`true`/`yes` or `0`/`off`/`false`/`no` (or empty), as environment switches say.
fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Some(true),
        "" | "0" | "off" | "false" | "no" => Some(false),
        _ => None,
    }
}

/// Longest sleep of an engine thread whose application threads assist it
/// ([`EngineConfig::assist`]): the retransmission timer a post arms (1 ms at first) fires at
/// most this late when the application stops calling.
pub const ASSISTED_MAX_SLEEP: Duration = Duration::from_millis(1);

/// Assisted thread mode: for this long after the application's last poll (or a send post that
/// extended the window, see `Shared::post_send_work`), the engine thread leaves receiving to
/// the application's polls and sleeps on its timer and doorbell only, not
/// on the sockets (it looks again at least this often). A datagram that arrives in that window
/// while nobody polls (an application that switched to polling its memory) waits at most this
/// long; one that arrives later wakes the engine thread at once.
pub const ASSISTED_POLL_WINDOW: Duration = Duration::from_micros(200);

/// Assisted thread mode: the longest an acknowledgement waits for a reply to carry it (see
/// `Engine::ack_hold_for`): a reply comes within a round trip, tens of microseconds, and
/// the hold must end well inside the peer's first retransmission timeout (1 ms by default).
pub const ASSISTED_ACK_HOLD: Duration = Duration::from_micros(100);

/// Assisted thread mode: how long a poll that delivered completions goes on receiving a
/// message that is still arriving (see `Shared::progress`).
pub const ASSISTED_LINGER: Duration = Duration::from_micros(50);

/// Assisted thread mode: how long after the application's last poll its send posts may keep
/// the engine thread out of the sockets (see `Shared::post_send_work`). While they do, no
/// deadline runs (retransmissions, keep-alives), so this bounds how late they can be.
pub const ASSISTED_BURST_LIMIT: Duration = Duration::from_millis(5);

/// Assisted thread mode: most send posts queued between two polls before one transmits them
/// (see `Shared::post_send_work`).
pub const ASSISTED_POST_BATCH: u32 = 32;

/// Assisted thread mode: after this long with no call from the application (a target that
/// waits elsewhere while its peer streams one-sided operations into it, like perftest's
/// bandwidth servers), the engine thread is the only thread of the process working the link.
/// It then busy-polls for [`ASSISTED_QUIET_SPIN`] after each pass that did something (at
/// least; [`EngineConfig::spin`] when longer), yielding the core between passes, so that a
/// stream's datagrams find it awake rather than each paying, on the sender's CPU, for a
/// wake-up. While the application calls, its own thread is the process's busy one, and a
/// second spinner would only take the core the peer needs on a small host (see
/// [`EngineConfig::spin`]).
pub const ASSISTED_QUIET_AFTER: Duration = Duration::from_millis(1);

/// Assisted thread mode: the engine thread's spin while the application is quiet (see
/// [`ASSISTED_QUIET_AFTER`]).
pub const ASSISTED_QUIET_SPIN: Duration = Duration::from_micros(1000);

/// Default of [`EngineConfig::gather_threshold`]: payloads from 1 KiB up are sent from the
/// region in place.
///
/// Why 1 KiB: a gathered datagram saves copying its payload once in user space but costs a
/// second iovec for the kernel to walk and an `Arc` clone and drop for the region; the CRC is
/// computed either way. Measured per datagram (header, CRC and send of 32-datagram batches over
/// loopback, both backends, 2 busy cores, best of 3, with a throwaway harness): below 1 KiB
/// gathering was as fast as copying or up to 2% slower (256-768 B: 0.997-1.023×); from 1 KiB it
/// was as fast or faster (1-4 KiB: 0.94-0.99×, 16 KiB: 0.86×, 65000 B: 0.69-0.78×). So small
/// messages, whose latency matters most, keep the single-buffer path (and its plain `send(2)`
/// fast path) and everything from a page-ish payload up skips the copy.
pub const DEFAULT_GATHER_THRESHOLD: Option<usize> = Some(1024);

/// The UDP send buffer asked for (Linux grants twice this, half for its bookkeeping): about
/// the kernel's own default, which the packet engine's frame socket keeps. A datagram holds its
/// share of the buffer while it waits in the interface's queue, so this bounds what a cable
/// slower than the host has queued before the kernel answers "try again" (EAGAIN, which every
/// backend retries). The protocol has no congestion control: a queue that overflows loses
/// datagrams, and their resends fill it again. With a cable held to 8 Gbit/s by a token bucket
/// with a 3 MB queue, the 16 MiB asked for before let the queue drop 40-57 % of a bulk
/// transfer's datagrams (400-455 MiB/s instead of 950); at 4 Gbit/s with a 2 MB queue even
/// 1 MiB overflowed it (230 MiB/s instead of 433); with this, neither did.
/// A 16 MiB buffer also let a whole window (8 MiB) wait in a Thunderbolt interface's queue,
/// milliseconds at its rate, past the 5 ms at which fq_codel, the usual default, drops. On veth,
/// loopback and a cable that keeps up, a datagram leaves the buffer as soon as it is handed on,
/// and the size changes nothing (docs/performance.md, "Cables slower than the host").
pub const DEFAULT_SEND_BUFFER: usize = 256 << 10;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            engine: EngineKind::Sockets,
            progress: Progress::Thread,
            spin: Duration::from_micros(200),
            max_sleep: Duration::from_millis(50),
            cpu: None,
            max_datagram: Config::default().max_datagram,
            receive_buffer: 16 << 20,
            send_buffer: DEFAULT_SEND_BUFFER,
            hold_acks: true,
            gather_threshold: DEFAULT_GATHER_THRESHOLD,
            keeper_period: KEEPER_HOLD,
            keeper_takeover: false,
            assist: false,
            faults: None,
            data_digest: None,
        }
    }
}
