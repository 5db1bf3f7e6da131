//! The progress engine: one UDP socket, every connection that uses it, and the loop that moves
//! datagrams between them.
//!
//! Two progress modes (chosen per device):
//! - [`Progress::Thread`]: a background thread owns the socket's backend and runs the loop, so
//!   one-sided operations complete with no call from the target application. It busy-polls for
//!   [`EngineConfig::spin`] after the last activity, then sleeps in the kernel until a datagram,
//!   a deadline or a post from another thread wakes it.
//! - [`Progress::Caller`]: no thread; whoever polls a completion queue (or calls
//!   [`Engine::progress`]) runs the loop, and posting a request sends it at once. This is what
//!   NCCL's proxy thread and 2-core machines want: one spinning thread per process.
//!
//! In caller mode a small *keeper* thread stands in for an application that has stopped
//! calling: when nobody entered the engine for a while (600 µs at most) it sends the acknowledgements
//! still held (below), so that the peer's requests complete. It blocks on a periodic timer
//! (every [`EngineConfig::keeper_period`]) that the application's first poll arms and that the keeper disarms
//! when it finds the application gone and nothing held; a polling application makes no system
//! call for it. The keeper never receives, and runs in `SCHED_BATCH` so that waking up never
//! preempts a polling thread.
//!
//! Acknowledgement hold (caller mode, [`EngineConfig::hold_acks`]): the ACK of a message whose
//! completion was just delivered is not sent in that same call; the application's next poll
//! sends it, unless a reply it posts first carries it. A ping-pong then costs one datagram each
//! way instead of two (see docs/performance.md).

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
// FxHash: these maps are looked up several times per datagram with small integer keys, which
// SipHash (std's default, built against hash flooding) makes cost more. Only this process
// inserts keys (queue pair numbers, region ids); a peer-supplied number is only looked up.
use rustc_hash::FxHashMap as HashMap;
use tbrdma_proto::connection::ConnectParams;
use tbrdma_proto::memory::RegisterError;
use tbrdma_proto::{
    Access, Config, Connection, ConnectionState, Event, Memory, PostError, Queue, RecvWr, Region,
    RegionId, SendWr, Sge, Stats, Time,
};

use crate::cq::{Completion, CqShared};
use crate::io::{DatagramIo, EngineKind, Landing, RegionPart, TxBatch, open as open_io};
use crate::memory::{Arena, Buffer};

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
    /// Preferred backend (io_uring falls back to sockets when unavailable).
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
    /// Socket receive and send buffer size to ask for.
    pub socket_buffer: usize,
    /// Caller mode: hold the acknowledgement of a just-completed message until the
    /// application's next poll, so that a reply posted in between carries it. The keeper
    /// thread bounds the hold when the application stops calling.
    pub hold_acks: bool,
    /// Caller mode: period of the keeper's alarm (see the module docs); held acknowledgements
    /// go out at most this plus 100 µs after the application's last poll. Keep it under half
    /// the peers' smallest retransmission timeout ([`Config::initial_rto`]), or an application
    /// that pauses makes its peers retransmit for nothing.
    pub keeper_period: Duration,
    /// Data packets whose payload is at least this many bytes are sent as gathered datagrams:
    /// the header from the engine's buffer and the payload straight from the registered region
    /// (two iovecs), saving a user-space copy of every payload byte; smaller payloads are
    /// copied behind the header. `None` copies everything. See [`DEFAULT_GATHER_THRESHOLD`].
    pub gather_threshold: Option<usize>,
}

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

/// Bytes in front of a send payload that a queue pair with [`Slot::send_headroom`] lets the
/// engine write: the largest datagram header, which then goes out from the region together with
/// its payload, as one contiguous buffer. On veth a single iovec sends a 16 KiB datagram about
/// 0.2 µs faster than the header and the payload as two (docs/performance.md).
pub const SEND_HEADROOM: usize = tbrdma_proto::wire::MAX_HEADER_LEN;

/// Caller mode: default of [`EngineConfig::keeper_period`]. Held acknowledgements go out at
/// most `KEEPER_HOLD + KEEPER_AWAY` (600 µs) after the application's last poll, well inside
/// the peer's smallest retransmission timeout with the default [`Config::initial_rto`] of 1 ms.
pub const KEEPER_HOLD: Duration = Duration::from_micros(500);
/// Caller mode: the keeper counts the application as gone when it has not polled for this long.
const KEEPER_AWAY: Duration = Duration::from_micros(100);
// Caller mode, how the keeper's alarm is kept: a periodic timerfd, armed by the application's
// first poll after the keeper parked and disarmed when the keeper finds the application gone
// and nothing held (both under the state lock). A polling application makes no system call for
// the keeper: setting a timer costs 6.4 µs on this VM (a timer-programming exit), and polls
// that pushed a one-shot alarm out every 250 µs made about one 16 KiB all-reduce in twenty
// ~11 µs slower (mean 9.85 µs for a median of 8.87; docs/performance.md); a keeper re-arming
// its own one-shot alarm on each wake-up cost about half that. The keeper wakes once per
// period while the application polls, usually while a waiting rank yields its core; each
// wake-up is a timer interrupt and two context switches on a busy core, so connections that
// can wait longer for held acknowledgements (the collectives) lengthen the period.
/// Upper bound written into each connection's [`Config::ack_hold`] in caller mode; in practice
/// the next poll or the keeper releases the hold much sooner.
const CALLER_ACK_HOLD: Duration = Duration::from_millis(1);

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            engine: EngineKind::Uring,
            progress: Progress::Thread,
            spin: Duration::from_micros(200),
            max_sleep: Duration::from_millis(50),
            cpu: None,
            max_datagram: Config::default().max_datagram,
            socket_buffer: 16 << 20,
            hold_acks: true,
            gather_threshold: DEFAULT_GATHER_THRESHOLD,
            keeper_period: KEEPER_HOLD,
        }
    }
}

