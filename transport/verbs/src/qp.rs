//! Queue pairs: posting work requests (a batch under one doorbell) and their state.

use tbrdma_engine::io::{Landing, RegionPart};
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

    /// Promises (with `true`) that the [`crate::SEND_HEADROOM`] bytes in front of the local buffer
    /// of every send this queue pair posts from now on lie in the same region and are not
    /// used by the application, nor by another outstanding send's payload, until that send
    /// completes: the engine then writes each datagram's header there and sends header and
    /// payload as one buffer, which the kernel takes faster than two (the collectives' slots
    /// are laid out for it). A broken promise corrupts what the application keeps there, or
    /// another send's data (which then fails its checksum at the peer and is retried until the
    /// request fails); it is never unsound. Off by default.
    pub fn set_send_headroom(&self, on: bool) -> Result<()> {
        let qp_num = self.qp_num;
        let mut state = self.device.inner.engine.lock();
        let slot = state.conns.get_mut(&qp_num).ok_or(VerbsError::QpFailed {
            qp_num,
            reason: "closed".into(),
        })?;
        slot.send_headroom = on;
        Ok(())
    }

    /// Lends the engine the bytes of `mr` from `offset - SEND_HEADROOM` to `offset + len`
    /// for receiving the write it expects next: a WRITE or WRITE_WITH_IMM on this queue pair
    /// whose payload starts at `mr.remote(offset)`. When that write arrives the kernel puts its
    /// payload straight where it belongs and the engine copies nothing (any other datagram
    /// received there is copied out and handled as usual). The loan lasts until a write is
    /// placed into those bytes or this queue pair completes its next receive, whichever comes
    /// first; the application must not read or write the bytes meanwhile (the header's room in
    /// front is overwritten even when no write comes).
    ///
    /// `seen` is how many receive completions of this queue pair the application has polled:
    /// when the engine has delivered more (a write the application has not seen may lie in the
    /// zone), the loan is refused and `Ok(false)` returned; so it is while a write into those
    /// bytes (on any queue pair) is partly received: its first datagrams may lie there. Only the sockets engine uses the
    /// zone; the others accept it and receive as usual. One zone per device: a new loan (from
    /// any queue pair of the device) replaces the last.
    pub fn expect_write(
        &self,
        mr: &crate::MemoryRegion,
        offset: usize,
        len: usize,
        seen: u64,
    ) -> Result<bool> {
        let head = crate::SEND_HEADROOM;
        let bad = |detail: String| Err(VerbsError::BadLanding { detail });
        if mr.pd_index() != self.pd.index {
            return bad("the region belongs to another protection domain".into());
        }
        if offset < head || offset.checked_add(len).is_none_or(|end| end > mr.len()) {
            return bad(format!(
                "offset {offset} + {len} bytes must lie in the region ({} bytes) with {head} bytes                  in front for the header",
                mr.len()
            ));
        }
        let qp_num = self.qp_num;
        let mut state = self.device.inner.engine.lock();
        let Some(slot) = state.conns.get(&qp_num) else {
            return Err(VerbsError::QpFailed {
                qp_num,
                reason: "closed".into(),
            });
        };
        // Room for one datagram's payload: a write of several lands its first one here.
        let room = len.min(slot.conn.max_payload() as usize);
        let landing = Landing {
            qpn: qp_num,
            zone: RegionPart::new(mr.buffer_arc(), offset - head, head + room),
            region: mr.region_id(),
            rkey: mr.rkey(),
            addr: mr.remote(offset).addr,
        };
        Ok(state.set_landing(self.pd.index, Some(landing), seen))
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
            state.forget_landing_of(qp_num);
            if let Some(slot) = state.conns.get_mut(&qp_num) {
                slot.conn.close(now);
                // The engine removes the slot once the CLOSE has gone out.
                slot.detached = true;
            }
        });
        let _ = self.device.inner.engine.progress();
    }
}
