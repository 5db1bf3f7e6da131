//! Rails: the links (paths) one connection may use when two hosts are joined by several
//! cables. The engine tells the core how many there are and on which one each datagram
//! arrived; the core says on which one each datagram leaves.
//!
//! Policy: each packet of a multi-packet message goes on the path that is up and has carried the
//! fewest bytes so far; everything else takes the first path that is up. (Round-robin by PSN
//! put every message of two packets, a full one and a short tail, wholly on one path: 64 KiB
//! WRITEs over two cables carried less than one cable.) A retransmission
//! timeout marks down the path the oldest unacknowledged packet last went out on (never the
//! last one up), so the retransmission and what follows go over the others. Which path that
//! was is recorded when it is sent ([`SentOn`]): the up-set may have changed since, and
//! recomputing the path from the PSN would then blame a rail that never carried it (a
//! random loss on the live rail, while another rail was pulled, once made the connection
//! blame the live rail again and again until it gave up). A path that is down is probed with a
//! keep-alive every [`crate::Config::path_probe_interval`]; the peer answers on the path the probe came in on, and any
//! datagram that arrives on a path marks it up again. The earliest probe due is the connection's
//! [`Timer::PathProbe`], which the methods that change it keep up to date.
//!
//! Loss or reordering: each cable delivers in the order it was given, but two cables do not
//! keep pace with each other (a queue in front of one, a slower one), so a receiver sees gaps
//! that the other cable fills a moment later. A packet is presumed lost only when one sent
//! after it on the same path has arrived ([`Paths::presumed_lost`], RACK's rule with the
//! path's own order); the sender ignores a receiver's gap report (NAK) until then, and resends
//! only the packets so presumed. Over two cables emulated at 8 Gbit/s each, answering every
//! NAK made the sender resend a fifth to a quarter of a bulk transfer (docs/performance.md,
//! "Cables slower than the host").

use std::collections::VecDeque;
use std::time::Duration;

use super::timer::{Timer, TimerTable};
use crate::hint::cold_path;
use crate::seq::Psn;
use crate::time::Time;

#[derive(Debug)]
pub(super) struct Paths {
    up: Vec<bool>,
    next_probe: Vec<Time>,
    /// Datagrams sent per path.
    pub sent: Vec<u64>,
    /// Bytes of sequenced packets sent per path (what striping balances).
    bytes: Vec<u64>,
    /// Times a path was declared down.
    pub failovers: u64,
    /// How often a path that is down is probed.
    probe_interval: Duration,
    /// The path each unacknowledged sequenced packet last went out on.
    sent_on: SentOn,
    /// Per path, one more than the highest transmission number ([`Sent::order`]) known to
    /// have arrived (0: none yet): everything sent on the path before it has arrived or is
    /// lost, since a path delivers in order.
    delivered: Vec<u64>,
}

/// One transmission of a sequenced packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sent {
    path: u16,
    /// The connection's count of sequenced transmissions when it went: orders the
    /// transmissions on each path, resends included (a PSN's does not).
    order: u64,
    /// Whether the packet went before: then an acknowledgement of it may be for an earlier
    /// transmission, on another path or earlier on this one, and says nothing of what this
    /// one's path delivered (Karn's ambiguity). Counting it as this transmission's arrival
    /// once made a tail probe, resent on the slower of two rails, presume the packets ahead
    /// of it on that rail lost while they were on their way: 596 needless resends of 256
    /// packets in the simulator.
    resent: bool,
}

/// The last transmission of each sequenced packet from the oldest unacknowledged one to the
/// newest sent: one entry per packet in flight, so bounded by the window the sender honours.
#[derive(Debug, Default)]
struct SentOn {
    /// PSN of the first entry.
    base: Psn,
    sent: VecDeque<Sent>,
    /// Transmissions recorded so far.
    transmissions: u64,
}

impl SentOn {
    /// Drops the entries of packets before `snd_una` (acknowledged), counting each as
    /// arrived on its path in `delivered`.
    fn trim(&mut self, snd_una: Psn, delivered: &mut [u64]) {
        let acked = snd_una.diff(self.base);
        if acked <= 0 {
            if acked < 0 {
                // A base from before a reset: start afresh.
                self.sent.clear();
                self.base = snd_una;
            }
            return;
        }
        let acked = (acked as usize).min(self.sent.len());
        for s in self.sent.drain(..acked) {
            arrived(delivered, s);
        }
        self.base = snd_una;
    }

