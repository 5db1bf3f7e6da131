//! One-shot schedules for fully connected ranks (a pair, a mesh): every rank writes its data
//! straight to every peer, chunk by chunk, and reduces locally in rank order, so every rank
//! computes the same bits. Latency is one exchange plus a reduction; each link carries the
//! whole message once per direction.

use std::ops::Range;

use tbrdma_verbs::WriteSink;

use crate::channel::{Channel, Fault, channel_to, pieces};
use crate::comm::{Communicator, Step};
use crate::dtype::{DType, Fold, FoldScratch, finish_avg, fold_ranks};
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
    let chunk_bytes = comm.chunk_bytes(dtype);
    let len = out.len();
    let nchunks = len.div_ceil(chunk_bytes);
    let ahead = comm.opts.slots;
    if (world, nchunks) == (2, 1)
        && let Some(sink) = comm.chans[1 - rank]
            .as_ref()
            .and_then(|ch| ch.next_arrival_sink())
    {
        return pair_step(comm, Pair::of_two(rank), Some(sink), input, out, dtype, op);
    }
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
            let fold = Fold {
                dtype,
                op,
                world,
                local: Some((rank, input.map(|i| &i[r.clone()]))),
            };
            fold_from_inboxes(
                chans,
                |p| p,
                fold,
                0..r.len(),
                &mut out[r],
                &mut scratch.fold,
            );
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

/// Folds bytes `part` of every peer's oldest message (each checked to be there) into the
/// same bytes of `out`, which is as long as those messages, as is `fold`'s local input. Piece
/// by piece, each peer's piece copied out of its inbox into L1 first
/// (`Channel::view_oldest_range`): every operator is element-wise.
/// `channel_of` maps the fold's ranks to the channels' (the identity, but for a pair step of
/// recursive doubling, whose two "ranks" are this one and its partner).
fn fold_from_inboxes(
    chans: &[Option<Channel>],
    channel_of: impl Fn(usize) -> usize,
    fold: Fold<'_>,
    part: Range<usize>,
    out: &mut [u8],
    scratch: &mut FoldScratch,
) {
    for piece in pieces(part.len()) {
        let at = part.start + piece.start..part.start + piece.end;
        let peer = |p: usize, f: &mut dyn FnMut(&[u8])| {
            if let Some(ch) = &chans[channel_of(p)] {
                ch.view_oldest_range(at.clone(), f)
            }
        };
        let fold = Fold {
            local: fold
                .local
                .map(|(rank, input)| (rank, input.map(|i| &i[at.clone()]))),
            ..fold
        };
        fold_ranks(fold, &mut out[at.clone()], &peer, scratch);
    }
}

/// The two sides of an exchange of whole messages: this rank's partner, and which of the two
/// comes first in the fold (rank order in a pair; the lower-ranked pair first in recursive
/// doubling), so that both sides compute the same bits.
#[derive(Clone, Copy, Debug)]
struct Pair {
    partner: usize,
    /// 0 when this side's data comes first in the fold, 1 when the partner's does.
    position: usize,
}

impl Pair {
    /// The two ranks of a pair.
    fn of_two(rank: usize) -> Pair {
        Pair {
            partner: 1 - rank,
            position: rank,
        }
    }
}

