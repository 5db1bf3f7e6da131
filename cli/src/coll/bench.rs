//! nccl-tests-style sweeps: `tbrdma allreduce|allgather|reducescatter|broadcast`. Columns
//! `size count type redop time(us) algbw(GB/s) busbw(GB/s) #wrong`, as nccl-tests prints them;
//! time is the mean over iterations, the slowest rank's (the median follows each row as a
//! comment line); bus bandwidth applies nccl-tests'
//! factors (2(N−1)/N for all-reduce, (N−1)/N for all-gather and reduce-scatter, 1 for
//! broadcast) so that figures compare across rank counts.

use std::time::Instant;

use anyhow::{anyhow, bail};
use clap::Args;
use serde::Serialize;
use tbrdma_collectives::check::{count_wrong, expected, input};
use tbrdma_collectives::{Algorithm, Communicator, DType, ReduceOp};

use super::baseline::{RingAddrs, UdpPair};
use super::compute::Compute;
use super::{CommArgs, parse_size};

/// Which collective a sweep measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// All-reduce.
    AllReduce,
    /// All-gather (size: the whole output).
    AllGather,
    /// Reduce-scatter (size: the whole input).
    ReduceScatter,
    /// Broadcast from rank 0.
    Broadcast,
}

/// Options of a sweep.
#[derive(Debug, Args, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub comm: CommArgs,
    /// Smallest size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8")]
    pub min: String,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "128M")]
    pub max: String,
    /// Multiply the size by this factor between steps.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub factor: usize,
    /// Element types: a list (f32,bf16) or `all`.
    #[arg(short = 'd', long = "datatype", default_value = "f32")]
    pub dtype: String,
    /// Reduction operators: a list (sum,max) or `all`.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: String,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Untimed iterations per size first.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: usize,
    /// Check every iteration's result against a locally computed reference.
    #[arg(short = 'c', long)]
    pub check: bool,
    /// Busy work of this many microseconds on every rank after each timed call, outside the
    /// timed region: a model's compute between its all-reduces (a decode step's are about a
    /// millisecond apart). 0: calls back to back, as nccl-tests does.
    #[arg(long = "gap-us", value_name = "US", default_value_t = 0)]
    pub gap_us: u64,
    /// During each gap, first write this many MiB of memory once, as a model's compute
    /// streams its weights through the caches (so each call starts with cold caches).
    #[arg(long = "gap-touch-mib", value_name = "MIB", default_value_t = 0)]
    pub gap_touch_mib: usize,
    /// All-reduce in place (the output buffer holds the input), as tensor-parallel frameworks
    /// call it (nccl-tests' in-place columns). The buffer is refilled with the input before
    /// each call, outside the timed region. tbrdma only.
    #[arg(long = "in-place")]
    pub in_place: bool,
    /// One JSON object per line and size on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// What moves the data (all-reduce only for the baselines): `tbrdma`; `tcp`, a plain TCP
    /// ring all-reduce as MLX's ring backend does it; `udp-floor`, the one-way latency of a
    /// busy-polling UDP ping-pong of the message between ranks 0 and 1 (one exchange at the
    /// kernel's floor); `udp-exchange`, ranks 0 and 1 both sending it and then receiving (what
    /// the kernel alone costs a two-rank one-shot all-reduce).
    #[arg(long, default_value = "tbrdma")]
    pub transport: String,
    /// Times tbrdma's calls in blocks of `--block`, each block between two blocks of this
    /// baseline run by the same processes over the same cable, and reports tbrdma's mean over
    /// the baseline's median block by block (`paired` in JSON). Only `udp-exchange`, for a
    /// two-rank all-reduce of one datagram. On a host whose speed changes from one second to
    /// the next, a ratio of figures taken seconds apart measures the host; blocks a few
    /// milliseconds apart share its speed.
    #[arg(long = "paired-with", value_name = "BASELINE")]
    pub paired_with: Option<String>,
    /// Calls per block with `--paired-with` (tbrdma's and the baseline's).
    #[arg(long, default_value_t = 500)]
    pub block: usize,
}

