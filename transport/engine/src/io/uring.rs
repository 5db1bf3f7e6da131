//! The io_uring backend: one ring per socket, multishot `recvmsg` into a provided-buffer ring,
//! batched `sendmsg` (zero-copy above a threshold, off by default; a gathered datagram's header
//! and region part as two iovecs), waits on one `io_uring_enter` with a timeout.
//!
//! Kernel requirements: multishot `recvmsg` (Linux 6.0) and provided-buffer rings (5.19) are
//! needed, [`UringIo::new`] fails otherwise and [`super::open`] falls back to sockets. Used when
//! present: `SINGLE_ISSUER` (6.0) + `DEFER_TASKRUN` (6.1) when the caller promises one thread,
//! else `COOP_TASKRUN` (5.19) + `TASKRUN_FLAG`, also for rings several threads share (caller
//! progress), whose multishot receive then follows the polling thread; `SENDMSG_ZC` (6.1);
//! NAPI busy-poll registration (6.9).
//!
//! Completions of every kind share one completion queue, so whichever call reaps them sorts
//! them: receive completions are queued until [`DatagramIo::recv`] hands them out, send
//! completions are awaited inside [`DatagramIo::send`] (the batch may be reused when it
//! returns), and the wake-up poll only re-arms.
//!
//! **This file contains `unsafe`**: pushing SQEs whose pointers (message headers, buffers,
//! addresses) the kernel reads after the push, the provided-buffer ring shared with the
//! kernel, and reading the buffers the kernel filled.

use std::collections::VecDeque;
use std::io;
use std::mem::ManuallyDrop;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use io_uring::types::{CancelBuilder, Fd, Napi, RecvMsgOut, SubmitArgs, Timespec};
use io_uring::{IoUring, Probe, cqueue, opcode, squeue};
use memmap2::MmapMut;

use super::send_error::{Attempt, Next, SendFailures, is_stale_icmp};
use super::sys;
use super::{DatagramIo, EngineKind, TxBatch};

/// Submission queue size: the most sends in flight per `io_uring_enter`.
const SQ_ENTRIES: u32 = 256;
/// Provided-buffer group id of the receive buffers.
const RX_GROUP: u16 = 0;
/// Memory for receive buffers; the count is this divided by the buffer size, clamped to
/// [`RX_BUFS_MIN`, `RX_BUFS_MAX`] and rounded down to a power of two. Pages are touched only
/// when the kernel first fills a buffer. Running out is harmless: the multishot receive ends
/// with ENOBUFS, datagrams wait in the socket buffer, and the next call re-arms it.
const RX_RING_BYTES: usize = 8 << 20;
const RX_BUFS_MIN: usize = 32;
const RX_BUFS_MAX: usize = 4096;
/// Room reserved in each receive buffer for the source address (the kernel pads it; 48 bytes
/// holds a `sockaddr_in6` and puts the payload at offset 64, cache-line aligned).
const RX_NAME_LEN: usize = 48;
/// Size of `struct io_uring_recvmsg_out`, which precedes the name in each receive buffer.
const RECVMSG_OUT_LEN: usize = 16;

/// Datagrams of at least this many bytes are sent with `SENDMSG_ZC`; `None` never does.
///
/// Measured with `examples/zc_threshold.rs` (Linux 6.18, 2 busy cores, 32-datagram batches,
/// best of 3): zero-copy sent at 0.53-0.99x the copying rate from 16 KiB to 64 KiB, over
/// loopback (65000 B: 19.5 vs 28.8 Gb/s) and over veth between namespaces (65000 B: 15.1 vs
/// 21.7 Gb/s), and used more CPU per GB; from 1 to 8 KiB it was within noise (0.78-1.12x).
/// Loopback and veth copy the pages anyway when the skb reaches the receiver, and each send
/// costs an extra notification completion that must arrive before the batch is reused.
/// `thunderbolt-net` also copies every packet into its own DMA pages, so the same holds there.
/// Zero-copy stays selectable through [`UringConfig::zero_copy_threshold`] for NICs that DMA
/// from user pages.
pub const DEFAULT_ZERO_COPY_THRESHOLD: Option<usize> = None;

/// NAPI busy-poll time registered on the ring by default, in µs (0: no registration).
pub const DEFAULT_NAPI_BUSY_POLL_USECS: u32 = 50;

// What a completion belongs to: the top byte of `user_data`; the rest is an index.
const TAG_SHIFT: u32 = 56;
const TAG_RECV: u64 = 1;
const TAG_SEND: u64 = 2;
const TAG_WAKE: u64 = 3;
const TAG_CANCEL: u64 = 4;
const INDEX_MASK: u64 = (1 << TAG_SHIFT) - 1;

fn user_data(tag: u64, index: u64) -> u64 {
    (tag << TAG_SHIFT) | (index & INDEX_MASK)
}

