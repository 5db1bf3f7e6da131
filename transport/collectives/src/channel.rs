//! A channel: the connection to one neighbour rank and the pre-registered slots on both sides.
//!
//! Data moves as WRITE_WITH_IMM from a slot of the local outbox into the same slot of the
//! peer's inbox; the immediate says what the message is. The receiver hands slots back so a
//! sender never overwrites a slot the peer has not read: on its own data messages (up to 63
//! slots in the immediate's spare bits, which in a collective's steady state returns every slot
//! with no message of its own), or, when half the slots are owed, in a zero-length
//! WRITE_WITH_IMM carrying a count. Messages are consumed in the order they were sent (completions are in
//! order), so the slot of a message is its sequence number modulo the slot count.
//!
//! This module registers memory only when a channel is built; it never blocks: callers poll and
//! decide how to wait.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ops::Range;

use tbrdma_verbs::{
    Completion, CompletionQueue, MemoryRegion, QueuePair, RecvWr, RemoteAddr, SendOp, SendWr,
    WcOpcode, WcStatus, WriteSink,
};

/// Bytes in front of every slot that belong to no slot: the engine writes a datagram's header
/// there and sends it together with the slot's data as one buffer (see
/// [`tbrdma_verbs::QueuePair::set_send_headroom`]). A multiple of 64 so that slots stay
/// cache-line aligned.
const SLOT_GAP: usize = tbrdma_verbs::SEND_HEADROOM.next_multiple_of(64);

/// Bytes of a region holding `slots` slots of `slot_bytes` bytes, each after its gap.
pub(crate) fn region_bytes(slots: usize, slot_bytes: usize) -> usize {
    slots * (SLOT_GAP + slot_bytes)
}

/// Immediate layout: two kind bits, six bits of slots handed back (data messages), then 24 bits
/// of payload.
const KIND_SHIFT: u32 = 30;
const CARRIED_SHIFT: u32 = 24;
const CARRIED_MAX: u64 = (1 << (KIND_SHIFT - CARRIED_SHIFT)) - 1;
const PAYLOAD: u32 = (1 << 24) - 1;
const KIND_DATA: u32 = 0;
const KIND_CREDIT: u32 = 1;
const KIND_ABORT: u32 = 2;
/// Abort payload meaning "the sender itself gave up" rather than naming another rank.
pub(crate) const ABORT_SELF: u32 = PAYLOAD;
/// `wr_id` bit of control messages (credits, aborts), whose completions are not data.
const CONTROL: u64 = 1 << 63;

/// Why a channel cannot go on.
#[derive(Debug)]
pub(crate) enum Fault {
    /// A completion failed or the protocol was broken: the peer is gone or misbehaving.
    Failed(String),
    /// The peer reports that a rank (or, with [`ABORT_SELF`], the peer itself) failed.
    Abort(u32),
}

/// The channel to `rank`, or a failure naming the missing cable.
pub(crate) fn channel_to(
    chans: &mut [Option<Channel>],
    rank: usize,
) -> Result<&mut Channel, Fault> {
    chans[rank]
        .as_mut()
        .ok_or_else(|| Fault::Failed(format!("no cable to rank {rank}")))
}

/// The connection to one neighbour.
#[derive(Debug)]
pub(crate) struct Channel {
    /// The neighbour's rank.
    pub peer: usize,
    qp: QueuePair,
    cq: CompletionQueue,
    inbox: MemoryRegion,
    /// Where [`Self::view_oldest_range`] copies a piece out of the inbox: allocated once, so a
    /// view neither allocates nor clears [`VIEW_PIECE`] bytes first, and it stays in L1
    /// between views.
    piece: RefCell<Box<[u8]>>,
    outbox: MemoryRegion,
    remote: RemoteAddr,
    slots: u64,
    slot_bytes: usize,
    credit_batch: u64,
    /// Data messages posted.
    sent: u64,
    /// Data messages whose WRITE completed (their outbox slot is free again).
    send_done: u64,
    /// Inbox slots the peer has handed back.
    credits: u64,
    /// Lengths of messages that arrived and are not consumed yet, oldest first.
    arrived: VecDeque<usize>,
    arrived_total: u64,
    consumed: u64,
    /// Consumed slots already handed back to the peer.
    credited: u64,
    control_posted: u64,
    control_done: u64,
    /// The connection ended; messages that arrived before stay readable.
    closed: bool,
    wcs: Vec<Completion>,
    /// Zero-length receives for immediates, all alike: built once, posted as a prefix.
    recv_wrs: Vec<RecvWr>,
    /// Receives consumed and not posted again yet (they are re-posted in batches).
    reposts_due: usize,
    /// Receive completions polled, for lending the next slot (see `lend_next_slot`).
    recv_seen: u64,
    /// Whether the engine receives into lent slots (only the sockets engine does).
    lends: bool,
}

