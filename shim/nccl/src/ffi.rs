//! The C boundary: the exported `ncclNetPlugin_v8`, `_v9`, `_v10` and `_v11` tables and the
//! `extern "C"` functions they point at. FFI file: this is where C pointers are read and
//! written, each under a `// SAFETY:` comment naming the NCCL contract that makes it valid.
//! Every entry point runs its body inside `catch_unwind`, so no panic crosses into C; every
//! failure becomes an `ncclResult_t` and a WARN through NCCL's logger. Handles NCCL holds
//! (comms, requests, memory handles, contexts) are integers from `net`, never Rust pointers,
//! so a stale or foreign handle is an error, not a crash.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::mem::size_of;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;

use tbrdma_verbs::Access;

use crate::abi::{
    CommConfig, Logger, MAX_NET_SIZE, NCCL_NET_DEVICE_HOST, NCCL_NET_HANDLE_MAXSIZE, NCCL_PTR_HOST,
    NCCL_SUCCESS, NcclResult, ProfilerCallback, PropertiesV8, PropertiesV9, PropertiesV11,
    VDeviceProps,
};
use crate::comm::Registration;
use crate::error::{NetError, Result};
use crate::log;
use crate::net::{self, DEVICE_NAME, DataComm, PLUGIN_NAME};

/// Runs an entry point's body: errors become their code plus a WARN, panics become
/// `ncclInternalError`.
fn guard(entry: &'static str, body: impl FnOnce() -> Result<()>) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(e)) => {
            log::warn(&format!("{entry}: {e}"));
            e.code()
        }
        Err(panic) => {
            let detail = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let e = NetError::Panic { entry, detail };
            let message = e.to_string();
            let _ = catch_unwind(|| log::warn(&message));
            e.code()
        }
    }
}

fn null_arg(what: &str) -> NetError {
    NetError::misuse(format!("{what} is NULL"))
}

/// Stores `value` through an out-pointer.
///
/// # Safety
/// `out` must be NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T, what: &str) -> Result<()> {
    if out.is_null() {
        return Err(null_arg(what));
    }
    // SAFETY: non-NULL, and valid for writes by the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

fn id_of(p: *mut c_void) -> u64 {
    p as usize as u64
}

fn ptr_of(id: u64) -> *mut c_void {
    id as usize as *mut c_void
}

/// The 128-byte handle buffer.
///
/// # Safety
/// `handle` must be NULL or point to `NCCL_NET_HANDLE_MAXSIZE` writable bytes that no one
/// else touches during the call (NCCL's contract for listen and connect).
unsafe fn handle_bytes<'a>(handle: *mut c_void) -> Result<&'a mut [u8; NCCL_NET_HANDLE_MAXSIZE]> {
    // SAFETY: see the function's contract; u8 has no alignment requirement.
    unsafe { handle.cast::<[u8; NCCL_NET_HANDLE_MAXSIZE]>().as_mut() }
        .ok_or_else(|| null_arg("handle"))
}

// ---------------------------------------------------------------------------------------
// init / devices / properties

unsafe extern "C" fn init_v8(logger: Logger) -> NcclResult {
    guard("init", || {
        log::set_logger(logger);
        net::init()
    })
}

unsafe extern "C" fn init_v10(logger: Logger, _prof: ProfilerCallback) -> NcclResult {
    guard("init", || {
        log::set_logger(logger);
        net::init()
    })
}

unsafe extern "C" fn init_v11(
    ctx: *mut *mut c_void,
    _comm_id: u64,
    _config: *mut CommConfig,
    logger: Logger,
    _prof: ProfilerCallback,
) -> NcclResult {
    guard("init", || {
        log::set_logger(logger);
        if ctx.is_null() {
            return Err(null_arg("ctx"));
        }
        let id = net::init_context()?;
        // SAFETY: NCCL passes a valid out-pointer for the new context.
        unsafe { put(ctx, ptr_of(id), "ctx") }
    })
}

