//! The connection manager (like `rdma_cm`): a TCP side channel on which the two sides swap
//! their data-socket endpoints, queue pair numbers, a random session token and optional
//! private data; then the protocol's own CONNECT/ACCEPT handshake runs over the link.
//!
//! The listener binds to the link's address (the device's), not to every interface, unless the
//! caller binds it elsewhere explicitly. It serves clients concurrently, at both steps of their
//! setup, each within one total deadline (`QpOptions::timeout`) from its arrival:
//!
//! - Each client's authentication and hello are read on a thread of its own, so a stranger
//!   that connects and sends nothing, trickles bytes or sends garbage is dropped (and logged)
//!   while the real peer's setup goes ahead. At most [`MAX_PENDING`] clients are read at once;
//!   one more closes the one that has waited longest (a real peer's hello takes a round trip, a
//!   stranger's hold lasts until its deadline, so a flood of strangers mostly evicts itself).
//! - A client whose hello arrived is answered at once: its connection is added to the engine
//!   (with a small completion queue of the listener's own) and the welcome sent, and it becomes
//!   a *candidate* while its handshake over the link runs. `accept` watches every candidate,
//!   and takes new clients, while it drives the engine; the first whose handshake completes is
//!   handed to the caller's completion queues and returned. So a client that speaks the
//!   protocol (possible without a cluster secret) and never shakes hands over the link holds
//!   nobody up: it is dropped at its deadline and logged. At most [`MAX_CANDIDATES`] are kept;
//!   one more drops the oldest still shaking hands. Candidates an `accept` leaves (a second
//!   client that connected at the same time) wait for the next one, and go with the listener.
//!
//! Before the first frame both sides run the cluster-secret handshake of `tbrdma-auth`
//! (`QpOptions::auth`, by default `TBRDMA_SECRET` / `TBRDMA_SECRET_FILE`): with a secret set, a
//! host without it, or with another one, is refused with a message naming the setting.
//!
//! Side-channel frames: a 4-byte little-endian length, then `"tbCM"`, version (u16), kind
//! (u8: 1 hello, 2 welcome, 3 reject), the number of rails (u8, 1 to 8) and the sender's data
//! socket on each (16-byte IPv6 or IPv4-mapped address, u16 port), queue pair number (u32),
//! largest datagram (u32), session token (u64, welcome only; zero otherwise), private-data
//! length (u32) and bytes, then how the sender carries datagrams (u8, [`Carrier`]; absent
//! from builds that predate the packet engine). A reject carries a UTF-8 message as its
//! private data. A connection uses as many rails as the side with fewer has, pairing them in
//! order.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use tbrdma_auth::{Auth, DeadlineStream};

use tbrdma_engine::worker::{NewConnection, random_u64};
use tbrdma_proto::codec::{Put, Reader, SOCKET_ADDR_LEN, SliceWriter};
use tbrdma_proto::connection::ConnectParams;
use tbrdma_proto::{Config, ConnectionState, Event, Psn};

use crate::device::{CompletionQueue, Device};
use crate::error::{Result, VerbsError};
use crate::pd::ProtectionDomain;
use crate::qp::QueuePair;

const MAGIC: &[u8; 4] = b"tbCM";
const VERSION: u16 = 1;
const MAX_PRIVATE: usize = 64 * 1024;
/// Bytes of a frame body with one rail and no private data.
const HEADER_LEN: usize = 46;
/// Most rails a frame may list.
const MAX_RAILS: usize = 8;
/// Most clients a listener reads hellos from at once; one more closes the oldest.
pub const MAX_PENDING: usize = 64;
/// Names the side channel in the authentication tags (see `tbrdma-auth`).
const AUTH_CONTEXT: &str = "tbrdma-cm";
/// Refusals a listener remembers for its timeout message.
const REMEMBERED_REFUSALS: usize = 4;
/// Most clients a listener keeps answered and shaking hands over the link (its candidates); one
/// more drops the oldest not yet connected.
pub const MAX_CANDIDATES: usize = 16;
/// What a listener's completion queue for its candidates holds (none ever completes there: a
/// candidate has no work posted).
const CANDIDATE_CQ: usize = 16;

/// Options for a new connection.
#[derive(Clone, Debug)]
pub struct QpOptions {
    /// Protocol configuration (window, retry budget, keep-alive, queue depths).
    pub config: Config,
    /// Bytes handed to the peer during setup (rdma_cm private data: rkeys, addresses, …).
    pub private_data: Vec<u8>,
    /// Longest the whole setup may take (and, on the listener, the longest a client may take
    /// to authenticate and send its hello).
    pub timeout: Duration,
    /// The cluster secret side channels authenticate with (default: the environment's
    /// `TBRDMA_SECRET` / `TBRDMA_SECRET_FILE`, none when unset).
    pub auth: Auth,
}

