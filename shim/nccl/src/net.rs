//! The plugin's engine, in NCCL's vocabulary but with no C types: the process-wide state that
//! `init` creates (the links, one logical device over them), listen handles, non-blocking
//! connect and accept, and the table that turns the integers NCCL holds as `void*` (comms,
//! requests, memory handles, v11 contexts) back into objects. It never dereferences a C pointer
//! and never blocks: connection setup runs on helper threads whose outcome each
//! `connect`/`accept` call looks up.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tbrdma_proto::codec::{Put, Reader, SOCKET_ADDR_LEN, SliceWriter};
use tbrdma_verbs::{
    CompletionQueue, Config, Device, DeviceConfig, EngineConfig, Listener, ProtectionDomain,
    QpOptions, VerbsError,
};

use crate::abi::NCCL_NET_HANDLE_MAXSIZE;
use crate::comm::{CQ_CAPACITY, Link, RecvComm, SendComm};
use crate::config::{DEFAULT_PREFIXES, PluginConfig};
use crate::error::{NetError, Result};
use crate::log;

/// Name matched by `NCCL_NET`.
pub const PLUGIN_NAME: &std::ffi::CStr = c"tbrdma";
/// The one logical device's name.
pub const DEVICE_NAME: &std::ffi::CStr = c"tbrdma0";
/// Private data both ends send during setup: magic and protocol version (3: the connector
/// adds the listen id of the handle it was given; 2: eager messages, credits and CTS by
/// message number; peers speaking an older version are refused at setup).
const HELLO: &[u8; 8] = b"tbNCCL\x00\x03";
/// Acceptor threads per listen comm. One is enough: an accept call never waits on any one
/// client (the connection manager reads hellos and runs link handshakes of many clients at
/// once, and returns whichever completes first), so a client that stalls in the middle of its
/// handshake holds neither the thread nor the ranks behind it, on its listener or the others.
const ACCEPTORS: usize = 1;
/// Connections set up and not yet taken by `accept`, per listen comm: more are closed at once
/// (NCCL accepts each connection it expects, so only strangers reach this).
const ACCEPT_BACKLOG: usize = 64;
/// Most links listed in a handle.
pub const MAX_HANDLE_ADDRS: usize = 4;
const HANDLE_MAGIC: &[u8; 4] = b"tbNC";
/// 3: the listening addresses only (2 listed each link's UDP listener port too, for the
/// sockets side a packet-engine link kept: the packet engine now reaches UDP peers itself).
const HANDLE_VERSION: u8 = 3;
/// Where the connector keeps its state in its own copy of the handle (NCCL passes the same
/// buffer on every retry; the listener leaves these bytes zero).
const STAGE_AT: usize = 96;
// The listening addresses end before the staging field.
const _: () = assert!(16 + SOCKET_ADDR_LEN * MAX_HANDLE_ADDRS <= STAGE_AT);
const STAGE_MAGIC: &[u8; 4] = b"stg1";
/// How long the acceptor waits on one listener before looking at the next (and at `stop`).
const ACCEPT_SLICE: Duration = Duration::from_millis(20);

/// One local link: an open device and its subnet.
#[derive(Debug)]
pub struct LocalLink {
    /// What the user named it by.
    pub name: String,
    /// The device.
    pub device: Device,
    /// The domain every registration and queue pair of this link uses.
    pub pd: ProtectionDomain,
    /// Prefix length of the link's address (for routing by the peer's address).
    pub prefix: u8,
    /// Reported speed, Mbit/s, if the interface says.
    pub speed: Option<i32>,
}

impl LocalLink {
    fn reaches(&self, peer: IpAddr) -> bool {
        match (self.device.ip(), peer) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix.min(32)))
                    .unwrap_or(0);
                u32::from(a) & mask == u32::from(b) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => a.segments()[..4] == b.segments()[..4],
            _ => false,
        }
    }
}

/// What `getProperties` reports, version-neutral.
#[derive(Clone, Copy, Debug)]
pub struct Properties {
    /// Mbit/s.
    pub speed: i32,
    /// Microseconds.
    pub latency: f32,
    /// Identity of the (logical) port.
    pub guid: u64,
}

