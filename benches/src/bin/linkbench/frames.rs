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
//! The frames carry no protocol, so nothing resends them, and the backend drops a frame while
//! the kernel's neighbour table has no entry for its destination (it asks the kernel to
//! resolve it): in a lab just made, the first frame is lost. So each frame's first 8 bytes
//! number it, the server echoes until it has echoed the last number, and during the warm-up
//! the client sends a frame again when its echo is late, ignoring stale echoes. The timed
//! round trips are never resent.

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use tbrdma_engine::io::packet::PacketIo;
use tbrdma_engine::io::{DatagramIo, TxBatch};

use crate::child::{ChildArgs, Measured, RoundTrips, check_stall, ready};

/// Largest datagram of the floor (a UDP datagram's largest payload, as the UDP floor uses).
const MAX_DATAGRAM: usize = 65_507;
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

/// Where [`receive`] copies a frame's datagram.
enum CopyTo<'a> {
    /// Into `batch`, addressed back to its sender: the server's echo.
    Echo(&'a mut TxBatch),
    /// Into a landing buffer: the client's copy of the echo.
    Land(&'a mut [u8]),
}

/// A frame's number, if it is long enough to carry one.
fn seq_of(data: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(data.get(..SEQ_LEN)?.try_into().ok()?))
}

/// Spins on the ring until one frame arrives, copies its datagram out of the ring as `into`
/// says, and returns its length and number. With `patience`, gives up after it (`None`).
fn receive(
    io: &mut PacketIo,
    mut into: CopyTo<'_>,
    what: &str,
    patience: Option<Duration>,
) -> anyhow::Result<Option<(usize, Option<u64>)>> {
    let since = Instant::now();
    let mut polls = 0u32;
    loop {
        let mut got = None;
        io.recv(&mut None, &mut |data: &[u8], from: SocketAddr| {
            if got.is_none() {
                got = Some((data.len(), seq_of(data)));
                match &mut into {
                    CopyTo::Echo(batch) => {
                        if let Some(buf) = batch.next_buf() {
                            buf[..data.len()].copy_from_slice(data);
                            batch.commit(data.len(), from);
                        }
                    }
                    CopyTo::Land(buf) => {
                        let n = data.len().min(buf.len());
                        buf[..n].copy_from_slice(&data[..n]);
                    }
                }
            }
        })
        .context("receiving a frame")?;
        if got.is_some() {
            return Ok(got);
        }
        polls += 1;
        if polls % POLLS_PER_CHECK == 0 {
            if patience.is_some_and(|p| since.elapsed() >= p) {
                return Ok(None);
            }
            check_stall(since, what)?;
        }
        std::hint::spin_loop();
    }
}

/// Echoes every frame until it has echoed the last one (number `total − 1`).
pub fn frame_server(args: &ChildArgs) -> anyhow::Result<()> {
    let mut io = open(args.server_addr)?;
    let mut batch = TxBatch::new(1, MAX_DATAGRAM);
    let last = args.total().saturating_sub(1);
    ready();
    loop {
        let got = receive(
            &mut io,
            CopyTo::Echo(&mut batch),
            "waiting for a frame",
            None,
        )?;
        io.send(&mut batch).context("echoing a frame")?;
        if got.is_some_and(|(_, seq)| seq == Some(last)) {
            return Ok(());
        }
    }
}

/// Sends a frame of the case's size, spins until its echo is back; one round trip each.
pub fn frame_client(args: &ChildArgs) -> anyhow::Result<Measured> {
    let size = args.case.size.min(MAX_DATAGRAM);
    ensure!(
        size >= SEQ_LEN,
        "frames of {size} bytes cannot carry their number"
    );
    // A port of our own for the shim; the socket itself stays unused.
    let mut io = open(SocketAddr::new(args.ip, 0))?;
    io.set_peer(Some(args.server_addr))?;
    let mut out = TxBatch::new(1, MAX_DATAGRAM);
    let mut landing = vec![0u8; MAX_DATAGRAM];
    let mut message = vec![0xa5u8; size];
    let mut rtts = RoundTrips::new();
    for i in 0..args.total() {
        let warming = i < args.warmup;
        message[..SEQ_LEN].copy_from_slice(&i.to_le_bytes());
        let (n, rtt) = 'echoed: loop {
            // Outside the time, as the UDP floor sends from its message in place.
            let buf = out.next_buf().expect("an empty batch has room");
            buf[..size].copy_from_slice(&message);
            out.commit(size, args.server_addr);
            let start = Instant::now();
            io.send(&mut out).context("sending a frame")?;
            loop {
                let patience = warming.then_some(WARMUP_PATIENCE);
                let into = CopyTo::Land(&mut landing);
                match receive(&mut io, into, "waiting for the echo", patience)? {
                    // The second echo of a frame sent twice during the warm-up.
                    Some((_, Some(seq))) if seq < i => continue,
                    Some((n, seq)) => {
                        let rtt = start.elapsed();
                        ensure!(seq == Some(i), "echo of frame {seq:?} for frame {i}");
                        break 'echoed (n, rtt);
                    }
                    // Late: send it again.
                    None => continue 'echoed,
                }
            }
        };
        ensure!(n == size, "echo of {n} bytes for {size}");
        if !warming {
            rtts.record(rtt);
        }
    }
    Ok(Measured::RoundTrips(rtts))
}
