//! # libnccl-net-tbrdma: an NCCL/RCCL network plugin on tbrdma
//!
//! One shared library (install it as both `libnccl-net-tbrdma.so` and
//! `librccl-net-tbrdma.so`) exporting `ncclNetPlugin_v8`, `_v9`, `_v10` and `_v11`, so that
//! NCCL and RCCL move their inter-host traffic over tbrdma queue pairs with no change to the
//! application: `NCCL_NET_PLUGIN=tbrdma NCCL_NET=tbrdma`. Installation, configuration and
//! the protocol are in `docs/nccl.md`; the ABI is restated in
//! `shared/design/nccl-net-plugin.md`.
//!
//! Layers, bottom up:
//! - [`comm`]: one connection end and its protocol over a queue pair (safe Rust);
//! - [`net`]: process-wide state, listen/connect/accept, the handle tables (safe Rust);
//! - `ffi` and `log`: the C boundary, the only files allowed `unsafe`.
//!
//! The library is linked with `-z nodelete` (see `build.rs`): NCCL may `dlclose` it after the
//! last communicator, and v8–v10 give no shutdown call first.

#![deny(unsafe_code)]

pub mod abi;
pub mod comm;
pub mod config;
pub mod error;
mod ffi;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod log;
pub mod net;

pub use ffi::{
    NetV8, NetV9, NetV10, NetV11, ncclNetPlugin_v8, ncclNetPlugin_v9, ncclNetPlugin_v10,
    ncclNetPlugin_v11,
};
