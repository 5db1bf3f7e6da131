//! The library exports, with rdma-core's version, every libibverbs symbol Debian 12's clients
//! and the provider libraries they load import (`tests/debian12-imports.txt`, measured with
//! `objdump -T`; they are linked with BIND_NOW, so one missing symbol stops the program at
//! load). When the clients are installed, their imports are read again here. Needs `readelf`
//! (binutils); skips without it.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// `name@VERSION` of each versioned definition (`readelf --dyn-syms -W`).
fn definitions(object: &Path) -> Option<BTreeSet<String>> {
    let out = Command::new("readelf")
        .args(["--dyn-syms", "-W"])
        .arg(object)
        .output()
        .ok()?;
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.contains(" UND "))
            .filter_map(|l| l.split_whitespace().nth(7))
            .map(|s| s.replace("@@", "@"))
            .collect(),
    )
}

/// `name@VERSION` of each IBVERBS import of `object` (undefined versioned symbols).
fn imports(object: &Path) -> BTreeSet<String> {
    let out = Command::new("readelf")
        .args(["--dyn-syms", "-W"])
        .arg(object)
        .output()
        .expect("readelf");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(" UND "))
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter(|s| s.contains("@IBVERBS_"))
        .map(|s| s.split(" (").next().unwrap_or(s).to_string())
        .collect()
}

#[test]
fn every_symbol_the_debian_12_clients_import_is_exported_with_its_version() {
    // `cargo test` builds the cdylib into deps/; `cargo build` into the profile folder.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let lib = [deps, deps.parent().unwrap()]
        .iter()
        .map(|dir| dir.join("libibverbs.so"))
        .find(|lib| lib.is_file())
        .expect("libibverbs.so built with this crate");
    let Some(defined) = definitions(&lib) else {
        eprintln!("SKIPPED: readelf not found (apt-get install binutils)");
        return;
    };
    let listed = include_str!("debian12-imports.txt");
    let mut wanted: BTreeSet<String> = listed
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(str::to_string)
        .collect();
    assert_eq!(wanted.len(), 109, "the measured list has 109 symbols");
    let clients = [
        "/usr/bin/ibv_devices",
        "/usr/bin/ibv_devinfo",
        "/usr/bin/ibv_rc_pingpong",
        "/usr/bin/ib_write_lat",
        "/usr/bin/ib_write_bw",
        "/usr/bin/ib_send_lat",
        "/usr/bin/ib_send_bw",
        "/usr/bin/ib_read_lat",
        "/usr/bin/ib_read_bw",
        "/usr/bin/ib_atomic_lat",
        "/lib/x86_64-linux-gnu/libmlx5.so.1",
        "/lib/x86_64-linux-gnu/libefa.so.1",
        "/lib/x86_64-linux-gnu/librdmacm.so.1",
    ];
    for client in clients.iter().map(Path::new).filter(|p| p.exists()) {
        let got = imports(client);
        assert!(
            !got.is_empty(),
            "read no IBVERBS import of {}",
            client.display()
        );
        wanted.extend(got);
    }
    let missing: Vec<&String> = wanted.difference(&defined).collect();
    assert!(
        missing.is_empty(),
        "not exported (or with another version): {missing:?}"
    );
    eprintln!("{} imported symbols all exported", wanted.len());
}
