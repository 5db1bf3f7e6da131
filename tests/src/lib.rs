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

/// Name of the nftables table the lab's loss rules live in (one per namespace; it goes with
/// the namespace).
const LOSS_TABLE: &str = "tbrdma_test_loss";

impl Lab {
    /// Makes every rank's kernel drop about `per_mille` of the UDP datagrams it sends, chosen
    /// at random (nftables; the kernel here has no netem). Panics, naming the fix, when the
    /// `nft` tool is missing.
    pub fn drop_udp(&self, per_mille: u32) {
        let rules = format!(
            "add table inet {LOSS_TABLE}\n\
             add chain inet {LOSS_TABLE} out {{ type filter hook output priority 0; }}\n\
             add rule inet {LOSS_TABLE} out meta l4proto udp numgen random mod 1000 < {per_mille} counter drop\n"
        );
        for rank in 0..self.hostfile.ranks.len() {
            self.nft(rank, &["-f", "-"], Some(&rules));
        }
    }

    /// UDP datagrams the rules of [`Self::drop_udp`] dropped so far, over all ranks.
    pub fn dropped_udp(&self) -> u64 {
        (0..self.hostfile.ranks.len())
            .map(|rank| {
                let listing = self.nft(rank, &["list", "table", "inet", LOSS_TABLE], None);
                listing
                    .split_whitespace()
                    .skip_while(|w| *w != "packets")
                    .nth(1)
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("no packet counter in:\n{listing}"))
            })
            .sum()
    }

    /// Runs `nft args` in `rank`'s namespace, with `input` on stdin; returns its output.
    fn nft(&self, rank: usize, args: &[&str], input: Option<&str>) -> String {
        use std::io::Write;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.namespace(rank), "nft"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ip netns exec");
        let mut stdin = child.stdin.take().expect("piped stdin");
        if let Some(text) = input {
            stdin.write_all(text.as_bytes()).expect("write nft rules");
        }
        drop(stdin);
        let out = child.wait_with_output().expect("wait for nft");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "nft {args:?} in {} failed: {stderr} (the loss tests need nftables: \
             apt-get install nftables)",
            self.namespace(rank)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
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
