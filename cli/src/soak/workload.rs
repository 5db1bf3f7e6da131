//! One queue pair's share of the soak (a lane): its region, the random mix of operations it
//! runs against the slice of the peer's region that only it uses, and the checks of every
//! result. One request is in flight per lane at a time, so each result can be predicted
//! exactly; the lanes of a session and the two sides run at once.
//!
//! What is checked, and how:
//! - WRITE and WRITE_WITH_IMM: read back at once with a READ and compared with what was
//!   written; a shadow copy of the slice remembers every byte this side put there;
//! - READ: a random range of the slice, compared with the shadow;
//! - SEND and SEND_WITH_IMM: the receiver checks the length and every byte against the pattern
//!   of the message's sequence number on the lane (receives complete in order), and the
//!   immediate, which carries that number; WRITE_WITH_IMM's immediate too;
//! - FETCH_ADD and CMP_SWAP: on a counter in the peer's region that only this lane touches, so
//!   the old value returned is predicted exactly (a third of the swaps are meant to miss).

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tbrdma_verbs::{
    Access, MemoryRegion, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WorkCompletion,
};

use super::report::Tally;
use crate::perf::pattern;
use crate::perf::session::Remote;

/// Largest message: the top of the largest size class.
pub const MAX_MSG: usize = 1 << 20;
/// The slice the peer's lane writes and reads.
const TARGET: usize = 0;
/// The 8-byte counter the peer's lane runs atomics on.
const COUNTER: usize = MAX_MSG;
/// Source of this side's WRITEs and SENDs.
const SRC: usize = COUNTER + 64;
/// Where this side's READs land.
const BACK: usize = SRC + MAX_MSG;
/// Where this side's atomics return the old value.
const ATOMIC_OUT: usize = BACK + MAX_MSG;
/// The receive slots.
const RECV_BASE: usize = ATOMIC_OUT + 64;
/// Receives kept posted per lane.
pub const RECVS: usize = 4;
/// Bytes of a lane's region.
pub const REGION_LEN: usize = RECV_BASE + RECVS * MAX_MSG;

/// Immediate bit of the DONE message that ends a lane; the other bits carry sequence numbers.
const DONE_FLAG: u32 = 1 << 31;
const SEQ_MASK: u32 = !DONE_FLAG;

const WR_OP: u64 = 1 << 56;
const WR_RECV: u64 = 2 << 56;
const WR_DONE: u64 = 3 << 56;
const WR_KIND: u64 = 0xff << 56;
const WR_LANE_SHIFT: u32 = 40;
const WR_LOW: u64 = (1 << WR_LANE_SHIFT) - 1;

/// Size classes: 1 B to 1 MiB.
const CLASSES: [(usize, usize); 5] = [
    (1, 8),
    (9, 512),
    (513, 8 << 10),
    ((8 << 10) + 1, 64 << 10),
    ((64 << 10) + 1, MAX_MSG),
];

/// Access the peer needs to a lane's region.
pub fn access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// Which lane a completion's `wr_id` belongs to.
pub fn lane_of(wr_id: u64) -> usize {
    ((wr_id & !WR_KIND) >> WR_LANE_SHIFT) as usize
}

fn size_in_class(rng: &mut impl Rng) -> usize {
    let (lo, hi) = CLASSES[(rng.next_u32() as usize) % CLASSES.len()];
    lo + (rng.next_u64() as usize) % (hi - lo + 1)
}

/// Length of the `seq`-th receive-consuming message on lane `lane`: both sides derive it, so
/// the receiver knows what length to expect.
fn send_len(lane: usize, seq: u64) -> usize {
    size_in_class(&mut ChaCha8Rng::seed_from_u64(message_id(lane, seq)))
}

/// Pattern iteration of the `seq`-th message on `lane`.
fn message_id(lane: usize, seq: u64) -> u64 {
    ((lane as u64) << 48) ^ seq ^ 0x5eed_0000_0000_0000
}

