//! One NCCL connection end (a send comm or a receive comm) and the small protocol it runs over
//! one tbrdma queue pair. It owns the queue pair, its completion queue, the memory
//! registrations NCCL made on the comm, its own bounce and control buffers and the request
//! slots; it never blocks and never touches a C pointer (addresses arrive as integers, checked
//! against the registrations, and NCCL's memory is only written through its registration).
//!
//! The protocol (`docs/nccl.md`, "Protocol"). Messages are numbered per connection in post
//! order on both sides (the k-th `isend` is message k, and so is the k-th `irecv`) and every
//! match is by that number, so matching is in order, as NCCL requires, whatever order the
//! messages arrive in.
//!
//! - **Eager** (at most [`EAGER_MAX`] bytes, and no CTS at hand): one SEND, immediate = the
//!   message number, into one of the [`BOUNCE_RING`] bounce buffers the receive comm registered
//!   and posted as receives when it was created. The sender sends from a copy in one of its
//!   [`STAGE_SLOTS`] staging buffers when one is free, and the request is complete at once
//!   (see the constant for why); otherwise from NCCL's buffer, complete when acknowledged.
//!   Once the `irecv` with that number exists (posted before or after the arrival), the bytes
//!   are copied into NCCL's buffer and the receive completes; a message that comes first waits
//!   in its bounce buffer, never dropped. A freed bounce buffer is posted again by the next
//!   `irecv` (as a verbs application posts its next receive before it replies) or, failing
//!   that, in batches ([`REPOST_BATCH`]) at the start of a `test`. One datagram per message,
//!   and nothing from the receiver before it.
//! - **Rendezvous** (larger messages): the data is a WRITE_WITH_IMM straight into NCCL's
//!   receive buffer, as the receiver's clear-to-send (CTS: address, rkey, capacity, message
//!   number) describes it. The receiver sends the CTS of a receive (a) when the sender asks,
//!   with a request-to-send (RTS: a zero-length SEND, immediate = number | [`RTS`]), or (b) at
//!   `irecv` time when the receive can hold more than `EAGER_MAX` and the last message to
//!   arrive came by rendezvous: a stream of large messages then needs no RTS and no extra
//!   round trip, and a stream of small ones no CTS at all (NCCL posts every receive with its
//!   full slot size, so the capacity alone says nothing). The sender matches CTSs by number,
//!   not in arrival order: a CTS for a message that already went eagerly is dropped, one for a
//!   message not posted yet is kept for it, and a message with a CTS at hand is written
//!   directly whatever its size (unless it can be staged). An RTS crossing a CTS sent under
//!   (b) is ignored.
//! - **Credits**: every eager SEND, RTS and WRITE_WITH_IMM consumes one posted bounce receive,
//!   so the sender sends only with a credit in hand: it starts with `BOUNCE_RING`, and the
//!   receiver returns the receives it posts again in the immediate of the SENDs it makes
//!   anyway (CTSs), or in a zero-length credit SEND once [`CREDIT_BATCH`] have gathered (at
//!   the start of its next `test`, off the path of the exchange that freed them) or at once
//!   when the sender may be down to [`CREDIT_LOW`]. The sender keeps one credit in reserve per RTS
//!   it sent, so the write each RTS announces can always go, even when eager messages waiting
//!   for their `irecv` fill every other bounce buffer. A send without a credit (or waiting
//!   for its CTS) is held in its request, in post order: `isend` never fails or blocks for it.
//! - **Too large**: a rendezvous message larger than the CTS capacity is not transmitted; the
//!   sender writes zero bytes with the [`TRUNCATED`] bit instead and both requests fail with
//!   `ncclInvalidUsage`. An eager message larger than its receive is caught by the receiver
//!   alone (nothing is copied, the receive fails with `ncclInvalidUsage`); its send completed
//!   already, as in NCCL's own socket transport. Either way the connection stays usable.
//!
//! Receiver-not-ready never happens in steady state: the sender spends credits only on
//! receives the receiver has posted, and the receiver's control SENDs (CTSs, credits) go into
//! [`CTRL_RING`] receives, more than it can have unread at the sender (the bound is at the
//! constant). Only a connection's first messages can race the other end's setup.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use tbrdma_proto::codec::{Put, Reader, SliceWriter};
use tbrdma_verbs::{
    Access, Completion, CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair, RecvWr,
    RemoteAddr, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

use crate::abi::NCCL_NET_MAX_REQUESTS;
use crate::error::{NetError, Result};

/// Largest message sent eagerly. Below it, copying out of the bounce buffer (about 1 µs for
/// 16 KiB) costs less than a rendezvous, whose CTS is a datagram with a syscall at each end
/// (several µs) and, when the receiver has not sent it ahead, a whole extra round trip. Above
/// it the copy grows with the size while the CTS cost stays fixed (and is usually hidden by
/// CTSs sent ahead). It also bounds the bounce memory, which is pinned: [`BOUNCE_RING`] ×
/// 16 KiB = 512 KiB per receive comm, against a default `RLIMIT_MEMLOCK` of 8 MiB.
pub const EAGER_MAX: u64 = 16 << 10;
/// Bounce buffers (posted receives) per receive comm: the sender's credits. Enough for 32
/// requests in flight eagerly; more would only pin more memory.
pub const BOUNCE_RING: usize = NCCL_NET_MAX_REQUESTS;
/// Bytes of a clear-to-send descriptor.
pub const CTS_LEN: usize = 32;
/// Control receives (for CTSs and credit messages) the sender keeps posted. Between two polls
/// of the sender, the receiver can send at most one CTS per receive outstanding (32) or
/// completed meanwhile by a message already in flight (at most `BOUNCE_RING`), and one credit
/// message per message that arrived meanwhile (at most `BOUNCE_RING`); fewer than
/// `CTRL_REPOST_BATCH` more wait to be posted again: 128 with room to spare.
pub const CTRL_RING: usize = 256;
/// CTS send buffers on the receiver (a buffer is free again when its SEND completes).
const CTS_SLOTS: usize = 2 * NCCL_NET_MAX_REQUESTS;
/// Staging buffers of `EAGER_MAX` bytes on the sender: an eager message copied into one
/// completes its request at once instead of when the peer acknowledges it (that
/// acknowledgement travels on the connection of the other direction's data, so no reply can
/// carry it: waiting for it put a datagram on every round trip). A buffer is free again when
/// its SEND is acknowledged, about one round trip later, so a few cover a ping-pong and a
/// stream falls back to sending from NCCL's buffer. 16 × 16 KiB = 256 KiB pinned per send comm.
pub const STAGE_SLOTS: usize = 16;
/// Credits the receiver gathers before it returns them in a message of their own: one credit
/// datagram per 16 messages in a ping-pong.
pub const CREDIT_BATCH: u64 = 16;
/// When the sender may hold no more than this many credits, the receiver returns what it has
/// at once, so a sender streaming messages does not stall.
pub const CREDIT_LOW: u64 = 8;
/// Freed bounce buffers a `test` posts again in one call when no `irecv` did (sooner when the
/// sender may be running out of credits): each post is an engine call, and an engine call on
/// the path of an exchange can make the other side's thread wait for the engine.
pub const REPOST_BATCH: usize = 8;
/// Control receives the sender posts again in one call, for the same reason.
pub const CTRL_REPOST_BATCH: usize = 32;
/// Completion-queue capacity: more than the completions either end can have unread.
pub const CQ_CAPACITY: usize = 1024;
// 32 eager sends in flight need no credit back; no control receive overflow; batching alone
// never brings the sender down to `CREDIT_LOW`; no completion-queue overflow (sender: control
// receives and two sends per request; receiver: bounce receives, CTS sends and at most one
// credit send per call in between).
const _: () = {
    assert!(BOUNCE_RING >= NCCL_NET_MAX_REQUESTS);
    assert!(CTRL_RING >= NCCL_NET_MAX_REQUESTS + 2 * BOUNCE_RING + CTRL_REPOST_BATCH);
    assert!(REPOST_BATCH + (CREDIT_BATCH as usize) + (CREDIT_LOW as usize) <= BOUNCE_RING);
    assert!(CQ_CAPACITY >= CTRL_RING + 2 * NCCL_NET_MAX_REQUESTS + STAGE_SLOTS);
    assert!(CQ_CAPACITY >= BOUNCE_RING + CTS_SLOTS + 4 * NCCL_NET_MAX_REQUESTS);
    assert!(CREDIT_LOW < CREDIT_BATCH && (CREDIT_BATCH as usize) <= BOUNCE_RING);
};

// Immediate data of the sender's messages: the message number's low 30 bits and a flag.
const SEQ_BITS: u32 = 30;
const SEQ_MASK: u32 = (1 << SEQ_BITS) - 1;
/// On a SEND: a request-to-send (no data).
pub const RTS: u32 = 1 << 30;
/// On a WRITE_WITH_IMM: the send was refused for being larger than the receive (no data).
pub const TRUNCATED: u32 = 1 << 31;

/// `wr_id` tag of the sender's RTSs (the low bits are the request slot).
const RTS_WR: u64 = 1 << 32;
/// `wr_id` tag of the sender's staged eager SENDs (the low bits are the staging buffer).
const STAGE_WR: u64 = 1 << 33;
/// `wr_id` tag of the receiver's CTS sends (the low bits are the CTS buffer).
const CTS_WR: u64 = 1 << 32;
/// `wr_id` tag of the receiver's credit messages.
const CREDIT_WR: u64 = 1 << 33;
const SLOT_BITS: u64 = 0xffff_ffff;
/// Completions taken from the queue per poll.
const POLL_BATCH: usize = 32;

/// Sends, over every comm of the process, that wait for a credit or a CTS. While it is not
/// zero, every `test` also progresses the other send comms ([`SendComm::try_progress`]), so a
/// send whose credit or CTS arrives goes out even if NCCL is busy testing another connection.
pub static WAITING_SENDS: AtomicUsize = AtomicUsize::new(0);

fn seq_imm(seq: u64) -> u32 {
    (seq as u32) & SEQ_MASK
}

/// The full message number whose low bits are `low`, nearest to `next` (the receiver's next
/// `irecv` number; every message in flight is within far less than 2^29 of it).
fn full_seq(next: u64, low: u32) -> Option<u64> {
    let ahead = low.wrapping_sub(next as u32) & SEQ_MASK;
    if ahead < 1 << (SEQ_BITS - 1) {
        Some(next + u64::from(ahead))
    } else {
        next.checked_sub(u64::from(SEQ_MASK - ahead + 1))
    }
}

fn no_data() -> Sge {
    Sge {
        addr: 0,
        len: 0,
        lkey: 0,
    }
}

/// A memory registration NCCL made on a comm (`mhandle`).
#[derive(Debug)]
pub struct Registration {
    /// First byte.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// The region (dropping it revokes the keys).
    pub mr: MemoryRegion,
}

/// The registrations of one comm, named by small integers (the `mhandle`s NCCL holds).
#[derive(Debug, Default)]
pub struct Registrations {
    next: u64,
    map: HashMap<u64, Registration>,
}

impl Registrations {
    /// Stores a registration and returns its handle (never 0).
    pub fn insert(&mut self, reg: Registration) -> u64 {
        self.next += 1;
        self.map.insert(self.next, reg);
        self.next
    }

    /// Removes a registration; false if the handle is unknown.
    pub fn remove(&mut self, handle: u64) -> bool {
        self.map.remove(&handle).is_some()
    }

    /// The registration under `handle` if it holds `len` bytes at `addr`.
    fn covering(&self, handle: u64, addr: u64, len: u64) -> Result<&Registration> {
        let reg = self
            .map
            .get(&handle)
            .ok_or_else(|| NetError::misuse(format!("unknown memory handle {handle:#x}")))?;
        let inside = addr >= reg.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= reg.addr + reg.len);
        if !inside {
            return Err(NetError::misuse(format!(
                "buffer {addr:#x}+{len} is outside the registration {:#x}+{}",
                reg.addr, reg.len
            )));
        }
        Ok(reg)
    }

    /// Keys and bounds check for `len` bytes at `addr` under `handle`. Zero-length messages
    /// are not checked (NCCL may pass a handle that does not cover them).
    fn local(&self, handle: u64, addr: u64, len: u64) -> Result<(u32, u32)> {
        if len == 0 {
            return Ok(self.map.get(&handle).map_or((0, 0), |r| (0, r.mr.rkey())));
        }
        let reg = self.covering(handle, addr, len)?;
        Ok((reg.mr.lkey(), reg.mr.rkey()))
    }
}