#[derive(Debug, Serialize)]
struct Row {
    size: usize,
    count: usize,
    #[serde(rename = "type")]
    dtype: String,
    redop: String,
    time_us: f64,
    /// Median per call (the slowest rank's median); not an nccl-tests column: printed as a
    /// comment line under the row, a key in JSON.
    time_us_median: f64,
    /// The 99th percentile per call (the slowest rank's): the tail a decode step of many
    /// all-reduces feels through the mean.
    #[serde(skip_serializing_if = "Option::is_none")]
    time_us_p99: Option<f64>,
    algbw_gbs: f64,
    busbw_gbs: f64,
    wrong: u64,
    /// Retransmitted packets, tail loss probes (counted among them) and retransmission
    /// timeouts in the timed calls, summed over the ranks' links (tbrdma only): a tail made
    /// by loss recovery rather than by scheduling.
    #[serde(skip_serializing_if = "Option::is_none")]
    recovery: Option<Recovery>,
    /// tbrdma against a baseline timed in blocks between its own (`--paired-with`).
    #[serde(skip_serializing_if = "Option::is_none")]
    paired: Option<Paired>,
    /// All-reduce on tbrdma: the share of the bytes the ranks received from each other in the
    /// timed calls that were reduced packet by packet as they arrived, with no copy into an
    /// inbox (`Communicator::reduced_on_arrival`; a two-rank one-shot all-reduce does it).
    #[serde(skip_serializing_if = "Option::is_none")]
    reduced_on_arrival: Option<f64>,
    /// In place (`--in-place`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    in_place: bool,
}

/// tbrdma's calls against a baseline's, block by block (`--paired-with`).
#[derive(Debug, Serialize, Clone)]
struct Paired {
    /// The baseline (`udp-exchange`).
    baseline: String,
    /// Blocks of tbrdma's calls; the baseline ran one more (one before each and one after the
    /// last).
    blocks: usize,
    /// Calls per block.
    block: usize,
    /// The median of the baseline's per-block medians (rank 0's, as `--transport
    /// udp-exchange` reports it), microseconds.
    baseline_us: f64,
    /// The median over tbrdma's blocks of its mean (the slowest rank's) over the geometric
    /// mean of the medians of the baseline's blocks before and after it: the figure issue 16's
    /// target (mean within 1.3x the exchange floor) is judged on.
    ratio_mean: f64,
    /// The same with tbrdma's per-block median (the slowest rank's).
    ratio_median: f64,
}

#[derive(Debug, Serialize, Clone, Copy)]
struct Recovery {
    retransmits: u64,
    tail_probes: u64,
    timeouts: u64,
}

fn list<T: std::str::FromStr<Err = String> + Copy>(s: &str, all: &[T]) -> anyhow::Result<Vec<T>> {
    if s == "all" {
        return Ok(all.to_vec());
    }
    s.split(',')
        .map(|x| x.trim().parse::<T>().map_err(|e| anyhow!(e)))
        .collect()
}

/// The sizes of a sweep.
fn sizes(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        out.push(s);
        match s.checked_mul(factor.max(2)) {
            Some(n) => s = n,
            None => break,
        }
    }
    out
}

/// Runs one sweep and prints it (rank 0). Returns the total number of wrong elements.
pub fn run(kind: Kind, args: BenchArgs) -> anyhow::Result<u64> {
    let dtypes = list(&args.dtype, &DType::ALL)?;
    let ops = if kind == Kind::AllReduce || kind == Kind::ReduceScatter {
        list(&args.op, &ReduceOp::ALL)?
    } else {
        vec![ReduceOp::Sum]
    };
    if args.in_place && kind != Kind::AllReduce {
        bail!("--in-place is for all-reduce");
    }
    if args.transport != "tbrdma" {
        if args.in_place {
            bail!("--in-place: tbrdma only (the TCP ring runs in place anyway)");
        }
        if kind != Kind::AllReduce {
            return Err(anyhow!(
                "--transport {} measures all-reduce only",
                args.transport
            ));
        }
        return run_baseline(&args, &dtypes, &ops);
    }
    let mut comm = args.comm.connect()?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let quiet = rank != 0;
    if !quiet && !args.json {
        println!(
            "# tbrdma {kind:?}: {world} ranks, {} topology, {} rails per neighbour, {} engine, algorithm {}",
            comm.topology(),
            comm.rails(),
            comm.engine().name(),
            args.comm.algo
        );
        header();
    }
    let mut total_wrong = 0;
    for &dtype in &dtypes {
        for &op in &ops {
            for size in sizes(parse_size(&args.min)?, parse_size(&args.max)?, args.factor) {
                let row = measure(&mut comm, kind, dtype, op, size, &args)?;
                total_wrong += row.wrong;
                if quiet {
                    continue;
                }
                print_row(&row, args.json)?;
            }
        }
    }
    Ok(total_wrong)
}

