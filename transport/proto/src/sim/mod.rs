//! A deterministic network simulator for the protocol core: two endpoints joined by a seeded
//! lossy [`LinkConfig`], driven in simulated time. Every run with the same seed is the same run,
//! and every drive is bounded by a step count, so a protocol bug fails a test instead of
//! hanging it. Used by the core's tests, the fuzz targets, the demo and the benchmarks.

mod link;
mod memory;

use std::time::Duration;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

pub use link::{LinkConfig, LinkStats};
pub use memory::SimMemory;

use crate::config::Config;
use crate::connection::{ConnectParams, Connection, ConnectionState, Event};
use crate::seq::Psn;
use crate::time::Time;
use crate::work::{PostError, RecvWr, SendWr, WorkCompletion};

/// One side of a simulated pair: a connection and its memory.
#[derive(Debug)]
pub struct Endpoint {
    /// The protocol state machine.
    pub conn: Connection,
    /// Its registered memory.
    pub mem: SimMemory,
    /// Every event the connection reported, in order.
    pub events: Vec<Event>,
    completions: Vec<WorkCompletion>,
    buf: Vec<u8>,
}

impl Endpoint {
    /// Posts a send-queue request.
    pub fn post_send(&mut self, wr: SendWr) -> Result<(), PostError> {
        self.conn.post_send(wr, &self.mem).map(|_| ())
    }

    /// Posts a receive.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        self.conn.post_recv(wr)
    }

    /// How many completions were reported and not taken yet (as of the last step).
    pub fn pending_completions(&self) -> usize {
        self.completions.len()
    }

    /// Takes every completion reported so far.
    pub fn take_completions(&mut self) -> Vec<WorkCompletion> {
        self.collect();
        std::mem::take(&mut self.completions)
    }

    fn collect(&mut self) {
        while let Some(wc) = self.conn.poll_completion() {
            self.completions.push(wc);
        }
        while let Some(event) = self.conn.poll_event() {
            self.events.push(event);
        }
    }

    fn is_settled(&self) -> bool {
        matches!(
            self.conn.state(),
            ConnectionState::Error | ConnectionState::Closed
        ) || self.conn.is_idle()
    }
}

/// How to build a simulated pair.
#[derive(Clone, Debug)]
pub struct PairConfig {
    /// Seed for keys, tokens, initial PSNs and every fault.
    pub seed: u64,
    /// Configuration of endpoint `a` (the active side).
    pub config_a: Config,
    /// Configuration of endpoint `b` (the passive side).
    pub config_b: Config,
    /// The link between them.
    pub link: LinkConfig,
}

impl Default for PairConfig {
    fn default() -> Self {
        PairConfig {
            seed: 1,
            config_a: Config::default(),
            config_b: Config::default(),
            link: LinkConfig::default(),
        }
    }
}

/// Two endpoints over a simulated link.
#[derive(Debug)]
pub struct Pair {
    /// The active side.
    pub a: Endpoint,
    /// The passive side.
    pub b: Endpoint,
    /// Simulated time.
    pub now: Time,
    /// One simulated cable per rail; rail 0 carries the handshake.
    links: Vec<link::Link>,
    steps: u64,
    /// Whether the last step put anything on the link.
    sent_last_step: bool,
}

impl Pair {
    /// Builds the pair and runs the handshake (bounded; on a hopeless link the connections end
    /// up failed, which the caller sees in their state).
    pub fn new(config: PairConfig) -> Pair {
        Pair::with_rails(config, 1)
    }

    /// As [`Pair::new`], joined by `rails` independent cables with the same fault model, each
    /// a path of the connections (striping and failover, see `connection/paths.rs`).
    pub fn with_rails(config: PairConfig, rails: usize) -> Pair {
        let rails = rails.max(1);
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
        let token = rng.next_u64();
        // Initial PSNs near the wrap-around point half of the time, so wrapping is exercised.
        let mut initial_psn = || {
            let r = rng.next_u32();
            if r & 1 == 0 {
                Psn(u32::MAX - (r % 4096))
            } else {
                Psn(r)
            }
        };
        let (psn_a, psn_b) = (initial_psn(), initial_psn());
        let now = Time::ZERO;
        let params_a = ConnectParams {
            token,
            local_qpn: 11,
            remote_qpn: 22,
            initial_psn: psn_a,
        };
        let params_b = ConnectParams {
            token,
            local_qpn: 22,
            remote_qpn: 11,
            initial_psn: psn_b,
        };
        let buf_a = vec![0; config.config_a.max_datagram];
        let buf_b = vec![0; config.config_b.max_datagram];
        let endpoint = |conn, seed, buf| Endpoint {
            conn,
            mem: SimMemory::new(seed),
            events: Vec::new(),
            completions: Vec::new(),
            buf,
        };
        let mut pair = Pair {
            a: endpoint(
                Connection::connect(config.config_a, params_a, now),
                config.seed ^ 0xa,
                buf_a,
            ),
            b: endpoint(
                Connection::accept(config.config_b, params_b, now),
                config.seed ^ 0xb,
                buf_b,
            ),
            now,
            links: (0..rails as u64)
                .map(|r| {
                    let seed = config.seed.wrapping_mul(31).wrapping_add(r);
                    link::Link::new(config.link.clone(), ChaCha8Rng::seed_from_u64(seed))
                })
                .collect(),
            steps: 0,
            sent_last_step: true,
        };
        pair.a.conn.set_paths(rails);
        pair.b.conn.set_paths(rails);
        pair.drive_until(100_000, |p| {
            p.a.conn.state() != ConnectionState::Connecting
                && p.b.conn.state() != ConnectionState::Connecting
        });
        pair
    }

