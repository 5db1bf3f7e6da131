//! Direct connections between ranks that share no cable (a ring of 4: ranks 0 and 2), over the
//! path the kernels of the hosts in between relay (IPv4 forwarding and host routes, as
//! `tbrdma lab up` and `tbrdma setup --relay` set them): the ranks in between do nothing.
//!
//! Each end of such a connection (planned by [`crate::direct_ends`]) is the rank's address on the cable to the first hop of its own
//! route to the other (`route`: the shorter way round, ties go up), so its datagrams leave by the
//! interface the kernel routes them through. The pair uses the same port as neighbours,
//! `port_base + lo·N + hi`, on the lower rank's end, and the same handshake, digest check and
//! channel. A connection is made on the first send/recv between the two (both ranks are in
//! that call), so building a communicator costs nothing more and registers nothing more.
//!
//! A path that does not work fails fast instead of hanging: the lower rank first probes the
//! higher one's end at the pair's port (nothing listens there, so a reset proves both
//! directions), the higher rank's connection attempts are bounded by [`PROBE`], and a refused
//! attempt (the lower rank is not listening yet) is retried until the communicator's timeout.
//! While a rank waits, it keeps polling its other channels.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tbrdma_verbs::{Listener, VerbsError, connect};

use crate::comm::Communicator;
use crate::error::{CollError, Result};

/// Longest a connection attempt (or the probe) over a routed path may stay unanswered before
/// the path counts as broken.
pub(crate) const PROBE: Duration = Duration::from_secs(3);

/// Whether `target` answers within `bound`: a refusal counts, it came back over the path.
fn probe_path(target: SocketAddr, bound: Duration) -> std::result::Result<(), String> {
    match TcpStream::connect_timeout(&target, bound) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ) =>
        {
            Err(format!("nothing came back within {bound:?}"))
        }
        Err(e) => Err(e.to_string()),
    }
}

impl Communicator {
    /// Connects this rank directly to `peer`, with which it shares no cable, unless it already
    /// is. Both ranks call it (from their send/recv); bounded by the communicator's timeout.
    pub(crate) fn connect_direct(&mut self, peer: usize, op: &'static str) -> Result<()> {
        if self.chans[peer].is_some() {
            return Ok(());
        }
        let Some(ends) = self.direct_ends[peer].clone() else {
            return Err(CollError::BadArgument {
                op,
                problem: format!(
                    "no cable joins ranks {} and {peer}, and the {} topology has no route to relay along",
                    self.rank, self.topology
                ),
            });
        };
        let local = self.rank;
        // A variant of its own would change the C API's status mapping; the verbs layer's
        // "unreachable" already maps to the right code there.
        let no_path = |addr: SocketAddr, detail: String| CollError::Connect {
            rank: peer,
            local,
            source: VerbsError::Unreachable {
                addr,
                detail: format!(
                    "{detail}; ranks {local} and {peer} share no cable and the hosts in between do not relay: make them relay (`tbrdma setup --relay HOSTFILE` on every host, or the commands in docs/collectives.md, \"Relay\"), or set TBRDMA_RELAY=ranks on every rank and have the ranks in between call forward"
                ),
            },
        };
        let connect_err = |source| CollError::Connect {
            rank: peer,
            local,
            source,
        };
        let port = self.pair_port(peer)?;
        let timeout = self.opts.timeout;
        let probe = timeout.min(PROBE);
        let deadline = Instant::now() + timeout;
        let timed_out = || CollError::Timeout {
            rank: peer,
            op,
            after: timeout,
        };
        let end = self.open_end(peer, &[ends.local.to_string()], true)?;
        let peer_end = SocketAddr::new(IpAddr::V4(ends.peer), port);
        let (digest, connected) = if local < peer {
            // Nothing listens at the peer's end on this port, so a refusal proves the path, both
            // ways; silence or an ICMP error means no relay.
            probe_path(peer_end, probe).map_err(|detail| no_path(peer_end, detail))?;
            let at = SocketAddr::new(IpAddr::V4(ends.local), port);
            let listener = Listener::bind_addr(&end.device, at).map_err(connect_err)?;
            let (digest, qp_opts) = self.qp_options(&end.inbox, timeout);
            loop {
                match listener.accept(&end.pd, &end.cq, &end.cq, &qp_opts, Some(Duration::ZERO)) {
                    Ok(connected) => break (digest, connected),
                    // No client yet (the verbs layer's wording for an empty accept queue).
                    Err(VerbsError::Timeout { what, .. })
                        if what.starts_with("waiting for a client") => {}
                    Err(source) => return Err(connect_err(source)),
                }
                if Instant::now() >= deadline {
                    return Err(timed_out());
                }
                self.poll_all(op)?;
                std::thread::sleep(Duration::from_millis(1));
            }
        } else {
            let (digest, qp_opts) = self.qp_options(&end.inbox, probe);
            loop {
                match connect(&end.pd, peer_end, &end.cq, &end.cq, &qp_opts) {
                    Ok(connected) => break (digest, connected),
                    // The path works; the peer has not reached its send/recv yet.
                    Err(VerbsError::PeerNotListening { .. }) => {}
                    Err(VerbsError::Unreachable { detail, .. }) => {
                        return Err(no_path(peer_end, detail));
                    }
                    Err(source) => return Err(connect_err(source)),
                }
                if Instant::now() >= deadline {
                    return Err(timed_out());
                }
                self.poll_all(op)?;
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        self.attach(peer, end, &digest, connected)
    }
}
