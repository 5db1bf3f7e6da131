//! Communicator options and the configuration digest every rank sends its neighbours during
//! setup (as connection private data), so that ranks started with different hostfiles, options
//! or versions fail at once with the difference spelled out instead of corrupting data later.

use std::time::Duration;

use tbrdma_netdev::hostfile::TopologyKind;
use tbrdma_proto::codec::{Put, Reader};
use tbrdma_verbs::{Auth, EngineKind, Progress, RemoteAddr};

use crate::dtype::DType;
use crate::error::{CollError, Result};

/// Which all-reduce algorithm to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Choose by size and topology (see `docs/collectives.md`).
    Auto,
    /// Every rank writes its input to every peer; each reduces locally in rank order. Needs a
    /// cable between every two ranks (a pair or a mesh).
    OneShot,
    /// Reduce-scatter then all-gather around the ring 0 → 1 → … → N−1 → 0, pipelined in slots.
    Ring,
    /// Recursive doubling over four ranks: each rank exchanges the whole message with rank
    /// r xor 1 and reduces, then with rank r xor 3 (the rank of the other pair it is cabled to)
    /// and reduces again: two exchanges where the ring takes six hops. Needs those two cables,
    /// which a ring of four has (and a mesh).
    Doubling,
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Algorithm::Auto),
            "oneshot" | "one-shot" => Ok(Algorithm::OneShot),
            "ring" => Ok(Algorithm::Ring),
            "doubling" => Ok(Algorithm::Doubling),
            _ => Err(format!(
                "unknown algorithm {s:?} (auto, oneshot, ring, doubling)"
            )),
        }
    }
}

/// How a message between two ranks that share no cable (a ring of 4: ranks 0 and 2) travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Relay {
    /// Over a direct connection to the peer, relayed by the kernels of the hosts in between
    /// (IPv4 forwarding and routes, as `tbrdma lab up` and `tbrdma setup --relay` set them);
    /// the ranks in between call nothing ([`crate::Communicator::forward`] does nothing). The
    /// default.
    Kernel,
    /// Along the ring through the ranks in between, each of which calls
    /// [`crate::Communicator::forward`]: for hosts that do not forward.
    Ranks,
}

impl std::str::FromStr for Relay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kernel" => Ok(Relay::Kernel),
            "ranks" => Ok(Relay::Ranks),
            _ => Err(format!("unknown relay {s:?} (kernel, ranks)")),
        }
    }
}

/// Environment variable that sets a communicator's initial [`Relay`] (`kernel` or `ranks`).
pub const RELAY_ENV: &str = "TBRDMA_RELAY";

impl Relay {
    /// [`RELAY_ENV`], or [`Relay::Kernel`] when it is unset.
    pub(crate) fn from_env() -> Result<Relay> {
        match std::env::var(RELAY_ENV) {
            Ok(v) if !v.is_empty() => v.parse().map_err(|e: String| CollError::BadConfig {
                problem: format!("{RELAY_ENV}: {e}"),
                fix: "set it to kernel or ranks, or unset it".into(),
            }),
            _ => Ok(Relay::Kernel),
        }
    }

    fn code(self) -> u8 {
        match self {
            Relay::Kernel => 0,
            Relay::Ranks => 1,
        }
    }
}

impl std::fmt::Display for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Relay::Kernel => "kernel",
            Relay::Ranks => "ranks",
        })
    }
}

