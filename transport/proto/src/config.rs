//! Per-connection configuration: sizes, windows, timers and retry budgets, with the defaults a
//! thunderbolt-net link wants. Every duration the connection waits for is here, so the
//! simulator (and a test) can compress or stretch it; the core holds no timing constant of its
//! own. Which deadline each one sets (`connection/timer.rs` names them):
//!
//! | Deadline | Set from |
//! |---|---|
//! | handshake | active side: [`Config::initial_rto`], doubled per resend up to [`Config::max_rto`], [`Config::max_retries`] resends; passive side: [`Config::idle_timeout`] |
//! | idle | [`Config::idle_timeout`] |
//! | retransmission | [`Config::initial_rto`], [`Config::rto_ceiling`], [`Config::max_rto`], [`Config::max_retries`] |
//! | tail loss probe | [`Config::tail_probe_floor`], the round-trip estimate and [`Config::ack_hold`] |
//! | receiver-not-ready resume | the delay in the peer's NAK, which is its [`Config::rnr_delay`], at most [`Config::max_rnr_delay`]; [`Config::max_rnr_retries`] |
//! | path probe | [`Config::path_probe_interval`] |
//! | keep-alive | [`Config::keepalive_interval`] |
//! | acknowledgement hold | [`Config::ack_hold`] |

use std::time::Duration;

use crate::wire::MAX_HEADER_LEN;

/// Largest window a connection advertises or honours: a peer's bigger offer is lowered to it
/// (sequence numbers compare within half of their 32-bit space; this keeps every window far
/// inside it, and what a sender keeps per unacknowledged packet bounded).
pub const MAX_WINDOW: u32 = 1 << 15;

/// Smallest payload per packet a peer may ask for in its handshake; a smaller offer is
/// refused (the handshake is dropped as malformed and the connection never establishes).
pub const MIN_PAYLOAD: u32 = 8;

/// Payload sizes per packet are multiples of this many bytes (when at least this large), so
/// every datagram boundary of a message falls on a multiple of 64 from its first byte: an
/// 8-byte word a reader polls inside a buffer the network fills (NCCL's LL protocol) never
/// straddles two datagrams that can land in either order (docs/semantics.md, "Visibility").
pub const PAYLOAD_ALIGN: u32 = 64;

/// The payload per packet both sides of a connection use: the smaller of the two offers,
/// rounded down to a multiple of [`PAYLOAD_ALIGN`] (offers below it, allowed down to
/// [`MIN_PAYLOAD`], are used as they are). Both sides compute it from the same two offers.
pub fn agreed_payload(ours: u32, theirs: u32) -> u32 {
    let p = ours.min(theirs);
    if p >= PAYLOAD_ALIGN {
        p - p % PAYLOAD_ALIGN
    } else {
        p
    }
}

/// Most packets one message may take: a longer request is refused when posted, so that one
/// message never spans more than a quarter of the sequence space.
pub const MAX_MESSAGE_PACKETS: u64 = 1 << 30;