    /// The links' counters, added up over the rails.
    pub fn link_stats(&self) -> LinkStats {
        let mut total = LinkStats::default();
        for l in &self.links {
            let s = l.stats;
            total.sent += s.sent;
            total.delivered += s.delivered;
            total.lost += s.lost;
            total.lost_in_outage += s.lost_in_outage;
            total.oversized += s.oversized;
            total.duplicated += s.duplicated;
            total.corrupted += s.corrupted;
        }
        total
    }

    /// One rail's counters.
    pub fn rail_stats(&self, rail: usize) -> LinkStats {
        self.links[rail].stats
    }

    /// Changes one rail's fault model from now on.
    pub fn rail_config_mut(&mut self, rail: usize) -> &mut LinkConfig {
        &mut self.links[rail].config
    }

    fn in_flight(&self) -> usize {
        self.links.iter().map(|l| l.in_flight()).sum()
    }

    fn next_arrival(&self) -> Option<Time> {
        self.links.iter().filter_map(|l| l.next_arrival()).min()
    }

    /// Changes the link's fault model from now on.
    pub fn link_config_mut(&mut self) -> &mut LinkConfig {
        &mut self.links[0].config
    }

    /// The PSNs of the sequenced packets in flight from `a` to `b`, each once.
    pub fn psns_in_flight_towards_b(&self) -> std::collections::HashSet<Psn> {
        self.links
            .iter()
            .flat_map(|l| l.psns_in_flight_towards(true))
            .collect()
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Runs one step: both sides transmit what they have, one due datagram is delivered, or
    /// time jumps to the next arrival or deadline. Returns false when nothing can ever happen
    /// again.
    pub fn step(&mut self) -> bool {
        self.steps += 1;
        let mut progressed = false;
        self.sent_last_step = false;
        for to_b in [true, false] {
            let now = self.now;
            let (from, links) = if to_b {
                (&mut self.a, &mut self.links)
            } else {
                (&mut self.b, &mut self.links)
            };
            while let Some((len, path)) =
                from.conn.poll_transmit_path(now, &mut from.buf, &from.mem)
            {
                links[path].send(now, to_b, &from.buf[..len]);
                progressed = true;
                self.sent_last_step = true;
            }
        }
        // Deliver the earliest datagram due on any rail.
        let due = (0..self.links.len())
            .filter_map(|r| {
                self.links[r]
                    .next_arrival()
                    .filter(|t| *t <= self.now)
                    .map(|t| (t, r))
            })
            .min();
        if let Some((_, rail)) = due {
            if let Some((to_b, bytes)) = self.links[rail].pop_due(self.now) {
                let to = if to_b { &mut self.b } else { &mut self.a };
                to.conn
                    .handle_datagram_on(self.now, &bytes, rail, &mut to.mem);
                progressed = true;
            }
        }
        if !progressed {
            let next = [
                self.next_arrival(),
                self.a.conn.poll_timeout(),
                self.b.conn.poll_timeout(),
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next else { return false };
            // Deadlines are never in the past once handled; step at least 1 ns to be sure.
            self.now = next.max(self.now + Duration::from_nanos(1));
            self.a.conn.handle_timeout(self.now);
            self.b.conn.handle_timeout(self.now);
        }
        self.a.collect();
        self.b.collect();
        true
    }

    /// Steps until `done` holds, at most `max_steps` times; returns whether `done` held.
    pub fn drive_until(&mut self, max_steps: u64, mut done: impl FnMut(&Pair) -> bool) -> bool {
        for _ in 0..max_steps {
            if done(self) {
                return true;
            }
            if !self.step() {
                return done(self);
            }
        }
        done(self)
    }

    /// Steps until both sides have nothing outstanding and nothing is in flight (or have
    /// failed), at most `max_steps` times. Returns whether that point was reached.
    pub fn drive(&mut self, max_steps: u64) -> bool {
        self.sent_last_step = true;
        self.drive_until(max_steps, |p| {
            !p.sent_last_step && p.in_flight() == 0 && p.a.is_settled() && p.b.is_settled()
        })
    }

    /// Advances simulated time by `duration`, running everything due meanwhile.
    pub fn advance(&mut self, duration: Duration, max_steps: u64) {
        let until = self.now + duration;
        for _ in 0..max_steps {
            let next = [
                self.next_arrival(),
                self.a.conn.poll_timeout(),
                self.b.conn.poll_timeout(),
            ]
            .into_iter()
            .flatten()
            .min();
            if next.is_none_or(|n| n > until) && self.in_flight() == 0 {
                // Nothing due before `until` except transmissions, which `step` does first.
                self.step_transmit_only();
                self.now = until;
                return;
            }
            if !self.step() || self.now >= until {
                return;
            }
        }
    }

    fn step_transmit_only(&mut self) {
        for to_b in [true, false] {
            let now = self.now;
            let from = if to_b { &mut self.a } else { &mut self.b };
            while let Some((len, path)) =
                from.conn.poll_transmit_path(now, &mut from.buf, &from.mem)
            {
                self.links[path].send(now, to_b, &from.buf[..len]);
            }
        }
    }
}
