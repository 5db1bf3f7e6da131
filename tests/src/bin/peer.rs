//! The test peer: one side of a multi-process test, run inside a lab namespace.
//!
//! `tbrdma-test-peer NETNS key=value…` with keys `role` (server|client), `scenario`
//! (ops|access|kill|memlock), `ip` (this side's link address), `server` (ip:port, client),
//! `port` (server), `engine` (uring|sockets|packet), `progress` (thread|caller), `violation`
//! (badkey|oob|noflag|revoked, access scenario). Prints what it checked on stdout; exits 0 only
//! when every check passed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use tbrdma_verbs::*;

const MIB: usize = 1 << 20;
const TARGET: usize = 17 * MIB;
const RECV_SLOT: usize = 2 * MIB;
const RECV_SLOTS: usize = 8;
const GOODBYE: u32 = 0xdead;

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

struct Args(HashMap<String, String>);

impl Args {
    fn get(&self, key: &str) -> anyhow::Result<&str> {
        self.0
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| anyhow!("missing {key}="))
    }
    fn or(&self, key: &str, default: &'static str) -> String {
        self.0
            .get(key)
            .cloned()
            .unwrap_or_else(|| default.to_string())
    }
}

fn device(args: &Args) -> anyhow::Result<Device> {
    let engine = EngineConfig {
        engine: args
            .or("engine", "uring")
            .parse()
            .map_err(|e: String| anyhow!(e))?,
        progress: args
            .or("progress", "caller")
            .parse()
            .map_err(|e: String| anyhow!(e))?,
        ..EngineConfig::default()
    };
    // `ip=a,b` opens two rails (cables to the same peer), in order.
    let ips: Vec<&str> = args.get("ip")?.split(',').collect();
    let dev = Device::open_rails(&ips, DeviceConfig { engine, port: 0 })?;
    println!(
        "engine {} ({:?} progress){}",
        dev.engine_kind().name(),
        dev.progress_mode(),
        dev.engine_fallback()
            .map(|f| format!(": {f}"))
            .unwrap_or_default()
    );
    Ok(dev)
}

/// Polls until `n` completions arrived or `timeout` passed.
fn wait(cq: &CompletionQueue, n: usize, timeout: Duration) -> anyhow::Result<Vec<WorkCompletion>> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [Completion::default(); 64];
    while got.len() < n {
        let k = cq.poll(&mut buf)?;
        got.extend(buf[..k].iter().map(|c| c.wc));
        if k == 0 {
            ensure!(
                start.elapsed() < timeout,
                "timed out after {timeout:?} waiting for {n} completions (got {got:?})"
            );
            std::thread::yield_now();
        }
    }
    Ok(got)
}

fn wait_ok(cq: &CompletionQueue, n: usize) -> anyhow::Result<Vec<WorkCompletion>> {
    let wcs = wait(cq, n, Duration::from_secs(60))?;
    for wc in &wcs {
        ensure!(
            wc.status == WcStatus::Success,
            "request {} failed: {:?}",
            wc.wr_id,
            wc.status
        );
    }
    Ok(wcs)
}

