//! Registered memory for the simulator: each region is a vector at a made-up address.

use crate::memory::{Access, Memory, MemoryTable, Region, RegionId};

/// Regions backed by vectors, with a real [`MemoryTable`] deciding access.
#[derive(Debug)]
pub struct SimMemory {
    table: MemoryTable,
    buffers: Vec<Option<Vec<u8>>>,
    next_addr: u64,
    /// Bytes the core placed through [`Memory::place_write`], by the length of the message
    /// they belong to (for tests of which placements are WRITEs).
    pub placed_as_writes: std::collections::BTreeMap<u64, usize>,
}

impl SimMemory {
    /// Empty memory whose keys come from `seed`.
    pub fn new(seed: u64) -> SimMemory {
        let mut key_seed = [0u8; 32];
        key_seed[..8].copy_from_slice(&seed.to_le_bytes());
        SimMemory {
            table: MemoryTable::new(key_seed),
            buffers: Vec::new(),
            next_addr: 0x10_0000,
            placed_as_writes: std::collections::BTreeMap::new(),
        }
    }

    /// Allocates and registers `len` zeroed bytes.
    ///
    /// # Panics
    /// If `access` is not a combination verbs allows (a test bug).
    pub fn alloc(&mut self, len: usize, access: Access) -> Region {
        let addr = self.next_addr;
        // Leave a gap between regions so an off-by-one never lands in a neighbour.
        self.next_addr += (len as u64).div_ceil(4096) * 4096 + 4096;
        let region = self
            .table
            .register(addr, len as u64, access)
            .expect("valid access flags");
        let slot = region.id.0 as usize;
        if self.buffers.len() <= slot {
            self.buffers.resize_with(slot + 1, || None);
        }
        self.buffers[slot] = Some(vec![0; len]);
        region
    }

    /// Deregisters a region: its keys stop working; its bytes stay readable for checks.
    pub fn deregister(&mut self, region: &Region) {
        let _ = self.table.deregister(region.id);
    }

    /// Deregisters a region and lets its bytes go, as the engine does once no request of the
    /// application names it: reads of it copy nothing from then on.
    pub fn free(&mut self, region: &Region) {
        self.deregister(region);
        if let Some(slot) = self.buffers.get_mut(region.id.0 as usize) {
            *slot = None;
        }
    }

    /// Copies `data` into `region` at `offset` (as the application would).
    pub fn fill(&mut self, region: &Region, offset: usize, data: &[u8]) {
        let buf = self.buffers[region.id.0 as usize]
            .as_mut()
            .expect("allocated region");
        buf[offset..offset + data.len()].copy_from_slice(data);
    }

    /// The bytes of `region` from `offset`, `len` long.
    pub fn bytes(&self, region: &Region, offset: usize, len: usize) -> &[u8] {
        let buf = self.buffers[region.id.0 as usize]
            .as_ref()
            .expect("allocated region");
        &buf[offset..offset + len]
    }

    /// Mutable access to the protection table.
    pub fn table_mut(&mut self) -> &mut MemoryTable {
        &mut self.table
    }

    fn buffer(&self, region: RegionId) -> &[u8] {
        self.buffers
            .get(region.0 as usize)
            .and_then(Option::as_deref)
            .unwrap_or(&[])
    }
}

impl Memory for SimMemory {
    fn table(&self) -> &MemoryTable {
        &self.table
    }

    fn read(&self, region: RegionId, offset: u64, out: &mut [u8]) {
        let buf = self.buffer(region);
        if buf.is_empty() {
            // Freed: like the engine's memory, copy nothing.
            return;
        }
        let start = offset as usize;
        out.copy_from_slice(&buf[start..start + out.len()]);
    }

    fn has_bytes(&self, region: RegionId) -> bool {
        self.buffers
            .get(region.0 as usize)
            .is_some_and(Option::is_some)
    }

    fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) {
        let buf = self.buffers[region.0 as usize]
            .as_mut()
            .expect("checked region");
        let start = offset as usize;
        buf[start..start + data.len()].copy_from_slice(data);
    }

    fn place_write(&mut self, region: RegionId, offset: u64, data: &[u8], message_len: u64) {
        *self.placed_as_writes.entry(message_len).or_default() += data.len();
        self.write(region, offset, data);
    }
}