/// How to build a communicator.
#[derive(Clone, Debug)]
pub struct CommOptions {
    /// All-reduce algorithm ([`Algorithm::Auto`]: by size and topology).
    pub algorithm: Algorithm,
    /// All-reduces up to this many bytes use one-shot under [`Algorithm::Auto`] on a pair; on a
    /// full mesh of N ranks, up to this divided by (N−1)² (each rank sends the whole message to
    /// N−1 peers). All-gather blocks up to this size go one-shot wherever the topology allows.
    pub one_shot_max: usize,
    /// Bytes per pre-registered slot: the pipelining unit.
    pub slot_bytes: usize,
    /// Slots per neighbour and direction (at least 2).
    pub slots: usize,
    /// Use at most this many cables per neighbour (0: all the hostfile lists).
    pub max_rails: usize,
    /// First TCP port of the connection manager; the pair (i, j) uses `port_base + i·N + j`.
    pub port_base: u16,
    /// Engine backend (io_uring falls back to sockets where it is refused, the packet engine
    /// without `CAP_NET_RAW` or on an IPv6 rail; a packet-engine rank sends UDP to a neighbour
    /// that hears only UDP, so ranks may differ).
    pub engine: EngineKind,
    /// Who drives progress. Caller progress (the default) suits collectives: every rank is
    /// inside a call while data moves, and it leaves the cores to the application.
    pub progress: Progress,
    /// Longest a collective waits for a neighbour before failing; also the setup timeout.
    pub timeout: Duration,
    /// Busy-poll iterations before a waiting rank starts yielding its core.
    pub spin: u32,
    /// The cluster secret the rendezvous and the connection manager authenticate with
    /// (default: `TBRDMA_SECRET` / `TBRDMA_SECRET_FILE` from the environment, none when unset).
    pub auth: Auth,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            algorithm: Algorithm::Auto,
            // The measured crossovers: 256-384 KiB on a pair, 64-128 KiB on a 3-rank mesh
            // (docs/collectives.md).
            one_shot_max: 256 << 10,
            // 8 slots of 256 KiB make an inbox and an outbox of 2 MiB each per neighbour,
            // which a core's second-level cache can keep up with: a 64 MiB all-reduce on a pair
            // took 9-11 % less time than with 512 KiB, 16 MiB 5-7 % (docs/performance.md).
            slot_bytes: 256 << 10,
            slots: 8,
            max_rails: 0,
            port_base: 18_600,
            // The fastest measured with caller progress: frames skip the kernel's IP and UDP
            // layers (a 16 KiB all-reduce: docs/performance.md; sockets took about a third of
            // io_uring's time, docs/collectives.md). Without root it is sockets.
            engine: EngineKind::Packet,
            progress: Progress::Caller,
            timeout: Duration::from_secs(20),
            // Yield almost at once: a spinning rank that shares its core with the rank it waits
            // for only delays it (4 ranks on 2 cores: 13 ms with 2000 rounds, 0.4 ms with 0),
            // and on a core of its own a yield costs one syscall.
            spin: 4,
            auth: Auth::default(),
        }
    }
}

/// Version of the digest format and of the collectives' wire protocol (slot and immediate
/// layout). Bump on any change that makes old and new ranks unable to work together.
/// Version 2 added the relay mode to the digest.
pub(crate) const PROTOCOL_VERSION: u16 = 2;
const MAGIC: &[u8; 4] = b"tbCO";
const LEN: usize = 4 + 2 + 4 * 8 + 1 + 8 + 4 + 4 + 1;

/// What a rank tells each neighbour at connection time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Digest {
    pub version: u16,
    pub rank: u32,
    pub world: u32,
    pub topology: TopologyKind,
    pub rails: u32,
    pub dtypes: u32,
    pub slot_bytes: u32,
    pub slots: u32,
    pub one_shot_max: u32,
    pub algorithm: u32,
    /// How messages between ranks with no cable travel.
    pub relay: Relay,
    /// The sender's inbox for this connection.
    pub inbox: RemoteAddr,
    /// The tbrdma version string's hash (FNV-1a-32 of `CARGO_PKG_VERSION`).
    pub build: u32,
}

fn topology_code(t: TopologyKind) -> u8 {
    match t {
        TopologyKind::Single => 0,
        TopologyKind::Pair => 1,
        TopologyKind::Mesh => 2,
        TopologyKind::Ring => 3,
        TopologyKind::Other => 4,
    }
}

fn topology_from(code: u8) -> Option<TopologyKind> {
    Some(match code {
        0 => TopologyKind::Single,
        1 => TopologyKind::Pair,
        2 => TopologyKind::Mesh,
        3 => TopologyKind::Ring,
        4 => TopologyKind::Other,
        _ => return None,
    })
}

