//! The sending end of a connection (`sendComm`): the request slots NCCL posts into, the credits
//! the receiver granted, the wait for a CTS after an RTS, the staging buffers for eager
//! messages, and the control receives the receiver's CTSs and credit returns land in. The
//! protocol is in the parent module's doc.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use tbrdma_verbs::{
    Access, Completion, MemoryRegion, ProtectionDomain, RecvWr, RemoteAddr, SendOp, SendWr, Sge,
    WcOpcode,
};

use super::{
    BOUNCE_RING, CTRL_REPOST_BATCH, CTRL_RING, CTS_LEN, Cts, EAGER_MAX, Link, PINNED, POLL_BATCH,
    RTS, RTS_WR, Registrations, SEND_PINNED, SLOT_BITS, STAGE_SLOTS, STAGE_WR, TRUNCATED,
    WAITING_SENDS, no_data, pin, seq_imm,
};
use crate::abi::NCCL_NET_MAX_REQUESTS;
use crate::error::{NetError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SendReq {
    Free,
    /// Posted by NCCL, data not transmitted yet: queued for a credit, or (after its RTS)
    /// waiting for its CTS.
    Waiting {
        seq: u64,
        addr: u64,
        len: u64,
        lkey: u32,
    },
    /// Data (or the refusal) posted; `refused` holds the receive's capacity when too small.
    InFlight {
        seq: u64,
        len: u64,
        refused: Option<u64>,
    },
    Done {
        len: u64,
    },
    Truncated {
        seq: u64,
        posted: u64,
        sent: u64,
    },
}

#[derive(Debug)]
struct SendState {
    reqs: [SendReq; NCCL_NET_MAX_REQUESTS],
    /// Waiting requests nothing was sent for yet, in post order (credits are spent in order).
    queue: VecDeque<usize>,
    /// Requests whose RTS went out, by message number; each holds one credit in reserve for
    /// its write.
    owed: HashMap<u64, usize>,
    /// CTSs for messages not transmitted yet (queued, or not posted by NCCL yet).
    cts: HashMap<u64, Cts>,
    /// Receives the peer posted for us that we have not used.
    credits: u64,
    /// Staging buffers not in use.
    stage_free: Vec<usize>,
    /// Control receives consumed and not posted again yet.
    ctrl_repost: Vec<usize>,
    next_seq: u64,
    failed: Option<String>,
}

impl SendState {
    fn waiting(&self) -> usize {
        self.reqs
            .iter()
            .filter(|r| matches!(r, SendReq::Waiting { .. }))
            .count()
    }

    /// The WRITE_WITH_IMM of request `slot` into the buffer `cts` describes (a zero-length
    /// refusal if it does not fit); None if the request is not waiting.
    fn write(&mut self, slot: usize, cts: &Cts) -> Option<SendWr> {
        let SendReq::Waiting {
            seq,
            addr,
            len,
            lkey,
        } = self.reqs[slot]
        else {
            return None;
        };
        let (local, imm, refused) = if len > cts.size {
            (no_data(), seq_imm(seq) | TRUNCATED, Some(cts.size))
        } else {
            (Sge { addr, len, lkey }, seq_imm(seq), None)
        };
        self.reqs[slot] = SendReq::InFlight { seq, len, refused };
        WAITING_SENDS.fetch_sub(1, Ordering::Relaxed);
        Some(SendWr {
            wr_id: slot as u64,
            local,
            op: SendOp::WriteWithImm {
                remote: RemoteAddr {
                    addr: cts.addr,
                    rkey: cts.rkey,
                },
                imm,
            },
        })
    }

    /// A CTS arrived: the write it allows (credit reserved by its RTS), or it is kept for a
    /// message not sent yet, or dropped (its message went eagerly).
    fn on_cts(&mut self, cts: Cts, wrs: &mut Vec<SendWr>) {
        if let Some(slot) = self.owed.remove(&cts.seq) {
            // Never below zero: an RTS is only sent with its write's credit in reserve.
            self.credits = self.credits.saturating_sub(1);
            wrs.extend(self.write(slot, &cts));
            return;
        }
        let queued = self
            .queue
            .iter()
            .any(|&s| matches!(self.reqs[s], SendReq::Waiting { seq, .. } if seq == cts.seq));
        if cts.seq >= self.next_seq + NCCL_NET_MAX_REQUESTS as u64 {
            // The receiver has at most that many receives posted: a CTS further ahead is a
            // peer ignoring the protocol, and keeping it would let the peer grow `cts` at will.
            self.failed.get_or_insert_with(|| {
                format!(
                    "protocol error: a clear-to-send for message {}, beyond the receives the peer can have posted",
                    cts.seq
                )
            });
        } else if queued || cts.seq >= self.next_seq {
            self.cts.insert(cts.seq, cts);
        }
    }

    /// Takes the work requests for queued messages, in order, while credits allow: a write
    /// when a CTS is at hand, else an eager SEND, else an RTS (which reserves a second credit
    /// for its write).
    fn take_ready(&mut self, wrs: &mut Vec<SendWr>) {
        while let Some(&slot) = self.queue.front() {
            let SendReq::Waiting {
                seq,
                addr,
                len,
                lkey,
            } = self.reqs[slot]
            else {
                self.queue.pop_front();
                continue;
            };
            let has_cts = self.cts.contains_key(&seq);
            let rendezvous = !has_cts && len > EAGER_MAX;
            let needed = self.owed.len() as u64 + if rendezvous { 2 } else { 1 };
            if self.credits < needed {
                return;
            }
            self.queue.pop_front();
            self.credits -= 1;
            if let Some(cts) = self.cts.remove(&seq) {
                wrs.extend(self.write(slot, &cts));
            } else if !rendezvous {
                self.reqs[slot] = SendReq::InFlight {
                    seq,
                    len,
                    refused: None,
                };
                WAITING_SENDS.fetch_sub(1, Ordering::Relaxed);
                wrs.push(SendWr {
                    wr_id: slot as u64,
                    local: Sge { addr, len, lkey },
                    op: SendOp::Send {
                        imm: Some(seq_imm(seq)),
                    },
                });
            } else {
                self.owed.insert(seq, slot);
                wrs.push(SendWr {
                    wr_id: RTS_WR | slot as u64,
                    local: no_data(),
                    op: SendOp::Send {
                        imm: Some(seq_imm(seq) | RTS),
                    },
                });
            }
        }
    }
}

/// The sending end of a connection (`sendComm`).
#[derive(Debug)]
pub struct SendComm {
    link: Link,
    /// Receive buffers for the receiver's CTSs.
    ctrl: MemoryRegion,
    /// Staging buffers for eager messages.
    stage: MemoryRegion,
    /// NCCL's registrations on this comm.
    pub regs: Mutex<Registrations>,
    state: Mutex<SendState>,
}

impl SendComm {
    /// Takes over a connected queue pair: allocates and posts the control receives.
    pub fn new(link: Link) -> Result<SendComm> {
        let ctrl = pin(
            &link.pd,
            CTRL_RING * CTS_LEN,
            Access::LOCAL_WRITE,
            "the control receives",
            SEND_PINNED,
        )?;
        let wrs: Vec<RecvWr> = (0..CTRL_RING)
            .map(|i| RecvWr {
                wr_id: i as u64,
                local: ctrl.sge(i * CTS_LEN, CTS_LEN),
            })
            .collect();
        link.qp
            .post_recv(&wrs)
            .map_err(NetError::verbs("posting the control receives"))?;
        let stage = pin(
            &link.pd,
            STAGE_SLOTS * EAGER_MAX as usize,
            Access::LOCAL_WRITE,
            "the staging buffers",
            SEND_PINNED,
        )?;
        PINNED.fetch_add(SEND_PINNED, Ordering::Relaxed);
        Ok(SendComm {
            link,
            ctrl,
            stage,
            regs: Mutex::new(Registrations::default()),
            state: Mutex::new(SendState {
                reqs: [SendReq::Free; NCCL_NET_MAX_REQUESTS],
                queue: VecDeque::new(),
                owed: HashMap::new(),
                cts: HashMap::new(),
                credits: BOUNCE_RING as u64,
                stage_free: (0..STAGE_SLOTS).rev().collect(),
                ctrl_repost: Vec::new(),
                next_seq: 0,
                failed: None,
            }),
        })
    }

    /// The domain registrations go into.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.link.pd
    }

    /// Posts a send of `len` bytes at `addr` (registered under `mhandle`). Returns the request
    /// slot, or None when every slot is busy (NCCL retries).
    pub fn isend(&self, addr: u64, len: u64, mhandle: u64) -> Result<Option<usize>> {
        let lkey = self
            .regs
            .lock()
            .expect("registrations lock")
            .local(mhandle, addr, len)?
            .0;
        let mut st = self.state.lock().expect("send comm lock");
        if let Some(detail) = &st.failed {
            return Err(self.link.remote_error(detail));
        }
        let Some(slot) = st.reqs.iter().position(|r| *r == SendReq::Free) else {
            self.progress(&mut st)?;
            return Ok(None);
        };
        let seq = st.next_seq;
        let staged = self.send_staged(&mut st, seq, addr, len, mhandle)?;
        st.next_seq += 1;
        if staged {
            st.reqs[slot] = SendReq::Done { len };
            return Ok(Some(slot));
        }
        st.reqs[slot] = SendReq::Waiting {
            seq,
            addr,
            len,
            lkey,
        };
        st.queue.push_back(slot);
        WAITING_SENDS.fetch_add(1, Ordering::Relaxed);
        // A message that can go now goes before the completion queue is polled: that poll
        // runs the engine, which would first send the acknowledgement it holds for the peer's
        // last message (a datagram ahead of ours on the round trip). A rendezvous message
        // without a CTS at hand polls first instead: its CTS may be there already, and then
        // no RTS is needed.
        if len <= EAGER_MAX || st.cts.contains_key(&seq) {
            self.transmit(&mut st)?;
        }
        if matches!(st.reqs[slot], SendReq::Waiting { .. }) {
            self.progress(&mut st)?;
        }
        Ok(Some(slot))
    }

    /// Whether request `slot` is done, and its byte count; the slot is free again once done.
    pub fn test(&self, slot: usize) -> Result<Option<u64>> {
        let mut st = self.state.lock().expect("send comm lock");
        let progressed = self.progress(&mut st);
        match st.reqs.get(slot).copied() {
            None | Some(SendReq::Free) => Err(NetError::misuse(format!(
                "test on send request {slot}, which is not outstanding"
            ))),
            Some(SendReq::Done { len }) => {
                st.reqs[slot] = SendReq::Free;
                Ok(Some(len))
            }
            Some(SendReq::Truncated { seq, posted, sent }) => {
                st.reqs[slot] = SendReq::Free;
                Err(NetError::Truncated { seq, posted, sent })
            }
            Some(_) => {
                progressed?;
                match &st.failed {
                    Some(detail) => Err(self.link.remote_error(detail)),
                    None => Ok(None),
                }
            }
        }
    }

    /// Whether closing the comm now could lose a send that already completed: a staged eager
    /// message (complete at `isend`) not yet acknowledged, on a connection still up. Progresses
    /// the comm first (unless another thread is doing so).
    pub fn unacked_completed_sends(&self) -> bool {
        let Ok(mut st) = self.state.try_lock() else {
            return true;
        };
        if let Err(e) = self.progress(&mut st) {
            st.failed.get_or_insert_with(|| e.to_string());
        }
        st.failed.is_none() && st.stage_free.len() < STAGE_SLOTS
    }

    /// Progresses this comm unless another thread is doing so; for calls made on behalf of
    /// other comms (errors are kept for this comm's own calls to report).
    pub fn try_progress(&self) {
        if let Ok(mut st) = self.state.try_lock() {
            if st.waiting() > 0 {
                if let Err(e) = self.progress(&mut st) {
                    st.failed.get_or_insert_with(|| e.to_string());
                }
            }
        }
    }

    /// Sends message `seq` eagerly from a copy in a staging buffer, if it is small, nothing
    /// is queued before it, a credit is free beyond the reserve and so is a staging buffer;
    /// returns whether it did (the request is then complete: NCCL's buffer is not read again).
    /// See [`STAGE_SLOTS`] for why.
    fn send_staged(
        &self,
        st: &mut SendState,
        seq: u64,
        addr: u64,
        len: u64,
        mhandle: u64,
    ) -> Result<bool> {
        let credit = st.credits > st.owed.len() as u64;
        if len > EAGER_MAX || !st.queue.is_empty() || !credit || st.failed.is_some() {
            return Ok(false);
        }
        let Some(buf) = st.stage_free.pop() else {
            return Ok(false);
        };
        let at = buf * EAGER_MAX as usize;
        if len > 0 {
            let regs = self.regs.lock().expect("registrations lock");
            let reg = match regs.covering(mhandle, addr, len) {
                Ok(reg) => reg,
                Err(e) => {
                    st.stage_free.push(buf);
                    return Err(e);
                }
            };
            reg.mr
                .copy_to((addr - reg.addr) as usize, &self.stage, at, len as usize);
        }
        // A CTS that came for it is not needed.
        st.cts.remove(&seq);
        st.credits -= 1;
        self.post(&[SendWr {
            wr_id: STAGE_WR | buf as u64,
            local: self.stage.sge(at, len as usize),
            op: SendOp::Send {
                imm: Some(seq_imm(seq)),
            },
        }])?;
        Ok(true)
    }

    /// Posts what the credits and CTSs at hand allow.
    fn transmit(&self, st: &mut SendState) -> Result<()> {
        if st.failed.is_some() {
            return Ok(());
        }
        let mut wrs = Vec::new();
        st.take_ready(&mut wrs);
        self.post(&wrs)
    }

    fn post(&self, wrs: &[SendWr]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        self.link
            .qp
            .post_send(wrs)
            .map_err(NetError::verbs("posting sends"))
    }

    /// Reaps completions (credits, CTSs, finished sends), then posts what became possible.
    fn progress(&self, st: &mut SendState) -> Result<()> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        let mut wrs = Vec::new();
        loop {
            let n = self.link.poll(&mut wcs)?;
            for c in &wcs[..n] {
                let wc = c.wc;
                if !wc.status.is_success() {
                    st.failed
                        .get_or_insert_with(|| self.link.failure("a request", wc.status));
                } else if wc.opcode == WcOpcode::Recv {
                    let ring = (wc.wr_id as usize) % CTRL_RING;
                    st.credits += u64::from(wc.imm.unwrap_or(0));
                    if st.credits > BOUNCE_RING as u64 {
                        // The receiver posted only `BOUNCE_RING` receives for us.
                        st.failed.get_or_insert_with(|| {
                            format!(
                                "protocol error: the peer granted {} credits, more than its {BOUNCE_RING} receives",
                                st.credits
                            )
                        });
                        st.credits = BOUNCE_RING as u64;
                    }
                    if wc.byte_len == CTS_LEN as u64 {
                        let mut raw = [0u8; CTS_LEN];
                        self.ctrl.read(ring * CTS_LEN, &mut raw);
                        if let Some(cts) = Cts::decode(&raw) {
                            st.on_cts(cts, &mut wrs);
                        }
                    }
                    st.ctrl_repost.push(ring);
                } else if wc.wr_id & STAGE_WR != 0 {
                    st.stage_free.push((wc.wr_id & SLOT_BITS) as usize);
                } else if wc.wr_id & RTS_WR == 0 {
                    if let Some(req) = st.reqs.get_mut(wc.wr_id as usize) {
                        if let SendReq::InFlight { seq, len, refused } = *req {
                            *req = match refused {
                                None => SendReq::Done { len },
                                Some(posted) => SendReq::Truncated {
                                    seq,
                                    posted,
                                    sent: len,
                                },
                            };
                        }
                    }
                }
            }
            if n < wcs.len() {
                break;
            }
        }
        if st.failed.is_some() {
            return Ok(());
        }
        // Data first: the control receives can wait.
        st.take_ready(&mut wrs);
        self.post(&wrs)?;
        if st.ctrl_repost.len() >= CTRL_REPOST_BATCH {
            let wrs: Vec<RecvWr> = st
                .ctrl_repost
                .drain(..)
                .map(|ring| RecvWr {
                    wr_id: ring as u64,
                    local: self.ctrl.sge(ring * CTS_LEN, CTS_LEN),
                })
                .collect();
            self.link
                .qp
                .post_recv(&wrs)
                .map_err(NetError::verbs("reposting control receives"))?;
        }
        Ok(())
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        WAITING_SENDS.fetch_sub(st.waiting(), Ordering::Relaxed);
        PINNED.fetch_sub(SEND_PINNED, Ordering::Relaxed);
    }
}

