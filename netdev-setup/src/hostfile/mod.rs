//! `tbrdma hostfile`: the cluster description the collectives read, its JSON format, and the
//! discovery that builds it by asking neighbours over each cable.

pub mod discover;
pub mod format;

pub use discover::{DiscoveryOptions, discover, local_record};
pub use format::{HostRecord, Hostfile, Rank, RankLink, RecordLink, Topology, TopologyKind};