/// Everything `init` opened.
#[derive(Debug)]
pub struct Plugin {
    /// Settings.
    pub config: PluginConfig,
    /// The links, in the order given.
    pub links: Vec<Arc<LocalLink>>,
}

fn interface_of(name: &str) -> Result<(IpAddr, u8, Option<String>)> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| NetError::NoDevice {
        detail: format!("listing interfaces: {e}"),
    })?;
    let wanted_ip = name.parse::<IpAddr>().ok();
    for ifa in addrs {
        let (Some(addr), Some(mask)) = (ifa.address, ifa.netmask) else {
            continue;
        };
        let (ip, prefix) =
            if let (Some(a), Some(m)) = (addr.as_sockaddr_in(), mask.as_sockaddr_in()) {
                (IpAddr::V4(a.ip()), u32::from(m.ip()).count_ones() as u8)
            } else if let (Some(a), Some(m)) = (addr.as_sockaddr_in6(), mask.as_sockaddr_in6()) {
                (IpAddr::V6(a.ip()), u128::from(m.ip()).count_ones() as u8)
            } else {
                continue;
            };
        let by_name = wanted_ip.is_none() && ifa.interface_name == name && ip.is_ipv4();
        if by_name || wanted_ip == Some(ip) {
            return Ok((ip, prefix, Some(ifa.interface_name)));
        }
    }
    match wanted_ip {
        // An address no interface lists: let Device::open say why.
        Some(ip) => Ok((ip, if ip.is_ipv4() { 32 } else { 128 }, None)),
        None => Err(NetError::NoDevice {
            detail: format!("interface {name:?} does not exist or has no IPv4 address"),
        }),
    }
}

fn default_links() -> Result<Vec<String>> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| NetError::NoDevice {
        detail: format!("listing interfaces: {e}"),
    })?;
    let mut names: Vec<String> = addrs
        .filter(|a| {
            a.address
                .and_then(|s| s.as_sockaddr_in().copied())
                .is_some()
        })
        .map(|a| a.interface_name)
        .filter(|n| DEFAULT_PREFIXES.iter().any(|p| n.starts_with(p)))
        .collect();
    names.sort();
    names.dedup();
    if names.is_empty() {
        return Err(NetError::NoDevice {
            detail: format!(
                "no interface named {}* has an IPv4 address; set {} to the links to use",
                DEFAULT_PREFIXES.join("* or "),
                crate::config::ENV_IFACES
            ),
        });
    }
    Ok(names)
}

fn interface_speed(iface: &str) -> Option<i32> {
    std::fs::read_to_string(format!("/sys/class/net/{iface}/speed"))
        .ok()?
        .trim()
        .parse::<i32>()
        .ok()
        .filter(|s| *s > 0)
}

impl Plugin {
    /// Opens every configured link.
    pub fn open(config: PluginConfig) -> Result<Plugin> {
        let names = if config.links.is_empty() {
            default_links()?
        } else {
            config.links.clone()
        };
        let mut links = Vec::new();
        for name in names.iter().take(MAX_HANDLE_ADDRS) {
            let (ip, prefix, iface) = interface_of(name)?;
            let speed = iface.as_deref().and_then(interface_speed);
            let open = |name: String, engine: EngineConfig| -> Result<LocalLink> {
                let device = Device::open(&ip.to_string(), DeviceConfig { engine, port: 0 })
                    .map_err(NetError::verbs(format!("opening link {name}")))?;
                Ok(LocalLink {
                    name,
                    pd: device.alloc_pd(),
                    device,
                    prefix,
                    speed,
                })
            };
            // On the packet engine, peers that frames do not reach (a peer over UDP, one with
            // no cable to this host, this host's own address) get UDP from the same device.
            let link = open(name.clone(), config.engine.clone())?;
            if let Some(reason) = link.device.engine_fallback() {
                log::warn(&format!(
                    "tbrdma NET: link {name} uses the {} engine: {reason}",
                    link.device.engine_kind().name()
                ));
            }
            links.push(Arc::new(link));
        }
        if names.len() > MAX_HANDLE_ADDRS {
            log::warn(&format!(
                "tbrdma NET: using the first {MAX_HANDLE_ADDRS} of {} links",
                names.len()
            ));
        }
        Ok(Plugin { config, links })
    }

