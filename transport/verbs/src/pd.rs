//! Protection domains and memory regions.
//!
//! **This file contains `unsafe`**: registering memory the caller owns, and the in-place view
//! of a region's bytes, whose contracts the caller keeps.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tbrdma_engine::memory::Buffer;
use tbrdma_engine::worker::PdId;
use tbrdma_proto::{Access, Region, RemoteAddr, Sge};

use crate::device::Device;
use crate::error::{Result, VerbsError};

/// A protection domain (`ibv_pd`): regions registered here are reachable only through queue
/// pairs of the same domain, so an rkey from another domain's connection fails.
#[derive(Clone, Debug)]
pub struct ProtectionDomain {
    pub(crate) device: Device,
    pub(crate) id: PdId,
}

impl ProtectionDomain {
    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Allocates `len` bytes of pinned memory and registers them with `access`.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        self.register(Arc::new(Buffer::allocate(len, false)?), access)
    }

    /// As [`Self::alloc_mr`], backed by 2 MiB huge pages when the system has them reserved
    /// (`vm.nr_hugepages`); ordinary pages otherwise.
    pub fn alloc_mr_huge(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        self.register(Arc::new(Buffer::allocate(len, true)?), access)
    }

    /// Registers memory the caller owns (`ibv_reg_mr` on an existing buffer). It is not pinned
    /// by tbrdma (pin it yourself if you need to).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads and writes from any thread, and must not be
    /// freed, until the returned region and every queue pair that used it are dropped. The
    /// engine writes into it whenever a peer's WRITE, a READ response or a receive lands there,
    /// so the caller must not hold Rust references into the range while requests use it.
    pub unsafe fn register_mr(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded to the caller (this function's contract is Buffer::from_raw's).
        let buffer = unsafe { Buffer::from_raw(ptr, len) };
        self.register(Arc::new(buffer), access)
    }

    fn register(&self, buffer: Arc<Buffer>, access: Access) -> Result<MemoryRegion> {
        let region = self
            .device
            .inner
            .engine
            .register(self.id, Arc::clone(&buffer), access)?;
        Ok(MemoryRegion {
            pd: self.clone(),
            buffer,
            region,
            deregistered: false,
        })
    }
}

/// A registered memory region (`ibv_mr`).
#[derive(Debug)]
pub struct MemoryRegion {
    pd: ProtectionDomain,
    buffer: Arc<Buffer>,
    region: Region,
    deregistered: bool,
}

impl MemoryRegion {
    /// Address of the first byte (what work requests and peers name).
    pub fn addr(&self) -> u64 {
        self.region.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buffer.len()
    }

    /// The bytes behind the region, shared with the engine.
    pub(crate) fn buffer_arc(&self) -> Arc<Buffer> {
        Arc::clone(&self.buffer)
    }

    /// The region's id in its protection domain's table.
    pub(crate) fn region_id(&self) -> tbrdma_proto::RegionId {
        self.region.id
    }

    /// Its protection domain.
    pub(crate) fn pd_id(&self) -> PdId {
        self.pd.id
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.region.lkey
    }

    /// Remote key: give it to the peer for one-sided access.
    pub fn rkey(&self) -> u32 {
        self.region.rkey
    }

    /// Whether huge pages back it.
    pub fn huge_pages(&self) -> bool {
        self.buffer.huge_pages()
    }

