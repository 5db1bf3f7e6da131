//! The `tbrdma` subcommands this crate owns (`setup`, `doctor`, `hostfile`, `lab`): argument
//! parsing and printing only, one file per subcommand; the work is done by the library.

/// `println!` for the CLI's output: a reader that went away (`tbrdma doctor | head`) is not
/// worth a panic, so write errors on stdout are ignored.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// The `print!` counterpart of `say!`.
macro_rules! say_raw {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout().lock(), $($arg)*);
    }};
}

mod doctor;
mod hostfile;
mod lab;
mod setup;

use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::detect::Detector;
use crate::inventory::Inventory;
use crate::links_file::{LINKS_ENV, LinksFile};

pub use lab::LabCommand;

/// Subcommands for finding, configuring and checking links.
#[derive(Debug, Subcommand)]
pub enum NetdevCommand {
    /// Configure the Thunderbolt links: up, MTU, point-to-point addresses, busy-poll settings.
    Setup(setup::SetupArgs),
    /// Check links, addresses, peers and host settings; each check passes, warns or fails.
    Doctor(doctor::DoctorArgs),
    /// Discover the cluster over the links (run on every host at once) and write the hostfile.
    Hostfile(hostfile::HostfileArgs),
    /// A virtual cluster of network namespaces joined by veth "cables".
    #[command(subcommand)]
    Lab(lab::LabCommand),
}

/// Where detection looks.
#[derive(Debug, Args)]
pub struct DetectArgs {
    /// sysfs root to read (a fake tree for tests and demos).
    #[arg(long, default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// procfs root to read sysctls from.
    #[arg(long, default_value = "/proc")]
    pub procfs_root: PathBuf,
    /// A links file naming non-Thunderbolt interfaces as cables (docs/setup.md).
    #[arg(long, env = LINKS_ENV)]
    pub links: Option<PathBuf>,
    /// Only these interfaces (repeatable).
    #[arg(long = "interface", value_name = "NAME")]
    pub interfaces: Vec<String>,
}

impl DetectArgs {
    pub(crate) fn detect(&self) -> anyhow::Result<(Detector, Inventory)> {
        let mut detector = Detector::new(&self.sysfs_root);
        detector.only = self.interfaces.clone();
        if let Some(path) = &self.links {
            detector.links_file = Some(LinksFile::load(path)?);
        }
        let inventory = detector.detect()?;
        Ok((detector, inventory))
    }
}

/// Runs one netdev subcommand; `probes` gives `doctor` the checks this crate cannot run.
pub fn run(
    command: NetdevCommand,
    probes: Option<&dyn crate::doctor::Probes>,
) -> anyhow::Result<()> {
    match command {
        NetdevCommand::Setup(args) => setup::run(args),
        NetdevCommand::Doctor(args) => doctor::run(args, probes),
        NetdevCommand::Hostfile(args) => hostfile::run(args),
        NetdevCommand::Lab(command) => lab::run(command),
    }
}

pub(crate) fn print_inventory(detector: &Detector, inventory: &Inventory) {
    let host = inventory
        .host
        .as_ref()
        .map(|h| format!("{} ({})", h.name, h.uuid))
        .unwrap_or_else(|| "unknown".into());
    say!("host: {host}");
    say!("links (sysfs root {}):", detector.sysfs_root.display());
    if inventory.links.is_empty() {
        say!("  none");
    }
    for link in &inventory.links {
        let peer = link
            .peer
            .as_ref()
            .map(|p| format!("{} ({})", p.name, p.uuid))
            .unwrap_or_else(|| "?".into());
        let addresses: Vec<String> = link
            .addresses
            .iter()
            .map(|(a, p)| format!("{a}/{p}"))
            .collect();
        say!(
            "  {:<14} {:<5} {:<9} mtu {:<6} peer {peer}{}",
            link.interface,
            if link.admin_up { "up" } else { "down" },
            link.operstate,
            link.mtu,
            if addresses.is_empty() {
                String::new()
            } else {
                format!("  addr {}", addresses.join(","))
            }
        );
    }
}
