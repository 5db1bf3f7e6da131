//! The exported C functions of libibverbs, and the operations table `verbs.h`'s inline
//! functions call (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_query_port`).
//!
//! **This is the crate's unsafe module.** Every C handle is the first field of a `#[repr(C)]`
//! object allocated here (`Box`), so a handle the application passes back converts to the
//! object by a cast; that the application passes back only live handles it got from this
//! library, and valid pointers for its out-parameters and work-request lists, is the verbs
//! contract every function here relies on (as rdma-core's does). The objects themselves
//! (`crate::objects`) are safe Rust. Every entry point runs inside [`guard`], so a panic
//! becomes an error return (EIO / NULL) and never unwinds into C.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::mem::{offset_of, size_of};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::{self, NonNull, null_mut};
use std::sync::{Arc, OnceLock};

use tbrdma_proto::{RemoteAddr, SendOp};

use crate::abi::*;
use crate::addressing::{self, Link};
use crate::objects::{self, Context, Cq, Errno, Pd, Qp, QpInit, SendReq};
use crate::stubs::versioned;

/// Runs `f`, turning a panic into `fallback` (with `errno` set to EIO).
fn guard<R>(fallback: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            eprintln!("tbrdma libibverbs: internal error (panic caught at the C boundary)");
            set_errno(libc::EIO);
            fallback
        }
    }
}

fn set_errno(e: Errno) {
    nix::errno::Errno::set_raw(e);
}

/// An errno return that also sets `errno` (callers read either).
fn fail(e: Errno) -> c_int {
    set_errno(e);
    e
}

/// NULL with `errno` set.
fn null<T>(e: Errno) -> *mut T {
    set_errno(e);
    null_mut()
}

fn copy_str(dst: &mut [c_char], s: &str) {
    let room = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(room)) {
        *d = b as c_char;
    }
}

// ---------------------------------------------------------------------------------------------
// Devices

/// A device: `ibv_device` first, then what libmlx5's `is_mlx5_dev` reads as the
/// `verbs_device` ops pointer (NULL: not one of theirs).
#[repr(C)]
struct DeviceObj {
    dev: ibv_device,
    verbs_device_ops: *const c_void,
    _verbs_device_rest: [u64; 8],
    index: usize,
    link: Link,
}

/// Built once and never changed, so the devices' addresses are stable for the process.
struct Devices(Vec<DeviceObj>);

// SAFETY: the device objects are built once and never written afterwards; their raw pointer
// fields are NULL. Sharing them between threads only ever reads.
unsafe impl Sync for Devices {}
// SAFETY: as above: immutable after construction.
unsafe impl Send for Devices {}

fn devices() -> &'static Devices {
    static DEVICES: OnceLock<Devices> = OnceLock::new();
    DEVICES.get_or_init(|| {
        let links = addressing::discover();
        Devices(
            links
                .into_iter()
                .enumerate()
                .map(|(index, link)| {
                    let mut dev = ibv_device {
                        _ops: [null_mut(); 2],
                        node_type: IBV_NODE_CA,
                        transport_type: IBV_TRANSPORT_IB,
                        name: [0; IBV_SYSFS_NAME_MAX],
                        dev_name: [0; IBV_SYSFS_NAME_MAX],
                        dev_path: [0; IBV_SYSFS_PATH_MAX],
                        ibdev_path: [0; IBV_SYSFS_PATH_MAX],
                    };
                    copy_str(&mut dev.name, &link.name);
                    copy_str(&mut dev.dev_name, &format!("uverbs{index}"));
                    copy_str(&mut dev.dev_path, &format!("{SYSFS_VERBS}/uverbs{index}"));
                    copy_str(&mut dev.ibdev_path, &format!("{SYSFS_IB}/{}", link.name));
                    DeviceObj {
                        dev,
                        verbs_device_ops: ptr::null(),
                        _verbs_device_rest: [0; 8],
                        index,
                        link,
                    }
                })
                .collect(),
        )
    })
}

const SYSFS_IB: &str = "/sys/class/infiniband";
const SYSFS_VERBS: &str = "/sys/class/infiniband_verbs";