unsafe extern "C" fn finalize_v11(ctx: *mut c_void) -> NcclResult {
    guard("finalize", || net::finalize_context(id_of(ctx)))
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> NcclResult {
    guard("devices", || {
        let n = net::devices()?;
        // SAFETY: NCCL passes a valid `int*`.
        unsafe { put(ndev, n, "ndev") }
    })
}

fn props_v9(p: &net::Properties, dev: c_int) -> PropertiesV9 {
    PropertiesV9 {
        name: DEVICE_NAME.as_ptr().cast_mut(),
        pci_path: std::ptr::null_mut(),
        guid: p.guid,
        ptr_support: NCCL_PTR_HOST,
        reg_is_global: 0,
        force_flush: 0,
        speed: p.speed,
        port: 0,
        latency: p.latency,
        max_comms: 65536,
        max_recvs: 1,
        net_device_type: NCCL_NET_DEVICE_HOST,
        net_device_version: 0,
        vprops: VDeviceProps {
            ndevs: 1,
            devs: [dev, 0, 0, 0],
        },
        max_p2p_bytes: MAX_NET_SIZE,
        max_coll_bytes: MAX_NET_SIZE,
    }
}

unsafe extern "C" fn get_properties_v8(dev: c_int, props: *mut PropertiesV8) -> NcclResult {
    guard("getProperties", || {
        let p = props_v9(&net::properties(dev)?, dev);
        let v8 = PropertiesV8 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
        };
        // SAFETY: NCCL passes a valid `ncclNetProperties_v8_t*`.
        unsafe { put(props, v8, "props") }
    })
}

unsafe extern "C" fn get_properties_v9(dev: c_int, props: *mut PropertiesV9) -> NcclResult {
    guard("getProperties", || {
        let p = props_v9(&net::properties(dev)?, dev);
        // SAFETY: NCCL passes a valid `ncclNetProperties_v9_t*` (v10's is the same struct).
        unsafe { put(props, p, "props") }
    })
}

unsafe extern "C" fn get_properties_v11(dev: c_int, props: *mut PropertiesV11) -> NcclResult {
    guard("getProperties", || {
        let p = PropertiesV11 {
            base: props_v9(&net::properties(dev)?, dev),
            max_multi_request_size: 1,
        };
        // SAFETY: NCCL passes a valid `ncclNetProperties_v11_t*`.
        unsafe { put(props, p, "props") }
    })
}

// ---------------------------------------------------------------------------------------
// listen / connect / accept

fn listen_into(dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> Result<()> {
    if listen_comm.is_null() {
        return Err(null_arg("listenComm"));
    }
    // SAFETY: NCCL passes its NCCL_NET_HANDLE_MAXSIZE-byte handle buffer.
    let handle = unsafe { handle_bytes(handle) }?;
    let id = net::listen(dev, handle)?;
    // SAFETY: checked non-NULL above; NCCL passes a valid `void**`.
    unsafe { put(listen_comm, ptr_of(id), "listenComm") }
}

unsafe extern "C" fn listen_v8(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> NcclResult {
    guard("listen", || listen_into(dev, handle, listen_comm))
}

unsafe extern "C" fn listen_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> NcclResult {
    guard("listen", || {
        net::check_context(id_of(ctx))?;
        listen_into(dev, handle, listen_comm)
    })
}

/// `*sendComm` is written NULL (call again) or with the new comm. The device-handle
/// out-parameter is never touched (pitfall P7: RCCL may pass something else there).
fn connect_into(dev: c_int, handle: *mut c_void, send_comm: *mut *mut c_void) -> Result<()> {
    if send_comm.is_null() {
        return Err(null_arg("sendComm"));
    }
    // SAFETY: NCCL passes a valid `void**`.
    unsafe { put(send_comm, std::ptr::null_mut(), "sendComm") }?;
    // SAFETY: NCCL passes the same 128-byte handle buffer on every retry.
    let handle = unsafe { handle_bytes(handle) }?;
    if let Some(id) = net::connect(dev, handle)? {
        // SAFETY: as above.
        unsafe { put(send_comm, ptr_of(id), "sendComm") }?;
    }
    Ok(())
}

unsafe extern "C" fn connect_v8(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut c_void,
) -> NcclResult {
    guard("connect", || connect_into(dev, handle, send_comm))
}

unsafe extern "C" fn connect_v10(
    dev: c_int,
    _config: *mut CommConfig,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut c_void,
) -> NcclResult {
    guard("connect", || connect_into(dev, handle, send_comm))
}

unsafe extern "C" fn connect_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut c_void,
) -> NcclResult {
    guard("connect", || {
        net::check_context(id_of(ctx))?;
        connect_into(dev, handle, send_comm)
    })
}

unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _recv_dev_comm: *mut *mut c_void,
) -> NcclResult {
    guard("accept", || {
        if recv_comm.is_null() {
            return Err(null_arg("recvComm"));
        }
        let id = net::accept(id_of(listen_comm))?;
        // SAFETY: checked non-NULL; NCCL passes a valid `void**`.
        unsafe {
            put(
                recv_comm,
                id.map_or(std::ptr::null_mut(), ptr_of),
                "recvComm",
            )
        }
    })
}

