//! `lab up`: namespaces, veth cables, then each rank configured by `setup`'s own planner and
//! the hostfile written from each rank's record. On any failure the half-built lab is torn
//! down again before the error is returned.

use std::os::fd::AsFd;
use std::path::PathBuf;

use crate::addressing::{cable_addresses, fnv1a64};
use crate::detect::Detector;
use crate::error::{NetdevError, Result};
use crate::hostfile::{Hostfile, local_record};
use crate::inventory::HostIdentity;
use crate::lab::state::{
    LabState, hostfile_path, interface_name, is_lab_namespace, lab_dir, links_path, namespace_name,
};
use crate::lab::{LabTopology, check_name, down};
use crate::links_file::{ExplicitLink, LinksFile};
use crate::netlink::Netlink;
use crate::netns;
use crate::setup::relay::relay_steps;
use crate::setup::{Plan, Roots, SetupOptions, apply, plan};

/// What to build.
#[derive(Debug, Clone)]
pub struct LabOptions {
    /// Lab name.
    pub name: String,
    /// Number of ranks (namespaces).
    pub ranks: usize,
    /// How they are cabled.
    pub topology: LabTopology,
    /// Cables between each pair of neighbours.
    pub rails: u32,
    /// veth MTU.
    pub mtu: u32,
    /// Replace an existing lab of the same name.
    pub force: bool,
}

/// The identity rank `rank` of lab `name` gets, given the lab's `tag` (see [`lab_tag`]): UUIDs
/// sort in rank order, so the hostfile's rank numbers are the lab's.
fn rank_identity(name: &str, tag: u32, rank: usize) -> HostIdentity {
    HostIdentity {
        uuid: rank_uuid(tag, rank),
        name: namespace_name(name, rank),
    }
}

fn rank_uuid(tag: u32, rank: usize) -> String {
    format!("{tag:08x}-0000-4000-8000-{rank:012x}")
}

/// The UUID prefix shared by the ranks of lab `name`: a hash of the name, so that labs of
/// different names get different addresses, chosen so that no two cables of the lab hash to
/// the same /30. A real host pair whose cables collide is told to name rails in a links file;
/// a lab picks its own identities, so it picks ones that do not collide (every name maps to
/// one tag, so a lab rebuilt under the same name gets the same addresses).
fn lab_tag(name: &str, pairs: &[(usize, usize)], rails: u32) -> u32 {
    (0u32..)
        .map(|attempt| {
            let key = if attempt == 0 {
                name.to_owned()
            } else {
                format!("{name}#{attempt}")
            };
            fnv1a64(key.as_bytes()) as u32
        })
        .find(|&tag| {
            let mut networks = std::collections::BTreeSet::new();
            pairs.iter().all(|&(a, b)| {
                (0..rails).all(|rail| {
                    networks.insert(
                        cable_addresses(&rank_uuid(tag, a), &rank_uuid(tag, b), rail).network,
                    )
                })
            })
        })
        .expect("a lab has at most a few dozen cables among 16 256 subnets")
}

/// Builds the lab and returns the path of its hostfile.
pub fn up(options: &LabOptions) -> Result<PathBuf> {
    check_name(&options.name)?;
    if options.rails == 0 || options.rails > 8 {
        return Err(NetdevError::bad_input(
            format!("--rails {} is out of range", options.rails),
            "use 1 to 8 cables per neighbour",
        ));
    }
    if !(68..=65_535).contains(&options.mtu) {
        return Err(NetdevError::bad_input(
            format!("--mtu {} is out of range for veth", options.mtu),
            "use 68 to 65535 (default 65520)",
        ));
    }
    let pairs = options.topology.neighbour_pairs(options.ranks)?;
    if !nix::unistd::geteuid().is_root() {
        return Err(NetdevError::NeedsRoot {
            step: format!(
                "lab up (create network namespaces for lab {})",
                options.name
            ),
        });
    }
    if exists(&options.name)? {
        if !options.force {
            return Err(NetdevError::LabExists {
                name: options.name.clone(),
            });
        }
        down(&options.name)?;
    }
    let state = LabState {
        name: options.name.clone(),
        ranks: options.ranks,
        topology: options.topology,
        rails: options.rails,
        mtu: options.mtu,
        namespaces: (0..options.ranks)
            .map(|k| namespace_name(&options.name, k))
            .collect(),
        status: "creating".into(),
    };
    // Written first, so `down` knows what to remove even if we die mid-way.
    state.save()?;
    match build(options, &pairs, &state) {
        Ok(path) => {
            LabState {
                status: "up".into(),
                ..state
            }
            .save()?;
            Ok(path)
        }
        Err(error) => {
            let _ = down(&options.name);
            Err(error)
        }
    }
}

/// True when anything of lab `name` is present.
pub fn exists(name: &str) -> Result<bool> {
    Ok(LabState::load(name)?.is_some()
        || lab_dir(name).exists()
        || netns::list().iter().any(|ns| is_lab_namespace(name, ns)))
}