/// Engine-wide counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Datagrams for no known queue pair, or from an address other than its peer.
    pub foreign_datagrams: u64,
    /// Loop iterations that moved something.
    pub busy_iterations: u64,
    /// Times the engine thread went to sleep.
    pub sleeps: u64,
    /// Payloads received straight into their place (a landing zone, see [`Landing`]).
    pub landed_in_place: u64,
}

/// A protection domain of one engine: which arena its regions live in. Only the engine makes
/// them ([`Engine::add_protection_domain`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PdId(usize);

/// A new connection, as the connection manager agreed it with the peer: everything the engine
/// needs to add it ([`Engine::add_connection`]).
#[derive(Debug)]
pub struct NewConnection {
    /// Protocol configuration (already fitted to this engine, see [`Engine::window_limit`]).
    pub config: Config,
    /// Whether this side sends CONNECT (the client).
    pub active: bool,
    /// Token, queue pair numbers (`local_qpn` names the connection) and initial sequence number.
    pub params: ConnectParams,
    /// The peer's data socket on each rail, in rail order.
    pub peers: Vec<SocketAddr>,
    /// The protection domain whose regions the connection's requests name.
    pub pd: PdId,
    /// Where send-queue completions go.
    pub send_cq: Arc<CqShared>,
    /// Where receive-queue completions go.
    pub recv_cq: Arc<CqShared>,
}

/// Why work could not be posted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostFailed {
    /// The engine has no connection by that number (closed, or never added).
    #[error("the queue pair is closed")]
    Closed,
    /// The protocol refused a request (queue full, malformed); the ones before it were posted.
    #[error(transparent)]
    Refused(#[from] PostError),
    /// Sending what was posted failed.
    #[error(transparent)]
    Io(io::Error),
}

/// The bytes of a registered region a queue pair expects its next write in
/// ([`Engine::expect_write`]).
#[derive(Debug)]
pub struct WriteZone {
    /// The region's bytes.
    pub buffer: Arc<Buffer>,
    /// The region's id in its protection domain.
    pub region: RegionId,
    /// The region's remote key.
    pub rkey: u32,
    /// Where the write's payload starts in `buffer`: the [`SEND_HEADROOM`] bytes in front of it
    /// must lie in the buffer too (the header is received there).
    pub offset: usize,
    /// How many payload bytes the write brings.
    pub len: usize,
}

/// One connection and where its completions go.
#[derive(Debug)]
struct Slot {
    /// The protocol state machine.
    conn: Connection,
    /// The peer's data socket on each rail: datagrams from anywhere else are dropped.
    peers: Vec<SocketAddr>,
    /// Protection domain (index of its arena).
    pd: usize,
    /// Where send-queue completions go.
    send_cq: Arc<CqShared>,
    /// Where receive-queue completions go.
    recv_cq: Arc<CqShared>,
    /// Connection events not yet read.
    events: Vec<Event>,
    /// Region named by each outstanding send, in post order (see [`State::record_post`]).
    sq_regions: VecDeque<Option<RegionId>>,
    /// Region named by each posted receive, in post order.
    rq_regions: VecDeque<Option<RegionId>>,
    /// The application dropped its queue pair: remove the slot once it has nothing to send.
    detached: bool,
    /// Receive-queue completions delivered so far (a landing zone is valid only for an
    /// application that has seen them all, see [`State::set_landing`]).
    recv_completions: u64,
    /// The application promised that the [`SEND_HEADROOM`] bytes in front of every send
    /// payload of this queue pair are its to write while the request is outstanding: gathered
    /// datagrams then have their header written there and leave as one buffer.
    send_headroom: bool,
}

/// Everything the loop and the application share, behind one lock.
#[derive(Debug)]
struct State {
    /// One arena per protection domain.
    arenas: Vec<Arena>,
    /// Outstanding requests naming each region, per protection domain.
    region_users: HashMap<(usize, RegionId), usize>,
    /// Connections by local queue pair number.
    conns: HashMap<u32, Slot>,
    /// Counters.
    stats: EngineStats,
    next_qpn: u32,
    /// Datagrams waiting to leave, one batch per rail.
    tx: Vec<TxBatch>,
    next_deadline: Option<Time>,
    /// Some connection holds an acknowledgement for a reply to carry.
    acks_held: bool,
    /// Something may have changed since the last transmit pass (a post, a new connection, a
    /// released hold): the next loop must run one even if nothing arrived.
    dirty: bool,
    /// Whom each rail's socket should be connected to, and whom it is.
    bindings: Vec<RailBinding>,
    /// Payloads of at least this many bytes are sent from their region in place
    /// ([`EngineConfig::gather_threshold`]; `usize::MAX`: never).
    gather_from: usize,
    /// Where the next datagram may be received (one zone per engine: the collectives open a
    /// device per neighbour), and the protection domain of its region.
    landing: Option<Landing>,
    landing_pd: usize,
}

/// A rail socket's association. A socket whose connections all talk to one peer is connected
/// to it: the kernel then skips a route lookup for every datagram sent and finds the socket by
/// early demultiplexing on receipt (measured on veth: about 1 µs off an 8 B round trip), and
/// drops datagrams from anyone else before they reach the engine. Once a second peer appears,
/// the socket is disconnected for good.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Binding {
    /// No connection yet.
    Open,
    /// Every connection on the rail talks to this address.
    Peer(SocketAddr),
    /// Connections on the rail talk to several addresses.
    Shared,
}

#[derive(Clone, Copy, Debug)]
struct RailBinding {
    wanted: Binding,
    applied: Option<SocketAddr>,
}

impl RailBinding {
    fn target(&self) -> Option<SocketAddr> {
        match self.wanted {
            Binding::Peer(p) => Some(p),
            Binding::Open | Binding::Shared => None,
        }
    }
}

