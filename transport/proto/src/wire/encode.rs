//! Encoding: the header goes in front, the caller places the payload straight after it (from
//! registered memory, with no intermediate copy), then [`seal`] writes the CRC. A payload left
//! where it lies (sent as a second part of a gathered datagram) is fed to [`seal_parts`]
//! instead: the CRC on the wire is the same.

use super::{COMMON_HEADER_LEN, CRC_RANGE, Ext, Header, MAGIC, VERSION, crc_stops_at};
use crate::codec::{Put, SliceWriter};

/// CRC-32C (Castagnoli) of a datagram, skipping the CRC field itself, over the bytes its
/// flags say it covers ([`super::crc_stops_at`]: the payload of a data packet only with a
/// data digest).
///
/// Castagnoli rather than the IEEE polynomial for its error detection on datagrams of up to
/// 64 KiB (Hamming distance 4 over the whole length, where IEEE drops to 3 beyond ~11 KiB).
/// Computed with crc-fast (carry-less multiplication folding, chosen at run time for the CPU),
/// which measured 2.3-2.5× faster than the crc32c crate's SSE4.2 loop from 4 KiB up; see
/// `docs/performance.md`.
pub fn crc_of(datagram: &[u8]) -> u32 {
    if datagram.len() <= SMALL_CRC {
        let covered =
            crc_stops_at(datagram).map_or(datagram, |end| datagram.get(..end).unwrap_or(datagram));
        return small_crc(covered);
    }
    crc_of_parts(datagram, |_| {})
}

/// Up to this many covered bytes (every header, and small packets whole), the CRC is one
/// call on a contiguous copy: a header is cut in two by the CRC field, and feeding crc-fast's
/// digest two pieces cost twice what one piece does (callgrind, 8-byte ping-pong).
const SMALL_CRC: usize = 256;

/// CRC-32C of `bytes` (at most [`SMALL_CRC`] of them), skipping the CRC field.
fn small_crc(bytes: &[u8]) -> u32 {
    let head = bytes.get(..CRC_RANGE.start).unwrap_or(bytes);
    let tail = bytes.get(CRC_RANGE.end..).unwrap_or(&[]);
    let mut joined = [0u8; SMALL_CRC];
    let len = (head.len() + tail.len()).min(SMALL_CRC);
    joined[..head.len()].copy_from_slice(head);
    joined[head.len()..len].copy_from_slice(&tail[..len - head.len()]);
    crc_fast::crc32_iscsi(&joined[..len])
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
    let sack_len = match ext {
        Ext::Ack { sacks, .. } => sacks.as_slice().len() * 8,
        _ => 0,
    };
    let payload_len = payload_len + sack_len;
    let mut w = SliceWriter::new(buf);
    w.put_bytes(&MAGIC);
    w.put_u8(VERSION);
    w.put_u8(ext.opcode() as u8);
    w.put_u32(0); // CRC, filled in by `seal`.
    w.put_u64(header.token);
    w.put_u32(header.dest_qpn);
    w.put_u32(header.psn.0);
    w.put_u32(header.ack_psn.0);
    w.put_u16(header.flags);
    w.put_u16(u16::try_from(payload_len).expect("payload length fits the 16-bit field"));
    debug_assert_eq!(w.position(), COMMON_HEADER_LEN);
    let segment = |w: &mut SliceWriter<'_>, s: &super::Segment| {
        w.put_u32(s.msg_first_psn.0);
        w.put_u32(s.imm_or_req);
        w.put_u64(s.offset);
        w.put_u64(s.msg_len);
    };
    let remote = |w: &mut SliceWriter<'_>, r: &super::Remote| {
        w.put_u32(r.rkey);
        w.put_zeros(4);
        w.put_u64(r.addr);
    };
    match ext {
        Ext::Send(s) | Ext::ReadResponse(s) => segment(&mut w, s),
        Ext::Write(s, r) | Ext::WriteWithImm(s, r) => {
            segment(&mut w, s);
            remote(&mut w, r);
        }
        Ext::ReadRequest { remote: r, len } => {
            remote(&mut w, r);
            w.put_u64(*len);
        }
        Ext::FetchAdd { remote: r, add } => {
            remote(&mut w, r);
            w.put_u64(*add);
            w.put_zeros(8);
        }
        Ext::CmpSwap {
            remote: r,
            compare,
            swap,
        } => {
            remote(&mut w, r);
            w.put_u64(*compare);
            w.put_u64(*swap);
        }
        Ext::AtomicResponse { req_psn, original } => {
            w.put_u32(req_psn.0);
            w.put_zeros(4);
            w.put_u64(*original);
        }
        Ext::FatalNak { req_psn, code } => {
            w.put_u32(req_psn.0);
            w.put_u8(*code as u8);
            w.put_zeros(3);
        }
        Ext::Ack {
            window,
            receive_limit,
            sacks,
        } => {
            w.put_u32(*window);
            w.put_u32(*receive_limit);
            w.put_u8(sacks.as_slice().len() as u8);
            w.put_zeros(3);
            for block in sacks.as_slice() {
                w.put_u32(block.start.0);
                w.put_u32(block.end.0);
            }
        }
        Ext::Nak {
            psn,
            code,
            rnr_delay_us,
        } => {
            w.put_u32(psn.0);
            w.put_u8(*code as u8);
            w.put_zeros(3);
            w.put_u32(*rnr_delay_us);
        }
        Ext::Connect(h) | Ext::Accept(h) => {
            w.put_u32(h.src_qpn);
            w.put_u32(h.initial_psn.0);
            w.put_u32(h.max_payload);
            w.put_u32(h.window);
        }
        Ext::Close { reason } => {
            w.put_u32(*reason);
            w.put_zeros(4);
        }
        Ext::KeepAlive => {}
    }
    w.position()
}
