//! # tbrdma-verbs: RDMA verbs over USB4/Thunderbolt links
//!
//! The public Rust API of tbrdma, named after ibverbs: open a [`Device`] (a link), allocate a
//! [`ProtectionDomain`], register [`MemoryRegion`]s, create [`CompletionQueue`]s, connect a
//! [`QueuePair`] through the connection manager ([`Listener`], [`connect`]), then
//! [`QueuePair::post_send`], [`QueuePair::post_recv`] and [`CompletionQueue::poll`].
//!
//! The whole lifecycle, between two devices on this host's loopback address:
//!
//! ```
//! use std::time::Duration;
//! use tbrdma_verbs::*;
//!
//! # fn main() -> Result<(), VerbsError> {
//! let config = DeviceConfig { engine: EngineConfig { progress: Progress::Caller, ..Default::default() }, port: 0 };
//! let server_dev = Device::open("127.0.0.1", config.clone())?;
//! let client_dev = Device::open("127.0.0.1", config)?;
//!
//! // Server: a region the client may write, announced as private data (address + rkey).
//! let server_pd = server_dev.alloc_pd();
//! let target = server_pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let server_cq = server_dev.create_cq(64);
//! let listener = Listener::bind(&server_dev, 0)?;
//! let server_addr = listener.local_addr()?;
//! let remote = target.remote(0);
//! let mut announce = remote.addr.to_le_bytes().to_vec();
//! announce.extend_from_slice(&remote.rkey.to_le_bytes());
//! let server = std::thread::spawn(move || {
//!     let opts = QpOptions { private_data: announce, ..Default::default() };
//!     let conn = listener.accept(&server_pd, &server_cq, &server_cq, &opts, Some(Duration::from_secs(5)))?;
//!     // Caller progress: the server polls, which also places the client's WRITE.
//!     while target.load_u64(0) == 0 {
//!         let mut wcs = [Completion::default(); 4];
//!         server_cq.poll(&mut wcs)?;
//!     }
//!     let mut got = [0u8; 8];
//!     target.read(0, &mut got);
//!     drop(conn);
//!     Ok::<_, VerbsError>(got)
//! });
//!
//! // Client: connect, learn the target from the private data, WRITE 8 bytes, wait for it.
//! let pd = client_dev.alloc_pd();
//! let cq = client_dev.create_cq(64);
//! let conn = connect(&pd, server_addr, &cq, &cq, &QpOptions::default())?;
//! let addr = u64::from_le_bytes(conn.peer_private_data[0..8].try_into().unwrap());
//! let rkey = u32::from_le_bytes(conn.peer_private_data[8..12].try_into().unwrap());
//! let src = pd.alloc_mr(8, Access::LOCAL_WRITE)?;
//! src.write(0, &42u64.to_le_bytes());
//! conn.qp.post_send(&[SendWr {
//!     wr_id: 1,
//!     local: src.sge(0, 8),
//!     op: SendOp::Write { remote: RemoteAddr { addr, rkey } },
//! }])?;
//! let mut wcs = [Completion::default(); 4];
//! let n = loop {
//!     let n = cq.poll(&mut wcs)?;
//!     if n > 0 { break n; }
//! };
//! assert_eq!((n, wcs[0].wc.wr_id, wcs[0].wc.status), (1, 1, WcStatus::Success));
//! assert_eq!(server.join().unwrap()?, 42u64.to_le_bytes());
//! # Ok(())
//! # }
//! ```

mod cm;
mod device;
mod direct;
mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod pd;
mod qp;

pub use cm::{Connected, Listener, MAX_CANDIDATES, MAX_PENDING, QpOptions, connect};
pub use device::{CompletionQueue, Device, DeviceConfig};
pub use direct::DirectParams;
pub use error::{Result, VerbsError};
pub use pd::{MemoryRegion, ProtectionDomain, WriteSink};
pub use qp::QueuePair;
/// The cluster-secret handshake and its helpers (`tbrdma-auth`), for side channels built on
/// this crate.
pub use tbrdma_auth as auth;
pub use tbrdma_auth::{Auth, Secret};
pub use tbrdma_engine::cq::Completion;
pub use tbrdma_engine::io::EngineKind;
pub use tbrdma_engine::io::faults;
pub use tbrdma_engine::memory::{SinkFn, copy_slice};
pub use tbrdma_engine::worker::{EngineConfig, LANDING_MIN, Progress, SEND_HEADROOM};
pub use tbrdma_proto::{
    Access, Config, ConnectionError, ConnectionState, Event, RecvWr, RemoteAddr, SendOp, SendWr,
    Sge, Stats, WcOpcode, WcStatus, WorkCompletion,
};
