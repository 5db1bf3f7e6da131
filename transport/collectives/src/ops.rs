//! The collective operations: argument checks, algorithm choice, and typed wrappers over the
//! byte-level schedules in `oneshot` and `ring`.

use crate::comm::Communicator;
use crate::config::{Algorithm, Relay};
use crate::dtype::{DType, Element};
use crate::error::{CollError, Result};
use crate::reduce_op::ReduceOp;
use crate::{oneshot, ring};
use tbrdma_netdev::hostfile::TopologyKind;

fn check_len(op: &'static str, what: &str, len: usize, want: usize) -> Result<()> {
    if len == want {
        Ok(())
    } else {
        Err(CollError::BadArgument {
            op,
            problem: format!("{what} has {len} bytes, expected {want}"),
        })
    }
}

fn check_elements(op: &'static str, len: usize, dtype: DType) -> Result<()> {
    if len % dtype.size() == 0 {
        Ok(())
    } else {
        Err(CollError::BadArgument {
            op,
            problem: format!("{len} bytes is not a whole number of {dtype} elements"),
        })
    }
}

impl Communicator {
    /// The algorithm an all-reduce of `bytes` bytes runs with the current options.
    pub fn choose_algorithm(&self, bytes: usize) -> Result<Algorithm> {
        let full = self.fully_connected();
        let ring = self.has_ring();
        let no_route = || CollError::BadArgument {
            op: "all_reduce",
            problem: format!(
                "the {} topology has neither every rank cabled to every other (one-shot) nor rank k cabled to k±1 (ring)",
                self.topology
            ),
        };
        Ok(match self.opts.algorithm {
            Algorithm::OneShot if full => Algorithm::OneShot,
            Algorithm::OneShot => {
                return Err(CollError::BadArgument {
                    op: "all_reduce",
                    problem: "one-shot needs a cable between every two ranks; this is a ring (use the ring algorithm)".into(),
                });
            }
            Algorithm::Ring if ring => Algorithm::Ring,
            Algorithm::Ring => return Err(no_route()),
            Algorithm::Doubling if self.supports_doubling() => Algorithm::Doubling,
            Algorithm::Doubling => {
                return Err(CollError::BadArgument {
                    op: "all_reduce",
                    problem: "recursive doubling needs four ranks, each cabled to ranks r xor 1 and r xor 3 (a ring of four or a mesh)".into(),
                });
            }
            Algorithm::Auto if full && (bytes <= self.one_shot_limit() || !ring) => {
                Algorithm::OneShot
            }
            Algorithm::Auto if self.supports_doubling() && bytes <= self.doubling_limit() => {
                Algorithm::Doubling
            }
            Algorithm::Auto if ring => Algorithm::Ring,
            Algorithm::Auto if full => Algorithm::OneShot,
            Algorithm::Auto => return Err(no_route()),
        })
    }

    /// The largest all-reduce that [`Algorithm::Auto`] sends one-shot where every rank is cabled
    /// to every other: [`CommOptions::one_shot_max`] for a pair, divided by (N−1)² for a mesh
    /// of N, where each rank sends the whole message to N−1 peers and they all share the cores
    /// and links (measured crossovers: docs/collectives.md).
    ///
    /// [`CommOptions::one_shot_max`]: crate::CommOptions::one_shot_max
    fn one_shot_limit(&self) -> usize {
        one_shot_limit(self.opts.one_shot_max, self.world)
    }

    /// The largest all-reduce that [`Algorithm::Auto`] runs by recursive doubling where the
    /// ranks are not all cabled to each other (a ring of four): two exchanges of the whole
    /// message beat the ring's six hops while the message is small (measured crossover:
    /// docs/collectives.md).
    fn doubling_limit(&self) -> usize {
        self.opts.one_shot_max / 4
    }