impl State {
    /// A fresh queue pair number.
    fn reserve_qpn(&mut self) -> u32 {
        loop {
            self.next_qpn = self.next_qpn.wrapping_add(1).max(1);
            if !self.conns.contains_key(&self.next_qpn) {
                return self.next_qpn;
            }
        }
    }

    /// Adds a connection; its rails' sockets are connected to its peer when it is their only
    /// one (see [`Binding`]), before its first datagram leaves.
    fn add_connection(&mut self, new: NewConnection, now: Time) {
        let NewConnection {
            config,
            active,
            params,
            peers,
            pd,
            send_cq,
            recv_cq,
        } = new;
        let qp_num = params.local_qpn;
        let mut conn = if active {
            Connection::connect(config, params, now)
        } else {
            Connection::accept(config, params, now)
        };
        conn.set_paths(peers.len());
        for (binding, peer) in self.bindings.iter_mut().zip(&peers) {
            binding.wanted = match binding.wanted {
                Binding::Open => Binding::Peer(*peer),
                Binding::Peer(p) if p == *peer => Binding::Peer(p),
                Binding::Peer(_) | Binding::Shared => Binding::Shared,
            };
        }
        let slot = Slot {
            conn,
            peers,
            pd: pd.0,
            send_cq,
            recv_cq,
            events: Vec::new(),
            sq_regions: VecDeque::new(),
            rq_regions: VecDeque::new(),
            detached: false,
            recv_completions: 0,
            send_headroom: false,
        };
        self.conns.insert(qp_num, slot);
        self.dirty = true;
    }

    /// Posts every request of `wrs` on queue pair `qpn`'s `queue` with `post`, stopping at the
    /// first one refused, and records which region each names (see [`Self::record_post`]).
    fn post_work<W>(
        &mut self,
        qpn: u32,
        wrs: &[W],
        queue: Queue,
        post: impl Fn(&mut Connection, &Arena, &W) -> Result<Sge, PostError>,
    ) -> Result<(), PostFailed> {
        let State {
            conns,
            arenas,
            region_users,
            ..
        } = self;
        let slot = conns.get_mut(&qpn).ok_or(PostFailed::Closed)?;
        let arena = &arenas[slot.pd];
        for wr in wrs {
            let local = post(&mut slot.conn, arena, wr)?;
            let region = region_of(arena, local);
            record_post(region_users, slot, queue, region);
        }
        Ok(())
    }

    /// Revokes the keys of `region` of protection domain `pd` and, when no outstanding request
    /// names it, forgets its bytes too; otherwise returns how many requests still do (its bytes
    /// stay until they complete: an in-flight send never reads freed memory).
    fn deregister(&mut self, pd: PdId, region: RegionId) -> Result<(), usize> {
        let key = (pd.0, region);
        let arena = &mut self.arenas[pd.0];
        let _ = arena.table_mut().deregister(region);
        match self.region_users.get(&key).copied().unwrap_or(0) {
            0 => {
                arena.deregister(region);
                self.region_users.remove(&key);
                Ok(())
            }
            users => Err(users),
        }
    }

    /// Connects or disconnects rail sockets whose wanted association changed.
    fn apply_bindings(&mut self, rails: &mut [Box<dyn DatagramIo>]) {
        for (rail, binding) in self.bindings.iter_mut().enumerate() {
            let target = binding.target();
            if target == binding.applied {
                continue;
            }
            match rails[rail].set_peer(target) {
                Ok(()) => binding.applied = target,
                Err(e) => {
                    tracing::warn!("cannot associate rail {rail}'s socket with {target:?}: {e}");
                    binding.wanted = Binding::Shared;
                    if rails[rail].set_peer(None).is_ok() {
                        binding.applied = None;
                    }
                }
            }
        }
    }

    /// Ends every acknowledgement hold: the next transmit pass sends them.
    fn release_held_acks(&mut self) {
        if std::mem::take(&mut self.acks_held) {
            self.dirty = true;
            for slot in self.conns.values_mut() {
                slot.conn.release_held_ack();
            }
        }
    }

    /// Lends the engine a landing zone (see [`Landing`]) for queue pair `landing.qpn`, whose
    /// application has seen `seen` of its receive completions, in protection domain `pd`.
    /// Refused (returns false) when that count is behind the engine's (writes the application
    /// has not seen yet may lie in the zone), or while a message to be placed in the zone is
    /// partly received: its first packets may already lie there, and any datagram received
    /// into the zone would overwrite them (such as its missing last packet, resent). With
    /// `None`, takes back any zone lent.
    fn set_landing(&mut self, pd: usize, landing: Option<Landing>, seen: u64) -> bool {
        self.clear_landing();
        let Some(landing) = landing else {
            return true;
        };
        if self
            .conns
            .get(&landing.qpn)
            .is_none_or(|slot| slot.recv_completions != seen || slot.detached)
        {
            return false;
        }
        let zone = landing.zone.offset()..landing.zone.offset() + landing.zone.len();
        // (Any queue pair of the domain: a peer may write into the same region on another.)
        let zone_bytes = zone.start as u64..zone.end as u64;
        let overwrites_a_message = self.conns.values().any(|slot| {
            slot.pd == pd
                && slot.conn.receiving_into().is_some_and(|(region, bytes)| {
                    region == landing.region
                        && bytes.start < zone_bytes.end
                        && zone_bytes.start < bytes.end
                })
        });
        if overwrites_a_message {
            return false;
        }
        self.arenas[pd].watch(Some((landing.region, zone)));
        self.landing = Some(landing);
        self.landing_pd = pd;
        true
    }

    /// Takes back the landing zone lent for queue pair `qpn`, if that is whose it is.
    fn forget_landing_of(&mut self, qpn: u32) {
        if self.landing.as_ref().is_some_and(|l| l.qpn == qpn) {
            self.clear_landing();
        }
    }

