//! Encoding: the header goes in front, the caller places the payload straight after it (from
//! registered memory, with no intermediate copy), then [`seal`] writes the CRC. A payload left
//! where it lies (sent as a second part of a gathered datagram) is fed to [`seal_parts`]
//! instead: the CRC on the wire is the same.

use super::{
    COMMON_HEADER_LEN, CRC_RANGE, Ext, Handshake, Header, MAGIC, MAX_EXT_LEN, Remote, Segment,
    VERSION, crc_stops_at,
};
use crate::codec::{Put, SliceWriter, put_in};

/// CRC-32C (Castagnoli) of a datagram, skipping the CRC field itself, over the bytes its
/// flags say it covers ([`super::crc_stops_at`]: the payload of a data packet only with a
/// data digest).
///
/// Castagnoli rather than the IEEE polynomial for its error detection on datagrams of up to
/// 64 KiB (Hamming distance 4 over the whole length, where IEEE drops to 3 beyond ~11 KiB).
/// Long inputs go through crc-fast (carry-less multiplication folding, chosen at run time for
/// the CPU), which measured 2.3-2.5× faster than the crc32c crate's SSE4.2 loop from 4 KiB up;
/// short ones (every header) through the `crc32` instruction where they lie (`SMALL_CRC`);
/// see `docs/performance.md`.
pub fn crc_of(datagram: &[u8]) -> u32 {
    if datagram.len() <= SMALL_CRC {
        let covered =
            crc_stops_at(datagram).map_or(datagram, |end| datagram.get(..end).unwrap_or(datagram));
        return small_crc(covered);
    }
    crc_of_parts(datagram, |_| {})
}

/// Up to this many covered bytes (every header, and small packets whole), the CRC runs over
/// the two pieces around the CRC field where they lie, with the CPU's `crc32` instruction
/// (`tbrdma_crc`); beyond, crc-fast's folding digest is faster.
const SMALL_CRC: usize = 256;

/// CRC-32C of `bytes` (at most [`SMALL_CRC`] of them), skipping the CRC field.
fn small_crc(bytes: &[u8]) -> u32 {
    let head = bytes.get(..CRC_RANGE.start).unwrap_or(bytes);
    let tail = bytes.get(CRC_RANGE.end..).unwrap_or(&[]);
    tbrdma_crc::crc32c_of_pieces(head, tail)
}

/// CRC-32C of a datagram sent in two parts: `header` (which may also hold some or all of the
/// payload), then the bytes `payload` hands to its argument, in order. The CRC field inside
/// `header` is skipped, so the value is the one [`crc_of`] gives for the concatenation; a data
/// packet without a data digest leaves its payload out, and `payload` is then not called.
pub fn crc_of_parts(header: &[u8], payload: impl FnOnce(&mut dyn FnMut(&[u8]))) -> u32 {
    if let Some(end) = crc_stops_at(header).filter(|&end| end <= SMALL_CRC) {
        return small_crc(header.get(..end).unwrap_or(header));
    }
    let head = header.get(..CRC_RANGE.start).unwrap_or(header);
    let tail = header.get(CRC_RANGE.end..).unwrap_or(&[]);
    let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    digest.update(head);
    digest.update(tail);
    payload(&mut |bytes| digest.update(bytes));
    // A 32-bit CRC in the low half.
    digest.finalize() as u32
}

/// Writes the CRC of `datagram` (header, extension and payload, all in place) into its header.
pub fn seal(datagram: &mut [u8]) {
    let crc = crc_of(datagram);
    SliceWriter::new(&mut datagram[CRC_RANGE]).put_u32(crc);
}

/// Writes into `header` the CRC of the datagram made of `header` followed by the bytes
/// `payload` hands to its argument (see [`crc_of_parts`]): for a datagram whose payload is
/// sent from where it lies, as a second part, instead of being copied behind the header.
pub fn seal_parts(header: &mut [u8], payload: impl FnOnce(&mut dyn FnMut(&[u8]))) {
    let crc = crc_of_parts(header, payload);
    SliceWriter::new(&mut header[CRC_RANGE]).put_u32(crc);
}

/// Writes the common and extension headers for a datagram with `payload_len` payload bytes
/// into the front of `buf` and returns how many bytes were written. For ACK the selective
/// acknowledgement blocks are the payload and are written here too (pass 0).
///
/// # Panics
/// If `buf` is shorter than the header (the caller sizes buffers for [`super::MAX_HEADER_LEN`]
/// plus the payload; this is a programming error, never a reaction to input).
pub fn write_header(buf: &mut [u8], header: &Header, ext: &Ext, payload_len: usize) -> usize {
    let sacks = match ext {
        Ext::Ack { sacks, .. } => sacks.as_slice(),
        _ => &[],
    };
    let payload_len = payload_len + sacks.len() * 8;
    let opcode = ext.opcode();
    let ext_len = opcode.ext_len();
    let len = COMMON_HEADER_LEN + ext_len + sacks.len() * 8;
    assert!(
        len <= buf.len(),
        "frame writer: a {len}-byte header does not fit a {}-byte buffer",
        buf.len()
    );
    // Both headers are built in arrays, each field at its fixed offset, then copied: no
    // bounds check per field (a cursor's checks were most of an 8-byte message's encoding).
    let mut common = [0u8; COMMON_HEADER_LEN];
    put_in::<0, 2, COMMON_HEADER_LEN>(&mut common, MAGIC);
    put_in::<2, 1, COMMON_HEADER_LEN>(&mut common, [VERSION]);
    put_in::<3, 1, COMMON_HEADER_LEN>(&mut common, [opcode as u8]);
    // Bytes 4..8, the CRC, stay zero until `seal`.
    put_in::<8, 8, COMMON_HEADER_LEN>(&mut common, header.token.to_le_bytes());
    put_in::<16, 4, COMMON_HEADER_LEN>(&mut common, header.dest_qpn.to_le_bytes());
    put_in::<20, 4, COMMON_HEADER_LEN>(&mut common, header.psn.0.to_le_bytes());
    put_in::<24, 4, COMMON_HEADER_LEN>(&mut common, header.ack_psn.0.to_le_bytes());
    put_in::<28, 2, COMMON_HEADER_LEN>(&mut common, header.flags.to_le_bytes());
    let payload_len = u16::try_from(payload_len).expect("payload length fits the 16-bit field");
    put_in::<30, 2, COMMON_HEADER_LEN>(&mut common, payload_len.to_le_bytes());
    buf[..COMMON_HEADER_LEN].copy_from_slice(&common);
    let ext_bytes = ext_header(ext);
    buf[COMMON_HEADER_LEN..COMMON_HEADER_LEN + ext_len].copy_from_slice(&ext_bytes[..ext_len]);
    // An ACK's selective acknowledgement blocks are its payload.
    let mut w = SliceWriter::new(&mut buf[COMMON_HEADER_LEN + ext_len..len]);
    for block in sacks {
        w.put_u32(block.start.0);
        w.put_u32(block.end.0);
    }
    len
}

