//! The receive stream: what arrives from the peer once established, and in which order it is
//! taken. It dispatches control packets (ACK, NAK, keep-alive) to the outgoing stream and the
//! acknowledgement policy, and accepts sequenced packets in order: duplicates are dropped,
//! packets of the message that holds the next expected PSN are taken in any order (tracked
//! per packet) except its last, which waits for the others; packets of later messages are
//! stashed until their turn (or dropped and NAKed when the stash is full). It owns the next
//! expected PSN, the message in progress, the stash, what an ACK reports (selective blocks) and
//! sequence-error NAKs.
//!
//! What an accepted packet *does* (placement, execution, completions, refusals) is the
//! responder's (`responder.rs`); when to acknowledge is the acknowledgement policy's (`ack.rs`).

use std::collections::VecDeque;
use std::time::Duration;

use super::responder::InTarget;
use super::tx::packets_for;
use super::{Connection, ConnectionError, ConnectionState};
use crate::hint::cold_path;
use crate::memory::{Memory, RegionId};
use crate::seq::Psn;
use crate::time::Time;
use crate::wire::{self, ErrorCode, Ext, NakCode, Packet, SackBlock, SackList, Segment};
use crate::work::WcStatus;

/// A datagram from the peer that passed decoding and addressing, as the receive path hands it
/// on: the decoded packet, the bytes it was decoded from (an early packet is stashed as such:
/// `datagram` then `tail`, the payload when the datagram came in two pieces) and the path it
/// came in on.
pub(super) struct Arrival<'a> {
    pub packet: &'a Packet<'a>,
    pub datagram: &'a [u8],
    pub tail: &'a [u8],
    pub path: usize,
}

/// The multi-packet message that holds the next expected PSN.
#[derive(Debug)]
struct InMessage {
    first_psn: Psn,
    npackets: u32,
    msg_len: u64,
    target: InTarget,
    /// What the packet that started it said of the whole message: every later packet must
    /// say the same, or it is dropped as malformed (a peer could otherwise stretch a message
    /// past the receive or the range its first packet was checked against).
    says: MessageClaims,
    /// With `Config::message_crc`: the CRC-32C of the packets before `expected`, folded in
    /// order (packets placed ahead of a gap wait in `RxStream::crcs`).
    crc: Option<u32>,
}

/// What every packet of one message repeats about the whole message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MessageClaims {
    /// The opcode's class: SEND, WRITE, WRITE_WITH_IMM or READ_RESPONSE.
    class: u8,
    /// The target a WRITE names (its first byte).
    remote: Option<wire::Remote>,
    msg_len: u64,
    /// Immediate data, or the READ_REQUEST answered.
    imm_or_req: u32,
    has_imm: bool,
}

impl MessageClaims {
    fn of(packet: &Packet<'_>, seg: &Segment) -> MessageClaims {
        let (class, remote) = match packet.ext {
            Ext::Send(_) => (0, None),
            Ext::Write(_, remote) => (1, Some(remote)),
            Ext::WriteWithImm(_, remote) => (2, Some(remote)),
            _ => (3, None),
        };
        MessageClaims {
            class,
            remote,
            msg_len: seg.msg_len,
            imm_or_req: seg.imm_or_req,
            has_imm: packet.header.flags & wire::FLAG_HAS_IMM != 0,
        }
    }
}

#[derive(Debug)]
pub(super) struct RxStream {
    started: bool,
    expected: Psn,
    current: Option<InMessage>,
    /// Which packets of `current` at or after `expected` arrived: index 0 is `expected`. Never
    /// longer than the window (packets beyond it are dropped before they get here), so what a
    /// message keeps is bounded by the window whatever length its first packet claims.
    received: VecDeque<bool>,
    /// With `Config::message_crc`: the payload CRC of each packet in `received` (0 where none
    /// arrived yet), in step with it. Empty otherwise.
    crcs: VecDeque<u32>,
    /// Shifts by the agreed payload length cheaply (made at the first message CRC).
    shifter: Option<wire::crc_algebra::Shifter>,
    pending_nak: Option<Ext>,
    nak_sent_for: Option<Psn>,
    /// Packets of later messages that arrived early (another rail, jitter), kept until the
    /// messages before them are complete, sorted by PSN. Copies are made only then.
    stash: Vec<(Psn, Option<Segment>, Vec<u8>)>,
    /// Buffers for the stash, reused.
    spare: Vec<Vec<u8>>,
    /// Whether the last data-bearing message to start was a SEND: the guess that the next one
    /// is one too (`Connection::next_receive_buffer`).
    pub last_started_send: bool,
}

