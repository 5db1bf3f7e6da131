//! `tbrdma bw`: bandwidth like perftest's `ib_*_bw`. The posting side keeps `--tx-depth`
//! requests outstanding on each of `--qps` connections; with `--bidir` both sides post and the
//! reported bandwidth is the sum of both directions.
//!
//! Each size is a phase that ends with a DONE message on every connection from each side once
//! all its requests completed, carrying its totals (messages, bytes, time, peak) and the
//! connection's message count. Completions of the peer's next phase that arrive before this
//! side has left the current one are carried over.
//!
//! `--verify`: every SEND is checked as its completion is polled: its bytes through the CRC-32C
//! the receiving engine built from the datagrams it accepted and placed
//! (`Config::message_crc`), compared with its pattern's, and where they landed by probing its
//! receive slot one word every 4 KiB (every byte of the slot when the CRC is missing or
//! differs; see [`Run::check_send`]). For WRITE, the receiver checks at the end of each size
//! that its region holds exactly the last message; for READ, every READ is checked against the
//! peer's fixed pattern. Message `k` of a connection leaves from byte `64 · (k % S)` of a
//! source holding the size's pattern with `S − 1` lines to spare, written once before the
//! size's clock starts, so it carries the pattern from word `8 · (k % S)` on: sending verified
//! data costs the sender nothing, its source is as long as without `--verify`, and the window
//! is not limited by it. `S` is at least 2 and does not divide the number of receive slots, so
//! the message a receive slot held before (or the target held before the last WRITE) differs
//! in every word: a datagram that was never placed is caught.

use std::time::{Duration, Instant};

use anyhow::bail;
use tbrdma_floors::tcp::{self, Streamed};
use tbrdma_verbs::{Access, MemoryRegion, RecvWr, SendOp, SendWr, WcOpcode, WorkCompletion};

use crate::perf::options::{BwArgs, BwOp, Measures};
use crate::perf::paired::{self, StreamLine};
use crate::perf::pattern;
use crate::perf::report::{self, Bandwidth, Recovery};
use crate::perf::session::{
    self, Announce, CONTROL, DONE_IMM, DONE_LEN, DONE_WORDS, Interrupted, Remote, Session, Setup,
    Watch,
};

/// Peak bandwidth is the best of these intervals.
const PEAK_INTERVAL: Duration = Duration::from_millis(10);
/// Memory for READ source slots, per connection.
const SLOT_BUDGET: usize = 64 << 20;
/// Memory for SEND receive slots, per connection. More slots than keep the link busy only
/// spread the receiver's writes over more memory than its caches hold: with 64 MiB of 1 MiB
/// slots `bw --op send --size 1M` made 3800-4060 MiB/s, with 16 MiB 5290-5510 (same minutes,
/// docs/performance.md). The sender's queue may be deeper than the receives: receive credit
/// holds it back (`tbrdma_proto`'s `connection/credit.rs`).
const RECV_SLOT_BUDGET: usize = 16 << 20;
/// With `--verify`, message `k` leaves from byte `SHIFT_BYTES · (k % S)` of one buffer that
/// holds the pattern with room to spare, so it carries the pattern from that word on: the
/// sender's source stays one message (plus a few lines) long, as without `--verify`. A cache
/// line, so every message leaves from where it would without `--verify`, alignment-wise.
const SHIFT_BYTES: usize = 64;

