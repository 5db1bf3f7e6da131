//! The C boundary of the collectives (`tbrdma-collectives`): the communicator (`tbrdma_comm`),
//! its options, the data-type and reduction enums, and the all-reduce family over raw buffers.
//! FFI file: with `ffi`, the only one allowed `unsafe`, each block under a `// SAFETY:` naming
//! the caller's contract (documented on each function in `tbrdma.h`). Every function body runs
//! inside `catch_unwind`.
//!
//! Buffers are a pointer and an element count; the byte length (`count * element size`, times
//! the world size for an all-gather's output) is checked for overflow before any slice is made,
//! and a pointer may be NULL only when its byte length is 0. An input and an output never alias
//! as Rust slices: an all-reduce with `sendbuf == recvbuf` runs in place, and any other overlap
//! (NCCL's in-place all-gather and reduce-scatter layouts included) copies the input aside
//! first, into a buffer the communicator keeps for that.

#![allow(unsafe_code)]
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::fmt::Display;
use std::net::SocketAddr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::Duration;

use tbrdma_collectives::{
    Algorithm, CommOptions, Communicator, DType, EngineKind, Progress, ReduceOp,
    Result as CollResult,
};

use crate::ffi::{
    TBRDMA_ENGINE_PACKET, TBRDMA_ENGINE_SOCKETS, TBRDMA_ENGINE_URING, TBRDMA_PROGRESS_CALLER,
    TBRDMA_PROGRESS_THREAD, give, guard, text,
};
use crate::status::{TBRDMA_ERR_INVALID, TBRDMA_OK, coll, fail};

/// A communicator: this process's rank among the ranks of a hostfile, connected to its cabled
/// neighbours. Use it from one thread at a time.
#[derive(Debug)]
pub struct tbrdma_comm {
    comm: Communicator,
    /// A copy of an input that overlaps its output; the unwritten output of a non-root reduce.
    stage: Vec<u8>,
}

/// Element type of a collective's buffers. Functions take it as an `int`, so an unknown value
/// is refused with `TBRDMA_ERR_INVALID` rather than undefined.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tbrdma_dtype {
    /// IEEE binary32 (`float`).
    TBRDMA_DTYPE_F32 = 0,
    /// IEEE binary64 (`double`).
    TBRDMA_DTYPE_F64 = 1,
    /// IEEE binary16 (`_Float16`), accumulated in f32 and rounded once.
    TBRDMA_DTYPE_F16 = 2,
    /// bfloat16 (the top half of a `float`), accumulated in f32 and rounded once.
    TBRDMA_DTYPE_BF16 = 3,
    /// `int8_t`; sums and products wrap.
    TBRDMA_DTYPE_I8 = 4,
    /// `uint8_t`; sums and products wrap.
    TBRDMA_DTYPE_U8 = 5,
    /// `int32_t`; sums and products wrap.
    TBRDMA_DTYPE_I32 = 6,
    /// `int64_t`; sums and products wrap.
    TBRDMA_DTYPE_I64 = 7,
}

/// Reduction operator (taken as an `int`, like `tbrdma_dtype`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tbrdma_redop {
    /// Sum.
    TBRDMA_REDOP_SUM = 0,
    /// Product.
    TBRDMA_REDOP_PROD = 1,
    /// Minimum.
    TBRDMA_REDOP_MIN = 2,
    /// Maximum.
    TBRDMA_REDOP_MAX = 3,
    /// Sum divided by the world size (integers truncate).
    TBRDMA_REDOP_AVG = 4,
}

const DTYPES: [(tbrdma_dtype, DType); 8] = [
    (tbrdma_dtype::TBRDMA_DTYPE_F32, DType::F32),
    (tbrdma_dtype::TBRDMA_DTYPE_F64, DType::F64),
    (tbrdma_dtype::TBRDMA_DTYPE_F16, DType::F16),
    (tbrdma_dtype::TBRDMA_DTYPE_BF16, DType::Bf16),
    (tbrdma_dtype::TBRDMA_DTYPE_I8, DType::I8),
    (tbrdma_dtype::TBRDMA_DTYPE_U8, DType::U8),
    (tbrdma_dtype::TBRDMA_DTYPE_I32, DType::I32),
    (tbrdma_dtype::TBRDMA_DTYPE_I64, DType::I64),
];