    fn clear_landing(&mut self) {
        end_loan(&mut self.landing, &mut self.arenas[..], self.landing_pd);
    }

    /// Receives, handles deadlines, transmits and routes completions once. Returns whether
    /// anything happened.
    fn run_once(&mut self, rails: &mut [Box<dyn DatagramIo>], now: Time) -> io::Result<bool> {
        let State {
            conns,
            arenas,
            stats,
            landing,
            landing_pd,
            ..
        } = self;
        let mut received = 0;
        for (rail, io) in rails.iter_mut().enumerate() {
            let lent = landing.is_some();
            received += io.recv(landing, &mut |data: &[u8], from| {
                let qpn = data
                    .get(16..20)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                match qpn.and_then(|q| conns.get_mut(&q)) {
                    Some(slot) if slot.peers.get(rail) == Some(&from) => {
                        slot.conn
                            .handle_datagram_on(now, data, rail, &mut arenas[slot.pd]);
                    }
                    _ => stats.foreign_datagrams += 1,
                }
            })?;
            // A write placed into the zone (received there, or copied in) ends the loan, and
            // so does a datagram too long for it (the backend dropped the zone).
            if lent && (landing.is_none() || arenas[*landing_pd].watch_hit()) {
                stats.landed_in_place += arenas[*landing_pd].take_in_place();
                // (The backend may have taken the zone already, when too long a datagram came.)
                *landing = None;
                arenas[*landing_pd].watch(None);
            }
        }
        let deadline_due = self.next_deadline.is_some_and(|d| d <= now);
        if deadline_due {
            for slot in self.conns.values_mut() {
                if slot.conn.poll_timeout().is_some_and(|d| d <= now) {
                    slot.conn.handle_timeout(now);
                }
            }
        }
        // An empty poll with no deadline and no post since the last pass has nothing to send.
        let sent = if received > 0 || deadline_due || self.dirty {
            self.flush(rails, now)?
        } else {
            false
        };
        let busy = received > 0 || sent;
        if busy {
            self.stats.busy_iterations += 1;
        }
        Ok(busy)
    }

    /// Transmits whatever the connections have to send and routes their completions and
    /// events. Returns whether a datagram went out.
    fn flush(&mut self, rails: &mut [Box<dyn DatagramIo>], now: Time) -> io::Result<bool> {
        self.dirty = false;
        self.apply_bindings(rails);
        let mut sent = false;
        let mut deadline: Option<Time> = None;
        let mut acks_held = false;
        let State {
            conns,
            arenas,
            region_users,
            tx,
            gather_from,
            landing,
            landing_pd,
            ..
        } = self;
        let gather_from = *gather_from;
        for slot in conns.values_mut() {
            let arena = &arenas[slot.pd];
            loop {
                // Every batch needs a free buffer: the datagram's rail is known only after.
                for (rail, batch) in tx.iter_mut().enumerate() {
                    if batch.is_full() {
                        rails[rail].send(batch)?;
                        sent = true;
                    }
                }
                let (first, others) = tx.split_first_mut().expect("at least one rail");
                let buf = first.next_buf().expect("a free buffer after sending");
                let Some(t) = slot.conn.poll_transmit_gather(now, buf, arena, gather_from) else {
                    break;
                };
                // A gathered datagram's payload is sent from its region, which the batch holds
                // on to until the datagram has left.
                let mut head_len = t.len;
                let part = match t.payload {
                    None => None,
                    Some(p) => match arena.buffer(p.region) {
                        Some(buffer)
                            if slot.send_headroom
                                && p.starts_request
                                && t.len <= p.offset as usize =>
                        {
                            // The header goes in front of the payload, in the headroom the
                            // application lent: one contiguous datagram in the region.
                            let start = p.offset as usize - t.len;
                            buffer.write(start, &buf[..t.len]);
                            head_len = 0;
                            Some(RegionPart::new(Arc::clone(buffer), start, t.len + p.len))
                        }
                        Some(buffer) => Some(RegionPart::new(
                            Arc::clone(buffer),
                            p.offset as usize,
                            p.len,
                        )),
                        None => {
                            // The region is gone (it cannot be while a request names it):
                            // drop the datagram rather than send a short one; the protocol
                            // resends or fails the request.
                            tracing::debug!("payload region {:?} is gone", p.region);
                            continue;
                        }
                    },
                };
                let path = t.path.min(slot.peers.len() - 1);
                first.commit_parts(head_len, slot.peers[path], part);
                if path > 0 {
                    first.move_last_to(&mut others[path - 1]);
                }
            }
            while let Some(wc) = slot.conn.poll_completion() {
                let (cq, regions) = match wc.queue {
                    Queue::Send => (&slot.send_cq, &mut slot.sq_regions),
                    Queue::Recv => {
                        slot.recv_completions += 1;
                        // The application has not seen this completion yet: its landing
                        // zone may be where the write went.
                        if landing
                            .as_ref()
                            .is_some_and(|l| l.qpn == slot.conn.params().local_qpn)
                        {
                            end_loan(landing, arenas, *landing_pd);
                        }
                        (&slot.recv_cq, &mut slot.rq_regions)
                    }
                };
                release_completed(region_users, slot.pd, regions);
                cq.push(Completion {
                    wc,
                    qp_num: slot.conn.params().local_qpn,
                });
            }
            while let Some(event) = slot.conn.poll_event() {
                slot.events.push(event);
            }
            if let Some(t) = slot.conn.poll_timeout() {
                deadline = Some(deadline.map_or(t, |d| d.min(t)));
            }
            acks_held |= slot.conn.ack_held();
        }
        // Dropped queue pairs whose CLOSE is now in the batch leave the table.
        conns.retain(|_, slot| !slot.detached);
        if landing
            .as_ref()
            .is_some_and(|l| !conns.contains_key(&l.qpn))
        {
            end_loan(landing, arenas, *landing_pd);
        }
        for (rail, batch) in tx.iter_mut().enumerate() {
            if !batch.is_empty() {
                rails[rail].send(batch)?;
                sent = true;
            }
        }
        self.next_deadline = deadline;
        self.acks_held = acks_held;
        Ok(sent)
    }

