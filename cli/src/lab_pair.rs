//! The labs the demo and the soak build for themselves, removed however the run ends: two
//! network namespaces joined by two veth cables (MTU 65520), and the demo's four hosts cabled
//! as a ring.

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

/// Builds lab `name`: four ranks cabled as a ring (one cable per neighbour), as four boxes with
/// two USB4 ports each are. Returns its guard.
pub fn up_ring_of_four(name: &str) -> anyhow::Result<LabGuard> {
    let options = LabOptions {
        name: name.to_string(),
        ranks: 4,
        topology: LabTopology::Ring,
        rails: 1,
        mtu: 65520,
        force: false,
    };
    lab::up(&options).context("building the ring of four")?;
    Ok(LabGuard(name.to_string()))
}
