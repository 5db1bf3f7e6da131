//! Decoding: checks come first (length, magic, version, CRC, opcode, flags, declared lengths),
//! then each field is read at its fixed offset out of a header whose length was checked once
//! (`codec::u32_in` and the like, whose offsets are checked when compiled).

use thiserror::Error;

use super::opcode::{ErrorCode, NakCode, Opcode};
use super::{
    COMMON_HEADER_LEN, Ext, Handshake, Header, KNOWN_FLAGS, MAGIC, MAX_EXT_LEN, MAX_SACK_BLOCKS,
    Remote, SackBlock, SackList, Segment, VERSION, crc_of, crc_of_parts,
};
use crate::codec::{array_in, u16_at, u16_in, u32_at, u32_in, u64_at, u64_in};
use crate::seq::Psn;

/// Why a datagram was rejected. A rejected datagram has no effect on any connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// Shorter than the common header.
    #[error("datagram of {0} bytes is shorter than the 32-byte header")]
    TooShort(usize),
    /// Does not start with the tbrdma magic.
    #[error("not a tbrdma datagram (bad magic)")]
    BadMagic,
    /// A protocol version this build does not speak.
    #[error("protocol version {0} is not supported (this build speaks version 1)")]
    UnsupportedVersion(u8),
    /// The CRC does not match: the datagram was corrupted.
    #[error("CRC mismatch: datagram corrupted")]
    BadCrc,
    /// An opcode byte this version does not define.
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// Flag bits this version does not define.
    #[error("unknown flag bits {0:#06x}")]
    UnknownFlags(u16),
    /// The declared lengths do not add up to the datagram's size.
    #[error("declared length {declared} does not match datagram length {actual}")]
    LengthMismatch {
        /// Header + extension + declared payload.
        declared: usize,
        /// Bytes received.
        actual: usize,
    },
    /// A field holds a value the protocol forbids.
    #[error("malformed datagram: {0}")]
    Malformed(&'static str),
}

/// A decoded datagram borrowing its payload from the receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// The common header.
    pub header: Header,
    /// The opcode-specific part.
    pub ext: Ext,
    /// Payload bytes (empty for control packets).
    pub payload: &'a [u8],
    /// The bytes in front of the payload (headers, CRC field included).
    pub head: &'a [u8],
    /// The datagram's CRC, as carried and checked.
    pub crc: u32,
}

impl Packet<'_> {
    /// The CRC-32C of the payload alone, taken out of the datagram's CRC: the payload is not
    /// read again, only the header's CRC is computed (see [`super::crc_algebra`]). `shifter`
    /// is cheap for the length most payloads have. Meaningful only when the CRC covers the
    /// payload ([`Header::data_digest`] on a data packet).
    pub fn payload_crc(&self, shifter: &super::crc_algebra::Shifter) -> u32 {
        let head_crc = super::crc_of_parts(self.head, |_| {});
        self.crc ^ shifter.shift(head_crc, self.payload.len() as u64)
    }
}

/// Decodes one datagram. Never panics, never reads outside `datagram`.
pub fn decode(datagram: &[u8]) -> Result<Packet<'_>, DecodeError> {
    decode_from(datagram, &[])
}

/// Decodes a datagram that was received in two pieces: `head`, exactly its common and
/// extension headers, and `payload`, the rest (a SEND received straight into the buffer of the
/// receive it is for). Checks everything [`decode`] checks, over the same bytes, and rejects a
/// `head` that is not exactly the headers its opcode has; an empty `payload` makes it
/// [`decode`]`(head)`. Never panics, never reads outside the two slices.
pub fn decode_parts<'a>(head: &'a [u8], payload: &'a [u8]) -> Result<Packet<'a>, DecodeError> {
    decode_from(head, payload)
}

