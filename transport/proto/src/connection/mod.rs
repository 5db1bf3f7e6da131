//! The reliable connection (queue pair) as a sans-IO state machine.
//!
//! Each side of a connection runs one reliable, ordered packet stream towards the other. That
//! stream carries the side's own requests (SEND, WRITE, READ_REQUEST, atomics) *and* its
//! responses to the peer's requests (READ_RESPONSE, ATOMIC_RESPONSE, FATAL_NAK), so one
//! mechanism (PSNs, cumulative + selective ACKs, retransmission with backoff, a window) makes
//! all of them reliable. Consequences worth knowing:
//!
//! - A request is executed when the responder reaches it *in order*; a retransmitted request
//!   arrives as a duplicate PSN and is dropped, so an atomic runs exactly once, and its saved
//!   result is the ATOMIC_RESPONSE waiting in the responder's retransmission queue.
//! - The packets of the message that holds the next expected PSN are placed as they arrive, in
//!   any order (the segments of one message never overlap). A packet of a *later* message that
//!   arrives early is dropped and NAKed, because placing it could reorder overlapping writes.
//! - Requester failures (retry exceeded, receiver not ready) are decided locally; responder
//!   failures go back as a sequenced FATAL_NAK, so everything before it completes normally.
//!
//! Files: `tx.rs` owns the outgoing stream, `rx.rs` the incoming stream (acceptance and order),
//! `responder.rs` what an accepted packet does (placement, execution, refusals), `ack.rs` when
//! to acknowledge, `sq.rs` completion order, `paths.rs` the rails, `timer.rs` the
//! table of deadlines.

mod ack;
mod credit;
mod paths;
mod responder;
mod rx;
mod sq;
mod timer;
mod tx;

use std::collections::VecDeque;
use std::time::Duration;

use thiserror::Error;

use crate::config::Config;
use crate::hint::cold_path;
use crate::memory::{Access, Memory, RegionId};
use crate::seq::Psn;
use crate::time::Time;
use crate::wire::{self, ErrorCode, Ext, Handshake, Header, Opcode};
use crate::work::{PostError, Queue, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion};

use ack::AckPolicy;
use paths::Paths;
use rx::{Arrival, RxStream};
use sq::{SendQueue, SqEntry};
use timer::{Timer, TimerTable};
use tx::{TimeoutAction, TxStream};

/// Which side opened the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Sends CONNECT (the rdma_cm client).
    Active,
    /// Answers CONNECT with ACCEPT (the rdma_cm server).
    Passive,
}

/// The connection's life cycle (a simplification of the verbs QP states).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectionState {
    /// Handshake in progress; posted requests wait.
    Connecting,
    /// Ready to send (verbs RTS).
    Established,
    /// This side refused a peer request and is delivering the FATAL_NAK before failing.
    Draining,
    /// Failed: every request has completed or been flushed, new ones are flushed (verbs ERR).
    Error,
    /// Closed by the application.
    Closed,
}

/// Why a connection failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum ConnectionError {
    /// The peer never answered CONNECT.
    #[error(
        "no answer to CONNECT within the retry budget (is the peer listening, is the link up?)"
    )]
    ConnectTimeout,
    /// The peer stopped acknowledging.
    #[error("the peer stopped answering: retry count exceeded")]
    RetryExceeded,
    /// The peer kept having no receive posted for our SEND.
    #[error("the peer had no receive posted within the receiver-not-ready retry budget")]
    RnrRetryExceeded,
    /// Nothing was heard from the peer for the idle timeout.
    #[error("nothing heard from the peer within the idle timeout")]
    PeerSilent,
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    ClosedByPeer,
    /// A local buffer failed its protection check.
    #[error("a work request named a local buffer outside its region or without permission")]
    LocalProtection,
    /// The peer refused one of our requests.
    #[error("the peer refused a request: {0:?}")]
    RequestRefused(WcStatus),
    /// We refused one of the peer's requests.
    #[error("refused a request from the peer: {0:?}")]
    PeerRequestRefused(ErrorCode),
    /// The host's own transport failed (a bug in the engine): nothing more can be done on
    /// this connection.
    #[error("this host's transport engine failed")]
    EngineFailed,
}

/// Something the application may want to know about the connection itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The handshake finished.
    Established,
    /// The connection failed; outstanding requests have completed with errors.
    Failed(ConnectionError),
    /// The application closed the connection.
    Closed,
}

/// Counters for diagnostics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Datagrams handed out by `poll_transmit`.
    pub packets_sent: u64,
    /// Datagrams that passed decoding and addressing.
    pub packets_received: u64,
    /// Sequenced packets sent again.
    pub retransmits: u64,
    /// Retransmission timeouts that fired.
    pub timeouts: u64,
    /// Tail loss probes sent (each also counts as a retransmit).
    pub tail_probes: u64,
    /// Datagrams that failed the CRC.
    pub corrupted: u64,
    /// Datagrams that failed to decode for another reason.
    pub malformed: u64,
    /// Datagrams with the wrong token or queue pair number.
    pub foreign: u64,
    /// Sequenced packets that had already arrived.
    pub duplicates: u64,
    /// Packets of a later message dropped because an earlier one was incomplete.
    pub out_of_order_dropped: u64,
    /// Packets placed ahead of a gap inside their message.
    pub out_of_order_placed: u64,
    /// Packets of a later message held until the messages before them completed.
    pub out_of_order_stashed: u64,
    /// Receiver-not-ready NAKs sent.
    pub rnr_naks_sent: u64,
    /// Sequence-error NAKs sent.
    pub seq_naks_sent: u64,
    /// Sequence-error NAKs received for a packet still on its way over a slower path (see
    /// `paths.rs`), so not answered with a resend.
    pub naks_for_reordering: u64,
    /// Explicit ACK packets sent.
    pub acks_sent: u64,
}