    /// The earliest connection deadline.
    fn next_deadline(&self) -> Option<Time> {
        self.next_deadline
    }
}

/// Takes back the landing zone lent, if any, and stops watching it (its arena is `pd`'s).
fn end_loan(landing: &mut Option<Landing>, arenas: &mut [Arena], pd: usize) {
    if landing.take().is_some() {
        arenas[pd].watch(None);
    }
}

// The rule that lets a region be deregistered safely: the i-th completion of a queue releases
// the region named by the i-th request posted on it (both queues complete in post order), and a
// region's bytes are forgotten only when no outstanding request names it. `record_post` and
// `release_completed` are the only places that change the per-queue FIFOs and the counts.

/// The region (if any) that the local buffer of a request names.
fn region_of(arena: &Arena, local: Sge) -> Option<RegionId> {
    (local.len > 0)
        .then(|| {
            arena
                .table()
                .check_local(local.lkey, local.addr, local.len, Access::empty())
                .ok()
                .map(|p| p.region)
        })
        .flatten()
}

/// A request naming `region` was posted on `slot`'s `queue`: remember it in post order and
/// count one more user of the region.
fn record_post(
    users: &mut HashMap<(usize, RegionId), usize>,
    slot: &mut Slot,
    queue: Queue,
    region: Option<RegionId>,
) {
    match queue {
        Queue::Send => slot.sq_regions.push_back(region),
        Queue::Recv => slot.rq_regions.push_back(region),
    }
    if let Some(r) = region {
        *users.entry((slot.pd, r)).or_default() += 1;
    }
}

/// The oldest outstanding request of the queue whose posted regions are `posted` completed:
/// its region has one user fewer.
fn release_completed(
    users: &mut HashMap<(usize, RegionId), usize>,
    pd: usize,
    posted: &mut VecDeque<Option<RegionId>>,
) {
    let region = posted.pop_front().flatten();
    if let Some(n) = region.and_then(|r| users.get_mut(&(pd, r))) {
        *n = n.saturating_sub(1);
    }
}

/// Parts shared by the application's threads and the engine thread.
#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// The backend, in caller mode (in thread mode the engine thread owns it).
    io: Mutex<Option<Vec<Box<dyn DatagramIo>>>>,
    wake: EventFd,
    sleeping: AtomicBool,
    stop: AtomicBool,
    epoch: Instant,
    /// Caller mode: when the application last entered the loop (nanoseconds of [`Shared::now`]),
    /// so the keeper can tell whether it is still polling.
    last_entry: AtomicU64,
    /// Caller mode: the keeper's alarm.
    keeper_timer: Option<TimerFd>,
    /// Caller mode: whether the alarm is set (or the keeper is checking); false once the keeper
    /// parked, when the next poll must arm it. Changed only under the state lock.
    keeper_armed: AtomicBool,
    /// Caller mode: [`EngineConfig::keeper_period`].
    keeper_period: Duration,
}

impl Shared {
    fn now(&self) -> Time {
        Time(self.epoch.elapsed().as_nanos() as u64)
    }

    /// Caller mode, for the keeper: sends the acknowledgements still held. Nothing else: the
    /// application's own polls receive (a keeper that received would run connection timers
    /// against a socket nobody reads and hand completions to an application in mid-step).
    /// Returns whether some may still be held: their datagram could not go out, or another
    /// thread was using the backends (and may leave without polling).
    fn flush_held_acks(&self) -> io::Result<bool> {
        let mut ran = false;
        let held = self.with_rails(|state, rails, now| {
            ran = true;
            if state.acks_held {
                state.release_held_acks();
                state.flush(rails, now)?;
            }
            if !state.acks_held {
                // Nothing left to send: park. Under the lock, so that a poll after this one
                // sees it and arms the alarm again (after the disarming).
                if let Some(timer) = &self.keeper_timer {
                    if let Err(e) = timer.unset() {
                        tracing::error!("cannot stop the keeper's timer: {e}");
                    }
                }
                self.keeper_armed.store(false, Ordering::Relaxed);
            }
            Ok(state.acks_held)
        })?;
        Ok(held || !ran)
    }

    /// Caller mode: sets the keeper's alarm to go off `after` from now (1 ns: at once).
    fn arm_keeper(&self, after: Duration) {
        if let Some(timer) = &self.keeper_timer {
            let at =
                Expiration::OneShot(TimeSpec::from_duration(after.max(Duration::from_nanos(1))));
            if let Err(e) = timer.set(at, TimerSetTimeFlags::empty()) {
                tracing::error!("cannot set the keeper's timer: {e}");
            }
        }
    }

    /// Caller mode: runs the loop once, first ending the acknowledgement holds (this is the
    /// "next call" they were waiting for).
    fn progress_caller(&self) -> io::Result<bool> {
        self.with_rails(|state, rails, now| {
            // The keeper reads this to tell whether the application is still polling. (When
            // another thread holds the rails, that thread's call records the time instead.)
            self.last_entry.store(now.0, Ordering::Relaxed);
            // A parked keeper needs its alarm set; an armed one re-arms itself.
            if !self.keeper_armed.load(Ordering::Relaxed) {
                self.keeper_armed.store(true, Ordering::Relaxed);
                if let Some(timer) = &self.keeper_timer {
                    let every = TimeSpec::from_duration(self.keeper_period);
                    if let Err(e) =
                        timer.set(Expiration::Interval(every), TimerSetTimeFlags::empty())
                    {
                        tracing::error!("cannot set the keeper's timer: {e}");
                    }
                }
            }
            state.release_held_acks();
            state.run_once(rails, now)
        })
    }