    /// All-reduce of bytes: `output = input₀ op input₁ op … op input_{N−1}`, element-wise, on
    /// every rank. `input` and `output` have the same length, a whole number of `dtype`
    /// elements (zero is fine). Every rank must call it with the same length, type and op.
    pub fn all_reduce_bytes(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        check_len("all_reduce", "the output", output.len(), input.len())?;
        self.all_reduce_inner(Some(input), output, dtype, op)
    }

    /// All-reduce in place.
    pub fn all_reduce_bytes_in_place(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.all_reduce_inner(None, buf, dtype, op)
    }

    fn all_reduce_inner(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_usable()?;
        check_elements("all_reduce", out.len(), dtype)?;
        if self.world == 1 || out.is_empty() {
            if let Some(input) = input {
                tbrdma_verbs::copy_slice(out, input);
            }
            return Ok(());
        }
        match self.choose_algorithm(out.len())? {
            Algorithm::Ring => {
                let plan = ring::Plan {
                    segments: ring::split(out.len() / dtype.size(), self.world, dtype.size()),
                    shift: 0,
                    phases: ring::Phases::Both,
                    dtype,
                    op,
                };
                ring::run(self, out, input, &plan)
            }
            Algorithm::Doubling => oneshot::doubling(self, input, out, dtype, op),
            _ => oneshot::all_reduce(self, input, out, dtype, op),
        }
    }

    /// The part of a reduce-scatter of `count` elements that rank `rank` receives: counts that
    /// do not divide by the world size give the first `count % N` ranks one more element.
    pub fn reduce_scatter_range(&self, count: usize, rank: usize) -> std::ops::Range<usize> {
        let seg = &ring::split(count, self.world, 1)[rank];
        seg.start..seg.end
    }

    /// Reduce-scatter: `input` (the same element count on every rank) is reduced across ranks
    /// and this rank receives its segment ([`Self::reduce_scatter_range`]) in `output`.
    pub fn reduce_scatter_bytes(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_usable()?;
        check_elements("reduce_scatter", input.len(), dtype)?;
        let es = dtype.size();
        let mine = self.reduce_scatter_range(input.len() / es, self.rank);
        let mine = mine.start * es..mine.end * es;
        check_len("reduce_scatter", "the output", output.len(), mine.len())?;
        if self.world == 1 {
            tbrdma_verbs::copy_slice(output, input);
            return Ok(());
        }
        if input.is_empty() {
            return Ok(());
        }
        if !self.has_ring() {
            return Err(CollError::BadArgument {
                op: "reduce_scatter",
                problem: "needs rank k cabled to k±1".into(),
            });
        }
        // The working buffer's contents do not matter: the ring reads `input` where it is.
        let mut work = std::mem::take(&mut self.scratch.work);
        work.resize(input.len(), 0);
        let plan = ring::Plan {
            segments: ring::split(input.len() / es, self.world, es),
            shift: self.world - 1,
            phases: ring::Phases::ReduceScatter,
            dtype,
            op,
        };
        let result = ring::run(self, &mut work, Some(input), &plan);
        tbrdma_verbs::copy_slice(output, &work[mine]);
        self.scratch.work = work;
        result
    }

    /// All-gather: every rank contributes `input` (the same length everywhere); `output` (N
    /// times as long) receives rank k's input at `k·len`.
    pub fn all_gather_bytes(&mut self, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.check_usable()?;
        let block = input.len();
        check_len("all_gather", "the output", output.len(), block * self.world)?;
        tbrdma_verbs::copy_slice(
            &mut output[self.rank * block..(self.rank + 1) * block],
            input,
        );
        if self.world == 1 || block == 0 {
            return Ok(());
        }
        if self.fully_connected()
            && (self.opts.algorithm != Algorithm::Ring || !self.has_ring())
            && (block <= self.opts.one_shot_max || !self.has_ring())
        {
            return oneshot::all_gather(self, output, block);
        }
        if !self.has_ring() {
            return Err(CollError::BadArgument {
                op: "all_gather",
                problem: "needs a cable between every two ranks, or rank k cabled to k±1".into(),
            });
        }
        let plan = ring::Plan {
            segments: (0..self.world)
                .map(|k| k * block..(k + 1) * block)
                .collect(),
            shift: self.world - 1,
            phases: ring::Phases::AllGather,
            dtype: DType::U8,
            op: ReduceOp::Sum,
        };
        ring::run(self, output, None, &plan)
    }

