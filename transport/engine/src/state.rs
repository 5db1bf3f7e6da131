//! The engine's state: every connection of the engine (its protocol state machine, peers and
//! completion queues), the protection domains' arenas, which region each outstanding request
//! names, the rails' socket associations, the lent landing zone and the transmit batches; and
//! the loop's passes over them ([`State::run_once`], [`State::flush`]).
//!
//! This module alone reads and writes that bookkeeping: the rest of the engine, and the verbs
//! crate through [`crate::worker::Engine`], state intentions (post this work, register that
//! region, add this connection) and the state keeps its own invariants. The one that makes
//! deregistration safe, "the i-th completion of a queue releases the region named by the i-th
//! request posted on it", is [`record_post`] and [`release_completed`].

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tbrdma_proto::connection::ConnectParams;
use tbrdma_proto::hint::cold_path;
use tbrdma_proto::memory::RegisterError;
use tbrdma_proto::wire;
use tbrdma_proto::{
    Access, Config, Connection, ConnectionState, Event, Memory, PostError, Queue, RecvWr, Region,
    RegionId, SendWr, Sge, Stats, Time,
};

use crate::conn_table::ConnTable;
use crate::cq::{Completion, CqShared};
use crate::io::{DatagramIo, EngineKind, Expect, Landing, Rails, Received, RegionPart, TxBatch};
use crate::memory::{Arena, Buffer};

/// Bytes in front of a send payload that a queue pair with send headroom (`QueuePair::set_send_headroom` in tbrdma-verbs) lets the
/// engine write: the largest datagram header, which then goes out from the region together with
/// its payload, as one contiguous buffer. On veth a single iovec sends a 16 KiB datagram about
/// 0.2 µs faster than the header and the payload as two (docs/performance.md).
pub const SEND_HEADROOM: usize = tbrdma_proto::wire::MAX_HEADER_LEN;

/// Engine-wide counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Packets for no known queue pair, or from an address other than its peer (each packet
    /// of a datagram that holds several counts on its own).
    pub foreign_datagrams: u64,
    /// Loop iterations that moved something.
    pub busy_iterations: u64,
    /// Times the engine thread went to sleep.
    pub sleeps: u64,
    /// Payloads received straight into their place (a landing zone, see [`Landing`]).
    pub landed_in_place: u64,
    /// Batches of datagrams handed to a backend to send (each one system call, or a few
    /// where the backend splits it), and the datagrams in them: their ratio is how well
    /// transmit passes batch.
    pub send_batches: u64,
    pub datagrams_sent: u64,
    /// Packets sent inside another packet's datagram (an ACK riding with another queue pair's
    /// data to the same peer, see `TxBatch::commit_coalescing`), not counted in
    /// `datagrams_sent`.
    pub packets_coalesced: u64,
}

/// A protection domain of one engine: which arena its regions live in. Only the engine makes
/// them ([`crate::worker::Engine::add_protection_domain`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PdId(usize);

/// A new connection, as the connection manager agreed it with the peer: everything the engine
/// needs to add it ([`crate::worker::Engine::add_connection`]).
#[derive(Debug)]
pub struct NewConnection {
    /// Protocol configuration (already fitted to this engine, see [`crate::worker::Engine::window_limit`]).
    pub config: Config,
    /// Whether this side sends CONNECT (the client).
    pub active: bool,
    /// Token, queue pair numbers (`local_qpn` names the connection) and initial sequence number.
    pub params: ConnectParams,
    /// The peer's data socket on each rail, in rail order.
    pub peers: Vec<SocketAddr>,
    /// The peer receives Ethernet frames (its connection manager said so): false sends it
    /// UDP even from the packet engine, which other backends always do.
    pub peer_takes_frames: bool,
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
/// ([`crate::worker::Engine::expect_write`]).
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
    /// The peer receives Ethernet frames (see [`NewConnection::peer_takes_frames`]).
    peer_takes_frames: bool,
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
pub(crate) struct State {
    /// One arena per protection domain.
    arenas: Vec<Arena>,
    /// Outstanding requests naming each region, per protection domain.
    region_users: RegionUsers,
    /// Regions whose keys were revoked while requests still named them: their bytes go when
    /// the last of those requests completes (or its queue pair goes).
    revoked: rustc_hash::FxHashSet<(usize, RegionId)>,
    /// Connections by local queue pair number.
    conns: ConnTable<Slot>,
    /// Counters.
    stats: EngineStats,
    next_qpn: u32,
    /// Datagrams waiting to leave, one batch per rail.
    tx: Vec<TxBatch>,
    next_deadline: Option<Time>,
    /// Some connection holds an acknowledgement for a reply to carry.
    acks_held: bool,
    /// Completions handed to completion queues so far (wrapping).
    completions_routed: u64,
    /// Something may have changed since the last transmit pass (a post, a new connection, a
    /// released hold): the next loop must run one even if nothing arrived.
    dirty: bool,
    /// Some slot is detached (its queue pair was dropped): the next transmit pass looks for
    /// slots to remove.
    any_detached: bool,
    /// Whom each rail's socket should be connected to (each backend knows whom it is, see
    /// `apply_bindings`).
    bindings: Vec<Binding>,
    /// Every connection's peer data sockets and whether the peer takes Ethernet frames
    /// ([`NewConnection::peer_takes_frames`]), sorted, which the rails learn with the bindings.
    peer_carriers: Vec<(SocketAddr, bool)>,
    /// Counts the changes to `bindings` and `peer_carriers`: a set of rails that applied this
    /// many is up to date.
    bindings_version: u64,
    /// Payloads of at least this many bytes are sent from their region in place
    /// ([`crate::worker::EngineConfig::gather_threshold`]; `usize::MAX`: never).
    gather_from: usize,
    /// Every connection asks for data digests ([`crate::EngineConfig::data_digest`]).
    data_digest: bool,
    /// Where the next datagram may be received (one zone per engine: the collectives open a
    /// device per neighbour), and the protection domain of its region.
    landing: Option<Landing>,
    landing_pd: usize,
    /// When no zone is lent: the buffer of the next receive a SEND would take, to receive the
    /// next datagram into (see [`Self::find_receive_landing`]), and its protection domain.
    receive_landing: Option<Landing>,
    receive_landing_pd: usize,
    /// Whether `receive_landing` may be out of date: set by whatever may change which receive
    /// is next (a post, a datagram received, a deadline, any lock that marks the state dirty).
    receive_landing_stale: bool,
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

impl Binding {
    fn target(&self) -> Option<SocketAddr> {
        match self {
            Binding::Peer(p) => Some(*p),
            Binding::Open | Binding::Shared => None,
        }
    }
}

impl State {
    /// A state for an engine of `rails` rails whose datagrams are at most `max_datagram`
    /// bytes, sending payloads of at least `gather_from` bytes from their region in place;
    /// queue pair numbers are drawn after `first_qpn`.
    pub(crate) fn new(
        rails: usize,
        max_datagram: usize,
        gather_from: usize,
        data_digest: bool,
        first_qpn: u32,
    ) -> State {
        State {
            arenas: Vec::new(),
            region_users: RegionUsers::default(),
            revoked: Default::default(),
            conns: ConnTable::default(),
            stats: EngineStats::default(),
            next_qpn: first_qpn,
            tx: (0..rails).map(|_| TxBatch::new(32, max_datagram)).collect(),
            next_deadline: None,
            acks_held: false,
            completions_routed: 0,
            dirty: false,
            any_detached: false,
            bindings: vec![Binding::Open; rails],
            peer_carriers: Vec::new(),
            bindings_version: 0,
            gather_from,
            data_digest,
            landing: None,
            landing_pd: 0,
            receive_landing: None,
            receive_landing_pd: 0,
            receive_landing_stale: true,
        }
    }

