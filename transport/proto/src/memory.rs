//! Memory protection as pure logic: the table of registered regions with their keys, bounds and
//! access flags, and the checks every local or remote access passes before a byte moves.
//!
//! This module decides *whether* an access is allowed; moving the bytes is the job of whoever
//! implements [`Memory`] (pinned mappings in the engine, vectors in the simulator).

use rand_chacha::ChaCha12Rng;
use rand_core::{Rng, SeedableRng};
// FxHash: every datagram carrying data looks up a key or two, and SipHash (std's default,
// built against hash flooding) costs several times more. Only this table inserts keys, drawn
// at random; a key a peer names is only looked up.
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use thiserror::Error;

bitflags::bitflags! {
    /// What may be done to a region (`enum ibv_access_flags`). Local read is always allowed.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local side may write into the region (receives, READ results, atomic results).
        const LOCAL_WRITE = 1;
        /// The peer may WRITE into the region.
        const REMOTE_WRITE = 1 << 1;
        /// The peer may READ from the region.
        const REMOTE_READ = 1 << 2;
        /// The peer may run FETCH_ADD and CMP_SWAP on the region.
        const REMOTE_ATOMIC = 1 << 3;
    }
}

/// Index of a region in its [`MemoryTable`]; stable for the region's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionId(pub u32);

/// A registered memory region (`struct ibv_mr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Handle for [`Memory`] calls.
    pub id: RegionId,
    /// Virtual address of the first byte, as the application and the peer name it.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Key for local use in work requests.
    pub lkey: u32,
    /// Key the peer names in one-sided operations.
    pub rkey: u32,
    /// Permissions.
    pub access: Access,
}

/// Why an access was refused. Every variant means: no byte was touched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum AccessError {
    /// The key names no live region (never issued, or revoked by deregistration).
    #[error(
        "key {key:#010x} names no registered region (wrong key, or the region was deregistered)"
    )]
    UnknownKey {
        /// The key presented.
        key: u32,
    },
    /// The range does not lie inside the region.
    #[error("range {addr:#x}+{len} is outside region {region_addr:#x}+{region_len}")]
    OutOfBounds {
        /// Start of the requested range.
        addr: u64,
        /// Length of the requested range.
        len: u64,
        /// Start of the region.
        region_addr: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The region was not registered with the permission this access needs.
    #[error("region lacks permission {needed:?} (registered with {granted:?})")]
    MissingPermission {
        /// The permission needed.
        needed: Access,
        /// The permissions the region has.
        granted: Access,
    },
    /// An atomic target that is not 8-byte aligned.
    #[error("atomic target {addr:#x} is not 8-byte aligned")]
    Misaligned {
        /// The address presented.
        addr: u64,
    },
}

/// Why a registration was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum RegisterError {
    /// Remote write or atomic access without local write, which verbs forbids too.
    #[error("REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE as well (as in ibv_reg_mr)")]
    RemoteWriteWithoutLocalWrite,
    /// The address range wraps around the end of the address space.
    #[error("region {addr:#x}+{len} wraps around the address space")]
    Wraps {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The region id returned is no longer registered.
    #[error("region {0:?} is not registered")]
    NotRegistered(RegionId),
}

/// Where a checked access lands: a region and the byte offset inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The region.
    pub region: RegionId,
    /// Offset of the first byte from the start of the region.
    pub offset: u64,
}

/// The regions of one protection domain and the keys that name them.
///
/// Keys are drawn from a ChaCha stream seeded by the caller (from the OS in production), so
/// they cannot be guessed from earlier keys, and they are never reissued, so a key that was
/// revoked keeps failing.
#[derive(Debug)]
pub struct MemoryTable {
    regions: Vec<Option<Region>>,
    by_lkey: HashMap<u32, RegionId>,
    by_rkey: HashMap<u32, RegionId>,
    issued: HashSet<u32>,
    rng: ChaCha12Rng,
}

impl MemoryTable {
    /// An empty table whose keys come from `seed`.
    pub fn new(seed: [u8; 32]) -> MemoryTable {
        MemoryTable {
            regions: Vec::new(),
            by_lkey: HashMap::default(),
            by_rkey: HashMap::default(),
            issued: HashSet::default(),
            rng: ChaCha12Rng::from_seed(seed),
        }
    }

