//! The C boundary of libtbrdma: `#[repr(C)]` types and `extern "C"` functions of the verbs
//! half (the collectives are in `ffi_coll`). FFI file: with `ffi_coll`, the only one allowed
//! `unsafe`, each block under a `// SAFETY:` naming the caller's contract (documented on each
//! function in `tbrdma.h`). Every function body runs inside `catch_unwind`.

#![allow(unsafe_code)]
#![allow(non_camel_case_types)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::net::SocketAddr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::time::Duration;

use tbrdma_verbs::{
    Access, Completion, CompletionQueue, Device, DeviceConfig, EngineConfig, EngineKind, Listener,
    MemoryRegion, Progress, ProtectionDomain, QpOptions, QueuePair, RecvWr, RemoteAddr, SendOp,
    SendWr, Sge, WcOpcode, WcStatus,
};

use crate::status::{
    TBRDMA_ERR_INTERNAL, TBRDMA_ERR_INVALID, TBRDMA_OK, fail, last_error_ptr, verbs,
};

/// An open link (`ibv_context`).
#[derive(Debug)]
pub struct tbrdma_device(Device);
/// A protection domain.
#[derive(Debug)]
pub struct tbrdma_pd(ProtectionDomain);
/// A registered memory region.
#[derive(Debug)]
pub struct tbrdma_mr(MemoryRegion);
/// A completion queue.
#[derive(Debug)]
pub struct tbrdma_cq(CompletionQueue);
/// A listening endpoint of the connection manager.
#[derive(Debug)]
pub struct tbrdma_listener(Listener);
/// A connected queue pair and the private data its peer sent.
#[derive(Debug)]
pub struct tbrdma_qp {
    qp: QueuePair,
    peer_private_data: Vec<u8>,
}

/// Engine backend for `tbrdma_device_open`: io_uring, falling back to sockets.
pub const TBRDMA_ENGINE_URING: c_int = 0;
/// Engine backend: nonblocking sockets.
pub const TBRDMA_ENGINE_SOCKETS: c_int = 1;
/// Engine backend: Ethernet frames on an `AF_PACKET` socket with a shared receive ring (needs
/// `CAP_NET_RAW` and IPv4 addresses, else falls back to sockets; every rank must use it).
pub const TBRDMA_ENGINE_PACKET: c_int = 2;
/// Progress: a background engine thread per device.
pub const TBRDMA_PROGRESS_THREAD: c_int = 0;
/// Progress: only inside `tbrdma_poll_cq`, posts and `tbrdma_device_progress`.
pub const TBRDMA_PROGRESS_CALLER: c_int = 1;

/// Access flag: local writes (needed by the remote flags).
pub const TBRDMA_ACCESS_LOCAL_WRITE: u32 = 1;
/// Access flag: the peer may WRITE.
pub const TBRDMA_ACCESS_REMOTE_WRITE: u32 = 1 << 1;
/// Access flag: the peer may READ.
pub const TBRDMA_ACCESS_REMOTE_READ: u32 = 1 << 2;
/// Access flag: the peer may run atomics.
pub const TBRDMA_ACCESS_REMOTE_ATOMIC: u32 = 1 << 3;

/// Send-queue operation: SEND.
pub const TBRDMA_WR_SEND: u32 = 0;
/// SEND with immediate data.
pub const TBRDMA_WR_SEND_WITH_IMM: u32 = 1;
/// RDMA WRITE.
pub const TBRDMA_WR_WRITE: u32 = 2;
/// RDMA WRITE with immediate data (consumes a receive at the peer).
pub const TBRDMA_WR_WRITE_WITH_IMM: u32 = 3;
/// RDMA READ.
pub const TBRDMA_WR_READ: u32 = 4;
/// 8-byte atomic fetch-and-add.
pub const TBRDMA_WR_FETCH_ADD: u32 = 5;
/// 8-byte atomic compare-and-swap.
pub const TBRDMA_WR_CMP_SWAP: u32 = 6;

/// A local buffer: address, length and the lkey of the region holding it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tbrdma_sge {
    /// Address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub length: u64,
    /// Local key of the region.
    pub lkey: u32,
}

