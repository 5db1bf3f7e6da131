//! `tbrdma demo`: two endpoints through the simulated lossy link.

/// Options of `tbrdma demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {}

/// Runs the demo.
pub fn run(_args: DemoArgs) -> anyhow::Result<()> {
    Ok(())
}