/// One exchange of a whole message (a slot or less) with `pair.partner`, reduced into `out` in
/// `pair`'s order: `out = x0 op x1`. With a `sink` (where the partner's message will land) each
/// of its packets is folded into `out` as it arrives, from where the engine received it, so
/// nothing is copied into the inbox and out again. What the fold did not take (packets that
/// arrived before the sink was set, or that it declined), and the whole message without a
/// sink, is folded from the inbox once the message is complete.
///
/// Out of place the fold computes `out` from `input` and the packet. In place (`input` is
/// `None`) it computes it from `out` itself, which holds this rank's data until the fold: so
/// this rank's message is sent before the sink is set (the fold must not change what is
/// sent), and a packet whose bytes were already taken is declined (folding it twice would
/// count it twice), which costs no copy of the input.
fn pair_step(
    comm: &mut Communicator,
    pair: Pair,
    sink: Option<WriteSink>,
    input: Option<&[u8]>,
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let Pair { partner, position } = pair;
    let len = out.len();
    let esize = dtype.size();
    let mut sent = false;
    if input.is_none() || sink.is_none() {
        // (If the partner's message comes in while this waits for room to send, it is stored
        // and folded from the inbox: correct, only slower.)
        comm.drive("all_reduce", |chans, _| {
            let ch = channel_to(chans, partner)?;
            Ok(if ch.can_send() {
                ch.send(input.unwrap_or(out))?;
                Step::Done
            } else {
                Step::WaitingOn(partner)
            })
        })?;
        sent = true;
    }
    let mut taken = Taken::default();
    if let Some(sink) = sink {
        let mut fold_scratch = std::mem::take(&mut comm.scratch.fold);
        let mut place = |at: usize, bytes: &[u8]| {
            let end = at + bytes.len();
            // Whole elements inside this message only (an honest peer's packets start at
            // multiples of 64 bytes), no more pieces than `Taken` keeps, and nothing already
            // taken.
            if end > len
                || at % esize != 0
                || bytes.len() % esize != 0
                || !taken.has_room()
                || taken.overlaps(at..end)
            {
                return false;
            }
            let fold = Fold {
                dtype,
                op,
                world: 2,
                local: Some((position, input.map(|i| &i[at..end]))),
            };
            fold_ranks(fold, &mut out[at..end], &|_, f| f(bytes), &mut fold_scratch);
            taken.add(at..end);
            true
        };
        let (_, arrived) = sink.run(&mut place, || {
            comm.drive("all_reduce", |chans, _| {
                let ch = channel_to(chans, partner)?;
                let mut progressed = false;
                if let (false, Some(input)) = (sent, input)
                    && ch.can_send()
                {
                    ch.send(input)?;
                    sent = true;
                    progressed = true;
                }
                Ok(if sent && ch.peek().is_some() {
                    Step::Done
                } else if progressed {
                    Step::Progressed
                } else {
                    Step::WaitingOn(partner)
                })
            })
        });
        comm.scratch.fold = fold_scratch;
        arrived?;
    }
    let mut gaps = [const { 0..0 }; Taken::MAX + 1];
    let mut n_gaps = 0;
    taken.for_each_gap(len, |gap| {
        gaps[n_gaps] = gap;
        n_gaps += 1;
    });
    let gaps = &gaps[..n_gaps];
    comm.reduced_on_arrival += (len - gaps.iter().map(|g| g.len()).sum::<usize>()) as u64;
    comm.drive("all_reduce", |chans, scratch| {
        // (Without a sink, nothing has waited for the partner's message yet.)
        let ch = channel_to(chans, partner)?;
        if ch.peek().is_none() {
            return Ok(Step::WaitingOn(partner));
        }
        ch.expect_oldest(len)?;
        let fold = Fold {
            dtype,
            op,
            world: 2,
            local: Some((position, input)),
        };
        // In place, `out` still holds this rank's data wherever the fold took nothing.
        for gap in gaps {
            fold_from_inboxes(
                chans,
                |_| partner,
                fold,
                gap.clone(),
                out,
                &mut scratch.fold,
            );
        }
        channel_to(chans, partner)?.release_oldest()?;
        Ok(Step::Done)
    })
}

