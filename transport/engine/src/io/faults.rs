//! A faulty cable in user space: a layer over any [`DatagramIo`] backend that loses,
//! duplicates, corrupts, reorders and delays the datagrams this process receives, and drops
//! all of them during one-way outages, each decided by a seeded random generator.
//!
//! It exists so that the lossy tests of every layer (engine, verbs, collectives, the NCCL
//! plugin) run in a plain `cargo test`, with no root and no nftables, and so that soak runs
//! can impair a real pair of hosts. The nftables tests stay as a confirmation that the real
//! kernel paths (EPERM on a filtered send, corrupted frames on the wire) behave the same.
//!
//! Faults are applied on receive, after the backend and before the protocol core, so one layer
//! covers the three backends alike. A process impairs what it receives; set the plan in both
//! processes for both directions, in one of them for a one-way fault. The plan comes from
//! [`EngineConfig::faults`](crate::worker::EngineConfig::faults) or, when that is `None`, from
//! the [`FAULTS_ENV`] environment variable, which reaches processes a test starts (the CLI,
//! the C API, the plugin) without any option of theirs. See [`FaultPlan::parse`] for the
//! syntax.
//!
//! Held datagrams (delayed, reordered, late duplicates) are bounded by [`MAX_HELD_BYTES`];
//! past that, datagrams pass straight through. The layer never touches what the backend
//! received in place (a landing zone): a datagram it changes or holds is copied first.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{DatagramIo, EngineKind, Landing, Received, TxBatch};

/// Environment variable read when the engine's configuration names no fault plan.
pub const FAULTS_ENV: &str = "TBRDMA_FAULTS";

/// Most bytes of datagrams held back at once, per rail (delays and reordering need a queue;
/// this bounds it whatever the plan says).
pub const MAX_HELD_BYTES: usize = 8 << 20;

/// Longest delay or outage a plan may ask for (a typo such as `delay=10s` would otherwise look
/// like a dead peer).
pub const MAX_DELAY: Duration = Duration::from_secs(1);

/// What to do to received datagrams. Probabilities are per datagram, between 0 and 1.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// Seed of the random generator (each rail mixes in its index).
    pub seed: u64,
    /// Share of datagrams lost.
    pub drop: f64,
    /// Share of datagrams delivered twice (the copy up to [`Self::reorder_by`] later).
    pub duplicate: f64,
    /// Share of datagrams delivered with one to three bits flipped.
    pub corrupt: f64,
    /// Share of datagrams held back by up to [`Self::reorder_by`], so later ones overtake
    /// them.
    pub reorder: f64,
    /// How far a reordered datagram or a duplicate falls behind (uniformly up to this).
    pub reorder_by: Duration,
    /// Every datagram is delivered this much later.
    pub delay: Duration,
    /// Periods, from the moment the rail opened, during which every datagram received is
    /// lost: `(start, length)`.
    pub outages: Vec<(Duration, Duration)>,
    /// The rails impaired (`None`: all of them).
    pub rails: Option<Vec<usize>>,
    /// Not a cable fault: the engine's code panics on receiving this many datagrams on a rail,
    /// so that tests can check that a bug in the engine becomes error completions and errors,
    /// never a hang or an abort.
    pub panic_after: Option<u64>,
}