fn header() {
    println!(
        "#{:>11} {:>12} {:>6} {:>6} {:>10} {:>12} {:>12} {:>7}",
        "size", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
    );
}

fn print_row(row: &Row, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(row)?);
    } else {
        println!(
            "{:>12} {:>12} {:>6} {:>6} {:>10.2} {:>12.3} {:>12.3} {:>7}",
            row.size,
            row.count,
            row.dtype,
            row.redop,
            row.time_us,
            row.algbw_gbs,
            row.busbw_gbs,
            row.wrong
        );
        let form = if row.in_place { "in place; " } else { "" };
        print!("#   {form}median per call {:.2} us", row.time_us_median);
        if let Some(p99) = row.time_us_p99 {
            print!(", p99 {p99:.2} us");
        }
        match row.recovery {
            Some(r) => println!(
                "; retransmits {} (tail probes {}), timeouts {}",
                r.retransmits, r.tail_probes, r.timeouts
            ),
            None => println!(),
        }
        if let Some(share) = row.reduced_on_arrival {
            println!(
                "#   {:.1} % of the received bytes reduced as they arrived",
                share * 100.0
            );
        }
        if let Some(p) = &row.paired {
            println!(
                "#   paired with {} in {} blocks of {} calls: its median {:.2} us; block by \
                 block, tbrdma's mean / it {:.2}, median / it {:.2} (medians over blocks)",
                p.baseline, p.blocks, p.block, p.baseline_us, p.ratio_mean, p.ratio_median
            );
        }
    }
    Ok(())
}

/// The same sweep over a baseline transport (see [`super::baseline`]).
fn run_baseline(args: &BenchArgs, dtypes: &[DType], ops: &[ReduceOp]) -> anyhow::Result<u64> {
    use super::baseline::{TcpRing, udp_floor};
    let addrs = RingAddrs::load(args.comm.hostfile.as_ref(), args.comm.rank)?;
    let (rank, world) = (addrs.rank(), addrs.world());
    let port = args.comm.port.wrapping_add(900);
    let timeout = std::time::Duration::from_secs_f64(args.comm.timeout.max(0.01));
    let min = parse_size(&args.min)?;
    let max = parse_size(&args.max)?;
    let mut ring = match args.transport.as_str() {
        "tcp" => Some(TcpRing::connect(&addrs, port, timeout)?),
        "udp-floor" | "udp-exchange" => None,
        other => {
            return Err(anyhow!(
                "unknown transport {other:?} (tbrdma, tcp, udp-floor, udp-exchange)"
            ));
        }
    };
    if rank == 0 && !args.json {
        println!("# baseline {}: {world} ranks", args.transport);
        header();
    }
    let mut total_wrong = 0;
    // The compute between calls, one for every baseline and size (its buffer allocated once).
    let mut gap = Compute::new(args.gap_us, args.gap_touch_mib);
    for &dtype in dtypes {
        for &op in ops {
            for size in sizes(min, max, args.factor) {
                let es = dtype.size();
                let count = size / es;
                let bytes = count * es;
                let (time, median, p99) = match ring.as_mut() {
                    None => match udp_floor(
                        &addrs,
                        port,
                        bytes,
                        args.iters.max(1),
                        args.transport == "udp-exchange",
                        &mut || gap.run(),
                    )? {
                        // Already a median (half the round trip for the ping-pong).
                        Some(t) => (t, t, None),
                        None => continue,
                    },
                    Some(ring) => {
                        let (mut inp, mut want) = (Vec::new(), Vec::new());
                        input(dtype, op, count, rank, size as u64, &mut inp);
                        if args.check {
                            expected(dtype, op, count, world, size as u64, &mut want);
                        }
                        let mut buf = inp.clone();
                        for _ in 0..args.warmup {
                            buf.copy_from_slice(&inp);
                            ring.all_reduce(&mut buf, dtype, op)?;
                        }
                        let mut wrong = 0u64;
                        let mut per_call = Vec::with_capacity(args.iters);
                        for _ in 0..args.iters {
                            buf.copy_from_slice(&inp);
                            let start = Instant::now();
                            ring.all_reduce(&mut buf, dtype, op)?;
                            per_call.push(start.elapsed().as_secs_f64());
                            if args.check {
                                wrong += count_wrong(dtype, &buf, &want) as u64;
                            }
                            gap.run();
                        }
                        total_wrong += wrong;
                        let times = super::CallTimes::new(per_call);
                        let (mean, median) = (times.mean, times.quantile(0.5));
                        let p99 = times.quantile(0.99);
                        let mut slowest = [mean, median, p99].map(f64::to_le_bytes).concat();
                        ring.all_reduce(&mut slowest, DType::F64, ReduceOp::Max)?;
                        let at = |i: usize| {
                            f64::from_le_bytes(
                                slowest[8 * i..8 * i + 8].try_into().expect("8 bytes"),
                            )
                        };
                        (at(0), at(1), Some(at(2)))
                    }
                };
                if rank != 0 {
                    continue;
                }
                let n = world as f64;
                let algbw = if time > 0.0 {
                    bytes as f64 / time / 1e9
                } else {
                    0.0
                };
                let factor = if ring.is_some() {
                    2.0 * (n - 1.0) / n
                } else {
                    1.0
                };
                let row = Row {
                    size: bytes,
                    count,
                    dtype: dtype.name().to_string(),
                    redop: op.name().to_string(),
                    time_us: time * 1e6,
                    time_us_median: median * 1e6,
                    time_us_p99: p99.map(|t| t * 1e6),
                    algbw_gbs: algbw,
                    busbw_gbs: algbw * factor,
                    wrong: total_wrong,
                    recovery: None,
                    paired: None,
                    reduced_on_arrival: None,
                    in_place: false,
                };
                print_row(&row, args.json)?;
            }
        }
    }
    Ok(total_wrong)
}

