//! Discovery: every host runs it at about the same time; each one talks only to its direct
//! neighbours, over each cable, by UDP between the cable's two addresses. Each message carries
//! the sender's whole view (the host records it knows). Views merge until a host's view is
//! *closed* (every cable in it leads to a host in it) and every neighbour reports the same
//! view; the host then keeps answering for a few more rounds so slower neighbours finish too.
//! Non-neighbours are learnt through neighbours, so a ring of any size converges.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

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
}

impl Default for DiscoveryOptions {
    fn default() -> Self {
        Self {
            port: DEFAULT_PORT,
            timeout: Duration::from_secs(30),
            interval: Duration::from_millis(100),
            linger_rounds: 10,
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

#[derive(Debug, Serialize, Deserialize)]
struct Message {
    v: u32,
    from: String,
    digest: u64,
    view: Vec<HostRecord>,
}

struct Channel<'a> {
    link: &'a RecordLink,
    socket: UdpSocket,
    peer: SocketAddrV4,
    peer_digest: Option<u64>,
}

/// Runs discovery from `local` and returns every host's record, sorted by UUID.
pub fn discover(local: &HostRecord, options: &DiscoveryOptions) -> Result<Vec<HostRecord>> {
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
        let peer = SocketAddrV4::new(link.peer_address, options.port);
        channels.push(Channel {
            link,
            socket,
            peer,
            peer_digest: None,
        });
    }
    let mut view: BTreeMap<String, HostRecord> = BTreeMap::new();
    view.insert(local.uuid.clone(), local.clone());
    let deadline = Instant::now() + options.timeout;
    let mut done_rounds: Option<u32> = None;
    let mut next_send = Instant::now();
    let mut buf = vec![0u8; 65_536];
    loop {
        let digest = digest_of(&view);
        let now = Instant::now();
        if now >= next_send {
            let bytes = encode(&local.uuid, digest, &view);
            if bytes.len() > MAX_DATAGRAM {
                return Err(NetdevError::bad_input(
                    format!(
                        "the cluster description ({} bytes) no longer fits one datagram",
                        bytes.len()
                    ),
                    "write the hostfile by hand for clusters this large (docs/hostfile.md)",
                ));
            }
            for channel in &channels {
                // A neighbour that is not up yet refuses; it is asked again next round.
                let _ = channel.socket.send_to(&bytes, channel.peer);
            }
            next_send = now + options.interval;
            if let Some(rounds) = done_rounds.as_mut() {
                *rounds += 1;
                if *rounds >= options.linger_rounds {
                    return Ok(view.into_values().collect());
                }
            }
        }
        for channel in &mut channels {
            while let Ok((len, _)) = channel.socket.recv_from(&mut buf) {
                let Ok(message) = serde_json::from_slice::<Message>(&buf[..len]) else {
                    continue;
                };
                // Only the host this cable leads to may speak on it.
                let sender_fits = message
                    .view
                    .iter()
                    .any(|r| r.uuid == message.from && r.answers_to(&channel.link.peer_uuid));
                if message.v != 1 || !sender_fits {
                    continue;
                }
                channel.peer_digest = Some(message.digest);
                // A host is the authority on its own record; others only fill gaps.
                for record in message.view {
                    let news = record.uuid == message.from || !view.contains_key(&record.uuid);
                    if news && record.uuid != local.uuid {
                        view.insert(record.uuid.clone(), record);
                    }
                }
            }
        }
        let digest = digest_of(&view);
        let agreed = channels.iter().all(|c| c.peer_digest == Some(digest));
        if done_rounds.is_none() && is_closed(&view) && agreed {
            done_rounds = Some(0);
        }
        if done_rounds.is_none() && Instant::now() >= deadline {
            return Err(NetdevError::DiscoveryTimeout {
                detail: missing(&channels, &view),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn encode(from: &str, digest: u64, view: &BTreeMap<String, HostRecord>) -> Vec<u8> {
    let message = Message {
        v: 1,
        from: from.to_owned(),
        digest,
        view: view.values().cloned().collect(),
    };
    serde_json::to_vec(&message).expect("message serializes")
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
        .filter(|c| c.peer_digest.is_none())
        .map(|c| format!("{} (peer {})", c.link.interface, c.link.peer_address))
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