    fn fresh_key(&mut self) -> u32 {
        loop {
            let key = self.rng.next_u32();
            if key != 0 && self.issued.insert(key) {
                return key;
            }
        }
    }

    /// Registers `len` bytes at `addr` with `access`.
    pub fn register(
        &mut self,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<Region, RegisterError> {
        if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
            && !access.contains(Access::LOCAL_WRITE)
        {
            return Err(RegisterError::RemoteWriteWithoutLocalWrite);
        }
        if addr.checked_add(len).is_none() {
            return Err(RegisterError::Wraps { addr, len });
        }
        // Slots are never reused: a request that still names a revoked region by id (a
        // placement computed before deregistration) then finds nothing instead of a stranger.
        let slot = self.regions.len();
        let id = RegionId(slot as u32);
        let region = Region {
            id,
            addr,
            len,
            lkey: self.fresh_key(),
            rkey: self.fresh_key(),
            access,
        };
        self.regions.push(Some(region));
        self.by_lkey.insert(region.lkey, id);
        self.by_rkey.insert(region.rkey, id);
        Ok(region)
    }

    /// Revokes a region: its keys stop working at once and are never issued again.
    pub fn deregister(&mut self, id: RegionId) -> Result<Region, RegisterError> {
        let region = self
            .regions
            .get_mut(id.0 as usize)
            .and_then(Option::take)
            .ok_or(RegisterError::NotRegistered(id))?;
        self.by_lkey.remove(&region.lkey);
        self.by_rkey.remove(&region.rkey);
        Ok(region)
    }

    /// The live region with this id.
    pub fn region(&self, id: RegionId) -> Option<&Region> {
        self.regions.get(id.0 as usize).and_then(Option::as_ref)
    }

    /// Every live region.
    pub fn regions(&self) -> impl Iterator<Item = &Region> {
        self.regions.iter().flatten()
    }

    /// Checks a peer's access to `len` bytes at `addr` under `rkey` that needs `needed`.
    pub fn check_remote(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        needed: Access,
    ) -> Result<Placement, AccessError> {
        let id = *self
            .by_rkey
            .get(&rkey)
            .ok_or(AccessError::UnknownKey { key: rkey })?;
        self.check(id, addr, len, needed)
    }

    /// Checks the local side's access to `len` bytes at `addr` under `lkey` that needs `needed`
    /// (empty for reading, [`Access::LOCAL_WRITE`] for writing).
    pub fn check_local(
        &self,
        lkey: u32,
        addr: u64,
        len: u64,
        needed: Access,
    ) -> Result<Placement, AccessError> {
        let id = *self
            .by_lkey
            .get(&lkey)
            .ok_or(AccessError::UnknownKey { key: lkey })?;
        self.check(id, addr, len, needed)
    }

    fn check(
        &self,
        id: RegionId,
        addr: u64,
        len: u64,
        needed: Access,
    ) -> Result<Placement, AccessError> {
        let region = self.region(id).ok_or(AccessError::UnknownKey { key: 0 })?;
        if !region.access.contains(needed) {
            return Err(AccessError::MissingPermission {
                needed,
                granted: region.access,
            });
        }
        let in_bounds = addr >= region.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= region.addr + region.len);
        if !in_bounds {
            return Err(AccessError::OutOfBounds {
                addr,
                len,
                region_addr: region.addr,
                region_len: region.len,
            });
        }
        Ok(Placement {
            region: id,
            offset: addr - region.addr,
        })
    }
}