    /// Properties of the logical device.
    pub fn properties(&self) -> Properties {
        let speed = self.config.speed_mbps.unwrap_or_else(|| {
            self.links
                .iter()
                .filter_map(|l| l.speed)
                .max()
                .unwrap_or(20_000)
        });
        let guid = self
            .links
            .iter()
            .flat_map(|l| l.device.ip().to_string().into_bytes())
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            });
        Properties {
            speed,
            latency: self.config.latency_us,
            guid,
        }
    }

    /// One line describing the links, for the log.
    pub fn describe(&self) -> String {
        let links: Vec<String> = self
            .links
            .iter()
            .map(|l| {
                format!(
                    "{} ({}/{}, {} engine{})",
                    l.name,
                    l.device.ip(),
                    l.prefix,
                    l.device.engine_kind().name(),
                    if l.device.carries_frames() {
                        "; UDP towards peers over UDP or not on a cable"
                    } else {
                        ""
                    }
                )
            })
            .collect();
        format!(
            "links {}; progress {:?}",
            links.join(", "),
            self.config.engine.progress
        )
    }

    /// The local side and the listener to connect to for a peer's handle: the first of its
    /// links a cable of ours reaches; else, relayed by the kernels in between, our first link
    /// to its first (over UDP: the engine sends frames only where they reach, see
    /// docs/verbs.md, "Frames where they reach, UDP elsewhere").
    fn route(&self, peer: &[SocketAddr]) -> (Arc<LocalLink>, SocketAddr) {
        for &addr in peer {
            if let Some(ours) = self.links.iter().find(|l| l.reaches(addr.ip())) {
                return (ours.clone(), addr);
            }
        }
        (self.links[0].clone(), peer[0])
    }
}

fn qp_options(config: &PluginConfig) -> QpOptions {
    let defaults = Config::default();
    let idle_timeout = config.idle_timeout.unwrap_or(defaults.idle_timeout);
    QpOptions {
        config: Config {
            // Only a connection's first messages can arrive before the other end has posted
            // its receives (the receiver's bounce receives go up right after accept, the
            // sender's control receives right after connect): give them time, not an error.
            rnr_delay: Duration::from_millis(1),
            max_rnr_retries: 5_000,
            idle_timeout,
            // Six keep-alives per idle timeout, as the transport's defaults (500 ms for 3 s).
            keepalive_interval: (idle_timeout / 6).min(defaults.keepalive_interval),
            ..defaults
        },
        private_data: HELLO.to_vec(),
        timeout: config.connect_timeout,
        ..QpOptions::default()
    }
}

fn check_hello(peer: SocketAddr, data: &[u8]) -> Result<()> {
    if data != HELLO {
        return Err(NetError::Remote {
            peer: peer.to_string(),
            detail: "the peer is not a tbrdma NCCL plugin of this version".into(),
        });
    }
    Ok(())
}

/// What a connector sends: [`HELLO`] and the listen id from the handle.
fn connector_hello(listen_id: u64) -> Vec<u8> {
    let mut v = HELLO.to_vec();
    v.extend_from_slice(&listen_id.to_le_bytes());
    v
}

/// Locks `m`, carrying on past a panic of another holder (the tables stay consistent: every
/// change to them is one insert or remove), so one panicking call cannot fail every later one.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------
// Handles

/// Writes a listen handle: magic, version, the number of links, two zero bytes, the listen
/// id, the listening addresses ([`SOCKET_ADDR_LEN`] bytes each), zeros after.
pub(crate) fn encode_handle(
    id: u64,
    links: &[SocketAddr],
    out: &mut [u8; NCCL_NET_HANDLE_MAXSIZE],
) {
    out.fill(0);
    let links = &links[..links.len().min(MAX_HANDLE_ADDRS)];
    let mut w = SliceWriter::new(&mut out[..STAGE_AT]);
    w.put_bytes(HANDLE_MAGIC);
    w.put_u8(HANDLE_VERSION);
    w.put_u8(links.len() as u8);
    w.put_zeros(2);
    w.put_u64(id);
    for &addr in links {
        w.put_socket_addr(addr);
    }
}

