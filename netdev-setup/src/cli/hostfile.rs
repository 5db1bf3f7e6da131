//! `tbrdma hostfile`: discover the cluster over the links and write the hostfile.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::cli::DetectArgs;
use crate::hostfile::{self, DiscoveryOptions, Hostfile};

/// `tbrdma hostfile`.
#[derive(Debug, Args)]
pub struct HostfileArgs {
    #[command(flatten)]
    detect: DetectArgs,
    /// Where to write the hostfile (`-` for standard output).
    #[arg(long, short, default_value = "hostfile.json")]
    out: PathBuf,
    /// UDP port discovery uses on every link.
    #[arg(long, default_value_t = hostfile::discover::DEFAULT_PORT)]
    port: u16,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

pub(super) fn run(args: HostfileArgs) -> anyhow::Result<()> {
    let (_, inventory) = args.detect.detect()?;
    let local = hostfile::local_record(&inventory)?;
    let options = DiscoveryOptions {
        port: args.port,
        timeout: Duration::from_secs(args.timeout),
        ..DiscoveryOptions::default()
    };
    eprintln!(
        "discovering over {} links (run this on every host)…",
        local.links.len()
    );
    let records = hostfile::discover(&local, &options)?;
    let hostfile = Hostfile::from_records(&records)?;
    if args.out.as_os_str() == "-" {
        say_raw!("{}", hostfile.to_json());
    } else {
        hostfile.save(&args.out)?;
        eprintln!(
            "{} ranks, topology {} with {} rail(s); wrote {}",
            hostfile.ranks.len(),
            hostfile.topology.kind,
            hostfile.topology.rails,
            args.out.display()
        );
    }
    Ok(())
}
