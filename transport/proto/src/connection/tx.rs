//! The outgoing stream: PSN assignment, the window, retransmission (on NAK, on a tail loss
//! probe, on timeout with exponential backoff and F-RTO's test for a spurious timeout, skipping
//! what the peer acknowledged selectively), and packet building.
//!
//! A message is kept as one entry however many packets it spans; any packet of it can be
//! rebuilt from its index, reading the payload from memory again. Nothing is copied aside for
//! retransmission: as with verbs, a buffer belongs to the transport until its request completes.
//!
//! Its three deadlines, the retransmission timeout ([`Timer::Retransmit`]), the tail loss
//! probe ([`Timer::TailProbe`]) and the end of a receiver-not-ready pause
//! ([`Timer::RnrResume`]), live in the connection's [`TimerTable`], which the methods that
//! move them are given.
//!
//! The tail loss probe exists because a lost last datagram (or its lost acknowledgement)
//! leaves the receiver nothing to NAK: without it, such a loss cost the whole retransmission
//! timeout (1 ms, 20 ms on collectives' connections) on links whose round trip is 5-50 µs.

use std::collections::VecDeque;
use std::time::Duration;

use super::PayloadRef;
use super::credit::SendCredit;
use super::sq::SqEntry;
use super::timer::{Timer, TimerTable};
use crate::config::Config;
use crate::hint::cold_path;
use crate::memory::{Memory, Placement};
use crate::seq::Psn;
use crate::time::{Time, nanos};
use crate::wire::{self, ErrorCode, Ext, Header, Remote, Segment};
use crate::work::SendOp;

/// What an outgoing message is.
#[derive(Clone, Copy, Debug)]
pub(super) enum OutKind {
    Send {
        source: Option<Placement>,
        len: u64,
        imm: Option<u32>,
    },
    Write {
        source: Option<Placement>,
        len: u64,
        remote: Remote,
        imm: Option<u32>,
    },
    ReadRequest {
        remote: Remote,
        len: u64,
    },
    FetchAdd {
        remote: Remote,
        add: u64,
    },
    CmpSwap {
        remote: Remote,
        compare: u64,
        swap: u64,
    },
    ReadResponse {
        source: Option<Placement>,
        len: u64,
        req_psn: Psn,
    },
    AtomicResponse {
        req_psn: Psn,
        original: u64,
    },
    FatalNak {
        req_psn: Psn,
        code: ErrorCode,
    },
}

impl OutKind {
    fn data_len(&self) -> u64 {
        match *self {
            OutKind::Send { len, .. }
            | OutKind::Write { len, .. }
            | OutKind::ReadResponse { len, .. } => len,
            _ => 0,
        }
    }

    /// Whether the message takes a receive at the peer (and so needs receive credit).
    fn consumes_receive(&self) -> bool {
        matches!(
            self,
            OutKind::Send { .. } | OutKind::Write { imm: Some(_), .. }
        )
    }
}

#[derive(Debug)]
pub(super) struct OutMessage {
    first_psn: Psn,
    npackets: u32,
    kind: OutKind,
    /// Its number among the receive-consuming messages (`credit.rs`), if it is one.
    receive_ordinal: Option<u32>,
}

impl OutMessage {
    fn last_psn(&self) -> Psn {
        self.first_psn.plus(self.npackets - 1)
    }
}

/// Packets needed for `len` bytes (an empty message still takes one).
pub(super) fn packets_for(len: u64, max_payload: u32) -> u32 {
    if len <= u64::from(max_payload) {
        // Most messages fit one datagram: a 64-bit division is some 40 cycles, several times
        // per message.
        return 1;
    }
    let n = len.div_ceil(u64::from(max_payload)).max(1);
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// What a retransmission timeout asks for.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum TimeoutAction {
    Nothing,
    Retransmit,
    Probe,
    GiveUp,
}

/// Where the sender is in F-RTO (RFC 5682), after a retransmission timeout: whether the
/// timeout was spurious (the acknowledgements were late, not lost: a peer descheduled on a busy
/// host) is told by the next two acknowledgements, before the rest of the flight is resent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Frto {
    /// The oldest unacknowledged packet goes again (`sent` once it went), alone; `until` is
    /// the first PSN never sent when the timeout fired.
    Resent {
        sent: bool,
        until: Psn,
        timed: Timed,
    },
    /// The first acknowledgement since moved on, but not past `until`: up to `budget` more new
    /// packets go (if there are any), and the next acknowledgement decides.
    NewSent { budget: u32, timed: Timed },
}

/// The packet that was being timed when the retransmission timeout fired. Karn's rule keeps
/// its round trip out of the estimator, since an acknowledgement could answer either copy;
/// but when F-RTO finds the timeout spurious, the original arrived, and the first
/// acknowledgement to cover it answered the original or came later still: its round trip
/// can only over-estimate. Sampling it then is what lets a link whose round trip is longer
/// than the first timeout (no sample yet) learn it; without it every flight timed out once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timed {
    /// No packet was being timed.
    Nothing,
    /// Packet `.0`, first sent at `.1`, not yet acknowledged.
    Waiting(Psn, Time),
    /// Acknowledged this many nanoseconds after it was first sent.
    Answered(u64),
}

impl Timed {
    /// An acknowledgement of everything before `ack` arrived at `now`.
    fn on_ack(self, ack: Psn, now: Time) -> Timed {
        match self {
            Timed::Waiting(psn, sent) if psn.before(ack) => {
                Timed::Answered(now.as_nanos().saturating_sub(sent.as_nanos()))
            }
            other => other,
        }
    }
}

