//! Unmodified verbs programs over the library, between two network namespaces joined by a veth
//! cable, selected with `LD_LIBRARY_PATH`: Debian's `ibv_devices`, `ibv_devinfo -v` and
//! `ibv_rc_pingpong` (package `ibverbs-utils`), perftest's latency and bandwidth tools
//! (`perftest`), and `tests/c/patterns.c` compiled against the system `verbs.h`
//! (`libibverbs-dev`), which checks every byte it moves. Each test says why and skips when it
//! is not root or a tool is not installed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tbrdma_netdev::lab::LabTopology;
use tbrdma_tests::Lab;

/// The tools share two cores: one lab test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Longest a tool may run before `timeout` ends it (a hang fails the test, never blocks CI).
const TOOL_TIMEOUT_S: u32 = 180;

fn find_tool(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// A directory holding the library as `libibverbs.so.1` and `libibverbs.so`.
fn library_dir() -> PathBuf {
    // `cargo test` builds the cdylib into deps/; `cargo build` into the profile folder.
    let exe = std::env::current_exe().expect("test executable");
    let deps = exe.parent().expect("target/<profile>/deps");
    let lib = [deps, deps.parent().expect("target/<profile>")]
        .iter()
        .map(|dir| dir.join("libibverbs.so"))
        .find(|lib| lib.is_file())
        .unwrap_or_else(|| {
            panic!(
                "libibverbs.so not built next to {} (cargo builds it with this crate)",
                deps.display()
            )
        });
    let dir = std::env::temp_dir().join(format!("tbrdma-ibv-lib-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("library dir");
    for name in ["libibverbs.so.1", "libibverbs.so"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link).expect("symlink the library");
    }
    dir
}

struct Setup {
    lab: Lab,
    lib: PathBuf,
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Setup {
    /// The lab, or None (with the reason printed) when a tool is missing or this is not root.
    fn new(tag: &str, tools: &[&str]) -> Option<Setup> {
        for tool in tools {
            if find_tool(tool).is_none() {
                let package = match *tool {
                    "cc" => "gcc",
                    t if t.starts_with("ibv_") => "ibverbs-utils",
                    _ => "perftest",
                };
                eprintln!("SKIPPED: {tool} is not installed (Debian: apt-get install {package})");
                return None;
            }
        }
        let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let lab = Lab::up(tag, 2, LabTopology::Pair, 1)?;
        Some(Setup {
            lab,
            lib: library_dir(),
            _serial: serial,
        })
    }

    fn interface(&self, rank: usize) -> String {
        self.lab.interface(rank, 1 - rank, 0)
    }

    fn address(&self, rank: usize) -> String {
        self.lab.address(rank, 1 - rank, 0).to_string()
    }

    /// `program args` in `rank`'s namespace over the library, with its link as the device.
    fn command(&self, rank: usize, program: &str, args: &[String]) -> Command {
        self.command_within(rank, TOOL_TIMEOUT_S, program, args)
    }

    /// [`Self::command`], ended by `timeout` after `seconds`.
    fn command_within(&self, rank: usize, seconds: u32, program: &str, args: &[String]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.lab.namespace(rank), "timeout"])
            .arg(seconds.to_string())
            .arg(program)
            .args(args)
            .env("LD_LIBRARY_PATH", &self.lib)
            .env("TBRDMA_IBV_DEVICES", self.interface(rank))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    fn device(&self, rank: usize) -> String {
        format!("tbrdma_{}", self.interface(rank))
    }

    /// Waits until something in `rank`'s namespace listens on TCP `port` (the servers'
    /// side channel), or the server exited.
    fn wait_listening(&self, rank: usize, port: u16, server: &mut Child) {
        let needle = format!(":{port:04X} 00000000:0000 0A");
        let start = Instant::now();
        loop {
            let out = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &self.lab.namespace(rank),
                    "cat",
                    "/proc/net/tcp",
                ])
                .output()
                .expect("read /proc/net/tcp");
            if String::from_utf8_lossy(&out.stdout).contains(&needle) {
                return;
            }
            if let Ok(Some(status)) = server.try_wait() {
                panic!("the server exited ({status}) before listening on {port}");
            }
            // Not a timing assertion: a bound so a broken server cannot hang the test.
            assert!(
                start.elapsed() < Duration::from_secs(u64::from(TOOL_TIMEOUT_S)),
                "the server never listened on port {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `program` as server in `server_rank` and as client (with the server's address
    /// appended) in the other namespace; returns (server output, client output) after checking
    /// both exited 0.
    fn pair(
        &self,
        server_rank: usize,
        program: &str,
        args: &[String],
        port: u16,
    ) -> (String, String) {
        let client_rank = 1 - server_rank;
        let mut server_args = args.to_vec();
        server_args.extend(["-d".into(), self.device(server_rank)]);
        let mut server = self
            .command(server_rank, program, &server_args)
            .spawn()
            .expect("start the server");
        self.wait_listening(server_rank, port, &mut server);
        let mut client_args = args.to_vec();
        client_args.extend(["-d".into(), self.device(client_rank)]);
        client_args.push(self.address(server_rank));
        let client = self
            .command(client_rank, program, &client_args)
            .output()
            .expect("run the client");
        let server = server.wait_with_output().expect("wait for the server");
        let (s, c) = (text(&server), text(&client));
        assert!(
            server.status.success() && client.status.success(),
            "{program} {args:?}: server {} / client {}\n--- server:\n{s}\n--- client:\n{c}",
            server.status,
            client.status
        );
        (s, c)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        // Runs before the serial guard is released: the next test makes its own.
        let _ = std::fs::remove_dir_all(&self.lib);
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

#[test]
fn ibv_devices_and_devinfo_list_the_links() {
    let Some(setup) = Setup::new("ibvd", &["ibv_devices", "ibv_devinfo"]) else {
        return;
    };
    for rank in 0..2 {
        let out = setup.command(rank, "ibv_devices", &[]).output().unwrap();
        let listing = text(&out);
        assert!(out.status.success(), "{listing}");
        assert!(listing.contains(&setup.device(rank)), "{listing}");
        let out = setup
            .command(rank, "ibv_devinfo", &strings(&["-v"]))
            .output()
            .unwrap();
        let info = text(&out);
        assert!(out.status.success(), "{info}");
        for expected in [
            format!("hca_id:\t{}", setup.device(rank)),
            "PORT_ACTIVE (4)".to_string(),
            "link_layer:\t\tEthernet".to_string(),
            "phys_port_cnt:\t\t\t1".to_string(),
            "atomic_cap:\t\t\tATOMIC_HCA (1)".to_string(),
            format!("GID[  0]:\t\t::ffff:{}, RoCE v2", setup.address(rank)),
        ] {
            assert!(info.contains(&expected), "no {expected:?} in:\n{info}");
        }
    }
}

/// `N iters in X seconds` on both sides: every iteration completed.
fn check_pingpong(out: &str, iters: u32) {
    assert!(
        out.contains(&format!("{iters} iters in")),
        "no '{iters} iters in' in:\n{out}"
    );
}

#[test]
fn ibv_rc_pingpong_sizes_iterations_and_both_roles() {
    let Some(setup) = Setup::new("ibvr", &["ibv_rc_pingpong"]) else {
        return;
    };
    let mut port = 18600;
    for server_rank in [0, 1] {
        for (size, iters) in [(1u32, 50u32), (4096, 300), (65536, 40), (1 << 20, 8)] {
            port += 1;
            let args = strings(&[
                "-g",
                "0",
                "-s",
                &size.to_string(),
                "-n",
                &iters.to_string(),
                "-p",
                &port.to_string(),
            ]);
            let (s, c) = setup.pair(server_rank, "ibv_rc_pingpong", &args, port);
            check_pingpong(&s, iters);
            check_pingpong(&c, iters);
        }
    }
}

/// The result row of a perftest run: `#bytes #iterations ...` with these values.
fn result_row(out: &str, bytes: u64, iters: u32) -> Option<Vec<&str>> {
    out.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.len() >= 4
            && fields[0] == bytes.to_string()
            && fields[1] == iters.to_string()
            && fields[2..].iter().all(|f| f.parse::<f64>().is_ok()))
        .then_some(fields)
    })
}

fn perftest(setup: &Setup, tool: &str, extra: &[&str], sizes: &[u64], iters: u32, port: &mut u16) {
    for &size in sizes {
        *port += 1;
        let mut args = strings(&["-n", &iters.to_string(), "-p", &port.to_string()]);
        if !tool.starts_with("ib_atomic") {
            args.extend(strings(&["-s", &size.to_string()]));
        }
        args.extend(strings(extra));
        let (s, c) = setup.pair(0, tool, &args, *port);
        let row = result_row(&c, size, iters)
            .unwrap_or_else(|| panic!("{tool} {args:?}: no result row in:\n{c}\n--- server:\n{s}"));
        // Bandwidth tools report on both sides; latency tools on the client (and some on both).
        if tool.ends_with("_bw") {
            assert!(
                result_row(&s, size, iters).is_some(),
                "{tool} {args:?}: the server printed no result:\n{s}"
            );
            let avg: f64 = row[3].parse().unwrap();
            assert!(avg > 0.0, "{tool} {args:?}: zero bandwidth:\n{c}");
        } else {
            let t_min: f64 = row[2].parse().unwrap();
            assert!(t_min > 0.0, "{tool} {args:?}: zero latency:\n{c}");
        }
        eprintln!("{tool} {size} B x {iters}: {}", row.join(" "));
    }
}

#[test]
fn perftest_latency_tools_complete_every_run() {
    let tools = [
        "ib_write_lat",
        "ib_send_lat",
        "ib_read_lat",
        "ib_atomic_lat",
    ];
    let Some(setup) = Setup::new("ibvl", &tools) else {
        return;
    };
    let mut port = 18700 - 90;
    perftest(
        &setup,
        "ib_write_lat",
        &[],
        &[2, 64, 4096, 65536],
        200,
        &mut port,
    );
    perftest(
        &setup,
        "ib_send_lat",
        &[],
        &[2, 64, 4096, 65536],
        200,
        &mut port,
    );
    perftest(
        &setup,
        "ib_read_lat",
        &[],
        &[2, 64, 4096, 65536],
        200,
        &mut port,
    );
    perftest(&setup, "ib_atomic_lat", &[], &[8], 200, &mut port);
    perftest(
        &setup,
        "ib_atomic_lat",
        &["-A", "CMP_AND_SWAP"],
        &[8],
        200,
        &mut port,
    );
}

#[test]
fn perftest_bandwidth_tools_complete_every_run() {
    let tools = ["ib_write_bw", "ib_send_bw", "ib_read_bw"];
    let Some(setup) = Setup::new("ibvb", &tools) else {
        return;
    };
    let mut port = 18700 - 60;
    for tool in tools {
        perftest(
            &setup,
            tool,
            &[],
            &[64, 4096, 65536, 1 << 20],
            100,
            &mut port,
        );
    }
}

/// Compiles `tests/c/patterns.c` against the system `verbs.h` and the library.
fn build_patterns(setup: &Setup) -> String {
    let exe = setup.lib.join("patterns");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/patterns.c");
    let out = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&source)
        .arg(format!("-L{}", setup.lib.display()))
        .arg("-l:libibverbs.so.1")
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "compiling patterns.c:\n{}",
        text(&out)
    );
    exe.to_string_lossy().into_owned()
}

