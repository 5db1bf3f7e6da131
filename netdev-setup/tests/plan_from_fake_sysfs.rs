//! Detection and planning against fake sysfs trees: the cabling cases the issue lists, each
//! with the exact plan `setup --dry-run` must show.

mod common;

use std::path::PathBuf;

use common::fake_sysfs::{FakeHost, IfaceState};
use tbrdma_netdev::addressing::cable_addresses;
use tbrdma_netdev::detect::Detector;
use tbrdma_netdev::inventory::Inventory;
use tbrdma_netdev::setup::{Persist, Plan, SetupOptions, Step, plan};

const A: &str = "0d5e1a2b-0000-0000-ffff-ffffffff0001";
const B: &str = "8a3c99f0-0000-0000-ffff-ffffffff0002";
const C: &str = "c0ffee00-0000-0000-ffff-ffffffff0003";

fn detect(host: &FakeHost) -> Inventory {
    Detector::new(host.sys()).detect().expect("detect")
}

fn plan_for(host: &FakeHost) -> Plan {
    let options = SetupOptions {
        proc_root: host.proc(),
        ..SetupOptions::default()
    };
    plan(&detect(host), &options).expect("plan")
}

/// The steps every fresh host needs after its per-link steps.
fn tuning_steps(interfaces: &[&str]) -> Vec<Step> {
    let mut steps = vec![
        Step::Sysctl {
            key: "net.core.busy_poll".into(),
            from: 0,
            to: 50,
        },
        Step::Sysctl {
            key: "net.core.busy_read".into(),
            from: 0,
            to: 50,
        },
        Step::Sysctl {
            key: "net.core.rmem_max".into(),
            from: 212_992,
            to: 64 << 20,
        },
        Step::Sysctl {
            key: "net.core.wmem_max".into(),
            from: 212_992,
            to: 64 << 20,
        },
    ];
    for interface in interfaces {
        steps.push(Step::InterfaceKnob {
            interface: (*interface).into(),
            knob: "napi_defer_hard_irqs".into(),
            from: 0,
            to: 2,
        });
        steps.push(Step::InterfaceKnob {
            interface: (*interface).into(),
            knob: "gro_flush_timeout".into(),
            from: 0,
            to: 200_000,
        });
    }
    steps
}

fn mtu(interface: &str) -> Step {
    Step::SetMtu {
        interface: interface.into(),
        from: 1500,
        to: 65_522,
    }
}

fn address(interface: &str, local: &str, peer: &str, peer_name: &str, rail: u32) -> Step {
    let addresses = cable_addresses(local, peer, rail);
    Step::AddAddress {
        interface: interface.into(),
        address: addresses.local,
        prefix_len: 30,
        peer_address: addresses.peer,
        peer_name: peer_name.into(),
    }
}

#[test]
fn one_cable() {
    let host = FakeHost::new(Some(A));
    host.cable("thunderbolt0", 1, B, "strix-b", IfaceState::FRESH);
    let inventory = detect(&host);
    assert_eq!(inventory.host.as_ref().unwrap().uuid, A);
    let link = &inventory.links[0];
    assert!(link.is_thunderbolt());
    assert_eq!(link.peer.as_ref().unwrap().name, "strix-b");
    assert_eq!(link.port.as_deref(), Some("0-1"));

    let mut expected = vec![
        mtu("thunderbolt0"),
        address("thunderbolt0", A, B, "strix-b", 0),
    ];
    expected.extend(tuning_steps(&["thunderbolt0"]));
    assert_eq!(plan_for(&host).steps, expected);
}

#[test]
fn both_ends_of_one_cable_derive_matching_addresses() {
    let a = FakeHost::new(Some(A));
    a.cable("thunderbolt0", 1, B, "strix-b", IfaceState::FRESH);
    let b = FakeHost::new(Some(B));
    b.cable("thunderbolt0", 2, A, "strix-a", IfaceState::FRESH);
    let find = |plan: Plan| {
        plan.steps.into_iter().find_map(|s| match s {
            Step::AddAddress {
                address,
                peer_address,
                ..
            } => Some((address, peer_address)),
            _ => None,
        })
    };
    let (a_local, a_peer) = find(plan_for(&a)).unwrap();
    let (b_local, b_peer) = find(plan_for(&b)).unwrap();
    assert_eq!((a_local, a_peer), (b_peer, b_local));
}

#[test]
fn two_cables_to_one_peer_are_two_rails() {
    let host = FakeHost::new(Some(A));
    // Interface names in probe order need not follow port order: rails follow ports.
    host.cable("thunderbolt0", 3, B, "strix-b", IfaceState::FRESH);
    host.cable("thunderbolt1", 1, B, "strix-b", IfaceState::FRESH);
    let mut expected = vec![
        mtu("thunderbolt0"),
        address("thunderbolt0", A, B, "strix-b", 1),
        mtu("thunderbolt1"),
        address("thunderbolt1", A, B, "strix-b", 0),
    ];
    expected.extend(tuning_steps(&["thunderbolt0", "thunderbolt1"]));
    assert_eq!(plan_for(&host).steps, expected);
}

#[test]
fn cables_to_two_peers() {
    let host = FakeHost::new(Some(A));
    host.cable("thunderbolt0", 1, B, "strix-b", IfaceState::FRESH);
    host.cable("thunderbolt1", 3, C, "strix-c", IfaceState::FRESH);
    let mut expected = vec![
        mtu("thunderbolt0"),
        address("thunderbolt0", A, B, "strix-b", 0),
        mtu("thunderbolt1"),
        address("thunderbolt1", A, C, "strix-c", 0),
    ];
    expected.extend(tuning_steps(&["thunderbolt0", "thunderbolt1"]));
    assert_eq!(plan_for(&host).steps, expected);
}

