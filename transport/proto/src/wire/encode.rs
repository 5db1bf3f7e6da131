//! Encoding: the header goes in front, the caller places the payload straight after it (from
//! registered memory, with no intermediate copy), then [`seal`] writes the CRC. A payload left
//! where it lies (sent as a second part of a gathered datagram) is fed to [`seal_parts`]
//! instead: the CRC on the wire is the same.

use super::bytes::Writer;
use super::{COMMON_HEADER_LEN, CRC_RANGE, Ext, Header, MAGIC, VERSION};

/// CRC-32C (Castagnoli) of a datagram, skipping the CRC field itself.
///
/// Castagnoli rather than the IEEE polynomial for its error detection on datagrams of up to
/// 64 KiB (Hamming distance 4 over the whole length, where IEEE drops to 3 beyond ~11 KiB).
/// Computed with crc-fast (carry-less multiplication folding, chosen at run time for the CPU),
/// which measured 2.3-2.5× faster than the crc32c crate's SSE4.2 loop from 4 KiB up; see
/// `docs/performance.md`.
pub fn crc_of(datagram: &[u8]) -> u32 {
    crc_of_parts(datagram, |_| {})
}

/// CRC-32C of a datagram sent in two parts: `header` (which may also hold some or all of the
/// payload), then the bytes `payload` hands to its argument, in order. The CRC field inside
/// `header` is skipped, so the value is the one [`crc_of`] gives for the concatenation.
pub fn crc_of_parts(header: &[u8], payload: impl FnOnce(&mut dyn FnMut(&[u8]))) -> u32 {
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
    datagram[CRC_RANGE].copy_from_slice(&crc.to_le_bytes());
}

/// Writes into `header` the CRC of the datagram made of `header` followed by the bytes
/// `payload` hands to its argument (see [`crc_of_parts`]): for a datagram whose payload is
/// sent from where it lies, as a second part, instead of being copied behind the header.
pub fn seal_parts(header: &mut [u8], payload: impl FnOnce(&mut dyn FnMut(&[u8]))) {
    let crc = crc_of_parts(header, payload);
    header[CRC_RANGE].copy_from_slice(&crc.to_le_bytes());
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
    let mut w = Writer::new(buf);
    w.put(&MAGIC);
    w.u8(VERSION);
    w.u8(ext.opcode() as u8);
    w.u32(0); // CRC, filled in by `seal`.
    w.u64(header.token);
    w.u32(header.dest_qpn);
    w.u32(header.psn.0);
    w.u32(header.ack_psn.0);
    w.u16(header.flags);
    w.u16(u16::try_from(payload_len).expect("payload length fits the 16-bit field"));
    debug_assert_eq!(w.position(), COMMON_HEADER_LEN);
    let segment = |w: &mut Writer<'_>, s: &super::Segment| {
        w.u32(s.msg_first_psn.0);
        w.u32(s.imm_or_req);
        w.u64(s.offset);
        w.u64(s.msg_len);
    };
    let remote = |w: &mut Writer<'_>, r: &super::Remote| {
        w.u32(r.rkey);
        w.zeros(4);
        w.u64(r.addr);
    };
    match ext {
        Ext::Send(s) | Ext::ReadResponse(s) => segment(&mut w, s),
        Ext::Write(s, r) | Ext::WriteWithImm(s, r) => {
            segment(&mut w, s);
            remote(&mut w, r);
        }
        Ext::ReadRequest { remote: r, len } => {
            remote(&mut w, r);
            w.u64(*len);
        }
        Ext::FetchAdd { remote: r, add } => {
            remote(&mut w, r);
            w.u64(*add);
            w.zeros(8);
        }
        Ext::CmpSwap {
            remote: r,
            compare,
            swap,
        } => {
            remote(&mut w, r);
            w.u64(*compare);
            w.u64(*swap);
        }
        Ext::AtomicResponse { req_psn, original } => {
            w.u32(req_psn.0);
            w.zeros(4);
            w.u64(*original);
        }
        Ext::FatalNak { req_psn, code } => {
            w.u32(req_psn.0);
            w.u8(*code as u8);
            w.zeros(3);
        }
        Ext::Ack { window, sacks } => {
            w.u32(*window);
            w.u8(sacks.as_slice().len() as u8);
            w.zeros(3);
            for block in sacks.as_slice() {
                w.u32(block.start.0);
                w.u32(block.end.0);
            }
        }
        Ext::Nak {
            psn,
            code,
            rnr_delay_us,
        } => {
            w.u32(psn.0);
            w.u8(*code as u8);
            w.zeros(3);
            w.u32(*rnr_delay_us);
        }
        Ext::Connect(h) | Ext::Accept(h) => {
            w.u32(h.src_qpn);
            w.u32(h.initial_psn.0);
            w.u32(h.max_payload);
            w.u32(h.window);
        }
        Ext::Close { reason } => {
            w.u32(*reason);
            w.zeros(4);
        }
        Ext::KeepAlive => {}
    }
    w.position()
}
