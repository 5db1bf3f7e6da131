//! What a bug in the engine turns into: a panic in the loop, or in a state method run for the
//! application, fails the engine instead of unwinding through it. Every connection is then
//! abandoned (its outstanding requests and posted receives complete as flushed), and every
//! later call that would post or drive the engine returns an error naming the panic. No lock
//! is poisoned on the way: the panic is caught inside the section that holds the state's
//! lock, which is released normally afterwards. (A lock poisoned anyway, by a panic in code
//! that is not contained, fails the engine the same way on the next lock.)
//!
//! This module owns the engine's failed flag and its reason; [`crate::progress`] runs the
//! sections through [`Failure::contain`].

use std::any::Any;
use std::io;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use crate::state::State;

/// Whether the engine failed, and why (set once, never cleared: a failed engine stays failed).
#[derive(Debug, Default)]
pub(crate) struct Failure {
    reason: OnceLock<String>,
}

impl Failure {
    /// An error if the engine failed.
    pub(crate) fn check(&self) -> io::Result<()> {
        match self.reason.get() {
            Some(reason) => Err(failed_error(reason)),
            None => Ok(()),
        }
    }

    /// Whether the engine failed.
    pub(crate) fn is_failed(&self) -> bool {
        self.reason.get().is_some()
    }

    /// Runs `f` on `state`. A panic in it fails the engine: every connection in `state` is
    /// abandoned and the error says why. Refused (with that error) once the engine failed.
    pub(crate) fn contain<R>(
        &self,
        state: &mut State,
        f: impl FnOnce(&mut State) -> io::Result<R>,
    ) -> io::Result<R> {
        self.check()?;
        match catch_unwind(AssertUnwindSafe(|| f(&mut *state))) {
            Ok(result) => result,
            Err(payload) => Err(self.fail(state, panic_message(&*payload))),
        }
    }

    /// Fails the engine for `reason` (if it had not failed already) and abandons every
    /// connection in `state`; returns the error later calls get.
    pub(crate) fn fail(&self, state: &mut State, reason: String) -> io::Error {
        if self.reason.set(reason).is_ok() {
            let reason = self.reason.get().map_or("", String::as_str);
            tracing::error!("the tbrdma engine failed: {reason}; every connection is flushed");
            // The state may be half-way through a change; abandoning it only completes
            // requests and forgets connections. Should that panic as well, the connections
            // are left as they are (the engine refuses every later call anyway).
            let _ = catch_unwind(AssertUnwindSafe(|| state.abandon()));
        }
        failed_error(self.reason.get().map_or("", String::as_str))
    }
}

fn failed_error(reason: &str) -> io::Error {
    io::Error::other(format!(
        "the tbrdma engine failed ({reason}); its connections were flushed: close this device \
         and open a new one (this is a bug: please report it with the log)"
    ))
}

/// The message a panic carried.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".to_string()
    }
}
