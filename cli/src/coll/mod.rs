//! Collective tools: `allreduce`, `allgather`, `reducescatter`, `broadcast` (nccl-tests style
//! sweeps) and `tp-bench` (the all-reduce cost of one decode step of a tensor-parallel model).
//! Every rank runs the same command; the hostfile and rank come from options or from
//! `TBRDMA_HOSTFILE` / `TBRDMA_RANK` (what `tbrdma lab exec` sets). Only rank 0 prints results.

pub mod baseline;
pub mod bench;
pub mod compute;
pub mod tp_bench;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow};
use clap::Args;
use tbrdma_collectives::{Algorithm, CommOptions, Communicator, EngineKind, Progress};

/// Per-call times of one rank: the mean and the times at given quantiles.
pub(crate) struct CallTimes {
    pub mean: f64,
    sorted: Vec<f64>,
}

impl CallTimes {
    /// Summarises `per_call` (seconds).
    pub(crate) fn new(mut per_call: Vec<f64>) -> CallTimes {
        let mean = per_call.iter().sum::<f64>() / per_call.len().max(1) as f64;
        per_call.sort_by(f64::total_cmp);
        CallTimes {
            mean,
            sorted: per_call,
        }
    }

    /// The time below which a fraction `q` of the calls fall (0 when there were none).
    pub(crate) fn quantile(&self, q: f64) -> f64 {
        let at = ((self.sorted.len() as f64 * q) as usize).min(self.sorted.len().saturating_sub(1));
        self.sorted.get(at).copied().unwrap_or(0.0)
    }
}

/// How to build the communicator.
#[derive(Debug, Args, Clone)]
pub struct CommArgs {
    /// The cluster's hostfile (default: $TBRDMA_HOSTFILE).
    #[arg(long, value_name = "PATH")]
    pub hostfile: Option<PathBuf>,
    /// This host's rank (default: $TBRDMA_RANK).
    #[arg(long)]
    pub rank: Option<usize>,
    /// All-reduce algorithm: auto, oneshot, ring, doubling (four ranks).
    #[arg(long, default_value = "auto")]
    pub algo: String,
    /// Largest all-reduce that `auto` sends one-shot on a pair (a mesh of N ranks: this divided
    /// by (N-1)²), in bytes, K/M suffixes.
    #[arg(long, value_name = "BYTES", default_value = "256K")]
    pub one_shot_max: String,
    /// Bytes per pre-registered slot (the pipelining unit; the library's default).
    #[arg(long, value_name = "BYTES", default_value = "256K")]
    pub slot_bytes: String,
    /// Slots per neighbour.
    #[arg(long, default_value_t = 8)]
    pub slots: usize,
    /// Use at most this many cables per neighbour (0: every cable in the hostfile).
    #[arg(long, default_value_t = 0)]
    pub rails: usize,
    /// Datagram backend: packet (the default: Ethernet frames with a receive ring shared with
    /// the kernel, the lowest latency; needs root, else sockets is used, and every rank must end
    /// up on the same one), sockets, or uring.
    #[arg(long, default_value = "packet")]
    pub engine: String,
    /// Who runs the engine: caller (spins inside collectives) or thread.
    #[arg(long, default_value = "caller")]
    pub progress: String,
    /// First TCP port of the connection manager.
    #[arg(long, default_value_t = 18_600)]
    pub port: u16,
    /// Idle polling rounds before a waiting rank starts yielding its core to other threads.
    #[arg(long, default_value_t = CommOptions::default().spin)]
    pub spin: u32,
    /// Seconds to wait for a neighbour before failing.
    #[arg(long, default_value_t = 20.0)]
    pub timeout: f64,
}

/// Parses `8`, `4K`, `16KiB`, `128M`, `1G` into bytes.
pub fn parse_size(s: &str) -> anyhow::Result<usize> {
    let t = s.trim();
    let digits = t.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = t[digits.len()..].to_ascii_uppercase();
    let n: usize = digits.parse().with_context(|| format!("size {s:?}"))?;
    let mul = match unit.as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        _ => return Err(anyhow!("size {s:?}: unknown unit {unit:?} (K, M, G)")),
    };
    n.checked_mul(mul)
        .ok_or_else(|| anyhow!("size {s:?} is too large"))
}

impl CommArgs {
    /// The communicator options these arguments ask for.
    pub fn options(&self) -> anyhow::Result<CommOptions> {
        Ok(CommOptions {
            algorithm: self.algo.parse::<Algorithm>().map_err(|e| anyhow!(e))?,
            one_shot_max: parse_size(&self.one_shot_max)?,
            slot_bytes: parse_size(&self.slot_bytes)?,
            slots: self.slots,
            max_rails: self.rails,
            port_base: self.port,
            engine: self.engine.parse::<EngineKind>().map_err(|e| anyhow!(e))?,
            progress: self.progress.parse::<Progress>().map_err(|e| anyhow!(e))?,
            timeout: Duration::from_secs_f64(self.timeout.max(0.01)),
            spin: self.spin,
            ..CommOptions::default()
        })
    }

    /// Connects to every neighbour.
    pub fn connect(&self) -> anyhow::Result<Communicator> {
        let path = match &self.hostfile {
            Some(p) => p.clone(),
            None => std::env::var_os("TBRDMA_HOSTFILE")
                .map(PathBuf::from)
                .ok_or_else(|| anyhow!("no hostfile: pass --hostfile or set TBRDMA_HOSTFILE"))?,
        };
        let rank = match self.rank {
            Some(r) => r,
            None => std::env::var("TBRDMA_RANK")
                .ok()
                .and_then(|r| r.parse().ok())
                .ok_or_else(|| anyhow!("no rank: pass --rank or set TBRDMA_RANK"))?,
        };
        Ok(Communicator::from_hostfile(&path, rank, self.options()?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("16K").unwrap(), 16 << 10);
        assert_eq!(parse_size("128M").unwrap(), 128 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert!(parse_size("3X").is_err());
    }
}
