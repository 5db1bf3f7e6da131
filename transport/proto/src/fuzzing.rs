//! Entry points for the fuzz targets (`transport/proto/fuzz`) and for the test that replays
//! their committed corpus, so both run exactly the same code.
//!
//! Both entry points panic when they find a bug, and only then: a panic here is a finding.
//!
//! - [`decode_packet`]: whatever decodes (as given, or with its CRC re-sealed) must re-encode
//!   to the same packet.
//! - [`feed_endpoint`]: an established simulated pair with work in progress, and a script of
//!   actions (forged datagrams, real ones delivered, dropped, reordered or corrupted, time
//!   passing, more work posted). The script format is described at [`feed_endpoint`].
//!
//! Nothing here ever runs in production; the panics are the point.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::codec::{self, Put, SliceWriter};
use crate::config::Config;
use crate::connection::ConnectionState;
use crate::memory::{Access, Region};
use crate::sim::{Endpoint, Pair, PairConfig};
use crate::time::Time;
use crate::wire::{self, CRC_RANGE, MAX_HEADER_LEN, MAX_SACK_BLOCKS, Opcode};
use crate::work::{Queue, RecvWr, RemoteAddr, SendOp, SendWr, Sge, WorkCompletion};

/// Decodes `data`; when it decodes, encodes the packet again and checks that the result
/// decodes to the same packet (the same fields: reserved bytes are ignored), with the same
/// length. Then does the same with `data` re-sealed (its CRC field rewritten), so that mutated
/// inputs get past the CRC check to the field checks behind it.
///
/// # Panics
/// On a round-trip mismatch (a wire-format bug).
pub fn decode_packet(data: &[u8]) {
    round_trip(data);
    if data.len() >= CRC_RANGE.end {
        let mut sealed = data.to_vec();
        wire::seal(&mut sealed);
        round_trip(&sealed);
    }
}

fn round_trip(data: &[u8]) {
    let Ok(packet) = wire::decode(data) else {
        return;
    };
    // For ACK the selective blocks are written with the header and the payload is empty.
    let mut buf = vec![0; MAX_HEADER_LEN + MAX_SACK_BLOCKS * 8 + packet.payload.len()];
    let header_len =
        wire::write_header(&mut buf, &packet.header, &packet.ext, packet.payload.len());
    buf.truncate(header_len + packet.payload.len());
    buf[header_len..].copy_from_slice(packet.payload);
    wire::seal(&mut buf);
    assert_eq!(
        buf.len(),
        data.len(),
        "re-encoding {packet:?} changed the datagram length"
    );
    // Compared field by field, not byte by byte: reserved bytes are ignored on receipt and
    // written as zero (docs/wire-format.md), so a peer's non-zero ones do not come back.
    match wire::decode(&buf) {
        Ok(again) => assert_eq!(
            (again.header, again.ext, again.payload),
            (packet.header, packet.ext, packet.payload),
            "re-encoded packet decodes differently"
        ),
        Err(e) => panic!("re-encoded {packet:?} does not decode: {e}"),
    }
}

/// Runs the action script `data` against an established pair (see the module docs), checking
/// after every action that no region the peer may not write and the application does not
/// write into has changed, and that no request completes twice. At the end the pair is
/// driven until it settles, and every send request must then have completed exactly once.
///
/// Script: a sequence of actions, each an opcode byte `op` and its arguments. `op & 7` is the
/// action, bit 3 the endpoint it targets (0: `b`, the passive side; 1: `a`), `op >> 4` flags:
///
/// | `op & 7` | arguments | action |
/// |---|---|---|
/// | 0, 1 | `len: u16 LE`, `len` bytes | deliver a forged datagram, patched as flags say ([`PATCH_ADDRESS`], [`PATCH_CRC`], [`PATCH_PSNS`], [`PATCH_REMOTE`]) |
/// | 2 | | deliver the next real datagram from the peer |
/// | 3 | `at: u8`, `xor: u8` | deliver the next real datagram with byte `at` xored (flag [`PATCH_CRC`]: re-sealed) |
/// | 4 | | flag 1: duplicate the next real datagram, 2: move it to the back, else drop it |
/// | 5 | `t: u8` | time passes by `t² × 50 µs`, then both timeouts are handled |
/// | 6 | `kind: u8`, `len: u8` | post a send-queue request (kind: operation, target region, alignment) |
/// | 7 | flag 1: `len: u8` | flag 1: post a receive; flag 2: close; else deliver every queued datagram |
pub fn feed_endpoint(data: &[u8]) {
    let mut harness = Harness::new(false);
    harness.run(data);
}