    /// Someone may have changed what there is to send: the next loop runs a transmit pass.
    pub(crate) fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// Engine-wide counters.
    pub(crate) fn stats(&self) -> EngineStats {
        EngineStats {
            packets_coalesced: self.tx.iter().map(TxBatch::coalesced).sum(),
            ..self.stats
        }
    }

    /// The engine thread goes to sleep.
    pub(crate) fn count_sleep(&mut self) {
        self.stats.sleeps += 1;
    }

    /// Whether some connection holds an acknowledgement (as of the last transmit pass).
    pub(crate) fn acks_held(&self) -> bool {
        self.acks_held
    }

    /// A new protection domain whose keys come from `seed`.
    pub(crate) fn add_protection_domain(&mut self, seed: [u8; 32]) -> PdId {
        self.arenas.push(Arena::new(seed));
        PdId(self.arenas.len() - 1)
    }

    /// The arena of protection domain `pd`, if there is one.
    pub(crate) fn arena_mut(&mut self, pd: PdId) -> Option<&mut Arena> {
        self.arenas.get_mut(pd.0)
    }

    /// Registers `buffer` with `access` in protection domain `pd`.
    pub(crate) fn register(
        &mut self,
        pd: PdId,
        buffer: Arc<Buffer>,
        access: Access,
    ) -> Result<Region, RegisterError> {
        self.arenas[pd.0].register(buffer, access)
    }

    /// Posts send-queue work requests on queue pair `qpn`; see [`Self::post_work`].
    pub(crate) fn post_send(&mut self, qpn: u32, wrs: &[SendWr]) -> Result<(), PostFailed> {
        self.post_work(qpn, wrs, Queue::Send, |conn, arena, wr| {
            conn.post_send(*wr, arena)
        })
    }

    /// Posts receive buffers on queue pair `qpn`; see [`Self::post_work`].
    pub(crate) fn post_recv(&mut self, qpn: u32, wrs: &[RecvWr]) -> Result<(), PostFailed> {
        self.receive_landing_stale = true;
        self.post_work(qpn, wrs, Queue::Recv, |conn, arena, wr| {
            conn.post_recv(*wr)?;
            Ok(region_of(arena, wr.local))
        })
    }

    /// Sets whether queue pair `qpn` lends the [`SEND_HEADROOM`] in front of its send
    /// payloads. False when there is no such queue pair.
    pub(crate) fn set_send_headroom(&mut self, qpn: u32, on: bool) -> bool {
        let Some(slot) = self.conns.get_mut(&qpn) else {
            return false;
        };
        slot.send_headroom = on;
        true
    }