// ---------------------------------------------------------------------------------------
// memory registration

unsafe extern "C" fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    mhandle: *mut *mut c_void,
) -> NcclResult {
    guard("regMr", || {
        if kind != NCCL_PTR_HOST {
            return Err(NetError::misuse(format!(
                "regMr of memory type {kind}: tbrdma registers host memory only (NCCL_PTR_HOST)"
            )));
        }
        if mhandle.is_null() {
            return Err(null_arg("mhandle"));
        }
        let ptr = NonNull::new(data.cast::<u8>()).ok_or_else(|| null_arg("data"))?;
        if size == 0 {
            return Err(NetError::misuse("regMr of 0 bytes"));
        }
        let comm = net::data_comm(id_of(comm))?;
        let (pd, regs, access) = match &comm {
            DataComm::Send(s) => (s.pd(), &s.regs, Access::LOCAL_WRITE),
            DataComm::Recv(r) => (r.pd(), &r.regs, Access::LOCAL_WRITE | Access::REMOTE_WRITE),
        };
        // SAFETY: NCCL's regMr contract: `data..data+size` is host memory NCCL owns and keeps
        // allocated until deregMr, and NCCL reads or writes it only between the completion of
        // the requests that use it and the next post (it is our peer's WRITE target only while
        // a receive on it is outstanding). deregMr drops the region, revoking its keys.
        let mr = unsafe { pd.register_mr(ptr, size, access) }
            .map_err(NetError::verbs("registering memory"))?;
        let id = regs
            .lock()
            .expect("registrations lock")
            .insert(Registration {
                addr: ptr.as_ptr() as usize as u64,
                len: size as u64,
                mr,
            });
        // SAFETY: checked non-NULL; NCCL passes a valid `void**`.
        unsafe { put(mhandle, ptr_of(id), "mhandle") }
    })
}

unsafe extern "C" fn dereg_mr(comm: *mut c_void, mhandle: *mut c_void) -> NcclResult {
    guard("deregMr", || {
        let comm = net::data_comm(id_of(comm))?;
        let regs = match &comm {
            DataComm::Send(s) => &s.regs,
            DataComm::Recv(r) => &r.regs,
        };
        if regs
            .lock()
            .expect("registrations lock")
            .remove(id_of(mhandle))
        {
            Ok(())
        } else {
            Err(NetError::misuse(format!(
                "deregMr of unknown memory handle {:#x}",
                id_of(mhandle)
            )))
        }
    })
}

// ---------------------------------------------------------------------------------------
// data path

