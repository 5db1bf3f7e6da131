//! Packet sequence numbers: 32-bit counters compared in serial-number arithmetic (RFC 1982), so
//! that a long-lived connection wraps around without confusing old packets with new ones.

use std::cmp::Ordering;
use std::fmt;

/// A packet sequence number in one direction of a connection.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(pub u32);

impl Psn {
    /// The sequence number `n` packets later.
    pub fn plus(self, n: u32) -> Psn {
        Psn(self.0.wrapping_add(n))
    }

    /// The sequence number `n` packets earlier.
    pub fn minus(self, n: u32) -> Psn {
        Psn(self.0.wrapping_sub(n))
    }

    /// Signed distance from `other` to `self` (positive when `self` is later).
    pub fn diff(self, other: Psn) -> i32 {
        self.0.wrapping_sub(other.0) as i32
    }

    /// Whether `self` comes strictly before `other`.
    pub fn before(self, other: Psn) -> bool {
        self.diff(other) < 0
    }

    /// Number of packets from `start` (inclusive) to `self` (exclusive); `self` must not be
    /// before `start`.
    pub fn distance_from(self, start: Psn) -> u32 {
        self.0.wrapping_sub(start.0)
    }
}

impl PartialOrd for Psn {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Psn {
    /// Serial-number order: valid while the two numbers are less than 2^31 apart, which the
    /// window limit guarantees for every pair the protocol compares.
    fn cmp(&self, other: &Self) -> Ordering {
        self.diff(*other).cmp(&0)
    }
}

impl fmt::Debug for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "psn{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_survives_wraparound() {
        let near_end = Psn(u32::MAX - 1);
        let wrapped = near_end.plus(5);
        assert_eq!(wrapped, Psn(3));
        assert!(near_end < wrapped);
        assert_eq!(wrapped.diff(near_end), 5);
        assert_eq!(wrapped.distance_from(near_end), 5);
    }
}
