//! Branch hints for the per-message path.
//!
//! Between two messages the kernel's network path runs on the same CPU and evicts the
//! engine's code and branch history, so each message fetches its path cold, and every jump
//! it takes is a break in that fetch (docs/performance.md, issue 16, "Rare branches out of
//! line"). Without a profile the compiler lays a rare branch's block in line and the common
//! path jumps over it; a call to [`cold_path`] in the rare block moves it out of line, so
//! the common path falls through.

/// Marks the branch that calls it as rarely taken. (`std::hint::cold_path` does the same
/// from Rust 1.95; the workspace supports 1.85.) Never inlined: a call to a cold function
/// is what tells the compiler, and an inlined empty body would tell it nothing.
#[cold]
#[inline(never)]
pub fn cold_path() {}
