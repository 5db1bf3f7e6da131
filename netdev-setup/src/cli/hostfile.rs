//! `tbrdma hostfile`: discover the cluster over the links (or read a hostfile) and write it in
//! tbrdma's format, as MLX's hostfile, or as one host's environment.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::cli::DetectArgs;
use crate::hostfile::{self, DiscoveryOptions, Hostfile};

/// `--format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// tbrdma's hostfile (docs/hostfile.md), what the collectives read.
    Tbrdma,
    /// mlx.launch's JSON hostfile: one entry per host with its link addresses.
    Mlx,
    /// One host's environment for NCCL/RCCL with the tbrdma plugin, torchrun and vLLM (sh).
    Env,
}

/// `tbrdma hostfile`.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  tbrdma hostfile                                   # on every host at once: discover, write hostfile.json
  tbrdma hostfile --from hostfile.json --format mlx -o mlx-hosts.json
  tbrdma hostfile --from hostfile.json --format env --rank 1 -o tbrdma-env.sh   # then `. tbrdma-env.sh`")]
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
    /// What to write.
    #[arg(long, value_enum, default_value_t = Format::Tbrdma)]
    format: Format,
    /// Convert this hostfile instead of discovering the cluster.
    #[arg(long, value_name = "PATH")]
    from: Option<PathBuf>,
    /// The host whose environment `--format env` writes (default: $TBRDMA_RANK).
    #[arg(long, env = "TBRDMA_RANK")]
    rank: Option<usize>,
}

fn write(out: &std::path::Path, text: &str) -> anyhow::Result<()> {
    if out.as_os_str() == "-" {
        say_raw!("{text}");
    } else {
        std::fs::write(out, text)?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

pub(super) fn run(args: HostfileArgs) -> anyhow::Result<()> {
    let (hostfile, local_uuid) = match &args.from {
        Some(path) => (Hostfile::load(path)?, None),
        None => {
            let (hostfile, uuid) = discover_cluster(&args)?;
            (hostfile, Some(uuid))
        }
    };
    // After discovery this host knows its own rank.
    let own_rank =
        local_uuid.and_then(|u| hostfile.ranks.iter().find(|r| r.uuid == u).map(|r| r.rank));
    match args.format {
        Format::Tbrdma if args.from.is_some() => write(&args.out, &hostfile.to_json()),
        Format::Tbrdma => {
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
        Format::Mlx => {
            let json = serde_json::to_string_pretty(&hostfile::export::mlx_hostfile(&hostfile))?;
            write(&args.out, &format!("{json}\n"))
        }
        Format::Env => {
            let rank = args.rank.or(own_rank).ok_or_else(|| {
                anyhow::anyhow!(
                    "--format env writes one host's environment: pass --rank (0..{})",
                    hostfile.ranks.len().saturating_sub(1)
                )
            })?;
            write(&args.out, &hostfile::export::environment(&hostfile, rank)?)
        }
    }
}

/// Discovery; returns the hostfile and this host's UUID.
fn discover_cluster(args: &HostfileArgs) -> anyhow::Result<(Hostfile, String)> {
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
    Ok((Hostfile::from_records(&records)?, local.uuid))
}
