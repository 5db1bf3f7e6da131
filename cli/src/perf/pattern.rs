//! The `--verify` payload pattern: bytes derived from (iteration, size), cheap to generate and
//! to check, so a misplaced, stale or corrupted byte is found and named by its offset.
//!
//! Word `i` (8 bytes, little-endian) of a message is `seed ^ (i · φ)`, with `seed` mixed from
//! (iteration, size) and φ the odd golden-ratio constant: every word of a message differs from
//! every other (φ is odd, so `i · φ` is a bijection), so a datagram placed at the wrong offset
//! is caught, and the seed differs between iterations, so a stale datagram is caught too. One
//! add and one xor per word: generating and checking run at memory speed (the checker reads the
//! bytes in L1-sized pieces copied out of the region, with no allocation), which is what lets
//! `--verify` check every byte of every iteration without becoming a benchmark of the verifier.

use multiversion::multiversion;

/// The odd constant that spreads word indices.
const PHI: u64 = 0x9e37_79b9_7f4a_7c15;
/// Words checked between tests of the accumulated difference.
const BLOCK_WORDS: usize = 64;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(PHI);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn seed(iteration: u64, size: usize) -> u64 {
    splitmix(iteration ^ (size as u64).rotate_left(32))
}

/// Fills `out` with the pattern of message `iteration` of a run of `size`-byte messages.
pub fn fill(iteration: u64, size: usize, out: &mut [u8]) {
    let seed = seed(iteration, size);
    let mut spread = 0u64;
    let mut chunks = out.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&(seed ^ spread).to_le_bytes());
        spread = spread.wrapping_add(PHI);
    }
    let tail = chunks.into_remainder();
    let word = (seed ^ spread).to_le_bytes();
    tail.copy_from_slice(&word[..tail.len()]);
}

/// The pattern as a new vector.
pub fn make(iteration: u64, size: usize) -> Vec<u8> {
    let mut v = vec![0u8; size];
    fill(iteration, size, &mut v);
    v
}

/// The first byte of `got` that differs from the pattern of (`iteration`, `size`), if any
/// (`got.len()` when it is shorter than `size` and matches that far). Reads `got` in place.
#[cfg(test)]
pub fn first_mismatch(iteration: u64, size: usize, got: &[u8]) -> Option<usize> {
    let n = got.len().min(size);
    mismatch_from(seed(iteration, size), 0, &got[..n])
        .or_else(|| (n < size || got.len() != size).then_some(n))
}

/// [`first_mismatch`] for the `size` bytes of `region` at `offset`, which should hold the
/// pattern from its word `shift` on (0: the message's own pattern; see [`crc`]). They are
/// copied out in L1-sized pieces and checked there: a region a peer can write is never viewed
/// in place (see `MemoryRegion::with_bytes`), and a piece this small costs little next to the
/// check.
pub fn first_mismatch_in(
    region: &tbrdma_verbs::MemoryRegion,
    offset: usize,
    iteration: u64,
    size: usize,
    shift: u64,
) -> Option<usize> {
    const PIECE: usize = 16 << 10;
    let mut piece = [0u8; PIECE];
    let seed = seed(iteration, size);
    let mut done = 0;
    while done < size {
        let len = (size - done).min(PIECE);
        region.read(offset + done, &mut piece[..len]);
        if let Some(at) = mismatch_from(seed, shift + (done / 8) as u64, &piece[..len]) {
            return Some(done + at);
        }
        done += len;
    }
    None
}

/// The CRC-32C of `size` bytes of the pattern of (`iteration`, `size`) from its word `shift`
/// on, to compare with the one a receive completion carries
/// (`tbrdma_verbs::WorkCompletion::payload_crc`). Shifted patterns are how `tbrdma bw` varies
/// its messages without more source memory (its `SHIFT_BYTES`).
pub fn crc(iteration: u64, size: usize, shift: u64) -> u32 {
    let skip = 8 * shift as usize;
    let mut bytes = vec![0u8; skip + size];
    fill(iteration, size, &mut bytes);
    tbrdma_proto::wire::crc_algebra::crc32c(&bytes[skip..])
}

/// Bytes between the words [`first_probe_mismatch_in`] reads.
pub const PROBE_STRIDE: usize = 4 << 10;

