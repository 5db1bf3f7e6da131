//! Completion storage shared between the engine (which fills it) and the application (which
//! drains it). Bounded like a verbs CQ: overflowing it is an error the application sees.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tbrdma_proto::WorkCompletion;

/// A completion and the queue pair it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Completion {
    /// The completion.
    pub wc: WorkCompletion,
    /// Local queue pair number.
    pub qp_num: u32,
}

/// A bounded completion queue.
#[derive(Debug)]
pub struct CqShared {
    queue: Mutex<VecDeque<Completion>>,
    /// The queue's length, written under its lock, read without it: a poll of an empty queue
    /// (most polls of a busy-polling application) takes no lock.
    len: AtomicUsize,
    capacity: usize,
    dropped: AtomicU64,
}

impl CqShared {
    /// A queue holding up to `capacity` completions.
    pub fn new(capacity: usize) -> CqShared {
        CqShared {
            queue: Mutex::new(VecDeque::with_capacity(capacity.min(1 << 16))),
            len: AtomicUsize::new(0),
            capacity: capacity.max(1),
            dropped: AtomicU64::new(0),
        }
    }

    /// Capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Adds a completion; when full, counts it as lost instead (the application sees the
    /// overflow on its next poll).
    pub fn push(&self, completion: Completion) {
        let mut q = self.queue.lock().expect("cq lock");
        if q.len() >= self.capacity {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        } else {
            q.push_back(completion);
            self.len.store(q.len(), Ordering::Release);
        }
    }

    /// Moves up to `out.len()` completions into `out`; returns how many. `Err(n)` when `n`
    /// completions were lost to overflow since the last poll (the ones still held are returned
    /// by later polls).
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize, u64> {
        // Loads first: the swaps are read-modify-writes, dearer than a load, and rarely due.
        if self.dropped.load(Ordering::Relaxed) > 0 {
            let dropped = self.dropped.swap(0, Ordering::Relaxed);
            if dropped > 0 {
                return Err(dropped);
            }
        }
        if self.is_empty() {
            return Ok(0);
        }
        let mut q = self.queue.lock().expect("cq lock");
        let n = out.len().min(q.len());
        for (slot, c) in out.iter_mut().zip(q.drain(..n)) {
            *slot = c;
        }
        self.len.store(q.len(), Ordering::Release);
        Ok(n)
    }

    /// Completions waiting.
    pub fn len(&self) -> usize {
        // (Acquire: a completion seen here is seen whole by the lock's holder after it.)
        self.len.load(Ordering::Acquire)
    }

    /// Whether none wait.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