#[derive(Debug)]
pub(super) struct TxStream {
    /// Next PSN to assign.
    next_psn: Psn,
    /// First PSN never transmitted.
    next_send: Psn,
    /// Oldest PSN not acknowledged.
    snd_una: Psn,
    messages: VecDeque<OutMessage>,
    /// PSN ranges above `snd_una` the peer acknowledged selectively (sorted, disjoint).
    sacked: Vec<(Psn, Psn)>,
    /// Retransmission cursor.
    rtx: Option<Psn>,
    /// Whether the cursor resends only the packets presumed lost (see
    /// [`Self::resend_presumed_lost`]) rather than every one not acknowledged selectively.
    rtx_selective: bool,
    /// After a retransmission timeout, until the acknowledgements have told whether it was
    /// spurious (see [`Frto`]). A spurious timeout used to resend the whole flight, up to a
    /// window (128 datagrams of 64 KiB in a bulk transfer); now it costs one packet. A flight
    /// that was really lost is resent from the oldest unacknowledged packet, as before, one or
    /// two acknowledgements later.
    frto: Option<Frto>,
    peer_window: u32,
    // The round-trip estimator and the timeouts are kept in nanoseconds: they are updated on
    // every acknowledgement and read on every packet sent, and `Duration`'s normalising,
    // overflow-checked arithmetic cost about 130 instructions per round trip more.
    initial_rto: u64,
    rto_ceiling: u64,
    max_rto: u64,
    rto: u64,
    /// Smoothed round trip and its deviation (RFC 6298), once sampled.
    srtt: Option<u64>,
    rttvar: u64,
    /// The packet being timed: its PSN and first transmission (Karn: never a resent one).
    rtt_probe: Option<(Psn, Time)>,
    /// See [`Config::tail_probe_floor`].
    tail_probe_floor: u64,
    /// How long the peer may hold an acknowledgement for a reply to carry it
    /// ([`Config::ack_hold`]; both sides run the same engine settings), which a probe must
    /// wait out before it can tell a slow answer from a lost datagram.
    ack_allowance: u64,
    /// Whether this flight (what is unacknowledged since the last progress) was probed: one
    /// probe per flight, after that only the retransmission timeout.
    tail_probed: bool,
    retries: u32,
    max_retries: u32,
    rnr_retries: u32,
    max_rnr_retries: u32,
    credit: SendCredit,
}

impl TxStream {
    pub fn new(initial_psn: Psn, config: &Config) -> TxStream {
        TxStream {
            next_psn: initial_psn,
            next_send: initial_psn,
            snd_una: initial_psn,
            messages: VecDeque::new(),
            sacked: Vec::new(),
            rtx: None,
            rtx_selective: false,
            frto: None,
            peer_window: 1,
            initial_rto: nanos(config.initial_rto),
            rto_ceiling: nanos(config.rto_ceiling.max(config.initial_rto)),
            max_rto: nanos(config.max_rto),
            rto: nanos(config.initial_rto),
            srtt: None,
            rttvar: 0,
            rtt_probe: None,
            tail_probe_floor: nanos(config.tail_probe_floor),
            ack_allowance: nanos(config.ack_hold),
            tail_probed: false,
            retries: 0,
            max_retries: config.max_retries,
            rnr_retries: 0,
            max_rnr_retries: config.max_rnr_retries,
            credit: SendCredit::default(),
        }
    }

    pub fn next_psn(&self) -> Psn {
        self.next_psn
    }

    /// The window the peer advertised, as honoured (for tests of its ceiling).
    #[cfg(test)]
    pub fn peer_window(&self) -> u32 {
        self.peer_window
    }

