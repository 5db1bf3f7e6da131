//! Discovery: every host runs it at about the same time; each one talks only to its direct
//! neighbours, over each cable, by UDP between the cable's two addresses. Each message carries
//! the sender's whole view (the host records it knows). Views merge until a host's view is
//! *closed* (every cable in it leads to a host in it) and every neighbour reports the same
//! view; the host then keeps answering for a few more rounds so slower neighbours finish too.
//! Non-neighbours are learnt through neighbours, so a ring of any size converges.
//!
//! What a neighbour sends is hostile input: a datagram counts only from the neighbour's own
//! address and port on that cable, from the host the cable leads to, whose record lists that
//! address; relayed records only fill gaps; a view holds at most [`MAX_HOSTS`] hosts of at most
//! [`MAX_LINKS`] cables each; and the whole run ends by its deadline. With a cluster secret
//! (`DiscoveryOptions::auth`, by default `TBRDMA_SECRET`), every datagram carries an
//! HMAC-SHA256 tag, each host a fresh nonce per run, and a view counts only when it echoes the
//! receiver's nonce: a datagram recorded in an earlier run, or from a host without the secret,
//! does not count, and the timeout's message says why.
//!
//! Datagram: `"tbDI"`, version (2), flags (bit 0: tagged), the tag (32 bytes, zeros when
//! untagged), then the message as JSON (`from`, `digest`, `nonce`, `echo`, `view`).

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tbrdma_auth::{Auth, NONCE_LEN, Secret, TAG_LEN};

use crate::addressing::{PREFIX_LEN, fnv1a64};
use crate::cables::cables;
use crate::error::{NetdevError, Result};
use crate::hostfile::format::{HostRecord, RecordLink};
use crate::inventory::Inventory;

/// The largest UDP payload over IPv4.
const MAX_DATAGRAM: usize = 65_507;

/// Default UDP port for discovery.
pub const DEFAULT_PORT: u16 = 18_515;

/// How discovery runs.
#[derive(Debug, Clone)]
pub struct DiscoveryOptions {
    /// UDP port, the same on every host.
    pub port: u16,
    /// Give up after this long.
    pub timeout: Duration,
    /// Time between two rounds of messages.
    pub interval: Duration,
    /// Rounds to keep answering after this host is done.
    pub linger_rounds: u32,
    /// The cluster secret datagrams are tagged with (default: `TBRDMA_SECRET` /
    /// `TBRDMA_SECRET_FILE` from the environment, none when unset).
    pub auth: Auth,
}

impl Default for DiscoveryOptions {
    fn default() -> Self {
        Self {
            port: DEFAULT_PORT,
            timeout: Duration::from_secs(30),
            interval: Duration::from_millis(100),
            linger_rounds: 10,
            auth: Auth::default(),
        }
    }
}

/// This host's record, from its inventory: its identity and each cable's addresses.
pub fn local_record(inventory: &Inventory) -> Result<HostRecord> {
    let host = inventory.host.clone().ok_or_else(|| {
        NetdevError::bad_input(
            "this host has no Thunderbolt UUID (no Thunderbolt domain found)",
            "connect a cable and run `tbrdma setup`, or name the links in a links file (--links)",
        )
    })?;
    let links = cables(inventory)?
        .into_iter()
        .map(|c| RecordLink {
            interface: c.interface,
            address: c.addresses.local,
            prefix_len: PREFIX_LEN,
            peer_uuid: c.peer.uuid,
            peer_address: c.addresses.peer,
            rail: c.rail,
        })
        .collect();
    let aliases = inventory
        .host_uuids
        .iter()
        .filter(|u| **u != host.uuid)
        .cloned()
        .collect();
    Ok(HostRecord {
        uuid: host.uuid,
        name: host.name,
        aliases,
        links,
    })
}

/// What goes in a datagram after its header.
#[derive(Debug, Serialize, Deserialize)]
struct Message {
    from: String,
    digest: u64,
    /// The sender's nonce for this run (hex), fresh each time discovery starts.
    nonce: String,
    /// The last nonce the sender heard from the receiver on this cable (hex), if any: with a
    /// cluster secret, a view counts only when it echoes the receiver's current nonce, so a
    /// datagram recorded in an earlier run is worthless.
    #[serde(default)]
    echo: Option<String>,
    view: Vec<HostRecord>,
}

