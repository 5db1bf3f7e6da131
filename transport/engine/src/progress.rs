//! Who runs the engine's loop, and how it is started. Two progress modes (chosen per device):
//! - [`Progress::Thread`]: a background thread owns the socket's backend and runs the loop, so
//!   one-sided operations complete with no call from the target application. It busy-polls for
//!   [`EngineConfig::spin`] after the last activity, then sleeps in the kernel until a datagram,
//!   a deadline or a post from another thread wakes it. With [`EngineConfig::assist`] the
//!   application's threads run the loop too, on their own backends over the same sockets
//!   (`Shared::io`): posts send at once, polls receive, and the engine thread covers only
//!   what arrives while nobody calls.
//! - [`Progress::Caller`]: no thread; whoever polls a completion queue (or calls
//!   [`Engine::progress`]) runs the loop, and posting a request sends it at once. This is what
//!   NCCL's proxy thread and 2-core machines want: one spinning thread per process. The keeper
//!   (`keeper.rs`) stands in for an application that stopped calling: it sends the held
//!   acknowledgements or, with [`EngineConfig::keeper_takeover`], runs the whole loop
//!   ([`Shared::take_over`]) until the application calls again.
//!
//! This module owns what the application's threads and the engine's threads share
//! ([`Shared`]: the state's lock, the backends, the wake-up descriptor, the stop flag), the
//! doorbell ([`Shared::post`]) and the start-up of the engine or keeper thread ([`launch`]).
//!
//! [`Engine::progress`]: crate::worker::Engine::progress

use std::io;
use std::net::UdpSocket;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::eventfd::{EfdFlags, EventFd};
use tbrdma_proto::Time;
use tbrdma_proto::hint::cold_path;

use crate::config::{
    ASSISTED_BURST_LIMIT, ASSISTED_LINGER, ASSISTED_MAX_SLEEP, ASSISTED_POLL_WINDOW,
    ASSISTED_POST_BATCH, ASSISTED_QUIET_AFTER, ASSISTED_QUIET_SPIN, EngineConfig, Progress,
};
use crate::failure::Failure;
use crate::io::faults::{FaultPlan, FaultyIo};
use crate::io::{DatagramIo, EngineKind, Rails, open as open_io};
use crate::keeper::Keeper;
use crate::state::State;

/// Parts shared by the application's threads and the engine thread.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    /// The backends the application's threads use: in caller mode the only ones; in thread
    /// mode with [`EngineConfig::assist`] a second set over the same sockets (the engine
    /// thread owns the first); otherwise none.
    io: Mutex<Option<Rails>>,
    wake: EventFd,
    sleeping: AtomicBool,
    stop: AtomicBool,
    /// The engine's clock (see [`engine_clock`]) and its raw reading at the start: engine
    /// time is counted from it ([`Self::now`]).
    clock: quanta::Clock,
    epoch: u64,
    /// Who drives the loop.
    progress: Progress,
    /// Caller mode: the keeper's alarm and the application's last poll.
    keeper: Keeper,
    /// Whether a panic failed the engine (every section that changes the state runs
    /// through it).
    failure: Failure,
    /// Caller mode with takeover: the keeper holds the backends and is blocked (or about to
    /// block) in their wait; an application call must wake it to get them back.
    keeper_waiting: AtomicBool,
    /// Longest single wait of the keeper while it runs the loop.
    max_sleep: Duration,
    /// Thread mode: the application's threads run the loop too ([`EngineConfig::assist`]).
    assisted: AtomicBool,
    /// Assisted thread mode: engine time (ns) of the application's last poll; 0 before the
    /// first, and after a poll handed a message over to the engine thread.
    last_assisted_poll: AtomicU64,
    /// Assisted thread mode: engine time (ns) the window in which the engine thread leaves
    /// the sockets to the application runs from (see [`ASSISTED_POLL_WINDOW`]): the last poll,
    /// or a send post since that extended it (see [`Shared::post_send_work`]); 0 with
    /// `last_assisted_poll`.
    assisted_window_from: AtomicU64,
    /// Thread mode: engine time (ns) of the application's last call that posted or polled (0
    /// before the first), which tells the engine thread whether the application is quiet
    /// (see [`ASSISTED_QUIET_AFTER`]).
    last_app_call: AtomicU64,
    /// Assisted thread mode: send posts since the application's last poll (see
    /// [`Shared::post_send_work`]).
    posts_since_poll: AtomicU32,
    /// Assisted thread mode: the engine thread is waiting on its doorbell only, leaving the
    /// sockets to the application's polls.
    standing_aside: AtomicBool,
    /// Caller mode: the application's last poll found nothing to do. The next poll then ends
    /// the acknowledgement holds (see [`Shared::progress`]).
    caller_poll_was_idle: AtomicBool,
}