/// Runs `tbrdma bw`.
pub fn run(args: BwArgs) -> anyhow::Result<()> {
    if args.qps == 0 || args.tx_depth == 0 {
        bail!("--qps and --tx-depth must be at least 1");
    }
    if args.duration.is_none() && args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    paired::check_bw_args(&args)?;
    let sizes = args.sizes.sizes(65536)?;
    session::raise_memlock();
    let server = match &args.connect.server {
        Some(s) => Some(session::server_addr(s, args.connect.port)?),
        None => None,
    };
    let dev = session::open_device(&args.connect, server, args.rails, Measures::Bandwidth)?;
    // `--paired-with tcp`: the server listens for the client's streams before the client can
    // connect to tbrdma, so it is there for the first.
    let (stream_listener, stream_to) = match (args.paired_with, server) {
        (None, _) => (None, None),
        (Some(_), None) => (
            Some(paired::stream_listener(dev.ip(), args.connect.port)?),
            None,
        ),
        (Some(_), Some(server)) => (None, Some(paired::stream_addr(server)?)),
    };
    let stream_for = paired::stream_duration(&args);
    let pd = dev.alloc_pd();
    let max = *sizes.iter().max().expect("at least one size");
    let qps = args.qps;
    let recv_slots = match args.op {
        BwOp::Send => (RECV_SLOT_BUDGET / max).clamp(4, args.tx_depth.max(4) * 2),
        _ => 0,
    };
    let source_slots = match args.op {
        BwOp::Read => (SLOT_BUDGET / max).clamp(1, args.tx_depth),
        _ => 1,
    };
    let shifts = match args.op {
        BwOp::Send | BwOp::Write if args.verify => pattern_shifts(recv_slots),
        _ => 1,
    };
    let source_len = max * source_slots + SHIFT_BYTES * (shifts - 1);
    let slot_len = max.max(DONE_LEN);
    let remote_access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let target = pd.alloc_mr(max * qps, remote_access)?;
    let source = pd.alloc_mr(source_len * qps, Access::LOCAL_WRITE)?;
    let recv = match recv_slots {
        0 => None,
        n => Some(pd.alloc_mr(slot_len * n * qps, Access::LOCAL_WRITE)?),
    };
    let read_pattern = pattern::make(0, max);
    if args.op == BwOp::Read {
        for l in 0..qps {
            target.write(l * max, &read_pattern);
        }
    }
    let announce = Announce {
        tool: "bw".into(),
        options: args.agreed(&sizes),
        regions: vec![Remote::of(&target)],
    };
    // A READ lands in its own slot, so that it can be checked after it completes.
    let window = args.tx_depth.min(if args.verify && args.op == BwOp::Read {
        source_slots
    } else {
        usize::MAX
    });
    let session = Session::connect(
        &dev,
        &pd,
        Setup {
            args: &args.connect,
            server,
            qps,
            cq_depth: window + recv_slots + 16,
            send_depth: window + 4,
            recv_depth: recv_slots + 4,
            control_recvs: args.op != BwOp::Send,
            message_crc: args.verify && args.op == BwOp::Send,
            announce,
        },
    )?;
    let peer = session.peer_region()?;
    let mut run = Run {
        op: args.op,
        verify: args.verify,
        posting: server.is_some() || args.bidir,
        window,
        max,
        source_slots,
        shifts,
        source_len,
        recv_slots,
        slot_len,
        timeout: session.timeout,
        session,
        target,
        source,
        recv,
        peer,
        read_pattern,
        pattern_crcs: Vec::new(),
        carry: vec![Vec::new(); qps],
    };
    for l in 0..qps {
        for j in 0..recv_slots {
            run.post_recv(l, j)?;
        }
    }
    session::start_measuring();
    let json = args.connect.json;
    let op_name = format!("{:?}", args.op).to_lowercase();
    let engine = dev.engine_kind().name();
    if server.is_some() {
        report::bandwidth_header(json);
    }
    let limit = match args.duration {
        Some(s) => Limit::Time(Duration::from_secs_f64(s.max(0.001))),
        None => Limit::Messages(args.iters),
    };
    for &size in &sizes {
        // `--paired-with tcp`: one TCP stream before tbrdma's run and one after, the client
        // writing, the server reading.
        let baseline = || -> anyhow::Result<Option<Streamed>> {
            match (&stream_listener, stream_to) {
                (Some(listener), _) => tcp::serve_stream(listener, size, stream_for).map(|()| None),
                (None, Some(to)) => tcp::stream(to, size, stream_for).map(Some),
                (None, None) => Ok(None),
            }
        };
        let before = baseline()?;
        let recovered_before = run.recovery();
        let mut partial = None;
        let (result, stopped) = match run.phase(size, limit, &mut partial) {
            Ok(r) => (Some(r), None),
            Err(error) => (partial, Some(error)),
        };
        let after = match stopped {
            None => baseline()?,
            Some(_) => None,
        };
        if let (Some(r), true) = (result, server.is_some()) {
            let line = before
                .zip(after)
                .map(|(b, a)| StreamLine::new(&b, &a, r.avg_mib_s));
            let recovery = run.recovery().since(&recovered_before);
            report::bandwidth_line(
                json,
                &op_name,
                engine,
                size,
                &r,
                args.verify,
                line.as_ref(),
                &recovery,
            );
        }
        if let Some(e) = stopped {
            if e.is::<Interrupted>() && server.is_some() {
                eprintln!(
                    "interrupted by Ctrl-C during the {size}-byte run: printed what was measured"
                );
            }
            return Err(e);
        }
    }
    if server.is_none() {
        eprintln!("served one run");
    }
    run.session.linger();
    Ok(())
}

