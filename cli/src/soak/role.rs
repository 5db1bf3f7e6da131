//! The two roles of `tbrdma soak`, the same workload on both: the server serves one client
//! at a time until a session ends cleanly, the client connects, runs for its duration and
//! reconnects whenever a session fails (the peer killed, a cable gone for too long).
//!
//! A session is `--qps` connections, each with its own region, announced in the connection's
//! private data. Any error completion fails the whole session: nothing new is posted, what is
//! in flight is drained (every error counted by its status), the connections are closed and a
//! new session starts. A session ends cleanly when each lane has sent its DONE and received the
//! peer's.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use serde::{Deserialize, Serialize};
use tbrdma_verbs::{
    Completion, CompletionQueue, Config, Device, Listener, ProtectionDomain, QpOptions, WcStatus,
    connect,
};

use super::SoakArgs;
use super::memory::Memory;
use super::report::{Failure, Tally, injected_faults, unix_ms};
use super::workload::{Lane, RECVS, Scratch, lane_of};
use crate::perf::session::{self, Remote};

/// What each side of a connection announces in its private data.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Announce {
    tool: String,
    /// Lanes of the session (the client decides).
    qps: usize,
    /// This connection's lane.
    lane: usize,
    /// The client's seed (the server derives its own from it).
    seed: u64,
    /// The client's run length, for the server's warm-up point.
    seconds: f64,
    /// The lane's region.
    region: Remote,
}

const TOOL: &str = "soak";

/// How long after a peer vanishes a session's first error completion may come: the retry
/// budget or the idle timeout of the soak's queue pairs, whichever is longer.
pub fn failure_bound() -> Duration {
    let config = qp_config();
    config.retry_budget().max(config.idle_timeout)
}

/// How the session's connections are configured: the defaults (so the failure bounds are
/// the documented ones), but a peer busy verifying a megabyte, or descheduled on a loaded
/// host, is not "not ready" for good: receiver-not-ready retries for up to 5 s.
fn qp_config() -> Config {
    Config {
        rnr_delay: Duration::from_millis(1),
        max_rnr_retries: 5000,
        max_send_wr: 16,
        max_recv_wr: 16,
        ..Config::default()
    }
}

enum Outcome {
    Finished,
    Failed,
}

/// One session: its lanes, their completion queue and protection domain (dropped in that
/// order: the queue pairs close before their regions go).
struct Session {
    lanes: Vec<Lane>,
    cq: CompletionQueue,
    _pd: ProtectionDomain,
}

/// What a role needs while it runs.
struct Run {
    tally: Tally,
    scratch: Scratch,
    started: Instant,
    /// The warm-up: memory is read this long after the first session started.
    warm_after: Duration,
    warm_taken: bool,
    first_session: Option<Instant>,
    last_sample: Instant,
    is_server: bool,
    /// The client's end of measuring.
    deadline: Option<Instant>,
    timeout: Duration,
}

fn device(args: &SoakArgs) -> anyhow::Result<Device> {
    let names: Vec<&str> = args.bind.iter().map(String::as_str).collect();
    if names.is_empty() {
        bail!("--bind ADDR[,ADDR2] is required: the local address of each rail, cable 1 first");
    }
    crate::perf::session::open_rails(&names, args.engine, args.progress)
}

