//! Rendezvous, as PyTorch does it: every rank knows only a rank-0 address, its rank and the
//! world size (`TBRDMA_ADDR`, `TBRDMA_RANK`, `TBRDMA_WORLD_SIZE`). Rank 0 listens there and on
//! its cables' addresses (a rank cabled to it may name that one), not on every interface; every
//! other rank connects and sends its host name
//! and its cable addresses (IPv4 interfaces with a prefix of /30 or longer: what
//! `tbrdma setup` gives each cable). Rank 0 pairs addresses that share a subnet into cables,
//! builds the same hostfile `tbrdma hostfile` would, and sends it back; then every rank builds
//! its communicator from it.
//!
//! Rank 0 reads each client on a thread of its own, all within the rendezvous' deadline, with
//! bounded lines and counts: a stranger that connects and says nothing, sends garbage, claims
//! a rank that is taken or a world of another size is told so (when it spoke the protocol) and
//! dropped, and the rendezvous goes on; when it times out, its error names what was refused.
//! Before anything else, both ends run the cluster-secret handshake of `tbrdma-auth`
//! (`CommOptions::auth`, by default `TBRDMA_SECRET`).
//!
//! Wire format (text over TCP, after the handshake): `tbrdma-rendezvous 1 <world> <rank>
//! <host>` then one `<interface> <address> <prefix>` line per address (at most
//! [`MAX_ADDRS`]) and `end`, each line at most [`MAX_LINE`] bytes; the answer is the
//! hostfile's JSON (at most 1 MiB), or a line starting with `error: `.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tbrdma_netdev::hostfile::{HostRecord, Hostfile, RecordLink};
use tbrdma_verbs::Auth;
use tbrdma_verbs::auth::DeadlineStream;

use crate::error::{CollError, Result};

const MAGIC: &str = "tbrdma-rendezvous 1";
/// Longest line of an announcement, newline included.
pub const MAX_LINE: usize = 256;
/// Most address lines in one announcement.
pub const MAX_ADDRS: usize = 64;
/// Longest answer (the hostfile) a rank reads from rank 0.
const MAX_ANSWER: u64 = 1 << 20;
/// Names the side channel in the authentication tags.
const AUTH_CONTEXT: &str = "tbrdma-rendezvous";
/// Refusals rank 0 remembers for its timeout message.
const REMEMBERED_REFUSALS: usize = 4;

fn bad(problem: impl Into<String>, fix: impl Into<String>) -> CollError {
    CollError::BadConfig {
        problem: problem.into(),
        fix: fix.into(),
    }
}

/// One address a rank has on a cable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CableAddr {
    interface: String,
    address: Ipv4Addr,
    prefix: u8,
}

#[derive(Debug, Clone)]
pub(crate) struct Announce {
    pub(crate) world: usize,
    pub(crate) rank: usize,
    pub(crate) host: String,
    pub(crate) addrs: Vec<CableAddr>,
}

fn local_cable_addrs() -> Result<Vec<CableAddr>> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| {
        bad(
            format!("listing interfaces: {e}"),
            "run on Linux with network access",
        )
    })?;
    let mut out = Vec::new();
    for ifa in addrs {
        let Some(sin) = ifa.address.as_ref().and_then(|a| a.as_sockaddr_in()) else {
            continue;
        };
        let Some(mask) = ifa.netmask.as_ref().and_then(|a| a.as_sockaddr_in()) else {
            continue;
        };
        let prefix = u32::from(mask.ip()).count_ones() as u8;
        let address = sin.ip();
        if address.is_loopback() || prefix < 30 {
            continue;
        }
        out.push(CableAddr {
            interface: ifa.interface_name,
            address,
            prefix,
        });
    }
    out.sort_by_key(|a| a.address);
    Ok(out)
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

pub(crate) fn encode(a: &Announce) -> String {
    let mut s = format!("{MAGIC} {} {} {}\n", a.world, a.rank, a.host);
    for c in &a.addrs {
        s += &format!("{} {} {}\n", c.interface, c.address, c.prefix);
    }
    s + "end\n"
}