/// The number of pattern shifts that `--verify` cycles through: the smallest from 2 up that
/// does not divide `recv_slots`, so consecutive messages into one receive slot (which the
/// receive queue uses in turn) carry different words. With no receive slots
/// (WRITE), 2: the target's previous message differs from the last one.
fn pattern_shifts(recv_slots: usize) -> usize {
    if recv_slots == 0 {
        return 2;
    }
    (2..=recv_slots + 1)
        .find(|s| recv_slots % s != 0)
        .expect("recv_slots + 1 does not divide it")
}

#[derive(Debug, Clone, Copy)]
enum Limit {
    Messages(u64),
    Time(Duration),
}

struct Run {
    op: BwOp,
    verify: bool,
    posting: bool,
    window: usize,
    max: usize,
    /// READ landing slots (1 for the other operations).
    source_slots: usize,
    /// Pattern shifts that consecutive messages cycle through with `--verify` (1 otherwise).
    shifts: usize,
    /// Bytes of the source region per connection.
    source_len: usize,
    recv_slots: usize,
    slot_len: usize,
    timeout: Duration,
    session: Session,
    target: MemoryRegion,
    source: MemoryRegion,
    recv: Option<MemoryRegion>,
    peer: Remote,
    read_pattern: Vec<u8>,
    /// With `--verify` and SEND: the CRC-32C of each pattern shift for the current size,
    /// which every received message's must equal.
    pattern_crcs: Vec<u32>,
    /// Per connection: the peer's completions of the next phase, seen early.
    carry: Vec<Vec<WorkCompletion>>,
}

/// One connection's progress in a phase.
#[derive(Debug, Default, Clone)]
struct LinkPhase {
    posted: u64,
    completed: u64,
    received: u64,
    peer_done: Option<[u64; DONE_WORDS]>,
    done_delivered: bool,
}

/// This side's counters in a phase.
#[derive(Debug)]
struct Meter {
    start: Instant,
    last: Instant,
    messages: u64,
    bytes: u64,
    bucket_start: Instant,
    bucket_bytes: u64,
    peak: f64,
}

impl Meter {
    fn new() -> Meter {
        let now = Instant::now();
        Meter {
            start: now,
            last: now,
            messages: 0,
            bytes: 0,
            bucket_start: now,
            bucket_bytes: 0,
            peak: 0.0,
        }
    }

    fn completed(&mut self, bytes: usize) {
        let now = Instant::now();
        let span = now - self.bucket_start;
        if span >= PEAK_INTERVAL {
            self.peak = self.peak.max(self.bucket_bytes as f64 / span.as_secs_f64());
            self.bucket_start = now;
            self.bucket_bytes = 0;
        }
        self.bucket_bytes += bytes as u64;
        self.messages += 1;
        self.bytes += bytes as u64;
        self.last = now;
    }

    fn elapsed(&self) -> Duration {
        self.last - self.start
    }

    /// Bytes per second over the whole phase.
    fn average(&self) -> f64 {
        let secs = self.elapsed().as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / secs
        } else {
            0.0
        }
    }

    fn result(&self) -> Bandwidth {
        let secs = self.elapsed().as_secs_f64().max(1e-9);
        let avg = self.average();
        const MIB: f64 = (1 << 20) as f64;
        Bandwidth {
            iters: self.messages,
            peak_mib_s: self.peak.max(avg) / MIB,
            avg_mib_s: avg / MIB,
            msg_rate_mpps: self.messages as f64 / secs / 1e6,
        }
    }
}

