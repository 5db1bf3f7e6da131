//! The verbs objects behind the C handles, in safe Rust over `tbrdma-verbs`: an open link
//! (shared by every context of a process on it), protection domains, memory regions,
//! completion queues and RC queue pairs with the verbs state machine.
//!
//! What this module owns:
//! - the **port slot** of the process on each link and the QPN numbering (see
//!   [`crate::addressing`]);
//! - the **queue pair state machine** (RESET, INIT, RTR, RTS, ERR): receives posted before RTR
//!   are kept and handed to the connection when it is made at RTR from the destination GID and
//!   QPN; sends are accepted in RTS only;
//! - **unsignaled sends**: the engine completes every request; this layer remembers which
//!   requests asked for a completion and drops the successful completions of the others when
//!   the application polls (errors are always reported), with the application's `wr_id`
//!   restored;
//! - **inline sends**: the payload is copied at post time into a per-queue-pair ring of
//!   registered slots, one per send-queue entry.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tbrdma_proto::{
    Access, Config, ConnectionError, Event, Queue, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};
use tbrdma_verbs::{
    Completion, CompletionQueue, Device, DeviceConfig, DirectParams, EngineConfig, EngineKind,
    MemoryRegion, Progress, ProtectionDomain, QueuePair, VerbsError,
};

use crate::abi::*;
use crate::addressing::{self, Link};

/// An errno value, as the verbs functions return it.
pub type Errno = i32;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock is caught at the C boundary; the data stays usable.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Largest inline payload a queue pair offers.
pub const MAX_INLINE: u32 = 1024;
/// Inline payload every queue pair offers at least.
pub const MIN_INLINE: u32 = 64;
/// Deepest queues a queue pair may ask for.
pub const MAX_QP_WR: u32 = 16384;
/// Most completions a completion queue may ask for.
pub const MAX_CQE: u32 = 1 << 20;

/// A link opened by this process: the tbrdma device (data socket on `base + slot`).
#[derive(Debug)]
pub struct OpenLink {
    pub device: Device,
    pub slot: u16,
    pub base: u16,
    pub link: Link,
}

static OPEN_LINKS: Mutex<Vec<(String, Weak<OpenLink>)>> = Mutex::new(Vec::new());
/// Queue pair indices are unique in the process (across links), never reused.
static NEXT_QP_INDEX: AtomicU16 = AtomicU16::new(1);

/// Fewer CPUs than this and the engine thread does not busy-poll by default (see
/// [`engine_config`]).
const SPIN_MIN_CPUS: usize = 4;

/// The engine `TBRDMA_IBV_ENGINE` asks for, if it names one (`sockets`, `packet`, `uring`).
/// Without it the library runs the packet engine, which falls back to sockets without
/// `CAP_NET_RAW` (said on standard error only when the variable asked for it: a verbs program
/// usually runs unprivileged).
fn engine_asked() -> Option<EngineKind> {
    let value = std::env::var("TBRDMA_IBV_ENGINE").ok()?;
    match value.as_str() {
        "sockets" => Some(EngineKind::Sockets),
        "packet" => Some(EngineKind::Packet),
        "uring" => Some(EngineKind::Uring),
        _ => {
            eprintln!(
                "tbrdma libibverbs: TBRDMA_IBV_ENGINE={value:?} is none of sockets, packet, \
                 uring; using the default (packet)"
            );
            None
        }
    }
}

fn engine_config() -> EngineConfig {
    // Thread progress so that one-sided operations land while the target polls its memory;
    // assisted, so that a program that keeps calling (posting, polling its CQ) sends and
    // receives from its own thread and waits for no engine thread to be scheduled. The
    // packet engine: its polls read the receive ring with no system call (docs/ibverbs.md).
    let mut config = EngineConfig {
        progress: Progress::Thread,
        assist: std::env::var("TBRDMA_IBV_ASSIST").map_or(true, |v| v != "0"),
        engine: engine_asked().unwrap_or(EngineKind::Packet),
        ..Default::default()
    };
    // A verbs program busy-polls (its CQ or, like `ib_write_lat`, its memory), so each process
    // is one spinning thread already; a spinning engine thread makes two. Where the CPUs are
    // fewer than the spinners of two such processes (a 2-core host running both ends, as the
    // tests do), spinning turns every round trip into a wait for a time slice: ib_write_lat,
    // 8 B, over veth on 2 cores, 230-600 µs typical with the 200 µs spin, 32-45 µs with none
    // (docs/performance.md). With none the engine thread sleeps in the kernel until a datagram
    // or a post wakes it.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < SPIN_MIN_CPUS {
        config.spin = Duration::ZERO;
    }
    if let Some(us) = std::env::var("TBRDMA_IBV_SPIN_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        config.spin = Duration::from_micros(us);
    }
    config
}

