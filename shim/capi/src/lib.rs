//! # libtbrdma: the C API of tbrdma (`tbrdma.h`)
//!
//! A C ABI over `tbrdma-verbs`: devices, protection domains, memory regions, completion
//! queues, queue pairs through the connection manager, post and poll; and over
//! `tbrdma-collectives`: communicators and the all-reduce family over raw buffers. Objects are
//! opaque pointers the caller frees with the matching `*_free`/`*_close` (in any order:
//! children keep what they need alive). Every function returns `TBRDMA_OK` (0) or a negative
//! `TBRDMA_ERR_*` code, and `tbrdma_last_error()` gives the message of the calling thread's
//! last failure. No panic crosses the boundary.
//!
//! The header `include/tbrdma.h` is generated from this crate by cbindgen
//! (`cbindgen.toml`) and committed; `tests/header.rs` regenerates it and fails when the
//! committed one is stale. `docs/examples/tbrdma_write_read.c` is a complete program (a
//! WRITE and a READ between two hosts), built and run by `tests/example.rs`;
//! `docs/examples/tbrdma_allreduce.c` runs the collectives across the ranks of a hostfile,
//! built and run by `tests/collectives.rs`.
//!
//! Layout: `ffi` (verbs) and `ffi_coll` (collectives) are the only files with `unsafe` (the
//! C boundary); `status` maps errors to codes and keeps the last message.

#![deny(unsafe_code)]

/// Unwraps a `Result<T, c_int>`, returning the error code from the enclosing function.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

mod ffi;
mod ffi_coll;
mod status;

pub use ffi::*;
pub use ffi_coll::*;
pub use status::*;
