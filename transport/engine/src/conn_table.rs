//! The engine's connections by local queue pair number ([`ConnTable`]).
//!
//! An engine has one or a few connections (a ping-pong, a ring or mesh of 2-4 hosts), some
//! have dozens (NCCL's comms, perftest's `-q`). Every transmit pass visits all of them and every
//! datagram and post looks one up, so the table keeps them in one vector, in the order they
//! were added: a pass walks it with no hashing, and a lookup among a few compares their numbers
//! one after another. Past [`LINEAR_MAX`] connections a lookup goes through a hash index
//! instead, so a peer's datagrams, which name any number they like, never cost more than one
//! hash probe. Adding and removing connections (rare) keep the index.

// FxHash: small integer keys this process chose; a peer-supplied number is only looked up.
use rustc_hash::FxHashMap;

/// Connections up to which a lookup scans the numbers instead of hashing.
const LINEAR_MAX: usize = 8;

/// Values of type `S` keyed by queue pair number, kept in insertion order.
#[derive(Debug)]
pub(crate) struct ConnTable<S> {
    /// `qpns[i]` is the number of `slots[i]`: the numbers alone, dense, for the scan.
    qpns: Vec<u32>,
    slots: Vec<S>,
    /// Position of each number in `qpns`, kept whatever the length; used past [`LINEAR_MAX`].
    index: FxHashMap<u32, usize>,
}

impl<S> Default for ConnTable<S> {
    fn default() -> Self {
        ConnTable {
            qpns: Vec::new(),
            slots: Vec::new(),
            index: FxHashMap::default(),
        }
    }
}

impl<S> ConnTable<S> {
    fn position(&self, qpn: u32) -> Option<usize> {
        if self.qpns.len() <= LINEAR_MAX {
            self.qpns.iter().position(|&q| q == qpn)
        } else {
            self.index.get(&qpn).copied()
        }
    }

    pub(crate) fn get(&self, qpn: &u32) -> Option<&S> {
        self.position(*qpn).map(|i| &self.slots[i])
    }

    pub(crate) fn get_mut(&mut self, qpn: &u32) -> Option<&mut S> {
        self.position(*qpn).map(|i| &mut self.slots[i])
    }

    pub(crate) fn contains_key(&self, qpn: &u32) -> bool {
        self.position(*qpn).is_some()
    }

    /// Adds `slot` as `qpn`, replacing (and returning) any slot already there.
    pub(crate) fn insert(&mut self, qpn: u32, slot: S) -> Option<S> {
        if let Some(i) = self.position(qpn) {
            return Some(std::mem::replace(&mut self.slots[i], slot));
        }
        self.index.insert(qpn, self.qpns.len());
        self.qpns.push(qpn);
        self.slots.push(slot);
        None
    }

    pub(crate) fn values(&self) -> std::slice::Iter<'_, S> {
        self.slots.iter()
    }

    pub(crate) fn values_mut(&mut self) -> std::slice::IterMut<'_, S> {
        self.slots.iter_mut()
    }

    /// Each connection with its number, in the order they were added.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &S)> {
        self.qpns.iter().copied().zip(&self.slots)
    }

    /// Keeps the slots for which `keep` returns true, in their order.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u32, &mut S) -> bool) {
        let before = self.slots.len();
        let mut i = 0;
        while i < self.slots.len() {
            if keep(self.qpns[i], &mut self.slots[i]) {
                i += 1;
            } else {
                self.qpns.remove(i);
                self.slots.remove(i);
            }
        }
        if self.slots.len() != before {
            self.index.clear();
            self.index
                .extend(self.qpns.iter().enumerate().map(|(i, &q)| (q, i)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways of looking up (the scan, and the index past `LINEAR_MAX`) agree with a plain
    /// map through inserts, replacements and removals, and iteration keeps insertion order.
    #[test]
    fn lookups_agree_with_a_map_below_and_above_the_scan_limit() {
        for n in [1u32, 3, LINEAR_MAX as u32, LINEAR_MAX as u32 + 1, 40] {
            let mut table = ConnTable::default();
            let mut model = std::collections::BTreeMap::new();
            for q in 0..n {
                let qpn = 1 + q * 7919;
                assert!(table.insert(qpn, q).is_none());
                model.insert(qpn, q);
            }
            let first = *model.keys().next().unwrap();
            assert_eq!(table.insert(first, 1000), Some(model[&first]));
            model.insert(first, 1000);
            table.retain(|qpn, v| {
                *v += 1;
                qpn % 3 != 0
            });
            model.retain(|qpn, _| qpn % 3 != 0);
            assert_eq!(table.values().count(), model.len());
            for (qpn, v) in &model {
                assert_eq!(table.get(qpn), Some(&(v + 1)), "n {n}, qpn {qpn}");
                assert!(table.contains_key(qpn));
            }
            for absent in [0u32, 2, u32::MAX - 1] {
                assert!(table.get(&absent).is_none() && table.get_mut(&absent).is_none());
            }
            let order: Vec<u32> = table.iter().map(|(q, _)| q).collect();
            let inserted: Vec<u32> = (0..n)
                .map(|q| 1 + q * 7919)
                .filter(|q| model.contains_key(q))
                .collect();
            assert_eq!(order, inserted);
            *table.values_mut().next().unwrap() = 7;
            assert_eq!(table.values().next(), Some(&7));
        }
    }
}
