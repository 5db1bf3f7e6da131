//! The receiving end of a connection (`recvComm`): the request slots NCCL posts into, the
//! bounce buffers eager messages land in, messages that arrived before their `irecv`, the CTSs
//! sent for rendezvous messages and the credits returned to the sender. The protocol is in the
//! parent module's doc.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use tbrdma_verbs::{
    Access, Completion, MemoryRegion, ProtectionDomain, RecvWr, SendOp, SendWr, WcOpcode,
    WorkCompletion,
};

use super::{
    BOUNCE_RING, CREDIT_BATCH, CREDIT_LOW, CREDIT_WR, CTS_LEN, CTS_SLOTS, CTS_WR, Cts, EAGER_MAX,
    Link, PINNED, POLL_BATCH, RECV_PINNED, REPOST_BATCH, RTS, Registrations, SEQ_MASK, SLOT_BITS,
    TRUNCATED, full_seq, no_data, pin,
};
use crate::abi::NCCL_NET_MAX_REQUESTS;
use crate::error::{NetError, Result};

/// How far beyond the next `irecv`'s number a message may be: the sender's credits
/// ([`BOUNCE_RING`]) and the RTSs it may have out (one per request) bound it.
const EARLY_AHEAD: usize = BOUNCE_RING + NCCL_NET_MAX_REQUESTS;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecvReq {
    Free,
    Posted {
        seq: u64,
        addr: u64,
        size: u64,
        rkey: u32,
        mhandle: u64,
        cts_sent: bool,
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

/// A message that arrived before its `irecv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Early {
    /// Eager data, held in its bounce buffer.
    Eager { bounce: usize, len: u64 },
    /// A request to send: the CTS goes when the receive is posted.
    Rts,
}

#[derive(Debug)]
struct RecvState {
    reqs: [RecvReq; NCCL_NET_MAX_REQUESTS],
    /// Messages that came before their receive, by message number.
    early: HashMap<u64, Early>,
    next_seq: u64,
    /// The last message came by rendezvous: large receives send their CTS at once.
    rendezvous: bool,
    /// Bounce buffers to post again as receives.
    repost: Vec<usize>,
    /// Their work requests, built in a vector kept between calls (this runs per message).
    repost_wrs: Vec<RecvWr>,
    /// Receives posted again and not yet returned to the sender as credits.
    pending_credits: u64,
    /// Receives granted to the sender so far (the initial ring plus every return).
    granted: u64,
    /// Messages that consumed a receive so far.
    arrived: u64,
    /// CTS buffers not in use.
    cts_free: Vec<usize>,
    /// Receives whose CTS waits for a free buffer, by message number (sent by the next
    /// progress: NCCL keeps testing a comm with receives outstanding).
    cts_queue: VecDeque<u64>,
    failed: Option<String>,
}

impl RecvState {
    fn posted(&self, seq: u64) -> Option<usize> {
        self.reqs
            .iter()
            .position(|r| matches!(r, RecvReq::Posted { seq: s, .. } if *s == seq))
    }

    fn protocol_error(&mut self, detail: String, peer: &str) {
        self.failed
            .get_or_insert_with(|| format!("protocol error: {detail} (peer {peer})"));
    }
}

/// The receiving end of a connection (`recvComm`).
#[derive(Debug)]
pub struct RecvComm {
    link: Link,
    /// The eager messages' landing buffers, `EAGER_MAX` bytes each.
    bounce: MemoryRegion,
    /// CTS send buffers.
    cts_bufs: MemoryRegion,
    /// NCCL's registrations on this comm.
    pub regs: Mutex<Registrations>,
    state: Mutex<RecvState>,
}

impl RecvComm {
    /// Takes over a connected queue pair: allocates and posts the bounce receives.
    pub fn new(link: Link) -> Result<RecvComm> {
        let bounce = pin(
            &link.pd,
            BOUNCE_RING * EAGER_MAX as usize,
            Access::LOCAL_WRITE,
            "the bounce buffers",
            RECV_PINNED,
        )?;
        let cts_bufs = pin(
            &link.pd,
            CTS_SLOTS * CTS_LEN,
            Access::LOCAL_WRITE,
            "the clear-to-send buffers",
            RECV_PINNED,
        )?;
        PINNED.fetch_add(RECV_PINNED, Ordering::Relaxed);
        let comm = RecvComm {
            link,
            bounce,
            cts_bufs,
            regs: Mutex::new(Registrations::default()),
            state: Mutex::new(RecvState {
                reqs: [RecvReq::Free; NCCL_NET_MAX_REQUESTS],
                early: HashMap::new(),
                next_seq: 0,
                rendezvous: false,
                repost: (0..BOUNCE_RING).collect(),
                repost_wrs: Vec::with_capacity(BOUNCE_RING),
                pending_credits: 0,
                granted: BOUNCE_RING as u64,
                arrived: 0,
                cts_free: (0..CTS_SLOTS).rev().collect(),
                cts_queue: VecDeque::new(),
                failed: None,
            }),
        };
        {
            let mut st = comm.state.lock().expect("recv comm lock");
            comm.post_reposts(&mut st)?;
            // The initial receives are the sender's initial credits, not returns.
            st.pending_credits = 0;
        }
        Ok(comm)
    }

    /// The domain registrations go into.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.link.pd
    }

    /// Posts a receive of up to `size` bytes at `addr` (registered under `mhandle`). Returns
    /// the request slot, or None when every slot is busy.
    ///
    /// It does not poll the completion queue: an `irecv` often comes right after a receive
    /// completed and right before the reply to it, and polling runs the engine, which would
    /// first send the acknowledgement it holds for the message just received (and return
    /// credits). The next `test` polls. It posts the bounce buffers freed since the last call
    /// (no engine run, no datagram), and the only thing it may send is a CTS: for a message
    /// whose RTS came already, or ahead for a stream of large messages (see the module doc).
    pub fn irecv(&self, addr: u64, size: u64, mhandle: u64) -> Result<Option<usize>> {
        let rkey = self
            .regs
            .lock()
            .expect("registrations lock")
            .local(mhandle, addr, size)?
            .1;
        let mut st = self.state.lock().expect("recv comm lock");
        if let Some(detail) = &st.failed {
            // A message that arrived whole before the connection failed is still delivered.
            let arrived = matches!(st.early.get(&st.next_seq), Some(Early::Eager { .. }));
            if !arrived {
                return Err(self.link.remote_error(detail));
            }
        }
        let Some(slot) = st.reqs.iter().position(|r| *r == RecvReq::Free) else {
            self.progress(&mut st)?;
            return Ok(None);
        };
        let seq = st.next_seq;
        st.next_seq += 1;
        st.reqs[slot] = RecvReq::Posted {
            seq,
            addr,
            size,
            rkey,
            mhandle,
            cts_sent: false,
        };
        match st.early.remove(&seq) {
            Some(Early::Eager { bounce, len }) => self.deliver(&mut st, slot, bounce, len),
            Some(Early::Rts) => self.send_cts(&mut st, slot)?,
            None if st.rendezvous && size > EAGER_MAX => self.send_cts(&mut st, slot)?,
            None => {}
        }
        // Bounce buffers freed since the last call go back now, as a verbs application posts
        // its next receive before it replies. Posted from `test` instead (at its start, every
        // time or in batches), the round trip of the benchmark was 10-25 % slower at 8 B or at
        // 512 KiB: the post then meets the peer's next message in the engine.
        self.post_reposts(&mut st)?;
        Ok(Some(slot))
    }

    /// Whether request `slot` is done, and the message's byte count.
    pub fn test(&self, slot: usize) -> Result<Option<u64>> {
        let mut st = self.state.lock().expect("recv comm lock");
        let progressed = self.progress(&mut st);
        match st.reqs.get(slot).copied() {
            None | Some(RecvReq::Free) => Err(NetError::misuse(format!(
                "test on receive request {slot}, which is not outstanding"
            ))),
            Some(RecvReq::Done { len }) => {
                st.reqs[slot] = RecvReq::Free;
                Ok(Some(len))
            }
            Some(RecvReq::Truncated { seq, posted, sent }) => {
                st.reqs[slot] = RecvReq::Free;
                Err(NetError::Truncated { seq, posted, sent })
            }
            Some(RecvReq::Posted { .. }) => {
                progressed?;
                match &st.failed {
                    Some(detail) => Err(self.link.remote_error(detail)),
                    None => Ok(None),
                }
            }
        }
    }

    fn progress(&self, st: &mut RecvState) -> Result<()> {
        // What earlier calls freed is dealt with now, before polling, and in batches: bounce
        // buffers to post again, then credits to return. The call that freed them was
        // completing a receive, most likely with a reply about to be posted, and each of these
        // is an engine call (the credits, a datagram) that would have delayed it.
        if st.repost.len() >= REPOST_BATCH {
            self.post_reposts(st)?;
        }
        self.return_credits(st, CREDIT_BATCH)?;
        self.flush_cts(st)?;
        let mut wcs = [Completion::default(); POLL_BATCH];
        loop {
            let n = self.link.poll(&mut wcs)?;
            for c in &wcs[..n] {
                let wc = c.wc;
                if !wc.status.is_success() {
                    st.failed
                        .get_or_insert_with(|| self.link.failure("a request", wc.status));
                } else if matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                    self.on_arrival(st, &wc)?;
                } else if wc.wr_id & CTS_WR != 0 {
                    st.cts_free.push((wc.wr_id & SLOT_BITS) as usize);
                }
            }
            if n < wcs.len() {
                break;
            }
        }
        if st.failed.is_some() {
            return Ok(());
        }
        self.flush_cts(st)?;
        // The sender may be about to run out: do not wait for the next call, nor for a batch.
        if st.granted.saturating_sub(st.arrived) <= CREDIT_LOW {
            self.post_reposts(st)?;
            self.return_credits(st, 1)?;
        }
        Ok(())
    }

    /// A message consumed a bounce receive.
    fn on_arrival(&self, st: &mut RecvState, wc: &WorkCompletion) -> Result<()> {
        st.arrived += 1;
        let bounce = wc.wr_id as usize;
        let peer = &self.link.peer;
        let (Some(imm), true) = (wc.imm, bounce < BOUNCE_RING) else {
            st.protocol_error(format!("a message without a number ({wc:?})"), peer);
            return Ok(());
        };
        let Some(seq) = full_seq(st.next_seq, imm & SEQ_MASK) else {
            st.protocol_error(
                format!("message number {} out of range", imm & SEQ_MASK),
                peer,
            );
            return Ok(());
        };
        let slot = st.posted(seq);
        if slot.is_none() && seq < st.next_seq {
            st.protocol_error(format!("message {seq} arrived twice"), peer);
            return Ok(());
        }
        // A sender spends one credit per message, and holds at most `BOUNCE_RING` beyond
        // the receives posted so far: a message further ahead (or a repeat of one waiting) is
        // a peer ignoring the protocol, and keeping it would let the peer grow `early` at will.
        if slot.is_none()
            && (seq >= st.next_seq + EARLY_AHEAD as u64 || st.early.contains_key(&seq))
        {
            st.protocol_error(
                format!("message {seq} is beyond what its credits allow"),
                peer,
            );
            return Ok(());
        }
        if wc.opcode == WcOpcode::RecvRdmaWithImm {
            st.repost.push(bounce);
            st.rendezvous = true;
            match slot.map(|s| (s, st.reqs[s])) {
                Some((
                    s,
                    RecvReq::Posted {
                        size,
                        cts_sent: true,
                        ..
                    },
                )) => {
                    st.reqs[s] = if imm & TRUNCATED != 0 {
                        RecvReq::Truncated {
                            seq,
                            posted: size,
                            sent: 0,
                        }
                    } else if wc.byte_len > size {
                        // The rkey covers NCCL's whole registration, not just this receive:
                        // a length beyond what the CTS offered is the peer's lie.
                        st.protocol_error(
                            format!(
                                "message {seq} claims {} bytes, its receive holds {size}",
                                wc.byte_len
                            ),
                            peer,
                        );
                        return Ok(());
                    } else {
                        RecvReq::Done { len: wc.byte_len }
                    };
                }
                _ => st.protocol_error(format!("a write for message {seq}, never cleared"), peer),
            }
        } else if imm & RTS != 0 {
            st.repost.push(bounce);
            st.rendezvous = true;
            match slot {
                Some(s) => self.send_cts(st, s)?,
                None => {
                    st.early.insert(seq, Early::Rts);
                }
            }
        } else {
            st.rendezvous = false;
            match slot {
                Some(s) => self.deliver(st, s, bounce, wc.byte_len),
                None => {
                    st.early.insert(
                        seq,
                        Early::Eager {
                            bounce,
                            len: wc.byte_len,
                        },
                    );
                }
            }
        }
        Ok(())
    }

    /// Completes receive `slot` with the eager message in `bounce`, and frees the bounce.
    fn deliver(&self, st: &mut RecvState, slot: usize, bounce: usize, len: u64) {
        let RecvReq::Posted {
            seq,
            addr,
            size,
            mhandle,
            ..
        } = st.reqs[slot]
        else {
            return;
        };
        st.repost.push(bounce);
        if len > size {
            st.reqs[slot] = RecvReq::Truncated {
                seq,
                posted: size,
                sent: len,
            };
            return;
        }
        if len > 0 {
            let regs = self.regs.lock().expect("registrations lock");
            match regs.covering(mhandle, addr, len) {
                Ok(reg) => {
                    self.bounce.copy_to(
                        bounce * EAGER_MAX as usize,
                        &reg.mr,
                        (addr - reg.addr) as usize,
                        len as usize,
                    );
                }
                Err(e) => {
                    st.failed
                        .get_or_insert_with(|| format!("receive {seq} lost its memory: {e}"));
                    return;
                }
            }
        }
        st.reqs[slot] = RecvReq::Done { len };
    }

    /// Sends the CTS of receive `slot` (once), or queues it until a CTS buffer is free.
    fn send_cts(&self, st: &mut RecvState, slot: usize) -> Result<()> {
        let RecvReq::Posted {
            seq,
            cts_sent: false,
            ..
        } = st.reqs[slot]
        else {
            return Ok(());
        };
        if let RecvReq::Posted { cts_sent, .. } = &mut st.reqs[slot] {
            *cts_sent = true;
        }
        if st.cts_free.is_empty() {
            st.cts_queue.push_back(seq);
            Ok(())
        } else {
            self.post_cts(st, slot)
        }
    }

    /// Sends the queued CTSs, as far as buffers allow.
    fn flush_cts(&self, st: &mut RecvState) -> Result<()> {
        while !st.cts_free.is_empty() && st.failed.is_none() {
            let Some(seq) = st.cts_queue.pop_front() else {
                break;
            };
            // A receive whose message came eagerly meanwhile needs no CTS any more.
            if let Some(slot) = st.posted(seq) {
                self.post_cts(st, slot)?;
            }
        }
        Ok(())
    }

    /// Posts the CTS of receive `slot` into a free buffer (the caller checked there is one).
    fn post_cts(&self, st: &mut RecvState, slot: usize) -> Result<()> {
        let RecvReq::Posted {
            seq,
            addr,
            size,
            rkey,
            ..
        } = st.reqs[slot]
        else {
            return Ok(());
        };
        let Some(buf) = st.cts_free.pop() else {
            st.cts_queue.push_front(seq);
            return Ok(());
        };
        let cts = Cts {
            addr,
            rkey,
            size,
            seq,
        };
        self.cts_bufs.write(buf * CTS_LEN, &cts.encode());
        // The credits for the receives posted again so far ride along.
        self.link
            .qp
            .post_send(&[SendWr {
                wr_id: CTS_WR | buf as u64,
                local: self.cts_bufs.sge(buf * CTS_LEN, CTS_LEN),
                op: SendOp::Send {
                    imm: Some(st.pending_credits as u32),
                },
            }])
            .map_err(NetError::verbs("sending a clear-to-send"))?;
        st.granted += st.pending_credits;
        st.pending_credits = 0;
        Ok(())
    }

    /// Posts the freed bounce buffers as receives again; each becomes a credit to return.
    fn post_reposts(&self, st: &mut RecvState) -> Result<()> {
        if st.repost.is_empty() || st.failed.is_some() {
            return Ok(());
        }
        let stride = EAGER_MAX as usize;
        let mut wrs = std::mem::take(&mut st.repost_wrs);
        wrs.clear();
        wrs.extend(st.repost.iter().map(|&b| RecvWr {
            wr_id: b as u64,
            local: self.bounce.sge(b * stride, stride),
        }));
        let posted = self
            .link
            .qp
            .post_recv(&wrs)
            .map_err(NetError::verbs("posting bounce receives"));
        let count = wrs.len() as u64;
        st.repost_wrs = wrs;
        posted?;
        st.pending_credits += count;
        st.repost.clear();
        Ok(())
    }

    /// Returns the pending credits in a message of their own if there are at least `batch`.
    fn return_credits(&self, st: &mut RecvState, batch: u64) -> Result<()> {
        if st.pending_credits < batch.max(1) || st.failed.is_some() {
            return Ok(());
        }
        self.link
            .qp
            .post_send(&[SendWr {
                wr_id: CREDIT_WR,
                local: no_data(),
                op: SendOp::Send {
                    imm: Some(st.pending_credits as u32),
                },
            }])
            .map_err(NetError::verbs("returning credits"))?;
        st.granted += st.pending_credits;
        st.pending_credits = 0;
        Ok(())
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        PINNED.fetch_sub(RECV_PINNED, Ordering::Relaxed);
    }
}

#[cfg(test)]
impl RecvComm {
    /// No message waits for its `irecv`.
    pub(super) fn settled(&self) -> bool {
        self.state.lock().unwrap().early.is_empty()
    }
}
