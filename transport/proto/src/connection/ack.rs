//! The acknowledgement policy: when this side acknowledges what it received.
//!
//! Every packet a side sends carries its cumulative acknowledgement, so a separate ACK packet
//! is needed only when nothing of this side's own is about to go out. The policy:
//!
//! - **at once** after [`crate::Config::ack_every`] packets accepted since the last
//!   acknowledgement, for a duplicate, for a packet placed ahead of a gap or held early (the
//!   ACK's selective blocks tell the sender what not to resend), and for a keep-alive (the
//!   answer goes back on the path the probe came in on);
//! - **deferrable** for the last packet of a message (it asks for an acknowledgement): the ACK
//!   may wait up to [`crate::Config::ack_hold`] for a reply of this side to carry it, which
//!   saves a datagram each way per ping-pong. The engine may end a hold early
//!   ([`super::Connection::release_held_ack`]);
//! - whatever is pending is settled by the next sequenced packet this side sends, unless the
//!   receive stream holds packets beyond a gap, which only an ACK's selective blocks can report.
//!
//! This module decides *when*; the receive stream (`rx.rs`) says *what* the ACK reports (the
//! next expected PSN and the selective blocks). The deadline lives in the connection's timer
//! table as [`Timer::Ack`]: due at once ([`Time::ZERO`]) or at the end of the hold.

use std::time::Duration;

use super::timer::{Timer, TimerTable};
use crate::config::Config;
use crate::time::Time;
use crate::wire::FLAG_ACK_REQUEST;

/// What is pending.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pending {
    /// Nothing to acknowledge.
    Nothing,
    /// An ACK is due at the next transmit pass.
    Due,
    /// An ACK that only answers a message's last packet: it may wait for a reply to carry it.
    Deferrable,
}

/// When this side acknowledges. See the module documentation.
#[derive(Debug)]
pub(super) struct AckPolicy {
    pending: Pending,
    /// Whether the pending ACK was given its hold (or had it released). A hold is given once,
    /// when the input that made a deferrable ACK pending has been processed; an ACK made due at
    /// once afterwards keeps the hold's deadline in the table until it is sent.
    hold_given: bool,
    /// Packets accepted since the last acknowledgement.
    since_ack: u32,
    /// The path on which a keep-alive probe arrived: the ACK answering it goes back there.
    reply_path: Option<usize>,
    every: u32,
    hold: Duration,
}

impl AckPolicy {
    pub fn new(config: &Config) -> AckPolicy {
        AckPolicy {
            pending: Pending::Nothing,
            hold_given: false,
            since_ack: 0,
            reply_path: None,
            every: config.ack_every,
            hold: config.ack_hold,
        }
    }

    /// Whether an acknowledgement is pending.
    pub fn is_pending(&self) -> bool {
        self.pending != Pending::Nothing
    }

    /// Whether the pending ACK waits for a reply to carry it, its hold not yet released.
    pub fn is_held(&self) -> bool {
        self.pending == Pending::Deferrable && self.hold_given
    }

    /// Whether the pending ACK may still wait at `now` (its hold has not ended).
    pub fn waits_at(&self, now: Time, timers: &TimerTable) -> bool {
        self.pending == Pending::Deferrable && timers.get(Timer::Ack).is_some_and(|t| now < t)
    }

    /// Acknowledge at the next transmit pass.
    pub fn ack_now(&mut self) {
        self.pending = Pending::Due;
    }

    /// A keep-alive probe arrived on `path`: answer it there, at once.
    pub fn answer_probe(&mut self, path: usize) {
        self.ack_now();
        self.reply_path = Some(path);
    }

    /// A message completed: acknowledge it, after a hold in which a reply of ours may carry the
    /// acknowledgement instead (unless something urgent is already pending).
    pub fn ack_deferrable(&mut self) {
        if self.pending == Pending::Nothing {
            self.pending = Pending::Deferrable;
        }
    }

    /// A sequenced packet (`flags` from its header) was accepted.
    pub fn on_accepted(&mut self, flags: u16) {
        self.since_ack += 1;
        if self.since_ack >= self.every {
            self.ack_now();
        } else if flags & FLAG_ACK_REQUEST != 0 {
            self.ack_deferrable();
        }
    }