/// A send-queue work request.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tbrdma_send_wr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// `TBRDMA_WR_*`.
    pub opcode: u32,
    /// Immediate data (`*_WITH_IMM`).
    pub imm: u32,
    /// Local buffer: source of SEND/WRITE, destination of READ and atomics (8 bytes).
    pub sge: tbrdma_sge,
    /// Peer address (WRITE, READ, atomics).
    pub remote_addr: u64,
    /// Peer rkey (WRITE, READ, atomics).
    pub rkey: u32,
    /// FETCH_ADD: value to add; CMP_SWAP: value to compare with.
    pub compare_add: u64,
    /// CMP_SWAP: value to store.
    pub swap: u64,
}

/// A receive-queue work request.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tbrdma_recv_wr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND lands (may be empty for WRITE_WITH_IMM).
    pub sge: tbrdma_sge,
}

/// A work completion.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct tbrdma_wc {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// Bytes: the message length for receives, the request length for sends.
    pub byte_len: u64,
    /// `TBRDMA_WC_*` status (0 = success).
    pub status: u32,
    /// `TBRDMA_WC_OP_*`.
    pub opcode: u32,
    /// Immediate data, valid when `has_imm` is 1.
    pub imm: u32,
    /// 1 when `imm` is valid.
    pub has_imm: u32,
    /// Local queue pair number.
    pub qp_num: u32,
}

/// Completion status: success.
pub const TBRDMA_WC_SUCCESS: u32 = 0;
/// An incoming SEND was longer than the receive buffer.
pub const TBRDMA_WC_LOCAL_LENGTH: u32 = 1;
/// A local buffer failed its key or bounds check.
pub const TBRDMA_WC_LOCAL_PROTECTION: u32 = 2;
/// Flushed: the queue pair failed before this request ran.
pub const TBRDMA_WC_FLUSHED: u32 = 3;
/// The peer refused a remote access (key, bounds, permission).
pub const TBRDMA_WC_REMOTE_ACCESS: u32 = 4;
/// The peer could not carry out the request.
pub const TBRDMA_WC_REMOTE_INVALID_REQUEST: u32 = 5;
/// The peer failed while carrying out the request.
pub const TBRDMA_WC_REMOTE_OPERATIONAL: u32 = 6;
/// No answer within the retry budget.
pub const TBRDMA_WC_RETRY_EXCEEDED: u32 = 7;
/// No receive posted at the peer within the receiver-not-ready budget.
pub const TBRDMA_WC_RNR_RETRY_EXCEEDED: u32 = 8;

/// Completion opcode: a SEND finished.
pub const TBRDMA_WC_OP_SEND: u32 = 0;
/// A WRITE finished.
pub const TBRDMA_WC_OP_RDMA_WRITE: u32 = 1;
/// A READ finished.
pub const TBRDMA_WC_OP_RDMA_READ: u32 = 2;
/// A FETCH_ADD finished.
pub const TBRDMA_WC_OP_FETCH_ADD: u32 = 3;
/// A CMP_SWAP finished.
pub const TBRDMA_WC_OP_CMP_SWAP: u32 = 4;
/// A SEND arrived into a receive.
pub const TBRDMA_WC_OP_RECV: u32 = 5;
/// A WRITE_WITH_IMM consumed a receive.
pub const TBRDMA_WC_OP_RECV_RDMA_WITH_IMM: u32 = 6;

fn status_code(s: WcStatus) -> u32 {
    match s {
        WcStatus::Success => TBRDMA_WC_SUCCESS,
        WcStatus::LocalLength => TBRDMA_WC_LOCAL_LENGTH,
        WcStatus::LocalProtection => TBRDMA_WC_LOCAL_PROTECTION,
        WcStatus::Flushed => TBRDMA_WC_FLUSHED,
        WcStatus::RemoteAccess => TBRDMA_WC_REMOTE_ACCESS,
        WcStatus::RemoteInvalidRequest => TBRDMA_WC_REMOTE_INVALID_REQUEST,
        WcStatus::RemoteOperational => TBRDMA_WC_REMOTE_OPERATIONAL,
        WcStatus::RetryExceeded => TBRDMA_WC_RETRY_EXCEEDED,
        WcStatus::RnrRetryExceeded => TBRDMA_WC_RNR_RETRY_EXCEEDED,
    }
}

