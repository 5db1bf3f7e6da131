//! The parent: builds the lab, runs every case as a server and a client process in the two
//! namespaces, once per round (all selected cases in order, then all again), prints the report,
//! and takes the lab down whatever happens.
//!
//! SIGINT, SIGTERM and SIGHUP are blocked in every thread and taken by a watcher thread with
//! `sigwait`: the first kills the children, which makes the running case fail and the lab
//! guard's `Drop` take the lab down; a second takes the lab down at once and exits.

use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use nix::sys::signal::{SigSet, Signal, kill};
use nix::unistd::Pid;
use tbrdma_benches::LabGuard;
use tbrdma_netdev::hostfile::Hostfile;
use tbrdma_netdev::lab::{self, LabOptions, LabTopology};
use tbrdma_verbs::EngineKind;

use crate::child::{ChildArgs, FLOOR_PORT_OFFSET};
use crate::report::{self, Counters, Outcome, Record, Run};
use crate::{Bench, Case, Options};

/// CPU of the server (rank 0) and of the client (rank 1).
pub const SERVER_CPU: usize = 1;
/// See [`SERVER_CPU`].
pub const CLIENT_CPU: usize = 0;
/// First TCP/UDP port of the servers; see [`port`].
const BASE_PORT: u16 = 18_515;
/// Longest a server may take to exit once its client is done.
const SERVER_EXIT: Duration = Duration::from_secs(10);

/// Children alive, for the signal watcher.
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

fn kill_children() {
    let pids = CHILDREN.lock().map(|c| c.clone()).unwrap_or_default();
    for pid in pids {
        let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
    }
}

fn watch_signals(lab_name: String) -> anyhow::Result<()> {
    let mut set = SigSet::empty();
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        set.add(signal);
    }
    // Blocked before any other thread exists, so every thread inherits the mask and only the
    // watcher receives them (children get a clean mask from `Command`).
    set.thread_block().context("blocking signals")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            while let Ok(signal) = set.wait() {
                kill_children();
                if INTERRUPTED.swap(true, Ordering::SeqCst) {
                    let _ = lab::down(&lab_name);
                    eprintln!("linkbench: {signal:?} again: lab {lab_name} taken down");
                    std::process::exit(130);
                }
                eprintln!("linkbench: {signal:?}: stopping");
            }
        })
        .context("starting the signal watcher")?;
    Ok(())
}

/// The message sizes of the latency cases. The floors move the same bytes: 64 KiB, more than
/// a UDP datagram or an Ethernet frame of the 65 520-byte MTU carries, goes as two datagrams
/// in the floors as it does in tbrdma.
pub const LATENCY_SIZES: [usize; 4] = [8, 4096, 16_384, 65_536];
/// The engines measured, each against its own floor.
pub const ENGINES: [EngineKind; 3] = [EngineKind::Uring, EngineKind::Sockets, EngineKind::Packet];

/// The cases in run order: per message size, every system back to back, the floors first. An
/// engine case runs its floor in lockstep itself ([`crate::pairing`]); the floors' own cases
/// give the table their figures.
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for size in LATENCY_SIZES {
        for bench in [Bench::TcpBlocking, Bench::UdpFloor, Bench::FrameFloor] {
            cases.push(Case { bench, size });
        }
        for engine in ENGINES {
            for bench in [Bench::Send(engine), Bench::Write(engine)] {
                cases.push(Case { bench, size });
            }
        }
    }
    cases.push(Case {
        bench: Bench::TcpStream,
        size: 1 << 20,
    });
    for engine in ENGINES {
        cases.push(Case {
            bench: Bench::WriteBandwidth(engine),
            size: 1 << 20,
        });
    }
    cases
}

