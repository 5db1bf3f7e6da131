//! The raw-frame floor: what the packet engine's kernel path allows, with no protocol on it.
//!
//! A busy-polled ping-pong of Ethernet frames of tbrdma's experimental EtherType (0x88B5) over
//! `AF_PACKET`, through the packet engine's own I/O backend
//! ([`tbrdma_engine::io::packet::PacketIo`]): each frame leaves with one `sendmsg` and arrives
//! in the 32-frame `TPACKET_V2` ring the process shares with the kernel, read by polling its
//! status word (no system call). Both ends copy each frame's datagram out of the ring once, as
//! every receiver that delivers data must (the ring frame is handed back to the kernel) and as
//! the engine does when it places a payload into a region: the server into its transmit buffer,
//! which it sends back, the client into a landing buffer, as the UDP floor's `recv` does. That
//! first read of a frame the other CPU's softirq wrote is the costliest pass over it (the
//! client's copy of a 16 KiB echo adds about 2 µs to the round trip on the 2-vCPU test host,
//! docs/performance.md). Everything the packet engine adds on top of this (header, CRC,
//! acknowledgements, completions) is what its ratio to this floor measures.
//!
//! A message larger than one frame (64 KiB: the MTU is 65 520) goes as the fewest frames that
//! carry it ([`crate::datagram_lengths`]), all sent before the first echo is awaited, and
//! the server echoes only once it has them all, as an engine's peer answers only a whole
//! message: the floor moves the same bytes as the engine does, in as few frames as the cable
//! allows.
//!
//! The frames carry no protocol, so nothing resends them, and the backend drops a frame while
//! the kernel's neighbour table has no entry for its destination (it asks the kernel to
//! resolve it): in a lab just made, the first frame is lost. So each frame's first 8 bytes
//! number its message (and the 9th, in a message of several frames, the frame), the server
//! echoes every message it receives whole (a message sent twice, twice), and during the warm-up the client sends a
//! message again when its echo is late, ignoring stale echoes. The timed round trips are never
//! resent.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use tbrdma_engine::io::packet::PacketIo;
use tbrdma_engine::io::{DatagramIo, Received, TxBatch};

use crate::pairing::{Echoer, Pinger};
use crate::{check_stall, datagram_lengths};

/// Largest datagram of the floor (a UDP datagram's largest payload, as the UDP floor uses).
const MAX_DATAGRAM: usize = 65_507;
/// Most frames a message is cut into (64 KiB takes two).
const MAX_FRAMES: usize = 64;
/// Ring polls between clock reads while waiting.
const POLLS_PER_CHECK: u32 = 4096;
/// How long a warm-up frame's echo may take before the frame is sent again (a neighbour
/// resolution on veth takes well under a millisecond).
const WARMUP_PATIENCE: Duration = Duration::from_millis(20);
/// Bytes at the front of every frame that number it (every size measured is at least 8).
const SEQ_LEN: usize = 8;

/// The packet backend on a UDP socket bound to `addr` (which only names the rail: address and
/// port in the frames' shim; it carries nothing).
fn open(addr: SocketAddr) -> anyhow::Result<PacketIo> {
    let socket = UdpSocket::bind(addr).with_context(|| format!("binding {addr}"))?;
    PacketIo::new(socket, MAX_DATAGRAM).context("opening the AF_PACKET socket and its ring")
}

/// Which message a frame belongs to and which of its frames it is: the first 8 bytes number
/// the message, the 9th numbers the frame when there are several.
fn frame_id(data: &[u8], frames: usize) -> Option<(u64, usize)> {
    let seq = u64::from_le_bytes(data.get(..SEQ_LEN)?.try_into().ok()?);
    let index = if frames > 1 {
        usize::from(*data.get(SEQ_LEN)?)
    } else {
        0
    };
    (index < frames).then_some((seq, index))
}

/// Spins on the ring until at least one frame arrives and hands every frame of that poll to
/// `each` (its datagram, still in the ring, and its sender). With `patience`, gives up after it
/// (`false`).
fn receive(
    io: &mut PacketIo,
    each: &mut dyn FnMut(&[u8], SocketAddr),
    what: &str,
    patience: Option<Duration>,
) -> anyhow::Result<bool> {
    let since = Instant::now();
    let mut polls = 0u32;
    loop {
        // (The packet backend delivers every datagram in one piece: `head` is all of it.)
        let mut whole = |datagram: Received<'_>, from| each(datagram.head, from);
        if io
            .recv(&mut None, &mut whole)
            .context("receiving a frame")?
            > 0
        {
            return Ok(true);
        }
        polls += 1;
        if polls % POLLS_PER_CHECK == 0 {
            if patience.is_some_and(|p| since.elapsed() >= p) {
                return Ok(false);
            }
            check_stall(since, what)?;
        }
        std::hint::spin_loop();
    }
}

/// The frames of a message seen so far, one bit each.
fn all_frames(frames: usize) -> u64 {
    if frames >= 64 {
        u64::MAX
    } else {
        (1 << frames) - 1
    }
}

/// The raw-frame floor's server: the packet backend, and the message being gathered.
#[derive(Debug)]
pub struct FrameEchoer {
    io: PacketIo,
    frames: usize,
    batch: TxBatch,
    /// The message being gathered, and which of its frames are in.
    current: Option<u64>,
    have: u64,
    /// The number of the message the next [`Echoer::echo`] waits for.
    expected: u64,
}

