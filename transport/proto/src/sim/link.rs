//! A simulated link: two directions of datagrams with seeded loss, duplication, corruption,
//! latency and jitter (which reorders), an MTU, and outages.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand_chacha::ChaCha8Rng;
use rand_core::Rng;

use crate::seq::Psn;
use crate::time::Time;

/// Fault and delay model of the link (both directions alike).
#[derive(Clone, Debug, PartialEq)]
pub struct LinkConfig {
    /// One-way delay of every datagram.
    pub latency: Duration,
    /// Extra delay drawn uniformly from zero to this; a non-zero jitter reorders datagrams.
    pub jitter: Duration,
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// Probability that a datagram arrives twice.
    pub duplicate: f64,
    /// Probability that a datagram arrives with bytes changed.
    pub corrupt: f64,
    /// Datagrams longer than this are dropped, as an interface drops what exceeds its MTU.
    pub mtu: usize,
    /// Bytes per second each direction carries; datagrams queue behind each other (`None`:
    /// unlimited).
    pub bandwidth: Option<u64>,
    /// Periods during which everything sent is lost: `(from, until)`, `until = None` for good.
    pub outages: Vec<(Time, Option<Time>)>,
}

impl Default for LinkConfig {
    /// A perfect 10 Gbit/s link with a 5 µs one-way delay, like one thunderbolt-net cable.
    fn default() -> Self {
        LinkConfig {
            latency: Duration::from_micros(5),
            jitter: Duration::ZERO,
            loss: 0.0,
            duplicate: 0.0,
            corrupt: 0.0,
            mtu: 65535,
            bandwidth: Some(10_000_000_000 / 8),
            outages: Vec::new(),
        }
    }
}

impl LinkConfig {
    /// Whether the link is down at `now`.
    pub fn is_down(&self, now: Time) -> bool {
        self.outages
            .iter()
            .any(|&(from, until)| now >= from && until.is_none_or(|u| now < u))
    }
}

/// What the link did, for reports and assertions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Datagrams offered to the link.
    pub sent: u64,
    /// Datagrams delivered (duplicates included).
    pub delivered: u64,
    /// Lost at random.
    pub lost: u64,
    /// Lost because the link was down.
    pub lost_in_outage: u64,
    /// Dropped for exceeding the MTU.
    pub oversized: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Delivered with bytes changed.
    pub corrupted: u64,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    arrival: Time,
    seq: u64,
    to_b: bool,
    bytes: Vec<u8>,
}

/// Datagrams in flight between endpoints `a` and `b`.
#[derive(Debug)]
pub(super) struct Link {
    pub config: LinkConfig,
    pub stats: LinkStats,
    rng: ChaCha8Rng,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    /// When each direction's transmitter is free again (index: `to_b as usize`).
    busy_until: [Time; 2],
}

impl Link {
    pub fn new(config: LinkConfig, rng: ChaCha8Rng) -> Link {
        Link {
            config,
            stats: LinkStats::default(),
            rng,
            queue: BinaryHeap::new(),
            seq: 0,
            busy_until: [Time::ZERO; 2],
        }
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// Offers a datagram sent at `now` in one direction.
    pub fn send(&mut self, now: Time, to_b: bool, datagram: &[u8]) {
        self.stats.sent += 1;
        if self.config.is_down(now) {
            self.stats.lost_in_outage += 1;
            return;
        }
        if datagram.len() > self.config.mtu {
            self.stats.oversized += 1;
            return;
        }
        if self.chance(self.config.loss) {
            self.stats.lost += 1;
            return;
        }
        // Serialisation: the datagram leaves after those queued before it.
        let mut departure = now;
        if let Some(bandwidth) = self.config.bandwidth {
            let start = now.max(self.busy_until[to_b as usize]);
            let wire_time =
                Duration::from_nanos(datagram.len() as u64 * 1_000_000_000 / bandwidth.max(1));
            self.busy_until[to_b as usize] = start + wire_time;
            departure = start + wire_time;
        }
        let copies = if self.chance(self.config.duplicate) {
            2
        } else {
            1
        };
        for copy in 0..copies {
            let mut bytes = datagram.to_vec();
            if self.chance(self.config.corrupt) && !bytes.is_empty() {
                let flips = 1 + self.rng.next_u32() % 3;
                for _ in 0..flips {
                    let at = self.rng.next_u32() as usize % bytes.len();
                    bytes[at] ^= 1 << (self.rng.next_u32() % 8);
                }
                self.stats.corrupted += 1;
            }
            let jitter_ns = self.config.jitter.as_nanos() as u64;
            let extra = if jitter_ns == 0 {
                0
            } else {
                self.rng.next_u64() % (jitter_ns + 1)
            };
            let arrival = departure + self.config.latency + Duration::from_nanos(extra);
            if copy == 1 {
                self.stats.duplicated += 1;
            }
            self.seq += 1;
            self.queue.push(Reverse(InFlight {
                arrival,
                seq: self.seq,
                to_b,
                bytes,
            }));
        }
    }

    /// Arrival time of the next datagram.
    pub fn next_arrival(&self) -> Option<Time> {
        self.queue.peek().map(|Reverse(f)| f.arrival)
    }

    /// The next datagram due by `now`: `(to_b, bytes)`.
    pub fn pop_due(&mut self, now: Time) -> Option<(bool, Vec<u8>)> {
        if self.next_arrival()? > now {
            return None;
        }
        let Reverse(f) = self.queue.pop()?;
        self.stats.delivered += 1;
        Some((f.to_b, f.bytes))
    }

    /// The PSNs of the sequenced packets in flight one way (a resent packet whose original is
    /// still on the way counts once: it takes no more of the receiver's window).
    pub fn psns_in_flight_towards(&self, to_b: bool) -> impl Iterator<Item = Psn> + '_ {
        self.queue
            .iter()
            .filter(move |Reverse(f)| f.to_b == to_b && f.bytes.get(3).is_some_and(|&op| op < 0x10))
            .filter_map(|Reverse(f)| crate::wire::decode(&f.bytes).ok())
            .map(|packet| packet.header.psn)
    }

    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
}
