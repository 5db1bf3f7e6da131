//! The engine handle: one UDP socket per rail, every connection that uses them, and the loop
//! that moves datagrams between them. [`Engine`] is what the verbs crate holds: it starts the
//! engine ([`Engine::start`]), says what it runs on, and takes intentions (add a connection,
//! post work, register or deregister a region, lend a landing zone) that the state carries out.
//!
//! Where the rest lives: the bookkeeping and the loop's passes in `state.rs`, who runs the loop
//! (a thread or the caller) and its start-up in `progress.rs`, the caller mode's keeper in
//! `keeper.rs`, the settings in `config.rs`.
//!
//! Acknowledgement hold (caller mode and assisted thread mode, [`EngineConfig::hold_acks`]):
//! the ACK of a message whose completion was just delivered is not sent in that same call. The
//! next datagram to the same peer carries it: a reply on the same queue pair in its header, one
//! on another queue pair as a second packet in its datagram (`TxBatch::commit_coalescing`).
//! Otherwise it goes at the application's next poll (assisted) or at its first poll after one
//! that found nothing (caller mode: the application is then waiting, not preparing a reply),
//! and at the latest at the end of the hold. A ping-pong then costs one datagram each way
//! instead of two, also over two queue pairs (see docs/performance.md). Assisted, it also
//! lets a memory-polling target's WRITE reply carry the ACK its peer's poll waits for, so the
//! peer's own poll receives the reply: no engine thread is woken in a ping-pong.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use tbrdma_proto::memory::RegisterError;
use tbrdma_proto::{Access, ConnectionState, Event, RecvWr, Region, RegionId, SendWr, Stats, Time};

use crate::cq::CqShared;
use crate::io::EngineKind;
use crate::io::faults::FaultPlan;
use crate::memory::{Arena, Buffer, SinkFn};
use crate::progress::{Shared, launch};
use crate::state::State;

pub use crate::config::{
    ASSISTED_ACK_HOLD, ASSISTED_MAX_SLEEP, ASSISTED_POLL_WINDOW, DATA_DIGEST_ENV,
    DEFAULT_GATHER_THRESHOLD, EngineConfig, Progress,
};
pub use crate::keeper::{CALLER_PASS_OVERDUE, KEEPER_HOLD, TAKEOVER_AWAY};
pub use crate::state::{EngineStats, NewConnection, PdId, PostFailed, SEND_HEADROOM, WriteZone};

/// Upper bound written into each connection's [`tbrdma_proto::Config::ack_hold`] in caller
/// mode: a quarter of the smallest retransmission timeout, for an application whose polls are
/// all busy (a stream on another queue pair); in practice a datagram to the peer, the first
/// idle poll or the keeper ends the hold much sooner.
const CALLER_ACK_HOLD: Duration = Duration::from_micros(250);

/// A running engine on one UDP socket.
#[derive(Debug)]
pub struct Engine {
    shared: Arc<Shared>,
    /// The engine thread (thread mode) or the keeper (caller mode).
    worker: Option<JoinHandle<()>>,
    /// Every connection asks for data digests (resolved at start, see `asks_data_digest`).
    data_digest: bool,
    config: EngineConfig,
    kind: EngineKind,
    fallback: Option<String>,
    local_addrs: Vec<SocketAddr>,
    features: crate::probe::KernelFeatures,
    /// Smallest receive buffer the kernel granted on any rail, in bytes.
    rcvbuf: usize,
    /// Whether a landing zone may be lent: set under the state lock when
    /// [`Self::expect_write`] grants one, cleared under it by the first [`Self::lending`] that
    /// finds none, so that the spins of a memory-polling application on an engine that lends
    /// nothing (every backend but sockets, every zone under [`LANDING_MIN`]) read one flag
    /// instead of locking the state: about 35 ns per spin, and once more on the round trip's
    /// path after the answer was placed.
    may_lend: AtomicBool,
}

/// Smallest landing zone lent ([`Engine::expect_write`]): a write of fewer bytes is copied
/// the usual way. The gather threshold's reasoning, from the other side (see
/// [`DEFAULT_GATHER_THRESHOLD`]): with an 8-byte zone, `linkbench`'s write-sockets round trip
/// was 1.03 of the one without a loan (ten alternating rounds, 2026-12-04), at 4 KiB 0.97.
pub const LANDING_MIN: usize = 1024;

/// 64 random bits from the kernel's generator (`getrandom(2)`): session tokens, initial
/// sequence numbers, queue pair numbers and memory keys. A failing generator is a broken
/// system, never a reason to use predictable values: it panics, naming the cause.
pub fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    if let Err(e) = getrandom::fill(&mut bytes) {
        panic!("the kernel's random generator (getrandom(2)) failed: {e}");
    }
    u64::from_le_bytes(bytes)
}

