//! The `tbrdma` subcommands this crate owns (`setup`, `doctor`, `hostfile`, `lab`): argument
//! parsing and printing only; the work is done by the library modules.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};

use crate::detect::Detector;
use crate::doctor::{self, DoctorOptions};
use crate::hostfile::{self, DiscoveryOptions, Hostfile};
use crate::inventory::Inventory;
use crate::lab::{self, LabOptions, LabTopology};
use crate::links_file::{LINKS_ENV, LinksFile};
use crate::setup::{self, Persist, Roots, SetupOptions};

/// Subcommands for finding, configuring and checking links.
#[derive(Debug, Subcommand)]
pub enum NetdevCommand {
    /// Configure the Thunderbolt links: up, MTU, point-to-point addresses, busy-poll settings.
    Setup(SetupArgs),
    /// Check links, addresses, peers and host settings; each check passes, warns or fails.
    Doctor(DoctorArgs),
    /// Discover the cluster over the links (run on every host at once) and write the hostfile.
    Hostfile(HostfileArgs),
    /// A virtual cluster of network namespaces joined by veth "cables".
    #[command(subcommand)]
    Lab(LabCommand),
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
    fn detect(&self) -> anyhow::Result<(Detector, Inventory)> {
        let mut detector = Detector::new(&self.sysfs_root);
        detector.only = self.interfaces.clone();
        if let Some(path) = &self.links {
            detector.links_file = Some(LinksFile::load(path)?);
        }
        let inventory = detector.detect()?;
        Ok((detector, inventory))
    }
}

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
}

/// `tbrdma doctor`.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    detect: DetectArgs,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

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

/// `tbrdma lab …`.
#[derive(Debug, Subcommand)]
pub enum LabCommand {
    /// Create a lab of N ranks.
    Up {
        /// Number of ranks (namespaces).
        ranks: usize,
        /// How the ranks are cabled.
        #[arg(long, value_enum, default_value_t = LabTopology::Mesh)]
        topology: LabTopology,
        /// Cables between each pair of neighbours.
        #[arg(long, default_value_t = 1)]
        rails: u32,
        /// veth MTU.
        #[arg(long, default_value_t = lab::DEFAULT_MTU)]
        mtu: u32,
        /// Lab name; several labs can exist side by side.
        #[arg(long, default_value = lab::DEFAULT_NAME)]
        name: String,
        /// Replace a lab of the same name.
        #[arg(long)]
        force: bool,
    },
    /// Remove a lab: its namespaces, interfaces, processes and files.
    Down {
        /// Lab name.
        #[arg(long, default_value = lab::DEFAULT_NAME)]
        name: String,
    },
    /// Run a command inside one rank's namespace.
    Exec {
        /// The rank.
        rank: usize,
        /// Lab name.
        #[arg(long, default_value = lab::DEFAULT_NAME)]
        name: String,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Print the path of the lab's hostfile.
    Hostfile {
        /// Lab name.
        #[arg(long, default_value = lab::DEFAULT_NAME)]
        name: String,
    },
}

/// Runs one netdev subcommand.
pub fn run(command: NetdevCommand) -> anyhow::Result<()> {
    match command {
        NetdevCommand::Setup(args) => run_setup(args),
        NetdevCommand::Doctor(args) => run_doctor(args),
        NetdevCommand::Hostfile(args) => run_hostfile(args),
        NetdevCommand::Lab(command) => run_lab(command),
    }
}

fn print_inventory(detector: &Detector, inventory: &Inventory) {
    let host = inventory
        .host
        .as_ref()
        .map(|h| format!("{} ({})", h.name, h.uuid))
        .unwrap_or_else(|| "unknown".into());
    println!("host: {host}");
    println!("links (sysfs root {}):", detector.sysfs_root.display());
    if inventory.links.is_empty() {
        println!("  none");
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
        println!(
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

fn run_setup(args: SetupArgs) -> anyhow::Result<()> {
    let (detector, inventory) = args.detect.detect()?;
    print_inventory(&detector, &inventory);
    let options = SetupOptions {
        mtu: args.mtu,
        persist: args.persist,
        proc_root: args.detect.procfs_root.clone(),
        ..SetupOptions::default()
    };
    if let Some(mtu) = args.mtu {
        anyhow::ensure!(
            (68..=65_535).contains(&mtu),
            "--mtu {mtu} is out of range; use 68 to 65535"
        );
    }
    let plan = setup::plan(&inventory, &options)?;
    print!("{plan}");
    if args.dry_run || plan.is_empty() {
        return Ok(());
    }
    let roots = Roots {
        proc_root: &options.proc_root,
        sysfs_root: &detector.sysfs_root,
    };
    setup::apply(&plan, &roots)?;
    let again = setup::plan(&detector.detect()?, &options)?;
    if again.is_empty() {
        println!("applied {} steps; setup complete", plan.steps.len());
    } else {
        println!(
            "applied {} steps, but these still differ:\n{again}",
            plan.steps.len()
        );
    }
    Ok(())
}

fn run_doctor(args: DoctorArgs) -> anyhow::Result<()> {
    let (detector, inventory) = args.detect.detect()?;
    let options = DoctorOptions {
        sysfs_root: detector.sysfs_root.clone(),
        proc_root: args.detect.procfs_root.clone(),
        live: detector.live,
    };
    let report = doctor::run(&inventory, &options)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    anyhow::ensure!(report.ok(), "doctor found failures (see the fixes above)");
    Ok(())
}

fn run_hostfile(args: HostfileArgs) -> anyhow::Result<()> {
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
        print!("{}", hostfile.to_json());
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

fn run_lab(command: LabCommand) -> anyhow::Result<()> {
    match command {
        LabCommand::Up {
            ranks,
            topology,
            rails,
            mtu,
            name,
            force,
        } => {
            let options = LabOptions {
                name: name.clone(),
                ranks,
                topology,
                rails,
                mtu,
                force,
            };
            let path = lab::up(&options)?;
            println!("lab {name}: {ranks} ranks, {topology}, {rails} rail(s), MTU {mtu}");
            println!("hostfile: {}", path.display());
            println!("try: tbrdma lab exec 0 --name {name} -- tbrdma doctor");
        }
        LabCommand::Down { name } => match lab::down(&name)? {
            0 => println!("lab {name}: nothing to remove"),
            _ => println!("lab {name}: removed"),
        },
        LabCommand::Exec {
            rank,
            name,
            command,
        } => {
            lab::exec(&name, rank, &command)?;
        }
        LabCommand::Hostfile { name } => {
            let path = lab::hostfile_path(&name);
            anyhow::ensure!(
                path.exists(),
                "lab {name} has no hostfile; start it with `tbrdma lab up 2 --name {name}`"
            );
            println!("{}", path.display());
        }
    }
    Ok(())
}