fn device_of(dev: *mut ibv_device) -> Option<&'static DeviceObj> {
    devices().0.iter().find(|d| ptr::eq(&d.dev, dev))
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    guard(null_mut(), || {
        let list = &devices().0;
        // SAFETY: calloc of n+1 pointers; the application frees it with ibv_free_device_list.
        let array = unsafe { libc::calloc(list.len() + 1, size_of::<*mut ibv_device>()) }
            as *mut *mut ibv_device;
        if array.is_null() {
            return null(libc::ENOMEM);
        }
        for (i, d) in list.iter().enumerate() {
            // SAFETY: i < n+1 slots allocated above; the devices live for the process.
            unsafe { *array.add(i) = &d.dev as *const ibv_device as *mut ibv_device };
        }
        if !num.is_null() {
            // SAFETY: the caller's out-parameter (verbs contract).
            unsafe { *num = list.len() as c_int };
        }
        array
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: the array came from calloc in ibv_get_device_list (verbs contract).
    guard((), || unsafe { libc::free(list as *mut c_void) })
}

#[unsafe(no_mangle)]
extern "C" fn ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    guard(ptr::null(), || match device_of(dev) {
        Some(d) => d.dev.name.as_ptr(),
        None => {
            set_errno(libc::ENODEV);
            ptr::null()
        }
    })
}

#[unsafe(no_mangle)]
extern "C" fn ibv_get_device_guid(dev: *mut ibv_device) -> u64 {
    guard(0, || device_of(dev).map_or(0, |d| d.link.guid().to_be()))
}

#[unsafe(no_mangle)]
extern "C" fn ibv_get_device_index(dev: *mut ibv_device) -> c_int {
    guard(-1, || device_of(dev).map_or(-1, |d| d.index as c_int))
}

// ---------------------------------------------------------------------------------------------
// Contexts

#[repr(C)]
struct ContextObj {
    vctx: verbs_context,
    ctx: Context,
    device: &'static DeviceObj,
    async_write_fd: c_int,
}

/// # Safety
/// `ctx` is a live context of this library.
unsafe fn context<'a>(ctx: *mut ibv_context) -> &'a ContextObj {
    let offset = offset_of!(ContextObj, vctx) + offset_of!(verbs_context, context);
    // SAFETY: contexts are the `context` field of a boxed ContextObj (see ibv_open_device).
    unsafe { &*((ctx as *mut u8).sub(offset) as *const ContextObj) }
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    guard(null_mut(), || {
        let Some(device) = device_of(dev) else {
            return null(libc::ENODEV);
        };
        let link = match objects::open_link(&device.link) {
            Ok(link) => link,
            Err(e) => return null(e),
        };
        let mut pipe = [0 as c_int; 2];
        // SAFETY: pipe2 writes two fds into the array.
        if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return null(libc::EMFILE);
        }
        // SAFETY: a NUL-terminated path.
        let cmd_fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        let ops = ibv_context_ops {
            _compat_query_device: null_mut(),
            _compat_query_port: null_mut(),
            _compat: [null_mut(); 5],
            alloc_mw: null_mut(),
            bind_mw: null_mut(),
            dealloc_mw: null_mut(),
            _compat_create_cq: null_mut(),
            poll_cq: Some(op_poll_cq),
            req_notify_cq: Some(op_req_notify_cq),
            _compat2: [null_mut(); 7],
            post_srq_recv: Some(op_post_srq_recv),
            _compat3: [null_mut(); 4],
            post_send: Some(op_post_send),
            post_recv: Some(op_post_recv),
            _compat4: [null_mut(); 5],
        };
        let obj = Box::new(ContextObj {
            vctx: verbs_context {
                query_port: Some(op_query_port),
                _other_ops: [null_mut(); VERBS_CONTEXT_SLOTS - 1],
                sz: size_of::<verbs_context>(),
                context: ibv_context {
                    device: dev,
                    ops,
                    cmd_fd,
                    async_fd: pipe[0],
                    num_comp_vectors: 1,
                    mutex: libc::PTHREAD_MUTEX_INITIALIZER,
                    abi_compat: VERBS_ABI_IS_EXTENDED,
                },
            },
            ctx: Context { link },
            device,
            async_write_fd: pipe[1],
        });
        let obj = Box::into_raw(obj);
        // SAFETY: just allocated; the handle is a field of it.
        unsafe { &raw mut (*obj).vctx.context }
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_close_device(ctx: *mut ibv_context) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live context (verbs contract); this is its last use.
        let obj = unsafe { context(ctx) } as *const ContextObj as *mut ContextObj;
        // SAFETY: allocated by Box in ibv_open_device.
        let obj = unsafe { Box::from_raw(obj) };
        // SAFETY: fds this context opened.
        unsafe {
            libc::close(obj.vctx.context.async_fd);
            libc::close(obj.async_write_fd);
            libc::close(obj.vctx.context.cmd_fd);
        }
        0
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_query_device(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live context and an out-parameter (verbs contract).
        unsafe { attr.write(context(ctx).ctx.device_attr()) };
        0
    })
}

