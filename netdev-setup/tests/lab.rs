//! The virtual lab end to end (needs root; skips without it): reachability between neighbours
//! for each topology, and in a ring from every rank to every address of every other rank
//! (relayed by the kernels in between), discovery in every namespace agreeing with the lab's
//! own hostfile, `setup` inside a namespace touching only that namespace and being idempotent,
//! and `lab down` leaving nothing behind, even after a crash.

mod common;

use std::time::Duration;

use common::lab_guard::{LabGuard, have_root};
use tbrdma_netdev::detect::Detector;
use tbrdma_netdev::hostfile::{DiscoveryOptions, Hostfile, TopologyKind, discover, local_record};
use tbrdma_netdev::lab::{self, LabTopology};
use tbrdma_netdev::links_file::LinksFile;
use tbrdma_netdev::netlink::{LinkState, Netlink};
use tbrdma_netdev::netns;
use tbrdma_netdev::ping::ping;
use tbrdma_netdev::setup::{self, Roots, SetupOptions, Step};

/// Pings every cable of every rank from its own namespace; returns the failures.
fn unreachable_links(lab: &LabGuard, hostfile: &Hostfile) -> Vec<String> {
    let mut failures = Vec::new();
    for rank in &hostfile.ranks {
        let result = netns::run_in(&lab.namespace(rank.rank), || {
            let mut failed = Vec::new();
            for link in &rank.links {
                if ping(&link.interface, link.peer_address, Duration::from_secs(2))?.is_none() {
                    failed.push(format!(
                        "rank {} {} -> rank {}",
                        rank.rank, link.interface, link.peer
                    ));
                }
            }
            Ok(failed)
        });
        failures.extend(result.expect("ping in namespace"));
    }
    failures
}

/// Sends a UDP datagram from every rank to every cable address of every other rank (neighbour
/// or not), each answered by an echo in the owner's namespace; returns the ones that got no
/// answer. In a ring, the ranks that share no cable are reached through the kernels in between.
fn unreachable_addresses(lab: &LabGuard, hostfile: &Hostfile, port: u16) -> Vec<String> {
    use std::net::{SocketAddr, UdpSocket};
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        for rank in 0..hostfile.ranks.len() {
            let (namespace, stop, ready) = (lab.namespace(rank), &stop, ready_tx.clone());
            scope.spawn(move || {
                netns::enter_current_thread(&namespace).unwrap();
                let echo = UdpSocket::bind(SocketAddr::from(([0, 0, 0, 0], port))).unwrap();
                echo.set_read_timeout(Some(Duration::from_millis(50)))
                    .unwrap();
                ready.send(()).unwrap();
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((len, from)) = echo.recv_from(&mut buf) {
                        let _ = echo.send_to(&buf[..len], from);
                    }
                }
            });
        }
        for _ in 0..hostfile.ranks.len() {
            ready_rx.recv().unwrap();
        }
        let mut failures = Vec::new();
        for from in &hostfile.ranks {
            let found = netns::run_in(&lab.namespace(from.rank), || {
                let mut failed = Vec::new();
                let socket = UdpSocket::bind(SocketAddr::from(([0, 0, 0, 0], 0))).unwrap();
                socket
                    .set_read_timeout(Some(Duration::from_secs(2)))
                    .unwrap();
                for to in hostfile.ranks.iter().filter(|r| r.rank != from.rank) {
                    for link in &to.links {
                        let probe = format!("{} -> {} at {}", from.rank, to.rank, link.address);
                        let mut buf = [0u8; 64];
                        let answered = socket
                            .send_to(probe.as_bytes(), (link.address, port))
                            .is_ok()
                            && socket
                                .recv_from(&mut buf)
                                .is_ok_and(|(len, _)| &buf[..len] == probe.as_bytes());
                        if !answered {
                            failed.push(probe);
                        }
                    }
                }
                Ok(failed)
            });
            failures.extend(found.expect("send in namespace"));
        }
        stop.store(true, Ordering::Relaxed);
        failures
    })
}

/// Runs discovery in every rank's namespace at once and returns each rank's hostfile.
fn discover_everywhere(lab: &LabGuard, ranks: usize, port: u16) -> Vec<Hostfile> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let namespace = lab.namespace(rank);
                let links = LinksFile::load(&lab::links_path(&lab.name, rank)).unwrap();
                scope.spawn(move || {
                    netns::run_in(&namespace, || {
                        let mut detector = Detector::new("/sys");
                        detector.links_file = Some(links);
                        let local = local_record(&detector.detect()?)?;
                        let options = DiscoveryOptions {
                            port,
                            timeout: Duration::from_secs(20),
                            interval: Duration::from_millis(20),
                            ..Default::default()
                        };
                        Hostfile::from_records(&discover(&local, &options)?)
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().expect("discovery"))
            .collect()
    })
}