/// How to set up the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UringConfig {
    /// Every call comes from the creating thread: enables `SINGLE_ISSUER` + `DEFER_TASKRUN`.
    pub single_issuer: bool,
    /// Zero-copy send from this datagram size; `None` never.
    pub zero_copy_threshold: Option<usize>,
    /// NAPI busy-poll time to register on the ring, in µs (0: none). Linux 6.9.
    pub napi_busy_poll_usecs: u32,
    /// Ask NAPI to prefer busy-polling over interrupts (with the registration above).
    pub napi_prefer_busy_poll: bool,
    /// Receive buffers in the provided-buffer ring (rounded down to a power of two, at most
    /// 32768); 0 sizes it from an 8 MiB budget.
    pub rx_buffers: usize,
}

impl Default for UringConfig {
    fn default() -> UringConfig {
        UringConfig {
            single_issuer: false,
            zero_copy_threshold: DEFAULT_ZERO_COPY_THRESHOLD,
            napi_busy_poll_usecs: DEFAULT_NAPI_BUSY_POLL_USECS,
            napi_prefer_busy_poll: false,
            rx_buffers: 0,
        }
    }
}

/// What the ring ended up with, for logs and `doctor`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UringSetup {
    /// Setup flags the kernel accepted, e.g. `"SINGLE_ISSUER|DEFER_TASKRUN"`.
    pub flags: &'static str,
    /// Setup flag combinations refused before (with the error).
    pub refused: Vec<String>,
    /// NAPI busy-poll registration: `Ok(usecs)` or why not.
    pub napi: Result<u32, String>,
    /// Zero-copy send threshold in force (`None` when off or unsupported).
    pub zero_copy_threshold: Option<usize>,
    /// Receive buffers in the provided-buffer ring, and the size of each.
    pub rx_buffers: (usize, usize),
}

/// One ring-setup attempt: its name and the flags it sets.
struct SetupAttempt {
    name: &'static str,
    single_issuer: bool,
    defer_taskrun: bool,
    coop_taskrun: bool,
}

/// The cooperative task-run setup, without the single-issuer promise.
const COOP: SetupAttempt = SetupAttempt {
    name: "COOP_TASKRUN",
    single_issuer: false,
    defer_taskrun: false,
    coop_taskrun: true,
};

/// No task-run flag at all: completions interrupt the thread that will run them.
const PLAIN: SetupAttempt = SetupAttempt {
    name: "(none)",
    single_issuer: false,
    defer_taskrun: false,
    coop_taskrun: false,
};

const SETUP_SINGLE: &[SetupAttempt] = &[
    SetupAttempt {
        name: "SINGLE_ISSUER|DEFER_TASKRUN",
        single_issuer: true,
        defer_taskrun: true,
        coop_taskrun: false,
    },
    SetupAttempt {
        name: "SINGLE_ISSUER|COOP_TASKRUN",
        single_issuer: true,
        defer_taskrun: false,
        coop_taskrun: true,
    },
    COOP,
    PLAIN,
];

// Several threads may call in without the single-issuer promise (caller progress: the
// application's pollers and the keeper). COOP_TASKRUN still pays there: without it every
// multishot-receive completion is delivered with an inter-processor interrupt (3.4× the UDP
// floor at 8 B against 1.7× with it, docs/performance.md). Its catch: a completion's task work
// runs when the thread that submitted the request next enters the kernel (a sleeping one is
// woken, one computing in user space is not), so `recv` re-arms the multishot receive from
// whichever thread polls (see `UringIo::rx_owner`).
const SETUP_SHARED: &[SetupAttempt] = &[COOP, PLAIN];

/// Builds a ring, dropping setup flags the kernel refuses (EINVAL) one combination at a time.
fn build_ring(
    single_issuer: bool,
    cq_entries: u32,
) -> io::Result<(IoUring, &'static str, Vec<String>)> {
    let attempts = if single_issuer {
        SETUP_SINGLE
    } else {
        SETUP_SHARED
    };
    let mut refused = Vec::new();
    let mut last = None;
    for attempt in attempts {
        let mut builder = IoUring::builder();
        builder
            .setup_cqsize(cq_entries)
            .setup_clamp()
            .setup_submit_all();
        if attempt.single_issuer {
            builder.setup_single_issuer();
        }
        if attempt.defer_taskrun {
            builder.setup_defer_taskrun();
        }
        if attempt.coop_taskrun {
            builder.setup_coop_taskrun();
        }
        if attempt.defer_taskrun || attempt.coop_taskrun {
            // The kernel raises IORING_SQ_TASKRUN when completions wait for us to enter.
            builder.setup_taskrun_flag();
        }
        match builder.build(SQ_ENTRIES) {
            Ok(ring) => return Ok((ring, attempt.name, refused)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                refused.push(format!("{}: {e}", attempt.name));
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EINVAL)))
}

/// `struct io_uring_buf`: one entry of a provided-buffer ring. The `resv` field of entry 0 is
/// the ring's tail, written by us and read by the kernel.
#[repr(C)]
struct RingEntry {
    addr: u64,
    len: u32,
    bid: u16,
    resv: u16,
}

const _: () = assert!(std::mem::size_of::<RingEntry>() == 16);