/// Buffers the lanes share, allocated once (so they never count as growth).
#[derive(Debug)]
pub struct Scratch {
    got: Vec<u8>,
    want: Vec<u8>,
    poison: Vec<u8>,
    /// Mismatches reported on stderr so far (the first few are named).
    reported: u32,
}

impl Scratch {
    /// Room for the largest message.
    pub fn new() -> Scratch {
        Scratch {
            got: vec![0; MAX_MSG],
            want: vec![0; MAX_MSG],
            poison: vec![0xa5; MAX_MSG],
            reported: 0,
        }
    }
}

/// Counts `got` against `want` into the tally; names the first bad byte of the first few.
fn check(got: &[u8], want: &[u8], what: &str, tally: &mut Tally, scratch_reported: &mut u32) {
    let wrong = got.iter().zip(want).filter(|(a, b)| a != b).count() as u64
        + got.len().abs_diff(want.len()) as u64;
    tally.bytes_verified += want.len() as u64 - wrong.min(want.len() as u64);
    if wrong > 0 {
        tally.bytes_wrong += wrong;
        if *scratch_reported < 10 {
            *scratch_reported += 1;
            let at = got.iter().zip(want).position(|(a, b)| a != b);
            eprintln!(
                "soak: WRONG BYTES: {what}: {wrong} of {} bytes differ (first at offset {at:?})",
                want.len()
            );
        }
    }
}

/// The operations of the mix.
#[derive(Debug, Clone, Copy)]
enum Pending {
    Write { imm: bool, off: usize, len: usize },
    ReadBack { off: usize, len: usize },
    Send { imm: bool },
    Read { off: usize, len: usize },
    FetchAdd { add: u64 },
    CmpSwap { compare: u64, swap: u64 },
    Done,
}

/// One lane: a queue pair, its region, and what it predicts about the peer's.
#[derive(Debug)]
pub struct Lane {
    /// Its index in the session (the same on both sides).
    pub index: usize,
    // Dropped before the region it uses.
    qp: QueuePair,
    mr: MemoryRegion,
    peer: Remote,
    rng: ChaCha8Rng,
    /// Every byte this side wrote into the peer's slice (the peer zeroes its region).
    shadow: Vec<u8>,
    /// The peer's counter as this side's atomics left it.
    counter: u64,
    send_seq: u64,
    recv_seq: u64,
    recv_posted: usize,
    pending: Option<Pending>,
    /// No more operations: send DONE once nothing is in flight.
    pub stop: bool,
    /// Stop as soon as the peer's DONE arrives (the server follows the client's clock).
    pub stop_on_peer_done: bool,
    done_acked: bool,
    done_received: bool,
    /// An error completion was seen: the queue pair is in the error state.
    pub errored: bool,
}

impl Lane {
    /// A fresh region for a lane, zeroed where the peer's predictions start from.
    pub fn region(pd: &tbrdma_verbs::ProtectionDomain) -> anyhow::Result<MemoryRegion> {
        let mr = pd.alloc_mr(REGION_LEN, access())?;
        mr.write(TARGET, &vec![0u8; COUNTER + 8]);
        Ok(mr)
    }

    /// A connected lane; posts its receives.
    pub fn new(
        index: usize,
        qp: QueuePair,
        mr: MemoryRegion,
        peer: Remote,
        seed: u64,
    ) -> anyhow::Result<Lane> {
        let lane = Lane {
            index,
            qp,
            mr,
            peer,
            rng: ChaCha8Rng::seed_from_u64(seed),
            shadow: vec![0; MAX_MSG],
            counter: 0,
            send_seq: 0,
            recv_seq: 0,
            recv_posted: 0,
            pending: None,
            stop: false,
            stop_on_peer_done: false,
            done_acked: false,
            done_received: false,
            errored: false,
        };
        let mut lane = lane;
        for seq in 0..RECVS as u64 {
            lane.post_recv(seq)?;
        }
        Ok(lane)
    }

    fn wr(&self, kind: u64, low: u64) -> u64 {
        kind | ((self.index as u64) << WR_LANE_SHIFT) | (low & WR_LOW)
    }

