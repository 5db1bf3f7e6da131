//! Queue pairs: posting work requests (a batch under one doorbell) and their state.

use tbrdma_engine::worker::{PostFailed, WriteZone};
use tbrdma_proto::{ConnectionState, Event, RecvWr, SendWr, Stats};

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
        let engine = &self.device.inner.engine;
        engine
            .post_send(self.qp_num, wrs)
            .map_err(|e| self.post_failed(e, "sending"))
    }

    /// Posts receive buffers, in order.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        let engine = &self.device.inner.engine;
        engine
            .post_recv(self.qp_num, wrs)
            .map_err(|e| self.post_failed(e, "posting receives"))
    }

    fn post_failed(&self, e: PostFailed, doing: &str) -> VerbsError {
        match e {
            PostFailed::Closed => self.closed(),
            PostFailed::Refused(e) => e.into(),
            PostFailed::Io(e) => VerbsError::io(doing)(e),
            other => VerbsError::io(doing)(std::io::Error::other(other.to_string())),
        }
    }

    fn closed(&self) -> VerbsError {
        VerbsError::QpFailed {
            qp_num: self.qp_num,
            reason: "closed".into(),
        }
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
        if self.device.inner.engine.set_send_headroom(self.qp_num, on) {
            Ok(())
        } else {
            Err(self.closed())
        }
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
    /// zone; the others refuse every loan (`Ok(false)`) and receive as usual, and so does it
    /// for a zone under [`crate::LANDING_MIN`] bytes, which a copy fills faster. One zone per
    /// device: a new loan (from any queue pair of the device) replaces the last.
    pub fn expect_write(
        &self,
        mr: &crate::MemoryRegion,
        offset: usize,
        len: usize,
        seen: u64,
    ) -> Result<bool> {
        let head = crate::SEND_HEADROOM;
        let bad = |detail: String| Err(VerbsError::BadLanding { detail });
        if mr.pd_id() != self.pd.id {
            return bad("the region belongs to another protection domain".into());
        }
        if offset < head || offset.checked_add(len).is_none_or(|end| end > mr.len()) {
            return bad(format!(
                "offset {offset} + {len} bytes must lie in the region ({} bytes) with {head} bytes                  in front for the header",
                mr.len()
            ));
        }
        let zone = WriteZone {
            buffer: mr.buffer_arc(),
            region: mr.region_id(),
            rkey: mr.rkey(),
            offset,
            len,
        };
        self.device
            .inner
            .engine
            .expect_write(self.qp_num, zone, seen)
            .ok_or_else(|| self.closed())
    }

    /// Whether [`Self::expect_write`] may lend a zone of `len` bytes on this device: false for
    /// every engine but sockets, and for a zone under [`crate::LANDING_MIN`] bytes, whose loans
    /// it always refuses. It locks nothing: an application that lends before every message (a
    /// memory-polling ping-pong) asks it first and skips the loans that would be refused, each
    /// of which costs a lock of the engine's state.
    pub fn lends_zones(&self, len: usize) -> bool {
        self.device.inner.engine.lends_zones(len)
    }

    /// Whether the landing zone of this queue pair's last [`Self::expect_write`] is still
    /// lent to the engine. It stops being lent when the expected write's first datagram has
    /// been placed there (the write is then complete, or its later datagrams are placed as
    /// usual, outside the zone), or when the loan ends otherwise (the queue pair's next receive
    /// completion, a datagram too long for the zone, the queue pair going, a newer loan on the
    /// device); in that case the zone's bytes are undefined until the write arrives, placed the
    /// usual way. An application that learns of a WRITE by polling memory (a flag or counter
    /// the write carries, as `ib_write_lat` does) reads the zone only once this is false:
    /// lend, then poll completions until `lending()` is false and the flag is set.
    pub fn lending(&self) -> bool {
        self.device.inner.engine.lending(self.qp_num)
    }

    /// The connection's state.
    pub fn state(&self) -> ConnectionState {
        self.device.inner.engine.connection_state(self.qp_num)
    }

    /// Connection events since the last call (established, failed and why, closed).
    pub fn take_events(&self) -> Vec<Event> {
        self.device.inner.engine.take_events(self.qp_num)
    }

    /// Whether the handshake completed at some point (the connection may have ended since).
    pub fn was_established(&self) -> bool {
        self.device.inner.engine.was_established(self.qp_num)
    }

    /// Protocol counters.
    pub fn stats(&self) -> Stats {
        self.device.inner.engine.connection_stats(self.qp_num)
    }

    /// Datagrams sent on each rail, and how many times a rail was declared down.
    pub fn rail_stats(&self) -> (Vec<u64>, u64) {
        self.device.inner.engine.rail_stats(self.qp_num)
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let _ = self.device.inner.engine.close(self.qp_num);
        let _ = self.device.inner.engine.progress();
    }
}
