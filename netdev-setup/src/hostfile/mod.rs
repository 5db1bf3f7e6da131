//! `tbrdma hostfile`: the cluster description the collectives read, its JSON format, and the
//! discovery that builds it by asking neighbours over each cable, and the forms other
//! frameworks read (`export`: MLX's hostfile, per-host NCCL/torchrun/vLLM environment).

pub mod discover;
pub mod export;
pub mod format;

pub use discover::{DiscoveryOptions, discover, local_record};
pub use format::{HostRecord, Hostfile, Rank, RankLink, RecordLink, Topology, TopologyKind};
