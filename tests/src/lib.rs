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
        // The tests run programs in the namespaces with `ip netns exec`.
        if let Err(e) = Command::new("ip").arg("-V").output() {
            eprintln!("skipping: the `ip` tool is not installed ({e}; apt-get install iproute2)");
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
        self.spawn_peer_with(bin, rank, args, &[])
    }

    /// [`Self::spawn_peer`] with extra environment variables.
    pub fn spawn_peer_with(
        &self,
        bin: &str,
        rank: usize,
        args: &[String],
        env: &[(&str, String)],
    ) -> Child {
        Command::new(bin)
            .arg(self.namespace(rank))
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the test peer")
    }
}

/// Name of the nftables table the lab's fault rules live in (one per namespace; it goes with
/// the namespace).
const FAULT_TABLE: &str = "tbrdma_test_faults";
/// Name of the nftables table that counts frames for [`Lab::watch_frames`].
const WATCH_TABLE: &str = "tbrdma_test_watch";

/// Faults the kernels of a lab inflict on the UDP datagrams they send, each in per mille of the
/// datagrams, chosen at random: `drop` them, send a `duplicate` along, or `corrupt` four bytes
/// (the 21st to 24th after a tbrdma header, left alone in shorter datagrams). As counts (see
/// [`Lab::faults_done`]): how many datagrams each rule hit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    pub drop: u64,
    pub duplicate: u64,
    pub corrupt: u64,
}

/// Whether the `nft` tool is here, or why not (the kernel fault tests skip without it; the
/// user-space faulty cable of `TBRDMA_FAULTS` covers the same faults everywhere).
pub fn nftables_available() -> Result<(), String> {
    match Command::new("nft").arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "`nft --version` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!(
            "nftables is not installed ({e}; apt-get install nftables)"
        )),
    }
}

impl Faults {
    /// The same faults as a user-space plan for the engine's fault layer (`TBRDMA_FAULTS`),
    /// seeded with `seed`, with `reorder` per mille of the datagrams overtaken as well (which
    /// nftables cannot do).
    pub fn user_space_plan(&self, seed: u64, reorder: u64) -> String {
        format!(
            "seed={seed},drop={},dup={},corrupt={},reorder={},reorder_by=300us",
            self.drop as f64 / 1000.0,
            self.duplicate as f64 / 1000.0,
            self.corrupt as f64 / 1000.0,
            reorder as f64 / 1000.0
        )
    }
}

/// Sums the `faults injected: …` lines (see the collectives peer) of several outputs into
/// counts by kind: `(seen, dropped, duplicated, corrupted, reordered)`.
pub fn faults_injected<'a>(outputs: impl IntoIterator<Item = &'a str>) -> [u64; 5] {
    let mut sum = [0u64; 5];
    for out in outputs {
        for line in out.lines() {
            let Some(rest) = line.strip_prefix("faults injected: ") else {
                continue;
            };
            for field in rest.split_whitespace() {
                let Some((key, value)) = field.split_once('=') else {
                    continue;
                };
                let i = match key {
                    "seen" => 0,
                    "dropped" => 1,
                    "duplicated" => 2,
                    "corrupted" => 3,
                    "reordered" => 4,
                    _ => continue,
                };
                sum[i] += value.parse::<u64>().unwrap_or(0);
            }
        }
    }
    sum
}

