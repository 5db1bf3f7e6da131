//! CRC-32C arithmetic: the CRC of a concatenation from the CRCs of its parts, without reading
//! the bytes again. The receive path uses it to hand an application the CRC-32C of a whole
//! message, built from the datagrams' own CRCs (see `Config::message_crc`).
//!
//! A CRC with equal initial and final XOR values (CRC-32C has both all ones) satisfies
//! `crc(A ‖ B) = shift(crc(A), |B|) ⊕ crc(B)`, where `shift(c, n)` multiplies `c` by `x^(8n)`
//! modulo the polynomial. Values are kept in the reflected bit order the CRC itself uses: bit 31
//! holds the coefficient of `x^0`.

/// The CRC-32C of `bytes` (Castagnoli, as iSCSI and `WorkCompletion::payload_crc` use it),
/// for an application to compare with a completion's.
pub fn crc32c(bytes: &[u8]) -> u32 {
    // A 32-bit CRC in the low half.
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// CRC-32C's polynomial, reflected.
const POLY: u32 = 0x82F6_3B78;

/// `a · b mod P`, both reflected. Branch-free: the bits of `a` are data, and a branch on
/// each would be mispredicted half the time (this runs twice per datagram with message CRCs).
const fn mul(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut i = 0;
    while i < 32 {
        // All ones where the coefficient of x^i in `a` is set.
        let take = 0u32.wrapping_sub((a >> (31 - i)) & 1);
        product ^= b & take;
        // b · x
        b = (b >> 1) ^ (POLY & 0u32.wrapping_sub(b & 1));
        i += 1;
    }
    product
}

/// Powers of `x`: entry `k` is `x^(2^k) mod P`. The polynomial is not irreducible, so the
/// powers are not assumed to repeat with period 32: 67 entries cover a shift of `u64::MAX`
/// bytes (`2^3` bits per byte, 64 bits of byte count).
const POWERS: [u32; 67] = {
    let mut table = [0u32; 67];
    table[0] = 1 << 30; // x^1
    let mut k = 1;
    while k < table.len() {
        table[k] = mul(table[k - 1], table[k - 1]);
        k += 1;
    }
    table
};

/// `x^(8·bytes) mod P`: the factor [`shift`] multiplies by.
const fn shift_factor(bytes: u64) -> u32 {
    let mut factor = 1u32 << 31; // x^0
    let mut rest = bytes;
    let mut k = 3; // one byte is x^(2^3)
    while rest != 0 {
        if rest & 1 != 0 {
            factor = mul(POWERS[k], factor);
        }
        rest >>= 1;
        k += 1;
    }
    factor
}

/// What `crc` becomes when `bytes` more bytes follow the data it covers, before their own CRC
/// is XORed in: `crc(A ‖ B) = shift(crc(A), |B|) ^ crc(B)`.
pub fn shift(crc: u32, bytes: u64) -> u32 {
    mul(shift_factor(bytes), crc)
}

/// [`shift`] with the factor of one length computed once: for a connection's packets, all but
/// a message's last of which have the same payload length.
#[derive(Clone, Copy, Debug)]
pub struct Shifter {
    len: u64,
    factor: u32,
}

impl Shifter {
    /// A shifter whose cheap case is `len` bytes.
    pub const fn new(len: u64) -> Shifter {
        Shifter {
            len,
            factor: shift_factor(len),
        }
    }

    /// The length it shifts by cheaply.
    pub fn cheap_len(&self) -> u64 {
        self.len
    }

    /// [`shift`]`(crc, bytes)`: one product when `bytes` is its length.
    pub fn shift(&self, crc: u32, bytes: u64) -> u32 {
        if bytes == self.len {
            mul(self.factor, crc)
        } else {
            shift(crc, bytes)
        }
    }
}

/// The CRC-32C of `A ‖ B` from `crc(A)`, `crc(B)` and `|B|`.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    shift(crc_a, len_b) ^ crc_b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes that look random enough for a CRC (a multiplicative hash of the index).
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        (0..len as u64)
            .map(|i| ((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
            .collect()
    }

    #[test]
    fn combining_parts_gives_the_crc_of_the_whole() {
        let data = bytes(70_000, 7);
        for cut in [0, 1, 3, 4, 5, 63, 64, 1000, 65_536, 69_999, 70_000] {
            let (a, b) = data.split_at(cut);
            assert_eq!(
                combine(crc32c(a), crc32c(b), b.len() as u64),
                crc32c(&data),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_header_crc_can_be_taken_out_of_a_datagram_crc() {
        // What the receive path does: crc(P) = crc(H ‖ P) ^ shift(crc(H), |P|).
        let datagram = bytes(9_000, 3);
        let (head, payload) = datagram.split_at(56);
        let recovered = crc32c(&datagram) ^ shift(crc32c(head), payload.len() as u64);
        assert_eq!(recovered, crc32c(payload));
    }

    #[test]
    fn a_message_folds_from_its_packets_in_order() {
        let message = bytes(200_001, 11);
        let full = 65_472usize;
        let shifter = Shifter::new(full as u64);
        let mut acc = 0;
        for packet in message.chunks(full) {
            acc = shifter.shift(acc, packet.len() as u64) ^ crc32c(packet);
        }
        assert_eq!(acc, crc32c(&message));
        // The empty message: nothing folded.
        assert_eq!(crc32c(&[]), 0);
    }

    #[test]
    fn shifts_compose() {
        for (a, b) in [
            (0u64, 5u64),
            (1, 1),
            (7, 9),
            (1 << 20, 3),
            (u64::MAX / 3, 12_345),
        ] {
            let c = 0xDEAD_BEEF;
            assert_eq!(shift(shift(c, a), b), shift(c, a + b), "{a} + {b}");
        }
        assert_eq!(shift(0x1234_5678, 0), 0x1234_5678);
    }
}