impl FaultPlan {
    /// Parses a plan: comma-separated `key=value` pairs, for example
    /// `seed=7,drop=2%,dup=1%,corrupt=1%,reorder=2%,reorder_by=300us,delay=50us,outage=2s+500ms,rails=1`.
    ///
    /// - `drop`, `dup` (or `duplicate`), `corrupt`, `reorder`: a share, as `0.02` or `2%`;
    /// - `delay`, `reorder_by`: a duration (`ns`, `us`, `ms` or `s`), at most [`MAX_DELAY`];
    ///   `reorder_by` defaults to 200 µs;
    /// - `outage=START+LENGTH`: no datagram arrives for LENGTH (at most 60 s) from START (at
    ///   most an hour) after the rail opened; may repeat;
    /// - `rails=0` or `rails=0;1`: only these rails;
    /// - `panic_after=N`: the engine panics on the N-th datagram a rail receives (a test of
    ///   how an engine bug is contained, not a cable fault);
    /// - `seed`: a number (default 1).
    ///
    /// An unknown key or a bad value is an error naming it.
    pub fn parse(spec: &str) -> Result<FaultPlan, String> {
        let mut plan = FaultPlan {
            seed: 1,
            reorder_by: Duration::from_micros(200),
            ..FaultPlan::default()
        };
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("{FAULTS_ENV}: {item:?} is not key=value"))?;
            let bad = |why: String| format!("{FAULTS_ENV}: {key}={value}: {why}");
            match key.trim() {
                "seed" => plan.seed = value.parse().map_err(|e| bad(format!("{e}")))?,
                "drop" | "loss" => plan.drop = parse_share(value).map_err(bad)?,
                "dup" | "duplicate" => plan.duplicate = parse_share(value).map_err(bad)?,
                "corrupt" => plan.corrupt = parse_share(value).map_err(bad)?,
                "reorder" => plan.reorder = parse_share(value).map_err(bad)?,
                "reorder_by" => plan.reorder_by = parse_delay(value).map_err(bad)?,
                "delay" => plan.delay = parse_delay(value).map_err(bad)?,
                "outage" => {
                    let (start, length) = value
                        .split_once('+')
                        .ok_or_else(|| bad("expected START+LENGTH, e.g. 2s+500ms".into()))?;
                    let start = parse_duration(start).map_err(bad)?;
                    if start > Duration::from_secs(3600) {
                        return Err(bad("the start is more than an hour away".into()));
                    }
                    let length = parse_duration(length).map_err(bad)?;
                    if length > Duration::from_secs(60) {
                        return Err(bad("an outage lasts at most 60 s".into()));
                    }
                    plan.outages.push((start, length));
                }
                "rails" => {
                    let rails = value
                        .split(';')
                        .map(|r| r.trim().parse::<usize>())
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| bad(format!("{e}")))?;
                    plan.rails = Some(rails);
                }
                "panic_after" => {
                    plan.panic_after = Some(value.parse().map_err(|e| bad(format!("{e}")))?);
                }
                other => {
                    return Err(format!(
                        "{FAULTS_ENV}: unknown key {other:?} (known: seed, drop, dup, corrupt, \
                         reorder, reorder_by, delay, outage, rails, panic_after)"
                    ));
                }
            }
        }
        Ok(plan)
    }

    /// The plan in [`FAULTS_ENV`], if it is set and not empty.
    pub fn from_env() -> Result<Option<FaultPlan>, String> {
        match std::env::var(FAULTS_ENV) {
            Ok(spec) if !spec.trim().is_empty() => FaultPlan::parse(&spec).map(Some),
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("{FAULTS_ENV} is not UTF-8")),
        }
    }

    /// Whether rail `rail` is impaired.
    pub fn applies_to(&self, rail: usize) -> bool {
        self.rails.as_ref().is_none_or(|r| r.contains(&rail))
    }
}

fn parse_share(value: &str) -> Result<f64, String> {
    let value = value.trim();
    let share = match value.strip_suffix('%') {
        Some(pct) => pct.trim().parse::<f64>().map(|p| p / 100.0),
        None => value.parse::<f64>(),
    }
    .map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&share) {
        Ok(share)
    } else {
        Err("a share must lie between 0 and 1 (0% and 100%)".into())
    }
}

fn parse_duration(value: &str) -> Result<Duration, String> {
    let value = value.trim();
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| "a duration needs a unit: ns, us, ms or s".to_string())?;
    let (number, unit) = value.split_at(split);
    let number: u64 = number.parse().map_err(|e| format!("{e}"))?;
    let nanos_per = match unit {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        other => return Err(format!("unknown unit {other:?}: use ns, us, ms or s")),
    };
    number
        .checked_mul(nanos_per)
        .map(Duration::from_nanos)
        .ok_or_else(|| "duration too long".to_string())
}

