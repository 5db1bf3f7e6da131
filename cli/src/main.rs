//! The `tbrdma` command line: one binary for every front-end tool.

mod demo;

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
    #[command(flatten)]
    Netdev(tbrdma_netdev::cli::NetdevCommand),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Netdev(command) => tbrdma_netdev::cli::run(command),
    }
}