/// Writes the first `len` bytes of `value` to `dst`.
///
/// # Safety
/// `dst` is valid for `len` bytes, `len <= size_of::<T>()`.
unsafe fn write_prefix<T>(dst: *mut T, value: &T, len: usize) {
    // SAFETY: forwarded to the caller.
    unsafe {
        ptr::copy_nonoverlapping(value as *const T as *const u8, dst as *mut u8, len);
    }
}

unsafe extern "C" fn op_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        if port != 1 {
            return fail(libc::EINVAL);
        }
        // SAFETY: a live context (verbs contract).
        let value = objects::port_attr(&unsafe { context(ctx) }.device.link);
        // SAFETY: the caller's struct of `len` bytes (verbs.h passes sizeof its struct).
        unsafe { write_prefix(attr, &value, len.min(size_of::<ibv_port_attr>())) };
        0
    })
}

/// The exported `ibv_query_port` takes the old, shorter struct.
#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_query_port(ctx: *mut ibv_context, port: u8, attr: *mut c_void) -> c_int {
    // SAFETY: as op_query_port, with the compat struct's length.
    unsafe { op_query_port(ctx, port, attr as *mut ibv_port_attr, COMPAT_PORT_ATTR_LEN) }
}

fn gid_of_context(obj: &ContextObj, port: u8, index: c_int) -> Result<[u8; 16], Errno> {
    if port != 1 || index != 0 {
        return Err(libc::EINVAL);
    }
    obj.device
        .link
        .ipv4()
        .map(addressing::gid_of)
        .ok_or(libc::ENODATA)
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    guard(-1, || {
        // SAFETY: a live context (verbs contract).
        match gid_of_context(unsafe { context(ctx) }, port, index) {
            Ok(raw) => {
                // SAFETY: the caller's out-parameter.
                unsafe { gid.write(ibv_gid { raw }) };
                0
            }
            Err(e) => {
                set_errno(e);
                -1
            }
        }
    })
}