/// The server port of case `index` (in [`cases`]) in round `round` (from 1):
/// `BASE_PORT + (round - 1) * cases().len() + index`, unique per case run, so that no case meets
/// an earlier one's sockets in TIME_WAIT; its paired floor's port, [`FLOOR_PORT_OFFSET`] above,
/// must exist too.
fn port(round: usize, index: usize) -> anyhow::Result<u16> {
    (round - 1)
        .checked_mul(cases().len())
        .and_then(|n| n.checked_add(index))
        .and_then(|n| u16::try_from(n).ok())
        .and_then(|n| BASE_PORT.checked_add(n))
        .filter(|p| p.checked_add(FLOOR_PORT_OFFSET).is_some())
        .ok_or_else(|| anyhow!("--rounds {round} is too many: the server ports run past 65535"))
}

/// The 1-, 5- and 15-minute load averages.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn address(hostfile: &Hostfile, rank: usize, peer: usize) -> anyhow::Result<IpAddr> {
    hostfile
        .ranks
        .get(rank)
        .and_then(|r| r.links.iter().find(|l| l.peer == peer && l.rail == 0))
        .map(|l| IpAddr::V4(l.address))
        .ok_or_else(|| anyhow!("the lab hostfile has no cable from rank {rank} to {peer}"))
}

fn spawn(exe: &Path, args: &ChildArgs) -> anyhow::Result<Child> {
    let child = Command::new(exe)
        .args(args.to_args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    if let Ok(mut c) = CHILDREN.lock() {
        c.push(child.id());
    }
    Ok(child)
}

fn forget(child: &Child) {
    if let Ok(mut c) = CHILDREN.lock() {
        c.retain(|&pid| pid != child.id());
    }
}

fn stderr_of(child: &mut Child) -> String {
    let mut text = String::new();
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut text);
    }
    text.trim().to_string()
}