/// Consumed receives are posted again once this many are due: one engine call per batch
/// instead of one per message. The queue is deeper by as much.
const REPOST_BATCH: usize = 8;
/// Bytes per piece of [`Channel::view_oldest_range`]: a quarter of a 48-64 KiB first-level
/// data cache, and a multiple of every element size, so a piece never splits an element.
pub const VIEW_PIECE: usize = 16 << 10;

/// The consecutive pieces, of at most [`VIEW_PIECE`] bytes, that a message of `len` bytes is
/// viewed in.
pub fn pieces(len: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len)
        .step_by(VIEW_PIECE)
        .map(move |start| start..len.min(start + VIEW_PIECE))
}

impl Channel {
    /// Wraps a connected queue pair; posts the receives that immediates consume.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        peer: usize,
        qp: QueuePair,
        cq: CompletionQueue,
        inbox: MemoryRegion,
        outbox: MemoryRegion,
        remote: RemoteAddr,
        slots: usize,
        slot_bytes: usize,
    ) -> tbrdma_verbs::Result<Channel> {
        // At most `slots` data messages and as many credit messages can be unconsumed at once,
        // plus an abort; twice that leaves slack for receives re-posted late, and the batch
        // for those not re-posted yet.
        let recv_depth = 2 * slots + 8 + REPOST_BATCH;
        const POLL_BATCH: usize = 64;
        let recv_wr = RecvWr {
            wr_id: 0,
            local: inbox.sge(0, 0),
        };
        let mut ch = Channel {
            peer,
            qp,
            cq,
            inbox,
            piece: RefCell::new(vec![0; VIEW_PIECE].into_boxed_slice()),
            outbox,
            remote,
            slots: slots as u64,
            slot_bytes,
            credit_batch: (slots as u64 / 2).max(1),
            sent: 0,
            send_done: 0,
            credits: 0,
            arrived: VecDeque::with_capacity(slots),
            arrived_total: 0,
            consumed: 0,
            credited: 0,
            control_posted: 0,
            control_done: 0,
            closed: false,
            wcs: vec![Completion::default(); POLL_BATCH],
            recv_wrs: vec![recv_wr; recv_depth.max(POLL_BATCH + REPOST_BATCH)],
            reposts_due: 0,
            recv_seen: 0,
            lends: false,
        };
        ch.post_recvs(recv_depth)?;
        ch.qp.set_send_headroom(true)?;
        ch.lends = ch.qp.lends_zones(ch.slot_bytes);
        ch.lend_next_slot();
        Ok(ch)
    }

    /// Posts `n` receives (at most one per completion a poll returns, or the initial depth).
    fn post_recvs(&self, n: usize) -> tbrdma_verbs::Result<()> {
        self.qp.post_recv(&self.recv_wrs[..n])
    }

    /// Moves completions into the channel's counters. Returns whether anything happened.
    pub fn poll(&mut self) -> Result<bool, Fault> {
        let n = self
            .cq
            .poll(&mut self.wcs)
            .map_err(|e| Fault::Failed(e.to_string()))?;
        let mut reposts = 0;
        for c in &self.wcs[..n] {
            let wc = c.wc;
            let is_recv = matches!(wc.opcode, WcOpcode::RecvRdmaWithImm | WcOpcode::Recv);
            if is_recv && wc.status == WcStatus::Flushed {
                // The peer closed (or the link failed): harmless if nothing more is needed
                // from it, which only the schedule knows; see `closed`.
                self.closed = true;
                continue;
            }
            if wc.status != WcStatus::Success {
                return Err(Fault::Failed(format!(
                    "a {:?} completed with {:?}",
                    wc.opcode, wc.status
                )));
            }
            match wc.opcode {
                WcOpcode::RecvRdmaWithImm | WcOpcode::Recv => {
                    reposts += 1;
                    let imm = wc.imm.unwrap_or(u32::MAX);
                    let payload = imm & PAYLOAD;
                    match imm >> KIND_SHIFT {
                        KIND_DATA => {
                            self.credits += u64::from((imm >> CARRIED_SHIFT) & CARRIED_MAX as u32);
                            let expect = (self.arrived_total & u64::from(PAYLOAD)) as u32;
                            if payload != expect || wc.byte_len as usize > self.slot_bytes {
                                return Err(Fault::Failed(format!(
                                    "protocol error: message {payload} of {} bytes where message {expect} was due",
                                    wc.byte_len
                                )));
                            }
                            self.arrived.push_back(wc.byte_len as usize);
                            self.arrived_total += 1;
                        }
                        KIND_CREDIT => self.credits += u64::from(payload),
                        KIND_ABORT => return Err(Fault::Abort(payload)),
                        _ => {
                            return Err(Fault::Failed(format!(
                                "protocol error: unknown immediate {imm:#x}"
                            )));
                        }
                    }
                }
                _ => {
                    if wc.wr_id & CONTROL == 0 {
                        self.send_done += 1;
                    } else {
                        self.control_done += 1;
                    }
                }
            }
        }
        if reposts > 0 && !self.closed {
            self.recv_seen += reposts as u64;
            self.reposts_due += reposts;
            if self.reposts_due >= REPOST_BATCH {
                self.post_recvs(self.reposts_due)
                    .map_err(|e| Fault::Failed(format!("re-posting receives: {e}")))?;
                self.reposts_due = 0;
            }
            self.lend_next_slot();
        }
        Ok(n > 0)
    }

    /// Lends the engine the inbox slot the next message will be written to, when it is free,
    /// so that the message is received straight into it (see
    /// [`QueuePair::expect_write`]); the engine takes the loan back at the next receive
    /// completion, after which this runs again. Only a speed-up: it fails only when the queue
    /// pair is gone, which the next poll reports.
    fn lend_next_slot(&self) {
        if self.lends && self.arrived_total - self.consumed < self.slots {
            let at = self.slot_offset(self.arrived_total);
            let lent = self
                .qp
                .expect_write(&self.inbox, at, self.slot_bytes, self.recv_seen);
            debug_assert!(
                !matches!(lent, Err(tbrdma_verbs::VerbsError::BadLanding { .. })),
                "the slot layout leaves room for the header: {lent:?}"
            );
        }
    }

    /// Where message `seq`'s slot starts, in both the outbox and the peer's inbox.
    fn slot_offset(&self, seq: u64) -> usize {
        (seq % self.slots) as usize * (SLOT_GAP + self.slot_bytes) + SLOT_GAP
    }

    /// Whether a data message may be posted now (a free slot on both sides).
    pub fn can_send(&self) -> bool {
        self.sent - self.credits < self.slots && self.sent - self.send_done < self.slots
    }

    /// Posts `data` (at most a slot) as the next message. Call only when [`Self::can_send`].
    pub fn send(&mut self, data: &[u8]) -> Result<(), Fault> {
        debug_assert!(self.can_send() && data.len() <= self.slot_bytes);
        let at = self.slot_offset(self.sent);
        if !data.is_empty() {
            self.outbox.write(at, data);
        }
        // Slots consumed since the last hand-back ride along.
        let carried = (self.consumed - self.credited).min(CARRIED_MAX);
        self.post_write(
            self.sent,
            at,
            data.len(),
            (KIND_DATA << KIND_SHIFT)
                | ((carried as u32) << CARRIED_SHIFT)
                | (self.sent & u64::from(PAYLOAD)) as u32,
        )?;
        self.credited += carried;
        self.sent += 1;
        Ok(())
    }

    fn post_write(&self, wr_id: u64, at: usize, len: usize, imm: u32) -> Result<(), Fault> {
        self.qp
            .post_send(&[SendWr {
                wr_id,
                local: self.outbox.sge(at, len),
                op: SendOp::WriteWithImm {
                    remote: RemoteAddr {
                        addr: self.remote.addr + at as u64,
                        rkey: self.remote.rkey,
                    },
                    imm,
                },
            }])
            .map_err(|e| Fault::Failed(format!("posting a write: {e}")))
    }

    /// Where the next message to arrive will land in the inbox, as a [`WriteSink`] whose
    /// function can reduce its packets as they come instead ([`WriteSink::run`]); `None` while
    /// an earlier message is waiting to be consumed (the next to arrive is then not the one
    /// the caller consumes next) or the connection is closed.
    pub fn next_arrival_sink(&self) -> Option<WriteSink> {
        (self.arrived.is_empty() && !self.closed).then(|| {
            let at = self.slot_offset(self.arrived_total);
            self.inbox.write_sink(at..at + self.slot_bytes)
        })
    }

    /// Length of the oldest unconsumed message, if one arrived.
    pub fn peek(&self) -> Option<usize> {
        self.arrived.front().copied()
    }

    /// Copies the oldest message into `out` (which must have its length) and frees its slot.
    /// One copy, straight out of the inbox: a peer writing the slot meanwhile can only change
    /// what is copied, not a view anyone holds.
    pub fn consume(&mut self, out: &mut [u8]) -> Result<(), Fault> {
        self.expect_oldest(out.len())?;
        self.inbox.read(self.slot_offset(self.consumed), out);
        self.release_oldest()
    }

    /// Checks that the oldest message arrived and is `len` bytes long.
    pub fn expect_oldest(&self, len: usize) -> Result<(), Fault> {
        match self.peek() {
            Some(got) if got == len => Ok(()),
            got => Err(Fault::Failed(format!(
                "protocol error: expected a message of {len} bytes, got {} (are all ranks running the same collective with the same count?)",
                got.map_or("none".to_string(), |g| g.to_string())
            ))),
        }
    }

    /// Lends the oldest message to `f` in consecutive pieces of at most [`VIEW_PIECE`] bytes,
    /// each with its range in the message. Call after [`Self::expect_oldest`].
    pub fn view_oldest_in_pieces(&self, f: &mut dyn FnMut(Range<usize>, &[u8])) {
        for piece in pieces(self.peek().unwrap_or(0)) {
            self.view_oldest_range(piece.clone(), &mut |bytes| f(piece.clone(), bytes));
        }
    }

    /// Lends bytes `range` of the oldest message (at most [`VIEW_PIECE`] of them) to `f`. Call
    /// after [`Self::expect_oldest`].
    ///
    /// They are copied out of the inbox first: an honest peer does not write the slot until
    /// [`Self::release_oldest`], but a hostile one holds the inbox's rkey and can write it at
    /// any time, and a view in place would then change under the reduction (a data race; see
    /// `MemoryRegion::with_bytes`). The copy goes into a buffer small enough to stay in the
    /// first-level cache while `f` reads it: for an element-wise reduction that costs a copy
    /// into L1, where a copy of the whole message would go to memory that `f` then reads
    /// again.
    ///
    /// # Panics
    /// If `range` is longer than [`VIEW_PIECE`] or runs past the message.
    pub fn view_oldest_range(&self, range: Range<usize>, f: &mut dyn FnMut(&[u8])) {
        let len = self.peek().unwrap_or(0);
        assert!(
            range.start <= range.end && range.end <= len && range.len() <= VIEW_PIECE,
            "view of {range:?} in a message of {len} bytes"
        );
        let mut piece = self.piece.borrow_mut();
        let piece = &mut piece[..range.len()];
        self.inbox
            .read(self.slot_offset(self.consumed) + range.start, piece);
        f(piece)
    }

    /// Frees the oldest message's slot (handing slots back to the peer when half are owed).
    pub fn release_oldest(&mut self) -> Result<(), Fault> {
        if self.arrived.pop_front().is_none() {
            return Err(Fault::Failed(
                "protocol error: released a message that has not arrived".into(),
            ));
        }
        self.consumed += 1;
        if self.arrived_total - self.consumed == self.slots - 1 {
            // The inbox was full, so no slot was lent: the next message's is free now.
            self.lend_next_slot();
        }
        let owed = self.consumed - self.credited;
        if owed >= self.credit_batch {
            self.control_posted += 1;
            self.post_write(
                CONTROL | self.control_posted,
                0,
                0,
                (KIND_CREDIT << KIND_SHIFT) | owed as u32,
            )?;
            self.credited = self.consumed;
        }
        Ok(())
    }

    /// The protocol counters of this channel's queue pair.
    pub fn stats(&self) -> tbrdma_verbs::Stats {
        self.qp.stats()
    }

    /// The datagram backend carrying this channel.
    pub fn engine_kind(&self) -> tbrdma_verbs::EngineKind {
        self.qp.device().engine_kind()
    }

    /// Whether the connection ended (the peer closed it, or it failed with receives posted).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether every posted write has completed (the peer has all of it).
    pub fn is_flushed(&self) -> bool {
        self.send_done == self.sent && self.control_done == self.control_posted
    }

    /// Tells the peer that `failed` (a rank, or [`ABORT_SELF`]) failed; best effort.
    pub fn abort(&mut self, failed: u32) {
        self.control_posted += 1;
        let _ = self.post_write(
            CONTROL | self.control_posted,
            0,
            0,
            (KIND_ABORT << KIND_SHIFT) | (failed & PAYLOAD),
        );
    }
}
