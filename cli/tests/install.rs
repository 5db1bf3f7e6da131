//! `tbrdma install` as a user runs it: into a temporary prefix, twice (idempotent), then the
//! installed CLI, the installed plugin (through shim/nccl's C harness, with the installed
//! environment file sourced) and the C example (built with the installed pkg-config file) run
//! from there across a lab pair; `--uninstall` removes exactly the files it wrote.
//!
//! The libraries come from the build folder next to the `tbrdma` under test: `cargo test
//! --workspace` builds them; a lone `cargo test -p tbrdma-cli` may not, and then these tests skip
//! with one line. The lab part needs root and `cc`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

const TBRDMA: &str = env!("CARGO_BIN_EXE_tbrdma");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The build folder holds both libraries, or the test cannot install them.
fn libraries_built() -> bool {
    let dir = Path::new(TBRDMA).parent().expect("build folder");
    let missing: Vec<&str> = ["libtbrdma.so", "libnccl_net_tbrdma.so"]
        .into_iter()
        .filter(|n| !dir.join(n).exists())
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "skipping: {} not built in {} (cargo build -p tbrdma-capi -p tbrdma-nccl)",
            missing.join(", "),
            dir.display()
        );
    }
    missing.is_empty()
}

fn show(o: &Output) -> String {
    format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn tbrdma(bin: &Path, args: &[&str]) -> Output {
    Command::new(bin).args(args).output().expect("run tbrdma")
}

/// Every file under `dir`, relative to it.
fn files(dir: &Path) -> BTreeSet<String> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(base, &path, out);
            } else {
                out.insert(path.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(dir, dir, &mut out);
    out
}

const INSTALLED: [&str; 8] = [
    "bin/tbrdma",
    "include/tbrdma.h",
    "lib/libnccl-net-tbrdma.so",
    "lib/librccl-net-tbrdma.so",
    "lib/libtbrdma.so",
    "lib/pkgconfig/tbrdma.pc",
    "share/tbrdma/env.sh",
    "share/tbrdma/install-manifest.txt",
];

fn install(prefix: &Path) {
    let out = tbrdma(
        Path::new(TBRDMA),
        &["install", "--prefix", prefix.to_str().unwrap()],
    );
    assert!(out.status.success(), "install:\n{}", show(&out));
}

#[test]
fn install_is_idempotent_and_uninstall_removes_exactly_what_it_wrote() {
    if !libraries_built() {
        return;
    }
    let tmp = tempfile::tempdir().expect("temp folder");
    let prefix = tmp.path().join("prefix");
    // A file of the user's in the same folders must survive the uninstall.
    std::fs::create_dir_all(prefix.join("lib")).unwrap();
    std::fs::write(prefix.join("lib/libmine.so"), b"not ours").unwrap();
    install(&prefix);
    let want: BTreeSet<String> = INSTALLED
        .iter()
        .map(|s| s.to_string())
        .chain(["lib/libmine.so".to_string()])
        .collect();
    assert_eq!(files(&prefix), want);
    let manifest =
        std::fs::read_to_string(prefix.join("share/tbrdma/install-manifest.txt")).unwrap();
    install(&prefix);
    assert_eq!(files(&prefix), want, "a second install adds nothing");
    assert_eq!(
        std::fs::read_to_string(prefix.join("share/tbrdma/install-manifest.txt")).unwrap(),
        manifest
    );
    // Both plugin names are the same library.
    assert_eq!(
        std::fs::read(prefix.join("lib/libnccl-net-tbrdma.so")).unwrap(),
        std::fs::read(prefix.join("lib/librccl-net-tbrdma.so")).unwrap()
    );
    let env = std::fs::read_to_string(prefix.join("share/tbrdma/env.sh")).unwrap();
    for line in [
        "export NCCL_NET_PLUGIN=tbrdma",
        "export NCCL_NET=tbrdma",
        "TBRDMA_IFACES",
    ] {
        assert!(env.contains(line), "{line}:\n{env}");
    }
    // The installed CLI runs and can uninstall itself.
    let installed = prefix.join("bin/tbrdma");
    let version = tbrdma(&installed, &["--version"]);
    assert!(version.status.success(), "{}", show(&version));
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
    let out = tbrdma(
        &installed,
        &[
            "install",
            "--uninstall",
            "--prefix",
            prefix.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "uninstall:\n{}", show(&out));
    assert_eq!(
        files(&prefix),
        BTreeSet::from(["lib/libmine.so".to_string()])
    );
    assert!(!prefix.join("share").exists(), "emptied folders go too");
    // A second uninstall finds no manifest and says so.
    let again = tbrdma(
        Path::new(TBRDMA),
        &[
            "install",
            "--uninstall",
            "--prefix",
            prefix.to_str().unwrap(),
        ],
    );
    assert!(!again.status.success());
    assert!(
        show(&again).contains("no tbrdma install in"),
        "{}",
        show(&again)
    );
}

#[test]
fn a_tampered_manifest_cannot_make_uninstall_delete_outside_the_prefix() {
    if !libraries_built() {
        return;
    }
    let tmp = tempfile::tempdir().expect("temp folder");
    let prefix = tmp.path().join("prefix");
    let outside = tmp.path().join("precious");
    std::fs::write(&outside, b"keep").unwrap();
    install(&prefix);
    let manifest = prefix.join("share/tbrdma/install-manifest.txt");
    let mut text = std::fs::read_to_string(&manifest).unwrap();
    text.push_str(&format!(
        "{}\n{}/../precious\n",
        outside.display(),
        prefix.display()
    ));
    std::fs::write(&manifest, text).unwrap();
    let out = tbrdma(
        Path::new(TBRDMA),
        &[
            "install",
            "--uninstall",
            "--prefix",
            prefix.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    assert!(
        show(&out).contains("refusing to touch it"),
        "{}",
        show(&out)
    );
    assert!(outside.exists());
}

/// `sh -c '. env.sh; exec …'` in `rank`'s namespace: what a user's job script does.
fn with_env(lab: &Lab, rank: usize, prefix: &Path, script: &str) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.namespace(rank), "sh", "-c"])
        .arg(format!(
            ". '{}/share/tbrdma/env.sh' && {script}",
            prefix.display()
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn cc() -> Option<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc).arg("--version").output() {
        Ok(o) if o.status.success() => Some(cc),
        _ => {
            eprintln!("skipping: no C compiler ({cc})");
            None
        }
    }
}

#[test]
fn the_installed_plugin_and_c_example_run_from_the_prefix() {
    if !libraries_built() {
        return;
    }
    let Some(cc) = cc() else { return };
    let Some(lab) = Lab::up("h18i", 2, LabTopology::Pair, 1) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("temp folder");
    let prefix = tmp.path().join("prefix");
    install(&prefix);

    // The NCCL/RCCL plugin, loaded by the C harness from the installed lib folder under both
    // names, with only the installed environment file's settings (plus the link to use).
    let harness = tmp.path().join("harness");
    let built = Command::new(&cc)
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&harness)
        .arg(root().join("shim/nccl/tests/harness/harness.c"))
        .arg("-ldl")
        .status()
        .expect("cc");
    assert!(built.success(), "compiling the harness");
    let runs: Vec<_> = (0..2)
        .map(|rank| {
            let me = lab.address(rank, 1 - rank, 0);
            let peer = lab.address(1 - rank, rank, 0);
            with_env(
                &lab,
                rank,
                &prefix,
                &format!(
                    "TBRDMA_IFACES={me} exec '{}' \"$TBRDMA_PREFIX/lib\" {rank} {peer} 18871 11",
                    harness.display()
                ),
            )
            .spawn()
            .expect("start the harness")
        })
        .collect();
    for (rank, run) in runs.into_iter().enumerate() {
        let out = run.wait_with_output().expect("harness");
        assert!(out.status.success(), "harness rank {rank}:\n{}", show(&out));
        let text = show(&out);
        assert!(text.contains("both names load"), "{text}");
        assert!(text.contains("harness: all checks passed"), "{text}");
    }

    // The C example, compiled with the installed header and pkg-config file, linked to the
    // installed libtbrdma.so, found at run time through the environment file.
    let pc = Command::new("pkg-config")
        .args(["--cflags", "--libs", "tbrdma"])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .output();
    let flags: Vec<String> = match pc {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .map(String::from)
            .collect(),
        _ => {
            eprintln!("pkg-config missing: compiling the example with -I/-L by hand");
            vec![
                format!("-I{}/include", prefix.display()),
                format!("-L{}/lib", prefix.display()),
                "-ltbrdma".into(),
            ]
        }
    };
    let example = tmp.path().join("tbrdma_write_read");
    let built = Command::new(&cc)
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&example)
        .arg(root().join("docs/examples/tbrdma_write_read.c"))
        .args(&flags)
        .output()
        .expect("cc");
    assert!(
        built.status.success(),
        "compiling the example with {flags:?}:\n{}",
        show(&built)
    );
    let server_ip = lab.address(0, 1, 0);
    let server = with_env(
        &lab,
        0,
        &prefix,
        &format!("exec '{}' server {server_ip} 18872", example.display()),
    )
    .spawn()
    .expect("server");
    let client = with_env(
        &lab,
        1,
        &prefix,
        &format!(
            "exec '{}' client {} {server_ip}:18872",
            example.display(),
            lab.address(1, 0, 0)
        ),
    )
    .spawn()
    .expect("client");
    let c = client.wait_with_output().expect("client");
    let s = server.wait_with_output().expect("server");
    assert!(
        c.status.success(),
        "client:\n{}\nserver:\n{}",
        show(&c),
        show(&s)
    );
    assert!(s.status.success(), "server:\n{}", show(&s));
    assert!(
        show(&c).contains("client: READ of 65536 bytes verified"),
        "{}",
        show(&c)
    );

    // The installed CLI, from the installed PATH, in the lab.
    let devices = with_env(&lab, 0, &prefix, "exec tbrdma devices")
        .output()
        .unwrap();
    assert!(devices.status.success(), "{}", show(&devices));
    assert!(
        show(&devices).contains(&lab.interface(0, 1, 0)),
        "{}",
        show(&devices)
    );
}
