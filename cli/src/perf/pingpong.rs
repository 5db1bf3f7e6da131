//! `tbrdma pingpong`: latency like perftest's `ib_*_lat`. The client measures and prints; the
//! server answers (write, send) or just serves its memory (read, atomic), for one run.
//!
//! Per iteration, with `seq` a counter both sides advance in step (1, 2, … across all sizes):
//! - write: the client WRITEs `size` bytes into the server's region plus `seq` in an aligned
//!   8-byte counter word at `align8(size)`; the server busy-polls that word (an atomic load),
//!   then WRITEs back the same way. With caller progress, payload, padding and counter travel
//!   as one WRITE whatever its size, as `ib_write_lat` sends one: the transport places a
//!   message's last datagram only after all its others (docs/semantics.md, "Visibility"), and
//!   places each datagram whole inside this side's poll, so the counter is never seen before
//!   the payload. With a background engine thread, which may be copying the last datagram
//!   while this side reads the counter, only up to 1 KiB travels as one WRITE; beyond it the
//!   counter is a second 8-byte WRITE posted behind the payload's, which the transport places
//!   only once the payload is complete (it never places a later message before an earlier one
//!   is whole). One-way = round trip / 2.
//! - send: SEND of `size` bytes into a pre-posted receive, answered the same way. One-way =
//!   round trip / 2.
//! - read: the client READs `size` bytes; the full READ latency is reported, as ib_read_lat.
//! - atomic: the client FETCH_ADDs 1 to an 8-byte word; the full latency is reported.
//!
//! The end of the run is a DONE message from the client, which the server waits for.
//!
//! Message `seq` travels from source half `seq % 2` into target half `seq % 2` (receive slots
//! for SEND), with or without `--verify`, so both runs move the same bytes to the same places.
//! `--verify` checks every byte of every iteration *outside the timed part*: after a side has
//! answered message `seq` (server) or taken the time of its round trip (client), it checks the
//! message in place and writes the pattern of `seq + 1` into the other source half. Nothing can
//! overwrite the half being checked meanwhile: the peer's next message goes to the other half,
//! and the one after that is only sent once this side has answered it. The server's checking
//! runs while the client checks its own copy, so neither lengthens the round trip measured.
//!
//! `--op write` lends each target half to the engine before the peer's message into it can be
//! sent, as a landing zone (the sockets engine then receives the WRITE's first datagram in
//! place, with no copy), and reads the counter only once the loan has ended: what an
//! `ib_write_lat`-style application that polls memory can do with the verbs API.

use std::time::{Duration, Instant};

use anyhow::bail;
use tbrdma_floors::pairing::{
    Echoer, Pinger, Plan, run_alone, run_client, run_server, serve_alone,
};
use tbrdma_verbs::{
    Access, MemoryRegion, Progress as EngineProgress, RecvWr, SendOp, SendWr, WcOpcode,
    WorkCompletion,
};

use crate::perf::options::{LatOp, Measures, PingpongArgs};
use crate::perf::paired::{self, Floor, PairedLine};
use crate::perf::pattern;
use crate::perf::report;
use crate::perf::session::{self, Announce, DONE_IMM, Interrupted, Remote, Session, Setup, Watch};
use crate::perf::stats::Samples;

/// With a background engine thread, payload, padding and counter up to this many bytes travel
/// as one WRITE: the thread places a datagram while this side polls the counter, and a copy
/// this short is never seen half done in practice; longer ones could show the counter first.
const ONE_WRITE_THREAD: usize = 1024;
/// Receives pre-posted for `--op send`.
const RECV_SLOTS: usize = 4;
/// Bytes in front of each target half: room for a datagram's header, so that the half can be
/// lent to the engine as a landing zone (see [`Run::lend`]).
const ZONE_GAP: usize = tbrdma_verbs::SEND_HEADROOM;

fn align8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

/// The memory of one side.
struct Buffers {
    /// The peer WRITEs here (payload, then the counter word), READs and FETCH_ADDs here: two
    /// halves of `half` bytes, each after [`ZONE_GAP`] bytes, message `seq` into half `seq % 2`.
    target: MemoryRegion,
    /// What this side sends or WRITEs from (half `seq % 2`), and where READ and FETCH_ADD
    /// results land.
    source: MemoryRegion,
    half: usize,
    /// `--op send` receive slots, `slot_len` bytes each.
    recv: Option<MemoryRegion>,
    slot_len: usize,
}