fn opcode_code(o: WcOpcode) -> u32 {
    match o {
        WcOpcode::Send => TBRDMA_WC_OP_SEND,
        WcOpcode::RdmaWrite => TBRDMA_WC_OP_RDMA_WRITE,
        WcOpcode::RdmaRead => TBRDMA_WC_OP_RDMA_READ,
        WcOpcode::FetchAdd => TBRDMA_WC_OP_FETCH_ADD,
        WcOpcode::CmpSwap => TBRDMA_WC_OP_CMP_SWAP,
        WcOpcode::Recv => TBRDMA_WC_OP_RECV,
        WcOpcode::RecvRdmaWithImm => TBRDMA_WC_OP_RECV_RDMA_WITH_IMM,
    }
}

/// Runs a body, turning a panic into `TBRDMA_ERR_INTERNAL`.
pub(crate) fn guard(body: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        fail(
            TBRDMA_ERR_INTERNAL,
            "internal error (a panic in libtbrdma); please report it",
        )
    })
}

fn invalid(what: &str) -> c_int {
    fail(TBRDMA_ERR_INVALID, what)
}

/// Borrows an object the caller passed.
///
/// # Safety
/// `p` must be NULL or a pointer this library returned and that has not been freed.
unsafe fn obj<'a, T>(p: *const T, what: &str) -> Result<&'a T, c_int> {
    // SAFETY: the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| invalid(&format!("{what} is NULL")))
}

/// Hands a new object to C through `out`.
///
/// # Safety
/// `out` must be valid for a pointer write.
pub(crate) unsafe fn give<T>(out: *mut *mut T, value: T) -> c_int {
    // SAFETY: the caller checked `out` is non-NULL; valid by the caller's contract.
    unsafe { out.write(Box::into_raw(Box::new(value))) };
    TBRDMA_OK
}

/// Reads a C string argument.
///
/// # Safety
/// `s` must be NULL or a NUL-terminated string.
pub(crate) unsafe fn text<'a>(s: *const c_char, what: &str) -> Result<&'a str, c_int> {
    if s.is_null() {
        return Err(invalid(&format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| invalid(&format!("{what} is not UTF-8")))
}

/// Reads `len` bytes of private data.
///
/// # Safety
/// `data` must be NULL (then `len` must be 0) or valid for reads of `len` bytes.
unsafe fn bytes(data: *const c_void, len: usize) -> Result<Vec<u8>, c_int> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if data.is_null() {
        return Err(invalid("private data is NULL with a non-zero length"));
    }
    // SAFETY: non-NULL and valid for `len` bytes by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec())
}

/// The message of the calling thread's last failure ("" if none). Valid until the next
/// failing call on the same thread.
#[unsafe(no_mangle)]
pub extern "C" fn tbrdma_last_error() -> *const c_char {
    last_error_ptr()
}

/// Opens the link named by an interface name (`thunderbolt0`) or a local IP address.
/// `engine` is `TBRDMA_ENGINE_*`, `progress` is `TBRDMA_PROGRESS_*`.
///
/// # Safety
/// `name_or_ip` must be a NUL-terminated string; `out` must be valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_device_open(
    name_or_ip: *const c_char,
    engine: c_int,
    progress: c_int,
    out: *mut *mut tbrdma_device,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let name = tri!(unsafe { text(name_or_ip, "name_or_ip") });
        if out.is_null() {
            return invalid("out is NULL");
        }
        let engine = match engine {
            TBRDMA_ENGINE_URING => EngineKind::Uring,
            TBRDMA_ENGINE_SOCKETS => EngineKind::Sockets,
            TBRDMA_ENGINE_PACKET => EngineKind::Packet,
            _ => {
                return invalid(
                    "engine must be TBRDMA_ENGINE_URING, TBRDMA_ENGINE_SOCKETS or TBRDMA_ENGINE_PACKET",
                );
            }
        };
        let progress = match progress {
            TBRDMA_PROGRESS_THREAD => Progress::Thread,
            TBRDMA_PROGRESS_CALLER => Progress::Caller,
            _ => {
                return invalid(
                    "progress must be TBRDMA_PROGRESS_THREAD or TBRDMA_PROGRESS_CALLER",
                );
            }
        };
        let config = DeviceConfig {
            engine: EngineConfig {
                engine,
                progress,
                ..EngineConfig::default()
            },
            port: 0,
        };
        match Device::open(name, config) {
            // SAFETY: `out` checked non-NULL, valid by the caller's contract.
            Ok(d) => unsafe { give(out, tbrdma_device(d)) },
            Err(e) => verbs(e),
        }
    })
}

