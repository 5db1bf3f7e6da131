//! The tbrdma cases, in caller progress mode: no engine thread, the one thread of each process
//! busy-polls its completion queue, which is also what runs the engine.
//!
//! - SEND ping-pong: receives are pre-posted on both sides; the client SENDs, spins until the
//!   echo's receive completes and reposts that receive; the server does the same and echoes.
//!   Each side reposts after it answered (the client: after the round trip's clock stopped),
//!   as `tbrdma pingpong --op send` does: 15 more receives stay posted meanwhile, so the repost
//!   is not on the round trip's path.
//! - WRITE ping-pong (perftest `ib_write_lat`): each side WRITEs into the other's region and
//!   spins on the last 8 bytes of its own region, which carry the iteration number. It lends
//!   that region to the engine first (`QueuePair::expect_write`: the sockets engine receives
//!   the first datagram of the message into it) and reads it only once the loan has ended
//!   (`QueuePair::lending`).
//! - WRITE bandwidth: 1 MiB WRITEs, 32 outstanding, one direction; a final SEND tells the
//!   server to stop.
//!
//! Each ping-pong runs in lockstep with its floor in the same two processes
//! ([`tbrdma_floors::pairing`]): the client reports its round trips and its ratios to the floor.
//!
//! Regions are announced as connection private data: address (u64) then rkey (u32).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use tbrdma_floors::check_stall;
use tbrdma_floors::frames::{FrameEchoer, FramePinger};
use tbrdma_floors::pairing::{Echoer, Pinger, run_client, run_server};
use tbrdma_floors::udp::{UdpEchoer, UdpPinger};
use tbrdma_verbs::*;

use crate::Bench;
use crate::child::{ChildArgs, Measured, RoundTrips, ready};

/// Receives pre-posted on each side of the SEND ping-pong.
const RECV_SLOTS: usize = 16;
/// Message size of the bandwidth case.
const BW_MESSAGE: usize = 1 << 20;
/// WRITEs in flight in the bandwidth case.
const BW_DEPTH: usize = 32;
/// How long a server keeps polling after its last message, so that its acknowledgements and
/// any retransmission still go out before it closes.
const LINGER: Duration = Duration::from_millis(200);
/// Longest a server waits for its client.
const ACCEPT_WAIT: Duration = Duration::from_secs(30);

fn engine_of(args: &ChildArgs) -> EngineKind {
    match args.case.bench {
        Bench::Send(e) | Bench::Write(e) | Bench::WriteBandwidth(e) => e,
        _ => EngineKind::Uring,
    }
}

fn open(args: &ChildArgs) -> anyhow::Result<Device> {
    let config = DeviceConfig {
        engine: EngineConfig {
            engine: engine_of(args),
            progress: Progress::Caller,
            ..EngineConfig::default()
        },
        port: 0,
    };
    let dev = Device::open(&args.ip.to_string(), config).context("opening the device")?;
    if let Some(why) = dev.engine_fallback() {
        // Measuring one backend under the other's name would be a lie.
        bail!("{why}");
    }
    Ok(dev)
}

fn announce(mr: &MemoryRegion) -> Vec<u8> {
    let mut data = mr.addr().to_le_bytes().to_vec();
    data.extend_from_slice(&mr.rkey().to_le_bytes());
    data
}

fn announced(data: &[u8]) -> anyhow::Result<RemoteAddr> {
    ensure!(
        data.len() >= 12,
        "peer sent {} bytes of private data",
        data.len()
    );
    Ok(RemoteAddr {
        addr: u64::from_le_bytes(data[..8].try_into()?),
        rkey: u32::from_le_bytes(data[8..12].try_into()?),
    })
}

/// Listens on the server address, says `ready`, accepts one connection.
fn serve(
    args: &ChildArgs,
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    private_data: Vec<u8>,
) -> anyhow::Result<Connected> {
    let listener = Listener::bind_addr(pd.device(), args.server_addr).context("listening")?;
    ready();
    let opts = QpOptions {
        private_data,
        ..QpOptions::default()
    };
    listener
        .accept(pd, cq, cq, &opts, Some(ACCEPT_WAIT))
        .context("accepting")
}

fn dial(
    args: &ChildArgs,
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    private_data: Vec<u8>,
) -> anyhow::Result<Connected> {
    let opts = QpOptions {
        private_data,
        ..QpOptions::default()
    };
    let server: SocketAddr = args.server_addr;
    connect(pd, server, cq, cq, &opts).with_context(|| format!("connecting to {server}"))
}