/// Decodes the datagram `bytes` followed by `tail`; a non-empty `tail` must start where the
/// headers end.
fn decode_from<'a>(bytes: &'a [u8], tail: &'a [u8]) -> Result<Packet<'a>, DecodeError> {
    let total = bytes.len() + tail.len();
    let datagram = bytes;
    // Every field of the common header at its fixed offset, out of one checked array.
    let Some(common) = datagram.first_chunk::<COMMON_HEADER_LEN>() else {
        return Err(DecodeError::TooShort(total));
    };
    if common[..2] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let version = common[2];
    if version != VERSION {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    let opcode_byte = common[3];
    let crc = u32_in::<4, COMMON_HEADER_LEN>(common);
    let computed = if tail.is_empty() {
        crc_of(datagram)
    } else {
        crc_of_parts(datagram, |feed| feed(tail))
    };
    if crc != computed {
        return Err(DecodeError::BadCrc);
    }
    let opcode = Opcode::from_u8(opcode_byte).ok_or(DecodeError::UnknownOpcode(opcode_byte))?;
    let short = DecodeError::TooShort(datagram.len());
    let token = u64_in::<8, COMMON_HEADER_LEN>(common);
    let dest_qpn = u32_in::<16, COMMON_HEADER_LEN>(common);
    let psn = Psn(u32_in::<20, COMMON_HEADER_LEN>(common));
    let ack_psn = Psn(u32_in::<24, COMMON_HEADER_LEN>(common));
    let flags = u16_in::<28, COMMON_HEADER_LEN>(common);
    let payload_len = usize::from(u16_in::<30, COMMON_HEADER_LEN>(common));
    if flags & !KNOWN_FLAGS != 0 {
        return Err(DecodeError::UnknownFlags(flags & !KNOWN_FLAGS));
    }
    let ext_len = opcode.ext_len();
    let declared = COMMON_HEADER_LEN + ext_len + payload_len;
    if declared != total {
        return Err(DecodeError::LengthMismatch {
            declared,
            actual: total,
        });
    }
    if !tail.is_empty() && datagram.len() != COMMON_HEADER_LEN + ext_len {
        return Err(DecodeError::Malformed(
            "a datagram received in two pieces must be cut where its headers end",
        ));
    }
    if payload_len > 0 && !opcode.carries_payload() {
        return Err(DecodeError::Malformed(
            "payload on an opcode that carries none",
        ));
    }
    let header = Header {
        opcode,
        token,
        dest_qpn,
        psn,
        ack_psn,
        flags,
    };
    let payload_start = COMMON_HEADER_LEN + ext_len;
    let payload = if tail.is_empty() {
        datagram.get(payload_start..).ok_or(short)?
    } else {
        tail
    };
    let head = datagram.get(..payload_start).ok_or(short)?;
    // (The declared length matched, so the extension header is all there.)
    let mut ext_bytes = [0u8; MAX_EXT_LEN];
    ext_bytes[..ext_len].copy_from_slice(head.get(COMMON_HEADER_LEN..).ok_or(short)?);
    let ext = decode_ext(&ext_bytes, opcode, payload)?;
    if let Some(seg) = ext.segment() {
        let end = seg.offset.checked_add(payload.len() as u64);
        if end.is_none_or(|end| end > seg.msg_len) {
            return Err(DecodeError::Malformed(
                "segment runs past the end of its message",
            ));
        }
    }
    let payload = if opcode == Opcode::Ack {
        &[][..]
    } else {
        payload
    };
    Ok(Packet {
        header,
        ext,
        payload,
        head,
        crc,
    })
}

/// The extension header of an `opcode` datagram, from its first `opcode.ext_len()` bytes in
/// `b` (the rest zero), each field at its fixed offset.
fn decode_ext(b: &[u8; MAX_EXT_LEN], opcode: Opcode, payload: &[u8]) -> Result<Ext, DecodeError> {
    const N: usize = MAX_EXT_LEN;
    Ok(match opcode {
        Opcode::Send => Ext::Send(segment(array_in::<0, 24, N>(b))),
        Opcode::Write => Ext::Write(
            segment(array_in::<0, 24, N>(b)),
            remote(array_in::<24, 16, N>(b)),
        ),
        Opcode::WriteWithImm => Ext::WriteWithImm(
            segment(array_in::<0, 24, N>(b)),
            remote(array_in::<24, 16, N>(b)),
        ),
        Opcode::ReadResponse => Ext::ReadResponse(segment(array_in::<0, 24, N>(b))),
        Opcode::ReadRequest => Ext::ReadRequest {
            remote: remote(array_in::<0, 16, N>(b)),
            len: u64_in::<16, N>(b),
        },
        Opcode::FetchAdd => Ext::FetchAdd {
            remote: remote(array_in::<0, 16, N>(b)),
            add: u64_in::<16, N>(b),
        },
        Opcode::CmpSwap => Ext::CmpSwap {
            remote: remote(array_in::<0, 16, N>(b)),
            compare: u64_in::<16, N>(b),
            swap: u64_in::<24, N>(b),
        },
        Opcode::AtomicResponse => Ext::AtomicResponse {
            req_psn: Psn(u32_in::<0, N>(b)),
            original: u64_in::<8, N>(b),
        },
        Opcode::FatalNak => {
            let code =
                ErrorCode::from_u8(b[4]).ok_or(DecodeError::Malformed("unknown error code"))?;
            Ext::FatalNak {
                req_psn: Psn(u32_in::<0, N>(b)),
                code,
            }
        }
        Opcode::Ack => {
            let count = usize::from(b[8]);
            if count > MAX_SACK_BLOCKS || payload.len() != count * 8 {
                return Err(DecodeError::Malformed(
                    "SACK block count does not match payload",
                ));
            }
            let mut sacks = SackList::default();
            for block in payload.chunks_exact(8).filter_map(<[u8]>::first_chunk::<8>) {
                let start = Psn(u32_in::<0, 8>(block));
                let end = Psn(u32_in::<4, 8>(block));
                if !start.before(end) {
                    return Err(DecodeError::Malformed("empty or inverted SACK block"));
                }
                sacks.push(SackBlock { start, end });
            }
            Ext::Ack {
                window: u32_in::<0, N>(b),
                receive_limit: u32_in::<4, N>(b),
                sacks,
            }
        }
        Opcode::Nak => {
            let code = NakCode::from_u8(b[4]).ok_or(DecodeError::Malformed("unknown NAK code"))?;
            Ext::Nak {
                psn: Psn(u32_in::<0, N>(b)),
                code,
                rnr_delay_us: u32_in::<8, N>(b),
            }
        }
        Opcode::Connect => Ext::Connect(handshake(array_in::<0, 16, N>(b))),
        Opcode::Accept => Ext::Accept(handshake(array_in::<0, 16, N>(b))),
        Opcode::Close => Ext::Close {
            reason: u32_in::<0, N>(b),
        },
        Opcode::KeepAlive => Ext::KeepAlive,
    })
}

/// A segment: the message's first PSN, the immediate, the offset and the message's length.
fn segment(b: [u8; 24]) -> Segment {
    Segment {
        msg_first_psn: Psn(u32_in::<0, 24>(&b)),
        imm_or_req: u32_in::<4, 24>(&b),
        offset: u64_in::<8, 24>(&b),
        msg_len: u64_in::<16, 24>(&b),
    }
}

/// A remote buffer: its rkey, 4 bytes of padding, its address.
fn remote(b: [u8; 16]) -> Remote {
    Remote {
        rkey: u32_in::<0, 16>(&b),
        addr: u64_in::<8, 16>(&b),
    }
}

/// A CONNECT's or ACCEPT's parameters.
fn handshake(b: [u8; 16]) -> Handshake {
    Handshake {
        src_qpn: u32_in::<0, 16>(&b),
        initial_psn: Psn(u32_in::<4, 16>(&b)),
        max_payload: u32_in::<8, 16>(&b),
        window: u32_in::<12, 16>(&b),
    }
}

/// Where a WRITE or WRITE_WITH_IMM datagram asks its payload to be placed, as its header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteTarget {
    /// Queue pair number at the receiver.
    pub dest_qpn: u32,
    /// Remote key of the target region.
    pub rkey: u32,
    /// Address of this datagram's first payload byte (the message's address plus the
    /// segment's offset).
    pub addr: u64,
    /// Payload bytes the header declares.
    pub payload_len: usize,
}

