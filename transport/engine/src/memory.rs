//! Registered memory: pinned anonymous mappings (memmap2 + `mlock`, huge pages on request) or
//! memory the caller owns, and [`Arena`], the [`Memory`] the protocol core reads and writes
//! through.
//!
//! A region is shared memory in the RDMA sense: the engine copies packets into and out of it
//! while the application also uses it, and the application is responsible for not touching a
//! range while a request that uses it is outstanding (as with any RDMA buffer). All access goes
//! through the raw pointer taken when the mapping was created.
//!
//! **This file contains `unsafe`**: raw copies into and out of registered memory, and the
//! borrowed closure of a write sink, whose lifetime the arena cannot name ([`with_write_sink`]).

use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};
use nix::sys::resource::{Resource, getrlimit};
use tbrdma_proto::{Memory, MemoryTable, RegionId};
use thiserror::Error;

/// Why memory could not be allocated or pinned.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// `mlock` failed because RLIMIT_MEMLOCK is too low.
    #[error(
        "cannot pin {requested} bytes: the locked-memory limit (RLIMIT_MEMLOCK) is {limit} \
         (already locked by this process: {locked}). Raise it: `ulimit -l unlimited` in the shell, \
         `LimitMEMLOCK=infinity` in a systemd unit, `--ulimit memlock=-1:-1` for docker run, \
         or a `memlock` line in /etc/security/limits.conf"
    )]
    MemlockTooLow {
        /// Bytes asked for.
        requested: usize,
        /// The soft limit, in bytes (or "unlimited").
        limit: String,
        /// Bytes this process already had locked.
        locked: usize,
    },
    /// A zero-length region was asked for.
    #[error("a memory region must be at least 1 byte long")]
    Empty,
    /// The kernel refused the mapping.
    #[error("cannot map {requested} bytes: {source}")]
    Map {
        /// Bytes asked for.
        requested: usize,
        /// The error.
        source: std::io::Error,
    },
}

fn locked_bytes() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmLck:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|kb| kb.parse::<usize>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}

/// The bytes behind one region.
#[derive(Debug)]
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    huge_pages: bool,
    /// Keeps the mapping alive (None for caller-owned memory).
    _map: Option<MmapMut>,
}

