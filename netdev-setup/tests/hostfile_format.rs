//! The hostfile format: round trip, rank order, topology recognition, and errors on input
//! that does not describe a cluster. No root needed.

use tbrdma_netdev::addressing::cable_addresses;
use tbrdma_netdev::hostfile::{HostRecord, Hostfile, RecordLink, TopologyKind};

mod common;
use common::records::records;

fn ring(n: usize) -> Vec<(usize, usize)> {
    (0..n).map(|i| (i, (i + 1) % n)).collect()
}

#[test]
fn round_trip() {
    let uuids = ["d", "a", "c", "b", "e"];
    let hostfile = Hostfile::from_records(&records(&uuids, &ring(5), 2)).unwrap();
    let text = hostfile.to_json();
    assert_eq!(Hostfile::parse(&text).unwrap(), hostfile);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostfile.json");
    hostfile.save(&path).unwrap();
    assert_eq!(Hostfile::load(&path).unwrap(), hostfile);
}

#[test]
fn record_order_does_not_matter() {
    let uuids = ["d", "a", "c", "b"];
    let mut recs = records(&uuids, &ring(4), 1);
    let first = Hostfile::from_records(&recs).unwrap();
    recs.reverse();
    assert_eq!(Hostfile::from_records(&recs).unwrap(), first);
}

#[test]
fn ring_ranks_follow_the_cables() {
    // Cabled d-a-c-b-e-d: rank 0 is "a", then its lower neighbour "c", …
    let uuids = ["d", "a", "c", "b", "e"];
    let hostfile = Hostfile::from_records(&records(&uuids, &ring(5), 1)).unwrap();
    assert_eq!(hostfile.topology.kind, TopologyKind::Ring);
    let order: Vec<&str> = hostfile.ranks.iter().map(|r| r.uuid.as_str()).collect();
    assert_eq!(order, ["a", "c", "b", "e", "d"]);
    for rank in &hostfile.ranks {
        let n = hostfile.ranks.len();
        let mut peers: Vec<usize> = rank.links.iter().map(|l| l.peer).collect();
        peers.sort();
        let mut want = vec![(rank.rank + 1) % n, (rank.rank + n - 1) % n];
        want.sort();
        assert_eq!(
            peers, want,
            "rank {} is cabled to its ring neighbours",
            rank.rank
        );
    }
}

