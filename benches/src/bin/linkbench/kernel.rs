//! The kernel baselines: what an application gets from plain sockets over the same veth pair.
//!
//! - The floors alone, one case each: the UDP floor ([`tbrdma_floors::udp`]) and the raw-frame
//!   floor ([`tbrdma_floors::frames`]).
//! - TCP ping-pong: blocking sockets with `TCP_NODELAY`, as most applications use TCP.
//! - TCP stream: one connection, blocking writes of 1 MiB, the reader reading
//!   ([`tbrdma_floors::tcp`]).

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use tbrdma_floors::frames::{FrameEchoer, FramePinger};
use tbrdma_floors::pairing::{Pinger, run_alone, serve_alone};
use tbrdma_floors::udp::{UdpEchoer, UdpPinger};
use tbrdma_floors::{STALL, tcp};

use crate::child::{ChildArgs, Measured, RoundTrips, ready};

/// Echoes every message of the case, busy-polling.
pub fn udp_server(args: &ChildArgs) -> anyhow::Result<()> {
    let mut echoer = UdpEchoer::bind(args.server_addr, args.case.size)?;
    ready();
    serve_alone(&mut echoer, args.plan())
}

/// One round trip per iteration.
pub fn udp_client(args: &ChildArgs) -> anyhow::Result<Measured> {
    let mut pinger = UdpPinger::connect(args.ip, args.server_addr, args.case.size)?;
    alone(&mut pinger, args)
}

/// Echoes every message of the case.
pub fn frame_server(args: &ChildArgs) -> anyhow::Result<()> {
    let mut echoer = FrameEchoer::open(args.server_addr, args.case.size)?;
    ready();
    serve_alone(&mut echoer, args.plan())
}

/// Sends a message of the case's size, spins until all of its echo is back; one round trip
/// each.
pub fn frame_client(args: &ChildArgs) -> anyhow::Result<Measured> {
    let mut pinger = FramePinger::open(args.ip, args.server_addr, args.case.size)?;
    alone(&mut pinger, args)
}

/// A floor's ping-pong run alone, every timed round trip recorded.
fn alone(pinger: &mut dyn Pinger, args: &ChildArgs) -> anyhow::Result<Measured> {
    let mut rtts = RoundTrips::new();
    run_alone(pinger, args.plan(), &mut |rtt| rtts.record(rtt))?;
    Ok(Measured::RoundTrips(rtts))
}

fn accept_one(args: &ChildArgs) -> anyhow::Result<TcpStream> {
    let listener = TcpListener::bind(args.server_addr).context("binding the TCP listener")?;
    ready();
    let (stream, _) = listener.accept().context("accepting")?;
    Ok(stream)
}

fn connect(args: &ChildArgs) -> anyhow::Result<TcpStream> {
    // The parent starts the client only once the server listens.
    TcpStream::connect_timeout(&args.server_addr, Duration::from_secs(5))
        .with_context(|| format!("connecting to {}", args.server_addr))
}

/// Echoes fixed-size messages until the client closes.
pub fn tcp_server(args: &ChildArgs) -> anyhow::Result<()> {
    let mut stream = accept_one(args)?;
    stream.set_nodelay(true)?;
    let mut buf = vec![0u8; args.case.size];
    loop {
        match stream.read_exact(&mut buf) {
            Ok(()) => stream.write_all(&buf)?,
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e).context("reading a message"),
        }
    }
}

/// Writes a message, reads the echo, blocking.
pub fn tcp_client(args: &ChildArgs) -> anyhow::Result<Measured> {
    let mut stream = connect(args)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(STALL))?;
    let msg = vec![0xa5u8; args.case.size];
    let mut buf = vec![0u8; args.case.size];
    let mut rtts = RoundTrips::new();
    for i in 0..args.total() {
        let start = Instant::now();
        stream.write_all(&msg)?;
        stream.read_exact(&mut buf).context("reading the echo")?;
        let rtt = start.elapsed();
        if i >= args.warmup {
            rtts.record(rtt);
        }
    }
    Ok(Measured::RoundTrips(rtts))
}

/// Reads until the client closes, then answers with the byte count.
pub fn stream_server(args: &ChildArgs) -> anyhow::Result<()> {
    let listener = TcpListener::bind(args.server_addr).context("binding the TCP listener")?;
    ready();
    tcp::serve_stream(&listener, args.case.size, args.duration)
}

/// Writes blocks for the case's duration; the time runs until the reader confirms the bytes.
pub fn stream_client(args: &ChildArgs) -> anyhow::Result<Measured> {
    let streamed = tcp::stream(args.server_addr, args.case.size, args.duration)?;
    Ok(Measured::Bandwidth {
        bytes: streamed.bytes,
        elapsed: streamed.elapsed,
    })
}