const REDOPS: [(tbrdma_redop, ReduceOp); 5] = [
    (tbrdma_redop::TBRDMA_REDOP_SUM, ReduceOp::Sum),
    (tbrdma_redop::TBRDMA_REDOP_PROD, ReduceOp::Prod),
    (tbrdma_redop::TBRDMA_REDOP_MIN, ReduceOp::Min),
    (tbrdma_redop::TBRDMA_REDOP_MAX, ReduceOp::Max),
    (tbrdma_redop::TBRDMA_REDOP_AVG, ReduceOp::Avg),
];

/// All-reduce algorithm: by size and topology (`docs/collectives.md`).
pub const TBRDMA_ALGO_AUTO: c_int = 0;
/// All-reduce algorithm: one-shot (needs a cable between every two ranks).
pub const TBRDMA_ALGO_ONESHOT: c_int = 1;
/// All-reduce algorithm: the pipelined ring.
pub const TBRDMA_ALGO_RING: c_int = 2;
/// All-reduce algorithm: recursive doubling over four ranks (two exchanges with the ranks r xor
/// 1 and r xor 3; a ring of four has those cables).
pub const TBRDMA_ALGO_DOUBLING: c_int = 3;

/// How to build a communicator. Fill it with `tbrdma_comm_options_init`, then change fields.
/// Every rank must use the same values (a difference fails setup with `TBRDMA_ERR_MISMATCH`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tbrdma_comm_options {
    /// `TBRDMA_ALGO_*` (default `TBRDMA_ALGO_AUTO`).
    pub algorithm: c_int,
    /// `TBRDMA_ENGINE_*` (default `TBRDMA_ENGINE_PACKET`, which is `TBRDMA_ENGINE_SOCKETS`
    /// without root).
    pub engine: c_int,
    /// `TBRDMA_PROGRESS_*` (default `TBRDMA_PROGRESS_CALLER`: the rank drives the transport
    /// inside each call).
    pub progress: c_int,
    /// Longest a collective, or setup, waits for a neighbour, in milliseconds (default 20000).
    pub timeout_ms: u32,
    /// First TCP port of connection setup: ranks i < j use `port_base + i*N + j` (default
    /// 18600).
    pub port_base: u16,
    /// All-reduces up to this many bytes run one-shot under `TBRDMA_ALGO_AUTO` on a pair; on a
    /// full mesh of N ranks up to this divided by (N-1)^2 (default 262144).
    pub one_shot_max: usize,
    /// Bytes per pre-registered slot, the pipelining unit (default 524288).
    pub slot_bytes: usize,
    /// Slots per neighbour and direction, at least 2 (default 8).
    pub slots: usize,
    /// Use at most this many cables per neighbour (0, the default: every one the hostfile
    /// lists).
    pub max_rails: usize,
    /// Busy-poll rounds before a waiting rank starts yielding its core (default 4).
    pub spin: u32,
}

fn bad(f: &str, problem: impl Display) -> c_int {
    fail(TBRDMA_ERR_INVALID, format!("{f}: {problem}"))
}

fn done(r: CollResult<()>) -> c_int {
    match r {
        Ok(()) => TBRDMA_OK,
        Err(e) => coll(e),
    }
}

fn dtype_of(f: &str, code: c_int) -> Result<DType, c_int> {
    DTYPES
        .iter()
        .find(|(c, _)| *c as c_int == code)
        .map(|&(_, d)| d)
        .ok_or_else(|| {
            bad(
                f,
                format!(
                    "dtype {code} is not a tbrdma_dtype (TBRDMA_DTYPE_F32 to TBRDMA_DTYPE_I64)"
                ),
            )
        })
}

fn op_of(f: &str, code: c_int) -> Result<ReduceOp, c_int> {
    REDOPS
        .iter()
        .find(|(c, _)| *c as c_int == code)
        .map(|&(_, o)| o)
        .ok_or_else(|| {
            bad(
                f,
                format!("op {code} is not a tbrdma_redop (TBRDMA_REDOP_SUM to TBRDMA_REDOP_AVG)"),
            )
        })
}

fn rank_arg(f: &str, what: &str, r: c_int) -> Result<usize, c_int> {
    usize::try_from(r).map_err(|_| bad(f, format!("{what} {r} is negative")))
}