/// Configuration of one connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Largest datagram the path carries (the link MTU minus IP and UDP headers). The payload
    /// per packet is this minus [`MAX_HEADER_LEN`], and the smaller of the two sides' wins.
    pub max_datagram: usize,
    /// Packets this side accepts beyond its cumulative acknowledgement (the receive window it
    /// advertises). Bounded by what the socket buffer holds: window × datagram ≤ rcvbuf.
    pub window: u32,
    /// Retransmission timeout before the first round-trip sample, and its floor afterwards.
    pub initial_rto: Duration,
    /// Ceiling of the timeout the round-trip estimator may choose before any backoff (the
    /// estimate follows RFC 6298: smoothed round trip plus four deviations).
    pub rto_ceiling: Duration,
    /// Ceiling of the exponential backoff.
    pub max_rto: Duration,
    /// Floor of the tail loss probe's timeout. When packets stay unacknowledged for
    /// `max(2 × smoothed round trip + ack_hold, tail_probe_floor)` after the last one was
    /// sent, that last one goes again, once, without backing off: if it (or its
    /// acknowledgement) was lost, the peer's answer repairs the loss or reports the gap long
    /// before the retransmission timeout would. No probe is sent when its deadline would not
    /// come before the retransmission timeout's, so a floor at or above [`Self::max_rto`]
    /// turns probes off.
    pub tail_probe_floor: Duration,
    /// Consecutive timeouts without progress before the connection fails with
    /// [`crate::WcStatus::RetryExceeded`] (verbs `retry_cnt`, which allows at most 7).
    pub max_retries: u32,
    /// How long a SEND waits after a receiver-not-ready NAK before retrying (verbs
    /// `min_rnr_timer`).
    pub rnr_delay: Duration,
    /// Longest pause a peer's receiver-not-ready NAK may ask for; a longer one is shortened to
    /// this (InfiniBand's longest RNR timer is 655 ms), so a peer cannot stall a connection
    /// for an hour with one NAK.
    pub max_rnr_delay: Duration,
    /// Receiver-not-ready retries before [`crate::WcStatus::RnrRetryExceeded`]. Unlike verbs,
    /// 7 does not mean "forever": the budget is always bounded.
    pub max_rnr_retries: u32,
    /// Idle time after which a keep-alive probe is sent.
    pub keepalive_interval: Duration,
    /// Silence from the peer, with nothing outstanding, after which the connection fails. The
    /// passive side also waits this long for the peer's CONNECT.
    pub idle_timeout: Duration,
    /// How often a path (rail) that was declared down is probed with a keep-alive; the peer's
    /// answer, or any datagram arriving on it, brings the path back.
    pub path_probe_interval: Duration,
    /// Send an acknowledgement at least every this many packets received.
    pub ack_every: u32,
    /// How long the acknowledgement of a completed message may wait for a packet of this side
    /// (a reply) to carry it, before it goes out on its own. Saves one datagram each way per
    /// ping-pong exchange. Off in the core by default; the engine turns it on for caller-driven
    /// connections, where the application's next poll (or the engine's keeper thread, when the
    /// application stops polling) ends the hold early — see `tbrdma_engine::worker`.
    pub ack_hold: Duration,
    /// Maximum outstanding send-queue requests (`max_send_wr`).
    pub max_send_wr: usize,
    /// Maximum posted receives (`max_recv_wr`).
    pub max_recv_wr: usize,
    /// Give every receive completion the CRC-32C of the message's bytes
    /// ([`crate::WorkCompletion::payload_crc`]), built from the datagrams' own CRCs as they are
    /// accepted: an application can check a message against what it expects without reading
    /// it again. Costs a header CRC and two 32-bit carry-less products per datagram; off by
    /// default.
    pub message_crc: bool,
    /// Ask for data digests: every data packet's CRC-32C covers its payload as well as its
    /// headers, both ways (the peer's asking is enough). Off by default: a payload is then
    /// vouched for by the link (thunderbolt-net's frames carry a CRC the host interface
    /// checks, Ethernet's an FCS) and, on the sockets and io_uring engines, by UDP's checksum,
    /// which the kernels compute and check; the headers, which say where a payload goes, are
    /// always covered. Turn it on where a link may corrupt undetected. See
    /// `docs/wire-format.md`, "What the CRC covers".
    pub data_digest: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            // MTU 65520 (thunderbolt-net's maximum is 65522) minus 20 (IPv4) and 8 (UDP).
            max_datagram: 65520 - 28,
            window: 128,
            // Round trips on a cable are ~10-50 µs; 1 ms leaves room for scheduling delays on a
            // busy 2-core host without spurious retransmissions.
            initial_rto: Duration::from_millis(1),
            // A receiver draining a full window of 64 KiB datagrams takes over a millisecond;
            // the estimator learns that, up to this ceiling.
            rto_ceiling: Duration::from_millis(10),
            // A budget of about 2 s (1 + 2 + … + 512 ms, then 1 s): a peer that vanished is
            // detected in bounded time, but a peer descheduled for a few hundred milliseconds
            // on a busy 2-core host (measured: a 227 ms budget was not enough there) is not declared dead.
            max_rto: Duration::from_secs(1),
            // Far above a cable's round trip (5-50 µs), so a peer that is merely slow to
            // answer costs at most one duplicate datagram per flight; far below the 1 ms
            // retransmission floor, which a lost last datagram used to cost in full.
            tail_probe_floor: Duration::from_micros(200),
            max_retries: 10,
            rnr_delay: Duration::from_micros(100),
            max_rnr_delay: Duration::from_millis(655),
            max_rnr_retries: 7,
            keepalive_interval: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(3),
            path_probe_interval: Duration::from_millis(100),
            ack_every: 16,
            ack_hold: Duration::ZERO,
            max_send_wr: 1024,
            max_recv_wr: 1024,
            message_crc: false,
            data_digest: false,
        }
    }
}

impl Config {
    /// Payload bytes per packet this side offers.
    pub fn max_payload(&self) -> u32 {
        let raw = self
            .max_datagram
            .saturating_sub(MAX_HEADER_LEN)
            .clamp(1, u16::MAX as usize) as u32;
        agreed_payload(raw, raw)
    }

    /// The longest the retransmission budget can last: the sum of every backed-off timeout,
    /// starting from the largest timeout the estimator may choose. A request to a peer that
    /// vanished completes with an error no later than this after the last sign of life.
    pub fn retry_budget(&self) -> Duration {
        let mut total = Duration::ZERO;
        let mut rto = self.initial_rto.max(self.rto_ceiling).min(self.max_rto);
        for _ in 0..=self.max_retries {
            total += rto;
            rto = (rto * 2).min(self.max_rto);
        }
        total
    }
}

#[cfg(test)]
mod payload_tests {
    use super::*;

    /// Every packet of a message starts at a multiple of 64 bytes from the message's first
    /// byte, whatever the link's datagram size and whatever the peer offers.
    #[test]
    fn datagram_boundaries_fall_on_multiples_of_64() {
        for max_datagram in [
            1500 - 28,
            9000 - 28,
            65_520 - 28,
            70_000,
            128 + MAX_HEADER_LEN,
        ] {
            let ours = Config {
                max_datagram,
                ..Config::default()
            }
            .max_payload();
            assert_eq!(
                ours % PAYLOAD_ALIGN,
                0,
                "max_datagram {max_datagram}: {ours}"
            );
            for theirs in [64, 65, 127, 1000, 1473, 8972, 65_464, 65_535] {
                let p = agreed_payload(ours, theirs);
                assert_eq!(p, agreed_payload(theirs, ours), "both sides agree");
                assert!(p > 0 && p <= ours.min(theirs));
                assert_eq!(p % PAYLOAD_ALIGN, 0, "{ours} and {theirs}: {p}");
                let len = 10 * u64::from(p) + 17;
                let n = crate::connection::packets_for_len(len, p);
                for index in 0..n {
                    assert_eq!((u64::from(index) * u64::from(p)) % 64, 0);
                }
            }
        }
        // Tiny offers (allowed down to MIN_PAYLOAD) are kept as they are.
        assert_eq!(agreed_payload(1000, MIN_PAYLOAD), MIN_PAYLOAD);
    }
}