fn assert_gone(name: &str) {
    let left: Vec<String> = netns::list()
        .into_iter()
        .filter(|ns| ns.starts_with(&format!("tbl-{name}-")))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    assert!(!lab::lab_dir(name).exists(), "state directory left behind");
    let host_links: Vec<LinkState> = Netlink::open().unwrap().links().unwrap();
    assert!(
        host_links.iter().all(|l| !l.name.starts_with("tbl-")),
        "interfaces in the host namespace"
    );
}

fn check_lab(
    test: &str,
    ranks: usize,
    topology: LabTopology,
    rails: u32,
    kind: TopologyKind,
    port: u16,
) {
    if !have_root(test) {
        return;
    }
    let lab = LabGuard::up(test, ranks, topology, rails);
    let hostfile = Hostfile::load(&lab::hostfile_path(&lab.name)).unwrap();
    assert_eq!(hostfile.ranks.len(), ranks);
    assert_eq!(hostfile.topology.kind, kind);
    assert_eq!(hostfile.topology.rails, rails);
    let degree = match kind {
        TopologyKind::Pair => 1,
        TopologyKind::Mesh => ranks - 1,
        _ => 2,
    };
    for rank in &hostfile.ranks {
        assert_eq!(
            rank.links.len(),
            degree * rails as usize,
            "rank {}",
            rank.rank
        );
        if kind == TopologyKind::Ring {
            let next = (rank.rank + 1) % ranks;
            assert!(
                rank.links.iter().any(|l| l.peer == next),
                "ring ranks follow the cables"
            );
        }
    }
    assert_eq!(unreachable_links(&lab, &hostfile), Vec::<String>::new());
    if kind == TopologyKind::Ring {
        // Every rank reaches every address of every other rank, through the ranks in between
        // where no cable joins the two (`lab up` sets forwarding and routes in a ring).
        assert_eq!(
            unreachable_addresses(&lab, &hostfile, port + 100),
            Vec::<String>::new()
        );
    }
    for (rank, discovered) in discover_everywhere(&lab, ranks, port)
        .into_iter()
        .enumerate()
    {
        assert_eq!(
            discovered, hostfile,
            "rank {rank} discovered a different hostfile"
        );
    }
    let name = lab.name.clone();
    drop(lab);
    assert_gone(&name);
}

#[test]
fn pair_with_two_rails() {
    check_lab("pair", 2, LabTopology::Pair, 2, TopologyKind::Pair, 18_601);
}

#[test]
fn mesh_of_3() {
    check_lab("mesh3", 3, LabTopology::Mesh, 1, TopologyKind::Mesh, 18_602);
}

#[test]
fn ring_of_4() {
    check_lab("ring4", 4, LabTopology::Ring, 1, TopologyKind::Ring, 18_603);
}

#[test]
fn ring_of_5() {
    check_lab("ring5", 5, LabTopology::Ring, 1, TopologyKind::Ring, 18_604);
}

#[test]
fn setup_in_a_namespace_touches_only_it_and_is_idempotent() {
    if !have_root("setup_in_a_namespace") {
        return;
    }
    let lab = LabGuard::up("setup", 2, LabTopology::Pair, 1);
    let host_before = Netlink::open().unwrap().links().unwrap();
    let peer_before = netns::run_in(&lab.namespace(1), || Netlink::open()?.links()).unwrap();
    let links = LinksFile::load(&lab::links_path(&lab.name, 0)).unwrap();
    let plans = netns::run_in(&lab.namespace(0), || {
        let netlink = Netlink::open()?;
        // Undo part of what `lab up` did, so setup has something to do.
        netlink.set_mtu("tbl-p1-0", 1500)?;
        let mut detector = Detector::new("/sys");
        detector.links_file = Some(links);
        let options = SetupOptions {
            mtu: Some(lab::DEFAULT_MTU),
            ..SetupOptions::default()
        };
        let first = setup::plan(&detector.detect()?, &options)?;
        setup::apply(
            &first,
            &Roots {
                proc_root: &options.proc_root,
                sysfs_root: &detector.sysfs_root,
            },
        )?;
        let second = setup::plan(&detector.detect()?, &options)?;
        Ok((first, second))
    })
    .unwrap();
    let (first, second) = plans;
    assert_eq!(
        first.steps,
        vec![Step::SetMtu {
            interface: "tbl-p1-0".into(),
            from: 1500,
            to: lab::DEFAULT_MTU
        }]
    );
    assert!(second.is_empty(), "second apply must be empty:\n{second}");
    assert_eq!(
        Netlink::open().unwrap().links().unwrap(),
        host_before,
        "host namespace changed"
    );
    let peer_after = netns::run_in(&lab.namespace(1), || Netlink::open()?.links()).unwrap();
    assert_eq!(
        peer_after, peer_before,
        "the other rank's namespace changed"
    );
}