/// The payload of a gathered datagram, left in registered memory: the caller sends these
/// bytes straight after the header [`Connection::poll_transmit_gather`] wrote (the CRC in that
/// header already covers them). The range was checked when its request was posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayloadRef {
    /// The region the bytes are in.
    pub region: RegionId,
    /// Offset of the first byte from the start of the region.
    pub offset: u64,
    /// How many bytes.
    pub len: usize,
    /// The bytes start the local buffer of a request this side posted (the first datagram of
    /// a SEND, WRITE or WRITE_WITH_IMM, not a READ response): what a send headroom is in
    /// front of.
    pub starts_request: bool,
}

/// A datagram from [`Connection::poll_transmit_gather`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// Bytes written at the front of the buffer: the header, followed by the payload unless
    /// the payload is in [`Self::payload`].
    pub len: usize,
    /// The path (rail) the datagram leaves on.
    pub path: usize,
    /// The payload, when it was left in memory: the datagram is the buffer's `len` bytes and
    /// then these.
    pub payload: Option<PayloadRef>,
}

impl Transmit {
    /// Length of the whole datagram on the wire.
    pub fn datagram_len(&self) -> usize {
        self.len + self.payload.map_or(0, |p| p.len)
    }
}

/// What the connection manager agreed on before the handshake: who is who, and the secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectParams {
    /// Random session token; every packet carries it and packets without it are ignored.
    pub token: u64,
    /// This side's queue pair number.
    pub local_qpn: u32,
    /// The peer's queue pair number.
    pub remote_qpn: u32,
    /// First PSN of this side's stream (random, so stale packets of an earlier connection
    /// between the same queue pairs do not fit).
    pub initial_psn: Psn,
}

/// Control packets waiting to go out.
#[derive(Debug, Default)]
struct PendingControl {
    handshake: bool,
    close: bool,
    keepalive: bool,
    /// A path that is down and due for a probe.
    probe: Option<usize>,
}

/// One reliable connection. See the module documentation.
#[derive(Debug)]
pub struct Connection {
    config: Config,
    role: Role,
    params: ConnectParams,
    state: ConnectionState,
    /// Payload bytes per packet, agreed in the handshake.
    max_payload: u32,
    /// Whether data packets carry a data digest, both ways: asked for by this side
    /// ([`Config::data_digest`], or [`Config::message_crc`], which is built from the digests)
    /// or by the peer in its CONNECT or ACCEPT. Data packets without one are then dropped.
    data_digest: bool,
    tx: TxStream,
    rx: RxStream,
    /// When to acknowledge what `rx` received.
    ack: AckPolicy,
    sq: SendQueue,
    rq: VecDeque<RecvWr>,
    /// How many receives `rq` gave up so far: the receive credit reported (`credit.rs`).
    receives_taken: credit::ReceiveCount,
    completions: VecDeque<WorkCompletion>,
    events: VecDeque<Event>,
    control: PendingControl,
    /// Every deadline of the connection (see `timer.rs`).
    timers: TimerTable,
    /// CONNECTs resent so far.
    handshake_attempts: u32,
    /// When the peer was last heard from (the idle timeout and the keep-alive count from it).
    last_heard: Time,
    /// When this side last sent a keep-alive, if it did since it last heard from the peer.
    keepalive_sent: Option<Time>,
    /// Why we refused a peer request, while draining.
    refused: Option<ErrorCode>,
    stats: Stats,
    paths: Paths,
    /// The path of the datagram the last `poll_transmit` produced.
    last_path: usize,
}

/// Packets a message of `len` bytes takes with `max_payload` bytes per packet (for tests of
/// where datagram boundaries fall).
#[cfg(test)]
pub(crate) fn packets_for_len(len: u64, max_payload: u32) -> u32 {
    tx::packets_for(len, max_payload)
}

impl Connection {
    /// The active side: sends CONNECT at the first `poll_transmit`.
    pub fn connect(config: Config, params: ConnectParams, now: Time) -> Connection {
        let mut conn = Connection::new(config, Role::Active, params, now);
        conn.control.handshake = true;
        conn
    }

    /// The passive side: waits for the peer's CONNECT.
    pub fn accept(config: Config, params: ConnectParams, now: Time) -> Connection {
        let mut conn = Connection::new(config, Role::Passive, params, now);
        conn.timers
            .set(Timer::Handshake, now + conn.config.idle_timeout);
        conn
    }

