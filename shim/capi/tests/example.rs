//! `docs/examples/tbrdma_write_read.c`, compiled here with the system C compiler against
//! `include/tbrdma.h` and `libtbrdma.so`, run as a server and a client in two network
//! namespaces joined by a veth pair: a WRITE and a READ, both checked byte by byte. Needs root
//! and `cc` (skips with a message otherwise).

use std::path::Path;
use std::process::{Child, Command, Stdio};

use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

mod common;
use common::{library_dir, show};

/// Compiles the example into a fresh folder; `None` (after saying so) without a C compiler.
fn build_example(tag: &str) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out_dir = std::env::temp_dir().join(format!("tbrdma-capi-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).expect("temp folder");
    let exe = out_dir.join("tbrdma_write_read");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join("../../docs/examples/tbrdma_write_read.c"))
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
            assert!(s.success(), "compiling the example failed");
            Some((out_dir, exe))
        }
    }
}

/// Starts the example in `rank`'s namespace, ended after 120 s at most (`timeout` exits 124).
fn spawn_example(lab: &Lab, exe: &Path, rank: usize, args: &[String], faults: &str) -> Child {
    Command::new("ip")
        .args(["netns", "exec", &lab.namespace(rank), "timeout", "120"])
        .arg(exe)
        .args(args)
        .env("LD_LIBRARY_PATH", library_dir())
        .env("TBRDMA_FAULTS", faults)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the example")
}

#[test]
fn the_c_example_writes_and_reads_between_two_namespaces() {
    let Some(lab) = Lab::up("ce", 2, LabTopology::Pair, 1) else {
        return;
    };
    let Some((out_dir, exe)) = build_example("ce") else {
        return;
    };
    let server_ip = lab.address(0, 1, 0).to_string();
    let server = spawn_example(
        &lab,
        &exe,
        0,
        &["server".into(), server_ip.clone(), "18830".into()],
        "",
    );
    let client = spawn_example(
        &lab,
        &exe,
        1,
        &[
            "client".into(),
            lab.address(1, 0, 0).to_string(),
            format!("{server_ip}:18830"),
        ],
        "",
    );
    let c = client.wait_with_output().expect("client");
    let s = server.wait_with_output().expect("server");
    assert!(
        c.status.success(),
        "client:\n{}\nserver:\n{}",
        show(&c),
        show(&s)
    );
    assert!(s.status.success(), "server:\n{}", show(&s));
    let (c, s) = (show(&c), show(&s));
    assert!(c.contains("client: WRITE of 65536 bytes completed"), "{c}");
    assert!(c.contains("client: READ of 65536 bytes verified"), "{c}");
    assert!(c.contains("client: bad access flags refused"), "{c}");
    assert!(
        s.contains("server: WRITE of 65536 bytes arrived intact"),
        "{s}"
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// A bug in the client's engine (a panic, injected with `TBRDMA_FAULTS=panic_after=4`) reaches
/// the C program as an error it reports and exits on: no abort, no hang, no panic through the
/// C boundary.
#[test]
fn a_panic_in_the_engine_reaches_a_c_program_as_an_error() {
    let Some(lab) = Lab::up("cf", 2, LabTopology::Pair, 1) else {
        return;
    };
    let Some((out_dir, exe)) = build_example("cf") else {
        return;
    };
    let server_ip = lab.address(0, 1, 0).to_string();
    let server = spawn_example(
        &lab,
        &exe,
        0,
        &["server".into(), server_ip.clone(), "18831".into()],
        "",
    );
    let client = spawn_example(
        &lab,
        &exe,
        1,
        &[
            "client".into(),
            lab.address(1, 0, 0).to_string(),
            format!("{server_ip}:18831"),
        ],
        "panic_after=4",
    );
    let c = client.wait_with_output().expect("client");
    // The example's server waits on a flag in memory, with no way to hear that its client
    // is gone: it is stopped here.
    // SIGTERM, which `timeout` passes on to the example (a SIGKILL would orphan it).
    let _ = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status();
    let _ = server.wait_with_output();
    assert_eq!(
        c.status.code(),
        Some(1),
        "the client exits with its own error status (124: it hung; none: a signal):\n{}",
        show(&c)
    );
    let text = show(&c);
    assert!(
        text.contains("the tbrdma engine failed") && text.contains("panic_after"),
        "the client names the failure: {text}"
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}