/// The provided-buffer ring and the receive buffers it hands the kernel.
///
/// Both mappings are shared with the kernel: they are only accessed through raw pointers, never
/// through a slice over the whole mapping, since the kernel writes buffers we do not own.
struct RxBuffers {
    ring: MmapMut,
    bufs: ManuallyDrop<MmapMut>,
    count: u16,
    size: usize,
    /// Our copy of the tail; published with a release store.
    tail: u16,
    /// Never unmap the buffers: the kernel might still write into them.
    leak: bool,
}

impl Drop for RxBuffers {
    fn drop(&mut self) {
        if !self.leak {
            // SAFETY: `bufs` is dropped exactly once, here, and never used afterwards.
            unsafe { ManuallyDrop::drop(&mut self.bufs) }
        }
    }
}

impl RxBuffers {
    fn new(max_datagram: usize, count: usize) -> io::Result<RxBuffers> {
        let size = (RECVMSG_OUT_LEN + RX_NAME_LEN + max_datagram).next_multiple_of(64);
        if size > u32::MAX as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "max_datagram too large",
            ));
        }
        let wanted = match count {
            0 => (RX_RING_BYTES / size).clamp(RX_BUFS_MIN, RX_BUFS_MAX),
            n => n.min(1 << 15),
        };
        let count = 1usize << wanted.ilog2();
        let ring = MmapMut::map_anon(count * std::mem::size_of::<RingEntry>())?;
        let bufs = MmapMut::map_anon(count * size)?;
        let mut rx = RxBuffers {
            ring,
            bufs: ManuallyDrop::new(bufs),
            count: count as u16,
            size,
            tail: 0,
            leak: false,
        };
        for bid in 0..rx.count {
            // SAFETY: the ring is new and not registered yet: no buffer is in it.
            unsafe { rx.provide(bid) };
        }
        rx.publish();
        Ok(rx)
    }

    fn entries(&mut self) -> *mut RingEntry {
        self.ring.as_mut_ptr().cast()
    }

    /// Registers the ring as buffer group [`RX_GROUP`] (Linux 5.19).
    ///
    /// # Safety
    /// `self` must outlive the registration: `ring` unregisters the group, or is dropped with
    /// every request cancelled, before `self` is dropped (the kernel writes into the buffers and
    /// reads the entries until then).
    unsafe fn register(&mut self, ring: &IoUring) -> io::Result<()> {
        let addr = self.entries() as u64;
        // SAFETY: `addr` is a page-aligned mapping of `count` entries owned by `self`, which
        // outlives the registration (this function's contract).
        unsafe {
            ring.submitter()
                .register_buf_ring_with_flags(addr, self.count, RX_GROUP, 0)
        }
    }

    /// Puts buffer `bid` back at the tail (visible to the kernel after [`Self::publish`]).
    ///
    /// # Safety
    /// Buffer `bid` must not be in the ring: never provided yet, or handed back by a receive
    /// completion since it last was. (Otherwise the ring would hold more entries than slots,
    /// and the kernel could fill one buffer twice while it is read.)
    unsafe fn provide(&mut self, bid: u16) {
        let mask = self.count - 1;
        // (A bid from the kernel is one of ours; the mask keeps the address in the mapping
        // whatever it is.)
        let bid = bid & mask;
        let addr = self.bufs.as_mut_ptr() as u64 + u64::from(bid) * self.size as u64;
        let slot = usize::from(self.tail & mask);
        let entry = self.entries();
        // SAFETY: `slot < count`, so the entry is inside the mapping. The kernel reads an entry
        // only between head and the published tail, and this slot lies past the published
        // tail: at most `count` buffers are in the ring (this function's contract), so the tail
        // never laps the head. Only addr/len/bid are written: `resv` of entry 0 is the tail.
        unsafe {
            let e = entry.add(slot);
            std::ptr::addr_of_mut!((*e).addr).write(addr);
            std::ptr::addr_of_mut!((*e).len).write(self.size as u32);
            std::ptr::addr_of_mut!((*e).bid).write(bid);
        }
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes every buffer provided so far visible to the kernel.
    fn publish(&mut self) {
        let entry = self.entries();
        // SAFETY: entry 0's `resv` field is the ring tail, a naturally aligned u16 inside the
        // mapping; the kernel only reads it, and every access from our side is this atomic store.
        let tail = unsafe { AtomicU16::from_ptr(std::ptr::addr_of_mut!((*entry).resv)) };
        tail.store(self.tail, Ordering::Release);
    }

    /// The first `len` bytes of buffer `bid`.
    ///
    /// # Safety
    /// A receive completion must have handed buffer `bid` back, and it must not have been
    /// provided again since (the kernel may be filling a buffer that is in the ring).
    unsafe fn filled(&self, bid: u16, len: usize) -> &[u8] {
        let bid = usize::from(bid) % usize::from(self.count);
        let len = len.min(self.size);
        // SAFETY: the range lies inside the mapping; the kernel completed a receive into buffer
        // `bid` (this function's contract) and will not touch it again until it is provided,
        // which needs `&mut self` and so waits for the borrow returned here.
        unsafe { std::slice::from_raw_parts(self.bufs.as_ptr().add(bid * self.size), len) }
    }
}

/// A message header the kernel reads, with every pointer aimed at memory owned by the same
/// `UringIo`.
#[repr(transparent)]
struct MsgHdr(libc::msghdr);