    /// Caller mode: runs `f` on the state and the backends unless another thread is using the
    /// backends right now (it is doing the same work: skip, returning false).
    fn with_rails(
        &self,
        f: impl FnOnce(&mut State, &mut [Box<dyn DatagramIo>], Time) -> io::Result<bool>,
    ) -> io::Result<bool> {
        let Ok(mut io) = self.io.try_lock() else {
            return Ok(false);
        };
        let Some(rails) = io.as_mut() else {
            return Ok(false);
        };
        let mut state = self.state.lock().expect("engine state lock");
        f(&mut state, rails, self.now())
    }
}

/// A running engine on one UDP socket.
#[derive(Debug)]
pub struct Engine {
    shared: Arc<Shared>,
    /// The engine thread (thread mode) or the keeper (caller mode).
    worker: Option<JoinHandle<()>>,
    config: EngineConfig,
    kind: EngineKind,
    fallback: Option<String>,
    local_addrs: Vec<SocketAddr>,
    features: crate::probe::KernelFeatures,
    /// Smallest receive buffer the kernel granted on any rail, in bytes.
    rcvbuf: usize,
}

/// Opens a backend on each rail's socket; returns them, the kind of the first and any
/// fallback reason.
type OpenedRails = (Vec<Box<dyn DatagramIo>>, EngineKind, Option<String>);

fn open_rails(
    config: &EngineConfig,
    sockets: Vec<UdpSocket>,
    single_issuer: bool,
) -> io::Result<OpenedRails> {
    let mut rails = Vec::with_capacity(sockets.len());
    let mut fallback = None;
    for socket in sockets {
        let (io, why) = open_io(config.engine, socket, config.max_datagram, single_issuer)?;
        fallback = fallback.or(why);
        rails.push(io);
    }
    let kind = rails[0].kind();
    Ok((rails, kind, fallback))
}

fn os_seed() -> [u8; 32] {
    let mut seed = [0u8; 32];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut seed);
    }
    seed
}

/// 64 random bits from the OS (session tokens, initial sequence numbers).
pub fn random_u64() -> u64 {
    u64::from_le_bytes(os_seed()[..8].try_into().expect("8 bytes"))
}

impl Engine {
    /// Binds a UDP socket to each address of `binds` (one per rail: the links to the same
    /// peers) and starts an engine on them.
    pub fn start(binds: &[SocketAddr], config: EngineConfig) -> io::Result<Engine> {
        if binds.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an engine needs at least one address",
            ));
        }
        let sockets = binds
            .iter()
            .map(|b| bind_socket(*b, config.socket_buffer))
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
        let state = State {
            arenas: Vec::new(),
            region_users: HashMap::default(),
            conns: HashMap::default(),
            stats: EngineStats::default(),
            next_qpn: (random_u64() as u32) & 0x00ff_ffff,
            tx: binds
                .iter()
                .map(|_| TxBatch::new(32, config.max_datagram))
                .collect(),
            next_deadline: None,
            acks_held: false,
            dirty: false,
            bindings: vec![
                RailBinding {
                    wanted: Binding::Open,
                    applied: None,
                };
                binds.len()
            ],
            gather_from: config.gather_threshold.unwrap_or(usize::MAX),
            landing: None,
            landing_pd: 0,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            io: Mutex::new(None),
            wake: EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?,
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            epoch: Instant::now(),
            last_entry: AtomicU64::new(0),
            keeper_timer: match config.progress {
                Progress::Caller => Some(TimerFd::new(
                    ClockId::CLOCK_MONOTONIC,
                    TimerFlags::TFD_CLOEXEC,
                )?),
                Progress::Thread => None,
            },
            keeper_armed: AtomicBool::new(false),
            keeper_period: config.keeper_period.max(Duration::from_micros(1)),
        });
        let (kind, fallback, worker) = match config.progress {
            Progress::Caller => {
                let (rails, kind, fallback) = open_rails(&config, sockets, false)?;
                *shared.io.lock().expect("io lock") = Some(rails);
                let keeper_shared = Arc::clone(&shared);
                let keeper = std::thread::Builder::new()
                    .name("tbrdma-keeper".into())
                    .spawn(move || keeper_thread(keeper_shared))?;
                (kind, fallback, Some(keeper))
            }
            Progress::Thread => {
                let (ready_tx, ready_rx) = std::sync::mpsc::channel();
                let thread_shared = Arc::clone(&shared);
                let thread_config = config.clone();
                let worker = std::thread::Builder::new()
                    .name("tbrdma-engine".into())
                    .spawn(move || {
                        // The backend is created on this thread, which will be its only user.
                        match open_rails(&thread_config, sockets, true) {
                            Ok((rails, kind, fallback)) => {
                                let _ = ready_tx.send(Ok((kind, fallback)));
                                engine_thread(thread_shared, rails, thread_config);
                            }
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                            }
                        }
                    })?;
                let (kind, fallback) = ready_rx
                    .recv()
                    .map_err(|_| io::Error::other("engine thread died at start"))??;
                (kind, fallback, Some(worker))
            }
        };
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
            worker,
            config,
            kind,
            fallback,
            local_addrs,
            features,
            rcvbuf,
        })
    }

    /// The backend in use.
    pub fn kind(&self) -> EngineKind {
        self.kind
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
        self.lock().stats
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The current engine time.
    pub fn now(&self) -> Time {
        self.shared.now()
    }

    /// Locks the shared state (registrations, connection setup, statistics).
    fn lock(&self) -> MutexGuard<'_, State> {
        let mut state = self.shared.state.lock().expect("engine state lock");
        // Whoever locks may change what there is to send.
        state.dirty = true;
        state
    }

    /// Runs `f` on the state, then makes sure whatever it queued gets sent: at once in caller
    /// mode, by waking the engine thread in thread mode. This is the doorbell.
    fn post<R>(&self, f: impl FnOnce(&mut State, Time) -> R) -> io::Result<R> {
        match self.config.progress {
            Progress::Caller => {
                let mut io = self.shared.io.lock().expect("io lock");
                let mut state = self.lock();
                let now = self.now();
                let result = f(&mut state, now);
                if let Some(rails) = io.as_mut() {
                    state.flush(rails, now)?;
                }
                Ok(result)
            }
            Progress::Thread => {
                let result = {
                    let mut state = self.lock();
                    f(&mut state, self.now())
                };
                if self.shared.sleeping.load(Ordering::SeqCst) {
                    let _ = self.shared.wake.write(1);
                }
                Ok(result)
            }
        }
    }

    /// [`Engine::post`], or with `quiet` in caller mode, for work that puts nothing on the wire
    /// by itself (posted receives), no transmit pass now: the next poll's pass routes whatever
    /// it produced (a flushed receive on a failed connection, say).
    fn post_maybe_quiet<R>(
        &self,
        quiet: bool,
        f: impl FnOnce(&mut State, Time) -> R,
    ) -> io::Result<R> {
        if quiet && self.config.progress == Progress::Caller {
            let mut state = self.lock();
            return Ok(f(&mut state, self.now()));
        }
        self.post(f)
    }

    /// Caller mode: runs the loop once (receive, deadlines, transmit). Thread mode: nothing
    /// (the engine thread does it). Returns whether anything happened.
    pub fn progress(&self) -> io::Result<bool> {
        if self.config.progress == Progress::Thread {
            return Ok(false);
        }
        self.shared.progress_caller()
    }

    /// The [`Config::ack_hold`] a new connection on this engine uses: in caller mode with
    /// [`EngineConfig::hold_acks`], a bound on holds that the next poll ends.
    pub fn ack_hold_for(&self, configured: Duration) -> Duration {
        if self.config.progress == Progress::Caller && self.config.hold_acks {
            configured.max(CALLER_ACK_HOLD)
        } else {
            configured
        }
    }
}