pub(crate) fn build_hash() -> u32 {
    env!("CARGO_PKG_VERSION")
        .bytes()
        .fold(0x811c_9dc5u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        })
}

pub(crate) fn algorithm_code(a: Algorithm) -> u32 {
    match a {
        Algorithm::Auto => 0,
        Algorithm::OneShot => 1,
        Algorithm::Ring => 2,
        Algorithm::Doubling => 3,
    }
}

impl Digest {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(LEN);
        out.put_bytes(MAGIC);
        out.put_u16(self.version);
        for v in [
            self.rank,
            self.world,
            self.rails,
            self.dtypes,
            self.slot_bytes,
            self.slots,
            self.one_shot_max,
            self.algorithm,
        ] {
            out.put_u32(v);
        }
        out.put_u8(topology_code(self.topology));
        out.put_u64(self.inbox.addr);
        out.put_u32(self.inbox.rkey);
        out.put_u32(self.build);
        out.put_u8(self.relay.code());
        out.resize(LEN, 0);
        out
    }

    /// Parses a neighbour's digest; `peer` names it in the error.
    pub fn decode(bytes: &[u8], peer: usize, local: usize) -> Result<Digest> {
        let bad = |what: &str| CollError::ConfigMismatch {
            rank: peer,
            local,
            field: "protocol",
            theirs: what.to_string(),
            ours: format!("tbrdma collectives protocol {PROTOCOL_VERSION}"),
        };
        let mut r = Reader::new(bytes);
        let version = match (r.array::<4>(), r.u16()) {
            (Some(magic), Some(version)) if &magic == MAGIC => version,
            _ => {
                return Err(bad(
                    "something that is not a tbrdma collectives communicator",
                ));
            }
        };
        // The version first: another version's digest may have another length.
        if version != PROTOCOL_VERSION {
            return Err(bad(&format!("tbrdma collectives protocol {version}")));
        }
        if bytes.len() < LEN {
            return Err(bad("a digest too short for its protocol version"));
        }
        // Fields in wire order (a struct expression evaluates its fields as written).
        let short = || bad("a digest too short for its protocol version");
        Ok(Digest {
            version,
            rank: r.u32().ok_or_else(short)?,
            world: r.u32().ok_or_else(short)?,
            rails: r.u32().ok_or_else(short)?,
            dtypes: r.u32().ok_or_else(short)?,
            slot_bytes: r.u32().ok_or_else(short)?,
            slots: r.u32().ok_or_else(short)?,
            one_shot_max: r.u32().ok_or_else(short)?,
            algorithm: r.u32().ok_or_else(short)?,
            topology: topology_from(r.u8().ok_or_else(short)?)
                .ok_or_else(|| bad("an unknown topology code"))?,
            inbox: RemoteAddr {
                addr: r.u64().ok_or_else(short)?,
                rkey: r.u32().ok_or_else(short)?,
            },
            build: r.u32().ok_or_else(short)?,
            relay: match r.u8().ok_or_else(short)? {
                0 => Relay::Kernel,
                1 => Relay::Ranks,
                _ => return Err(bad("an unknown relay code")),
            },
        })
    }

    /// Checks that `theirs` (from rank `peer`) agrees with this rank's digest.
    pub fn check(&self, theirs: &Digest, peer: usize) -> Result<()> {
        let local = self.rank as usize;
        let differ = |field: &'static str, t: String, o: String| {
            Err(CollError::ConfigMismatch {
                rank: peer,
                local,
                field,
                theirs: t,
                ours: o,
            })
        };
        if theirs.rank as usize != peer {
            return differ(
                "rank numbering",
                format!(
                    "rank {} (it answered on the cable to rank {peer})",
                    theirs.rank
                ),
                format!("a cable to rank {peer}"),
            );
        }
        let fields: [(&'static str, u32, u32); 8] = [
            ("world size", theirs.world, self.world),
            ("rails per neighbour", theirs.rails, self.rails),
            ("supported types (bit mask)", theirs.dtypes, self.dtypes),
            ("slot size in bytes", theirs.slot_bytes, self.slot_bytes),
            ("slots per neighbour", theirs.slots, self.slots),
            (
                "one-shot threshold in bytes",
                theirs.one_shot_max,
                self.one_shot_max,
            ),
            ("algorithm code", theirs.algorithm, self.algorithm),
            ("tbrdma version hash", theirs.build, self.build),
        ];
        for (field, t, o) in fields {
            if t != o {
                return differ(field, t.to_string(), o.to_string());
            }
        }
        if theirs.relay != self.relay {
            return differ(
                "relay (TBRDMA_RELAY)",
                theirs.relay.to_string(),
                self.relay.to_string(),
            );
        }
        if theirs.topology != self.topology {
            return differ(
                "topology",
                theirs.topology.to_string(),
                self.topology.to_string(),
            );
        }
        Ok(())
    }
}