impl Shared {
    /// Shares `state` for an engine run as `config` says.
    pub(crate) fn new(state: State, config: &EngineConfig) -> io::Result<Shared> {
        let clock = engine_clock();
        let epoch = clock.raw();
        Ok(Shared {
            state: Mutex::new(state),
            io: Mutex::new(None),
            wake: EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?,
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            clock,
            epoch,
            progress: config.progress,
            keeper: Keeper::new(
                config.progress == Progress::Caller,
                config.keeper_period,
                config.keeper_takeover,
            )?,
            failure: Failure::default(),
            keeper_waiting: AtomicBool::new(false),
            max_sleep: config.max_sleep,
            assisted: AtomicBool::new(false),
            last_assisted_poll: AtomicU64::new(0),
            assisted_window_from: AtomicU64::new(0),
            last_app_call: AtomicU64::new(0),
            posts_since_poll: AtomicU32::new(0),
            standing_aside: AtomicBool::new(false),
            caller_poll_was_idle: AtomicBool::new(true),
        })
    }

    /// Whether the application's threads run the loop too (thread mode with
    /// [`EngineConfig::assist`] on an engine that supports it).
    pub(crate) fn is_assisted(&self) -> bool {
        self.assisted.load(Ordering::Relaxed)
    }

    /// Assisted thread mode: whether the application is polling, so that its polls do the
    /// engine's work: its window is open (it polled, or extended the window with a post, less
    /// than [`ASSISTED_POLL_WINDOW`] ago), or one of its threads is using its backends right
    /// now (in a poll or a post's transmit pass, however long). Returns how long the window
    /// stays open.
    fn application_polls(&self) -> Option<Duration> {
        if self.io.try_lock().is_err() {
            return Some(ASSISTED_POLL_WINDOW);
        }
        let from = self.assisted_window_from.load(Ordering::SeqCst);
        let age = Duration::from_nanos(self.now().0.saturating_sub(from));
        (from != 0 && age < ASSISTED_POLL_WINDOW).then(|| ASSISTED_POLL_WINDOW - age)
    }

    /// Records an application call (see `last_app_call`).
    fn note_app_call(&self, now: Time) {
        self.last_app_call.store(now.0.max(1), Ordering::Relaxed);
    }

    /// Assisted thread mode: how long the engine thread spins after a pass that did something
    /// (see [`ASSISTED_QUIET_AFTER`]); `configured` otherwise.
    fn spin_after_busy(&self, configured: Duration) -> Duration {
        if !self.is_assisted() {
            return configured;
        }
        let last = self.last_app_call.load(Ordering::Relaxed);
        let quiet = last == 0
            || self.now().0.saturating_sub(last) >= ASSISTED_QUIET_AFTER.as_nanos() as u64;
        if quiet {
            configured.max(ASSISTED_QUIET_SPIN)
        } else {
            configured
        }
    }

    /// Caller mode: whether the loop has not run for [`crate::keeper::CALLER_PASS_OVERDUE`] (an
    /// application working through completions it has already polled, without polling an empty
    /// queue).
    pub(crate) fn pass_overdue(&self) -> bool {
        self.progress == Progress::Caller
            && self
                .keeper
                .last_entry_older_than(crate::keeper::CALLER_PASS_OVERDUE, self.now())
    }

    /// The current engine time.
    pub(crate) fn now(&self) -> Time {
        // (0 while the counter reads behind the start, as another CPU's might by a little.)
        Time(self.clock.delta_as_nanos(self.epoch, self.clock.raw()))
    }