impl Run {
    /// What this side's connections have resent so far, and sent on each rail.
    fn recovery(&self) -> Recovery {
        let mut total = Recovery::default();
        for link in &self.session.links {
            let stats = link.qp.stats();
            total.retransmits += stats.retransmits;
            total.tail_probes += stats.tail_probes;
            total.timeouts += stats.timeouts;
            let (per_rail, _) = link.qp.rail_stats();
            if total.rail_datagrams.len() < per_rail.len() {
                total.rail_datagrams.resize(per_rail.len(), 0);
            }
            for (sum, n) in total.rail_datagrams.iter_mut().zip(per_rail) {
                *sum += n;
            }
        }
        total
    }

    fn post_recv(&self, l: usize, j: usize) -> anyhow::Result<()> {
        let recv = self.recv.as_ref().expect("receive slots");
        let slot = l * self.recv_slots + j;
        self.session.links[l].qp.post_recv(&[RecvWr {
            wr_id: slot as u64,
            local: recv.sge(slot * self.slot_len, self.slot_len),
        }])?;
        Ok(())
    }

    /// Which of the pattern shifts message `k` of a connection carries.
    fn shift_index(&self, k: u64) -> usize {
        (k % self.shifts as u64) as usize
    }

    /// The pattern word message `k` of a connection starts at (see [`SHIFT_BYTES`]).
    fn shift_of(&self, k: u64) -> u64 {
        (self.shift_index(k) * SHIFT_BYTES / 8) as u64
    }

    /// With `--verify`, writes the pattern for `size` into each connection's source, with
    /// room for every shift (before the clock starts).
    fn fill_patterns(&mut self, size: usize) {
        if !self.verify || self.op == BwOp::Read || !self.posting {
            return;
        }
        let mut bytes = vec![0u8; size + SHIFT_BYTES * (self.shifts - 1)];
        pattern::fill(0, size, &mut bytes);
        for l in 0..self.session.links.len() {
            self.source.write(l * self.source_len, &bytes);
        }
    }

    /// Where message `k` of connection `l` leaves from: its READ slot, or its pattern shift.
    fn source_offset(&self, l: usize, k: u64) -> usize {
        let slot = (k % self.source_slots as u64) as usize * self.max;
        l * self.source_len + slot + self.shift_index(k) * SHIFT_BYTES
    }

    /// With `--verify` and SEND, the CRC of each pattern shift for `size` (before the clock
    /// starts), for [`Self::check_send`].
    fn compute_pattern_crcs(&mut self, size: usize) {
        self.pattern_crcs = if self.verify && self.op == BwOp::Send {
            (0..self.shifts as u64)
                .map(|j| pattern::crc(0, size, self.shift_of(j)))
                .collect()
        } else {
            Vec::new()
        };
    }

    /// Checks SEND `k` of connection `l`, received into receive slot `slot`. Its content is
    /// vouched for by the CRC-32C the receiving engine built from the datagrams it accepted
    /// and placed (`crc`), compared with its pattern's: the bytes are not read again. Where
    /// they landed is probed one word every `PROBE_STRIDE` bytes. Without a CRC, or with one
    /// that differs, every byte of the slot is checked, which names the first bad one.
    fn check_send(
        &self,
        l: usize,
        slot: usize,
        k: u64,
        size: usize,
        crc: Option<u32>,
    ) -> anyhow::Result<()> {
        let recv = self.recv.as_ref().expect("receive slots");
        let at = slot * self.slot_len;
        let shift = self.shift_of(k);
        let want_crc = self.pattern_crcs.get(self.shift_index(k)).copied();
        let bad = if crc.is_some() && crc == want_crc {
            pattern::first_probe_mismatch_in(recv, at, 0, size, shift)
        } else {
            pattern::first_mismatch_in(recv, at, 0, size, shift)
        };
        if let Some(byte) = bad {
            bail!(
                "verification failed at byte {byte} of iteration {k} ({size}-byte SEND, connection {l})"
            );
        }
        if let (Some(got), Some(want)) = (crc, want_crc) {
            if got != want {
                bail!(
                    "verification failed for iteration {k} ({size}-byte SEND, connection {l}): its slot holds the pattern, but the CRC-32C the engine built from its datagrams is {got:#010x}, not the pattern's {want:#010x}"
                );
            }
        }
        Ok(())
    }