/// Prints the client's protocol counters for the parent (datagrams per round trip tell whether
/// acknowledgements ride on data or cost datagrams of their own; `landed`, how many payloads
/// the engine received straight into their place).
fn report_stats(dev: &Device, qp: &QueuePair) {
    let s = qp.stats();
    println!(
        "STATS sent={} received={} acks={} retransmits={} timeouts={} rnr_naks={} duplicates={} \
         dropped={} seq_naks={} landed={}",
        s.packets_sent,
        s.packets_received,
        s.acks_sent,
        s.retransmits,
        s.timeouts,
        s.rnr_naks_sent,
        s.duplicates,
        s.out_of_order_dropped + s.corrupted + s.malformed + s.foreign,
        s.seq_naks_sent,
        dev.engine_stats().landed_in_place
    );
}

/// Polls once; fails on any unsuccessful completion. Returns how many completions arrived.
fn poll(cq: &CompletionQueue, buf: &mut [Completion]) -> anyhow::Result<usize> {
    let n = cq.poll(buf).context("polling the completion queue")?;
    for c in &buf[..n] {
        ensure!(
            c.wc.status == WcStatus::Success,
            "{:?} request {} completed with {:?}",
            c.wc.opcode,
            c.wc.wr_id,
            c.wc.status
        );
    }
    Ok(n)
}

/// Polls until no send is outstanding. Receives still posted may complete as flushed
/// meanwhile: the peer, done, closes the connection.
fn drain_sends(cq: &CompletionQueue, outstanding: &mut u64) -> anyhow::Result<()> {
    let mut buf = [Completion::default(); 64];
    let since = Instant::now();
    while *outstanding > 0 {
        let n = cq.poll(&mut buf).context("polling the completion queue")?;
        for c in buf[..n].iter().filter(|c| !is_receive(c.wc.opcode)) {
            ensure!(
                c.wc.status == WcStatus::Success,
                "{:?} request {} completed with {:?}",
                c.wc.opcode,
                c.wc.wr_id,
                c.wc.status
            );
            *outstanding -= 1;
        }
        check_stall(since, "waiting for the last sends to complete")?;
    }
    Ok(())
}

/// Keeps the engine running for [`LINGER`].
fn linger(cq: &CompletionQueue) {
    let mut buf = [Completion::default(); 64];
    let until = Instant::now() + LINGER;
    while Instant::now() < until {
        let _ = cq.poll(&mut buf);
    }
}

fn is_receive(op: WcOpcode) -> bool {
    matches!(op, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm)
}

fn post_recv_slot(qp: &QueuePair, rx: &MemoryRegion, slot: u64, size: usize) -> anyhow::Result<()> {
    qp.post_recv(&[RecvWr {
        wr_id: slot,
        local: rx.sge(slot as usize * size, size),
    }])
    .context("posting a receive")
}

/// Spins until one receive completes. Returns its slot (its `wr_id`, for the caller to repost)
/// and its length.
fn await_receive(
    cq: &CompletionQueue,
    sends_outstanding: &mut u64,
) -> anyhow::Result<(u64, usize)> {
    let mut buf = [Completion::default(); 16];
    let since = Instant::now();
    let mut received = None;
    let mut idle = 0u32;
    while received.is_none() {
        let n = poll(cq, &mut buf)?;
        for c in &buf[..n] {
            if is_receive(c.wc.opcode) {
                received = Some((c.wc.wr_id, c.wc.byte_len as usize));
            } else {
                *sends_outstanding -= 1;
            }
        }
        if n == 0 {
            idle += 1;
            if idle % 4096 == 0 {
                check_stall(since, "waiting for a message")?;
            }
        }
    }
    Ok(received.unwrap_or_default())
}

/// The floor a tbrdma ping-pong's server runs in lockstep with it ([`tbrdma_floors::pairing`]), bound
/// before the server says it is ready.
fn floor_echoer(args: &ChildArgs) -> anyhow::Result<Box<dyn Echoer>> {
    let addr = args.floor_addr()?;
    Ok(match Bench::floor_of(engine_of(args)) {
        Bench::FrameFloor => Box::new(FrameEchoer::open(addr, args.case.size)?),
        _ => Box::new(UdpEchoer::bind(addr, args.case.size)?),
    })
}