    /// Sets [`Timer::Ack`] after an input was processed (received at `now`): a deferrable ACK
    /// gets its hold, an ACK due at once is due at [`Time::ZERO`].
    pub fn arm(&mut self, now: Time, timers: &mut TimerTable) {
        match self.pending {
            Pending::Nothing => self.settled(timers),
            Pending::Deferrable if !self.hold_given => {
                timers.set(Timer::Ack, now + self.hold);
                self.hold_given = true;
            }
            _ if !self.hold_given => timers.set(Timer::Ack, Time::ZERO),
            _ => {}
        }
    }

    /// Ends the hold of a held ACK: it is due at once.
    pub fn release(&mut self, timers: &mut TimerTable) {
        if self.is_held() {
            self.pending = Pending::Due;
            timers.set(Timer::Ack, Time::ZERO);
        }
    }

    /// The path the next ACK must leave on, if it answers a probe.
    pub fn take_reply_path(&mut self) -> Option<usize> {
        self.reply_path.take()
    }

    /// An ACK went out: nothing is pending.
    pub fn on_ack_sent(&mut self, timers: &mut TimerTable) {
        self.pending = Pending::Nothing;
        self.since_ack = 0;
        self.settled(timers);
    }

    /// A sequenced packet of ours carried the cumulative acknowledgement; `has_sacks`: the
    /// receive stream holds packets beyond a gap, which still need an ACK to report them.
    pub fn on_piggybacked(&mut self, has_sacks: bool, timers: &mut TimerTable) {
        if !has_sacks {
            self.on_ack_sent(timers);
        }
    }

    /// The connection failed or closed: nothing more is acknowledged.
    pub fn clear(&mut self) {
        self.pending = Pending::Nothing;
    }

    fn settled(&mut self, timers: &mut TimerTable) {
        timers.stop(Timer::Ack);
        self.hold_given = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(every: u32, hold_us: u64) -> AckPolicy {
        AckPolicy::new(&Config {
            ack_every: every,
            ack_hold: Duration::from_micros(hold_us),
            ..Config::default()
        })
    }

    #[test]
    fn a_message_end_is_held_until_the_hold_ends_or_is_released() {
        let mut ack = policy(16, 50);
        let mut timers = TimerTable::default();
        ack.on_accepted(FLAG_ACK_REQUEST);
        ack.arm(Time(1_000), &mut timers);
        assert!(ack.is_held());
        assert_eq!(timers.get(Timer::Ack), Some(Time(51_000)));
        assert!(ack.waits_at(Time(50_999), &timers));
        assert!(!ack.waits_at(Time(51_000), &timers));
        ack.release(&mut timers);
        assert!(!ack.is_held() && ack.is_pending());
        assert_eq!(timers.get(Timer::Ack), Some(Time::ZERO));
        ack.on_ack_sent(&mut timers);
        assert!(!ack.is_pending());
        assert_eq!(timers.get(Timer::Ack), None);
    }

    #[test]
    fn every_nth_packet_is_acknowledged_at_once() {
        let mut ack = policy(2, 50);
        let mut timers = TimerTable::default();
        ack.on_accepted(0);
        ack.arm(Time(10), &mut timers);
        assert!(!ack.is_pending());
        ack.on_accepted(0);
        ack.arm(Time(20), &mut timers);
        assert!(ack.is_pending() && !ack.is_held());
        assert_eq!(timers.get(Timer::Ack), Some(Time::ZERO));
    }

    #[test]
    fn a_reply_settles_the_ack_unless_selective_blocks_wait() {
        let mut ack = policy(16, 50);
        let mut timers = TimerTable::default();
        ack.ack_now();
        ack.arm(Time(5), &mut timers);
        ack.on_piggybacked(true, &mut timers);
        assert!(ack.is_pending());
        ack.on_piggybacked(false, &mut timers);
        assert!(!ack.is_pending());
        assert_eq!(timers.next_timeout(), None);
    }
}