/// Runs `script` like [`feed_endpoint`] and returns an equivalent script in which every real
/// datagram delivered to an endpoint is replaced by the same datagram forged with every patch
/// flag (so the fuzzer can mutate real traffic). Used to generate the seed corpus.
pub fn record_endpoint_script(script: &[u8]) -> Vec<u8> {
    let mut harness = Harness::new(true);
    harness.run(script);
    harness.recording.unwrap_or_default()
}

/// Runs `script` like [`feed_endpoint`] but without the final settling, and describes where
/// it left the pair: both connections' states and counters, and the completions seen per side.
/// Lets tests check that a recorded script replays the same traffic as the original.
pub fn describe_endpoint_script(script: &[u8]) -> String {
    let mut harness = Harness::new(false);
    let mut input = Script(script);
    while let Some(op) = input.u8() {
        harness.action(op, &mut input);
        harness.pump();
        harness.check();
    }
    let completed = |side: usize| {
        harness.ledgers[side]
            .posted
            .values()
            .filter(|&&count| count > 0)
            .count()
    };
    format!(
        "b: {:?} {:?}, {} completed\na: {:?} {:?}, {} completed",
        harness.pair.b.conn.state(),
        harness.pair.b.conn.stats(),
        completed(0),
        harness.pair.a.conn.state(),
        harness.pair.a.conn.stats(),
        completed(1),
    )
}

/// Forged-datagram flag: write the target's session token and queue pair number.
pub const PATCH_ADDRESS: u8 = 1;
/// Forged-datagram flag: compute and write the CRC (after every other patch).
pub const PATCH_CRC: u8 = 2;
/// Forged-datagram flag: PSN fields are offsets from the stream they belong to.
pub const PATCH_PSNS: u8 = 4;
/// Forged-datagram flag: a remote key field is an index into the target's keys, and the
/// address an offset from that region's start.
pub const PATCH_REMOTE: u8 = 8;
/// Every patch flag.
pub const PATCH_ALL: u8 = PATCH_ADDRESS | PATCH_CRC | PATCH_PSNS | PATCH_REMOTE;

/// Bytes per region; small so the fuzzer's offsets land inside them.
const REGION_LEN: usize = 4096;
/// Regions per endpoint, in this order.
const TARGET: usize = 0; // Everything allowed: the peer may change it.
const SINK: usize = 1; // Local write only: receives, READ and atomic results land here.
const SOURCE: usize = 2; // No access flags: the source of WRITEs and SENDs.
const READABLE: usize = 3; // Remote read only.
const GUARD: usize = 4; // Local write, never named in any request.
const REVOKED: usize = 5; // Everything allowed, then deregistered.
const REGIONS: usize = 6;
/// Regions nothing may ever change.
const PROTECTED: [usize; 4] = [SOURCE, READABLE, GUARD, REVOKED];
/// Most datagrams queued towards one endpoint; older ones are dropped beyond it.
const MAX_QUEUED: usize = 1024;
/// Most datagrams one `poll_transmit` loop may produce; more means it never stops.
const MAX_BURST: usize = 4096;
/// Smallest datagram an ACK with every selective block needs (44-byte header, 8 per block).
/// The core does not yet refuse a smaller `max_datagram` (it panics in `poll_transmit`
/// instead); once it does, this harness may go smaller.
const MIN_ACK_DATAGRAM: usize =
    wire::COMMON_HEADER_LEN + wire::Opcode::Ack.ext_len() + MAX_SACK_BLOCKS * 8;

