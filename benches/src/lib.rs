//! Helpers shared by the benchmark binaries (`linkbench`, `collbench`); the criterion
//! benchmarks live in `benches/benches/`.

use tbrdma_netdev::lab;

/// Takes lab `name` down when dropped (after a run, an error or a panic alike), saying so on
/// stderr under the name of `tool`.
#[derive(Debug)]
pub struct LabGuard {
    /// The lab.
    pub name: String,
    /// The benchmark that made it, for the messages.
    pub tool: &'static str,
}

impl Drop for LabGuard {
    fn drop(&mut self) {
        match lab::down(&self.name) {
            Ok(_) => eprintln!("lab {} taken down", self.name),
            Err(e) => eprintln!("{}: taking lab {} down: {e}", self.tool, self.name),
        }
    }
}