    /// Locks the shared state (registrations, connection setup, statistics).
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        let mut state = self.lock_quiet();
        // Whoever locks may change what there is to send.
        state.mark_dirty();
        state
    }

    /// Locks the shared state for a query that changes nothing, so it leaves the state clean:
    /// unlike [`Self::lock`], the next pass of the loop is not made to look for something to
    /// send. For queries an application makes between polls (`QueuePair::lending`), where a
    /// dirty state would make every poll a full pass.
    pub(crate) fn lock_to_read(&self) -> MutexGuard<'_, State> {
        self.lock_quiet()
    }

    /// Locks the shared state for the loop itself (which leaves it clean). A lock poisoned by
    /// a panic that was not contained fails the engine (see `failure.rs`) instead of
    /// panicking here too.
    fn lock_quiet(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(state) => state,
            Err(poisoned) => {
                cold_path();
                // A panic that was not contained (see `failure.rs`) left the state
                // half-changed: the engine fails rather than every later call panicking.
                let mut state = poisoned.into_inner();
                let _ = self.failure.fail(
                    &mut state,
                    "a panic while the engine's state was locked".into(),
                );
                state
            }
        }
    }

    /// Runs `f` on the state, then makes sure whatever it queued gets sent: at once in caller
    /// mode, by waking the engine thread in thread mode. This is the doorbell.
    pub(crate) fn post<R>(&self, f: impl FnOnce(&mut State, Time) -> R) -> io::Result<R> {
        match self.progress {
            Progress::Caller => {
                self.enter();
                if self.keeper_waiting.load(Ordering::SeqCst) {
                    // The keeper holds the backends, blocked in their wait: queue the work and
                    // let the keeper (woken by `enter`) send it in its next pass rather than
                    // wait for it to be scheduled.
                    let mut state = self.lock();
                    let now = self.now();
                    let result = self.failure.contain(&mut state, |state| Ok(f(state, now)));
                    drop(state);
                    let _ = self.wake.write(1);
                    return result;
                }
                let mut io = self.io.lock().unwrap_or_else(|e| e.into_inner());
                let mut state = self.lock();
                let now = self.now();
                self.failure.contain(&mut state, |state| {
                    let result = f(state, now);
                    if let Some(rails) = io.as_mut() {
                        state.flush(rails, now)?;
                    }
                    Ok(result)
                })
            }
            Progress::Thread => {
                // Assisted: send from this thread unless another is using its backends (then
                // that one, or the engine thread, sends it; see `EngineConfig::assist` for the
                // deadlines this leaves to the engine thread's bounded sleep).
                if let Some(mut io) = self
                    .assisted
                    .load(Ordering::Relaxed)
                    .then(|| self.io.try_lock().ok())
                    .flatten()
                {
                    if let Some(rails) = io.as_mut() {
                        let mut state = self.lock();
                        let now = self.now();
                        self.note_app_call(now);
                        return self.failure.contain(&mut state, |state| {
                            let result = f(state, now);
                            state.flush(rails, now)?;
                            Ok(result)
                        });
                    }
                }
                let result = {
                    let mut state = self.lock();
                    let now = self.now();
                    self.note_app_call(now);
                    self.failure
                        .contain(&mut state, |state| Ok(f(state, now)))?
                };
                if self.sleeping.load(Ordering::SeqCst) {
                    let _ = self.wake.write(1);
                }
                Ok(result)
            }
        }
    }

    /// [`Self::post`] for send work. Assisted, while the application polls (its window is
    /// open, see [`Self::application_polls`]), the first post after a poll transmits at once
    /// (a ping-pong's reply, the first of a burst); those that follow it before the next poll
    /// only queue, and that poll's transmit pass sends them together, every
    /// [`ASSISTED_POST_BATCH`]-th transmitting the queue at once. A program that posts one
    /// request per call (perftest's bandwidth tests) then costs one system call per batch of
    /// datagrams, not per datagram.
    ///
    /// Each such post restarts the window: a burst that outlasted a window measured from the
    /// poll alone (perftest's 100 posts after a completion) went out one datagram per call
    /// once it had lapsed. Posts extend it for at most [`ASSISTED_BURST_LIMIT`] after the last
    /// poll, because while the window is open the engine thread runs no deadlines: after
    /// that, every post transmits at once and the engine thread is back. An application
    /// that stops calling after a queued post has it sent by the engine thread within
    /// [`ASSISTED_POLL_WINDOW`] of that post.
    pub(crate) fn post_send_work<R>(&self, f: impl FnOnce(&mut State, Time) -> R) -> io::Result<R> {
        if self.progress != Progress::Thread || !self.is_assisted() {
            return self.post(f);
        }
        let polled = self.last_assisted_poll.load(Ordering::SeqCst);
        let now = self.now().0.max(1);
        if polled == 0 || now.saturating_sub(polled) >= ASSISTED_BURST_LIMIT.as_nanos() as u64 {
            return self.post(f);
        }
        let from = self.assisted_window_from.load(Ordering::SeqCst);
        let open = from != 0 && now.saturating_sub(from) < ASSISTED_POLL_WINDOW.as_nanos() as u64;
        // The window runs from this post (the exchange leaves a hand-over's 0, see `progress`,
        // in place).
        let _ = self.assisted_window_from.compare_exchange(
            from,
            now,
            Ordering::SeqCst,
            Ordering::Relaxed,
        );
        let queued = if open {
            self.posts_since_poll.fetch_add(1, Ordering::Relaxed)
        } else {
            // The window had lapsed (the thread was descheduled, say): this post transmits
            // what is queued, and the burst goes on batching after it.
            self.posts_since_poll.store(1, Ordering::Relaxed);
            0
        };
        if queued % ASSISTED_POST_BATCH != 0 {
            self.note_app_call(Time(now));
            let mut state = self.lock();
            // (Read again under the lock: the protocol's deadlines start from it.)
            let now = self.now();
            return self.failure.contain(&mut state, |state| Ok(f(state, now)));
        }
        let result = self.post(f);
        // (The transmit pass may have taken a while: the window runs from its end.)
        let _ = self.assisted_window_from.compare_exchange(
            now,
            self.now().0.max(1),
            Ordering::SeqCst,
            Ordering::Relaxed,
        );
        result
    }

    /// [`Self::post`], or with `quiet` in caller mode (or assisted thread mode), for work that
    /// puts nothing on the wire by itself (posted receives), no transmit pass now: the next
    /// poll's pass routes whatever it produced (a flushed receive on a failed connection, say).
    pub(crate) fn post_maybe_quiet<R>(
        &self,
        quiet: bool,
        f: impl FnOnce(&mut State, Time) -> R,
    ) -> io::Result<R> {
        if quiet && (self.progress == Progress::Caller || self.is_assisted()) {
            let mut state = self.lock();
            let now = self.now();
            if self.progress == Progress::Thread {
                self.note_app_call(now);
            }
            return self.failure.contain(&mut state, |state| Ok(f(state, now)));
        }
        self.post(f)
    }

    /// Caller mode: runs the loop once (receive, deadlines, transmit), first ending the
    /// acknowledgement holds when the previous poll found nothing to do. Thread mode:
    /// runs it once if the application's threads assist ([`EngineConfig::assist`]), else
    /// nothing (the engine thread does it). Returns whether anything happened.
    pub(crate) fn progress(&self) -> io::Result<bool> {
        if self.progress == Progress::Thread {
            if !self.assisted.load(Ordering::Relaxed) {
                return Ok(false);
            }
            // (While this poll runs, it holds the backends, which tells the engine thread to
            // keep out; its end is recorded below.)
            self.posts_since_poll.store(0, Ordering::Relaxed);
            let mut hand_over = false;
            // As in caller mode, this poll is the "next call" acknowledgement holds wait for.
            let ran = self.with_rails(|state, rails, now| {
                state.release_held_acks();
                let before = state.completions_routed();
                let busy = state.run_once(rails, now)?;
                // A poll that returns completions may be the application's last for a while
                // (it goes on to read its memory, say), while a message is still arriving (a
                // reply whose first packet carried the acknowledgement that completed them):
                // this poll receives the rest for up to `ASSISTED_LINGER`, and what is still
                // due after that is left to the engine thread rather than to a poll that may
                // not come.
                if state.completions_routed() != before && state.receiving() {
                    let until = now + ASSISTED_LINGER;
                    loop {
                        let now = self.now();
                        if now >= until || !state.receiving() {
                            break;
                        }
                        state.run_once(rails, now)?;
                    }
                    hand_over = state.receiving();
                }
                Ok(busy)
            });
            if hand_over {
                // SeqCst with the engine thread's announcement (see `engine_thread`).
                self.last_assisted_poll.store(0, Ordering::SeqCst);
                self.assisted_window_from.store(0, Ordering::SeqCst);
                self.note_app_call(self.now());
                if self.standing_aside.load(Ordering::SeqCst) {
                    let _ = self.wake.write(1);
                }
            } else {
                // The engine thread reads this to leave the receiving to the polls.
                let now = self.now();
                self.note_app_call(now);
                let now = now.0.max(1);
                self.last_assisted_poll.store(now, Ordering::Relaxed);
                self.assisted_window_from.store(now, Ordering::Relaxed);
            }
            return ran;
        }
        self.enter();
        self.with_rails(|state, rails, now| {
            // The keeper reads this to tell whether the application is still polling.
            self.keeper.note_poll(now);
            // Holds end at the first poll after one that found nothing: the application is
            // then waiting, so the reply a hold waits for is not being prepared. Ending them at
            // every poll sent each ACK by itself whenever the reply went on another queue pair
            // (NCCL's send and receive comms between two processes are two): the poll that
            // completed a reply was followed by another (NCCL testing its send) before the next
            // message was posted, and that poll sent the ACK alone, one more system call and
            // one more datagram on the critical path. Now the next message to the peer carries
            // it (`TxBatch::commit_coalescing`). A connection with a send of its own still
            // unacknowledged ends its hold at the next poll, as before: in an exchange both
            // ways (a two-rank all-reduce), the peer's ACK of that send may be waiting for
            // this one. Polls that are all busy leave a hold to its deadline
            // (`CALLER_ACK_HOLD`).
            if self.caller_poll_was_idle.load(Ordering::Relaxed) {
                state.release_held_acks();
            } else {
                state.release_held_acks_of_waiting();
            }
            let busy = state.run_once(rails, now)?;
            self.caller_poll_was_idle.store(!busy, Ordering::Relaxed);
            Ok(busy)
        })
    }

    /// Caller mode with takeover: an application call begins. Recorded before anything is
    /// locked, then a keeper blocked in the backends' wait is woken so that it hands them back
    /// (the keeper sets `keeper_waiting` before it looks at the time of the last call, the
    /// application records that time before it looks at `keeper_waiting`: one of them sees the
    /// other).
    fn enter(&self) {
        if self.keeper.takes_over() {
            self.keeper.note_entry(self.now());
            if self.keeper_waiting.load(Ordering::SeqCst) {
                let _ = self.wake.write(1);
            }
        }
    }

    /// Caller mode with takeover, for the keeper once the application has gone: runs the loop
    /// (ending acknowledgement holds first, as a poll does), then blocks in the backends' wait
    /// until a datagram, the next deadline or the application's next call, and again, until
    /// the application is back or the engine stops. Nothing spins: a pass that did nothing is
    /// followed by a wait.
    fn take_over(&self) -> io::Result<()> {
        while !self.stop.load(Ordering::SeqCst) {
            let Ok(mut io) = self.io.try_lock() else {
                // The application is using the backends: it is back.
                return Ok(());
            };
            let Some(rails) = io.as_mut() else {
                return Ok(());
            };
            if self.failure.is_failed() {
                // Nothing runs on a failed engine.
                return Ok(());
            }
            let (busy, timeout) = {
                let mut state = self.lock_quiet();
                let now = self.now();
                let busy = self.failure.contain(&mut state, |state| {
                    state.release_held_acks();
                    state.run_once(rails, now)
                })?;
                let timeout = state
                    .next_deadline()
                    .map_or(self.max_sleep, |d| d.saturating_since(now))
                    .min(self.max_sleep);
                (busy, timeout)
            };
            // Checked after the pass, so that what a returning application queued while the
            // keeper waited (see `post`) has been sent.
            if !self.keeper.app_away(self.now()) {
                return Ok(());
            }
            if busy {
                continue;
            }
            self.keeper_waiting.store(true, Ordering::SeqCst);
            let mut waited = Ok(());
            if self.keeper.app_away(self.now()) && !self.stop.load(Ordering::SeqCst) {
                // The wait watches rail 0 only: with several rails it stays short.
                let timeout = if rails.len() > 1 {
                    timeout.min(Duration::from_millis(1))
                } else {
                    timeout
                };
                waited = rails[0].wait(timeout, self.wake.as_fd());
                let _ = self.wake.read();
            }
            self.keeper_waiting.store(false, Ordering::SeqCst);
            waited?;
        }
        Ok(())
    }

    /// Tells the engine or keeper thread to stop and wakes it.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.wake.write(1);
        // The keeper blocks on its alarm: ring it, under the state lock, so that a keeper
        // deciding to park (under that lock) either parks before the ring or sees the stop.
        // (Before, a park right after the ring left the keeper waiting for ever, and the
        // engine's drop joining it.)
        let _state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.keeper.ring();
    }

    /// Caller mode, for the keeper: sends the acknowledgements still held. Nothing else: the
    /// application's own polls receive (a keeper that received would run connection timers
    /// against a socket nobody reads and hand completions to an application in mid-step).
    /// Returns whether some may still be held: their datagram could not go out, or another
    /// thread was using the backends (and may leave without polling).
    fn flush_held_acks(&self) -> io::Result<bool> {
        if self.failure.is_failed() {
            // Nothing to send ever again: park for good (under the lock, as below).
            let _state = self.lock_quiet();
            self.keeper.park();
            return Ok(false);
        }
        let mut ran = false;
        let held = self.with_rails(|state, rails, now| {
            ran = true;
            if state.acks_held() {
                state.release_held_acks();
                state.flush(rails, now)?;
            }
            // (A keeper that takes over never parks: its alarm must tell it when to.)
            if !state.acks_held() && !self.stop.load(Ordering::SeqCst) && !self.keeper.takes_over()
            {
                // Nothing left to send: park (under the lock, see `Keeper::park`; never once
                // stopping, see `stop`).
                self.keeper.park();
            }
            Ok(state.acks_held())
        })?;
        Ok(held || !ran)
    }

    /// Caller mode, or thread mode when assisted: runs `f` on the state and the application's
    /// backends unless another thread is using them right now (it is doing the same work:
    /// skip, returning false); without backends (thread mode, not assisted), returns false.
    fn with_rails(
        &self,
        f: impl FnOnce(&mut State, &mut Rails, Time) -> io::Result<bool>,
    ) -> io::Result<bool> {
        let Ok(mut io) = self.io.try_lock() else {
            return Ok(false);
        };
        let Some(rails) = io.as_mut() else {
            return Ok(false);
        };
        // An assisting thread never waits for the engine thread, which holds the state only
        // while it does this same work: waiting would let a preempted engine thread stall the
        // application for a time slice (two cores, both busy-polled, make that common).
        let mut state = if self.progress == Progress::Thread {
            match self.state.try_lock() {
                Ok(state) => state,
                Err(std::sync::TryLockError::WouldBlock) => return Ok(false),
                Err(std::sync::TryLockError::Poisoned(_)) => self.lock_quiet(),
            }
        } else {
            self.lock_quiet()
        };
        let now = self.now();
        self.failure
            .contain(&mut state, |state| f(state, rails, now))
    }
}