/// Closes a device handle (the link closes when nothing else uses it). NULL is ignored.
///
/// # Safety
/// `dev` must be NULL or a device from `tbrdma_device_open`, not yet closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_device_close(dev: *mut tbrdma_device) {
    if !dev.is_null() {
        // SAFETY: allocated by `give` and not yet freed, by the caller's contract.
        drop(unsafe { Box::from_raw(dev) });
    }
}

/// Caller progress: runs the engine once. Thread progress: does nothing.
///
/// # Safety
/// `dev` must be a live device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_device_progress(dev: *const tbrdma_device) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let dev = tri!(unsafe { obj(dev, "dev") });
        match dev.0.progress() {
            Ok(_) => TBRDMA_OK,
            Err(e) => verbs(e),
        }
    })
}

/// Allocates a protection domain.
///
/// # Safety
/// `dev` must be a live device; `out` valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_pd_alloc(
    dev: *const tbrdma_device,
    out: *mut *mut tbrdma_pd,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let dev = tri!(unsafe { obj(dev, "dev") });
        if out.is_null() {
            return invalid("out is NULL");
        }
        // SAFETY: checked non-NULL.
        unsafe { give(out, tbrdma_pd(dev.0.alloc_pd())) }
    })
}

/// Frees a protection domain handle. NULL is ignored.
///
/// # Safety
/// `pd` must be NULL or from `tbrdma_pd_alloc`, not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_pd_free(pd: *mut tbrdma_pd) {
    if !pd.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(pd) });
    }
}

fn access_of(bits: u32) -> Result<Access, c_int> {
    Access::from_bits(bits).ok_or_else(|| invalid("unknown access flags"))
}

/// Allocates `len` bytes of pinned memory and registers them with `access`
/// (`TBRDMA_ACCESS_*`); `tbrdma_mr_addr` gives the address.
///
/// # Safety
/// `pd` must be live; `out` valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_mr_alloc(
    pd: *const tbrdma_pd,
    len: usize,
    access: u32,
    out: *mut *mut tbrdma_mr,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let pd = tri!(unsafe { obj(pd, "pd") });
        let access = tri!(access_of(access));
        if out.is_null() || len == 0 {
            return invalid("out is NULL or len is 0");
        }
        match pd.0.alloc_mr(len, access) {
            // SAFETY: checked non-NULL.
            Ok(mr) => unsafe { give(out, tbrdma_mr(mr)) },
            Err(e) => verbs(e),
        }
    })
}

/// Registers memory the caller owns (`ibv_reg_mr`).
///
/// # Safety
/// `pd` must be live; `out` valid for a pointer write; `addr..addr+len` must stay valid for
/// reads and writes from any thread until the region and every queue pair that used it are
/// freed, and the caller must not rely on its contents while requests that name it are
/// outstanding.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_mr_register(
    pd: *const tbrdma_pd,
    addr: *mut c_void,
    len: usize,
    access: u32,
    out: *mut *mut tbrdma_mr,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let pd = tri!(unsafe { obj(pd, "pd") });
        let access = tri!(access_of(access));
        let Some(ptr) = NonNull::new(addr.cast::<u8>()) else {
            return invalid("addr is NULL");
        };
        if out.is_null() || len == 0 {
            return invalid("out is NULL or len is 0");
        }
        // SAFETY: forwarded: this function's contract is register_mr's.
        match unsafe { pd.0.register_mr(ptr, len, access) } {
            // SAFETY: checked non-NULL.
            Ok(mr) => unsafe { give(out, tbrdma_mr(mr)) },
            Err(e) => verbs(e),
        }
    })
}