fn measure(
    comm: &mut Communicator,
    kind: Kind,
    dtype: DType,
    op: ReduceOp,
    size: usize,
    args: &BenchArgs,
) -> anyhow::Result<Row> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let es = dtype.size();
    // Per-rank element count: all-gather's size is the whole output, as in nccl-tests.
    let count = match kind {
        Kind::AllGather => size / es / world,
        _ => size / es,
    };
    let seed = size as u64;
    let (mut inp, mut want) = (Vec::new(), Vec::new());
    input(dtype, op, count, rank, seed, &mut inp);
    let out_len = match kind {
        Kind::AllGather => count * es * world,
        Kind::ReduceScatter => comm.reduce_scatter_range(count, rank).len() * es,
        _ => count * es,
    };
    if args.check {
        match kind {
            Kind::AllReduce => expected(dtype, op, count, world, seed, &mut want),
            Kind::ReduceScatter => {
                expected(dtype, op, count, world, seed, &mut want);
                let r = comm.reduce_scatter_range(count, rank);
                want = want[r.start * es..r.end * es].to_vec();
            }
            Kind::AllGather => {
                let mut block = Vec::new();
                for r in 0..world {
                    input(dtype, op, count, r, seed, &mut block);
                    want.extend_from_slice(&block);
                }
            }
            Kind::Broadcast => input(dtype, op, count, 0, seed, &mut want),
        }
    }
    let mut out = vec![0u8; out_len];
    // (`run` refuses `--in-place` for anything but an all-reduce.)
    let in_place = args.in_place;
    // In place, `out` was refilled with the input before the call (outside the timing).
    let once = |comm: &mut Communicator, inp: &[u8], out: &mut Vec<u8>| -> anyhow::Result<()> {
        match kind {
            Kind::AllReduce if in_place => comm.all_reduce_bytes_in_place(out, dtype, op)?,
            Kind::AllReduce => comm.all_reduce_bytes(inp, out, dtype, op)?,
            Kind::AllGather => comm.all_gather_bytes(inp, out)?,
            Kind::ReduceScatter => comm.reduce_scatter_bytes(inp, out, dtype, op)?,
            Kind::Broadcast => {
                if rank == 0 {
                    out.copy_from_slice(inp);
                }
                comm.broadcast_bytes(out, 0)?
            }
        }
        Ok(())
    };
    let mut pair = match args.paired_with.as_deref() {
        None => None,
        Some("udp-exchange") if kind == Kind::AllReduce && world == 2 => {
            let addrs = RingAddrs::load(args.comm.hostfile.as_ref(), args.comm.rank)?;
            UdpPair::connect(&addrs, args.comm.port.wrapping_add(900), count * es)?
        }
        Some("udp-exchange") => bail!("--paired-with udp-exchange pairs a two-rank all-reduce"),
        Some(other) => bail!("--paired-with {other:?}: only udp-exchange"),
    };
    let block = args.block.max(1);
    let mut gap = Compute::new(args.gap_us, args.gap_touch_mib);
    for _ in 0..args.warmup {
        if in_place {
            out.copy_from_slice(&inp);
        }
        once(comm, &inp, &mut out)?;
    }
    if let Some(pair) = pair.as_mut() {
        pair.exchanges(args.warmup.min(block), &mut || gap.run())?;
    }
    comm.barrier()?;
    let before = recovery(comm);
    let on_arrival_before = comm.reduced_on_arrival();
    let mut wrong = 0u64;
    let mut per_call = Vec::with_capacity(args.iters);
    let mut live = inp.clone();
    // Without a pairing, one block of every call.
    let blocks = if pair.is_some() {
        args.iters.div_ceil(block)
    } else {
        1
    };
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for b in 0..blocks {
        let calls = if pair.is_some() {
            block.min(args.iters - b * block)
        } else {
            args.iters
        };
        if let Some(pair) = pair.as_mut() {
            theirs.push(median_of(pair.exchanges(block, &mut || gap.run())?));
        }
        let first = per_call.len();
        for _ in 0..calls {
            if gap.is_active() {
                // After a gap, the input and the output are written first, as a model's compute
                // leaves the tensor it hands over (and as the TCP ring's in-place buffer is
                // refreshed before each call): a gap that evicted the caches must not leave this
                // side's buffers cold while the baseline's are warm.
                live.copy_from_slice(&inp);
                out.fill(0xAA);
            } else if args.check {
                out.fill(0xAA);
            }
            if in_place {
                out.copy_from_slice(&live);
            }
            let start = Instant::now();
            once(comm, &live, &mut out)?;
            per_call.push(start.elapsed().as_secs_f64());
            if args.check {
                wrong += count_wrong(dtype, &out, &want) as u64;
            }
            gap.run();
        }
        let this_block = super::CallTimes::new(per_call[first..].to_vec());
        ours.push((this_block.mean, this_block.quantile(0.5)));
    }
    if let Some(pair) = pair.as_mut() {
        theirs.push(median_of(pair.exchanges(block, &mut || gap.run())?));
    }
    // (Read before the all-reduces that share the figures, which would count too.)
    let on_arrival = comm.reduced_on_arrival() - on_arrival_before;
    let paired = match args.paired_with.as_deref() {
        Some(baseline) => Some(pairing(comm, baseline, block, &ours, &theirs)?),
        None => None,
    };
    let times = super::CallTimes::new(per_call);
    let (mean, median, p99) = (times.mean, times.quantile(0.5), times.quantile(0.99));
    // Every rank reports the slowest rank's mean, median and p99, and the sums over ranks of
    // wrong elements and of loss recovery in the timed calls.
    let mut slowest = [mean, median, p99];
    comm.all_reduce_in_place(&mut slowest, ReduceOp::Max)?;
    let recovered = recovery(comm).since(before);
    let mut wrong_all = [wrong as i64];
    comm.all_reduce_in_place(&mut wrong_all, ReduceOp::Sum)?;
    let [time, median, p99] = slowest;
    let mut recovery_all = [
        recovered.retransmits as i64,
        recovered.tail_probes as i64,
        recovered.timeouts as i64,
        on_arrival as i64,
    ];
    comm.all_reduce_in_place(&mut recovery_all, ReduceOp::Sum)?;
    let bytes = match kind {
        Kind::AllGather => count * es * world,
        _ => count * es,
    };
    let algbw = if time > 0.0 {
        bytes as f64 / time / 1e9
    } else {
        0.0
    };
    let n = world as f64;
    let factor = match kind {
        Kind::AllReduce => 2.0 * (n - 1.0) / n,
        Kind::AllGather | Kind::ReduceScatter => (n - 1.0) / n,
        Kind::Broadcast => 1.0,
    };
    Ok(Row {
        size: bytes,
        count,
        dtype: dtype.name().to_string(),
        redop: match kind {
            Kind::AllReduce | Kind::ReduceScatter => op.name().to_string(),
            _ => "none".to_string(),
        },
        time_us: time * 1e6,
        time_us_median: median * 1e6,
        time_us_p99: Some(p99 * 1e6),
        algbw_gbs: algbw,
        busbw_gbs: algbw * factor,
        wrong: wrong_all[0] as u64,
        recovery: Some(Recovery {
            retransmits: recovery_all[0] as u64,
            tail_probes: recovery_all[1] as u64,
            timeouts: recovery_all[2] as u64,
        }),
        paired,
        // What each rank receives per call: the whole message from each of the others
        // (one-shot), from each of its two partners (doubling), or 2(N-1)/N of it (ring).
        reduced_on_arrival: (kind == Kind::AllReduce && args.iters > 0 && world > 1).then(|| {
            let received = match comm.choose_algorithm(bytes) {
                Ok(Algorithm::Doubling) => 2 * bytes,
                Ok(Algorithm::Ring) => bytes * 2 * (world - 1) / world,
                _ => bytes * (world - 1),
            };
            recovery_all[3] as f64 / (args.iters * world * received) as f64
        }),
        in_place,
    })
}