// SAFETY: `Buffer` owns its mapping (or, for caller memory, the caller promised in
// `Buffer::from_raw` that the memory outlives it and is usable from any thread). All access to
// the bytes goes through raw copies whose races with the application are the documented RDMA
// contract, never through Rust references held across threads.
unsafe impl Send for Buffer {}
// SAFETY: as above; `&Buffer` only hands out the pointer and length.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Maps `len` zeroed bytes, backed by 2 MiB huge pages when `huge_pages` is set and the
    /// system has them (otherwise ordinary pages), and pins them with `mlock`.
    pub fn allocate(len: usize, huge_pages: bool) -> Result<Buffer, MemoryError> {
        if len == 0 {
            return Err(MemoryError::Empty);
        }
        let mut used_huge = false;
        let mut map = None;
        if huge_pages {
            let rounded = len.div_ceil(2 << 20) * (2 << 20);
            match MmapOptions::new().len(rounded).huge(Some(21)).map_anon() {
                Ok(m) => {
                    map = Some(m);
                    used_huge = true;
                }
                Err(e) => {
                    tracing::info!("no huge pages for {len} bytes ({e}); using ordinary pages")
                }
            }
        }
        let mut map = match map {
            Some(m) => m,
            None => MmapOptions::new()
                .len(len)
                .map_anon()
                .map_err(|source| MemoryError::Map {
                    requested: len,
                    source,
                })?,
        };
        if let Err(e) = map.lock() {
            let limit = match getrlimit(Resource::RLIMIT_MEMLOCK) {
                Ok((soft, _)) if soft == libc::RLIM_INFINITY => "unlimited".to_string(),
                Ok((soft, _)) => format!("{soft} bytes"),
                Err(_) => "unknown".to_string(),
            };
            tracing::debug!("mlock failed: {e}");
            return Err(MemoryError::MemlockTooLow {
                requested: len,
                limit,
                locked: locked_bytes(),
            });
        }
        let ptr = NonNull::new(map.as_mut_ptr()).expect("mmap never returns null");
        Ok(Buffer {
            ptr,
            len,
            huge_pages: used_huge,
            _map: Some(map),
        })
    }

    /// Wraps memory the caller owns.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes from any thread for as long as the
    /// returned `Buffer` (and every clone of the `Arc` it is put in) lives, must not be freed or
    /// unmapped before then, and the caller must accept that the engine writes into it whenever
    /// the peer's operations or posted receives say so.
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize) -> Buffer {
        Buffer {
            ptr,
            len,
            huge_pages: false,
            _map: None,
        }
    }

    /// Address of the first byte: what the region is registered and named by.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never, for an allocated one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether huge pages back it.
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// Panics with `what` unless `len` bytes at `offset` lie inside the buffer: every access
    /// checks this before it touches the mapping.
    fn assert_inside(&self, offset: usize, len: usize, what: &str) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "{what}"
        );
    }

    /// Copies `out.len()` bytes from `offset`.
    ///
    /// # Panics
    /// If the range is outside the buffer.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.assert_inside(offset, out.len(), "read outside the buffer");
        // SAFETY: the range is inside the live mapping (checked above); `out` is a distinct
        // Rust buffer. Concurrent writes by the engine are the RDMA contract (module docs).
        unsafe { copy_bytes(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len()) }
    }

    /// Calls `f` with the `len` bytes at `offset`, borrowed in place (no copy): for reducing or
    /// checksumming straight out of a region.
    ///
    /// # Safety
    /// Nothing may write the range while `f` runs: no other thread through [`Self::write`] or
    /// [`Self::copy_to`], and no engine placing a peer's WRITE or a receive into it (a peer
    /// holding an rkey for the range can make the engine do that at any time, which is why
    /// this is not a safe function: a `&[u8]` must not change under its holder).
    ///
    /// # Panics
    /// If the range is outside the buffer.
    pub unsafe fn with_slice<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.assert_inside(offset, len, "view outside the buffer");
        // SAFETY: the range is inside the live mapping (checked above), which outlives `self`
        // and so the borrow `f` gets; nothing writes it while `f` runs (the caller's contract).
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) };
        f(bytes)
    }

    /// The address of byte `offset`, for handing the kernel an iovec that points into the region
    /// (the payload part of a gathered datagram, see [`crate::io::RegionPart`]). Taking it is
    /// harmless; whoever gives it to the kernel must keep the range inside the buffer and the
    /// buffer alive until the kernel is done reading.
    pub fn ptr_at(&self, offset: usize) -> *const u8 {
        self.ptr.as_ptr().wrapping_add(offset)
    }

    /// Copies `data` to `offset`.
    ///
    /// # Panics
    /// If the range is outside the buffer.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.assert_inside(offset, data.len(), "write outside the buffer");
        // SAFETY: as in `read`, in the other direction.
        unsafe { copy_bytes(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len()) }
    }

    /// Copies `data` to `offset` as [`Self::write`] does, but past the caches where the CPU
    /// can (x86-64: non-temporal stores): the destination's cache lines are neither read first
    /// nor kept, so a stream into memory that is not cached costs one write of each line
    /// instead of a read and a write, and does not evict what the caches hold. Every store is
    /// visible to other threads when this returns (it ends with a store fence), as after
    /// `write`. For the parts of large WRITEs, which nothing reads soon.
    ///
    /// # Panics
    /// If the range is outside the buffer.
    pub fn write_streaming(&self, offset: usize, data: &[u8]) {
        self.assert_inside(offset, data.len(), "write outside the buffer");
        // SAFETY: the range is inside the live mapping (checked above) and `data` is a
        // distinct Rust buffer, as in `write`.
        unsafe { copy_streaming(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len()) }
    }

    /// Copies `len` bytes at `offset` into `dst` at `dst_offset`, with no intermediate buffer
    /// (the ranges may overlap when `dst` is this buffer).
    ///
    /// # Panics
    /// If either range is outside its buffer.
    pub fn copy_to(&self, offset: usize, dst: &Buffer, dst_offset: usize, len: usize) {
        let inside = |at: usize, size: usize| at.checked_add(len).is_some_and(|end| end <= size);
        assert!(inside(offset, self.len), "copy from outside the buffer");
        assert!(inside(dst_offset, dst.len), "copy to outside the buffer");
        let src = self.ptr.as_ptr().wrapping_add(offset);
        let dst = dst.ptr.as_ptr().wrapping_add(dst_offset);
        let (from, to) = (src as usize, dst as usize);
        let overlap = from < to + len && to < from + len;
        // SAFETY: both ranges are inside live mappings (checked above); `ptr::copy` allows them
        // to overlap, and `copy_bytes` gets them only when they do not. Concurrent writes by
        // the engine are the RDMA contract (module docs).
        unsafe {
            if overlap {
                std::ptr::copy(src, dst, len)
            } else {
                copy_bytes(src, dst, len)
            }
        }
    }

    /// Reads the aligned 8-byte word at `offset` with an atomic load (for polling a flag the
    /// peer writes).
    ///
    /// # Panics
    /// If the word is outside the buffer or not 8-byte aligned.
    pub fn load_u64(&self, offset: usize) -> u64 {
        assert!(
            offset + 8 <= self.len && (self.addr() as usize + offset) % 8 == 0,
            "unaligned or out of range"
        );
        // SAFETY: in range and aligned (checked); AtomicU64 has u64's layout, and the engine's
        // writes to this word are plain copies the load may observe torn only across words.
        let word =
            unsafe { &*(self.ptr.as_ptr().add(offset) as *const std::sync::atomic::AtomicU64) };
        word.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The regions of one protection domain: the protocol core's [`MemoryTable`] plus the bytes.
#[derive(Debug)]
pub struct Arena {
    table: MemoryTable,
    buffers: Vec<Option<Arc<Buffer>>>,
    /// A range some datagram may be received into (a landing zone, see
    /// [`crate::io::Landing`]), and whether a placement has written into it since it was set.
    watch: Option<(RegionId, std::ops::Range<usize>)>,
    watch_hit: bool,
    /// Placements found already in place since [`Self::take_in_place`].
    in_place: u64,
    /// Where WRITEs into one range go instead of into its bytes (see [`with_write_sink`]).
    sink: Option<WriteSink>,
}

impl Arena {
    /// An empty arena whose keys come from `seed` (take it from the OS).
    pub fn new(seed: [u8; 32]) -> Arena {
        Arena {
            table: MemoryTable::new(seed),
            buffers: Vec::new(),
            watch: None,
            watch_hit: false,
            in_place: 0,
            sink: None,
        }
    }

    /// Registers `buffer` with `access`.
    pub fn register(
        &mut self,
        buffer: Arc<Buffer>,
        access: tbrdma_proto::Access,
    ) -> Result<tbrdma_proto::Region, tbrdma_proto::memory::RegisterError> {
        let region = self
            .table
            .register(buffer.addr(), buffer.len() as u64, access)?;
        let slot = region.id.0 as usize;
        if self.buffers.len() <= slot {
            self.buffers.resize_with(slot + 1, || None);
        }
        self.buffers[slot] = Some(buffer);
        Ok(region)
    }

    /// Revokes a region's keys and forgets its bytes.
    pub fn deregister(&mut self, id: RegionId) {
        let _ = self.table.deregister(id);
        if let Some(slot) = self.buffers.get_mut(id.0 as usize) {
            *slot = None;
        }
    }

    /// The protection table.
    pub fn table_mut(&mut self) -> &mut MemoryTable {
        &mut self.table
    }

    /// The bytes of a registered region (for a datagram that sends them where they lie: it
    /// keeps the `Arc` until the kernel has read them).
    pub fn buffer(&self, id: RegionId) -> Option<&Arc<Buffer>> {
        self.buffers.get(id.0 as usize).and_then(Option::as_ref)
    }
}

impl Arena {
    fn store(&mut self, region: RegionId, offset: u64, data: &[u8], how: Store) {
        if let Some(Some(buffer)) = self.buffers.get(region.0 as usize) {
            let offset = offset as usize;
            self.watch_hit |= touches(&self.watch, region, offset, data.len());
            if data.as_ptr() == buffer.ptr_at(offset) && offset + data.len() <= buffer.len() {
                // Received straight into its place (a landing zone): nothing to copy.
                self.in_place += 1;
                return;
            }
            match how {
                Store::Cached => buffer.write(offset, data),
                Store::Streaming => buffer.write_streaming(offset, data),
            }
        }
    }

    /// Starts watching `range` of `region` for placements (`None`: stops).
    pub fn watch(&mut self, range: Option<(RegionId, std::ops::Range<usize>)>) {
        self.watch = range;
        self.watch_hit = false;
    }

    /// Whether a placement wrote into the watched range since [`Self::watch`].
    pub fn watch_hit(&self) -> bool {
        self.watch_hit
    }

    /// How many placements found their bytes already in place since the last call.
    pub fn take_in_place(&mut self) -> u64 {
        std::mem::take(&mut self.in_place)
    }
}

impl Memory for Arena {
    fn table(&self) -> &MemoryTable {
        &self.table
    }

    fn read(&self, region: RegionId, offset: u64, out: &mut [u8]) {
        if let Some(Some(buffer)) = self.buffers.get(region.0 as usize) {
            buffer.read(offset as usize, out);
        }
    }

    fn has_bytes(&self, region: RegionId) -> bool {
        self.buffer(region).is_some()
    }

    fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) {
        self.store(region, offset, data, Store::Cached);
    }

    fn place_write(&mut self, region: RegionId, offset: u64, data: &[u8], message_len: u64) {
        if let Some(sink) = &mut self.sink
            && sink.region == region
            && let Some(at) = (offset as usize).checked_sub(sink.range.start)
            && at.saturating_add(data.len()) <= sink.range.len()
        {
            // The landing zone's bookkeeping sees the placement whoever takes it.
            self.watch_hit |= touches(&self.watch, region, offset as usize, data.len());
            // SAFETY: `with_write_sink` installed the sink and removes it, under the same lock
            // as this `&mut Arena`, before the closure's borrow ends; calls are serialised by
            // that `&mut`, and the closure is `Send` (whichever thread runs the loop calls it).
            let place = unsafe { sink.place.as_mut() };
            if place(at, data) {
                return;
            }
        }
        let how = if message_len >= STREAMING_MESSAGE_MIN {
            Store::Streaming
        } else {
            Store::Cached
        };
        self.store(region, offset, data, how);
    }

    fn with_bytes(&self, region: RegionId, offset: u64, len: usize, f: &mut dyn FnMut(&[u8])) {
        if let Some(Some(buffer)) = self.buffers.get(region.0 as usize) {
            // SAFETY: the core calls this while the engine builds a datagram, under the state
            // lock, which every placement into a region also takes: no peer's write or receive
            // lands meanwhile. The range is the payload of an outstanding request or response,
            // which the application does not write until it completes (the verbs contract on
            // posted buffers, docs/semantics.md).
            unsafe { buffer.with_slice(offset as usize, len, |bytes| f(bytes)) };
        }
    }
}

