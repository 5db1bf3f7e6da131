//! `tbrdma report`: the standard sweep between two hosts, written as `report.json` (machine,
//! kernel, links, settings, every figure), SVG plots and one self-contained HTML page to share.
//!
//! Layout: `plan` (which runs, in order: the same list on both ends), this file (the control
//! channel that keeps the two ends in step, and running each step as a `tbrdma` child with
//! `--json`, so every figure comes from the tool a user would rerun by hand), `machine` (what
//! the report says about each host), `plot` (SVG charts) and `page` (the HTML).
//!
//! Control channel: one TCP connection, JSON lines of at most [`MAX_LINE`] bytes. The client
//! sends its [`plan::Plan`]; the server checks it and then, for each step number in order,
//! starts its side, says ready, waits for the client's side to finish, and answers with what
//! its side printed. The server never runs anything but its own plan's steps.

mod machine;
mod page;
mod plan;
mod plot;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Args;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use plan::{Plan, Shape, Step};

/// Longest control-channel line accepted (a step's output is a few hundred short lines).
const MAX_LINE: u64 = 4 << 20;
/// Lines of a step's output kept, and bytes per line.
const MAX_OUTPUT_LINES: usize = 2000;
const MAX_OUTPUT_LINE: usize = 4096;
/// How long one end waits for the other between messages (a full sweep's longest step is
/// well under this).
const STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// After its peer's side finished, how long a side's child may take to finish too.
const GRACE: Duration = Duration::from_secs(15);

/// `tbrdma report`.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  tbrdma report                         # on host A: serve one report
  tbrdma report 10.0.0.1 --quick        # on host B: a short sweep, written to ./report/
  tbrdma report 10.0.0.1 --out /tmp/r   # the full sweep

The collective runs (all-reduce by size, its kernel floors, the tensor-parallel estimate) need
the hostfile on both hosts (--hostfile, or TBRDMA_HOSTFILE and TBRDMA_RANK as `tbrdma lab exec`
sets them); without one the report says they were left out.")]
pub struct ReportArgs {
    /// The host serving the other end (`tbrdma report` there). Without it, serve one report.
    pub peer: Option<String>,
    /// A short sweep (a few sizes, few iterations): for tests and a first look.
    #[arg(long)]
    pub quick: bool,
    /// Folder to write report.json, the SVG plots and report.html into (client).
    #[arg(long, default_value = "report")]
    pub out: PathBuf,
    /// TCP port of the report's control channel.
    #[arg(long, default_value_t = 18_517)]
    pub port: u16,
    /// Side-channel port of the pingpong and bw runs.
    #[arg(long, default_value_t = crate::perf::options::DEFAULT_PORT)]
    pub data_port: u16,
    /// First port of the collective runs' connection manager.
    #[arg(long, default_value_t = 18_600)]
    pub coll_port: u16,
    /// Local address of the link to use.
    #[arg(long, value_name = "IP")]
    pub bind: Option<String>,
    /// The cluster's hostfile, for the collective runs (default: $TBRDMA_HOSTFILE).
    #[arg(long, value_name = "PATH", env = "TBRDMA_HOSTFILE")]
    pub hostfile: Option<PathBuf>,
    /// This host's rank in it (default: $TBRDMA_RANK).
    #[arg(long, env = "TBRDMA_RANK")]
    pub rank: Option<usize>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
enum Msg {
    Hello { plan: Plan },
    Accept { machine: Value },
    Refuse { why: String },
    Start { step: usize },
    Ready { step: usize },
    Finished { step: usize },
    Done { step: usize, output: Output },
}

/// What one side of a step printed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Output {
    ok: bool,
    /// Its JSON result lines.
    rows: Vec<Value>,
    /// The last line of its stderr when it failed.
    error: Option<String>,
}

