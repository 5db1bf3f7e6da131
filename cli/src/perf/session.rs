//! What `pingpong` and `bw` share: opening the device, connecting (or serving one client) with
//! the run's options and memory regions as private data, refusing a peer whose options differ,
//! polling completions with a stall timeout and Ctrl-C, and the end-of-phase DONE message.
//! It measures nothing and prints only diagnostics, on stderr.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use serde::{Deserialize, Serialize};
use tbrdma_verbs::{
    Access, Completion, CompletionQueue, Config, Device, DeviceConfig, EngineConfig, EngineKind,
    Listener, MemoryRegion, Progress, ProtectionDomain, QpOptions, QueuePair, RecvWr, RemoteAddr,
    SendOp, SendWr, VerbsError, WcStatus, WorkCompletion, connect,
};

use crate::perf::options::{Agreed, ConnectArgs, EngineArg, Measures, ProgressArg, differences};

/// Set by Ctrl-C while a measurement runs; the loops stop and print what they have.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Whether a measurement is running (otherwise Ctrl-C exits at once).
static MEASURING: AtomicBool = AtomicBool::new(false);

/// Immediate data of the DONE message that ends a phase.
pub const DONE_IMM: u32 = 0x7462_444e;
/// `wr_id` bit of control receives and sends.
pub const CONTROL: u64 = 1 << 63;
/// Numbers a DONE message carries.
pub const DONE_WORDS: usize = 5;
/// Bytes of a DONE message: little-endian u64s.
pub const DONE_LEN: usize = DONE_WORDS * 8;
const CONTROL_SLOT: usize = 64;
/// Control receives posted per connection.
const CONTROL_RECVS: usize = 2;

/// The error a loop returns when Ctrl-C stopped it.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted by Ctrl-C")
    }
}

impl std::error::Error for Interrupted {}

/// Whether Ctrl-C was pressed during a measurement.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// Installs the Ctrl-C handler: during a measurement the first press stops it (the tool prints
/// what it measured); otherwise, or on a second press, the process exits at once.
pub fn install_ctrl_c() {
    let _ = ctrlc::set_handler(|| {
        if MEASURING.load(Ordering::Relaxed) && !INTERRUPTED.swap(true, Ordering::Relaxed) {
            return;
        }
        eprintln!("tbrdma: interrupted");
        std::process::exit(130);
    });
}

/// Marks the start of measuring (Ctrl-C now prints partial results).
pub fn start_measuring() {
    MEASURING.store(true, Ordering::Relaxed);
}

/// Raises the soft RLIMIT_MEMLOCK to the hard limit: registered memory is pinned, and the
/// usual soft default (8 MiB) is less than a sweep needs. Failure is not an error here: the
/// allocation that needs more says so, with the fix.
pub fn raise_memlock() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_MEMLOCK)
        && soft < hard
    {
        let _ = setrlimit(Resource::RLIMIT_MEMLOCK, hard, hard);
    }
}

/// Resolves SERVER (an IP or a host name) with the port.
pub fn server_addr(server: &str, port: u16) -> anyhow::Result<SocketAddr> {
    let mut addrs = (server, port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve server {server:?}"))?;
    let all: Vec<SocketAddr> = addrs.by_ref().collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| anyhow!("server {server:?} has no address"))
}

/// The local address the kernel routes `to` from: connecting a UDP socket sends nothing.
fn route_source(to: SocketAddr) -> anyhow::Result<IpAddr> {
    let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let socket = UdpSocket::bind(any).context("opening a socket for the route lookup")?;
    socket.connect(to).map_err(|e| {
        anyhow!(
            "cannot reach {to}: {e} (no route; is the link up and addressed? `tbrdma doctor` checks)"
        )
    })?;
    Ok(socket.local_addr()?.ip())
}

