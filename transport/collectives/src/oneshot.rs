//! One-shot schedules for fully connected ranks (a pair, a mesh): every rank writes its data
//! straight to every peer, chunk by chunk, and reduces locally in rank order, so every rank
//! computes the same bits. Latency is one exchange plus a reduction; each link carries the
//! whole message once per direction.

use std::ops::Range;

use crate::channel::{Fault, channel_to, pieces};
use crate::comm::{Communicator, Step};
use crate::dtype::{DType, Fold, fold_ranks};
use crate::error::Result;
use crate::reduce_op::ReduceOp;

/// Byte range of chunk `c` of a buffer of `len` bytes cut in chunks of `chunk` bytes.
fn chunk(c: usize, chunk: usize, len: usize) -> Range<usize> {
    (c * chunk).min(len)..((c + 1) * chunk).min(len)
}

/// All-reduce of `out` (holding this rank's input when `input` is `None`, in place).
pub(crate) fn all_reduce(
    comm: &mut Communicator,
    input: Option<&[u8]>,
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (rank, world) = (comm.rank, comm.world);
    let esize = dtype.size();
    let chunk_bytes = (comm.opts.slot_bytes / esize) * esize;
    let len = out.len();
    let nchunks = len.div_ceil(chunk_bytes);
    let ahead = comm.opts.slots;
    let mut next_send = [0usize; 64];
    let mut next_send_vec;
    let next_send: &mut [usize] = if world <= 64 {
        &mut next_send[..world]
    } else {
        next_send_vec = vec![0usize; world];
        &mut next_send_vec
    };
    let mut c = 0;
    comm.drive("all_reduce", |chans, scratch| {
        let mut progressed = false;
        let mut waiting = None;
        for (p, ch) in chans.iter_mut().enumerate() {
            let Some(ch) = ch else { continue };
            while next_send[p] < nchunks && next_send[p] < c + ahead && ch.can_send() {
                let r = chunk(next_send[p], chunk_bytes, len);
                ch.send(match input {
                    Some(i) => &i[r],
                    None => &out[r],
                })?;
                next_send[p] += 1;
                progressed = true;
            }
            if next_send[p] <= c && waiting.is_none() {
                waiting = Some(p);
            }
        }
        if waiting.is_none() {
            waiting = (0..world).find(|&p| chans[p].as_ref().is_some_and(|ch| ch.peek().is_none()));
        }
        if waiting.is_none() && c < nchunks {
            let r = chunk(c, chunk_bytes, len);
            for (p, ch) in chans.iter().enumerate() {
                match ch {
                    Some(ch) => ch.expect_oldest(r.len())?,
                    None if p == rank => {}
                    None => return Err(Fault::Failed(format!("no cable to rank {p}"))),
                }
            }
            // Reduced piece by piece, each peer's piece copied out of its inbox into L1 first
            // (`Channel::view_oldest_range`): every operator is element-wise.
            for piece in pieces(r.len()) {
                let peer = |p: usize, f: &mut dyn FnMut(&[u8])| {
                    if let Some(ch) = &chans[p] {
                        ch.view_oldest_range(piece.clone(), f)
                    }
                };
                let at = r.start + piece.start..r.start + piece.end;
                let fold = Fold {
                    dtype,
                    op,
                    world,
                    local: Some((rank, input.map(|i| &i[at.clone()]))),
                };
                fold_ranks(fold, &mut out[at], &peer, &mut scratch.fold);
            }
            for ch in chans.iter_mut().flatten() {
                ch.release_oldest()?;
            }
            c += 1;
            progressed = true;
        }
        Ok(if c == nchunks {
            Step::Done
        } else if progressed {
            Step::Progressed
        } else {
            Step::WaitingOn(waiting.unwrap_or(rank))
        })
    })
}

/// Broadcast of `buf` from `root` straight to every peer.
pub(crate) fn broadcast(comm: &mut Communicator, buf: &mut [u8], root: usize) -> Result<()> {
    let rank = comm.rank;
    let chunk_bytes = comm.opts.slot_bytes;
    let len = buf.len();
    let nchunks = len.div_ceil(chunk_bytes);
    if rank == root {
        let mut next = vec![0usize; comm.world];
        comm.drive("broadcast", |chans, _| {
            let mut progressed = false;
            let mut waiting = None;
            for (p, ch) in chans.iter_mut().enumerate() {
                let Some(ch) = ch else { continue };
                while next[p] < nchunks && ch.can_send() {
                    ch.send(&buf[chunk(next[p], chunk_bytes, len)])?;
                    next[p] += 1;
                    progressed = true;
                }
                if next[p] < nchunks {
                    waiting = Some(p);
                }
            }
            Ok(match waiting {
                None => Step::Done,
                Some(_) if progressed => Step::Progressed,
                Some(p) => Step::WaitingOn(p),
            })
        })
    } else {
        let mut c = 0;
        comm.drive("broadcast", |chans, _| {
            let ch = channel_to(chans, root)?;
            let mut progressed = false;
            while c < nchunks && ch.peek().is_some() {
                ch.consume(&mut buf[chunk(c, chunk_bytes, len)])?;
                c += 1;
                progressed = true;
            }
            Ok(if c == nchunks {
                Step::Done
            } else if progressed {
                Step::Progressed
            } else {
                Step::WaitingOn(root)
            })
        })
    }
}

/// All-gather: every rank's `n`-byte block lands at `rank·n` in `out` on every rank. `out`
/// already holds this rank's block.
pub(crate) fn all_gather(comm: &mut Communicator, out: &mut [u8], block: usize) -> Result<()> {
    let (rank, world) = (comm.rank, comm.world);
    let chunk_bytes = comm.opts.slot_bytes;
    let nchunks = block.div_ceil(chunk_bytes);
    let own = rank * block..(rank + 1) * block;
    let mut next_send = vec![0usize; world];
    let mut next_recv = vec![0usize; world];
    comm.drive("all_gather", |chans, _| {
        let mut progressed = false;
        let mut waiting = None;
        for (p, ch) in chans.iter_mut().enumerate() {
            let Some(ch) = ch else { continue };
            while next_send[p] < nchunks && ch.can_send() {
                let r = chunk(next_send[p], chunk_bytes, block);
                ch.send(&out[own.start + r.start..own.start + r.end])?;
                next_send[p] += 1;
                progressed = true;
            }
            while next_recv[p] < nchunks && ch.peek().is_some() {
                let r = chunk(next_recv[p], chunk_bytes, block);
                let at = p * block;
                ch.consume(&mut out[at + r.start..at + r.end])?;
                next_recv[p] += 1;
                progressed = true;
            }
            if (next_recv[p] < nchunks || next_send[p] < nchunks) && waiting.is_none() {
                waiting = Some(p);
            }
        }
        Ok(match waiting {
            None => Step::Done,
            Some(_) if progressed => Step::Progressed,
            Some(p) => Step::WaitingOn(p),
        })
    })
}