    fn post_recv(&mut self, seq: u64) -> anyhow::Result<()> {
        let slot = RECV_BASE + (seq as usize % RECVS) * MAX_MSG;
        self.qp.post_recv(&[RecvWr {
            wr_id: self.wr(WR_RECV, seq),
            local: self.mr.sge(slot, MAX_MSG),
        }])?;
        self.recv_posted += 1;
        Ok(())
    }

    fn post(
        &mut self,
        kind: u64,
        local: (usize, usize),
        op: SendOp,
        p: Pending,
    ) -> anyhow::Result<()> {
        self.qp.post_send(&[SendWr {
            wr_id: self.wr(kind, 0),
            local: self.mr.sge(local.0, local.1),
            op,
        }])?;
        self.pending = Some(p);
        Ok(())
    }

    /// Requests and receives not completed yet.
    pub fn outstanding(&self) -> usize {
        self.pending.is_some() as usize + self.recv_posted
    }

    /// Whether the lane may be torn down after a failure: nothing in flight, and an errored
    /// queue pair's receives flushed (a healthy one's are dropped with it).
    pub fn quiet(&self) -> bool {
        self.pending.is_none() && (!self.errored || self.recv_posted == 0)
    }

    /// What is still outstanding, for the log: `lane 2: errored, Read in flight, 1 receive`.
    pub fn describe(&self) -> String {
        let pending = match self.pending {
            Some(p) => format!("{p:?} in flight"),
            None => "nothing in flight".into(),
        };
        format!(
            "lane {}: {}{pending}, {} receives posted",
            self.index,
            if self.errored { "errored, " } else { "" },
            self.recv_posted
        )
    }

    /// Both DONEs exchanged and nothing in flight.
    pub fn finished(&self) -> bool {
        self.done_acked && self.done_received && self.pending.is_none()
    }

    /// Starts the next operation when none is in flight. Returns whether it posted.
    pub fn step(&mut self, scratch: &mut Scratch) -> anyhow::Result<bool> {
        if self.pending.is_some() || self.done_acked {
            return Ok(false);
        }
        if self.stop {
            let seq = self.send_seq;
            self.send_seq += 1;
            self.post(
                WR_DONE,
                (SRC, 0),
                SendOp::Send {
                    imm: Some(DONE_FLAG | (seq as u32 & SEQ_MASK)),
                },
                Pending::Done,
            )?;
            return Ok(true);
        }
        let roll = self.rng.next_u32() % 100;
        match roll {
            0..30 => {
                let imm = roll >= 20;
                let len = size_in_class(&mut self.rng);
                let off = (self.rng.next_u64() as usize) % (MAX_MSG - len + 1);
                pattern::fill(self.rng.next_u64(), len, &mut scratch.want[..len]);
                self.mr.write(SRC, &scratch.want[..len]);
                self.shadow[off..off + len].copy_from_slice(&scratch.want[..len]);
                let remote = self.peer.at(TARGET + off);
                let op = if imm {
                    let seq = self.send_seq;
                    self.send_seq += 1;
                    SendOp::WriteWithImm {
                        remote,
                        imm: seq as u32 & SEQ_MASK,
                    }
                } else {
                    SendOp::Write { remote }
                };
                self.post(WR_OP, (SRC, len), op, Pending::Write { imm, off, len })?;
            }
            30..55 => {
                let imm = roll >= 45;
                let seq = self.send_seq;
                self.send_seq += 1;
                let len = send_len(self.index, seq);
                pattern::fill(message_id(self.index, seq), len, &mut scratch.want[..len]);
                self.mr.write(SRC, &scratch.want[..len]);
                let imm_value = imm.then_some(seq as u32 & SEQ_MASK);
                self.post(
                    WR_OP,
                    (SRC, len),
                    SendOp::Send { imm: imm_value },
                    Pending::Send { imm },
                )?;
            }
            55..70 => {
                let len = size_in_class(&mut self.rng);
                let off = (self.rng.next_u64() as usize) % (MAX_MSG - len + 1);
                self.read(off, len, Pending::Read { off, len }, scratch)?;
            }
            70..85 => {
                let add = self.rng.next_u64();
                self.mr.write(ATOMIC_OUT, &(!self.counter).to_le_bytes());
                let op = SendOp::FetchAdd {
                    remote: self.peer.at(COUNTER),
                    add,
                };
                self.post(WR_OP, (ATOMIC_OUT, 8), op, Pending::FetchAdd { add })?;
            }
            _ => {
                let miss = self.rng.next_u32() % 3 == 0;
                let compare = if miss {
                    self.counter.wrapping_add(1)
                } else {
                    self.counter
                };
                let swap = self.rng.next_u64();
                self.mr.write(ATOMIC_OUT, &(!self.counter).to_le_bytes());
                let op = SendOp::CmpSwap {
                    remote: self.peer.at(COUNTER),
                    compare,
                    swap,
                };
                self.post(
                    WR_OP,
                    (ATOMIC_OUT, 8),
                    op,
                    Pending::CmpSwap { compare, swap },
                )?;
            }
        }
        Ok(true)
    }

