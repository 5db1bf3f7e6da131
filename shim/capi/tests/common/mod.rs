//! Helpers shared by the C API's integration tests.

use std::path::PathBuf;
use std::process::Output;

/// The folder holding the `libtbrdma.so` cargo built for this run.
pub fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps folder");
    for dir in [deps, deps.parent().expect("profile folder")] {
        if dir.join("libtbrdma.so").exists() {
            return dir.to_path_buf();
        }
    }
    panic!("libtbrdma.so not found next to {}", deps.display());
}

/// A child's stdout and stderr, for assertion messages.
pub fn show(o: &Output) -> String {
    format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