    fn new(mut config: Config, role: Role, params: ConnectParams, now: Time) -> Connection {
        // The largest header plus a byte of payload must fit; anything smaller cannot work.
        config.max_datagram = config
            .max_datagram
            .max(wire::MAX_HEADER_LEN + crate::config::MIN_PAYLOAD as usize);
        config.window = config.window.clamp(1, crate::config::MAX_WINDOW);
        let max_payload = config.max_payload();
        let tx = TxStream::new(params.initial_psn, &config);
        Connection {
            max_payload,
            data_digest: config.data_digest || config.message_crc,
            tx,
            rx: RxStream::new(),
            ack: AckPolicy::new(&config),
            sq: SendQueue::default(),
            rq: VecDeque::new(),
            receives_taken: credit::ReceiveCount::default(),
            completions: VecDeque::new(),
            events: VecDeque::new(),
            control: PendingControl::default(),
            timers: TimerTable::default(),
            handshake_attempts: 0,
            last_heard: now,
            keepalive_sent: None,
            refused: None,
            stats: Stats::default(),
            paths: Paths::new(config.path_probe_interval),
            last_path: 0,
            config,
            role,
            params,
            state: ConnectionState::Connecting,
        }
    }

    /// The connection's state.
    pub fn state(&self) -> ConnectionState {
        self.state
    }

    /// Which side this is.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The parameters it was created with.
    pub fn params(&self) -> &ConnectParams {
        &self.params
    }

    /// Payload bytes per packet (agreed in the handshake; this side's offer before it).
    pub fn max_payload(&self) -> u32 {
        self.max_payload
    }

    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Whether data packets carry data digests, both ways (asked for by either side: see
    /// [`Config::data_digest`]); final once the connection is established.
    pub fn uses_data_digest(&self) -> bool {
        self.data_digest
    }

    /// Declares how many paths (rails: links to the same peer) the connection may use; path 0
    /// is the one the handshake uses. Call before traffic flows.
    pub fn set_paths(&mut self, count: usize) {
        self.paths.set_count(count, &mut self.timers);
    }

    /// Number of paths.
    pub fn path_count(&self) -> usize {
        self.paths.count()
    }

    /// Whether `path` is currently used.
    pub fn path_is_up(&self, path: usize) -> bool {
        self.paths.is_up(path)
    }

    /// Datagrams sent on each path, and how many times a path was declared down.
    pub fn path_stats(&self) -> (&[u64], u64) {
        (&self.paths.sent, self.paths.failovers)
    }

    /// Requests posted to the send queue and not yet completed.
    pub fn outstanding_sends(&self) -> usize {
        self.sq.len()
    }

    /// Receives posted and not yet consumed.
    pub fn posted_recvs(&self) -> usize {
        self.rq.len()
    }

    /// Where an incoming message partly received goes (region and byte range): some of its
    /// packets may have been placed there, and more are due. Whoever lends the engine memory
    /// to receive into must not lend those bytes meanwhile (see the engine's landing zones).
    pub fn receiving_into(&self) -> Option<(RegionId, std::ops::Range<u64>)> {
        self.rx.message_in_progress()
    }

    /// Whether nothing is waiting: no request outstanding, nothing unacknowledged either way.
    pub fn is_idle(&self) -> bool {
        self.sq.is_empty() && self.tx.is_empty() && !self.ack.is_pending()
    }

    /// Posts a send-queue request (`ibv_post_send` with one work request).
    ///
    /// An accepted request always completes exactly once through [`Self::poll_completion`].
    /// A request whose local buffer fails its check completes with
    /// [`WcStatus::LocalProtection`] when it reaches the head of the queue, and the connection
    /// fails, as verbs does; on a failed or closed connection requests complete with
    /// [`WcStatus::Flushed`].
    ///
    /// Returns the region the request's local buffer lies in, when it has one and will read or
    /// write it (its bytes must stay until the request completes).
    pub fn post_send<M: Memory + ?Sized>(
        &mut self,
        wr: SendWr,
        mem: &M,
    ) -> Result<Option<RegionId>, PostError> {
        if matches!(wr.op, SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. }) && wr.local.len != 8 {
            return Err(PostError::Invalid(
                "an atomic's local buffer must be exactly 8 bytes",
            ));
        }
        if u64::from(tx::packets_for(wr.local.len, self.max_payload))
            > crate::config::MAX_MESSAGE_PACKETS
        {
            return Err(PostError::Invalid(
                "the message needs more than 2^30 packets at the negotiated payload size",
            ));
        }
        if !self.accepts_posts() {
            self.completions.push_back(WorkCompletion {
                wr_id: wr.wr_id,
                queue: Queue::Send,
                status: WcStatus::Flushed,
                opcode: wr.op.completion_opcode(),
                byte_len: 0,
                imm: None,
                payload_crc: None,
            });
            return Ok(None);
        }
        if self.sq.len() >= self.config.max_send_wr {
            return Err(PostError::QueueFull {
                queue: Queue::Send,
                depth: self.config.max_send_wr,
            });
        }
        let needed = match wr.op {
            SendOp::Send { .. } | SendOp::Write { .. } | SendOp::WriteWithImm { .. } => {
                Access::empty()
            }
            _ => Access::LOCAL_WRITE,
        };
        let local = if wr.local.len == 0 {
            Ok(None)
        } else {
            mem.table()
                .check_local(wr.local.lkey, wr.local.addr, wr.local.len, needed)
                .map(Some)
        };
        let local_error = local.is_err();
        let local = local.ok().flatten();
        self.sq.push(SqEntry::new(wr, local, local_error));
        if self.state == ConnectionState::Established {
            self.enqueue_posted();
        }
        Ok(local.map(|placement| placement.region))
    }