pub(crate) fn decode_handle(h: &[u8; NCCL_NET_HANDLE_MAXSIZE]) -> Result<Vec<SocketAddr>> {
    let mut r = Reader::new(h);
    if r.bytes(HANDLE_MAGIC.len()) != Some(HANDLE_MAGIC) || r.u8() != Some(HANDLE_VERSION) {
        return Err(NetError::misuse(
            "connect: the handle is not a tbrdma listen handle of this version (is the peer running the same plugin?)",
        ));
    }
    let none = || NetError::misuse("connect: the handle lists no address");
    let n = usize::from(r.u8().ok_or_else(none)?);
    if n == 0 || n > MAX_HANDLE_ADDRS {
        return Err(none());
    }
    r.skip(2 + 8).ok_or_else(none)?; // Padding and the listen id.
    (0..n).map(|_| r.socket_addr().ok_or_else(none)).collect()
}

/// The listen id a handle carries (after [`decode_handle`] accepted it).
pub(crate) fn handle_listen_id(h: &[u8; NCCL_NET_HANDLE_MAXSIZE]) -> u64 {
    let mut r = Reader::new(&h[8..]);
    r.u64().unwrap_or(0)
}

pub(crate) fn stage_of(h: &[u8; NCCL_NET_HANDLE_MAXSIZE]) -> Option<u64> {
    let mut r = Reader::new(h.get(STAGE_AT..)?);
    let id = r.u64()?;
    (r.bytes(STAGE_MAGIC.len())? == STAGE_MAGIC).then_some(id)
}

fn set_stage(h: &mut [u8; NCCL_NET_HANDLE_MAXSIZE], id: Option<u64>) {
    let mut w = SliceWriter::new(&mut h[STAGE_AT..STAGE_AT + 12]);
    match id {
        Some(id) => {
            w.put_u64(id);
            w.put_bytes(STAGE_MAGIC);
        }
        None => w.put_zeros(12),
    }
}

// ---------------------------------------------------------------------------------------
// Objects NCCL holds

/// A listening endpoint (`listenComm`): an acceptor thread and what it accepted.
#[derive(Debug)]
pub struct ListenComm {
    accepted: Arc<Mutex<VecDeque<Result<RecvComm>>>>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for ListenComm {
    fn drop(&mut self) {
        // The acceptors notice within one slice; not waiting keeps closeListen non-blocking.
        self.stop.store(true, Ordering::SeqCst);
        lock(&self.threads).clear();
    }
}

/// A connection being set up on a helper thread.
#[derive(Debug, Default)]
struct PendingConnect {
    /// The handle's listener part (everything before the stage bytes).
    target: Vec<u8>,
    outcome: Mutex<Option<Result<SendComm>>>,
}

#[derive(Debug, Clone)]
enum Object {
    Listen(Arc<ListenComm>),
    Send(Arc<SendComm>),
    Recv(Arc<RecvComm>),
}

#[derive(Debug, Default)]
struct Global {
    plugin: Option<Arc<Plugin>>,
    contexts: BTreeSet<u64>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    plugin: None,
    contexts: BTreeSet::new(),
});

/// Comms by id. Requests are `comm id << 8 | slot + 1`.
static OBJECTS: RwLock<Option<HashMap<u64, Object>>> = RwLock::new(None);
static PENDING: Mutex<Option<HashMap<u64, Arc<PendingConnect>>>> = Mutex::new(None);
/// Ids start high so that no handle NCCL holds is 0 or the 0x1 sentinel.
static NEXT_ID: AtomicU64 = AtomicU64::new(0x100);

/// A listen id unique across processes and hosts (the handle travels to other ranks).
fn listen_nonce(id: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u64(id);
    h.write_u32(std::process::id());
    h.finish()
}

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

fn insert(obj: Object) -> u64 {
    let id = next_id();
    OBJECTS
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(id, obj);
    id
}

fn lookup(id: u64) -> Option<Object> {
    OBJECTS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()?
        .get(&id)
        .cloned()
}

fn remove(id: u64) -> Option<Object> {
    OBJECTS
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()?
        .remove(&id)
}

fn plugin() -> Result<Arc<Plugin>> {
    lock(&GLOBAL).plugin.clone().ok_or(NetError::NotInitialized)
}

// ---------------------------------------------------------------------------------------
// Entry points (version-neutral)