fn build(options: &LabOptions, pairs: &[(usize, usize)], state: &LabState) -> Result<PathBuf> {
    for namespace in &state.namespaces {
        netns::create(namespace)?;
    }
    let tag = lab_tag(&options.name, pairs, options.rails);
    let mut links: Vec<LinksFile> = (0..options.ranks)
        .map(|k| LinksFile {
            host: rank_identity(&options.name, tag, k),
            links: Vec::new(),
        })
        .collect();
    let netlink = Netlink::open()?;
    for &(a, b) in pairs {
        let ns_a = netns::open(&state.namespaces[a])?;
        let ns_b = netns::open(&state.namespaces[b])?;
        for rail in 0..options.rails {
            let (if_a, if_b) = (interface_name(b, rail), interface_name(a, rail));
            netlink.add_veth_between(&if_a, ns_a.as_fd(), &if_b, ns_b.as_fd(), options.mtu)?;
            for (from, to, interface) in [(a, b, if_a), (b, a, if_b)] {
                let peer = rank_identity(&options.name, tag, to);
                links[from].links.push(ExplicitLink {
                    interface,
                    peer,
                    rail,
                    mtu: Some(options.mtu),
                });
            }
        }
    }
    let mut records = Vec::new();
    for (rank, file) in links.iter().enumerate() {
        file.save(&links_path(&options.name, rank))?;
        let record = netns::run_in(&state.namespaces[rank], || {
            Netlink::open()?.set_up("lo")?;
            configure_rank(file)
        })?;
        records.push(record);
    }
    // veth carrier reaches `operstate` through the kernel's link watcher, up to a second
    // later; wait, so that a `doctor` right after `lab up` sees the links up.
    for (rank, file) in links.iter().enumerate() {
        netns::run_in(&state.namespaces[rank], || {
            wait_for_operstate_up(file);
            Ok(())
        })?;
    }
    let hostfile = Hostfile::from_records(&records)?;
    // In a ring of 4 or more, ranks that share no cable reach each other through the kernels
    // of the ranks in between (`setup::relay`).
    for rank in 0..options.ranks {
        netns::run_in(&state.namespaces[rank], || configure_relay(&hostfile, rank))?;
    }
    let path = hostfile_path(&options.name);
    hostfile.save(&path)?;
    Ok(path)
}

/// Configures the calling thread's namespace exactly as `tbrdma setup --links FILE` would.
fn configure_rank(file: &LinksFile) -> Result<crate::hostfile::HostRecord> {
    let mut detector = Detector::new("/sys");
    detector.links_file = Some(file.clone());
    let inventory = detector.detect()?;
    let options = SetupOptions::default();
    let plan = plan(&inventory, &options)?;
    let roots = Roots {
        proc_root: &options.proc_root,
        sysfs_root: &detector.sysfs_root,
    };
    apply(&plan, &roots)?;
    local_record(&inventory)
}

/// Turns forwarding on and adds the routes to the ranks this one has no cable to, in the
/// calling thread's namespace: what `tbrdma setup --relay HOSTFILE` would do on a real host.
fn configure_relay(hostfile: &Hostfile, rank: usize) -> Result<()> {
    let options = SetupOptions::default();
    let steps = relay_steps(hostfile, rank, &options.proc_root, &[]);
    let roots = Roots {
        proc_root: &options.proc_root,
        sysfs_root: std::path::Path::new("/sys"),
    };
    apply(
        &Plan {
            steps,
            notes: Vec::new(),
        },
        &roots,
    )
}

fn wait_for_operstate_up(file: &LinksFile) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let all_up = || {
        file.links.iter().all(|l| {
            let path = format!("/sys/class/net/{}/operstate", l.interface);
            std::fs::read_to_string(path).is_ok_and(|s| s.trim() == "up")
        })
    };
    while !all_up() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn networks(tag: u32, pairs: &[(usize, usize)], rails: u32) -> Vec<std::net::Ipv4Addr> {
        pairs
            .iter()
            .flat_map(|&(a, b)| {
                (0..rails)
                    .map(move |rail| cable_addresses(&rank_uuid(tag, a), &rank_uuid(tag, b), rail))
            })
            .map(|addresses| addresses.network)
            .collect()
    }

    fn distinct(networks: &[std::net::Ipv4Addr]) -> bool {
        let set: std::collections::BTreeSet<_> = networks.iter().collect();
        set.len() == networks.len()
    }

    #[test]
    fn a_lab_whose_name_hashes_its_cables_together_gets_a_tag_that_does_not() {
        // CI's lab `tf4r28840` (a ring of 4) had two cables of rank 2 on one /30 and failed
        // to come up.
        let pairs = LabTopology::Ring.neighbour_pairs(4).unwrap();
        let name = "tf4r28840";
        let naive = fnv1a64(name.as_bytes()) as u32;
        assert!(!distinct(&networks(naive, &pairs, 1)));
        let tag = lab_tag(name, &pairs, 1);
        assert!(distinct(&networks(tag, &pairs, 1)));
        assert_eq!(tag, lab_tag(name, &pairs, 1), "the same name, the same tag");
    }

    #[test]
    fn every_test_lab_name_gets_cables_on_distinct_subnets() {
        // The test labs are `t<tag><pid % 100000>`: check a spread of them in the largest
        // shapes the tests build.
        let shapes = [
            (LabTopology::Ring.neighbour_pairs(4).unwrap(), 2),
            (LabTopology::Mesh.neighbour_pairs(4).unwrap(), 2),
        ];
        for n in (0..100_000).step_by(7) {
            let name = format!("tf4r{n}");
            for (pairs, rails) in &shapes {
                let tag = lab_tag(&name, pairs, *rails);
                assert!(distinct(&networks(tag, pairs, *rails)), "{name}");
            }
        }
    }
}