fn parse_delay(value: &str) -> Result<Duration, String> {
    let d = parse_duration(value)?;
    if d > MAX_DELAY {
        return Err(format!("at most {MAX_DELAY:?}"));
    }
    Ok(d)
}

/// How many datagrams the fault layers of this process have seen and what they did to them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Datagrams the backends received on impaired rails.
    pub seen: u64,
    /// Lost at random.
    pub dropped: u64,
    /// Lost in an outage.
    pub lost_in_outage: u64,
    /// Delivered twice.
    pub duplicated: u64,
    /// Delivered with bits flipped.
    pub corrupted: u64,
    /// Held back so that later datagrams overtook them.
    pub reordered: u64,
}

impl std::fmt::Display for FaultCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seen={} dropped={} lost_in_outage={} duplicated={} corrupted={} reordered={}",
            self.seen,
            self.dropped,
            self.lost_in_outage,
            self.duplicated,
            self.corrupted,
            self.reordered
        )
    }
}

/// Process-wide tallies, in the order of [`FaultCounts`]' fields.
static INJECTED: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

/// What every fault layer of this process has done so far (tests print it from their child
/// processes and check that each fault they asked for really happened).
pub fn injected() -> FaultCounts {
    let get = |i: usize| INJECTED[i].load(Ordering::Relaxed);
    FaultCounts {
        seen: get(0),
        dropped: get(1),
        lost_in_outage: get(2),
        duplicated: get(3),
        corrupted: get(4),
        reordered: get(5),
    }
}

fn tally(i: usize) {
    INJECTED[i].fetch_add(1, Ordering::Relaxed);
}

/// A datagram held back, released at `release` (ties in arrival order).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Held {
    release: Instant,
    seq: u64,
    from: SocketAddr,
    bytes: Vec<u8>,
}

/// The plan's decisions for one datagram.
#[derive(Debug)]
struct Fate {
    /// Deliver nothing.
    lost: bool,
    /// Flip bits in the delivered copy.
    corrupt: bool,
    /// Hold the datagram this long (zero: deliver at once).
    hold: Duration,
    /// Also deliver a copy this much later.
    duplicate_after: Option<Duration>,
}

/// A backend seen through a [`FaultPlan`]; see the module docs.
#[derive(Debug)]
pub struct FaultyIo {
    inner: Box<dyn DatagramIo>,
    faults: Faults,
}

/// The layer's own state, apart from the backend so that both can be borrowed at once.
#[derive(Debug)]
struct Faults {
    plan: FaultPlan,
    rng: rand_chacha::ChaCha8Rng,
    opened: Instant,
    held: BinaryHeap<Reverse<Held>>,
    held_bytes: usize,
    next_seq: u64,
    /// Datagrams this rail received (for [`FaultPlan::panic_after`]).
    received: u64,
}

