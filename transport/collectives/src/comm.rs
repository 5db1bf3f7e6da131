//! The communicator: N ranks, one channel per cabled neighbour, built from a hostfile (and one
//! per rank with no cable to this one once a send/recv connects it directly: `direct`).
//!
//! Owns connection setup (deterministic order: a rank connects to every lower-ranked neighbour,
//! in rank order, then accepts every higher-ranked one, so no two ranks wait on each other), the
//! configuration check, and the wait loop every collective runs in: poll every channel, try
//! the next step, spin a while, then yield the core. It never computes a reduction itself.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use tbrdma_netdev::hostfile::{Hostfile, TopologyKind};
use tbrdma_verbs::{
    Access, Config, Connected, Device, DeviceConfig, EngineConfig, EngineKind, Listener, QpOptions,
    Stats, VerbsError, connect,
};

use crate::channel::{ABORT_SELF, Channel, Fault};
use crate::config::{
    Algorithm, CommOptions, Digest, PROTOCOL_VERSION, Relay, algorithm_code, build_hash, dtype_mask,
};
use crate::direct_ends::DirectEnds;
use crate::dtype::FoldScratch;
use crate::error::{CollError, Result};

/// Reusable buffers, so collectives allocate nothing once warmed up.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// A reduce-scatter's working copy of its input.
    pub work: Vec<u8>,
    /// The reduction's accumulators.
    pub fold: FoldScratch,
    /// A typed call's bytes, or a non-root's reduce output.
    pub typed: Vec<u8>,
}

/// What a step of a collective is doing after one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Finished.
    Done,
    /// Moved something; try again at once.
    Progressed,
    /// Nothing possible until rank `.0` does something.
    WaitingOn(usize),
}

/// A group of ranks that run collectives together.
#[derive(Debug)]
pub struct Communicator {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) topology: TopologyKind,
    pub(crate) rails: usize,
    pub(crate) opts: CommOptions,
    /// Indexed by peer rank: the channel to each neighbour, and to each rank with no cable to
    /// this one once a send/recv with it connected directly (`direct`); `None` otherwise.
    pub(crate) chans: Vec<Option<Channel>>,
    /// Indexed by peer rank: whether a cable joins the two.
    pub(crate) cabled: Vec<bool>,
    /// How messages between ranks that share no cable travel.
    pub(crate) relay: Relay,
    /// Indexed by peer rank, for ranks with no cable to this one: the two ends of a direct
    /// connection over the routed path (see `direct`).
    pub(crate) direct_ends: Vec<Option<DirectEnds>>,
    pub(crate) scratch: Scratch,
    /// Bytes of peers' data reduced packet by packet as they arrived (see `oneshot`).
    pub(crate) reduced_on_arrival: u64,
    poisoned: Option<String>,
}

/// What one end of a connection needs before it connects: a device on the cable (or cables)
/// it leaves by, and the slots.
pub(crate) struct End {
    pub device: Device,
    pub pd: tbrdma_verbs::ProtectionDomain,
    pub cq: tbrdma_verbs::CompletionQueue,
    pub inbox: tbrdma_verbs::MemoryRegion,
    pub outbox: tbrdma_verbs::MemoryRegion,
}

fn bad(problem: impl Into<String>, fix: impl Into<String>) -> CollError {
    CollError::BadConfig {
        problem: problem.into(),
        fix: fix.into(),
    }
}

impl Communicator {
    /// Builds the communicator for `rank` from the hostfile at `path`.
    pub fn from_hostfile(path: &Path, rank: usize, opts: CommOptions) -> Result<Communicator> {
        let hostfile = Hostfile::load(path).map_err(|e| {
            bad(
                e.to_string(),
                "generate it with `tbrdma hostfile` or `tbrdma lab up`",
            )
        })?;
        Communicator::new(&hostfile, rank, opts)
    }

