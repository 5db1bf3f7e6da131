//! # tbrdma-engine: the protocol core on real links
//!
//! Owns everything between the sans-IO protocol core and the kernel: the UDP socket bound to a
//! link, the datagram backends ([`io`]: io_uring, plain sockets or `AF_PACKET` frames, and the
//! user-space faulty cable over any of them), the registered memory the
//! core places data into ([`memory`]), the kernel feature probe ([`probe`]) and the progress
//! loop that drives connections ([`worker`]). It makes no protocol decision of its own.
//!
//! `unsafe` lives only in `io/sys.rs`, `io/sockets.rs`, `io/uring.rs`, `io/packet.rs`, `memory.rs` and `sched.rs`, each of
//! which says so at the top.

mod config;
mod conn_table;
pub mod cq;
mod failure;
pub mod io;
mod keeper;
pub mod memory;
pub mod probe;
mod progress;
pub mod sched;
pub mod socket;
mod state;
pub mod worker;
