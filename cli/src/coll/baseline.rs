//! Baselines for `tbrdma allreduce --transport …`, measured over the same links as tbrdma:
//!
//! - `tcp`: a plain TCP ring all-reduce in the design of MLX's ring backend: `TCP_NODELAY`
//!   sockets to both ring neighbours, reduce-scatter then all-gather, whole segments per step;
//!   nonblocking sockets, busy-polled and yielding when idle, the same terms as tbrdma's
//!   caller progress. It reduces with tbrdma's own kernels, so only the transport differs.
//! - `udp-floor`: the one-way latency of a busy-polling UDP ping-pong of the message between
//!   ranks 0 and 1 (half the round trip): what one exchange costs at the kernel's floor.
//! - `udp-exchange`: ranks 0 and 1 both send the message and then wait for the other's, as a
//!   one-shot all-reduce of two ranks does: the time of the whole exchange (not halved), which
//!   is what the kernel alone costs such an all-reduce (on veth the sender's system call also
//!   delivers into the receiver's socket, so the two sends do not overlap for free).

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use tbrdma_collectives::{DType, Hostfile, ReduceOp, combine, finish_avg};

/// Where this rank is and how to reach its ring neighbours.
pub struct RingAddrs {
    rank: usize,
    world: usize,
    /// This rank's address on the cable to the next rank, and the next rank's address there.
    to_next: (Ipv4Addr, Ipv4Addr),
    /// This rank's address on the cable to the previous rank.
    from_prev: Ipv4Addr,
}

fn link(hf: &Hostfile, rank: usize, peer: usize) -> anyhow::Result<(Ipv4Addr, Ipv4Addr)> {
    hf.ranks[rank]
        .links
        .iter()
        .filter(|l| l.peer == peer)
        .min_by_key(|l| l.rail)
        .map(|l| (l.address, l.peer_address))
        .ok_or_else(|| anyhow!("rank {rank} has no cable to rank {peer}: not a ring"))
}

