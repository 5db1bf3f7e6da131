//! Scheduling class of the engine's helper threads.
//!
//! **This file contains `unsafe`**: one `sched_setscheduler` call (the nix crate does not wrap
//! it).

use std::io;

/// Moves the calling thread to `SCHED_BATCH`: it keeps its fair share of the CPU but does not
/// preempt the thread running on a core when it wakes up; it runs at that thread's next yield,
/// block or time-slice end instead. For a periodic housekeeping thread next to a busy-polling
/// application this turns each wake-up from an interruption of the application's critical path
/// into work done while the application waits anyway.
pub fn set_batch_scheduling() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid, initialised `sched_param` that outlives the call; pid 0 names
    // the calling thread; the call reads the struct and changes nothing else in this process.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