    pub fn set_peer_window(&mut self, window: u32) {
        self.peer_window = window.clamp(1, crate::config::MAX_WINDOW);
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    fn has_unacked(&self) -> bool {
        self.snd_una != self.next_psn
    }

    /// Oldest unacknowledged PSN.
    pub fn snd_una(&self) -> Psn {
        self.snd_una
    }

    /// The index in `messages` of the message `psn` belongs to (`messages.len()` if none).
    fn message_index(&self, psn: Psn) -> usize {
        match self.messages.front() {
            // The oldest message, as in a ping-pong, where it is the only one: a VecDeque's
            // binary search costs some 30 instructions more, on every packet.
            Some(m) if !m.last_psn().before(psn) => 0,
            _ => self.messages.partition_point(|m| m.last_psn().before(psn)),
        }
    }

    /// Whether the packet at `psn` belongs to a multi-packet message (and may be striped).
    pub fn is_striped(&self, psn: Psn) -> bool {
        let index = self.message_index(psn);
        self.messages.get(index).is_some_and(|m| m.npackets > 1)
    }

    /// Forgets everything outstanding (the connection failed or closed).
    pub fn clear(&mut self, timers: &mut TimerTable) {
        self.messages.clear();
        self.sacked.clear();
        self.stop_resending();
        timers.stop(Timer::RnrResume);
        timers.stop(Timer::Retransmit);
        timers.stop(Timer::TailProbe);
        self.snd_una = self.next_psn;
        self.next_send = self.next_psn;
    }

    fn push(&mut self, kind: OutKind, max_payload: u32) -> (Psn, Psn) {
        let npackets = packets_for(kind.data_len(), max_payload);
        let first_psn = self.next_psn;
        self.next_psn = first_psn.plus(npackets);
        let receive_ordinal = kind.consumes_receive().then(|| self.credit.assign());
        let message = OutMessage {
            first_psn,
            npackets,
            kind,
            receive_ordinal,
        };
        let last = message.last_psn();
        self.messages.push_back(message);
        (first_psn, last)
    }

    /// Gives a posted request its PSNs.
    pub fn push_request(&mut self, entry: &SqEntry, max_payload: u32) -> (Psn, Psn) {
        let source = entry.local;
        let len = entry.wr.local.len;
        let remote = |r: crate::work::RemoteAddr| Remote {
            rkey: r.rkey,
            addr: r.addr,
        };
        let kind = match entry.wr.op {
            SendOp::Send { imm } => OutKind::Send { source, len, imm },
            SendOp::Write { remote: r } => OutKind::Write {
                source,
                len,
                remote: remote(r),
                imm: None,
            },
            SendOp::WriteWithImm { remote: r, imm } => OutKind::Write {
                source,
                len,
                remote: remote(r),
                imm: Some(imm),
            },
            SendOp::Read { remote: r } => OutKind::ReadRequest {
                remote: remote(r),
                len,
            },
            SendOp::FetchAdd { remote: r, add } => OutKind::FetchAdd {
                remote: remote(r),
                add,
            },
            SendOp::CmpSwap {
                remote: r,
                compare,
                swap,
            } => OutKind::CmpSwap {
                remote: remote(r),
                compare,
                swap,
            },
        };
        self.push(kind, max_payload)
    }

    /// Queues a response to the peer's request.
    pub fn push_response(&mut self, kind: OutKind, max_payload: u32) {
        self.push(kind, max_payload);
    }

    /// Forgets what the peer acknowledged selectively, as RFC 2018 asks after a timeout: a
    /// receiver may throw away what it SACKed (a full stash, a message it could not take yet),
    /// and a NAK or a timeout is when the sender learns that it may have. Everything not
    /// cumulatively acknowledged is then sent again from the retransmission cursor (the peer
    /// drops what it already holds as duplicates).
    fn forget_sacks(&mut self) {
        self.sacked.clear();
    }

    fn is_sacked(&self, psn: Psn) -> bool {
        self.sacked
            .iter()
            .any(|&(s, e)| !psn.before(s) && psn.before(e))
    }

    /// The PSN to transmit next, if the window, the RNR pause and the retransmission cursor
    /// allow one.
    #[cfg(test)]
    pub fn next_to_send(&mut self, now: Time, timers: &mut TimerTable) -> Option<Psn> {
        self.next_to_send_judging(now, timers, |_| true)
    }

    /// [`Self::next_to_send`], where a selective retransmission (see
    /// [`Self::resend_presumed_lost`]) skips the packets for which `presumed_lost` is false.
    pub fn next_to_send_judging(
        &mut self,
        now: Time,
        timers: &mut TimerTable,
        presumed_lost: impl Fn(Psn) -> bool,
    ) -> Option<Psn> {
        if let Some(until) = timers.get(Timer::RnrResume) {
            cold_path();
            if now < until {
                return None;
            }
            self.resume(timers);
        }
        if let Some(frto) = &self.frto {
            // (After a retransmission timeout only.)
            cold_path();
            match frto {
                // (Before it went, the oldest is where the timeout put the cursor.)
                Frto::Resent { sent: false, .. } => {}
                Frto::Resent { sent: true, .. } | Frto::NewSent { budget: 0, .. } => {
                    return None;
                }
                // Only new packets: the next acknowledgement tells whether the rest of the
                // flight arrived.
                Frto::NewSent { .. } => return self.next_new(),
            }
        }
        if let Some(mut cursor) = self.rtx {
            cold_path();
            if cursor.before(self.snd_una) {
                cursor = self.snd_una;
            }
            while cursor.before(self.next_send)
                && (self.is_sacked(cursor) || (self.rtx_selective && !presumed_lost(cursor)))
            {
                cursor = cursor.plus(1);
            }
            if cursor.before(self.next_send) {
                self.rtx = Some(cursor);
                return Some(cursor);
            }
            self.stop_resending();
        }
        self.next_new()
    }

    /// Whether [`Self::next_to_send`] (and [`Self::wants_credit_report`]) would certainly find
    /// nothing: no receiver-not-ready pause to end, no F-RTO or retransmission under way, every
    /// packet of the stream sent once.
    pub fn nothing_to_send(&self, timers: &TimerTable) -> bool {
        !self.next_send.before(self.next_psn)
            && self.rtx.is_none()
            && self.frto.is_none()
            && !timers.is_set(Timer::RnrResume)
    }

    /// The next packet never sent, if the window and the receive credit let it go.
    fn next_new(&self) -> Option<Psn> {
        let in_flight = self.next_send.distance_from(self.snd_una);
        if !self.next_send.before(self.next_psn) || in_flight >= self.peer_window {
            return None;
        }
        (!self.waits_for_credit(self.next_send)).then_some(self.next_send)
    }

    /// Whether the packet at `psn`, never sent, must wait for receive credit: only the first
    /// packet of a receive-consuming message needs it.
    fn waits_for_credit(&self, psn: Psn) -> bool {
        let index = self.message_index(psn);
        self.messages
            .get(index)
            .filter(|m| m.first_psn == psn)
            .and_then(|m| m.receive_ordinal)
            .is_some_and(|n| !self.credit.may_start(n))
    }

    /// The peer reported its receive limit (in an ACK).
    pub fn on_receive_limit(&mut self, limit: u32) {
        self.credit.on_report(limit);
    }

    /// Whether the next new packet waits for receive credit and the peer should be asked for a
    /// fresh report (once per limit heard; see `credit.rs`).
    pub fn wants_credit_report(&mut self) -> bool {
        self.next_send.before(self.next_psn)
            && self.waits_for_credit(self.next_send)
            && self.credit.ask()
    }

    /// The receiver-not-ready pause is over ([`Timer::RnrResume`] fired, or a transmit pass
    /// found it past): the NAKed message may go again.
    fn resume(&mut self, timers: &mut TimerTable) {
        timers.stop(Timer::RnrResume);
    }

    /// Records that `psn` went out; returns whether it was a retransmission.
    pub fn on_sent(&mut self, psn: Psn, now: Time, timers: &mut TimerTable) -> bool {
        match &mut self.frto {
            Some(Frto::Resent { sent, .. }) => *sent = true,
            Some(Frto::NewSent { budget, .. }) => *budget = budget.saturating_sub(1),
            None => {}
        }
        let retransmit = psn.before(self.next_send);
        if retransmit {
            self.rtx = Some(psn.plus(1));
            // Karn: an acknowledgement could now answer either copy; stop timing.
            if self.rtt_probe.is_some_and(|(p, _)| !p.before(psn)) {
                self.rtt_probe = None;
            }
        } else {
            self.next_send = psn.plus(1);
            if self.rtt_probe.is_none() {
                self.rtt_probe = Some((psn, now));
            }
        }
        if !timers.is_set(Timer::Retransmit) {
            timers.set(Timer::Retransmit, now.after_nanos(self.rto));
        }
        if !retransmit {
            // The probe timeout counts from the last packet sent, as RACK-TLP's does.
            self.arm_tail_probe(now, timers);
        }
        retransmit
    }

    /// The tail loss probe's timeout: twice the smoothed round trip plus the peer's longest
    /// acknowledgement hold, at least the floor; none before the first round-trip sample
    /// (without one, a probe could come before an answer that is merely on its way, and the
    /// probe's copy would then spoil the very sample it lacks: Karn).
    fn tail_probe_timeout(&self) -> Option<u64> {
        self.srtt.map(|srtt| {
            srtt.saturating_mul(2)
                .saturating_add(self.ack_allowance)
                .max(self.tail_probe_floor)
        })
    }

    /// Arms [`Timer::TailProbe`] for this flight, unless it was probed already, nothing is
    /// unacknowledged, or the retransmission timeout comes first anyway.
    fn arm_tail_probe(&self, now: Time, timers: &mut TimerTable) {
        let at = self
            .tail_probe_timeout()
            .map(|timeout| now.after_nanos(timeout))
            .filter(|&at| {
                !self.tail_probed
                    && self.has_unacked()
                    && timers.get(Timer::Retransmit).is_some_and(|rto| at < rto)
            });
        timers.set_or_stop(Timer::TailProbe, at);
    }

    /// The peer answered this flight with a NAK: it is alive and recovery is under way, so
    /// the flight needs no probe.
    fn flight_answered(&mut self, timers: &mut TimerTable) {
        self.tail_probed = true;
        timers.stop(Timer::TailProbe);
    }

    /// Handles [`Timer::TailProbe`]: points the retransmission cursor at the last packet sent
    /// that the peer has not acknowledged selectively, and returns whether a probe goes out.
    /// The peer's answer does the rest: the probe fills a lost tail (the acknowledgement then
    /// covers everything), or it shows the peer a gap in front of it (a sequence NAK resends
    /// from there), or it is a duplicate (acknowledged at once, which also repairs a lost ACK).
    /// The timeout does not back off: nothing is known to be lost yet.
    pub fn on_tail_probe(&mut self, now: Time, timers: &mut TimerTable) -> bool {
        if !timers.is_expired(Timer::TailProbe, now) {
            return false;
        }
        timers.stop(Timer::TailProbe);
        let pausing = timers
            .get(Timer::RnrResume)
            .is_some_and(|until| now < until);
        if self.tail_probed || !self.has_unacked() || self.rtx.is_some() || pausing {
            return false;
        }
        let mut last = self.next_send.minus(1);
        while self.snd_una.before(last) && self.is_sacked(last) {
            last = last.minus(1);
        }
        if last.before(self.snd_una) || !last.before(self.next_send) {
            return false;
        }
        self.tail_probed = true;
        self.go_back_to(last);
        // A probe during F-RTO (an acknowledgement moved on, and nothing since) is a
        // retransmission decision of its own: the flight's end may be what was lost.
        self.frto = None;
        true
    }

    /// Builds the datagram for `psn` into `buf`; `header` has everything but opcode, PSN and
    /// per-packet flags filled in. A payload of at least `gather_from` bytes (and at least 1)
    /// is left in memory: only the header is written, sealed with the CRC of header and
    /// payload, and the payload is returned for the caller to send as the datagram's second
    /// part. Returns the bytes written into `buf` and that payload, if any.
    pub fn build<M: Memory + ?Sized>(
        &self,
        psn: Psn,
        mut header: Header,
        max_payload: u32,
        buf: &mut [u8],
        mem: &M,
        gather_from: usize,
    ) -> (usize, Option<PayloadRef>) {
        let index = self.message_index(psn);
        let message = &self.messages[index];
        let packet_index = psn.distance_from(message.first_psn);
        let is_last = packet_index + 1 == message.npackets;
        header.psn = psn;
        if is_last {
            header.flags |= wire::FLAG_ACK_REQUEST;
        }
        let mut source = None;
        let mut payload_len = 0usize;
        let mut segment = |len: u64, imm_or_req: u32| {
            let offset = u64::from(packet_index) * u64::from(max_payload);
            payload_len = (len - offset).min(u64::from(max_payload)) as usize;
            Segment {
                msg_first_psn: message.first_psn,
                imm_or_req,
                offset,
                msg_len: len,
            }
        };
        let ext = match message.kind {
            OutKind::Send {
                source: s,
                len,
                imm,
            } => {
                if imm.is_some() {
                    header.flags |= wire::FLAG_HAS_IMM;
                }
                source = s;
                Ext::Send(segment(len, imm.unwrap_or(0)))
            }
            OutKind::Write {
                source: s,
                len,
                remote,
                imm: None,
            } => {
                source = s;
                Ext::Write(segment(len, 0), remote)
            }
            OutKind::Write {
                source: s,
                len,
                remote,
                imm: Some(imm),
            } => {
                source = s;
                Ext::WriteWithImm(segment(len, imm), remote)
            }
            OutKind::ReadResponse {
                source: Some(s),
                req_psn,
                ..
            } if !mem.has_bytes(s.region) => {
                // The application let the region go while its bytes were on their way (a
                // resend after a loss): refuse the READ rather than send whatever the buffer
                // holds. The requester fails the request with a remote access error.
                Ext::FatalNak {
                    req_psn,
                    code: ErrorCode::RemoteAccess,
                }
            }
            OutKind::ReadResponse {
                source: s,
                len,
                req_psn,
            } => {
                source = s;
                Ext::ReadResponse(segment(len, req_psn.0))
            }
            OutKind::ReadRequest { remote, len } => Ext::ReadRequest { remote, len },
            OutKind::FetchAdd { remote, add } => Ext::FetchAdd { remote, add },
            OutKind::CmpSwap {
                remote,
                compare,
                swap,
            } => Ext::CmpSwap {
                remote,
                compare,
                swap,
            },
            OutKind::AtomicResponse { req_psn, original } => {
                Ext::AtomicResponse { req_psn, original }
            }
            OutKind::FatalNak { req_psn, code } => Ext::FatalNak { req_psn, code },
        };
        header.opcode = ext.opcode();
        let header_len = wire::write_header(buf, &header, &ext, payload_len);
        let end = header_len + payload_len;
        if let (Some(source), Some(seg)) = (source, ext.segment()) {
            let payload = PayloadRef {
                region: source.region,
                offset: source.offset + seg.offset,
                len: payload_len,
                starts_request: seg.offset == 0 && !matches!(ext, Ext::ReadResponse(_)),
            };
            if payload_len > 0 && payload_len >= gather_from {
                wire::seal_parts(&mut buf[..header_len], |feed| {
                    mem.with_bytes(payload.region, payload.offset, payload.len, feed)
                });
                return (header_len, Some(payload));
            }
            let payload_bytes = &mut buf[header_len..end];
            if !mem.has_bytes(payload.region) {
                // A request's bytes stay until it completes (the engine keeps a region a
                // request names), so this does not happen; should it, the datagram carries
                // zeros, never an earlier datagram's bytes.
                payload_bytes.fill(0);
            }
            mem.read(payload.region, payload.offset, payload_bytes);
        }
        wire::seal(&mut buf[..end]);
        (end, None)
    }

    /// F-RTO: what an acknowledgement that moved `snd_una` on to `ack` says about the last
    /// retransmission timeout. One that moves nothing says nothing here (unlike in RFC 5682,
    /// where it ends F-RTO): tbrdma acknowledges duplicates, receive credit and every 16th
    /// packet, so a stale acknowledgement often lands just after a timeout (in the simulator,
    /// the answer to the previous flight's resent packet, every time). A flight that was
    /// really lost is resent on the peer's NAK, or on the next timeout.
    fn frto_answer(&mut self, ack: Psn, now: Time) {
        match self.frto {
            Some(Frto::Resent { sent, until, timed }) => {
                let timed = timed.on_ack(ack, now);
                if !sent || !ack.before(until) {
                    // Everything outstanding at the timeout arrived, or the originals did
                    // before the resend even went: the timeout was spurious.
                    self.spurious_timeout(timed);
                } else {
                    // Up to two new packets go, if there are any (RFC 5682 resends the flight
                    // when there are none; here the next acknowledgement decides anyway, and a
                    // loss at the end of a transfer is found by the tail probe this progress
                    // re-arms, or by the next timeout).
                    self.frto = Some(Frto::NewSent { budget: 2, timed });
                    self.stop_resending();
                }
            }
            Some(Frto::NewSent { timed, .. }) => {
                // Two acknowledgements in a row moved on past the one packet resent: the
                // originals are arriving, and the timeout was spurious.
                self.spurious_timeout(timed.on_ack(ack, now));
            }
            None => {}
        }
    }

    /// F-RTO found the last timeout spurious: the flight goes on as if it had not fired, and
    /// the packet timed when it fired gives its round trip (see [`Timed`]).
    fn spurious_timeout(&mut self, timed: Timed) {
        self.frto = None;
        self.stop_resending();
        if let Timed::Answered(rtt) = timed {
            self.sample_rtt(rtt);
        }
    }

    /// Processes a cumulative acknowledgement. Returns whether it acknowledged anything new and
    /// whether a FATAL_NAK of ours was among it.
    pub fn on_cumulative_ack(
        &mut self,
        ack: Psn,
        now: Time,
        timers: &mut TimerTable,
    ) -> (bool, bool) {
        if self.next_send.before(ack) {
            return (false, false);
        }
        if !self.snd_una.before(ack) {
            return (false, false);
        }
        self.snd_una = ack;
        let mut fatal_acked = false;
        while let Some(front) = self.messages.front() {
            if !front.last_psn().before(ack) {
                break;
            }
            fatal_acked |= matches!(front.kind, OutKind::FatalNak { .. });
            if let Some(n) = front.receive_ordinal {
                self.credit.acked(n);
            }
            self.messages.pop_front();
        }
        if self.frto.is_some() {
            cold_path();
            self.frto_answer(ack, now);
        }
        if !self.sacked.is_empty() {
            // (Only after a loss.)
            cold_path();
            self.sacked.retain_mut(|(start, end)| {
                if start.before(ack) {
                    *start = ack;
                }
                start.before(*end)
            });
        }
        if let Some((probe, sent)) = self.rtt_probe {
            if probe.before(ack) {
                self.sample_rtt(now.as_nanos().saturating_sub(sent.as_nanos()));
                self.rtt_probe = None;
            }
        }
        self.retries = 0;
        self.rnr_retries = 0;
        self.rto = self.base_rto();
        timers.set_or_stop(
            Timer::Retransmit,
            self.has_unacked().then(|| now.after_nanos(self.rto)),
        );
        // Progress starts a new flight, which may be probed again.
        self.tail_probed = false;
        self.arm_tail_probe(now, timers);
        (true, fatal_acked)
    }

    /// RFC 6298's estimator, on a round trip of `sample` nanoseconds.
    fn sample_rtt(&mut self, sample: u64) {
        match self.srtt {
            None => {
                self.srtt = Some(sample);
                self.rttvar = sample / 2;
            }
            Some(srtt) => {
                let deviation = srtt.abs_diff(sample);
                self.rttvar = self.rttvar.saturating_mul(3).saturating_add(deviation) / 4;
                self.srtt = Some(srtt.saturating_mul(7).saturating_add(sample) / 8);
            }
        }
    }

    /// The timeout before backoff: RFC 6298's `SRTT + max(G, 4·RTTVAR)`, between the floor and
    /// the ceiling, with the floor (`initial_rto`, 1 ms by default) as the granularity `G`: what
    /// a busy host may take to schedule the peer. Without it a bulk transfer, whose round trip
    /// is the queue in front of the receiver (about 0.9 ms for a window of 64 KiB datagrams on
    /// veth) and varies little, got a timeout barely above that round trip, and a receiver late
    /// by a few hundred microseconds made the sender resend the whole window (measured: 1-5
    /// spurious timeouts per 2-second `linkbench` bandwidth round).
    fn base_rto(&self) -> u64 {
        match self.srtt {
            None => self.initial_rto,
            Some(srtt) => srtt
                .saturating_add(self.rttvar.saturating_mul(4).max(self.initial_rto))
                .clamp(self.initial_rto, self.rto_ceiling),
        }
    }

    /// Records selective acknowledgements.
    pub fn on_sack(&mut self, blocks: &[wire::SackBlock]) {
        for block in blocks {
            let start = if block.start.before(self.snd_una) {
                self.snd_una
            } else {
                block.start
            };
            let end = if self.next_send.before(block.end) {
                self.next_send
            } else {
                block.end
            };
            if !start.before(end) {
                continue;
            }
            self.sacked.push((start, end));
        }
        self.sacked.sort_by_key(|a| a.0);
        let mut merged: Vec<(Psn, Psn)> = Vec::with_capacity(self.sacked.len());
        for &(s, e) in &self.sacked {
            match merged.last_mut() {
                Some(last) if !last.1.before(s) => {
                    if last.1.before(e) {
                        last.1 = e;
                    }
                }
                _ => merged.push((s, e)),
            }
        }
        self.sacked = merged;
    }

    /// The peer saw a gap at `psn`: resend from there.
    pub fn on_sequence_nak(&mut self, psn: Psn, timers: &mut TimerTable) {
        if psn.before(self.snd_una) || !psn.before(self.next_send) {
            return;
        }
        self.forget_sacks();
        self.flight_answered(timers);
        // The peer is there and says what it misses: NAK recovery, not the timeout's.
        self.frto = None;
        // (From the gap, or from where a resend under way has got to if that is earlier.)
        let from = self.rtx.filter(|&c| !psn.before(c)).unwrap_or(psn);
        self.go_back_to(from);
    }

    /// Over several paths: resends, from `psn` on, the packets the caller's judge (passed to
    /// [`Self::next_to_send_judging`]) presumes lost, and none of the others, which may still
    /// be on their way over a slower path. Unlike a NAK's go-back, what the peer acknowledged
    /// selectively is kept: a receiver that throws stashed packets away again is caught by the
    /// retransmission timeout, which forgets it and resends everything.
    pub fn resend_presumed_lost(&mut self, psn: Psn, timers: &mut TimerTable) {
        if psn.before(self.snd_una) || !psn.before(self.next_send) || self.is_sacked(psn) {
            return;
        }
        self.flight_answered(timers);
        self.frto = None;
        match self.rtx {
            // A go-back under way resends this too.
            Some(_) if !self.rtx_selective => {}
            Some(c) if !psn.before(c) => {}
            _ => {
                self.rtx = Some(psn);
                self.rtx_selective = true;
            }
        }
    }

    /// Whether a retransmission is under way.
    pub fn resending(&self) -> bool {
        self.rtx.is_some()
    }

    /// Points the retransmission cursor at `psn`, to resend every packet from there that the
    /// peer has not acknowledged selectively.
    fn go_back_to(&mut self, psn: Psn) {
        self.rtx = Some(psn);
        self.rtx_selective = false;
    }

    /// Ends any retransmission (and with it a selective one's mode).
    fn stop_resending(&mut self) {
        self.rtx = None;
        self.rtx_selective = false;
    }

    /// The peer had no receive for the message at `psn`: pause, then resend it. Returns false
    /// when the receiver-not-ready budget is spent.
    pub fn on_rnr_nak(
        &mut self,
        psn: Psn,
        delay: Duration,
        now: Time,
        timers: &mut TimerTable,
    ) -> bool {
        if psn.before(self.snd_una) || !psn.before(self.next_send) {
            return true;
        }
        self.rnr_retries += 1;
        if self.rnr_retries > self.max_rnr_retries {
            return false;
        }
        self.forget_sacks();
        self.flight_answered(timers);
        self.frto = None;
        self.go_back_to(psn);
        let resume = now + delay;
        timers.set(Timer::RnrResume, resume);
        timers.set(Timer::Retransmit, resume.after_nanos(self.rto));
        true
    }

    /// Keeps the retransmission timer armed while the connection waits for the peer (unacked
    /// packets, or READ and atomic responses), and disarmed otherwise.
    /// `awaiting_response` is asked only when nothing is unacknowledged (it scans the send
    /// queue).
    pub fn arm(
        &mut self,
        now: Time,
        timers: &mut TimerTable,
        awaiting_response: impl FnOnce() -> bool,
    ) {
        if !self.has_unacked() && !awaiting_response() {
            timers.stop(Timer::Retransmit);
        } else if !timers.is_set(Timer::Retransmit) {
            timers.set(Timer::Retransmit, now.after_nanos(self.rto));
        }
    }

    /// A response arrived while nothing of ours was unacknowledged: the peer is alive and
    /// working, so the retry count starts over.
    pub fn on_response_progress(&mut self, now: Time, timers: &mut TimerTable) {
        if !self.has_unacked() {
            self.retries = 0;
            self.rto = self.base_rto();
            timers.set(Timer::Retransmit, now.after_nanos(self.rto));
        }
    }

    /// Handles the retransmission deadline ([`Timer::Retransmit`]): backs off and re-arms it,
    /// or asks for the connection to fail when the retry budget is spent.
    pub fn on_timeout(&mut self, now: Time, timers: &mut TimerTable) -> TimeoutAction {
        if !timers.is_expired(Timer::Retransmit, now)
            || timers.get(Timer::RnrResume).is_some_and(|h| now < h)
        {
            return TimeoutAction::Nothing;
        }
        self.retries += 1;
        if self.retries > self.max_retries {
            return TimeoutAction::GiveUp;
        }
        self.rto = self.rto.saturating_mul(2).min(self.max_rto);
        let timed = match self.rtt_probe.take() {
            Some((psn, sent)) => Timed::Waiting(psn, sent),
            None => Timed::Nothing,
        };
        // Until progress, the retransmission timeout alone recovers this flight.
        self.tail_probed = true;
        timers.stop(Timer::TailProbe);
        self.forget_sacks();
        timers.set(Timer::Retransmit, now.after_nanos(self.rto));
        if self.has_unacked() {
            self.go_back_to(self.snd_una);
            // A second timeout before the answer: the flight is lost, resend all of it.
            self.frto = match self.frto {
                None if self.snd_una.before(self.next_send) => Some(Frto::Resent {
                    sent: false,
                    until: self.next_send,
                    timed,
                }),
                _ => None,
            };
            TimeoutAction::Retransmit
        } else {
            TimeoutAction::Probe
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeout_keeps_a_granularity_above_a_steady_round_trip() {
        let config = Config::default();
        let floor = config.initial_rto;
        // A bulk transfer: the round trip is the receiver's queue, about 0.9 ms, steady.
        let mut tx = TxStream::new(Psn(0), &config);
        for i in 0..50u64 {
            tx.sample_rtt(nanos(Duration::from_micros(900 + i % 3)));
        }
        assert!(
            tx.base_rto() >= nanos(Duration::from_micros(900) + floor),
            "{:?}",
            tx.base_rto()
        );
        // A ping-pong: a 20 µs round trip keeps the floor plus that round trip.
        let mut tx = TxStream::new(Psn(0), &config);
        for _ in 0..50 {
            tx.sample_rtt(nanos(Duration::from_micros(20)));
        }
        assert!(
            tx.base_rto() >= nanos(floor)
                && tx.base_rto() <= nanos(floor + Duration::from_micros(40))
        );
        // A wildly varying round trip is still capped by the ceiling.
        let mut tx = TxStream::new(Psn(0), &config);
        for i in 0..50u64 {
            tx.sample_rtt(nanos(Duration::from_millis(if i % 2 == 0 {
                1
            } else {
                40
            })));
        }
        assert_eq!(tx.base_rto(), nanos(config.rto_ceiling));
    }

    /// Sends a four-packet message, has packets 2 and 3 SACKed, then `renege` (a timeout, a
    /// sequence NAK or an RNR NAK); returns the PSNs resent afterwards.
    fn resent_after(renege: impl FnOnce(&mut TxStream, &mut TimerTable, Time)) -> Vec<u32> {
        let config = Config::default();
        let mp = config.max_payload();
        let mut tx = TxStream::new(Psn(0), &config);
        let mut timers = TimerTable::default();
        tx.set_peer_window(128);
        tx.push_response(
            OutKind::Write {
                source: None,
                len: 4 * u64::from(mp),
                remote: Remote { rkey: 1, addr: 0 },
                imm: None,
            },
            mp,
        );
        let now = Time(1_000);
        while let Some(psn) = tx.next_to_send(now, &mut timers) {
            tx.on_sent(psn, now, &mut timers);
        }
        tx.on_sack(&[wire::SackBlock {
            start: Psn(2),
            end: Psn(4),
        }]);
        let later = Time(now.0 + 10_000_000_000);
        renege(&mut tx, &mut timers, later);
        let mut resent = Vec::new();
        while let Some(psn) = tx.next_to_send(later, &mut timers) {
            tx.on_sent(psn, later, &mut timers);
            resent.push(psn.0);
        }
        resent
    }

    #[test]
    fn selective_acknowledgements_are_forgotten_on_a_timeout_or_a_nak() {
        // A timeout resends the oldest alone (F-RTO); a second one, with no answer moving on
        // between them, says the flight was lost, and everything unacknowledged goes again.
        let timeout = resent_after(|tx, timers, now| {
            assert_eq!(tx.on_timeout(now, timers), TimeoutAction::Retransmit);
            assert_eq!(tx.next_to_send(now, timers), Some(Psn(0)));
            tx.on_sent(Psn(0), now, timers);
            assert_eq!(
                tx.next_to_send(now, timers),
                None,
                "one packet until an answer"
            );
            tx.on_cumulative_ack(Psn(0), now, timers);
            assert_eq!(
                tx.next_to_send(now, timers),
                None,
                "a duplicate says nothing"
            );
            let later = Time(now.0 + 10_000_000_000);
            assert_eq!(tx.on_timeout(later, timers), TimeoutAction::Retransmit);
        });
        assert_eq!(
            timeout,
            [0, 1, 2, 3],
            "after a second timeout, everything unacknowledged"
        );
        let nak = resent_after(|tx, timers, _| tx.on_sequence_nak(Psn(0), timers));
        assert_eq!(nak, [0, 1, 2, 3], "after a sequence NAK");
        let rnr = resent_after(|tx, timers, now| {
            assert!(tx.on_rnr_nak(Psn(0), Duration::ZERO, now, timers));
        });
        assert_eq!(rnr, [0, 1, 2, 3], "after an RNR NAK");
    }

    /// A message of `packets` packets, the first `sent` of them sent (the window), then a
    /// retransmission timeout and the resend of the oldest.
    fn timed_out_flight(packets: u32, sent: u32, timers: &mut TimerTable) -> (TxStream, Time) {
        let config = Config::default();
        let mp = config.max_payload();
        let mut tx = TxStream::new(Psn(0), &config);
        tx.set_peer_window(sent);
        tx.push_response(
            OutKind::Write {
                source: None,
                len: u64::from(packets) * u64::from(mp),
                remote: Remote { rkey: 1, addr: 0 },
                imm: None,
            },
            mp,
        );
        let now = Time(1_000);
        while let Some(psn) = tx.next_to_send(now, timers) {
            tx.on_sent(psn, now, timers);
        }
        let later = Time(now.0 + 10_000_000_000);
        assert_eq!(tx.on_timeout(later, timers), TimeoutAction::Retransmit);
        assert_eq!(tx.next_to_send(later, timers), Some(Psn(0)));
        tx.on_sent(Psn(0), later, timers);
        (tx, later)
    }

    /// Everything sent, then acknowledged late: the timeout was spurious and nothing but the
    /// one packet went again.
    #[test]
    fn an_acknowledgement_of_the_whole_flight_ends_a_spurious_timeout() {
        let mut timers = TimerTable::default();
        let (mut tx, now) = timed_out_flight(8, 8, &mut timers);
        tx.on_cumulative_ack(Psn(8), now, &mut timers);
        assert_eq!(tx.next_to_send(now, &mut timers), None);
    }

    /// Acknowledgements arriving in pieces: the first moves on, so two new packets go (not the
    /// flight); the second moves on too, so the timeout was spurious and sending goes on as
    /// before it. Had nothing moved on before the next timeout, the flight would have gone
    /// again.
    #[test]
    fn two_acknowledgements_that_move_on_show_a_timeout_was_spurious() {
        for second_moves_on in [true, false] {
            let mut timers = TimerTable::default();
            let (mut tx, now) = timed_out_flight(32, 8, &mut timers);
            let drain = |tx: &mut TxStream, timers: &mut TimerTable, now| {
                let mut sent = Vec::new();
                while let Some(psn) = tx.next_to_send(now, timers) {
                    tx.on_sent(psn, now, timers);
                    sent.push(psn.0);
                }
                sent
            };
            tx.on_cumulative_ack(Psn(4), now, &mut timers);
            assert_eq!(
                drain(&mut tx, &mut timers, now),
                [8, 9],
                "two new, no resend"
            );
            if second_moves_on {
                tx.on_cumulative_ack(Psn(6), now, &mut timers);
                assert_eq!(
                    drain(&mut tx, &mut timers, now),
                    [10, 11, 12, 13],
                    "new packets, as the window allows"
                );
            } else {
                tx.on_cumulative_ack(Psn(4), now, &mut timers);
                assert_eq!(
                    drain(&mut tx, &mut timers, now),
                    [],
                    "a duplicate says nothing"
                );
                let later = Time(now.0 + 10_000_000_000);
                assert_eq!(tx.on_timeout(later, &mut timers), TimeoutAction::Retransmit);
                assert_eq!(
                    drain(&mut tx, &mut timers, later),
                    [4, 5, 6, 7, 8, 9, 10, 11],
                    "the unacknowledged flight again, then new packets as the window allows"
                );
            }
        }
    }

    /// During F-RTO with nothing new to send, an acknowledgement that moved on and then
    /// silence: the tail probe still goes (the flight's end may be what was lost).
    #[test]
    fn a_tail_probe_still_goes_during_f_rto() {
        let mut timers = TimerTable::default();
        let (mut tx, now) = timed_out_flight(8, 8, &mut timers);
        tx.sample_rtt(nanos(Duration::from_micros(50)));
        tx.on_cumulative_ack(Psn(2), now, &mut timers);
        assert_eq!(
            tx.next_to_send(now, &mut timers),
            None,
            "nothing new to send"
        );
        let probe_at = timers
            .get(Timer::TailProbe)
            .expect("progress arms the probe");
        assert!(tx.on_tail_probe(probe_at, &mut timers));
        assert_eq!(tx.next_to_send(probe_at, &mut timers), Some(Psn(7)));
    }
}
