//! The `tbrdma` command line: one binary for every front-end tool.

mod demo;
mod perf;

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
        Command::Netdev(command) => tbrdma_netdev::cli::run(command).map(|()| ExitCode::SUCCESS),
    }
}