    /// Builds the communicator from the environment: `TBRDMA_HOSTFILE` and `TBRDMA_RANK` (what
    /// `tbrdma lab exec` sets) or, without a hostfile, a rendezvous at `TBRDMA_ADDR`
    /// (rank 0's `ip:port`) with `TBRDMA_RANK` and `TBRDMA_WORLD_SIZE`, as PyTorch does.
    pub fn from_env(opts: CommOptions) -> Result<Communicator> {
        let var = |name: &str| std::env::var(name).ok();
        let rank = var("TBRDMA_RANK")
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| {
                bad(
                    "TBRDMA_RANK is not set to a rank number",
                    "set it to this host's rank",
                )
            })?;
        if let Some(path) = var("TBRDMA_HOSTFILE") {
            return Communicator::from_hostfile(Path::new(&path), rank, opts);
        }
        let Some(addr) = var("TBRDMA_ADDR") else {
            return Err(bad(
                "neither TBRDMA_HOSTFILE nor TBRDMA_ADDR is set",
                "point TBRDMA_HOSTFILE at the cluster's hostfile, or set TBRDMA_ADDR (rank 0's ip:port) and TBRDMA_WORLD_SIZE",
            ));
        };
        let addr: SocketAddr = addr.parse().map_err(|_| {
            bad(
                format!("TBRDMA_ADDR={addr:?} is not an ip:port"),
                "give rank 0's address and a free port, e.g. 169.254.10.1:29500",
            )
        })?;
        let world = var("TBRDMA_WORLD_SIZE")
            .and_then(|w| w.parse().ok())
            .ok_or_else(|| {
                bad(
                    "TBRDMA_WORLD_SIZE is not set to a number",
                    "set it to the number of ranks",
                )
            })?;
        Communicator::from_rendezvous(addr, rank, world, opts)
    }

    /// Builds the communicator after a rendezvous at rank 0's `addr`: the ranks swap their
    /// cable addresses and rank 0 derives the hostfile (see the `rendezvous` module).
    pub fn from_rendezvous(
        addr: SocketAddr,
        rank: usize,
        world: usize,
        opts: CommOptions,
    ) -> Result<Communicator> {
        let hostfile = crate::rendezvous::rendezvous(addr, rank, world, opts.timeout, &opts.auth)?;
        Communicator::new(&hostfile, rank, opts)
    }

    /// Builds the communicator for `rank` of `hostfile`: opens one device per neighbour (with
    /// every cable to it as rails), registers the slots, connects, and checks that every
    /// neighbour has the same configuration.
    pub fn new(hostfile: &Hostfile, rank: usize, opts: CommOptions) -> Result<Communicator> {
        let world = hostfile.ranks.len();
        if rank >= world {
            return Err(bad(
                format!("rank {rank} is not in the hostfile (it lists {world} ranks)"),
                "ranks count from 0",
            ));
        }
        if opts.slots < 2 || opts.slot_bytes < 64 || opts.slot_bytes > u32::MAX as usize {
            return Err(bad(
                format!("{} slots of {} bytes", opts.slots, opts.slot_bytes),
                "use at least 2 slots of at least 64 bytes",
            ));
        }
        let max_rails = if opts.max_rails == 0 {
            usize::MAX
        } else {
            opts.max_rails
        };
        let rails = (hostfile.topology.rails.max(1) as usize).min(max_rails);
        let relay = Relay::from_env()?;
        let mut comm = Communicator {
            rank,
            world,
            topology: hostfile.topology.kind,
            rails,
            opts: opts.clone(),
            chans: (0..world).map(|_| None).collect(),
            cabled: vec![false; world],
            relay,
            direct_ends: vec![None; world],
            scratch: Scratch::default(),
            reduced_on_arrival: 0,
            poisoned: None,
        };
        let me = &hostfile.ranks[rank];
        let mut neighbours: Vec<usize> = me.links.iter().map(|l| l.peer).collect();
        neighbours.sort_unstable();
        neighbours.dedup();
        struct Pending {
            peer: usize,
            end: End,
            target: SocketAddr,
            listener: Option<Listener>,
        }
        let mut pending = Vec::new();
        for &peer in &neighbours {
            if peer >= world || peer == rank {
                return Err(bad(
                    format!("rank {rank}'s hostfile entry lists a cable to rank {peer}"),
                    "regenerate the hostfile",
                ));
            }
            comm.cabled[peer] = true;
            let mut links: Vec<_> = me.links.iter().filter(|l| l.peer == peer).collect();
            links.sort_by_key(|l| l.rail);
            links.truncate(rails);
            let ips: Vec<String> = links.iter().map(|l| l.address.to_string()).collect();
            let end = comm.open_end(peer, &ips, false)?;
            let port = comm.pair_port(peer)?;
            let listener = if peer > rank {
                let at = SocketAddr::new(IpAddr::V4(links[0].address), port);
                Some(
                    Listener::bind_addr(&end.device, at).map_err(|source| CollError::Connect {
                        rank: peer,
                        local: rank,
                        source,
                    })?,
                )
            } else {
                None
            };
            pending.push(Pending {
                peer,
                end,
                target: SocketAddr::new(IpAddr::V4(links[0].peer_address), port),
                listener,
            });
        }
        comm.direct_ends = crate::direct_ends::plan_ends(hostfile, rank, &comm.cabled);
        let deadline = Instant::now() + opts.timeout;
        // Lower-ranked neighbours first (they are already accepting), then the higher ones.
        for p in pending {
            let (digest, qp_opts) = comm.qp_options(&p.end.inbox, opts.timeout);
            let connected = match &p.listener {
                Some(listener) => {
                    let wait = deadline.saturating_duration_since(Instant::now());
                    listener.accept(&p.end.pd, &p.end.cq, &p.end.cq, &qp_opts, Some(wait))
                }
                None => connect_retrying(&p.end.pd, p.target, &p.end.cq, &qp_opts, deadline),
            }
            .map_err(|source| CollError::Connect {
                rank: p.peer,
                local: rank,
                source,
            })?;
            comm.attach(p.peer, p.end, &digest, connected)?;
        }
        Ok(comm)
    }

    /// Opens a device on the local addresses `ips` (one per rail) and registers the slots of
    /// a connection to `peer`.
    pub(crate) fn open_end(&self, peer: usize, ips: &[String], relayed: bool) -> Result<End> {
        let names: Vec<&str> = ips.iter().map(String::as_str).collect();
        // The packet engine's frames are not IP: the hosts in between a kernel-relayed
        // connection would not forward them, so such an end uses the sockets engine.
        let engine_kind = match self.opts.engine {
            EngineKind::Packet if relayed => EngineKind::Sockets,
            kind => kind,
        };
        let engine = EngineConfig {
            engine: engine_kind,
            progress: self.opts.progress,
            keeper_period: KEEPER_PERIOD,
            ..EngineConfig::default()
        };
        let device =
            Device::open_rails(&names, DeviceConfig { engine, port: 0 }).map_err(|source| {
                CollError::Connect {
                    rank: peer,
                    local: self.rank,
                    source,
                }
            })?;
        let pd = device.alloc_pd();
        let cq = device.create_cq(8 * self.opts.slots + 256);
        let bytes = crate::channel::region_bytes(self.opts.slots, self.opts.slot_bytes);
        let inbox = pd.alloc_mr(bytes, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let outbox = pd.alloc_mr(bytes, Access::LOCAL_WRITE)?;
        Ok(End {
            device,
            pd,
            cq,
            inbox,
            outbox,
        })
    }

    /// The TCP port of the connection manager for this rank and `peer`:
    /// `port_base + lo·N + hi`.
    pub(crate) fn pair_port(&self, peer: usize) -> Result<u16> {
        let (lo, hi) = (self.rank.min(peer), self.rank.max(peer));
        pair_port(&self.opts, self.world, lo, hi).ok_or_else(|| {
            bad(
                format!(
                    "port base {} leaves no port for ranks {lo} and {hi}",
                    self.opts.port_base
                ),
                "choose a lower port base",
            )
        })
    }

    /// This rank's digest for a connection whose inbox is `inbox`, and the connection options
    /// carrying it (setup bounded by `setup_timeout`).
    pub(crate) fn qp_options(
        &self,
        inbox: &tbrdma_verbs::MemoryRegion,
        setup_timeout: Duration,
    ) -> (Digest, QpOptions) {
        let digest = self.digest(inbox);
        let qp_opts = QpOptions {
            config: link_config(&self.opts),
            private_data: digest.encode(),
            timeout: setup_timeout,
            auth: self.opts.auth.clone(),
        };
        (digest, qp_opts)
    }

    /// Checks the peer's digest and installs the channel to `peer`.
    pub(crate) fn attach(
        &mut self,
        peer: usize,
        end: End,
        digest: &Digest,
        connected: Connected,
    ) -> Result<()> {
        let Connected {
            qp,
            peer_private_data,
            ..
        } = connected;
        let theirs = Digest::decode(&peer_private_data, peer, self.rank)?;
        digest.check(&theirs, peer)?;
        drop(end.device);
        self.chans[peer] = Some(Channel::new(
            peer,
            qp,
            end.cq,
            end.inbox,
            end.outbox,
            theirs.inbox,
            self.opts.slots,
            self.opts.slot_bytes,
        )?);
        Ok(())
    }

    fn digest(&self, inbox: &tbrdma_verbs::MemoryRegion) -> Digest {
        Digest {
            version: PROTOCOL_VERSION,
            rank: self.rank as u32,
            world: self.world as u32,
            topology: self.topology,
            rails: self.rails as u32,
            dtypes: dtype_mask(),
            slot_bytes: self.opts.slot_bytes as u32,
            slots: self.opts.slots as u32,
            one_shot_max: self.opts.one_shot_max.min(u32::MAX as usize) as u32,
            algorithm: algorithm_code(self.opts.algorithm),
            relay: self.relay,
            inbox: inbox.remote(0),
            build: build_hash(),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The datagram backend of the connections to neighbours: the one asked for, or sockets
    /// where it was unavailable (a connection relayed by the kernels in between always uses
    /// sockets when the packet engine was asked for).
    pub fn engine(&self) -> EngineKind {
        self.chans
            .iter()
            .zip(&self.cabled)
            .find_map(|(chan, &cabled)| chan.as_ref().filter(|_| cabled))
            .map_or(self.opts.engine, Channel::engine_kind)
    }

    /// The protocol counters of the connection to each neighbour, by rank (retransmissions,
    /// timeouts, duplicates...): what tells a slow tail made by loss recovery from one made by
    /// scheduling.
    pub fn link_stats(&self) -> Vec<(usize, Stats)> {
        self.chans
            .iter()
            .enumerate()
            .filter_map(|(peer, chan)| chan.as_ref().map(|ch| (peer, ch.stats())))
            .collect()
    }

    /// Bytes of the peers' data that all-reduces reduced packet by packet as it arrived,
    /// straight out of the engine's receive buffers, since the communicator was built (a
    /// two-rank one-shot all-reduce does when its call is in time for the peer's message; the
    /// rest is copied into an inbox slot first and reduced from there).
    pub fn reduced_on_arrival(&self) -> u64 {
        self.reduced_on_arrival
    }

    /// The cluster's shape.
    pub fn topology(&self) -> TopologyKind {
        self.topology
    }

    /// Cables used per neighbour.
    pub fn rails(&self) -> usize {
        self.rails
    }

    /// The options it was built with.
    pub fn options(&self) -> &CommOptions {
        &self.opts
    }

    /// Changes the algorithm (for tools that compare them). Every rank must do the same.
    pub fn set_algorithm(&mut self, algorithm: Algorithm) {
        self.opts.algorithm = algorithm;
    }

    /// Whether a cable joins this rank and `peer`.
    pub fn is_neighbour(&self, peer: usize) -> bool {
        self.cabled.get(peer).copied().unwrap_or(false)
    }

    /// How messages between ranks that share no cable travel (see [`Relay`]).
    pub fn relay(&self) -> Relay {
        self.relay
    }

    /// Changes how messages between ranks that share no cable travel. Every rank must do the
    /// same, before the first send/recv between ranks with no cable.
    pub fn set_relay(&mut self, relay: Relay) {
        self.relay = relay;
    }

    /// Whether every rank is a neighbour (a pair or a full mesh).
    pub fn fully_connected(&self) -> bool {
        (0..self.world).all(|p| p == self.rank || self.is_neighbour(p))
    }

    /// The bytes of one message of a schedule cut in slot-sized chunks: a slot's worth of whole
    /// `dtype` elements, so that no element straddles two messages.
    pub(crate) fn chunk_bytes(&self, dtype: crate::dtype::DType) -> usize {
        (self.opts.slot_bytes / dtype.size()) * dtype.size()
    }

    /// Whether recursive doubling can run ([`crate::Algorithm::Doubling`]): four ranks, and
    /// this rank cabled to ranks r xor 1 and r xor 3 (a ring of four or a mesh; checked
    /// locally).
    pub fn supports_doubling(&self) -> bool {
        self.world == 4 && self.is_neighbour(self.rank ^ 1) && self.is_neighbour(self.rank ^ 3)
    }

    /// Whether rank k+1 and k−1 are neighbours of every rank k (checked locally).
    pub fn has_ring(&self) -> bool {
        let next = (self.rank + 1) % self.world;
        let prev = (self.rank + self.world - 1) % self.world;
        self.world == 1 || (self.is_neighbour(next) && self.is_neighbour(prev))
    }

    pub(crate) fn check_usable(&self) -> Result<()> {
        match &self.poisoned {
            Some(why) => Err(CollError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    /// Runs `step` until it is done, polling every channel in between. Spins `opts.spin`
    /// idle rounds, then yields the core each round. Fails when a channel fails or when
    /// nothing moved for `opts.timeout`; then tells every neighbour, so that ranks waiting on
    /// this one fail too and name the rank that failed first.
    pub(crate) fn drive(
        &mut self,
        op: &'static str,
        mut step: impl FnMut(&mut [Option<Channel>], &mut Scratch) -> Result<Step, Fault>,
    ) -> Result<()> {
        // When the current idle stretch was first noticed (at its 256th round), for the timeout;
        // progress clears it. No clock read per round: a call makes a dozen rounds or so.
        let mut idle_since: Option<Instant> = None;
        let mut idle: u32 = 0;
        // The first step runs before the first poll: data posted then carries the
        // acknowledgements the engine still holds for the previous call's messages (a poll
        // would send them first, each in a datagram of its own).
        let mut polled = false;
        loop {
            let mut moved = false;
            let mut fault = None;
            for ch in self.chans.iter_mut().flatten().filter(|_| polled) {
                match ch.poll() {
                    Ok(m) => moved |= m,
                    Err(f) => {
                        fault = Some((ch.peer, f));
                        break;
                    }
                }
            }
            polled = true;
            if fault.is_none() {
                match step(&mut self.chans, &mut self.scratch) {
                    Ok(Step::Done) => return Ok(()),
                    Ok(Step::Progressed) => moved = true,
                    Ok(Step::WaitingOn(peer))
                        if self.chans[peer].as_ref().is_some_and(Channel::is_closed) =>
                    {
                        fault = Some((
                            peer,
                            Fault::Failed("its connection closed (the process ended?)".into()),
                        ));
                    }
                    Ok(Step::WaitingOn(peer)) => {
                        if moved {
                            idle = 0;
                            idle_since = None;
                        } else {
                            idle = idle.saturating_add(1);
                            if idle > self.opts.spin {
                                std::thread::yield_now();
                            }
                            if idle % 256 == 0 {
                                let since = *idle_since.get_or_insert_with(Instant::now);
                                if since.elapsed() >= self.opts.timeout {
                                    let err = CollError::Timeout {
                                        rank: peer,
                                        op,
                                        after: self.opts.timeout,
                                    };
                                    return Err(self.fail(err, ABORT_SELF));
                                }
                            }
                        }
                        continue;
                    }
                    Err(f) => fault = Some((usize::MAX, f)),
                }
            }
            match fault {
                None => {
                    if moved {
                        idle = 0;
                        idle_since = None;
                    }
                }
                Some((peer, f)) => return Err(self.fault(op, peer, f)),
            }
        }
    }

    /// Turns a channel's fault (`peer` is `usize::MAX` for this rank's own) into the error
    /// naming the rank that failed, poisoning the communicator and telling the neighbours.
    fn fault(&mut self, op: &'static str, peer: usize, f: Fault) -> CollError {
        let (failed, detail) = match f {
            Fault::Failed(detail) if peer == usize::MAX => (self.rank, detail),
            Fault::Failed(detail) => (peer, detail),
            Fault::Abort(ABORT_SELF) => (peer, "it gave up and told its neighbours".to_string()),
            Fault::Abort(r) => (r as usize, format!("reported by rank {peer}")),
        };
        let err = CollError::RankFailed {
            rank: failed,
            op,
            detail,
        };
        let notice = if failed == self.rank {
            ABORT_SELF
        } else {
            failed as u32
        };
        self.fail(err, notice)
    }

    /// Polls every channel once (so the engines answer and acknowledge while this rank waits
    /// for something else, such as a connection); a failed channel fails the communicator as
    /// in a collective.
    pub(crate) fn poll_all(&mut self, op: &'static str) -> Result<()> {
        let mut fault = None;
        for ch in self.chans.iter_mut().flatten() {
            if let Err(f) = ch.poll() {
                fault = Some((ch.peer, f));
                break;
            }
        }
        match fault {
            None => Ok(()),
            Some((peer, f)) => Err(self.fault(op, peer, f)),
        }
    }

    /// Poisons the communicator and tells every neighbour which rank failed, then drives the
    /// engines briefly so the notices leave.
    fn fail(&mut self, err: CollError, failed: u32) -> CollError {
        self.poisoned = Some(err.to_string());
        for ch in self.chans.iter_mut().flatten() {
            if ch.peer as u32 != failed {
                ch.abort(failed);
            }
        }
        let until = Instant::now() + Duration::from_millis(20);
        while Instant::now() < until {
            for ch in self.chans.iter_mut().flatten() {
                let _ = ch.poll();
            }
            std::thread::yield_now();
        }
        err
    }
}

impl Drop for Communicator {
    /// Waits (bounded) until the peers have every write this rank posted: the last collective
    /// can return before its final writes are acknowledged, and closing the queue pairs then
    /// would flush them and fail the peers' copy of that collective.
    fn drop(&mut self) {
        if self.poisoned.is_some() {
            return;
        }
        let until = Instant::now() + self.opts.timeout.min(Duration::from_secs(2));
        while Instant::now() < until {
            let mut flushed = true;
            for ch in self.chans.iter_mut().flatten() {
                if ch.poll().is_err() || ch.is_closed() {
                    continue;
                }
                flushed &= ch.is_flushed();
            }
            if flushed {
                break;
            }
            std::thread::yield_now();
        }
    }
}

/// Caller progress: how often the keeper of a collective's device checks for an application
/// that left with acknowledgements held (between collectives they always are: each call's last
/// message is acknowledged by the next call's first). The engine's default, 500 µs, keeps them
/// inside a 1 ms retransmission timeout, but each check is a timer interrupt and two context
/// switches on a busy core: on the 2-core VM a 16 KiB all-reduce pair's mean was 9.6-9.8 µs for
/// a median of 8.9 with 500 µs checks, 9.4-9.6 (p99 25-27 µs) with 2 ms, 9.0-9.1 (p99 11 µs)
/// with 10 ms. Collectives need no acknowledgement sooner (8 slots per neighbour, and every
/// call's messages carry the previous call's), so they check every 10 ms and raise the
/// retransmission floor to match ([`RTO_FLOOR`]).
const KEEPER_PERIOD: Duration = Duration::from_millis(10);
/// Retransmission-timeout floor of the collectives' connections: about twice the keeper's bound
/// (10.1 ms), so that a rank pausing between collectives never makes its neighbours retransmit.
/// A pulled cable costs this long to fail over; losses inside a stream are repaired from
/// selective acknowledgements, and a tail loss (a lost datagram with nothing behind it) by the
/// tail loss probe ([`TAIL_PROBE_FLOOR`]). (TCP's floor is 200 ms.)
const RTO_FLOOR: Duration = Duration::from_millis(20);
/// Floor of the collectives' tail loss probe (`Config::tail_probe_floor`): a lost last datagram
/// of a collective costs about this, instead of [`RTO_FLOOR`]. A rank that computes for longer
/// than this between collectives, holding the acknowledgement of its neighbour's last message,
/// draws one needless probe per collective (the last datagram again, answered by the rank's
/// next poll): its cost, a few microseconds, is under one percent of such a gap. Shorter gaps
/// (a decode step's all-reduces follow each other within a millisecond or so) draw none.
const TAIL_PROBE_FLOOR: Duration = Duration::from_millis(2);

/// The protocol settings of a collectives connection. With caller progress a rank answers
/// nothing while it computes between collectives, so the idle timeout is stretched to the
/// collective timeout and the retransmission budget to half of it: a rank may stay away that
/// long without its neighbours declaring it dead. Half, so that a dead rank's neighbours that
/// were writing to it fail, and tell the others who failed, before anyone's own timeout fires
/// (which could only name the rank it waits on).
fn link_config(opts: &CommOptions) -> Config {
    let mut config = Config {
        idle_timeout: opts.timeout.max(Duration::from_secs(3)),
        initial_rto: RTO_FLOOR,
        tail_probe_floor: TAIL_PROBE_FLOOR,
        max_rto: Config::default().max_rto.max(Duration::from_millis(500)),
        ..Config::default()
    };
    while config.retry_budget() < opts.timeout / 2 && config.max_retries < 10_000 {
        config.max_retries += 1;
    }
    // A rank may send its first message before its neighbour has posted the receives for it:
    // the neighbour's engine (a thread, in thread progress) answers "not ready" until that
    // neighbour finishes building its channels, which on a busy 2-core machine took longer
    // than the default 7 retries 100 µs apart (RnrRetryExceeded at start-up, seen with
    // --progress thread). Afterwards flow control keeps receives posted, so a long budget only
    // matters then: as long as the retransmission budget, at 1 ms a retry.
    config.rnr_delay = Duration::from_millis(1);
    config.max_rnr_retries = u32::try_from((opts.timeout / 2).as_millis())
        .unwrap_or(u32::MAX)
        .max(7);
    config
}

fn pair_port(opts: &CommOptions, world: usize, lo: usize, hi: usize) -> Option<u16> {
    let offset = lo.checked_mul(world)?.checked_add(hi)?;
    u16::try_from(usize::from(opts.port_base).checked_add(offset)?).ok()
}

/// Connects, retrying while the peer has not started listening yet.
fn connect_retrying(
    pd: &tbrdma_verbs::ProtectionDomain,
    target: SocketAddr,
    cq: &tbrdma_verbs::CompletionQueue,
    opts: &QpOptions,
    deadline: Instant,
) -> tbrdma_verbs::Result<Connected> {
    loop {
        match connect(pd, target, cq, cq, opts) {
            Err(VerbsError::PeerNotListening { .. } | VerbsError::Unreachable { .. })
                if Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}