/// Bytes in `count` elements of `dtype`, `times` over; refused when that overflows or exceeds
/// what one object may span (`isize::MAX`).
fn byte_len(f: &str, count: usize, dtype: DType, times: usize) -> Result<usize, c_int> {
    count
        .checked_mul(dtype.size())
        .and_then(|b| b.checked_mul(times))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            let times = if times == 1 {
                String::new()
            } else {
                format!(" times {times} ranks")
            };
            bad(
                f,
                format!("count {count} of {dtype}{times} overflows the address space"),
            )
        })
}

fn overlap(a: *const c_void, a_len: usize, b: *const c_void, b_len: usize) -> bool {
    let (a, b) = (a as usize, b as usize);
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

/// The input bytes of a call.
///
/// # Safety
/// `p` must be NULL or valid for reads of `len` bytes (at most `isize::MAX`), not written
/// during `'a`.
unsafe fn input<'a>(f: &str, what: &str, p: *const c_void, len: usize) -> Result<&'a [u8], c_int> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(bad(f, format!("{what} is NULL with {len} bytes to read")));
    }
    // SAFETY: non-NULL (checked) and valid for `len <= isize::MAX` bytes by the caller's
    // contract.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// The output bytes of a call.
///
/// # Safety
/// `p` must be NULL or valid for reads and writes of `len` bytes (at most `isize::MAX`), not
/// accessed through any other pointer during `'a`.
unsafe fn output<'a>(
    f: &str,
    what: &str,
    p: *mut c_void,
    len: usize,
) -> Result<&'a mut [u8], c_int> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(bad(f, format!("{what} is NULL with {len} bytes to write")));
    }
    // SAFETY: non-NULL (checked), valid for `len <= isize::MAX` bytes and not aliased by the
    // caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
}

/// Borrows the communicator for a query.
///
/// # Safety
/// `p` must be NULL or a live communicator.
unsafe fn comm_ref<'a>(f: &str, p: *const tbrdma_comm) -> Result<&'a tbrdma_comm, c_int> {
    // SAFETY: the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| bad(f, "comm is NULL"))
}

/// Borrows the communicator for a call.
///
/// # Safety
/// `p` must be NULL or a live communicator that no other thread is using.
unsafe fn comm_mut<'a>(f: &str, p: *mut tbrdma_comm) -> Result<&'a mut tbrdma_comm, c_int> {
    // SAFETY: the caller's contract.
    unsafe { p.as_mut() }.ok_or_else(|| bad(f, "comm is NULL"))
}

/// Runs `op` over the caller's input and output bytes; when the two overlap, the input is
/// copied into the communicator's stage first, so they never alias as slices.
///
/// # Safety
/// `send` must be NULL or valid for reads of `send_len` bytes, `recv` NULL or valid for reads
/// and writes of `recv_len` bytes (both at most `isize::MAX`), and neither may be accessed by
/// another thread during the call.
unsafe fn run(
    c: &mut tbrdma_comm,
    f: &str,
    send: *const c_void,
    send_len: usize,
    recv: *mut c_void,
    recv_len: usize,
    op: impl FnOnce(&mut Communicator, &[u8], &mut [u8]) -> CollResult<()>,
) -> c_int {
    let tbrdma_comm { comm, stage } = c;
    if overlap(send, send_len, recv, recv_len) {
        // SAFETY: the caller's contract; this borrow ends with the copy, before the output's.
        let src = tri!(unsafe { input(f, "sendbuf", send, send_len) });
        stage.clear();
        stage.extend_from_slice(src);
        // SAFETY: the caller's contract; the input is no longer borrowed.
        let dst = tri!(unsafe { output(f, "recvbuf", recv, recv_len) });
        return done(op(comm, stage, dst));
    }
    // SAFETY: the caller's contract; the two ranges are disjoint (checked above).
    let (src, dst) = unsafe {
        (
            tri!(input(f, "sendbuf", send, send_len)),
            tri!(output(f, "recvbuf", recv, recv_len)),
        )
    };
    done(op(comm, src, dst))
}

fn engine_code(e: EngineKind) -> c_int {
    match e {
        EngineKind::Uring => TBRDMA_ENGINE_URING,
        EngineKind::Sockets => TBRDMA_ENGINE_SOCKETS,
        EngineKind::Packet => TBRDMA_ENGINE_PACKET,
        _ => -1, // A backend the C API has no code for yet.
    }
}

fn progress_code(p: Progress) -> c_int {
    match p {
        Progress::Thread => TBRDMA_PROGRESS_THREAD,
        Progress::Caller => TBRDMA_PROGRESS_CALLER,
    }
}