/// Whether a placement of `len` bytes at `offset` of `region` touches the watched range.
fn touches(
    watch: &Option<(RegionId, std::ops::Range<usize>)>,
    region: RegionId,
    offset: usize,
    len: usize,
) -> bool {
    watch.as_ref().is_some_and(|(watched, range)| {
        *watched == region && offset < range.end && range.start < offset.saturating_add(len)
    })
}

/// What a write sink is handed ([`with_write_sink`]): the offset of a WRITE packet's payload
/// from the start of the sunk range, and the payload; it returns whether it took the bytes
/// (else they are stored in the region as usual). It runs under the engine's state lock, on
/// whichever thread runs the loop, so it must not call into the engine.
pub type SinkFn<'a> = dyn FnMut(usize, &[u8]) -> bool + Send + 'a;

/// A range of a region whose incoming WRITE packets go to a function instead of into its bytes.
#[derive(Debug)]
struct WriteSink {
    region: RegionId,
    range: std::ops::Range<usize>,
    /// The closure `with_write_sink` borrowed, its lifetime erased: valid while this is
    /// installed (see there).
    place: NonNull<SinkFn<'static>>,
}

// SAFETY: the closure behind `place` is `Send` (`SinkFn` says so), and `with_write_sink` keeps
// it alive and otherwise untouched while this exists.
unsafe impl Send for WriteSink {}

