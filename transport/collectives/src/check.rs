//! Deterministic per-rank inputs and their reference results, for `--check` in the tools and
//! for the tests: any rank can compute what every rank contributed and what the result must
//! be, without communicating.
//!
//! The values are small integers (−8..=8, or ±1, ±2 for prod) so that every reduction order
//! gives the exact same result in every type, 16-bit floats included: a mismatch is a bug, not
//! rounding. [`random_input`] gives arbitrary floats, for checking that ranks agree bit for bit.

use half::{bf16, f16};

use crate::dtype::{DType, reduce_ranks};
use crate::reduce_op::ReduceOp;

fn mix(seed: u64, rank: usize, i: usize) -> u64 {
    let mut x = seed
        ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (i as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn push_value(dtype: DType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
        DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
        DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
        DType::Bf16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
        DType::I8 => out.push(v as i64 as i8 as u8),
        DType::U8 => out.push(v as i64 as u8),
        DType::I32 => out.extend_from_slice(&(v as i64 as i32).to_le_bytes()),
        DType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
    }
}

/// Rank `rank`'s input of `count` elements for `op` (small integers), into `out`.
pub fn input(dtype: DType, op: ReduceOp, count: usize, rank: usize, seed: u64, out: &mut Vec<u8>) {
    out.clear();
    out.reserve(count * dtype.size());
    for i in 0..count {
        let h = mix(seed, rank, i);
        let v = if op == ReduceOp::Prod {
            [-2.0, -1.0, 1.0, 2.0][(h % 4) as usize]
        } else {
            (h % 17) as f64 - 8.0
        };
        push_value(dtype, v, out);
    }
}

/// Rank `rank`'s input of arbitrary values (floats in [−1, 1), integers over their range).
pub fn random_input(dtype: DType, count: usize, rank: usize, seed: u64, out: &mut Vec<u8>) {
    out.clear();
    for i in 0..count {
        let h = mix(seed, rank, i);
        if dtype.is_float() {
            push_value(dtype, (h >> 11) as f64 / (1u64 << 52) as f64 - 1.0, out);
        } else {
            out.extend_from_slice(&h.to_le_bytes()[..dtype.size()]);
        }
    }
}

/// The all-reduce of every rank's [`input`], into `out`.
pub fn expected(
    dtype: DType,
    op: ReduceOp,
    count: usize,
    world: usize,
    seed: u64,
    out: &mut Vec<u8>,
) {
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| {
            let mut v = Vec::new();
            input(dtype, op, count, r, seed, &mut v);
            v
        })
        .collect();
    out.clear();
    out.resize(count * dtype.size(), 0);
    reduce_ranks(dtype, op, out, &inputs, &mut Vec::new());
}

/// Elements of `got` that differ (bitwise) from `want`.
pub fn count_wrong(dtype: DType, got: &[u8], want: &[u8]) -> usize {
    let n = dtype.size();
    let mut wrong = got
        .chunks(n)
        .zip(want.chunks(n))
        .filter(|(a, b)| a != b)
        .count();
    wrong += got.len().abs_diff(want.len()) / n;
    wrong
}

/// FNV-1a-64 of bytes: ranks print it so a test can see that they agree bit for bit.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_deterministic_and_differ_by_rank() {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        input(DType::Bf16, ReduceOp::Sum, 100, 0, 7, &mut a);
        input(DType::Bf16, ReduceOp::Sum, 100, 0, 7, &mut b);
        input(DType::Bf16, ReduceOp::Sum, 100, 1, 7, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 200);
        let mut want = Vec::new();
        expected(DType::I32, ReduceOp::Max, 5, 3, 1, &mut want);
        assert_eq!(want.len(), 20);
        assert_eq!(count_wrong(DType::I32, &want, &want), 0);
        let mut other = want.clone();
        other[4] ^= 1;
        assert_eq!(count_wrong(DType::I32, &other, &want), 1);
    }
}

/// What [`suite`] found on one rank.
#[derive(Debug, Default)]
pub struct SuiteReport {
    /// Calls whose result matched the reference.
    pub passed: usize,
    /// Mismatches, one line each.
    pub failures: Vec<String>,
    /// `name fingerprint` lines of results from arbitrary inputs: equal on every rank when
    /// the ranks agree bit for bit.
    pub fingerprints: Vec<String>,
}