    /// Posts as many requests on connection `l` as the window and the limit allow.
    fn fill(
        &mut self,
        l: usize,
        state: &mut LinkPhase,
        size: usize,
        cap: u64,
    ) -> anyhow::Result<()> {
        let room = self.window as u64 - (state.posted - state.completed);
        let n = room.min(cap.saturating_sub(state.posted));
        if n == 0 {
            return Ok(());
        }
        let mut wrs = Vec::with_capacity(n as usize);
        for k in state.posted..state.posted + n {
            let at = self.source_offset(l, k);
            let remote = self.peer.at(l * self.max);
            let op = match self.op {
                BwOp::Write => SendOp::Write { remote },
                BwOp::Send => SendOp::Send { imm: None },
                BwOp::Read => SendOp::Read { remote },
            };
            wrs.push(SendWr {
                wr_id: k,
                local: self.source.sge(at, size),
                op,
            });
        }
        self.session.links[l].qp.post_send(&wrs)?;
        state.posted += n;
        Ok(())
    }

    /// Handles one completion of connection `l`.
    fn handle(
        &mut self,
        l: usize,
        wc: WorkCompletion,
        state: &mut LinkPhase,
        meter: &mut Meter,
        size: usize,
    ) -> anyhow::Result<()> {
        let receive = matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
        if receive && state.peer_done.is_some() {
            self.carry[l].push(wc);
            return Ok(());
        }
        if receive && wc.imm == Some(DONE_IMM) {
            let words = if wc.wr_id & CONTROL != 0 {
                self.session.take_control(l, &wc)?
            } else {
                let slot = wc.wr_id as usize;
                let mut raw = [0u8; DONE_LEN];
                let recv = self.recv.as_ref().expect("receive slots");
                recv.read(slot * self.slot_len, &mut raw);
                self.post_recv(l, slot - l * self.recv_slots)?;
                session::done_words(&raw)
            };
            if self.verify && self.op == BwOp::Write && words[4] > 0 {
                let last = self.shift_of(words[4] - 1);
                let bad = pattern::first_mismatch_in(&self.target, l * self.max, 0, size, last);
                if let Some(at) = bad {
                    bail!(
                        "verification failed at byte {at} of iteration {} ({size}-byte WRITE, connection {l})",
                        words[4] - 1
                    );
                }
            }
            state.peer_done = Some(words);
        } else if receive {
            let slot = wc.wr_id as usize;
            let k = state.received;
            state.received += 1;
            if wc.byte_len as usize != size {
                bail!(
                    "verification failed at byte {} of iteration {k}: received {} bytes, expected {size}",
                    wc.byte_len.min(size as u64),
                    wc.byte_len
                );
            }
            if self.verify {
                self.check_send(l, slot, k, size, wc.payload_crc)?;
            }
            self.post_recv(l, slot - l * self.recv_slots)?;
        } else if wc.wr_id & CONTROL != 0 {
            state.done_delivered = true;
        } else {
            if self.verify && self.op == BwOp::Read {
                let at = self.source_offset(l, wc.wr_id);
                let want = &self.read_pattern[..size];
                let bad = pattern::first_difference_in(&self.source, at, want);
                if let Some(i) = bad {
                    bail!(
                        "verification failed at byte {i} of iteration {} ({size}-byte READ, connection {l})",
                        wc.wr_id
                    );
                }
            }
            state.completed += 1;
            meter.completed(size);
        }
        Ok(())
    }