    /// Broadcast: `buf` on `root` is copied into `buf` on every rank.
    pub fn broadcast_bytes(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        self.check_usable()?;
        if root >= self.world {
            return Err(CollError::BadArgument {
                op: "broadcast",
                problem: format!("root {root} is not a rank (world size {})", self.world),
            });
        }
        if self.world == 1 || buf.is_empty() {
            return Ok(());
        }
        if self.fully_connected() && (self.opts.algorithm != Algorithm::Ring || !self.has_ring()) {
            oneshot::broadcast(self, buf, root)
        } else if self.has_ring() {
            ring::broadcast(self, buf, root)
        } else {
            Err(CollError::BadArgument {
                op: "broadcast",
                problem: "needs a cable between every two ranks, or rank k cabled to k±1".into(),
            })
        }
    }

    /// Reduce: like all-reduce, but only `root`'s `output` is written (the others' is left as
    /// it was). Runs as an all-reduce: on these topologies that costs about as much.
    pub fn reduce_bytes(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        if root >= self.world {
            return Err(CollError::BadArgument {
                op: "reduce",
                problem: format!("root {root} is not a rank (world size {})", self.world),
            });
        }
        check_len("reduce", "the output", output.len(), input.len())?;
        if self.rank == root {
            self.all_reduce_bytes(input, output, dtype, op)
        } else {
            let mut tmp = std::mem::take(&mut self.scratch.typed);
            tmp.clear();
            tmp.extend_from_slice(input);
            let result = self.all_reduce_inner(None, &mut tmp, dtype, op);
            self.scratch.typed = tmp;
            result
        }
    }

    /// Barrier: returns once every rank has entered it.
    pub fn barrier(&mut self) -> Result<()> {
        let mut token = [1u8];
        self.all_reduce_inner(None, &mut token, DType::U8, ReduceOp::Max)
    }

    /// The path of a point-to-point message from `src` to `dst`: direct over a cable, else
    /// around the ring the shorter way (ties go up). Returns the hops in order, `src` first.
    pub fn route(&self, src: usize, dst: usize) -> Result<Vec<usize>> {
        let n = self.world;
        if src >= n || dst >= n || src == dst {
            return Err(CollError::BadArgument {
                op: "send/recv",
                problem: format!("no path from rank {src} to rank {dst} in a world of {n}"),
            });
        }
        let cabled = |a: usize, b: usize| match self.topology {
            TopologyKind::Pair | TopologyKind::Mesh => true,
            TopologyKind::Ring => (a + 1) % n == b || (b + 1) % n == a,
            // Elsewhere only this rank's own cables are known.
            _ => {
                (a == self.rank && self.is_neighbour(b)) || (b == self.rank && self.is_neighbour(a))
            }
        };
        if cabled(src, dst) {
            return Ok(vec![src, dst]);
        }
        if self.topology != TopologyKind::Ring {
            return Err(CollError::BadArgument {
                op: "send/recv",
                problem: format!(
                    "no cable joins ranks {src} and {dst}, and the {} topology has no ring to relay along",
                    self.topology
                ),
            });
        }
        Ok(tbrdma_netdev::setup::relay::ring_path(n, src, dst))
    }