// SAFETY: the raw pointers inside point at the owning `UringIo`'s own heap memory (or at a
// `TxBatch` only for the duration of one `send` call, which cannot span threads); moving the
// owner to another thread does not move that memory.
unsafe impl Send for MsgHdr {}

/// Per-datagram state of one `send` call.
#[derive(Clone, Copy, Debug, Default)]
struct TxSlot {
    name_len: libc::socklen_t,
    attempt: Attempt,
}

/// Storage the send SQEs point into; sized to the largest batch seen, never resized while a
/// send is in flight.
#[derive(Default)]
struct TxState {
    names: Vec<libc::sockaddr_storage>,
    /// Two per datagram: its buffer, then the region part of a gathered one.
    iovs: Vec<[IoVec; 2]>,
    hdrs: Vec<MsgHdr>,
    slots: Vec<TxSlot>,
    /// Datagrams (indices) waiting to be pushed.
    queue: VecDeque<usize>,
    /// Send completions reaped and not yet handled by `send`.
    done: Vec<(usize, SendDone)>,
}

#[derive(Clone, Copy, Debug)]
enum SendDone {
    /// The send itself: bytes sent or `-errno`; `more` when a zero-copy notification follows.
    Sent { res: i32, more: bool },
    /// A zero-copy send's notification: the kernel no longer reads the buffer.
    Notification,
}

impl TxState {
    /// Points one message header per datagram at the batch's buffers. Called only with nothing
    /// in flight, so growing the vectors moves no memory the kernel reads.
    fn prepare(&mut self, batch: &TxBatch, peer: Option<SocketAddr>) {
        let n = batch.len();
        if self.hdrs.len() < n {
            self.names.resize(n, sys::empty_storage());
            self.iovs.resize_with(n, || [IoVec::EMPTY, IoVec::EMPTY]);
            self.hdrs.resize_with(n, || MsgHdr(sys::empty_msghdr()));
            self.slots.resize(n, TxSlot::default());
        }
        self.queue.clear();
        self.done.clear();
        for i in 0..n {
            let (data, dest) = batch.get(i);
            let (name, mut name_len) = sys::to_storage(&dest);
            if peer == Some(dest) {
                // The connected peer: no address, the kernel's cached route.
                name_len = 0;
            }
            self.names[i] = name;
            self.iovs[i] = [
                IoVec(libc::iovec {
                    iov_base: data.as_ptr() as *mut libc::c_void,
                    iov_len: data.len(),
                }),
                batch.part(i).map_or(IoVec::EMPTY, |p| {
                    IoVec(libc::iovec {
                        iov_base: p.as_ptr() as *mut libc::c_void,
                        iov_len: p.len(),
                    })
                }),
            ];
            self.slots[i] = TxSlot {
                name_len,
                ..TxSlot::default()
            };
            self.queue.push_back(i);
        }
        // Pointers are taken only after every element is written, through `as_mut_ptr`, so that
        // no later `&mut` to a vector invalidates them.
        let names = self.names.as_mut_ptr();
        let iovs = self.iovs.as_mut_ptr();
        for i in 0..n {
            // `wrapping_add` keeps this safe; `i < n <= len` so the pointers are in bounds.
            let name_len = self.slots[i].name_len;
            let name = if name_len > 0 {
                names.wrapping_add(i).cast()
            } else {
                std::ptr::null_mut()
            };
            let iov_len = if batch.part(i).is_some() { 2 } else { 1 };
            self.hdrs[i] = MsgHdr(sys::msghdr(
                name,
                name_len,
                iovs.wrapping_add(i).cast(),
                iov_len,
            ));
        }
    }

    /// The message header of datagram `i`, for an SQE.
    fn hdr(&self, i: usize) -> *const libc::msghdr {
        debug_assert!(i < self.hdrs.len());
        self.hdrs.as_ptr().wrapping_add(i).cast()
    }
}

/// An iovec; `[IoVec; 2]` has the layout of `[libc::iovec; 2]`, which a message header with
/// `msg_iovlen` 2 points at.
#[repr(transparent)]
struct IoVec(libc::iovec);

impl IoVec {
    const EMPTY: IoVec = IoVec(libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    });
}

// SAFETY: as for `MsgHdr`: the pointer targets a `TxBatch` buffer or region part only during
// one `send` call.
unsafe impl Send for IoVec {}

/// A completed receive: buffer `bid` holds `len` bytes (recvmsg_out header, name, payload).
#[derive(Clone, Copy, Debug)]
struct RxDone {
    bid: u16,
    len: usize,
}