impl FaultyIo {
    /// Wraps `inner`, rail `rail` of its engine, in `plan`.
    pub fn new(inner: Box<dyn DatagramIo>, plan: FaultPlan, rail: usize) -> FaultyIo {
        use rand_core::SeedableRng;
        let seed = plan.seed ^ (rail as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        FaultyIo {
            inner,
            faults: Faults {
                plan,
                rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
                opened: Instant::now(),
                held: BinaryHeap::new(),
                held_bytes: 0,
                next_seq: 0,
                received: 0,
            },
        }
    }
}

impl Faults {
    fn chance(&mut self, p: f64) -> bool {
        use rand_core::Rng;
        p > 0.0 && ((self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    fn up_to(&mut self, d: Duration) -> Duration {
        use rand_core::Rng;
        let nanos = d.as_nanos() as u64;
        Duration::from_nanos(self.rng.next_u64() % (nanos + 1))
    }

    fn in_outage(&self, now: Instant) -> bool {
        let since = now.saturating_duration_since(self.opened);
        self.plan
            .outages
            .iter()
            .any(|&(start, length)| since >= start && since < start + length)
    }

    fn fate(&mut self, now: Instant) -> Fate {
        tally(0);
        let mut fate = Fate {
            lost: false,
            corrupt: false,
            hold: self.plan.delay,
            duplicate_after: None,
        };
        if self.in_outage(now) {
            tally(2);
            fate.lost = true;
            return fate;
        }
        if self.chance(self.plan.drop) {
            tally(1);
            fate.lost = true;
            return fate;
        }
        if self.chance(self.plan.corrupt) {
            tally(4);
            fate.corrupt = true;
        }
        if self.chance(self.plan.reorder) {
            tally(5);
            let by = self.plan.reorder_by;
            fate.hold += Duration::from_nanos(1) + self.up_to(by);
        }
        if self.chance(self.plan.duplicate) {
            tally(3);
            let by = self.plan.reorder_by;
            fate.duplicate_after = Some(fate.hold + self.up_to(by));
        }
        fate
    }

    fn flip_bits(&mut self, bytes: &mut [u8]) {
        use rand_core::Rng;
        if bytes.is_empty() {
            return;
        }
        let flips = 1 + self.rng.next_u32() % 3;
        for _ in 0..flips {
            let at = self.rng.next_u32() as usize % bytes.len();
            bytes[at] ^= 1 << (self.rng.next_u32() % 8);
        }
    }

    /// Queues a copy of `data` for `release`; returns it instead when the queue is full.
    fn hold(&mut self, release: Instant, from: SocketAddr, bytes: Vec<u8>) -> Option<Vec<u8>> {
        if self.held_bytes + bytes.len() > MAX_HELD_BYTES {
            return Some(bytes);
        }
        self.held_bytes += bytes.len();
        self.next_seq += 1;
        self.held.push(Reverse(Held {
            release,
            seq: self.next_seq,
            from,
            bytes,
        }));
        None
    }

    /// Applies the plan to one received datagram; returns how many datagrams it delivered.
    fn receive(
        &mut self,
        data: Received<'_>,
        from: SocketAddr,
        now: Instant,
        deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
    ) -> usize {
        self.received += 1;
        if self.plan.panic_after == Some(self.received) {
            panic!(
                "panic injected by {FAULTS_ENV} (panic_after={})",
                self.received
            );
        }
        let fate = self.fate(now);
        if fate.lost {
            return 0;
        }
        let mut delivered = 0;
        if let Some(after) = fate.duplicate_after {
            // The copy is the datagram as it left: only the first delivery is corrupted.
            if let Some(copy) = self.hold(now + after, from, data.to_vec()) {
                deliver(Received::whole(&copy), from);
                delivered += 1;
            }
        }
        if !fate.corrupt && fate.hold.is_zero() {
            deliver(data, from);
            return delivered + 1;
        }
        let mut bytes = data.to_vec();
        if fate.corrupt {
            self.flip_bits(&mut bytes);
        }
        if fate.hold.is_zero() {
            deliver(Received::whole(&bytes), from);
            return delivered + 1;
        }
        if let Some(bytes) = self.hold(now + fate.hold, from, bytes) {
            deliver(Received::whole(&bytes), from);
            delivered += 1;
        }
        delivered
    }

    /// Delivers every held datagram whose time has come; returns how many.
    fn release(
        &mut self,
        now: Instant,
        deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
    ) -> usize {
        let mut released = 0;
        while self.held.peek().is_some_and(|h| h.0.release <= now) {
            let Reverse(held) = self.held.pop().expect("peeked");
            self.held_bytes -= held.bytes.len();
            deliver(Received::whole(&held.bytes), held.from);
            released += 1;
        }
        released
    }

    /// How long until the next held datagram is due, if any is held.
    fn next_release(&self, now: Instant) -> Option<Duration> {
        self.held
            .peek()
            .map(|h| h.0.release.saturating_duration_since(now))
    }
}

impl DatagramIo for FaultyIo {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }

    fn send(&mut self, batch: &mut TxBatch) -> io::Result<()> {
        self.inner.send(batch)
    }

    fn recv(
        &mut self,
        landing: &mut Option<Landing>,
        deliver: &mut dyn FnMut(Received<'_>, SocketAddr),
    ) -> io::Result<usize> {
        let FaultyIo { inner, faults } = self;
        let now = Instant::now();
        let mut delivered = 0;
        inner.recv(landing, &mut |data, from| {
            delivered += faults.receive(data, from, now, deliver);
        })?;
        // Held datagrams go after what the backend received: it may have received the first
        // of those into a landing zone, and a held write placed into the zone before that
        // would be overwritten (the engine ends the loan only after this call).
        delivered += faults.release(now, deliver);
        Ok(delivered)
    }

    fn wait(&mut self, timeout: Duration, wake: BorrowedFd<'_>) -> io::Result<()> {
        let timeout = match self.faults.next_release(Instant::now()) {
            Some(due) => timeout.min(due),
            None => timeout,
        };
        self.inner.wait(timeout, wake)
    }

    fn send_drops(&self) -> u64 {
        self.inner.send_drops()
    }

    fn set_peer(&mut self, peer: Option<SocketAddr>) -> io::Result<()> {
        self.inner.set_peer(peer)
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.inner.peer()
    }

    fn set_peer_carriers(&mut self, peers: &[(SocketAddr, bool)]) {
        self.inner.set_peer_carriers(peers);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::NullIo;

    #[test]
    fn plans_parse_and_bad_ones_name_the_problem() {
        let plan = FaultPlan::parse(
            "seed=7, drop=2%, dup=0.01, corrupt=1%, reorder=3%, reorder_by=300us, delay=50us, \
             outage=2s+500ms, outage=10s+1ms, rails=0;2",
        )
        .unwrap();
        assert_eq!(plan.seed, 7);
        assert!((plan.drop - 0.02).abs() < 1e-12 && (plan.duplicate - 0.01).abs() < 1e-12);
        assert!((plan.corrupt - 0.01).abs() < 1e-12 && (plan.reorder - 0.03).abs() < 1e-12);
        assert_eq!(plan.reorder_by, Duration::from_micros(300));
        assert_eq!(plan.delay, Duration::from_micros(50));
        assert_eq!(
            plan.outages,
            vec![
                (Duration::from_secs(2), Duration::from_millis(500)),
                (Duration::from_secs(10), Duration::from_millis(1))
            ]
        );
        assert!(plan.applies_to(0) && !plan.applies_to(1) && plan.applies_to(2));
        assert!(FaultPlan::parse("").unwrap().applies_to(5));

        for (spec, says) in [
            ("drop", "not key=value"),
            ("drop=150%", "between 0 and 1"),
            ("drop=-0.1", "between 0 and 1"),
            ("delay=10", "needs a unit"),
            ("delay=5s", "at most"),
            ("delay=3fortnights", "unknown unit"),
            ("delay=99999999999999999999s", "number too large"),
            ("outage=2s", "START+LENGTH"),
            ("outage=2s+2h", "unknown unit"),
            ("outage=9999s+1s", "more than an hour"),
            ("rails=a", "invalid digit"),
            ("jitter=1ms", "unknown key"),
        ] {
            let err = FaultPlan::parse(spec).expect_err(spec);
            assert!(err.contains(says), "{spec}: {err}");
            assert!(err.contains(FAULTS_ENV), "{spec}: {err}");
        }
    }

    fn num(datagram: &[u8]) -> u32 {
        u32::from_le_bytes(datagram.try_into().expect("4 bytes"))
    }

    /// Drives [`Faults::receive`] and [`Faults::release`] with numbered datagrams and
    /// returns what came out, in order.
    fn run(plan: FaultPlan, count: u32, step: Duration) -> Vec<Vec<u8>> {
        let from: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut faults = FaultyIo::new(Box::<NullIo>::default(), plan, 0).faults;
        let start = faults.opened;
        let mut out = Vec::new();
        let mut deliver = |d: Received<'_>, _from: SocketAddr| out.push(d.to_vec());
        for i in 0..count {
            let now = start + step * i;
            faults.release(now, &mut deliver);
            faults.receive(Received::whole(&i.to_le_bytes()), from, now, &mut deliver);
        }
        faults.release(start + step * count + Duration::from_secs(2), &mut deliver);
        assert_eq!(faults.held_bytes, 0, "everything held came out");
        out
    }

    #[test]
    fn each_fault_happens_at_about_its_rate_and_only_then() {
        let n = 20_000;
        let step = Duration::from_micros(10);
        let clean = run(FaultPlan::parse("").unwrap(), n, step);
        assert_eq!(clean.len(), n as usize);
        assert!(
            clean
                .iter()
                .enumerate()
                .all(|(i, d)| d[..] == (i as u32).to_le_bytes())
        );

        let lossy = run(FaultPlan::parse("drop=10%").unwrap(), n, step);
        let lost = n as usize - lossy.len();
        assert!((1500..2500).contains(&lost), "{lost} of {n} lost");
        assert!(
            lossy.windows(2).all(|w| num(&w[0]) < num(&w[1])),
            "order kept"
        );

        let dups = run(FaultPlan::parse("dup=10%").unwrap(), n, step);
        let extra = dups.len() - n as usize;
        assert!((1500..2500).contains(&extra), "{extra} duplicates");
        let mut sorted = dups.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), n as usize, "duplicates are exact copies");

        let corrupt = run(FaultPlan::parse("corrupt=10%").unwrap(), n, step);
        let changed = corrupt
            .iter()
            .enumerate()
            .filter(|(i, d)| d[..] != (*i as u32).to_le_bytes())
            .count();
        assert!((1500..2500).contains(&changed), "{changed} corrupted");

        let reordered = run(
            FaultPlan::parse("reorder=10%,reorder_by=100us").unwrap(),
            n,
            step,
        );
        assert_eq!(reordered.len(), n as usize);
        let inversions = reordered
            .windows(2)
            .filter(|w| num(&w[0]) > num(&w[1]))
            .count();
        assert!(inversions > 500, "{inversions} datagrams overtaken");
        let mut sorted = reordered.clone();
        sorted.sort_by_key(|d| num(d));
        assert_eq!(sorted, clean, "reordering loses and changes nothing");
    }

    #[test]
    fn outages_lose_everything_in_their_window_and_nothing_else() {
        // Datagrams every 1 ms; an outage from 10 ms for 5 ms loses numbers 10..15.
        let out = run(
            FaultPlan::parse("outage=10ms+5ms").unwrap(),
            30,
            Duration::from_millis(1),
        );
        let got: Vec<u32> = out.iter().map(|d| num(d)).collect();
        let expected: Vec<u32> = (0..30).filter(|i| !(10..15).contains(i)).collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn delays_hold_everything_and_the_queue_is_bounded() {
        let from: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut faults = FaultyIo::new(
            Box::<NullIo>::default(),
            FaultPlan::parse("delay=1ms").unwrap(),
            0,
        )
        .faults;
        let now = faults.opened;
        let mut out = 0usize;
        let mut deliver = |_: Received<'_>, _: SocketAddr| out += 1;
        let big = vec![0u8; 60_000];
        // More than the queue may hold: the rest passes through at once.
        for _ in 0..200 {
            faults.receive(Received::whole(&big), from, now, &mut deliver);
        }
        assert!(faults.held_bytes <= MAX_HELD_BYTES);
        let passed = 200 - faults.held.len();
        assert!(passed > 0 && passed < 200, "{passed} passed at once");
        assert_eq!(faults.next_release(now), Some(Duration::from_millis(1)));
        assert_eq!(
            faults.release(now + Duration::from_micros(999), &mut |_, _| {}),
            0
        );
        assert_eq!(
            faults.release(now + Duration::from_millis(1), &mut |_, _| {}),
            200 - passed
        );
        assert_eq!(faults.next_release(now), None);
    }
}