/// Which local address or interface to open: `--bind`, `--iface`, the route to the server, or
/// (server without either) the first link `tbrdma devices` finds with an address.
fn local_name(args: &ConnectArgs, server: Option<SocketAddr>) -> anyhow::Result<String> {
    if let Some(ip) = &args.bind {
        return Ok(ip.clone());
    }
    if let Some(iface) = &args.iface {
        return Ok(iface.clone());
    }
    if let Some(server) = server {
        return Ok(route_source(server)?.to_string());
    }
    crate::perf::devices::default_listen_address()
        .map(|ip| ip.to_string())
        .ok_or_else(|| {
            anyhow!("no link with an IPv4 address to listen on: pass --bind IP or --iface NAME (see `tbrdma devices`)")
        })
}

/// Opens the device for this run; with `rails`, over every link to the same peer.
pub fn open_device(
    args: &ConnectArgs,
    server: Option<SocketAddr>,
    rails: bool,
    measures: Measures,
) -> anyhow::Result<Device> {
    let name = local_name(args, server)?;
    let names = if rails {
        crate::perf::devices::rails_with(&name)?
    } else {
        vec![name]
    };
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let engine = EngineArg::or_default_for(args.engine, args.progress, measures);
    open_rails(&names, engine, args.progress)
}

/// Opens a device over the links `names` (cable 1 first) with the engine and progress asked.
pub fn open_rails(
    names: &[&str],
    engine: EngineArg,
    progress: ProgressArg,
) -> anyhow::Result<Device> {
    let engine = EngineConfig {
        engine: match engine {
            EngineArg::Uring => EngineKind::Uring,
            EngineArg::Sockets => EngineKind::Sockets,
            EngineArg::Packet => EngineKind::Packet,
        },
        progress: match progress {
            ProgressArg::Caller => Progress::Caller,
            ProgressArg::Thread => Progress::Thread,
        },
        ..EngineConfig::default()
    };
    Ok(Device::open_rails(names, DeviceConfig { engine, port: 0 })?)
}

/// The engine actually running, for stderr: `uring, caller progress` (and why not io_uring).
pub fn engine_summary(dev: &Device) -> String {
    let progress = match dev.progress_mode() {
        Progress::Caller => "caller",
        Progress::Thread => "thread",
    };
    let rails = match dev.rails() {
        1 => String::new(),
        n => format!(", {n} rails"),
    };
    let digests = if dev.asks_data_digest() {
        ", data digests"
    } else {
        ""
    };
    format!(
        "engine {}, {progress} progress{rails}{digests}{}",
        dev.engine_kind().name(),
        dev.engine_fallback()
            .map(|why| format!("; io_uring unavailable: {why}"))
            .unwrap_or_default()
    )
}

/// A region the peer may access, as announced in the private data.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Remote {
    /// Address of its first byte.
    pub addr: u64,
    /// Its rkey.
    pub rkey: u32,
}

impl Remote {
    /// Of a local region.
    pub fn of(mr: &MemoryRegion) -> Remote {
        Remote {
            addr: mr.addr(),
            rkey: mr.rkey(),
        }
    }

    /// The byte at `offset`.
    pub fn at(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr + offset as u64,
            rkey: self.rkey,
        }
    }
}

/// What each side tells the other while connecting.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Announce {
    /// `pingpong` or `bw`.
    pub tool: String,
    /// The options that must agree.
    pub options: Agreed,
    /// Regions the peer may access.
    pub regions: Vec<Remote>,
}

/// One connection and its completion queue; completions polled but not yet consumed wait in
/// `backlog` (a phase may end in the middle of a batch).
#[derive(Debug)]
pub struct Link {
    /// The queue pair.
    pub qp: QueuePair,
    cq: CompletionQueue,
    backlog: VecDeque<WorkCompletion>,
    buf: [Completion; 1],
}

