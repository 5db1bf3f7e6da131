//! The perftest-style tools: `tbrdma devices`, `tbrdma pingpong` (latency, like `ib_*_lat`)
//! and `tbrdma bw` (bandwidth, like `ib_*_bw`). Results go to stdout; diagnostics, progress
//! and the one-line error of a failed run go to stderr.
//!
//! Layout: `options` (flags, and what both sides must agree on), `session` (device, connection
//! manager, completions, DONE), `pingpong` and `bw` (the measurements), `paired` (the floor a
//! `pingpong --paired-with` runs beside tbrdma), `stats` and `report`
//! (numbers and their lines), `pattern` (`--verify`), `devices`.

pub mod bw;
pub mod devices;
pub mod options;
mod paired;
pub mod pattern;
pub mod pingpong;
mod report;
pub(crate) mod session;
mod stats;

use std::process::ExitCode;

/// Runs a measuring tool and turns its outcome into the exit status: 0 when the run completed
/// (and verified), 130 after Ctrl-C, 1 otherwise with exactly one line on stderr.
pub fn exit_status(tool: &str, run: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    session::install_ctrl_c();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<session::Interrupted>() => ExitCode::from(130),
        Err(e) => {
            let line = format!("{e:#}").replace('\n', " ");
            eprintln!("tbrdma {tool}: error: {line}");
            ExitCode::FAILURE
        }
    }
}