/// One line (without its newline), at most [`MAX_LINE`] bytes read whatever the peer sends.
fn line(reader: &mut impl BufRead) -> std::result::Result<String, String> {
    let mut bytes = Vec::new();
    reader
        .take(MAX_LINE as u64)
        .read_until(b'\n', &mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.last() != Some(&b'\n') {
        return Err(if bytes.len() >= MAX_LINE {
            format!("a line longer than {MAX_LINE} bytes")
        } else {
            "the announcement ended early".to_string()
        });
    }
    let text = String::from_utf8(bytes).map_err(|_| "a line that is not UTF-8".to_string())?;
    Ok(text.trim_end().to_string())
}

/// Parses an announcement, whatever the peer sends: bounded lines and count, checked names.
pub(crate) fn decode(reader: &mut impl BufRead) -> std::result::Result<Announce, String> {
    let head = line(reader)?;
    // (The version must end where the magic does: "… 12 …" is version 12, not 1 and 2.)
    let rest = head
        .strip_prefix(MAGIC)
        .filter(|rest| rest.is_empty() || rest.starts_with(char::is_whitespace))
        .ok_or("not a tbrdma rendezvous client (or another version)")?;
    let mut f = rest.split_whitespace();
    let mut num = || -> std::result::Result<usize, String> {
        f.next()
            .and_then(|x| x.parse().ok())
            .ok_or_else(|| "malformed rendezvous header".to_string())
    };
    let (world, rank) = (num()?, num()?);
    let host = f.next().unwrap_or("unknown").to_string();
    tbrdma_netdev::names::check_host_name("host name", &host).map_err(|e| e.to_string())?;
    let mut addrs = Vec::new();
    loop {
        let l = line(reader)?;
        if l == "end" {
            break;
        }
        if addrs.len() == MAX_ADDRS {
            return Err(format!("more than {MAX_ADDRS} addresses"));
        }
        let p: Vec<&str> = l.split_whitespace().collect();
        let [interface, address, prefix] = p[..] else {
            return Err(format!("malformed address line {l:?}"));
        };
        tbrdma_netdev::names::check_interface_name(interface).map_err(|e| e.to_string())?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| format!("bad prefix {prefix:?}"))?;
        addrs.push(CableAddr {
            interface: interface.to_string(),
            address: address
                .parse()
                .map_err(|_| format!("bad address {address:?}"))?,
            prefix,
        });
    }
    Ok(Announce {
        world,
        rank,
        host,
        addrs,
    })
}

fn uuid(rank: usize) -> String {
    format!("rendezvous-rank-{rank:05}")
}

fn subnet(a: &CableAddr) -> u32 {
    let mask = if a.prefix >= 32 {
        u32::MAX
    } else {
        !(u32::MAX >> a.prefix)
    };
    u32::from(a.address) & mask
}

/// Builds the hostfile from every rank's announcement (index = rank).
fn build(all: &[Announce]) -> Result<Hostfile> {
    let records: Vec<HostRecord> = all
        .iter()
        .map(|a| {
            let mut links = Vec::new();
            for mine in &a.addrs {
                for other in all.iter().filter(|o| o.rank != a.rank) {
                    for theirs in &other.addrs {
                        if theirs.prefix == mine.prefix
                            && subnet(theirs) == subnet(mine)
                            && theirs.address != mine.address
                        {
                            links.push(RecordLink {
                                interface: mine.interface.clone(),
                                address: mine.address,
                                prefix_len: mine.prefix,
                                peer_uuid: uuid(other.rank),
                                peer_address: theirs.address,
                                rail: 0,
                            });
                        }
                    }
                }
            }
            HostRecord {
                uuid: uuid(a.rank),
                name: a.host.clone(),
                aliases: Vec::new(),
                links,
            }
        })
        .collect();
    let hostfile = Hostfile::from_records(&records).map_err(|e| {
        bad(
            format!("building the cluster from the ranks' addresses: {e}"),
            "check the cables' addresses (`tbrdma doctor`)",
        )
    })?;
    for (i, r) in hostfile.ranks.iter().enumerate() {
        if r.uuid != uuid(i) {
            return Err(bad(
                format!(
                    "the cables put rank {} in position {i} of the ring",
                    r.uuid
                        .trim_start_matches("rendezvous-rank-")
                        .trim_start_matches('0')
                ),
                "number the ranks along the ring (rank k cabled to k-1 and k+1), or use a hostfile",
            ));
        }
    }
    Ok(hostfile)
}