#[cfg(test)]
impl SendComm {
    /// Nothing waits: no request for a credit or a CTS, no CTS for its message.
    pub(super) fn settled(&self) -> bool {
        let st = self.state.lock().unwrap();
        st.queue.is_empty() && st.owed.is_empty() && st.cts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(seq: u64, len: u64) -> SendReq {
        SendReq::Waiting {
            seq,
            addr: 0x1000,
            len,
            lkey: 7,
        }
    }

    fn sender(credits: u64) -> SendState {
        SendState {
            reqs: [SendReq::Free; NCCL_NET_MAX_REQUESTS],
            queue: VecDeque::new(),
            owed: HashMap::new(),
            cts: HashMap::new(),
            credits,
            stage_free: Vec::new(),
            ctrl_repost: Vec::new(),
            next_seq: 0,
            failed: None,
        }
    }

    /// Queues message `seq` of `len` bytes in slot `slot`, as `isend` does.
    fn queue(st: &mut SendState, slot: usize, len: u64) {
        st.reqs[slot] = waiting(st.next_seq, len);
        st.next_seq += 1;
        st.queue.push_back(slot);
        WAITING_SENDS.fetch_add(1, Ordering::Relaxed);
    }

    #[test]
    fn small_messages_go_eagerly_and_large_ones_ask_first() {
        let mut st = sender(BOUNCE_RING as u64);
        queue(&mut st, 0, 8);
        queue(&mut st, 1, EAGER_MAX + 1);
        queue(&mut st, 2, 0);
        let mut wrs = Vec::new();
        st.take_ready(&mut wrs);
        assert_eq!(wrs.len(), 3);
        assert_eq!(wrs[0].op, SendOp::Send { imm: Some(0) });
        assert_eq!(wrs[1].op, SendOp::Send { imm: Some(1 | RTS) });
        assert_eq!(wrs[1].local.len, 0);
        assert_eq!(wrs[2].op, SendOp::Send { imm: Some(2) });
        assert_eq!(st.credits, BOUNCE_RING as u64 - 3);
        assert_eq!(st.owed.len(), 1);
        // The CTS for message 1 lets its write go on the reserved credit.
        let cts = Cts {
            addr: 0x9000,
            rkey: 3,
            size: 1 << 20,
            seq: 1,
        };
        wrs.clear();
        st.on_cts(cts, &mut wrs);
        assert!(matches!(
            wrs[0].op,
            SendOp::WriteWithImm {
                imm: 1,
                remote: RemoteAddr {
                    addr: 0x9000,
                    rkey: 3
                }
            }
        ));
        assert_eq!(st.credits, BOUNCE_RING as u64 - 4);
        assert!(st.owed.is_empty());
        // A CTS for a message that went eagerly is dropped; one for a future message is kept.
        st.on_cts(Cts { seq: 0, ..cts }, &mut wrs);
        st.on_cts(Cts { seq: 5, ..cts }, &mut wrs);
        assert_eq!(st.cts.keys().copied().collect::<Vec<_>>(), [5]);
        WAITING_SENDS.fetch_sub(st.waiting(), Ordering::Relaxed);
    }

    #[test]
    fn a_cts_at_hand_means_a_direct_write_and_a_small_one_refuses() {
        let mut st = sender(4);
        st.cts.insert(
            0,
            Cts {
                addr: 0x9000,
                rkey: 3,
                size: 100,
                seq: 0,
            },
        );
        queue(&mut st, 0, 1 << 20);
        let mut wrs = Vec::new();
        st.take_ready(&mut wrs);
        assert!(matches!(
            wrs[0].op,
            SendOp::WriteWithImm { imm, .. } if imm == TRUNCATED
        ));
        assert_eq!(wrs[0].local.len, 0);
        assert_eq!(
            st.reqs[0],
            SendReq::InFlight {
                seq: 0,
                len: 1 << 20,
                refused: Some(100)
            }
        );
        WAITING_SENDS.fetch_sub(st.waiting(), Ordering::Relaxed);
    }

    #[test]
    fn credits_are_spent_in_order_and_an_rts_keeps_one_for_its_write() {
        let mut st = sender(2);
        queue(&mut st, 0, EAGER_MAX + 1); // RTS: 1 credit spent, 1 reserved
        queue(&mut st, 1, 8); // needs 1 beyond the reserve: none left
        let mut wrs = Vec::new();
        st.take_ready(&mut wrs);
        assert_eq!(wrs.len(), 1);
        assert_eq!((st.credits, st.queue.len()), (1, 1));
        // Without credits beyond the reserve, nothing else goes, however long it waits.
        st.take_ready(&mut wrs);
        assert_eq!(wrs.len(), 1);
        // One credit back: the eager message goes; the write still has its reserve.
        st.credits += 1;
        st.take_ready(&mut wrs);
        assert_eq!(wrs.len(), 2);
        assert_eq!(st.credits, 1);
        st.on_cts(
            Cts {
                addr: 1,
                rkey: 1,
                size: 1 << 20,
                seq: 0,
            },
            &mut wrs,
        );
        assert_eq!((wrs.len(), st.credits), (3, 0));
        WAITING_SENDS.fetch_sub(st.waiting(), Ordering::Relaxed);
    }
}
