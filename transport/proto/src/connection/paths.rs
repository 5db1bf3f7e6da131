//! Rails: the links (paths) one connection may use when two hosts are joined by several
//! cables. The engine tells the core how many there are and on which one each datagram
//! arrived; the core says on which one each datagram leaves.
//!
//! Policy: the packets of a multi-packet message are striped round-robin (by PSN) over the
//! paths that are up; everything else takes the first path that is up. A retransmission
//! timeout marks down the path the oldest unacknowledged packet last went out on (never the
//! last one up), so the retransmission and what follows go over the others. Which path that
//! was is recorded when it is sent ([`SentOn`]): the up-set may have changed since, and
//! recomputing the path from the PSN would then blame a rail that never carried it (a
//! random loss on the live rail, while another rail was pulled, once made the connection
//! blame the live rail again and again until it gave up). A path that is down is probed with a
//! keep-alive every [`crate::Config::path_probe_interval`]; the peer answers on the path the probe came in on, and any
//! datagram that arrives on a path marks it up again. The earliest probe due is the connection's
//! [`Timer::PathProbe`], which the methods that change it keep up to date.

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
    /// Times a path was declared down.
    pub failovers: u64,
    /// How often a path that is down is probed.
    probe_interval: Duration,
    /// The path each unacknowledged sequenced packet last went out on.
    sent_on: SentOn,
}

/// The path of each sequenced packet from the oldest unacknowledged one to the newest sent:
/// one entry per packet in flight, so bounded by the window the sender honours.
#[derive(Debug, Default)]
struct SentOn {
    /// PSN of the first entry.
    base: Psn,
    paths: VecDeque<u16>,
}

impl SentOn {
    /// Drops the entries of packets before `snd_una` (acknowledged).
    fn trim(&mut self, snd_una: Psn) {
        let acked = snd_una.diff(self.base);
        if acked < 0 || acked as usize >= self.paths.len() {
            // Everything acknowledged (or a base from before a reset): start afresh.
            self.paths.clear();
            self.base = snd_una;
            return;
        }
        self.paths.drain(..acked as usize);
        self.base = snd_una;
    }

    fn record(&mut self, psn: Psn, path: u16, snd_una: Psn) {
        self.trim(snd_una);
        let Ok(index) = usize::try_from(psn.diff(self.base)) else {
            return;
        };
        if let Some(slot) = self.paths.get_mut(index) {
            *slot = path;
        } else if index == self.paths.len() {
            // The usual case: the next PSN, sent for the first time.
            self.paths.push_back(path);
        } else {
            // PSNs go out in order the first time, so this is the next one; should a gap
            // ever appear, its packets are counted as sent on this path too.
            self.paths.resize(index + 1, path);
        }
    }

    fn get(&self, psn: Psn) -> Option<usize> {
        let index = usize::try_from(psn.diff(self.base)).ok()?;
        self.paths.get(index).map(|&p| usize::from(p))
    }
}

impl Paths {
    pub fn new(probe_interval: Duration) -> Paths {
        Paths {
            up: vec![true],
            next_probe: vec![Time::ZERO],
            sent: vec![0],
            failovers: 0,
            probe_interval,
            sent_on: SentOn::default(),
        }
    }

    pub fn set_count(&mut self, n: usize, timers: &mut TimerTable) {
        let n = n.max(1);
        self.up = vec![true; n];
        self.next_probe = vec![Time::ZERO; n];
        self.sent = vec![0; n];
        self.rearm(timers);
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

    /// The path for the packet at `psn` (`striped`: whether it belongs to a multi-packet
    /// message, asked only when several paths are up).
    pub fn for_packet(&self, psn: Psn, striped: impl FnOnce() -> bool) -> usize {
        if self.up.len() == 1 {
            return 0;
        }
        let ups = self.up_count();
        if ups <= 1 || !striped() {
            return self.primary();
        }
        let nth = psn.0 as usize % ups;
        self.up
            .iter()
            .enumerate()
            .filter(|(_, u)| **u)
            .nth(nth)
            .map_or(0, |(i, _)| i)
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
        self.sent_on.record(psn, path, snd_una);
    }

    /// The path the sequenced packet `psn` last went out on, if it is still unacknowledged
    /// and was sent (never known with a single path: see `record_sent`).
    pub fn sent_path(&self, psn: Psn) -> Option<usize> {
        self.sent_on.get(psn)
    }

    /// Forgets every packet's path (nothing is outstanding any more).
    pub fn forget_sent(&mut self) {
        self.sent_on = SentOn::default();
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