/// The engine's bookkeeping, by intention: every change to connections, regions and landing
/// zones goes through these, so that the state's invariants live in this file alone.
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
        let mut state = self.lock();
        state.arenas.push(Arena::new(seed));
        PdId(state.arenas.len() - 1)
    }

    /// Registers `buffer` with `access` in protection domain `pd`.
    pub fn register(
        &self,
        pd: PdId,
        buffer: Arc<Buffer>,
        access: Access,
    ) -> Result<Region, RegisterError> {
        self.lock().arenas[pd.0].register(buffer, access)
    }

    /// Revokes the keys of `region` in `pd` at once and, unless an outstanding request still
    /// names it, forgets its bytes; otherwise returns how many requests do. Call it again once
    /// they completed (the keys stay revoked meanwhile, the bytes stay mapped).
    pub fn deregister(&self, pd: PdId, region: RegionId) -> Result<(), usize> {
        self.lock().deregister(pd, region)
    }

    /// Adds a connection (not yet established) and starts its handshake.
    pub fn add_connection(&self, new: NewConnection) -> io::Result<()> {
        self.post(|state, now| state.add_connection(new, now))
    }

    /// Posts send-queue work requests on queue pair `qpn` under one lock and one doorbell.
    /// Stops at the first refused request; the ones before it were posted.
    pub fn post_send(&self, qpn: u32, wrs: &[SendWr]) -> Result<(), PostFailed> {
        self.post(|state, _now| {
            state.post_work(qpn, wrs, Queue::Send, |conn, arena, wr| {
                conn.post_send(*wr, arena)?;
                Ok(wr.local)
            })
        })
        .map_err(PostFailed::Io)?
    }

    /// Posts receive buffers on queue pair `qpn`, in order. A posted receive puts nothing on
    /// the wire: in caller mode no transmit pass runs for it (the next poll's does).
    pub fn post_recv(&self, qpn: u32, wrs: &[RecvWr]) -> Result<(), PostFailed> {
        self.post_maybe_quiet(true, |state, _now| {
            state.post_work(qpn, wrs, Queue::Recv, |conn, _arena, wr| {
                conn.post_recv(*wr)?;
                Ok(wr.local)
            })
        })
        .map_err(PostFailed::Io)?
    }

    /// Sets whether queue pair `qpn` lends the engine the [`SEND_HEADROOM`] bytes in front of
    /// its send payloads (see `QueuePair::set_send_headroom` in tbrdma-verbs). False when the
    /// engine has no such queue pair.
    pub fn set_send_headroom(&self, qpn: u32, on: bool) -> bool {
        let mut state = self.lock();
        let Some(slot) = state.conns.get_mut(&qpn) else {
            return false;
        };
        slot.send_headroom = on;
        true
    }

    /// Lends the engine `zone` for receiving the write queue pair `qpn` expects next (see
    /// [`Landing`]): the header's room in front of the payload and room for one datagram's
    /// payload. `seen`: how many receive completions of the queue pair the application has
    /// polled. `Some(false)`: refused (see `State::set_landing`); `None`: no such queue pair.
    ///
    /// # Panics
    /// If the zone, with its header room, does not lie in `zone.buffer`.
    pub fn expect_write(&self, qpn: u32, zone: WriteZone, seen: u64) -> Option<bool> {
        let mut state = self.lock();
        let slot = state.conns.get(&qpn)?;
        let pd = slot.pd;
        // Room for one datagram's payload: a write of several lands its first one here.
        let room = zone.len.min(slot.conn.max_payload() as usize);
        let addr = zone.buffer.addr() + zone.offset as u64;
        let landing = Landing {
            qpn,
            zone: RegionPart::new(
                zone.buffer,
                zone.offset - SEND_HEADROOM,
                SEND_HEADROOM + room,
            ),
            region: zone.region,
            rkey: zone.rkey,
            addr,
        };
        Some(state.set_landing(pd, Some(landing), seen))
    }

    /// Closes queue pair `qpn` (its CLOSE goes out; the engine forgets it once sent) and takes
    /// back any landing zone it lent.
    pub fn close(&self, qpn: u32) -> io::Result<()> {
        self.post(|state, now| {
            state.forget_landing_of(qpn);
            if let Some(slot) = state.conns.get_mut(&qpn) {
                slot.conn.close(now);
                // The engine removes the slot once the CLOSE has gone out.
                slot.detached = true;
            }
        })
    }

    /// The state of connection `qpn` ([`ConnectionState::Closed`] once the engine forgot it).
    pub fn connection_state(&self, qpn: u32) -> ConnectionState {
        self.lock()
            .conns
            .get(&qpn)
            .map_or(ConnectionState::Closed, |s| s.conn.state())
    }

    /// Events of connection `qpn` since the last call.
    pub fn take_events(&self, qpn: u32) -> Vec<Event> {
        self.lock()
            .conns
            .get_mut(&qpn)
            .map(|s| std::mem::take(&mut s.events))
            .unwrap_or_default()
    }

    /// Whether connection `qpn` completed its handshake and the event is still unread.
    pub fn was_established(&self, qpn: u32) -> bool {
        self.lock()
            .conns
            .get(&qpn)
            .is_some_and(|s| s.events.contains(&Event::Established))
    }

    /// Protocol counters of connection `qpn` (zeros once the engine forgot it).
    pub fn connection_stats(&self, qpn: u32) -> Stats {
        self.lock()
            .conns
            .get(&qpn)
            .map(|s| *s.conn.stats())
            .unwrap_or_default()
    }

    /// Datagrams connection `qpn` sent on each rail, and how many times a rail was declared
    /// down.
    pub fn rail_stats(&self, qpn: u32) -> (Vec<u64>, u64) {
        self.lock().conns.get(&qpn).map_or((Vec::new(), 0), |s| {
            let (sent, failovers) = s.conn.path_stats();
            (sent.to_vec(), failovers)
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.shared.wake.write(1);
        // The keeper blocks on its alarm: ring it.
        self.shared.arm_keeper(Duration::ZERO);
        if let Some(worker) = self.worker.take() {
            worker.thread().unpark();
            let _ = worker.join();
        }
    }
}

fn bind_socket(bind: SocketAddr, buffer: usize) -> io::Result<UdpSocket> {
    // Ask for large buffers (forced past the sysctl caps where allowed): a window of 64 KiB
    // datagrams must fit. What the kernel grants bounds the advertised window instead.
    let socket = crate::socket::bind_udp(bind, buffer, buffer)?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

fn engine_thread(shared: Arc<Shared>, mut rails: Vec<Box<dyn DatagramIo>>, config: EngineConfig) {
    if let Some(cpu) = config.cpu {
        let mut set = nix::sched::CpuSet::new();
        if set.set(cpu).is_ok() {
            if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
                tracing::warn!("cannot pin the engine thread to CPU {cpu}: {e}");
            }
        }
    }
    let mut last_busy = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        let busy = run_locked(&shared, &mut rails);
        if busy {
            last_busy = Instant::now();
            continue;
        }
        if last_busy.elapsed() < config.spin {
            std::hint::spin_loop();
            continue;
        }
        // Announce the sleep, then look once more: a post that raced with the announcement is
        // either seen now or wakes the sleep through the eventfd.
        shared.sleeping.store(true, Ordering::SeqCst);
        if !run_locked(&shared, &mut rails) {
            let deadline = shared
                .state
                .lock()
                .expect("engine state lock")
                .next_deadline();
            let now = shared.now();
            let timeout = deadline
                .map_or(config.max_sleep, |d| d.saturating_since(now))
                .min(config.max_sleep);
            shared.state.lock().expect("engine state lock").stats.sleeps += 1;
            // With several rails the sleep watches rail 0 only, so it is kept short.
            let timeout = if rails.len() > 1 {
                timeout.min(Duration::from_millis(1))
            } else {
                timeout
            };
            if let Err(e) = rails[0].wait(timeout, shared.wake.as_fd()) {
                tracing::error!("engine wait failed: {e}");
            }
            let _ = shared.wake.read();
        }
        shared.sleeping.store(false, Ordering::SeqCst);
        last_busy = Instant::now();
    }
}