/// Waits for the server to exit, killing it after [`SERVER_EXIT`].
fn finish_server(server: &mut Child) -> anyhow::Result<bool> {
    let until = Instant::now() + SERVER_EXIT;
    let status = loop {
        if let Some(status) = server.try_wait()? {
            break Some(status);
        }
        if Instant::now() > until {
            let _ = server.kill();
            let _ = server.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    forget(server);
    Ok(status.is_some_and(|s| s.success()))
}

struct Lab {
    name: String,
    server_ip: IpAddr,
    client_ip: IpAddr,
}

fn run_case(
    exe: &Path,
    lab: &Lab,
    case: Case,
    round: usize,
    port: u16,
    options: &Options,
) -> anyhow::Result<Record> {
    let server_args = ChildArgs {
        netns: lab::namespace_name(&lab.name, 0),
        server: true,
        case,
        ip: lab.server_ip,
        server_addr: SocketAddr::new(lab.server_ip, port),
        cpu: SERVER_CPU,
        warmup: options.warmup,
        iters: options.iters,
        duration: options.duration,
        block: options.block,
    };
    let client_args = ChildArgs {
        netns: lab::namespace_name(&lab.name, 1),
        server: false,
        ip: lab.client_ip,
        cpu: CLIENT_CPU,
        ..server_args.clone()
    };
    let mut server = spawn(exe, &server_args)?;
    let mut lines = BufReader::new(server.stdout.take().context("server stdout")?);
    let mut line = String::new();
    loop {
        line.clear();
        if lines.read_line(&mut line)? == 0 {
            let _ = server.wait();
            forget(&server);
            bail!("the server did not start: {}", stderr_of(&mut server));
        }
        if line.trim() == "ready" {
            break;
        }
    }
    let client = spawn(exe, &client_args)?;
    let client_pid = client.id();
    let output = client
        .wait_with_output()
        .context("waiting for the client")?;
    if let Ok(mut c) = CHILDREN.lock() {
        c.retain(|&pid| pid != client_pid);
    }
    let server_ok = finish_server(&mut server)?;
    let server_err = stderr_of(&mut server);
    let client_err = String::from_utf8_lossy(&output.stderr).trim().to_string();
    ensure!(
        !INTERRUPTED.load(Ordering::SeqCst),
        "interrupted during {}",
        case.bench
    );
    ensure!(
        output.status.success(),
        "{} {} B: client failed: {client_err}\nserver: {server_err}",
        case.bench,
        case.size
    );
    ensure!(
        server_ok,
        "{} {} B: server failed: {server_err}",
        case.bench,
        case.size
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .ok_or_else(|| anyhow!("{} {} B: no result in {stdout:?}", case.bench, case.size))?;
    Ok(Record {
        case,
        round,
        outcome: Outcome::parse(result)?,
        counters: stdout
            .lines()
            .find_map(|l| l.strip_prefix("STATS "))
            .map(Counters::parse),
        paired: stdout
            .lines()
            .find_map(|l| l.strip_prefix("PAIRED "))
            .map(report::parse_paired)
            .transpose()?,
        error: None,
    })
}

/// Runs everything; see the crate docs.
pub fn parent(options: &Options) -> anyhow::Result<()> {
    ensure!(
        nix::unistd::Uid::effective().is_root(),
        "linkbench creates network namespaces: run it as root"
    );
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let highest = [SERVER_CPU, CLIENT_CPU]
        .into_iter()
        .max()
        .unwrap_or_default();
    ensure!(
        cpus > highest,
        "linkbench pins to CPUs {CLIENT_CPU} and {SERVER_CPU}; this machine has {cpus}"
    );
    let selected: Vec<(usize, Case)> = cases()
        .into_iter()
        .enumerate()
        .filter(|(_, case)| {
            let name = case.bench.name();
            options.only.is_empty() || options.only.iter().any(|o| name.contains(o.as_str()))
        })
        .collect();
    // Fail on too many rounds before the lab exists, not in the middle of the run.
    port(options.rounds, cases().len() - 1)?;
    let name = format!("lb{}", std::process::id() % 100_000);
    watch_signals(name.clone())?;
    let load_before = load_average();
    let started = Instant::now();
    eprintln!("creating lab {name}: two namespaces, one veth pair, MTU 65520");
    let guard = LabGuard {
        name: name.clone(),
        tool: "linkbench",
    };
    let path = lab::up(&LabOptions {
        name: name.clone(),
        ranks: 2,
        topology: LabTopology::Pair,
        rails: 1,
        mtu: 65_520,
        force: true,
    })
    .with_context(|| format!("lab up {name}"))?;
    let hostfile = Hostfile::load(&path).context("reading the lab hostfile")?;
    let lab = Lab {
        name: guard.name.clone(),
        server_ip: address(&hostfile, 0, 1)?,
        client_ip: address(&hostfile, 1, 0)?,
    };
    eprintln!(
        "cores: server in rank 0 ({}) pinned to CPU {SERVER_CPU}, client in rank 1 ({}) pinned \
         to CPU {CLIENT_CPU}; one thread each, tbrdma in caller progress mode (no engine thread)",
        lab.server_ip, lab.client_ip
    );
    let exe = std::env::current_exe().context("finding this executable")?;
    let mut records = Vec::new();
    for round in 1..=options.rounds {
        if options.rounds > 1 {
            eprintln!("round {round} of {}", options.rounds);
        }
        for &(i, case) in &selected {
            ensure!(!INTERRUPTED.load(Ordering::SeqCst), "interrupted");
            eprint!("  {:<18} {:>7} B ... ", case.bench.name(), case.size);
            // A failed case is a result too (the table says why); only an interruption stops.
            let record = match run_case(&exe, &lab, case, round, port(round, i)?, options) {
                Ok(record) => record,
                Err(e) if !INTERRUPTED.load(Ordering::SeqCst) => Record {
                    case,
                    round,
                    outcome: Outcome::Failed,
                    counters: None,
                    paired: None,
                    error: Some(format!("{e:#}")),
                },
                Err(e) => return Err(e),
            };
            eprintln!(
                "{}{}",
                record.outcome.short(),
                record
                    .error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            );
            records.push(record);
        }
    }
    let run = Run {
        lab: lab.name.clone(),
        server_ip: lab.server_ip,
        client_ip: lab.client_ip,
        load_before,
        load_after: load_average(),
        elapsed: started.elapsed(),
        options: options.clone(),
        records,
    };
    drop(guard);
    if options.json {
        println!("{}", report::json(&run));
    } else {
        print!("{}", report::table(&run));
    }
    Ok(())
}