    /// A local buffer of `len` bytes at `offset`, for a work request.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge {
            addr: self.region.addr + offset as u64,
            len: len as u64,
            lkey: self.region.lkey,
        }
    }

    /// The peer's name for the byte at `offset`.
    pub fn remote(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.region.addr + offset as u64,
            rkey: self.region.rkey,
        }
    }

    /// Copies bytes out of the region.
    ///
    /// # Panics
    /// If the range is outside the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.buffer.read(offset, out)
    }

    /// Calls `f` with the `len` bytes at `offset`, borrowed in place instead of copied (to
    /// reduce or checksum straight out of a region). [`Self::read`] is the safe way.
    ///
    /// # Safety
    /// Nothing may write the range while `f` runs: no request of this process, no other
    /// thread, and no peer. A peer that holds an rkey for the range can write it whenever the
    /// engine runs (its thread, in thread progress), whatever the application's protocol says;
    /// only a range no rkey of a peer covers, or a peer that is trusted, keeps the contract.
    /// (Safe code cannot call it:)
    ///
    /// ```compile_fail,E0133
    /// fn look(mr: &tbrdma_verbs::MemoryRegion) -> u8 {
    ///     mr.with_bytes(0, 1, |bytes| bytes[0])
    /// }
    /// ```
    ///
    /// # Panics
    /// If the range is outside the region.
    pub unsafe fn with_bytes<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        // SAFETY: the caller's contract is the buffer's.
        unsafe { self.buffer.with_slice(offset, len, f) }
    }

    /// The bytes `range` of this region, as a [`WriteSink`]: a place where a function can take
    /// the peers' WRITEs instead of the region's bytes (to reduce each packet as it arrives,
    /// with no copy into the region and none out of it).
    pub fn write_sink(&self, range: std::ops::Range<usize>) -> WriteSink {
        WriteSink {
            pd: self.pd.clone(),
            region: self.region.id,
            range,
        }
    }

    /// Copies bytes into the region.
    ///
    /// # Panics
    /// If the range is outside the region.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.buffer.write(offset, data)
    }

    /// Copies `len` bytes at `offset` into `dst` at `dst_offset`, straight from region to
    /// region.
    ///
    /// # Panics
    /// If either range is outside its region.
    pub fn copy_to(&self, offset: usize, dst: &MemoryRegion, dst_offset: usize, len: usize) {
        self.buffer.copy_to(offset, &dst.buffer, dst_offset, len)
    }

    /// Atomically loads the aligned 8-byte word at `offset` (to poll a flag a peer writes).
    pub fn load_u64(&self, offset: usize) -> u64 {
        self.buffer.load_u64(offset)
    }

    /// Deregisters the region, waiting up to `timeout` for requests that name it to complete
    /// (driving progress meanwhile in caller mode). Its keys stop working at once either way.
    pub fn deregister(mut self, timeout: Duration) -> Result<()> {
        let result = self.deregister_inner(timeout);
        self.deregistered = true;
        result
    }

    fn deregister_inner(&mut self, timeout: Duration) -> Result<()> {
        let engine = &self.pd.device.inner.engine;
        let start = Instant::now();
        // The first call revokes the keys, whoever still uses the region.
        loop {
            match engine.deregister(self.pd.id, self.region.id) {
                Ok(()) => return Ok(()),
                Err(users) if start.elapsed() >= timeout => {
                    return Err(VerbsError::RegionInUse {
                        users,
                        waited: timeout,
                    });
                }
                Err(_) => {}
            }
            let _ = engine.progress();
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if !self.deregistered {
            // Revoke the keys now; the bytes stay in the arena (kept alive by its Arc) until no
            // outstanding request names them, so an in-flight send never reads freed memory.
            let _ = self
                .pd
                .device
                .inner
                .engine
                .deregister(self.pd.id, self.region.id);
        }
    }
}

/// Bytes of a region whose incoming WRITEs a function can take instead of the bytes
/// ([`MemoryRegion::write_sink`]). It holds the protection domain, not the region.
#[derive(Clone, Debug)]
pub struct WriteSink {
    pd: ProtectionDomain,
    region: tbrdma_proto::RegionId,
    range: std::ops::Range<usize>,
}

impl WriteSink {
    /// Runs `body` while every WRITE packet (of a WRITE or WRITE_WITH_IMM, on any queue pair of
    /// the protection domain) whose payload lands entirely inside the range is handed to
    /// `place(at, payload)` instead of being stored, `at` counted from the range's start;
    /// `place` returns whether it took the payload, and what it declines is stored as usual.
    /// So are packets placed before `body` began, those reaching outside the range, and every
    /// receive and READ response: `place` sees only what it took, and whatever it did not take
    /// is in the region. The payload is the packet's bytes where the engine received them (the
    /// packet engine's ring, say): nothing was copied yet.
    ///
    /// `place` runs inside the engine's loop, under its lock, on whichever thread runs it
    /// (`body`'s own polls, the keeper, the engine thread): it must be quick and must not call
    /// into the engine. A peer decides what it is handed: offsets, lengths, the same packet
    /// twice (a retransmission placed again).
    ///
    /// The sink is gone when this returns, `body` panicking or not. Returns whether it was
    /// installed: not when the range runs past the region, the region was deregistered, or
    /// another sink of the protection domain is running (one at a time); `body` runs either
    /// way.
    pub fn run<R>(
        &self,
        place: &mut tbrdma_engine::memory::SinkFn<'_>,
        body: impl FnOnce() -> R,
    ) -> (bool, R) {
        self.pd.device.inner.engine.with_write_sink(
            self.pd.id,
            self.region,
            self.range.clone(),
            place,
            body,
        )
    }
}