/// Opens `link` for this process, or shares the already open one.
pub fn open_link(link: &Link) -> Result<Arc<OpenLink>, Errno> {
    let mut open = lock(&OPEN_LINKS);
    open.retain(|(_, weak)| weak.strong_count() > 0);
    if let Some(existing) = open
        .iter()
        .find(|(name, _)| *name == link.ifname)
        .and_then(|(_, weak)| weak.upgrade())
    {
        return Ok(existing);
    }
    let ip = link.ipv4().ok_or(libc::ENODEV)?;
    let base = addressing::port_base();
    for slot in 0..addressing::PORT_SLOTS {
        let config = DeviceConfig {
            engine: engine_config(),
            port: base + slot,
        };
        match Device::open(&ip.to_string(), config) {
            Ok(device) => {
                if let Some(why) = device.engine_fallback()
                    && std::env::var_os("TBRDMA_IBV_ENGINE").is_some()
                {
                    eprintln!("tbrdma libibverbs: {}: {why}", link.ifname);
                }
                let opened = Arc::new(OpenLink {
                    device,
                    slot,
                    base,
                    link: link.clone(),
                });
                open.push((link.ifname.clone(), Arc::downgrade(&opened)));
                return Ok(opened);
            }
            Err(VerbsError::Io { source, .. })
                if source.raw_os_error() == Some(libc::EADDRINUSE) => {}
            Err(e) => {
                eprintln!("tbrdma libibverbs: opening {}: {e}", link.ifname);
                return Err(libc::EIO);
            }
        }
    }
    eprintln!(
        "tbrdma libibverbs: every port from {base} to {} on {ip} is taken",
        base + addressing::PORT_SLOTS - 1
    );
    Err(libc::EADDRINUSE)
}

/// What `ibv_open_device` returns (behind the `verbs_context`).
#[derive(Debug)]
pub struct Context {
    pub link: Arc<OpenLink>,
}

impl Context {
    /// `ibv_query_device`.
    pub fn device_attr(&self) -> ibv_device_attr {
        let mut fw_ver = [0 as std::ffi::c_char; 64];
        for (d, s) in fw_ver
            .iter_mut()
            .zip(concat!("tbrdma ", env!("CARGO_PKG_VERSION")).bytes())
        {
            *d = s as std::ffi::c_char;
        }
        ibv_device_attr {
            fw_ver,
            node_guid: self.link.link.guid().to_be(),
            sys_image_guid: self.link.link.guid().to_be(),
            max_mr_size: 1 << 40,
            page_size_cap: 4096,
            // Not a vendor perftest knows: it then uses the portable post API.
            vendor_id: 0x00ff_ffff,
            vendor_part_id: 0x7462,
            hw_ver: 0,
            max_qp: i32::from(addressing::MAX_QP_INDEX),
            max_qp_wr: MAX_QP_WR as i32,
            device_cap_flags: 0,
            max_sge: 1,
            max_sge_rd: 1,
            max_cq: 0xffff,
            max_cqe: MAX_CQE as i32,
            max_mr: 0xffff,
            max_pd: 0xffff,
            max_qp_rd_atom: 16,
            max_ee_rd_atom: 0,
            max_res_rd_atom: 16 * 0xffff,
            max_qp_init_rd_atom: 16,
            max_ee_init_rd_atom: 0,
            atomic_cap: IBV_ATOMIC_HCA,
            max_ee: 0,
            max_rdd: 0,
            max_mw: 0,
            max_raw_ipv6_qp: 0,
            max_raw_ethy_qp: 0,
            max_mcast_grp: 0,
            max_mcast_qp_attach: 0,
            max_total_mcast_qp_attach: 0,
            max_ah: 0,
            max_fmr: 0,
            max_map_per_fmr: 0,
            max_srq: 0,
            max_srq_wr: 0,
            max_srq_sge: 0,
            max_pkeys: 1,
            local_ca_ack_delay: 0,
            phys_port_cnt: 1,
        }
    }
}