fn isend_into(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: u64,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> Result<()> {
    if request.is_null() {
        return Err(null_arg("request"));
    }
    // SAFETY: NCCL passes a valid `void**`.
    unsafe { put(request, std::ptr::null_mut(), "request") }?;
    let comm_id = id_of(send_comm);
    let comm = net::send_comm(comm_id)?;
    if let Some(slot) = comm.isend(data as usize as u64, size, id_of(mhandle))? {
        // SAFETY: as above.
        unsafe { put(request, ptr_of(net::request_id(comm_id, slot)), "request") }?;
    }
    Ok(())
}

unsafe extern "C" fn isend_v8(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    _tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("isend", || {
        let size = u64::try_from(size).map_err(|_| NetError::misuse("isend of a negative size"))?;
        isend_into(send_comm, data, size, mhandle, request)
    })
}

unsafe extern "C" fn isend_v9(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    _tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("isend", || {
        isend_into(send_comm, data, size as u64, mhandle, request)
    })
}

unsafe extern "C" fn isend_v10(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    _tag: c_int,
    mhandle: *mut c_void,
    _phandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("isend", || {
        isend_into(send_comm, data, size as u64, mhandle, request)
    })
}

/// Reads entry 0 of NCCL's `n`-entry receive arrays; `size_of_entry` reads `sizes[0]`.
fn irecv_into(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    size: impl FnOnce() -> Result<u64>,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> Result<()> {
    if request.is_null() {
        return Err(null_arg("request"));
    }
    // `*request` may hold the 0x1 hint on entry (pitfall P6): it is output only.
    // SAFETY: NCCL passes a valid `void**`.
    unsafe { put(request, std::ptr::null_mut(), "request") }?;
    if n != 1 {
        return Err(NetError::misuse(format!(
            "irecv with n = {n}: tbrdma advertises maxRecvs = 1"
        )));
    }
    if data.is_null() || mhandles.is_null() {
        return Err(null_arg("irecv data or mhandles"));
    }
    // SAFETY: with n == 1 NCCL passes arrays of at least one entry.
    let (buf, mh) = unsafe { (data.read(), mhandles.read()) };
    let size = size()?;
    let comm_id = id_of(recv_comm);
    let comm = net::recv_comm(comm_id)?;
    if let Some(slot) = comm.irecv(buf as usize as u64, size, id_of(mh))? {
        // SAFETY: as above.
        unsafe { put(request, ptr_of(net::request_id(comm_id, slot)), "request") }?;
    }
    Ok(())
}

unsafe extern "C" fn irecv_v8(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("irecv", || {
        let size = || {
            // SAFETY: with n == 1 (checked before this runs) `sizes` has one entry.
            let s = unsafe { sizes.as_ref() }.ok_or_else(|| null_arg("sizes"))?;
            u64::try_from(*s).map_err(|_| NetError::misuse("irecv of a negative size"))
        };
        irecv_into(recv_comm, n, data, size, mhandles, request)
    })
}

unsafe extern "C" fn irecv_v9(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("irecv", || {
        let size = || {
            // SAFETY: with n == 1 (checked before this runs) `sizes` has one entry.
            let s = unsafe { sizes.as_ref() }.ok_or_else(|| null_arg("sizes"))?;
            Ok(*s as u64)
        };
        irecv_into(recv_comm, n, data, size, mhandles, request)
    })
}

unsafe extern "C" fn irecv_v10(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    _phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("irecv", || {
        let size = || {
            // SAFETY: with n == 1 (checked before this runs) `sizes` has one entry.
            let s = unsafe { sizes.as_ref() }.ok_or_else(|| null_arg("sizes"))?;
            Ok(*s as u64)
        };
        irecv_into(recv_comm, n, data, size, mhandles, request)
    })
}

/// Host memory needs no flush: "no request" tells NCCL there is nothing to wait for.
unsafe extern "C" fn iflush(
    _recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iflush", || {
        // SAFETY: NCCL passes a valid `void**`.
        unsafe { put(request, std::ptr::null_mut(), "request") }
    })
}

