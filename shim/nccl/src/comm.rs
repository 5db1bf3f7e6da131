//! One NCCL connection end (a send comm or a receive comm) and the small protocol it runs over
//! one tbrdma queue pair. It owns the queue pair, its completion queue, the memory
//! registrations NCCL made on the comm and the request slots; it never blocks and never
//! touches a C pointer (addresses arrive as integers, checked against the registrations).
//!
//! The protocol (`docs/nccl.md`, "Protocol"): the receiver answers each `irecv` by posting a
//! zero-length receive and then SENDing a 32-byte clear-to-send (CTS) descriptor (buffer
//! address, rkey, capacity, message number) into one of the sender's 64 pre-posted control
//! receives. The sender matches CTS k with its k-th `isend` (both sides count in post order,
//! so matching is FIFO per connection) and WRITE_WITH_IMMs the data straight into the
//! receiver's buffer, the immediate carrying the message number. The WRITE_WITH_IMM consumes
//! the zero-length receive, whose completion gives the receiver the byte count. A send posted
//! before its CTS arrives waits in the sender (held, never dropped). A send larger than the
//! CTS capacity is not transmitted: the sender posts a zero-length WRITE_WITH_IMM with the
//! "truncated" bit instead, and both requests fail with `ncclInvalidUsage`; the connection
//! stays usable. Neither side can ever hit receiver-not-ready in steady state: the sender
//! has more control receives posted (64) than the receiver can have CTSs outstanding (32),
//! and the receiver posts the data receive before its CTS.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use tbrdma_verbs::{
    Access, Completion, CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair, RecvWr,
    RemoteAddr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};

use crate::abi::NCCL_NET_MAX_REQUESTS;
use crate::error::{NetError, Result};

/// Bytes of a clear-to-send descriptor.
pub const CTS_LEN: usize = 32;
/// Control slots per connection: more than the receiver can have outstanding.
pub const CTS_RING: usize = 2 * NCCL_NET_MAX_REQUESTS;
/// Completion-queue capacity: every request and control slot at once, with room to spare.
pub const CQ_CAPACITY: usize = 4 * CTS_RING;
// No receiver-not-ready in steady state, and no completion-queue overflow.
const _: () = {
    assert!(CTS_RING > NCCL_NET_MAX_REQUESTS);
    assert!(CQ_CAPACITY >= CTS_RING + 2 * NCCL_NET_MAX_REQUESTS);
};
/// Immediate-data bit of a send refused for being larger than the receive.
const TRUNCATED: u32 = 1 << 31;
const SEQ_MASK: u32 = TRUNCATED - 1;
/// `wr_id` bit marking the receiver's CTS sends (the low bits are the ring slot).
const CTS_WR: u64 = 1 << 32;
/// Completions taken from the queue per poll.
const POLL_BATCH: usize = 32;

/// Sends, over every comm of the process, that wait for their CTS. While it is not zero, every
/// data call also progresses the other send comms ([`SendComm::try_progress`]), so a send
/// whose CTS arrives is transmitted even if NCCL is busy testing another connection.
pub static WAITING_SENDS: AtomicUsize = AtomicUsize::new(0);

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

    /// Keys and bounds check for `len` bytes at `addr` under `handle`. Zero-length messages
    /// are not checked (NCCL may pass a handle that does not cover them).
    fn local(&self, handle: u64, addr: u64, len: u64) -> Result<(u32, u32)> {
        if len == 0 {
            return Ok(self.map.get(&handle).map_or((0, 0), |r| (0, r.mr.rkey())));
        }
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
    /// The domain NCCL's registrations go into.
    pub pd: ProtectionDomain,
    /// CTS ring: receive buffers on the sender, send buffers on the receiver.
    pub ctrl: MemoryRegion,
    /// The peer, for messages.
    pub peer: String,
}

