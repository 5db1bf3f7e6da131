//! The demo's last step: an unmodified perftest tool (`ib_write_lat`, Debian's `perftest`)
//! between the two lab hosts over tbrdma's libibverbs-compatible library (`shim/ibverbs`),
//! selected with `LD_LIBRARY_PATH` as a user selects it. Skipped, saying what to install or
//! build, when the tool or the library is missing: the rest of the demo needs neither.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tbrdma_netdev::hostfile::Hostfile;

/// The first UDP port of the library's per-process slots (its default, `TBRDMA_IBV_PORT_BASE`);
/// perftest's side channel goes just below it.
const PERFTEST_PORT: u16 = 18_650;

/// Where `cargo build -p tbrdma-ibverbs` (or `cargo build --workspace`) leaves the library:
/// next to this binary, or in its deps/ folder.
fn library() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.to_path_buf(), dir.join("deps")]
        .into_iter()
        .map(|d| d.join("libibverbs.so"))
        .find(|lib| lib.is_file())
}

fn tool(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// Runs `ib_write_lat` between rank 0 (server) and rank 1 over rail 0, or says why not.
pub fn run(lab: &str, hostfile: &Hostfile) -> anyhow::Result<()> {
    println!(
        "\n== perftest's ib_write_lat, unmodified, over tbrdma's libibverbs, on its Ethernet frames \
         (the library's packet engine, as root; docs/ibverbs.md)"
    );
    let (Some(lib), Some(ib_write_lat)) = (library(), tool("ib_write_lat")) else {
        println!(
            "   skipped: needs Debian's perftest (apt-get install perftest) and the library \
             (cargo build --release -p tbrdma-ibverbs); then run the demo again"
        );
        return Ok(());
    };
    let dir = std::env::temp_dir().join(format!("tbrdma-demo-ibverbs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).context("a folder for the library's names")?;
    for name in ["libibverbs.so.1", "libibverbs.so"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link).context("linking the library")?;
    }
    let result = run_pair(lab, hostfile, &dir, &ib_write_lat);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_pair(lab: &str, hostfile: &Hostfile, lib_dir: &Path, tool: &Path) -> anyhow::Result<()> {
    let link = |rank: usize| {
        hostfile.ranks[rank]
            .links
            .iter()
            .find(|l| l.rail == 0)
            .map(|l| (l.interface.clone(), l.address.to_string()))
            .context("the lab host has no rail 0")
    };
    let ((if0, addr0), (if1, _)) = (link(0)?, link(1)?);
    let port = PERFTEST_PORT.to_string();
    let common = ["-s", "8", "-n", "2000", "-p", &port];
    let command = |rank: usize, iface: &str, extra: &[&str]| {
        let ns = tbrdma_netdev::lab::namespace_name(lab, rank);
        let device = format!("tbrdma_{iface}");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &ns, "timeout", "120"])
            .arg(tool)
            .args(common)
            .args(["-d", &device])
            .args(extra)
            .env("LD_LIBRARY_PATH", lib_dir)
            .env("TBRDMA_IBV_DEVICES", iface)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    };
    println!(
        "   rank 0: LD_LIBRARY_PATH=<the library> TBRDMA_IBV_DEVICES={if0} ib_write_lat {} -d tbrdma_{if0}",
        common.join(" ")
    );
    println!(
        "   rank 1: LD_LIBRARY_PATH=<the library> TBRDMA_IBV_DEVICES={if1} ib_write_lat {} -d tbrdma_{if1} {addr0}",
        common.join(" ")
    );
    let mut server = command(0, &if0, &[])
        .spawn()
        .context("starting ib_write_lat")?;
    wait_listening(lab, PERFTEST_PORT, &mut server)?;
    let client = command(1, &if1, &[&addr0])
        .output()
        .context("running ib_write_lat")?;
    let server = server.wait_with_output()?;
    if !client.status.success() || !server.status.success() {
        bail!(
            "ib_write_lat over the library failed:\nrank 0: {}\nrank 1: {}",
            String::from_utf8_lossy(&server.stderr).trim(),
            String::from_utf8_lossy(&client.stderr).trim()
        );
    }
    print!("{}", String::from_utf8_lossy(&client.stdout));
    Ok(())
}

/// Waits until perftest's server listens on its TCP side channel in rank 0's namespace.
fn wait_listening(lab: &str, port: u16, server: &mut std::process::Child) -> anyhow::Result<()> {
    let needle = format!(":{port:04X} 00000000:0000 0A");
    let ns = tbrdma_netdev::lab::namespace_name(lab, 0);
    let start = Instant::now();
    loop {
        let tcp = Command::new("ip")
            .args(["netns", "exec", &ns, "cat", "/proc/net/tcp"])
            .output()
            .context("reading rank 0's TCP sockets")?;
        if String::from_utf8_lossy(&tcp.stdout).contains(&needle) {
            return Ok(());
        }
        if let Some(status) = server.try_wait()? {
            bail!("ib_write_lat's server exited ({status}) before it listened");
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("ib_write_lat's server did not listen within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