/// io_uring datagram I/O on one UDP socket.
pub struct UringIo {
    // Field order matters: the ring is dropped (after `Drop` cancels every request) before the
    // memory its requests point into.
    ring: IoUring,
    socket: UdpSocket,
    rx: RxBuffers,
    /// Header of the multishot receive: only its name and control lengths are read.
    rx_hdr: Box<MsgHdr>,
    rx_armed: bool,
    /// Generation of the multishot receive armed last (its `user_data` index): the end of an
    /// earlier one, cancelled when another thread took over, does not disarm it.
    rx_gen: u64,
    /// With `COOP_TASKRUN` and no single issuer: the thread that armed the receive, whose
    /// kernel entries run its completions (a sleeping owner is woken for them, but one
    /// computing in user space runs them only at its next kernel entry, up to a timer tick
    /// later). `recv` from another thread re-arms it there, so a device opened on one thread
    /// and polled on another (NCCL's init and proxy threads) never waits on the first.
    rx_owner: Option<std::thread::ThreadId>,
    /// Whether completions wait for their submitting thread (`COOP_TASKRUN` without
    /// `SINGLE_ISSUER`), which is when `rx_owner` matters.
    coop_shared: bool,
    rx_ready: VecDeque<RxDone>,
    rx_error: Option<io::Error>,
    /// The descriptor a wake-up poll is armed on, if any.
    wake_armed: Option<RawFd>,
    tx: TxState,
    /// Datagrams dropped, and whether a filter's drop was reported.
    failures: SendFailures,
    /// The address the socket is connected to, if any.
    peer: Option<SocketAddr>,
    /// Times the multishot receive was armed.
    rx_arms: u64,
    /// Times another thread took the multishot receive over (see `rx_owner`).
    rx_takeovers: u64,
    setup: UringSetup,
}

impl std::fmt::Debug for UringIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringIo")
            .field("socket", &self.socket)
            .field("setup", &self.setup)
            .field("rx_armed", &self.rx_armed)
            .field("rx_ready", &self.rx_ready.len())
            .field("send_drops", &self.failures.drops())
            .finish_non_exhaustive()
    }
}

impl UringIo {
    /// Sets up the ring for `socket` with the default configuration.
    pub fn new(socket: UdpSocket, max_datagram: usize, single_issuer: bool) -> io::Result<UringIo> {
        UringIo::with_config(
            socket,
            max_datagram,
            UringConfig {
                single_issuer,
                ..UringConfig::default()
            },
        )
    }