    /// Runs one size. When it stops early, `partial` gets what was measured.
    fn phase(
        &mut self,
        size: usize,
        limit: Limit,
        partial: &mut Option<Bandwidth>,
    ) -> anyhow::Result<Bandwidth> {
        let qps = self.session.links.len();
        let mut states = vec![LinkPhase::default(); qps];
        for (l, carried) in self.carry.iter_mut().enumerate() {
            for wc in carried.drain(..).rev() {
                self.session.links[l].unpoll(wc);
            }
        }
        self.fill_patterns(size);
        self.compute_pattern_crcs(size);
        let mut meter = Meter::new();
        let (cap, deadline) = match limit {
            Limit::Messages(n) => (n, None),
            Limit::Time(d) => (u64::MAX, Some(meter.start + d)),
        };
        let mut side_done = false;
        let mut watch = Watch::new(self.timeout);
        let mut progress_at = meter.start + Duration::from_secs(2);
        if !self.posting {
            side_done = true;
            for l in 0..qps {
                self.session.send_done(l, [0; DONE_WORDS])?;
            }
        }
        loop {
            if session::interrupted() {
                *partial = (meter.messages > 0).then(|| meter.result());
                return Err(Interrupted.into());
            }
            let now = Instant::now();
            let stop_posting = deadline.is_some_and(|d| now >= d);
            let mut moved = false;
            for (l, state) in states.iter_mut().enumerate() {
                if self.posting && !side_done && !stop_posting {
                    self.fill(l, state, size, cap)?;
                }
                for _ in 0..64 {
                    match self.session.links[l].next()? {
                        Some(wc) => {
                            moved = true;
                            self.handle(l, wc, state, &mut meter, size)?;
                        }
                        None => break,
                    }
                }
            }
            if !side_done
                && states
                    .iter()
                    .all(|s| s.completed == s.posted && (stop_posting || s.posted >= cap))
            {
                side_done = true;
                let r = [
                    meter.messages,
                    meter.bytes,
                    meter.elapsed().as_nanos() as u64,
                    meter.peak.max(meter.average()).to_bits(),
                ];
                for (l, s) in states.iter().enumerate() {
                    self.session
                        .send_done(l, [r[0], r[1], r[2], r[3], s.completed])?;
                }
            }
            if side_done
                && states
                    .iter()
                    .all(|s| s.done_delivered && s.peer_done.is_some())
            {
                break;
            }
            if moved {
                watch.progressed();
            } else if self.posting && !side_done {
                let outstanding: u64 = states.iter().map(|s| s.posted - s.completed).sum();
                if let Err(e) = watch
                    .check(|| format!("with {outstanding} requests of {size} bytes outstanding"))
                {
                    *partial = (meter.messages > 0).then(|| meter.result());
                    return Err(e);
                }
            }
            if now >= progress_at && self.posting && !side_done {
                progress_at = now + Duration::from_secs(1);
                eprintln!(
                    "  {size} bytes: {} messages, {:.0} MiB/s so far",
                    meter.messages,
                    meter.average() / (1 << 20) as f64
                );
            }
        }
        let mut result = meter.result();
        if self.posting && self.session.is_server {
            // Bidirectional: the client reports both directions; the server's numbers are its own.
            return Ok(result);
        }
        let peer = states[0].peer_done.expect("peer finished");
        if peer[0] > 0 {
            // The peer streamed too (--bidir): report the sum, as perftest does.
            let secs = Duration::from_nanos(peer[2]).as_secs_f64().max(1e-9);
            const MIB: f64 = (1 << 20) as f64;
            let peer_avg = peer[1] as f64 / secs / MIB;
            let peer_peak = f64::from_bits(peer[3]) / MIB;
            result = Bandwidth {
                iters: result.iters + peer[0],
                peak_mib_s: result.peak_mib_s + peer_peak.max(peer_avg),
                avg_mib_s: result.avg_mib_s + peer_avg,
                msg_rate_mpps: result.msg_rate_mpps + peer[0] as f64 / secs / 1e6,
            };
        }
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::pattern_shifts;

    #[test]
    fn consecutive_messages_into_one_slot_carry_different_patterns() {
        for recv in [0, 1, 2, 4, 6, 12, 60, 64, 256] {
            let s = pattern_shifts(recv);
            assert!(s >= 2, "{recv}: {s}");
            if recv > 0 {
                assert_ne!(recv % s, 0, "{recv}: {s}");
            }
        }
    }
}
