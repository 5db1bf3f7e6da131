//! # tbrdma-collectives: all-reduce and friends over tbrdma verbs
//!
//! A [`Communicator`] joins N ranks (2–4 Linux hosts linked by USB4/Thunderbolt cables, or lab
//! namespaces) described by a hostfile: one verbs device per cabled neighbour (every cable to it
//! as a rail), one reliable queue pair per neighbour, and pre-registered slots on both sides, so
//! a collective registers nothing. Data moves as one-sided WRITE_WITH_IMM into the peer's slots;
//! the immediate numbers the message and slots are handed back in batches.
//!
//! Operations: [`Communicator::all_reduce`] (sum, prod, min, max, avg over f32, f64, f16,
//! bf16, i8, u8, i32, i64; 16-bit floats accumulate in f32), reduce-scatter, all-gather,
//! broadcast, reduce and barrier. Algorithms: one-shot (every rank writes its input to every
//! peer and reduces locally in rank order) on a pair or mesh for small messages; a pipelined
//! ring (reduce-scatter then all-gather) for large messages and ring topologies. Every rank
//! gets the same bits. See `docs/collectives.md`.
//!
//! Failure: a rank that dies makes its neighbours' requests fail within the transport's retry
//! budget; they tell their other neighbours which rank failed, so every rank returns
//! [`CollError::RankFailed`] naming it, and nothing waits longer than [`CommOptions::timeout`].
//!
//! ```no_run
//! use tbrdma_collectives::{CommOptions, Communicator, ReduceOp};
//! # fn main() -> Result<(), tbrdma_collectives::CollError> {
//! // TBRDMA_HOSTFILE and TBRDMA_RANK, as `tbrdma lab exec` sets them.
//! let mut comm = Communicator::from_env(CommOptions::default())?;
//! let mut hidden = vec![1.0f32; 8192];
//! comm.all_reduce_in_place(&mut hidden, ReduceOp::Sum)?;
//! assert_eq!(hidden[0], comm.world_size() as f32);
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod channel;
pub mod check;
mod comm;
mod config;
mod direct;
mod direct_ends;
mod dtype;
mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod half_float;
mod oneshot;
mod ops;
mod reduce_op;
mod rendezvous;
mod ring;

pub use comm::Communicator;
pub use config::{Algorithm, CommOptions, RELAY_ENV, Relay};
pub use dtype::{DType, Element, combine, finish_avg, reduce_ranks};
pub use error::{CollError, Result};
pub use half::{bf16, f16};
pub use reduce_op::ReduceOp;
pub use tbrdma_netdev::hostfile::{Hostfile, TopologyKind};
pub use tbrdma_verbs::{EngineKind, Progress, Stats};