    /// Sets up the ring for `socket`. Fails (never panics) when io_uring is missing (ENOSYS),
    /// denied (EPERM: seccomp, `kernel.io_uring_disabled`), or lacks multishot `recvmsg` or
    /// provided-buffer rings.
    pub fn with_config(
        socket: UdpSocket,
        max_datagram: usize,
        config: UringConfig,
    ) -> io::Result<UringIo> {
        // Sends carry MSG_DONTWAIT so that a full socket buffer is reported (and retried, then
        // dropped) as with the sockets backend; the socket is nonblocking for the same reason
        // should the descriptor be shared with one.
        socket.set_nonblocking(true)?;
        let mut rx = RxBuffers::new(max_datagram, config.rx_buffers)?;
        let cq_entries =
            (usize::from(rx.count) + 2 * SQ_ENTRIES as usize + 64).next_power_of_two() as u32;
        let (ring, flags, refused) = build_ring(config.single_issuer, cq_entries).map_err(|e| {
            let hint = match e.raw_os_error() {
                Some(libc::ENOSYS) => " (kernel built without io_uring)",
                Some(libc::EPERM) => " (denied: seccomp profile or kernel.io_uring_disabled)",
                _ => "",
            };
            io::Error::new(e.kind(), format!("io_uring_setup: {e}{hint}"))
        })?;

        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe).map_err(|e| {
            io::Error::new(e.kind(), format!("io_uring opcode probe (Linux 5.6): {e}"))
        })?;
        for (code, name) in [
            (opcode::RecvMsg::CODE, "RECVMSG"),
            (opcode::SendMsg::CODE, "SENDMSG"),
            (opcode::PollAdd::CODE, "POLL_ADD"),
            (opcode::AsyncCancel::CODE, "ASYNC_CANCEL"),
        ] {
            if !probe.is_supported(code) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("io_uring lacks {name}"),
                ));
            }
        }
        let zero_copy_threshold = if probe.is_supported(opcode::SendMsgZc::CODE) {
            config.zero_copy_threshold
        } else {
            None
        };

        // SAFETY: `rx` outlives the registration: it becomes a field of the `UringIo` below,
        // which drops `ring` (after cancelling every request) before it; on an early return,
        // `ring` (declared later) is dropped first.
        unsafe { rx.register(&ring) }.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("provided-buffer ring registration (Linux 5.19): {e}"),
            )
        })?;

        let napi = if config.napi_busy_poll_usecs == 0 {
            Err("not requested".to_string())
        } else {
            let mut napi = Napi::new()
                .set_busy_poll_timeout(config.napi_busy_poll_usecs)
                .set_prefer_busy_poll(config.napi_prefer_busy_poll);
            match ring.submitter().register_napi(&mut napi) {
                Ok(()) => Ok(config.napi_busy_poll_usecs),
                Err(e) => Err(format!("io_uring_register_napi (Linux 6.9): {e}")),
            }
        };

        let mut rx_hdr = Box::new(MsgHdr(sys::empty_msghdr()));
        rx_hdr.0.msg_namelen = RX_NAME_LEN as libc::socklen_t;
        let rx_buffers = (usize::from(rx.count), rx.size);
        // The flags are named by the attempt that succeeded (see `SETUP_SINGLE`/`SETUP_SHARED`).
        let coop_shared = flags.contains("COOP_TASKRUN") && !flags.contains("SINGLE_ISSUER");
        let mut io = UringIo {
            ring,
            socket,
            rx,
            rx_hdr,
            rx_armed: false,
            rx_gen: 0,
            rx_owner: None,
            coop_shared,
            rx_ready: VecDeque::new(),
            rx_error: None,
            wake_armed: None,
            tx: TxState::default(),
            failures: SendFailures::default(),
            peer: None,
            rx_arms: 0,
            rx_takeovers: 0,
            setup: UringSetup {
                flags,
                refused,
                napi,
                zero_copy_threshold,
                rx_buffers,
            },
        };
        // Arm the receive now so that a kernel without multishot recvmsg (before 6.0) is found
        // here: it rejects the SQE at once with EINVAL.
        io.arm_recv()?;
        io.enter()?;
        io.reap();
        if let Some(e) = io.rx_error.take() {
            return Err(io::Error::new(
                e.kind(),
                format!("multishot recvmsg (Linux 6.0): {e}"),
            ));
        }
        tracing::debug!(setup = ?io.setup, "io_uring engine ready");
        Ok(io)
    }

    /// What the ring ended up with.
    pub fn setup(&self) -> &UringSetup {
        &self.setup
    }

    /// Whether a multishot receive is armed right now (probe and tests).
    pub fn receive_armed(&self) -> bool {
        self.rx_armed
    }

    /// How many times the multishot receive ended (buffers ran out, an error) and was armed
    /// again. Often means the buffer ring is too small for the traffic between `recv` calls.
    pub fn receive_rearms(&self) -> u64 {
        self.rx_arms
            .saturating_sub(1)
            .saturating_sub(self.rx_takeovers)
    }

    /// How many times a thread other than the one that armed the multishot receive polled and
    /// moved it to itself (caller progress with `COOP_TASKRUN`).
    pub fn receive_takeovers(&self) -> u64 {
        self.rx_takeovers
    }

    /// Pushes one SQE, submitting first when the queue is full.
    ///
    /// # Safety
    /// Everything `entry` points at (message header, iovecs, buffers, address) must stay alive
    /// and unmoved until its completion (and a zero-copy send's notification) has been reaped,
    /// or the request is cancelled with the cancellation confirmed.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the entry's memory outlives the request (this function's contract).
            let pushed = unsafe { self.ring.submission().push(entry) };
            if pushed.is_ok() {
                return Ok(());
            }
            self.submit()?;
            // A full completion queue holds the submission back (EBUSY): make room.
            self.reap();
        }
    }

    /// Submits queued SQEs (without waiting).
    fn submit(&mut self) -> io::Result<()> {
        match self.ring.submit() {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Enters the kernel only when something needs it: SQEs to submit, task work to run
    /// (IORING_SQ_TASKRUN) or an overflowed completion queue to flush. Otherwise completions
    /// are read from shared memory alone.
    fn enter(&mut self) -> io::Result<()> {
        let needed = {
            let sq = self.ring.submission();
            !sq.is_empty() || sq.taskrun() || sq.cq_overflow()
        };
        if needed { self.submit() } else { Ok(()) }
    }

    fn arm_recv(&mut self) -> io::Result<()> {
        let generation = self.rx_gen.wrapping_add(1) & INDEX_MASK;
        let entry =
            opcode::RecvMsgMulti::new(Fd(self.socket.as_raw_fd()), &self.rx_hdr.0, RX_GROUP)
                .build()
                .user_data(user_data(TAG_RECV, generation));
        // SAFETY: the receive points at `rx_hdr`, boxed and owned by `self`, and at the buffer
        // group, which `self` owns; `Drop` cancels every request before they are freed.
        unsafe { self.push(&entry)? };
        self.rx_gen = generation;
        self.rx_armed = true;
        if self.coop_shared {
            self.rx_owner = Some(std::thread::current().id());
        }
        self.rx_arms += 1;
        Ok(())
    }

    /// Moves the multishot receive to the calling thread: cancels the one another thread armed
    /// (its completions wait for that thread to enter the kernel) and arms a new one here. A
    /// datagram the old one still delivers later is handed out like any other.
    fn take_over_recv(&mut self) -> io::Result<()> {
        let cancel = opcode::AsyncCancel::new(user_data(TAG_RECV, self.rx_gen))
            .build()
            .user_data(user_data(TAG_CANCEL, 0));
        // SAFETY: a cancellation points at no memory.
        unsafe { self.push(&cancel)? };
        self.arm_recv()?;
        self.rx_takeovers += 1;
        self.submit()
    }

    /// Sorts every available completion.
    fn reap(&mut self) {
        // Collect first: handling a completion needs `&mut self`.
        let mut batch: [Option<(u64, i32, u32)>; 64] = [None; 64];
        loop {
            let mut n = 0;
            {
                let mut cq = self.ring.completion();
                for cqe in cq.by_ref().take(batch.len()) {
                    batch[n] = Some((cqe.user_data(), cqe.result(), cqe.flags()));
                    n += 1;
                }
            }
            for done in batch.iter_mut().take(n) {
                if let Some((data, res, flags)) = done.take() {
                    self.on_completion(data, res, flags);
                }
            }
            if n < batch.len() {
                return;
            }
        }
    }

    fn on_completion(&mut self, data: u64, res: i32, flags: u32) {
        let index = data & INDEX_MASK;
        match data >> TAG_SHIFT {
            TAG_RECV => {
                // Datagrams are delivered whichever generation received them; only the end of
                // the current one needs a new arm.
                if !cqueue::more(flags) && index == self.rx_gen {
                    self.rx_armed = false;
                }
                if let Some(bid) = cqueue::buffer_select(flags) {
                    if res >= 0 {
                        self.rx_ready.push_back(RxDone {
                            bid,
                            len: res as usize,
                        });
                    } else {
                        // SAFETY: this completion handed buffer `bid` back.
                        unsafe { self.rx.provide(bid) };
                        self.rx.publish();
                    }
                } else if res < 0 {
                    let errno = -res;
                    // ENOBUFS: the buffer ring ran dry (re-armed once buffers are back);
                    // ECANCELED: cancelled on drop.
                    if !(errno == libc::ENOBUFS || errno == libc::ECANCELED || is_stale_icmp(errno))
                    {
                        self.rx_error
                            .get_or_insert(io::Error::from_raw_os_error(errno));
                    }
                }
            }
            TAG_SEND => {
                // Only `send` has sends in flight; it consumes these before returning.
                let kind = if cqueue::notif(flags) {
                    SendDone::Notification
                } else {
                    SendDone::Sent {
                        res,
                        more: cqueue::more(flags),
                    }
                };
                self.tx.done.push((index as usize, kind));
            }
            TAG_WAKE if self.wake_armed == Some(index as RawFd) => self.wake_armed = None,
            _ => {}
        }
    }
}

/// Receive rounds per `recv` call: a round reaps, delivers and returns buffers, so a burst
/// larger than the buffer ring is drained within one call.
const RECV_ROUNDS: usize = 4;

impl DatagramIo for UringIo {
    fn kind(&self) -> EngineKind {
        EngineKind::Uring
    }

    fn send(&mut self, batch: &mut TxBatch) -> io::Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let fd = Fd(self.socket.as_raw_fd());
        let zc_from = self.setup.zero_copy_threshold;
        self.tx.prepare(batch, self.peer);
        // Completions (and zero-copy notifications) still owed by the kernel.
        let mut in_flight = 0usize;
        let mut first_error = None;
        loop {
            while let Some(i) = self.tx.queue.pop_front() {
                let hdr = self.tx.hdr(i);
                let flags = libc::MSG_DONTWAIT as u32;
                let entry = match zc_from {
                    Some(from) if batch.datagram_len(i) >= from => {
                        opcode::SendMsgZc::new(fd, hdr).flags(flags).build()
                    }
                    _ => opcode::SendMsg::new(fd, hdr).flags(flags).build(),
                };
                let entry = entry.user_data(user_data(TAG_SEND, i as u64));
                // SAFETY: the send points at `self.tx` (not resized while sends are in flight)
                // and at the batch's buffers and region parts, which this call keeps alive and
                // unmoved until every completion and notification is reaped (or, when the ring
                // fails, until the cancellation is confirmed; otherwise they are leaked).
                if let Err(e) = unsafe { self.push(&entry) } {
                    first_error.get_or_insert(e);
                    self.tx.queue.clear();
                    break;
                }
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) {
                    // The ring refuses to run: the kernel may still hold pointers into the batch,
                    // so cancel everything before handing the batch back.
                    if !self.cancel_all() {
                        // Not certain the kernel let go: keep the regions the sends point into
                        // mapped for good (the batch's own buffers live as long as the engine).
                        for i in 0..batch.len() {
                            std::mem::forget(batch.part(i).cloned());
                        }
                    }
                    batch.clear();
                    return Err(e);
                }
            }
            self.reap();
            for k in 0..self.tx.done.len() {
                let (i, done) = self.tx.done[k];
                match done {
                    SendDone::Notification => in_flight -= 1,
                    SendDone::Sent { res, more } => {
                        if !more {
                            in_flight -= 1;
                        }
                        if res >= 0 {
                            continue;
                        }
                        let attempt = &mut self.tx.slots[i].attempt;
                        match self.failures.after(-res, attempt) {
                            Next::Again => self.tx.queue.push_back(i),
                            // Lost on the way out, as on a cable: the protocol resends.
                            Next::Drop => {}
                            Next::Fail => {
                                first_error.get_or_insert(io::Error::from_raw_os_error(-res));
                            }
                        }
                    }
                }
            }
            self.tx.done.clear();
            if !self.tx.queue.is_empty() {
                std::hint::spin_loop();
            }
        }
        batch.clear();
        first_error.map_or(Ok(()), Err)
    }

    fn recv(
        &mut self,
        // Multishot receive picks its buffers from the ring: no landing zones here.
        _landing: &mut Option<super::Landing>,
        deliver: &mut dyn FnMut(super::Received<'_>, SocketAddr),
    ) -> io::Result<usize> {
        if self.coop_shared && self.rx_armed && self.rx_owner != Some(std::thread::current().id()) {
            self.take_over_recv()?;
        }
        let mut total = 0;
        for _ in 0..RECV_ROUNDS {
            if !self.rx_armed {
                self.arm_recv()?;
            }
            self.enter()?;
            self.reap();
            if self.rx_ready.is_empty() {
                break;
            }
            while let Some(done) = self.rx_ready.pop_front() {
                // SAFETY: `rx_ready` holds buffers that receive completions handed back, each
                // once, until the loop below provides them again.
                let buf = unsafe { self.rx.filled(done.bid, done.len) };
                if let Ok(msg) = RecvMsgOut::parse(buf, &self.rx_hdr.0) {
                    // Truncated: larger than any datagram tbrdma sends, so not ours.
                    if !msg.is_payload_truncated() && !msg.is_name_data_truncated() {
                        if let Some(from) = sys::parse(msg.name_data()) {
                            deliver(super::Received::whole(msg.payload_data()), from);
                            total += 1;
                        }
                    }
                }
                // SAFETY: a completion handed `done.bid` back (above), and it leaves
                // `rx_ready` now.
                unsafe { self.rx.provide(done.bid) };
            }
            self.rx.publish();
        }
        if !self.rx_armed {
            self.arm_recv()?;
            self.enter()?;
        }
        match self.rx_error.take() {
            Some(e) if total == 0 => Err(e),
            other => {
                self.rx_error = other;
                Ok(total)
            }
        }
    }

    fn wait(&mut self, timeout: Duration, wake: BorrowedFd<'_>) -> io::Result<()> {
        self.reap();
        if !self.rx_ready.is_empty() || self.rx_error.is_some() {
            return Ok(());
        }
        if !self.rx_armed {
            self.arm_recv()?;
        }
        let fd = wake.as_raw_fd();
        if self.wake_armed != Some(fd) {
            if let Some(old) = self.wake_armed.take() {
                let cancel = opcode::AsyncCancel::new(user_data(TAG_WAKE, old as u64))
                    .build()
                    .user_data(user_data(TAG_CANCEL, 0));
                // SAFETY: a cancellation points at no memory.
                unsafe { self.push(&cancel)? };
            }
            let poll = opcode::PollAdd::new(Fd(fd), libc::POLLIN as u32)
                .build()
                .user_data(user_data(TAG_WAKE, fd as u64));
            // SAFETY: a poll names its descriptor by number and points at no memory.
            unsafe { self.push(&poll)? };
            self.wake_armed = Some(fd);
        }
        // Spurious returns are allowed, so a day stands in for longer timeouts (which would
        // overflow the kernel's signed seconds).
        let timespec = Timespec::from(timeout.min(Duration::from_secs(86_400)));
        let args = SubmitArgs::new().timespec(&timespec);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME | libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) => {}
            Err(e) => return Err(e),
        }
        self.reap();
        Ok(())
    }

    fn send_drops(&self) -> u64 {
        self.failures.drops()
    }

    fn set_peer(&mut self, peer: Option<SocketAddr>) -> io::Result<()> {
        crate::socket::set_udp_peer(&self.socket, peer)?;
        self.peer = peer;
        Ok(())
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }
}