/// The median of `v` (0 when empty).
fn median_of(v: Vec<f64>) -> f64 {
    super::CallTimes::new(v).quantile(0.5)
}

/// tbrdma's blocks (`ours`: this rank's mean and median per block) against the baseline's
/// (`theirs`: the median of each, one more than ours, one before each of ours and one after
/// the last): the slowest rank's figures for ours, rank 0's for theirs (as the baseline
/// reports itself), then [`block_ratios`].
fn pairing(
    comm: &mut Communicator,
    baseline: &str,
    block: usize,
    ours: &[(f64, f64)],
    theirs: &[f64],
) -> anyhow::Result<Paired> {
    let rank0 = comm.rank() == 0;
    let mut all: Vec<f64> = ours.iter().map(|o| o.0).collect();
    all.extend(ours.iter().map(|o| o.1));
    all.extend(theirs.iter().map(|&t| if rank0 { t } else { 0.0 }));
    comm.all_reduce_in_place(&mut all, ReduceOp::Max)?;
    let n = ours.len();
    let (means, rest) = all.split_at(n);
    let (medians, theirs) = rest.split_at(n);
    Ok(Paired {
        baseline: baseline.to_string(),
        blocks: n,
        block,
        baseline_us: median_of(theirs.to_vec()) * 1e6,
        ratio_mean: median_of(block_ratios(means, theirs)),
        ratio_median: median_of(block_ratios(medians, theirs)),
    })
}

