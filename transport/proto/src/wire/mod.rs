//! The wire format: what every tbrdma datagram looks like, byte by byte (see
//! `docs/wire-format.md`), with a decoder that checks length, version and CRC before any field
//! is believed, and never panics or reads out of bounds whatever it is given.
//!
//! A datagram is a 32-byte common header, an extension header whose size the opcode fixes, and
//! a payload. All integers are little-endian (every host tbrdma targets is).

pub mod crc_algebra;
mod decode;
mod encode;
mod opcode;

pub use decode::{
    DecodeError, Packet, SEND_HEADER_LEN, WriteTarget, decode, decode_parts, is_ack, packet_len,
    peek_send_start, peek_write_target,
};
pub use encode::{crc_of, crc_of_parts, seal, seal_parts, write_header};

pub use opcode::{ErrorCode, NakCode, Opcode};

use crate::seq::Psn;

/// First two bytes of every datagram: `"tB"`.
pub const MAGIC: [u8; 2] = *b"tB";
/// The protocol version this crate speaks (3: a data packet's CRC covers its payload only
/// with [`FLAG_DATA_DIGEST`]).
pub const VERSION: u8 = 3;
/// Size of the common header.
pub const COMMON_HEADER_LEN: usize = 32;
/// Largest extension header (WRITE and WRITE_WITH_IMM).
pub const MAX_EXT_LEN: usize = 40;
/// Largest header in front of a payload.
pub const MAX_HEADER_LEN: usize = COMMON_HEADER_LEN + MAX_EXT_LEN;
/// Most selective-acknowledgement blocks one ACK carries.
pub const MAX_SACK_BLOCKS: usize = 16;
/// Longest ACK packet: common header, extension, every selective block.
pub const MAX_ACK_LEN: usize = COMMON_HEADER_LEN + Opcode::Ack.ext_len() + MAX_SACK_BLOCKS * 8;
/// Byte range of the CRC field inside the common header.
pub const CRC_RANGE: std::ops::Range<usize> = 4..8;

/// Flag: `ack_psn` carries a cumulative acknowledgement.
pub const FLAG_ACK_VALID: u16 = 1;
/// Flag: the `imm` field of a SEND is present.
pub const FLAG_HAS_IMM: u16 = 1 << 1;
/// Flag: the sender asks for an acknowledgement without delay (last packet of a message).
pub const FLAG_ACK_REQUEST: u16 = 1 << 2;
/// Flag: the connection uses data digests. On a data packet (SEND, WRITE, WRITE_WITH_IMM,
/// READ_RESPONSE) the CRC then covers the payload too; without it the CRC covers the headers
/// only and the payload's integrity is the link's (docs/wire-format.md, "What the CRC
/// covers"). On CONNECT it asks the peer for data digests; on ACCEPT it says both sides use
/// them. Every other packet is covered whole whatever this bit says.
pub const FLAG_DATA_DIGEST: u16 = 1 << 3;
/// Flags this version defines; a datagram with any other bit set is rejected.
pub const KNOWN_FLAGS: u16 = FLAG_ACK_VALID | FLAG_HAS_IMM | FLAG_ACK_REQUEST | FLAG_DATA_DIGEST;

/// The common header, as decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the datagram is.
    pub opcode: Opcode,
    /// The connection's random session token.
    pub token: u64,
    /// Queue pair number at the receiver.
    pub dest_qpn: u32,
    /// Sequence number in the sender's stream (for unsequenced opcodes: the sender's next PSN).
    pub psn: Psn,
    /// Cumulative acknowledgement of the receiver's stream: every PSN before it has arrived.
    pub ack_psn: Psn,
    /// `FLAG_*` bits.
    pub flags: u16,
}

impl Header {
    /// Whether the cumulative acknowledgement is meaningful.
    pub fn ack_valid(&self) -> bool {
        self.flags & FLAG_ACK_VALID != 0
    }

    /// Whether the packet says its connection uses data digests ([`FLAG_DATA_DIGEST`]).
    pub fn data_digest(&self) -> bool {
        self.flags & FLAG_DATA_DIGEST != 0
    }
}

/// Where the CRC of the datagram that starts with `head` stops: `Some(header length)` for a
/// data packet without [`FLAG_DATA_DIGEST`], whose payload is left out (its common and
/// extension headers are always covered), `None` for any other datagram, covered whole. Reads
/// only the opcode and flags, so it is safe on any input: bytes too short to say, or of an
/// unknown opcode, are covered whole (and rejected later).
pub fn crc_stops_at(head: &[u8]) -> Option<usize> {
    let (Some(&opcode), Some(flags)) = (head.get(3), head.get(28..30)) else {
        return None;
    };
    let flags = u16::from_le_bytes([flags[0], flags[1]]);
    Opcode::from_u8(opcode)
        .filter(|op| op.carries_data() && flags & FLAG_DATA_DIGEST == 0)
        .map(|op| COMMON_HEADER_LEN + op.ext_len())
}

/// Where a segment sits inside its message; carried by every data-bearing packet so that each
/// can be placed on arrival without waiting for the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// PSN of the message's first packet.
    pub msg_first_psn: Psn,
    /// Immediate data (SEND with `FLAG_HAS_IMM`, WRITE_WITH_IMM), or for READ_RESPONSE the PSN
    /// of the READ_REQUEST being answered.
    pub imm_or_req: u32,
    /// Byte offset of this packet's payload in the message.
    pub offset: u64,
    /// Length of the whole message.
    pub msg_len: u64,
}