fn algorithm_code(a: Algorithm) -> c_int {
    match a {
        Algorithm::Auto => TBRDMA_ALGO_AUTO,
        Algorithm::OneShot => TBRDMA_ALGO_ONESHOT,
        Algorithm::Ring => TBRDMA_ALGO_RING,
        Algorithm::Doubling => TBRDMA_ALGO_DOUBLING,
    }
}

/// The Rust options of C options (defaults for NULL).
///
/// # Safety
/// `p` must be NULL or valid for a read of the struct.
unsafe fn comm_options(f: &str, p: *const tbrdma_comm_options) -> Result<CommOptions, c_int> {
    // SAFETY: the caller's contract.
    let Some(o) = (unsafe { p.as_ref() }) else {
        return Ok(CommOptions::default());
    };
    let algorithm = match o.algorithm {
        TBRDMA_ALGO_AUTO => Algorithm::Auto,
        TBRDMA_ALGO_ONESHOT => Algorithm::OneShot,
        TBRDMA_ALGO_RING => Algorithm::Ring,
        TBRDMA_ALGO_DOUBLING => Algorithm::Doubling,
        other => return Err(bad(f, format!("algorithm {other} is not a TBRDMA_ALGO_*"))),
    };
    let engine = match o.engine {
        TBRDMA_ENGINE_URING => EngineKind::Uring,
        TBRDMA_ENGINE_SOCKETS => EngineKind::Sockets,
        TBRDMA_ENGINE_PACKET => EngineKind::Packet,
        other => return Err(bad(f, format!("engine {other} is not a TBRDMA_ENGINE_*"))),
    };
    let progress = match o.progress {
        TBRDMA_PROGRESS_THREAD => Progress::Thread,
        TBRDMA_PROGRESS_CALLER => Progress::Caller,
        other => {
            return Err(bad(
                f,
                format!("progress {other} is not a TBRDMA_PROGRESS_*"),
            ));
        }
    };
    if o.timeout_ms == 0 {
        return Err(bad(
            f,
            "timeout_ms is 0 (use tbrdma_comm_options_init's default)",
        ));
    }
    Ok(CommOptions {
        algorithm,
        one_shot_max: o.one_shot_max,
        slot_bytes: o.slot_bytes,
        slots: o.slots,
        max_rails: o.max_rails,
        port_base: o.port_base,
        engine,
        progress,
        timeout: Duration::from_millis(u64::from(o.timeout_ms)),
        spin: o.spin,
        ..CommOptions::default()
    })
}

/// Hands a new communicator to C, or records why there is none.
///
/// # Safety
/// `out` must be non-NULL and valid for a pointer write.
unsafe fn made(out: *mut *mut tbrdma_comm, r: CollResult<Communicator>) -> c_int {
    match r {
        // SAFETY: the caller's contract.
        Ok(comm) => unsafe {
            give(
                out,
                tbrdma_comm {
                    comm,
                    stage: Vec::new(),
                },
            )
        },
        Err(e) => coll(e),
    }
}

/// Checks `out` and sets `*out` to NULL, so a failed constructor leaves nothing to free.
///
/// # Safety
/// `out` must be NULL or valid for a pointer write.
unsafe fn clear_out(f: &str, out: *mut *mut tbrdma_comm) -> Result<(), c_int> {
    if out.is_null() {
        return Err(bad(f, "out is NULL"));
    }
    // SAFETY: non-NULL (checked), valid by the caller's contract.
    unsafe { out.write(std::ptr::null_mut()) };
    Ok(())
}

/// Fills `opts` with the defaults (those of a NULL `opts`).
///
/// # Safety
/// `opts` must be valid for a write of the struct.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_comm_options_init(opts: *mut tbrdma_comm_options) -> c_int {
    guard(|| {
        if opts.is_null() {
            return bad("tbrdma_comm_options_init", "opts is NULL");
        }
        let d = CommOptions::default();
        let value = tbrdma_comm_options {
            algorithm: algorithm_code(d.algorithm),
            engine: engine_code(d.engine),
            progress: progress_code(d.progress),
            timeout_ms: u32::try_from(d.timeout.as_millis()).unwrap_or(u32::MAX),
            port_base: d.port_base,
            one_shot_max: d.one_shot_max,
            slot_bytes: d.slot_bytes,
            slots: d.slots,
            max_rails: d.max_rails,
            spin: d.spin,
        };
        // SAFETY: non-NULL (checked), valid by the caller's contract.
        unsafe { opts.write(value) };
        TBRDMA_OK
    })
}