/// Runs a function on an arena under the engine's state lock; false when it cannot reach it.
pub(crate) type InArena<'a> = dyn Fn(&mut dyn FnMut(&mut Arena)) -> bool + 'a;

/// Runs `body` with `place` as the sink of bytes `range` of `region`, in the arena that
/// `in_arena` reaches under the engine's state lock (it returns false when it cannot reach
/// it): every WRITE packet whose payload lands entirely inside the range is handed to `place`
/// ([`SinkFn`]) instead of being stored, unless `place` declines it. Packets of a WRITE that
/// arrived before, or that reach outside the range, are stored as usual: `place` sees only
/// what it took. The sink is removed before this returns, under the lock every placement
/// holds, also when `body` panics: `place` is never called afterwards.
///
/// Returns whether the sink was installed (not when the region is not registered there, the
/// range runs past its bytes, or the arena has a sink already: one per arena) and what `body`
/// returned. `body` runs either way.
pub(crate) fn with_write_sink<R>(
    in_arena: &InArena<'_>,
    region: RegionId,
    range: std::ops::Range<usize>,
    place: &mut SinkFn<'_>,
    body: impl FnOnce() -> R,
) -> (bool, R) {
    // SAFETY: only the lifetime changes (the same fat pointer). The erased borrow is not used
    // beyond `place`'s: the guard below removes the sink from the arena before this function
    // returns or unwinds, and nothing else copies the pointer out of the arena.
    let place = unsafe {
        std::mem::transmute::<NonNull<SinkFn<'_>>, NonNull<SinkFn<'static>>>(NonNull::from(place))
    };
    let mut installed = false;
    in_arena(&mut |arena| {
        let fits = arena
            .buffer(region)
            .is_some_and(|b| range.start <= range.end && range.end <= b.len());
        if fits && arena.sink.is_none() {
            arena.sink = Some(WriteSink {
                region,
                range: range.clone(),
                place,
            });
            installed = true;
        }
    });
    /// Removes the sink when dropped: on return and on unwinding alike.
    struct Removal<'a>(&'a InArena<'a>);
    impl Drop for Removal<'_> {
        fn drop(&mut self) {
            let reached = (self.0)(&mut |arena| arena.sink = None);
            if !reached {
                // Arenas are never removed, and this one was reached when the sink went in;
                // were it not, the erased borrow would outlive its closure: stop here.
                std::process::abort();
            }
        }
    }
    let removal = installed.then_some(Removal(in_arena));
    let got = body();
    drop(removal);
    (installed, got)
}

