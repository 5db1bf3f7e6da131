//! The two-host lab the demo and the soak build for themselves: two network namespaces joined
//! by two veth cables (MTU 65520), removed however the run ends.

use anyhow::Context;
use tbrdma_netdev::hostfile::Hostfile;
use tbrdma_netdev::lab::{self, LabOptions, LabTopology};

/// Removes the lab when dropped.
#[derive(Debug)]
pub struct LabGuard(String);

impl Drop for LabGuard {
    fn drop(&mut self) {
        match lab::down(&self.0) {
            Ok(_) => eprintln!("lab {} removed", self.0),
            Err(e) => eprintln!(
                "removing lab {}: {e} (run `tbrdma lab down --name {}`)",
                self.0, self.0
            ),
        }
    }
}

/// Builds lab `name`: two ranks, a pair, two cables. Returns its guard and hostfile.
pub fn up(name: &str) -> anyhow::Result<(LabGuard, Hostfile)> {
    let options = LabOptions {
        name: name.to_string(),
        ranks: 2,
        topology: LabTopology::Pair,
        rails: 2,
        mtu: 65520,
        force: false,
    };
    let path = lab::up(&options).context("building the lab")?;
    let guard = LabGuard(name.to_string());
    let hostfile = Hostfile::load(&path)?;
    Ok((guard, hostfile))
}
