//! The `tbrdma` command line: one binary for every front-end tool.

mod coll;
mod demo;
mod doctor;
mod install;
mod lab_pair;
mod perf;
mod report;
mod soak;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// tbrdma: RDMA semantics over USB4/Thunderbolt networking, in user space.
#[derive(Debug, Parser)]
#[command(name = "tbrdma", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Drive two endpoints through a simulated lossy link and report what happened.
    Demo(demo::DemoArgs),
    /// List the links tbrdma can use and the kernel's engine features (like ibv_devinfo).
    Devices(perf::devices::DevicesArgs),
    /// Latency between two hosts, like perftest's ib_*_lat; without SERVER, serve one run.
    Pingpong(perf::options::PingpongArgs),
    /// Bandwidth between two hosts, like perftest's ib_*_bw; without SERVER, serve one run.
    Bw(perf::options::BwArgs),
    /// All-reduce sweep across the hostfile's ranks, like nccl-tests' all_reduce_perf.
    Allreduce(coll::bench::BenchArgs),
    /// All-gather sweep, like nccl-tests' all_gather_perf.
    Allgather(coll::bench::BenchArgs),
    /// Reduce-scatter sweep, like nccl-tests' reduce_scatter_perf.
    Reducescatter(coll::bench::BenchArgs),
    /// Broadcast sweep from rank 0, like nccl-tests' broadcast_perf.
    Broadcast(coll::bench::BenchArgs),
    /// All-reduce cost of one tensor-parallel decode step, and the tokens/s it allows.
    TpBench(coll::tp_bench::TpBenchArgs),
    /// The standard sweep between two hosts, as report.json, SVG plots and an HTML page.
    Report(report::ReportArgs),
    /// Install the CLI, libtbrdma, tbrdma.h, pkg-config file, NCCL/RCCL plugin and env file.
    Install(install::InstallArgs),
    /// Load an NCCL net plugin as NCCL does and print what it exports (`doctor --nccl` runs it).
    #[command(hide = true)]
    NcclProbe {
        /// The library to load.
        path: String,
    },
    /// Soak test: every operation and size, both ways, over a faulty cable, with a rail pulled and a peer killed.
    Soak(soak::SoakArgs),
    #[command(flatten)]
    Netdev(tbrdma_netdev::cli::NetdevCommand),
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(args) => demo::run(args).map(|()| ExitCode::SUCCESS),
        Command::Devices(args) => perf::devices::run(args).map(|()| ExitCode::SUCCESS),
        Command::Pingpong(args) => Ok(perf::exit_status("pingpong", || perf::pingpong::run(args))),
        Command::Bw(args) => Ok(perf::exit_status("bw", || perf::bw::run(args))),
        Command::Allreduce(args) => coll::bench::main(coll::bench::Kind::AllReduce, args),
        Command::Allgather(args) => coll::bench::main(coll::bench::Kind::AllGather, args),
        Command::Reducescatter(args) => coll::bench::main(coll::bench::Kind::ReduceScatter, args),
        Command::Broadcast(args) => coll::bench::main(coll::bench::Kind::Broadcast, args),
        Command::TpBench(args) => coll::tp_bench::run(args).map(|()| ExitCode::SUCCESS),
        Command::Report(args) => report::run(args).map(|()| ExitCode::SUCCESS),
        Command::Install(args) => install::run(args).map(|()| ExitCode::SUCCESS),
        Command::NcclProbe { path } => doctor::nccl_probe::run(&path).map(|()| ExitCode::SUCCESS),
        Command::Soak(args) => Ok(soak::main(args)),
        Command::Netdev(command) => {
            tbrdma_netdev::cli::run(command, Some(&doctor::CliProbes)).map(|()| ExitCode::SUCCESS)
        }
    }
}