fn config() -> Config {
    Config {
        // 256 payload bytes per packet: messages of a few hundred bytes span several packets.
        max_datagram: (MAX_HEADER_LEN + 256).max(MIN_ACK_DATAGRAM),
        window: 8,
        ack_every: 4,
        max_send_wr: 64,
        max_recv_wr: 64,
        ..Config::default()
    }
}

/// Reads the script.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn u8(&mut self) -> Option<u8> {
        let (&first, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(first)
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
}

/// What one endpoint has outstanding, for the exactly-once check.
#[derive(Default)]
struct Ledger {
    next_wr_id: u64,
    /// Completions seen per posted request.
    posted: HashMap<(Queue, u64), u32>,
}

struct Harness {
    pair: Pair,
    now: Time,
    /// Per endpoint (index 0: `b`, 1: `a`): its regions, in the order of the constants above.
    regions: [[Region; REGIONS]; 2],
    /// What the protected regions held at the start.
    snapshots: [Vec<Vec<u8>>; 2],
    ledgers: [Ledger; 2],
    /// Datagrams on their way to each endpoint.
    queues: [VecDeque<Vec<u8>>; 2],
    buf: Vec<u8>,
    recording: Option<Vec<u8>>,
}

fn other(side: usize) -> usize {
    1 - side
}

impl Harness {
    fn new(record: bool) -> Harness {
        let mut pair = Pair::new(PairConfig {
            seed: 7,
            config_a: config(),
            config_b: config(),
            ..PairConfig::default()
        });
        assert_eq!(pair.a.conn.state(), ConnectionState::Established);
        assert_eq!(pair.b.conn.state(), ConnectionState::Established);
        let regions = [setup_regions(&mut pair.b), setup_regions(&mut pair.a)];
        let snapshot = |ep: &Endpoint, regions: &[Region; REGIONS]| {
            PROTECTED
                .iter()
                .map(|&i| ep.mem.bytes(&regions[i], 0, REGION_LEN).to_vec())
                .collect::<Vec<_>>()
        };
        let snapshots = [
            snapshot(&pair.b, &regions[0]),
            snapshot(&pair.a, &regions[1]),
        ];
        let now = pair.now;
        let mut harness = Harness {
            pair,
            now,
            regions,
            snapshots,
            ledgers: Default::default(),
            queues: Default::default(),
            buf: vec![0; config().max_datagram],
            recording: record.then(Vec::new),
        };
        // Work in flight both ways before the script starts, so it has state to disturb.
        for side in 0..2 {
            for i in 0..4 {
                harness.post_recv(side, 24 + i);
            }
            for (kind, len) in [(0, 37), (3, 37), (4, 0), (5, 0), (2, 12), (1, 6)] {
                harness.post_send(side, kind, len);
            }
        }
        harness.pump();
        harness
    }

    fn ep(&mut self, side: usize) -> &mut Endpoint {
        if side == 0 {
            &mut self.pair.b
        } else {
            &mut self.pair.a
        }
    }

    fn ep_ref(&self, side: usize) -> &Endpoint {
        if side == 0 {
            &self.pair.b
        } else {
            &self.pair.a
        }
    }

    fn record(&mut self, bytes: &[u8]) {
        if let Some(r) = &mut self.recording {
            r.extend_from_slice(bytes);
        }
    }

    fn run(&mut self, data: &[u8]) {
        let mut script = Script(data);
        while let Some(op) = script.u8() {
            self.action(op, &mut script);
            self.pump();
            self.check();
        }
        self.finish();
    }

