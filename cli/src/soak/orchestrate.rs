//! The lab run of `tbrdma soak` (root): two network namespaces joined by two veth cables, both
//! roles as separate `tbrdma` processes in them (started with `tbrdma lab exec`, as a user runs
//! them on two hosts), both with the faulty cable of `--faults`, for each engine in turn.
//! Meanwhile it pulls rail 2 on the client's side for a few seconds (link down, then up), and
//! kills the server with SIGKILL half-way and restarts it: the client must see error
//! completions within the documented bound (docs/semantics.md, "Failure"), reconnect and
//! carry on. Then it judges each engine: no wrong byte, memory flat on both sides, errors after
//! the kill within the bound, a reconnect, faults really injected.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tbrdma_netdev::lab;

use super::SoakArgs;
use super::report::{Tally, unix_ms};
use super::role;
use crate::perf::options::EngineArg;

/// Scheduling allowance on top of the documented failure bound: the client notices the error
/// completion when its poll loop next runs, on a host whose two cores the two soak processes
/// (and whatever else runs) share.
const BOUND_SLACK_MS: u64 = 1000;

/// Time the client keeps running after its first error past the kill: the restarted server
/// starting in the lab, the client's failed session draining, its reconnect and a few
/// operations, on a loaded 2-core host.
const RECONNECT_ALLOWANCE: Duration = Duration::from_secs(3);

/// An `ip link set` under way.
struct RailChange {
    child: Reaper,
    what: String,
}

impl RailChange {
    /// Whether it has ended; an error when it failed.
    fn finished(&mut self) -> anyhow::Result<bool> {
        match self.child.child().try_wait()? {
            None => Ok(false),
            Some(status) => self.check(status).map(|()| true),
        }
    }

    /// Waits for it to end; an error when it failed.
    fn wait(&mut self) -> anyhow::Result<()> {
        let status = self.child.child().wait()?;
        self.check(status)
    }

    fn check(&mut self, status: std::process::ExitStatus) -> anyhow::Result<()> {
        self.child.0 = None;
        if !status.success() {
            bail!("{} failed ({status})", self.what);
        }
        Ok(())
    }
}

/// Kills a process that is still running when the run ends early.
struct Reaper(Option<Child>);

impl Reaper {
    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("a running child")
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn engine_name(e: EngineArg) -> &'static str {
    match e {
        EngineArg::Sockets => "sockets",
        EngineArg::Uring => "uring",
        EngineArg::Packet => "packet",
    }
}

/// What the run of one engine gave.
struct EngineResult {
    engine: &'static str,
    client: Option<Tally>,
    server: Option<Tally>,
    kill_to_error_ms: Option<u64>,
    bound_ms: u64,
    killed: bool,
    pulled: bool,
    problems: Vec<String>,
}

