//! What a failed send means for its datagram, for every backend: one classification of the
//! errno ([`classify`]) and one retry policy on top of it ([`SendFailures::after`]), so that
//! the sockets, io_uring and packet backends treat the same error the same way.
//!
//! A datagram the kernel could not send is either tried again (the socket buffer is full for
//! a moment), lost (as if a cable dropped it: the protocol's retransmission, on another rail
//! if there is one, takes over), or the error is fatal to the call. Losing a datagram is never
//! an error: the protocol is built for it, and a link that loses everything ends in
//! retry-exceeded errors, bounded in time like a vanished peer.

/// What an errno from a send means for the datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SendError {
    /// Nothing was sent, for now only (socket buffer full, interrupted): try again a while,
    /// then count the datagram as lost.
    Retry,
    /// The datagram is lost: filtered on the way out, no route or interface for now, or an
    /// ICMP error about an earlier datagram (see [`is_stale_icmp`]).
    DatagramLost,
    /// Anything else: the backend reports it.
    Fatal,
}

/// Classifies the errno of a failed send.
pub(crate) fn classify(errno: i32) -> SendError {
    match errno {
        libc::EAGAIN | libc::ENOBUFS | libc::EINTR => SendError::Retry,
        // A packet filter (nftables, iptables) dropped it on its way out.
        libc::EPERM => SendError::DatagramLost,
        // The route or the interface is gone for now (link down, cable pulled).
        libc::ENETDOWN | libc::ENXIO => SendError::DatagramLost,
        e if is_stale_icmp(e) => SendError::DatagramLost,
        _ => SendError::Fatal,
    }
}

/// ICMP errors (port or host unreachable) that an earlier datagram brought back surface on a
/// later call of a connected UDP socket; they say nothing about that call, whose datagram was
/// not sent (a send) or which may still find one (a receive).
pub(crate) fn is_stale_icmp(errno: i32) -> bool {
    matches!(
        errno,
        libc::ECONNREFUSED | libc::EHOSTUNREACH | libc::ENETUNREACH | libc::EHOSTDOWN
    )
}

/// Tries of a send the kernel refused for lack of buffer space before its datagram is dropped
/// (the protocol retransmits it).
const SEND_RETRIES: u32 = 1000;
/// Tries of a send that picked up a stale ICMP error (it was not sent, and the error is gone
/// once reported) before its datagram counts as lost. Several datagrams in flight to a closed
/// port bring back several errors, one for each of the next sends.
const STALE_ICMP_RETRIES: u32 = 16;

/// What a backend does with a datagram whose send failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Send it again.
    Again,
    /// Forget it (counted in [`SendFailures::drops`]) and go on with the next.
    Drop,
    /// Stop and report the error.
    Fail,
}

/// One datagram's tries so far.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Attempt {
    retries: u32,
    stale_icmp: u32,
}

/// A backend's record of failed sends: datagrams dropped, and whether a packet filter's drop
/// was reported (once per backend, since the cause is outside tbrdma).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SendFailures {
    drops: u64,
    warned_filter: bool,
}

impl SendFailures {
    /// A datagram's send failed with `errno` after the tries in `attempt`: what now.
    pub(crate) fn after(&mut self, errno: i32, attempt: &mut Attempt) -> Next {
        match classify(errno) {
            SendError::Retry if attempt.retries < SEND_RETRIES => {
                attempt.retries += 1;
                Next::Again
            }
            SendError::DatagramLost
                if is_stale_icmp(errno) && attempt.stale_icmp < STALE_ICMP_RETRIES =>
            {
                // About an earlier datagram: this one was not sent, and may well be now.
                attempt.stale_icmp += 1;
                Next::Again
            }
            // The socket buffer stayed full, or the datagram is lost: the protocol resends.
            SendError::Retry | SendError::DatagramLost => {
                if errno == libc::EPERM && !std::mem::replace(&mut self.warned_filter, true) {
                    tracing::warn!(
                        "a packet filter dropped an outgoing datagram (EPERM); tbrdma resends, \
                         but check the nftables/iptables output rules for the tbrdma ports if it \
                         keeps happening"
                    );
                }
                self.count_drop();
                Next::Drop
            }
            SendError::Fatal => Next::Fail,
        }
    }

    /// A datagram was dropped before it reached the kernel (no way to its address).
    pub(crate) fn count_drop(&mut self) {
        self.drops += 1;
    }

    /// Datagrams dropped so far.
    pub(crate) fn drops(&self) -> u64 {
        self.drops
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_errno_has_its_class() {
        use SendError::*;
        let table = [
            (libc::EAGAIN, Retry),
            (libc::EWOULDBLOCK, Retry),
            (libc::ENOBUFS, Retry),
            (libc::EINTR, Retry),
            (libc::EPERM, DatagramLost),
            (libc::ECONNREFUSED, DatagramLost),
            (libc::EHOSTUNREACH, DatagramLost),
            (libc::ENETUNREACH, DatagramLost),
            (libc::EHOSTDOWN, DatagramLost),
            (libc::ENETDOWN, DatagramLost),
            (libc::ENXIO, DatagramLost),
            (libc::EBADF, Fatal),
            (libc::EINVAL, Fatal),
            (libc::EFAULT, Fatal),
            (libc::EMSGSIZE, Fatal),
            (libc::ENOTSOCK, Fatal),
            (libc::EDESTADDRREQ, Fatal),
            (libc::EACCES, Fatal),
            (0, Fatal),
        ];
        for (errno, class) in table {
            assert_eq!(classify(errno), class, "errno {errno}");
        }
    }

    #[test]
    fn retries_are_bounded_then_the_datagram_is_dropped() {
        let mut failures = SendFailures::default();
        for (errno, tries) in [
            (libc::ENOBUFS, SEND_RETRIES),
            (libc::ECONNREFUSED, STALE_ICMP_RETRIES),
            (libc::EPERM, 0),
            (libc::ENETDOWN, 0),
        ] {
            let mut attempt = Attempt::default();
            for _ in 0..tries {
                assert_eq!(failures.after(errno, &mut attempt), Next::Again);
            }
            assert_eq!(failures.after(errno, &mut attempt), Next::Drop, "{errno}");
        }
        assert_eq!(failures.drops(), 4);
        let mut attempt = Attempt::default();
        assert_eq!(failures.after(libc::EBADF, &mut attempt), Next::Fail);
        assert_eq!(failures.drops(), 4);
    }
}
