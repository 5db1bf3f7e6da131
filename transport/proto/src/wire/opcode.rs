//! Opcode and error-code numbering on the wire.

/// What a datagram is. Opcodes below 0x10 are *sequenced*: they take a PSN in the sender's
/// stream and are delivered reliably and in order. The rest are control packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Two-sided send.
    Send = 0x01,
    /// One-sided write.
    Write = 0x02,
    /// One-sided write that consumes a receive and carries 32 bits of immediate data.
    WriteWithImm = 0x03,
    /// One-sided read request.
    ReadRequest = 0x04,
    /// Data answering a read request.
    ReadResponse = 0x05,
    /// Atomic fetch-and-add.
    FetchAdd = 0x06,
    /// Atomic compare-and-swap.
    CmpSwap = 0x07,
    /// Result of an atomic.
    AtomicResponse = 0x08,
    /// Sequenced negative acknowledgement that ends the connection.
    FatalNak = 0x09,
    /// Cumulative and selective acknowledgement.
    Ack = 0x10,
    /// Recoverable negative acknowledgement.
    Nak = 0x11,
    /// Connection request.
    Connect = 0x20,
    /// Connection accepted.
    Accept = 0x21,
    /// Connection closed.
    Close = 0x22,
    /// Liveness probe.
    KeepAlive = 0x23,
}

impl Opcode {
    /// Decodes an opcode byte.
    pub fn from_u8(byte: u8) -> Option<Opcode> {
        Some(match byte {
            0x01 => Opcode::Send,
            0x02 => Opcode::Write,
            0x03 => Opcode::WriteWithImm,
            0x04 => Opcode::ReadRequest,
            0x05 => Opcode::ReadResponse,
            0x06 => Opcode::FetchAdd,
            0x07 => Opcode::CmpSwap,
            0x08 => Opcode::AtomicResponse,
            0x09 => Opcode::FatalNak,
            0x10 => Opcode::Ack,
            0x11 => Opcode::Nak,
            0x20 => Opcode::Connect,
            0x21 => Opcode::Accept,
            0x22 => Opcode::Close,
            0x23 => Opcode::KeepAlive,
            _ => return None,
        })
    }

    /// Whether the opcode takes a PSN and is delivered reliably in order.
    pub fn is_sequenced(self) -> bool {
        (self as u8) < 0x10
    }

    /// Whether packets of this opcode carry message bytes after a segment header (SEND,
    /// WRITE, WRITE_WITH_IMM, READ_RESPONSE): the payload a data digest covers.
    pub const fn carries_data(self) -> bool {
        matches!(
            self,
            Opcode::Send | Opcode::Write | Opcode::WriteWithImm | Opcode::ReadResponse
        )
    }

    /// Size of this opcode's extension header.
    pub const fn ext_len(self) -> usize {
        match self {
            Opcode::Send | Opcode::ReadResponse => 24,
            Opcode::Write | Opcode::WriteWithImm => 40,
            Opcode::ReadRequest => 24,
            Opcode::FetchAdd | Opcode::CmpSwap => 32,
            Opcode::AtomicResponse => 16,
            Opcode::FatalNak => 8,
            Opcode::Ack => 12,
            Opcode::Nak => 12,
            Opcode::Connect | Opcode::Accept => 16,
            Opcode::Close => 8,
            Opcode::KeepAlive => 0,
        }
    }

    /// Whether a payload may follow the extension header.
    pub fn carries_payload(self) -> bool {
        matches!(
            self,
            Opcode::Send
                | Opcode::Write
                | Opcode::WriteWithImm
                | Opcode::ReadResponse
                | Opcode::Ack
        )
    }
}

/// Why a FATAL_NAK ended a request (maps to the requester's completion status).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorCode {
    /// Bad or revoked rkey, out of bounds, or missing permission.
    RemoteAccess = 1,
    /// The request cannot be carried out (receive buffer too small, misaligned atomic).
    InvalidRequest = 2,
    /// The responder failed while carrying it out.
    RemoteOperational = 3,
}

impl ErrorCode {
    /// Decodes an error-code byte.
    pub fn from_u8(byte: u8) -> Option<ErrorCode> {
        Some(match byte {
            1 => ErrorCode::RemoteAccess,
            2 => ErrorCode::InvalidRequest,
            3 => ErrorCode::RemoteOperational,
            _ => return None,
        })
    }
}

/// Why a NAK asks for a retransmission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    /// A packet arrived beyond a gap; resend from the PSN named.
    SequenceError = 1,
    /// A SEND or WRITE_WITH_IMM found no posted receive; retry after the delay.
    ReceiverNotReady = 2,
}

impl NakCode {
    /// Decodes a NAK-code byte.
    pub fn from_u8(byte: u8) -> Option<NakCode> {
        Some(match byte {
            1 => NakCode::SequenceError,
            2 => NakCode::ReceiverNotReady,
            _ => return None,
        })
    }
}