/// Runs one role; prints the human summary on stderr and the JSON line on stdout. Fails when a
/// byte was wrong, memory grew or the last session did not end cleanly.
pub fn run(args: &SoakArgs) -> anyhow::Result<()> {
    session::raise_memlock();
    session::start_measuring();
    let memory_start = Memory::now();
    let dev = device(args)?;
    let config = qp_config();
    let seed = args.seed.unwrap_or_else(|| unix_ms() % 1_000_000);
    let mut run = Run {
        tally: Tally {
            role: if args.serve { "server" } else { "client" }.into(),
            engine: session::engine_summary(&dev),
            seed,
            qps: args.qps,
            memory_start,
            memory_peak: memory_start,
            retry_budget_ms: config.retry_budget().as_millis() as u64,
            idle_timeout_ms: config.idle_timeout.as_millis() as u64,
            ..Tally::default()
        },
        scratch: Scratch::new(),
        started: Instant::now(),
        warm_after: Duration::ZERO,
        warm_taken: false,
        first_session: None,
        last_sample: Instant::now(),
        is_server: args.serve,
        deadline: None,
        timeout: Duration::from_secs_f64(args.timeout.max(0.1)),
    };
    if args.serve {
        serve(args, &dev, &mut run)?;
    } else {
        let peer = args
            .peer
            .as_deref()
            .ok_or_else(|| anyhow!("PEER or --serve is required"))?;
        let server = session::server_addr(peer, args.port)?;
        let seconds = args.duration_secs();
        run.warm_after = warm_up(seconds);
        run.deadline = Some(Instant::now() + Duration::from_secs_f64(seconds));
        eprintln!(
            "soak client: {} QPs to {server} for {seconds} s, seed {seed} ({})",
            args.qps, run.tally.engine
        );
        client(args, &dev, server, seconds, &mut run);
    }
    let tally = &mut run.tally;
    tally.seconds = run.started.elapsed().as_secs_f64();
    if tally.memory_end == Memory::default() {
        tally.close_memory();
    }
    tally.faults = injected_faults();
    eprintln!("{}", tally.human());
    println!(
        "{}",
        serde_json::to_string(&tally).expect("plain data serializes")
    );
    if tally.bytes_wrong > 0 {
        bail!("{} bytes were wrong", tally.bytes_wrong);
    }
    if !tally.memory_flat {
        bail!("memory grew (see the summary)");
    }
    if !tally.finished {
        bail!("the last session did not end cleanly");
    }
    Ok(())
}

/// The memory reading after which growth counts: a tenth of the run, 1 to 30 s in.
fn warm_up(seconds: f64) -> Duration {
    Duration::from_secs_f64((seconds / 10.0).clamp(1.0, 30.0))
}

fn options(announce: &Announce, timeout: Duration) -> QpOptions {
    QpOptions {
        config: qp_config(),
        private_data: serde_json::to_vec(announce).expect("plain data serializes"),
        timeout,
        ..QpOptions::default()
    }
}

fn theirs(data: &[u8]) -> anyhow::Result<Announce> {
    let a: Announce = serde_json::from_slice(data)
        .map_err(|_| anyhow!("the peer is not running `tbrdma soak`"))?;
    if a.tool != TOOL {
        bail!("the peer runs `tbrdma {}`, not `tbrdma soak`", a.tool);
    }
    Ok(a)
}

/// The seed of lane `lane` of session `session` on one side.
fn lane_seed(seed: u64, is_server: bool, session: u64, lane: usize) -> u64 {
    seed ^ (u64::from(is_server) << 63) ^ (session << 32) ^ (lane as u64).wrapping_mul(0x9e37_79b9)
}

fn cq_depth(qps: usize) -> usize {
    qps * (RECVS + 2) + 16
}

