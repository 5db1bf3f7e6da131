//! Multi-process tests of tbrdma over real sockets between network namespaces live in
//! `tests/`; this library holds what they share: a lab of namespaces joined by veth "cables"
//! (built with `tbrdma-netdev`'s lab, torn down on drop) and a way to run the test peer
//! (`src/bin/peer.rs`) inside one of them.

use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};

use tbrdma_netdev::hostfile::Hostfile;
use tbrdma_netdev::lab::{self, LabOptions, LabTopology};

/// A lab that exists for the lifetime of this value.
#[derive(Debug)]
pub struct Lab {
    /// Unique lab name.
    pub name: String,
    /// Its hostfile.
    pub hostfile: Hostfile,
}

impl Lab {
    /// Builds a lab of `ranks` ranks with `rails` cables per neighbour, or returns `None` (and
    /// says why) when this process may not create namespaces (not root).
    pub fn up(tag: &str, ranks: usize, topology: LabTopology, rails: u32) -> Option<Lab> {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipping: network-namespace tests need root");
            return None;
        }
        let name = format!("t{}{}", tag, std::process::id() % 100_000);
        let options = LabOptions {
            name: name.clone(),
            ranks,
            topology,
            rails,
            mtu: 65520,
            force: true,
        };
        let path = lab::up(&options).unwrap_or_else(|e| panic!("lab up {name}: {e}"));
        let hostfile = Hostfile::load(&path).expect("lab hostfile");
        Some(Lab { name, hostfile })
    }

    /// Namespace of `rank`.
    pub fn namespace(&self, rank: usize) -> String {
        lab::namespace_name(&self.name, rank)
    }

    /// Address of `rank` on its cable to `peer`, rail `rail`.
    pub fn address(&self, rank: usize, peer: usize, rail: u32) -> Ipv4Addr {
        self.hostfile.ranks[rank]
            .links
            .iter()
            .find(|l| l.peer == peer && l.rail == rail)
            .unwrap_or_else(|| panic!("rank {rank} has no rail {rail} to {peer}"))
            .address
    }

    /// Interface name of `rank`'s cable to `peer`, rail `rail`.
    pub fn interface(&self, rank: usize, peer: usize, rail: u32) -> String {
        self.hostfile.ranks[rank]
            .links
            .iter()
            .find(|l| l.peer == peer && l.rail == rail)
            .expect("link")
            .interface
            .clone()
    }

    /// Starts the test peer `bin` (pass `env!("CARGO_BIN_EXE_tbrdma-test-peer")`) in `rank`'s
    /// namespace with `args`, output piped.
    pub fn spawn_peer(&self, bin: &str, rank: usize, args: &[String]) -> Child {
        Command::new(bin)
            .arg(self.namespace(rank))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the test peer")
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Err(e) = lab::down(&self.name) {
            eprintln!("lab down {}: {e}", self.name);
        }
    }
}

/// Waits for a peer and returns (success, stdout, stderr).
pub fn finish(child: Child) -> (bool, String, String) {
    let out = child.wait_with_output().expect("wait for the test peer");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