/// Each of `ours` over the geometric mean of the two of `theirs` beside it (`theirs[i]` ran
/// just before `ours[i]`, `theirs[i + 1]` just after).
fn block_ratios(ours: &[f64], theirs: &[f64]) -> Vec<f64> {
    ours.iter()
        .zip(theirs.windows(2))
        .map(|(o, t)| o / (t[0] * t[1]).sqrt())
        .collect()
}

/// This rank's loss recovery so far, over all its links.
fn recovery(comm: &Communicator) -> Recovery {
    comm.link_stats().iter().fold(
        Recovery {
            retransmits: 0,
            tail_probes: 0,
            timeouts: 0,
        },
        |acc, (_, s)| Recovery {
            retransmits: acc.retransmits + s.retransmits,
            tail_probes: acc.tail_probes + s.tail_probes,
            timeouts: acc.timeouts + s.timeouts,
        },
    )
}

impl Recovery {
    /// What happened between `earlier` and `self`.
    fn since(self, earlier: Recovery) -> Recovery {
        Recovery {
            retransmits: self.retransmits.saturating_sub(earlier.retransmits),
            tail_probes: self.tail_probes.saturating_sub(earlier.tail_probes),
            timeouts: self.timeouts.saturating_sub(earlier.timeouts),
        }
    }
}

/// Runs a sweep as a command: fails when any element was wrong.
pub fn main(kind: Kind, args: BenchArgs) -> anyhow::Result<std::process::ExitCode> {
    let wrong = run(kind, args)?;
    if wrong > 0 {
        eprintln!("{wrong} wrong elements");
        return Ok(std::process::ExitCode::FAILURE);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::{block_ratios, median_of, sizes};

    #[test]
    fn each_block_is_judged_against_the_baseline_blocks_beside_it() {
        // The baseline ran 4 µs, then 16 µs (a slower second), then 9 µs; ours 12 and 18.
        let ratios = block_ratios(&[12.0, 18.0], &[4.0, 16.0, 9.0]);
        assert_eq!(ratios.len(), 2);
        assert!((ratios[0] - 12.0 / 8.0).abs() < 1e-12, "{ratios:?}");
        assert!((ratios[1] - 18.0 / 12.0).abs() < 1e-12, "{ratios:?}");
        assert_eq!(median_of(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_of(Vec::new()), 0.0);
    }

    #[test]
    fn a_sweep_doubles_up_to_the_maximum() {
        assert_eq!(sizes(8, 64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sizes(8, 8, 2), vec![8]);
        assert_eq!(sizes(16, 8, 2), Vec::<usize>::new());
    }
}