/// WRITEs of at least this many bytes are placed with [`Buffer::write_streaming`]
/// ([`tbrdma_proto::Memory::place_write`]). Nobody on the target side is about to read a
/// WRITE's bytes (NCCL's rendezvous writes into a receive slot that the proxy or a GPU copy
/// reads after the whole step has landed), and a message this size does not stay in a core's
/// private cache whole anyway (L2 is 1-2 MiB per core on the hosts tbrdma targets). A
/// hardware RDMA NIC on an AMD host writes to memory the same way, past the CPU's caches.
/// Receives and READ responses stay cached, as do smaller WRITEs: their reader (the
/// application that asked, the collectives reducing a slot as soon as it lands) comes at once.
/// Measured: the NCCL plugin's stream of 4 MiB WRITE_WITH_IMMs into 8 distinct 4 MiB buffers
/// went from 0.87x to 0.90-0.99x of `tbrdma bw` (pluginbench); streaming receives too made
/// `tbrdma bw --op send` about 30 % faster but its `--verify`, which reads every message back,
/// about 15 % slower (docs/performance.md, 2026-12-02).
pub const STREAMING_MESSAGE_MIN: u64 = 1 << 20;

/// How [`Arena`] stores a placement.
#[derive(Clone, Copy, Debug)]
enum Store {
    Cached,
    Streaming,
}

