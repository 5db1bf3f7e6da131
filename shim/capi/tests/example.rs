//! `docs/examples/tbrdma_write_read.c`, compiled here with the system C compiler against
//! `include/tbrdma.h` and `libtbrdma.so`, run as a server and a client in two network
//! namespaces joined by a veth pair: a WRITE and a READ, both checked byte by byte. Needs root
//! and `cc` (skips with a message otherwise).

use std::path::Path;
use std::process::{Command, Stdio};

use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

mod common;
use common::{library_dir, show};

#[test]
fn the_c_example_writes_and_reads_between_two_namespaces() {
    let Some(lab) = Lab::up("ce", 2, LabTopology::Pair, 1) else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out_dir = std::env::temp_dir().join(format!("tbrdma-capi-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).expect("temp folder");
    let exe = out_dir.join("tbrdma_write_read");
    let libs = library_dir();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join("../../docs/examples/tbrdma_write_read.c"))
        .arg("-I")
        .arg(root.join("include"))
        .arg("-L")
        .arg(&libs)
        .arg("-ltbrdma")
        .status();
    match built {
        Err(e) => {
            eprintln!("skipping: no C compiler ({cc}: {e})");
            return;
        }
        Ok(s) => assert!(s.success(), "compiling the example failed"),
    }
    let server_ip = lab.address(0, 1, 0).to_string();
    let spawn = |rank: usize, args: &[String]| {
        Command::new("ip")
            .args(["netns", "exec", &lab.namespace(rank)])
            .arg(&exe)
            .args(args)
            .env("LD_LIBRARY_PATH", &libs)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the example")
    };
    let server = spawn(0, &["server".into(), server_ip.clone(), "18830".into()]);
    let client = spawn(
        1,
        &[
            "client".into(),
            lab.address(1, 0, 0).to_string(),
            format!("{server_ip}:18830"),
        ],
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
