//! Errors of the collectives: each names the rank involved and, where there is one, the fix.

use std::time::Duration;

use thiserror::Error;

/// Why building a communicator or running a collective failed.
#[derive(Debug, Error)]
pub enum CollError {
    /// The hostfile or environment does not describe a usable communicator.
    #[error("{problem} ({fix})")]
    BadConfig {
        /// What is wrong.
        problem: String,
        /// How to fix it.
        fix: String,
    },
    /// A peer's configuration differs from this rank's.
    #[error(
        "rank {rank} disagrees on the {field}: it has {theirs}, rank {local} has {ours}; start every rank with the same hostfile, options and tbrdma version"
    )]
    ConfigMismatch {
        /// The peer that differs.
        rank: usize,
        /// This rank.
        local: usize,
        /// What differs.
        field: &'static str,
        /// The peer's value.
        theirs: String,
        /// This rank's value.
        ours: String,
    },
    /// Connecting to a neighbour failed.
    #[error("connecting rank {local} to rank {rank}: {source}")]
    Connect {
        /// The neighbour.
        rank: usize,
        /// This rank.
        local: usize,
        /// What the verbs layer said.
        source: tbrdma_verbs::VerbsError,
    },
    /// The connection to a rank failed during a collective (it died, or its link went down).
    #[error("rank {rank} failed during {op}: {detail}")]
    RankFailed {
        /// The rank that failed.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// How it showed (a completion status, a peer's report).
        detail: String,
    },
    /// Nothing came from a rank within the communicator's timeout.
    #[error(
        "{op} timed out after {after:?} waiting for rank {rank} (is it running the same collectives in the same order?)"
    )]
    Timeout {
        /// The rank waited for.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// The arguments of a call are wrong.
    #[error("{op}: {problem}")]
    BadArgument {
        /// The collective.
        op: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// An earlier collective failed; the communicator cannot be used any more.
    #[error("the communicator is unusable after an earlier failure: {0}")]
    Poisoned(String),
    /// A verbs call failed locally (memory registration, posting).
    #[error(transparent)]
    Verbs(#[from] tbrdma_verbs::VerbsError),
}

/// Result of a collectives call.
pub type Result<T, E = CollError> = std::result::Result<T, E>;
