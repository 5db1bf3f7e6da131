//! `tbrdma setup`: print what detection found and the plan, then apply it unless `--dry-run`.

use clap::Args;

use crate::cli::{DetectArgs, print_inventory};
use crate::setup::{self, Persist, Roots, SetupOptions};

/// `tbrdma setup`.
#[derive(Debug, Args)]
pub struct SetupArgs {
    #[command(flatten)]
    detect: DetectArgs,
    /// Print the plan and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// MTU for every link (default: the driver's maximum, 65522 for thunderbolt-net).
    #[arg(long)]
    mtu: Option<u32>,
    /// Also write persistent configuration for this network manager.
    #[arg(long, value_enum)]
    persist: Option<Persist>,
    /// In a ring of 4 or more hosts (this cluster's hostfile): also forward IPv4 between the
    /// cables and route to every rank's cable addresses, so ranks that share no cable reach
    /// each other through the hosts in between (not persistent; the log says how to undo it).
    #[arg(long, value_name = "HOSTFILE")]
    relay: Option<std::path::PathBuf>,
}

pub(super) fn run(args: SetupArgs) -> anyhow::Result<()> {
    if let Some(mtu) = args.mtu {
        anyhow::ensure!(
            (68..=65_535).contains(&mtu),
            "--mtu {mtu} is out of range; use 68 to 65535 (thunderbolt-net allows up to 65522)"
        );
    }
    let relay = match &args.relay {
        Some(path) => Some(crate::hostfile::Hostfile::load(path)?),
        None => None,
    };
    let (detector, inventory) = args.detect.detect()?;
    print_inventory(&detector, &inventory);
    let options = SetupOptions {
        mtu: args.mtu,
        persist: args.persist,
        proc_root: args.detect.procfs_root.clone(),
        relay,
        ..SetupOptions::default()
    };
    let plan = setup::plan(&inventory, &options)?;
    say_raw!("{plan}");
    if args.dry_run || plan.is_empty() {
        return Ok(());
    }
    let roots = Roots {
        proc_root: &options.proc_root,
        sysfs_root: &detector.sysfs_root,
    };
    setup::apply(&plan, &roots)?;
    if let Some(undo) = setup::relay::undo_hint(&plan.steps) {
        say!(
            "relay: forwarding and routes to the ranks without a cable to this host are set; undo with: {undo}"
        );
    }
    let again = setup::plan(&detector.detect()?, &options)?;
    if again.is_empty() {
        say!("applied {} steps; setup complete", plan.steps.len());
    } else {
        say!(
            "applied {} steps, but these still differ:\n{again}",
            plan.steps.len()
        );
    }
    Ok(())
}