/// Builds the communicator for `rank` of the hostfile at `hostfile` (`docs/hostfile.md`;
/// `tbrdma hostfile` or `tbrdma lab up` writes it): connects to every cabled neighbour and
/// checks that they agree on the configuration. Every rank calls it; it returns once this
/// rank's neighbours are connected. `opts` may be NULL (defaults). `*out` is NULL on failure.
///
/// # Safety
/// `hostfile` must be a NUL-terminated string; `opts` NULL or valid for reads; `out` valid for
/// a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_comm_from_hostfile(
    hostfile: *const c_char,
    rank: c_int,
    opts: *const tbrdma_comm_options,
    out: *mut *mut tbrdma_comm,
) -> c_int {
    const F: &str = "tbrdma_comm_from_hostfile";
    guard(|| {
        // SAFETY: the caller's contract, for each argument.
        let (path, opts) = unsafe {
            tri!(clear_out(F, out));
            (
                tri!(text(hostfile, &format!("{F}: hostfile"))),
                tri!(comm_options(F, opts)),
            )
        };
        let rank = tri!(rank_arg(F, "rank", rank));
        let r = Communicator::from_hostfile(Path::new(path), rank, opts);
        // SAFETY: `out` checked non-NULL, valid by the caller's contract.
        unsafe { made(out, r) }
    })
}

/// Builds the communicator from the environment: `TBRDMA_HOSTFILE` and `TBRDMA_RANK` (what
/// `tbrdma lab exec` sets) or, without a hostfile, a rendezvous at `TBRDMA_ADDR` (rank 0's
/// `ip:port`) with `TBRDMA_RANK` and `TBRDMA_WORLD_SIZE`. `opts` may be NULL (defaults).
/// `*out` is NULL on failure.
///
/// # Safety
/// `opts` must be NULL or valid for reads; `out` valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_comm_from_env(
    opts: *const tbrdma_comm_options,
    out: *mut *mut tbrdma_comm,
) -> c_int {
    const F: &str = "tbrdma_comm_from_env";
    guard(|| {
        // SAFETY: the caller's contract, for each argument.
        let opts = unsafe {
            tri!(clear_out(F, out));
            tri!(comm_options(F, opts))
        };
        let r = Communicator::from_env(opts);
        // SAFETY: `out` checked non-NULL, valid by the caller's contract.
        unsafe { made(out, r) }
    })
}

/// Builds the communicator after a rendezvous at rank 0's `addr` (`"ip:port"`, a port rank 0
/// can listen on): the ranks swap their cable addresses and rank 0 derives the hostfile
/// (`docs/collectives.md`). `opts` may be NULL (defaults). `*out` is NULL on failure.
///
/// # Safety
/// `addr` must be a NUL-terminated string; `opts` NULL or valid for reads; `out` valid for a
/// pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_comm_from_rendezvous(
    addr: *const c_char,
    rank: c_int,
    world_size: c_int,
    opts: *const tbrdma_comm_options,
    out: *mut *mut tbrdma_comm,
) -> c_int {
    const F: &str = "tbrdma_comm_from_rendezvous";
    guard(|| {
        // SAFETY: the caller's contract, for each argument.
        let (addr, opts) = unsafe {
            tri!(clear_out(F, out));
            (
                tri!(text(addr, &format!("{F}: addr"))),
                tri!(comm_options(F, opts)),
            )
        };
        let Ok(addr) = addr.parse::<SocketAddr>() else {
            return bad(F, format!("addr {addr:?} is not \"ip:port\""));
        };
        let rank = tri!(rank_arg(F, "rank", rank));
        let world = tri!(rank_arg(F, "world_size", world_size));
        if rank >= world {
            return bad(F, format!("rank {rank} is not below world_size {world}"));
        }
        let r = Communicator::from_rendezvous(addr, rank, world, opts);
        // SAFETY: `out` checked non-NULL, valid by the caller's contract.
        unsafe { made(out, r) }
    })
}