    /// Sends `data` to `dst`; `dst` calls [`Self::recv_bytes`] with the same length. Messages
    /// between two ranks arrive in the order they were sent. Where no cable joins the two (see
    /// [`Self::route`]), with [`Relay::Kernel`] (the default) the message goes over a direct
    /// connection that the hosts in between relay in their kernels, made by the first send/recv
    /// between the two (which therefore waits for the peer's matching call), and the ranks in
    /// between call nothing; with [`Relay::Ranks`] each rank in between calls
    /// [`Self::forward`].
    pub fn send_bytes(&mut self, dst: usize, data: &[u8]) -> Result<()> {
        self.check_usable()?;
        let path = self.route(self.rank, dst)?;
        let next = if path.len() > 2 && self.relay == Relay::Kernel {
            self.connect_direct(dst, "send")?;
            dst
        } else {
            path[1]
        };
        let mut copy = std::mem::take(&mut self.scratch.typed);
        copy.clear();
        copy.extend_from_slice(data);
        let result = ring::pipe(self, "send", &mut copy, None, Some(next));
        self.scratch.typed = copy;
        result
    }

    /// Receives `out.len()` bytes sent by `src` with [`Self::send_bytes`].
    pub fn recv_bytes(&mut self, src: usize, out: &mut [u8]) -> Result<()> {
        self.check_usable()?;
        let path = self.route(src, self.rank)?;
        let prev = if path.len() > 2 && self.relay == Relay::Kernel {
            self.connect_direct(src, "recv")?;
            src
        } else {
            path[path.len() - 2]
        };
        ring::pipe(self, "recv", out, Some(prev), None)
    }

    /// Relays a `len`-byte message from `src` to `dst` through this rank, which must be on
    /// [`Self::route`]`(src, dst)`. Chunks are passed on as they arrive. With [`Relay::Kernel`]
    /// (the default) the kernel relays instead, and this only checks its arguments.
    pub fn forward(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        self.check_usable()?;
        let path = self.route(src, dst)?;
        let Some(at) = path
            .iter()
            .position(|&k| k == self.rank)
            .filter(|&i| i > 0 && i + 1 < path.len())
        else {
            return Err(CollError::BadArgument {
                op: "forward",
                problem: format!(
                    "rank {} is not between {src} and {dst} on {path:?}",
                    self.rank
                ),
            });
        };
        if self.relay == Relay::Kernel {
            return Ok(());
        }
        let mut buf = std::mem::take(&mut self.scratch.typed);
        buf.clear();
        buf.resize(len, 0);
        let result = ring::pipe(
            self,
            "forward",
            &mut buf,
            Some(path[at - 1]),
            Some(path[at + 1]),
        );
        self.scratch.typed = buf;
        result
    }

    /// Typed all-reduce (out of place).
    pub fn all_reduce<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if input.len() != output.len() {
            return Err(CollError::BadArgument {
                op: "all_reduce",
                problem: format!(
                    "input has {} elements, output {}",
                    input.len(),
                    output.len()
                ),
            });
        }
        let mut bytes = std::mem::take(&mut self.scratch.typed);
        T::to_bytes(input, &mut bytes);
        let result = self.all_reduce_inner(None, &mut bytes, T::DTYPE, op);
        T::from_bytes(&bytes, output);
        self.scratch.typed = bytes;
        result
    }

    /// Typed all-reduce in place.
    pub fn all_reduce_in_place<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let mut bytes = std::mem::take(&mut self.scratch.typed);
        T::to_bytes(buf, &mut bytes);
        let result = self.all_reduce_inner(None, &mut bytes, T::DTYPE, op);
        T::from_bytes(&bytes, buf);
        self.scratch.typed = bytes;
        result
    }
}

/// See [`Communicator::one_shot_limit`].
fn one_shot_limit(one_shot_max: usize, world: usize) -> usize {
    let peers = world.saturating_sub(1).max(1);
    one_shot_max / (peers * peers)
}

#[cfg(test)]
mod tests {
    use super::one_shot_limit;

    #[test]
    fn one_shot_shrinks_with_the_square_of_the_peers() {
        let max = 256 << 10;
        assert_eq!(one_shot_limit(max, 1), max);
        assert_eq!(one_shot_limit(max, 2), max, "a pair: the option itself");
        assert_eq!(
            one_shot_limit(max, 3),
            64 << 10,
            "a 3-mesh: the measured crossover"
        );
        assert_eq!(one_shot_limit(max, 4), max / 9);
    }
}