/// Deregisters and frees a region (its keys stop working at once). NULL is ignored.
///
/// # Safety
/// `mr` must be NULL or from `tbrdma_mr_alloc`/`tbrdma_mr_register`, not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_mr_free(mr: *mut tbrdma_mr) {
    if !mr.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(mr) });
    }
}

/// Address of the region's first byte (a pointer into this process for both kinds).
///
/// # Safety
/// `mr` must be a live region.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_mr_addr(mr: *const tbrdma_mr) -> *mut c_void {
    // SAFETY: the caller's contract.
    unsafe { mr.as_ref() }.map_or(std::ptr::null_mut(), |m| m.0.addr() as usize as *mut c_void)
}

/// Length of the region in bytes.
///
/// # Safety
/// `mr` must be a live region.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_mr_len(mr: *const tbrdma_mr) -> usize {
    // SAFETY: the caller's contract.
    unsafe { mr.as_ref() }.map_or(0, |m| m.0.len())
}

/// Local key (for `tbrdma_sge.lkey`).
///
/// # Safety
/// `mr` must be a live region.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_mr_lkey(mr: *const tbrdma_mr) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { mr.as_ref() }.map_or(0, |m| m.0.lkey())
}

/// Remote key (give it to the peer with the address).
///
/// # Safety
/// `mr` must be a live region.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_mr_rkey(mr: *const tbrdma_mr) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { mr.as_ref() }.map_or(0, |m| m.0.rkey())
}

/// Creates a completion queue with room for `capacity` completions.
///
/// # Safety
/// `dev` must be live; `out` valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_cq_create(
    dev: *const tbrdma_device,
    capacity: usize,
    out: *mut *mut tbrdma_cq,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let dev = tri!(unsafe { obj(dev, "dev") });
        if out.is_null() || capacity == 0 {
            return invalid("out is NULL or capacity is 0");
        }
        // SAFETY: checked non-NULL.
        unsafe { give(out, tbrdma_cq(dev.0.create_cq(capacity))) }
    })
}

/// Frees a completion queue handle. NULL is ignored.
///
/// # Safety
/// `cq` must be NULL or from `tbrdma_cq_create`, not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_cq_free(cq: *mut tbrdma_cq) {
    if !cq.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(cq) });
    }
}

/// Moves up to `max` completions into `wcs`; returns how many (0 or more) or a negative
/// error. In caller-progress mode this also runs the engine.
///
/// # Safety
/// `cq` must be live; `wcs` valid for writes of `max` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_poll_cq(
    cq: *const tbrdma_cq,
    wcs: *mut tbrdma_wc,
    max: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let cq = tri!(unsafe { obj(cq, "cq") });
        if wcs.is_null() && max > 0 {
            return invalid("wcs is NULL");
        }
        let mut buf = vec![Completion::default(); max.min(1024)];
        let n = match cq.0.poll(&mut buf) {
            Ok(n) => n,
            Err(e) => return verbs(e),
        };
        for (i, c) in buf[..n].iter().enumerate() {
            let wc = tbrdma_wc {
                wr_id: c.wc.wr_id,
                byte_len: c.wc.byte_len,
                status: status_code(c.wc.status),
                opcode: opcode_code(c.wc.opcode),
                imm: c.wc.imm.unwrap_or(0),
                has_imm: u32::from(c.wc.imm.is_some()),
                qp_num: c.qp_num,
            };
            // SAFETY: i < n <= max entries, valid by the caller's contract.
            unsafe { wcs.add(i).write(wc) };
        }
        n as c_int
    })
}

/// Listens for connections on the device's address, TCP port `port` (0: any free port).
///
/// # Safety
/// `dev` must be live; `out` valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_listen(
    dev: *const tbrdma_device,
    port: u16,
    out: *mut *mut tbrdma_listener,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let dev = tri!(unsafe { obj(dev, "dev") });
        if out.is_null() {
            return invalid("out is NULL");
        }
        match Listener::bind(&dev.0, port) {
            // SAFETY: checked non-NULL.
            Ok(l) => unsafe { give(out, tbrdma_listener(l)) },
            Err(e) => verbs(e),
        }
    })
}