/// Runs the lab soak; the exit status is non-zero when any engine has a problem.
pub fn run(args: &SoakArgs) -> anyhow::Result<ExitCode> {
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "the lab run needs root (it builds two network namespaces); without root, run the two roles yourself: `tbrdma soak --serve --bind IP` on one host, `tbrdma soak IP --bind IP2` on the other"
        );
    }
    // Ctrl-C (which the roles in the lab also receive) ends the run early, the lab removed.
    crate::perf::session::install_ctrl_c();
    crate::perf::session::start_measuring();
    let plan = tbrdma_verbs::faults::FaultPlan::parse(&args.faults)
        .map_err(|e| anyhow::anyhow!("--faults: {e}"))?;
    let faulty = plan.drop + plan.duplicate + plan.corrupt + plan.reorder > 0.0;
    let name = args
        .lab_name
        .clone()
        .unwrap_or_else(|| format!("soak{}", std::process::id() % 10_000));
    let (_guard, hostfile) = crate::lab_pair::up(&name)?;
    let addrs = |rank: usize| -> Vec<String> {
        (0..2)
            .map(|rail| {
                hostfile.ranks[rank]
                    .links
                    .iter()
                    .find(|l| l.rail == rail)
                    .map(|l| l.address.to_string())
                    .unwrap_or_default()
            })
            .collect()
    };
    let (server_addrs, client_addrs) = (addrs(0), addrs(1));
    let logs = std::env::temp_dir().join(format!("tbrdma-soak-{name}"));
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let secs = args.duration_secs();
    let seed = args.seed.unwrap_or_else(|| unix_ms() % 1_000_000);
    println!(
        "tbrdma soak: lab {name} (2 rails: server {}, client {}), {secs} s per engine, {} QPs, seed {seed}",
        server_addrs.join(","),
        client_addrs.join(","),
        args.qps
    );
    println!("   faults in both processes: {}", args.faults);
    println!("   logs: {}", logs.display());
    let mut results = Vec::new();
    for &engine in &args.engines {
        let plan = Plan {
            lab: &name,
            engine,
            secs,
            seed,
            server_addrs: &server_addrs,
            client_addrs: &client_addrs,
            logs: &logs,
            args,
            faulty,
        };
        let result = plan.run()?;
        print_result(&result);
        results.push(result);
    }
    let failed: Vec<&str> = results
        .iter()
        .filter(|r| !r.problems.is_empty())
        .map(|r| r.engine)
        .collect();
    let json: Vec<serde_json::Value> = results.iter().map(result_json).collect();
    println!("{}", serde_json::json!({ "soak": json }));
    if failed.is_empty() {
        println!("soak passed on every engine");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("soak FAILED on: {}", failed.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

struct Plan<'a> {
    lab: &'a str,
    engine: EngineArg,
    secs: f64,
    seed: u64,
    server_addrs: &'a [String],
    client_addrs: &'a [String],
    logs: &'a Path,
    args: &'a SoakArgs,
    /// Whether the fault plan asks for any loss, duplicate, corruption or reordering.
    faulty: bool,
}

impl Plan<'_> {
    fn command(
        &self,
        rank: usize,
        role_args: &[String],
        fault_seed: u64,
    ) -> anyhow::Result<Command> {
        let exe = std::env::current_exe().context("finding the tbrdma binary")?;
        let mut cmd = Command::new(&exe);
        cmd.args(["lab", "exec", &rank.to_string(), "--name", self.lab, "--"])
            .arg(&exe)
            .args(role_args)
            .env(
                tbrdma_verbs::faults::FAULTS_ENV,
                format!("seed={fault_seed},{}", self.args.faults),
            );
        Ok(cmd)
    }

    fn spawn(&self, mut cmd: Command, log: &str) -> anyhow::Result<Child> {
        let out = File::create(self.logs.join(format!("{log}.out")))?;
        let err = File::create(self.logs.join(format!("{log}.err")))?;
        cmd.stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .context("starting a tbrdma process in the lab")
    }

    fn common(&self) -> Vec<String> {
        let progress = match self.args.progress {
            crate::perf::options::ProgressArg::Caller => "caller",
            crate::perf::options::ProgressArg::Thread => "thread",
        };
        vec![
            "--engine".into(),
            engine_name(self.engine).into(),
            "--progress".into(),
            progress.into(),
            "--port".into(),
            self.args.port.to_string(),
            "--timeout".into(),
            self.args.timeout.to_string(),
        ]
    }

    fn server(&self, incarnation: u64) -> anyhow::Result<Child> {
        let mut a = vec![
            "soak".into(),
            "--serve".into(),
            "--bind".into(),
            self.server_addrs.join(","),
        ];
        a.extend(self.common());
        let cmd = self.command(0, &a, self.seed * 10 + incarnation)?;
        self.spawn(
            cmd,
            &format!("{}-server{incarnation}", engine_name(self.engine)),
        )
    }

    fn client(&self, secs: f64) -> anyhow::Result<Child> {
        let mut a = vec![
            "soak".into(),
            self.server_addrs[0].clone(),
            "--bind".into(),
            self.client_addrs.join(","),
            "--seconds".into(),
            secs.to_string(),
            "--qps".into(),
            self.args.qps.to_string(),
            "--seed".into(),
            self.seed.to_string(),
        ];
        a.extend(self.common());
        let cmd = self.command(1, &a, self.seed * 10 + 9)?;
        self.spawn(cmd, &format!("{}-client", engine_name(self.engine)))
    }

    /// Starts taking rail 2 of the client's side down or up. It runs beside the run's loop:
    /// taking a veth down waits for the kernel, up to 7 s on a loaded 2-core host, and the
    /// server's kill must not wait for it.
    fn rail(&self, up: bool) -> anyhow::Result<RailChange> {
        let ns = lab::namespace_name(self.lab, 1);
        let dev = lab::state::interface_name(0, 1);
        let state = if up { "up" } else { "down" };
        let child = Command::new("ip")
            .args(["-n", &ns, "link", "set", "dev", &dev, state])
            .stdin(Stdio::null())
            .spawn()
            .context("running `ip` (iproute2) to pull a cable")?;
        Ok(RailChange {
            child: Reaper(Some(child)),
            what: format!("`ip -n {ns} link set dev {dev} {state}`"),
        })
    }

    fn run(&self) -> anyhow::Result<EngineResult> {
        let engine = engine_name(self.engine);
        let pull_at = self.secs * 0.2;
        let pull_for = (self.secs * 0.1).clamp(1.0, 5.0);
        let kill_at = self.secs * 0.5;
        // After the kill the client must have the time to see its error within the bound and
        // to reconnect, or a short run could end before either and judge nothing: a short
        // run's client goes on past `secs` for that.
        let after_kill =
            role::failure_bound() + Duration::from_millis(BOUND_SLACK_MS) + RECONNECT_ALLOWANCE;
        let client_secs = if self.args.no_kill {
            self.secs
        } else {
            self.secs.max(kill_at + after_kill.as_secs_f64())
        };
        if client_secs > self.secs {
            println!(
                "\n== {engine}: {} s (the client runs {client_secs:.1} s: after the kill at {kill_at:.1} s it needs {:.1} s to show its error within the bound and reconnect)",
                self.secs,
                after_kill.as_secs_f64()
            );
        } else {
            println!("\n== {engine}: {} s", self.secs);
        }
        let mut server = Reaper(Some(self.server(1)?));
        // The client retries while the server starts listening.
        std::thread::sleep(Duration::from_millis(300));
        let mut client = Reaper(Some(self.client(client_secs)?));
        let t0 = Instant::now();
        let (mut pulled, mut restored, mut killed) = (false, false, false);
        let mut kill_ms = 0;
        let mut kill_t = 0.0;
        let mut pull_ms = 0;
        // The `ip` command under way, and when the pull's `ip link set down` returned: the
        // cable stays out `pull_for` from then.
        let mut rail_change: Option<RailChange> = None;
        let mut pulled_done: Option<f64> = None;
        let mut problems = Vec::new();
        let client_limit = Duration::from_secs_f64(client_secs + 90.0);
        let client_status = loop {
            if let Some(status) = client.child().try_wait()? {
                break Some(status);
            }
            let t = t0.elapsed().as_secs_f64();
            if let Some(change) = &mut rail_change
                && change.finished()?
            {
                rail_change = None;
                if restored {
                    println!("   {t:.1} s: rail 2 restored (`ip` returned)");
                } else {
                    pulled_done = Some(t);
                    println!("   {t:.1} s: rail 2 is down (`ip` returned)");
                }
            }
            if !pulled && !self.args.no_pull && t >= pull_at {
                pull_ms = unix_ms();
                rail_change = Some(self.rail(false)?);
                pulled = true;
                println!("   {t:.1} s: pulling rail 2 (client side, link down)");
            }
            if !restored && pulled_done.is_some_and(|done| t >= done + pull_for) {
                rail_change = Some(self.rail(true)?);
                restored = true;
                println!("   {t:.1} s: restoring rail 2");
            }
            if !killed && !self.args.no_kill && t >= kill_at {
                kill_ms = unix_ms();
                kill_t = t;
                let s = server.child();
                s.kill().context("killing the server")?;
                let _ = s.wait();
                killed = true;
                println!("   {t:.1} s: server killed (SIGKILL), restarting it");
                server = Reaper(Some(self.server(2)?));
            }
            if crate::perf::session::interrupted() {
                bail!("interrupted by Ctrl-C");
            }
            if t0.elapsed() > client_limit {
                problems.push(format!(
                    "the client did not end within {} s",
                    client_limit.as_secs()
                ));
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        // The cable goes back up whatever happened: after a pull still under way, if any.
        if let Some(mut change) = rail_change.take() {
            change.wait()?;
        }
        if pulled && !restored {
            self.rail(true)?.wait()?;
        }
        // A kill later than planned (this host did not run the orchestrator's loop) may leave
        // the client too little time to show what it must; said with the problems it explains.
        let kill_too_late = killed && kill_t - kill_at > 0.25;
        // The server ends once the client's last session ended cleanly.
        let until = Instant::now() + Duration::from_secs(20);
        let server_status = loop {
            if let Some(status) = server.child().try_wait()? {
                break Some(status);
            }
            if Instant::now() > until {
                problems.push("the restarted server did not end after the client".into());
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        drop(client);
        drop(server);
        let client = self.report(&format!("{engine}-client"));
        let server = self.report(&format!("{engine}-server{}", if killed { 2 } else { 1 }));
        for (who, status) in [("client", client_status), ("server", server_status)] {
            if let Some(s) = status
                && !s.success()
            {
                problems.push(format!("the {who} exited with {s}"));
            }
        }
        let mut kill_to_error_ms = None;
        let mut bound_ms = 0;
        for (who, tally) in [("client", &client), ("server", &server)] {
            let Some(t) = tally else {
                problems.push(format!("the {who} printed no report"));
                continue;
            };
            if t.bytes_wrong > 0 {
                problems.push(format!("the {who} found {} wrong bytes", t.bytes_wrong));
            }
            if !t.memory_flat {
                problems.push(format!("the {who}'s memory grew"));
            }
            if let Some(n) = t.errors.get("not_flushed_in_time") {
                problems.push(format!(
                    "the {who}'s failed sessions left requests or receives without a completion past the bound ({n} times; see its log)"
                ));
            }
            if t.operations == 0 {
                problems.push(format!("the {who} completed no operation"));
            }
            if self.faulty
                && t.faults.get("seen").copied().unwrap_or(0) > 0
                && t.faults
                    .iter()
                    .filter(|(k, _)| *k != "seen")
                    .all(|(_, v)| *v == 0)
            {
                problems.push(format!("no fault was injected in the {who}"));
            }
        }
        if let Some(c) = &client
            && pulled
        {
            let end = if killed { kill_ms } else { u64::MAX };
            for f in c
                .failures
                .iter()
                .filter(|f| (pull_ms..end).contains(&f.at_unix_ms))
            {
                problems.push(format!(
                    "a session failed ({}) {} ms after rail 2 was pulled: connections must carry on over the other rail",
                    f.first,
                    f.at_unix_ms - pull_ms
                ));
            }
        }
        if let Some(c) = &client
            && killed
        {
            bound_ms = c.retry_budget_ms.max(c.idle_timeout_ms);
            kill_to_error_ms = c
                .failures
                .iter()
                .find(|f| f.at_unix_ms >= kill_ms)
                .map(|f| f.at_unix_ms - kill_ms);
            match kill_to_error_ms {
                None => problems.push("the client saw no error after the kill".into()),
                Some(ms) if ms > bound_ms + BOUND_SLACK_MS => problems.push(format!(
                    "the client's first error came {ms} ms after the kill (bound {bound_ms} ms + {BOUND_SLACK_MS} ms)"
                )),
                Some(_) => {}
            }
            if c.error_count() == 0 {
                problems.push("the client counted no error".into());
            }
            if c.sessions < 2 {
                problems.push("the client never reconnected".into());
            }
            if kill_too_late && (kill_to_error_ms.is_none() || c.sessions < 2) {
                problems.push(format!(
                    "the server was killed at {kill_t:.1} s instead of {kill_at:.1} s, which left the client {:.1} s of its {client_secs:.1} s run where it needs {:.1} s",
                    client_secs - kill_t,
                    after_kill.as_secs_f64()
                ));
            }
        }
        Ok(EngineResult {
            engine,
            client,
            server,
            kill_to_error_ms,
            bound_ms,
            killed,
            pulled,
            problems,
        })
    }

    fn report(&self, log: &str) -> Option<Tally> {
        let path: PathBuf = self.logs.join(format!("{log}.out"));
        let text = std::fs::read_to_string(path).ok()?;
        text.lines()
            .rev()
            .find_map(|l| serde_json::from_str::<Tally>(l).ok())
    }
}

fn print_result(r: &EngineResult) {
    let mib = |k: u64| k as f64 / 1024.0;
    for (who, t) in [("client", &r.client), ("server (restarted)", &r.server)] {
        let Some(t) = t else { continue };
        let errors = if t.errors.is_empty() {
            "none".to_string()
        } else {
            t.errors
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "   {who}: {} operations, {} received, bytes verified {}, bytes wrong {}, errors: {errors}, sessions {}",
            t.operations, t.received, t.bytes_verified, t.bytes_wrong, t.sessions
        );
        println!(
            "      RSS {:.1} MiB at start, {:.1} after warm-up, {:.1} at end; VmLck {:.1} / {:.1} / {:.1} MiB; flat: {}",
            mib(t.memory_start.rss_kib),
            mib(t.memory_warm.rss_kib),
            mib(t.memory_end.rss_kib),
            mib(t.memory_start.lck_kib),
            mib(t.memory_warm.lck_kib),
            mib(t.memory_end.lck_kib),
            t.memory_flat
        );
        let f = |k: &str| t.faults.get(k).copied().unwrap_or(0);
        println!(
            "      faults injected: {} datagrams seen, {} dropped, {} duplicated, {} corrupted, {} reordered",
            f("seen"),
            f("dropped"),
            f("duplicated"),
            f("corrupted"),
            f("reordered")
        );
    }
    match r.kill_to_error_ms {
        Some(ms) => println!(
            "   server kill: client's first error {ms} ms later (bound {} ms + {BOUND_SLACK_MS} ms slack)",
            r.bound_ms
        ),
        None if r.killed => println!("   server kill: no error seen by the client"),
        None => {}
    }
    if r.problems.is_empty() {
        println!("   {}: PASS", r.engine);
    } else {
        println!("   {}: FAIL: {}", r.engine, r.problems.join("; "));
    }
}

fn result_json(r: &EngineResult) -> serde_json::Value {
    serde_json::json!({
        "engine": r.engine,
        "passed": r.problems.is_empty(),
        "problems": r.problems,
        "killed_and_restarted": r.killed,
        "rail_pulled": r.pulled,
        "kill_to_error_ms": r.kill_to_error_ms,
        "bound_ms": r.bound_ms,
        "client": r.client,
        "server": r.server,
    })
}
