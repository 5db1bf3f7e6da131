//! The plugin driven as NCCL's proxy thread drives it, by a C program (`tests/harness/`)
//! compiled here with the system C compiler, one process per rank in two network namespaces
//! joined by a veth pair (MTU 65520). The plugin is installed under both names NCCL and RCCL
//! look for, and the harness runs its whole suite through each exported version's struct.
//! Needs root and `cc` (skips with a message otherwise).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

/// One pair of busy-polling processes at a time: the machine may have only 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// The plugin cargo built for this test run (the cdylib next to the test's `deps` folder).
fn plugin_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps folder");
    for dir in [deps, deps.parent().expect("profile folder")] {
        let candidate = dir.join("libnccl_net_tbrdma.so");
        if candidate.exists() {
            return candidate;
        }
    }
    panic!("libnccl_net_tbrdma.so not found next to {}", deps.display());
}

/// Compiles the harness and installs the plugin under both names into a fresh folder.
fn prepare(tag: &str) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("tbrdma-nccl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp folder");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/harness");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(dir.join("harness"))
        .arg(src.join("harness.c"))
        .arg("-ldl")
        .status();
    match status {
        Err(e) => {
            eprintln!("skipping: no C compiler ({cc}: {e})");
            return None;
        }
        Ok(s) => assert!(s.success(), "compiling the harness failed"),
    }
    let plugin = plugin_path();
    for name in ["libnccl-net-tbrdma.so", "librccl-net-tbrdma.so"] {
        std::fs::copy(&plugin, dir.join(name)).expect("install the plugin");
    }
    Some(dir)
}

/// Runs both ranks of a pair lab with `env` and the given versions; returns rank 0's and
/// rank 1's output.
fn run(lab: &Lab, dir: &Path, versions: &str, env: &[(&str, &str)]) -> [String; 2] {
    let side = |rank: usize| Side {
        lab_rank: rank,
        ifaces: lab.address(rank, 1 - rank, 0).to_string(),
        reached_at: lab.address(rank, 1 - rank, 0).to_string(),
        env: env.to_vec(),
    };
    run_sides(lab, dir, versions, [side(0), side(1)])
}

/// One harness process: the lab rank whose namespace it runs in, its `TBRDMA_IFACES`, the
/// address the other process reaches it at, and its environment.
struct Side<'a> {
    lab_rank: usize,
    ifaces: String,
    reached_at: String,
    env: Vec<(&'a str, &'a str)>,
}

/// Runs the harness as rank 0 and rank 1 on the two sides; returns their outputs.
fn run_sides(lab: &Lab, dir: &Path, versions: &str, sides: [Side<'_>; 2]) -> [String; 2] {
    let port = "18811";
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let (me, peer) = (&sides[rank], &sides[1 - rank]);
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &lab.namespace(me.lab_rank)])
                .arg(dir.join("harness"))
                .arg(dir)
                .args([&rank.to_string(), &peer.reached_at, port, versions])
                .env("TBRDMA_IFACES", &me.ifaces)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in &me.env {
                cmd.env(k, v);
            }
            cmd.spawn().expect("start the harness")
        })
        .collect();
    let outputs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for the harness"))
        .collect();
    let text = |o: &std::process::Output| {
        format!(
            "{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    for (rank, o) in outputs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {rank} failed ({}):\n{}\n=== other rank ===\n{}",
            o.status,
            text(o),
            text(&outputs[1 - rank])
        );
    }
    [text(&outputs[0]), text(&outputs[1])]
}