impl Default for QpOptions {
    fn default() -> Self {
        QpOptions {
            config: Config::default(),
            private_data: Vec::new(),
            timeout: Duration::from_secs(5),
            auth: Auth::default(),
        }
    }
}

/// A connected queue pair and what the peer sent along.
#[derive(Debug)]
pub struct Connected {
    /// The queue pair.
    pub qp: QueuePair,
    /// The peer's private data.
    pub peer_private_data: Vec<u8>,
    /// The peer's data socket.
    pub peer: SocketAddr,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Frame {
    kind: u8,
    data_addrs: Vec<SocketAddr>,
    qp_num: u32,
    max_datagram: u32,
    token: u64,
    private: Vec<u8>,
    /// How the sender carries datagrams.
    carrier: Carrier,
}

/// How a side carries its datagrams: one byte after a setup message's private data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Carrier {
    /// UDP only: the sockets and io_uring engines (and a message without the byte, from a
    /// build that predates the packet engine; or a value this build does not know).
    Udp = 0,
    /// Ethernet frames only: the packet engine of builds before it also spoke UDP.
    FramesOnly = 1,
    /// The packet engine: frames to peers that take them on its link, UDP to the others, and
    /// both received.
    Frames = 2,
}

impl Carrier {
    fn of(device: &Device) -> Carrier {
        if device.carries_frames() {
            Carrier::Frames
        } else {
            Carrier::Udp
        }
    }

    fn from_byte(byte: Option<u8>) -> Carrier {
        match byte {
            Some(1) => Carrier::FramesOnly,
            Some(2) => Carrier::Frames,
            _ => Carrier::Udp,
        }
    }
}

/// Whether this side may send the peer Ethernet frames, given how each carries datagrams; or,
/// when the two would never hear each other (a UDP side and an older frames-only peer), the
/// refusal's detail.
fn peer_takes_frames(ours: Carrier, theirs: Carrier) -> std::result::Result<bool, String> {
    match (ours, theirs) {
        (Carrier::Udp, Carrier::FramesOnly) | (Carrier::FramesOnly, Carrier::Udp) => Err(
            "one side sends datagrams only as Ethernet frames (the packet engine of an older tbrdma) and the other only over UDP (the sockets or io_uring engine): use the same tbrdma version on both hosts, or the same engine"
                .into(),
        ),
        (Carrier::Udp, _) | (_, Carrier::Udp) => Ok(false),
        _ => Ok(true),
    }
}

fn write_frame(stream: &mut impl Write, f: &Frame) -> std::io::Result<()> {
    stream.write_all(&encode_frame(f))?;
    stream.flush()
}

/// A frame as it goes on the stream: the body's length, then the body.
pub(crate) fn encode_frame(f: &Frame) -> Vec<u8> {
    let rails = &f.data_addrs[..f.data_addrs.len().min(MAX_RAILS)];
    let mut out = Vec::with_capacity(4 + 48 + f.private.len());
    out.put_u32(0); // The body's length, filled in below.
    out.put_bytes(MAGIC);
    out.put_u16(VERSION);
    out.put_u8(f.kind);
    out.put_u8(rails.len() as u8);
    for &addr in rails {
        out.put_socket_addr(addr);
    }
    out.put_u32(f.qp_num);
    out.put_u32(f.max_datagram);
    out.put_u64(f.token);
    out.put_u32(f.private.len() as u32);
    out.put_bytes(&f.private);
    out.put_u8(f.carrier as u8);
    let body_len = (out.len() - 4) as u32;
    SliceWriter::new(&mut out[..4]).put_u32(body_len);
    out
}

fn read_frame(stream: &mut impl Read, peer: &str) -> Result<Frame> {
    let bad = |detail: &str| VerbsError::Handshake {
        peer: peer.to_string(),
        detail: detail.to_string(),
    };
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .map_err(|e| bad(&format!("reading the setup message: {e}")))?;
    let len = u32::from_le_bytes(len) as usize;
    if !(HEADER_LEN..=HEADER_LEN + SOCKET_ADDR_LEN * (MAX_RAILS - 1) + MAX_PRIVATE + 1)
        .contains(&len)
    {
        return Err(bad("not a tbrdma connection manager (bad frame length)"));
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|e| bad(&format!("reading the setup message: {e}")))?;
    decode_frame(&body).map_err(|detail| bad(&detail))
}