/// The client of that floor.
fn floor_pinger(args: &ChildArgs) -> anyhow::Result<Box<dyn Pinger>> {
    let addr = args.floor_addr()?;
    Ok(match Bench::floor_of(engine_of(args)) {
        Bench::FrameFloor => Box::new(FramePinger::open(args.ip, addr, args.case.size)?),
        _ => Box::new(UdpPinger::connect(args.ip, addr, args.case.size)?),
    })
}

/// One side of the SEND ping-pong: its queue pair, its source buffer and its receive slots.
struct SendSide {
    qp: QueuePair,
    cq: CompletionQueue,
    tx: MemoryRegion,
    rx: MemoryRegion,
    size: usize,
    sends: u64,
    next: u64,
}

impl SendSide {
    /// Allocates the buffers, connects (`serve` or `dial`) and posts every receive slot.
    fn connect(
        args: &ChildArgs,
        dev: &Device,
        connect: fn(
            &ChildArgs,
            &ProtectionDomain,
            &CompletionQueue,
            Vec<u8>,
        ) -> anyhow::Result<Connected>,
    ) -> anyhow::Result<SendSide> {
        let pd = dev.alloc_pd();
        let cq = dev.create_cq(4096);
        let size = args.case.size;
        let tx = pd.alloc_mr(size, Access::LOCAL_WRITE)?;
        let rx = pd.alloc_mr(size * RECV_SLOTS, Access::LOCAL_WRITE)?;
        let conn = connect(args, &pd, &cq, Vec::new())?;
        let qp = conn.qp;
        for slot in 0..RECV_SLOTS as u64 {
            post_recv_slot(&qp, &rx, slot, size)?;
        }
        Ok(SendSide {
            qp,
            cq,
            tx,
            rx,
            size,
            sends: 0,
            next: 0,
        })
    }

    /// SENDs `len` bytes.
    fn send(&mut self, len: usize) -> anyhow::Result<()> {
        self.qp.post_send(&[SendWr {
            wr_id: self.next,
            local: self.tx.sge(0, len),
            op: SendOp::Send { imm: None },
        }])?;
        self.next += 1;
        self.sends += 1;
        Ok(())
    }

    /// Waits for the next message; returns its slot and length.
    fn receive(&mut self) -> anyhow::Result<(u64, usize)> {
        await_receive(&self.cq, &mut self.sends)
    }

    /// Posts receive slot `slot` again.
    fn repost(&self, slot: u64) -> anyhow::Result<()> {
        post_recv_slot(&self.qp, &self.rx, slot, self.size)
    }
}

impl Pinger for SendSide {
    /// SEND posted → echo received (and its receive reposted).
    fn round_trip(&mut self, _warming: bool) -> anyhow::Result<Duration> {
        let start = Instant::now();
        self.send(self.size)?;
        let (slot, len) = self.receive()?;
        let rtt = start.elapsed();
        ensure!(len == self.size, "echo of {len} bytes for {}", self.size);
        self.repost(slot)?;
        Ok(rtt)
    }
}

impl Echoer for SendSide {
    fn echo(&mut self) -> anyhow::Result<()> {
        let (slot, len) = self.receive()?;
        self.send(len)?;
        self.repost(slot)
    }
}

/// SEND ping-pong, server side: echoes every message, and its floor's in between.
pub fn send_server(args: &ChildArgs) -> anyhow::Result<()> {
    let mut floor = floor_echoer(args)?;
    let dev = open(args)?;
    let mut side = SendSide::connect(args, &dev, serve)?;
    run_server(&mut side, floor.as_mut(), args.plan())?;
    drain_sends(&side.cq, &mut side.sends)?;
    linger(&side.cq);
    Ok(())
}

/// SEND ping-pong, client side, paired with its floor.
pub fn send_client(args: &ChildArgs) -> anyhow::Result<Measured> {
    let dev = open(args)?;
    let mut side = SendSide::connect(args, &dev, dial)?;
    let mut floor = floor_pinger(args)?;
    let mut rtts = RoundTrips::new();
    let paired = run_client(&mut side, floor.as_mut(), args.plan(), &mut |rtt| {
        rtts.record(rtt)
    })?;
    drain_sends(&side.cq, &mut side.sends)?;
    report_stats(&dev, &side.qp);
    Ok(Measured::Paired(rtts, paired))
}

/// Where a WRITE ping-pong's message lands in its inbox: after room for a datagram's header,
/// so that the inbox can be lent as a landing zone ([`QueuePair::expect_write`]).
const INBOX_AT: usize = SEND_HEADROOM;