/// Runs the rendezvous and returns the cluster's hostfile.
pub(crate) fn rendezvous(
    addr: SocketAddr,
    rank: usize,
    world: usize,
    timeout: Duration,
    auth: &Auth,
) -> Result<Hostfile> {
    if world == 0 || rank >= world {
        return Err(bad(
            format!("rank {rank} of a world of {world}"),
            "TBRDMA_RANK counts from 0 and must be below TBRDMA_WORLD_SIZE",
        ));
    }
    let me = Announce {
        world,
        rank,
        host: host_name(),
        addrs: local_cable_addrs()?,
    };
    let deadline = Instant::now() + timeout;
    let secret = auth.resolve().map_err(|e| {
        bad(
            format!("rendezvous at {addr}: {e}"),
            "fix the cluster secret's setting",
        )
    })?;
    if rank == 0 {
        serve(addr, me, timeout, deadline, auth)
    } else {
        join(addr, &me, deadline, secret.as_deref())
    }
}

fn io_error(addr: SocketAddr, what: &str, e: std::io::Error) -> CollError {
    bad(
        format!("rendezvous at {addr}: {what}: {e}"),
        "check TBRDMA_ADDR (rank 0's address and a free port) and that rank 0 runs",
    )
}

/// A client rank 0 has heard from: its stream (for the answer) and announcement.
struct Arrival {
    stream: TcpStream,
    from: SocketAddr,
    announce: Announce,
}

/// Reads one client's authentication and announcement, within `deadline`.
fn read_client(
    stream: &TcpStream,
    auth: &Auth,
    deadline: Instant,
) -> std::result::Result<Announce, String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    let secret = auth.resolve().map_err(|e| e.to_string())?;
    let mut io = DeadlineStream::new(stream, deadline);
    tbrdma_verbs::auth::server(&mut io, secret.as_deref(), AUTH_CONTEXT)
        .map_err(|e| e.to_string())?;
    decode(&mut BufReader::new(io))
}

/// Keeps the last few refusals for the timeout's message.
fn remember(refused: &mut Vec<String>, why: String) {
    if refused.len() == REMEMBERED_REFUSALS {
        refused.remove(0);
    }
    refused.push(why);
}

