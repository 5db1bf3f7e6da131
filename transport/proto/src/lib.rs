//! # tbrdma-proto: the protocol core
//!
//! The sans-IO heart of tbrdma: the wire format, the reliable-connection (queue-pair) state
//! machine and the memory-protection checks. It owns the *meaning* of every packet and never
//! touches the outside world: no sockets, no clock, no threads, no `unsafe`.
//!
//! The caller (the engine in production, the simulator in tests) feeds it:
//! - [`Connection::handle_datagram`] for every datagram that arrived for the connection,
//! - [`Connection::handle_timeout`] when the deadline from [`Connection::poll_timeout`] passes,
//!
//! and drains it with:
//! - [`Connection::poll_transmit`] until it returns `None`, sending each datagram,
//! - [`Connection::poll_completion`] for work completions, [`Connection::poll_event`] for
//!   connection events.
//!
//! Time is a [`Time`] value passed in; memory is reached through the [`Memory`] trait, whose
//! [`MemoryTable`] decides what a remote peer may touch before a byte moves.
//!
//! ```
//! use tbrdma_proto::sim::{Pair, PairConfig};
//! use tbrdma_proto::{Access, RemoteAddr, SendOp, SendWr, Sge, WcStatus};
//!
//! // Two connected endpoints over a perfect simulated link.
//! let mut pair = Pair::new(PairConfig::default());
//! let src = pair.a.mem.alloc(4096, Access::LOCAL_WRITE);
//! let dst = pair.b.mem.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
//! pair.a.mem.fill(&src, 0, b"hello, thunderbolt");
//!
//! let wr = SendWr {
//!     wr_id: 7,
//!     local: Sge { addr: src.addr, len: 18, lkey: src.lkey },
//!     op: SendOp::Write { remote: RemoteAddr { addr: dst.addr, rkey: dst.rkey } },
//! };
//! pair.a.post_send(wr).unwrap();
//! pair.drive(10_000);
//!
//! let wc = pair.a.take_completions()[0];
//! assert_eq!((wc.wr_id, wc.status), (7, WcStatus::Success));
//! assert_eq!(pair.b.mem.bytes(&dst, 0, 18), b"hello, thunderbolt");
//! ```
#![forbid(unsafe_code)]

pub mod codec;
pub mod config;
pub mod connection;
pub mod hint;
pub mod memory;
pub mod seq;
pub mod time;
pub mod wire;
pub mod work;

#[cfg(any(test, feature = "sim"))]
pub mod sim;

#[cfg(feature = "fuzzing")]
pub mod fuzzing;

pub use config::Config;
pub use connection::{Connection, ConnectionError, ConnectionState, Event, Role, Stats};
pub use memory::{Access, AccessError, Memory, MemoryTable, Region, RegionId};
pub use seq::Psn;
pub use time::Time;
pub use work::{
    PostError, Queue, RecvWr, RemoteAddr, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};
