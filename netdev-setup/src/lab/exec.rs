//! `lab exec RANK -- CMD…`: runs a command inside one rank's namespace, with the environment
//! that makes tbrdma's own commands see that rank's cables and the lab's hostfile.

use std::os::unix::process::CommandExt;
use std::process::Command;

use crate::error::{NetdevError, Result};
use crate::lab::state::{LabState, hostfile_path, links_path};
use crate::links_file::LINKS_ENV;
use crate::netns;

/// Environment variable naming the hostfile, set by `lab exec`.
pub const HOSTFILE_ENV: &str = "TBRDMA_HOSTFILE";
/// Environment variable with the rank number, set by `lab exec`.
pub const RANK_ENV: &str = "TBRDMA_RANK";

/// Replaces this process with `command` inside rank `rank` of lab `name`. Call it from a
/// single-threaded process (the CLI): it moves the calling thread into the namespace.
pub fn exec(name: &str, rank: usize, command: &[String]) -> Result<std::convert::Infallible> {
    let state =
        LabState::load(name)?.ok_or_else(|| NetdevError::NoSuchLab { name: name.into() })?;
    if rank >= state.ranks {
        return Err(NetdevError::bad_input(
            format!("lab {name} has ranks 0..{}, not {rank}", state.ranks - 1),
            "pick a rank from `tbrdma lab hostfile`",
        ));
    }
    let Some((program, args)) = command.split_first() else {
        return Err(NetdevError::bad_input(
            "no command given",
            "write it after `--`, e.g. `tbrdma lab exec 0 -- ip addr`",
        ));
    };
    netns::enter_current_thread(&state.namespaces[rank])?;
    let error = Command::new(program)
        .args(args)
        .env(LINKS_ENV, links_path(name, rank))
        .env(HOSTFILE_ENV, hostfile_path(name))
        .env(RANK_ENV, rank.to_string())
        .exec();
    Err(NetdevError::io("running", program, error))
}