/// The port a listener listens on.
///
/// # Safety
/// `listener` must be live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_listener_port(listener: *const tbrdma_listener) -> u16 {
    // SAFETY: the caller's contract.
    unsafe { listener.as_ref() }
        .and_then(|l| l.0.local_addr().ok())
        .map_or(0, |a| a.port())
}

/// Frees a listener. NULL is ignored.
///
/// # Safety
/// `listener` must be NULL or from `tbrdma_listen`, not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_listener_free(listener: *mut tbrdma_listener) {
    if !listener.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(listener) });
    }
}

fn options(private: Vec<u8>, timeout_ms: u32) -> QpOptions {
    QpOptions {
        private_data: private,
        timeout: Duration::from_millis(u64::from(timeout_ms.max(1))),
        ..QpOptions::default()
    }
}

/// Waits up to `timeout_ms` for a client, then sets up the connection (sending
/// `private_data`, at most 64 KiB) within the same time.
///
/// # Safety
/// All objects live; `private_data` valid for `private_len` bytes (or NULL with 0); `out`
/// valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_accept(
    listener: *const tbrdma_listener,
    pd: *const tbrdma_pd,
    send_cq: *const tbrdma_cq,
    recv_cq: *const tbrdma_cq,
    private_data: *const c_void,
    private_len: usize,
    timeout_ms: u32,
    out: *mut *mut tbrdma_qp,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract, for each argument.
        let (listener, pd, scq, rcq) = unsafe {
            (
                tri!(obj(listener, "listener")),
                tri!(obj(pd, "pd")),
                tri!(obj(send_cq, "send_cq")),
                tri!(obj(recv_cq, "recv_cq")),
            )
        };
        // SAFETY: the caller's contract.
        let private = tri!(unsafe { bytes(private_data, private_len) });
        if out.is_null() {
            return invalid("out is NULL");
        }
        let opts = options(private, timeout_ms);
        let wait = Some(opts.timeout);
        match listener.0.accept(&pd.0, &scq.0, &rcq.0, &opts, wait) {
            // SAFETY: checked non-NULL.
            Ok(c) => unsafe {
                give(
                    out,
                    tbrdma_qp {
                        qp: c.qp,
                        peer_private_data: c.peer_private_data,
                    },
                )
            },
            Err(e) => verbs(e),
        }
    })
}

/// Connects to a listener at `server` ("ip:port"), sending `private_data`, within
/// `timeout_ms`.
///
/// # Safety
/// All objects live; `server` NUL-terminated; `private_data` valid for `private_len` bytes
/// (or NULL with 0); `out` valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_connect(
    pd: *const tbrdma_pd,
    server: *const c_char,
    send_cq: *const tbrdma_cq,
    recv_cq: *const tbrdma_cq,
    private_data: *const c_void,
    private_len: usize,
    timeout_ms: u32,
    out: *mut *mut tbrdma_qp,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract, for each argument.
        let (pd, scq, rcq, server) = unsafe {
            (
                tri!(obj(pd, "pd")),
                tri!(obj(send_cq, "send_cq")),
                tri!(obj(recv_cq, "recv_cq")),
                tri!(text(server, "server")),
            )
        };
        let Ok(server) = server.parse::<SocketAddr>() else {
            return invalid("server must be \"ip:port\"");
        };
        // SAFETY: the caller's contract.
        let private = tri!(unsafe { bytes(private_data, private_len) });
        if out.is_null() {
            return invalid("out is NULL");
        }
        match tbrdma_verbs::connect(&pd.0, server, &scq.0, &rcq.0, &options(private, timeout_ms)) {
            // SAFETY: checked non-NULL.
            Ok(c) => unsafe {
                give(
                    out,
                    tbrdma_qp {
                        qp: c.qp,
                        peer_private_data: c.peer_private_data,
                    },
                )
            },
            Err(e) => verbs(e),
        }
    })
}

