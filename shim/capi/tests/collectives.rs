//! The collectives' C API from C: `docs/examples/tbrdma_allreduce.c` and `tests/c/coll_checks.c`
//! are compiled with the system C compiler against `include/tbrdma.h` and `libtbrdma.so`.
//!
//! - Without root: `coll_checks local` on a one-rank hostfile (every argument error with its
//!   code and message, and the one-rank semantics: in place, overlapping buffers).
//! - With root (skipped otherwise): the example as 2 ranks in two lab namespaces (hostfile and
//!   rank as arguments, then again from a rendezvous through `TBRDMA_ADDR`), a rank that leaves
//!   named by the other (`coll_checks failure`), and the example as a 3-rank mesh from
//!   `TBRDMA_HOSTFILE`/`TBRDMA_RANK`, and as a 4-rank ring, where rank 1 relays rank 0's
//!   message to rank 2.
//!
//! Skips with a message when there is no C compiler.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;

use tbrdma_netdev::lab::{LabTopology, hostfile_path};
use tbrdma_tests::Lab;

/// One world of busy-polling processes at a time: the machine may have only 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

const ENV: [&str; 4] = [
    "TBRDMA_HOSTFILE",
    "TBRDMA_RANK",
    "TBRDMA_ADDR",
    "TBRDMA_WORLD_SIZE",
];

mod common;
use common::{library_dir, show};

/// A scratch folder for one test, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("tbrdma-capi-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp folder");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Compiles `source` (relative to this crate) into `dir`; `None` when there is no compiler.
fn compile(dir: &Path, source: &str) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let name = Path::new(source).file_stem().expect("file name");
    let exe = dir.join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join(source))
        .arg("-I")
        .arg(root.join("include"))
        .arg("-L")
        .arg(library_dir())
        .arg("-ltbrdma")
        .status();
    match built {
        Err(e) => {
            eprintln!("skipping: no C compiler ({cc}: {e})");
            None
        }
        Ok(s) => {
            assert!(s.success(), "compiling {source} failed");
            Some(exe)
        }
    }
}

/// Starts `exe` in `rank`'s namespace with `args` and extra environment `env` (the outer
/// `TBRDMA_*` variables removed).
fn spawn(lab: &Lab, rank: usize, exe: &Path, args: &[String], env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.namespace(rank)])
        .arg(exe)
        .args(args)
        .env("LD_LIBRARY_PATH", library_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in ENV {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("start the program")
}

/// Waits for every rank; asserts each succeeded and printed `want`; returns their outputs.
fn finish_all(children: Vec<Child>, want: &str) -> Vec<String> {
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait"))
        .collect();
    let all = outputs
        .iter()
        .enumerate()
        .map(|(r, o)| format!("=== rank {r} ===\n{}", show(o)))
        .collect::<Vec<_>>()
        .join("\n");
    for o in &outputs {
        assert!(o.status.success(), "{all}");
        assert!(String::from_utf8_lossy(&o.stdout).contains(want), "{all}");
    }
    outputs.iter().map(show).collect()
}

#[test]
fn argument_errors_and_one_rank_semantics() {
    let scratch = Scratch::new("local");
    let Some(exe) = compile(&scratch.0, "tests/c/coll_checks.c") else {
        return;
    };
    let hostfile = scratch.0.join("single.json");
    std::fs::write(
        &hostfile,
        r#"{
  "version": 1,
  "topology": { "kind": "single", "rails": 0 },
  "ranks": [ { "rank": 0, "host": "solo", "uuid": "00000000-0000-0000-0000-000000000001", "links": [] } ]
}
"#,
    )
    .expect("write the hostfile");
    let mut cmd = Command::new(&exe);
    cmd.arg("local")
        .arg(&hostfile)
        .env("LD_LIBRARY_PATH", library_dir());
    for var in ENV {
        cmd.env_remove(var);
    }
    let out = cmd.output().expect("run coll_checks");
    let text = show(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("checks passed"), "{text}");
    eprintln!("{text}");
}