/// Runs the pattern program, server in rank 0, with `delays` (seconds before RTR) for the
/// server and the client.
fn run_patterns(setup: &Setup, exe: &str, port: u16, delays: [u32; 2]) {
    run_patterns_with(setup, exe, port, delays, [None, None]);
}

/// [`run_patterns`] with `TBRDMA_IBV_ENGINE` set to `engines[rank]` where given.
fn run_patterns_with(
    setup: &Setup,
    exe: &str,
    port: u16,
    delays: [u32; 2],
    engines: [Option<&str>; 2],
) {
    let port = port.to_string();
    let mut server_cmd = setup.command(0, exe, &strings(&["server", &setup.device(0), &port]));
    let mut client_cmd = setup.command(1, exe, &patterns_client_args(setup, &port));
    for ((cmd, delay), engine) in [(&mut server_cmd, delays[0]), (&mut client_cmd, delays[1])]
        .into_iter()
        .zip(engines)
    {
        if delay > 0 {
            cmd.env("PATTERNS_RTR_DELAY_S", delay.to_string());
        }
        if let Some(engine) = engine {
            cmd.env("TBRDMA_IBV_ENGINE", engine);
        }
    }
    run_pattern_pair(server_cmd, client_cmd, &format!("delays {delays:?}"));
}