/// Bytes in front of a SEND's payload: the common header and the segment.
pub const SEND_HEADER_LEN: usize = COMMON_HEADER_LEN + 24;

/// Reads, from the first [`SEND_HEADER_LEN`] bytes of a datagram, whether it is the first
/// packet of a SEND (its payload is the message's first bytes) and if so the destination queue
/// pair and the payload length its header declares. Checks nothing but the magic, version and
/// opcode, as [`peek_write_target`]: for choosing where a datagram goes, never for believing it.
pub fn peek_send_start(head: &[u8]) -> Option<(u32, usize)> {
    let head = head.get(..SEND_HEADER_LEN)?;
    if head[..2] != MAGIC || head[2] != VERSION || head[3] != Opcode::Send as u8 {
        return None;
    }
    // The segment's offset follows its first PSN and immediate (see `write_header`).
    if u64_at(head, COMMON_HEADER_LEN + 8)? != 0 {
        return None;
    }
    Some((u32_at(head, 16)?, usize::from(u16_at(head, 30)?)))
}

/// The length of the packet at the front of `bytes`, as its common header declares it: the
/// common header, the extension header its opcode fixes, and the payload. Only the magic, the
/// version and the opcode are looked at (the CRC and everything else are [`decode`]'s to check),
/// so the length may exceed `bytes`. A datagram may carry several packets back to back
/// (docs/wire-format.md, "Several packets in one datagram"); the receiver splits it with this
/// and decodes each packet on its own.
pub fn packet_len(bytes: &[u8]) -> Option<usize> {
    let head = bytes.get(..COMMON_HEADER_LEN)?;
    if head[..2] != MAGIC || head[2] != VERSION {
        return None;
    }
    let opcode = Opcode::from_u8(head[3])?;
    Some(COMMON_HEADER_LEN + opcode.ext_len() + usize::from(u16_at(head, 30)?))
}