/// Datagram header: magic, version, flags (bit 0: tagged), then the tag (zeros if untagged).
const MAGIC: &[u8; 4] = b"tbDI";
const VERSION: u8 = 2;
const HEADER_LEN: usize = 4 + 1 + 1 + TAG_LEN;
/// Names the datagrams in their tags.
const TAG_LABEL: &[u8] = b"tbrdma-discovery 2\0";
/// Most hosts a view may hold: more is a neighbour's garbage, not a cluster.
pub const MAX_HOSTS: usize = 256;
/// Most cables and aliases one record may list.
pub const MAX_LINKS: usize = 64;

/// One cable's exchange with the neighbour at its other end.
#[derive(Debug)]
pub(crate) struct Peer {
    /// The neighbour's discovery socket: the only source heard on this cable.
    pub(crate) addr: SocketAddrV4,
    /// The UUID the neighbour shows on this cable.
    pub(crate) uuid: String,
    /// The digest of its view, once a datagram from it counted.
    pub(crate) digest: Option<u64>,
    /// Its nonce, once heard (echoed back in ours).
    pub(crate) nonce: Option<String>,
    /// Why its last datagram did not count, if it did not.
    pub(crate) refused: Option<String>,
}

/// This host's side of discovery: its view, its nonce and secret.
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) local_uuid: String,
    pub(crate) view: BTreeMap<String, HostRecord>,
    pub(crate) nonce: String,
    pub(crate) secret: Option<Arc<Secret>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Node {
    /// The datagram for `peer`: header (with a tag when there is a secret), then the message.
    fn datagram(&self, peer: &Peer) -> Vec<u8> {
        let message = Message {
            from: self.local_uuid.clone(),
            digest: digest_of(&self.view),
            nonce: self.nonce.clone(),
            echo: peer.nonce.clone(),
            view: self.view.values().cloned().collect(),
        };
        let json = serde_json::to_vec(&message).expect("message serializes");
        let mut out = Vec::with_capacity(HEADER_LEN + json.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        match &self.secret {
            Some(secret) => {
                out.push(1);
                out.extend_from_slice(&secret.tag(&[TAG_LABEL, &json]));
            }
            None => {
                out.push(0);
                out.extend_from_slice(&[0; TAG_LEN]);
            }
        }
        out.extend_from_slice(&json);
        out
    }

    /// Takes a datagram that arrived from `src` on `peer`'s cable: its view merges into ours
    /// only if it comes from the neighbour's own address, from the host this cable leads to,
    /// whose record lists that address, passes the secret's check (when set), and stays within
    /// the bounds. Otherwise `peer.refused` says why (shown if discovery times out).
    pub(crate) fn receive(&mut self, peer: &mut Peer, src: SocketAddr, bytes: &[u8]) {
        if let Err(why) = self.absorb(peer, src, bytes) {
            peer.refused = Some(why);
        }
    }

    fn absorb(&mut self, peer: &mut Peer, src: SocketAddr, bytes: &[u8]) -> Result<(), String> {
        if src != SocketAddr::V4(peer.addr) {
            // A stranger (or another port) cannot speak for the neighbour. Not kept as the
            // reason: the neighbour's own word must not be masked by a stranger's noise.
            return Ok(());
        }
        if bytes.len() < HEADER_LEN || &bytes[..4] != MAGIC {
            return Err("the neighbour sent something that is not discovery".into());
        }
        if bytes[4] != VERSION {
            return Err(format!(
                "the neighbour runs discovery version {}, this host {VERSION}: use the same tbrdma on every host",
                bytes[4]
            ));
        }
        let (tagged, tag, json) = (
            bytes[5] & 1 != 0,
            &bytes[6..HEADER_LEN],
            &bytes[HEADER_LEN..],
        );
        match (&self.secret, tagged) {
            (Some(_), false) => {
                return Err(
                    "the neighbour has no cluster secret and this host has one (TBRDMA_SECRET or TBRDMA_SECRET_FILE): set the same secret on every host".into(),
                );
            }
            (None, true) => {
                return Err(
                    "the neighbour requires a cluster secret and this host has none: set TBRDMA_SECRET (or TBRDMA_SECRET_FILE) to the cluster's secret here".into(),
                );
            }
            (Some(secret), true) if !secret.verify(&[TAG_LABEL, json], tag) => {
                return Err(
                    "the neighbour's cluster secret is not this host's: set the same TBRDMA_SECRET (or TBRDMA_SECRET_FILE) on every host".into(),
                );
            }
            _ => {}
        }
        let message: Message =
            serde_json::from_slice(json).map_err(|e| format!("a malformed message: {e}"))?;
        if message.nonce.len() != 2 * NONCE_LEN {
            return Err("a malformed message: bad nonce".into());
        }
        // Only the host this cable leads to may speak on it, and its record must put it at the
        // address the datagram came from.
        let sender_fits = message.view.iter().any(|r| {
            r.uuid == message.from
                && r.answers_to(&peer.uuid)
                && r.links.iter().any(|l| l.address == *peer.addr.ip())
        });
        if !sender_fits {
            return Err(format!(
                "a message whose sender is not the host this cable leads to ({}) at {}",
                peer.uuid,
                peer.addr.ip()
            ));
        }
        peer.nonce = Some(message.nonce.clone());
        if self.secret.is_some() && message.echo.as_deref() != Some(self.nonce.as_str()) {
            // Authentic, but not (yet) an answer to this run: the next one will echo our nonce.
            return Ok(());
        }
        if message.view.len() > MAX_HOSTS
            || message
                .view
                .iter()
                .any(|r| r.links.len() > MAX_LINKS || r.aliases.len() > MAX_LINKS)
        {
            return Err(format!(
                "a view beyond the bounds ({MAX_HOSTS} hosts, {MAX_LINKS} cables a host)"
            ));
        }
        // A host is the authority on its own record; others only fill gaps, up to the bound.
        for record in message.view {
            let news = record.uuid == message.from || !self.view.contains_key(&record.uuid);
            let room = self.view.len() < MAX_HOSTS || self.view.contains_key(&record.uuid);
            if news && room && record.uuid != self.local_uuid {
                self.view.insert(record.uuid.clone(), record);
            }
        }
        peer.digest = Some(message.digest);
        peer.refused = None;
        Ok(())
    }
}

struct Channel<'a> {
    link: &'a RecordLink,
    socket: UdpSocket,
    peer: Peer,
}

