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

/// What a benchmark's header says about tbrdma's data digests, which the children inherit from
/// the environment (`TBRDMA_DATA_DIGEST`, docs/wire-format.md, "What the CRC covers").
pub fn data_digest_note() -> String {
    let env = tbrdma_engine::worker::DATA_DIGEST_ENV;
    match std::env::var(env) {
        Ok(value) if !value.trim().is_empty() => format!("tbrdma data digests: {env}={value}"),
        _ => format!("tbrdma data digests: off (the default; {env}=1 turns them on)"),
    }
}