/// `dst.copy_from_slice(src)`, without glibc's slow case (see [`copy_bytes`]): for copies
/// between ordinary buffers on a message's path (the collectives' working buffers). Two
/// 16 KiB `Vec`s allocated one after the other lie 16 KiB + 16 bytes apart, exactly that case.
///
/// # Panics
/// If the lengths differ.
pub fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_slice between slices of different lengths"
    );
    // SAFETY: both slices are valid for their length, which is the same, and a `&mut` slice
    // never overlaps a `&` one.
    unsafe { copy_bytes(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

/// Copies of at least this many bytes whose destination lies less than [`SHORT_DISTANCE`]
/// bytes past the source, modulo 4 KiB, go by [`copy_blocks`] (see [`copy_bytes`]).
const SHORT_DISTANCE_MIN_LEN: usize = 1024;
/// See [`SHORT_DISTANCE_MIN_LEN`].
const SHORT_DISTANCE: usize = 64;

/// Copies `len` bytes from `src` to `dst`, as `memcpy` does, but never with `rep movsb` where
/// the destination lies 1 to 63 bytes past the source modulo 4 KiB. There, glibc's `memcpy`
/// (2.36, which switches to `rep movsb` from a few KiB on CPUs with fast short `rep movsb`)
/// took 9.4 µs for 16 KiB on this project's AMD EPYC (Zen 3) VM, against 0.4 µs at any other
/// distance: each load of the string move then aliases a store it has just made. The NCCL
/// plugin's copy of an eager message out of its bounce buffer into NCCL's (malloc'd, so 16
/// bytes past a page) buffer hit it on every message (docs/performance.md, stop 51). Those
/// copies go in 64-byte blocks of vector moves, at 0.4-0.5 µs for 16 KiB here.
///
/// # Safety
/// `src` must be valid for reading and `dst` for writing `len` bytes, and the two ranges must
/// not overlap.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    let ahead = (dst as usize).wrapping_sub(src as usize) % 4096;
    if len >= SHORT_DISTANCE_MIN_LEN && (1..SHORT_DISTANCE).contains(&ahead) {
        // SAFETY: the caller's contract.
        unsafe { copy_blocks(src, dst, len) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

/// Copies `len` bytes from `src` to `dst` in 64-byte blocks of unaligned 16-byte vector
/// loads and stores (SSE2, in the x86-64 baseline), then the tail.
///
/// # Safety
/// As for [`copy_bytes`].
#[cfg(target_arch = "x86_64")]
#[inline(never)]
unsafe fn copy_blocks(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
    let body_end = len / 64 * 64;
    // SAFETY: every access is inside the two ranges (body_end <= len), which the caller
    // guarantees are valid and disjoint; the loads and stores are unaligned ones.
    unsafe {
        let mut at = 0;
        while at < body_end {
            let v = [0, 1, 2, 3].map(|lane| _mm_loadu_si128(src.add(at + 16 * lane).cast()));
            for (lane, v) in v.into_iter().enumerate() {
                _mm_storeu_si128(dst.add(at + 16 * lane).cast::<__m128i>(), v);
            }
            // Keeps LLVM from turning the loop back into a call of `memcpy`.
            std::arch::asm!("", options(nomem, nostack, preserves_flags));
            at += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at);
    }
}

/// Elsewhere, a plain copy.
///
/// # Safety
/// As for [`copy_bytes`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_blocks(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Copies `len` bytes from `src` to `dst`, with non-temporal stores for the 16-byte aligned
/// part of the destination, then fences them.
///
/// # Safety
/// `src` must be valid for reading and `dst` for writing `len` bytes, and the two ranges must
/// not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Streaming stores need a 16-byte aligned destination: plain copies for the unaligned
    // head and for the tail shorter than one 64-byte step.
    let head = dst.align_offset(16).min(len);
    let body_end = head + (len - head) / 64 * 64;
    // SAFETY: every access is inside the two ranges (body_end <= len), which the caller
    // guarantees are valid and disjoint; `dst + head` is 16-byte aligned, as
    // `_mm_stream_si128` requires, and so is every 16-byte step from it. SSE2, which these
    // intrinsics need, is part of the x86-64 baseline. The fence orders the streaming stores
    // before whatever this thread stores next (such as the completion that says the bytes
    // are there).
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut at = head;
        while at < body_end {
            for lane in 0..4 {
                let v = _mm_loadu_si128(src.add(at + 16 * lane).cast::<__m128i>());
                _mm_stream_si128(dst.add(at + 16 * lane).cast::<__m128i>(), v);
            }
            at += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at);
        _mm_sfence();
    }
}

/// Elsewhere, a plain copy.
///
/// # Safety
/// As for the x86-64 version.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arena_lends_region_bytes_in_place() {
        let mut arena = Arena::new([3; 32]);
        let buffer = Arc::new(Buffer::allocate(4096, false).unwrap());
        buffer.write(100, b"gathered payload");
        let region = arena
            .register(Arc::clone(&buffer), tbrdma_proto::Access::empty())
            .unwrap();
        let mut seen = Vec::new();
        arena.with_bytes(region.id, 100, 16, &mut |bytes| {
            assert_eq!(bytes.as_ptr(), buffer.ptr_at(100), "not a copy");
            seen.extend_from_slice(bytes);
        });
        assert_eq!(seen, b"gathered payload");
        assert!(Arc::ptr_eq(arena.buffer(region.id).unwrap(), &buffer));
        arena.deregister(region.id);
        arena.with_bytes(region.id, 100, 16, &mut |_| panic!("a region that is gone"));
        assert!(arena.buffer(region.id).is_none());
    }

    #[test]
    fn a_streaming_write_copies_exactly_its_range_at_any_alignment() {
        let buffer = Buffer::allocate(8192, false).unwrap();
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 1) as u8).collect();
        for offset in [0, 1, 15, 16, 17, 63, 64, 100, 4095] {
            for len in [0, 1, 15, 16, 63, 64, 65, 200, 3000] {
                buffer.write(0, &[0xee; 8192]);
                buffer.write_streaming(offset, &data[..len]);
                let mut out = vec![0; 8192];
                buffer.read(0, &mut out);
                assert_eq!(&out[offset..offset + len], &data[..len], "{offset}+{len}");
                assert!(
                    out[..offset].iter().all(|&b| b == 0xee),
                    "before {offset}+{len}"
                );
                assert!(
                    out[offset + len..].iter().all(|&b| b == 0xee),
                    "after {offset}+{len}"
                );
            }
        }
    }

    /// Copies at distances near a multiple of 4 KiB (the block copy's case) and elsewhere,
    /// between buffers and inside one: exactly the range, nothing around it.
    #[test]
    fn copies_at_every_short_distance_move_exactly_their_range() {
        let src = Buffer::allocate(1 << 16, false).unwrap();
        let dst = Buffer::allocate(1 << 16, false).unwrap();
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 13 + 5) as u8).collect();
        src.write(0, &data);
        for distance in (0..80).chain([4032, 4095, 4096, 4097, 4100]) {
            for len in [0, 1, 63, 1023, 1024, 1025, 4096, 16_384, 16_447] {
                for at in [0, 3] {
                    dst.write(0, &[0xee; 1 << 16]);
                    src.copy_to(at, &dst, at + distance, len);
                    let mut out = vec![0; 1 << 16];
                    dst.read(0, &mut out);
                    let (lo, hi) = (at + distance, at + distance + len);
                    assert_eq!(&out[lo..hi], &data[at..at + len], "{distance} {len} {at}");
                    assert!(out[..lo].iter().all(|&b| b == 0xee), "{distance} {len}");
                    assert!(out[hi..].iter().all(|&b| b == 0xee), "{distance} {len}");
                    // The same through `read` and `write` (a Rust buffer on one side).
                    let mut back = vec![0; len + distance];
                    dst.read(lo, &mut back[distance..]);
                    assert_eq!(&back[distance..], &data[at..at + len]);
                }
            }
        }
        // Between Rust slices of one allocation, at short distances and not.
        for distance in [0, 8, 16, 40, 63, 64, 4096 + 16] {
            let mut both = vec![0u8; 2 * 16_384 + 4096 + 64];
            both[..16_384].copy_from_slice(&data[..16_384]);
            let (from, to) = both.split_at_mut(16_384 + distance);
            copy_slice(&mut to[..16_384], &from[..16_384]);
            assert_eq!(&to[..16_384], &data[..16_384], "slices {distance}");
        }
        // Overlapping ranges in one buffer, the destination a little past the source.
        for distance in [1, 8, 16, 63, 64] {
            src.write(0, &data);
            src.copy_to(100, &src, 100 + distance, 16_384);
            let mut out = vec![0; 16_384];
            src.read(100 + distance, &mut out);
            assert_eq!(out, data[100..100 + 16_384], "overlap {distance}");
        }
    }

    #[test]
    fn parts_of_large_and_small_writes_land_the_same() {
        let mut arena = Arena::new([5; 32]);
        let buffer = Arc::new(Buffer::allocate(1 << 16, false).unwrap());
        let region = arena
            .register(Arc::clone(&buffer), tbrdma_proto::Access::empty())
            .unwrap();
        let part: Vec<u8> = (0..9000u32).map(|i| (i % 251) as u8).collect();
        arena.place_write(region.id, 3, &part, STREAMING_MESSAGE_MIN);
        arena.place_write(region.id, 20_003, &part, 100);
        let mut out = vec![0; 9000];
        buffer.read(3, &mut out);
        assert_eq!(out, part);
        buffer.read(20_003, &mut out);
        assert_eq!(out, part);
    }
}