/// Caller mode: stands in for an application that stopped calling (see the module docs).
fn keeper_thread(shared: Arc<Shared>) {
    if let Err(e) = crate::sched::set_batch_scheduling() {
        tracing::debug!("keeper stays in the default scheduling class: {e}");
    }
    let Some(timer) = &shared.keeper_timer else {
        return;
    };
    // While armed the alarm rings every `keeper_period`; a check finds the application gone
    // when it has not polled for `KEEPER_AWAY`, so held acknowledgements go out at most
    // `keeper_period + KEEPER_AWAY` after its last poll.
    let away_ns = KEEPER_AWAY.as_nanos() as u64;
    loop {
        // Parked (disarmed) this waits until a poll arms the alarm.
        if let Err(e) = timer.wait() {
            tracing::error!("the keeper's timer failed: {e}");
            std::thread::sleep(shared.keeper_period);
        }
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        let now = shared.now().0;
        if now.saturating_sub(shared.last_entry.load(Ordering::Relaxed)) < away_ns {
            continue;
        }
        if let Err(e) = shared.flush_held_acks() {
            tracing::error!("engine I/O failed: {e}");
        }
    }
}

fn run_locked(shared: &Shared, rails: &mut [Box<dyn DatagramIo>]) -> bool {
    let now = shared.now();
    let mut state = shared.state.lock().expect("engine state lock");
    match state.run_once(rails, now) {
        Ok(busy) => busy,
        Err(e) => {
            tracing::error!("engine I/O failed: {e}");
            false
        }
    }
}