impl Link {
    /// The next completion, if one is there. A failed one is an error that says why.
    ///
    /// Polls one at a time, so that every completion taken is a poll, which runs the engine when
    /// it is overdue (`CompletionQueue::poll`): a tool that works on each completion (`bw
    /// --verify` checks every SEND where it landed) keeps acknowledging what arrives meanwhile.
    pub fn next(&mut self) -> anyhow::Result<Option<WorkCompletion>> {
        // (A completion polled now is returned as it is, without passing through the backlog:
        // this runs on every spin of every timed wait.)
        let wc = match self.backlog.pop_front() {
            Some(wc) => wc,
            None if self.cq.poll(&mut self.buf)? == 0 => return Ok(None),
            None => self.buf[0].wc,
        };
        if wc.status != WcStatus::Success {
            return Err(failed(&wc));
        }
        Ok(Some(wc))
    }

    /// Puts a completion back, to be returned first by the next [`Link::next`].
    pub fn unpoll(&mut self, wc: WorkCompletion) {
        self.backlog.push_front(wc);
    }
}

fn failed(wc: &WorkCompletion) -> anyhow::Error {
    let why = match wc.status {
        WcStatus::RetryExceeded => "the peer stopped answering (peer gone or link down)",
        WcStatus::RnrRetryExceeded => "the peer posted no receive in time",
        WcStatus::Flushed => "the connection failed (the peer closed it or stopped answering)",
        WcStatus::RemoteAccess => "the peer refused the access (bad key or bounds)",
        _ => "see docs/semantics.md",
    };
    anyhow!("{:?} request failed with {:?}: {why}", wc.opcode, wc.status)
}

/// Watches a wait: fails it after `timeout` without progress, stops it on Ctrl-C. The clock
/// is read only every 256 idle spins: a wait that ends sooner (every ping-pong message on a
/// healthy link) reads it never, where two reads per message cost ~50 ns of each side's
/// critical path on a VM's clock.
#[derive(Debug)]
pub struct Watch {
    timeout: Duration,
    /// When the first 256 idle spins since the start or the last progress were done.
    since: Option<Instant>,
    spins: u32,
}

impl Watch {
    /// Starts watching.
    pub fn new(timeout: Duration) -> Watch {
        Watch {
            timeout,
            since: None,
            spins: 0,
        }
    }

    /// Something happened: the timeout restarts.
    pub fn progressed(&mut self) {
        self.since = None;
        self.spins = 0;
    }

    /// Call on every idle spin; `what` describes what is awaited.
    pub fn check(&mut self, what: impl FnOnce() -> String) -> anyhow::Result<()> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins % 256 != 0 {
            return Ok(());
        }
        if interrupted() {
            return Err(Interrupted.into());
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() >= self.timeout {
            bail!(
                "timed out after {} seconds {} (is the other side still running?)",
                secs(self.timeout),
                what()
            );
        }
        Ok(())
    }
}

