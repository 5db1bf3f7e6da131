//! Time as data. The core never reads a clock: every input carries `now`, and deadlines go out
//! as [`Time`] values. The engine maps them onto a monotonic clock; the simulator onto a counter.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time, in nanoseconds since an epoch chosen by the caller.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(pub u64);

impl Time {
    /// The caller's epoch.
    pub const ZERO: Time = Time(0);

    /// Nanoseconds since the caller's epoch.
    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// `nanos` nanoseconds later (saturating): the cheap form of `self + Duration` for code
    /// that keeps its intervals in nanoseconds.
    pub fn after_nanos(self, nanos: u64) -> Time {
        Time(self.0.saturating_add(nanos))
    }

    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// `d` in nanoseconds, saturating at `u64::MAX` (584 years).
pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, rhs: Duration) -> Time {
        self.after_nanos(nanos(rhs))
    }
}

impl Sub<Time> for Time {
    type Output = Duration;
    fn sub(self, rhs: Time) -> Duration {
        self.saturating_since(rhs)
    }
}

impl fmt::Debug for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:06}ms", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}
