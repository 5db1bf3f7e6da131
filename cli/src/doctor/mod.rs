//! The checks `tbrdma doctor` gets from this crate, because tbrdma-netdev (which owns the doctor)
//! must not depend on the transport or the plugin: a ping-pong and a bandwidth run over each link
//! (`transport`), and the NCCL/RCCL plugin loaded as the current environment would load it
//! (`nccl`, with the `dlopen` itself in `nccl_probe`, run in a child process).

pub mod nccl;
pub mod nccl_probe;
pub mod transport;

use tbrdma_netdev::doctor::{Check, LinkUnderTest, Probes};

/// The probes the CLI plugs into `tbrdma doctor`.
#[derive(Debug, Default)]
pub struct CliProbes;

impl Probes for CliProbes {
    fn links(&self, links: &[LinkUnderTest]) -> Vec<Check> {
        transport::checks(links, &transport::Settings::from_env())
    }

    fn nccl(&self) -> Vec<Check> {
        nccl::checks(&|name| std::env::var(name).ok())
    }
}