/// The pattern client's arguments, for a server in rank 0 on `port`.
fn patterns_client_args(setup: &Setup, port: &str) -> Vec<String> {
    strings(&["client", &setup.device(1), &setup.address(0), port])
}

/// Runs a pattern server and client; returns their output after checking that both passed.
fn run_pattern_pair(
    mut server_cmd: Command,
    mut client_cmd: Command,
    what: &str,
) -> (String, String) {
    let mut server = server_cmd.spawn().expect("start the server");
    let mut first = String::new();
    BufReader::new(server.stdout.as_mut().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert_eq!(first.trim(), "listening", "the server said {first:?}");
    let client = client_cmd.output().unwrap();
    let server = server.wait_with_output().unwrap();
    let (s, c) = (text(&server), text(&client));
    assert!(
        server.status.success()
            && client.status.success()
            && s.contains("PASS")
            && c.contains("PASS"),
        "{what}\n--- server:\n{s}\n--- client:\n{c}"
    );
    (s, c)
}

fn patterns_setup(tag: &str) -> Option<Setup> {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() {
        eprintln!(
            "SKIPPED: /usr/include/infiniband/verbs.h not found (apt-get install libibverbs-dev)"
        );
        return None;
    }
    Setup::new(tag, &["cc"])
}

#[test]
fn patterns_through_the_real_verbs_h_check_every_byte() {
    let Some(setup) = patterns_setup("ibvp") else {
        return;
    };
    let exe = build_patterns(&setup);
    run_patterns(&setup, &exe, 18690, [0, 0]);
}

/// The library runs the packet engine by default, and a process on the sockets engine (as one
/// without root falls back to) still reaches it: each queue pair number says whether its
/// process hears frames (docs/ibverbs.md). Two packet processes move their bytes in frames;
/// with one sockets process either way round, no frame crosses the cable, and the pattern
/// program checks every byte in each case.
#[test]
fn packet_and_sockets_processes_reach_each_other() {
    let Some(setup) = patterns_setup("ibvm") else {
        return;
    };
    if let Err(why) = setup.lab.watch_frames() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let exe = build_patterns(&setup);
    run_patterns(&setup, &exe, 18694, [0, 0]);
    let (frames, broadcast) = setup.lab.frames_sent();
    // (The program's exchanges take about 70 frames.)
    assert!(
        frames > 20,
        "two packet-engine processes sent {frames} frames: their bytes did not go in frames"
    );
    assert_eq!(broadcast, 0, "frames were broadcast");
    run_patterns_with(&setup, &exe, 18695, [0, 0], [Some("sockets"), None]);
    run_patterns_with(&setup, &exe, 18696, [0, 0], [None, Some("sockets")]);
    let (after, _) = setup.lab.frames_sent();
    assert_eq!(
        after, frames,
        "frames were sent to a process on the sockets engine, which cannot hear them"
    );
}

/// A process without `CAP_NET_RAW` (an ordinary user, as most verbs programs run) falls back
/// to the sockets engine, says so when asked for the packet engine, and still reaches a packet
/// process: its queue pair numbers lack the frames bit, so it gets UDP. No frame crosses the
/// cable.
#[test]
fn a_process_without_cap_net_raw_falls_back_and_still_reaches_a_packet_peer() {
    let Some(setup) = patterns_setup("ibvu") else {
        return;
    };
    if find_tool("setpriv").is_none() {
        eprintln!("SKIPPED: setpriv is not installed (Debian: apt-get install util-linux)");
        return;
    }
    if let Err(why) = setup.lab.watch_frames() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let exe = build_patterns(&setup);
    // The unprivileged user may not reach the build folder: a world-readable copy of the
    // library (the program is built in the library folder, under the temporary directory).
    let copy = setup.lib.join("world-readable");
    std::fs::create_dir_all(&copy).expect("a folder for the copy");
    let lib = std::fs::read_link(setup.lib.join("libibverbs.so.1")).expect("the library's link");
    std::fs::copy(&lib, copy.join("libibverbs.so.1")).expect("copy the library");
    use std::os::unix::fs::PermissionsExt;
    for path in [&setup.lib, &copy] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let port = "18697";
    let server = setup.command(0, &exe, &strings(&["server", &setup.device(0), port]));
    // As user nobody, with no capability (and root's memory lock limit, inherited).
    let mut args = strings(&["--reuid=65534", "--regid=65534", "--clear-groups", &exe]);
    args.extend(patterns_client_args(&setup, port));
    let mut client = setup.command_within(1, 60, "setpriv", &args);
    client
        .env("LD_LIBRARY_PATH", &copy)
        .env("TBRDMA_IBV_ENGINE", "packet");
    let (_, c) = run_pattern_pair(server, client, "an unprivileged client");
    assert!(
        c.contains("CAP_NET_RAW") && c.contains("using the sockets engine"),
        "the unprivileged client did not say it fell back:\n{c}"
    );
    let (frames, _) = setup.lab.frames_sent();
    assert_eq!(
        frames, 0,
        "frames were sent to a process that cannot hear them"
    );
}

/// One side reaches RTR seconds after the other (longer than tbrdma's default idle timeout
/// and handshake budget): the other side waits for it, whichever of the two sends CONNECT.
#[test]
fn a_peer_that_reaches_rtr_seconds_later_is_waited_for() {
    let Some(setup) = patterns_setup("ibvw") else {
        return;
    };
    let exe = build_patterns(&setup);
    run_patterns(&setup, &exe, 18691, [0, 5]);
    run_patterns(&setup, &exe, 18692, [5, 0]);
}

/// With a pre-shared key, both sides holding it connect; a side with another key cannot: the
/// side that sends CONNECT gives up after its (shortened: 4 retries, about 30 ms) budget and
/// its posted receive is flushed, which the pattern server reports as its failure.
#[test]
fn a_peer_without_the_key_cannot_connect() {
    let Some(setup) = patterns_setup("ibvk") else {
        return;
    };
    let exe = build_patterns(&setup);
    let port = "18693";
    let run = |keys: [&str; 2], retries: &str, client_limit: u32| {
        let mut server_cmd = setup.command(0, &exe, &strings(&["server", &setup.device(0), port]));
        let mut client_cmd = setup.command_within(
            1,
            client_limit,
            &exe,
            &strings(&["client", &setup.device(1), &setup.address(0), port]),
        );
        for (cmd, key) in [(&mut server_cmd, keys[0]), (&mut client_cmd, keys[1])] {
            cmd.env("TBRDMA_IBV_PSK", key)
                .env("TBRDMA_IBV_RETRIES", retries);
        }
        let mut server = server_cmd.spawn().expect("start the server");
        let mut first = String::new();
        BufReader::new(server.stdout.as_mut().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert_eq!(first.trim(), "listening", "the server said {first:?}");
        // The client of a failed handshake waits for ever (as a verbs queue pair would):
        // `timeout` ends it after `client_limit` seconds.
        let client = client_cmd.spawn().expect("start the client");
        let server = server.wait_with_output().unwrap();
        let client = client.wait_with_output().unwrap();
        (server.status.success(), text(&server), text(&client))
    };
    // Rank 0's address is the smaller: the server sends CONNECT.
    let ip = |rank| setup.address(rank).parse::<std::net::Ipv4Addr>().unwrap();
    assert!(ip(0) < ip(1), "the lab gave rank 0 the larger address");
    let (ok, s, c) = run(["same key", "same key"], "30", TOOL_TIMEOUT_S);
    assert!(
        ok && s.contains("PASS"),
        "--- server:\n{s}\n--- client:\n{c}"
    );
    let (ok, s, c) = run(["one key", "another key"], "4", 15);
    assert!(
        !ok && s.contains("first receive: status 5"),
        "the handshake with a wrong key must fail:\n--- server:\n{s}\n--- client:\n{c}"
    );
}