/// Frees a communicator: waits (up to 2 s) until the neighbours have this rank's last writes,
/// then closes its connections. NULL is ignored.
///
/// # Safety
/// `comm` must be NULL or from a `tbrdma_comm_from_*`, not yet freed and not in use.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_comm_free(comm: *mut tbrdma_comm) {
    if !comm.is_null() {
        // SAFETY: allocated by `give` and not yet freed, by the caller's contract.
        let comm = unsafe { Box::from_raw(comm) };
        // Nothing to report from a void function; a panic must still not cross the boundary.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(comm)));
    }
}

/// This process's rank (0 to world size - 1), or `TBRDMA_ERR_INVALID` when `comm` is NULL.
///
/// # Safety
/// `comm` must be NULL or a live communicator.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_comm_rank(comm: *const tbrdma_comm) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_ref("tbrdma_comm_rank", comm) });
        c_int::try_from(c.comm.rank()).unwrap_or(c_int::MAX)
    })
}

/// The number of ranks, or `TBRDMA_ERR_INVALID` when `comm` is NULL.
///
/// # Safety
/// `comm` must be NULL or a live communicator.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_comm_world_size(comm: *const tbrdma_comm) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_ref("tbrdma_comm_world_size", comm) });
        c_int::try_from(c.comm.world_size()).unwrap_or(c_int::MAX)
    })
}

/// Bytes per element of `dtype` (a `tbrdma_dtype`), or 0 for an unknown value.
#[unsafe(no_mangle)]
pub extern "C" fn tbrdma_dtype_size(dtype: c_int) -> usize {
    DTYPES
        .iter()
        .find(|(c, _)| *c as c_int == dtype)
        .map_or(0, |(_, d)| d.size())
}

/// All-reduce: `recvbuf[i] = sendbuf_0[i] op sendbuf_1[i] op ...` over every rank, `count`
/// elements of `dtype` (`tbrdma_dtype`), `op` a `tbrdma_redop`. `sendbuf == recvbuf` runs in
/// place. Every rank must call it with the same count, type and op; every rank gets the same
/// bits.
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread; `sendbuf` valid for reads
/// and `recvbuf` for reads and writes of `count` elements (NULL only when `count` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_all_reduce(
    comm: *mut tbrdma_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
) -> c_int {
    const F: &str = "tbrdma_all_reduce";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut(F, comm) });
        let dtype = tri!(dtype_of(F, dtype));
        let op = tri!(op_of(F, op));
        let len = tri!(byte_len(F, count, dtype, 1));
        if std::ptr::eq(sendbuf, recvbuf) {
            // SAFETY: the caller's contract.
            let buf = tri!(unsafe { output(F, "recvbuf", recvbuf, len) });
            return done(c.comm.all_reduce_bytes_in_place(buf, dtype, op));
        }
        // SAFETY: the caller's contract.
        unsafe {
            run(c, F, sendbuf, len, recvbuf, len, |comm, i, o| {
                comm.all_reduce_bytes(i, o, dtype, op)
            })
        }
    })
}

/// Where this rank's part of a reduce-scatter of `count` elements lies: elements
/// `*offset` to `*offset + *recvcount - 1` go to rank `rank`. Counts that do not divide by the
/// world size give the first `count % N` ranks one element more. Either output may be NULL.
///
/// # Safety
/// `comm` must be a live communicator; `offset` and `recvcount` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_reduce_scatter_range(
    comm: *const tbrdma_comm,
    count: usize,
    rank: c_int,
    offset: *mut usize,
    recvcount: *mut usize,
) -> c_int {
    const F: &str = "tbrdma_reduce_scatter_range";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_ref(F, comm) });
        let rank = tri!(rank_arg(F, "rank", rank));
        let world = c.comm.world_size();
        if rank >= world {
            return bad(F, format!("rank {rank} is not a rank (world size {world})"));
        }
        let range = c.comm.reduce_scatter_range(count, rank);
        if !offset.is_null() {
            // SAFETY: non-NULL (checked), valid by the caller's contract.
            unsafe { offset.write(range.start) };
        }
        if !recvcount.is_null() {
            // SAFETY: non-NULL (checked), valid by the caller's contract.
            unsafe { recvcount.write(range.len()) };
        }
        TBRDMA_OK
    })
}

