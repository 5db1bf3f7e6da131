//! Why a plugin call failed, and the `ncclResult_t` each failure becomes.

use thiserror::Error;

use crate::abi::{
    NCCL_INTERNAL_ERROR, NCCL_INVALID_USAGE, NCCL_REMOTE_ERROR, NCCL_SYSTEM_ERROR, NcclResult,
};

/// A failed plugin call.
#[derive(Debug, Error)]
pub enum NetError {
    /// An environment variable has a value the plugin cannot use.
    #[error("tbrdma NET: bad configuration: {detail}")]
    Config {
        /// What is wrong.
        detail: String,
    },
    /// No link could be opened.
    #[error("tbrdma NET: no usable link: {detail}")]
    NoDevice {
        /// What was tried.
        detail: String,
    },
    /// `init` has not been called (or failed).
    #[error("tbrdma NET: called before a successful init")]
    NotInitialized,
    /// NCCL passed something the plugin did not hand out or cannot serve.
    #[error("tbrdma NET: {detail}")]
    Misuse {
        /// What was wrong.
        detail: String,
    },
    /// A message was larger than the receive posted for it.
    #[error(
        "tbrdma NET: message truncated: the receive posted for message {seq} holds {posted} bytes, the send was {sent} bytes"
    )]
    Truncated {
        /// Message number on the connection.
        seq: u64,
        /// Bytes the receive could hold.
        posted: u64,
        /// Bytes sent (0 on the receiving side of a refused rendezvous, which only learns
        /// that the send was too large).
        sent: u64,
    },
    /// The connection failed (peer gone, link down, protocol error).
    #[error("tbrdma NET: connection to {peer} failed: {detail}")]
    Remote {
        /// The peer.
        peer: String,
        /// Why.
        detail: String,
    },
    /// A verbs call failed.
    #[error("tbrdma NET: {context}: {source}")]
    Verbs {
        /// What was being done.
        context: String,
        /// The error.
        source: tbrdma_verbs::VerbsError,
    },
    /// The locked-memory limit is too low for a comm's own buffers.
    #[error(
        "tbrdma NET: cannot pin {what} of a new connection: the locked-memory limit \
         (RLIMIT_MEMLOCK) is {limit}, this process has {locked_kib} KiB locked, and each \
         connection needs {needs_kib} KiB more (a receive comm {recv_kib} KiB, a send comm \
         {send_kib} KiB; NCCL opens one of each per channel and peer). Fix: `ulimit -l \
         unlimited` before starting the job, `--ulimit memlock=-1:-1` for docker/podman, \
         `LimitMEMLOCK=infinity` for a systemd unit, or `* - memlock unlimited` in \
         /etc/security/limits.d/90-tbrdma.conf (then log in again)",
        locked_kib = locked / 1024,
        needs_kib = needs / 1024,
        recv_kib = crate::comm::RECV_PINNED / 1024,
        send_kib = crate::comm::SEND_PINNED / 1024
    )]
    Memlock {
        /// The soft limit, as the engine reports it ("65536 bytes", "unlimited").
        limit: String,
        /// Bytes the process had locked.
        locked: usize,
        /// Bytes the comm being created pins.
        needs: usize,
        /// Which buffers failed.
        what: &'static str,
    },
    /// A panic was caught at the C boundary.
    #[error("tbrdma NET: internal error (panic) in {entry}: {detail}")]
    Panic {
        /// The entry point.
        entry: &'static str,
        /// The panic message.
        detail: String,
    },
}

impl NetError {
    /// The `ncclResult_t` to return.
    pub fn code(&self) -> NcclResult {
        match self {
            NetError::Config { .. } | NetError::Truncated { .. } => NCCL_INVALID_USAGE,
            NetError::NoDevice { .. } | NetError::Verbs { .. } | NetError::Memlock { .. } => {
                NCCL_SYSTEM_ERROR
            }
            NetError::Remote { .. } => NCCL_REMOTE_ERROR,
            NetError::NotInitialized | NetError::Misuse { .. } | NetError::Panic { .. } => {
                NCCL_INTERNAL_ERROR
            }
        }
    }

    /// Wraps a verbs error with what was being done.
    pub fn verbs(context: impl Into<String>) -> impl FnOnce(tbrdma_verbs::VerbsError) -> NetError {
        // The context becomes a String only on error: this sits on every post.
        move |source| NetError::Verbs {
            context: context.into(),
            source,
        }
    }

    /// A misuse with this description.
    pub fn misuse(detail: impl Into<String>) -> NetError {
        NetError::Misuse {
            detail: detail.into(),
        }
    }
}

/// Result of a plugin operation.
pub type Result<T, E = NetError> = std::result::Result<T, E>;