impl Engine {
    /// Binds a UDP socket to each address of `binds` (one per rail: the links to the same
    /// peers) and starts an engine on them.
    pub fn start(binds: &[SocketAddr], mut config: EngineConfig) -> io::Result<Engine> {
        if binds.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an engine needs at least one address",
            ));
        }
        let sockets = binds
            .iter()
            .map(|b| bind_socket(*b, config.receive_buffer, config.send_buffer))
            .collect::<io::Result<Vec<_>>>()?;
        let local_addrs = sockets
            .iter()
            .map(UdpSocket::local_addr)
            .collect::<io::Result<Vec<_>>>()?;
        let local_addr = local_addrs[0];
        let rcvbuf = sockets
            .iter()
            .map(|s| crate::socket::buffer_sizes(s).map_or(0, |(rcv, _)| rcv))
            .min()
            .unwrap_or(0);
        // What this kernel offers, recorded once (under a millisecond) and logged, so a user
        // can see why a path was or was not taken.
        let features = crate::probe::probe();
        tracing::debug!("kernel features:\n{features}");
        // The fault plan is read once, here: whether it corrupts decides the digests too.
        let invalid = |why| io::Error::new(io::ErrorKind::InvalidInput, why);
        if config.faults.is_none() {
            config.faults = FaultPlan::from_env().map_err(invalid)?;
        }
        let data_digest = config.asks_data_digest().map_err(invalid)?;
        let state = State::new(
            binds.len(),
            config.max_datagram,
            config.gather_threshold.unwrap_or(usize::MAX),
            data_digest,
            (random_u64() as u32) & 0x00ff_ffff,
        );
        let shared = Arc::new(Shared::new(state, &config)?);
        let (kind, fallback, worker) = launch(&shared, &config, sockets)?;
        tracing::info!(
            "engine on {local_addr}: {} backend, {:?} progress{}",
            kind.name(),
            config.progress,
            fallback
                .as_deref()
                .map(|f| format!(" ({f})"))
                .unwrap_or_default()
        );
        Ok(Engine {
            shared,
            worker: Some(worker),
            data_digest,
            config,
            kind,
            fallback,
            local_addrs,
            features,
            rcvbuf,
            may_lend: AtomicBool::new(false),
        })
    }

    /// The backend in use.
    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    /// Whether every connection of this engine asks for data digests
    /// ([`EngineConfig::data_digest`], the environment, or a fault plan that corrupts).
    pub fn asks_data_digest(&self) -> bool {
        self.data_digest
    }

    /// Whether the application's polls run the loop (caller mode, or thread mode with
    /// [`EngineConfig::assist`] on a backend that supports it): a polling thread then needs
    /// no other thread to be scheduled for its completions to arrive.
    pub fn polls_progress(&self) -> bool {
        self.config.progress == Progress::Caller || self.shared.is_assisted()
    }

    /// Caller mode: whether the loop has not run for [`CALLER_PASS_OVERDUE`]. A completion
    /// queue's poll runs the loop when it finds completions waiting but this holds, so that an
    /// application slow to work through them still acknowledges what arrives meanwhile and
    /// drains the sockets (docs/verbs.md, "Progress").
    pub fn pass_overdue(&self) -> bool {
        self.shared.pass_overdue()
    }

    /// Why the preferred backend was not used, if it was not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// The data socket's address on rail 0 (what peers send to).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addrs[0]
    }

    /// The data sockets' addresses, one per rail.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local_addrs
    }

    /// The largest receive window (in datagrams of `max_datagram` bytes) the data socket's
    /// buffer holds: a connection advertising more would have the kernel drop datagrams under
    /// load. Linux reports twice the usable size, and each datagram costs some bookkeeping.
    pub fn window_limit(&self, max_datagram: usize) -> u32 {
        let usable = self.rcvbuf / 2;
        let by_buffer = u32::try_from((usable / (max_datagram + 1024)).max(4)).unwrap_or(u32::MAX);
        match self.kind {
            // The packet engine's ring holds a fixed number of frames, whatever their size.
            EngineKind::Packet => by_buffer.min(crate::io::packet::RING_FRAMES as u32),
            _ => by_buffer,
        }
    }

    /// What the kernel offered at start-up.
    pub fn kernel_features(&self) -> &crate::probe::KernelFeatures {
        &self.features
    }

    /// Engine-wide counters.
    pub fn stats(&self) -> EngineStats {
        self.lock().stats()
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The current engine time.
    pub fn now(&self) -> Time {
        self.shared.now()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    /// Caller mode: runs the loop once (receive, deadlines, transmit). Thread mode: nothing
    /// (the engine thread does it). Returns whether anything happened.
    pub fn progress(&self) -> io::Result<bool> {
        self.shared.progress()
    }

    /// The [`tbrdma_proto::Config::ack_hold`] a new connection on this engine uses: in caller mode with
    /// [`EngineConfig::hold_acks`], a bound on holds that the next poll ends.
    pub fn ack_hold_for(&self, configured: Duration) -> Duration {
        // Holds need a next call to end them early: caller mode's polls, or an assisting
        // application's (see `Shared::progress`). Assisted, nothing else ends them (caller
        // mode's keeper sends them once the application has gone), so they are short: a target
        // that never polls (perftest's bandwidth servers) held the acknowledgement of each
        // burst's last message for a millisecond, as long as the sender's first
        // retransmission timeout, and the sender resent the burst.
        if !self.config.hold_acks || !self.polls_progress() {
            configured
        } else if self.shared.is_assisted() {
            configured.max(ASSISTED_ACK_HOLD)
        } else {
            configured.max(CALLER_ACK_HOLD)
        }
    }
}

/// The engine's bookkeeping, by intention: every change to connections, regions and landing
/// zones is one of these, and the state (`state.rs`) keeps its own invariants.
impl Engine {
    /// A fresh queue pair number (for the connection manager to announce before adding it).
    pub fn reserve_qpn(&self) -> u32 {
        self.lock().reserve_qpn()
    }

    /// A new protection domain: an arena for regions, with keys from a fresh OS seed.
    pub fn add_protection_domain(&self) -> PdId {
        let mut seed = [0u8; 32];
        for chunk in seed.chunks_mut(8) {
            chunk.copy_from_slice(&random_u64().to_le_bytes());
        }
        self.lock().add_protection_domain(seed)
    }

    /// Registers `buffer` with `access` in protection domain `pd`.
    pub fn register(
        &self,
        pd: PdId,
        buffer: Arc<Buffer>,
        access: Access,
    ) -> Result<Region, RegisterError> {
        self.lock().register(pd, buffer, access)
    }

    /// Runs `body` while the WRITE packets whose payload lands entirely inside bytes `range` of
    /// `region` (in protection domain `pd`) are handed to `place` instead of being stored,
    /// unless it declines them; see [`crate::memory::with_write_sink`], which says what
    /// `place` may do and when the packets are stored as usual. Returns whether the sink was
    /// installed (one per protection domain at a time) and what `body` returned.
    pub fn with_write_sink<R>(
        &self,
        pd: PdId,
        region: RegionId,
        range: std::ops::Range<usize>,
        place: &mut SinkFn<'_>,
        body: impl FnOnce() -> R,
    ) -> (bool, R) {
        // (Quietly: a sink changes nothing the loop sends.)
        let in_arena = |f: &mut dyn FnMut(&mut Arena)| {
            let mut state = self.shared.lock_to_read();
            state.arena_mut(pd).map(f).is_some()
        };
        crate::memory::with_write_sink(&in_arena, region, range, place, body)
    }

    /// Revokes the keys of `region` in `pd` at once and, unless an outstanding request still
    /// names it, forgets its bytes; otherwise returns how many requests do. Call it again once
    /// they completed (the keys stay revoked meanwhile, the bytes stay mapped).
    pub fn deregister(&self, pd: PdId, region: RegionId) -> Result<(), usize> {
        self.lock().deregister(pd, region)
    }

    /// Adds a connection (not yet established) and starts its handshake.
    pub fn add_connection(&self, new: NewConnection) -> io::Result<()> {
        self.shared
            .post(|state, now| state.add_connection(new, now))
    }

    /// Posts send-queue work requests on queue pair `qpn` under one lock and one doorbell.
    /// Stops at the first refused request; the ones before it were posted.
    pub fn post_send(&self, qpn: u32, wrs: &[SendWr]) -> Result<(), PostFailed> {
        self.shared
            .post_send_work(|state, _now| state.post_send(qpn, wrs))
            .map_err(PostFailed::Io)?
    }

    /// Posts receive buffers on queue pair `qpn`, in order. A posted receive puts nothing on
    /// the wire: in caller mode no transmit pass runs for it (the next poll's does).
    pub fn post_recv(&self, qpn: u32, wrs: &[RecvWr]) -> Result<(), PostFailed> {
        self.shared
            .post_maybe_quiet(true, |state, _now| state.post_recv(qpn, wrs))
            .map_err(PostFailed::Io)?
    }

    /// Sets whether queue pair `qpn` lends the engine the [`SEND_HEADROOM`] bytes in front of
    /// its send payloads (see `QueuePair::set_send_headroom` in tbrdma-verbs). False when the
    /// engine has no such queue pair.
    pub fn set_send_headroom(&self, qpn: u32, on: bool) -> bool {
        self.lock().set_send_headroom(qpn, on)
    }

    /// Sends queue pair `qpn`'s completions to `send_cq` and `recv_cq` from now on (the
    /// connection manager adds a connection with completion queues of its own while it waits
    /// for the handshake, then hands it to the application's). Only while the queue pair has
    /// no work outstanding, so that no completion is on its way to the old queues:
    /// `Some(false)` when it has (nothing changes), `None` when the engine has no such queue
    /// pair.
    pub fn rebind_cqs(
        &self,
        qpn: u32,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
    ) -> Option<bool> {
        self.lock().rebind_cqs(qpn, send_cq, recv_cq)
    }

    /// Lends the engine `zone` for receiving the write queue pair `qpn` expects next (see
    /// [`crate::io::Landing`]): the header's room in front of the payload and room for one
    /// datagram's payload. `seen`: how many receive completions of the queue pair the
    /// application has polled. `Some(false)`: refused (a completion the application has not
    /// seen, a message partly received into those bytes, a zone under [`LANDING_MIN`] bytes,
    /// or a backend other than sockets, which never receives into a zone); `None`: no such
    /// queue pair.
    ///
    /// # Panics
    /// If the zone, with its header room, does not lie in `zone.buffer`.
    pub fn expect_write(&self, qpn: u32, zone: WriteZone, seen: u64) -> Option<bool> {
        if !self.lends_zones(zone.len) {
            // Refused, so that a memory-polling application (`lending()`) does not pay for a
            // zone that saves nothing. (A refusal changes nothing the loop sends: the state is
            // locked only to read.)
            return self
                .shared
                .lock_to_read()
                .has_connection(qpn)
                .then_some(false);
        }
        let mut state = self.lock();
        let granted = state.expect_write(qpn, zone, seen);
        if granted == Some(true) {
            // (Under the lock: a `lending` that clears the flag holds it too, see there.)
            self.may_lend.store(true, Ordering::Release);
        }
        granted
    }

    /// Whether [`Self::expect_write`] may grant a zone of `len` bytes: only the sockets backend
    /// receives into a zone, and a payload under [`LANDING_MIN`] bytes is copied faster than a
    /// loan is set up and watched. Where this is false every loan is refused, and an
    /// application that would lend a zone before every message can skip the call (a lock of
    /// the state and the region's reference count taken and dropped, for nothing).
    pub fn lends_zones(&self, len: usize) -> bool {
        self.kind == EngineKind::Sockets && len >= LANDING_MIN
    }

    /// Whether queue pair `qpn` still has the landing zone of its last
    /// [`Self::expect_write`] lent.
    pub fn lending(&self, qpn: u32) -> bool {
        // No zone lent since the last call that found none: nothing to lock. (The flag was
        // cleared under the state lock after the loan ended, so what the loop placed in the
        // zone before is visible to whoever reads false here.)
        if !self.may_lend.load(Ordering::Acquire) {
            return false;
        }
        // (Asked between polls, spin after spin: a lock that marked the state dirty would make
        // every poll look for something to send.)
        let state = self.shared.lock_to_read();
        if !state.lends_any() {
            // Granted only under this lock (`expect_write`), so no loan can start between the
            // check and the store.
            self.may_lend.store(false, Ordering::Release);
        }
        state.lending(qpn)
    }

    /// Closes queue pair `qpn` (its CLOSE goes out; the engine forgets it once sent) and takes
    /// back any landing zone it lent.
    pub fn close(&self, qpn: u32) -> io::Result<()> {
        self.shared.post(|state, now| state.close(qpn, now))
    }

    /// The state of connection `qpn` ([`ConnectionState::Closed`] once the engine forgot it).
    pub fn connection_state(&self, qpn: u32) -> ConnectionState {
        self.lock().connection_state(qpn)
    }

    /// Events of connection `qpn` since the last call.
    pub fn take_events(&self, qpn: u32) -> Vec<Event> {
        self.lock().take_events(qpn)
    }

    /// Whether connection `qpn` completed its handshake and the event is still unread.
    pub fn was_established(&self, qpn: u32) -> bool {
        self.lock().was_established(qpn)
    }

    /// Protocol counters of connection `qpn` (zeros once the engine forgot it).
    pub fn connection_stats(&self, qpn: u32) -> Stats {
        self.lock().connection_stats(qpn)
    }

    /// Datagrams connection `qpn` sent on each rail, and how many times a rail was declared
    /// down.
    pub fn rail_stats(&self, qpn: u32) -> (Vec<u64>, u64) {
        self.lock().rail_stats(qpn)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.stop();
        if let Some(worker) = self.worker.take() {
            worker.thread().unpark();
            let _ = worker.join();
        }
    }
}

fn bind_socket(bind: SocketAddr, receive: usize, send: usize) -> io::Result<UdpSocket> {
    // Forced past the sysctl caps where allowed (see `EngineConfig::{receive,send}_buffer`).
    let socket = crate::socket::bind_udp(bind, receive, send)?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}