    /// A READ of the peer's slice into BACK, which is poisoned first so that a READ that
    /// placed nothing cannot pass.
    fn read(
        &mut self,
        off: usize,
        len: usize,
        p: Pending,
        scratch: &Scratch,
    ) -> anyhow::Result<()> {
        self.mr.write(BACK, &scratch.poison[..len]);
        let op = SendOp::Read {
            remote: self.peer.at(TARGET + off),
        };
        self.post(WR_OP, (BACK, len), op, p)
    }

    /// A failed completion: forget what it was (the session is being torn down).
    pub fn on_error(&mut self, wc: &WorkCompletion) {
        self.errored = true;
        if wc.wr_id & WR_KIND == WR_RECV {
            self.recv_posted = self.recv_posted.saturating_sub(1);
        } else {
            self.pending = None;
        }
    }

    /// A successful completion: checks it, and (unless `may_post` is false: the session is
    /// failing) posts what follows (the READ back of a WRITE, the next receive).
    pub fn on_success(
        &mut self,
        wc: &WorkCompletion,
        tally: &mut Tally,
        scratch: &mut Scratch,
        may_post: bool,
    ) -> anyhow::Result<()> {
        if wc.wr_id & WR_KIND == WR_RECV {
            return self.on_receive(wc, tally, scratch, may_post);
        }
        let Some(p) = self.pending.take() else {
            tally.error("unexpected_completion");
            return Ok(());
        };
        let Scratch { got, reported, .. } = scratch;
        match p {
            Pending::Write { imm, off, len } => {
                tally.op(if imm { "write_imm" } else { "write" });
                if may_post {
                    self.read(off, len, Pending::ReadBack { off, len }, scratch)?;
                }
            }
            Pending::ReadBack { off, len } | Pending::Read { off, len } => {
                let name = match p {
                    Pending::ReadBack { .. } => "read_back",
                    _ => "read",
                };
                self.mr.read(BACK, &mut got[..len]);
                check(
                    &got[..len],
                    &self.shadow[off..off + len],
                    name,
                    tally,
                    reported,
                );
                tally.op(name);
            }
            Pending::Send { imm } => tally.op(if imm { "send_imm" } else { "send" }),
            Pending::FetchAdd { add } => {
                let old = self.mr.load_u64(ATOMIC_OUT);
                check(
                    &old.to_le_bytes(),
                    &self.counter.to_le_bytes(),
                    "fetch_add",
                    tally,
                    reported,
                );
                self.counter = old.wrapping_add(add);
                tally.op("fetch_add");
            }
            Pending::CmpSwap { compare, swap } => {
                let old = self.mr.load_u64(ATOMIC_OUT);
                check(
                    &old.to_le_bytes(),
                    &self.counter.to_le_bytes(),
                    "cmp_swap",
                    tally,
                    reported,
                );
                if old == compare {
                    self.counter = swap;
                } else {
                    self.counter = old;
                }
                tally.op("cmp_swap");
            }
            Pending::Done => self.done_acked = true,
        }
        Ok(())
    }