/// `ibv_query_port` for `link`.
pub fn port_attr(link: &Link) -> ibv_port_attr {
    let active = link.is_active();
    ibv_port_attr {
        state: if active {
            IBV_PORT_ACTIVE
        } else {
            IBV_PORT_DOWN
        },
        max_mtu: IBV_MTU_4096,
        active_mtu: IBV_MTU_4096,
        gid_tbl_len: 1,
        port_cap_flags: IBV_PORT_IP_BASED_GIDS,
        max_msg_sz: 0x8000_0000,
        pkey_tbl_len: 1,
        // 4X QDR (40 Gb/s): the class of a Thunderbolt 3/4 link.
        active_width: 2,
        active_speed: 4,
        phys_state: if active { 5 } else { 3 },
        max_vl_num: 1,
        link_layer: IBV_LINK_LAYER_ETHERNET,
        ..Default::default()
    }
}

/// A protection domain.
#[derive(Debug)]
pub struct Pd {
    pub tb: ProtectionDomain,
    pub link: Arc<OpenLink>,
}

/// Translates verbs access flags (optional hints ignored), or EINVAL for ones not supported.
pub fn access_of(flags: i32) -> Result<Access, Errno> {
    let known = IBV_ACCESS_LOCAL_WRITE
        | IBV_ACCESS_REMOTE_WRITE
        | IBV_ACCESS_REMOTE_READ
        | IBV_ACCESS_REMOTE_ATOMIC
        | IBV_ACCESS_HUGETLB
        | IBV_ACCESS_OPTIONAL_RANGE;
    if flags & !known != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    let remote = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
    // Verbs: remote write or atomic access requires local write.
    if flags & remote != 0 && flags & IBV_ACCESS_LOCAL_WRITE == 0 {
        return Err(libc::EINVAL);
    }
    Ok(Access::from_bits_truncate((flags & 0xf) as u32))
}

/// A completion queue, and the send tables of the queue pairs that complete into it.
#[derive(Debug)]
pub struct Cq {
    pub tb: CompletionQueue,
    pub cqe: u32,
    senders: Mutex<HashMap<u32, Attached>>,
    /// An empty poll yields the core: only when the engine thread alone makes progress.
    yield_when_empty: bool,
}

/// A queue pair completing into a completion queue: its send table, and the queue pair (to
/// ask whether its flushed requests are reported).
#[derive(Debug)]
struct Attached {
    table: Arc<SendTable>,
    qp: Weak<Qp>,
}

impl Cq {
    /// A completion queue for `cqe` completions of the application's.
    pub fn new(ctx: &Context, cqe: i32) -> Result<Cq, Errno> {
        if cqe < 1 || cqe as u32 > MAX_CQE {
            return Err(libc::EINVAL);
        }
        // Room for the application's completions plus the unsignaled ones, which the engine
        // produces too and this layer drops when the application polls.
        let capacity = (cqe as usize).saturating_mul(4) + 65536;
        Ok(Cq {
            tb: ctx.link.device.create_cq(capacity),
            cqe: cqe as u32,
            senders: Mutex::new(HashMap::new()),
            yield_when_empty: !ctx.link.device.polls_progress(),
        })
    }

    /// `ibv_poll_cq`: fills `out` with up to `out.len()` completions.
    pub fn poll(&self, out: &mut [ibv_wc]) -> Result<usize, Errno> {
        // The staging buffer is on the stack and zeroed on every call, so it is no larger than
        // the request needs: 32 zeroed completions were a measurable share of a latency
        // test's poll loop, which asks for one.
        if out.len() <= 4 {
            self.poll_staged::<4>(out)
        } else {
            self.poll_staged::<32>(out)
        }
    }

