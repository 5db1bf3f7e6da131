//! # tbrdma-crc: CRC-32C of short inputs given in pieces
//!
//! Every tbrdma datagram carries a CRC-32C (Castagnoli) of its header, which the CRC field
//! itself cuts in two, so the check is over two pieces of some 4 and 70 bytes, computed once
//! when a datagram is sent and once when it arrives. crc-fast (which the wire format uses for
//! long inputs, where its carry-less-multiplication folding is fastest) takes either a copy of
//! the pieces joined or two calls of its digest for that; here the SSE4.2 `crc32` instruction
//! runs over both pieces where they lie. Per 8 B ping-pong round trip (two headers checked)
//! that is about 175 instructions and 10 taken jumps instead of about 280 and 18 (callgrind,
//! docs/performance.md). Same polynomial, same values.
//!
//! This crate holds the project's only `unsafe` for it, in the module `sse42`: the instruction is
//! reached through `std::arch` intrinsics, which need the CPU feature checked at run time.
//! Without SSE4.2 (or off x86-64) crc-fast computes the value.

#![deny(unsafe_code)]

/// CRC-32C of `head` followed by `tail` (the standard check value: initial value and final
/// XOR all ones, reflected), as `crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, head ++ tail)`.
/// Made for short inputs; long ones are faster through crc-fast's digest.
pub fn crc32c_of_pieces(head: &[u8], tail: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(crc) = sse42::crc32c_of_pieces(head, tail) {
        return crc;
    }
    let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    digest.update(head);
    digest.update(tail);
    // A 32-bit CRC in the low half.
    digest.finalize() as u32
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod sse42 {
    use std::arch::x86_64::{_mm_crc32_u8, _mm_crc32_u16, _mm_crc32_u32, _mm_crc32_u64};

    /// [`super::crc32c_of_pieces`] with the `crc32` instruction, or `None` when the CPU lacks
    /// SSE4.2.
    pub fn crc32c_of_pieces(head: &[u8], tail: &[u8]) -> Option<u32> {
        if !std::is_x86_feature_detected!("sse4.2") {
            return None;
        }
        // SAFETY: the CPU has SSE4.2 (checked just above), all `update` requires.
        Some(!unsafe { update(update(!0, head), tail) })
    }

    /// The CRC-32C register `crc` (not inverted) after `bytes`: eight bytes per instruction,
    /// then four, two and one (unaligned loads are fine on x86-64). Per round trip, a byte
    /// loop for the last three took 2 jumps more, and a loop over 32-byte blocks 4 more.
    ///
    /// # Safety
    /// The CPU must support SSE4.2.
    #[target_feature(enable = "sse4.2")]
    // (From Rust 1.87 these intrinsics are safe to call inside a function that enables the
    // feature; the blocks stay for the workspace's minimum Rust, 1.85.)
    #[allow(unused_unsafe)]
    pub unsafe fn update(mut crc: u32, bytes: &[u8]) -> u32 {
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            let word = u64::from_le_bytes([
                word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
            ]);
            // SAFETY: SSE4.2 is enabled for this function, and the caller vouched for the CPU.
            crc = unsafe { _mm_crc32_u64(u64::from(crc), word) } as u32;
        }
        let mut rest = words.remainder();
        if let [a, b, c, d, more @ ..] = rest {
            // SAFETY: as above.
            crc = unsafe { _mm_crc32_u32(crc, u32::from_le_bytes([*a, *b, *c, *d])) };
            rest = more;
        }
        if let [a, b, more @ ..] = rest {
            // SAFETY: as above.
            crc = unsafe { _mm_crc32_u16(crc, u16::from_le_bytes([*a, *b])) };
            rest = more;
        }
        if let [byte] = rest {
            // SAFETY: as above.
            crc = unsafe { _mm_crc32_u8(crc, *byte) };
        }
        crc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference(head: &[u8], tail: &[u8]) -> u32 {
        let joined: Vec<u8> = head.iter().chain(tail).copied().collect();
        crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, &joined) as u32
    }

    #[test]
    fn the_standard_check_value() {
        // CRC-32C's check value: the nine ASCII digits.
        assert_eq!(crc32c_of_pieces(b"1234", b"56789"), 0xe306_9283);
        assert_eq!(crc32c_of_pieces(b"", b"123456789"), 0xe306_9283);
        assert_eq!(crc32c_of_pieces(b"", b""), 0);
    }

    proptest! {
        #[test]
        fn any_two_pieces_give_what_crc_fast_gives_for_them_joined(
            head in proptest::collection::vec(any::<u8>(), 0..40),
            tail in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            prop_assert_eq!(crc32c_of_pieces(&head, &tail), reference(&head, &tail));
        }
    }
}