    /// Sends queue pair `qpn`'s completions to `send_cq` and `recv_cq` from now on; see
    /// [`crate::worker::Engine::rebind_cqs`]. `None`: no such queue pair (or it was closed);
    /// `Some(false)`: refused, it has work outstanding.
    pub(crate) fn rebind_cqs(
        &mut self,
        qpn: u32,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
    ) -> Option<bool> {
        let slot = self.conns.get_mut(&qpn).filter(|s| !s.detached)?;
        // A completion is only ever made for a request posted on the queue pair (a send, or a
        // receive consumed by a SEND or WRITE_WITH_IMM; one that finds none is answered
        // receiver-not-ready and completes nothing here), and its FIFO entry goes when the
        // completion is routed: with both empty, none is on its way to the old queues.
        let idle = slot.sq_regions.is_empty()
            && slot.rq_regions.is_empty()
            && slot.conn.outstanding_sends() == 0
            && slot.conn.posted_recvs() == 0;
        if !idle {
            return Some(false);
        }
        slot.send_cq = send_cq;
        slot.recv_cq = recv_cq;
        Some(true)
    }

    /// Lends `zone` for the write queue pair `qpn` expects next (see [`Self::set_landing`]);
    /// `None` when there is no such queue pair.
    ///
    /// # Panics
    /// If the zone, with its header room, does not lie in `zone.buffer`.
    pub(crate) fn expect_write(&mut self, qpn: u32, zone: WriteZone, seen: u64) -> Option<bool> {
        let slot = self.conns.get(&qpn)?;
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
            expect: Expect::Write {
                rkey: zone.rkey,
                addr,
            },
        };
        Some(self.set_landing(pd, Some(landing), seen))
    }

    /// Whether queue pair `qpn` still has a landing zone lent: false from the pass that placed
    /// a write into it, or ended the loan otherwise (see [`Self::set_landing`] and the loop's
    /// receive pass), on.
    pub(crate) fn lending(&self, qpn: u32) -> bool {
        self.landing.as_ref().is_some_and(|l| l.qpn == qpn)
    }

    /// Whether any queue pair has a landing zone lent.
    pub(crate) fn lends_any(&self) -> bool {
        self.landing.is_some()
    }

    /// Closes queue pair `qpn` (the slot goes once its CLOSE is out) and takes back any
    /// landing zone it lent.
    pub(crate) fn close(&mut self, qpn: u32, now: Time) {
        self.forget_landing_of(qpn);
        if let Some(slot) = self.conns.get_mut(&qpn) {
            slot.conn.close(now);
            // The engine removes the slot once the CLOSE has gone out.
            slot.detached = true;
            self.any_detached = true;
        }
    }

    /// Whether queue pair `qpn` exists (its slot may be on its way out).
    pub(crate) fn has_connection(&self, qpn: u32) -> bool {
        self.conns.contains_key(&qpn)
    }

    /// The state of connection `qpn` ([`ConnectionState::Closed`] once it is gone).
    pub(crate) fn connection_state(&self, qpn: u32) -> ConnectionState {
        self.conns
            .get(&qpn)
            .map_or(ConnectionState::Closed, |s| s.conn.state())
    }

    /// Events of connection `qpn` since the last call.
    pub(crate) fn take_events(&mut self, qpn: u32) -> Vec<Event> {
        self.conns
            .get_mut(&qpn)
            .map(|s| std::mem::take(&mut s.events))
            .unwrap_or_default()
    }

    /// Whether an unread event of connection `qpn` says it was established.
    pub(crate) fn was_established(&self, qpn: u32) -> bool {
        self.conns
            .get(&qpn)
            .is_some_and(|s| s.events.contains(&Event::Established))
    }

    /// Protocol counters of connection `qpn` (zeros once it is gone).
    pub(crate) fn connection_stats(&self, qpn: u32) -> Stats {
        self.conns
            .get(&qpn)
            .map(|s| *s.conn.stats())
            .unwrap_or_default()
    }

    /// Datagrams connection `qpn` sent on each rail, and its rail failovers.
    pub(crate) fn rail_stats(&self, qpn: u32) -> (Vec<u64>, u64) {
        self.conns.get(&qpn).map_or((Vec::new(), 0), |s| {
            let (sent, failovers) = s.conn.path_stats();
            (sent.to_vec(), failovers)
        })
    }
}

impl State {
    /// A fresh queue pair number.
    pub(crate) fn reserve_qpn(&mut self) -> u32 {
        loop {
            self.next_qpn = self.next_qpn.wrapping_add(1).max(1);
            if !self.conns.contains_key(&self.next_qpn) {
                return self.next_qpn;
            }
        }
    }

