//! The send queue: requests in post order, and what each still waits for. Completions leave
//! only from the front, which is what makes them arrive in post order.

use std::collections::VecDeque;

use crate::memory::Placement;
use crate::seq::Psn;
use crate::work::{Queue, SendOp, SendWr, WcStatus, WorkCompletion};

/// One posted request.
#[derive(Debug)]
pub(super) struct SqEntry {
    pub wr: SendWr,
    /// Where the local buffer is (None for an empty buffer).
    pub local: Option<Placement>,
    /// The local buffer failed its protection check.
    pub local_error: bool,
    /// Whether the request has been given PSNs in the outgoing stream.
    pub queued: bool,
    pub first_psn: Psn,
    pub last_psn: Psn,
    /// Every packet of the request was acknowledged.
    pub acked: bool,
    /// The READ or atomic response arrived in full.
    pub responded: bool,
}

impl SqEntry {
    pub fn new(wr: SendWr, local: Option<Placement>, local_error: bool) -> SqEntry {
        SqEntry {
            wr,
            local,
            local_error,
            queued: false,
            first_psn: Psn(0),
            last_psn: Psn(0),
            acked: false,
            responded: false,
        }
    }

    /// READ and atomics finish when their response arrives, the rest when acknowledged.
    pub fn needs_response(&self) -> bool {
        matches!(
            self.wr.op,
            SendOp::Read { .. } | SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. }
        )
    }

    pub fn is_done(&self) -> bool {
        if self.needs_response() {
            self.responded
        } else {
            self.acked
        }
    }

    pub fn completion(&self, status: WcStatus) -> WorkCompletion {
        WorkCompletion {
            wr_id: self.wr.wr_id,
            queue: Queue::Send,
            status,
            opcode: self.wr.op.completion_opcode(),
            byte_len: if status.is_success() {
                self.wr.local.len
            } else {
                0
            },
            imm: None,
            payload_crc: None,
        }
    }
}

/// Requests in post order.
#[derive(Debug, Default)]
pub(super) struct SendQueue {
    entries: VecDeque<SqEntry>,
}

impl SendQueue {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn push(&mut self, entry: SqEntry) {
        self.entries.push_back(entry);
    }

    pub fn pop(&mut self) -> Option<SqEntry> {
        self.entries.pop_front()
    }

    pub fn front(&self) -> Option<&SqEntry> {
        self.entries.front()
    }

    /// Entries not yet given PSNs (always a suffix of the queue).
    pub fn unqueued_mut(&mut self) -> impl Iterator<Item = &mut SqEntry> {
        self.entries.iter_mut().skip_while(|e| e.queued)
    }

    /// Whether every posted request already has its PSNs (the last one is queued).
    pub fn all_queued(&self) -> bool {
        self.entries.back().is_none_or(|e| e.queued)
    }

    /// Whether some request waits for a response from the peer.
    pub fn awaits_response(&self) -> bool {
        self.entries
            .iter()
            .any(|e| e.queued && e.needs_response() && !e.responded)
    }

    /// Whether a READ that was sent still waits for its response.
    pub fn awaits_read_response(&self) -> bool {
        self.entries
            .iter()
            .any(|e| e.queued && matches!(e.wr.op, SendOp::Read { .. }) && !e.responded)
    }

    /// Marks every request whose packets all come before `snd_una` as acknowledged.
    pub fn mark_acked_before(&mut self, snd_una: Psn) {
        for entry in self.entries.iter_mut() {
            if !entry.queued || !entry.last_psn.before(snd_una) {
                break;
            }
            entry.acked = true;
        }
    }

    /// The queued request whose first PSN is `psn`.
    pub fn by_first_psn(&mut self, psn: Psn) -> Option<&mut SqEntry> {
        self.entries
            .iter_mut()
            .take_while(|e| e.queued)
            .find(|e| e.first_psn == psn)
    }

    /// Position of the queued request whose packets include `psn`.
    pub fn position_containing(&self, psn: Psn) -> Option<usize> {
        self.entries
            .iter()
            .take_while(|e| e.queued)
            .position(|e| !psn.before(e.first_psn) && !e.last_psn.before(psn))
    }
}