#[test]
fn refuses_an_existing_lab_and_several_labs_coexist() {
    if !have_root("refuses_an_existing_lab") {
        return;
    }
    let first = LabGuard::up("exists", 2, LabTopology::Pair, 1);
    let mut again = first.options.clone();
    again.force = false;
    let error = lab::up(&again).unwrap_err().to_string();
    assert!(
        error.contains("already exists") && error.contains("--force"),
        "{error}"
    );
    // A lab whose name extends this one's is a different lab.
    let second = LabGuard::up("exists-2", 2, LabTopology::Pair, 1);
    assert!(netns::path_of(&first.namespace(0)).exists());
    let second_name = second.name.clone();
    drop(second);
    assert!(
        netns::path_of(&first.namespace(0)).exists(),
        "down of one lab left the other alone"
    );
    assert_gone(&second_name);
}

#[test]
fn down_cleans_up_after_a_crash() {
    if !have_root("down_cleans_up_after_a_crash") {
        return;
    }
    let name = format!("crash-{}", std::process::id() % 100_000);
    // What a crash half-way through `lab up` leaves: a namespace, a directory, no state.json.
    netns::create(&lab::namespace_name(&name, 0)).unwrap();
    netns::create(&lab::namespace_name(&name, 3)).unwrap();
    std::fs::create_dir_all(lab::lab_dir(&name)).unwrap();
    assert!(lab::down(&name).unwrap() > 0);
    assert_gone(&name);
    assert_eq!(lab::down(&name).unwrap(), 0, "a second down finds nothing");
}

#[test]
fn bad_lab_input_is_an_error_not_a_panic() {
    let options = |name: &str, ranks, topology, rails, mtu| lab::LabOptions {
        name: name.into(),
        ranks,
        topology,
        rails,
        mtu,
        force: false,
    };
    for (bad, expect) in [
        (
            options("Bad Name", 2, LabTopology::Pair, 1, 65_520),
            "not usable",
        ),
        (
            options("x", 3, LabTopology::Pair, 1, 65_520),
            "pair has 2 ranks",
        ),
        (options("x", 2, LabTopology::Ring, 1, 65_520), "ring of 2"),
        (options("x", 2, LabTopology::Pair, 0, 65_520), "--rails 0"),
        (options("x", 2, LabTopology::Pair, 1, 10), "--mtu 10"),
    ] {
        let error = lab::up(&bad).unwrap_err().to_string();
        assert!(error.contains(expect), "{error}");
    }
}

#[test]
fn down_reaches_the_mount_copies_of_processes_in_other_labs() {
    if !have_root("down_reaches_the_mount_copies") {
        return;
    }
    // Anything running in a lab namespace (a `lab exec`) has its own copy of the mount table,
    // with a bind mount of every lab's namespaces; `down` must reach into those copies, or the
    // namespaces and their veths would live on there.
    let first = LabGuard::up("copies-a", 2, LabTopology::Pair, 1);
    let (to_inside, inside_rx) = std::sync::mpsc::channel::<String>();
    let (inside_tx, from_inside) = std::sync::mpsc::channel::<usize>();
    let count_mounts = |name: &str| {
        std::fs::read_to_string("/proc/thread-self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(&format!("/tbl-{name}-r")))
            .count()
    };
    std::thread::scope(|scope| {
        let namespace = first.namespace(0);
        scope.spawn(move || {
            netns::run_in(&namespace, move || {
                while let Ok(name) = inside_rx.recv() {
                    inside_tx.send(count_mounts(&name)).unwrap();
                }
                Ok(())
            })
            .unwrap();
        });
        let second = LabGuard::up("copies-b", 2, LabTopology::Pair, 1);
        let name = second.name.clone();
        to_inside.send(name.clone()).unwrap();
        assert_eq!(
            from_inside.recv().unwrap(),
            2,
            "new namespaces show up in the copy"
        );
        drop(second);
        to_inside.send(name.clone()).unwrap();
        assert_eq!(
            from_inside.recv().unwrap(),
            0,
            "down removed them from the copy too"
        );
        drop(to_inside);
    });
}
