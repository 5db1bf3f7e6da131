//! Ring schedules: reduce-scatter then all-gather around 0 → 1 → … → N−1 → 0, each segment
//! cut into slot-sized chunks that pipeline (a chunk is forwarded as soon as it has been
//! reduced). Works on any topology where neighbouring ranks are cabled (pair, mesh, ring).
//!
//! Step s of the reduce-scatter sends segment label r−s and receives r−s−1; after N−1 steps
//! rank r holds label r+1 fully reduced. All-gather step t sends label r+1−t and receives r−t.
//! Every segment is reduced along one fixed chain and then copied, so every rank ends with the
//! same bits. Labels map to buffer segments through `shift`, so reduce-scatter and all-gather
//! can put segment r on rank r.

use std::ops::Range;

use crate::channel::channel_to;
use crate::comm::{Communicator, Step};
use crate::dtype::{DType, combine, combine_into, finish_avg};
use crate::error::Result;
use crate::reduce_op::ReduceOp;

/// Which part of the ring to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phases {
    /// Reduce-scatter and all-gather (all-reduce).
    Both,
    /// Reduce-scatter only.
    ReduceScatter,
    /// All-gather only.
    AllGather,
}

/// A ring run over `work`.
#[derive(Debug)]
pub(crate) struct Plan {
    /// Byte range of each segment of `work`, by segment index.
    pub segments: Vec<Range<usize>>,
    /// Segment index = (label + shift) mod N.
    pub shift: usize,
    pub phases: Phases,
    pub dtype: DType,
    pub op: ReduceOp,
}

/// Splits `count` elements of `esize` bytes into `world` segments, the first `count % world`
/// one element longer.
pub(crate) fn split(count: usize, world: usize, esize: usize) -> Vec<Range<usize>> {
    let (base, rem) = (count / world, count % world);
    (0..world)
        .map(|k| {
            let start = k * base + k.min(rem);
            let len = base + usize::from(k < rem);
            start * esize..(start + len) * esize
        })
        .collect()
}

/// Runs `plan` over `work`. Out of place, `input` is this rank's input and `work` (the output)
/// need not hold anything yet: step 0 sends from `input` and the reduce-scatter writes
/// `input op received` into `work`, so nothing is copied first and the bits are those of the
/// in-place run.
pub(crate) fn run(
    comm: &mut Communicator,
    work: &mut [u8],
    input: Option<&[u8]>,
    plan: &Plan,
) -> Result<()> {
    let (r, n) = (comm.rank, comm.world);
    if n == 1 {
        if let Some(input) = input {
            tbrdma_verbs::copy_slice(work, input);
        }
        return Ok(());
    }
    let chunk_bytes = comm.chunk_bytes(plan.dtype);
    let longest = plan.segments.iter().map(|s| s.len()).max().unwrap_or(0);
    let m = longest.div_ceil(chunk_bytes).max(1);
    let (first, last) = match plan.phases {
        Phases::Both => (0, 2 * (n - 1)),
        Phases::ReduceScatter => (0, n - 1),
        Phases::AllGather => (n - 1, 2 * (n - 1)),
    };
    let (begin, end) = (first * m, last * m);
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let chunk_of = |label: usize, j: usize| {
        let seg = &plan.segments[(label + plan.shift) % n];
        let a = (seg.start + j * chunk_bytes).min(seg.end);
        let b = (seg.start + (j + 1) * chunk_bytes).min(seg.end);
        a..b
    };
    // Labels sent and received at step s.
    let send_label = |s: usize| {
        if s < n - 1 {
            (r + n - s) % n
        } else {
            (r + 1 + n - (s - (n - 1))) % n
        }
    };
    let recv_label = |s: usize| {
        if s < n - 1 {
            (r + 2 * n - s - 1) % n
        } else {
            (r + n - (s - (n - 1))) % n
        }
    };
    let finishes_avg = plan.op == ReduceOp::Avg && plan.phases != Phases::AllGather;
    let (mut sent, mut recvd) = (begin, begin);
    comm.drive(op_name(plan.phases), |chans, _| {
        let mut progressed = false;
        {
            let ch = channel_to(chans, prev)?;
            while recvd < end && ch.peek().is_some() {
                let (s, j) = (recvd / m, recvd % m);
                let range = chunk_of(recv_label(s), j);
                if s < n - 1 {
                    // Reduced out of the inbox slot piece by piece, each copied out into L1
                    // first (`view_oldest_in_pieces`); out of place, this rank's input is read
                    // where the caller holds it.
                    ch.expect_oldest(range.len())?;
                    let (dtype, op) = (plan.dtype, plan.op);
                    let acc = &mut work[range.clone()];
                    match input {
                        Some(input) => {
                            let mine = &input[range.clone()];
                            ch.view_oldest_in_pieces(&mut |r, x| {
                                combine_into(dtype, op, &mut acc[r.clone()], &mine[r], x)
                            });
                        }
                        None => {
                            ch.view_oldest_in_pieces(&mut |r, x| {
                                combine(dtype, op, &mut acc[r], x)
                            });
                        }
                    }
                    ch.release_oldest()?;
                    let acc = &mut work[range];
                    if finishes_avg && s == n - 2 {
                        finish_avg(plan.dtype, acc, n);
                    }
                } else {
                    ch.consume(&mut work[range])?;
                }
                recvd += 1;
                progressed = true;
            }
        }
        {
            let ch = channel_to(chans, next)?;
            // A chunk can leave once the step before has reduced (or received) it.
            while sent < end && (sent < begin + m || recvd + m > sent) && ch.can_send() {
                let (s, j) = (sent / m, sent % m);
                let range = chunk_of(send_label(s), j);
                // Step 0 sends this rank's own, unreduced input.
                ch.send(match input {
                    Some(input) if s == 0 => &input[range],
                    _ => &work[range],
                })?;
                sent += 1;
                progressed = true;
            }
        }
        Ok(if sent == end && recvd == end {
            Step::Done
        } else if progressed {
            Step::Progressed
        } else if recvd < end {
            Step::WaitingOn(prev)
        } else {
            Step::WaitingOn(next)
        })
    })
}