unsafe extern "C" fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    guard("test", || {
        if done.is_null() {
            return Err(null_arg("done"));
        }
        let outcome = net::test(id_of(request));
        let finished = match &outcome {
            Ok(Some(_)) | Err(NetError::Truncated { .. }) => 1,
            _ => 0,
        };
        // SAFETY: NCCL passes a valid `int*`.
        unsafe { put(done, finished, "done") }?;
        if let Some(len) = outcome? {
            if !sizes.is_null() {
                // SAFETY: non-NULL `sizes` has n (1) entries.
                unsafe { put(sizes, c_int::try_from(len).unwrap_or(c_int::MAX), "sizes") }?;
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn close_send(comm: *mut c_void) -> NcclResult {
    guard("closeSend", || net::close(id_of(comm), "send"))
}

unsafe extern "C" fn close_recv(comm: *mut c_void) -> NcclResult {
    guard("closeRecv", || net::close(id_of(comm), "recv"))
}

unsafe extern "C" fn close_listen(comm: *mut c_void) -> NcclResult {
    guard("closeListen", || net::close(id_of(comm), "listen"))
}

// ---------------------------------------------------------------------------------------
// The tables

type VoidP = *mut c_void;
type VoidPP = *mut *mut c_void;
/// Members tbrdma leaves NULL; their exact signatures do not matter for a NULL pointer.
type Absent = Option<unsafe extern "C" fn()>;

/// `ncclNet_v8_t` (152 bytes). Fields follow NCCL's member order (see the design notes).
#[repr(C)]
#[derive(Debug)]
pub struct NetV8 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(Logger) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropertiesV8) -> NcclResult>,
    pub listen: Option<unsafe extern "C" fn(c_int, VoidP, VoidPP) -> NcclResult>,
    pub connect: Option<unsafe extern "C" fn(c_int, VoidP, VoidPP, VoidPP) -> NcclResult>,
    pub accept: Option<unsafe extern "C" fn(VoidP, VoidPP, VoidPP) -> NcclResult>,
    pub reg_mr: Option<unsafe extern "C" fn(VoidP, VoidP, usize, c_int, VoidPP) -> NcclResult>,
    pub reg_mr_dma_buf: Absent,
    pub dereg_mr: Option<unsafe extern "C" fn(VoidP, VoidP) -> NcclResult>,
    pub isend:
        Option<unsafe extern "C" fn(VoidP, VoidP, c_int, c_int, VoidP, VoidPP) -> NcclResult>,
    pub irecv: Option<
        unsafe extern "C" fn(
            VoidP,
            c_int,
            VoidPP,
            *mut c_int,
            *mut c_int,
            VoidPP,
            VoidPP,
        ) -> NcclResult,
    >,
    pub iflush: Option<
        unsafe extern "C" fn(VoidP, c_int, VoidPP, *mut c_int, VoidPP, VoidPP) -> NcclResult,
    >,
    pub test: Option<unsafe extern "C" fn(VoidP, *mut c_int, *mut c_int) -> NcclResult>,
    pub close_send: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub get_device_mr: Absent,
    pub irecv_consumed: Absent,
}

/// `ncclNet_v9_t` (160 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct NetV9 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(Logger) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropertiesV9) -> NcclResult>,
    pub listen: Option<unsafe extern "C" fn(c_int, VoidP, VoidPP) -> NcclResult>,
    pub connect: Option<unsafe extern "C" fn(c_int, VoidP, VoidPP, VoidPP) -> NcclResult>,
    pub accept: Option<unsafe extern "C" fn(VoidP, VoidPP, VoidPP) -> NcclResult>,
    pub reg_mr: Option<unsafe extern "C" fn(VoidP, VoidP, usize, c_int, VoidPP) -> NcclResult>,
    pub reg_mr_dma_buf: Absent,
    pub dereg_mr: Option<unsafe extern "C" fn(VoidP, VoidP) -> NcclResult>,
    pub isend:
        Option<unsafe extern "C" fn(VoidP, VoidP, usize, c_int, VoidP, VoidPP) -> NcclResult>,
    pub irecv: Option<
        unsafe extern "C" fn(
            VoidP,
            c_int,
            VoidPP,
            *mut usize,
            *mut c_int,
            VoidPP,
            VoidPP,
        ) -> NcclResult,
    >,
    pub iflush: Option<
        unsafe extern "C" fn(VoidP, c_int, VoidPP, *mut c_int, VoidPP, VoidPP) -> NcclResult,
    >,
    pub test: Option<unsafe extern "C" fn(VoidP, *mut c_int, *mut c_int) -> NcclResult>,
    pub close_send: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub get_device_mr: Absent,
    pub irecv_consumed: Absent,
    pub make_vdevice: Absent,
}

/// `ncclNet_v10_t` (160 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct NetV10 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(Logger, ProfilerCallback) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropertiesV9) -> NcclResult>,
    pub listen: Option<unsafe extern "C" fn(c_int, VoidP, VoidPP) -> NcclResult>,
    pub connect:
        Option<unsafe extern "C" fn(c_int, *mut CommConfig, VoidP, VoidPP, VoidPP) -> NcclResult>,
    pub accept: Option<unsafe extern "C" fn(VoidP, VoidPP, VoidPP) -> NcclResult>,
    pub reg_mr: Option<unsafe extern "C" fn(VoidP, VoidP, usize, c_int, VoidPP) -> NcclResult>,
    pub reg_mr_dma_buf: Absent,
    pub dereg_mr: Option<unsafe extern "C" fn(VoidP, VoidP) -> NcclResult>,
    pub isend: Option<
        unsafe extern "C" fn(VoidP, VoidP, usize, c_int, VoidP, VoidP, VoidPP) -> NcclResult,
    >,
    pub irecv: Option<
        unsafe extern "C" fn(
            VoidP,
            c_int,
            VoidPP,
            *mut usize,
            *mut c_int,
            VoidPP,
            VoidPP,
            VoidPP,
        ) -> NcclResult,
    >,
    pub iflush: Option<
        unsafe extern "C" fn(VoidP, c_int, VoidPP, *mut c_int, VoidPP, VoidPP) -> NcclResult,
    >,
    pub test: Option<unsafe extern "C" fn(VoidP, *mut c_int, *mut c_int) -> NcclResult>,
    pub close_send: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub get_device_mr: Absent,
    pub irecv_consumed: Absent,
    pub make_vdevice: Absent,
}