/// [`first_mismatch_in`] for one word every [`PROBE_STRIDE`] bytes and the message's last
/// word, not every byte: for a message whose content a CRC already vouched for, whether it
/// landed where it should. A datagram of at least [`PROBE_STRIDE`] bytes placed at the wrong
/// offset, or not at all (the slot then holds another pattern), covers a probe.
pub fn first_probe_mismatch_in(
    region: &tbrdma_verbs::MemoryRegion,
    offset: usize,
    iteration: u64,
    size: usize,
    shift: u64,
) -> Option<usize> {
    let seed = seed(iteration, size);
    let last_word = size.saturating_sub(1) / 8 * 8;
    let probes = (0..size)
        .step_by(PROBE_STRIDE)
        .chain((size > 0).then_some(last_word));
    let mut word = [0u8; 8];
    for at in probes {
        let got = &mut word[..(size - at).min(8)];
        region.read(offset + at, got);
        if let Some(i) = mismatch_from(seed, shift + (at / 8) as u64, got) {
            return Some(at + i);
        }
    }
    None
}

/// The first of the `want.len()` bytes of `region` at `offset` that differs from `want`,
/// read in pieces as [`first_mismatch_in`] does.
pub fn first_difference_in(
    region: &tbrdma_verbs::MemoryRegion,
    offset: usize,
    want: &[u8],
) -> Option<usize> {
    const PIECE: usize = 16 << 10;
    let mut piece = [0u8; PIECE];
    for (i, expected) in want.chunks(PIECE).enumerate() {
        let got = &mut piece[..expected.len()];
        region.read(offset + i * PIECE, got);
        if let Some(j) = got.iter().zip(expected).position(|(a, b)| a != b) {
            return Some(i * PIECE + j);
        }
    }
    None
}

/// The first byte of `got` that differs from the pattern words of `seed` numbered from
/// `first_word` on (`got` starts on a word boundary; only its end may cut a word).
///
/// The receiver of a `bw --op send --verify` stream runs this on every byte, on the core that
/// limits the stream, so it is cloned for wider vectors: built for the x86-64 baseline (SSE2)
/// it checked 36-41 GB/s of a 16 KiB piece in L1, for AVX2 62 GB/s, for AVX-512 77-88 GB/s
/// (one core of the 2-core VM of docs/performance.md).
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2"))]
fn mismatch_from(seed: u64, first_word: u64, got: &[u8]) -> Option<usize> {
    let mut spread = PHI.wrapping_mul(first_word);
    let mut at = 0;
    // Fast pass: accumulate the differences of a block, look closer only when one is off.
    for block in got.chunks(BLOCK_WORDS * 8) {
        let start = spread;
        let mut diff = 0u64;
        let mut words = block.chunks_exact(8);
        for w in &mut words {
            let word = u64::from_le_bytes(w.try_into().expect("8 bytes"));
            diff |= word ^ seed ^ spread;
            spread = spread.wrapping_add(PHI);
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            let want = (seed ^ spread).to_le_bytes();
            if tail != &want[..tail.len()] {
                diff = 1;
            }
        }
        if diff != 0 {
            return Some(at + slow_mismatch(seed, start, block));
        }
        at += block.len();
    }
    None
}