/// The inbox of a WRITE ping-pong: the message's bytes after [`INBOX_AT`] bytes of room.
fn alloc_inbox(pd: &ProtectionDomain, size: usize) -> anyhow::Result<MemoryRegion> {
    Ok(pd.alloc_mr(INBOX_AT + size, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?)
}

/// What a WRITE ping-pong side tells its peer: where its message lands.
fn announce_inbox(inbox: &MemoryRegion) -> Vec<u8> {
    let mut data = (inbox.addr() + INBOX_AT as u64).to_le_bytes().to_vec();
    data.extend_from_slice(&inbox.rkey().to_le_bytes());
    data
}

/// WRITE ping-pong state of one side: its own region (the peer writes it), its source buffer
/// and the peer's region.
struct WriteSide {
    qp: QueuePair,
    cq: CompletionQueue,
    inbox: MemoryRegion,
    outbox: MemoryRegion,
    peer: RemoteAddr,
    size: usize,
    sends: u64,
    buf: [Completion; 16],
    /// The number of the last message written.
    seq: u64,
}

impl WriteSide {
    fn seq_offset(&self) -> usize {
        self.size - 8
    }

    /// WRITEs the message carrying `seq` in its last 8 bytes.
    fn write(&mut self, seq: u64) -> anyhow::Result<()> {
        self.outbox.write(self.seq_offset(), &seq.to_le_bytes());
        self.qp.post_send(&[SendWr {
            wr_id: seq,
            local: self.outbox.sge(0, self.size),
            op: SendOp::Write { remote: self.peer },
        }])?;
        self.sends += 1;
        Ok(())
    }

    /// Lends the inbox to the engine for the peer's next message, as a memory-polling
    /// application does to have the sockets engine receive it in place (the other engines
    /// copy it there as usual, and are not asked: see `QueuePair::lends_zones`). A refused
    /// loan (the message partly arrived) changes nothing.
    fn lend(&self) -> anyhow::Result<()> {
        if self.qp.lends_zones(self.size) {
            self.qp.expect_write(&self.inbox, INBOX_AT, self.size, 0)?;
        }
        Ok(())
    }

    /// Spins until the peer's message `seq` has landed, polling the queue (which, in caller
    /// mode, is what places it). The inbox is read only once the engine no longer has it on
    /// loan.
    fn await_seq(&mut self, seq: u64) -> anyhow::Result<()> {
        let since = Instant::now();
        let mut spins = 0u32;
        while self.qp.lending() || self.inbox.load_u64(INBOX_AT + self.seq_offset()) != seq {
            let n = poll(&self.cq, &mut self.buf)?;
            self.sends -= n as u64;
            spins += 1;
            if spins % 4096 == 0 {
                check_stall(since, "waiting for the peer's WRITE")?;
            }
        }
        Ok(())
    }
}

fn write_side(
    args: &ChildArgs,
    pd: &ProtectionDomain,
    cq: CompletionQueue,
    inbox: MemoryRegion,
    conn: Connected,
) -> anyhow::Result<WriteSide> {
    let size = args.case.size;
    ensure!(
        size >= 8 && size % 8 == 0,
        "WRITE ping-pong needs a multiple of 8 bytes"
    );
    Ok(WriteSide {
        peer: announced(&conn.peer_private_data)?,
        qp: conn.qp,
        cq,
        inbox,
        outbox: pd.alloc_mr(size, Access::LOCAL_WRITE)?,
        size,
        sends: 0,
        buf: [Completion::default(); 16],
        seq: 0,
    })
}

impl Pinger for WriteSide {
    /// WRITE `seq` posted → the server's WRITE `seq` seen in our region.
    fn round_trip(&mut self, _warming: bool) -> anyhow::Result<Duration> {
        self.seq += 1;
        let start = Instant::now();
        self.lend()?;
        self.write(self.seq)?;
        self.await_seq(self.seq)?;
        Ok(start.elapsed())
    }
}

impl Echoer for WriteSide {
    /// Answers WRITE `seq` with WRITE `seq`, the inbox lent again for the next one first.
    fn echo(&mut self) -> anyhow::Result<()> {
        self.seq += 1;
        self.await_seq(self.seq)?;
        self.lend()?;
        self.write(self.seq)
    }
}

/// WRITE ping-pong, server side, and its floor's in between.
pub fn write_server(args: &ChildArgs) -> anyhow::Result<()> {
    let mut floor = floor_echoer(args)?;
    let dev = open(args)?;
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(4096);
    let inbox = alloc_inbox(&pd, args.case.size)?;
    let conn = serve(args, &pd, &cq, announce_inbox(&inbox))?;
    let mut side = write_side(args, &pd, cq, inbox, conn)?;
    side.lend()?;
    run_server(&mut side, floor.as_mut(), args.plan())?;
    drain_sends(&side.cq, &mut side.sends)?;
    linger(&side.cq);
    Ok(())
}

/// WRITE ping-pong, client side, paired with its floor.
pub fn write_client(args: &ChildArgs) -> anyhow::Result<Measured> {
    let dev = open(args)?;
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(4096);
    let inbox = alloc_inbox(&pd, args.case.size)?;
    let conn = dial(args, &pd, &cq, announce_inbox(&inbox))?;
    let mut side = write_side(args, &pd, cq, inbox, conn)?;
    let mut floor = floor_pinger(args)?;
    let mut rtts = RoundTrips::new();
    let paired = run_client(&mut side, floor.as_mut(), args.plan(), &mut |rtt| {
        rtts.record(rtt)
    })?;
    drain_sends(&side.cq, &mut side.sends)?;
    report_stats(&dev, &side.qp);
    Ok(Measured::Paired(rtts, paired))
}

/// WRITE bandwidth, server side: a region to be written, kept alive by polling until the
/// client's closing SEND.
pub fn bandwidth_server(args: &ChildArgs) -> anyhow::Result<()> {
    let dev = open(args)?;
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(4096);
    // One message-sized target that every WRITE overwrites, as perftest's ib_write_bw does
    // and as the TCP stream's reader reuses one buffer: the comparison is of transports, not
    // of how much memory each side streams through the caches.
    let target = pd.alloc_mr(BW_MESSAGE, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let rx = pd.alloc_mr(64, Access::LOCAL_WRITE)?;
    let conn = serve(args, &pd, &cq, announce(&target))?;
    post_recv_slot(&conn.qp, &rx, 0, 64)?;
    let mut buf = [Completion::default(); 16];
    let mut last = Instant::now();
    loop {
        let n = poll(&cq, &mut buf)?;
        if buf[..n].iter().any(|c| is_receive(c.wc.opcode)) {
            break;
        }
        // Caller progress places the WRITEs while this polls; no completion shows for them.
        if n > 0 {
            last = Instant::now();
        } else if conn.qp.state() != ConnectionState::Established {
            bail!("connection ended before the closing SEND");
        } else if last.elapsed() > Duration::from_secs(60) {
            bail!("no closing SEND after a minute");
        }
    }
    linger(&cq);
    Ok(())
}

/// WRITE bandwidth, client side: bytes of WRITEs completed between the first post and the
/// last completion.
pub fn bandwidth_client(args: &ChildArgs) -> anyhow::Result<Measured> {
    let dev = open(args)?;
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(4096);
    let src = pd.alloc_mr(BW_MESSAGE, Access::LOCAL_WRITE)?;
    let conn = dial(args, &pd, &cq, Vec::new())?;
    let target = announced(&conn.peer_private_data)?;
    let qp = conn.qp;
    let wr = |n: u64| SendWr {
        wr_id: n,
        local: src.sge(0, BW_MESSAGE),
        op: SendOp::Write { remote: target },
    };
    let mut buf = [Completion::default(); 64];
    let start = Instant::now();
    let first: Vec<SendWr> = (0..BW_DEPTH as u64).map(wr).collect();
    qp.post_send(&first)?;
    let mut posted = BW_DEPTH as u64;
    let mut done = 0u64;
    let mut last = Instant::now();
    while done < posted {
        let n = poll(&cq, &mut buf)?;
        if n == 0 {
            check_stall(last, "waiting for WRITE completions")?;
            continue;
        }
        last = Instant::now();
        done += n as u64;
        if start.elapsed() < args.duration {
            let more: Vec<SendWr> = (posted..posted + n as u64).map(wr).collect();
            qp.post_send(&more)?;
            posted += n as u64;
        }
    }
    let elapsed = start.elapsed();
    qp.post_send(&[SendWr {
        wr_id: u64::MAX,
        local: src.sge(0, 8),
        op: SendOp::Send { imm: None },
    }])?;
    let mut closing = 1;
    drain_sends(&cq, &mut closing)?;
    report_stats(&dev, &qp);
    Ok(Measured::Bandwidth {
        bytes: done * BW_MESSAGE as u64,
        elapsed,
    })
}