/// Early packets kept per connection and path before further ones are dropped. A receive
/// pass reads up to a batch from each rail (32 datagrams in both engines), and over two
/// rails one rail's batch can be early nearly whole while the gap waits in the other's: with
/// 32 in all, two cables of 64 KiB WRITEs dropped hundreds of packets a second and took 7-43
/// retransmission timeouts in 2 s; with 32 per path, none to 3 (docs/performance.md, "A
/// stash per rail"). Bounded by the window all the same.
const STASH_PER_PATH: usize = 32;
/// Early packets held before the gap is reported with a NAK (below it, reordering by a rail or
/// jitter usually fills the gap by itself).
const REORDER_THRESHOLD: usize = 3;

impl RxStream {
    pub fn new() -> RxStream {
        RxStream {
            started: false,
            expected: Psn(0),
            current: None,
            received: VecDeque::new(),
            crcs: VecDeque::new(),
            shifter: None,
            pending_nak: None,
            nak_sent_for: None,
            stash: Vec::new(),
            spare: Vec::new(),
            last_started_send: true,
        }
    }

    /// Keeps an early packet (the datagram `datagram` followed by `tail`, in one piece); false
    /// when the stash already holds `limit` packets. A packet it holds already is not kept
    /// twice (true).
    fn stash(
        &mut self,
        limit: usize,
        psn: Psn,
        segment: Option<Segment>,
        datagram: &[u8],
        tail: &[u8],
    ) -> bool {
        if self.stash.len() >= limit {
            return false;
        }
        let at = self.stash.partition_point(|(p, _, _)| p.before(psn));
        if self.stash.get(at).is_some_and(|(p, _, _)| *p == psn) {
            return true;
        }
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(datagram);
        buf.extend_from_slice(tail);
        self.stash.insert(at, (psn, segment, buf));
        true
    }

    /// Room kept for the message in progress, in packets (for tests of its bound).
    #[cfg(test)]
    pub fn tracked_packets(&self) -> usize {
        self.received.capacity()
    }

    pub fn start(&mut self, initial_psn: Psn) {
        self.started = true;
        self.expected = initial_psn;
    }

    pub fn started(&self) -> bool {
        self.started
    }

    pub fn expected(&self) -> Psn {
        self.expected
    }

    /// Where the message partly received goes (its region and byte range), while some of its
    /// packets have arrived (and may have been placed) and others have not.
    pub fn message_in_progress(&self) -> Option<(RegionId, std::ops::Range<u64>)> {
        let message = self.current.as_ref()?;
        let at = message.target.placement()?;
        Some((
            at.region,
            at.offset..at.offset.saturating_add(message.msg_len),
        ))
    }

    /// Whether no message is partly received and no early packet is held: the next message
    /// to arrive starts fresh, in order.
    pub fn between_messages(&self) -> bool {
        self.current.is_none() && self.stash.is_empty()
    }

    /// The receive the message in progress consumed (a SEND's, or a WRITE_WITH_IMM's), if
    /// any: it left the receive queue with the message's first packet, so whoever drops the
    /// message must complete it (see `Connection::flush_all`).
    pub fn consumed_receive(&self) -> Option<u64> {
        match self.current.as_ref()?.target {
            InTarget::Recv { wr_id, .. } => Some(wr_id),
            InTarget::Write {
                recv: Some((wr_id, _)),
                ..
            } => Some(wr_id),
            InTarget::Write { recv: None, .. } | InTarget::ReadResponse { .. } => None,
        }
    }

    pub fn clear(&mut self) {
        self.current = None;
        self.received.clear();
        self.crcs.clear();
        self.pending_nak = None;
        self.stash.clear();
    }

    /// Selective blocks: runs of packets of the current message received beyond the gap.
    fn sacks(&self) -> SackList {
        let mut list = SackList::default();
        if self.current.is_some() {
            self.current_sacks(&mut list);
        }
        self.stash_sacks(list)
    }