    /// Adds a connection; its rails' sockets are connected to its peer when it is their only
    /// one (see [`Binding`]), before its first datagram leaves.
    pub(crate) fn add_connection(&mut self, new: NewConnection, now: Time) {
        let NewConnection {
            mut config,
            active,
            params,
            peers,
            peer_takes_frames,
            pd,
            send_cq,
            recv_cq,
        } = new;
        let qp_num = params.local_qpn;
        config.data_digest |= self.data_digest;
        let mut conn = if active {
            Connection::connect(config, params, now)
        } else {
            Connection::accept(config, params, now)
        };
        conn.set_paths(peers.len());
        for (binding, peer) in self.bindings.iter_mut().zip(&peers) {
            *binding = match *binding {
                Binding::Open => Binding::Peer(*peer),
                Binding::Peer(p) if p == *peer => Binding::Peer(p),
                Binding::Peer(_) | Binding::Shared => Binding::Shared,
            };
        }
        self.peer_carriers
            .extend(peers.iter().map(|&p| (p, peer_takes_frames)));
        self.peer_carriers.sort_unstable();
        self.peer_carriers.dedup();
        self.bindings_version += 1;
        let slot = Slot {
            conn,
            peers,
            peer_takes_frames,
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
    /// first one refused, and records the region each names (`post` says which; see
    /// [`record_post`]).
    fn post_work<W>(
        &mut self,
        qpn: u32,
        wrs: &[W],
        queue: Queue,
        post: impl Fn(&mut Connection, &Arena, &W) -> Result<Option<RegionId>, PostError>,
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
            let region = post(&mut slot.conn, arena, wr)?;
            record_post(region_users, slot, queue, region);
        }
        Ok(())
    }

    /// Revokes the keys of `region` of protection domain `pd` and, when no outstanding request
    /// names it, forgets its bytes too; otherwise returns how many requests still do (its bytes
    /// stay until they complete: an in-flight send never reads freed memory).
    pub(crate) fn deregister(&mut self, pd: PdId, region: RegionId) -> Result<(), usize> {
        let key = (pd.0, region);
        let arena = &mut self.arenas[pd.0];
        let _ = arena.table_mut().deregister(region);
        match self.region_users.count(key) {
            0 => {
                arena.deregister(region);
                Ok(())
            }
            users => {
                self.revoked.insert(key);
                Err(users)
            }
        }
    }

    /// Connects or disconnects rail sockets whose wanted association changed, as `rails` know
    /// them. In assisted thread mode two sets of backends share each socket and each knows
    /// only its own association: each set catches up here, under the state's lock, before it
    /// sends anything, so neither sends without an address to a socket the other disconnected
    /// (connecting the socket again to the address it has is harmless). Until it catches up, a
    /// set that thinks the socket unconnected sends with the address, which a connected UDP
    /// socket accepts.
    ///
    /// A set that has applied the current [`Self::bindings_version`] has nothing to catch up
    /// on: the test is one comparison per pass.
    fn apply_bindings(&mut self, rails: &mut Rails) {
        if rails.bindings_applied == Some(self.bindings_version) {
            return;
        }
        cold_path();
        // (First: a backend that learns a peer hears only UDP looks no MAC address up for it.)
        for io in rails.iter_mut() {
            io.set_peer_carriers(&self.peer_carriers);
        }
        for (rail, binding) in self.bindings.iter_mut().enumerate() {
            let target = binding.target();
            if target == rails[rail].peer() {
                continue;
            }
            if let Err(e) = rails[rail].set_peer(target) {
                tracing::warn!("cannot associate rail {rail}'s socket with {target:?}: {e}");
                *binding = Binding::Shared;
                let _ = rails[rail].set_peer(None);
                // (The other set, if any, has yet to disconnect its view of the socket.)
                self.bindings_version += 1;
            }
        }
        rails.bindings_applied = Some(self.bindings_version);
    }

    /// Completions handed to completion queues so far (a wrapping count: compare two readings).
    pub(crate) fn completions_routed(&self) -> u64 {
        self.completions_routed
    }

    /// Whether some connection has an incoming message partly received (more of its packets
    /// are due).
    pub(crate) fn receiving(&self) -> bool {
        self.conns
            .values()
            .any(|slot| slot.conn.receiving_into().is_some())
    }

    /// Ends every acknowledgement hold: the next transmit pass sends them.
    pub(crate) fn release_held_acks(&mut self) {
        if std::mem::take(&mut self.acks_held) {
            self.dirty = true;
            for slot in self.conns.values_mut() {
                slot.conn.release_held_ack();
            }
        }
    }

    /// Ends the holds of the connections that wait for an acknowledgement themselves (a send
    /// not yet completed): in an exchange both ways on one queue pair, each side's ACK may be
    /// what the other's reply waits for, so neither waits for a reply. The others keep theirs.
    pub(crate) fn release_held_acks_of_waiting(&mut self) {
        if !self.acks_held {
            return;
        }
        let mut still_held = false;
        for slot in self.conns.values_mut() {
            if slot.conn.ack_held() && slot.conn.outstanding_sends() > 0 {
                slot.conn.release_held_ack();
                self.dirty = true;
            }
            still_held |= slot.conn.ack_held();
        }
        self.acks_held = still_held;
    }

    /// Lends the engine a landing zone (see [`Landing`]) for queue pair `landing.qpn`, whose
    /// application has seen `seen` of its receive completions, in protection domain `pd`.
    /// Refused (returns false) when that count is behind the engine's (writes the application
    /// has not seen yet may lie in the zone), or while a message to be placed in the zone is
    /// partly received: its first packets may already lie there, and any datagram received
    /// into the zone would overwrite them (such as its missing last packet, resent). With
    /// `None`, takes back any zone lent.
    pub(crate) fn set_landing(&mut self, pd: usize, landing: Option<Landing>, seen: u64) -> bool {
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
    pub(crate) fn forget_landing_of(&mut self, qpn: u32) {
        if self.landing.as_ref().is_some_and(|l| l.qpn == qpn) {
            self.clear_landing();
        }
    }

    fn clear_landing(&mut self) {
        end_loan(&mut self.landing, &mut self.arenas[..], self.landing_pd);
    }

    /// Receives, handles deadlines, transmits and routes completions once. Returns whether
    /// anything happened.
    pub(crate) fn run_once(&mut self, rails: &mut Rails, now: Time) -> io::Result<bool> {
        let mut received = self.receive(rails, now)?;
        let deadline_due = self.next_deadline.is_some_and(|d| d <= now);
        if deadline_due && received > 0 && received <= rails.len() {
            // What this pass read may be only the first of what waits (the first receive after
            // an empty poll takes one datagram from each rail): read on before judging a
            // deadline, or an acknowledgement queued behind it is taken for a loss. A sender's
            // first window of 64 KiB datagrams took 3.5 ms to send over veth, and then timed
            // out on the peer's request queued in front of the acknowledgements
            // (docs/performance.md, "One batch per receive"). Not after full batches: a pass
            // that reads on then copies twice as much before it acknowledges anything. Once per
            // pass, so that a stream that keeps arriving cannot hold a deadline off.
            received += self.receive(rails, now)?;
        }
        if deadline_due {
            self.receive_landing_stale = true;
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

    /// Receives once from every rail (a batch at most from each) and hands each datagram to
    /// its connection; returns how many arrived.
    fn receive(&mut self, rails: &mut Rails, now: Time) -> io::Result<usize> {
        if self.landing.is_none() && (self.receive_landing_stale || self.dirty) {
            self.find_receive_landing(rails);
        }
        let State {
            conns,
            arenas,
            stats,
            landing,
            landing_pd,
            receive_landing,
            receive_landing_pd,
            receive_landing_stale,
            ..
        } = self;
        let mut received = 0;
        for (rail, io) in rails.iter_mut().enumerate() {
            let lent = landing.is_some();
            // A zone lent for a WRITE comes first; otherwise the next receive's buffer, if any.
            let zone = if lent {
                &mut *landing
            } else {
                &mut *receive_landing
            };
            let into_receive = !lent && zone.is_some();
            let got = io.recv(zone, &mut |datagram: Received<'_>, from| {
                if !datagram.tail.is_empty() {
                    // The expected SEND's first packet, its payload in the receive's buffer:
                    // one packet, whose headers say which queue pair.
                    deliver_packet(conns, arenas, stats, rail, from, now, datagram);
                    return;
                }
                // A datagram may hold several packets back to back (`TxBatch::commit_coalescing`),
                // each for its own queue pair and checked on its own; a length that does not
                // parse, or runs past the end, leaves the rest as one packet, which then fails
                // to decode.
                let mut rest = datagram.head;
                while !rest.is_empty() {
                    let len = wire::packet_len(rest)
                        .filter(|&n| n < rest.len())
                        .unwrap_or(rest.len());
                    let (data, tail) = rest.split_at(len);
                    rest = tail;
                    let packet = Received::whole(data);
                    deliver_packet(conns, arenas, stats, rail, from, now, packet);
                }
            })?;
            received += got;
            if into_receive && got > 0 {
                // The receive may be taken now, or another come first: look again next pass.
                stats.landed_in_place += arenas[*receive_landing_pd].take_in_place();
                *receive_landing = None;
                *receive_landing_stale = true;
            }
            // A write placed into the zone (received there, or copied in) ends the loan, and
            // so does a datagram too long for it (the backend dropped the zone).
            if lent && (landing.is_none() || arenas[*landing_pd].watch_hit()) {
                stats.landed_in_place += arenas[*landing_pd].take_in_place();
                // (The backend may have taken the zone already, when too long a datagram came.)
                *landing = None;
                arenas[*landing_pd].watch(None);
            }
        }
        Ok(received)
    }

    /// Finds the buffer the next datagram is best received into when no zone is lent: that of
    /// the oldest receive posted on a connection that expects a new message (see
    /// `Connection::next_receive_buffer`), at least [`RECEIVE_LANDING_MIN`] long, up to one
    /// datagram's payload. Only the sockets backend receives there.
    fn find_receive_landing(&mut self, rails: &[Box<dyn DatagramIo>]) {
        self.receive_landing_stale = false;
        self.receive_landing = None;
        if rails
            .first()
            .is_none_or(|io| io.kind() != EngineKind::Sockets)
        {
            return;
        }
        for (qpn, slot) in self.conns.iter() {
            if slot.detached {
                continue;
            }
            let arena = &self.arenas[slot.pd];
            let min_len = RECEIVE_LANDING_MIN as u64;
            let Some((region, bytes)) = slot.conn.next_receive_buffer(arena, min_len) else {
                continue;
            };
            let len = (bytes.end - bytes.start).min(u64::from(slot.conn.max_payload())) as usize;
            let start = bytes.start as usize;
            let Some(buffer) = arena.buffer(region) else {
                continue;
            };
            if len < RECEIVE_LANDING_MIN
                || start.checked_add(len).is_none_or(|end| end > buffer.len())
            {
                continue;
            }
            self.receive_landing = Some(Landing {
                qpn,
                zone: RegionPart::new(Arc::clone(buffer), start, len),
                region,
                expect: Expect::Send,
            });
            self.receive_landing_pd = slot.pd;
            return;
        }
    }

    /// Transmits whatever the connections have to send and routes their completions and
    /// events. Returns whether a datagram went out.
    pub(crate) fn flush(&mut self, rails: &mut Rails, now: Time) -> io::Result<bool> {
        self.dirty = false;
        self.apply_bindings(rails);
        let mut sent = false;
        let mut deadline: Option<Time> = None;
        let mut acks_held = false;
        let mut routed = 0;
        let mut unused = Vec::new();
        let State {
            conns,
            arenas,
            region_users,
            revoked,
            tx,
            gather_from,
            landing,
            landing_pd,
            stats,
            any_detached,
            ..
        } = self;
        let gather_from = *gather_from;
        for slot in conns.values_mut() {
            sent |= transmit(slot, &arenas[slot.pd], tx, rails, stats, now, gather_from)?;
            // (Checked here: the call's set-up alone cost some 30 instructions, and half the
            // passes of a ping-pong have nothing to route.)
            if slot.conn.has_completions_or_events() {
                routed += route_completions(
                    slot,
                    landing,
                    arenas,
                    *landing_pd,
                    region_users,
                    revoked,
                    &mut unused,
                );
            }
            if let Some(t) = slot.conn.poll_timeout() {
                deadline = Some(deadline.map_or(t, |d| d.min(t)));
            }
            acks_held |= slot.conn.ack_held();
        }
        // An acknowledgement held for a reply on its own connection rides instead in a datagram
        // this pass sends to the same peer on another one (see `TxBatch::commit_coalescing`),
        // when there is room behind it: the reply it waited for may be that datagram.
        if acks_held && !tx[0].is_empty() {
            acks_held = false;
            for slot in conns.values_mut() {
                if slot.conn.ack_held() && tx[0].can_carry_ack(slot.peers[0], wire::MAX_ACK_LEN) {
                    slot.conn.release_held_ack();
                    sent |= transmit(slot, &arenas[slot.pd], tx, rails, stats, now, gather_from)?;
                    // (The deadline taken above may be the hold's, now gone: waking for it
                    // early is harmless.)
                }
                acks_held |= slot.conn.ack_held();
            }
        }
        // Dropped queue pairs whose CLOSE is now in the batch leave the table, and their
        // requests that never completed stop counting as users of their regions (else the
        // regions stay pinned for good: `deregister` would only ever revoke them).
        let mut some_gone = false;
        if std::mem::take(any_detached) {
            conns.retain(|_, slot| {
                if !slot.detached {
                    return true;
                }
                some_gone = true;
                while !slot.sq_regions.is_empty() {
                    unused.extend(release_completed(
                        region_users,
                        slot.pd,
                        &mut slot.sq_regions,
                    ));
                }
                while !slot.rq_regions.is_empty() {
                    unused.extend(release_completed(
                        region_users,
                        slot.pd,
                        &mut slot.rq_regions,
                    ));
                }
                false
            });
            // (A zone is lent only to a queue pair in the table, and this is where they leave.)
            if landing
                .as_ref()
                .is_some_and(|l| !conns.contains_key(&l.qpn))
            {
                end_loan(landing, arenas, *landing_pd);
            }
        }
        // A revoked region no request names any more is forgotten (and so unpinned) now.
        if !unused.is_empty() {
            cold_path();
            for key in unused {
                if revoked.remove(&key) {
                    arenas[key.0].deregister(key.1);
                }
            }
        }
        for (io, batch) in rails.iter_mut().zip(tx.iter_mut()) {
            if !batch.is_empty() {
                send_batch(io, batch, stats)?;
                sent = true;
            }
        }
        self.next_deadline = deadline;
        self.acks_held = acks_held;
        self.completions_routed = self.completions_routed.wrapping_add(routed);
        if some_gone {
            cold_path();
            self.forget_gone_peers();
        }
        Ok(sent)
    }

    /// Rebuilds `peer_carriers` from the connections left, after some left the table.
    fn forget_gone_peers(&mut self) {
        self.peer_carriers = self
            .conns
            .values()
            .flat_map(|slot| slot.peers.iter().map(|&p| (p, slot.peer_takes_frames)))
            .collect();
        self.peer_carriers.sort_unstable();
        self.peer_carriers.dedup();
        self.bindings_version += 1;
    }

    /// The earliest connection deadline.
    pub(crate) fn next_deadline(&self) -> Option<Time> {
        self.next_deadline
    }

    /// The engine failed (see `failure.rs`): every connection is abandoned, its outstanding
    /// requests and posted receives completing as flushed on their completion queues, and
    /// nothing more is sent or received.
    pub(crate) fn abandon(&mut self) {
        let mut unused = Vec::new();
        let State {
            conns,
            arenas,
            region_users,
            revoked,
            landing,
            landing_pd,
            ..
        } = self;
        for slot in conns.values_mut() {
            slot.conn.abandon();
            // (Abandoned: nobody waits for what the count tells.)
            route_completions(
                slot,
                landing,
                arenas,
                *landing_pd,
                region_users,
                revoked,
                &mut unused,
            );
        }
        for key in unused {
            if revoked.remove(&key) {
                arenas[key.0].deregister(key.1);
            }
        }
        end_loan(landing, arenas, *landing_pd);
        self.next_deadline = None;
        self.acks_held = false;
        self.dirty = false;
    }
}

/// Smallest receive buffer a datagram is received into (see [`State::find_receive_landing`]).
/// Measured with `scripts/linkbench-ab.py` and `scripts/pingpong-ab.py` against the build that
/// never did (2026-12-06): SEND round trips at 16 KiB 0.92-0.95 of before and at 64 KiB
/// 0.91-0.99, but at 4 KiB 1.015-1.033 in three runs of four (0.90 in the fourth): a 4 KiB copy
/// costs about what `recvmsg` of three pieces costs over `recvfrom`. Sizes between were not
/// measured; 8 KiB is where the sender's lone copy stops paying too (`LONE_COPY_MAX`).
const RECEIVE_LANDING_MIN: usize = 8 * 1024;

/// Hands one packet (`packet`, received on `rail` from `from`) to the connection its header
/// names, if that connection's peer on the rail is the sender; counts it as foreign otherwise.
fn deliver_packet(
    conns: &mut ConnTable<Slot>,
    arenas: &mut [Arena],
    stats: &mut EngineStats,
    rail: usize,
    from: SocketAddr,
    now: Time,
    packet: Received<'_>,
) {
    let qpn = packet
        .head
        .get(16..20)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    match qpn.and_then(|q| conns.get_mut(&q)) {
        Some(slot) if slot.peers.get(rail) == Some(&from) => {
            let arena = &mut arenas[slot.pd];
            slot.conn
                .handle_datagram_parts_on(now, packet.head, packet.tail, rail, arena);
        }
        _ => stats.foreign_datagrams += 1,
    }
}

/// Hands `slot`'s new completions to its completion queues (releasing the regions they name:
/// `revoked` ones no request names any more go into `unused`) and keeps its new events.
fn route_completions(
    slot: &mut Slot,
    landing: &mut Option<Landing>,
    arenas: &mut [Arena],
    landing_pd: usize,
    region_users: &mut RegionUsers,
    revoked: &rustc_hash::FxHashSet<(usize, RegionId)>,
    unused: &mut Vec<(usize, RegionId)>,
) -> u64 {
    let mut routed = 0;
    while let Some(wc) = slot.conn.poll_completion() {
        routed += 1;
        let (cq, regions) = match wc.queue {
            Queue::Send => (&slot.send_cq, &mut slot.sq_regions),
            Queue::Recv => {
                slot.recv_completions += 1;
                // The application has not seen this completion yet: its landing zone may be
                // where the write went.
                if landing
                    .as_ref()
                    .is_some_and(|l| l.qpn == slot.conn.params().local_qpn)
                {
                    end_loan(landing, arenas, landing_pd);
                }
                (&slot.recv_cq, &mut slot.rq_regions)
            }
        };
        // Only a revoked region is collected: most completions release one still registered,
        // and collecting those cost an allocation per completion.
        if let Some(key) = release_completed(region_users, slot.pd, regions) {
            if revoked.contains(&key) {
                unused.push(key);
            }
        }
        cq.push(Completion {
            wc,
            qp_num: slot.conn.params().local_qpn,
        });
    }
    while let Some(event) = slot.conn.poll_event() {
        slot.events.push(event);
    }
    routed
}

/// Writes every datagram `slot`'s connection has to send into the rails' batches, sending a
/// batch whenever it is full. A packet wholly in its buffer for the first rail may join a
/// datagram already in the batch (see [`TxBatch::commit_coalescing`]). Returns whether a batch
/// was sent.
fn transmit(
    slot: &mut Slot,
    arena: &Arena,
    tx: &mut [TxBatch],
    rails: &mut [Box<dyn DatagramIo>],
    stats: &mut EngineStats,
    now: Time,
    gather_from: usize,
) -> io::Result<bool> {
    let mut sent = false;
    let (first, others) = tx.split_first_mut().expect("at least one rail");
    loop {
        // Most passes end with a poll that finds nothing (after the datagram a post made, or
        // after a receive whose ACK waits for the reply): a few flags tell so for less.
        if slot.conn.nothing_to_transmit(now) {
            break;
        }
        // The datagram is written into the first rail's batch and moved to its own rail's
        // after (its rail is known only then): the first batch needs a free buffer now, the
        // other's one before the move.
        if first.is_full() {
            cold_path();
            send_batch(&mut rails[0], first, stats)?;
            sent = true;
        }
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
                    if slot.send_headroom && p.starts_request && t.len <= p.offset as usize =>
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
        match part {
            None if path == 0 => first.commit_coalescing(head_len, slot.peers[0]),
            part => {
                first.commit_parts(head_len, slot.peers[path], part);
                if path > 0 {
                    let other = &mut others[path - 1];
                    if other.is_full() {
                        cold_path();
                        send_batch(&mut rails[path], other, stats)?;
                        sent = true;
                    }
                    first.move_last_to(other);
                }
            }
        }
    }
    Ok(sent)
}

/// Sends `batch`'s datagrams through `io` and counts them.
fn send_batch(
    io: &mut Box<dyn DatagramIo>,
    batch: &mut TxBatch,
    stats: &mut EngineStats,
) -> io::Result<()> {
    stats.send_batches += 1;
    stats.datagrams_sent += batch.len() as u64;
    io.send(batch)
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
fn record_post(users: &mut RegionUsers, slot: &mut Slot, queue: Queue, region: Option<RegionId>) {
    match queue {
        Queue::Send => slot.sq_regions.push_back(region),
        Queue::Recv => slot.rq_regions.push_back(region),
    }
    if let Some(r) = region {
        users.add((slot.pd, r));
    }
}

/// The oldest outstanding request of the queue whose posted regions are `posted` completed:
/// its region has one user fewer. Returns the region when that was its last user.
fn release_completed(
    users: &mut RegionUsers,
    pd: usize,
    posted: &mut VecDeque<Option<RegionId>>,
) -> Option<(usize, RegionId)> {
    let region = posted.pop_front().flatten()?;
    users.release((pd, region)).then_some((pd, region))
}

/// How many outstanding requests name each region: `counts[pd][region id]`. Indexed rather
/// than hashed (it is touched twice per message, and a hash map's entry cost some 70
/// instructions of a round trip): region ids are slots of their domain's table, never reused,
/// so a count stays with its region; a deregistered region's stays at 0.
#[derive(Debug, Default)]
struct RegionUsers {
    counts: Vec<Vec<usize>>,
}

impl RegionUsers {
    fn add(&mut self, (pd, region): (usize, RegionId)) {
        let at = region.0 as usize;
        if self.counts.len() <= pd {
            self.counts.resize_with(pd + 1, Vec::new);
        }
        let counts = &mut self.counts[pd];
        if counts.len() <= at {
            cold_path();
            counts.resize(at + 1, 0);
        }
        counts[at] += 1;
    }

    /// One user fewer; whether that was the last.
    fn release(&mut self, (pd, region): (usize, RegionId)) -> bool {
        match self
            .counts
            .get_mut(pd)
            .and_then(|c| c.get_mut(region.0 as usize))
        {
            Some(n) if *n > 0 => {
                *n -= 1;
                *n == 0
            }
            _ => false,
        }
    }

    fn count(&self, (pd, region): (usize, RegionId)) -> usize {
        self.counts
            .get(pd)
            .and_then(|c| c.get(region.0 as usize))
            .copied()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tbrdma_proto::Psn;

    /// A state with one passive connection, `qpn`, whose completions go to `send`/`recv`.
    fn one_connection(qpn: u32, send: &Arc<CqShared>, recv: &Arc<CqShared>) -> State {
        let mut state = State::new(1, 1500, usize::MAX, false, 0);
        let pd = state.add_protection_domain([7; 32]);
        add_peer(&mut state, pd, qpn, "127.0.0.1:9", false, [send, recv]);
        state
    }

    /// Adds passive connection `qpn` to `peer`, completions to `send` and `recv`.
    fn add_peer(
        state: &mut State,
        pd: PdId,
        qpn: u32,
        peer: &str,
        peer_takes_frames: bool,
        [send, recv]: [&Arc<CqShared>; 2],
    ) {
        state.add_connection(
            NewConnection {
                config: Config::default(),
                active: false,
                params: ConnectParams {
                    token: 1,
                    local_qpn: qpn,
                    remote_qpn: 2,
                    initial_psn: Psn(0),
                },
                peers: vec![peer.parse().unwrap()],
                peer_takes_frames,
                pd,
                send_cq: send.clone(),
                recv_cq: recv.clone(),
            },
            Time::ZERO,
        );
    }

    #[test]
    fn backends_learn_each_peers_carrier_and_forget_a_closed_ones() {
        let cq = Arc::new(CqShared::new(16));
        let mut state = State::new(1, 1500, usize::MAX, false, 0);
        let pd = state.add_protection_domain([7; 32]);
        add_peer(&mut state, pd, 5, "10.0.0.2:9", false, [&cq, &cq]);
        add_peer(&mut state, pd, 6, "10.0.0.3:9", true, [&cq, &cq]);
        let recorder = crate::io::NullIo::default();
        let carriers = recorder.carriers.clone();
        let mut rails = Rails::new(vec![Box::new(recorder)]);
        state.flush(&mut rails, Time::ZERO).unwrap();
        let (udp, frames) = ("10.0.0.2:9".parse().unwrap(), "10.0.0.3:9".parse().unwrap());
        assert_eq!(
            *carriers.lock().unwrap(),
            vec![(udp, false), (frames, true)]
        );
        // Closed: the slot leaves with its CLOSE, and the next pass tells the backend.
        state.close(5, Time::ZERO);
        state.flush(&mut rails, Time::ZERO).unwrap();
        state.flush(&mut rails, Time::ZERO).unwrap();
        assert_eq!(*carriers.lock().unwrap(), vec![(frames, true)]);
    }

    fn receive(wr_id: u64) -> RecvWr {
        RecvWr {
            wr_id,
            local: Sge {
                addr: 0,
                len: 0,
                lkey: 0,
            },
        }
    }

    #[test]
    fn a_region_is_unused_when_its_last_outstanding_request_completes() {
        let mut users = RegionUsers::default();
        let (a, b) = ((1, RegionId(3)), (0, RegionId(0)));
        assert!(!users.release(a), "nothing was posted");
        users.add(a);
        users.add(a);
        users.add(b);
        assert_eq!((users.count(a), users.count(b)), (2, 1));
        assert!(!users.release(a));
        assert!(users.release(a), "its last user");
        assert!(!users.release(a), "no count below zero");
        assert_eq!((users.count(a), users.count(b)), (0, 1));
        assert_eq!(users.count((5, RegionId(9))), 0);
    }

    #[test]
    fn completion_queues_are_rebound_only_while_no_work_is_outstanding() {
        let old = Arc::new(CqShared::new(4));
        let new = Arc::new(CqShared::new(4));
        let mut state = one_connection(5, &old, &old);
        assert_eq!(state.rebind_cqs(6, new.clone(), new.clone()), None);
        assert_eq!(state.rebind_cqs(5, new.clone(), new.clone()), Some(true));
        // A posted receive could complete on the queue it was posted under: refused.
        state.post_recv(5, &[receive(1)]).unwrap();
        let other = Arc::new(CqShared::new(4));
        assert_eq!(
            state.rebind_cqs(5, other.clone(), other.clone()),
            Some(false)
        );
        // Its completion (flushed here) reaches the queue bound when it was posted.
        state.abandon();
        assert_eq!((old.len(), new.len(), other.len()), (0, 1, 0));
        // Routed: nothing outstanding any more.
        assert_eq!(state.rebind_cqs(5, other.clone(), other), Some(true));
        // A closed queue pair is not rebound.
        state.close(5, Time::ZERO);
        assert_eq!(state.rebind_cqs(5, new.clone(), new), None);
    }
}