    /// [`Self::poll`] through a staging buffer of `N` completions. Only the first batch may run
    /// the engine (when nothing is queued); the rest only take what is queued, so that a poll
    /// that found completions costs one engine pass, not a second one to find the queue empty.
    fn poll_staged<const N: usize>(&self, out: &mut [ibv_wc]) -> Result<usize, Errno> {
        let mut n = 0;
        let mut buf = [Completion::default(); N];
        let mut first = true;
        while n < out.len() {
            let want = buf.len().min(out.len() - n);
            let polled = if std::mem::take(&mut first) {
                self.tb.poll(&mut buf[..want])
            } else {
                self.tb.poll_queued(&mut buf[..want])
            };
            let got = match polled {
                Ok(got) => got,
                Err(VerbsError::CqOverflow { .. }) => return Err(libc::ENOSPC),
                Err(_) => return Err(libc::EIO),
            };
            if got == 0 {
                if n == 0 && self.yield_when_empty {
                    // The engine thread needs a core to make progress; a polling application
                    // would otherwise hold it for its whole time slice on a small host. (When
                    // the application's polls receive, the poll itself is the progress.)
                    std::thread::yield_now();
                }
                break;
            }
            let senders = lock(&self.senders);
            for c in &buf[..got] {
                if let Some(wc) = translate(c, &senders) {
                    out[n] = wc;
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    fn attach(&self, qp: &Arc<Qp>) {
        let attached = Attached {
            table: Arc::clone(&qp.sends),
            qp: Arc::downgrade(qp),
        };
        lock(&self.senders).insert(qp.qp_num, attached);
    }

    fn detach(&self, qp_num: u32) {
        lock(&self.senders).remove(&qp_num);
    }

    /// Whether a queue pair still completes into it (`ibv_destroy_cq` then fails with EBUSY).
    pub fn in_use(&self) -> bool {
        !lock(&self.senders).is_empty()
    }
}

fn status_of(s: WcStatus) -> i32 {
    match s {
        WcStatus::Success => IBV_WC_SUCCESS,
        WcStatus::LocalLength => IBV_WC_LOC_LEN_ERR,
        WcStatus::LocalProtection => IBV_WC_LOC_PROT_ERR,
        WcStatus::Flushed => IBV_WC_WR_FLUSH_ERR,
        WcStatus::RemoteAccess => IBV_WC_REM_ACCESS_ERR,
        WcStatus::RemoteInvalidRequest => IBV_WC_REM_INV_REQ_ERR,
        WcStatus::RemoteOperational => IBV_WC_REM_OP_ERR,
        WcStatus::RetryExceeded => IBV_WC_RETRY_EXC_ERR,
        WcStatus::RnrRetryExceeded => IBV_WC_RNR_RETRY_EXC_ERR,
    }
}

fn opcode_of(o: WcOpcode) -> i32 {
    match o {
        WcOpcode::Send => IBV_WC_SEND,
        WcOpcode::RdmaWrite => IBV_WC_RDMA_WRITE,
        WcOpcode::RdmaRead => IBV_WC_RDMA_READ,
        WcOpcode::FetchAdd => IBV_WC_FETCH_ADD,
        WcOpcode::CmpSwap => IBV_WC_COMP_SWAP,
        WcOpcode::Recv => IBV_WC_RECV,
        WcOpcode::RecvRdmaWithImm => IBV_WC_RECV_RDMA_WITH_IMM,
    }
}

/// The verbs completion for an engine completion, or None for a successful unsignaled send.
fn translate(c: &Completion, senders: &HashMap<u32, Attached>) -> Option<ibv_wc> {
    let attached = senders.get(&c.qp_num);
    let table = attached.map(|a| &a.table);
    let mut wc = ibv_wc {
        wr_id: c.wc.wr_id,
        status: status_of(c.wc.status),
        opcode: opcode_of(c.wc.opcode),
        byte_len: c.wc.byte_len.min(u64::from(u32::MAX)) as u32,
        qp_num: c.qp_num,
        src_qp: table.map_or(0, |t| t.remote_qpn()),
        ..Default::default()
    };
    if let Some(imm) = c.wc.imm {
        wc.imm_data = imm;
        wc.wc_flags |= IBV_WC_WITH_IMM;
    }
    if c.wc.status == WcStatus::Flushed
        && attached.is_none_or(|a| a.qp.upgrade().is_none_or(|qp| qp.flushes_are_silent()))
    {
        if let (Some(t), Queue::Send) = (table, c.wc.queue) {
            t.take(c.wc.wr_id);
        }
        return None;
    }
    if c.wc.queue == Queue::Send {
        let (wr_id, signaled) = table.and_then(|t| t.take(c.wc.wr_id))?;
        if !signaled && c.wc.status == WcStatus::Success {
            return None;
        }
        wc.wr_id = wr_id;
    }
    if c.wc.status != WcStatus::Success {
        // Verbs: only wr_id, status, qp_num and vendor_err are valid in an error completion.
        wc.opcode = 0;
        wc.byte_len = 0;
        wc.wc_flags = 0;
    }
    Some(wc)
}

/// The application's `wr_id` and signaled flag of each outstanding send, by the sequence
/// number the engine was given as `wr_id` instead.
#[derive(Debug, Default)]
pub struct SendTable {
    inner: Mutex<SendTableInner>,
}

#[derive(Debug, Default)]
struct SendTableInner {
    next: u64,
    outstanding: HashMap<u64, (u64, bool)>,
    remote_qpn: u32,
}

impl SendTable {
    fn add(&self, wr_id: u64, signaled: bool) -> u64 {
        let mut t = lock(&self.inner);
        let seq = t.next;
        t.next += 1;
        t.outstanding.insert(seq, (wr_id, signaled));
        seq
    }

    fn take(&self, seq: u64) -> Option<(u64, bool)> {
        lock(&self.inner).outstanding.remove(&seq)
    }

    fn remote_qpn(&self) -> u32 {
        lock(&self.inner).remote_qpn
    }
}

/// A send work request as the C boundary hands it over.
#[derive(Debug)]
pub struct SendReq<'a> {
    pub wr_id: u64,
    pub signaled: bool,
    /// The local buffer (None: no scatter/gather entry, a zero-length request).
    pub sge: Option<ibv_sge>,
    /// The payload, copied now, when the request is inline.
    pub inline: Option<&'a [u8]>,
    pub op: SendOp,
}

/// Inline payloads: one registered slot per send-queue entry, reused round-robin (the
/// application cannot have more sends outstanding than the queue is deep).
#[derive(Debug)]
struct InlineRing {
    mr: MemoryRegion,
    slot_len: usize,
    slots: usize,
    next: usize,
}

/// What a queue pair was created with.
#[derive(Clone, Copy, Debug)]
pub struct QpInit {
    pub cap: ibv_qp_cap,
    pub sq_sig_all: bool,
}

/// An RC queue pair.
#[derive(Debug)]
pub struct Qp {
    pub qp_num: u32,
    inner: Mutex<QpInner>,
    sends: Arc<SendTable>,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
}

#[derive(Debug)]
struct QpInner {
    state: i32,
    pd: Arc<Pd>,
    init: QpInit,
    attr: ibv_qp_attr,
    tb: Option<QueuePair>,
    /// Why the connection ended, once it did.
    ended: Option<ConnectionError>,
    pending_recvs: Vec<RecvWr>,
    inline: Option<InlineRing>,
}

/// The connection settings of a verbs-mode queue pair (docs/ibverbs.md, "Connections").
fn verbs_config(init: &QpInit) -> Config {
    let retries = std::env::var("TBRDMA_IBV_RETRIES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(30);
    Config {
        max_send_wr: init.cap.max_send_wr.max(1) as usize,
        max_recv_wr: init.cap.max_recv_wr.max(1) as usize,
        // An RC queue pair in RTR waits for its peer as long as it takes (the peer may reach
        // RTR much later); an idle one never fails. Keep-alives still run.
        idle_timeout: Duration::from_secs(24 * 3600),
        // Also the handshake's budget: with backoff capped at 1 s, about 20 s for the peer to
        // reach RTR after this side did.
        max_retries: retries,
        // rnr_retry 7 means "forever" in verbs; tbrdma keeps every budget finite.
        max_rnr_retries: 1_000_000,
        ..Config::default()
    }
}

impl Qp {
    /// `ibv_create_qp` for an RC queue pair (the caller checked the type).
    pub fn create(
        pd: Arc<Pd>,
        send_cq: Arc<Cq>,
        recv_cq: Arc<Cq>,
        mut init: QpInit,
    ) -> Result<Arc<Qp>, Errno> {
        let cap = &mut init.cap;
        if cap.max_send_wr > MAX_QP_WR
            || cap.max_recv_wr > MAX_QP_WR
            || cap.max_send_sge > 1
            || cap.max_recv_sge > 1
            || cap.max_inline_data > MAX_INLINE
        {
            return Err(libc::EINVAL);
        }
        cap.max_send_wr = cap.max_send_wr.max(1);
        cap.max_recv_wr = cap.max_recv_wr.max(1);
        cap.max_send_sge = 1;
        cap.max_recv_sge = 1;
        cap.max_inline_data = cap.max_inline_data.max(MIN_INLINE);
        // (Never past the last index: a wrapped count would reuse a live queue pair's number.)
        let Ok(index) = NEXT_QP_INDEX.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |i| {
            (i <= addressing::MAX_QP_INDEX).then_some(i + 1)
        }) else {
            // 32767 queue pairs in this process: the numbering space is spent.
            return Err(libc::ENOMEM);
        };
        let qp_num = addressing::qpn_of(pd.link.slot, index, pd.link.device.carries_frames());
        let slots = cap.max_send_wr as usize;
        let slot_len = cap.max_inline_data as usize;
        let mr = pd
            .tb
            .alloc_mr(slots * slot_len, Access::LOCAL_WRITE)
            .map_err(|_| libc::ENOMEM)?;
        let qp = Arc::new(Qp {
            qp_num,
            inner: Mutex::new(QpInner {
                state: IBV_QPS_RESET,
                pd,
                init,
                attr: ibv_qp_attr::default(),
                tb: None,
                ended: None,
                pending_recvs: Vec::new(),
                inline: Some(InlineRing {
                    mr,
                    slot_len,
                    slots,
                    next: 0,
                }),
            }),
            sends: Arc::new(SendTable::default()),
            send_cq,
            recv_cq,
        });
        qp.send_cq.attach(&qp);
        qp.recv_cq.attach(&qp);
        Ok(qp)
    }

    /// Whether requests the engine flushed stay unreported: when the peer closed its end of an
    /// established connection and the application has not moved the queue pair to ERR. On
    /// InfiniBand this side would not notice the peer's queue pair going away at all (its
    /// receives stay posted until the application tears it down); reporting the flushes would
    /// fail applications that finish with receives posted (ibv_rc_pingpong does). A connection
    /// that failed otherwise (handshake, retries) reports them: the application must learn
    /// that its requests will never complete.
    fn flushes_are_silent(&self) -> bool {
        let mut inner = lock(&self.inner);
        let events = inner
            .tb
            .as_ref()
            .map(|tb| tb.take_events())
            .unwrap_or_default();
        for e in events {
            if let Event::Failed(err) = e {
                inner.ended = Some(err);
            }
        }
        matches!(inner.state, IBV_QPS_RTR | IBV_QPS_RTS)
            && inner.ended == Some(ConnectionError::ClosedByPeer)
    }

    /// The capabilities it was created with (what `ibv_create_qp` reports back).
    pub fn cap(&self) -> ibv_qp_cap {
        lock(&self.inner).init.cap
    }

    /// The state, as `ibv_query_qp` reports it: ERR once the connection failed or closed.
    pub fn state(&self) -> i32 {
        let inner = lock(&self.inner);
        Self::live_state(&inner)
    }

    fn live_state(inner: &QpInner) -> i32 {
        match (&inner.tb, inner.state) {
            (Some(tb), IBV_QPS_RTR | IBV_QPS_RTS) => match tb.state() {
                tbrdma_proto::ConnectionState::Error | tbrdma_proto::ConnectionState::Closed => {
                    IBV_QPS_ERR
                }
                _ => inner.state,
            },
            (_, s) => s,
        }
    }

    /// `ibv_query_qp`.
    pub fn query(&self) -> (ibv_qp_attr, QpInit) {
        let inner = lock(&self.inner);
        let mut attr = inner.attr;
        attr.qp_state = Self::live_state(&inner);
        attr.cur_qp_state = attr.qp_state;
        attr.cap = inner.init.cap;
        (attr, inner.init)
    }

    /// `ibv_modify_qp`.
    pub fn modify(&self, attr: &ibv_qp_attr, mask: i32) -> Result<i32, Errno> {
        let mut inner = lock(&self.inner);
        let current = Self::live_state(&inner);
        if mask & IBV_QP_CAP != 0 {
            return Err(libc::EINVAL);
        }
        let target = if mask & IBV_QP_STATE != 0 {
            attr.qp_state
        } else {
            current
        };
        let keep = |inner: &mut QpInner| {
            // Remember what the application set, for ibv_query_qp.
            let a = &mut inner.attr;
            if mask & IBV_QP_ACCESS_FLAGS != 0 {
                a.qp_access_flags = attr.qp_access_flags;
            }
            if mask & IBV_QP_PORT != 0 {
                a.port_num = attr.port_num;
            }
            if mask & IBV_QP_AV != 0 {
                a.ah_attr = attr.ah_attr;
            }
            if mask & IBV_QP_PATH_MTU != 0 {
                a.path_mtu = attr.path_mtu;
            }
            if mask & IBV_QP_DEST_QPN != 0 {
                a.dest_qp_num = attr.dest_qp_num;
            }
            if mask & IBV_QP_RQ_PSN != 0 {
                a.rq_psn = attr.rq_psn;
            }
            if mask & IBV_QP_SQ_PSN != 0 {
                a.sq_psn = attr.sq_psn;
            }
            if mask & IBV_QP_TIMEOUT != 0 {
                a.timeout = attr.timeout;
            }
            if mask & IBV_QP_RETRY_CNT != 0 {
                a.retry_cnt = attr.retry_cnt;
            }
            if mask & IBV_QP_RNR_RETRY != 0 {
                a.rnr_retry = attr.rnr_retry;
            }
            if mask & IBV_QP_MIN_RNR_TIMER != 0 {
                a.min_rnr_timer = attr.min_rnr_timer;
            }
        };
        match (current, target) {
            (_, IBV_QPS_RESET) => {
                inner.tb = None;
                inner.ended = None;
                inner.pending_recvs.clear();
                inner.attr = ibv_qp_attr::default();
            }
            (_, IBV_QPS_ERR) => {
                // Closing flushes what is outstanding; receives never handed over are flushed
                // here.
                inner.tb = None;
                inner.pending_recvs.clear();
            }
            (IBV_QPS_RESET, IBV_QPS_INIT) | (IBV_QPS_INIT, IBV_QPS_INIT) => {
                if mask & IBV_QP_PORT != 0 && attr.port_num != 1 {
                    return Err(libc::EINVAL);
                }
                keep(&mut inner);
            }
            (IBV_QPS_INIT, IBV_QPS_RTR) => {
                if mask & (IBV_QP_AV | IBV_QP_DEST_QPN) != IBV_QP_AV | IBV_QP_DEST_QPN {
                    return Err(libc::EINVAL);
                }
                keep(&mut inner);
                self.connect(&mut inner, attr)?;
            }
            (IBV_QPS_RTR, IBV_QPS_RTS) | (IBV_QPS_RTS, IBV_QPS_RTS) => keep(&mut inner),
            _ => return Err(libc::EINVAL),
        }
        inner.state = target;
        Ok(target)
    }

    /// INIT to RTR: the connection to the peer named by the destination GID and QPN.
    fn connect(&self, inner: &mut QpInner, attr: &ibv_qp_attr) -> Result<(), Errno> {
        let ah = &attr.ah_attr;
        if ah.is_global == 0 {
            eprintln!(
                "tbrdma libibverbs: RTR without a GRH (is_global = 0): give the peer's GID (e.g. ibv_rc_pingpong -g 0)"
            );
            return Err(libc::EINVAL);
        }
        let link = &inner.pd.link;
        let peer = match addressing::peer_of(link.base, &ah.grh.dgid.raw, attr.dest_qp_num) {
            Ok(SocketAddr::V4(p)) => p,
            Ok(_) => return Err(libc::EINVAL),
            Err(why) => {
                eprintln!("tbrdma libibverbs: RTR: {why}");
                return Err(libc::EINVAL);
            }
        };
        let local = match link.device.data_addr() {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
                Some(ip) => SocketAddrV4::new(ip, a.port()),
                None => return Err(libc::EINVAL),
            },
        };
        if IpAddr::V4(*peer.ip()) == link.device.ip() && peer.port() == local.port() {
            // Both ends in one process on one link would share a socket: not supported.
            if attr.dest_qp_num == self.qp_num {
                return Err(libc::EINVAL);
            }
        }
        let psk = std::env::var("TBRDMA_IBV_PSK").ok();
        let token = addressing::token(
            (local, self.qp_num),
            (peer, attr.dest_qp_num),
            psk.as_deref().map(str::as_bytes),
        );
        let params = DirectParams {
            local_qpn: self.qp_num,
            remote_qpn: attr.dest_qp_num,
            peer: SocketAddr::V4(peer),
            active: addressing::is_active((local, self.qp_num), (peer, attr.dest_qp_num)),
            token,
            config: verbs_config(&inner.init),
            peer_takes_frames: addressing::hears_frames(attr.dest_qp_num),
        };
        let tb =
            QueuePair::connect_direct(&inner.pd.tb, &self.send_cq.tb, &self.recv_cq.tb, params)
                .map_err(|e| {
                    eprintln!("tbrdma libibverbs: RTR: {e}");
                    libc::EIO
                })?;
        lock(&self.sends.inner).remote_qpn = attr.dest_qp_num;
        let pending = std::mem::take(&mut inner.pending_recvs);
        if !pending.is_empty() {
            tb.post_recv(&pending).map_err(|_| libc::ENOMEM)?;
        }
        inner.tb = Some(tb);
        Ok(())
    }

    /// `ibv_post_send` of one request.
    pub fn post_send(&self, req: SendReq<'_>) -> Result<(), Errno> {
        let mut inner = lock(&self.inner);
        if inner.state != IBV_QPS_RTS {
            return Err(libc::EINVAL);
        }
        let signaled = req.signaled || inner.init.sq_sig_all;
        let local = match (req.inline, req.sge) {
            (Some(data), _) => {
                let ring = inner.inline.as_mut().ok_or(libc::EINVAL)?;
                if data.len() > ring.slot_len
                    || !matches!(
                        req.op,
                        SendOp::Send { .. } | SendOp::Write { .. } | SendOp::WriteWithImm { .. }
                    )
                {
                    return Err(libc::EINVAL);
                }
                let offset = ring.next * ring.slot_len;
                ring.next = (ring.next + 1) % ring.slots;
                ring.mr.write(offset, data);
                ring.mr.sge(offset, data.len())
            }
            (None, Some(sge)) => Sge {
                addr: sge.addr,
                len: u64::from(sge.length),
                lkey: sge.lkey,
            },
            (None, None) => Sge {
                addr: 0,
                len: 0,
                lkey: 0,
            },
        };
        let tb = inner.tb.as_ref().ok_or(libc::EINVAL)?;
        let seq = self.sends.add(req.wr_id, signaled);
        let wr = SendWr {
            wr_id: seq,
            local,
            op: req.op,
        };
        tb.post_send(&[wr]).map_err(|e| {
            self.sends.take(seq);
            match e {
                VerbsError::Post(tbrdma_proto::PostError::QueueFull { .. }) => libc::ENOMEM,
                _ => libc::EINVAL,
            }
        })
    }

    /// `ibv_post_recv` of one request.
    pub fn post_recv(&self, wr_id: u64, sge: Option<ibv_sge>) -> Result<(), Errno> {
        let mut inner = lock(&self.inner);
        let local = sge.map_or(
            Sge {
                addr: 0,
                len: 0,
                lkey: 0,
            },
            |s| Sge {
                addr: s.addr,
                len: u64::from(s.length),
                lkey: s.lkey,
            },
        );
        let wr = RecvWr { wr_id, local };
        match inner.state {
            IBV_QPS_INIT => {
                if inner.pending_recvs.len() >= inner.init.cap.max_recv_wr as usize {
                    return Err(libc::ENOMEM);
                }
                inner.pending_recvs.push(wr);
                Ok(())
            }
            IBV_QPS_RTR | IBV_QPS_RTS => {
                let tb = inner.tb.as_ref().ok_or(libc::EINVAL)?;
                tb.post_recv(&[wr]).map_err(|e| match e {
                    VerbsError::Post(tbrdma_proto::PostError::QueueFull { .. }) => libc::ENOMEM,
                    _ => libc::EINVAL,
                })
            }
            _ => Err(libc::EINVAL),
        }
    }
}

impl Qp {
    /// `ibv_destroy_qp`: its completion queues forget it (what it had outstanding completes
    /// unreported, as verbs leaves it undefined). Not in `Drop`: a poller holding the
    /// completion queue's table may drop the last reference.
    pub fn detach(&self) {
        self.send_cq.detach(self.qp_num);
        self.recv_cq.detach(self.qp_num);
    }
}
