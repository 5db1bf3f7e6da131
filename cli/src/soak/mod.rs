//! `tbrdma soak`: a long run of every operation and size class, both directions, several
//! queue pairs, over a faulty cable, checking every byte and watching memory.
//!
//! Three ways to run it:
//! - `tbrdma soak --serve --bind ADDR[,ADDR2]`: one side (serves until a client's run ends);
//! - `tbrdma soak PEER --bind ADDR[,ADDR2] --seconds S --qps N --engine E`: the other side;
//!   both run the same workload, so traffic flows both ways;
//! - `tbrdma soak` (root): the orchestrator builds a two-rail lab, runs both sides in it with
//!   a faulty cable for each engine, pulls one rail and restores it, kills the server once and
//!   restarts it, and judges the result.
//!
//! Layout: `workload` (one queue pair's operations and checks), `role` (the sessions of one
//! side: connect or serve, drive, fail, reconnect), `orchestrate` (the lab run), `report` (the
//! counts, the JSON line, the summary), `memory` (VmRSS / VmLck and the flatness rule).

mod memory;
mod orchestrate;
mod report;
mod role;
mod workload;

use std::process::ExitCode;

use clap::Args;

use crate::perf::options::{EngineArg, ProgressArg};

/// Most queue pairs a session may have.
pub const MAX_QPS: usize = 16;

/// The faulty cable of the orchestrator's runs: 2 % loss, 1 % duplicates, 1 % corruption, 2 %
/// reordering (the figures), set in both processes so both directions suffer.
pub const DEFAULT_FAULTS: &str = "drop=2%,dup=1%,corrupt=1%,reorder=2%,reorder_by=300us";

/// `tbrdma soak`.
#[derive(Debug, Args, Clone)]
#[command(after_help = "\
Examples:
  sudo tbrdma soak --minutes 10                      # lab run: every engine, 10 min each
  sudo tbrdma soak --seconds 30 --engines sockets    # a short one
  tbrdma soak --serve --bind 10.0.0.1,10.0.1.1       # host A (both cables)
  tbrdma soak 10.0.0.1 --bind 10.0.0.2,10.0.1.2 --minutes 10 --qps 4   # host B
  TBRDMA_FAULTS='drop=2%,dup=1%,corrupt=1%,reorder=2%' tbrdma soak …   # impair a real cable")]
pub struct SoakArgs {
    /// Peer to connect to (client role). Without PEER and --serve: run both roles in a lab.
    pub peer: Option<String>,
    /// Serve (the other role): accept a client's sessions until one ends cleanly.
    #[arg(long, conflicts_with = "peer")]
    pub serve: bool,
    /// Local address of each rail, cable 1 first (both hosts in the same order).
    #[arg(long, value_delimiter = ',', value_name = "ADDR[,ADDR2]")]
    pub bind: Vec<String>,
    /// Run length (per engine in a lab run).
    #[arg(long, value_name = "S", conflicts_with = "minutes")]
    pub seconds: Option<f64>,
    /// Run length in minutes (per engine in a lab run); 1 minute without either.
    #[arg(long, value_name = "M")]
    pub minutes: Option<f64>,
    /// Queue pairs per session (each with its own region).
    #[arg(long, default_value_t = 4, value_parser = parse_qps)]
    pub qps: usize,
    /// Datagram backend of this side.
    #[arg(long, value_enum, default_value_t = EngineArg::Sockets)]
    pub engine: EngineArg,
    /// Who runs the engine: `caller` (the soak loop polls, yielding when idle) or `thread`.
    #[arg(long, value_enum, default_value_t = ProgressArg::Caller)]
    pub progress: ProgressArg,
    /// TCP port of the connection manager.
    #[arg(long, short = 'p', default_value_t = 18520)]
    pub port: u16,
    /// Seed of the operation mix (printed; random without it).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Seconds a connection's setup may take.
    #[arg(long, value_name = "S", default_value_t = 10.0)]
    pub timeout: f64,
    /// Lab run: the engines to soak, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "sockets,uring,packet"
    )]
    pub engines: Vec<EngineArg>,
    /// Lab run: the fault plan of both processes (TBRDMA_FAULTS syntax; a seed is added).
    #[arg(long, value_name = "SPEC", default_value = DEFAULT_FAULTS)]
    pub faults: String,
    /// Lab run: leave both rails up (to isolate a failure).
    #[arg(long)]
    pub no_pull: bool,
    /// Lab run: do not kill the server (to isolate a failure).
    #[arg(long)]
    pub no_kill: bool,
    /// Lab run: the lab's name.
    #[arg(long, value_name = "NAME")]
    pub lab_name: Option<String>,
}

fn parse_qps(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_QPS).contains(&n) => Ok(n),
        _ => Err(format!("use 1 to {MAX_QPS} queue pairs")),
    }
}

impl SoakArgs {
    /// The run length in seconds.
    pub fn duration_secs(&self) -> f64 {
        self.seconds
            .or(self.minutes.map(|m| m * 60.0))
            .unwrap_or(60.0)
            .max(1.0)
    }
}

/// Runs the soak: a role, or the lab run.
pub fn main(args: SoakArgs) -> ExitCode {
    if args.peer.is_none() && !args.serve {
        return match orchestrate::run(&args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!(
                    "tbrdma soak: error: {}",
                    format!("{e:#}").replace('\n', " ")
                );
                ExitCode::FAILURE
            }
        };
    }
    crate::perf::exit_status("soak", || role::run(&args))
}
