//! The `--verify` payload pattern: bytes derived from (iteration, size), cheap to generate and
//! to check, so a misplaced, stale or corrupted byte is found and named by its offset.

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Fills `out` with the pattern of message `iteration` of a run of `size`-byte messages.
pub fn fill(iteration: u64, size: usize, out: &mut [u8]) {
    let seed = splitmix(iteration ^ (size as u64).rotate_left(32));
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let word = splitmix(seed.wrapping_add(i as u64)).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// The pattern as a new vector.
pub fn make(iteration: u64, size: usize) -> Vec<u8> {
    let mut v = vec![0u8; size];
    fill(iteration, size, &mut v);
    v
}

/// The first byte of `got` that differs from the pattern, if any.
pub fn first_mismatch(iteration: u64, size: usize, got: &[u8]) -> Option<usize> {
    let want = make(iteration, size);
    if got.len() != want.len() {
        return Some(got.len().min(want.len()));
    }
    got.iter().zip(&want).position(|(a, b)| a != b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_by_iteration_and_size_and_name_the_bad_byte() {
        assert_ne!(make(1, 64), make(2, 64));
        assert_ne!(make(1, 64)[..32], make(1, 32)[..]);
        let mut got = make(7, 100);
        assert_eq!(first_mismatch(7, 100, &got), None);
        got[42] ^= 1;
        assert_eq!(first_mismatch(7, 100, &got), Some(42));
    }
}