fn client(args: &SoakArgs, dev: &Device, server: SocketAddr, seconds: f64, run: &mut Run) {
    loop {
        let give_up = Instant::now() + Duration::from_secs(30);
        let session = loop {
            match connect_session(args, dev, server, seconds, run) {
                Ok(s) => break Some(s),
                Err(e) => {
                    run.tally.connect_failures += 1;
                    if Instant::now() >= give_up {
                        eprintln!("soak client: giving up connecting: {e:#}");
                        break None;
                    }
                    if run.tally.connect_failures % 20 == 1 {
                        eprintln!("soak client: connecting: {e:#} (retrying)");
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        };
        let Some(mut session) = session else { return };
        run.tally.sessions += 1;
        if run.tally.sessions > 1 {
            eprintln!("soak client: reconnected (session {})", run.tally.sessions);
        }
        match drive(&mut session, run) {
            Outcome::Finished => {
                run.tally.finished = true;
                return;
            }
            Outcome::Failed => drop(session),
        }
    }
}

fn connect_session(
    args: &SoakArgs,
    dev: &Device,
    server: SocketAddr,
    seconds: f64,
    run: &Run,
) -> anyhow::Result<Session> {
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(cq_depth(args.qps));
    let mut lanes = Vec::with_capacity(args.qps);
    for lane in 0..args.qps {
        let mr = Lane::region(&pd)?;
        let announce = Announce {
            tool: TOOL.into(),
            qps: args.qps,
            lane,
            seed: run.tally.seed,
            seconds,
            region: Remote::of(&mr),
        };
        let conn = connect(&pd, server, &cq, &cq, &options(&announce, run.timeout))
            .with_context(|| format!("connecting lane {lane} to {server}"))?;
        let peer = theirs(&conn.peer_private_data)?;
        if peer.lane != lane {
            bail!("the server answered lane {lane} as lane {}", peer.lane);
        }
        let seed = lane_seed(run.tally.seed, false, run.tally.sessions, lane);
        lanes.push(Lane::new(lane, conn.qp, mr, peer.region, seed)?);
    }
    Ok(Session { lanes, cq, _pd: pd })
}

fn serve(args: &SoakArgs, dev: &Device, run: &mut Run) -> anyhow::Result<()> {
    let listener = Listener::bind(dev, args.port)?;
    eprintln!(
        "soak server: waiting on {} ({})",
        listener.local_addr()?,
        run.tally.engine
    );
    loop {
        let mut session = match accept_session(dev, &listener, run) {
            Ok(s) => s,
            Err(e) => {
                run.tally.connect_failures += 1;
                eprintln!("soak server: a client failed to connect: {e:#}");
                continue;
            }
        };
        run.tally.sessions += 1;
        eprintln!(
            "soak server: session {} with {} QPs, seed {}",
            run.tally.sessions, run.tally.qps, run.tally.seed
        );
        match drive(&mut session, run) {
            Outcome::Finished => {
                run.tally.finished = true;
                return Ok(());
            }
            Outcome::Failed => drop(session),
        }
    }
}

fn accept_session(dev: &Device, listener: &Listener, run: &mut Run) -> anyhow::Result<Session> {
    let pd = dev.alloc_pd();
    let mut lanes: Vec<Lane> = Vec::new();
    let mut cq: Option<CompletionQueue> = None;
    let mut qps = 1;
    let mut lane = 0;
    while lane < qps {
        let mr = Lane::region(&pd)?;
        let announce = Announce {
            tool: TOOL.into(),
            qps,
            lane,
            seed: run.tally.seed,
            seconds: 0.0,
            region: Remote::of(&mr),
        };
        // The first connection tells how many follow; its queue is sized for the most the
        // client may ask (checked below), so that one queue serves every lane.
        let queue = cq.get_or_insert_with(|| dev.create_cq(cq_depth(super::MAX_QPS)));
        let wait = (lane > 0).then_some(run.timeout);
        let conn = listener.accept(&pd, queue, queue, &options(&announce, run.timeout), wait)?;
        let peer = theirs(&conn.peer_private_data)?;
        if lane == 0 {
            if peer.qps == 0 || peer.qps > super::MAX_QPS {
                bail!(
                    "the client asks for {} QPs (1 to {})",
                    peer.qps,
                    super::MAX_QPS
                );
            }
            qps = peer.qps;
            run.tally.qps = qps;
            run.tally.seed = peer.seed;
            if run.warm_after.is_zero() {
                run.warm_after = warm_up(peer.seconds);
            }
        }
        if peer.lane != lane {
            bail!("the client sent lane {} as connection {lane}", peer.lane);
        }
        let seed = lane_seed(run.tally.seed, true, run.tally.sessions, lane);
        let mut l = Lane::new(lane, conn.qp, mr, peer.region, seed)?;
        l.stop_on_peer_done = true;
        lanes.push(l);
        lane += 1;
    }
    Ok(Session {
        lanes,
        cq: cq.expect("one connection at least"),
        _pd: pd,
    })
}

/// Runs a session until it ends cleanly or fails (then drained).
fn drive(session: &mut Session, run: &mut Run) -> Outcome {
    let mut buf = vec![Completion::default(); 64];
    let mut failing: Option<Instant> = None;
    let mut idle = 0u32;
    let drain_for = Duration::from_millis(run.tally.retry_budget_ms + run.tally.idle_timeout_ms)
        + Duration::from_secs(2);
    let session_started = Instant::now();
    run.first_session.get_or_insert(session_started);
    loop {
        let now = Instant::now();
        sample_memory(run, now);
        if !run.is_server && (run.deadline.is_some_and(|d| now >= d) || session::interrupted()) {
            for lane in &mut session.lanes {
                lane.stop = true;
            }
        }
        let n = match session.cq.poll(&mut buf) {
            Ok(n) => n,
            Err(e) => {
                fail(run, &mut failing, "poll", &e.to_string());
                0
            }
        };
        for c in &buf[..n] {
            let wc = c.wc;
            let Some(lane) = session.lanes.get_mut(lane_of(wc.wr_id)) else {
                run.tally.error("unknown_completion");
                continue;
            };
            if wc.status != WcStatus::Success {
                let kind = format!("{:?}", wc.status);
                run.tally.error(&kind);
                lane.on_error(&wc);
                if failing.is_none() {
                    let since = session_started.elapsed();
                    fail(
                        run,
                        &mut failing,
                        &kind,
                        &format!("after {since:.1?} in the session"),
                    );
                }
                continue;
            }
            if let Err(e) =
                lane.on_success(&wc, &mut run.tally, &mut run.scratch, failing.is_none())
            {
                fail(run, &mut failing, "post", &format!("{e:#}"));
            }
        }
        let mut posted = false;
        if failing.is_none() {
            for lane in &mut session.lanes {
                match lane.step(&mut run.scratch) {
                    Ok(p) => posted |= p,
                    Err(e) => {
                        fail(run, &mut failing, "post", &format!("{e:#}"));
                        break;
                    }
                }
            }
        }
        match failing {
            Some(since) if session.lanes.iter().all(Lane::quiet) || since.elapsed() > drain_for => {
                let left: usize = session.lanes.iter().map(Lane::outstanding).sum();
                eprintln!(
                    "soak {}: session failed; drained in {:.1?} ({left} receives dropped with their queue pairs)",
                    run.tally.role,
                    since.elapsed()
                );
                if since.elapsed() > drain_for {
                    // The documented bound says every request and receive of a failed
                    // connection completes within this: name what did not.
                    run.tally.error("not_flushed_in_time");
                    for lane in session.lanes.iter().filter(|l| !l.quiet()) {
                        eprintln!("soak {}: NOT FLUSHED: {}", run.tally.role, lane.describe());
                    }
                }
                return Outcome::Failed;
            }
            Some(_) => {}
            None if session.lanes.iter().all(Lane::finished) => {
                // The last acknowledgements reach the peer before the connections close.
                let until = Instant::now() + Duration::from_millis(100);
                while Instant::now() < until {
                    let _ = session.cq.poll(&mut buf);
                    std::thread::yield_now();
                }
                run.tally.close_memory();
                return Outcome::Finished;
            }
            None => {}
        }
        if n == 0 && !posted {
            idle += 1;
            // Caller progress: the poll above runs the engine, so spin a little, then let the
            // peer process (and everything else on a small host) have the core.
            if idle >= 16 {
                std::thread::yield_now();
            }
        } else {
            idle = 0;
        }
    }
}

fn fail(run: &mut Run, failing: &mut Option<Instant>, kind: &str, detail: &str) {
    if kind == "poll" || kind == "post" {
        run.tally.error(kind);
    }
    if failing.is_none() {
        *failing = Some(Instant::now());
        run.tally.failures.push(Failure {
            at_unix_ms: unix_ms(),
            first: kind.to_string(),
        });
        eprintln!(
            "soak {}: session failing: {kind} ({detail})",
            run.tally.role
        );
    }
}

fn sample_memory(run: &mut Run, now: Instant) {
    if now.duration_since(run.last_sample) < Duration::from_secs(1) {
        return;
    }
    run.last_sample = now;
    let m = Memory::now();
    run.tally.memory_peak = run.tally.memory_peak.max(m);
    if !run.warm_taken
        && !run.warm_after.is_zero()
        && run
            .first_session
            .is_some_and(|t| now.duration_since(t) >= run.warm_after)
    {
        run.warm_taken = true;
        run.tally.memory_warm = m;
    }
}
