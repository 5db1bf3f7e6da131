//! `tbrdma tp-bench`: the all-reduce traffic of one decode step of a tensor-parallel model
//! (two all-reduces of hidden × batch elements per layer) measured on the actual links, and
//! what it implies: communication time per token and the tokens-per-second ceiling that
//! communication alone allows.

use std::time::Instant;

use anyhow::anyhow;
use clap::Args;
use tbrdma_collectives::{DType, ReduceOp};

use super::CommArgs;
use super::compute::Compute;

/// Options of `tp-bench`.
#[derive(Debug, Args, Clone)]
pub struct TpBenchArgs {
    #[command(flatten)]
    pub comm: CommArgs,
    /// Hidden size of the model (Llama-3-70B: 8192).
    #[arg(long, default_value_t = 8192)]
    pub hidden: usize,
    /// Transformer layers (Llama-3-70B: 80).
    #[arg(long, default_value_t = 80)]
    pub layers: usize,
    /// Activation type.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Tokens (decode steps) to time, after one untimed.
    #[arg(long, default_value_t = 20)]
    pub tokens: usize,
    /// Busy compute of this many microseconds before each all-reduce (a layer has two: after
    /// attention and after the MLP), outside the timed calls. 0: the all-reduces back to back,
    /// the ceiling communication alone allows. With it the tool also reports the step time a
    /// model would see: its compute leaves the caches and the links as a real one does.
    #[arg(long = "compute-us", value_name = "US", default_value_t = 0)]
    pub compute_us: u64,
    /// During each compute stretch, first write this many MiB (a layer streams its weights
    /// through the caches: a 70B model in bf16 over two boxes reads about 830 MiB per layer, about
    /// 3.5-4.5 ms at a Strix Halo box's 200-256 GB/s).
    #[arg(long = "compute-touch-mib", value_name = "MIB", default_value_t = 0)]
    pub compute_touch_mib: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark; rank 0 prints.
pub fn run(args: TpBenchArgs) -> anyhow::Result<()> {
    let dtype: DType = args.dtype.parse().map_err(|e: String| anyhow!(e))?;
    let mut comm = args.comm.connect()?;
    let count = args.hidden * args.batch;
    let bytes = count * dtype.size();
    let per_token = 2 * args.layers;
    let mut buf = vec![0u8; bytes];
    let mut per_call = Vec::with_capacity(per_token * args.tokens);
    let mut compute = Compute::new(args.compute_us, args.compute_touch_mib);
    let mut step_time = 0.0;
    for token in 0..=args.tokens {
        comm.barrier()?;
        let step = Instant::now();
        for _ in 0..per_token {
            if compute.is_active() {
                compute.run();
                // The compute leaves the activations it hands to the all-reduce.
                buf.fill(0);
            }
            let start = Instant::now();
            comm.all_reduce_bytes_in_place(&mut buf, dtype, ReduceOp::Sum)?;
            if token > 0 {
                per_call.push(start.elapsed().as_secs_f64());
            }
        }
        if token > 0 {
            step_time += step.elapsed().as_secs_f64();
        }
    }
    let times = super::CallTimes::new(per_call);
    // The slowest rank's mean all-reduce and its mean step (a token waits for every rank).
    let mut slowest = [times.mean, step_time / args.tokens.max(1) as f64];
    comm.all_reduce_in_place(&mut slowest, ReduceOp::Max)?;
    let token_s = slowest[1];
    let compute_per_token = (args.compute_us as f64 * 1e-6) * per_token as f64;
    let (median, p99) = (times.quantile(0.5), times.quantile(0.99));
    let comm_per_token = slowest[0] * per_token as f64;
    let ceiling = if comm_per_token > 0.0 {
        1.0 / comm_per_token
    } else {
        f64::INFINITY
    };
    if comm.rank() != 0 {
        return Ok(());
    }
    let algorithm = comm.choose_algorithm(bytes)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "ranks": comm.world_size(),
                "hidden": args.hidden,
                "layers": args.layers,
                "batch": args.batch,
                "type": dtype.name(),
                "bytes_per_allreduce": bytes,
                "allreduces_per_token": per_token,
                "algorithm": format!("{algorithm:?}"),
                "allreduce_us_mean": slowest[0] * 1e6,
                "allreduce_us_median": median * 1e6,
                "allreduce_us_p99": p99 * 1e6,
                "comm_ms_per_token": comm_per_token * 1e3,
                "tokens_per_s_ceiling": ceiling,
                "compute_us_per_allreduce": args.compute_us,
                "compute_touch_mib": args.compute_touch_mib,
                "token_ms": token_s * 1e3,
                "tokens_per_s": if token_s > 0.0 { 1.0 / token_s } else { f64::INFINITY },
            })
        );
    } else {
        println!(
            "{} ranks ({} topology), hidden {} x batch {} {} = {} bytes per all-reduce, {} all-reduces per token ({:?})",
            comm.world_size(),
            comm.topology(),
            args.hidden,
            args.batch,
            dtype,
            bytes,
            per_token,
            algorithm
        );
        println!(
            "all-reduce: {:.1} us mean (slowest rank), {:.1} us median, {:.1} us p99 (rank 0)",
            slowest[0] * 1e6,
            median * 1e6,
            p99 * 1e6
        );
        println!(
            "communication per token: {:.3} ms -> at most {:.1} tokens/s from communication alone",
            comm_per_token * 1e3,
            ceiling
        );
        if compute.is_active() {
            println!(
                "with {} us of compute (writing {} MiB) before each all-reduce: a token took \
                 {:.3} ms (compute {:.3} ms, the rest communication and waiting) -> {:.1} tokens/s",
                args.compute_us,
                args.compute_touch_mib,
                token_s * 1e3,
                compute_per_token * 1e3,
                1.0 / token_s
            );
        }
    }
    Ok(())
}