    fn action(&mut self, op: u8, script: &mut Script<'_>) {
        let side = usize::from(op >> 3 & 1);
        let flags = op >> 4;
        match op & 7 {
            0 | 1 => {
                let len = [script.u8().unwrap_or(0), script.u8().unwrap_or(0)];
                let len = usize::from(u16::from_le_bytes(len));
                let mut datagram = script.bytes(len).to_vec();
                self.record(&[op, len as u8, (len >> 8) as u8]);
                self.record(&datagram);
                self.patch(side, flags, &mut datagram);
                self.deliver_bytes(side, &datagram);
            }
            2 => self.deliver_next(side, op),
            3 => {
                let at = script.u8().unwrap_or(0);
                let xor = script.u8().unwrap_or(0);
                let Some(mut datagram) = self.queues[side].pop_front() else {
                    self.record(&[op, at, xor]);
                    return;
                };
                let i = usize::from(at) % datagram.len().max(1);
                if let Some(byte) = datagram.get_mut(i) {
                    *byte ^= xor;
                }
                if flags & PATCH_CRC != 0 && datagram.len() >= CRC_RANGE.end {
                    wire::seal(&mut datagram);
                }
                // Recorded as the datagram it became, forged without patches.
                let len = datagram.len();
                self.record(&[(side as u8) << 3, len as u8, (len >> 8) as u8]);
                self.record(&datagram);
                self.deliver_bytes(side, &datagram);
            }
            4 => {
                self.record(&[op]);
                let queue = &mut self.queues[side];
                if let Some(datagram) = queue.pop_front() {
                    match flags & 3 {
                        1 => {
                            queue.push_front(datagram.clone());
                            queue.push_back(datagram);
                        }
                        2 => queue.push_back(datagram),
                        _ => {}
                    }
                }
            }
            5 => {
                let t = script.u8().unwrap_or(0);
                self.record(&[op, t]);
                let step = Duration::from_micros(50) * u32::from(t) * u32::from(t);
                self.advance(self.now + step);
            }
            6 => {
                let kind = script.u8().unwrap_or(0);
                let len = script.u8().unwrap_or(0);
                self.record(&[op, kind, len]);
                self.post_send(side, kind, len);
            }
            _ => {
                if flags & 1 != 0 {
                    let len = script.u8().unwrap_or(0);
                    self.record(&[op, len]);
                    self.post_recv(side, len);
                } else if flags & 2 != 0 {
                    self.record(&[op]);
                    let now = self.now;
                    self.ep(side).conn.close(now);
                } else {
                    // Everything queued now, both ways; what it provokes waits for next time.
                    let counts = [self.queues[0].len(), self.queues[1].len()];
                    for (side, count) in counts.into_iter().enumerate() {
                        for _ in 0..count {
                            self.deliver_next(side, (side as u8) << 3 | 2);
                            // As the recorded script, one action per datagram, will.
                            self.pump();
                        }
                    }
                }
            }
        }
    }

    /// Delivers the next real datagram queued towards `side`; when recording, writes it into
    /// the script as a forged datagram with every patch flag (`op` is the action that did it).
    fn deliver_next(&mut self, side: usize, op: u8) {
        let Some(datagram) = self.queues[side].pop_front() else {
            if op & 7 == 2 {
                self.record(&[op]);
            }
            return;
        };
        if self.recording.is_some() {
            let (flags, forged) = self.unpatch(side, &datagram);
            let len = forged.len();
            self.record(&[(side as u8) << 3 | flags << 4, len as u8, (len >> 8) as u8]);
            self.record(&forged);
        }
        self.deliver_bytes(side, &datagram);
    }

    fn deliver_bytes(&mut self, side: usize, datagram: &[u8]) {
        let now = self.now;
        let ep = self.ep(side);
        ep.conn.handle_datagram(now, datagram, &mut ep.mem);
    }

    /// Moves time forward to `until`, handling every deadline on the way.
    fn advance(&mut self, until: Time) {
        for _ in 0..10_000 {
            let next = [0, 1]
                .into_iter()
                .filter_map(|s| self.ep_ref(s).conn.poll_timeout())
                .min();
            match next {
                Some(next) if next <= until => {
                    self.now = next.max(self.now);
                    self.handle_timeouts();
                    // Retransmissions are queued, not delivered: the script decides.
                    self.pump();
                }
                _ => break,
            }
        }
        self.now = until.max(self.now);
        self.handle_timeouts();
    }

    fn handle_timeouts(&mut self) {
        let now = self.now;
        for side in 0..2 {
            self.ep(side).conn.handle_timeout(now);
        }
    }