fn server(args: &Args) -> anyhow::Result<()> {
    let dev = device(args)?;
    let pd = dev.alloc_pd();
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let target = pd.alloc_mr(TARGET, all)?;
    let read_only = pd.alloc_mr(MIB, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    let initial = pattern(TARGET, 99);
    target.write(0, &initial);
    read_only.write(0, &initial[..MIB]);
    let recv = pd.alloc_mr(RECV_SLOT * RECV_SLOTS, Access::LOCAL_WRITE)?;
    let reply = pd.alloc_mr(64, Access::LOCAL_WRITE)?;
    let cq = dev.create_cq(4096);
    // Replies complete on their own queue, so waiting for one never swallows a receive.
    let send_cq = dev.create_cq(64);
    let listener = Listener::bind(&dev, args.get("port")?.parse()?)?;
    let mut private = Vec::new();
    for mr in [&target, &read_only] {
        private.extend_from_slice(&mr.addr().to_le_bytes());
        private.extend_from_slice(&mr.rkey().to_le_bytes());
    }
    println!("listening on {}", listener.local_addr()?);
    let opts = QpOptions {
        private_data: private,
        ..QpOptions::default()
    };
    let conn = listener.accept(&pd, &send_cq, &cq, &opts, Some(Duration::from_secs(30)))?;
    let qp = conn.qp;
    for slot in 0..RECV_SLOTS {
        qp.post_recv(&[RecvWr {
            wr_id: slot as u64,
            local: recv.sge(slot * RECV_SLOT, RECV_SLOT),
        }])?;
    }
    let mut buf = [Completion::default(); 64];
    let mut replies = 0u64;
    loop {
        let n = match cq.poll(&mut buf) {
            Ok(n) => n,
            Err(e) => bail!("polling: {e}"),
        };
        // Flushed receives mean the connection failed (the access scenario does it on purpose).
        let flushed = buf[..n].iter().any(|c| c.wc.status == WcStatus::Flushed);
        if flushed || (n == 0 && qp.state() != ConnectionState::Established) {
            // The client broke the connection (the access scenario does so on purpose).
            let mut now = vec![0u8; TARGET];
            target.read(0, &mut now);
            let mut ro = vec![0u8; MIB];
            read_only.read(0, &mut ro);
            println!("connection ended: {:?}", qp.take_events());
            println!(
                "target {}",
                if now == initial {
                    "untouched"
                } else {
                    "CHANGED"
                }
            );
            println!(
                "read-only region {}",
                if ro == initial[..MIB] {
                    "untouched"
                } else {
                    "CHANGED"
                }
            );
            return Ok(());
        }
        for c in &buf[..n] {
            let wc = c.wc;
            match (wc.opcode, wc.status) {
                (WcOpcode::Recv | WcOpcode::RecvRdmaWithImm, WcStatus::Success) => {
                    let len = wc.byte_len as usize;
                    let mut data = vec![0u8; len];
                    if wc.opcode == WcOpcode::Recv {
                        recv.read(wc.wr_id as usize * RECV_SLOT, &mut data);
                    } else {
                        target.read(0, &mut data);
                    }
                    let mut answer = fnv(&data).to_le_bytes().to_vec();
                    answer.extend_from_slice(&(len as u64).to_le_bytes());
                    reply.write(0, &answer);
                    replies += 1;
                    qp.post_send(&[SendWr {
                        wr_id: 1000 + replies,
                        local: reply.sge(0, 16),
                        op: SendOp::Send { imm: wc.imm },
                    }])?;
                    wait_ok(&send_cq, 1)?;
                    qp.post_recv(&[RecvWr {
                        wr_id: wc.wr_id,
                        local: recv.sge(wc.wr_id as usize * RECV_SLOT, RECV_SLOT),
                    }])?;
                    if wc.imm == Some(GOODBYE) {
                        println!("served {replies} messages");
                        // Give the client time to read our answer before the drop closes.
                        let until = Instant::now() + Duration::from_millis(200);
                        while Instant::now() < until {
                            let _ = cq.poll(&mut buf);
                        }
                        return Ok(());
                    }
                }
                (_, WcStatus::Success) => {}
                (_, status) => bail!("completion {} failed: {status:?}", wc.wr_id),
            }
        }
    }
}

struct Client {
    qp: QueuePair,
    cq: CompletionQueue,
    src: MemoryRegion,
    dst: MemoryRegion,
    replies: MemoryRegion,
    target: RemoteAddr,
    read_only: RemoteAddr,
    next_id: u64,
}

fn client_connect(
    args: &Args,
    config: Config,
) -> anyhow::Result<(Device, ProtectionDomain, Client)> {
    let dev = device(args)?;
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(4096);
    let server: SocketAddr = args.get("server")?.parse()?;
    let opts = QpOptions {
        config,
        ..QpOptions::default()
    };
    let start = Instant::now();
    let conn = loop {
        match connect(&pd, server, &cq, &cq, &opts) {
            Ok(c) => break c,
            Err(VerbsError::PeerNotListening { .. })
                if start.elapsed() < Duration::from_secs(20) =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).context("connecting"),
        }
    };
    let p = &conn.peer_private_data;
    ensure!(
        p.len() == 24,
        "server sent {} bytes of private data",
        p.len()
    );
    let remote = |i: usize| RemoteAddr {
        addr: u64::from_le_bytes(p[i * 12..i * 12 + 8].try_into().unwrap()),
        rkey: u32::from_le_bytes(p[i * 12 + 8..i * 12 + 12].try_into().unwrap()),
    };
    let client = Client {
        target: remote(0),
        read_only: remote(1),
        qp: conn.qp,
        cq,
        src: pd.alloc_mr(TARGET, Access::LOCAL_WRITE)?,
        dst: pd.alloc_mr(TARGET, Access::LOCAL_WRITE)?,
        replies: pd.alloc_mr(16 * 64, Access::LOCAL_WRITE)?,
        next_id: 1,
    };
    Ok((dev, pd, client))
}