/// Runs every operation × type × op × count (each algorithm the topology allows) on this rank
/// against the local reference. Every rank of the communicator must call it with the same
/// arguments. A transport error ends it.
pub fn suite(
    comm: &mut crate::Communicator,
    counts: &[usize],
    seed: u64,
) -> crate::Result<SuiteReport> {
    use crate::config::Algorithm;
    let mut report = SuiteReport::default();
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut algorithms = Vec::new();
    if comm.fully_connected() {
        algorithms.push(Algorithm::OneShot);
    }
    if comm.has_ring() {
        algorithms.push(Algorithm::Ring);
    }
    if comm.supports_doubling() {
        algorithms.push(Algorithm::Doubling);
    }
    let saved = comm.options().algorithm;
    let (mut inp, mut want, mut got) = (Vec::new(), Vec::new(), Vec::new());
    let note = |report: &mut SuiteReport, what: String, wrong: usize| {
        if wrong == 0 {
            report.passed += 1;
        } else {
            report.failures.push(format!("{what}: {wrong} wrong"));
        }
    };
    for &alg in &algorithms {
        comm.set_algorithm(alg);
        for (k, &count) in counts.iter().enumerate() {
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    let s = seed ^ (k as u64) << 8 ^ (dtype as u64) << 16 ^ (op as u64) << 24;
                    input(dtype, op, count, rank, s, &mut inp);
                    expected(dtype, op, count, world, s, &mut want);
                    got.clear();
                    got.resize(inp.len(), 0xAA);
                    let in_place = (k + op as usize) % 2 == 1;
                    if in_place {
                        got.copy_from_slice(&inp);
                        comm.all_reduce_bytes_in_place(&mut got, dtype, op)?;
                    } else {
                        comm.all_reduce_bytes(&inp, &mut got, dtype, op)?;
                    }
                    let what = format!(
                        "all_reduce {alg:?} {dtype} {op} count {count}{}",
                        if in_place { " in place" } else { "" }
                    );
                    note(&mut report, what, count_wrong(dtype, &got, &want));
                }
                // Reduce-scatter, all-gather, broadcast and reduce, once per type and count.
                let op = ReduceOp::ALL[k % 5];
                let s = seed ^ 0x5ca7 ^ (k as u64) << 8 ^ (dtype as u64) << 16;
                input(dtype, op, count, rank, s, &mut inp);
                expected(dtype, op, count, world, s, &mut want);
                let mine = comm.reduce_scatter_range(count, rank);
                let es = dtype.size();
                got.clear();
                got.resize(mine.len() * es, 0xAA);
                if comm.has_ring() || world == 1 {
                    comm.reduce_scatter_bytes(&inp, &mut got, dtype, op)?;
                    let w = count_wrong(dtype, &got, &want[mine.start * es..mine.end * es]);
                    note(
                        &mut report,
                        format!("reduce_scatter {alg:?} {dtype} {op} count {count}"),
                        w,
                    );
                }
                got.clear();
                got.resize(inp.len() * world, 0xAA);
                comm.all_gather_bytes(&inp, &mut got)?;
                let mut all = Vec::new();
                for r in 0..world {
                    input(dtype, op, count, r, s, &mut want);
                    all.extend_from_slice(&want);
                }
                note(
                    &mut report,
                    format!("all_gather {alg:?} {dtype} count {count}"),
                    count_wrong(dtype, &got, &all),
                );
                let root = k % world;
                input(dtype, op, count, root, s, &mut want);
                if rank == root {
                    got.clone_from(&want);
                } else {
                    got.clear();
                    got.resize(want.len(), 0xAA);
                }
                comm.broadcast_bytes(&mut got, root)?;
                note(
                    &mut report,
                    format!("broadcast {alg:?} {dtype} root {root} count {count}"),
                    count_wrong(dtype, &got, &want),
                );
                expected(dtype, op, count, world, s, &mut want);
                got.clear();
                got.resize(inp.len(), 0xAA);
                let before = got.clone();
                comm.reduce_bytes(&inp, &mut got, dtype, op, root)?;
                let w = if rank == root {
                    count_wrong(dtype, &got, &want)
                } else {
                    count_wrong(dtype, &got, &before)
                };
                note(
                    &mut report,
                    format!("reduce {alg:?} {dtype} {op} root {root} count {count}"),
                    w,
                );
                // Arbitrary floats: the ranks must agree bit for bit.
                random_input(dtype, count, rank, s, &mut inp);
                got.clear();
                got.resize(inp.len(), 0);
                comm.all_reduce_bytes(&inp, &mut got, dtype, ReduceOp::Sum)?;
                report.fingerprints.push(format!(
                    "{alg:?}/{dtype}/{count} {:016x}",
                    fingerprint(&got)
                ));
            }
        }
        comm.barrier()?;
        report.passed += 1;
    }
    comm.set_algorithm(saved);
    // Point-to-point between every ordered pair, relayed where no cable joins them: as the
    // communicator is set to relay (by default the kernels in between, which the ranks in
    // between leave alone), then, if that was the kernel, through the ranks in between too.
    let relay = comm.relay();
    let mut relays = vec![relay];
    if relay == crate::Relay::Kernel {
        relays.push(crate::Relay::Ranks);
    }
    for &mode in &relays {
        comm.set_relay(mode);
        for (k, &count) in counts.iter().enumerate() {
            for src in 0..world {
                for dst in (0..world).filter(|&d| d != src) {
                    let s = seed ^ 0x9e1a ^ (k as u64) << 8 ^ (src * world + dst) as u64;
                    random_input(DType::U8, count, src, s, &mut want);
                    let path = comm.route(src, dst)?;
                    if rank == src {
                        comm.send_bytes(dst, &want)?;
                    } else if rank == dst {
                        got.clear();
                        got.resize(count, 0xAA);
                        comm.recv_bytes(src, &mut got)?;
                        let how = if path.len() > 2 {
                            format!(" relayed by the {mode}")
                        } else {
                            String::new()
                        };
                        note(
                            &mut report,
                            format!("send/recv {src}->{dst} via {path:?}{how} count {count}"),
                            count_wrong(DType::U8, &got, &want),
                        );
                    } else if path.contains(&rank) && mode == crate::Relay::Ranks {
                        comm.forward(src, dst, count)?;
                    }
                }
            }
        }
    }
    comm.set_relay(relay);
    // Everyone leaves the suite together, so no rank closes its connections while another
    // still has point-to-point traffic in flight to it.
    comm.barrier()?;
    Ok(report)
}
