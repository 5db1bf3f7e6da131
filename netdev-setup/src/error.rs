//! The one error type of this crate. Every variant names what went wrong and, where there is
//! one, the fix; the binary turns it into a message with `anyhow` and nothing else.

use std::io;
use std::path::PathBuf;

/// What can go wrong while finding, configuring or checking links, or running the lab.
#[derive(Debug, thiserror::Error)]
pub enum NetdevError {
    /// A file under sysfs, procfs or the lab's state directory could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What we were doing ("reading", "writing", …).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A netlink request failed.
    #[error("netlink: {operation} failed: {message}")]
    Netlink {
        /// The operation, phrased as a plan step ("set MTU of thunderbolt0 to 65522").
        operation: String,
        /// The kernel's or the library's message.
        message: String,
    },
    /// A step needs privileges this process does not have.
    #[error("`{step}` needs root (CAP_NET_ADMIN / CAP_SYS_ADMIN); run it with sudo")]
    NeedsRoot {
        /// The plan step or lab action that needs it.
        step: String,
    },
    /// A namespace operation (create, enter, delete) failed.
    #[error("network namespace {name}: {action} failed: {source}")]
    Namespace {
        /// The namespace's name.
        name: String,
        /// What we were doing.
        action: &'static str,
        /// The errno.
        source: nix::Error,
    },
    /// The user gave input we cannot use.
    #[error("{problem}; {fix}")]
    BadInput {
        /// What is wrong.
        problem: String,
        /// How to fix it.
        fix: String,
    },
    /// A lab with this name already exists.
    #[error(
        "lab `{name}` already exists; run `tbrdma lab down --name {name}` first, or pass --force to replace it"
    )]
    LabExists {
        /// The lab's name.
        name: String,
    },
    /// No lab with this name exists.
    #[error("no lab named `{name}`; start one with `tbrdma lab up 2 --name {name}`")]
    NoSuchLab {
        /// The lab's name.
        name: String,
    },
    /// Discovery did not converge before its deadline.
    #[error(
        "hostfile discovery timed out: {detail}; run `tbrdma hostfile` on every host at about the same time, after `tbrdma setup`"
    )]
    DiscoveryTimeout {
        /// What was still missing.
        detail: String,
    },
    /// A file that should hold JSON did not parse.
    #[error("{path}: not a valid {what}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What it should have been ("hostfile", "links file", …).
        what: &'static str,
        /// The parser's error.
        source: serde_json::Error,
    },
}

impl NetdevError {
    /// Wraps an I/O error with the file and the action it happened in.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// A bad-input error with its fix.
    pub fn bad_input(problem: impl Into<String>, fix: impl Into<String>) -> Self {
        Self::BadInput {
            problem: problem.into(),
            fix: fix.into(),
        }
    }
}

/// Shorthand for this crate's results.
pub type Result<T, E = NetdevError> = std::result::Result<T, E>;