    fn current_sacks(&self, list: &mut SackList) {
        let mut run: Option<usize> = None;
        for i in 0..=self.received.len() {
            let got = self.received.get(i).copied().unwrap_or(false);
            match (got, run) {
                (true, None) => run = Some(i),
                (false, Some(start)) => {
                    let block = SackBlock {
                        start: self.expected.plus(start as u32),
                        end: self.expected.plus(i as u32),
                    };
                    if !list.push(block) {
                        break;
                    }
                    run = None;
                }
                _ => {}
            }
        }
    }

    fn stash_sacks(&self, mut list: SackList) -> SackList {
        // Stashed packets arrived too: runs of consecutive PSNs.
        let mut run: Option<(Psn, Psn)> = None;
        for &(psn, _, _) in &self.stash {
            match run {
                Some((start, end)) if end == psn => run = Some((start, psn.plus(1))),
                Some((start, end)) => {
                    if !list.push(SackBlock { start, end }) {
                        return list;
                    }
                    run = Some((psn, psn.plus(1)));
                }
                None => run = Some((psn, psn.plus(1))),
            }
        }
        if let Some((start, end)) = run {
            list.push(SackBlock { start, end });
        }
        list
    }

    /// Whether packets beyond the gap were received (an ACK must report them).
    pub fn has_sacks(&self) -> bool {
        !self.stash.is_empty() || (self.current.is_some() && self.received.iter().any(|&r| r))
    }

    /// The ACK to send now, with as many selective blocks as fit in `max_datagram`.
    pub fn ack_frame(&self, window: u32, receive_limit: u32, max_datagram: usize) -> Ext {
        let mut sacks = self.sacks();
        let fixed = wire::COMMON_HEADER_LEN + wire::Opcode::Ack.ext_len();
        sacks.truncate(max_datagram.saturating_sub(fixed) / 8);
        Ext::Ack {
            window,
            receive_limit,
            sacks,
        }
    }

    /// Moves past a single-packet message that was accepted.
    fn accepted_single(&mut self, psn: Psn) {
        self.expected = psn.plus(1);
    }

    /// The responder refused the message in progress: nothing more of it is taken.
    pub fn abandon_message(&mut self) {
        self.current = None;
        self.received.clear();
        self.crcs.clear();
    }

    /// The shifter of a full packet's payload (`max_payload` bytes), made once.
    fn shifter(&mut self, max_payload: u32) -> wire::crc_algebra::Shifter {
        match self.shifter {
            Some(shifter) if shifter.cheap_len() == u64::from(max_payload) => shifter,
            _ => *self
                .shifter
                .insert(wire::crc_algebra::Shifter::new(u64::from(max_payload))),
        }
    }

    /// Records that the packet `ahead` places after `expected` was placed (with its payload
    /// CRC when the connection builds message CRCs), and moves `expected` past every packet
    /// now received in a row, folding their CRCs into the message's in order.
    fn mark_received(&mut self, ahead: usize, packet_crc: Option<u32>, max_payload: u32) {
        if ahead == 0 && self.received.is_empty() {
            // In order with nothing out of order behind it (`crcs` is never longer than
            // `received`): the common case, without touching the queues.
            self.deliver_in_order(packet_crc, max_payload);
            return;
        }
        if self.received.len() <= ahead {
            self.received.resize(ahead + 1, false);
        }
        self.received[ahead] = true;
        if let Some(crc) = packet_crc {
            if self.crcs.len() <= ahead {
                self.crcs.resize(ahead + 1, 0);
            }
            self.crcs[ahead] = crc;
        }
        while self.received.front() == Some(&true) {
            self.received.pop_front();
            let packet_crc = self.crcs.pop_front();
            self.deliver_in_order(packet_crc, max_payload);
        }
    }

    /// The packet at `expected` is in: folds its CRC (if it has one) into its message's, and
    /// moves `expected` on.
    fn deliver_in_order(&mut self, packet_crc: Option<u32>, max_payload: u32) {
        if let (Some(crc), Some(message)) = (packet_crc, self.current.as_ref()) {
            // This packet's length: every packet but a message's last is full.
            let index = self.expected.distance_from(message.first_psn);
            let start = u64::from(index) * u64::from(max_payload);
            let len = message
                .msg_len
                .saturating_sub(start)
                .min(u64::from(max_payload));
            let shifter = self.shifter(max_payload);
            if let Some(acc) = self.current.as_mut().and_then(|m| m.crc.as_mut()) {
                *acc = shifter.shift(*acc, len) ^ crc;
            }
        }
        self.expected = self.expected.plus(1);
    }