    /// Posts a receive buffer (`ibv_post_recv`). Its key is checked when a message arrives for
    /// it; a bad key then completes it with [`WcStatus::LocalProtection`].
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        if !self.accepts_posts() {
            self.completions.push_back(WorkCompletion {
                wr_id: wr.wr_id,
                queue: Queue::Recv,
                status: WcStatus::Flushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                payload_crc: None,
            });
            return Ok(());
        }
        if self.rq.len() >= self.config.max_recv_wr {
            return Err(PostError::QueueFull {
                queue: Queue::Recv,
                depth: self.config.max_recv_wr,
            });
        }
        self.rq.push_back(wr);
        Ok(())
    }

    fn accepts_posts(&self) -> bool {
        matches!(
            self.state,
            ConnectionState::Connecting | ConnectionState::Established
        )
    }

    /// Closes the connection: outstanding requests are flushed and a CLOSE goes to the peer.
    pub fn close(&mut self, now: Time) {
        if matches!(self.state, ConnectionState::Error | ConnectionState::Closed) {
            return;
        }
        let _ = now;
        self.flush_all(None);
        self.state = ConnectionState::Closed;
        self.timers.stop_all();
        self.control.close = true;
        self.events.push_back(Event::Closed);
    }

    /// Gives up on the connection because the engine driving it failed: every outstanding
    /// request and posted receive is flushed, nothing more is sent (no CLOSE: the engine
    /// that would send it is what failed), and the connection enters the error state.
    pub fn abandon(&mut self) {
        self.fail(None, ConnectionError::EngineFailed);
        self.control = Default::default();
    }

    /// The next work completion, in post order per queue.
    pub fn poll_completion(&mut self) -> Option<WorkCompletion> {
        self.completions.pop_front()
    }

    /// The next connection event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether [`Self::poll_transmit_gather`] (or any `poll_transmit*`) would certainly return
    /// nothing at `now`: no control packet or NAK waiting, nothing new or to resend in the
    /// outgoing stream and no receiver-not-ready pause to end, no acknowledgement due. A
    /// driver tests this before the polls that usually find nothing (the one after each
    /// datagram, the one after a receive whose ACK is held), which cost several times as much.
    /// False whenever unsure: a poll is then always correct. Every poll checks the claim in
    /// builds with debug assertions.
    #[inline]
    pub fn nothing_to_transmit(&self, now: Time) -> bool {
        let control = &self.control;
        let control_waits = control.handshake
            || control.close
            || control.keepalive
            || control.probe.is_some()
            || self.rx.has_pending_nak();
        !control_waits
            && self.tx.nothing_to_send(&self.timers)
            && (!self.ack.is_pending() || self.ack.waits_at(now, &self.timers))
    }

    /// Whether [`Self::poll_completion`] or [`Self::poll_event`] has something to return.
    #[inline]
    pub fn has_completions_or_events(&self) -> bool {
        !self.completions.is_empty() || !self.events.is_empty()
    }

    /// Processes one datagram received from the peer. Anything that does not decode, carries
    /// the wrong token or queue pair, or makes no sense in the current state is dropped and
    /// counted; nothing a peer sends can make this panic.
    pub fn handle_datagram<M: Memory + ?Sized>(&mut self, now: Time, datagram: &[u8], mem: &mut M) {
        self.handle_datagram_on(now, datagram, 0, mem);
    }

    /// As [`Self::handle_datagram`], for a datagram that arrived on `path`.
    pub fn handle_datagram_on<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        datagram: &[u8],
        path: usize,
        mem: &mut M,
    ) {
        self.receive(now, datagram, &[], path, mem);
        self.settle_timers();
    }

    /// As [`Self::handle_datagram_on`], for a datagram received in two pieces: `head`, its
    /// headers, and `payload`, the rest (see [`wire::decode_parts`]; with `payload` empty,
    /// `head` is the whole datagram). A payload that already lies where the message is placed
    /// is not copied (the [`Memory`] sees its own bytes).
    pub fn handle_datagram_parts_on<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        head: &[u8],
        payload: &[u8],
        path: usize,
        mem: &mut M,
    ) {
        self.receive(now, head, payload, path, mem);
        self.settle_timers();
    }

    /// Where the payload of the next message would go if it is a SEND arriving in order with
    /// its first packet: the buffer of the oldest posted receive, when no message is partly
    /// received, nothing early is held, its key grants local write to all of it, and the last
    /// data-bearing message to start was a SEND (a peer that sends WRITEs is likely to go on
    /// doing so, and receiving those into the buffer would only cost a copy out). A receiver
    /// may receive a datagram straight into it (see the engine's receive landing): the buffer
    /// is the transport's until its receive completes, so anything else that lands there is
    /// only overwritten later. A buffer shorter than `min_len` is not offered (and its key is
    /// not looked up).
    ///
    /// Returns the region and the buffer's byte range in it.
    pub fn next_receive_buffer<M: Memory + ?Sized>(
        &self,
        mem: &M,
        min_len: u64,
    ) -> Option<(RegionId, std::ops::Range<u64>)> {
        if self.state != ConnectionState::Established
            || !self.rx.between_messages()
            || !self.rx.last_started_send
        {
            return None;
        }
        let recv = self.rq.front()?;
        if recv.local.len == 0 || recv.local.len < min_len {
            return None;
        }
        let at = mem
            .table()
            .check_local(
                recv.local.lkey,
                recv.local.addr,
                recv.local.len,
                Access::LOCAL_WRITE,
            )
            .ok()?;
        Some((at.region, at.offset..at.offset + recv.local.len))
    }

    /// Decodes the datagram `datagram` followed by `tail` (empty unless it came in two pieces)
    /// and acts on it.
    fn receive<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        datagram: &[u8],
        tail: &[u8],
        path: usize,
        mem: &mut M,
    ) {
        // The packet is used where it was decoded, by reference: it is some 200 bytes (an ACK
        // carries its SACK blocks inline), and each move was a `memcpy`.
        let decoded = wire::decode_parts(datagram, tail);
        let packet = match &decoded {
            Ok(packet) => packet,
            Err(wire::DecodeError::BadCrc) => {
                cold_path();
                self.stats.corrupted += 1;
                return;
            }
            Err(_) => {
                cold_path();
                self.stats.malformed += 1;
                return;
            }
        };
        let header = packet.header;
        if header.token != self.params.token || header.dest_qpn != self.params.local_qpn {
            cold_path();
            self.stats.foreign += 1;
            return;
        }
        if self.data_digest && !header.data_digest() && header.opcode.carries_data() {
            cold_path();
            // Both sides agreed on digests: a payload nothing vouches for is not placed.
            self.stats.corrupted += 1;
            return;
        }
        self.stats.packets_received += 1;
        self.paths.mark_up(path, &mut self.timers);
        match self.state {
            ConnectionState::Connecting => {
                cold_path();
                self.handle_handshake(now, &packet.ext, header.data_digest())
            }
            ConnectionState::Established | ConnectionState::Draining => {
                self.heard(now);
                if let Ext::Connect(_) = packet.ext {
                    cold_path();
                    // Our ACCEPT was lost: say it again.
                    if self.role == Role::Passive {
                        self.control.handshake = true;
                    }
                    return;
                }
                if header.ack_valid() {
                    self.on_ack_psn(now, header.ack_psn);
                }
                if let Ext::Close { .. } = packet.ext {
                    cold_path();
                    // What the peer acknowledged in its CLOSE did arrive: complete it before
                    // flushing the rest, so a peer that closes right after receiving our last
                    // WRITE does not turn that WRITE into an error.
                    if self.state == ConnectionState::Established {
                        self.drain_send_queue();
                    }
                    self.fail(None, ConnectionError::ClosedByPeer);
                    return;
                }
                let arrival = Arrival {
                    packet,
                    datagram,
                    tail,
                    path,
                };
                self.handle_established(now, &arrival, mem);
                self.ack.arm(now, &mut self.timers);
                self.after_progress(now);
            }
            ConnectionState::Error | ConnectionState::Closed => {
                cold_path();
                // Tell a peer that still talks to us that we are gone, so it fails fast.
                if !matches!(packet.ext, Ext::Close { .. }) {
                    self.control.close = true;
                }
            }
        }
    }

    /// `data_digest`: the peer's CONNECT asks for data digests, or its ACCEPT says both sides
    /// use them.
    fn handle_handshake(&mut self, now: Time, ext: &Ext, data_digest: bool) {
        let peer = match (self.role, ext) {
            (Role::Passive, Ext::Connect(h)) | (Role::Active, Ext::Accept(h)) => *h,
            _ => return,
        };
        if peer.src_qpn != self.params.remote_qpn
            || peer.max_payload < crate::config::MIN_PAYLOAD
            || peer.window == 0
        {
            self.stats.malformed += 1;
            return;
        }
        self.heard(now);
        self.max_payload = crate::config::agreed_payload(self.max_payload, peer.max_payload);
        self.tx.set_peer_window(peer.window);
        self.data_digest |= data_digest;
        self.rx.start(peer.initial_psn);
        self.state = ConnectionState::Established;
        self.timers.stop(Timer::Handshake);
        // The passive side answers; the active side is done.
        self.control.handshake = self.role == Role::Passive;
        self.events.push_back(Event::Established);
        self.enqueue_posted();
    }

    /// The peer was heard from: the idle timeout starts over, and so does the keep-alive.
    fn heard(&mut self, now: Time) {
        self.last_heard = now;
        self.keepalive_sent = None;
        self.timers.set(Timer::Idle, now + self.config.idle_timeout);
    }

    fn handshake_params(&self) -> Handshake {
        Handshake {
            src_qpn: self.params.local_qpn,
            initial_psn: self.params.initial_psn,
            max_payload: self.config.max_payload(),
            window: self.config.window,
        }
    }

    /// Processes expired deadlines. Call it when the time from [`Self::poll_timeout`] has come
    /// (calling it early or late is harmless).
    pub fn handle_timeout(&mut self, now: Time) {
        for timer in self.timers.expired(now) {
            // An earlier handler may have stopped or moved this one (a failure stops them all).
            if self.timers.is_expired(timer, now) {
                self.on_timer(timer, now);
            }
        }
        self.settle_timers();
    }

    /// What each deadline does when it passes. A handler re-arms or stops its own timer, or
    /// leaves it due for the transmit pass that acts on it (the RNR resume, the ACK).
    fn on_timer(&mut self, timer: Timer, now: Time) {
        match timer {
            Timer::Handshake => {
                self.timers.stop(Timer::Handshake);
                match self.role {
                    Role::Passive => self.fail(None, ConnectionError::ConnectTimeout),
                    Role::Active => {
                        self.handshake_attempts += 1;
                        if self.handshake_attempts > self.config.max_retries {
                            self.fail(None, ConnectionError::ConnectTimeout);
                        } else {
                            // Re-armed, with backoff, when the CONNECT goes out.
                            self.control.handshake = true;
                        }
                    }
                }
            }
            Timer::Idle => {
                self.fail(Some(WcStatus::RetryExceeded), ConnectionError::PeerSilent);
            }
            // The transmit pass resumes sending (and stops the timer).
            Timer::RnrResume => {}
            Timer::Retransmit => self.on_tx_timeout(now),
            Timer::TailProbe => {
                if self.tx.on_tail_probe(now, &mut self.timers) {
                    self.stats.tail_probes += 1;
                }
            }
            Timer::PathProbe => {
                // While draining, the probe waits (the timer stays due) until the drain ends.
                if self.state == ConnectionState::Established {
                    if let Some(path) = self.paths.probe_due(now, &mut self.timers) {
                        self.control.probe = Some(path);
                    }
                }
            }
            Timer::KeepAlive => {
                self.control.keepalive = true;
                self.keepalive_sent = Some(now);
                // `settle_timers` arms the next one.
            }
            // The ACK is due: the transmit pass sends it (and stops the timer).
            Timer::Ack => {}
        }
    }

    /// Brings the timers that follow the connection's state up to date; every input that can
    /// change that state ends with it. A connection that ended has no deadlines. The keep-alive
    /// runs only while established with neither a retransmission timeout nor a
    /// receiver-not-ready pause running (both already wait for the peer), counting from the
    /// last sign of life or the last keep-alive sent.
    fn settle_timers(&mut self) {
        match self.state {
            ConnectionState::Error | ConnectionState::Closed => {
                cold_path();
                self.timers.stop_all()
            }
            ConnectionState::Established
                if !self.timers.is_set(Timer::Retransmit)
                    && !self.timers.is_set(Timer::RnrResume) =>
            {
                let since = self.keepalive_sent.unwrap_or(self.last_heard);
                self.timers
                    .set(Timer::KeepAlive, since + self.config.keepalive_interval);
            }
            _ => self.timers.stop(Timer::KeepAlive),
        }
    }

    /// Whether an acknowledgement is being held for a reply to carry (see [`Config::ack_hold`]).
    pub fn ack_held(&self) -> bool {
        self.ack.is_held()
    }

    /// Ends the hold of a held acknowledgement now: the next transmit pass sends it unless a
    /// packet of this side carries it first. A caller-driven engine calls this when the
    /// application comes back into the engine, so that a hold lasts one application step rather
    /// than a fixed time.
    pub fn release_held_ack(&mut self) {
        self.ack.release(&mut self.timers);
        self.settle_timers();
    }

    /// The earliest time [`Self::handle_timeout`] has something to do, if any: the earliest
    /// deadline in the timer table.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.timers.next_timeout()
    }

    /// Writes the next datagram to send into `buf` and returns its length, or `None` when
    /// nothing is due. Call it until it returns `None` after every `handle_*` or `post_*`.
    ///
    /// # Panics
    /// If `buf` is shorter than `config.max_datagram` (a programming error of the caller).
    pub fn poll_transmit<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        buf: &mut [u8],
        mem: &M,
    ) -> Option<usize> {
        assert!(
            buf.len()
                >= self
                    .config
                    .max_datagram
                    .min(wire::MAX_HEADER_LEN + self.max_payload as usize),
            "poll_transmit needs a buffer of at least config.max_datagram bytes"
        );
        self.poll_transmit_path(now, buf, mem).map(|(len, _)| len)
    }

    /// As [`Self::poll_transmit`], also saying on which path (rail) the datagram must leave.
    pub fn poll_transmit_path<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        buf: &mut [u8],
        mem: &M,
    ) -> Option<(usize, usize)> {
        // No payload reaches `usize::MAX` bytes: everything is copied into `buf`.
        self.poll_transmit_gather(now, buf, mem, usize::MAX)
            .map(|t| (t.len, t.path))
    }

    /// As [`Self::poll_transmit_path`], but a payload of at least `gather_from` bytes is not
    /// copied: only the header goes into `buf`, and [`Transmit::payload`] says which bytes of
    /// registered memory the caller must send after it, as the second part of the same datagram
    /// (a two-element `sendmsg` iovec). The CRC in the header covers both parts, read from
    /// memory in place through [`Memory::with_bytes`], so the datagram on the wire is byte for
    /// byte the one [`Self::poll_transmit_path`] would have produced. Smaller payloads (and
    /// every control packet) are copied behind the header as usual, and the result has no
    /// payload part. `buf` must be as large as for [`Self::poll_transmit`].
    pub fn poll_transmit_gather<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        buf: &mut [u8],
        mem: &M,
        gather_from: usize,
    ) -> Option<Transmit> {
        // Engines skip the poll when this says so: every poll of a build with debug assertions
        // (the tests, the simulator, the fuzz targets) checks the claim.
        let claimed_idle = cfg!(debug_assertions) && self.nothing_to_transmit(now);
        self.last_path = self.paths.primary();
        let next = self.next_datagram(now, buf, mem, gather_from);
        self.settle_timers();
        debug_assert!(
            !(claimed_idle && next.is_some()),
            "nothing_to_transmit was true, yet a datagram came"
        );
        let (len, payload) = next?;
        self.stats.packets_sent += 1;
        if let Some(sent) = self.paths.sent.get_mut(self.last_path) {
            *sent += 1;
        }
        Some(Transmit {
            len,
            path: self.last_path,
            payload,
        })
    }

    fn next_datagram<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        buf: &mut [u8],
        mem: &M,
        gather_from: usize,
    ) -> Option<(usize, Option<PayloadRef>)> {
        if self.control.handshake {
            cold_path();
            self.control.handshake = false;
            let h = self.handshake_params();
            let ext = if self.role == Role::Active {
                Ext::Connect(h)
            } else {
                Ext::Accept(h)
            };
            if self.role == Role::Active && self.state == ConnectionState::Connecting {
                let backoff =
                    self.config.initial_rto * 2u32.saturating_pow(self.handshake_attempts);
                self.timers
                    .set(Timer::Handshake, now + backoff.min(self.config.max_rto));
            }
            return Some((self.control_packet(buf, ext), None));
        }
        if self.control.close {
            cold_path();
            self.control.close = false;
            return Some((self.control_packet(buf, Ext::Close { reason: 0 }), None));
        }
        if !matches!(
            self.state,
            ConnectionState::Established | ConnectionState::Draining
        ) {
            cold_path();
            return None;
        }
        if let Some(nak) = self.rx.take_nak() {
            cold_path();
            return Some((self.control_packet(buf, nak), None));
        }
        if let Some(sent) = self.transmit_sequenced(now, buf, mem, gather_from) {
            return Some(sent);
        }
        if self.ack.is_pending() && !self.ack.waits_at(now, &self.timers) {
            self.ack.on_ack_sent(&mut self.timers);
            self.stats.acks_sent += 1;
            if let Some(path) = self.ack.take_reply_path() {
                self.last_path = path;
            }
            let limit = self.receives_taken.limit(self.rq.len());
            let ext = self
                .rx
                .ack_frame(self.config.window, limit, self.config.max_datagram);
            return Some((self.control_packet(buf, ext), None));
        }
        if self.tx.wants_credit_report() {
            cold_path();
            // Held back by receive credit: the peer answers a keep-alive with an ACK at once.
            return Some((self.control_packet(buf, Ext::KeepAlive), None));
        }
        if let Some(path) = self.control.probe.take() {
            cold_path();
            self.last_path = path;
            return Some((self.control_packet(buf, Ext::KeepAlive), None));
        }
        if self.control.keepalive {
            cold_path();
            self.control.keepalive = false;
            return Some((self.control_packet(buf, Ext::KeepAlive), None));
        }
        None
    }

    fn header(&self, opcode: Opcode, psn: Psn, flags: u16) -> Header {
        let ack_flag = if self.rx.started() {
            wire::FLAG_ACK_VALID
        } else {
            0
        };
        // On every packet: the CONNECT asks, the ACCEPT answers, and a data packet's CRC then
        // covers its payload.
        let digest_flag = if self.data_digest {
            wire::FLAG_DATA_DIGEST
        } else {
            0
        };
        Header {
            opcode,
            token: self.params.token,
            dest_qpn: self.params.remote_qpn,
            psn,
            ack_psn: self.rx.expected(),
            flags: flags | ack_flag | digest_flag,
        }
    }

    fn control_packet(&mut self, buf: &mut [u8], ext: Ext) -> usize {
        let header = self.header(ext.opcode(), self.tx.next_psn(), 0);
        let len = wire::write_header(buf, &header, &ext, 0);
        wire::seal(&mut buf[..len]);
        len
    }

    /// Moves posted requests into the outgoing stream once the connection is established.
    ///
    /// A request that changes the peer's memory (SEND, WRITE, atomics) waits until every READ
    /// posted before it has its response: the responder reads memory when it sends (and
    /// resends) response packets, so letting a later WRITE overtake would let the READ see the
    /// WRITE's data. This is verbs' `IBV_SEND_FENCE`, applied always (see docs/semantics.md).
    fn enqueue_posted(&mut self) {
        if self.sq.all_queued() {
            // The common case after every datagram: nothing new to give PSNs to.
            return;
        }
        let max_payload = self.max_payload;
        let mut read_pending = self.sq.awaits_read_response();
        for entry in self.sq.unqueued_mut() {
            if entry.local_error {
                // Nothing after a request that can never run is sent: it fails the connection
                // when it reaches the head of the queue, and everything behind it is flushed.
                break;
            }
            let is_read = matches!(entry.wr.op, SendOp::Read { .. });
            if read_pending && !is_read {
                break;
            }
            read_pending |= is_read;
            let (first, last) = self.tx.push_request(entry, max_payload);
            entry.first_psn = first;
            entry.last_psn = last;
            entry.queued = true;
        }
    }

    /// Completes what finished at the head of the send queue, in order.
    fn drain_send_queue(&mut self) {
        while let Some(front) = self.sq.front() {
            if front.local_error {
                self.fail(
                    Some(WcStatus::LocalProtection),
                    ConnectionError::LocalProtection,
                );
                return;
            }
            if !front.is_done() {
                return;
            }
            let entry = self.sq.pop().expect("front exists");
            self.completions
                .push_back(entry.completion(WcStatus::Success));
        }
    }

    fn after_progress(&mut self, now: Time) {
        if matches!(
            self.state,
            ConnectionState::Established | ConnectionState::Draining
        ) {
            self.drain_send_queue();
        }
        if self.state == ConnectionState::Established {
            self.enqueue_posted();
        }
        if matches!(
            self.state,
            ConnectionState::Established | ConnectionState::Draining
        ) {
            let sq = &self.sq;
            self.tx.arm(now, &mut self.timers, || sq.awaits_response());
        }
    }

    fn transmit_sequenced<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        buf: &mut [u8],
        mem: &M,
        gather_from: usize,
    ) -> Option<(usize, Option<PayloadRef>)> {
        let paths = &self.paths;
        let psn = self
            .tx
            .next_to_send_judging(now, &mut self.timers, |p| paths.presumed_lost(p))?;
        let header = self.header(Opcode::Send, psn, 0);
        let built = self
            .tx
            .build(psn, header, self.max_payload, buf, mem, gather_from);
        let len = built.0 + built.1.map_or(0, |p| p.len);
        let tx = &self.tx;
        self.last_path = self.paths.for_packet(len, || tx.is_striped(psn));
        if self.tx.on_sent(psn, now, &mut self.timers) {
            self.stats.retransmits += 1;
        }
        self.paths
            .record_sent(psn, self.last_path, self.tx.snd_una());
        self.ack
            .on_piggybacked(self.rx.has_sacks(), &mut self.timers);
        Some(built)
    }

    fn on_tx_timeout(&mut self, now: Time) {
        match self.tx.on_timeout(now, &mut self.timers) {
            TimeoutAction::Nothing => {}
            TimeoutAction::Retransmit => {
                self.stats.timeouts += 1;
                // Blame the path that carried the oldest lost packet; the others carry on.
                if let Some(path) = self.paths.sent_path(self.tx.snd_una()) {
                    self.paths.mark_down(path, now, &mut self.timers);
                }
            }
            TimeoutAction::Probe => {
                self.stats.timeouts += 1;
                self.control.keepalive = true;
            }
            TimeoutAction::GiveUp => {
                self.stats.timeouts += 1;
                self.fail(
                    Some(WcStatus::RetryExceeded),
                    ConnectionError::RetryExceeded,
                );
            }
        }
    }

    /// Fails the connection: the first outstanding request gets `head_status` (when given),
    /// everything else is flushed, and the connection enters the error state.
    fn fail(&mut self, head_status: Option<WcStatus>, error: ConnectionError) {
        self.fail_at(
            head_status.map(|_| 0),
            head_status.unwrap_or(WcStatus::Flushed),
            error,
        );
    }

    /// Fails the connection, completing the request at `culprit` (a send-queue position) with
    /// `status` and flushing everything else.
    fn fail_at(&mut self, culprit: Option<usize>, status: WcStatus, error: ConnectionError) {
        if matches!(self.state, ConnectionState::Error | ConnectionState::Closed) {
            return;
        }
        self.flush_all(culprit.map(|pos| (pos, status)));
        self.state = ConnectionState::Error;
        self.timers.stop_all();
        // Best effort: tell the peer, so that it fails now rather than after its own timeouts.
        self.control.close = !matches!(
            error,
            ConnectionError::ClosedByPeer | ConnectionError::ConnectTimeout
        );
        self.events.push_back(Event::Failed(error));
    }

    fn flush_all(&mut self, culprit: Option<(usize, WcStatus)>) {
        let mut position = 0;
        while let Some(entry) = self.sq.pop() {
            let status = match culprit {
                Some((pos, status)) if pos == position => status,
                _ => WcStatus::Flushed,
            };
            self.completions.push_back(entry.completion(status));
            position += 1;
        }
        // A message half received holds the receive it consumed, which was ahead of every
        // receive still queued: it completes first (it would otherwise never complete).
        if let Some(wr_id) = self.rx.consumed_receive() {
            self.push_recv_completion(wr_id, WcStatus::Flushed, WcOpcode::Recv, 0, None);
        }
        for wr in self.rq.drain(..) {
            self.completions.push_back(WorkCompletion {
                wr_id: wr.wr_id,
                queue: Queue::Recv,
                status: WcStatus::Flushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                payload_crc: None,
            });
        }
        self.tx.clear(&mut self.timers);
        self.paths.forget_sent();
        self.rx.clear();
        self.ack.clear();
        self.control.keepalive = false;
    }

    /// The retransmission budget as configured: a vanished peer is detected within this much
    /// time of the last packet heard (see [`Config::retry_budget`]).
    pub fn retry_budget(&self) -> Duration {
        self.config.retry_budget()
    }
}

#[cfg(test)]
mod tests;