    /// Collects what both endpoints want to send and every completion.
    fn pump(&mut self) {
        let now = self.now;
        for side in 0..2 {
            let mut buf = std::mem::take(&mut self.buf);
            let mut burst = 0;
            loop {
                let ep = self.ep(side);
                let Some(len) = ep.conn.poll_transmit(now, &mut buf, &ep.mem) else {
                    break;
                };
                burst += 1;
                assert!(burst <= MAX_BURST, "poll_transmit never returns None");
                let queue = &mut self.queues[other(side)];
                if queue.len() == MAX_QUEUED {
                    queue.pop_front();
                }
                queue.push_back(buf[..len].to_vec());
            }
            self.buf = buf;
            for wc in self.ep(side).take_completions() {
                self.complete(side, &wc);
            }
        }
    }

    fn complete(&mut self, side: usize, wc: &WorkCompletion) {
        let Some(count) = self.ledgers[side].posted.get_mut(&(wc.queue, wc.wr_id)) else {
            panic!("completion for a request never posted: {wc:?}");
        };
        *count += 1;
        assert_eq!(*count, 1, "request completed twice: {wc:?}");
    }

    fn check(&self) {
        for side in 0..2 {
            let ep = self.ep_ref(side);
            for (snapshot, &i) in self.snapshots[side].iter().zip(&PROTECTED) {
                let now = ep.mem.bytes(&self.regions[side][i], 0, REGION_LEN);
                if now != snapshot.as_slice() {
                    let at = now.iter().zip(snapshot).position(|(a, b)| a != b);
                    panic!(
                        "region {i} of endpoint {} changed at offset {at:?} though no one may write it",
                        ["b", "a"][side]
                    );
                }
            }
        }
    }

    /// Lets the pair settle with real traffic only, then checks every send request completed.
    fn finish(&mut self) {
        let mut settled = false;
        for _ in 0..20_000 {
            self.pump();
            self.check();
            if !self.queues[0].is_empty() || !self.queues[1].is_empty() {
                for side in 0..2 {
                    while let Some(datagram) = self.queues[side].pop_front() {
                        self.deliver_bytes(side, &datagram);
                    }
                }
                continue;
            }
            let quiet = |ep: &Endpoint| {
                ep.conn.is_idle()
                    || matches!(
                        ep.conn.state(),
                        ConnectionState::Error | ConnectionState::Closed
                    )
            };
            if quiet(&self.pair.a) && quiet(&self.pair.b) {
                settled = true;
                break;
            }
            let next = [0, 1]
                .into_iter()
                .filter_map(|s| self.ep_ref(s).conn.poll_timeout())
                .min();
            let Some(next) = next else { break };
            self.now = next.max(self.now + Duration::from_nanos(1));
            self.handle_timeouts();
        }
        if !settled {
            return;
        }
        for (side, ledger) in self.ledgers.iter().enumerate() {
            for (&(queue, wr_id), &count) in &ledger.posted {
                if queue == Queue::Send {
                    assert_eq!(
                        count,
                        1,
                        "send request {wr_id} of endpoint {} never completed (states: a {:?}, b {:?})",
                        ["b", "a"][side],
                        self.pair.a.conn.state(),
                        self.pair.b.conn.state()
                    );
                }
            }
        }
    }

    fn post_recv(&mut self, side: usize, len: u8) {
        let sink = self.regions[side][SINK];
        let offset = u64::from(len) * 13 % 2048;
        let wr = RecvWr {
            wr_id: self.ledgers[side].next_wr_id,
            local: Sge {
                addr: sink.addr + offset,
                len: u64::from(len) * 8,
                lkey: sink.lkey,
            },
        };
        self.ledgers[side].next_wr_id += 1;
        if self.ep(side).post_recv(wr).is_ok() {
            self.ledgers[side].posted.insert((Queue::Recv, wr.wr_id), 0);
        }
    }