/// Every type the build supports, as a digest field.
pub(crate) fn dtype_mask() -> u32 {
    DType::support_mask()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(rank: u32) -> Digest {
        Digest {
            version: PROTOCOL_VERSION,
            rank,
            world: 3,
            topology: TopologyKind::Mesh,
            rails: 1,
            dtypes: dtype_mask(),
            slot_bytes: 1 << 19,
            slots: 8,
            one_shot_max: 1 << 18,
            algorithm: 0,
            relay: Relay::Kernel,
            inbox: RemoteAddr {
                addr: 0x1234_5678_9abc,
                rkey: 77,
            },
            build: build_hash(),
        }
    }

    #[test]
    fn digest_round_trips() {
        let d = digest(2);
        assert_eq!(Digest::decode(&d.encode(), 2, 0).unwrap(), d);
    }

    #[test]
    fn digest_layout_is_fixed_and_truncations_are_refused() {
        let d = digest(2);
        let e = d.encode();
        assert_eq!(e.len(), LEN);
        assert_eq!(&e[..4], MAGIC);
        assert_eq!(e[4..6], PROTOCOL_VERSION.to_le_bytes());
        assert_eq!(e[6..10], 2u32.to_le_bytes());
        assert_eq!(e[10..14], 3u32.to_le_bytes());
        assert_eq!(e[38], 2, "mesh");
        assert_eq!(e[39..47], 0x1234_5678_9abcu64.to_le_bytes());
        assert_eq!(e[47..51], 77u32.to_le_bytes());
        assert_eq!(e[51..55], build_hash().to_le_bytes());
        assert_eq!(e[55], 0, "kernel relay");
        for len in 0..LEN {
            assert!(
                Digest::decode(&e[..len], 2, 0).is_err(),
                "{len} bytes decoded"
            );
        }
    }

    #[test]
    fn a_difference_names_the_rank_and_the_field() {
        let ours = digest(0);
        let mut theirs = digest(2);
        theirs.world = 4;
        let err = ours.check(&theirs, 2).unwrap_err().to_string();
        assert!(
            err.contains("rank 2 disagrees on the world size: it has 4, rank 0 has 3"),
            "{err}"
        );
        let mut theirs = digest(2);
        theirs.topology = TopologyKind::Ring;
        let err = ours.check(&theirs, 2).unwrap_err().to_string();
        assert!(
            err.contains("topology: it has ring, rank 0 has mesh"),
            "{err}"
        );
        let mut theirs = digest(2);
        theirs.relay = Relay::Ranks;
        let err = ours.check(&theirs, 2).unwrap_err().to_string();
        assert!(
            err.contains("relay (TBRDMA_RELAY): it has ranks, rank 0 has kernel"),
            "{err}"
        );
        let mut old = digest(2).encode();
        old[4] = 1;
        old.truncate(55);
        let err = Digest::decode(&old, 2, 0).unwrap_err().to_string();
        assert!(err.contains("protocol 1"), "{err}");
        assert!(ours.check(&digest(2), 2).is_ok());
        assert!(ours.check(&digest(1), 2).is_err());
        let err = Digest::decode(b"nope", 1, 0).unwrap_err().to_string();
        assert!(err.contains("rank 1"), "{err}");
    }
}