#[test]
fn the_c_example_runs_on_two_ranks_and_names_a_rank_that_left() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("ca2", 2, LabTopology::Pair, 1) else {
        return;
    };
    let scratch = Scratch::new("pair");
    let Some(example) = compile(&scratch.0, "../../docs/examples/tbrdma_allreduce.c") else {
        return;
    };
    let checks = compile(&scratch.0, "tests/c/coll_checks.c").expect("compiler");
    let hostfile = hostfile_path(&lab.name).display().to_string();

    // The hostfile and rank as arguments.
    let children = (0..2)
        .map(|r| spawn(&lab, r, &example, &[hostfile.clone(), r.to_string()], &[]))
        .collect();
    let outs = finish_all(children, "all checks passed");
    assert!(
        outs[0].contains("all_reduce of 70000 f32 (sum) verified"),
        "{}",
        outs[0]
    );
    assert!(
        outs[1].contains("broadcast from rank 1 verified"),
        "{}",
        outs[1]
    );
    assert!(
        outs[1].contains("message from rank 0 over 1 hops verified"),
        "{}",
        outs[1]
    );
    assert!(
        outs[0].contains("bad dtype refused: tbrdma_all_reduce: dtype 42"),
        "{}",
        outs[0]
    );

    // A rendezvous at rank 0's cable address, from the environment.
    let addr = format!("{}:29521", lab.address(0, 1, 0));
    let children = (0..2)
        .map(|r| {
            let env = [
                ("TBRDMA_ADDR", addr.clone()),
                ("TBRDMA_RANK", r.to_string()),
                ("TBRDMA_WORLD_SIZE", "2".to_string()),
            ];
            spawn(&lab, r, &example, &[], &env)
        })
        .collect();
    finish_all(children, "all checks passed");

    // Rank 1 leaves; rank 0's next all-reduce fails naming it, and the one after that says
    // the communicator is unusable.
    let children = (0..2)
        .map(|r| {
            let args = ["failure".to_string(), hostfile.clone(), r.to_string()];
            spawn(&lab, r, &checks, &args, &[])
        })
        .collect();
    let outs = finish_all(children, "");
    assert!(
        outs[0].contains("rank 0: failure of rank 1 reported"),
        "{}",
        outs[0]
    );
    eprintln!("{}", outs[0]);
}

#[test]
fn the_c_example_runs_on_a_three_rank_mesh_from_the_environment() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("ca3", 3, LabTopology::Mesh, 1) else {
        return;
    };
    let scratch = Scratch::new("mesh");
    let Some(example) = compile(&scratch.0, "../../docs/examples/tbrdma_allreduce.c") else {
        return;
    };
    let hostfile = hostfile_path(&lab.name).display().to_string();
    let children = (0..3)
        .map(|r| {
            let env = [
                ("TBRDMA_HOSTFILE", hostfile.clone()),
                ("TBRDMA_RANK", r.to_string()),
            ];
            spawn(&lab, r, &example, &[], &env)
        })
        .collect();
    let outs = finish_all(children, "all checks passed");
    assert!(outs[0].contains("communicator of 3 ranks"), "{}", outs[0]);
    assert!(
        outs[2].contains("broadcast from rank 2 verified"),
        "{}",
        outs[2]
    );
}

#[test]
fn the_c_example_runs_on_a_four_rank_ring_with_a_relayed_message() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::up("ca4", 4, LabTopology::Ring, 1) else {
        return;
    };
    let scratch = Scratch::new("ring");
    let Some(example) = compile(&scratch.0, "../../docs/examples/tbrdma_allreduce.c") else {
        return;
    };
    let hostfile = hostfile_path(&lab.name).display().to_string();
    let children = (0..4)
        .map(|r| spawn(&lab, r, &example, &[hostfile.clone(), r.to_string()], &[]))
        .collect();
    let outs = finish_all(children, "all checks passed");
    assert!(
        outs[1].contains("rank 1: relayed the message from rank 0 to rank 2"),
        "{}",
        outs[1]
    );
    assert!(
        outs[2].contains("message from rank 0 over 2 hops verified"),
        "{}",
        outs[2]
    );
}
