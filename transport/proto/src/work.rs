//! Work requests and work completions: the vocabulary an application uses to ask for transfers
//! and to learn how they ended. Names follow ibverbs (`ibv_send_wr`, `ibv_wc`, `IBV_WC_*`).

use thiserror::Error;

/// A local buffer: an address inside a registered region and the key that region was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Local key of the region that holds the buffer.
    pub lkey: u32,
}

/// A buffer in the peer's memory, named by address and remote key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteAddr {
    /// Virtual address in the peer's region.
    pub addr: u64,
    /// Remote key the peer's region was registered with.
    pub rkey: u32,
}

/// What a send-queue work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send into the peer's next posted receive; `imm` is delivered with it.
    Send {
        /// Immediate data (SEND_WITH_IMM) or none (plain SEND).
        imm: Option<u32>,
    },
    /// One-sided write of the local buffer to `remote`.
    Write {
        /// Target buffer in the peer's memory.
        remote: RemoteAddr,
    },
    /// One-sided write that also consumes one posted receive at the peer and hands it `imm`.
    WriteWithImm {
        /// Target buffer in the peer's memory.
        remote: RemoteAddr,
        /// Immediate data delivered in the peer's receive completion.
        imm: u32,
    },
    /// One-sided read of `remote` into the local buffer.
    Read {
        /// Source buffer in the peer's memory.
        remote: RemoteAddr,
    },
    /// 8-byte atomic add at `remote`; the original value lands in the local buffer.
    FetchAdd {
        /// 8-byte aligned target in the peer's memory.
        remote: RemoteAddr,
        /// Value to add (wrapping).
        add: u64,
    },
    /// 8-byte atomic compare-and-swap at `remote`; the original value lands in the local buffer.
    CmpSwap {
        /// 8-byte aligned target in the peer's memory.
        remote: RemoteAddr,
        /// Value the target must hold for the swap to happen.
        compare: u64,
        /// Value written when the comparison holds.
        swap: u64,
    },
}

impl SendOp {
    /// The opcode reported in this request's completion.
    pub fn completion_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send { .. } => WcOpcode::Send,
            SendOp::Write { .. } => WcOpcode::RdmaWrite,
            SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::CmpSwap { .. } => WcOpcode::CmpSwap,
        }
    }
}

/// A send-queue work request (`ibv_send_wr` with one scatter-gather entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Local buffer: the source of SEND and WRITE, the destination of READ and atomics.
    pub local: Sge,
    /// The operation.
    pub op: SendOp,
}

/// A receive-queue work request: a buffer for one incoming SEND or WRITE_WITH_IMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND's payload is placed (may be empty for WRITE_WITH_IMM only).
    pub local: Sge,
}

/// Which queue a completion belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Queue {
    /// The send queue (requests this side posted with `post_send`).
    #[default]
    Send,
    /// The receive queue (buffers this side posted with `post_recv`).
    Recv,
}

/// How a work request ended (`enum ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WcStatus {
    /// Completed as asked.
    #[default]
    Success,
    /// The local buffer does not fit (an incoming SEND longer than the posted receive).
    LocalLength,
    /// The local buffer's key is unknown or revoked, out of bounds, or lacks local write.
    LocalProtection,
    /// The connection entered the error state before this request could run.
    Flushed,
    /// The peer refused a remote access: bad or revoked rkey, out of bounds, missing permission.
    RemoteAccess,
    /// The peer could not carry out the request (a SEND longer than its receive buffer, a
    /// misaligned atomic).
    RemoteInvalidRequest,
    /// The peer failed while carrying out the request.
    RemoteOperational,
    /// The peer did not answer within the retry budget (link down, peer gone).
    RetryExceeded,
    /// The peer had no receive posted for a SEND within the receiver-not-ready retry budget.
    RnrRetryExceeded,
}

impl WcStatus {
    /// Whether the request succeeded.
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

/// What a completed work request did (`enum ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WcOpcode {
    /// A SEND finished (send queue).
    #[default]
    Send,
    /// A WRITE or WRITE_WITH_IMM finished (send queue).
    RdmaWrite,
    /// A READ finished (send queue).
    RdmaRead,
    /// A FETCH_ADD finished (send queue).
    FetchAdd,
    /// A CMP_SWAP finished (send queue).
    CmpSwap,
    /// A SEND arrived into a posted receive (receive queue).
    Recv,
    /// A WRITE_WITH_IMM consumed a posted receive (receive queue).
    RecvRdmaWithImm,
}

/// A work completion (`struct ibv_wc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct WorkCompletion {
    /// The `wr_id` of the request or receive this completes.
    pub wr_id: u64,
    /// Which queue it belongs to.
    pub queue: Queue,
    /// How it ended.
    pub status: WcStatus,
    /// What it did.
    pub opcode: WcOpcode,
    /// Bytes transferred: the message length for receives, the request length for sends.
    pub byte_len: u64,
    /// Immediate data carried by SEND_WITH_IMM or WRITE_WITH_IMM.
    pub imm: Option<u32>,
    /// For a successful receive on a connection with [`crate::Config::message_crc`]: the
    /// CRC-32C of the message's bytes as they were accepted from the wire and placed (for a
    /// WRITE_WITH_IMM, the WRITE's bytes). `None` otherwise.
    pub payload_crc: Option<u32>,
}

/// Why a work request was refused at post time. Requests that are accepted always complete;
/// these are refused before they enter a queue, as `ibv_post_send` returns an errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum PostError {
    /// The send or receive queue already holds its configured maximum of requests.
    #[error(
        "the {queue:?} queue is full ({depth} requests outstanding); poll completions before posting more, or raise the queue depth"
    )]
    QueueFull {
        /// The full queue.
        queue: Queue,
        /// Its configured depth.
        depth: usize,
    },
    /// The request is malformed (an atomic whose local buffer is not 8 bytes, …).
    #[error("invalid work request: {0}")]
    Invalid(&'static str),
}