fn op_name(phases: Phases) -> &'static str {
    match phases {
        Phases::Both => "all_reduce",
        Phases::ReduceScatter => "reduce_scatter",
        Phases::AllGather => "all_gather",
    }
}

/// Broadcast along the ring from `root`: root → root+1 → … → root−1, chunks forwarded as
/// they arrive.
pub(crate) fn broadcast(comm: &mut Communicator, buf: &mut [u8], root: usize) -> Result<()> {
    let (r, n) = (comm.rank, comm.world);
    let chunk_bytes = comm.opts.slot_bytes;
    let len = buf.len();
    let nchunks = len.div_ceil(chunk_bytes);
    let pos = (r + n - root) % n;
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let receives = if pos == 0 { 0 } else { nchunks };
    let sends = if pos == n - 1 { 0 } else { nchunks };
    let range = |c: usize| (c * chunk_bytes).min(len)..((c + 1) * chunk_bytes).min(len);
    let (mut sent, mut recvd) = (0, 0);
    comm.drive("broadcast", |chans, _| {
        let mut progressed = false;
        if recvd < receives {
            let ch = channel_to(chans, prev)?;
            while recvd < receives && ch.peek().is_some() {
                ch.consume(&mut buf[range(recvd)])?;
                recvd += 1;
                progressed = true;
            }
        }
        if sent < sends {
            let ch = channel_to(chans, next)?;
            while sent < sends && (pos == 0 || sent < recvd) && ch.can_send() {
                ch.send(&buf[range(sent)])?;
                sent += 1;
                progressed = true;
            }
        }
        Ok(if sent == sends && recvd == receives {
            Step::Done
        } else if progressed {
            Step::Progressed
        } else if recvd < receives {
            Step::WaitingOn(prev)
        } else {
            Step::WaitingOn(next)
        })
    })
}

/// Moves `buf` along a path: receives it chunk by chunk from `from` (unless this rank is the
/// origin) and passes every chunk on to `to` (unless it is the destination) as soon as it has
/// arrived.
pub(crate) fn pipe(
    comm: &mut Communicator,
    op: &'static str,
    buf: &mut [u8],
    from: Option<usize>,
    to: Option<usize>,
) -> Result<()> {
    let chunk_bytes = comm.opts.slot_bytes;
    let len = buf.len();
    let nchunks = len.div_ceil(chunk_bytes);
    let range = |c: usize| (c * chunk_bytes).min(len)..((c + 1) * chunk_bytes).min(len);
    let receives = if from.is_some() { nchunks } else { 0 };
    let sends = if to.is_some() { nchunks } else { 0 };
    let (mut sent, mut recvd) = (0, 0);
    comm.drive(op, |chans, _| {
        let mut progressed = false;
        if let Some(p) = from {
            let ch = channel_to(chans, p)?;
            while recvd < receives && ch.peek().is_some() {
                ch.consume(&mut buf[range(recvd)])?;
                recvd += 1;
                progressed = true;
            }
        }
        if let Some(p) = to {
            let ch = channel_to(chans, p)?;
            while sent < sends && (from.is_none() || sent < recvd) && ch.can_send() {
                ch.send(&buf[range(sent)])?;
                sent += 1;
                progressed = true;
            }
        }
        Ok(if sent == sends && recvd == receives {
            Step::Done
        } else if progressed {
            Step::Progressed
        } else if recvd < receives {
            Step::WaitingOn(from.unwrap_or(0))
        } else {
            Step::WaitingOn(to.unwrap_or(0))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_buffer_with_the_remainder_first() {
        assert_eq!(split(10, 4, 2), vec![0..6, 6..12, 12..16, 16..20]);
        assert_eq!(split(2, 4, 4), vec![0..4, 4..8, 8..8, 8..8]);
        assert_eq!(split(0, 3, 8), vec![0..0, 0..0, 0..0]);
    }
}