impl Client {
    fn at(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.target.addr + offset as u64,
            rkey: self.target.rkey,
        }
    }

    fn post(&mut self, local: Sge, op: SendOp) -> anyhow::Result<u64> {
        let wr_id = self.next_id;
        self.next_id += 1;
        self.qp.post_send(&[SendWr { wr_id, local, op }])?;
        Ok(wr_id)
    }

    fn run(&mut self, local: Sge, op: SendOp) -> anyhow::Result<WorkCompletion> {
        self.post(local, op)?;
        let wc = wait_ok(&self.cq, 1)?.remove(0);
        Ok(wc)
    }

    /// Sends a request that makes the server answer with the hash of what it received.
    fn hashed(&mut self, op: SendOp, len: usize) -> anyhow::Result<(u64, u64)> {
        self.qp.post_recv(&[RecvWr {
            wr_id: 0,
            local: self.replies.sge(0, 16),
        }])?;
        self.post(self.src.sge(0, len), op)?;
        let wcs = wait_ok(&self.cq, 2)?;
        ensure!(
            wcs.iter()
                .any(|w| w.opcode == WcOpcode::Recv && w.byte_len == 16),
            "no answer among {wcs:?}"
        );
        let mut answer = [0u8; 16];
        self.replies.read(0, &mut answer);
        Ok((
            u64::from_le_bytes(answer[..8].try_into()?),
            u64::from_le_bytes(answer[8..].try_into()?),
        ))
    }
}

fn client_ops(args: &Args) -> anyhow::Result<()> {
    let (_dev, _pd, mut c) = client_connect(args, Config::default())?;
    let data = pattern(TARGET, 5);
    c.src.write(0, &data);
    for len in [1usize, 7, 4096, 65_419, 65_421, MIB + 3, 16 * MIB] {
        c.run(c.src.sge(0, len), SendOp::Write { remote: c.at(0) })?;
        c.run(c.dst.sge(0, len), SendOp::Read { remote: c.at(0) })?;
        let mut back = vec![0u8; len];
        c.dst.read(0, &mut back);
        ensure!(
            fnv(&back) == fnv(&data[..len]),
            "WRITE then READ of {len} bytes came back different"
        );
        println!("write+read {len} bytes: hash ok");
        if len <= RECV_SLOT {
            let (hash, got) = c.hashed(
                SendOp::Send {
                    imm: Some(len as u32),
                },
                len,
            )?;
            ensure!(
                got == len as u64 && hash == fnv(&data[..len]),
                "SEND of {len} bytes arrived as {got} bytes with another hash"
            );
            println!("send {len} bytes: hash ok");
        }
        let (hash, got) = c.hashed(
            SendOp::WriteWithImm {
                remote: c.at(0),
                imm: len as u32,
            },
            len,
        )?;
        ensure!(
            got == len as u64 && hash == fnv(&data[..len]),
            "WRITE_WITH_IMM of {len} bytes: server saw {got} bytes with another hash"
        );
        println!("write_with_imm {len} bytes: hash ok");
    }
    // Atomics on a word past the written area (still the server's initial pattern).
    let word = 16 * MIB + 64;
    c.run(c.dst.sge(0, 8), SendOp::Read { remote: c.at(word) })?;
    let mut start = [0u8; 8];
    c.dst.read(0, &mut start);
    let start = u64::from_le_bytes(start);
    for i in 0..100u64 {
        c.run(
            c.dst.sge(8 * i as usize, 8),
            SendOp::FetchAdd {
                remote: c.at(word),
                add: 1,
            },
        )?;
    }
    for i in 0..100u64 {
        let mut v = [0u8; 8];
        c.dst.read(8 * i as usize, &mut v);
        ensure!(
            u64::from_le_bytes(v) == start.wrapping_add(i),
            "FETCH_ADD {i} returned {}",
            u64::from_le_bytes(v)
        );
    }
    c.run(
        c.dst.sge(0, 8),
        SendOp::CmpSwap {
            remote: c.at(word),
            compare: start.wrapping_add(100),
            swap: 7,
        },
    )?;
    c.run(c.dst.sge(8, 8), SendOp::Read { remote: c.at(word) })?;
    let mut v = [0u8; 16];
    c.dst.read(0, &mut v);
    ensure!(
        u64::from_le_bytes(v[..8].try_into()?) == start.wrapping_add(100)
            && u64::from_le_bytes(v[8..].try_into()?) == 7,
        "CMP_SWAP went wrong"
    );
    println!("atomics: 100 fetch_add + cmp_swap ok");
    // 64 outstanding requests under one doorbell.
    let wrs: Vec<SendWr> = (0..64)
        .map(|i| SendWr {
            wr_id: 10_000 + i,
            local: c.src.sge(i as usize * 65_536, 65_536),
            op: SendOp::Write {
                remote: c.at(i as usize * 65_536),
            },
        })
        .collect();
    c.qp.post_send(&wrs)?;
    let wcs = wait_ok(&c.cq, 64)?;
    ensure!(
        wcs.iter().map(|w| w.wr_id).eq(10_000..10_064),
        "completions out of order"
    );
    c.run(c.dst.sge(0, 4 * MIB), SendOp::Read { remote: c.at(0) })?;
    let mut back = vec![0u8; 4 * MIB];
    c.dst.read(0, &mut back);
    ensure!(
        back == data[..4 * MIB],
        "64 outstanding writes landed wrong"
    );
    println!("64 outstanding writes: ok, in order");
    c.hashed(SendOp::Send { imm: Some(GOODBYE) }, 0)?;
    println!("all checks passed");
    Ok(())
}