/// `init`: opens the links on the first call; later calls keep them (idempotent).
pub fn init() -> Result<()> {
    let mut g = lock(&GLOBAL);
    if g.plugin.is_some() {
        return Ok(());
    }
    let config = PluginConfig::from_env(|k| std::env::var(k).ok())?;
    let plugin = Plugin::open(config)?;
    log::info(&format!("tbrdma NET: initialized: {}", plugin.describe()));
    g.plugin = Some(Arc::new(plugin));
    Ok(())
}

/// v11 `init`: as [`init`], and a fresh context id.
pub fn init_context() -> Result<u64> {
    init()?;
    let id = next_id();
    lock(&GLOBAL).contexts.insert(id);
    Ok(id)
}

/// v11 `finalize`: forgets the context; after the last one the links close as soon as no
/// comm uses them (NCCL may unload the library next).
pub fn finalize_context(ctx: u64) -> Result<()> {
    if ctx == 0 {
        // NCCL finalizes the context it holds even when `init` failed and never set one:
        // nothing to do, and nothing to warn about (the failed init said why already).
        return Ok(());
    }
    let mut g = lock(&GLOBAL);
    if !g.contexts.remove(&ctx) {
        return Err(NetError::misuse(format!(
            "finalize of unknown context {ctx:#x}"
        )));
    }
    if g.contexts.is_empty() {
        drop(g);
        // NCCL may unload the library next: give sends that completed time to be delivered.
        settle_lingering(true);
        let mut g = lock(&GLOBAL);
        if !g.contexts.is_empty() {
            return Ok(());
        }
        g.plugin = None;
        log::info("tbrdma NET: last context finalized, links released");
        let faults = tbrdma_verbs::faults::injected();
        if faults.seen > 0 {
            // TBRDMA_FAULTS was set: say what the user-space faulty cable did.
            log::info(&format!("tbrdma NET: faults injected: {faults}"));
        }
    }
    Ok(())
}

/// Whether `ctx` is a live v11 context.
pub fn check_context(ctx: u64) -> Result<()> {
    if lock(&GLOBAL).contexts.contains(&ctx) {
        Ok(())
    } else {
        Err(NetError::misuse(format!("unknown context {ctx:#x}")))
    }
}

/// `devices`: one logical device.
pub fn devices() -> Result<i32> {
    plugin().map(|_| 1)
}

/// `getProperties`.
pub fn properties(dev: i32) -> Result<Properties> {
    check_dev(dev)?;
    Ok(plugin()?.properties())
}

fn check_dev(dev: i32) -> Result<()> {
    if dev != 0 {
        return Err(NetError::misuse(format!(
            "device {dev} does not exist (tbrdma has one logical device, 0)"
        )));
    }
    Ok(())
}

