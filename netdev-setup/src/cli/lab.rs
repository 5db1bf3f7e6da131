//! `tbrdma lab up|down|exec|hostfile`.

use clap::Subcommand;

use crate::lab::{self, LabOptions, LabTopology};

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

pub(super) fn run(command: LabCommand) -> anyhow::Result<()> {
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
            say!("lab {name}: {ranks} ranks, {topology}, {rails} rail(s), MTU {mtu}");
            say!("hostfile: {}", path.display());
            say!("try: tbrdma lab exec 0 --name {name} -- tbrdma doctor");
        }
        LabCommand::Down { name } => match lab::down(&name)? {
            0 => say!("lab {name}: nothing to remove"),
            _ => say!("lab {name}: removed"),
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
            say!("{}", path.display());
        }
    }
    Ok(())
}