struct Channel {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Channel {
    fn new(stream: TcpStream) -> anyhow::Result<Channel> {
        stream.set_read_timeout(Some(STEP_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(Channel {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    fn send(&mut self, msg: &Msg) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(msg)?;
        line.push(b'\n');
        self.writer
            .write_all(&line)
            .context("the report's peer went away")
    }

    fn recv(&mut self) -> anyhow::Result<Msg> {
        let mut line = Vec::new();
        (&mut self.reader)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .context("reading from the report's peer")?;
        if line.is_empty() {
            bail!("the report's peer closed the connection");
        }
        if !line.ends_with(b"\n") {
            bail!("the report's peer sent a line longer than {MAX_LINE} bytes");
        }
        serde_json::from_slice(&line)
            .map_err(|e| anyhow!("the report's peer sent an unreadable message: {e}"))
    }
}

/// Runs `tbrdma report`.
pub fn run(args: ReportArgs) -> anyhow::Result<()> {
    match args.peer.clone() {
        Some(peer) => client(&args, &peer),
        None => server(&args),
    }
}

fn exe() -> PathBuf {
    std::env::current_exe().unwrap_or_else(|_| "tbrdma".into())
}

/// The child command of `step` for this side.
fn command(step: &Step, args: &ReportArgs, peer: Option<&str>) -> Command {
    let mut cmd = Command::new(exe());
    cmd.args(&step.args).arg("--json");
    match step.shape {
        Shape::ClientServer => {
            cmd.args(peer);
            cmd.args(["--port", &args.data_port.to_string(), "--timeout", "30"]);
            if let Some(bind) = &args.bind {
                cmd.args(["--bind", bind]);
            }
        }
        Shape::Ranks => {
            cmd.args(["--port", &args.coll_port.to_string()]);
            if let Some(h) = &args.hostfile {
                cmd.arg("--hostfile").arg(h);
            }
            if let Some(r) = args.rank {
                cmd.args(["--rank", &r.to_string()]);
            }
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// The printable form of a step's command, for report.json.
fn shown(step: &Step) -> String {
    format!("tbrdma {} --json", step.args.join(" "))
}

/// A running side of a step, its output collected by threads.
/// A running side of a step; dropped unfinished (the peer went away), its child is killed.
struct Running {
    child: Child,
    stdout: Option<std::thread::JoinHandle<Vec<String>>>,
    stderr: Option<std::thread::JoinHandle<Vec<String>>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn bounded_lines(
    pipe: impl Read + Send + 'static,
    ready: Option<std::sync::mpsc::Sender<()>>,
) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if let Some(tx) = &ready
                && line.starts_with("waiting for a client")
            {
                let _ = tx.send(());
            }
            if lines.len() < MAX_OUTPUT_LINES {
                lines.push(line.chars().take(MAX_OUTPUT_LINE).collect());
            }
        }
        lines
    })
}

impl Running {
    /// Starts `cmd`; for a server side, returns once it listens.
    fn start(mut cmd: Command, serves: bool) -> anyhow::Result<Running> {
        let mut child = cmd.spawn().context("starting a tbrdma run")?;
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = bounded_lines(child.stdout.take().expect("piped"), None);
        let stderr = bounded_lines(child.stderr.take().expect("piped"), serves.then_some(tx));
        if serves && rx.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = child.kill();
        }
        Ok(Running {
            child,
            stdout: Some(stdout),
            stderr: Some(stderr),
        })
    }

    /// Waits up to `limit` for the child (then kills it) and collects its output.
    fn finish(mut self, limit: Duration) -> Output {
        let deadline = Instant::now() + limit;
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
            }
        };
        let join = |h: Option<std::thread::JoinHandle<Vec<String>>>| {
            h.and_then(|h| h.join().ok()).unwrap_or_default()
        };
        let stdout = join(self.stdout.take());
        let stderr = join(self.stderr.take());
        let ok = status.is_some_and(|s| s.success());
        Output {
            ok,
            rows: stdout
                .iter()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(Value::is_object)
                .collect(),
            error: (!ok).then(|| match status {
                None => "stopped: it did not finish in time".to_owned(),
                // The error line, not a backtrace's last frame (RUST_BACKTRACE may be set).
                Some(_) => stderr
                    .iter()
                    .rev()
                    .find(|l| l.contains("rror"))
                    .or_else(|| stderr.iter().rev().find(|l| !l.trim().is_empty()))
                    .cloned()
                    .unwrap_or_else(|| "failed".into()),
            }),
        }
    }
}

fn have_hostfile(args: &ReportArgs) -> bool {
    args.hostfile.as_deref().is_some_and(Path::exists)
}

fn server(args: &ReportArgs) -> anyhow::Result<()> {
    let bind = args.bind.as_deref().unwrap_or("0.0.0.0");
    let listener = TcpListener::bind((bind, args.port))
        .with_context(|| format!("listening on {bind}:{}", args.port))?;
    eprintln!("waiting for `tbrdma report` on {}", listener.local_addr()?);
    let (stream, from) = listener.accept()?;
    let mut ch = Channel::new(stream)?;
    let Msg::Hello { plan } = ch.recv()? else {
        bail!("{from} did not start with its plan")
    };
    let ours = env!("CARGO_PKG_VERSION");
    let refuse = if plan.version != ours {
        Some(format!(
            "version {} here, {} there: install the same tbrdma on both hosts",
            ours, plan.version
        ))
    } else if plan.collectives && !have_hostfile(args) {
        Some("no hostfile on the serving host: pass --hostfile (or set TBRDMA_HOSTFILE and TBRDMA_RANK)".to_owned())
    } else {
        None
    };
    if let Some(why) = refuse {
        ch.send(&Msg::Refuse { why: why.clone() })?;
        bail!("refused the report from {from}: {why}");
    }
    ch.send(&Msg::Accept {
        machine: machine::describe(),
    })?;
    eprintln!("serving a report to {from}");
    for (i, step) in plan.steps().iter().enumerate() {
        match ch.recv()? {
            Msg::Start { step: s } if s == i => {}
            other => bail!("expected the start of step {i}, got {other:?}"),
        }
        let running = Running::start(command(step, args, None), step.shape == Shape::ClientServer)?;
        ch.send(&Msg::Ready { step: i })?;
        match ch.recv()? {
            Msg::Finished { step: s } if s == i => {}
            other => bail!("expected the end of step {i}, got {other:?}"),
        }
        let output = running.finish(GRACE);
        ch.send(&Msg::Done { step: i, output })?;
    }
    eprintln!("served one report");
    Ok(())
}

fn connect(peer: &str, port: u16) -> anyhow::Result<TcpStream> {
    let addr: SocketAddr = (peer, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {peer}"))?
        .next()
        .ok_or_else(|| anyhow!("{peer} has no address"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                bail!(
                    "no `tbrdma report` serving at {addr}: {e} (start `tbrdma report` there first)"
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Whether the hostfile gives this host more than one cable to any neighbour.
fn rails(args: &ReportArgs) -> bool {
    let (Some(path), Some(rank)) = (&args.hostfile, args.rank) else {
        return false;
    };
    let Ok(hf) = tbrdma_netdev::hostfile::Hostfile::load(path) else {
        return false;
    };
    hf.ranks
        .get(rank)
        .is_some_and(|r| r.links.iter().any(|l| l.rail > 0))
}

/// One step's result in report.json.
#[derive(Debug, Serialize)]
pub struct StepResult {
    name: String,
    command: String,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    rows: Vec<Value>,
}

fn client(args: &ReportArgs, peer: &str) -> anyhow::Result<()> {
    let collectives = have_hostfile(args) && args.rank.is_some();
    let plan = Plan {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        quick: args.quick,
        rails: rails(args),
        collectives,
    };
    let mut ch = Channel::new(connect(peer, args.port)?)?;
    ch.send(&Msg::Hello { plan: plan.clone() })?;
    let server_machine = match ch.recv()? {
        Msg::Accept { machine } => machine,
        Msg::Refuse { why } => bail!("the peer refused: {why}"),
        other => bail!("unexpected answer {other:?}"),
    };
    let steps = plan.steps();
    let mut results = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        eprintln!("[{}/{}] {}", i + 1, steps.len(), shown(step));
        ch.send(&Msg::Start { step: i })?;
        match ch.recv()? {
            Msg::Ready { step: s } if s == i => {}
            other => bail!("expected the peer ready for step {i}, got {other:?}"),
        }
        let ours = Running::start(command(step, args, Some(peer)), false)?.finish(STEP_TIMEOUT);
        ch.send(&Msg::Finished { step: i })?;
        let theirs = match ch.recv()? {
            Msg::Done { step: s, output } if s == i => output,
            other => bail!("expected the peer's output of step {i}, got {other:?}"),
        };
        // Collective runs print on rank 0, which may be either end.
        let rows = if ours.rows.is_empty() {
            theirs.rows.clone()
        } else {
            ours.rows.clone()
        };
        let ok = ours.ok && theirs.ok && !rows.is_empty();
        let error = ours
            .error
            .map(|e| format!("here: {e}"))
            .or(theirs.error.map(|e| format!("on the peer: {e}")))
            .or((!ok).then(|| "no result lines".to_owned()));
        if let Some(e) = &error {
            eprintln!("  failed: {e}");
        }
        results.push(StepResult {
            name: step.name.clone(),
            command: shown(step),
            ok,
            error,
            rows,
        });
    }
    let report = serde_json::json!({
        "tool": "tbrdma report",
        "version": env!("CARGO_PKG_VERSION"),
        "quick": args.quick,
        "created_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "peer": peer,
        "collectives": if collectives { Value::Null } else {
            Value::String("left out: no hostfile (run `tbrdma hostfile` on both hosts, or pass --hostfile and --rank)".into())
        },
        "client": machine::describe(),
        "server": server_machine,
        "steps": results,
    });
    write_outputs(&args.out, &report)
}

/// Writes report.json, the SVG plots and report.html into `out`.
fn write_outputs(out: &Path, report: &Value) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(
        out.join("report.json"),
        serde_json::to_string_pretty(report)?,
    )?;
    let charts = plot::charts(report)?;
    for chart in &charts {
        std::fs::write(out.join(format!("{}.svg", chart.id)), &chart.svg)?;
    }
    std::fs::write(out.join("report.html"), page::html(report, &charts))?;
    let failed: Vec<&str> = report["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["ok"] != true)
        .filter_map(|s| s["name"].as_str())
        .collect();
    println!(
        "wrote {}/report.json, report.html and {} plots{}",
        out.display(),
        charts.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!("; failed steps: {}", failed.join(", "))
        }
    );
    Ok(())
}