/// Runs discovery from `local` and returns every host's record, sorted by UUID.
pub fn discover(local: &HostRecord, options: &DiscoveryOptions) -> Result<Vec<HostRecord>> {
    let secret = options
        .auth
        .resolve()
        .map_err(|e| NetdevError::bad_input(e.to_string(), "fix the cluster secret's setting"))?;
    let mut channels = Vec::new();
    for link in &local.links {
        let bind = SocketAddrV4::new(link.address, options.port);
        let socket = UdpSocket::bind(bind).map_err(|e| match e.kind() {
            ErrorKind::AddrNotAvailable => NetdevError::bad_input(
                format!(
                    "{} does not have its address {} yet",
                    link.interface, link.address
                ),
                "run `tbrdma setup` first",
            ),
            _ => NetdevError::io("binding discovery socket to", bind.to_string(), e),
        })?;
        socket
            .set_nonblocking(true)
            .map_err(|e| NetdevError::io("configuring", bind.to_string(), e))?;
        channels.push(Channel {
            link,
            socket,
            peer: Peer {
                addr: SocketAddrV4::new(link.peer_address, options.port),
                uuid: link.peer_uuid.clone(),
                digest: None,
                nonce: None,
                refused: None,
            },
        });
    }
    let nonce = tbrdma_auth::fresh_nonce()
        .map_err(|e| NetdevError::bad_input(e.to_string(), "check the kernel's getrandom(2)"))?;
    let mut node = Node {
        local_uuid: local.uuid.clone(),
        view: BTreeMap::from([(local.uuid.clone(), local.clone())]),
        nonce: hex(&nonce),
        secret,
    };
    let deadline = Instant::now() + options.timeout;
    let mut done_rounds: Option<u32> = None;
    let mut next_send = Instant::now();
    let mut buf = vec![0u8; 65_536];
    loop {
        let now = Instant::now();
        if now >= next_send {
            for channel in &channels {
                let bytes = node.datagram(&channel.peer);
                if bytes.len() > MAX_DATAGRAM {
                    return Err(NetdevError::bad_input(
                        format!(
                            "the cluster description ({} bytes) no longer fits one datagram",
                            bytes.len()
                        ),
                        "write the hostfile by hand for clusters this large (docs/hostfile.md)",
                    ));
                }
                // A neighbour that is not up yet refuses; it is asked again next round.
                let _ = channel.socket.send_to(&bytes, channel.peer.addr);
            }
            next_send = now + options.interval;
            if let Some(rounds) = done_rounds.as_mut() {
                *rounds += 1;
                if *rounds >= options.linger_rounds {
                    return Ok(node.view.into_values().collect());
                }
            }
        }
        for channel in &mut channels {
            // At most a bounded batch per cable and pass: a flood cannot starve the others.
            for _ in 0..64 {
                let Ok((len, src)) = channel.socket.recv_from(&mut buf) else {
                    break;
                };
                node.receive(&mut channel.peer, src, &buf[..len]);
            }
        }
        let digest = digest_of(&node.view);
        let agreed = channels.iter().all(|c| c.peer.digest == Some(digest));
        if done_rounds.is_none() && is_closed(&node.view) && agreed {
            done_rounds = Some(0);
        }
        if done_rounds.is_none() && Instant::now() >= deadline {
            return Err(NetdevError::DiscoveryTimeout {
                detail: missing(&channels, &node.view),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn digest_of(view: &BTreeMap<String, HostRecord>) -> u64 {
    let records: Vec<&HostRecord> = view.values().collect();
    fnv1a64(&serde_json::to_vec(&records).expect("records serialize"))
}

fn is_closed(view: &BTreeMap<String, HostRecord>) -> bool {
    view.values()
        .all(|r| r.links.iter().all(|l| knows(view, &l.peer_uuid)))
}

fn knows(view: &BTreeMap<String, HostRecord>, uuid: &str) -> bool {
    view.values().any(|r| r.answers_to(uuid))
}

fn missing(channels: &[Channel<'_>], view: &BTreeMap<String, HostRecord>) -> String {
    let silent: Vec<String> = channels
        .iter()
        .filter(|c| c.peer.digest.is_none())
        .map(|c| match &c.peer.refused {
            Some(why) => format!(
                "{} (peer {}: refused: {why})",
                c.link.interface, c.link.peer_address
            ),
            None => format!("{} (peer {})", c.link.interface, c.link.peer_address),
        })
        .collect();
    let unknown: Vec<&str> = view
        .values()
        .flat_map(|r| r.links.iter())
        .map(|l| l.peer_uuid.as_str())
        .filter(|u| !knows(view, u))
        .collect();
    let mut parts = Vec::new();
    if !silent.is_empty() {
        parts.push(format!("no answer over {}", silent.join(", ")));
    }
    if !unknown.is_empty() {
        parts.push(format!("never heard of hosts {}", unknown.join(", ")));
    }
    if parts.is_empty() {
        parts.push("neighbours never agreed on the cluster".into());
    }
    parts.join("; ")
}

/// What the cargo-fuzz target (`fuzz/` at the repository root) drives: one datagram, as the
/// neighbour of a fixed host would send it, with and without a secret.
#[cfg(feature = "fuzzing")]
pub fn fuzz_receive(bytes: &[u8]) {
    let local = HostRecord {
        uuid: "local".into(),
        name: "local".into(),
        aliases: Vec::new(),
        links: vec![RecordLink {
            interface: "tb0".into(),
            address: std::net::Ipv4Addr::new(10, 0, 0, 1),
            prefix_len: 30,
            peer_uuid: "peer".into(),
            peer_address: std::net::Ipv4Addr::new(10, 0, 0, 2),
            rail: 0,
        }],
    };
    let addr = SocketAddrV4::new(std::net::Ipv4Addr::new(10, 0, 0, 2), DEFAULT_PORT);
    for secret in [
        None,
        Secret::new(b"a-secret-for-the-fuzzer").ok().map(Arc::new),
    ] {
        let mut node = Node {
            local_uuid: local.uuid.clone(),
            view: BTreeMap::from([(local.uuid.clone(), local.clone())]),
            nonce: "00".repeat(NONCE_LEN),
            secret,
        };
        let mut peer = Peer {
            addr,
            uuid: "peer".into(),
            digest: None,
            nonce: None,
            refused: None,
        };
        node.receive(&mut peer, SocketAddr::V4(addr), bytes);
        assert!(node.view.len() <= MAX_HOSTS);
        assert!(
            node.view["local"] == local,
            "a neighbour rewrote this host's record"
        );
        // What a host then sends still encodes (and closes or not, without looping).
        let _ = node.datagram(&peer);
        let _ = is_closed(&node.view);
    }
}

#[cfg(test)]
mod tests;
