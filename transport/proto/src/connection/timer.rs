//! The connection's deadlines as data: one [`Timer`] per kind of deadline, one [`TimerTable`]
//! holding when each is due (or that it is stopped).
//!
//! Whoever arms or stops a deadline writes it here and nowhere else, so
//! [`super::Connection::poll_timeout`] is the earliest entry of the table and
//! [`super::Connection::handle_timeout`] a loop over the expired entries, each with one handler.
//! The durations themselves come from [`crate::Config`].

use crate::time::Time;

/// A kind of deadline. The order of the variants is the order in which
/// [`super::Connection::handle_timeout`] handles the ones that expired together: the idle
/// timeout first (a silent peer fails the connection, nothing else matters then), the
/// outgoing stream's timers next, the probes after them, the acknowledgement hold last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Timer {
    /// Connecting: the active side resends CONNECT (with backoff) when it fires; the passive
    /// side gives up waiting for CONNECT.
    Handshake = 0,
    /// Established: nothing heard from the peer for [`crate::Config::idle_timeout`].
    Idle = 1,
    /// The receiver-not-ready pause ends: the NAKed message may be sent again. The transmit
    /// pass that resumes sending stops it, so its handler has nothing to do.
    RnrResume = 2,
    /// The retransmission timeout of the outgoing stream (with exponential backoff).
    Retransmit = 3,
    /// A path (rail) that is down is due for a probe.
    PathProbe = 4,
    /// Nothing outstanding and nothing heard for [`crate::Config::keepalive_interval`]: send a
    /// keep-alive. Runs only while neither [`Timer::Retransmit`] nor [`Timer::RnrResume`] does
    /// (those already test the peer's liveness).
    KeepAlive = 5,
    /// An acknowledgement is pending and due: at once ([`Time::ZERO`], the earliest time there
    /// is), or at the end of its hold (see [`crate::Config::ack_hold`]), when it stops waiting
    /// for a reply to carry it. Stopped when the ACK goes out or is carried by another packet;
    /// the transmit pass sends it, so its handler has nothing to do.
    Ack = 6,
    /// Unacknowledged packets and nothing heard for the probe timeout (well before the
    /// retransmission timeout): the last of them goes again, once per flight, to ask for an
    /// acknowledgement (a tail loss probe; see `tx.rs`).
    TailProbe = 7,
}

impl Timer {
    /// Every timer, in handling order.
    pub const ALL: [Timer; 8] = [
        Timer::Handshake,
        Timer::Idle,
        Timer::RnrResume,
        Timer::Retransmit,
        Timer::PathProbe,
        Timer::KeepAlive,
        Timer::Ack,
        Timer::TailProbe,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// When each [`Timer`] is due; `None` when it is stopped.
/// Deadlines in nanoseconds, [`NOT_SET`] for a timer that is not running: the earliest is
/// looked up after every datagram, and a minimum over plain integers is a few instructions
/// where one over `Option<Time>` was some fifty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TimerTable {
    due: [u64; Timer::ALL.len()],
}

/// The entry of a timer that is not running. A deadline that far out (584 years) is kept one
/// nanosecond earlier.
const NOT_SET: u64 = u64::MAX;

impl Default for TimerTable {
    fn default() -> TimerTable {
        TimerTable {
            due: [NOT_SET; Timer::ALL.len()],
        }
    }
}

impl TimerTable {
    pub fn set(&mut self, timer: Timer, at: Time) {
        self.due[timer.index()] = at.as_nanos().min(NOT_SET - 1);
    }

    pub fn set_or_stop(&mut self, timer: Timer, at: Option<Time>) {
        match at {
            Some(at) => self.set(timer, at),
            None => self.stop(timer),
        }
    }

    pub fn stop(&mut self, timer: Timer) {
        self.due[timer.index()] = NOT_SET;
    }

    pub fn stop_all(&mut self) {
        self.due = [NOT_SET; Timer::ALL.len()];
    }

    pub fn get(&self, timer: Timer) -> Option<Time> {
        let at = self.due[timer.index()];
        (at != NOT_SET).then_some(Time(at))
    }