/// The clock engine time is read from, shared by every engine of the process: the CPU's
/// time-stamp counter scaled to nanoseconds, where the CPU says it is invariant (quanta checks
/// CPUID and calibrates it once against the monotonic clock, in about 0.6 ms), otherwise the
/// monotonic clock itself. The engine reads it on every pass of its loop and two or three times
/// more per message and side (the post, the completion queue's overdue check): on this
/// project's VMs a read costs 11-12 ns against 36-37 ns for `clock_gettime`, whose vDSO code
/// orders the counter's read with a fence and converts under a sequence lock
/// (docs/performance.md, stop 48). Engine time only ever meets engine time (deadlines, the
/// keeper's bookkeeping); waits take durations.
fn engine_clock() -> quanta::Clock {
    static CLOCK: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new).clone()
}

/// What [`launch`] started: the backend kind of rail 0, why the preferred one was not used (if
/// it was not), and the engine thread (thread mode) or the keeper (caller mode).
pub(crate) type Launched = (EngineKind, Option<String>, JoinHandle<()>);

/// Opens the backends on `sockets` (one per rail) and starts the thread that goes with the
/// progress mode: in caller mode the backends go into `shared` and the keeper starts; in
/// thread mode the engine thread opens them (it will be their only user) and runs the loop.
pub(crate) fn launch(
    shared: &Arc<Shared>,
    config: &EngineConfig,
    mut sockets: Vec<UdpSocket>,
) -> io::Result<Launched> {
    match config.progress {
        Progress::Caller => {
            let (rails, kind, fallback) = open_rails(config, sockets, false)?;
            *shared.io.lock().unwrap_or_else(|e| e.into_inner()) = Some(rails);
            let keeper_shared = Arc::clone(shared);
            let keeper = std::thread::Builder::new()
                .name("tbrdma-keeper".into())
                .spawn(move || {
                    let s = &keeper_shared;
                    s.keeper.run(
                        &s.stop,
                        || s.now(),
                        || s.flush_held_acks(),
                        || s.take_over(),
                    )
                })?;
            Ok((kind, fallback, keeper))
        }
        Progress::Thread => {
            // Assisted: the application's backends and the engine thread's are opened here as
            // pairs over the same sockets (a datagram goes to whichever set reads first, and
            // both handle it under the state's lock); the engine thread's set moves to it.
            let mut paired = None;
            if config.assist && config.engine != EngineKind::Uring {
                let (engine_rails, app_rails, kind, fallback) =
                    open_rail_pairs(config, std::mem::take(&mut sockets))?;
                *shared.io.lock().unwrap_or_else(|e| e.into_inner()) = Some(app_rails);
                shared.assisted.store(true, Ordering::SeqCst);
                paired = Some((engine_rails, kind, fallback));
            }
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let thread_shared = Arc::clone(shared);
            let thread_config = config.clone();
            let worker = std::thread::Builder::new()
                .name("tbrdma-engine".into())
                .spawn(move || {
                    // Unpaired, the backend is created on this thread, which will be its only
                    // user (io_uring's single issuer).
                    let opened =
                        paired.map_or_else(|| open_rails(&thread_config, sockets, true), Ok);
                    match opened {
                        Ok((rails, kind, fallback)) => {
                            let _ = ready_tx.send(Ok((kind, fallback)));
                            engine_thread(thread_shared, rails, thread_config);
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                })?;
            let (kind, fallback) = ready_rx
                .recv()
                .map_err(|_| io::Error::other("engine thread died at start"))??;
            Ok((kind, fallback, worker))
        }
    }
}

/// Opens a backend on each rail's socket; returns them, the kind of the first and any
/// fallback reason.
type OpenedRails = (Rails, EngineKind, Option<String>);

fn open_rails(
    config: &EngineConfig,
    sockets: Vec<UdpSocket>,
    single_issuer: bool,
) -> io::Result<OpenedRails> {
    let faults = fault_plan(config)?;
    let mut rails = Vec::with_capacity(sockets.len());
    let mut fallback = None;
    for (rail, socket) in sockets.into_iter().enumerate() {
        let (io, why) = open_io(config.engine, socket, config.max_datagram, single_issuer)?;
        fallback = fallback.or(why);
        rails.push(with_faults(io, faults.as_ref(), rail));
    }
    let kind = rails[0].kind();
    Ok((Rails::new(rails), kind, fallback))
}

/// [`open_rails`] for assisted thread mode: two sets over the same sockets (`io::open_pair`),
/// the engine thread's and the application's.
fn open_rail_pairs(
    config: &EngineConfig,
    sockets: Vec<UdpSocket>,
) -> io::Result<(Rails, Rails, EngineKind, Option<String>)> {
    let faults = fault_plan(config)?;
    let (mut engine_side, mut app_side) = (Vec::new(), Vec::new());
    let mut fallback = None;
    for (rail, socket) in sockets.into_iter().enumerate() {
        let (engine_io, app_io, why) =
            crate::io::open_pair(config.engine, socket, config.max_datagram)?;
        fallback = fallback.or(why);
        engine_side.push(with_faults(engine_io, faults.as_ref(), rail));
        app_side.push(with_faults(app_io, faults.as_ref(), rail));
    }
    let kind = engine_side[0].kind();
    Ok((
        Rails::new(engine_side),
        Rails::new(app_side),
        kind,
        fallback,
    ))
}

/// The fault plan of `config`, or of the environment (`TBRDMA_FAULTS`).
fn fault_plan(config: &EngineConfig) -> io::Result<Option<FaultPlan>> {
    match &config.faults {
        Some(plan) => Ok(Some(plan.clone())),
        None => {
            FaultPlan::from_env().map_err(|why| io::Error::new(io::ErrorKind::InvalidInput, why))
        }
    }
}

/// `io`, behind the faulty cable of `plan` where it applies to `rail`.
fn with_faults(
    io: Box<dyn DatagramIo>,
    plan: Option<&FaultPlan>,
    rail: usize,
) -> Box<dyn DatagramIo> {
    match plan.filter(|p| p.applies_to(rail)) {
        Some(plan) => {
            tracing::warn!("rail {rail}: injecting faults into received datagrams: {plan:?}");
            Box::new(FaultyIo::new(io, plan.clone(), rail))
        }
        None => io,
    }
}

fn engine_thread(shared: Arc<Shared>, mut rails: Rails, config: EngineConfig) {
    if let Some(cpu) = config.cpu {
        let mut set = nix::sched::CpuSet::new();
        if set.set(cpu).is_ok() {
            if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
                tracing::warn!("cannot pin the engine thread to CPU {cpu}: {e}");
            }
        }
    }
    let mut last_busy = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) && !shared.failure.is_failed() {
        // Assisted, while the application polls, its polls run the loop (receive, deadlines,
        // transmit): the engine thread keeps out of their way, neither taking the state from
        // them nor woken by the datagrams they read, and looks again when the application
        // may have stopped (see `ASSISTED_POLL_WINDOW`).
        if let Some(look_again) = shared.application_polls() {
            // Announce it, then look once more: a poll that handed a message over (see
            // `Shared::progress`) either sees the announcement and rings, or is seen here.
            shared.standing_aside.store(true, Ordering::SeqCst);
            if shared.application_polls().is_some() {
                if let Err(e) = crate::io::wait_readable_one(shared.wake.as_fd(), look_again) {
                    tracing::error!("engine wait failed: {e}");
                }
                let _ = shared.wake.read();
            }
            shared.standing_aside.store(false, Ordering::SeqCst);
            continue;
        }
        let busy = run_locked(&shared, &mut rails);
        if busy {
            last_busy = Instant::now();
            continue;
        }
        let since_busy = last_busy.elapsed();
        if since_busy < config.spin {
            std::hint::spin_loop();
            continue;
        }
        if since_busy < shared.spin_after_busy(config.spin) {
            // The quiet application's spin (`ASSISTED_QUIET_SPIN`) yields the core between
            // passes: "no call for 1 ms" is also what an application thread that is runnable
            // but descheduled looks like, and on a small host this spin must not keep it off
            // the core. With nothing else runnable here the yield returns at once.
            std::thread::yield_now();
            continue;
        }
        // Announce the sleep, then look once more: a post that raced with the announcement is
        // either seen now or wakes the sleep through the eventfd.
        shared.sleeping.store(true, Ordering::SeqCst);
        if run_locked(&shared, &mut rails) {
            last_busy = Instant::now();
        } else {
            let deadline = shared.lock_quiet().next_deadline();
            let now = shared.now();
            // Assisted, a post does not wake this thread: it sleeps no longer than the
            // deadline a post may have set since it looked would tolerate.
            let max_sleep = if shared.assisted.load(Ordering::Relaxed) {
                config.max_sleep.min(ASSISTED_MAX_SLEEP)
            } else {
                config.max_sleep
            };
            let timeout = deadline
                .map_or(max_sleep, |d| d.saturating_since(now))
                .min(max_sleep);
            shared.lock_quiet().count_sleep();
            // With several rails the sleep watches rail 0 only, so it is kept short.
            let timeout = if rails.len() > 1 {
                timeout.min(Duration::from_millis(1))
            } else {
                timeout
            };
            if let Err(e) = rails[0].wait(timeout, shared.wake.as_fd()) {
                tracing::error!("engine wait failed: {e}");
            }
            let _ = shared.wake.read();
        }
        shared.sleeping.store(false, Ordering::SeqCst);
        // (No spin after a wake alone: the pass after it spins if it finds work. A timer's
        // wake with nothing to do used to spin too, which kept an idle engine busy for the
        // spin once per sleep.)
    }
}

fn run_locked(shared: &Shared, rails: &mut Rails) -> bool {
    let now = shared.now();
    let mut state = shared.lock_quiet();
    match shared
        .failure
        .contain(&mut state, |state| state.run_once(rails, now))
    {
        Ok(busy) => busy,
        Err(e) => {
            tracing::error!("engine I/O failed: {e}");
            false
        }
    }
}