impl UringIo {
    /// Cancels every request and waits for the kernel to let go of their memory. Returns
    /// whether that is certain.
    fn cancel_all(&mut self) -> bool {
        let _ = self.submit();
        let limit = Timespec::from(Duration::from_secs(2));
        let done = match self
            .ring
            .submitter()
            .register_sync_cancel(Some(limit), CancelBuilder::any())
        {
            Ok(()) => true,
            Err(e) => e.raw_os_error() == Some(libc::ENOENT),
        };
        self.reap();
        self.rx_armed = false;
        self.wake_armed = None;
        self.tx.done.clear();
        done
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        // Closing the ring cancels its requests asynchronously, after which the multishot
        // receive could still write into the buffer mappings. Cancel synchronously first; if
        // that cannot be confirmed (e.g. dropped on a thread other than a SINGLE_ISSUER ring's
        // owner), leak the buffers rather than risk the kernel writing into reused memory.
        if !self.cancel_all() {
            tracing::warn!("io_uring requests could not be cancelled; leaking the receive buffers");
            self.rx.leak = true;
        }
    }
}

/// Registers and unregisters a small provided-buffer ring on `ring` (for the feature probe).
pub(crate) fn try_provided_buffer_ring(ring: &IoUring) -> io::Result<()> {
    let mut rx = RxBuffers::new(64, 1)?;
    // SAFETY: the group is unregistered below before `rx` is dropped; should that fail, `rx`
    // is leaked instead.
    unsafe { rx.register(ring)? };
    let unregistered = ring.submitter().unregister_buf_ring(RX_GROUP);
    if unregistered.is_err() {
        std::mem::forget(rx);
    }
    unregistered
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        let data = user_data(TAG_SEND, 12345);
        assert_eq!(data >> TAG_SHIFT, TAG_SEND);
        assert_eq!(data & INDEX_MASK, 12345);
    }
}