impl Buffers {
    fn at(&self, seq: u64) -> usize {
        ZONE_GAP + (seq % 2) as usize * (ZONE_GAP + self.half)
    }
}

/// A message received in the timed part, checked (and its receive slot reposted) after it.
#[derive(Debug, Clone, Copy)]
struct Received {
    seq: u64,
    size: usize,
    iteration: u64,
    /// The SEND's receive slot; `None` for a WRITE (target half `seq % 2`).
    slot: Option<usize>,
}

struct Run<'a> {
    op: LatOp,
    /// Largest payload + padding + counter sent as one WRITE.
    one_write: usize,
    verify: bool,
    session: Session,
    buf: Buffers,
    peer: Remote,
    timeout: Duration,
    /// The server's fixed READ pattern (client, `--op read --verify`).
    read_pattern: &'a [u8],
    /// FETCH_ADDs done so far: the value the next one must return.
    adds: u64,
    /// The message whose pattern the source holds (`--verify`).
    prepared: Option<(u64, usize)>,
    /// The highest `seq` whose WRITE or SEND has completed on this side.
    sent_through: u64,
    /// The message of the current iteration, to check once its time is taken.
    received: Option<Received>,
    /// Where the next pattern is generated before it is written into the source.
    scratch: Vec<u8>,
}