/// The first differing byte of a block known to hold one, the pattern's words starting at
/// `spread`.
fn slow_mismatch(seed: u64, mut spread: u64, block: &[u8]) -> usize {
    for (i, w) in block.chunks(8).enumerate() {
        let want = (seed ^ spread).to_le_bytes();
        if let Some(j) = w.iter().zip(want).position(|(a, b)| *a != b) {
            return i * 8 + j;
        }
        spread = spread.wrapping_add(PHI);
    }
    unreachable!("the block differs from the pattern somewhere")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_checked_in_pieces_finds_what_the_whole_check_finds() {
        let size = (40 << 10) + 5;
        let good = make(9, size);
        let seed = seed(9, size);
        let in_pieces = |got: &[u8]| {
            let piece = 16 << 10;
            got.chunks(piece).enumerate().find_map(|(i, p)| {
                mismatch_from(seed, (i * piece / 8) as u64, p).map(|at| i * piece + at)
            })
        };
        assert_eq!(in_pieces(&good), None);
        for at in [0, 16 << 10, (16 << 10) + 3, size - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            assert_eq!(in_pieces(&bad), Some(at));
            assert_eq!(first_mismatch(9, size, &bad), Some(at));
        }
    }

    #[test]
    fn patterns_differ_by_iteration_and_size_and_name_the_bad_byte() {
        assert_ne!(make(1, 64), make(2, 64));
        assert_ne!(make(1, 64)[..32], make(1, 32)[..]);
        let mut got = make(7, 100);
        assert_eq!(first_mismatch(7, 100, &got), None);
        got[42] ^= 1;
        assert_eq!(first_mismatch(7, 100, &got), Some(42));
    }

    #[test]
    fn every_byte_of_a_large_message_is_checked() {
        // Sizes that end inside a word, inside a block and on a block boundary.
        for size in [1, 7, 8, 9, 511, 512, 513, 4096, 16384 + 3, 1 << 20] {
            let good = make(3, size);
            assert_eq!(first_mismatch(3, size, &good), None, "{size}");
            for at in [0, size / 2, size - 1] {
                let mut bad = good.clone();
                bad[at] ^= 0x80;
                assert_eq!(first_mismatch(3, size, &bad), Some(at), "{size} at {at}");
            }
        }
    }

    #[test]
    fn a_stale_or_misplaced_datagram_is_found_where_it_starts() {
        let size = 4 * 9000;
        let mut got = make(5, size);
        // The previous iteration's second "datagram" left in place.
        got[9000..18000].copy_from_slice(&make(4, size)[9000..18000]);
        assert_eq!(first_mismatch(5, size, &got), Some(9000));
        // The right iteration's bytes, one datagram off (8-byte aligned, so only the
        // position-dependence of the words can see it).
        let mut got = make(5, size);
        let shifted = make(5, size)[9000..18000].to_vec();
        got[18000..27000].copy_from_slice(&shifted);
        assert_eq!(first_mismatch(5, size, &got), Some(18000));
    }

    #[test]
    fn a_short_or_long_message_is_a_mismatch_at_its_end() {
        let good = make(2, 64);
        assert_eq!(first_mismatch(2, 64, &good[..40]), Some(40));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(first_mismatch(2, 64, &long), Some(64));
    }

    /// A region of `bytes` on a loopback device (caller progress: no engine thread).
    fn region(bytes: usize) -> (tbrdma_verbs::Device, tbrdma_verbs::MemoryRegion) {
        use tbrdma_verbs::{Access, Device, DeviceConfig, EngineConfig, Progress};
        let config = DeviceConfig {
            engine: EngineConfig {
                progress: Progress::Caller,
                ..EngineConfig::default()
            },
            port: 0,
        };
        let dev = Device::open("127.0.0.1", config).expect("loopback device");
        let mr = dev
            .alloc_pd()
            .alloc_mr(bytes, Access::LOCAL_WRITE)
            .expect("region");
        (dev, mr)
    }

    #[test]
    fn the_pattern_crc_is_that_of_its_bytes() {
        for size in [0, 1, 9, 4096, 65_537] {
            assert_eq!(
                crc(4, size, 0),
                tbrdma_proto::wire::crc_algebra::crc32c(&make(4, size))
            );
            let mut longer = vec![0u8; size + 16];
            fill(4, size, &mut longer);
            let shifted = tbrdma_proto::wire::crc_algebra::crc32c(&longer[16..]);
            assert_eq!(crc(4, size, 2), shifted);
        }
        assert_ne!(crc(4, 4096, 0), crc(5, 4096, 0));
        assert_ne!(crc(4, 4096, 0), crc(4, 4096, 1));
    }

    #[test]
    fn probes_find_a_misplaced_or_missing_datagram_and_the_last_word() {
        let size = 200_003;
        let (_dev, mr) = region(size + 64);
        let good = make(3, size);
        mr.write(64, &good);
        assert_eq!(first_probe_mismatch_in(&mr, 64, 3, size, 0), None);
        // A datagram that was never placed: its range still holds another iteration's bytes.
        mr.write(64 + 65_536, &make(4, size)[65_536..131_072]);
        // (Reported at the first byte that differs, inside the first word probed in it.)
        let word = |at: Option<usize>| at.map(|byte| byte / 8 * 8);
        assert_eq!(
            word(first_probe_mismatch_in(&mr, 64, 3, size, 0)),
            Some(65_536)
        );
        // A datagram placed one payload too far.
        mr.write(64, &good);
        mr.write(64 + 131_072, &good[65_536..131_072]);
        assert_eq!(
            word(first_probe_mismatch_in(&mr, 64, 3, size, 0)),
            Some(131_072)
        );
        // The message's last byte is probed.
        mr.write(64, &good);
        mr.write(64 + size - 1, &[good[size - 1] ^ 1]);
        assert_eq!(first_probe_mismatch_in(&mr, 64, 3, size, 0), Some(size - 1));
        for tiny in [1, 7, 8, 13] {
            mr.write(64, &make(3, tiny));
            assert_eq!(first_probe_mismatch_in(&mr, 64, 3, tiny, 0), None, "{tiny}");
            mr.write(64 + tiny - 1, &[make(3, tiny)[tiny - 1] ^ 0x80]);
            assert_eq!(first_probe_mismatch_in(&mr, 64, 3, tiny, 0), Some(tiny - 1));
        }
    }
}