/// Parses a frame body (everything after the length), whatever the peer sent: the error is
/// the detail of a handshake failure.
pub(crate) fn decode_frame(body: &[u8]) -> std::result::Result<Frame, String> {
    let truncated = || "setup message truncated".to_string();
    let mut r = Reader::new(body);
    if r.bytes(MAGIC.len()) != Some(MAGIC) {
        return Err("not a tbrdma connection manager (bad magic)".into());
    }
    let version = r.u16().ok_or_else(truncated)?;
    if version != VERSION {
        return Err(format!(
            "peer speaks connection-manager version {version}, this build {VERSION}: use the same tbrdma version on both hosts"
        ));
    }
    let kind = r.u8().ok_or_else(truncated)?;
    let rails = usize::from(r.u8().ok_or_else(truncated)?);
    if rails == 0 || rails > MAX_RAILS {
        return Err("a setup message must list 1 to 8 rails".into());
    }
    let data_addrs = (0..rails)
        .map(|_| r.socket_addr())
        .collect::<Option<Vec<_>>>()
        .ok_or_else(truncated)?;
    let qp_num = r.u32().ok_or_else(truncated)?;
    let max_datagram = r.u32().ok_or_else(truncated)?;
    let token = r.u64().ok_or_else(truncated)?;
    let plen = r.u32().ok_or_else(truncated)? as usize;
    let private = r
        .bytes(plen)
        .ok_or_else(|| "private data truncated".to_string())?
        .to_vec();
    let carrier = Carrier::from_byte(r.u8());
    Ok(Frame {
        kind,
        data_addrs,
        qp_num,
        max_datagram,
        token,
        private,
        carrier,
    })
}

fn config_for(device: &Device, opts: &QpOptions) -> Config {
    let mut config = opts.config.clone();
    config.max_datagram = config
        .max_datagram
        .min(device.inner.engine.config().max_datagram);
    // Never advertise more than the socket buffer holds: the kernel would drop the excess.
    let limit = device.inner.engine.window_limit(config.max_datagram);
    config.window = config.window.min(limit);
    // Caller progress: acknowledgements wait for the application's next poll (engine docs).
    config.ack_hold = device.inner.engine.ack_hold_for(config.ack_hold);
    config
}

/// Who the new connection talks to, as agreed on the side channel.
struct Agreed {
    /// Whether this side sends CONNECT (the client).
    active: bool,
    qp_num: u32,
    remote_qpn: u32,
    token: u64,
    /// The peer's data socket on each rail.
    peers: Vec<SocketAddr>,
    /// This side may send the peer Ethernet frames.
    peer_takes_frames: bool,
}

/// Adds the connection to the engine (not yet established). The passive side does this before
/// answering, so the client's CONNECT always finds it.
fn register(
    pd: &ProtectionDomain,
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
    opts: &QpOptions,
    mut agreed: Agreed,
) -> Result<QueuePair> {
    let device = &pd.device;
    // Rails pair up in order; the side with fewer decides how many are used.
    agreed.peers.truncate(device.rails());
    let params = ConnectParams {
        token: agreed.token,
        local_qpn: agreed.qp_num,
        remote_qpn: agreed.remote_qpn,
        initial_psn: Psn(random_u64() as u32),
    };
    let config = config_for(device, opts);
    device
        .inner
        .engine
        .add_connection(NewConnection {
            config,
            active: agreed.active,
            params,
            peers: agreed.peers,
            peer_takes_frames: agreed.peer_takes_frames,
            pd: pd.id,
            send_cq: send_cq.shared.clone(),
            recv_cq: recv_cq.shared.clone(),
        })
        .map_err(VerbsError::io("starting the connection"))?;
    Ok(QueuePair {
        device: device.clone(),
        pd: pd.clone(),
        qp_num: agreed.qp_num,
    })
}