    fn record(&mut self, psn: Psn, path: u16, snd_una: Psn, delivered: &mut [u64]) {
        self.trim(snd_una, delivered);
        let Ok(index) = usize::try_from(psn.diff(self.base)) else {
            return;
        };
        let sent = Sent {
            path,
            order: self.transmissions,
            resent: false,
        };
        self.transmissions += 1;
        if let Some(slot) = self.sent.get_mut(index) {
            *slot = Sent {
                resent: true,
                ..sent
            };
        } else if index == self.sent.len() {
            // The usual case: the next PSN, sent for the first time.
            self.sent.push_back(sent);
        } else {
            // PSNs go out in order the first time, so this is the next one; should a gap
            // ever appear, its packets are counted as sent now on this path too.
            self.sent.resize(index + 1, sent);
        }
    }

    fn get(&self, psn: Psn) -> Option<Sent> {
        let index = usize::try_from(psn.diff(self.base)).ok()?;
        self.sent.get(index).copied()
    }
}

/// Counts transmission `s` as arrived, unless it was a resend (whichever transmission
/// arrived, it shows nothing certain about `s`'s path).
fn arrived(delivered: &mut [u64], s: Sent) {
    if s.resent {
        return;
    }
    if let Some(d) = delivered.get_mut(usize::from(s.path)) {
        *d = (*d).max(s.order + 1);
    }
}

impl Paths {
    pub fn new(probe_interval: Duration) -> Paths {
        Paths {
            up: vec![true],
            next_probe: vec![Time::ZERO],
            sent: vec![0],
            bytes: vec![0],
            failovers: 0,
            probe_interval,
            sent_on: SentOn::default(),
            delivered: vec![0],
        }
    }

    pub fn set_count(&mut self, n: usize, timers: &mut TimerTable) {
        let n = n.max(1);
        self.up = vec![true; n];
        self.next_probe = vec![Time::ZERO; n];
        self.sent = vec![0; n];
        self.bytes = vec![0; n];
        self.delivered = vec![0; n];
        self.rearm(timers);
    }

    /// Whether there is more than one path (only then is anything recorded per packet).
    pub fn several(&self) -> bool {
        self.up.len() > 1
    }

    pub fn count(&self) -> usize {
        self.up.len()
    }

    pub fn is_up(&self, path: usize) -> bool {
        self.up.get(path).copied().unwrap_or(false)
    }

    fn up_count(&self) -> usize {
        self.up.iter().filter(|&&u| u).count()
    }

    /// The path for control packets and single-packet messages.
    pub fn primary(&self) -> usize {
        // (The first path is up unless its cable is out.)
        if self.up.first() == Some(&true) {
            return 0;
        }
        cold_path();
        self.up.iter().position(|&u| u).unwrap_or(0)
    }

    /// The path for a sequenced packet of `len` bytes (`striped`: whether it belongs to a
    /// multi-packet message, asked only when several paths are up), counted as sent on it.
    pub fn for_packet(&mut self, len: usize, striped: impl FnOnce() -> bool) -> usize {
        if self.up.len() == 1 {
            return 0;
        }
        let path = if self.up_count() <= 1 || !striped() {
            self.primary()
        } else {
            // The least loaded path that is up (the first of equals).
            (0..self.up.len())
                .filter(|&p| self.up[p])
                .min_by_key(|&p| self.bytes[p])
                .unwrap_or(0)
        };
        self.bytes[path] = self.bytes[path].wrapping_add(len as u64);
        path
    }

    /// Records that the sequenced packet `psn` went out on `path` (`snd_una`: the oldest
    /// packet not acknowledged, so that acknowledged entries are dropped).
    pub fn record_sent(&mut self, psn: Psn, path: usize, snd_una: Psn) {
        if self.up.len() == 1 {
            // One path: nothing to blame a loss on (`mark_down` keeps the last path up), and
            // keeping the record cost some 40 instructions per packet.
            return;
        }
        let path = u16::try_from(path).unwrap_or(u16::MAX);
        self.sent_on.record(psn, path, snd_una, &mut self.delivered);
    }

