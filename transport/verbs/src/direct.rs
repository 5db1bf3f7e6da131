//! Queue pairs connected without the connection manager (`ibv_modify_qp` to RTR): the caller
//! already knows everything the side channel would have carried (the peer's data socket and
//! queue pair number, the token, who sends CONNECT), typically because a verbs application
//! exchanged GIDs and QPNs itself. The libibverbs-compatible library (`shim/ibverbs`) is the
//! user; `docs/ibverbs.md` describes how it derives these values.

use std::net::SocketAddr;

use tbrdma_engine::worker::{NewConnection, random_u64};
use tbrdma_proto::connection::ConnectParams;
use tbrdma_proto::{Config, Psn};

use crate::device::CompletionQueue;
use crate::error::{Result, VerbsError};
use crate::pd::ProtectionDomain;
use crate::qp::QueuePair;

/// What a direct connection needs: what the connection manager would otherwise agree on.
#[derive(Clone, Debug)]
pub struct DirectParams {
    /// This side's queue pair number (names the connection in the engine: must be unused on
    /// the device, and must not come from [`crate::Device`]'s connection-manager numbering
    /// range, which starts at 1 and counts up).
    pub local_qpn: u32,
    /// The peer's queue pair number.
    pub remote_qpn: u32,
    /// The peer's data socket (one rail).
    pub peer: SocketAddr,
    /// Whether this side sends CONNECT; exactly one of the two sides must.
    pub active: bool,
    /// Session token both sides computed the same way.
    pub token: u64,
    /// Protocol configuration (fitted to the device as the connection manager does).
    pub config: Config,
    /// Whether the peer receives Ethernet frames (it runs the packet engine): this side sends
    /// it frames only then, and only when it runs the packet engine itself; UDP otherwise.
    /// The caller learns it with the rest (the libibverbs library: from the peer's queue pair
    /// number, docs/ibverbs.md).
    pub peer_takes_frames: bool,
}

impl QueuePair {
    /// Creates a queue pair that connects straight to `params.peer` over the link: the active
    /// side sends CONNECT (retried within the configuration's retry budget), the passive side
    /// waits for it for `config.idle_timeout`. Returns at once, before the handshake; requests
    /// posted meanwhile wait for it. Receives posted now are kept.
    pub fn connect_direct(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        params: DirectParams,
    ) -> Result<QueuePair> {
        let device = &pd.device;
        let engine = &device.inner.engine;
        let mut config = params.config;
        config.max_datagram = config.max_datagram.min(engine.config().max_datagram);
        config.window = config.window.min(engine.window_limit(config.max_datagram));
        config.ack_hold = engine.ack_hold_for(config.ack_hold);
        engine
            .add_connection(NewConnection {
                config,
                active: params.active,
                params: ConnectParams {
                    token: params.token,
                    local_qpn: params.local_qpn,
                    remote_qpn: params.remote_qpn,
                    initial_psn: Psn(random_u64() as u32),
                },
                peers: vec![params.peer],
                peer_takes_frames: params.peer_takes_frames && device.carries_frames(),
                pd: pd.id,
                send_cq: send_cq.shared.clone(),
                recv_cq: recv_cq.shared.clone(),
            })
            .map_err(VerbsError::io("starting the connection"))?;
        Ok(QueuePair {
            device: device.clone(),
            pd: pd.clone(),
            qp_num: params.local_qpn,
        })
    }
}