fn client_access(args: &Args) -> anyhow::Result<()> {
    let (_dev, pd, mut c) = client_connect(args, Config::default())?;
    let violation = args.get("violation")?;
    let op = match violation {
        "badkey" => SendOp::Write {
            remote: RemoteAddr {
                addr: c.target.addr,
                rkey: c.target.rkey ^ 0x0101,
            },
        },
        "oob" => SendOp::Write {
            remote: c.at(TARGET - 100),
        },
        "noflag" => SendOp::Write {
            remote: c.read_only,
        },
        "otherconn" => {
            // An rkey that is valid, but on another connection's domain: this client's own.
            let mine = pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
            SendOp::Write {
                remote: mine.remote(0),
            }
        }
        other => bail!("unknown violation {other}"),
    };
    c.post(c.src.sge(0, 1000), op)?;
    let wcs = wait(&c.cq, 1, Duration::from_secs(30))?;
    ensure!(
        wcs[0].status == WcStatus::RemoteAccess,
        "expected a remote access error, got {:?}",
        wcs[0].status
    );
    println!("{violation}: completed with RemoteAccess");
    let state = c.qp.state();
    ensure!(
        state == ConnectionState::Error,
        "queue pair should be in error, is {state:?}"
    );
    // Posting to a failed queue pair flushes.
    c.post(c.src.sge(0, 8), SendOp::Write { remote: c.at(0) })?;
    let wcs = wait(&c.cq, 1, Duration::from_secs(5))?;
    ensure!(
        wcs[0].status == WcStatus::Flushed,
        "post after error: {:?}",
        wcs[0].status
    );
    println!("post after error: Flushed");
    Ok(())
}

fn client_kill(args: &Args) -> anyhow::Result<()> {
    let config = Config {
        max_retries: 5,
        ..Config::default()
    };
    let budget = config.retry_budget();
    let (_dev, _pd, mut c) = client_connect(args, config)?;
    c.src.write(0, &pattern(MIB, 1));
    let mut last_ok = Instant::now();
    let mut announced = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [Completion::default(); 64];
    let mut outstanding = 0;
    loop {
        ensure!(
            Instant::now() < deadline,
            "no error completion 60 s into the test: the transport hangs"
        );
        while outstanding < 8 {
            c.post(c.src.sge(0, MIB), SendOp::Write { remote: c.at(0) })?;
            outstanding += 1;
        }
        let n = c.cq.poll(&mut buf)?;
        for (i, wc) in buf[..n].iter().map(|b| b.wc).enumerate() {
            outstanding -= 1;
            if wc.status == WcStatus::Success {
                last_ok = Instant::now();
                if !announced {
                    println!("streaming");
                    announced = true;
                }
                continue;
            }
            ensure!(
                wc.status == WcStatus::RetryExceeded,
                "first error was {:?}",
                wc.status
            );
            let waited = last_ok.elapsed();
            println!(
                "error completion RetryExceeded {waited:?} after the last success (retry budget {budget:?})"
            );
            // Every other outstanding request is flushed.
            let mut rest: Vec<WorkCompletion> = buf[i + 1..n].iter().map(|b| b.wc).collect();
            let more = outstanding - rest.len();
            rest.extend(wait(&c.cq, more, Duration::from_secs(5))?);
            ensure!(
                rest.iter().all(|w| w.status == WcStatus::Flushed),
                "{rest:?}"
            );
            println!("{} more flushed", rest.len());
            return Ok(());
        }
    }
}

