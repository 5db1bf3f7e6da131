//! The keeper: in caller mode, a small thread that stands in for an application that has
//! stopped calling. When nobody entered the engine for a while (600 µs at most) it sends the
//! acknowledgements still held (see [`crate::worker`]), so that the peer's requests complete.
//! It blocks on a periodic timer (every [`EngineConfig::keeper_period`]) that the
//! application's first poll arms and that the keeper disarms when it finds the application gone
//! and nothing held; a polling application makes no system call for it. The keeper never
//! receives, and runs in `SCHED_BATCH` so that waking up never preempts a polling thread.
//!
//! With [`EngineConfig::keeper_takeover`] the keeper does more once the application has gone
//! for longer ([`TAKEOVER_AWAY`], 10 ms): it runs the whole loop in the application's place (receive,
//! acknowledgements, keep-alives, retransmissions), blocking in the backend's wait until a
//! datagram, a deadline or the application's return, so an idle connection lives and a dead
//! peer is noticed with no core kept busy. The application's next call wakes it and takes the
//! loop back (see `progress.rs`). While the application polls, the alarm stays armed and the
//! keeper only checks, once per period, whether it is still there.
//!
//! This module owns the keeper's alarm and its record of the application's last call; what a
//! check does with the engine's state (send the held acknowledgements, or take over the loop)
//! is given to [`Keeper::run`] by the progress loop, which owns the state.
//!
//! [`EngineConfig::keeper_takeover`]: crate::worker::EngineConfig::keeper_takeover
//!
//! [`EngineConfig::keeper_period`]: crate::worker::EngineConfig::keeper_period

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use tbrdma_proto::Time;

/// Caller mode: default of [`EngineConfig::keeper_period`]. Held acknowledgements go out at
/// most `KEEPER_HOLD + KEEPER_AWAY` (600 µs) after the application's last poll, well inside
/// the peer's smallest retransmission timeout with the default [`Config::initial_rto`] of 1 ms.
///
/// [`EngineConfig::keeper_period`]: crate::worker::EngineConfig::keeper_period
/// [`Config::initial_rto`]: tbrdma_proto::Config::initial_rto
pub const KEEPER_HOLD: Duration = Duration::from_micros(500);
/// Caller mode: a completion queue's poll that finds completions waiting runs the loop anyway
/// when the loop has not run for this long. An application that polls a batch and then works
/// on each completion (checking a 1 MiB message takes tens of microseconds) otherwise ran no
/// loop until it had worked through them all: nothing it received meanwhile was acknowledged,
/// and its sender timed out and resent the whole window (measured: `tbrdma bw --op send
/// --verify`, 840 timeouts in two seconds; docs/performance.md). A pass that finds nothing
/// costs about a microsecond, so this costs a slow consumer at most a few percent.
pub const CALLER_PASS_OVERDUE: Duration = Duration::from_micros(50);
/// Caller mode: the keeper counts the application as gone when it has not polled for this long.
const KEEPER_AWAY: Duration = Duration::from_micros(100);
/// Caller mode with takeover: the keeper runs the loop itself once the application has not
/// called for this long. Far longer than a descheduled polling thread is usually away on a busy
/// host (each takeover makes the returning application wait for the keeper to be scheduled
/// before it has the backends again), far shorter than any connection timer that matters:
/// retransmissions start at 1 ms but a retransmission budget lasts seconds, keep-alives go
/// every 500 ms.
pub const TAKEOVER_AWAY: Duration = Duration::from_millis(10);
// How the keeper's alarm is kept: a periodic timerfd, armed by the application's first poll
// after the keeper parked and disarmed when the keeper finds the application gone and nothing
// held (both under the state lock). A polling application makes no system call for the
// keeper: setting a timer costs 6.4 µs on this VM (a timer-programming exit), and polls that
// pushed a one-shot alarm out every 250 µs made about one 16 KiB all-reduce in twenty ~11 µs
// slower (mean 9.85 µs for a median of 8.87; docs/performance.md); a keeper re-arming its own
// one-shot alarm on each wake-up cost about half that. The keeper wakes once per period while
// the application polls, usually while a waiting rank yields its core; each wake-up is a timer
// interrupt and two context switches on a busy core, so connections that can wait longer for
// held acknowledgements (the collectives) lengthen the period.

/// The keeper's alarm and what it knows of the application (caller mode; in thread mode it
/// has no timer and every call does nothing).
#[derive(Debug)]
pub(crate) struct Keeper {
    /// When the application last entered the loop (nanoseconds of engine time), so the keeper
    /// can tell whether it is still polling.
    last_entry: AtomicU64,
    /// The alarm (caller mode only).
    timer: Option<TimerFd>,
    /// Whether the alarm is set (or the keeper is checking); false once the keeper parked,
    /// when the next poll must arm it. Changed only under the engine's state lock.
    armed: AtomicBool,
    /// [`EngineConfig::keeper_period`](crate::worker::EngineConfig::keeper_period).
    period: Duration,
    /// [`EngineConfig::keeper_takeover`](crate::worker::EngineConfig::keeper_takeover).
    takeover: bool,
}