#[test]
fn no_thunderbolt_at_all() {
    let host = FakeHost::new(None);
    host.plain_nic("eth0");
    let inventory = detect(&host);
    assert!(inventory.host.is_none());
    assert!(inventory.links.is_empty(), "eth0 is not a Thunderbolt link");
    let plan = plan_for(&host);
    assert!(plan.is_empty());
    assert!(
        plan.notes[0].contains("no Thunderbolt links found"),
        "{plan}"
    );
}

#[test]
fn link_that_is_down_is_brought_up() {
    let host = FakeHost::new(Some(A));
    host.cable("thunderbolt0", 1, B, "strix-b", IfaceState::DOWN);
    host.plain_nic("eth0");
    let mut expected = vec![
        Step::LinkUp {
            interface: "thunderbolt0".into(),
        },
        mtu("thunderbolt0"),
        address("thunderbolt0", A, B, "strix-b", 0),
    ];
    expected.extend(tuning_steps(&["thunderbolt0"]));
    assert_eq!(plan_for(&host).steps, expected);
}

#[test]
fn satisfied_settings_are_not_planned_and_mtu_can_be_chosen() {
    let host = FakeHost::new(Some(A));
    host.cable(
        "thunderbolt0",
        1,
        B,
        "strix-b",
        IfaceState {
            up: true,
            mtu: 9000,
        },
    );
    for (key, value) in [
        ("busy_poll", "50"),
        ("busy_read", "50"),
        ("rmem_max", "134217728"),
        ("wmem_max", "67108864"),
    ] {
        std::fs::write(host.proc().join("sys/net/core").join(key), value).unwrap();
    }
    let options = SetupOptions {
        mtu: Some(9000),
        proc_root: host.proc(),
        ..SetupOptions::default()
    };
    let plan = plan(&detect(&host), &options).unwrap();
    let mut expected = vec![address("thunderbolt0", A, B, "strix-b", 0)];
    expected.extend(tuning_steps(&["thunderbolt0"]).split_off(4));
    assert_eq!(plan.steps, expected, "a larger rmem_max is left alone");
}

#[test]
fn persist_files_are_in_the_dry_run() {
    let host = FakeHost::new(Some(A));
    host.cable("thunderbolt0", 1, B, "strix-b", IfaceState::FRESH);
    let root = tempfile::tempdir().unwrap();
    for (persist, file) in [
        (
            Persist::Networkd,
            "etc/systemd/network/50-tbrdma-thunderbolt0.network",
        ),
        (
            Persist::Nm,
            "etc/NetworkManager/system-connections/tbrdma-thunderbolt0.nmconnection",
        ),
    ] {
        let options = SetupOptions {
            persist: Some(persist),
            proc_root: host.proc(),
            persist_root: root.path().to_owned(),
            ..SetupOptions::default()
        };
        let plan = plan(&detect(&host), &options).unwrap();
        let written: Vec<(PathBuf, String)> = plan
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::WriteFile { path, contents } => Some((path.clone(), contents.clone())),
                _ => None,
            })
            .collect();
        let wanted = format!("{}/30", cable_addresses(A, B, 0).local);
        let (_, link_file) = written
            .iter()
            .find(|(p, _)| p == &root.path().join(file))
            .expect(file);
        assert!(
            link_file.contains(&wanted) && link_file.contains("65522"),
            "{link_file}"
        );
        assert!(
            written
                .iter()
                .any(|(p, c)| p.ends_with("etc/sysctl.d/90-tbrdma.conf")
                    && c.contains("net.core.busy_poll = 50"))
        );
        assert!(
            written
                .iter()
                .any(|(p, c)| p.ends_with("etc/udev/rules.d/90-tbrdma.rules")
                    && c.contains("napi_defer_hard_irqs"))
        );
        assert!(
            plan.to_string().contains(file),
            "dry-run output names the file"
        );
    }
}

#[test]
fn interface_filter_rejects_unknown_names() {
    let host = FakeHost::new(Some(A));
    host.cable("thunderbolt0", 1, B, "strix-b", IfaceState::FRESH);
    let mut detector = Detector::new(host.sys());
    detector.only = vec!["thunderbolt7".into()];
    let error = detector.detect().unwrap_err().to_string();
    assert!(
        error.contains("thunderbolt7") && error.contains("links file"),
        "{error}"
    );
}

#[test]
fn two_usb4_routers_address_each_cable_by_its_own_router() {
    const A1: &str = "0d5e1a2b-0000-0000-ffff-ffffffff00a1";
    let host = FakeHost::new(Some(A));
    host.second_router(A1);
    host.cable("thunderbolt0", 1, B, "strix-b", IfaceState::FRESH);
    host.cable_on(1, "thunderbolt1", 1, C, "strix-c", IfaceState::FRESH);
    let inventory = detect(&host);
    assert_eq!(
        inventory.host.as_ref().unwrap().uuid,
        A,
        "the lowest router UUID names the host"
    );
    assert_eq!(inventory.host_uuids, [A, A1]);
    let mut expected = vec![
        mtu("thunderbolt0"),
        address("thunderbolt0", A, B, "strix-b", 0),
        mtu("thunderbolt1"),
        address("thunderbolt1", A1, C, "strix-c", 0),
    ];
    expected.extend(tuning_steps(&["thunderbolt0", "thunderbolt1"]));
    assert_eq!(plan_for(&host).steps, expected);
}