fn client_rails(args: &Args) -> anyhow::Result<()> {
    let (_dev, _pd, mut c) = client_connect(args, Config::default())?;
    let data = pattern(16 * MIB, 3);
    c.src.write(0, &data);
    let mut buf = [Completion::default(); 64];
    let mut outstanding = 0;
    let mut streaming_since: Option<Instant> = None;
    let mut next = 0usize;
    let mut done = 0u64;
    // Stream 1 MiB WRITEs for two seconds after the first one lands; the test takes a rail
    // down meanwhile. Every write must still succeed.
    while streaming_since.is_none_or(|t| t.elapsed() < Duration::from_secs(2)) || outstanding > 0 {
        let keep_posting = streaming_since.is_none_or(|t| t.elapsed() < Duration::from_secs(2));
        while keep_posting && outstanding < 8 {
            c.post(
                c.src.sge(next * MIB, MIB),
                SendOp::Write {
                    remote: c.at(next * MIB),
                },
            )?;
            next = (next + 1) % 16;
            outstanding += 1;
        }
        let n = c.cq.poll(&mut buf)?;
        for wc in buf[..n].iter().map(|b| b.wc) {
            outstanding -= 1;
            ensure!(
                wc.status == WcStatus::Success,
                "write {} failed: {:?} (after {done} good ones)",
                wc.wr_id,
                wc.status
            );
            done += 1;
            if streaming_since.is_none() {
                let (sent, _) = c.qp.rail_stats();
                println!("streaming on {} rails: {sent:?}", sent.len());
                streaming_since = Some(Instant::now());
            }
        }
    }
    let (sent, failovers) = c.qp.rail_stats();
    println!(
        "{done} writes of 1 MiB succeeded; datagrams per rail {sent:?}; rails declared down {failovers}"
    );
    c.run(c.dst.sge(0, 16 * MIB), SendOp::Read { remote: c.at(0) })?;
    let mut back = vec![0u8; 16 * MIB];
    c.dst.read(0, &mut back);
    ensure!(back == data, "the target differs from what was written");
    println!("target verified");
    Ok(())
}

fn unreachable(args: &Args) -> anyhow::Result<()> {
    let dev = device(args)?;
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(16);
    let server: SocketAddr = args.get("server")?.parse()?;
    match connect(
        &pd,
        server,
        &cq,
        &cq,
        &QpOptions {
            timeout: Duration::from_secs(2),
            ..QpOptions::default()
        },
    ) {
        Ok(_) => bail!("connected to {server}, which has no route"),
        Err(e @ VerbsError::Unreachable { .. }) => {
            println!("unreachable: {e}");
            Ok(())
        }
        Err(e) => bail!("wrong error for an unroutable peer: {e}"),
    }
}

fn memlock(args: &Args) -> anyhow::Result<()> {
    // Drop root (and its CAP_IPC_LOCK) so the memlock limit applies, then ask for more.
    nix::unistd::setgid(nix::unistd::Gid::from_raw(65534))?;
    nix::unistd::setuid(nix::unistd::Uid::from_raw(65534))?;
    let dev = device(args)?;
    let pd = dev.alloc_pd();
    let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)?;
    let ask = (soft as usize).saturating_mul(4).max(64 * MIB);
    match pd.alloc_mr(ask, Access::LOCAL_WRITE) {
        Ok(_) => bail!("pinned {ask} bytes beyond a memlock limit of {soft}"),
        Err(e) => {
            let msg = e.to_string();
            ensure!(
                msg.contains("RLIMIT_MEMLOCK") && msg.contains("ulimit -l"),
                "unhelpful message: {msg}"
            );
            println!("memlock error: {msg}");
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let mut argv = std::env::args().skip(1);
    let Some(netns) = argv.next() else {
        eprintln!("usage: tbrdma-test-peer NETNS key=value…");
        return ExitCode::from(2);
    };
    let args = Args(
        argv.filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect(),
    );
    if let Err(e) = tbrdma_netdev::netns::enter_current_thread(&netns) {
        eprintln!("error: entering namespace {netns}: {e}");
        return ExitCode::from(2);
    }
    // Root may raise its own memlock limit; the regions here are larger than the default.
    let inf = nix::sys::resource::RLIM_INFINITY;
    let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK, inf, inf);
    let result = match (args.or("role", ""), args.or("scenario", "").as_str()) {
        (_, "memlock") => memlock(&args),
        (_, "unreachable") => unreachable(&args),
        (r, _) if r == "server" => server(&args),
        (_, "ops") => client_ops(&args),
        (_, "access") => client_access(&args),
        (_, "kill") => client_kill(&args),
        (_, "rails") => client_rails(&args),
        (role, scenario) => Err(anyhow!("unknown role {role:?} / scenario {scenario:?}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
