//! Receive credit: how a sender keeps its receive-consuming messages (SEND, WRITE_WITH_IMM)
//! within the receives its peer has posted, so that a receiver slower than its sender slows
//! the sender down instead of refusing messages.
//!
//! This is InfiniBand's end-to-end credit, with an absolute limit instead of a count. Both
//! sides number receive-consuming messages from 0 at the start of the connection, in sequence
//! order (the receiver takes receives in that order). Every ACK carries the receiver's
//! `receive_limit`: the receives it has taken plus those it has posted and not yet used. The
//! sender starts message `n` (its first transmission, never a retransmission) only when `n` is
//! before the limit it last heard, or when none of its receive-consuming messages is
//! unacknowledged: that one message goes without credit, as InfiniBand allows, so a stale
//! report stalls nothing and a post with nothing outstanding is sent at once, as caller
//! progress promises (the sender's engine may not run again before the peer waits for it). If
//! the receiver really has no receive, it answers that message with a receiver-not-ready NAK,
//! as before. Before the first ACK nothing holds a sender back.
//!
//! Without credit a sender with a deeper queue than the receiver's posted receives ran into
//! receiver-not-ready NAKs, and each one made it resend everything behind the refused message
//! (measured: `tbrdma bw --op send --verify`, 1 MiB, 64 receives, 128 outstanding: 2000 NAKs
//! in two seconds, four fifths of the data sent twice; docs/performance.md).
//!
//! A report goes stale when the receiver posts receives and its acknowledgements ride on its
//! own data packets, whose header has no room for the limit. A sender held back by credit with
//! messages outstanding asks with a KEEPALIVE, which the receiver answers with an ACK at once
//! (once per limit heard, so a receiver that has posted nothing is not asked again and again);
//! once nothing is outstanding, the one message without credit goes. The receiver sends no
//! report of its own when its application posts: a ping-pong whose receiver reposts after
//! replying would pay a datagram per message for it (`two_queue_pairs.rs` in the verbs tests).
//!
//! Ownership: this module owns the numbering and the sender's decision; the receive queue
//! (`Connection::rq`) owns how many receives are posted.

/// Whether ordinal `a` comes before `b`, in the wrapping order (within half of the space).
fn before(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) as i32) > 0
}

/// The receiver's side: how many receives it has taken.
#[derive(Debug, Default)]
pub(super) struct ReceiveCount {
    taken: u32,
}

impl ReceiveCount {
    /// A receive was taken for the next receive-consuming message.
    pub fn took_one(&mut self) {
        self.taken = self.taken.wrapping_add(1);
    }

    /// The limit to report, with `posted` receives waiting.
    pub fn limit(&self, posted: usize) -> u32 {
        self.taken
            .wrapping_add(u32::try_from(posted).unwrap_or(u32::MAX))
    }
}

/// The sender's side: the numbering of its receive-consuming messages and the last limit heard.
#[derive(Debug, Default)]
pub(super) struct SendCredit {
    /// The ordinal the next receive-consuming message gets.
    next: u32,
    /// The oldest ordinal not yet acknowledged (equal to `next` when none is outstanding).
    unacked: u32,
    /// The limit last heard, if any (none before the first ACK: nothing holds a sender back).
    limit: Option<u32>,
    /// The limit a renewal was last asked about: a report with the same limit is not asked
    /// about again (a receiver whose application has not posted would answer each question
    /// with the same limit, one round trip after another).
    asked_about: Option<u32>,
}

impl SendCredit {
    /// Numbers a new receive-consuming message.
    pub fn assign(&mut self) -> u32 {
        let n = self.next;
        self.next = self.next.wrapping_add(1);
        n
    }

    /// The message numbered `n` is acknowledged (messages are acknowledged in order).
    pub fn acked(&mut self, n: u32) {
        self.unacked = n.wrapping_add(1);
    }

    /// An ACK reported `limit` (after its cumulative acknowledgement was applied). Reports can
    /// arrive out of order: a lower one than already heard is stale and ignored.
    pub fn on_report(&mut self, limit: u32) {
        if self.limit.is_none_or(|l| !before(limit, l)) {
            self.limit = Some(limit);
        }
    }

    /// Whether message `n` may be transmitted for the first time: within the limit, or, when
    /// none is outstanding and the limit may be stale, as the one message without credit.
    pub fn may_start(&self, n: u32) -> bool {
        self.limit.is_none_or(|l| before(n, l)) || self.unacked == n
    }

    /// Held back by credit: whether to ask for a fresh report now (once per limit heard).
    pub fn ask(&mut self) -> bool {
        let fresh = self.limit.is_some() && self.asked_about != self.limit;
        if fresh {
            self.asked_about = self.limit;
        }
        fresh
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_starts_messages_up_to_the_limit_and_one_more_only_when_nothing_is_outstanding() {
        let mut c = SendCredit::default();
        let ordinals: Vec<u32> = (0..4).map(|_| c.assign()).collect();
        assert_eq!(ordinals, [0, 1, 2, 3]);
        assert!(
            c.may_start(3),
            "no report yet: nothing holds the sender back"
        );
        c.on_report(2);
        assert!(c.may_start(0) && c.may_start(1));
        assert!(
            !c.may_start(2),
            "beyond the limit while 0 and 1 are outstanding"
        );
        c.acked(0);
        assert!(!c.may_start(2));
        c.acked(1);
        assert!(
            c.may_start(2),
            "nothing outstanding and the limit heard before: one may go without credit"
        );
        assert!(!c.may_start(3));
        c.on_report(1);
        assert!(!c.may_start(3), "a stale, lower report changes nothing");
        c.on_report(4);
        assert!(c.may_start(3));
    }

    #[test]
    fn ordinals_and_limits_wrap() {
        let mut c = SendCredit {
            next: u32::MAX - 1,
            unacked: u32::MAX - 1,
            ..SendCredit::default()
        };
        let a = c.assign();
        let b = c.assign();
        let d = c.assign();
        assert_eq!((a, b, d), (u32::MAX - 1, u32::MAX, 0));
        c.on_report(u32::MAX);
        assert!(c.may_start(a) && !c.may_start(b));
        c.on_report(1);
        assert!(
            c.may_start(b) && c.may_start(d) && !c.may_start(1),
            "1 is after u32::MAX, and so is 0"
        );
        let mut r = ReceiveCount { taken: u32::MAX };
        assert_eq!(r.limit(3), 2);
        r.took_one();
        assert_eq!(r.limit(0), 0);
    }

    #[test]
    fn a_held_sender_asks_once_per_limit_heard() {
        let mut c = SendCredit::default();
        assert!(
            !c.ask(),
            "no report: nothing holds the sender back, nothing to ask"
        );
        c.on_report(0);
        assert!(c.ask());
        assert!(!c.ask());
        c.on_report(0);
        assert!(
            !c.ask(),
            "the same answer: asking again would only repeat it"
        );
        c.on_report(1);
        assert!(c.ask());
    }
}