/// The bytes behind a [`MemoryTable`]. The core calls `read` and `write` only with ranges the
/// table has already checked, so implementations may treat an out-of-range call as a bug.
pub trait Memory {
    /// The protection table for these bytes.
    fn table(&self) -> &MemoryTable;
    /// Copies `out.len()` bytes from `region` at `offset` into `out`.
    fn read(&self, region: RegionId, offset: u64, out: &mut [u8]);
    /// Copies `data` into `region` at `offset`.
    fn write(&mut self, region: RegionId, offset: u64, data: &[u8]);
    /// Copies `data`, one packet's payload of an incoming WRITE (or WRITE_WITH_IMM) of
    /// `message_len` bytes, into `region` at `offset`. A WRITE is the peer putting bytes into
    /// memory it was granted, on its own schedule: unlike a receive or a READ response, which
    /// land in a buffer this side named in a request and reads on completion, nobody on this
    /// side is about to read them. The core places WRITEs through this so that the memory can
    /// store them accordingly (the engine stores large ones past the caches). The default is
    /// [`Self::write`].
    fn place_write(&mut self, region: RegionId, offset: u64, data: &[u8], message_len: u64) {
        let _ = message_len;
        self.write(region, offset, data);
    }
    /// Whether the bytes of `region` are still there. They may outlive its keys (requests
    /// that name a deregistered region keep it), but once they are gone, [`Self::read`]
    /// copies nothing and [`Self::with_bytes`] lends nothing.
    fn has_bytes(&self, region: RegionId) -> bool;
    /// Lends the `len` bytes of `region` at `offset` to `f`, in place where the implementation
    /// can (the engine's pinned mappings), so that the core can checksum a payload that is sent
    /// from where it lies without copying it. `f` may be called several times with consecutive
    /// pieces that together make up the range; for a region that is gone it may not be called at
    /// all.
    ///
    /// The default copies through [`Self::read`] into a temporary (fine for test memories).
    fn with_bytes(&self, region: RegionId, offset: u64, len: usize, f: &mut dyn FnMut(&[u8])) {
        let mut bytes = vec![0; len];
        self.read(region, offset, &mut bytes);
        f(&bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> MemoryTable {
        MemoryTable::new([7; 32])
    }

    #[test]
    fn keys_are_distinct_nonzero_and_not_sequential() {
        let mut t = table();
        let a = t.register(0x1000, 64, Access::LOCAL_WRITE).unwrap();
        let b = t.register(0x2000, 64, Access::LOCAL_WRITE).unwrap();
        let keys = [a.lkey, a.rkey, b.lkey, b.rkey];
        for (i, k) in keys.iter().enumerate() {
            assert_ne!(*k, 0);
            for other in &keys[i + 1..] {
                assert_ne!(k, other);
                assert!(k.abs_diff(*other) > 1, "keys look sequential: {keys:x?}");
            }
        }
    }

    #[test]
    fn remote_checks_cover_key_bounds_and_flags() {
        let mut t = table();
        let r = t
            .register(0x1000, 100, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        assert_eq!(
            t.check_remote(r.rkey, 0x1000 + 10, 90, Access::REMOTE_WRITE),
            Ok(Placement {
                region: r.id,
                offset: 10
            })
        );
        assert!(matches!(
            t.check_remote(r.rkey, 0x1000 + 10, 91, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.check_remote(r.rkey, 0xfff, 1, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.check_remote(r.rkey, u64::MAX, 2, Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.check_remote(r.rkey, 0x1000, 8, Access::REMOTE_READ),
            Err(AccessError::MissingPermission { .. })
        ));
        assert!(matches!(
            t.check_remote(r.lkey, 0x1000, 8, Access::REMOTE_WRITE),
            Err(AccessError::UnknownKey { .. })
        ));
    }

    #[test]
    fn revoked_keys_stay_dead() {
        let mut t = table();
        let r = t
            .register(0, 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        t.deregister(r.id).unwrap();
        assert!(t.check_remote(r.rkey, 0, 8, Access::REMOTE_WRITE).is_err());
        for _ in 0..1000 {
            let n = t
                .register(0, 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap();
            assert_ne!(n.rkey, r.rkey);
            assert_ne!(n.lkey, r.lkey);
            t.deregister(n.id).unwrap();
        }
    }

    #[test]
    fn remote_write_needs_local_write() {
        let mut t = table();
        assert_eq!(
            t.register(0, 8, Access::REMOTE_WRITE),
            Err(RegisterError::RemoteWriteWithoutLocalWrite)
        );
    }
}