#[test]
fn recognises_topologies_and_rails() {
    type Case<'a> = (&'a [&'a str], Vec<(usize, usize)>, u32, TopologyKind);
    let cases: [Case<'_>; 5] = [
        (&["a", "b"], vec![(0, 1)], 2, TopologyKind::Pair),
        (
            &["a", "b", "c"],
            vec![(0, 1), (1, 2), (0, 2)],
            1,
            TopologyKind::Mesh,
        ),
        (&["a", "b", "c", "d"], ring(4), 2, TopologyKind::Ring),
        (
            &["a", "b", "c"],
            vec![(0, 1), (1, 2)],
            1,
            TopologyKind::Other,
        ),
        (&["a"], vec![], 0, TopologyKind::Single),
    ];
    for (uuids, edges, rails, kind) in cases {
        let hostfile = Hostfile::from_records(&records(uuids, &edges, rails.max(1))).unwrap();
        assert_eq!(hostfile.topology.kind, kind, "{uuids:?}");
        assert_eq!(hostfile.topology.rails, rails, "{uuids:?}");
    }
}

#[test]
fn links_carry_addresses_both_ways() {
    let hostfile = Hostfile::from_records(&records(&["a", "b"], &[(0, 1)], 2)).unwrap();
    let (r0, r1) = (&hostfile.ranks[0], &hostfile.ranks[1]);
    for rail in 0..2 {
        let l0 = r0.links.iter().find(|l| l.rail == rail).unwrap();
        let l1 = r1.links.iter().find(|l| l.rail == rail).unwrap();
        assert_eq!((l0.address, l0.peer_address), (l1.peer_address, l1.address));
        assert_eq!((l0.peer, l1.peer), (1, 0));
    }
}

#[test]
fn rejects_what_is_not_a_cluster() {
    let mut recs = records(&["a", "b"], &[(0, 1)], 1);
    recs.pop();
    let error = Hostfile::from_records(&recs).unwrap_err().to_string();
    assert!(error.contains("unknown host b"), "{error}");

    let recs = records(&["a", "a"], &[], 1);
    assert!(
        Hostfile::from_records(&recs)
            .unwrap_err()
            .to_string()
            .contains("two hosts claim")
    );

    assert!(Hostfile::parse("{").is_err());
    let mut hostfile = Hostfile::from_records(&records(&["a", "b"], &[(0, 1)], 1)).unwrap();
    hostfile.ranks[0].links[0].peer = 7;
    assert!(
        Hostfile::parse(&hostfile.to_json())
            .unwrap_err()
            .contains("rank 7")
    );
    hostfile.version = 99;
    assert!(
        Hostfile::parse(&hostfile.to_json())
            .unwrap_err()
            .contains("version 99")
    );
}

/// Records that disagree about their cables are an error at once. Before, four hosts where
/// the lowest (`a`) lists cables to `b` and `c` that they do not list back, and `b`, `c`, `d`
/// each list the other two, looked like a ring and sent the ring walk round `b-c-d` for ever
/// (growing its list until memory ran out).
#[test]
fn records_that_disagree_about_a_cable_are_an_error_not_a_loop() {
    let mut recs = records(&["b", "c", "d"], &[(0, 1), (1, 2), (0, 2)], 1);
    let mut a = records(&["a", "b", "c"], &[(0, 1), (0, 2)], 1).remove(0);
    a.name = "host-a".into();
    recs.push(a);
    let error = Hostfile::from_records(&recs).unwrap_err().to_string();
    assert!(error.contains("inconsistent host records"), "{error}");
    assert!(error.contains("host-a lists a cable to host-b"), "{error}");

    // A record claiming a cable to itself.
    let mut recs = records(&["a", "b"], &[(0, 1)], 1);
    recs[0].links[0].peer_uuid = "a".into();
    let error = Hostfile::from_records(&recs).unwrap_err().to_string();
    assert!(error.contains("cable to itself"), "{error}");
}

#[test]
fn hosts_with_two_usb4_routers_are_one_rank_each() {
    // Host a has routers a0 and a1, host b has b0 and b1; cable 1 joins a0-b0, cable 2 a1-b1.
    // Each cable is rail 0 of its own UUID pair, yet the hostfile sees one pair, two rails.
    let cable = |interface: &str, local: &str, peer: &str| {
        let addresses = cable_addresses(local, peer, 0);
        RecordLink {
            interface: interface.into(),
            address: addresses.local,
            prefix_len: 30,
            peer_uuid: peer.into(),
            peer_address: addresses.peer,
            rail: 0,
        }
    };
    let a = HostRecord {
        uuid: "a0".into(),
        name: "a".into(),
        aliases: vec!["a1".into()],
        links: vec![
            cable("thunderbolt0", "a0", "b0"),
            cable("thunderbolt1", "a1", "b1"),
        ],
    };
    let b = HostRecord {
        uuid: "b0".into(),
        name: "b".into(),
        aliases: vec!["b1".into()],
        links: vec![
            cable("thunderbolt0", "b0", "a0"),
            cable("thunderbolt1", "b1", "a1"),
        ],
    };
    let hostfile = Hostfile::from_records(&[b, a]).unwrap();
    assert_eq!(hostfile.topology.kind, TopologyKind::Pair);
    assert_eq!(hostfile.topology.rails, 2);
    let rails = |rank: usize| -> Vec<(u32, std::net::Ipv4Addr)> {
        hostfile.ranks[rank]
            .links
            .iter()
            .map(|l| (l.rail, l.address))
            .collect()
    };
    let (r0, r1) = (rails(0), rails(1));
    assert_eq!(r0.iter().map(|r| r.0).collect::<Vec<_>>(), [0, 1]);
    for (rail, address) in &r0 {
        let other = hostfile.ranks[1]
            .links
            .iter()
            .find(|l| l.rail == *rail)
            .unwrap();
        assert_eq!(
            other.peer_address, *address,
            "both ends agree on rail {rail}"
        );
    }
    assert_eq!(r1.len(), 2);
}

/// Names from records and hostfiles end up in paths, config files and environment files that
/// root tools write: one that could escape them is refused, naming the problem.
#[test]
fn names_that_could_escape_a_path_or_a_file_are_refused() {
    let uuids = ["a", "b"];
    let good = records(&uuids, &[(0, 1)], 1);
    let hostfile = Hostfile::from_records(&good).unwrap();
    for bad in ["../../etc/cron.d/x", "eth0\nNCCL_NET=Socket", "eth*", ""] {
        let mut recs = good.clone();
        recs[0].links[0].interface = bad.into();
        let err = Hostfile::from_records(&recs).unwrap_err().to_string();
        assert!(err.contains("not usable"), "{bad:?}: {err}");

        let text = hostfile
            .to_json()
            .replace("\"thunderbolt0\"", &serde_json::to_string(bad).unwrap());
        let err = Hostfile::parse(&text).unwrap_err();
        assert!(err.contains("not usable"), "{bad:?}: {err}");
    }
    let mut recs = good.clone();
    recs[1].name = "b; reboot".into();
    assert!(Hostfile::from_records(&recs).is_err());
    let text = hostfile.to_json().replace("host-a", "host a");
    assert!(Hostfile::parse(&text).is_err());
}