impl Lab {
    /// Makes every cable as slow as `rate` (tc's notation: `4gbit`) in each direction, with a
    /// queue of about 2 MB in front of it: a token bucket (`tbf`) at the root of each end,
    /// as a Thunderbolt cable is slower than the host that feeds it. veth alone is bound by the
    /// CPUs that copy, never by a wire. Returns why not when `tc` or the kernel's `tbf` is
    /// missing.
    pub fn limit_rate(&self, rate: &str) -> Result<(), String> {
        for rank in &self.hostfile.ranks {
            let namespace = self.namespace(rank.rank);
            for link in &rank.links {
                let out = Command::new("ip")
                    .args(["netns", "exec", &namespace, "tc", "qdisc", "replace", "dev"])
                    .arg(&link.interface)
                    .args([
                        "root", "tbf", "rate", rate, "burst", "1mb", "latency", "2ms",
                    ])
                    .output()
                    .map_err(|e| format!("cannot run tc ({e}; apt-get install iproute2)"))?;
                if !out.status.success() {
                    return Err(format!(
                        "tc cannot add a token bucket to {}: {}",
                        link.interface,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Datagrams the cables' token buckets (see [`Self::limit_rate`]) dropped for a full
    /// queue, all ranks and cables together.
    pub fn rate_limit_drops(&self) -> u64 {
        let mut drops = 0;
        for rank in &self.hostfile.ranks {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.namespace(rank.rank)])
                .args(["tc", "-s", "qdisc", "show"])
                .output()
                .expect("run tc");
            let text = String::from_utf8_lossy(&out.stdout);
            // "Sent 123 bytes 4 pkt (dropped 5, overlimits 6 requeues 0)"
            for part in text.split("(dropped ").skip(1) {
                let n = part.split(',').next().unwrap_or("");
                drops += n
                    .trim()
                    .parse::<u64>()
                    .unwrap_or_else(|_| panic!("tc's drop count: {text}"));
            }
        }
        drops
    }

    /// Makes every rank's kernel inflict `faults` on the UDP datagrams it sends (nftables in
    /// each namespace; the kernel here has no netem). Panics, naming the fix, when the `nft`
    /// tool is missing.
    pub fn impair(&self, faults: Faults) {
        for (rank, host) in self.hostfile.ranks.iter().enumerate() {
            let mut rules = format!(
                "add table ip {FAULT_TABLE}\n\
                 add chain ip {FAULT_TABLE} out {{ type filter hook output priority 0; }}\n"
            );
            let mut rule = |what: &str, per_mille: u64, action: &str| {
                if per_mille > 0 {
                    rules.push_str(&format!(
                        "add rule ip {FAULT_TABLE} out {what} meta l4proto udp \
                         numgen random mod 1000 < {per_mille} counter {action}\n"
                    ));
                }
            };
            // A duplicate must name the interface it leaves by: one rule per cable.
            for link in &host.links {
                let dev = &link.interface;
                rule(
                    &format!("oifname \"{dev}\""),
                    faults.duplicate,
                    &format!("dup to ip daddr device \"{dev}\" comment \"duplicate\""),
                );
            }
            // Bits 800-831 after the UDP header's start: UDP header (8 B), tbrdma header (72 B),
            // then payload bytes 20-23. The receiving kernel does not check UDP checksums of
            // veth traffic, so tbrdma's own checksum must catch it.
            rule(
                "",
                faults.corrupt,
                "@th,800,32 set 0x5a5a5a5a comment \"corrupt\"",
            );
            rule("", faults.drop, "drop comment \"drop\"");
            self.nft(rank, &["-f", "-"], Some(&rules));
        }
    }

    /// Makes every rank's kernel inflict `faults` on the tbrdma Ethernet frames it sends (the
    /// packet engine's, which carry no IP header for [`Self::impair`]'s rules to see), with
    /// nftables' `netdev` egress hook on every cable (Linux 5.16+). Returns why not when this
    /// kernel or nft lacks that hook.
    pub fn impair_frames(&self, faults: Faults) -> Result<(), String> {
        for (rank, host) in self.hostfile.ranks.iter().enumerate() {
            let mut rules = format!("add table netdev {FAULT_TABLE}\n");
            for (i, link) in host.links.iter().enumerate() {
                let dev = &link.interface;
                rules.push_str(&format!(
                    "add chain netdev {FAULT_TABLE} out{i} {{ type filter hook egress device \"{dev}\" priority 0; }}\n"
                ));
                let mut rule = |per_mille: u64, action: &str| {
                    if per_mille > 0 {
                        rules.push_str(&format!(
                            "add rule netdev {FAULT_TABLE} out{i} ether type 0x88b5 \
                             numgen random mod 1000 < {per_mille} counter {action}\n"
                        ));
                    }
                };
                rule(
                    faults.duplicate,
                    &format!("dup to \"{dev}\" comment \"duplicate\""),
                );
                // Bits 944-975 of the frame: Ethernet header (14 B), address shim (12 B),
                // tbrdma header (72 B), then payload bytes 20-23.
                rule(
                    faults.corrupt,
                    "@ll,944,32 set 0x5a5a5a5a comment \"corrupt\"",
                );
                rule(faults.drop, "drop comment \"drop\"");
            }
            self.try_nft(rank, &["-f", "-"], Some(&rules))
                .map_err(|e| format!("nftables cannot impair frames here: {e}"))?;
        }
        Ok(())
    }

    /// Counts the tbrdma Ethernet frames every rank sends on every cable, and those of them
    /// sent to the broadcast address, with nftables' `netdev` egress hook (Linux 5.16+; see
    /// [`Self::frames_sent`]). Returns why not when this kernel or nft lacks that hook.
    pub fn watch_frames(&self) -> Result<(), String> {
        for (rank, host) in self.hostfile.ranks.iter().enumerate() {
            let mut rules = format!("add table netdev {WATCH_TABLE}\n");
            for (i, link) in host.links.iter().enumerate() {
                let dev = &link.interface;
                rules.push_str(&format!(
                    "add chain netdev {WATCH_TABLE} out{i} {{ type filter hook egress device \"{dev}\" priority 0; }}\n\
                     add rule netdev {WATCH_TABLE} out{i} ether type 0x88b5 ether daddr ff:ff:ff:ff:ff:ff counter comment \"broadcast\"\n\
                     add rule netdev {WATCH_TABLE} out{i} ether type 0x88b5 counter comment \"frames\"\n"
                ));
            }
            self.try_nft(rank, &["-f", "-"], Some(&rules))
                .map_err(|e| format!("nftables cannot watch frames here: {e}"))?;
        }
        Ok(())
    }

    /// Frames counted by [`Self::watch_frames`] so far, over all ranks: (all, broadcast).
    pub fn frames_sent(&self) -> (u64, u64) {
        let (mut all, mut broadcast) = (0, 0);
        for rank in 0..self.hostfile.ranks.len() {
            let listing = self.nft(rank, &["list", "table", "netdev", WATCH_TABLE], None);
            for line in listing.lines().filter(|l| l.contains("counter packets")) {
                let packets = line
                    .split_whitespace()
                    .skip_while(|w| *w != "packets")
                    .nth(1)
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("no packet count in: {line}"));
                if line.contains("\"broadcast\"") {
                    broadcast += packets;
                } else {
                    all += packets;
                }
            }
        }
        (all, broadcast)
    }

    /// Datagrams and frames the rules of [`Self::impair`] and [`Self::impair_frames`] hit so
    /// far, over all ranks.
    pub fn faults_done(&self) -> Faults {
        let mut done = Faults::default();
        for rank in 0..self.hostfile.ranks.len() {
            let listing = self.nft(rank, &["list", "ruleset"], None);
            for line in listing.lines().filter(|l| l.contains("counter packets")) {
                let packets = line
                    .split_whitespace()
                    .skip_while(|w| *w != "packets")
                    .nth(1)
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("no packet count in: {line}"));
                let count = if line.contains("\"duplicate\"") {
                    &mut done.duplicate
                } else if line.contains("\"corrupt\"") {
                    &mut done.corrupt
                } else if line.contains("\"drop\"") {
                    &mut done.drop
                } else if line.contains("\"broadcast\"") || line.contains("\"frames\"") {
                    // `watch_frames`' counters, not faults.
                    continue;
                } else {
                    panic!("a rule of no known kind: {line}")
                };
                *count += packets;
            }
        }
        done
    }

    /// Runs `nft args` in `rank`'s namespace, with `input` on stdin; returns its output, or
    /// panics naming the fix.
    fn nft(&self, rank: usize, args: &[&str], input: Option<&str>) -> String {
        self.try_nft(rank, args, input).unwrap_or_else(|e| {
            panic!("{e} (the fault tests need nftables: apt-get install nftables)")
        })
    }

    /// Runs `nft args` in `rank`'s namespace, with `input` on stdin; returns its output or
    /// what went wrong.
    fn try_nft(&self, rank: usize, args: &[&str], input: Option<&str>) -> Result<String, String> {
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
        if !out.status.success() {
            return Err(format!(
                "nft {args:?} in {} failed: {}",
                self.namespace(rank),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
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