impl Link {
    /// Allocates the control ring for a new connection.
    pub fn ctrl_region(pd: &ProtectionDomain) -> Result<MemoryRegion> {
        pd.alloc_mr(CTS_RING * CTS_LEN, Access::LOCAL_WRITE)
            .map_err(NetError::verbs("allocating the control ring"))
    }

    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        self.cq.poll(out).map_err(|e| NetError::Remote {
            peer: self.peer.clone(),
            detail: e.to_string(),
        })
    }

    fn failure(&self, what: &str, status: WcStatus) -> String {
        format!("{what} completed with {status:?} (peer {})", self.peer)
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
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    fn decode(b: &[u8; CTS_LEN]) -> Cts {
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Cts {
            addr: u64_at(0),
            rkey: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            size: u64_at(16),
            seq: u64_at(24),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SendReq {
    Free,
    /// Posted by NCCL, waiting for its CTS.
    Waiting {
        seq: u64,
        addr: u64,
        len: u64,
        lkey: u32,
    },
    /// WRITE_WITH_IMM posted; `refused` holds the receive's capacity when it was too small.
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
    /// Slots waiting for a CTS, in post order.
    waiting: VecDeque<usize>,
    /// CTSs received and not yet matched, in arrival order.
    cts: VecDeque<Cts>,
    next_seq: u64,
    failed: Option<String>,
}

/// The sending end of a connection (`sendComm`).
#[derive(Debug)]
pub struct SendComm {
    link: Link,
    /// NCCL's registrations on this comm.
    pub regs: Mutex<Registrations>,
    state: Mutex<SendState>,
}

impl SendComm {
    /// Takes over a connected queue pair: posts the control receives.
    pub fn new(link: Link) -> Result<SendComm> {
        let wrs: Vec<RecvWr> = (0..CTS_RING)
            .map(|i| RecvWr {
                wr_id: i as u64,
                local: link.ctrl.sge(i * CTS_LEN, CTS_LEN),
            })
            .collect();
        link.qp
            .post_recv(&wrs)
            .map_err(NetError::verbs("posting the control receives"))?;
        Ok(SendComm {
            link,
            regs: Mutex::new(Registrations::default()),
            state: Mutex::new(SendState {
                reqs: [SendReq::Free; NCCL_NET_MAX_REQUESTS],
                waiting: VecDeque::new(),
                cts: VecDeque::new(),
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
        self.progress(&mut st)?;
        let Some(slot) = st.reqs.iter().position(|r| *r == SendReq::Free) else {
            return Ok(None);
        };
        let seq = st.next_seq;
        st.next_seq += 1;
        st.reqs[slot] = SendReq::Waiting {
            seq,
            addr,
            len,
            lkey,
        };
        st.waiting.push_back(slot);
        WAITING_SENDS.fetch_add(1, Ordering::Relaxed);
        self.match_and_post(&mut st)?;
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
                    Some(detail) => Err(NetError::Remote {
                        peer: self.link.peer.clone(),
                        detail: detail.clone(),
                    }),
                    None => Ok(None),
                }
            }
        }
    }

    /// Progresses this comm unless another thread is doing so; for calls made on behalf of
    /// other comms (errors are kept for this comm's own calls to report).
    pub fn try_progress(&self) {
        if let Ok(mut st) = self.state.try_lock() {
            if !st.waiting.is_empty() {
                if let Err(e) = self.progress(&mut st) {
                    st.failed.get_or_insert_with(|| e.to_string());
                }
            }
        }
    }

    /// Reaps completions, then posts every send whose CTS has arrived.
    fn progress(&self, st: &mut SendState) -> Result<()> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        let mut repost = Vec::new();
        loop {
            let n = self.link.poll(&mut wcs)?;
            for c in &wcs[..n] {
                let wc = c.wc;
                if wc.opcode == WcOpcode::Recv && wc.status.is_success() {
                    let ring = (wc.wr_id as usize) % CTS_RING;
                    let mut raw = [0u8; CTS_LEN];
                    self.link.ctrl.read(ring * CTS_LEN, &mut raw);
                    st.cts.push_back(Cts::decode(&raw));
                    repost.push(RecvWr {
                        wr_id: ring as u64,
                        local: self.link.ctrl.sge(ring * CTS_LEN, CTS_LEN),
                    });
                } else if !wc.status.is_success() {
                    st.failed
                        .get_or_insert_with(|| self.link.failure("a request", wc.status));
                } else if let Some(req) = st.reqs.get_mut(wc.wr_id as usize) {
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
            if n < wcs.len() {
                break;
            }
        }
        if !repost.is_empty() && st.failed.is_none() {
            self.link
                .qp
                .post_recv(&repost)
                .map_err(NetError::verbs("reposting control receives"))?;
        }
        self.match_and_post(st)
    }

    fn match_and_post(&self, st: &mut SendState) -> Result<()> {
        if st.failed.is_some() {
            return Ok(());
        }
        let mut wrs = Vec::new();
        while !st.waiting.is_empty() && !st.cts.is_empty() {
            let slot = st.waiting.pop_front().expect("non-empty");
            WAITING_SENDS.fetch_sub(1, Ordering::Relaxed);
            let cts = st.cts.pop_front().expect("non-empty");
            let SendReq::Waiting {
                seq,
                addr,
                len,
                lkey,
            } = st.reqs[slot]
            else {
                continue;
            };
            if cts.seq != seq {
                st.failed = Some(format!(
                    "protocol error: clear-to-send for message {} while message {seq} waits (peer {})",
                    cts.seq, self.link.peer
                ));
                return Ok(());
            }
            let remote = RemoteAddr {
                addr: cts.addr,
                rkey: cts.rkey,
            };
            let imm = (seq as u32) & SEQ_MASK;
            let (local, imm, refused) = if len > cts.size {
                (
                    Sge {
                        addr: 0,
                        len: 0,
                        lkey: 0,
                    },
                    imm | TRUNCATED,
                    Some(cts.size),
                )
            } else {
                (Sge { addr, len, lkey }, imm, None)
            };
            st.reqs[slot] = SendReq::InFlight { seq, len, refused };
            wrs.push(SendWr {
                wr_id: slot as u64,
                local,
                op: SendOp::WriteWithImm { remote, imm },
            });
        }
        if !wrs.is_empty() {
            self.link
                .qp
                .post_send(&wrs)
                .map_err(NetError::verbs("posting sends"))?;
        }
        Ok(())
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        WAITING_SENDS.fetch_sub(st.waiting.len(), Ordering::Relaxed);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecvReq {
    Free,
    Posted { seq: u64, size: u64 },
    Done { len: u64 },
    Truncated { seq: u64, posted: u64 },
}

#[derive(Debug)]
struct RecvState {
    reqs: [RecvReq; NCCL_NET_MAX_REQUESTS],
    /// Slots in `irecv` order: the order WRITE_WITH_IMMs consume the receives.
    posted: VecDeque<usize>,
    next_seq: u64,
    failed: Option<String>,
}

/// The receiving end of a connection (`recvComm`).
#[derive(Debug)]
pub struct RecvComm {
    link: Link,
    /// NCCL's registrations on this comm.
    pub regs: Mutex<Registrations>,
    state: Mutex<RecvState>,
}

impl RecvComm {
    /// Takes over a connected queue pair.
    pub fn new(link: Link) -> RecvComm {
        RecvComm {
            link,
            regs: Mutex::new(Registrations::default()),
            state: Mutex::new(RecvState {
                reqs: [RecvReq::Free; NCCL_NET_MAX_REQUESTS],
                posted: VecDeque::new(),
                next_seq: 0,
                failed: None,
            }),
        }
    }

    /// The domain registrations go into.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.link.pd
    }

    /// Posts a receive of up to `size` bytes at `addr` (registered under `mhandle`). Returns
    /// the request slot, or None when every slot is busy.
    pub fn irecv(&self, addr: u64, size: u64, mhandle: u64) -> Result<Option<usize>> {
        let rkey = self
            .regs
            .lock()
            .expect("registrations lock")
            .local(mhandle, addr, size)?
            .1;
        let mut st = self.state.lock().expect("recv comm lock");
        self.progress(&mut st)?;
        if let Some(detail) = &st.failed {
            return Err(NetError::Remote {
                peer: self.link.peer.clone(),
                detail: detail.clone(),
            });
        }
        let Some(slot) = st.reqs.iter().position(|r| *r == RecvReq::Free) else {
            return Ok(None);
        };
        let seq = st.next_seq;
        let ring = (seq as usize) % CTS_RING;
        let cts = Cts {
            addr,
            rkey,
            size,
            seq,
        };
        self.link.ctrl.write(ring * CTS_LEN, &cts.encode());
        // The data's receive goes first, so the WRITE_WITH_IMM the CTS triggers always finds it.
        self.link
            .qp
            .post_recv(&[RecvWr {
                wr_id: slot as u64,
                local: Sge {
                    addr: 0,
                    len: 0,
                    lkey: 0,
                },
            }])
            .map_err(NetError::verbs("posting a receive"))?;
        self.link
            .qp
            .post_send(&[SendWr {
                wr_id: CTS_WR | ring as u64,
                local: self.link.ctrl.sge(ring * CTS_LEN, CTS_LEN),
                op: SendOp::Send { imm: None },
            }])
            .map_err(NetError::verbs("sending a clear-to-send"))?;
        st.next_seq += 1;
        st.reqs[slot] = RecvReq::Posted { seq, size };
        st.posted.push_back(slot);
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
            Some(RecvReq::Truncated { seq, posted }) => {
                st.reqs[slot] = RecvReq::Free;
                Err(NetError::Truncated {
                    seq,
                    posted,
                    sent: 0,
                })
            }
            Some(RecvReq::Posted { .. }) => {
                progressed?;
                match &st.failed {
                    Some(detail) => Err(NetError::Remote {
                        peer: self.link.peer.clone(),
                        detail: detail.clone(),
                    }),
                    None => Ok(None),
                }
            }
        }
    }

    fn progress(&self, st: &mut RecvState) -> Result<()> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        loop {
            let n = self.link.poll(&mut wcs)?;
            for c in &wcs[..n] {
                let wc = c.wc;
                if !wc.status.is_success() {
                    st.failed
                        .get_or_insert_with(|| self.link.failure("a request", wc.status));
                    continue;
                }
                if wc.opcode != WcOpcode::RecvRdmaWithImm {
                    // A CTS send finished: its ring slot is free for reuse.
                    continue;
                }
                let Some(slot) = st.posted.pop_front() else {
                    st.failed = Some("protocol error: a message with no receive posted".into());
                    continue;
                };
                let RecvReq::Posted { seq, size } = st.reqs[slot] else {
                    continue;
                };
                let imm = wc.imm.unwrap_or(0);
                if imm & SEQ_MASK != (seq as u32) & SEQ_MASK || wc.wr_id != slot as u64 {
                    st.failed = Some(format!(
                        "protocol error: message {} arrived for receive {seq} (peer {})",
                        imm & SEQ_MASK,
                        self.link.peer
                    ));
                    continue;
                }
                st.reqs[slot] = if imm & TRUNCATED != 0 {
                    RecvReq::Truncated { seq, posted: size }
                } else {
                    RecvReq::Done { len: wc.byte_len }
                };
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
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
        assert_eq!(Cts::decode(&c.encode()), c);
    }
}