impl RingAddrs {
    /// Reads the neighbours from the hostfile (same defaults as the communicator).
    pub fn load(hostfile: Option<&PathBuf>, rank: Option<usize>) -> anyhow::Result<RingAddrs> {
        let path = hostfile
            .cloned()
            .or_else(|| std::env::var_os("TBRDMA_HOSTFILE").map(PathBuf::from))
            .ok_or_else(|| anyhow!("no hostfile: pass --hostfile or set TBRDMA_HOSTFILE"))?;
        let rank = rank
            .or_else(|| std::env::var("TBRDMA_RANK").ok()?.parse().ok())
            .ok_or_else(|| anyhow!("no rank: pass --rank or set TBRDMA_RANK"))?;
        let hf = Hostfile::load(&path)?;
        let world = hf.ranks.len();
        if rank >= world || world < 2 {
            bail!("rank {rank} of {world}: the baselines need at least 2 ranks");
        }
        let next = (rank + 1) % world;
        let prev = (rank + world - 1) % world;
        Ok(RingAddrs {
            rank,
            world,
            to_next: link(&hf, rank, next)?,
            from_prev: link(&hf, rank, prev)?.0,
        })
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// World size.
    pub fn world(&self) -> usize {
        self.world
    }
}

/// The TCP ring.
pub struct TcpRing {
    rank: usize,
    world: usize,
    next: TcpStream,
    prev: TcpStream,
    send: Vec<u8>,
    recv: Vec<u8>,
}

impl TcpRing {
    /// Listens for the previous rank and connects to the next one.
    pub fn connect(addrs: &RingAddrs, port: u16, timeout: Duration) -> anyhow::Result<TcpRing> {
        let listener = TcpListener::bind((addrs.from_prev, port))
            .with_context(|| format!("listening on {}:{port}", addrs.from_prev))?;
        let deadline = Instant::now() + timeout;
        let target = SocketAddr::from((addrs.to_next.1, port));
        let next = loop {
            match TcpStream::connect_timeout(&target, timeout) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).with_context(|| format!("connecting to {target}")),
            }
        };
        let (prev, _) = listener.accept().context("accepting the previous rank")?;
        for s in [&next, &prev] {
            s.set_nodelay(true)?;
            s.set_nonblocking(true)?;
        }
        Ok(TcpRing {
            rank: addrs.rank,
            world: addrs.world,
            next,
            prev,
            send: Vec::new(),
            recv: Vec::new(),
        })
    }

    /// Sends `self.send` to the next rank while receiving `self.recv.len()` bytes from the
    /// previous one, busy-polling both.
    fn exchange(&mut self) -> anyhow::Result<()> {
        let (mut sent, mut got) = (0, 0);
        while sent < self.send.len() || got < self.recv.len() {
            let mut moved = false;
            if sent < self.send.len() {
                match self.next.write(&self.send[sent..]) {
                    Ok(n) => {
                        sent += n;
                        moved = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e).context("sending to the next rank"),
                }
            }
            if got < self.recv.len() {
                match self.prev.read(&mut self.recv[got..]) {
                    Ok(0) => bail!("the previous rank closed the connection"),
                    Ok(n) => {
                        got += n;
                        moved = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e).context("receiving from the previous rank"),
                }
            }
            // The same waiting policy as tbrdma's default (yield at once when idle), so that
            // 4 ranks on 2 cores compare on equal terms.
            if !moved {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Ring all-reduce of `buf` in place.
    pub fn all_reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> anyhow::Result<()> {
        let (r, n, es) = (self.rank, self.world, dtype.size());
        let count = buf.len() / es;
        let seg = |k: usize| {
            let (base, rem) = (count / n, count % n);
            let start = k * base + k.min(rem);
            (start * es)..((start + base + usize::from(k < rem)) * es)
        };
        for s in 0..n - 1 {
            let (out, inn) = (seg((r + n - s) % n), seg((r + 2 * n - s - 1) % n));
            self.send.clear();
            self.send.extend_from_slice(&buf[out]);
            self.recv.resize(inn.len(), 0);
            self.exchange()?;
            combine(dtype, op, &mut buf[inn.clone()], &self.recv);
            if op == ReduceOp::Avg && s == n - 2 {
                finish_avg(dtype, &mut buf[inn], n);
            }
        }
        for t in 0..n - 1 {
            let (out, inn) = (seg((r + 1 + n - t) % n), seg((r + n - t) % n));
            self.send.clear();
            self.send.extend_from_slice(&buf[out]);
            self.recv.resize(inn.len(), 0);
            self.exchange()?;
            buf[inn].copy_from_slice(&self.recv);
        }
        Ok(())
    }
}

/// One-way latency (half the median round trip) of a busy-polling UDP ping-pong of `size`
/// bytes between ranks 0 and 1 of a pair or, with `exchange`, the median time of both sending
/// and then receiving; other ranks return `None` at once. `gap` runs after each timed exchange
/// (`--gap-us`: the same compute between calls as the all-reduces get); the ping-pong has none,
/// since a gap on the echoing side would be timed by the other.
pub fn udp_floor(
    addrs: &RingAddrs,
    port: u16,
    size: usize,
    iters: usize,
    exchange: bool,
    gap: &mut dyn FnMut(),
) -> anyhow::Result<Option<f64>> {
    let Some(mut pair) = UdpPair::connect(addrs, port, size)? else {
        return Ok(None);
    };
    if exchange {
        let times = super::CallTimes::new(pair.exchanges(iters, gap)?);
        return Ok((addrs.rank == 0).then(|| times.quantile(0.5)));
    }
    let rtts = super::CallTimes::new(pair.ping_pongs(iters)?);
    Ok((addrs.rank == 0).then(|| rtts.quantile(0.5) / 2.0))
}

/// The busy-polled UDP socket between ranks 0 and 1 that the `udp-floor` and `udp-exchange`
/// baselines use, connected (after a handshake) and kept, so that exchanges can be timed in
/// blocks between blocks of tbrdma's calls (`tbrdma allreduce --paired-with udp-exchange`).
pub struct UdpPair {
    sock: UdpSocket,
    rank: usize,
    msg: Vec<u8>,
    buf: Vec<u8>,
}

impl UdpPair {
    /// The socket of this rank (0 or 1; other ranks get `None`) for messages of `size` bytes,
    /// once the other rank has answered.
    pub fn connect(addrs: &RingAddrs, port: u16, size: usize) -> anyhow::Result<Option<UdpPair>> {
        if addrs.rank > 1 {
            return Ok(None);
        }
        if size > 65_507 {
            bail!("{size} bytes do not fit in one UDP datagram");
        }
        // Rank 0's next is rank 1: both use the cable between them.
        let (local, peer) = if addrs.rank == 0 {
            addrs.to_next
        } else {
            (addrs.from_prev, addrs.to_next.1)
        };
        let sock = UdpSocket::bind((local, port))?;
        sock.connect((peer, port))?;
        sock.set_nonblocking(true)?;
        let mut buf = vec![0u8; 65_536];
        // Handshake: rank 0 pings until rank 1 answers.
        let deadline = Instant::now() + Duration::from_secs(10);
        if addrs.rank == 0 {
            loop {
                sock.send(&[0]).ok();
                std::thread::sleep(Duration::from_millis(10));
                if sock.recv(&mut buf).is_ok_and(|n| n == 1) {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("rank 1 never answered over UDP");
                }
            }
        } else {
            while !sock.recv(&mut buf).is_ok_and(|n| n == 1) {
                if Instant::now() > deadline {
                    bail!("rank 0 never pinged over UDP");
                }
            }
            sock.send(&[0])?;
        }
        Ok(Some(UdpPair {
            sock,
            rank: addrs.rank,
            msg: vec![7u8; size.max(1)],
            buf,
        }))
    }

    /// Waits for a datagram of the message's length (the handshake's are 1 byte of 0).
    fn recv_msg(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.sock.recv(&mut self.buf) {
                Ok(n) if n == self.msg.len() && self.buf[0] == 7 => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        bail!("no UDP answer within 5 s");
                    }
                }
                // The peer's socket may not exist yet: ICMP unreachable shows up here.
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Times `iters` exchanges (send, then receive the other's), `gap` after each; seconds.
    pub fn exchanges(&mut self, iters: usize, gap: &mut dyn FnMut()) -> anyhow::Result<Vec<f64>> {
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let start = Instant::now();
            self.sock.send(&self.msg)?;
            self.recv_msg()?;
            times.push(start.elapsed().as_secs_f64());
            gap();
        }
        Ok(times)
    }

    /// `iters` ping-pongs: rank 0 sends and times the round trip, rank 1 echoes (and returns
    /// no times); seconds.
    pub fn ping_pongs(&mut self, iters: usize) -> anyhow::Result<Vec<f64>> {
        let mut rtts = Vec::with_capacity(iters);
        for _ in 0..iters {
            if self.rank == 0 {
                let start = Instant::now();
                self.sock.send(&self.msg)?;
                self.recv_msg()?;
                rtts.push(start.elapsed().as_secs_f64());
            } else {
                self.recv_msg()?;
                self.sock.send(&self.msg)?;
            }
        }
        Ok(rtts)
    }
}