/// `listen`: one listener per link, their addresses in the handle, an acceptor thread.
pub fn listen(dev: i32, handle: &mut [u8; NCCL_NET_HANDLE_MAXSIZE]) -> Result<u64> {
    check_dev(dev)?;
    let plugin = plugin()?;
    let mut listeners = Vec::new();
    let mut links = Vec::new();
    for link in &plugin.links {
        let l = Listener::bind(&link.device, 0)
            .map_err(NetError::verbs(format!("listening on {}", link.name)))?;
        let addr = l
            .local_addr()
            .map_err(NetError::verbs("listener address"))?;
        listeners.push((l, link.clone()));
        links.push(addr);
    }
    let id = next_id();
    let nonce = listen_nonce(id);
    encode_handle(nonce, &links, handle);
    let accepted = Arc::new(Mutex::new(VecDeque::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let options = qp_options(&plugin.config);
    let listeners = Arc::new(listeners);
    let mut threads = Vec::new();
    for _ in 0..ACCEPTORS {
        let (accepted, stopping) = (accepted.clone(), stop.clone());
        let (listeners, options) = (listeners.clone(), options.clone());
        let thread = std::thread::Builder::new()
            .name("tbrdma-accept".into())
            .spawn(move || acceptor(&listeners, &options, nonce, &accepted, &stopping));
        match thread {
            Ok(t) => threads.push(t),
            Err(e) => {
                stop.store(true, Ordering::SeqCst);
                return Err(NetError::misuse(format!(
                    "starting the acceptor thread: {e}"
                )));
            }
        }
    }
    let comm = ListenComm {
        accepted,
        stop,
        threads: Mutex::new(threads),
    };
    let obj = Object::Listen(Arc::new(comm));
    OBJECTS
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(id, obj);
    let listening: Vec<String> = links.iter().map(SocketAddr::to_string).collect();
    log::info(&format!(
        "tbrdma NET: listening on {}",
        listening.join(", ")
    ));
    Ok(id)
}

fn is_no_client_yet(e: &VerbsError) -> bool {
    matches!(e, VerbsError::Timeout { what, .. } if what.starts_with("waiting for a client"))
}

/// One acceptor thread: takes the connections set up on the listeners, looking at each in turn
/// for [`ACCEPT_SLICE`] (each listener keeps setting up the clients it answered meanwhile, see
/// `tbrdma_verbs::Listener::accept`), and queues those `accept` should hand out. A handshake that fails, a client that is not a
/// tbrdma plugin of this version or was not given this listener's handle (its listen id
/// differs) is closed and logged, never queued: NCCL's next `accept` must be a rank it expects.
/// Only a local failure to set the comm up (memory) is queued, for `accept` to report.
fn acceptor(
    listeners: &[(Listener, Arc<LocalLink>)],
    options: &QpOptions,
    nonce: u64,
    accepted: &Mutex<VecDeque<Result<RecvComm>>>,
    stop: &AtomicBool,
) {
    let expected = connector_hello(nonce);
    // Each listener's next connection's completion queue, made once and kept until one takes it.
    let mut cqs: Vec<Option<CompletionQueue>> = listeners.iter().map(|_| None).collect();
    while !stop.load(Ordering::SeqCst) {
        for ((listener, link), next_cq) in listeners.iter().zip(&mut cqs) {
            let cq = next_cq.get_or_insert_with(|| link.device.create_cq(CQ_CAPACITY));
            let outcome = listener.accept(&link.pd, cq, cq, options, Some(ACCEPT_SLICE));
            let conn = match outcome {
                Err(e) if is_no_client_yet(&e) => continue,
                Err(e) => {
                    log::info(&format!(
                        "tbrdma NET: dropped a failed connection attempt on {}: {e}",
                        link.name
                    ));
                    continue;
                }
                Ok(conn) => conn,
            };
            let cq = next_cq.take().expect("made above");
            if conn.peer_private_data != expected {
                log::info(&format!(
                    "tbrdma NET: dropped a connection from {} on {}: not a tbrdma NCCL plugin of this version, or not given this listener's handle",
                    conn.peer, link.name
                ));
                continue;
            }
            let result = RecvComm::new(Link {
                qp: conn.qp,
                cq,
                pd: link.pd.clone(),
                peer: conn.peer.to_string(),
            });
            if result.is_ok() {
                log::info(&format!(
                    "tbrdma NET: accepted a connection from {} on {} ({} KiB pinned by the plugin)",
                    conn.peer,
                    link.name,
                    crate::comm::PINNED.load(Ordering::Relaxed) / 1024
                ));
            }
            if stop.load(Ordering::SeqCst) {
                return;
            }
            let mut queue = lock(accepted);
            if queue.len() < ACCEPT_BACKLOG {
                queue.push_back(result);
            }
        }
    }
}

/// `accept`: the next connection the acceptor set up, or None (call again).
pub fn accept(listen_id: u64) -> Result<Option<u64>> {
    let Some(Object::Listen(l)) = lookup(listen_id) else {
        return Err(NetError::misuse(format!(
            "accept on {listen_id:#x}, which is not a listen comm"
        )));
    };
    let next = lock(&l.accepted).pop_front();
    match next {
        None => Ok(None),
        Some(Err(e)) => Err(e),
        Some(Ok(comm)) => Ok(Some(insert(Object::Recv(Arc::new(comm))))),
    }
}

/// `connect`: starts setup on a helper thread (its id kept in the handle's stage bytes),
/// then reports None until the thread is done.
pub fn connect(dev: i32, handle: &mut [u8; NCCL_NET_HANDLE_MAXSIZE]) -> Result<Option<u64>> {
    check_dev(dev)?;
    let peer_links = decode_handle(handle)?;
    let mut pending = lock(&PENDING);
    let table = pending.get_or_insert_with(HashMap::new);
    // NCCL passes the same buffer on every retry, so the stage bytes find the helper. Should a
    // caller pass a fresh copy of the handle instead, its listener bytes (addresses and a random
    // listen id) find the one connect in
    // progress to that listener rather than starting another.
    let target = handle[..STAGE_AT].to_vec();
    let stage = stage_of(handle)
        .filter(|id| table.contains_key(id))
        .or_else(|| {
            table
                .iter()
                .find(|(_, p)| p.target == target)
                .map(|(id, _)| *id)
        });
    if let Some(id) = stage {
        if let Some(p) = table.get(&id) {
            let outcome = lock(&p.outcome).take();
            return match outcome {
                None => Ok(None),
                Some(result) => {
                    table.remove(&id);
                    set_stage(handle, None);
                    result.map(|c| Some(insert(Object::Send(Arc::new(c)))))
                }
            };
        }
    }
    let plugin = plugin()?;
    let (link, server) = plugin.route(&peer_links);
    let mut options = qp_options(&plugin.config);
    options.private_data = connector_hello(handle_listen_id(handle));
    let p = Arc::new(PendingConnect {
        target,
        outcome: Mutex::new(None),
    });
    let id = next_id();
    {
        let p = p.clone();
        std::thread::Builder::new()
            .name("tbrdma-connect".into())
            .spawn(move || {
                // A failure is logged once, by the `connect` call that reports it.
                let result = connect_blocking(&link, server, &options);
                *lock(&p.outcome) = Some(result);
            })
            .map_err(|e| NetError::misuse(format!("starting the connect thread: {e}")))?;
    }
    table.insert(id, p);
    set_stage(handle, Some(id));
    Ok(None)
}

fn connect_blocking(link: &LocalLink, server: SocketAddr, options: &QpOptions) -> Result<SendComm> {
    let cq = link.device.create_cq(CQ_CAPACITY);
    let conn = tbrdma_verbs::connect(&link.pd, server, &cq, &cq, options).map_err(
        NetError::verbs(format!("connecting to {server} over {}", link.name)),
    )?;
    check_hello(server, &conn.peer_private_data)?;
    let comm = SendComm::new(Link {
        qp: conn.qp,
        cq,
        pd: link.pd.clone(),
        peer: server.to_string(),
    })?;
    log::info(&format!(
        "tbrdma NET: connected to {server} over {} ({} KiB pinned by the plugin)",
        link.name,
        crate::comm::PINNED.load(Ordering::Relaxed) / 1024
    ));
    Ok(comm)
}

/// Which end a registration belongs to.
#[derive(Debug, Clone)]
pub enum DataComm {
    /// A send comm.
    Send(Arc<SendComm>),
    /// A receive comm.
    Recv(Arc<RecvComm>),
}

/// The send or receive comm named `id`.
pub fn data_comm(id: u64) -> Result<DataComm> {
    match lookup(id) {
        Some(Object::Send(s)) => Ok(DataComm::Send(s)),
        Some(Object::Recv(r)) => Ok(DataComm::Recv(r)),
        _ => Err(NetError::misuse(format!(
            "{id:#x} is not a send or receive comm"
        ))),
    }
}

/// The send comm named `id`.
pub fn send_comm(id: u64) -> Result<Arc<SendComm>> {
    match lookup(id) {
        Some(Object::Send(s)) => Ok(s),
        _ => Err(NetError::misuse(format!("{id:#x} is not a send comm"))),
    }
}

/// The receive comm named `id`.
pub fn recv_comm(id: u64) -> Result<Arc<RecvComm>> {
    match lookup(id) {
        Some(Object::Recv(r)) => Ok(r),
        _ => Err(NetError::misuse(format!("{id:#x} is not a receive comm"))),
    }
}

/// Progresses the send comms whose sends wait for a credit or a CTS (see
/// [`crate::comm::WAITING_SENDS`]).
pub fn progress_waiting_sends() {
    if crate::comm::WAITING_SENDS.load(Ordering::Relaxed) == 0 {
        return;
    }
    let sends: Vec<Arc<SendComm>> = match OBJECTS.read().unwrap_or_else(|e| e.into_inner()).as_ref()
    {
        None => return,
        Some(map) => map
            .values()
            .filter_map(|o| match o {
                Object::Send(s) => Some(s.clone()),
                _ => None,
            })
            .collect(),
    };
    for s in sends {
        s.try_progress();
    }
}

/// Longest a closed send comm is kept for its completed sends to be acknowledged: longer than
/// the transport's retransmission budget (about 3 s by default), after which the connection
/// has failed anyway.
const LINGER: Duration = Duration::from_secs(10);

/// Send comms NCCL closed while a send that already completed (a staged eager message) was
/// not acknowledged yet: the queue pair stays open, and the engine keeps retransmitting, until
/// it is (`closeSend` must not lose what `test` said was sent), the connection fails or
/// [`LINGER`] passes.
static LINGERING: Mutex<Vec<(Arc<SendComm>, Instant)>> = Mutex::new(Vec::new());

/// Drops the lingering send comms that are done; with `wait`, first waits (bounded by their
/// deadlines) until all are.
fn settle_lingering(wait: bool) {
    loop {
        let left = {
            let mut list = lock(&LINGERING);
            if list.is_empty() {
                return;
            }
            let now = Instant::now();
            list.retain(|(s, deadline)| now < *deadline && s.unacked_completed_sends());
            list.len()
        };
        if left == 0 || !wait {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The request value for `slot` of comm `id`.
pub fn request_id(comm: u64, slot: usize) -> u64 {
    (comm << 8) | (slot as u64 + 1)
}

/// `test`: whether the request is done, and its size.
pub fn test(request: u64) -> Result<Option<u64>> {
    let (comm, slot) = (request >> 8, (request & 0xff) as usize);
    if slot == 0 {
        return Err(NetError::misuse(format!("{request:#x} is not a request")));
    }
    progress_waiting_sends();
    settle_lingering(false);
    match lookup(comm) {
        Some(Object::Send(s)) => s.test(slot - 1),
        Some(Object::Recv(r)) => r.test(slot - 1),
        _ => Err(NetError::misuse(format!(
            "request {request:#x} belongs to no open comm"
        ))),
    }
}

/// `closeSend` / `closeRecv` / `closeListen`: forgets the comm; everything it owns is freed
/// once no call in flight on another thread still uses it.
pub fn close(id: u64, kind: &str) -> Result<()> {
    settle_lingering(false);
    let ok = match (remove(id), kind) {
        (Some(Object::Send(s)), "send") => {
            if s.unacked_completed_sends() {
                let deadline = Instant::now() + LINGER;
                lock(&LINGERING).push((s, deadline));
            }
            true
        }
        (Some(Object::Recv(_)), "recv") | (Some(Object::Listen(_)), "listen") => true,
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(NetError::misuse(format!(
            "close{kind} of {id:#x}, which is not one"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_keep_the_stage_apart() {
        let addrs: Vec<SocketAddr> = vec![
            "10.1.2.3:4567".parse().unwrap(),
            "[fe80::1]:9".parse().unwrap(),
        ];
        let mut h = [0xaau8; NCCL_NET_HANDLE_MAXSIZE];
        encode_handle(77, &addrs, &mut h);
        assert_eq!(decode_handle(&h).unwrap(), addrs);
        assert_eq!(handle_listen_id(&h), 77);
        assert_eq!(stage_of(&h), None);
        set_stage(&mut h, Some(0x1234));
        assert_eq!(stage_of(&h), Some(0x1234));
        assert_eq!(decode_handle(&h).unwrap(), addrs);
        set_stage(&mut h, None);
        assert_eq!(stage_of(&h), None);
    }

    #[test]
    fn foreign_handles_are_refused() {
        let h = [0u8; NCCL_NET_HANDLE_MAXSIZE];
        assert!(decode_handle(&h).is_err());
        // Handles of the earlier versions, and one that lists no link.
        let link: SocketAddr = "10.1.2.3:4567".parse().unwrap();
        let mut h = [0u8; NCCL_NET_HANDLE_MAXSIZE];
        for version in [1, 2] {
            encode_handle(77, &[link], &mut h);
            h[4] = version;
            assert!(decode_handle(&h).is_err());
        }
        encode_handle(77, &[link], &mut h);
        h[5] = 0;
        assert!(decode_handle(&h).is_err());
    }

    #[test]
    fn requests_encode_comm_and_slot() {
        let r = request_id(0x1234, 31);
        assert_eq!((r >> 8, (r & 0xff) - 1), (0x1234, 31));
        assert!(request_id(0x100, 0) > 1);
    }
}