/// `ncclNet_v11_t` (176 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct NetV11 {
    pub name: *const c_char,
    pub init: Option<
        unsafe extern "C" fn(VoidPP, u64, *mut CommConfig, Logger, ProfilerCallback) -> NcclResult,
    >,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropertiesV11) -> NcclResult>,
    pub listen: Option<unsafe extern "C" fn(VoidP, c_int, VoidP, VoidPP) -> NcclResult>,
    pub connect: Option<unsafe extern "C" fn(VoidP, c_int, VoidP, VoidPP, VoidPP) -> NcclResult>,
    pub accept: Option<unsafe extern "C" fn(VoidP, VoidPP, VoidPP) -> NcclResult>,
    pub reg_mr: Option<unsafe extern "C" fn(VoidP, VoidP, usize, c_int, VoidPP) -> NcclResult>,
    pub reg_mr_dma_buf: Absent,
    pub dereg_mr: Option<unsafe extern "C" fn(VoidP, VoidP) -> NcclResult>,
    pub isend: Option<
        unsafe extern "C" fn(VoidP, VoidP, usize, c_int, VoidP, VoidP, VoidPP) -> NcclResult,
    >,
    pub irecv: Option<
        unsafe extern "C" fn(
            VoidP,
            c_int,
            VoidPP,
            *mut usize,
            *mut c_int,
            VoidPP,
            VoidPP,
            VoidPP,
        ) -> NcclResult,
    >,
    pub iflush: Option<
        unsafe extern "C" fn(VoidP, c_int, VoidPP, *mut c_int, VoidPP, VoidPP) -> NcclResult,
    >,
    pub test: Option<unsafe extern "C" fn(VoidP, *mut c_int, *mut c_int) -> NcclResult>,
    pub close_send: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub get_device_mr: Absent,
    pub irecv_consumed: Absent,
    pub make_vdevice: Absent,
    pub finalize: Option<unsafe extern "C" fn(VoidP) -> NcclResult>,
    pub set_net_attr: Absent,
}

const _: () = {
    assert!(size_of::<NetV8>() == 152);
    assert!(size_of::<NetV9>() == 160);
    assert!(size_of::<NetV10>() == 160);
    assert!(size_of::<NetV11>() == 176);
    assert!(std::mem::offset_of!(NetV8, test) == 13 * 8);
    assert!(std::mem::offset_of!(NetV10, close_listen) == 16 * 8);
    assert!(std::mem::offset_of!(NetV11, finalize) == 20 * 8);
};

// SAFETY: the tables are immutable; their only pointers are to a static C string and to
// functions, all valid for the life of the library and safe to read from any thread.
unsafe impl Sync for NetV8 {}
// SAFETY: as for NetV8.
unsafe impl Sync for NetV9 {}
// SAFETY: as for NetV8.
unsafe impl Sync for NetV10 {}
// SAFETY: as for NetV8.
unsafe impl Sync for NetV11 {}

/// The v8 table (NCCL 2.20–2.23, RCCL ROCm 6.2–6.4).
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v8: NetV8 = NetV8 {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(init_v8),
    devices: Some(devices),
    get_properties: Some(get_properties_v8),
    listen: Some(listen_v8),
    connect: Some(connect_v8),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v8),
    irecv: Some(irecv_v8),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
};

/// The v9 table (NCCL 2.24–2.25).
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v9: NetV9 = NetV9 {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(init_v8),
    devices: Some(devices),
    get_properties: Some(get_properties_v9),
    listen: Some(listen_v8),
    connect: Some(connect_v8),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v9),
    irecv: Some(irecv_v9),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
};

/// The v10 table (NCCL 2.26–2.27, RCCL ROCm 7.0–7.2).
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v10: NetV10 = NetV10 {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(init_v10),
    devices: Some(devices),
    get_properties: Some(get_properties_v9),
    listen: Some(listen_v8),
    connect: Some(connect_v10),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
};

/// The v11 table (NCCL 2.28–2.29, RCCL after the 2.28 sync): per-communicator contexts.
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v11: NetV11 = NetV11 {
    name: PLUGIN_NAME.as_ptr(),
    init: Some(init_v11),
    devices: Some(devices),
    get_properties: Some(get_properties_v11),
    listen: Some(listen_v11),
    connect: Some(connect_v11),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
    finalize: Some(finalize_v11),
    set_net_attr: None,
};
