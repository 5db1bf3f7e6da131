//! Root detection and a lab that always comes down, even when the test panics.

use tbrdma_netdev::lab::{self, LabOptions, LabTopology};

/// True when the test can create namespaces; otherwise prints why it is skipped.
pub fn have_root(test: &str) -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        eprintln!("skipping {test}: needs root (network namespaces); CI runs it as root");
    }
    root
}

/// A lab that `lab down`s itself on drop.
pub struct LabGuard {
    pub name: String,
    pub options: LabOptions,
}

impl LabGuard {
    /// Brings up a lab whose name is unique to this test and process.
    pub fn up(test: &str, ranks: usize, topology: LabTopology, rails: u32) -> Self {
        let name = format!("{test}-{}", std::process::id() % 100_000);
        let options = LabOptions {
            name: name.clone(),
            ranks,
            topology,
            rails,
            mtu: lab::DEFAULT_MTU,
            force: true,
        };
        let guard = LabGuard { name, options };
        lab::up(&guard.options).expect("lab up");
        guard
    }

    pub fn namespace(&self, rank: usize) -> String {
        lab::namespace_name(&self.name, rank)
    }
}

impl Drop for LabGuard {
    fn drop(&mut self) {
        if let Err(e) = lab::down(&self.name) {
            eprintln!("lab down {} failed: {e}", self.name);
        }
    }
}
