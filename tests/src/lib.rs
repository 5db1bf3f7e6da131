//! End-to-end tests of the `tbrdma` tools, run the way a user runs them (see `tests/`).
//! The library part holds helpers shared by those tests.

use std::path::PathBuf;

/// Path of the `tbrdma` binary built for this test run.
pub fn tbrdma_bin() -> PathBuf {
    let mut dir = std::env::current_exe().expect("test executable path");
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join("tbrdma")
}
