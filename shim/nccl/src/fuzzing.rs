//! What the cargo-fuzz target `nccl_control` (`fuzz/` at the repository root) drives: the
//! plugin's decoders of what a peer sends it, fed anything. The listen handle reaches
//! `connect` through NCCL's bootstrap from the peer; a CTS arrives over the link; the message
//! number comes in a completion's immediate value.

use crate::abi::NCCL_NET_HANDLE_MAXSIZE;
use crate::comm::{Cts, SEQ_MASK, full_seq};
use crate::net::{decode_handle, encode_handle, handle_listen_id, stage_of};

/// Decodes `data` as a listen handle (its first 128 bytes, zero-padded), a CTS (what follows)
/// and a message number (the first 12 bytes as the receiver's next number and an immediate):
/// none panics; a handle that decodes re-encodes to one that decodes the same; a CTS
/// re-encodes to the same bytes; a message number found is the nearest one with those low bits.
pub fn control(data: &[u8]) {
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let n = data.len().min(NCCL_NET_HANDLE_MAXSIZE);
    handle[..n].copy_from_slice(&data[..n]);
    if let Ok(links) = decode_handle(&handle) {
        let id = handle_listen_id(&handle);
        let mut again = [0u8; NCCL_NET_HANDLE_MAXSIZE];
        encode_handle(id, &links, &mut again);
        assert_eq!(decode_handle(&again).ok(), Some(links));
        assert_eq!(handle_listen_id(&again), id);
    }
    let _ = stage_of(&handle);

    let rest = &data[n..];
    if let Some(cts) = Cts::decode(rest) {
        let bytes = cts.encode();
        assert_eq!(Cts::decode(&bytes), Some(cts));
    }

    if data.len() >= 12 {
        let next = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
        let imm = u32::from_le_bytes(data[8..12].try_into().expect("4 bytes"));
        if let Some(seq) = full_seq(next, imm & SEQ_MASK) {
            assert_eq!((seq as u32) & SEQ_MASK, imm & SEQ_MASK);
            assert!(seq.abs_diff(next) <= u64::from(SEQ_MASK / 2 + 1));
        }
    }
}