/// The extension header of `ext`, in the first `ext.opcode().ext_len()` bytes (the rest zero).
fn ext_header(ext: &Ext) -> [u8; MAX_EXT_LEN] {
    const N: usize = MAX_EXT_LEN;
    let mut b = [0u8; N];
    match ext {
        Ext::Send(s) | Ext::ReadResponse(s) => put_in::<0, 24, N>(&mut b, segment_bytes(s)),
        Ext::Write(s, r) | Ext::WriteWithImm(s, r) => {
            put_in::<0, 24, N>(&mut b, segment_bytes(s));
            put_in::<24, 16, N>(&mut b, remote_bytes(r));
        }
        Ext::ReadRequest { remote: r, len } => {
            put_in::<0, 16, N>(&mut b, remote_bytes(r));
            put_in::<16, 8, N>(&mut b, len.to_le_bytes());
        }
        Ext::FetchAdd { remote: r, add } => {
            put_in::<0, 16, N>(&mut b, remote_bytes(r));
            put_in::<16, 8, N>(&mut b, add.to_le_bytes());
            // 8 bytes of padding.
        }
        Ext::CmpSwap {
            remote: r,
            compare,
            swap,
        } => {
            put_in::<0, 16, N>(&mut b, remote_bytes(r));
            put_in::<16, 8, N>(&mut b, compare.to_le_bytes());
            put_in::<24, 8, N>(&mut b, swap.to_le_bytes());
        }
        Ext::AtomicResponse { req_psn, original } => {
            put_in::<0, 4, N>(&mut b, req_psn.0.to_le_bytes());
            put_in::<8, 8, N>(&mut b, original.to_le_bytes());
        }
        Ext::FatalNak { req_psn, code } => {
            put_in::<0, 4, N>(&mut b, req_psn.0.to_le_bytes());
            put_in::<4, 1, N>(&mut b, [*code as u8]);
        }
        Ext::Ack {
            window,
            receive_limit,
            sacks,
        } => {
            put_in::<0, 4, N>(&mut b, window.to_le_bytes());
            put_in::<4, 4, N>(&mut b, receive_limit.to_le_bytes());
            put_in::<8, 1, N>(&mut b, [sacks.as_slice().len() as u8]);
        }
        Ext::Nak {
            psn,
            code,
            rnr_delay_us,
        } => {
            put_in::<0, 4, N>(&mut b, psn.0.to_le_bytes());
            put_in::<4, 1, N>(&mut b, [*code as u8]);
            put_in::<8, 4, N>(&mut b, rnr_delay_us.to_le_bytes());
        }
        Ext::Connect(h) | Ext::Accept(h) => put_in::<0, 16, N>(&mut b, handshake_bytes(h)),
        Ext::Close { reason } => put_in::<0, 4, N>(&mut b, reason.to_le_bytes()),
        Ext::KeepAlive => {}
    }
    b
}

/// A segment: the message's first PSN, the immediate, the offset and the message's length.
fn segment_bytes(s: &Segment) -> [u8; 24] {
    let mut b = [0u8; 24];
    put_in::<0, 4, 24>(&mut b, s.msg_first_psn.0.to_le_bytes());
    put_in::<4, 4, 24>(&mut b, s.imm_or_req.to_le_bytes());
    put_in::<8, 8, 24>(&mut b, s.offset.to_le_bytes());
    put_in::<16, 8, 24>(&mut b, s.msg_len.to_le_bytes());
    b
}

/// A remote buffer: its rkey, 4 bytes of padding, its address.
fn remote_bytes(r: &Remote) -> [u8; 16] {
    let mut b = [0u8; 16];
    put_in::<0, 4, 16>(&mut b, r.rkey.to_le_bytes());
    put_in::<8, 8, 16>(&mut b, r.addr.to_le_bytes());
    b
}

/// A CONNECT's or ACCEPT's parameters.
fn handshake_bytes(h: &Handshake) -> [u8; 16] {
    let mut b = [0u8; 16];
    put_in::<0, 4, 16>(&mut b, h.src_qpn.to_le_bytes());
    put_in::<4, 4, 16>(&mut b, h.initial_psn.0.to_le_bytes());
    put_in::<8, 4, 16>(&mut b, h.max_payload.to_le_bytes());
    put_in::<12, 4, 16>(&mut b, h.window.to_le_bytes());
    b
}