    pub fn is_set(&self, timer: Timer) -> bool {
        self.due[timer.index()] != NOT_SET
    }

    pub fn is_expired(&self, timer: Timer, now: Time) -> bool {
        self.get(timer).is_some_and(|at| at <= now)
    }

    pub fn next_timeout(&self) -> Option<Time> {
        let earliest = self.due.iter().copied().min().unwrap_or(NOT_SET);
        (earliest != NOT_SET).then_some(Time(earliest))
    }

    pub fn expired(&self, now: Time) -> Expired {
        Expired {
            table: *self,
            now,
            next: 0,
        }
    }
}

/// Iterator over the timers that were due, from [`TimerTable::expired`].
#[derive(Debug)]
pub(super) struct Expired {
    table: TimerTable,
    now: Time,
    next: usize,
}

impl Iterator for Expired {
    type Item = Timer;

    fn next(&mut self) -> Option<Timer> {
        while let Some(&timer) = Timer::ALL.get(self.next) {
            self.next += 1;
            if self.table.is_expired(timer, self.now) {
                return Some(timer);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_timer_has_its_own_slot_in_handling_order() {
        for (i, timer) in Timer::ALL.iter().enumerate() {
            assert_eq!(timer.index(), i);
        }
    }

    #[test]
    fn the_next_timeout_is_the_earliest_running_entry() {
        let mut table = TimerTable::default();
        assert_eq!(table.next_timeout(), None);
        table.set(Timer::KeepAlive, Time(500));
        table.set(Timer::Idle, Time(3000));
        table.set(Timer::Retransmit, Time(20));
        assert_eq!(table.next_timeout(), Some(Time(20)));
        // Setting again replaces, even with a later time.
        table.set(Timer::Retransmit, Time(900));
        assert_eq!(table.next_timeout(), Some(Time(500)));
        assert_eq!(table.get(Timer::Retransmit), Some(Time(900)));
    }

    #[test]
    fn a_stopped_timer_no_longer_counts() {
        let mut table = TimerTable::default();
        table.set(Timer::Ack, Time(5));
        table.set(Timer::Idle, Time(10));
        table.stop(Timer::Ack);
        assert!(!table.is_set(Timer::Ack));
        assert_eq!(table.next_timeout(), Some(Time(10)));
        assert_eq!(table.expired(Time(7)).count(), 0);
        table.set_or_stop(Timer::Idle, None);
        assert_eq!(table.next_timeout(), None);
        table.set_or_stop(Timer::PathProbe, Some(Time(1)));
        table.set(Timer::Handshake, Time(2));
        table.stop_all();
        assert_eq!(table, TimerTable::default());
    }

    #[test]
    fn expired_timers_come_in_handling_order_not_deadline_order() {
        let mut table = TimerTable::default();
        table.set(Timer::Ack, Time(1));
        table.set(Timer::KeepAlive, Time(2));
        table.set(Timer::Idle, Time(3));
        table.set(Timer::Retransmit, Time(4));
        table.set(Timer::PathProbe, Time(100));
        let expired: Vec<Timer> = table.expired(Time(4)).collect();
        assert_eq!(
            expired,
            [Timer::Idle, Timer::Retransmit, Timer::KeepAlive, Timer::Ack]
        );
        // A deadline equal to `now` is due; a later one is not.
        assert!(table.is_expired(Timer::Retransmit, Time(4)));
        assert!(!table.is_expired(Timer::PathProbe, Time(99)));
    }

    #[test]
    fn the_expired_iterator_is_a_snapshot_the_handlers_may_change() {
        let mut table = TimerTable::default();
        table.set(Timer::Idle, Time(1));
        table.set(Timer::KeepAlive, Time(1));
        let mut handled = Vec::new();
        for timer in table.expired(Time(1)) {
            if !table.is_expired(timer, Time(1)) {
                continue;
            }
            handled.push(timer);
            // The first handler ends everything (as a failing connection does).
            table.stop_all();
        }
        assert_eq!(handled, [Timer::Idle]);
    }
}