/// Drives the engine until the protocol handshake over the link completes or fails.
fn wait_established(qp: QueuePair, peer: SocketAddr, deadline: Instant) -> Result<QueuePair> {
    loop {
        let _ = qp.device.progress();
        match qp.state() {
            ConnectionState::Established => return Ok(qp),
            ConnectionState::Connecting => {}
            // With background progress a fast peer may connect, finish one-sided work and close
            // before this loop looks: the connection was made, so setup succeeded; the caller
            // sees the closure on its next call.
            _ if qp.was_established() => return Ok(qp),
            _ => {
                let reason = qp.take_events().iter().rev().find_map(|e| match e {
                    Event::Failed(err) => Some(err.to_string()),
                    _ => None,
                });
                return Err(VerbsError::QpFailed {
                    qp_num: qp.qp_num,
                    reason: reason.unwrap_or_else(|| "failed during setup".into()),
                });
            }
        }
        if Instant::now() >= deadline {
            return Err(VerbsError::Timeout {
                what: format!(
                    "handshake over the link with {peer} (the side channel worked, the data path did not: a firewall, or the wrong interface?)"
                ),
                after: Duration::ZERO,
            });
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Accepts connections on a TCP port (like `rdma_listen`). Dropping it closes the clients it
/// answered that no `accept` returned.
#[derive(Debug)]
pub struct Listener {
    device: Device,
    tcp: TcpListener,
    /// The hellos read and the candidates; one `accept` call at a time takes from them.
    setup: Mutex<Setup>,
    arrived: mpsc::Sender<Arrival>,
    /// Where the candidates' completions would go until one is handed to the caller.
    candidate_cq: CompletionQueue,
    /// Clients whose hello is being read now (a handle to close each, oldest first).
    pending: Arc<Mutex<VecDeque<(u64, TcpStream)>>>,
    /// Numbers the clients, to find each in `pending`.
    next_client: AtomicU64,
    /// Why the last few clients were dropped, for the timeout message.
    refused: Arc<Mutex<Vec<String>>>,
}

/// What `accept` takes from: hellos read, and clients answered.
#[derive(Debug)]
struct Setup {
    /// Hellos read by the per-client threads, oldest first.
    arrivals: mpsc::Receiver<Arrival>,
    /// Clients answered whose handshake over the link is under way (or done, for an `accept`
    /// to take), oldest first.
    candidates: VecDeque<Candidate>,
}

/// A client that was answered: its connection exists, on the listener's completion queue.
#[derive(Debug)]
struct Candidate {
    qp: QueuePair,
    /// The side channel, open until the candidate is returned or dropped (as before there were
    /// candidates: the client has nothing more to say on it).
    _stream: TcpStream,
    /// The client's data socket on rail 0.
    peer: SocketAddr,
    peer_private_data: Vec<u8>,
    /// The private data the welcome carried (the options of the `accept` that answered).
    sent_private_data: Vec<u8>,
    /// The end of this client's setup, and how long it was given.
    deadline: Instant,
    timeout: Duration,
}

/// A client that authenticated and sent a well-formed hello.
#[derive(Debug)]
struct Arrival {
    stream: TcpStream,
    from: SocketAddr,
    hello: Frame,
    /// The end of this client's setup.
    deadline: Instant,
}

/// Remembers why a client was dropped, for the timeout message (the last few).
fn remember(refused: &Mutex<Vec<String>>, why: String) {
    let mut refused = refused.lock().unwrap_or_else(|p| p.into_inner());
    if refused.len() == REMEMBERED_REFUSALS {
        refused.remove(0);
    }
    refused.push(why);
}

/// Forgets client `id` (its hello was read, or it failed).
fn done(pending: &Mutex<VecDeque<(u64, TcpStream)>>, id: u64) {
    let mut pending = pending.lock().unwrap_or_else(|p| p.into_inner());
    pending.retain(|(i, _)| *i != id);
}

/// Reads one client's authentication and hello, within `deadline`.
fn read_hello(
    stream: &TcpStream,
    from: SocketAddr,
    auth: &Auth,
    deadline: Instant,
) -> Result<Frame> {
    let peer = from.to_string();
    let refused = |detail: String| VerbsError::Handshake {
        peer: peer.clone(),
        detail,
    };
    stream
        .set_nonblocking(false)
        .map_err(VerbsError::io("side channel"))?;
    let _ = stream.set_nodelay(true);
    let secret = auth.resolve().map_err(|e| refused(e.to_string()))?;
    let mut io = DeadlineStream::new(stream, deadline);
    tbrdma_auth::server(&mut io, secret.as_deref(), AUTH_CONTEXT)
        .map_err(|e| refused(e.to_string()))?;
    let hello = read_frame(&mut io, &peer)?;
    if hello.kind != 1 {
        return Err(refused("expected a hello".into()));
    }
    Ok(hello)
}

impl Listener {
    /// Listens on the device's address, port `port` (0: any free port).
    pub fn bind(device: &Device, port: u16) -> Result<Listener> {
        Listener::bind_addr(device, SocketAddr::new(device.ip(), port))
    }

    /// Listens on an explicit address (for example `0.0.0.0` to accept on every interface).
    pub fn bind_addr(device: &Device, addr: SocketAddr) -> Result<Listener> {
        let tcp = TcpListener::bind(addr).map_err(|e| VerbsError::Io {
            context: format!(
                "listening on {addr} (is another server using the port? choose another with --port)"
            ),
            source: e,
        })?;
        // Accepting never blocks: `accept` polls the socket and the clients' hellos together.
        tcp.set_nonblocking(true)
            .map_err(VerbsError::io("listener"))?;
        let (arrived, arrivals) = mpsc::channel();
        Ok(Listener {
            device: device.clone(),
            tcp,
            setup: Mutex::new(Setup {
                arrivals,
                candidates: VecDeque::new(),
            }),
            arrived,
            candidate_cq: device.create_cq(CANDIDATE_CQ),
            pending: Arc::new(Mutex::new(VecDeque::new())),
            next_client: AtomicU64::new(0),
            refused: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// The listening address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.tcp
            .local_addr()
            .map_err(VerbsError::io("reading the listening address"))
    }

    /// Waits up to `wait` (None: forever) for a client whose setup completes, and returns its
    /// connection, its completions going to `send_cq` and `recv_cq`.
    ///
    /// Each client has `opts.timeout` from its arrival for its whole setup. While it waits,
    /// `accept` reads new clients' hellos, answers them (with `pd` and `opts`) and drives the
    /// engine, and returns the first client whose handshake over the link completes, wherever
    /// it came in the queue (see the module docs). Clients that do not authenticate
    /// (`opts.auth`), send something other than a hello, send nothing, or do not shake hands
    /// over the link within their deadline are dropped and logged, and do not end the wait (the
    /// timeout's message lists the last few). A client that uses the other kind of data path
    /// (Ethernet frames or UDP) is refused and ends it with that error.
    ///
    /// Clients answered and not yet returned when it returns stay for the next call. A call
    /// returns only those answered with the same protection domain and private data as its
    /// own (the client was told those rkeys); the listener's callers normally pass the same.
    pub fn accept(
        &self,
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        opts: &QpOptions,
        wait: Option<Duration>,
    ) -> Result<Connected> {
        let until = wait.map(|w| Instant::now() + w);
        // Only one caller at a time takes arrivals and candidates; others wait here (each its
        // own `wait`).
        let mut setup = self.setup.lock().unwrap_or_else(|p| p.into_inner());
        let setup = &mut *setup;
        loop {
            self.take_new_clients(opts)?;
            while let Ok(arrival) = setup.arrivals.try_recv() {
                self.answer(arrival, pd, opts, &mut setup.candidates)?;
            }
            if !setup.candidates.is_empty() {
                let _ = self.device.progress();
            }
            if let Some(won) = self.settle(&mut setup.candidates, pd, opts) {
                let Candidate {
                    qp,
                    peer,
                    peer_private_data,
                    ..
                } = won;
                let engine = &self.device.inner.engine;
                match engine.rebind_cqs(qp.qp_num, send_cq.shared.clone(), recv_cq.shared.clone()) {
                    Some(true) => {
                        return Ok(Connected {
                            qp,
                            peer_private_data,
                            peer,
                        });
                    }
                    // Nobody else holds the queue pair to post on it, and the engine forgets a
                    // connection only once it is closed: neither can happen.
                    refused => {
                        self.drop_client(
                            peer,
                            format!("handing the connection over failed ({refused:?})"),
                        );
                        continue;
                    }
                }
            }
            if let (Some(until), Some(wait)) = (until, wait) {
                if Instant::now() >= until {
                    let refused = self.refused.lock().unwrap_or_else(|p| p.into_inner());
                    let mut what = "waiting for a client to connect".to_string();
                    if !refused.is_empty() {
                        what += &format!(" (clients refused meanwhile: {})", refused.join("; "));
                    }
                    return Err(VerbsError::Timeout { what, after: wait });
                }
            }
            // Candidates shaking hands need the engine driven often (caller progress); with
            // none, a new hello is all there is to wait for.
            let most = if setup.candidates.is_empty() {
                Duration::from_millis(2)
            } else {
                Duration::from_micros(20)
            };
            let slice = match until {
                Some(until) => until.saturating_duration_since(Instant::now()).min(most),
                None => most,
            };
            match setup.arrivals.recv_timeout(slice) {
                Ok(arrival) => self.answer(arrival, pd, opts, &mut setup.candidates)?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    unreachable!("the listener holds a sender")
                }
            }
        }
    }

    /// Looks at every candidate: drops those that failed, or are still shaking hands past their
    /// deadline, and takes out the first (oldest) whose handshake completed and that was
    /// answered with `pd` and `opts`' private data.
    fn settle(
        &self,
        candidates: &mut VecDeque<Candidate>,
        pd: &ProtectionDomain,
        opts: &QpOptions,
    ) -> Option<Candidate> {
        let now = Instant::now();
        let mut won = None;
        let mut i = 0;
        while i < candidates.len() {
            let c = &candidates[i];
            let ours = c.qp.pd.id == pd.id && c.sent_private_data == opts.private_data;
            let dropped = match c.qp.state() {
                ConnectionState::Established if ours && won.is_none() => {
                    won = candidates.remove(i);
                    continue;
                }
                // (Left for a call with its protection domain and private data, or for our next.)
                ConnectionState::Established => None,
                ConnectionState::Connecting if now < c.deadline => None,
                ConnectionState::Connecting => Some(
                    VerbsError::Timeout {
                        what: format!(
                            "handshake over the link with {} (the side channel worked, the data path did not: a firewall, the wrong interface, or a stranger that stalls?)",
                            c.peer
                        ),
                        after: c.timeout,
                    }
                    .to_string(),
                ),
                // With background progress a fast peer may connect, finish one-sided work and
                // close before anyone looks: the connection was made, so setup succeeded; the
                // caller sees the closure on its next call.
                _ if c.qp.was_established() && ours && won.is_none() => {
                    won = candidates.remove(i);
                    continue;
                }
                _ => {
                    let reason = c.qp.take_events().iter().rev().find_map(|e| match e {
                        Event::Failed(err) => Some(err.to_string()),
                        _ => None,
                    });
                    Some(
                        VerbsError::QpFailed {
                            qp_num: c.qp.qp_num,
                            reason: reason.unwrap_or_else(|| "failed during setup".into()),
                        }
                        .to_string(),
                    )
                }
            };
            match dropped {
                Some(why) => {
                    let c = candidates.remove(i).expect("in range");
                    self.drop_client(c.peer, why);
                    // Its queue pair closes here.
                    drop(c);
                }
                None => i += 1,
            }
        }
        if won.is_some() {
            debug_assert!(
                self.candidate_cq.shared.is_empty(),
                "a candidate with no work posted completed something"
            );
        }
        won
    }

    /// Logs and remembers why the client whose data socket is `peer` was dropped.
    fn drop_client(&self, peer: SocketAddr, why: String) {
        tracing::warn!("connection manager: dropping the client at {peer}: {why}");
        remember(&self.refused, format!("{peer}: {why}"));
    }

    /// Accepts every client waiting on the socket and starts reading its hello on a thread of
    /// its own.
    fn take_new_clients(&self, opts: &QpOptions) -> Result<()> {
        loop {
            let (stream, from) = match self.tcp.accept() {
                Ok(pair) => pair,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                // The client went away between its SYN and our accept.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
                Err(e) => {
                    return Err(VerbsError::Io {
                        context: "accepting a connection".into(),
                        source: e,
                    });
                }
            };
            let id = self.next_client.fetch_add(1, Ordering::Relaxed);
            {
                let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                if pending.len() >= MAX_PENDING {
                    if let Some((_, oldest)) = pending.pop_front() {
                        // Its thread's next read fails, and it drops the client.
                        let _ = oldest.shutdown(std::net::Shutdown::Both);
                        tracing::warn!(
                            "connection manager: {MAX_PENDING} clients setting up: closing the oldest"
                        );
                    }
                }
                match stream.try_clone() {
                    Ok(handle) => pending.push_back((id, handle)),
                    Err(e) => {
                        tracing::warn!("connection manager: closing {from}: {e}");
                        continue;
                    }
                }
            }
            let deadline = Instant::now() + opts.timeout;
            let (auth, arrived) = (opts.auth.clone(), self.arrived.clone());
            let (pending, refused) = (self.pending.clone(), self.refused.clone());
            let spawned = std::thread::Builder::new()
                .name("tbrdma-cm-hello".into())
                .spawn(move || {
                    match read_hello(&stream, from, &auth, deadline) {
                        Ok(hello) => {
                            // Fails only when the listener is gone: the stream closes with it.
                            let _ = arrived.send(Arrival {
                                stream,
                                from,
                                hello,
                                deadline,
                            });
                        }
                        Err(e) => {
                            tracing::warn!("connection manager: dropping a client: {e}");
                            remember(&refused, e.to_string());
                        }
                    }
                    done(&pending, id);
                });
            if let Err(e) = spawned {
                done(&self.pending, id);
                tracing::warn!("connection manager: closing {from}: no thread for it: {e}");
            }
        }
    }

    /// Answers a client whose hello arrived and adds it to the candidates. Errors: the client
    /// uses the other kind of data path (it is told why too), or the engine refused the new
    /// connection (a local failure).
    fn answer(
        &self,
        arrival: Arrival,
        pd: &ProtectionDomain,
        opts: &QpOptions,
        candidates: &mut VecDeque<Candidate>,
    ) -> Result<()> {
        let Arrival {
            stream,
            from,
            hello,
            deadline,
        } = arrival;
        // A hello that waited past its client's deadline (no accept call meanwhile): the
        // client has given up.
        if deadline <= Instant::now() {
            tracing::warn!("connection manager: {from} gave up before an accept took its hello");
            return Ok(());
        }
        let peer_name = from.to_string();
        let mut io = DeadlineStream::new(&stream, deadline);
        let carrier = Carrier::of(&self.device);
        let peer_takes_frames = match peer_takes_frames(carrier, hello.carrier) {
            Ok(frames) => frames,
            Err(detail) => {
                // Tell the client why too (a refusal carries its reason as private data).
                let refusal = Frame {
                    kind: 3,
                    data_addrs: self.device.data_addrs().to_vec(),
                    qp_num: 0,
                    max_datagram: 0,
                    token: 0,
                    private: detail.clone().into_bytes(),
                    carrier,
                };
                let _ = write_frame(&mut io, &refusal);
                return Err(VerbsError::Handshake {
                    peer: peer_name,
                    detail,
                });
            }
        };
        let qp_num = self.device.inner.engine.reserve_qpn();
        let token = random_u64();
        let welcome = Frame {
            kind: 2,
            data_addrs: self.device.data_addrs().to_vec(),
            qp_num,
            max_datagram: self.device.inner.engine.config().max_datagram as u32,
            token,
            private: opts.private_data.clone(),
            carrier,
        };
        // The connection exists before the client hears of it, so its CONNECT finds it.
        let agreed = Agreed {
            active: false,
            qp_num,
            remote_qpn: hello.qp_num,
            token,
            peers: hello.data_addrs.clone(),
            peer_takes_frames,
        };
        let cq = &self.candidate_cq;
        let qp = register(pd, cq, cq, opts, agreed)?;
        let peer = hello.data_addrs[0];
        if let Err(e) = write_frame(&mut io, &welcome) {
            // The client went away; its queue pair closes here.
            drop(qp);
            self.drop_client(peer, format!("{peer_name}: sending the answer: {e}"));
            return Ok(());
        }
        if candidates.len() >= MAX_CANDIDATES {
            // The oldest still shaking hands (a real peer takes a round trip, a stranger stays
            // until its deadline); or, if every one is connected, the oldest.
            let oldest = candidates
                .iter()
                .position(|c| c.qp.state() == ConnectionState::Connecting)
                .unwrap_or(0);
            if let Some(c) = candidates.remove(oldest) {
                self.drop_client(
                    c.peer,
                    format!("{MAX_CANDIDATES} clients setting up: dropping the oldest"),
                );
            }
        }
        candidates.push_back(Candidate {
            qp,
            _stream: stream,
            peer,
            peer_private_data: hello.private,
            sent_private_data: opts.private_data.clone(),
            deadline,
            timeout: opts.timeout,
        });
        Ok(())
    }
}

/// Connects to a [`Listener`] at `server` (its TCP address), like `rdma_connect`.
pub fn connect(
    pd: &ProtectionDomain,
    server: SocketAddr,
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
    opts: &QpOptions,
) -> Result<Connected> {
    let device = &pd.device;
    let deadline = Instant::now() + opts.timeout;
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(server),
        socket2::Type::STREAM,
        None,
    )
    .map_err(VerbsError::io("creating the side-channel socket"))?;
    // Leave through the link's address, so the side channel takes the same cable.
    if device.ip().is_ipv4() == server.is_ipv4() {
        socket
            .bind(&SocketAddr::new(device.ip(), 0).into())
            .map_err(VerbsError::io("binding the side channel"))?;
    }
    if let Err(e) = socket.connect_timeout(&server.into(), opts.timeout) {
        return Err(match e.kind() {
            std::io::ErrorKind::ConnectionRefused => VerbsError::PeerNotListening { addr: server },
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
                VerbsError::Unreachable {
                    addr: server,
                    detail: format!("no answer within {:?}", opts.timeout),
                }
            }
            _ => VerbsError::Unreachable {
                addr: server,
                detail: e.to_string(),
            },
        });
    }
    let stream: TcpStream = socket.into();
    let _ = stream.set_nodelay(true);
    let peer_name = server.to_string();
    let mut stream = DeadlineStream::new(&stream, deadline);
    let secret = opts.auth.resolve().map_err(|e| VerbsError::Handshake {
        peer: peer_name.clone(),
        detail: e.to_string(),
    })?;
    tbrdma_auth::client(&mut stream, secret.as_deref(), AUTH_CONTEXT).map_err(|e| {
        VerbsError::Handshake {
            peer: peer_name.clone(),
            detail: e.to_string(),
        }
    })?;
    let qp_num = device.inner.engine.reserve_qpn();
    let hello = Frame {
        kind: 1,
        data_addrs: device.data_addrs().to_vec(),
        qp_num,
        max_datagram: device.inner.engine.config().max_datagram as u32,
        token: 0,
        private: opts.private_data.clone(),
        carrier: Carrier::of(device),
    };
    write_frame(&mut stream, &hello).map_err(|e| VerbsError::Handshake {
        peer: peer_name.clone(),
        detail: format!("sending the hello: {e}"),
    })?;
    let welcome = read_frame(&mut stream, &peer_name)?;
    if welcome.kind == 3 {
        return Err(VerbsError::Handshake {
            peer: peer_name,
            detail: String::from_utf8_lossy(&welcome.private).into_owned(),
        });
    }
    if welcome.kind != 2 {
        return Err(VerbsError::Handshake {
            peer: peer_name,
            detail: "expected a welcome".into(),
        });
    }
    let peer_takes_frames =
        peer_takes_frames(Carrier::of(device), welcome.carrier).map_err(|detail| {
            VerbsError::Handshake {
                peer: peer_name,
                detail,
            }
        })?;
    let agreed = Agreed {
        active: true,
        qp_num,
        remote_qpn: welcome.qp_num,
        token: welcome.token,
        peers: welcome.data_addrs.clone(),
        peer_takes_frames,
    };
    let qp = register(pd, send_cq, recv_cq, opts, agreed)?;
    let qp = wait_established(qp, welcome.data_addrs[0], deadline)?;
    Ok(Connected {
        qp,
        peer_private_data: welcome.private,
        peer: welcome.data_addrs[0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame() -> Frame {
        Frame {
            kind: 2,
            data_addrs: vec![
                "10.0.0.1:4791".parse().unwrap(),
                "[fe80::2]:4792".parse().unwrap(),
            ],
            qp_num: 0x0102_0304,
            max_datagram: 9000,
            token: 0x1122_3344_5566_7788,
            private: b"private".to_vec(),
            carrier: Carrier::Frames,
        }
    }

    #[test]
    fn frames_round_trip_with_the_documented_layout() {
        let f = frame();
        let bytes = encode_frame(&f);
        let body = &bytes[4..];
        assert_eq!(
            u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize,
            body.len()
        );
        assert_eq!(
            body.len(),
            HEADER_LEN + SOCKET_ADDR_LEN + f.private.len() + 1
        );
        assert_eq!(&body[..8], b"tbCM\x01\x00\x02\x02");
        // The first rail: an IPv4-mapped address, then the port.
        assert_eq!(
            &body[8..26],
            &[
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1, 0xb7, 0x12
            ]
        );
        assert_eq!(decode_frame(body), Ok(f));
    }

    #[test]
    fn frames_go_only_to_packet_peers_and_only_old_frames_only_peers_are_refused() {
        use Carrier::*;
        // A byte this build does not know is read as UDP, the carrier every engine hears.
        assert_eq!(Carrier::from_byte(Some(9)), Udp);
        assert_eq!(Carrier::from_byte(Some(2)), Frames);
        assert_eq!(peer_takes_frames(Frames, Frames), Ok(true));
        assert_eq!(peer_takes_frames(Frames, FramesOnly), Ok(true));
        assert_eq!(peer_takes_frames(Frames, Udp), Ok(false));
        assert_eq!(peer_takes_frames(Udp, Frames), Ok(false));
        assert_eq!(peer_takes_frames(Udp, Udp), Ok(false));
        let refusal = peer_takes_frames(Udp, FramesOnly).unwrap_err();
        assert!(refusal.contains("same tbrdma version"), "{refusal}");
    }

    #[test]
    fn every_truncation_is_an_error_and_an_older_peer_means_udp() {
        let bytes = encode_frame(&frame());
        let body = &bytes[4..];
        // Without the trailing byte: a frame from a build that predates the packet engine.
        let old = decode_frame(&body[..body.len() - 1]).unwrap();
        assert_eq!(old.carrier, Carrier::Udp);
        for len in 0..body.len() - 1 {
            assert!(decode_frame(&body[..len]).is_err(), "{len} bytes decoded");
        }
    }
}