/// A remote buffer named in a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    /// Remote key.
    pub rkey: u32,
    /// Virtual address (for WRITE: of the message's first byte).
    pub addr: u64,
}

/// One selective-acknowledgement block: PSNs `start` (inclusive) to `end` (exclusive) arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SackBlock {
    /// First PSN received.
    pub start: Psn,
    /// One past the last PSN received.
    pub end: Psn,
}

/// Up to [`MAX_SACK_BLOCKS`] blocks, without allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SackList {
    blocks: [SackBlock; MAX_SACK_BLOCKS],
    len: usize,
}

impl SackList {
    /// Appends a block; returns false (and drops it) when the list is full.
    pub fn push(&mut self, block: SackBlock) -> bool {
        if self.len == MAX_SACK_BLOCKS {
            return false;
        }
        self.blocks[self.len] = block;
        self.len += 1;
        true
    }

    /// Keeps only the first `len` blocks.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The blocks.
    pub fn as_slice(&self) -> &[SackBlock] {
        &self.blocks[..self.len]
    }
}

/// Parameters each side announces in CONNECT and ACCEPT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handshake {
    /// The sender's own queue pair number (the destination of packets sent back to it).
    pub src_qpn: u32,
    /// First PSN of the sender's stream.
    pub initial_psn: Psn,
    /// Largest payload the sender accepts in one datagram.
    pub max_payload: u32,
    /// Packets the sender is willing to receive beyond its cumulative acknowledgement.
    pub window: u32,
}

/// The opcode-specific part of a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ext {
    /// SEND: one segment of a two-sided message.
    Send(Segment),
    /// WRITE: one segment of a one-sided write to `remote` (the message's start).
    Write(Segment, Remote),
    /// WRITE_WITH_IMM: as WRITE, and consumes a receive at the peer.
    WriteWithImm(Segment, Remote),
    /// READ_REQUEST: read `len` bytes at `remote`.
    ReadRequest {
        /// Source buffer.
        remote: Remote,
        /// Bytes to read.
        len: u64,
    },
    /// READ_RESPONSE: one segment of the data answering a READ_REQUEST (`imm_or_req`).
    ReadResponse(Segment),
    /// FETCH_ADD at `remote`.
    FetchAdd {
        /// Target.
        remote: Remote,
        /// Addend.
        add: u64,
    },
    /// CMP_SWAP at `remote`.
    CmpSwap {
        /// Target.
        remote: Remote,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// ATOMIC_RESPONSE: the value the target held before the atomic named by `req_psn`.
    AtomicResponse {
        /// PSN of the FETCH_ADD or CMP_SWAP answered.
        req_psn: Psn,
        /// Original value.
        original: u64,
    },
    /// FATAL_NAK (sequenced): the request at `req_psn` failed; the sender enters the error state.
    FatalNak {
        /// PSN of the failed request in the receiver's stream.
        req_psn: Psn,
        /// Why.
        code: ErrorCode,
    },
    /// ACK: cumulative acknowledgement (in the header) plus window, receive credit and
    /// selective blocks.
    Ack {
        /// Packets the receiver can take beyond the cumulative acknowledgement.
        window: u32,
        /// Receive credit: the sender may start the receive-consuming messages (SEND,
        /// WRITE_WITH_IMM) numbered before this one, counting such messages from 0 at the start
        /// of the connection and wrapping at 2^32 (the receives the receiver took so far plus
        /// those it has posted; see `connection/credit.rs`).
        receive_limit: u32,
        /// PSNs received beyond the cumulative acknowledgement.
        sacks: SackList,
    },
    /// NAK: a recoverable negative acknowledgement.
    Nak {
        /// The PSN the NAK is about (the next one expected).
        psn: Psn,
        /// Why.
        code: NakCode,
        /// For receiver-not-ready: how long to wait before retrying, in microseconds.
        rnr_delay_us: u32,
    },
    /// CONNECT: the active side's parameters.
    Connect(Handshake),
    /// ACCEPT: the passive side's parameters.
    Accept(Handshake),
    /// CLOSE: the sender is tearing the connection down.
    Close {
        /// Reason code (0: closed by the application).
        reason: u32,
    },
    /// KEEPALIVE: asks for an ACK, proving the peer alive.
    KeepAlive,
}

impl Ext {
    /// The opcode this extension belongs to.
    pub fn opcode(&self) -> Opcode {
        match self {
            Ext::Send(_) => Opcode::Send,
            Ext::Write(..) => Opcode::Write,
            Ext::WriteWithImm(..) => Opcode::WriteWithImm,
            Ext::ReadRequest { .. } => Opcode::ReadRequest,
            Ext::ReadResponse(_) => Opcode::ReadResponse,
            Ext::FetchAdd { .. } => Opcode::FetchAdd,
            Ext::CmpSwap { .. } => Opcode::CmpSwap,
            Ext::AtomicResponse { .. } => Opcode::AtomicResponse,
            Ext::FatalNak { .. } => Opcode::FatalNak,
            Ext::Ack { .. } => Opcode::Ack,
            Ext::Nak { .. } => Opcode::Nak,
            Ext::Connect(_) => Opcode::Connect,
            Ext::Accept(_) => Opcode::Accept,
            Ext::Close { .. } => Opcode::Close,
            Ext::KeepAlive => Opcode::KeepAlive,
        }
    }

    /// The segment descriptor of a data-bearing packet.
    pub fn segment(&self) -> Option<&Segment> {
        match self {
            Ext::Send(s) | Ext::Write(s, _) | Ext::WriteWithImm(s, _) | Ext::ReadResponse(s) => {
                Some(s)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;