    fn on_receive(
        &mut self,
        wc: &WorkCompletion,
        tally: &mut Tally,
        scratch: &mut Scratch,
        may_post: bool,
    ) -> anyhow::Result<()> {
        self.recv_posted = self.recv_posted.saturating_sub(1);
        let seq = self.recv_seq;
        self.recv_seq += 1;
        let Scratch {
            got,
            want,
            reported,
            ..
        } = scratch;
        if wc.wr_id & WR_LOW != seq & WR_LOW {
            tally.error("receive_out_of_order");
        }
        let want_imm = seq as u32 & SEQ_MASK;
        match (wc.opcode, wc.imm) {
            (WcOpcode::Recv, Some(imm)) if imm & DONE_FLAG != 0 => {
                check(
                    &imm.to_le_bytes(),
                    &(DONE_FLAG | want_imm).to_le_bytes(),
                    "DONE immediate",
                    tally,
                    reported,
                );
                self.done_received = true;
                if self.stop_on_peer_done {
                    self.stop = true;
                }
            }
            (WcOpcode::Recv, imm) => {
                let len = send_len(self.index, seq);
                if let Some(imm) = imm {
                    check(
                        &imm.to_le_bytes(),
                        &want_imm.to_le_bytes(),
                        "SEND_WITH_IMM immediate",
                        tally,
                        reported,
                    );
                }
                let got_len = (wc.byte_len as usize).min(MAX_MSG);
                pattern::fill(message_id(self.index, seq), len, &mut want[..len]);
                let slot = RECV_BASE + (seq as usize % RECVS) * MAX_MSG;
                self.mr.read(slot, &mut got[..got_len]);
                check(
                    &got[..got_len],
                    &want[..len],
                    "SEND payload",
                    tally,
                    reported,
                );
                tally.received += 1;
            }
            (WcOpcode::RecvRdmaWithImm, imm) => {
                let imm = imm.unwrap_or(!want_imm);
                check(
                    &imm.to_le_bytes(),
                    &want_imm.to_le_bytes(),
                    "WRITE_WITH_IMM immediate",
                    tally,
                    reported,
                );
                tally.received += 1;
            }
            (other, _) => {
                tally.error(&format!("receive_with_opcode_{other:?}"));
            }
        }
        if may_post {
            self.post_recv(seq + RECVS as u64)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_cover_every_class_from_one_byte_to_one_mebibyte() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let sizes: Vec<usize> = (0..5000).map(|_| size_in_class(&mut rng)).collect();
        assert!(sizes.iter().all(|&s| (1..=MAX_MSG).contains(&s)));
        for (lo, hi) in CLASSES {
            assert!(sizes.iter().any(|s| (lo..=hi).contains(s)), "{lo}..={hi}");
        }
        // Both sides derive a message's length from its lane and number alone.
        assert_eq!(send_len(2, 77), send_len(2, 77));
        assert!((0..64).any(|seq| send_len(0, seq) != send_len(1, seq)));
    }

    #[test]
    fn a_check_counts_every_wrong_or_missing_byte() {
        let mut tally = Tally::default();
        let mut reported = 0;
        check(b"abcd", b"abcd", "same", &mut tally, &mut reported);
        assert_eq!((tally.bytes_verified, tally.bytes_wrong), (4, 0));
        check(b"abXd", b"abcd", "one", &mut tally, &mut reported);
        assert_eq!((tally.bytes_verified, tally.bytes_wrong), (7, 1));
        check(b"ab", b"abcd", "short", &mut tally, &mut reported);
        assert_eq!((tally.bytes_verified, tally.bytes_wrong), (9, 3));
        assert_eq!(reported, 2);
    }

    #[test]
    fn work_request_ids_name_their_lane() {
        for lane in [0usize, 1, 15] {
            for kind in [WR_OP, WR_RECV, WR_DONE] {
                let id = kind | ((lane as u64) << WR_LANE_SHIFT) | (12345 & WR_LOW);
                assert_eq!(lane_of(id), lane);
            }
        }
    }
}