/// Rank 0: listens on `addr`, collects every other rank's announcement, answers them all.
fn serve(
    addr: SocketAddr,
    me: Announce,
    timeout: Duration,
    deadline: Instant,
    auth: &Auth,
) -> Result<Hostfile> {
    let world = me.world;
    // TBRDMA_ADDR is rank 0's own address; ranks cabled to rank 0 may reach it on their own
    // cable's address instead (a mesh has no address every rank can route to). Rank 0 listens
    // on those and nowhere else, never on every interface.
    let listen = |at: SocketAddr| -> Result<TcpListener> {
        let listener = TcpListener::bind(at).map_err(|e| {
            let what = if e.kind() == std::io::ErrorKind::AddrNotAvailable {
                "listening (rank 0 listens on TBRDMA_ADDR, which must be an address of rank 0's host)"
            } else {
                "listening"
            };
            io_error(at, what, e)
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_error(at, "listening", e))?;
        Ok(listener)
    };
    let mut listeners = vec![listen(addr)?];
    if !addr.ip().is_unspecified() {
        for cable in &me.addrs {
            let at = SocketAddr::new(cable.address.into(), addr.port());
            if at != addr {
                listeners.push(listen(at)?);
            }
        }
    }
    let (arrived, arrivals) = mpsc::channel::<std::result::Result<Arrival, String>>();
    // Each client has a thread until the deadline at most; beyond this many at once, newcomers
    // are closed (the real ranks, world - 1 of them, fit many times over).
    let max_pending = 4 * world + 16;
    let pending = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut all: Vec<Option<Announce>> = vec![None; world];
    let mut streams = Vec::new();
    let mut refused: Vec<String> = Vec::new();
    all[0] = Some(me);
    while streams.len() < world - 1 {
        for listener in &listeners {
            loop {
                match listener.accept() {
                    Ok((stream, from)) => {
                        use std::sync::atomic::Ordering;
                        if pending.fetch_add(1, Ordering::SeqCst) >= max_pending {
                            pending.fetch_sub(1, Ordering::SeqCst);
                            remember(&mut refused, format!("{from}: too many clients at once"));
                            continue;
                        }
                        let (arrived, held, auth) =
                            (arrived.clone(), pending.clone(), auth.clone());
                        let spawned = std::thread::Builder::new()
                            .name("tbrdma-rendezvous".into())
                            .spawn(move || {
                                let got = read_client(&stream, &auth, deadline)
                                    .map(|announce| Arrival {
                                        stream,
                                        from,
                                        announce,
                                    })
                                    .map_err(|e| format!("{from}: {e}"));
                                held.fetch_sub(1, Ordering::SeqCst);
                                let _ = arrived.send(got);
                            });
                        if spawned.is_err() {
                            pending.fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
                    Err(e) => return Err(io_error(addr, "accepting", e)),
                }
            }
        }
        let slice = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(5));
        match arrivals.recv_timeout(slice) {
            Ok(Ok(Arrival {
                stream,
                from,
                announce: a,
            })) => {
                let problem = if a.world != world {
                    Some(format!(
                        "rank {} says the world has {} ranks, rank 0 says {world}: set the same TBRDMA_WORLD_SIZE on every rank",
                        a.rank, a.world
                    ))
                } else if a.rank == 0 || a.rank >= world {
                    Some(format!(
                        "rank {} is not a client rank of a world of {world}",
                        a.rank
                    ))
                } else if all[a.rank].is_some() {
                    Some(format!(
                        "two ranks claim rank {}: give every host its own TBRDMA_RANK",
                        a.rank
                    ))
                } else {
                    None
                };
                match problem {
                    Some(problem) => {
                        let mut io = DeadlineStream::new(&stream, deadline);
                        let _ = io.write_all(format!("error: {problem}\n").as_bytes());
                        remember(&mut refused, format!("{from}: {problem}"));
                    }
                    None => {
                        let r = a.rank;
                        all[r] = Some(a);
                        streams.push(stream);
                    }
                }
            }
            Ok(Err(why)) => remember(&mut refused, why),
            Err(_) => {}
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (0..world).filter(|&r| all[r].is_none()).collect();
            if refused.is_empty() {
                return Err(CollError::Timeout {
                    rank: missing[0],
                    op: "rendezvous",
                    after: timeout,
                });
            }
            return Err(bad(
                format!(
                    "rendezvous at {addr}: ranks {missing:?} never arrived within {timeout:?}; clients refused meanwhile: {}",
                    refused.join("; ")
                ),
                "start every rank with the same TBRDMA_ADDR, TBRDMA_WORLD_SIZE and cluster secret (TBRDMA_SECRET), each with its own TBRDMA_RANK",
            ));
        }
    }
    let all: Vec<Announce> = all.into_iter().flatten().collect();
    let result = build(&all);
    let answer = match &result {
        Ok(h) => h.to_json(),
        Err(e) => format!("error: {e}\n"),
    };
    // Each answer gets its own short deadline: a rank that stopped reading costs only that.
    for stream in streams {
        let mut io = DeadlineStream::new(&stream, Instant::now() + timeout);
        let _ = io.write_all(answer.as_bytes());
    }
    result
}

/// Any other rank: connects to rank 0 (retrying until it listens), announces, reads the answer.
fn join(
    addr: SocketAddr,
    me: &Announce,
    deadline: Instant,
    secret: Option<&tbrdma_verbs::Secret>,
) -> Result<Hostfile> {
    let stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(s) => break s,
            Err(_) if Instant::now() + Duration::from_millis(20) < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return Err(io_error(addr, "connecting", e)),
        }
    };
    let mut io = DeadlineStream::new(&stream, deadline);
    tbrdma_verbs::auth::client(&mut io, secret, AUTH_CONTEXT).map_err(|e| {
        bad(
            format!("rendezvous at {addr}: {e}"),
            "use the same cluster secret on every rank",
        )
    })?;
    io.write_all(encode(me).as_bytes())
        .map_err(|e| io_error(addr, "sending", e))?;
    let mut answer = String::new();
    io.take(MAX_ANSWER)
        .read_to_string(&mut answer)
        .map_err(|e| io_error(addr, "waiting for rank 0's answer", e))?;
    if let Some(err) = answer.strip_prefix("error: ") {
        return Err(bad(
            format!("rank 0 refused the cluster: {}", err.trim()),
            "fix the configuration it names",
        ));
    }
    Hostfile::parse(&answer).map_err(|e| {
        bad(
            format!("rank 0's hostfile: {e}"),
            "use the same tbrdma everywhere",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(rank: usize, addrs: &[(&str, [u8; 4])]) -> Announce {
        Announce {
            world: 3,
            rank,
            host: format!("h{rank}"),
            addrs: addrs
                .iter()
                .map(|(i, a)| CableAddr {
                    interface: i.to_string(),
                    address: Ipv4Addr::from(*a),
                    prefix: 30,
                })
                .collect(),
        }
    }

    #[test]
    fn shared_subnets_become_cables_and_a_mesh() {
        let all = [
            ann(0, &[("tb0", [169, 254, 0, 1]), ("tb1", [169, 254, 0, 5])]),
            ann(1, &[("tb0", [169, 254, 0, 2]), ("tb1", [169, 254, 0, 9])]),
            ann(2, &[("tb0", [169, 254, 0, 6]), ("tb1", [169, 254, 0, 10])]),
        ];
        let hf = build(&all).unwrap();
        assert_eq!(
            hf.topology.kind,
            tbrdma_netdev::hostfile::TopologyKind::Mesh
        );
        let l = &hf.ranks[1].links;
        assert_eq!(l.len(), 2);
        assert_eq!(
            (l[0].peer, l[0].peer_address),
            (0, Ipv4Addr::new(169, 254, 0, 1))
        );
        assert_eq!(
            (l[1].peer, l[1].peer_address),
            (2, Ipv4Addr::new(169, 254, 0, 10))
        );
        let text = encode(&all[2]);
        let back = decode(&mut text.as_bytes()).unwrap();
        assert_eq!(
            (back.rank, back.world, back.addrs),
            (2, 3, all[2].addrs.clone())
        );
    }
    /// A reader that repeats `pattern` for ever.
    struct Endless(&'static [u8], usize);

    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            for b in buf.iter_mut() {
                *b = self.0[self.1 % self.0.len()];
                self.1 += 1;
            }
            Ok(buf.len())
        }
    }

    /// Before, a line was read to its end however long, and address lines were read until
    /// `end` however many: a client sending either without end grew rank 0's memory for ever.
    #[test]
    fn an_endless_line_or_endless_addresses_are_refused_after_a_bound() {
        let e = decode(&mut BufReader::new(Endless(b"x", 0))).unwrap_err();
        assert!(e.contains("longer than"), "{e}");
        let head: &[u8] = b"tbrdma-rendezvous 1 2 1 h\n";
        let mut endless = BufReader::new(head.chain(Endless(b"tb0 169.254.0.1 30\n", 0)));
        let e = decode(&mut endless).unwrap_err();
        assert!(e.contains("more than 64 addresses"), "{e}");
        // Names that end up in files are checked.
        let text = "tbrdma-rendezvous 1 2 1 h\n../etc 169.254.0.1 30\nend\n";
        assert!(decode(&mut text.as_bytes()).is_err());
        let text = "tbrdma-rendezvous 1 2 1 a/b\nend\n";
        assert!(decode(&mut text.as_bytes()).is_err());
    }

    #[test]
    fn another_version_is_refused_even_when_it_begins_with_this_ones_digits() {
        let text = "tbrdma-rendezvous 12 2 h\nend\n";
        let e = decode(&mut text.as_bytes()).unwrap_err();
        assert!(e.contains("another version"), "{e}");
        let text = "tbrdma-rendezvous 1 2 1 h\nend\n";
        assert_eq!(decode(&mut text.as_bytes()).unwrap().world, 2);
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Rank 0 on a thread (waiting up to 60 s, what a stranger could hold it for before), a
    /// world of two; `before` runs first, then rank 1 (allowing itself 10 s).
    fn rendezvous_with(
        before: impl FnOnce(SocketAddr),
        auth0: Auth,
        auth1: Auth,
        timeout0: Duration,
    ) -> (Result<Hostfile>, Result<Hostfile>) {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let rank0 = std::thread::spawn(move || rendezvous(addr, 0, 2, timeout0, &auth0));
        // Rank 0 is listening once a connection succeeds (that one says nothing).
        let probe = loop {
            if let Ok(s) = TcpStream::connect(addr) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        before(addr);
        let rank1 = rendezvous(addr, 1, 2, Duration::from_secs(10), &auth1);
        drop(probe);
        (rank0.join().unwrap(), rank1)
    }

    /// Before, rank 0 read its clients one after the other, each with the whole timeout: a
    /// stranger that connected and said nothing held it, and rank 1 gave up waiting.
    #[test]
    fn a_silent_stranger_does_not_delay_the_real_ranks() {
        let (r0, r1) = rendezvous_with(
            |_| {},
            Auth::Disabled,
            Auth::Disabled,
            Duration::from_secs(60),
        );
        let (h0, h1) = (r0.unwrap(), r1.unwrap());
        assert_eq!(h0, h1);
        assert_eq!(h0.ranks.len(), 2);
    }

    /// Before, any bad client (garbage, another world size, a rank already taken) ended rank
    /// 0's rendezvous with an error: a stranger could stop a job from starting.
    #[test]
    fn garbage_and_impostors_are_refused_and_the_rendezvous_goes_on() {
        let (r0, r1) = rendezvous_with(
            |addr| {
                for junk in [
                    &b"GET / HTTP/1.1\r\n\r\n"[..],
                    b"tbAU\x01\x00................................",
                ] {
                    let mut s = TcpStream::connect(addr).unwrap();
                    let _ = s.write_all(junk);
                    let _ = s.shutdown(std::net::Shutdown::Write);
                    let mut sink = Vec::new();
                    let _ = s.read_to_end(&mut sink);
                }
                // Speaks the protocol, but for a world of 5: told why, and dropped.
                let mut s = TcpStream::connect(addr).unwrap();
                let mut io = DeadlineStream::new(&s, Instant::now() + Duration::from_secs(10));
                tbrdma_verbs::auth::client(&mut io, None, AUTH_CONTEXT).unwrap();
                s.write_all(b"tbrdma-rendezvous 1 5 1 impostor\nend\n")
                    .unwrap();
                let mut answer = String::new();
                s.read_to_string(&mut answer).unwrap();
                assert!(answer.starts_with("error: ") && answer.contains("TBRDMA_WORLD_SIZE"));
            },
            Auth::Disabled,
            Auth::Disabled,
            Duration::from_secs(60),
        );
        let (h0, h1) = (r0.unwrap(), r1.unwrap());
        assert_eq!(h0, h1);
        assert!(h1.ranks[1].host != "impostor");
    }

    /// Before, rank 0 listened on `0.0.0.0`: every interface of its host. Now on TBRDMA_ADDR
    /// and its cables' addresses only (loopback is never a cable).
    #[test]
    fn rank_0_listens_on_its_address_only() {
        let (r0, r1) = rendezvous_with(
            |addr| {
                // 127.0.0.2 is this host too (all of 127/8 is loopback), but not TBRDMA_ADDR.
                let other = SocketAddr::new("127.0.0.2".parse().unwrap(), addr.port());
                let e = TcpStream::connect(other).unwrap_err();
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
            },
            Auth::Disabled,
            Auth::Disabled,
            Duration::from_secs(60),
        );
        r0.unwrap();
        r1.unwrap();
    }

    fn secret(s: &str) -> Auth {
        Auth::with_secret(tbrdma_verbs::Secret::new(s.as_bytes()).unwrap())
    }

    #[test]
    fn the_same_secret_joins_and_another_or_none_is_refused_naming_the_setting() {
        let key = "a-cluster-secret-of-some-length";
        let (r0, r1) = rendezvous_with(|_| {}, secret(key), secret(key), Duration::from_secs(60));
        r0.unwrap();
        r1.unwrap();
        for (auth0, auth1) in [
            (secret(key), secret("another-secret-of-some-length")),
            (secret(key), Auth::Disabled),
            (Auth::Disabled, secret(key)),
        ] {
            let case = format!("{auth0:?} / {auth1:?}");
            let (r0, r1) = rendezvous_with(|_| {}, auth0, auth1, Duration::from_secs(3));
            let e1 = r1.expect_err(&case).to_string();
            assert!(e1.contains("TBRDMA_SECRET"), "{case}: rank 1: {e1}");
            let e0 = r0.expect_err(&case).to_string();
            assert!(e0.contains("TBRDMA_SECRET"), "{case}: rank 0: {e0}");
        }
    }
}