/// Recursive doubling over four ranks ([`crate::Algorithm::Doubling`]): an exchange of the
/// whole message with rank r xor 1, reduced, then one with rank r xor 3, reduced again. After
/// the first, ranks 0 and 1 hold x0 op x1 and ranks 2 and 3 hold x2 op x3; the second gives
/// every rank (x0 op x1) op (x2 op x3), the same bits everywhere (the pair of ranks 0 and 1
/// first in the fold). 16-bit floats are rounded after each exchange, as the ring rounds
/// after each hop; avg divides once, at the end. Messages over a slot go a slot at a time.
pub(crate) fn doubling(
    comm: &mut Communicator,
    input: Option<&[u8]>,
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let rank = comm.rank;
    debug_assert!(comm.supports_doubling());
    let steps = [
        Pair {
            partner: rank ^ 1,
            position: rank & 1,
        },
        Pair {
            partner: rank ^ 3,
            position: rank >> 1,
        },
    ];
    // Avg sums and divides once: dividing after each exchange would round twice.
    let step_op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let chunk_bytes = comm.chunk_bytes(dtype);
    let len = out.len();
    for c in 0..len.div_ceil(chunk_bytes) {
        let r = chunk(c, chunk_bytes, len);
        for (k, &pair) in steps.iter().enumerate() {
            let sink = comm.chans[pair.partner]
                .as_ref()
                .and_then(|ch| ch.next_arrival_sink());
            // The first exchange reads the caller's input; the second reduces `out` in place.
            let input = if k == 0 {
                input.map(|i| &i[r.clone()])
            } else {
                None
            };
            pair_step(comm, pair, sink, input, &mut out[r.clone()], dtype, step_op)?;
        }
        if op == ReduceOp::Avg {
            finish_avg(dtype, &mut out[r], comm.world);
        }
    }
    Ok(())
}

/// The byte ranges of a message that a sink's fold took: a few (one per packet; a slot is a
/// handful of packets), and when they are used up the fold declines the rest, which is then
/// stored and folded from the inbox.
#[derive(Default)]
struct Taken {
    ranges: [Range<usize>; Taken::MAX],
    n: usize,
}

impl Taken {
    const MAX: usize = 16;

    fn has_room(&self) -> bool {
        self.n < Self::MAX
    }

    fn add(&mut self, r: Range<usize>) {
        self.ranges[self.n] = r;
        self.n += 1;
    }

    /// Whether some of `r` was taken already.
    fn overlaps(&self, r: Range<usize>) -> bool {
        self.ranges[..self.n]
            .iter()
            .any(|t| t.start < r.end && r.start < t.end)
    }

    /// Calls `f` with each range of `0..len` that nothing taken covers, in order.
    fn for_each_gap(&mut self, len: usize, mut f: impl FnMut(Range<usize>)) {
        let taken = &mut self.ranges[..self.n];
        taken.sort_unstable_by_key(|r| r.start);
        let mut from = 0;
        for r in taken.iter() {
            if r.start > from {
                f(from..r.start);
            }
            from = from.max(r.end);
        }
        if from < len {
            f(from..len);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(taken: &[Range<usize>], len: usize) -> Vec<Range<usize>> {
        let mut t = Taken::default();
        for r in taken {
            t.add(r.clone());
        }
        let mut out = Vec::new();
        t.for_each_gap(len, |g| out.push(g));
        out
    }

    #[test]
    fn gaps_are_what_no_taken_range_covers() {
        assert_eq!(gaps(&[], 100), vec![0..100]);
        assert_eq!(gaps(&[0..50, 50..100], 100), Vec::<Range<usize>>::new());
        // Out of order, overlapping, the same range twice.
        assert_eq!(
            gaps(&[64..80, 0..16, 8..32, 64..80], 100),
            vec![32..64, 80..100]
        );
        assert_eq!(gaps(&[10..20, 20..30], 30), vec![0..10]);
    }

    #[test]
    fn a_range_overlaps_what_it_shares_bytes_with() {
        let mut t = Taken::default();
        t.add(64..128);
        assert!(t.overlaps(64..128));
        assert!(t.overlaps(0..65));
        assert!(t.overlaps(127..200));
        assert!(t.overlaps(80..90));
        assert!(!t.overlaps(0..64));
        assert!(!t.overlaps(128..192));
        assert!(!Taken::default().overlaps(0..1 << 20));
    }

    #[test]
    fn taken_holds_at_most_max_ranges() {
        let mut t = Taken::default();
        for k in 0..Taken::MAX {
            assert!(t.has_room());
            t.add(k * 8..k * 8 + 8);
        }
        assert!(!t.has_room());
        let mut out = Vec::new();
        t.for_each_gap(Taken::MAX * 8 + 4, |g| out.push(g));
        assert_eq!(out, vec![Taken::MAX * 8..Taken::MAX * 8 + 4]);
    }
}
