//! Queue pairs: posting work requests (a batch under one doorbell) and their state.

use tbrdma_engine::memory::Arena;
use tbrdma_engine::worker::{Slot, use_region};
use tbrdma_proto::{
    Access, ConnectionState, Event, Memory, PostError, Queue, RecvWr, RegionId, SendWr, Sge, Stats,
};

use crate::device::Device;
use crate::error::{Result, VerbsError};
use crate::pd::ProtectionDomain;

/// A connected reliable queue pair (`ibv_qp` of type RC). Created by the connection manager
/// ([`crate::connect`], [`crate::Listener::accept`]). Dropping it closes the connection.
#[derive(Debug)]
pub struct QueuePair {
    pub(crate) device: Device,
    pub(crate) pd: ProtectionDomain,
    pub(crate) qp_num: u32,
}

fn region_of<M: Memory>(mem: &M, lkey: u32, addr: u64, len: u64) -> Option<RegionId> {
    (len > 0)
        .then(|| {
            mem.table()
                .check_local(lkey, addr, len, Access::empty())
                .ok()
                .map(|p| p.region)
        })
        .flatten()
}

impl QueuePair {
    /// Local queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Posts send-queue work requests, all under one doorbell: one lock, one transmission
    /// burst. Each accepted request completes exactly once on the send completion queue.
    /// Stops at the first refused request (queue full, malformed) and returns its error; the
    /// ones before it were posted.
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        self.post_each(wrs, Queue::Send, "sending", |slot, arena, wr| {
            slot.conn.post_send(*wr, arena)?;
            Ok(wr.local)
        })
    }

    /// Posts receive buffers, in order.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        self.post_each(wrs, Queue::Recv, "posting receives", |slot, _arena, wr| {
            slot.conn.post_recv(*wr)?;
            Ok(wr.local)
        })
    }

    /// Posts every request with `post` under one engine lock, recording which region each
    /// names (so deregistration can wait for it), then rings the doorbell.
    fn post_each<W>(
        &self,
        wrs: &[W],
        queue: Queue,
        doing: &str,
        post: impl Fn(&mut Slot, &Arena, &W) -> std::result::Result<Sge, PostError>,
    ) -> Result<()> {
        let qp_num = self.qp_num;
        let pd = self.pd.index;
        let engine = &self.device.inner.engine;
        // A posted receive puts nothing on the wire: no transmit pass for it (caller mode).
        let quiet = queue == Queue::Recv;
        engine
            .post_maybe_quiet(quiet, |state, _now| {
                let Some(slot) = state.conns.get_mut(&qp_num) else {
                    return Err(VerbsError::QpFailed {
                        qp_num,
                        reason: "closed".into(),
                    });
                };
                let arena = &state.arenas[pd];
                let mut result = Ok(());
                for wr in wrs {
                    match post(slot, arena, wr) {
                        Ok(local) => {
                            let region = region_of(arena, local.lkey, local.addr, local.len);
                            match queue {
                                Queue::Send => slot.sq_regions.push_back(region),
                                Queue::Recv => slot.rq_regions.push_back(region),
                            }
                            use_region(&mut state.region_users, pd, region);
                        }
                        Err(e) => {
                            result = Err(e.into());
                            break;
                        }
                    }
                }
                result
            })
            .map_err(VerbsError::io(doing))?
    }

    /// The connection's state.
    pub fn state(&self) -> ConnectionState {
        let state = self.device.inner.engine.lock();
        state
            .conns
            .get(&self.qp_num)
            .map_or(ConnectionState::Closed, |s| s.conn.state())
    }

    /// Connection events since the last call (established, failed and why, closed).
    pub fn take_events(&self) -> Vec<Event> {
        let mut state = self.device.inner.engine.lock();
        state
            .conns
            .get_mut(&self.qp_num)
            .map(|s| std::mem::take(&mut s.events))
            .unwrap_or_default()
    }

    /// Whether the handshake completed at some point (the connection may have ended since).
    pub fn was_established(&self) -> bool {
        let state = self.device.inner.engine.lock();
        state
            .conns
            .get(&self.qp_num)
            .is_some_and(|s| s.events.contains(&Event::Established))
    }

    /// Protocol counters.
    pub fn stats(&self) -> Stats {
        let state = self.device.inner.engine.lock();
        state
            .conns
            .get(&self.qp_num)
            .map(|s| *s.conn.stats())
            .unwrap_or_default()
    }

    /// Datagrams sent on each rail, and how many times a rail was declared down.
    pub fn rail_stats(&self) -> (Vec<u64>, u64) {
        let state = self.device.inner.engine.lock();
        state.conns.get(&self.qp_num).map_or((Vec::new(), 0), |s| {
            let (sent, failovers) = s.conn.path_stats();
            (sent.to_vec(), failovers)
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let qp_num = self.qp_num;
        let _ = self.device.inner.engine.post(|state, now| {
            if let Some(slot) = state.conns.get_mut(&qp_num) {
                slot.conn.close(now);
                // The engine removes the slot once the CLOSE has gone out.
                slot.detached = true;
            }
        });
        let _ = self.device.inner.engine.progress();
    }
}