/// Seconds as the user typed them: `10`, `0.5`.
pub fn secs(d: Duration) -> String {
    format!("{}", (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

/// One side of a run, connected.
#[derive(Debug)]
pub struct Session {
    /// Whether this side listened.
    pub is_server: bool,
    /// The connections (one unless `--qps`).
    pub links: Vec<Link>,
    /// What the peer announced.
    pub peer: Announce,
    /// Stall timeout.
    pub timeout: Duration,
    control: MemoryRegion,
}

/// How to connect.
#[derive(Debug)]
pub struct Setup<'a> {
    /// Connection options.
    pub args: &'a ConnectArgs,
    /// Server's address (client only).
    pub server: Option<SocketAddr>,
    /// Connections to make.
    pub qps: usize,
    /// Completion-queue depth per connection.
    pub cq_depth: usize,
    /// Send-queue depth per connection.
    pub send_depth: usize,
    /// Receive-queue depth per connection.
    pub recv_depth: usize,
    /// Whether to post receives for DONE messages. Receives are consumed in the order they
    /// were posted, so a tool whose data arrives by SEND takes DONE in its data slots instead.
    pub control_recvs: bool,
    /// Whether receive completions carry their message's CRC-32C
    /// (`tbrdma_verbs::Config::message_crc`).
    pub message_crc: bool,
    /// What to announce.
    pub announce: Announce,
}

fn explain_connect(e: VerbsError, timeout: Duration, elapsed: Duration) -> anyhow::Error {
    match e {
        VerbsError::Handshake { peer, .. } if elapsed + Duration::from_millis(50) >= timeout => {
            anyhow!(
                "timed out after {} seconds: {peer} accepted the connection but sent no tbrdma answer (is `tbrdma` serving there?)",
                secs(timeout)
            )
        }
        VerbsError::Unreachable { addr, detail } if detail.starts_with("no answer within") => {
            anyhow!(
                "timed out after {} seconds connecting to {addr}: no answer (is the link up and addressed? `tbrdma doctor` checks)",
                secs(timeout)
            )
        }
        other => other.into(),
    }
}

impl Session {
    /// The first region the peer announced (the target of one-sided operations).
    pub fn peer_region(&self) -> anyhow::Result<Remote> {
        self.peer
            .regions
            .first()
            .copied()
            .ok_or_else(|| anyhow::anyhow!("the peer announced no memory region"))
    }

    /// Serves one client (no server address) or connects to the server, `setup.qps` times,
    /// and checks that the peer runs the same tool with the same options.
    pub fn connect(
        dev: &Device,
        pd: &ProtectionDomain,
        setup: Setup<'_>,
    ) -> anyhow::Result<Session> {
        let timeout = setup.args.timeout();
        let control = pd.alloc_mr(
            CONTROL_SLOT * (CONTROL_RECVS + 1) * setup.qps,
            Access::LOCAL_WRITE,
        )?;
        let retries_for_timeout = (timeout.as_micros() / 100).clamp(7, u32::MAX as u128) as u32;
        let opts = QpOptions {
            config: Config {
                max_send_wr: setup.send_depth.max(16),
                max_recv_wr: setup.recv_depth.max(16),
                rnr_delay: Duration::from_micros(100),
                // A peer still setting up (or verifying a large payload) is not a failure.
                max_rnr_retries: retries_for_timeout,
                message_crc: setup.message_crc,
                ..Config::default()
            },
            private_data: serde_json::to_vec(&setup.announce).expect("plain data serializes"),
            timeout,
            ..QpOptions::default()
        };
        let mut links = Vec::with_capacity(setup.qps);
        let mut peer: Option<Announce> = None;
        let listener = match setup.server {
            Some(_) => None,
            None => {
                let l = Listener::bind(dev, setup.args.port)?;
                eprintln!(
                    "waiting for a client on {} ({})",
                    l.local_addr()?,
                    engine_summary(dev)
                );
                Some(l)
            }
        };
        for i in 0..setup.qps {
            let cq = dev.create_cq(setup.cq_depth);
            let started = Instant::now();
            let conn = match (&listener, setup.server) {
                (Some(l), _) => {
                    let wait = (i > 0).then_some(timeout);
                    l.accept(pd, &cq, &cq, &opts, wait)?
                }
                (None, Some(server)) => connect(pd, server, &cq, &cq, &opts)
                    .map_err(|e| explain_connect(e, timeout, started.elapsed()))?,
                (None, None) => unreachable!("a server address or a listener"),
            };
            let theirs: Announce =
                serde_json::from_slice(&conn.peer_private_data).map_err(|_| {
                    anyhow!(
                        "the peer at {} is not running `tbrdma {}`",
                        conn.peer,
                        setup.announce.tool
                    )
                })?;
            if peer.is_none()
                && let Err(e) = check_agreement(&setup.announce, &theirs, setup.server.is_none())
            {
                if listener.is_some() {
                    // The client checks too, once its connection is up: closing at once would
                    // leave it with "connection closed" instead of the differing options.
                    wait_for_close(dev, &conn.qp, timeout);
                }
                return Err(e);
            }
            peer.get_or_insert(theirs);
            links.push(Link {
                qp: conn.qp,
                cq,
                backlog: VecDeque::new(),
                buf: [Completion::default(); 1],
            });
        }
        if let Some(server) = setup.server {
            eprintln!(
                "connected to {server} from {} ({})",
                dev.ip(),
                engine_summary(dev)
            );
        }
        let session = Session {
            is_server: setup.server.is_none(),
            links,
            peer: peer.expect("at least one connection"),
            timeout,
            control,
        };
        for (i, link) in session.links.iter().enumerate() {
            if !setup.control_recvs {
                break;
            }
            for slot in 0..CONTROL_RECVS {
                session.post_control_recv(link, i * CONTROL_RECVS + slot)?;
            }
        }
        Ok(session)
    }

    /// Posts a control receive (DONE messages) into control slot `slot`.
    pub fn post_control_recv(&self, link: &Link, slot: usize) -> anyhow::Result<()> {
        link.qp.post_recv(&[RecvWr {
            wr_id: CONTROL | slot as u64,
            local: self.control.sge(slot * CONTROL_SLOT, CONTROL_SLOT),
        }])?;
        Ok(())
    }

    /// Reads the DONE message a control receive `wc` delivered, and reposts the receive.
    pub fn take_control(
        &self,
        link_index: usize,
        wc: &WorkCompletion,
    ) -> anyhow::Result<[u64; DONE_WORDS]> {
        let slot = (wc.wr_id & !CONTROL) as usize;
        let mut raw = [0u8; DONE_LEN];
        self.control.read(slot * CONTROL_SLOT, &mut raw);
        self.post_control_recv(&self.links[link_index], slot)?;
        Ok(done_words(&raw))
    }

    /// Sends DONE with its numbers on connection `link_index`.
    pub fn send_done(&self, link_index: usize, words: [u64; DONE_WORDS]) -> anyhow::Result<()> {
        let offset = CONTROL_SLOT * (CONTROL_RECVS * self.links.len() + link_index);
        let mut raw = [0u8; DONE_LEN];
        for (chunk, w) in raw.chunks_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        self.control.write(offset, &raw);
        self.links[link_index].qp.post_send(&[SendWr {
            wr_id: CONTROL | link_index as u64,
            local: self.control.sge(offset, DONE_LEN),
            op: SendOp::Send {
                imm: Some(DONE_IMM),
            },
        }])?;
        Ok(())
    }

    /// After the last phase: keeps the engine running briefly so the final acknowledgements
    /// reach the peer before the connections close.
    pub fn linger(&mut self) {
        let until = Instant::now() + Duration::from_millis(50);
        while Instant::now() < until {
            for link in &mut self.links {
                let _ = link.next();
            }
        }
    }
}

/// Runs the engine until the peer closes `qp` or `timeout` passes.
fn wait_for_close(dev: &Device, qp: &QueuePair, timeout: Duration) {
    let until = Instant::now() + timeout;
    while Instant::now() < until && qp.state() == tbrdma_verbs::ConnectionState::Established {
        let _ = dev.progress();
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The numbers of a DONE message.
pub fn done_words(raw: &[u8]) -> [u64; DONE_WORDS] {
    let mut words = [0u64; DONE_WORDS];
    for (w, chunk) in words.iter_mut().zip(raw.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
    words
}

fn check_agreement(mine: &Announce, theirs: &Announce, i_am_server: bool) -> anyhow::Result<()> {
    if mine.tool != theirs.tool {
        bail!(
            "the peer runs `tbrdma {}`, this side `tbrdma {}`: run the same command on both",
            theirs.tool,
            mine.tool
        );
    }
    let (server, client) = if i_am_server {
        (&mine.options, &theirs.options)
    } else {
        (&theirs.options, &mine.options)
    };
    let diff = differences(server, client);
    if !diff.is_empty() {
        bail!(
            "server and client options differ: {}; run both with the same options",
            diff.join(", ")
        );
    }
    Ok(())
}