/// Copies up to `cap` bytes of the private data the peer sent into `buf`; returns its full
/// length.
///
/// # Safety
/// `qp` must be live; `buf` valid for writes of `cap` bytes (or NULL with 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_qp_peer_private_data(
    qp: *const tbrdma_qp,
    buf: *mut c_void,
    cap: usize,
) -> usize {
    // SAFETY: the caller's contract.
    let Some(qp) = (unsafe { qp.as_ref() }) else {
        return 0;
    };
    let n = qp.peer_private_data.len().min(cap);
    if n > 0 && !buf.is_null() {
        // SAFETY: `buf` holds `cap >= n` bytes by the caller's contract; no overlap (ours is
        // a fresh Vec).
        unsafe { std::ptr::copy_nonoverlapping(qp.peer_private_data.as_ptr(), buf.cast(), n) };
    }
    qp.peer_private_data.len()
}

/// The local queue pair number.
///
/// # Safety
/// `qp` must be live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_qp_num(qp: *const tbrdma_qp) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { qp.as_ref() }.map_or(0, |q| q.qp.qp_num())
}

/// Closes the connection and frees the queue pair. NULL is ignored.
///
/// # Safety
/// `qp` must be NULL or from `tbrdma_accept`/`tbrdma_connect`, not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_qp_free(qp: *mut tbrdma_qp) {
    if !qp.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(qp) });
    }
}

fn send_wr(w: &tbrdma_send_wr) -> Result<SendWr, c_int> {
    let remote = RemoteAddr {
        addr: w.remote_addr,
        rkey: w.rkey,
    };
    let op = match w.opcode {
        TBRDMA_WR_SEND => SendOp::Send { imm: None },
        TBRDMA_WR_SEND_WITH_IMM => SendOp::Send { imm: Some(w.imm) },
        TBRDMA_WR_WRITE => SendOp::Write { remote },
        TBRDMA_WR_WRITE_WITH_IMM => SendOp::WriteWithImm { remote, imm: w.imm },
        TBRDMA_WR_READ => SendOp::Read { remote },
        TBRDMA_WR_FETCH_ADD => SendOp::FetchAdd {
            remote,
            add: w.compare_add,
        },
        TBRDMA_WR_CMP_SWAP => SendOp::CmpSwap {
            remote,
            compare: w.compare_add,
            swap: w.swap,
        },
        other => return Err(invalid(&format!("unknown opcode {other}"))),
    };
    Ok(SendWr {
        wr_id: w.wr_id,
        local: sge(&w.sge),
        op,
    })
}

fn sge(s: &tbrdma_sge) -> Sge {
    Sge {
        addr: s.addr,
        len: s.length,
        lkey: s.lkey,
    }
}

/// Posts `n` send-queue requests under one doorbell. On an error, the requests before the
/// refused one were posted.
///
/// # Safety
/// `qp` must be live; `wrs` valid for reads of `n` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_post_send(
    qp: *const tbrdma_qp,
    wrs: *const tbrdma_send_wr,
    n: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let qp = tri!(unsafe { obj(qp, "qp") });
        if wrs.is_null() && n > 0 {
            return invalid("wrs is NULL");
        }
        let raw = if n == 0 {
            &[][..]
        } else {
            // SAFETY: non-NULL (checked) and `n` entries readable by the caller's contract.
            unsafe { std::slice::from_raw_parts(wrs, n) }
        };
        let wrs: Vec<SendWr> = tri!(raw.iter().map(send_wr).collect::<Result<_, _>>());
        match qp.qp.post_send(&wrs) {
            Ok(()) => TBRDMA_OK,
            Err(e) => verbs(e),
        }
    })
}

/// Posts `n` receive buffers, in order.
///
/// # Safety
/// `qp` must be live; `wrs` valid for reads of `n` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_post_recv(
    qp: *const tbrdma_qp,
    wrs: *const tbrdma_recv_wr,
    n: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let qp = tri!(unsafe { obj(qp, "qp") });
        if wrs.is_null() && n > 0 {
            return invalid("wrs is NULL");
        }
        let raw = if n == 0 {
            &[][..]
        } else {
            // SAFETY: non-NULL (checked) and `n` entries readable by the caller's contract.
            unsafe { std::slice::from_raw_parts(wrs, n) }
        };
        let wrs: Vec<RecvWr> = raw
            .iter()
            .map(|w| RecvWr {
                wr_id: w.wr_id,
                local: sge(&w.sge),
            })
            .collect();
        match qp.qp.post_recv(&wrs) {
            Ok(()) => TBRDMA_OK,
            Err(e) => verbs(e),
        }
    })
}