    /// The path the sequenced packet `psn` last went out on, if it is still unacknowledged
    /// and was sent (never known with a single path: see `record_sent`).
    pub fn sent_path(&self, psn: Psn) -> Option<usize> {
        self.sent_on.get(psn).map(|s| usize::from(s.path))
    }

    /// The peer acknowledged everything before `snd_una` (several paths only: see
    /// `record_sent`).
    pub fn on_acked(&mut self, snd_una: Psn) {
        self.sent_on.trim(snd_una, &mut self.delivered);
    }

    /// The peer acknowledged the packets from `start` up to `end` selectively.
    pub fn on_sacked(&mut self, start: Psn, end: Psn) {
        let base = self.sent_on.base;
        let mut psn = if start.before(base) { base } else { start };
        // (At most the entries recorded, a window's: none past the newest sent.)
        while psn.before(end) {
            let Some(s) = self.sent_on.get(psn) else {
                break;
            };
            arrived(&mut self.delivered, s);
            psn = psn.plus(1);
        }
    }

    /// Whether the unacknowledged packet `psn` is presumed lost: a packet sent after its last
    /// transmission on the same path has arrived (a path delivers in order). A packet of which
    /// nothing is known (one path, or never sent) is presumed lost, as every gap was before
    /// paths were told apart.
    pub fn presumed_lost(&self, psn: Psn) -> bool {
        match self.sent_on.get(psn) {
            Some(s) => self
                .delivered
                .get(usize::from(s.path))
                .is_some_and(|&d| d > s.order),
            None => true,
        }
    }

    /// Forgets every packet's path (nothing is outstanding any more).
    pub fn forget_sent(&mut self) {
        // (The count goes on: `delivered` compares with it.)
        self.sent_on = SentOn {
            transmissions: self.sent_on.transmissions,
            ..SentOn::default()
        };
    }

    /// Declares `path` down unless it is the last one up; returns whether it did.
    pub fn mark_down(&mut self, path: usize, now: Time, timers: &mut TimerTable) -> bool {
        if self.up_count() <= 1 || !self.is_up(path) {
            return false;
        }
        self.up[path] = false;
        self.next_probe[path] = now + self.probe_interval;
        self.failovers += 1;
        self.rearm(timers);
        true
    }

    pub fn mark_up(&mut self, path: usize, timers: &mut TimerTable) {
        if let Some(u) = self.up.get_mut(path) {
            if !*u {
                *u = true;
                self.rearm(timers);
            }
        }
    }

    /// A path due for a probe at `now`, if any (its next probe is then scheduled).
    pub fn probe_due(&mut self, now: Time, timers: &mut TimerTable) -> Option<usize> {
        let path = (0..self.up.len()).find(|&p| !self.up[p] && self.next_probe[p] <= now)?;
        self.next_probe[path] = now + self.probe_interval;
        self.rearm(timers);
        Some(path)
    }

    /// Sets [`Timer::PathProbe`] to the next probe due, or stops it when every path is up.
    fn rearm(&self, timers: &mut TimerTable) {
        timers.set_or_stop(Timer::PathProbe, self.next_probe());
    }

    /// When the next probe is due.
    fn next_probe(&self) -> Option<Time> {
        (0..self.up.len())
            .filter(|&p| !self.up[p])
            .map(|p| self.next_probe[p])
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striping_balances_bytes_when_messages_are_a_full_packet_and_a_short_tail() {
        let mut timers = TimerTable::default();
        let mut paths = Paths::new(Duration::from_millis(100));
        paths.set_count(2, &mut timers);
        let mut bytes = [0u64; 2];
        // 64 KiB WRITEs: a full datagram and a tail of a hundred bytes each. By PSN parity
        // every full one went on path 0.
        for _ in 0..100 {
            for len in [65_400, 136] {
                bytes[paths.for_packet(len, || true)] += len as u64;
            }
        }
        let (more, less) = (bytes[0].max(bytes[1]), bytes[0].min(bytes[1]));
        assert!(more - less <= 65_400, "bytes per path: {bytes:?}");
        // Single-packet messages stay on the first path.
        assert_eq!(paths.for_packet(100, || false), 0);
    }
}
