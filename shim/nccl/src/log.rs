//! Logging through the function NCCL hands to `init` (the only sanctioned way for a plugin to
//! print). FFI file: calling the C variadic logger is `unsafe`. Messages are formatted in Rust
//! and passed as the argument of a fixed `"%s"` format, so no text is ever interpreted by
//! printf. Without a logger (before `init`), warnings go to stderr and the rest is dropped.

#![allow(unsafe_code)]

use std::ffi::{CString, c_int, c_ulong};
use std::sync::Mutex;

use crate::abi::{Logger, NCCL_ALL, NCCL_INIT, NCCL_LOG_INFO, NCCL_LOG_WARN, NCCL_NET};

static LOGGER: Mutex<Logger> = Mutex::new(None);

/// Remembers NCCL's logger (a later `init` replaces it).
pub fn set_logger(logger: Logger) {
    if logger.is_some() {
        *LOGGER.lock().unwrap_or_else(|e| e.into_inner()) = logger;
    }
}

#[track_caller]
fn emit(level: c_int, flags: c_ulong, message: &str) {
    let logger = *LOGGER.lock().unwrap_or_else(|e| e.into_inner());
    let Some(log) = logger else {
        if level == NCCL_LOG_WARN {
            eprintln!("{message}");
        }
        return;
    };
    let location = std::panic::Location::caller();
    let file = CString::new(location.file()).unwrap_or_default();
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: `log` is the `ncclDebugLogger_t` NCCL passed to init and keeps valid while the
    // plugin is loaded. Every pointer is a NUL-terminated string that outlives the call, and
    // the format "%s" consumes exactly the one `char*` argument passed.
    unsafe {
        log(
            level,
            flags,
            file.as_ptr(),
            location.line() as c_int,
            c"%s".as_ptr(),
            text.as_ptr(),
        );
    }
}

/// A warning (all subsystems: NCCL shows it with `NCCL_DEBUG=WARN`).
#[track_caller]
pub fn warn(message: &str) {
    emit(NCCL_LOG_WARN, NCCL_ALL, message);
}

/// An informational line (subsystems INIT and NET).
#[track_caller]
pub fn info(message: &str) {
    emit(NCCL_LOG_INFO, NCCL_INIT | NCCL_NET, message);
}