    /// Posts a request from `side` towards its peer. `kind % 6` picks the operation, `kind / 6
    /// % 8` the peer's region (0-3: target, readable, revoked, guard; more: target), bit 7 a
    /// misaligned atomic; `len` sizes and places it.
    fn post_send(&mut self, side: usize, kind: u8, len: u8) {
        let peer = &self.regions[other(side)];
        let remote_region = [TARGET, READABLE, REVOKED, GUARD]
            .get(usize::from(kind / 6 % 8))
            .map_or(peer[TARGET], |&i| peer[i]);
        let offset = u64::from(len) * 13 % 2048;
        let length = 1 + u64::from(len) * 8;
        let atomic_offset = (offset & !7) | u64::from(kind >> 7);
        let remote = |offset| RemoteAddr {
            addr: remote_region.addr + offset,
            rkey: remote_region.rkey,
        };
        let own = &self.regions[side];
        let source = Sge {
            addr: own[SOURCE].addr + offset,
            len: length,
            lkey: own[SOURCE].lkey,
        };
        let sink = |len| Sge {
            addr: own[SINK].addr + offset,
            len,
            lkey: own[SINK].lkey,
        };
        let (local, op) = match kind % 6 {
            0 => (
                source,
                SendOp::Write {
                    remote: remote(offset),
                },
            ),
            1 => (
                source,
                SendOp::WriteWithImm {
                    remote: remote(offset),
                    imm: u32::from(len),
                },
            ),
            2 => (
                source,
                SendOp::Send {
                    imm: (kind & 0x40 != 0).then_some(u32::from(len)),
                },
            ),
            3 => (
                sink(length),
                SendOp::Read {
                    remote: remote(offset),
                },
            ),
            4 => (
                sink(8),
                SendOp::FetchAdd {
                    remote: remote(atomic_offset),
                    add: u64::from(len),
                },
            ),
            _ => (
                sink(8),
                SendOp::CmpSwap {
                    remote: remote(atomic_offset),
                    compare: 0,
                    swap: u64::from(len) + 1,
                },
            ),
        };
        let wr = SendWr {
            wr_id: self.ledgers[side].next_wr_id,
            local,
            op,
        };
        self.ledgers[side].next_wr_id += 1;
        if self.ep(side).post_send(wr).is_ok() {
            self.ledgers[side].posted.insert((Queue::Send, wr.wr_id), 0);
        }
    }

    /// The remote keys a forged datagram towards `side` can name, with their regions: every
    /// region's rkey (most refuse remote access), and one lkey.
    fn keys(&self, side: usize) -> [(u32, u64); REGIONS + 1] {
        let r = &self.regions[side];
        let mut keys = [(r[TARGET].lkey, r[TARGET].addr); REGIONS + 1];
        for (key, region) in keys.iter_mut().zip(r) {
            *key = (region.rkey, region.addr);
        }
        keys
    }

    /// Applies the patch `flags` to a forged datagram towards `side`.
    fn patch(&self, side: usize, flags: u8, d: &mut [u8]) {
        if d.len() < wire::COMMON_HEADER_LEN {
            return;
        }
        let own = *self.ep_ref(side).conn.params();
        let peer = *self.ep_ref(other(side)).conn.params();
        if flags & PATCH_ADDRESS != 0 {
            let mut w = SliceWriter::new(&mut d[8..20]);
            w.put_u64(own.token);
            w.put_u32(own.local_qpn);
        }
        if flags & PATCH_PSNS != 0 {
            for (at, base) in psn_fields(d) {
                let base = [peer.initial_psn.0, own.initial_psn.0][base as usize];
                add_u32(d, at, base);
            }
        }
        if flags & PATCH_REMOTE != 0
            && let Some(at) = remote_field(d)
        {
            let keys = self.keys(side);
            let (key, addr) = keys[get_u32(d, at) as usize % keys.len()];
            set_u32(d, at, key);
            set_u64(d, at + 8, addr.wrapping_add(get_u64(d, at + 8)));
        }
        if flags & PATCH_CRC != 0 {
            wire::seal(d);
        }
    }

