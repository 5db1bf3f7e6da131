//! Errors of the verbs API: each names what failed and, where there is one, the fix.
//! Asynchronous outcomes (a request that failed on the wire) are completion statuses instead.

use std::net::SocketAddr;
use std::time::Duration;

use thiserror::Error;

/// Why a verbs call failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No interface has the name given.
    #[error(
        "no network interface named {name:?} (interfaces here: {available}); check the cable and `tbrdma devices`"
    )]
    NoSuchInterface {
        /// The name asked for.
        name: String,
        /// Interfaces that exist.
        available: String,
    },
    /// The interface has no IPv4 address to bind to.
    #[error(
        "interface {name:?} has no IPv4 address; give it one (`tbrdma setup`) or open the device by IP"
    )]
    NoAddress {
        /// The interface.
        name: String,
    },
    /// The address is not configured on any local interface.
    #[error(
        "{addr} is not an address of this host; use the address of the link (see `ip -br addr`)"
    )]
    AddressNotLocal {
        /// The address asked for.
        addr: String,
    },
    /// Nothing listens at the peer's address.
    #[error(
        "no tbrdma listener at {addr} (connection refused): start the server side first, and check the port"
    )]
    PeerNotListening {
        /// The address tried.
        addr: SocketAddr,
    },
    /// The peer's address cannot be reached.
    #[error("cannot reach {addr}: {detail} (is the link up and addressed? `tbrdma doctor` checks)")]
    Unreachable {
        /// The address tried.
        addr: SocketAddr,
        /// What the kernel said.
        detail: String,
    },
    /// A step of connection setup took too long.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// The step.
        what: String,
        /// How long it was given.
        after: Duration,
    },
    /// The peer speaks another connection-manager protocol or broke it.
    #[error("connection setup with {peer} failed: {detail}")]
    Handshake {
        /// The peer.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The queue pair failed or was closed.
    #[error("queue pair {qp_num} is in the error state: {reason}")]
    QpFailed {
        /// The queue pair.
        qp_num: u32,
        /// Why.
        reason: String,
    },
    /// Completions were lost because the completion queue was full.
    #[error(
        "completion queue overflowed: {lost} completions were lost; create it with room for every outstanding request"
    )]
    CqOverflow {
        /// How many were lost.
        lost: u64,
    },
    /// A region is still named by outstanding requests.
    #[error(
        "memory region still used by {users} outstanding requests after {waited:?}; poll their completions first"
    )]
    RegionInUse {
        /// Outstanding requests.
        users: usize,
        /// How long deregistration waited.
        waited: Duration,
    },
    /// A landing zone that cannot be lent as asked.
    #[error("cannot lend that landing zone: {detail}")]
    BadLanding {
        /// What is wrong and how to fix it.
        detail: String,
    },
    /// Memory could not be allocated or pinned.
    #[error(transparent)]
    Memory(#[from] tbrdma_engine::memory::MemoryError),
    /// The access flags are not a valid combination.
    #[error(transparent)]
    Register(#[from] tbrdma_proto::memory::RegisterError),
    /// A work request was refused.
    #[error(transparent)]
    Post(#[from] tbrdma_proto::PostError),
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

impl VerbsError {
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> VerbsError {
        // The context becomes a String only on error: this sits on every poll and post.
        move |source| VerbsError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Result of a verbs call.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;