/// Whether the packet at the front of `bytes` is an acknowledgement (ACK), which a sender may
/// put in the same datagram as another packet for the same peer (see [`packet_len`]).
pub fn is_ack(bytes: &[u8]) -> bool {
    bytes.len() >= COMMON_HEADER_LEN && bytes[3] == Opcode::Ack as u8
}

/// Reads [`WriteTarget`] from the first [`super::MAX_HEADER_LEN`] bytes of a datagram, checking
/// nothing but the magic, version and opcode (not the CRC, which covers bytes not looked at):
/// for choosing where a datagram is received, never for believing anything about it, which
/// [`decode`] alone decides.
pub fn peek_write_target(head: &[u8]) -> Option<WriteTarget> {
    let head = head.get(..super::MAX_HEADER_LEN)?;
    let opcode = Opcode::from_u8(head[3])?;
    if head[..2] != MAGIC || head[2] != VERSION || opcode.ext_len() != super::MAX_EXT_LEN {
        return None;
    }
    if !matches!(opcode, Opcode::Write | Opcode::WriteWithImm) {
        return None;
    }
    // Offsets as `write_header` lays them out: the common header's queue pair number and
    // payload length, then the segment (first PSN, immediate, offset, message length) and the
    // remote buffer (rkey, 4 bytes of padding, address).
    Some(WriteTarget {
        dest_qpn: u32_at(head, 16)?,
        rkey: u32_at(head, 56)?,
        addr: u64_at(head, 64)?.wrapping_add(u64_at(head, 40)?),
        payload_len: usize::from(u16_at(head, 30)?),
    })
}