impl Keeper {
    /// A keeper with an alarm of period `period` when `caller_mode`, none otherwise.
    pub(crate) fn new(caller_mode: bool, period: Duration, takeover: bool) -> io::Result<Keeper> {
        Ok(Keeper {
            last_entry: AtomicU64::new(0),
            timer: if caller_mode {
                Some(TimerFd::new(
                    ClockId::CLOCK_MONOTONIC,
                    TimerFlags::TFD_CLOEXEC,
                )?)
            } else {
                None
            },
            armed: AtomicBool::new(false),
            period: period.max(Duration::from_micros(1)),
            takeover,
        })
    }

    /// Whether the keeper takes over the loop when the application goes away.
    pub(crate) fn takes_over(&self) -> bool {
        self.takeover && self.timer.is_some()
    }

    /// The application called at `now` (before it locks anything, so that a keeper about to
    /// block in the backend's wait sees it; see `Shared::enter`).
    pub(crate) fn note_entry(&self, now: Time) {
        self.last_entry.store(now.0, Ordering::SeqCst);
    }

    /// Whether the application has not entered the loop for `overdue` at `now`.
    pub(crate) fn last_entry_older_than(&self, overdue: Duration, now: Time) -> bool {
        now.0
            .saturating_sub(self.last_entry.load(Ordering::Relaxed))
            >= overdue.as_nanos() as u64
    }

    /// Whether the application has not called for `KEEPER_AWAY` at `now`.
    pub(crate) fn app_away(&self, now: Time) -> bool {
        now.0.saturating_sub(self.last_entry.load(Ordering::SeqCst))
            >= KEEPER_AWAY.as_nanos() as u64
    }

    fn arm(&self) {
        if let Some(timer) = &self.timer {
            let every = TimeSpec::from_duration(self.period);
            if let Err(e) = timer.set(Expiration::Interval(every), TimerSetTimeFlags::empty()) {
                tracing::error!("cannot set the keeper's timer: {e}");
            }
        }
    }

    /// The application entered the loop at `now`. Call under the state lock: a parked keeper
    /// needs its alarm set; an armed one re-arms itself.
    pub(crate) fn note_poll(&self, now: Time) {
        // (When another thread holds the rails, that thread's call records the time instead.)
        self.last_entry.store(now.0, Ordering::Relaxed);
        if !self.armed.load(Ordering::Relaxed) {
            self.armed.store(true, Ordering::Relaxed);
            self.arm();
        }
    }

    /// Nothing is left to send: disarms the alarm. Call under the state lock, so that a poll
    /// after this one sees it and arms the alarm again (after the disarming).
    pub(crate) fn park(&self) {
        if let Some(timer) = &self.timer {
            if let Err(e) = timer.unset() {
                tracing::error!("cannot stop the keeper's timer: {e}");
            }
        }
        self.armed.store(false, Ordering::Relaxed);
    }

    /// Rings the alarm at once (to make the keeper look at `stop`).
    pub(crate) fn ring(&self) {
        if let Some(timer) = &self.timer {
            let at = Expiration::OneShot(TimeSpec::from_duration(Duration::from_nanos(1)));
            if let Err(e) = timer.set(at, TimerSetTimeFlags::empty()) {
                tracing::error!("cannot set the keeper's timer: {e}");
            }
        }
    }

    /// The keeper thread's body: waits for the alarm and, whenever the application has not
    /// polled for a while, calls `flush_held_acks` (which parks the keeper, see [`Self::park`],
    /// when nothing is left). Returns once `stop` is set and the alarm rang.
    ///
    /// With takeover, a check that finds the application gone calls `take_over` instead, which
    /// returns once the application is back (or `stop` is set); the alarm is off meanwhile.
    pub(crate) fn run(
        &self,
        stop: &AtomicBool,
        now: impl Fn() -> Time,
        mut flush_held_acks: impl FnMut() -> io::Result<bool>,
        mut take_over: impl FnMut() -> io::Result<()>,
    ) {
        if let Err(e) = crate::sched::set_batch_scheduling() {
            tracing::debug!("keeper stays in the default scheduling class: {e}");
        }
        let Some(timer) = &self.timer else {
            return;
        };
        // While armed the alarm rings every `period`; a check finds the application gone
        // when it has not polled for `KEEPER_AWAY`, so held acknowledgements go out at most
        // `period + KEEPER_AWAY` after its last poll.
        let away_ns = KEEPER_AWAY.as_nanos() as u64;
        if self.takes_over() {
            // Never parked: the alarm runs from the start (an application that never polls is
            // away), and is off only while the keeper runs the loop itself.
            self.armed.store(true, Ordering::Relaxed);
            self.arm();
        }
        loop {
            // Parked (disarmed) this waits until a poll arms the alarm.
            if let Err(e) = timer.wait() {
                tracing::error!("the keeper's timer failed: {e}");
                std::thread::sleep(self.period);
            }
            if stop.load(Ordering::Relaxed) {
                return;
            }
            if now()
                .0
                .saturating_sub(self.last_entry.load(Ordering::Relaxed))
                < away_ns
            {
                continue;
            }
            let away = now()
                .0
                .saturating_sub(self.last_entry.load(Ordering::Relaxed));
            if self.takes_over() && away >= TAKEOVER_AWAY.as_nanos() as u64 {
                if let Err(e) = timer.unset() {
                    tracing::error!("cannot stop the keeper's timer: {e}");
                }
                if let Err(e) = take_over() {
                    tracing::error!("engine I/O failed: {e}");
                    std::thread::sleep(self.period);
                }
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                self.arm();
                continue;
            }
            if let Err(e) = flush_held_acks() {
                tracing::error!("engine I/O failed: {e}");
            }
        }
    }
}