/// The queue pair and what belongs to it.
#[derive(Debug)]
pub struct Link {
    /// The connected queue pair.
    pub qp: QueuePair,
    /// Its completion queue (send and receive).
    pub cq: CompletionQueue,
    /// The domain NCCL's registrations and the comm's own buffers go into.
    pub pd: ProtectionDomain,
    /// The peer, for messages.
    pub peer: String,
}

impl Link {
    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        self.cq.poll(out).map_err(|e| NetError::Remote {
            peer: self.peer.clone(),
            detail: e.to_string(),
        })
    }

    fn failure(&self, what: &str, status: WcStatus) -> String {
        format!("{what} completed with {status:?} (peer {})", self.peer)
    }

    fn remote_error(&self, detail: &str) -> NetError {
        NetError::Remote {
            peer: self.peer.clone(),
            detail: detail.to_string(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cts {
    addr: u64,
    rkey: u32,
    size: u64,
    seq: u64,
}

impl Cts {
    fn encode(&self) -> [u8; CTS_LEN] {
        let mut b = [0u8; CTS_LEN];
        let mut w = SliceWriter::new(&mut b);
        w.put_u64(self.addr);
        w.put_u32(self.rkey);
        w.put_zeros(4);
        w.put_u64(self.size);
        w.put_u64(self.seq);
        b
    }

    /// `None` only for fewer than [`CTS_LEN`] bytes.
    fn decode(b: &[u8]) -> Option<Cts> {
        let mut r = Reader::new(b);
        let addr = r.u64()?;
        let rkey = r.u32()?;
        r.skip(4)?;
        Some(Cts {
            addr,
            rkey,
            size: r.u64()?,
            seq: r.u64()?,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Sending end

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
        if queued || cts.seq >= self.next_seq {
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
        let ctrl = link
            .pd
            .alloc_mr(CTRL_RING * CTS_LEN, Access::LOCAL_WRITE)
            .map_err(NetError::verbs("allocating the control receives"))?;
        let wrs: Vec<RecvWr> = (0..CTRL_RING)
            .map(|i| RecvWr {
                wr_id: i as u64,
                local: ctrl.sge(i * CTS_LEN, CTS_LEN),
            })
            .collect();
        link.qp
            .post_recv(&wrs)
            .map_err(NetError::verbs("posting the control receives"))?;
        let stage = link
            .pd
            .alloc_mr(STAGE_SLOTS * EAGER_MAX as usize, Access::LOCAL_WRITE)
            .map_err(NetError::verbs("allocating the staging buffers"))?;
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
    }
}

// ---------------------------------------------------------------------------------------
// Receiving end

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
        let bounce = link
            .pd
            .alloc_mr(BOUNCE_RING * EAGER_MAX as usize, Access::LOCAL_WRITE)
            .map_err(NetError::verbs("allocating the bounce buffers"))?;
        let cts_bufs = link
            .pd
            .alloc_mr(CTS_SLOTS * CTS_LEN, Access::LOCAL_WRITE)
            .map_err(NetError::verbs("allocating the clear-to-send buffers"))?;
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
            return Err(self.link.remote_error(detail));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cts_round_trips() {
        let c = Cts {
            addr: 0x7f00_1234_5678,
            rkey: 0xdead_beef,
            size: 8 << 20,
            seq: 1 << 40,
        };
        assert_eq!(Cts::decode(&c.encode()), Some(c));
    }

    #[test]
    fn message_numbers_are_rebuilt_from_their_low_bits() {
        for next in [0u64, 5, 1 << 29, (1 << 30) - 3, (1 << 30) + 7, 77 << 30] {
            for seq in [next.saturating_sub(40), next, next + 1, next + 100] {
                assert_eq!(
                    full_seq(next, seq_imm(seq)),
                    Some(seq),
                    "next {next} seq {seq}"
                );
            }
        }
        // Behind message 0 there is nothing.
        assert_eq!(full_seq(0, SEQ_MASK), None);
        // The flags never leak into the number.
        assert_eq!(seq_imm((1 << 30) + 9) & (RTS | TRUNCATED), 0);
    }

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

/// The protocol end to end over a real queue pair (127.0.0.1, caller progress), driven from
/// one thread by random schedules of posts and tests: sends and receives posted in any order
/// and far ahead of each other, requests tested in any order, sizes from 0 B to 64 KiB around
/// the eager limit, some receives too small.
#[cfg(test)]
mod wire_tests {
    use std::time::{Duration, Instant};

    use tbrdma_verbs::{Device, DeviceConfig, EngineConfig, Listener, Progress, QpOptions};

    use super::*;

    /// Buffer of one outstanding request.
    const SLOT: u64 = 64 << 10;
    const SLOTS: usize = NCCL_NET_MAX_REQUESTS;

    fn pair() -> (SendComm, RecvComm) {
        let config = DeviceConfig {
            engine: EngineConfig {
                progress: Progress::Caller,
                ..Default::default()
            },
            port: 0,
        };
        let dev = Device::open("127.0.0.1", config).expect("device");
        let pd = dev.alloc_pd();
        let listener = Listener::bind(&dev, 0).expect("listen");
        let server = listener.local_addr().expect("listening address");
        let (rpd, rcq) = (pd.clone(), dev.create_cq(CQ_CAPACITY));
        let acceptor = std::thread::spawn(move || {
            let wait = Some(Duration::from_secs(10));
            let c = listener
                .accept(&rpd, &rcq, &rcq, &QpOptions::default(), wait)
                .expect("accept");
            let link = Link {
                qp: c.qp,
                cq: rcq,
                pd: rpd,
                peer: "receiver".into(),
            };
            RecvComm::new(link).expect("receive comm")
        });
        let scq = dev.create_cq(CQ_CAPACITY);
        let c =
            tbrdma_verbs::connect(&pd, server, &scq, &scq, &QpOptions::default()).expect("connect");
        let link = Link {
            qp: c.qp,
            cq: scq,
            pd,
            peer: "sender".into(),
        };
        let send = SendComm::new(link).expect("send comm");
        (send, acceptor.join().expect("acceptor"))
    }

    /// Registers `SLOTS` request buffers on a comm; returns the handle and the first address.
    fn register(pd: &ProtectionDomain, regs: &Mutex<Registrations>) -> (u64, u64) {
        let len = SLOTS as u64 * SLOT;
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let mr = pd.alloc_mr(len as usize, access).expect("region");
        let addr = mr.addr();
        let handle = regs.lock().unwrap().insert(Registration { addr, len, mr });
        (handle, addr)
    }

    fn byte(message: usize, at: u64) -> u8 {
        ((message as u64).wrapping_mul(0x9e37) ^ at.wrapping_mul(31)) as u8
    }

    /// Message `i`: its size (at most `max`) and the capacity of its receive.
    fn plan(next: &mut impl FnMut() -> u64, messages: usize, max: u64) -> Vec<(u64, u64)> {
        (0..messages)
            .map(|_| {
                let size = match next() % 8 {
                    0 => 0,
                    1 => next() % 64,
                    2 | 3 => next() % (EAGER_MAX + 1),
                    4 => EAGER_MAX - 1 + next() % 3,
                    _ => 1 + next() % SLOT,
                }
                .min(max);
                let capacity = if size > 0 && next() % 16 == 0 {
                    next() % size
                } else if next() % 2 == 0 {
                    SLOT
                } else {
                    size + next() % (SLOT - size + 1)
                };
                (size, capacity)
            })
            .collect()
    }

    fn run(seed: u64, messages: usize, max: u64) {
        let (send, recv) = pair();
        let (sh, saddr) = register(send.pd(), &send.regs);
        let (rh, raddr) = register(recv.pd(), &recv.regs);
        let mut rng = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let plan = plan(&mut next, messages, max);
        let (mut send_bufs, mut recv_bufs): (Vec<usize>, Vec<usize>) =
            ((0..SLOTS).collect(), (0..SLOTS).collect());
        // Outstanding requests: (message, request slot, buffer).
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        let (mut posted_sends, mut posted_recvs, mut done_sends, mut done_recvs) = (0, 0, 0, 0);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut step = 0u64;
        while done_sends < messages || done_recvs < messages {
            assert!(
                Instant::now() < deadline,
                "seed {seed}: stuck at {done_sends} sends and {done_recvs} receives done \
                 ({posted_sends} and {posted_recvs} posted)"
            );
            step += 1;
            // Phases that favour one side, so that each runs far ahead of the other.
            let bias = (step / 300) % 3;
            let op = next() % 6;
            let op = match (bias, op) {
                (1, 4 | 5) => 0,
                (2, 4 | 5) => 1,
                (_, 4 | 5) => 2 + next() % 2,
                (_, op) => op,
            };
            match op {
                0 if posted_sends < messages && !send_bufs.is_empty() => {
                    let (size, _) = plan[posted_sends];
                    let buf = send_bufs.pop().unwrap();
                    let at = buf as u64 * SLOT;
                    let data: Vec<u8> = (0..size).map(|k| byte(posted_sends, k)).collect();
                    send.regs.lock().unwrap().map[&sh]
                        .mr
                        .write(at as usize, &data);
                    match send.isend(saddr + at, size, sh).expect("isend") {
                        Some(slot) => {
                            sends.push((posted_sends, slot, buf));
                            posted_sends += 1;
                        }
                        None => send_bufs.push(buf),
                    }
                }
                1 if posted_recvs < messages && !recv_bufs.is_empty() => {
                    let (_, capacity) = plan[posted_recvs];
                    let buf = recv_bufs.pop().unwrap();
                    let at = raddr + buf as u64 * SLOT;
                    match recv.irecv(at, capacity, rh).expect("irecv") {
                        Some(slot) => {
                            recvs.push((posted_recvs, slot, buf));
                            posted_recvs += 1;
                        }
                        None => recv_bufs.push(buf),
                    }
                }
                2 if !sends.is_empty() => {
                    let pick = (next() % sends.len() as u64) as usize;
                    let (i, slot, buf) = sends[pick];
                    let (size, capacity) = plan[i];
                    let finished = match send.test(slot) {
                        Ok(None) => false,
                        Ok(Some(len)) => {
                            assert_eq!(len, size, "seed {seed}: send {i} size");
                            true
                        }
                        Err(NetError::Truncated { .. }) => {
                            assert!(capacity < size, "seed {seed}: send {i} refused");
                            true
                        }
                        Err(e) => panic!("seed {seed}: send {i}: {e}"),
                    };
                    if finished {
                        sends.swap_remove(pick);
                        send_bufs.push(buf);
                        done_sends += 1;
                    }
                }
                3 if !recvs.is_empty() => {
                    let pick = (next() % recvs.len() as u64) as usize;
                    let (i, slot, buf) = recvs[pick];
                    let (size, capacity) = plan[i];
                    let finished = match recv.test(slot) {
                        Ok(None) => false,
                        Ok(Some(len)) => {
                            assert!(capacity >= size, "seed {seed}: receive {i} not refused");
                            assert_eq!(len, size, "seed {seed}: receive {i} size");
                            let mut got = vec![0u8; size as usize];
                            let at = buf as u64 * SLOT;
                            recv.regs.lock().unwrap().map[&rh]
                                .mr
                                .read(at as usize, &mut got);
                            let want: Vec<u8> = (0..size).map(|k| byte(i, k)).collect();
                            assert!(got == want, "seed {seed}: receive {i} data differs");
                            true
                        }
                        Err(NetError::Truncated { .. }) => {
                            assert!(capacity < size, "seed {seed}: receive {i} refused");
                            true
                        }
                        Err(e) => panic!("seed {seed}: receive {i}: {e}"),
                    };
                    if finished {
                        recvs.swap_remove(pick);
                        recv_bufs.push(buf);
                        done_recvs += 1;
                    }
                }
                _ => {}
            }
        }
        let st = send.state.lock().unwrap();
        assert!(st.queue.is_empty() && st.owed.is_empty() && st.cts.is_empty());
        assert!(recv.state.lock().unwrap().early.is_empty());
    }

    #[test]
    fn random_schedules_deliver_every_message_in_order() {
        for seed in 1..=8 {
            run(seed, 500, SLOT);
        }
    }

    /// No rendezvous, hence no CTS to carry credits back: only the credit messages do.
    #[test]
    fn eager_only_schedules_get_their_credits_back() {
        for seed in 11..=14 {
            run(seed, 500, EAGER_MAX);
        }
    }
}
