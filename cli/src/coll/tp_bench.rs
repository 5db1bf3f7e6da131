//! `tbrdma tp-bench`: the all-reduce traffic of one decode step of a tensor-parallel model
//! (two all-reduces of hidden × batch elements per layer) measured on the actual links, and
//! what it implies: communication time per token and the tokens-per-second ceiling that
//! communication alone allows.

use std::time::Instant;

use anyhow::anyhow;
use clap::Args;
use tbrdma_collectives::{DType, ReduceOp};

use super::CommArgs;

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
    for token in 0..=args.tokens {
        comm.barrier()?;
        for _ in 0..per_token {
            let start = Instant::now();
            comm.all_reduce_bytes_in_place(&mut buf, dtype, ReduceOp::Sum)?;
            if token > 0 {
                per_call.push(start.elapsed().as_secs_f64());
            }
        }
    }
    let times = super::CallTimes::new(per_call);
    let mut slowest = [times.mean];
    comm.all_reduce_in_place(&mut slowest, ReduceOp::Max)?;
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
    }
    Ok(())
}