/// Runs `tbrdma pingpong`.
pub fn run(args: PingpongArgs) -> anyhow::Result<()> {
    let explicit_sizes = args.sizes.all || !args.sizes.size.is_empty();
    let sizes = match args.op {
        LatOp::Atomic if explicit_sizes && args.sizes.sizes(8)? != [8] => {
            bail!("--op atomic moves 8 bytes: drop --size/--all")
        }
        LatOp::Atomic => vec![8],
        _ => args.sizes.sizes(2)?,
    };
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    paired::check_pingpong_args(&args)?;
    session::raise_memlock();
    let server = match &args.connect.server {
        Some(s) => Some(session::server_addr(s, args.connect.port)?),
        None => None,
    };
    let dev = session::open_device(&args.connect, server, false, Measures::RoundTrips)?;
    let floor = args.paired_with.map(|f| Floor::of(f, dev.engine_kind()));
    let local_ip = dev.ip();
    let pd = dev.alloc_pd();
    let max = *sizes.iter().max().expect("at least one size");
    let half = align8(max) + 8;
    let region_len = 2 * (ZONE_GAP + half);
    let remote_access =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let target = pd.alloc_mr(region_len, remote_access)?;
    let source = pd.alloc_mr(region_len, Access::LOCAL_WRITE)?;
    let slot_len = max.max(session::DONE_LEN);
    let recv = match args.op {
        LatOp::Send => Some(pd.alloc_mr(slot_len * RECV_SLOTS, Access::LOCAL_WRITE)?),
        _ => None,
    };
    // The server's memory is what READs return: a fixed pattern the client can check.
    let read_pattern = pattern::make(0, max);
    if server.is_none() && args.op == LatOp::Read {
        target.write(0, &read_pattern);
    }
    if !args.verify {
        source.write(0, &pattern::make(0, region_len));
    }
    let announce = Announce {
        tool: "pingpong".into(),
        options: args.agreed(&sizes),
        regions: vec![Remote::of(&target)],
    };
    let session = Session::connect(
        &dev,
        &pd,
        Setup {
            args: &args.connect,
            server,
            qps: 1,
            cq_depth: 64 + RECV_SLOTS,
            send_depth: 16,
            recv_depth: RECV_SLOTS + 4,
            // SEND runs receive DONE in a data slot: receives are consumed in posted order.
            control_recvs: args.op != LatOp::Send,
            message_crc: false,
            announce,
        },
    )?;
    let peer = session.peer_region()?;
    let one_write = match dev.progress_mode() {
        EngineProgress::Caller => usize::MAX,
        EngineProgress::Thread => ONE_WRITE_THREAD,
    };
    let mut run = Run {
        op: args.op,
        one_write,
        verify: args.verify,
        timeout: session.timeout,
        session,
        buf: Buffers {
            target,
            source,
            half,
            recv,
            slot_len,
        },
        peer,
        read_pattern: &read_pattern,
        adds: 0,
        prepared: None,
        sent_through: 0,
        received: None,
        scratch: Vec::new(),
    };
    if let Some(recv) = &run.buf.recv {
        for slot in 0..RECV_SLOTS {
            run.session.links[0].qp.post_recv(&[RecvWr {
                wr_id: slot as u64,
                local: recv.sge(slot * slot_len, slot_len),
            }])?;
        }
    }
    session::start_measuring();
    let op_name = format!("{:?}", args.op).to_lowercase();
    let engine = dev.engine_kind().name();
    let json = args.connect.json;
    let one_way = match args.op {
        LatOp::Write | LatOp::Send => 2.0,
        LatOp::Read | LatOp::Atomic => 1.0,
    };
    if server.is_some() {
        report::latency_header(json);
    }
    let mut seq = 0u64;
    for &size in &sizes {
        let total = args.warmup + args.iters;
        let mut samples = Samples::with_capacity(args.iters as usize);
        let mut progress = Progress::new(size, total);
        let plan = Plan {
            warmup: args.warmup,
            iters: args.iters,
            block: args.block,
        };
        let mut turns = Turns {
            run: &mut run,
            size,
            seq: &mut seq,
            done: 0,
            total,
            progress: &mut progress,
        };
        let mut record = |rtt: Duration| samples.record(rtt.as_nanos() as u64);
        // Alone, or in turn with the floor (`--paired-with`); only the client measures.
        let result = match (server, floor) {
            (Some(_), None) => run_alone(&mut turns, plan, &mut record).map(|()| None),
            (None, None) => serve_alone(&mut turns, plan).map(|()| None),
            (Some(server), Some(floor)) => paired::pinger(floor, local_ip, server, size)
                .and_then(|mut f| run_client(&mut turns, f.as_mut(), plan, &mut record))
                .map(|p| Some(PairedLine::new(floor, args.block, &p, one_way))),
            (None, Some(floor)) => paired::echoer(floor, local_ip, args.connect.port, size)
                .and_then(|mut f| run_server(&mut turns, f.as_mut(), plan))
                .map(|()| None),
        };
        let (paired_line, stopped) = match result {
            Ok(line) => (line, None),
            Err(e) => (None, Some(e)),
        };
        if let Some(l) = samples.summary(one_way) {
            report::latency_line(
                json,
                &op_name,
                engine,
                size,
                &l,
                args.verify,
                paired_line.as_ref(),
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
    run.finish()
}

/// One size's ping-pong of tbrdma, one round trip at a time, driven alone or, with
/// `--paired-with`, in turn with the floor's (the schedule is `tbrdma_floors::pairing`'s).
struct Turns<'r, 'a> {
    run: &'r mut Run<'a>,
    size: usize,
    /// The run's message counter, which both sides advance once per round trip of tbrdma.
    seq: &'r mut u64,
    /// Round trips of this size so far, and in all (warm-up included).
    done: u64,
    total: u64,
    progress: &'r mut Progress,
}

impl Turns<'_, '_> {
    /// Starts the next round trip: its message number.
    fn next(&mut self) -> anyhow::Result<u64> {
        if session::interrupted() {
            return Err(Interrupted.into());
        }
        *self.seq += 1;
        Ok(*self.seq)
    }

    fn finished_one(&mut self) {
        self.done += 1;
        self.progress.tick(self.done);
    }
}

impl Pinger for Turns<'_, '_> {
    fn round_trip(&mut self, _warming: bool) -> anyhow::Result<Duration> {
        let seq = self.next()?;
        let rtt = self.run.client_iteration(self.size, seq, self.done)?;
        self.finished_one();
        Ok(rtt)
    }
}

impl Echoer for Turns<'_, '_> {
    fn echo(&mut self) -> anyhow::Result<()> {
        let seq = self.next()?;
        let more = self.done + 1 < self.total;
        self.run.server_iteration(self.size, seq, self.done, more)?;
        self.finished_one();
        Ok(())
    }
}

impl Run<'_> {
    fn link(&mut self) -> &mut session::Link {
        &mut self.session.links[0]
    }

    fn client_iteration(&mut self, size: usize, seq: u64, i: u64) -> anyhow::Result<Duration> {
        match self.op {
            LatOp::Write | LatOp::Send => {
                self.prepare(size, seq)?;
                let start = Instant::now();
                // The answer can only come once this message is out.
                self.lend(size, seq)?;
                self.send_message(size, seq)?;
                self.wait_message(size, seq, i)?;
                let elapsed = start.elapsed();
                self.after_answer(size, seq)?;
                Ok(elapsed)
            }
            LatOp::Read => {
                if self.verify {
                    self.buf.source.write(0, &vec![0u8; size]);
                }
                let start = Instant::now();
                let wr = SendWr {
                    wr_id: seq,
                    local: self.buf.source.sge(0, size),
                    op: SendOp::Read {
                        remote: self.peer.at(0),
                    },
                };
                self.link().qp.post_send(&[wr])?;
                self.wait_send_completion(seq, size, i)?;
                let elapsed = start.elapsed();
                if self.verify {
                    let mut got = vec![0u8; size];
                    self.buf.source.read(0, &mut got);
                    if let Some(at) = got.iter().zip(self.read_pattern).position(|(a, b)| a != b) {
                        bail!(
                            "verification failed at byte {at} of iteration {i} ({size}-byte READ)"
                        );
                    }
                }
                Ok(elapsed)
            }
            LatOp::Atomic => {
                let start = Instant::now();
                let wr = SendWr {
                    wr_id: seq,
                    local: self.buf.source.sge(0, 8),
                    op: SendOp::FetchAdd {
                        remote: self.peer.at(0),
                        add: 1,
                    },
                };
                self.link().qp.post_send(&[wr])?;
                self.wait_send_completion(seq, size, i)?;
                let elapsed = start.elapsed();
                let got = self.buf.source.load_u64(0);
                if self.verify && got != self.adds {
                    bail!(
                        "verification failed at byte 0 of iteration {i}: FETCH_ADD returned {got}, expected {}",
                        self.adds
                    );
                }
                self.adds += 1;
                Ok(elapsed)
            }
        }
    }

    /// One message answered; `more`: another of this size follows.
    fn server_iteration(
        &mut self,
        size: usize,
        seq: u64,
        i: u64,
        more: bool,
    ) -> anyhow::Result<()> {
        match self.op {
            LatOp::Write | LatOp::Send => {
                self.prepare(size, seq)?;
                self.wait_message(size, seq, i)?;
                // The client sends the next message only once it has this answer. (The first
                // message of a size may arrive before the server could lend: it is copied.)
                if more {
                    self.lend(size, seq + 1)?;
                }
                self.send_message(size, seq)?;
                self.after_answer(size, seq)
            }
            // The client does all the work; the server's engine serves it from `finish`.
            LatOp::Read | LatOp::Atomic => Ok(()),
        }
    }

    /// With `--verify`, writes the pattern of message `seq` into its source half, once the
    /// request that last sent from that half (`seq - 2`) has completed (so a retransmission of
    /// it never carries the new bytes). Outside the timed part.
    // (Inlined, as `after_answer` is: without `--verify` a round trip makes no call here.)
    #[inline(always)]
    fn prepare(&mut self, size: usize, seq: u64) -> anyhow::Result<()> {
        if !self.verify || self.prepared == Some((seq, size)) {
            return Ok(());
        }
        self.write_pattern(size, seq)
    }

    fn write_pattern(&mut self, size: usize, seq: u64) -> anyhow::Result<()> {
        let mut watch = Watch::new(self.timeout);
        // The peer's next message may come meanwhile: kept for the timed part.
        let mut others = Vec::new();
        while self.sent_through + 2 < seq {
            match self.link().next()? {
                Some(wc) if self.note_sent(&wc) => watch.progressed(),
                Some(wc) => others.push(wc),
                None => watch.check(|| format!("waiting to reuse the buffer of message {seq}"))?,
            }
        }
        for wc in others.into_iter().rev() {
            self.link().unpoll(wc);
        }
        let at = self.buf.at(seq);
        let mut bytes = std::mem::take(&mut self.scratch);
        bytes.resize(size, 0);
        pattern::fill(seq, size, &mut bytes);
        self.buf.source.write(at, &bytes);
        self.scratch = bytes;
        self.prepared = Some((seq, size));
        Ok(())
    }

    /// Records a completion of this side's own WRITE or SEND; false for anything else.
    fn note_sent(&mut self, wc: &WorkCompletion) -> bool {
        let own = matches!(wc.opcode, WcOpcode::RdmaWrite | WcOpcode::Send)
            && wc.wr_id & session::CONTROL == 0;
        if own {
            self.sent_through = self.sent_through.max(wc.wr_id);
        }
        own
    }

    /// After this side has answered (server) or timed (client) message `seq`: checks the
    /// received message in place, hands its receive slot back, and prepares the next message.
    #[inline(always)]
    fn after_answer(&mut self, size: usize, seq: u64) -> anyhow::Result<()> {
        if let Some(r) = self.received.take() {
            // (A WRITE run without `--verify` has nothing to check and no slot to repost.)
            if self.verify || r.slot.is_some() {
                self.check(r)?;
            }
        }
        self.prepare(size, seq + 1)
    }

    /// Checks a received message against its pattern (`--verify`) and reposts its slot.
    fn check(&mut self, r: Received) -> anyhow::Result<()> {
        let (region, at, what) = match r.slot {
            Some(slot) => (
                self.buf
                    .recv
                    .as_ref()
                    .expect("send runs have receive slots"),
                slot * self.buf.slot_len,
                "SEND",
            ),
            None => (&self.buf.target, self.buf.at(r.seq), "WRITE"),
        };
        if self.verify {
            // The peer's seq equals ours: both advance it once per iteration.
            let bad = pattern::first_mismatch_in(region, at, r.seq, r.size, 0);
            if let Some(byte) = bad {
                bail!(
                    "verification failed at byte {byte} of iteration {} ({}-byte {what})",
                    r.iteration,
                    r.size
                );
            }
        }
        if let Some(slot) = r.slot {
            let wr = RecvWr {
                wr_id: slot as u64,
                local: region.sge(at, self.buf.slot_len),
            };
            self.link().qp.post_recv(&[wr])?;
        }
        Ok(())
    }

    /// `--op write`: lends the target half of the peer's message `seq` to the engine as a
    /// landing zone (`QueuePair::expect_write`), so that the sockets engine receives the
    /// WRITE's first datagram straight into it; [`Self::wait_message`] reads the half only once
    /// the loan has ended. Called only before the peer can have sent that message (this side
    /// has not answered the message before it yet), since a zone lent over a message already
    /// there could be overwritten by the next datagram. A refused loan changes nothing.
    fn lend(&mut self, size: usize, seq: u64) -> anyhow::Result<()> {
        if self.op != LatOp::Write {
            return Ok(());
        }
        // The zone names the WRITE exactly: payload, padding and counter when they go as one,
        // else the payload (the counter follows as a WRITE of its own).
        let one = align8(size) + 8;
        let len = if one <= self.one_write { one } else { size };
        let qp = &self.session.links[0].qp;
        // (Where every loan would be refused, as on the packet and io_uring engines, asking
        // cost a lock of the engine's state per message.)
        if qp.lends_zones(len) {
            qp.expect_write(&self.buf.target, self.buf.at(seq), len, 0)?;
        }
        Ok(())
    }

    /// WRITE (payload + counter) or SEND message `seq` from its source half.
    fn send_message(&mut self, size: usize, seq: u64) -> anyhow::Result<()> {
        let base = self.buf.at(seq);
        let counter_at = align8(size);
        // (An array, not a Vec: an allocation per message showed in the tool's profile.)
        let (wrs, count) = match self.op {
            LatOp::Send => {
                let wr = SendWr {
                    wr_id: seq,
                    local: self.buf.source.sge(base, size),
                    op: SendOp::Send { imm: None },
                };
                ([wr, wr], 1)
            }
            _ if counter_at + 8 <= self.one_write => {
                self.buf.source.write(base + counter_at, &seq.to_le_bytes());
                let wr = SendWr {
                    wr_id: seq,
                    local: self.buf.source.sge(base, counter_at + 8),
                    op: SendOp::Write {
                        remote: self.peer.at(base),
                    },
                };
                ([wr, wr], 1)
            }
            _ => {
                self.buf.source.write(base + counter_at, &seq.to_le_bytes());
                let payload = SendWr {
                    wr_id: seq,
                    local: self.buf.source.sge(base, size),
                    op: SendOp::Write {
                        remote: self.peer.at(base),
                    },
                };
                let counter = SendWr {
                    wr_id: seq,
                    local: self.buf.source.sge(base + counter_at, 8),
                    op: SendOp::Write {
                        remote: self.peer.at(base + counter_at),
                    },
                };
                ([payload, counter], 2)
            }
        };
        self.link().qp.post_send(&wrs[..count])?;
        Ok(())
    }

    /// Busy-polls for message `seq` from the peer (counter word or receive); what it received
    /// is checked later, by [`Run::after_answer`].
    fn wait_message(&mut self, size: usize, seq: u64, i: u64) -> anyhow::Result<()> {
        let mut watch = Watch::new(self.timeout);
        let what = || format!("waiting for iteration {i} of the {size}-byte run");
        let counter_at = self.buf.at(seq) + align8(size);
        loop {
            if self.op == LatOp::Write
                && !self.session.links[0].qp.lending()
                && self.buf.target.load_u64(counter_at) == seq
            {
                self.received = Some(Received {
                    seq,
                    size,
                    iteration: i,
                    slot: None,
                });
                break;
            }
            match self.link().next()? {
                Some(wc) if wc.opcode == WcOpcode::Recv => {
                    if wc.imm == Some(DONE_IMM) {
                        bail!(
                            "the peer ended the run early, in iteration {i} of the {size}-byte run"
                        );
                    }
                    if wc.byte_len as usize != size {
                        bail!(
                            "verification failed at byte {} of iteration {i}: received {} bytes, expected {size}",
                            wc.byte_len.min(size as u64),
                            wc.byte_len
                        );
                    }
                    self.received = Some(Received {
                        seq,
                        size,
                        iteration: i,
                        slot: Some(wc.wr_id as usize),
                    });
                    break;
                }
                Some(wc) => {
                    self.note_sent(&wc);
                    watch.progressed()
                }
                None => watch.check(what)?,
            }
        }
        Ok(())
    }

    /// Waits for the completion of this side's request `wr_id`.
    fn wait_send_completion(&mut self, wr_id: u64, size: usize, i: u64) -> anyhow::Result<()> {
        let mut watch = Watch::new(self.timeout);
        loop {
            match self.link().next()? {
                Some(wc) if wc.wr_id == wr_id && wc.opcode != WcOpcode::Recv => return Ok(()),
                Some(_) => watch.progressed(),
                None => watch.check(|| format!("in iteration {i} of the {size}-byte run"))?,
            }
        }
    }

    /// Client: sends DONE and waits until it is delivered. Server: waits for DONE.
    fn finish(mut self) -> anyhow::Result<()> {
        if !self.session.is_server {
            self.session.send_done(0, [0; session::DONE_WORDS])?;
            let mut watch = Watch::new(self.timeout);
            loop {
                match self.link().next()? {
                    Some(wc) if wc.wr_id == session::CONTROL && wc.opcode == WcOpcode::Send => {
                        break;
                    }
                    Some(_) => watch.progressed(),
                    None => watch.check(|| "ending the run".to_string())?,
                }
            }
        } else {
            // For read and atomic runs the client works alone; its requests keep the
            // connection alive, and a client that goes away fails it (a flushed receive).
            loop {
                match self.link().next()? {
                    Some(wc) if wc.opcode == WcOpcode::Recv && wc.imm == Some(DONE_IMM) => break,
                    Some(_) => {}
                    None if session::interrupted() => return Err(Interrupted.into()),
                    None => {}
                }
            }
            eprintln!("served one run");
        }
        self.session.linger();
        Ok(())
    }
}

/// Progress on stderr for runs longer than a couple of seconds.
struct Progress {
    size: usize,
    total: u64,
    start: Instant,
    last: Instant,
}

impl Progress {
    fn new(size: usize, total: u64) -> Progress {
        let now = Instant::now();
        Progress {
            size,
            total,
            start: now,
            last: now,
        }
    }

    #[inline(always)]
    fn tick(&mut self, done: u64) {
        if done % 64 != 0 {
            return;
        }
        self.print_if_due(done);
    }

    fn print_if_due(&mut self, done: u64) {
        let now = Instant::now();
        if now - self.start >= Duration::from_secs(2) && now - self.last >= Duration::from_secs(1) {
            self.last = now;
            eprintln!("  {} bytes: {done}/{} iterations", self.size, self.total);
        }
    }
}