impl FrameEchoer {
    /// The backend on `addr`, for messages of `size` bytes.
    pub fn open(addr: SocketAddr, size: usize) -> anyhow::Result<FrameEchoer> {
        let frames = datagram_lengths(size, MAX_DATAGRAM).len();
        ensure!(
            frames <= MAX_FRAMES,
            "{size} B takes more than {MAX_FRAMES} frames"
        );
        Ok(FrameEchoer {
            io: open(addr)?,
            frames,
            batch: TxBatch::new(frames, MAX_DATAGRAM),
            current: None,
            have: 0,
            expected: 0,
        })
    }
}

impl Echoer for FrameEchoer {
    /// Echoes every message once all its frames are in, copying each out of the ring into the
    /// echo, until it has echoed the one it expects (a warm-up message the client sent again
    /// is echoed again).
    fn echo(&mut self) -> anyhow::Result<()> {
        let Self {
            io,
            frames,
            batch,
            current,
            have,
            expected,
        } = self;
        let frames = *frames;
        loop {
            let mut complete = None;
            receive(
                io,
                &mut |data, from| {
                    let Some((seq, index)) = frame_id(data, frames) else {
                        return;
                    };
                    if *current != Some(seq) {
                        // A new message (or the client's resend during the warm-up): start over.
                        batch.clear();
                        *current = Some(seq);
                        *have = 0;
                    }
                    if *have & (1 << index) != 0 {
                        return;
                    }
                    *have |= 1 << index;
                    if let Some(buf) = batch.next_buf() {
                        buf[..data.len()].copy_from_slice(data);
                        batch.commit(data.len(), from);
                    }
                    if *have == all_frames(frames) {
                        complete = Some(seq);
                    }
                },
                "waiting for a frame",
                None,
            )?;
            let Some(seq) = complete else { continue };
            io.send(batch).context("echoing a message")?;
            *current = None;
            if seq == *expected {
                *expected += 1;
                return Ok(());
            }
        }
    }
}

/// The raw-frame floor's client: the packet backend, the message's frames, where the echo
/// lands, and the number of the next message.
#[derive(Debug)]
pub struct FramePinger {
    io: PacketIo,
    server: SocketAddr,
    lengths: Vec<usize>,
    out: TxBatch,
    landing: Vec<u8>,
    message: Vec<u8>,
    next: u64,
}

impl FramePinger {
    /// The backend on `ip` (a port of its own for the shim; the socket itself stays unused),
    /// sending messages of `size` bytes to `server`.
    pub fn open(ip: IpAddr, server: SocketAddr, size: usize) -> anyhow::Result<FramePinger> {
        let lengths = datagram_lengths(size, MAX_DATAGRAM);
        let frames = lengths.len();
        ensure!(
            size >= SEQ_LEN && frames <= MAX_FRAMES,
            "a message of {size} bytes cannot be numbered in at most {MAX_FRAMES} frames"
        );
        let mut io = open(SocketAddr::new(ip, 0))?;
        io.set_peer(Some(server))?;
        Ok(FramePinger {
            io,
            server,
            lengths,
            out: TxBatch::new(frames, MAX_DATAGRAM),
            landing: vec![0u8; size],
            message: vec![0xa5u8; size],
            next: 0,
        })
    }
}

impl Pinger for FramePinger {
    /// Sends the next message, spins until all of its echo is back. While `warming`, a message
    /// whose echo is late is sent again (echoes of the first copy are then stale); a timed
    /// round trip is never resent.
    fn round_trip(&mut self, warming: bool) -> anyhow::Result<Duration> {
        let i = self.next;
        self.next += 1;
        let size = self.message.len();
        let frames = self.lengths.len();
        let rtt = 'echoed: loop {
            // Outside the time, as the UDP floor sends from its message in place.
            let mut at = 0;
            for (index, &len) in self.lengths.iter().enumerate() {
                let buf = self.out.next_buf().expect("the batch has a slot per frame");
                buf[..len].copy_from_slice(&self.message[at..at + len]);
                buf[..SEQ_LEN].copy_from_slice(&i.to_le_bytes());
                if frames > 1 {
                    buf[SEQ_LEN] = index as u8;
                }
                self.out.commit(len, self.server);
                at += len;
            }
            let start = Instant::now();
            self.io.send(&mut self.out).context("sending a message")?;
            let mut have = 0u64;
            while have != all_frames(frames) {
                let patience = warming.then_some(WARMUP_PATIENCE);
                let (lengths, landing) = (&self.lengths, &mut self.landing);
                let mut each = |data: &[u8], _from: SocketAddr| {
                    // Echoes of an earlier message (sent twice during the warm-up) are stale.
                    let Some((_, index)) = frame_id(data, frames).filter(|&(s, _)| s == i) else {
                        return;
                    };
                    let offset: usize = lengths[..index].iter().sum();
                    let n = data.len().min(size - offset);
                    landing[offset..offset + n].copy_from_slice(&data[..n]);
                    have |= 1 << index;
                };
                if !receive(&mut self.io, &mut each, "waiting for the echo", patience)? {
                    // Late: send it again.
                    continue 'echoed;
                }
            }
            break start.elapsed();
        };
        Ok(rtt)
    }
}
