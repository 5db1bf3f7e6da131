//! # libibverbs.so.1 over tbrdma
//!
//! A library with the ABI of rdma-core's libibverbs (Debian 12's 44.0: the symbols and version
//! nodes its clients and provider libraries import, the object layouts `verbs.h`'s inline
//! functions read), so unmodified verbs programs (`ibv_devinfo`, `ibv_rc_pingpong`, perftest)
//! run over tbrdma when `LD_LIBRARY_PATH` selects it. It never loads rdma-core providers and
//! never opens `/dev/infiniband`. See `docs/ibverbs.md`.
//!
//! Layers, from the C boundary inwards:
//! - [`abi`]: the C structs and constants (checked against the system `verbs.h` by a test);
//! - `exports`: every exported C function, the only module with `unsafe` (pointer
//!   conversions at the boundary), each call guarded so that no panic crosses into C;
//! - `stubs`: the provider-facing private symbols, present so that provider libraries load;
//! - [`objects`]: the verbs objects (context, PD, MR, CQ, QP with its state machine) in safe
//!   Rust over `tbrdma-verbs`;
//! - [`addressing`]: devices (links), GIDs, the QPN encoding of the peer's port, the token.

pub mod abi;
pub mod addressing;
mod exports;
pub mod objects;
mod stubs;