#[test]
fn the_c_harness_drives_every_exported_version_across_two_namespaces() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("nc", 2, LabTopology::Pair, 1) else {
        return;
    };
    let Some(dir) = prepare("all") else {
        return;
    };
    let outs = run(&lab, &dir, "8,9,10,11", &[]);
    for out in &outs {
        assert!(
            out.contains("both names load; v8, v9, v10 and v11 resolve"),
            "{out}"
        );
        for v in ["v8", "v9", "v10", "v11"] {
            for line in [
                "loopback listen/connect/accept from one thread ok",
                "proxy pattern: 300 messages each way",
                "32 in flight each way, sends first, verified",
                "32 in flight each way, receives first, verified",
                "sizes 0 B to 8 MiB verified",
                "flood: 300 small messages each way",
                "a send larger than the receive fails the receive with ncclInvalidUsage (eager: the send completes; rendezvous: it fails too)",
                "all scenarios passed",
            ] {
                assert!(out.contains(&format!("{v}: {line}")), "{v}: {line}\n{out}");
            }
        }
        assert!(
            out.contains("reload: dlclose, dlopen, init, transfer ok"),
            "{out}"
        );
        assert!(out.contains("harness: all checks passed"), "{out}");
        // Logged through NCCL's logger, and the truncation named as such.
        assert!(out.contains("] tbrdma NET: initialized: links"), "{out}");
        assert!(out.contains("message truncated"), "{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_c_harness_passes_with_caller_progress_and_the_sockets_engine() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("nk", 2, LabTopology::Pair, 1) else {
        return;
    };
    let Some(dir) = prepare("caller") else {
        return;
    };
    let outs = run(
        &lab,
        &dir,
        "10",
        &[("TBRDMA_PROGRESS", "caller"), ("TBRDMA_ENGINE", "sockets")],
    );
    for out in &outs {
        assert!(out.contains("v10: all scenarios passed"), "{out}");
        assert!(out.contains("progress Caller"), "{out}");
        assert!(out.contains("sockets engine"), "{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The whole suite of v11 over the engine's user-space faulty cable (`TBRDMA_FAULTS` in both
/// ranks: loss, duplicates, corruption and reordering of what each receives): every transfer
/// still verified, and the layer really hit datagrams of each kind.
#[test]
fn the_c_harness_passes_over_a_faulty_cable() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("nf", 2, LabTopology::Pair, 1) else {
        return;
    };
    let Some(dir) = prepare("faulty") else {
        return;
    };
    let outs = run(
        &lab,
        &dir,
        "11",
        &[(
            "TBRDMA_FAULTS",
            "seed=5,drop=2%,dup=1%,corrupt=1%,reorder=2%,reorder_by=300us",
        )],
    );
    for out in &outs {
        assert!(out.contains("v11: all scenarios passed"), "{out}");
        assert!(out.contains("harness: all checks passed"), "{out}");
        let line = out
            .lines()
            .find(|l| l.contains("tbrdma NET: faults injected: "))
            .unwrap_or_else(|| panic!("no fault report: {out}"));
        for kind in ["dropped", "duplicated", "corrupted", "reordered"] {
            let count: u64 = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{kind}=")))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no {kind} count: {line}"));
            assert!(count > 0, "no datagram was {kind}: {line}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The packet engine on both ends: the plugin's data goes as Ethernet frames (counted on the
/// cable by nftables where it can), and the whole v10 suite passes.
#[test]
fn the_c_harness_passes_over_frames() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("np", 2, LabTopology::Pair, 1) else {
        return;
    };
    let Some(dir) = prepare("frames") else {
        return;
    };
    let watching = lab.watch_frames();
    let outs = run(&lab, &dir, "10", &[("TBRDMA_ENGINE", "packet")]);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.contains("v10: all scenarios passed"), "{out}");
        assert!(out.contains("packet engine"), "{out}");
        // Connections to the other rank (those to its own listener go over UDP, which the
        // kernel loops back; the frames counted below are the other rank's).
        let peer = format!("connected to {}:", lab.address(1 - rank, rank, 0));
        assert!(out.lines().any(|l| l.contains(&peer)), "{out}");
    }
    match watching {
        Ok(()) => {
            let (frames, broadcast) = lab.frames_sent();
            // The suite moves hundreds of messages each way.
            assert!(frames > 1000, "{frames} frames counted");
            assert_eq!(broadcast, 0);
        }
        Err(why) => eprintln!("frames not counted: {why}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One end on the packet engine, the other on sockets (as where one host lacks root): the
/// packet end sends the other UDP (its connection manager said it hears only UDP), no frame
/// crosses the cable, and the suite passes.
#[test]
fn the_c_harness_passes_between_frames_and_udp() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("nm", 2, LabTopology::Pair, 1) else {
        return;
    };
    let Some(dir) = prepare("mixed") else {
        return;
    };
    let watching = lab.watch_frames();
    let side = |rank: usize, engine| Side {
        lab_rank: rank,
        ifaces: lab.address(rank, 1 - rank, 0).to_string(),
        reached_at: lab.address(rank, 1 - rank, 0).to_string(),
        env: vec![("TBRDMA_ENGINE", engine)],
    };
    let outs = run_sides(&lab, &dir, "10", [side(0, "packet"), side(1, "sockets")]);
    for out in &outs {
        assert!(out.contains("v10: all scenarios passed"), "{out}");
    }
    assert!(
        outs[0].contains("packet engine; UDP towards"),
        "{}",
        outs[0]
    );
    assert!(!outs[1].contains("packet engine"), "{}", outs[1]);
    no_frames_crossed(&lab, watching);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where nftables can count them (`Lab::watch_frames` said so), no tbrdma frame left a rank.
fn no_frames_crossed(lab: &Lab, watching: Result<(), String>) {
    match watching {
        Ok(()) => assert_eq!(lab.frames_sent(), (0, 0), "frames on the cables"),
        Err(why) => eprintln!("frames not counted: {why}"),
    }
}

/// Ranks 0 and 2 of a ring of four have no cable between them: with the packet engine, the
/// plugin reaches the other over UDP through the kernels of the hosts in between (the peer is
/// off the subnet of every link), and sends no frame.
#[test]
fn the_c_harness_passes_relayed_with_the_packet_engine() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("nr", 4, LabTopology::Ring, 1) else {
        return;
    };
    let Some(dir) = prepare("relayed") else {
        return;
    };
    let side = |rank: usize| Side {
        lab_rank: rank,
        ifaces: format!(
            "{},{}",
            lab.address(rank, (rank + 1) % 4, 0),
            lab.address(rank, (rank + 3) % 4, 0)
        ),
        reached_at: lab.address(rank, (rank + 1) % 4, 0).to_string(),
        env: vec![("TBRDMA_ENGINE", "packet")],
    };
    let watching = lab.watch_frames();
    let outs = run_sides(&lab, &dir, "10", [side(0), side(2)]);
    for out in &outs {
        assert!(out.contains("v10: all scenarios passed"), "{out}");
        assert!(out.contains("packet engine; UDP towards"), "{out}");
    }
    no_frames_crossed(&lab, watching);
    let _ = std::fs::remove_dir_all(&dir);
}