    /// The responder has no receive for the message starting at `psn`: ask the sender to retry
    /// after `delay`.
    pub fn nak_not_ready(&mut self, psn: Psn, delay: Duration) {
        self.pending_nak = Some(Ext::Nak {
            psn,
            code: NakCode::ReceiverNotReady,
            rnr_delay_us: delay.as_micros().min(u32::MAX as u128) as u32,
        });
    }

    /// Whether a NAK waits to be sent ([`Self::take_nak`] would return one).
    pub fn has_pending_nak(&self) -> bool {
        self.pending_nak.is_some()
    }

    pub fn take_nak(&mut self) -> Option<Ext> {
        self.pending_nak.take()
    }

    fn nak_sequence(&mut self) -> bool {
        if self.nak_sent_for == Some(self.expected) {
            return false;
        }
        self.nak_sent_for = Some(self.expected);
        self.pending_nak = Some(Ext::Nak {
            psn: self.expected,
            code: NakCode::SequenceError,
            rnr_delay_us: 0,
        });
        true
    }
}

impl Connection {
    /// Handles everything but the handshake once established; the header's cumulative
    /// acknowledgement has already been applied.
    pub(super) fn handle_established<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        arrival: &Arrival<'_>,
        mem: &mut M,
    ) {
        match arrival.packet.ext {
            Ext::Ack {
                window,
                receive_limit,
                sacks,
            } => {
                self.tx.set_peer_window(window);
                self.tx.on_receive_limit(receive_limit);
                self.tx.on_sack(sacks.as_slice());
                if self.paths.several() && !sacks.as_slice().is_empty() {
                    for block in sacks.as_slice() {
                        self.paths.on_sacked(block.start, block.end);
                    }
                    self.resend_what_a_path_lost();
                }
            }
            Ext::Nak {
                psn,
                code: NakCode::SequenceError,
                ..
            } => {
                cold_path();
                if !self.paths.several() {
                    self.tx.on_sequence_nak(psn, &mut self.timers)
                } else if self.paths.presumed_lost(psn) {
                    self.tx.resend_presumed_lost(psn, &mut self.timers)
                } else {
                    // The gap is a packet on its way over a slower path: what follows it on
                    // its own path arriving first is what makes it lost.
                    self.stats.naks_for_reordering += 1;
                }
            }
            Ext::Nak {
                psn,
                code: NakCode::ReceiverNotReady,
                rnr_delay_us,
            } => {
                cold_path();
                // The peer chose it: never longer than our ceiling.
                let delay =
                    Duration::from_micros(u64::from(rnr_delay_us)).min(self.config.max_rnr_delay);
                if !self.tx.on_rnr_nak(psn, delay, now, &mut self.timers) {
                    self.fail(
                        Some(WcStatus::RnrRetryExceeded),
                        ConnectionError::RnrRetryExceeded,
                    );
                }
            }
            Ext::KeepAlive => self.ack.answer_probe(arrival.path),
            Ext::Connect(_) | Ext::Accept(_) | Ext::Close { .. } => {}
            _ => self.on_sequenced(now, arrival, mem),
        }
    }

    /// Applies the cumulative acknowledgement carried by any packet.
    pub(super) fn on_ack_psn(&mut self, now: Time, ack: Psn) {
        let (progress, fatal_acked) = self.tx.on_cumulative_ack(ack, now, &mut self.timers);
        if progress {
            self.sq.mark_acked_before(ack);
            if self.paths.several() {
                self.paths.on_acked(self.tx.snd_una());
                self.resend_what_a_path_lost();
            }
        }
        if fatal_acked {
            let code = self.refused.unwrap_or(ErrorCode::RemoteOperational);
            self.fail(None, ConnectionError::PeerRequestRefused(code));
        }
    }

    /// Over several paths: resends the oldest unacknowledged packet (and the others presumed
    /// lost after it) once a packet sent after it on its path has arrived, unless a resend is
    /// under way. The receiver's NAK for it may have come and gone while it still looked like
    /// reordering.
    fn resend_what_a_path_lost(&mut self) {
        let oldest = self.tx.snd_una();
        if !self.tx.resending() && self.paths.presumed_lost(oldest) {
            self.tx.resend_presumed_lost(oldest, &mut self.timers);
        }
    }

    /// A sequenced packet: dropped if it is a duplicate or beyond the window, stashed if it
    /// belongs to a later message, accepted otherwise (and then whatever stashed packets it
    /// made ready).
    fn on_sequenced<M: Memory + ?Sized>(&mut self, now: Time, arrival: &Arrival<'_>, mem: &mut M) {
        if self.state != ConnectionState::Established {
            cold_path();
            // Draining: we refused a request; nothing after it is executed.
            return;
        }
        let packet = &arrival.packet;
        let psn = packet.header.psn;
        let expected = self.rx.expected;
        if psn.before(expected) {
            cold_path();
            self.stats.duplicates += 1;
            self.ack.ack_now();
            return;
        }
        if psn.distance_from(expected) >= self.config.window {
            cold_path();
            self.stats.out_of_order_dropped += 1;
            return;
        }
        let segment = packet.ext.segment().copied();
        if !self.turn_of(psn, segment.as_ref()) {
            // (Only on a link that loses or reorders.)
            cold_path();
            let limit = STASH_PER_PATH * self.paths.count();
            if self
                .rx
                .stash(limit, psn, segment, arrival.datagram, arrival.tail)
            {
                self.stats.out_of_order_stashed += 1;
                // SACK what is held, so the sender resends only the gap.
                self.ack.ack_now();
                if self.rx.stash.len() >= REORDER_THRESHOLD && self.rx.nak_sequence() {
                    self.stats.seq_naks_sent += 1;
                }
            } else {
                self.stats.out_of_order_dropped += 1;
                if self.rx.nak_sequence() {
                    self.stats.seq_naks_sent += 1;
                }
            }
            return;
        }
        self.accept_sequenced(now, packet, mem);
        self.drain_stash(now, mem);
    }

    /// Whether a packet at `psn` belongs to the message that holds the next expected PSN.
    fn belongs(&self, psn: Psn, segment: Option<&Segment>) -> bool {
        let expected = self.rx.expected;
        match (&self.rx.current, segment) {
            (Some(current), Some(seg)) => {
                seg.msg_first_psn == current.first_psn
                    && psn.distance_from(current.first_psn) < current.npackets
            }
            (Some(_), None) => false,
            (None, Some(seg)) => seg.msg_first_psn == expected,
            (None, None) => psn == expected,
        }
    }

    /// Whether a packet at `psn` may be taken now: it belongs to the message in progress (or the
    /// next) and is not that message's last come before the rest. Otherwise it is stashed.
    fn turn_of(&self, psn: Psn, segment: Option<&Segment>) -> bool {
        self.belongs(psn, segment) && !self.last_before_the_rest(psn, segment)
    }

    /// Whether a packet at `psn` is the last of a message of several, come before all the
    /// others are placed. It waits in the stash until they are, so that the last bytes of a
    /// message are placed last: a reader polling a flag in a WRITE's last word (as `ib_write_lat`
    /// does) sees it only once the rest of the WRITE is in place (docs/semantics.md,
    /// "Visibility"). On an in-order link the last packet comes last and this costs nothing.
    fn last_before_the_rest(&self, psn: Psn, segment: Option<&Segment>) -> bool {
        let Some(seg) = segment else {
            return false;
        };
        psn != self.rx.expected
            && psn.distance_from(seg.msg_first_psn).wrapping_add(1)
                == packets_for(seg.msg_len, self.max_payload)
    }

    /// Processes stashed packets whose turn has come.
    fn drain_stash<M: Memory + ?Sized>(&mut self, now: Time, mem: &mut M) {
        while self.state == ConnectionState::Established && !self.rx.stash.is_empty() {
            let (psn, _, _) = self.rx.stash[0];
            if psn.before(self.rx.expected) {
                let (_, _, buf) = self.rx.stash.remove(0);
                self.rx.spare.push(buf);
                continue;
            }
            let Some(index) = self
                .rx
                .stash
                .iter()
                .position(|(p, seg, _)| self.turn_of(*p, seg.as_ref()))
            else {
                return;
            };
            let (_, _, bytes) = self.rx.stash.remove(index);
            if let Ok(packet) = wire::decode(&bytes) {
                self.accept_sequenced(now, &packet, mem);
            }
            self.rx.spare.push(bytes);
        }
    }

    /// The packet whose turn it is: a packet of a data-bearing message, or a single-packet
    /// request or response, which the responder executes.
    fn accept_sequenced<M: Memory + ?Sized>(
        &mut self,
        now: Time,
        packet: &Packet<'_>,
        mem: &mut M,
    ) {
        let is_response = matches!(
            packet.ext,
            Ext::ReadResponse(_) | Ext::AtomicResponse { .. }
        );
        let accepted = match packet.ext.segment().copied() {
            Some(seg) => self.on_segment(packet, &seg, mem),
            None => {
                let accepted = self.execute_single(packet, mem);
                if accepted {
                    self.rx.accepted_single(packet.header.psn);
                }
                accepted
            }
        };
        if accepted {
            self.ack.on_accepted(packet.header.flags);
            if is_response {
                self.tx.on_response_progress(now, &mut self.timers);
            }
        }
    }

    /// A packet of a data-bearing message: checks that it fits its message, starts the message
    /// (the responder decides where it goes) or continues it, has the responder place it, and
    /// moves the next expected PSN past what is now complete. Returns whether it was accepted.
    fn on_segment<M: Memory + ?Sized>(
        &mut self,
        packet: &Packet<'_>,
        seg: &Segment,
        mem: &mut M,
    ) -> bool {
        let (psn, payload) = (packet.header.psn, packet.payload);
        let npackets = packets_for(seg.msg_len, self.max_payload);
        let index = psn.distance_from(seg.msg_first_psn);
        let offset_ok = seg.offset == u64::from(index) * u64::from(self.max_payload);
        let len_ok = payload.len() as u64
            == (seg.msg_len - seg.offset.min(seg.msg_len)).min(u64::from(self.max_payload));
        if index >= npackets || !offset_ok || !len_ok {
            cold_path();
            self.stats.malformed += 1;
            return false;
        }
        if psn.distance_from(self.rx.expected) >= self.config.window {
            cold_path();
            // (The receive stream drops these first; the bitmap below relies on it.)
            self.stats.out_of_order_dropped += 1;
            return false;
        }
        if let Some(current) = &self.rx.current {
            if MessageClaims::of(packet, seg) != current.says {
                cold_path();
                self.stats.malformed += 1;
                return false;
            }
            self.stats.out_of_order_placed += u64::from(psn != self.rx.expected);
            let target = current.target;
            if !self.still_permitted(&target, &packet.ext, seg, mem) {
                return false;
            }
        } else {
            let Some(target) = self.begin_message(packet, seg, mem) else {
                return false;
            };
            self.rx.current = Some(InMessage {
                first_psn: seg.msg_first_psn,
                npackets,
                msg_len: seg.msg_len,
                target,
                says: MessageClaims::of(packet, seg),
                crc: self.config.message_crc.then_some(0),
            });
            self.rx.received.clear();
            self.rx.crcs.clear();
            if psn != self.rx.expected {
                self.stats.out_of_order_placed += 1;
            }
        }
        let Some(current) = &self.rx.current else {
            return false;
        };
        // (The receive stream took only packets from `expected` on and inside the window.)
        let ahead = psn.distance_from(self.rx.expected) as usize;
        if psn.before(self.rx.expected) || self.rx.received.get(ahead).copied() == Some(true) {
            cold_path();
            self.stats.duplicates += 1;
            self.ack.ack_now();
            return false;
        }
        Connection::place(&current.target, seg.offset, payload, seg.msg_len, mem);
        let (first_psn, npackets) = (current.first_psn, current.npackets);
        let packet_crc = self
            .config
            .message_crc
            .then(|| packet.payload_crc(&self.rx.shifter(self.max_payload)));
        self.rx.mark_received(ahead, packet_crc, self.max_payload);
        if self.rx.expected.distance_from(first_psn) == npackets {
            let done = self.rx.current.take().expect("current message exists");
            self.complete_message(done.target, done.msg_len, done.crc);
            self.ack.ack_deferrable();
        } else if !psn.before(self.rx.expected) {
            // Placed ahead of a gap (the expected sequence number did not move past it): tell
            // the sender what we hold so it resends only the gap. An in-order packet waits for
            // `ack_every`.
            self.ack.ack_now();
        }
        true
    }
}
