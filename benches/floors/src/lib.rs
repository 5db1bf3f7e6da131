//! The floors a tbrdma ping-pong is judged against, and the schedule that judges it (issue 16).
//!
//! A floor is the cheapest ping-pong the kernel allows on the same cable with no protocol on
//! it, busy-polled both ways:
//! - [`udp`]: nonblocking UDP sockets, the floor of the sockets and io_uring engines;
//! - [`frames`]: raw Ethernet frames over `AF_PACKET`, received through the packet engine's own
//!   ring, the floor of the packet engine.
//!
//! Bulk transfer has a baseline rather than a floor: one TCP stream ([`tcp`]), what `iperf3`
//! measures.
//!
//! [`pairing`] runs a tbrdma ping-pong and its floor in turn, in blocks, in the same two
//! processes, and judges each block of the engine against the floor blocks beside it.
//!
//! `linkbench`, `tbrdma pingpong --paired-with` and `tbrdma bw --paired-with` use this crate,
//! so that the tools users run and the benchmark measure the same baselines the same way.

pub mod frames;
pub mod pairing;
pub mod tcp;
pub mod udp;

use std::time::{Duration, Instant};

use anyhow::bail;

/// Longest a ping-pong may go without progress before it fails.
pub const STALL: Duration = Duration::from_secs(10);

/// Fails when `since` is longer ago than [`STALL`].
pub fn check_stall(since: Instant, what: &str) -> anyhow::Result<()> {
    if since.elapsed() > STALL {
        bail!("no progress for {STALL:?} while {what}");
    }
    Ok(())
}

/// Bytes the last datagram of a floor's message of several carries at least: an Ethernet
/// frame shorter than 64 bytes is padded, and 64 leave room for its numbers.
const MIN_LAST_DATAGRAM: usize = 64;

/// How a floor cuts a message of `size` bytes into datagrams of at most `max`: as few as carry
/// it (whole ones, then the rest), as an engine must, the last one at least
/// [`MIN_LAST_DATAGRAM`] bytes (taken from the one before it). A message that fits is one
/// datagram.
pub fn datagram_lengths(size: usize, max: usize) -> Vec<usize> {
    if size <= max {
        return vec![size];
    }
    let mut lengths = vec![max; size / max];
    let rest = size % max;
    if rest > 0 {
        let last = rest.max(MIN_LAST_DATAGRAM);
        if let Some(before) = lengths.last_mut() {
            *before -= last - rest;
        }
        lengths.push(last);
    }
    lengths
}

#[cfg(test)]
mod tests {
    use super::datagram_lengths;

    #[test]
    fn a_floor_message_is_cut_into_the_fewest_datagrams_that_carry_it() {
        assert_eq!(datagram_lengths(8, 65_507), [8]);
        assert_eq!(datagram_lengths(65_507, 65_507), [65_507]);
        assert_eq!(datagram_lengths(65_536, 65_507), [65_472, 64]);
        assert_eq!(datagram_lengths(131_014, 65_507), [65_507, 65_507]);
        assert_eq!(
            datagram_lengths(200_000, 65_507),
            [65_507, 65_507, 65_507, 3_479]
        );
        for size in [65_508, 65_570, 65_571, 100_000, 262_144] {
            let lengths = datagram_lengths(size, 65_507);
            assert_eq!(lengths.iter().sum::<usize>(), size);
            assert_eq!(lengths.len(), size.div_ceil(65_507));
            assert!(
                lengths.iter().all(|&l| (64..=65_507).contains(&l)),
                "{lengths:?}"
            );
        }
    }
}