fn gid_entry(obj: &ContextObj, port: u8, index: u32) -> Result<ibv_gid_entry, Errno> {
    let raw = gid_of_context(obj, port, index.min(c_int::MAX as u32) as c_int)?;
    Ok(ibv_gid_entry {
        gid: ibv_gid { raw },
        gid_index: index,
        port_num: u32::from(port),
        gid_type: IBV_GID_TYPE_ROCE_V2,
        ndev_ifindex: obj.device.link.ifindex,
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        if flags != 0 || entry_size < size_of::<ibv_gid_entry>() || port > 255 {
            return fail(libc::EINVAL);
        }
        // SAFETY: a live context (verbs contract).
        match gid_entry(unsafe { context(ctx) }, port as u8, index) {
            Ok(e) => {
                // SAFETY: the caller's out-parameter, at least entry_size bytes.
                unsafe { entry.write(e) };
                0
            }
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn _ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    guard(-(libc::EIO as isize), || {
        if flags != 0 || entry_size < size_of::<ibv_gid_entry>() {
            return -(libc::EINVAL as isize);
        }
        // SAFETY: a live context (verbs contract).
        match gid_entry(unsafe { context(ctx) }, 1, 0) {
            Ok(_) if max_entries == 0 => -(libc::EINVAL as isize),
            Ok(e) => {
                // SAFETY: the caller's array of max_entries entries of entry_size bytes.
                unsafe { entries.write(e) };
                1
            }
            Err(_) => 0,
        }
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    gid_type: *mut c_int,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live context (verbs contract).
        match gid_of_context(unsafe { context(ctx) }, port, index as c_int) {
            Ok(_) => {
                // SAFETY: the caller's out-parameter.
                unsafe { gid_type.write(IBV_GID_TYPE_SYSFS_ROCE_V2) };
                0
            }
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_query_pkey(
    _ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    guard(-1, || {
        if port != 1 || index != 0 {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: the caller's out-parameter. The default partition key, 0xffff.
        unsafe { pkey.write(0xffff) };
        0
    })
}

#[unsafe(no_mangle)]
extern "C" fn ibv_get_pkey_index(_ctx: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    guard(-1, || if port == 1 && pkey == 0xffff { 0 } else { -1 })
}

// ---------------------------------------------------------------------------------------------
// Protection domains and memory regions

#[repr(C)]
struct PdObj {
    ibv: ibv_pd,
    pd: Arc<Pd>,
}

#[repr(C)]
struct MrObj {
    ibv: ibv_mr,
    _mr: tbrdma_verbs::MemoryRegion,
}

/// # Safety
/// `pd` is a live protection domain of this library.
unsafe fn pd_of<'a>(pd: *mut ibv_pd) -> &'a PdObj {
    // SAFETY: every ibv_pd is the first field of a boxed PdObj.
    unsafe { &*(pd as *const PdObj) }
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    guard(null_mut(), || {
        // SAFETY: a live context (verbs contract).
        let obj = unsafe { context(ctx) };
        let link = Arc::clone(&obj.ctx.link);
        let pd = Arc::new(Pd {
            tb: link.device.alloc_pd(),
            link,
        });
        let handle = Arc::as_ptr(&pd) as usize as u32;
        Box::into_raw(Box::new(PdObj {
            ibv: ibv_pd {
                context: ctx,
                handle,
            },
            pd,
        })) as *mut ibv_pd
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live protection domain, allocated by Box in ibv_alloc_pd; its last use.
        // Regions and queue pairs keep what they need of it alive.
        drop(unsafe { Box::from_raw(pd as *mut PdObj) });
        0
    })
}

fn reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr {
    let access = match objects::access_of(access) {
        Ok(a) => a,
        Err(e) => return null(e),
    };
    let Some(start) = NonNull::new(addr as *mut u8) else {
        return null(libc::EINVAL);
    };
    if len == 0 {
        return null(libc::EINVAL);
    }
    // SAFETY: a live protection domain (verbs contract).
    let obj = unsafe { pd_of(pd) };
    // SAFETY: the verbs contract of ibv_reg_mr: `addr..addr+len` is the application's memory,
    // readable and writable, and stays mapped until ibv_dereg_mr (and until the requests that
    // name it have completed); the application does not hold Rust references into it.
    let mr = match unsafe { obj.pd.tb.register_mr(start, len, access) } {
        Ok(mr) => mr,
        Err(_) => return null(libc::ENOMEM),
    };
    Box::into_raw(Box::new(MrObj {
        ibv: ibv_mr {
            context: obj.ibv.context,
            pd,
            addr,
            length: len,
            handle: mr.lkey(),
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        },
        _mr: mr,
    })) as *mut ibv_mr
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    guard(null_mut(), || reg_mr(pd, addr, len, access))
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    guard(null_mut(), || {
        // tbrdma names a region's bytes by their virtual address.
        if iova != addr as u64 {
            return null(libc::EOPNOTSUPP);
        }
        reg_mr(pd, addr, len, access)
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    // SAFETY: the same contract.
    unsafe { ibv_reg_mr_iova(pd, addr, len, iova, access as c_int) }
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live region allocated by Box in reg_mr; its last use. Dropping revokes the
        // keys at once.
        drop(unsafe { Box::from_raw(mr as *mut MrObj) });
        0
    })
}

// ---------------------------------------------------------------------------------------------
// Completion queues

#[repr(C)]
struct CqObj {
    ibv: ibv_cq,
    cq: Arc<Cq>,
}

/// # Safety
/// `cq` is a live completion queue of this library.
unsafe fn cq_of<'a>(cq: *mut ibv_cq) -> &'a CqObj {
    // SAFETY: every ibv_cq is the first field of a boxed CqObj.
    unsafe { &*(cq as *const CqObj) }
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    guard(null_mut(), || {
        if !channel.is_null() {
            // Completion channels (event mode) are not supported yet.
            return null(libc::EOPNOTSUPP);
        }
        // SAFETY: a live context (verbs contract).
        let obj = unsafe { context(ctx) };
        let cq = match Cq::new(&obj.ctx, cqe) {
            Ok(cq) => Arc::new(cq),
            Err(e) => return null(e),
        };
        Box::into_raw(Box::new(CqObj {
            ibv: ibv_cq {
                context: ctx,
                channel: null_mut(),
                cq_context,
                handle: Arc::as_ptr(&cq) as usize as u32,
                cqe,
                mutex: libc::PTHREAD_MUTEX_INITIALIZER,
                cond: libc::PTHREAD_COND_INITIALIZER,
                comp_events_completed: 0,
                async_events_completed: 0,
            },
            cq,
        })) as *mut ibv_cq
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live completion queue (verbs contract).
        if unsafe { cq_of(cq) }.cq.in_use() {
            return fail(libc::EBUSY);
        }
        // SAFETY: allocated by Box in ibv_create_cq; its last use.
        drop(unsafe { Box::from_raw(cq as *mut CqObj) });
        0
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_resize_cq(_cq: *mut ibv_cq, _cqe: c_int) -> c_int {
    fail(libc::EOPNOTSUPP)
}

unsafe extern "C" fn op_poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    guard(-1, || {
        if num_entries <= 0 {
            return 0;
        }
        // SAFETY: a live completion queue (verbs contract).
        let cq = &unsafe { cq_of(cq) }.cq;
        let mut buf = [ibv_wc::default(); 16];
        let mut done = 0usize;
        let total = num_entries as usize;
        while done < total {
            let want = buf.len().min(total - done);
            let n = match cq.poll(&mut buf[..want]) {
                Ok(n) => n,
                Err(_) if done > 0 => break,
                Err(e) => return -e,
            };
            // SAFETY: the caller's array has num_entries entries; done + n <= num_entries.
            unsafe { ptr::copy_nonoverlapping(buf.as_ptr(), wc.add(done), n) };
            done += n;
            if n < want {
                break;
            }
        }
        done as c_int
    })
}

unsafe extern "C" fn op_req_notify_cq(_cq: *mut ibv_cq, _solicited_only: c_int) -> c_int {
    // No completion channels yet: ibv_create_cq refused the channel this would signal.
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
extern "C" fn ibv_create_comp_channel(_ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    null(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
extern "C" fn ibv_destroy_comp_channel(_channel: *mut ibv_comp_channel) -> c_int {
    fail(libc::EINVAL)
}

#[unsafe(no_mangle)]
extern "C" fn ibv_get_cq_event(
    _channel: *mut ibv_comp_channel,
    _cq: *mut *mut ibv_cq,
    _cq_context: *mut *mut c_void,
) -> c_int {
    set_errno(libc::EOPNOTSUPP);
    -1
}

#[unsafe(no_mangle)]
extern "C" fn ibv_ack_cq_events(_cq: *mut ibv_cq, _nevents: c_uint) {}

// ---------------------------------------------------------------------------------------------
// Queue pairs

#[repr(C)]
struct QpObj {
    ibv: ibv_qp,
    qp: Arc<Qp>,
}

/// # Safety
/// `qp` is a live queue pair of this library.
unsafe fn qp_of<'a>(qp: *mut ibv_qp) -> &'a QpObj {
    // SAFETY: every ibv_qp is the first field of a boxed QpObj.
    unsafe { &*(qp as *const QpObj) }
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    guard(null_mut(), || {
        // SAFETY: the caller's attributes (verbs contract).
        let a = unsafe { &mut *attr };
        if a.qp_type != IBV_QPT_RC || !a.srq.is_null() {
            // UD, UC, XRC, raw packet and shared receive queues are not supported.
            return null(libc::EOPNOTSUPP);
        }
        if a.send_cq.is_null() || a.recv_cq.is_null() {
            return null(libc::EINVAL);
        }
        // SAFETY: live objects of this library (verbs contract).
        let (pd_obj, scq, rcq) = unsafe { (pd_of(pd), cq_of(a.send_cq), cq_of(a.recv_cq)) };
        let init = QpInit {
            cap: a.cap,
            sq_sig_all: a.sq_sig_all != 0,
        };
        let qp = match Qp::create(
            Arc::clone(&pd_obj.pd),
            Arc::clone(&scq.cq),
            Arc::clone(&rcq.cq),
            init,
        ) {
            Ok(qp) => qp,
            Err(e) => return null(e),
        };
        a.cap = qp.cap();
        let ibv = ibv_qp {
            context: pd_obj.ibv.context,
            qp_context: a.qp_context,
            pd,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: null_mut(),
            handle: qp.qp_num,
            qp_num: qp.qp_num,
            state: IBV_QPS_RESET,
            qp_type: IBV_QPT_RC,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            cond: libc::PTHREAD_COND_INITIALIZER,
            events_completed: 0,
        };
        Box::into_raw(Box::new(QpObj { ibv, qp })) as *mut ibv_qp
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: allocated by Box in ibv_create_qp; its last use (closes the connection).
        let obj = unsafe { Box::from_raw(qp as *mut QpObj) };
        obj.qp.detach();
        drop(obj);
        0
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live queue pair and the caller's attributes (verbs contract).
        let (obj, attr) = unsafe { (qp_of(qp), &*attr) };
        match obj.qp.modify(attr, mask) {
            Ok(state) => {
                // SAFETY: the queue pair's public state field, read by applications.
                unsafe { (*qp).state = state };
                0
            }
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live queue pair (verbs contract).
        let obj = unsafe { qp_of(qp) };
        let (a, init) = obj.qp.query();
        // SAFETY: the caller's out-parameters (init_attr may be NULL).
        unsafe {
            attr.write(a);
            if !init_attr.is_null() {
                init_attr.write(ibv_qp_init_attr {
                    qp_context: obj.ibv.qp_context,
                    send_cq: obj.ibv.send_cq,
                    recv_cq: obj.ibv.recv_cq,
                    srq: null_mut(),
                    cap: init.cap,
                    qp_type: IBV_QPT_RC,
                    sq_sig_all: c_int::from(init.sq_sig_all),
                });
            }
        }
        0
    })
}

/// One `ibv_send_wr` as the safe request.
///
/// # Safety
/// `wr` and its scatter/gather list are valid (verbs contract), and an inline request's buffer
/// is readable for its length.
unsafe fn send_req<'a>(wr: &'a ibv_send_wr) -> Result<SendReq<'a>, Errno> {
    let sge = match wr.num_sge {
        0 => None,
        // SAFETY: num_sge entries at sg_list (verbs contract).
        1 => Some(unsafe { *wr.sg_list }),
        _ => return Err(libc::EINVAL),
    };
    // SAFETY: the union member that the opcode selects; both are plain integers.
    let (rdma, atomic) = unsafe { (wr.wr.rdma, wr.wr.atomic) };
    let rdma = RemoteAddr {
        addr: rdma.remote_addr,
        rkey: rdma.rkey,
    };
    let atomic_remote = RemoteAddr {
        addr: atomic.remote_addr,
        rkey: atomic.rkey,
    };
    let op = match wr.opcode {
        IBV_WR_SEND => SendOp::Send { imm: None },
        IBV_WR_SEND_WITH_IMM => SendOp::Send {
            imm: Some(wr.imm_data),
        },
        IBV_WR_RDMA_WRITE => SendOp::Write { remote: rdma },
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::WriteWithImm {
            remote: rdma,
            imm: wr.imm_data,
        },
        IBV_WR_RDMA_READ => SendOp::Read { remote: rdma },
        IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAdd {
            remote: atomic_remote,
            add: atomic.compare_add,
        },
        IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CmpSwap {
            remote: atomic_remote,
            compare: atomic.compare_add,
            swap: atomic.swap,
        },
        _ => return Err(libc::EINVAL),
    };
    let inline = if wr.send_flags & IBV_SEND_INLINE != 0 {
        match sge {
            Some(s) if s.length > 0 => {
                // SAFETY: an inline request's buffer is the application's, readable now; it is
                // copied before this call returns.
                Some(unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) })
            }
            _ => Some(&[][..]),
        }
    } else {
        None
    };
    Ok(SendReq {
        wr_id: wr.wr_id,
        signaled: wr.send_flags & IBV_SEND_SIGNALED != 0,
        sge,
        inline,
        op,
    })
}

unsafe extern "C" fn op_post_send(
    qp: *mut ibv_qp,
    mut wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live queue pair (verbs contract).
        let obj = unsafe { qp_of(qp) };
        while !wr.is_null() {
            // SAFETY: each request of the list is valid (verbs contract).
            let r = unsafe { send_req(&*wr) }.and_then(|req| obj.qp.post_send(req));
            if let Err(e) = r {
                if !bad_wr.is_null() {
                    // SAFETY: the caller's out-parameter.
                    unsafe { *bad_wr = wr };
                }
                return fail(e);
            }
            // SAFETY: as above.
            wr = unsafe { (*wr).next };
        }
        0
    })
}

unsafe extern "C" fn op_post_recv(
    qp: *mut ibv_qp,
    mut wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a live queue pair (verbs contract).
        let obj = unsafe { qp_of(qp) };
        while !wr.is_null() {
            // SAFETY: each request of the list and its scatter/gather list are valid.
            let w = unsafe { &*wr };
            let r = match w.num_sge {
                0 => obj.qp.post_recv(w.wr_id, None),
                // SAFETY: one entry at sg_list.
                1 => obj.qp.post_recv(w.wr_id, Some(unsafe { *w.sg_list })),
                _ => Err(libc::EINVAL),
            };
            if let Err(e) = r {
                if !bad_wr.is_null() {
                    // SAFETY: the caller's out-parameter.
                    unsafe { *bad_wr = wr };
                }
                return fail(e);
            }
            wr = w.next;
        }
        0
    })
}

unsafe extern "C" fn op_post_srq_recv(
    _srq: *mut c_void,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    if !bad_wr.is_null() {
        // SAFETY: the caller's out-parameter.
        unsafe { *bad_wr = wr };
    }
    fail(libc::EOPNOTSUPP)
}

// ---------------------------------------------------------------------------------------------
// What is not supported: shared receive queues, address handles, multicast, the extended QP.

#[unsafe(no_mangle)]
extern "C" fn ibv_create_srq(_pd: *mut ibv_pd, _attr: *mut c_void) -> *mut c_void {
    null(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_modify_srq(_srq: *mut c_void, _attr: *mut c_void, _mask: c_int) -> c_int {
    fail(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_query_srq(_srq: *mut c_void, _attr: *mut c_void) -> c_int {
    fail(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_destroy_srq(_srq: *mut c_void) -> c_int {
    fail(libc::EINVAL)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_create_ah(_pd: *mut ibv_pd, _attr: *mut c_void) -> *mut c_void {
    null(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_destroy_ah(_ah: *mut c_void) -> c_int {
    fail(libc::EINVAL)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_create_ah_from_wc(
    _pd: *mut ibv_pd,
    _wc: *mut ibv_wc,
    _grh: *mut c_void,
    _port: u8,
) -> *mut c_void {
    null(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_init_ah_from_wc(
    _ctx: *mut ibv_context,
    _port: u8,
    _wc: *mut ibv_wc,
    _grh: *mut c_void,
    _attr: *mut c_void,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_attach_mcast(_qp: *mut ibv_qp, _gid: *const ibv_gid, _lid: u16) -> c_int {
    fail(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_detach_mcast(_qp: *mut ibv_qp, _gid: *const ibv_gid, _lid: u16) -> c_int {
    fail(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_qp_to_qp_ex(_qp: *mut ibv_qp) -> *mut c_void {
    null(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_query_ece(_qp: *mut ibv_qp, _ece: *mut c_void) -> c_int {
    fail(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_set_ece(_qp: *mut ibv_qp, _ece: *mut c_void) -> c_int {
    fail(libc::EOPNOTSUPP)
}
#[unsafe(no_mangle)]
extern "C" fn ibv_resolve_eth_l2_from_gid(
    _ctx: *mut ibv_context,
    _attr: *mut c_void,
    _mac: *mut u8,
    _vid: *mut u16,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}

// ---------------------------------------------------------------------------------------------
// Fork, async events, strings, sysfs

#[unsafe(no_mangle)]
extern "C" fn ibv_fork_init() -> c_int {
    // Regions are ordinary memory here: nothing to protect across fork.
    0
}
#[unsafe(no_mangle)]
extern "C" fn ibv_is_fork_initialized() -> c_int {
    // IBV_FORK_UNNEEDED
    2
}
#[unsafe(no_mangle)]
extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}
#[unsafe(no_mangle)]
extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// Blocks until the context's asynchronous event pipe has an event; none is generated yet, so
/// this waits until the context is closed (then fails), as for a device that reports none.
#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut ibv_context,
    _event: *mut ibv_async_event,
) -> c_int {
    guard(-1, || {
        // SAFETY: a live context (verbs contract).
        let fd = unsafe { context(ctx) }.vctx.context.async_fd;
        let mut byte = 0u8;
        // SAFETY: reads at most one byte into a local.
        let _ = unsafe { libc::read(fd, &mut byte as *mut u8 as *mut c_void, 1) };
        set_errno(libc::EIO);
        -1
    })
}

#[unsafe(no_mangle)]
extern "C" fn ibv_ack_async_event(_event: *mut ibv_async_event) {}

/// A static C string for `s`.
fn cstr(s: &'static CStr) -> *const c_char {
    s.as_ptr()
}

#[unsafe(no_mangle)]
extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    const NAMES: [&CStr; 24] = [
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
        c"TM error",
        c"TM software rendezvous",
    ];
    cstr(
        usize::try_from(status)
            .ok()
            .and_then(|i| NAMES.get(i))
            .copied()
            .unwrap_or(c"unknown"),
    )
}

#[unsafe(no_mangle)]
extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    cstr(match node_type {
        1 => c"InfiniBand channel adapter",
        2 => c"InfiniBand switch",
        3 => c"InfiniBand router",
        4 => c"iWARP NIC",
        5 => c"usNIC",
        6 => c"usNIC UDP",
        7 => c"unspecified",
        _ => c"unknown",
    })
}

#[unsafe(no_mangle)]
extern "C" fn ibv_port_state_str(state: c_int) -> *const c_char {
    cstr(match state {
        0 => c"no state change (NOP)",
        1 => c"down",
        2 => c"init",
        3 => c"armed",
        4 => c"active",
        5 => c"active deferred",
        _ => c"unknown",
    })
}

#[unsafe(no_mangle)]
extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    cstr(match event {
        0 => c"CQ error",
        1 => c"local work queue catastrophic error",
        2 => c"invalid request local work queue error",
        3 => c"local access violation work queue error",
        4 => c"communication established",
        5 => c"send queue drained",
        6 => c"path migrated",
        7 => c"path migration request error",
        8 => c"local catastrophic error",
        9 => c"port active",
        10 => c"port error",
        _ => c"unknown",
    })
}

#[unsafe(no_mangle)]
extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    cstr(c"/sys")
}

/// Reads `dir/file` into `buf` (NUL-terminated, trailing newline dropped) and returns its
/// length, or -1. A device's `ibdev_path` is served from memory (there is no
/// `/sys/class/infiniband` entry for it): `board_id`, `fw_ver`, `node_type`, `node_guid`.
#[unsafe(no_mangle)]
unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard(-1, || {
        if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
            return -1;
        }
        // SAFETY: NUL-terminated strings from the caller (verbs contract).
        let (dir, file) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
        let (dir, file) = (dir.to_string_lossy(), file.to_string_lossy());
        let ours = devices()
            .0
            .iter()
            .find(|d| dir.trim_end_matches('/') == format!("{SYSFS_IB}/{}", d.link.name));
        let text = match ours {
            Some(d) => match file.as_ref() {
                "board_id" => "TBRDMA_USB4_NET".to_string(),
                "fw_ver" => env!("CARGO_PKG_VERSION").to_string(),
                "node_type" => "1: CA".to_string(),
                "node_guid" => {
                    let g = d.link.guid().to_be_bytes();
                    format!(
                        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
                        g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7]
                    )
                }
                _ => return -1,
            },
            None => match std::fs::read_to_string(format!("{dir}/{file}")) {
                Ok(t) => t.trim_end_matches('\n').to_string(),
                Err(_) => return -1,
            },
        };
        let n = text.len().min(size - 1);
        // SAFETY: the caller's buffer holds `size` bytes; n + 1 <= size.
        unsafe {
            ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, buf, n);
            *buf.add(n) = 0;
        }
        n as c_int
    })
}

versioned!("IBVERBS_1.0":
    ibv_create_comp_channel, ibv_destroy_comp_channel, ibv_get_sysfs_path, ibv_read_sysfs_file,
);
versioned!("IBVERBS_1.1":
    ibv_get_device_list, ibv_free_device_list, ibv_get_device_name, ibv_get_device_guid,
    ibv_open_device, ibv_close_device, ibv_query_device, ibv_query_port, ibv_query_gid,
    ibv_query_pkey, ibv_alloc_pd, ibv_dealloc_pd, ibv_reg_mr, ibv_dereg_mr, ibv_create_cq,
    ibv_resize_cq, ibv_destroy_cq, ibv_get_cq_event, ibv_ack_cq_events, ibv_create_srq,
    ibv_modify_srq, ibv_query_srq, ibv_destroy_srq, ibv_create_qp, ibv_query_qp, ibv_modify_qp,
    ibv_destroy_qp, ibv_create_ah, ibv_destroy_ah, ibv_create_ah_from_wc, ibv_init_ah_from_wc,
    ibv_attach_mcast, ibv_detach_mcast, ibv_fork_init, ibv_dontfork_range, ibv_dofork_range,
    ibv_get_async_event, ibv_ack_async_event, ibv_wc_status_str, ibv_node_type_str,
    ibv_port_state_str, ibv_event_type_str, ibv_resolve_eth_l2_from_gid,
);
versioned!("IBVERBS_1.5": ibv_get_pkey_index);
versioned!("IBVERBS_1.6": ibv_qp_to_qp_ex);
versioned!("IBVERBS_1.7": ibv_reg_mr_iova);
versioned!("IBVERBS_1.8": ibv_reg_mr_iova2);
versioned!("IBVERBS_1.9": ibv_get_device_index);
versioned!("IBVERBS_1.10": ibv_query_ece, ibv_set_ece);
versioned!("IBVERBS_1.11": _ibv_query_gid_ex, _ibv_query_gid_table);
versioned!("IBVERBS_1.13": ibv_is_fork_initialized);
versioned!("IBVERBS_PRIVATE_34": ibv_query_gid_type);