/// Reduce-scatter: the `sendcount` elements of `sendbuf` (the same count on every rank) are
/// reduced across ranks, and this rank receives its part (`tbrdma_reduce_scatter_range`) in
/// `recvbuf`, which holds `recvcount` elements: exactly that part's length, else
/// `TBRDMA_ERR_INVALID`. The buffers may overlap (NCCL's in place: `recvbuf` inside
/// `sendbuf`).
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread; `sendbuf` valid for reads
/// of `sendcount` elements and `recvbuf` for reads and writes of `recvcount` (NULL only with a
/// count of 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_reduce_scatter(
    comm: *mut tbrdma_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    recvcount: usize,
    dtype: c_int,
    op: c_int,
) -> c_int {
    const F: &str = "tbrdma_reduce_scatter";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut(F, comm) });
        let dtype = tri!(dtype_of(F, dtype));
        let op = tri!(op_of(F, op));
        let send_len = tri!(byte_len(F, sendcount, dtype, 1));
        let rank = c.comm.rank();
        let mine = c.comm.reduce_scatter_range(sendcount, rank).len();
        if recvcount != mine {
            return bad(
                F,
                format!(
                    "recvcount is {recvcount}, but rank {rank} receives {mine} of {sendcount} elements (tbrdma_reduce_scatter_range)"
                ),
            );
        }
        let recv_len = tri!(byte_len(F, recvcount, dtype, 1));
        // SAFETY: the caller's contract.
        unsafe {
            run(c, F, sendbuf, send_len, recvbuf, recv_len, |comm, i, o| {
                comm.reduce_scatter_bytes(i, o, dtype, op)
            })
        }
    })
}

/// All-gather: every rank contributes `sendcount` elements (the same count everywhere);
/// `recvbuf` (world size * `sendcount` elements) receives rank k's at element `k * sendcount`.
/// The buffers may overlap (NCCL's in place: `sendbuf` is rank r's block of `recvbuf`).
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread; `sendbuf` valid for reads
/// of `sendcount` elements and `recvbuf` for reads and writes of world size * `sendcount` (NULL
/// only when `sendcount` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_all_gather(
    comm: *mut tbrdma_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: c_int,
) -> c_int {
    const F: &str = "tbrdma_all_gather";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut(F, comm) });
        let dtype = tri!(dtype_of(F, dtype));
        let send_len = tri!(byte_len(F, sendcount, dtype, 1));
        let recv_len = tri!(byte_len(F, sendcount, dtype, c.comm.world_size()));
        // SAFETY: the caller's contract.
        unsafe {
            run(c, F, sendbuf, send_len, recvbuf, recv_len, |comm, i, o| {
                comm.all_gather_bytes(i, o)
            })
        }
    })
}

/// Broadcast: `count` elements of `buf` on rank `root` are copied into `buf` on every rank.
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread; `buf` valid for reads and
/// writes of `count` elements (NULL only when `count` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_broadcast(
    comm: *mut tbrdma_comm,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
) -> c_int {
    const F: &str = "tbrdma_broadcast";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut(F, comm) });
        let dtype = tri!(dtype_of(F, dtype));
        let root = tri!(rank_arg(F, "root", root));
        let len = tri!(byte_len(F, count, dtype, 1));
        // SAFETY: the caller's contract.
        let buf = tri!(unsafe { output(F, "buf", buf, len) });
        done(c.comm.broadcast_bytes(buf, root))
    })
}

/// Reduce: like `tbrdma_all_reduce`, but only rank `root`'s `recvbuf` is written; on the
/// other ranks `recvbuf` is not touched and may be NULL. The buffers may overlap (in place:
/// `sendbuf == recvbuf`).
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread; `sendbuf` valid for reads
/// and `recvbuf` (NULL allowed off the root) for reads and writes of `count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_reduce(
    comm: *mut tbrdma_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
) -> c_int {
    const F: &str = "tbrdma_reduce";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut(F, comm) });
        let dtype = tri!(dtype_of(F, dtype));
        let op = tri!(op_of(F, op));
        let root = tri!(rank_arg(F, "root", root));
        let len = tri!(byte_len(F, count, dtype, 1));
        if recvbuf.is_null() && c.comm.rank() != root {
            let tbrdma_comm { comm, stage } = c;
            // SAFETY: the caller's contract.
            let src = tri!(unsafe { input(F, "sendbuf", sendbuf, len) });
            stage.clear();
            stage.resize(len, 0);
            return done(comm.reduce_bytes(src, stage, dtype, op, root));
        }
        // SAFETY: the caller's contract.
        unsafe {
            run(c, F, sendbuf, len, recvbuf, len, |comm, i, o| {
                comm.reduce_bytes(i, o, dtype, op, root)
            })
        }
    })
}

