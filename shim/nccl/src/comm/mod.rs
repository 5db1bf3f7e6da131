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
//!
//! Who owns what: this module holds what both ends agree on (the constants, the immediate's
//! layout, the CTS, message numbering, the registrations and the [`Link`]); `send.rs` owns the
//! sending end ([`SendComm`]: credits, the RTS/CTS wait, staging) and `recv.rs` the receiving
//! end ([`RecvComm`]: bounce buffers, early arrivals, CTSs and credit returns). Neither end
//! reaches into the other's state.

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;

use tbrdma_proto::codec::{Put, Reader, SliceWriter};
use tbrdma_verbs::{
    Completion, CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair, Sge, WcStatus,
};

use crate::abi::NCCL_NET_MAX_REQUESTS;
use crate::error::{NetError, Result};

#[cfg(test)]
mod hostile_tests;
mod recv;
mod send;
#[cfg(test)]
mod wire_tests;

pub use recv::RecvComm;
pub use send::SendComm;

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
pub(crate) const SEQ_MASK: u32 = (1 << SEQ_BITS) - 1;
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

/// Bytes a receive comm pins of its own (bounce buffers and CTS buffers, in whole pages).
pub const RECV_PINNED: usize = pages(BOUNCE_RING * EAGER_MAX as usize) + pages(CTS_SLOTS * CTS_LEN);
/// Bytes a send comm pins of its own (staging buffers and control receives, in whole pages).
pub const SEND_PINNED: usize = pages(STAGE_SLOTS * EAGER_MAX as usize) + pages(CTRL_RING * CTS_LEN);

const fn pages(bytes: usize) -> usize {
    bytes.div_ceil(4096) * 4096
}

/// Bytes the plugin's comms pin right now (reported in the log; NCCL's own registrations are
/// not pinned by tbrdma).
pub static PINNED: AtomicUsize = AtomicUsize::new(0);

/// Allocates and pins `len` bytes of a comm's own buffers; a too-low locked-memory limit
/// becomes [`NetError::Memlock`], which names the limit, what a comm needs and the fix.
fn pin(
    pd: &ProtectionDomain,
    len: usize,
    access: tbrdma_verbs::Access,
    what: &'static str,
    comm_needs: usize,
) -> Result<MemoryRegion> {
    use tbrdma_engine::memory::MemoryError;
    pd.alloc_mr(len, access).map_err(|e| match e {
        tbrdma_verbs::VerbsError::Memory(MemoryError::MemlockTooLow { limit, locked, .. }) => {
            NetError::Memlock {
                limit,
                locked,
                needs: comm_needs,
                what,
            }
        }
        other => NetError::verbs(format!("allocating {what}"))(other),
    })
}

/// Sends, over every comm of the process, that wait for a credit or a CTS. While it is not
/// zero, every `test` also progresses the other send comms ([`SendComm::try_progress`]), so a
/// send whose credit or CTS arrives goes out even if NCCL is busy testing another connection.
pub static WAITING_SENDS: AtomicUsize = AtomicUsize::new(0);

fn seq_imm(seq: u64) -> u32 {
    (seq as u32) & SEQ_MASK
}

/// The full message number whose low bits are `low`, nearest to `next` (the receiver's next
/// `irecv` number; every message in flight is within far less than 2^29 of it).
pub(crate) fn full_seq(next: u64, low: u32) -> Option<u64> {
    let ahead = low.wrapping_sub(next as u32) & SEQ_MASK;
    if ahead < 1 << (SEQ_BITS - 1) {
        next.checked_add(u64::from(ahead))
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
pub(crate) struct Cts {
    addr: u64,
    rkey: u32,
    size: u64,
    seq: u64,
}

impl Cts {
    pub(crate) fn encode(&self) -> [u8; CTS_LEN] {
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
    pub(crate) fn decode(b: &[u8]) -> Option<Cts> {
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
}
