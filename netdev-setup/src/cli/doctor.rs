//! `tbrdma doctor`: run the checks, print them (or JSON), fail when a check fails.

use clap::Args;

use crate::cli::DetectArgs;
use crate::doctor::{self, DoctorOptions, Probes};

/// `tbrdma doctor`.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    detect: DetectArgs,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also check the NCCL/RCCL plugin as the current environment would load it.
    #[arg(long)]
    nccl: bool,
}

pub(super) fn run(args: DoctorArgs, probes: Option<&dyn Probes>) -> anyhow::Result<()> {
    let (detector, inventory) = args.detect.detect()?;
    let options = DoctorOptions {
        sysfs_root: detector.sysfs_root.clone(),
        proc_root: args.detect.procfs_root.clone(),
        live: detector.live,
        nccl: args.nccl,
    };
    let report = doctor::run(&inventory, &options, probes)?;
    if args.json {
        say!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        say_raw!("{report}");
    }
    anyhow::ensure!(report.ok(), "doctor found failures (see the fixes above)");
    Ok(())
}
