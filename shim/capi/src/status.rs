//! Return codes and the per-thread last-error message. It owns the mapping from
//! `VerbsError` and `CollError` to codes; it never calls into C.

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};

use tbrdma_collectives::CollError;
use tbrdma_verbs::VerbsError;

/// Success.
pub const TBRDMA_OK: c_int = 0;
/// An argument is NULL, malformed or out of range.
pub const TBRDMA_ERR_INVALID: c_int = -1;
/// No such interface, no address, or an address of another host.
pub const TBRDMA_ERR_NO_DEVICE: c_int = -2;
/// Nobody listening, peer unreachable, or connection setup refused.
pub const TBRDMA_ERR_CONNECT: c_int = -3;
/// A step took longer than allowed.
pub const TBRDMA_ERR_TIMEOUT: c_int = -4;
/// The queue pair is in the error state or closed.
pub const TBRDMA_ERR_QP: c_int = -5;
/// Completions were lost: the completion queue was too small.
pub const TBRDMA_ERR_CQ_OVERFLOW: c_int = -6;
/// Memory could not be allocated, pinned or registered (see the message: often the memlock
/// limit), or a region is still in use.
pub const TBRDMA_ERR_MEMORY: c_int = -7;
/// A work request was refused (queue full, malformed).
pub const TBRDMA_ERR_POST: c_int = -8;
/// An operating-system call failed.
pub const TBRDMA_ERR_IO: c_int = -9;
/// A bug in tbrdma (a panic was caught).
pub const TBRDMA_ERR_INTERNAL: c_int = -10;
/// A rank failed or stopped answering during a collective (the message names it), or the
/// communicator is unusable after such a failure: free it.
pub const TBRDMA_ERR_RANK_FAILED: c_int = -11;
/// The ranks of a communicator disagree on the configuration (hostfile, options, tbrdma
/// version); the message names the rank and what differs.
pub const TBRDMA_ERR_MISMATCH: c_int = -12;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error and returns `code`.
pub(crate) fn fail(code: c_int, message: impl Into<String>) -> c_int {
    let text = message.into().replace('\0', " ");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(text).unwrap_or_default());
    code
}

/// The code of a verbs error (its message is recorded).
pub(crate) fn verbs(e: VerbsError) -> c_int {
    fail(verbs_code(&e), e.to_string())
}

/// The code of a collectives error (its message, which names the rank involved, is recorded).
pub(crate) fn coll(e: CollError) -> c_int {
    let code = match &e {
        CollError::BadConfig { .. } | CollError::BadArgument { .. } => TBRDMA_ERR_INVALID,
        CollError::ConfigMismatch { .. } => TBRDMA_ERR_MISMATCH,
        CollError::Connect { source, .. } => verbs_code(source),
        CollError::RankFailed { .. } | CollError::Poisoned(_) => TBRDMA_ERR_RANK_FAILED,
        CollError::Timeout { .. } => TBRDMA_ERR_TIMEOUT,
        CollError::Verbs(v) => verbs_code(v),
    };
    fail(code, e.to_string())
}

fn verbs_code(e: &VerbsError) -> c_int {
    match e {
        VerbsError::NoSuchInterface { .. }
        | VerbsError::NoAddress { .. }
        | VerbsError::AddressNotLocal { .. } => TBRDMA_ERR_NO_DEVICE,
        VerbsError::PeerNotListening { .. }
        | VerbsError::Unreachable { .. }
        | VerbsError::Handshake { .. } => TBRDMA_ERR_CONNECT,
        VerbsError::Timeout { .. } => TBRDMA_ERR_TIMEOUT,
        VerbsError::QpFailed { .. } => TBRDMA_ERR_QP,
        VerbsError::CqOverflow { .. } => TBRDMA_ERR_CQ_OVERFLOW,
        VerbsError::RegionInUse { .. } | VerbsError::Memory(_) | VerbsError::Register(_) => {
            TBRDMA_ERR_MEMORY
        }
        VerbsError::Post(_) => TBRDMA_ERR_POST,
        _ => TBRDMA_ERR_IO,
    }
}

/// The last error message of this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
