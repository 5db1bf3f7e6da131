//! Rendezvous, as PyTorch does it: every rank knows only a rank-0 address, its rank and the
//! world size (`TBRDMA_ADDR`, `TBRDMA_RANK`, `TBRDMA_WORLD_SIZE`). Rank 0 listens there; every
//! other rank connects and sends its host name and its cable addresses (IPv4 interfaces with a
//! prefix of /30 or longer: what `tbrdma setup` gives each cable). Rank 0 pairs addresses that
//! share a subnet into cables, builds the same hostfile `tbrdma hostfile` would, and sends it
//! back; then every rank builds its communicator from it.
//!
//! Wire format (text over TCP): `tbrdma-rendezvous 1 <world> <rank> <host>` then one
//! `<interface> <address> <prefix>` line per address and `end`; the answer is the hostfile's
//! JSON, or a line starting with `error: `.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tbrdma_netdev::hostfile::{HostRecord, Hostfile, RecordLink};

use crate::error::{CollError, Result};

const MAGIC: &str = "tbrdma-rendezvous 1";

fn bad(problem: impl Into<String>, fix: impl Into<String>) -> CollError {
    CollError::BadConfig {
        problem: problem.into(),
        fix: fix.into(),
    }
}

/// One address a rank has on a cable.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CableAddr {
    interface: String,
    address: Ipv4Addr,
    prefix: u8,
}

#[derive(Debug, Clone)]
struct Announce {
    world: usize,
    rank: usize,
    host: String,
    addrs: Vec<CableAddr>,
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

fn encode(a: &Announce) -> String {
    let mut s = format!("{MAGIC} {} {} {}\n", a.world, a.rank, a.host);
    for c in &a.addrs {
        s += &format!("{} {} {}\n", c.interface, c.address, c.prefix);
    }
    s + "end\n"
}

fn decode(reader: &mut impl BufRead) -> std::result::Result<Announce, String> {
    let mut line = String::new();
    let mut next = |line: &mut String| {
        line.clear();
        reader
            .read_line(line)
            .map_err(|e| e.to_string())
            .map(|_| line.trim_end().to_string())
    };
    let head = next(&mut line)?;
    let rest = head
        .strip_prefix(MAGIC)
        .ok_or("not a tbrdma rendezvous client (or another version)")?;
    let mut f = rest.split_whitespace();
    let mut num = || -> std::result::Result<usize, String> {
        f.next()
            .and_then(|x| x.parse().ok())
            .ok_or_else(|| "malformed rendezvous header".to_string())
    };
    let (world, rank) = (num()?, num()?);
    let host = head
        .split_whitespace()
        .nth(4)
        .unwrap_or("unknown")
        .to_string();
    let mut addrs = Vec::new();
    loop {
        let l = next(&mut line)?;
        if l == "end" {
            break;
        }
        let p: Vec<&str> = l.split_whitespace().collect();
        let [interface, address, prefix] = p[..] else {
            return Err(format!("malformed address line {l:?}"));
        };
        addrs.push(CableAddr {
            interface: interface.to_string(),
            address: address
                .parse()
                .map_err(|_| format!("bad address {address:?}"))?,
            prefix: prefix
                .parse()
                .map_err(|_| format!("bad prefix {prefix:?}"))?,
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
    let io = |what: &str, e: std::io::Error| {
        bad(
            format!("rendezvous at {addr}: {what}: {e}"),
            "check TBRDMA_ADDR (rank 0's address and a free port) and that rank 0 runs",
        )
    };
    if rank == 0 {
        let any = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), addr.port());
        let listener = TcpListener::bind(any).map_err(|e| io("listening", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io("listening", e))?;
        let mut all: Vec<Option<Announce>> = vec![None; world];
        let mut streams = Vec::new();
        all[0] = Some(me);
        while streams.len() < world - 1 {
            match listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).map_err(|e| io("accepting", e))?;
                    s.set_read_timeout(Some(timeout))
                        .map_err(|e| io("accepting", e))?;
                    let mut reader = BufReader::new(s.try_clone().map_err(|e| io("accepting", e))?);
                    let a = decode(&mut reader)
                        .map_err(|e| bad(e, "run the same tbrdma on every rank"))?;
                    if a.world != world {
                        return Err(bad(
                            format!(
                                "rank {} says the world has {} ranks, rank 0 says {world}",
                                a.rank, a.world
                            ),
                            "set the same TBRDMA_WORLD_SIZE on every rank",
                        ));
                    }
                    if a.rank == 0 || a.rank >= world || all[a.rank].is_some() {
                        return Err(bad(
                            format!("two ranks claim rank {}", a.rank),
                            "give every host its own TBRDMA_RANK",
                        ));
                    }
                    let r = a.rank;
                    all[r] = Some(a);
                    streams.push(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = (0..world)
                            .filter(|&r| all[r].is_none())
                            .map(|r| r.to_string())
                            .collect();
                        return Err(CollError::Timeout {
                            rank: missing[0].parse().unwrap_or(0),
                            op: "rendezvous",
                            after: timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io("accepting", e)),
            }
        }
        let all: Vec<Announce> = all.into_iter().flatten().collect();
        let result = build(&all);
        let answer = match &result {
            Ok(h) => h.to_json(),
            Err(e) => format!("error: {e}\n"),
        };
        for mut s in streams {
            let _ = s.write_all(answer.as_bytes());
        }
        result
    } else {
        let mut stream = loop {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(io("connecting", e)),
            }
        };
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| io("connecting", e))?;
        stream
            .write_all(encode(&me).as_bytes())
            .map_err(|e| io("sending", e))?;
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .map_err(|e| io("waiting for rank 0's answer", e))?;
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
}