/// Barrier: returns once every rank has entered it.
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_barrier(comm: *mut tbrdma_comm) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut("tbrdma_barrier", comm) });
        done(c.comm.barrier())
    })
}

/// The path of a point-to-point message from rank `src` to rank `dst`: direct over a cable,
/// else around the ring the shorter way. Writes up to `cap` ranks (`src` first, `dst` last) to
/// `path` and returns how many the path has (2 when a cable joins them), or a negative error.
/// By default the kernels of the ranks in between relay (docs/collectives.md, "Relay"); with
/// TBRDMA_RELAY=ranks they must call `tbrdma_forward` instead.
///
/// # Safety
/// `comm` must be a live communicator; `path` valid for writes of `cap` entries (NULL with 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_route(
    comm: *const tbrdma_comm,
    src: c_int,
    dst: c_int,
    path: *mut c_int,
    cap: usize,
) -> c_int {
    const F: &str = "tbrdma_route";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_ref(F, comm) });
        let src = tri!(rank_arg(F, "src", src));
        let dst = tri!(rank_arg(F, "dst", dst));
        if path.is_null() && cap > 0 {
            return bad(F, "path is NULL with a non-zero cap");
        }
        let hops = match c.comm.route(src, dst) {
            Ok(h) => h,
            Err(e) => return coll(e),
        };
        for (i, &k) in hops.iter().take(cap).enumerate() {
            // SAFETY: i < cap entries, valid by the caller's contract.
            unsafe { path.add(i).write(c_int::try_from(k).unwrap_or(c_int::MAX)) };
        }
        c_int::try_from(hops.len()).unwrap_or(c_int::MAX)
    })
}

/// Sends `count` elements of `buf` to rank `peer`, which calls `tbrdma_recv` with the same
/// count and type. Where no cable joins the two, the hosts in between relay in their kernels
/// (`tbrdma setup --relay`; the lab does it) and only the two ranks call; with
/// TBRDMA_RELAY=ranks every rank in between calls `tbrdma_forward` (see `tbrdma_route`).
/// Messages between two ranks arrive in the order they were sent.
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread; `buf` valid for reads of
/// `count` elements (NULL only when `count` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_send(
    comm: *mut tbrdma_comm,
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
) -> c_int {
    const F: &str = "tbrdma_send";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut(F, comm) });
        let dtype = tri!(dtype_of(F, dtype));
        let peer = tri!(rank_arg(F, "peer", peer));
        let len = tri!(byte_len(F, count, dtype, 1));
        // SAFETY: the caller's contract.
        let data = tri!(unsafe { input(F, "buf", buf, len) });
        done(c.comm.send_bytes(peer, data))
    })
}

/// Receives `count` elements into `buf` from rank `peer`'s `tbrdma_send`.
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread; `buf` valid for reads and
/// writes of `count` elements (NULL only when `count` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_recv(
    comm: *mut tbrdma_comm,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
) -> c_int {
    const F: &str = "tbrdma_recv";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut(F, comm) });
        let dtype = tri!(dtype_of(F, dtype));
        let peer = tri!(rank_arg(F, "peer", peer));
        let len = tri!(byte_len(F, count, dtype, 1));
        // SAFETY: the caller's contract.
        let out = tri!(unsafe { output(F, "buf", buf, len) });
        done(c.comm.recv_bytes(peer, out))
    })
}

/// Relays a message of `count` elements from rank `src` to rank `dst` through this rank, which
/// must be between them on `tbrdma_route(src, dst)`, when TBRDMA_RELAY=ranks. Chunks are passed
/// on as they arrive. With the default kernel relay it only checks its arguments.
///
/// # Safety
/// `comm` must be a live communicator not in use by another thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tbrdma_forward(
    comm: *mut tbrdma_comm,
    src: c_int,
    dst: c_int,
    count: usize,
    dtype: c_int,
) -> c_int {
    const F: &str = "tbrdma_forward";
    guard(|| {
        // SAFETY: the caller's contract.
        let c = tri!(unsafe { comm_mut(F, comm) });
        let dtype = tri!(dtype_of(F, dtype));
        let src = tri!(rank_arg(F, "src", src));
        let dst = tri!(rank_arg(F, "dst", dst));
        let len = tri!(byte_len(F, count, dtype, 1));
        done(c.comm.forward(src, dst, len))
    })
}