    /// The inverse of [`Self::patch`] for a real datagram towards `side`: the flags that apply
    /// and the datagram they turn back into `datagram`.
    fn unpatch(&self, side: usize, datagram: &[u8]) -> (u8, Vec<u8>) {
        let mut d = datagram.to_vec();
        if d.len() < wire::COMMON_HEADER_LEN {
            return (0, d);
        }
        let own = *self.ep_ref(side).conn.params();
        let peer = *self.ep_ref(other(side)).conn.params();
        let mut flags = PATCH_ADDRESS | PATCH_CRC | PATCH_PSNS;
        d[8..20].fill(0);
        for (at, base) in psn_fields(&d) {
            let base = [peer.initial_psn.0, own.initial_psn.0][base as usize];
            add_u32(&mut d, at, base.wrapping_neg());
        }
        if let Some(at) = remote_field(&d) {
            let key = get_u32(&d, at);
            if let Some(index) = self.keys(side).iter().position(|&(k, _)| k == key) {
                let addr = self.keys(side)[index].1;
                flags |= PATCH_REMOTE;
                set_u32(&mut d, at, index as u32);
                let value = get_u64(&d, at + 8);
                set_u64(&mut d, at + 8, value.wrapping_sub(addr));
            }
        }
        d[CRC_RANGE].fill(0);
        (flags, d)
    }
}

/// Gives an endpoint its six regions (see the constants), filled with a pattern.
fn setup_regions(ep: &mut Endpoint) -> [Region; REGIONS] {
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let access = [
        all,
        Access::LOCAL_WRITE,
        Access::empty(),
        Access::REMOTE_READ,
        Access::LOCAL_WRITE,
        all,
    ];
    let regions = access.map(|access| ep.mem.alloc(REGION_LEN, access));
    let pattern: Vec<u8> = (0..REGION_LEN).map(|i| (i * 7 + 3) as u8).collect();
    for region in &regions {
        ep.mem.fill(region, 0, &pattern);
    }
    ep.mem.deregister(&regions[REVOKED]);
    regions
}

// Field access at offsets the callers found inside the datagram (a field past its end is a
// bug in the harness, hence the panics).
fn get_u32(d: &[u8], at: usize) -> u32 {
    codec::u32_at(d, at).expect("field inside the datagram")
}

fn get_u64(d: &[u8], at: usize) -> u64 {
    codec::u64_at(d, at).expect("field inside the datagram")
}

fn set_u32(d: &mut [u8], at: usize, value: u32) {
    SliceWriter::new(&mut d[at..]).put_u32(value);
}

fn set_u64(d: &mut [u8], at: usize, value: u64) {
    SliceWriter::new(&mut d[at..]).put_u64(value);
}

fn add_u32(d: &mut [u8], at: usize, add: u32) {
    set_u32(d, at, get_u32(d, at).wrapping_add(add));
}

/// Where the PSN fields of a datagram towards an endpoint are, and whose stream each belongs
/// to (0: the sender's, 1: the receiver's). `d` is at least a common header long.
fn psn_fields(d: &[u8]) -> Vec<(usize, u8)> {
    let mut fields = vec![(20, 0), (24, 1)];
    let Some(opcode) = Opcode::from_u8(d[3]) else {
        return fields;
    };
    let ext = wire::COMMON_HEADER_LEN;
    let fits = |at: usize| at + 4 <= d.len();
    match opcode {
        Opcode::Send | Opcode::Write | Opcode::WriteWithImm => fields.push((ext, 0)),
        Opcode::ReadResponse => fields.extend([(ext, 0), (ext + 4, 1)]),
        Opcode::AtomicResponse | Opcode::FatalNak | Opcode::Nak => fields.push((ext, 1)),
        Opcode::Connect | Opcode::Accept => fields.push((ext + 4, 0)),
        Opcode::Ack => {
            let count = d.get(ext + 4).copied().unwrap_or(0).min(16);
            for i in 0..usize::from(count) {
                let at = ext + opcode.ext_len() + i * 8;
                fields.extend([(at, 1), (at + 4, 1)]);
            }
        }
        _ => {}
    }
    fields.retain(|&(at, _)| fits(at));
    fields
}

/// Where the remote key of a request is (the address follows 8 bytes later).
fn remote_field(d: &[u8]) -> Option<usize> {
    let at = match Opcode::from_u8(d[3])? {
        Opcode::Write | Opcode::WriteWithImm => wire::COMMON_HEADER_LEN + 24,
        Opcode::ReadRequest | Opcode::FetchAdd | Opcode::CmpSwap => wire::COMMON_HEADER_LEN,
        _ => return None,
    };
    (at + 16 <= d.len()).then_some(at)
}
