//! One TCP stream: the baseline of bulk transfer, what `iperf3` measures with its defaults. One
//! connection, blocking writes of a block for a while, the reader reading and counting; the time
//! runs until the reader has confirmed every byte (its count comes back once the writer has shut
//! its side down), so nothing still in the socket buffers is counted as moved.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::STALL;

/// What one stream moved, and in how long.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Streamed {
    /// Bytes the reader confirmed.
    pub bytes: u64,
    /// From the first write to the confirmation.
    pub elapsed: Duration,
}

impl Streamed {
    /// MiB per second.
    pub fn mib_per_s(&self) -> f64 {
        self.bytes as f64 / (1024.0 * 1024.0) / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The reader's side: accepts one connection on `listener` (within [`STALL`]), reads it to its
/// end in blocks of `block` bytes, then answers with the byte count. A writer that sends for
/// longer than `lasting` (plus [`STALL`]) fails the stream rather than holding the reader.
pub fn serve_stream(listener: &TcpListener, block: usize, lasting: Duration) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let since = Instant::now();
    let mut stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if since.elapsed() > STALL {
                    bail!("no TCP stream came within {STALL:?}");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e).context("accepting the TCP stream"),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(STALL))?;
    let until = Instant::now() + lasting + STALL;
    let mut buf = vec![0u8; block.max(1)];
    let mut total = 0u64;
    loop {
        match stream.read(&mut buf).context("reading the TCP stream")? {
            0 => break,
            n => total += n as u64,
        }
        if Instant::now() > until {
            bail!("the TCP stream went on past {lasting:?}");
        }
    }
    stream.write_all(&total.to_le_bytes())?;
    Ok(())
}

/// The writer's side: connects to `server` (over the route to it: the cable its address is
/// on), writes blocks of `block` bytes for `duration`, shuts its side down and waits for the
/// reader's count.
pub fn stream(server: SocketAddr, block: usize, duration: Duration) -> anyhow::Result<Streamed> {
    let mut stream = TcpStream::connect_timeout(&server, Duration::from_secs(5))
        .with_context(|| format!("connecting the TCP stream to {server}"))?;
    stream.set_read_timeout(Some(STALL))?;
    let data = vec![0xa5u8; block.max(1)];
    let start = Instant::now();
    while start.elapsed() < duration {
        stream.write_all(&data).context("writing the TCP stream")?;
    }
    stream.shutdown(Shutdown::Write)?;
    let mut count = [0u8; 8];
    stream
        .read_exact(&mut count)
        .context("reading the TCP stream's byte count")?;
    Ok(Streamed {
        bytes: u64::from_le_bytes(count),
        elapsed: start.elapsed(),
    })
}
