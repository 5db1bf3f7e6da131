//! Round trip through the plugin against the same transfer through the verbs API, in one run
//! (a benchmark, not a test; figures in `docs/performance.md`).
//!
//! `cargo bench -p tbrdma-nccl --bench roundtrip [-- ITERATIONS]`
//!
//! Two threads of one process ping-pong a message over 127.0.0.1, caller progress (each
//! thread runs the engine in its own calls, as NCCL's proxy thread would with
//! `TBRDMA_PROGRESS=caller`). Plugin: through the exported `ncclNetPlugin_v10` table,
//! `irecv` posted before the peer's `isend`, `test` polled as NCCL polls it. Verbs: a SEND
//! into a receive posted beforehand, completions polled. Reports the median and 99th
//! percentile round trip per size, and the overhead of the plugin's median over the verbs
//! one. Last column, for reference: the same verbs transfer shaped as NCCL's connections
//! are, the message on one queue pair and the reply on another, both on one device. Each
//! direction's acknowledgements then travel without a reply to carry them, a cost the plugin
//! inherits from NCCL's one-way connections rather than from its protocol.
//!
//! The three are measured in alternating blocks ([`ROUNDS`] of each, on the same
//! connections), not one after the other: on a shared 2-core machine the load of other
//! processes drifts within a second, and would otherwise land on one measurement and not on
//! the others.

use std::ffi::c_void;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use nccl_net_tbrdma::abi::NCCL_PTR_HOST;
use nccl_net_tbrdma::ncclNetPlugin_v10 as NET;
use tbrdma_verbs::*;

const SIZES: [usize; 2] = [8, 512 * 1024];
const BUF: usize = 1 << 20;
/// Alternating blocks of each measurement per size.
const ROUNDS: usize = 5;

type Ptr = usize;

fn check(what: &str, r: i32) {
    assert_eq!(r, 0, "{what} returned {r}");
}

/// One rank's plugin comms and buffers.
struct PluginRank {
    send: Ptr,
    recv: Ptr,
    smh: Ptr,
    rmh: Ptr,
    sbuf: Vec<u8>,
    rbuf: Vec<u8>,
}

fn call_test(req: Ptr) -> bool {
    let (mut done, mut size) = (0, 0);
    // SAFETY: `req` is a live request from isend/irecv; `done` and `size` are valid ints.
    let r = unsafe { NET.test.expect("test")(req as *mut c_void, &mut done, &mut size) };
    check("test", r);
    done == 1
}

fn wait(req: Ptr) {
    while !call_test(req) {}
}

impl PluginRank {
    fn isend(&mut self, len: usize) -> Ptr {
        let mut req: *mut c_void = std::ptr::null_mut();
        while req.is_null() {
            // SAFETY: `send` and `smh` came from connect/regMr; `sbuf` is registered and
            // outlives the request; `req` is a valid out-pointer.
            let r = unsafe {
                NET.isend.expect("isend")(
                    self.send as *mut c_void,
                    self.sbuf.as_mut_ptr().cast(),
                    len,
                    0,
                    self.smh as *mut c_void,
                    std::ptr::null_mut(),
                    &mut req,
                )
            };
            check("isend", r);
        }
        req as Ptr
    }

    fn irecv(&mut self) -> Ptr {
        let mut req: *mut c_void = std::ptr::null_mut();
        let mut data = [self.rbuf.as_mut_ptr().cast::<c_void>()];
        let mut sizes = [BUF];
        let mut tags = [0];
        let mut mhs = [self.rmh as *mut c_void];
        let mut phs = [std::ptr::null_mut()];
        while req.is_null() {
            // SAFETY: one-entry arrays as NCCL passes them; `rbuf` is registered and
            // outlives the request.
            let r = unsafe {
                NET.irecv.expect("irecv")(
                    self.recv as *mut c_void,
                    1,
                    data.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    tags.as_mut_ptr(),
                    mhs.as_mut_ptr(),
                    phs.as_mut_ptr(),
                    &mut req,
                )
            };
            check("irecv", r);
        }
        req as Ptr
    }
}

/// Sets up both ranks: each listens, connects to the other and accepts, from this thread.
fn plugin_pair() -> (PluginRank, PluginRank) {
    // SAFETY: a NULL logger and profiler are allowed.
    check("init", unsafe { NET.init.expect("init")(None, None) });
    let mut handles = [[0u8; 128]; 2];
    let mut listens = [std::ptr::null_mut(); 2];
    for i in 0..2 {
        // SAFETY: a 128-byte handle buffer and a valid out-pointer.
        let r = unsafe {
            NET.listen.expect("listen")(0, handles[i].as_mut_ptr().cast(), &mut listens[i])
        };
        check("listen", r);
    }
    let mut sends: [*mut c_void; 2] = [std::ptr::null_mut(); 2];
    let mut recvs: [*mut c_void; 2] = [std::ptr::null_mut(); 2];
    let deadline = Instant::now() + Duration::from_secs(30);
    while sends.iter().chain(recvs.iter()).any(|p| p.is_null()) {
        assert!(Instant::now() < deadline, "connection setup timed out");
        for i in 0..2 {
            if sends[i].is_null() {
                // Rank i sends to rank 1 - i, whose handle it received.
                // SAFETY: the peer's handle buffer, kept across retries; valid out-pointer.
                let r = unsafe {
                    NET.connect.expect("connect")(
                        0,
                        std::ptr::null_mut(),
                        handles[1 - i].as_mut_ptr().cast(),
                        &mut sends[i],
                        std::ptr::null_mut(),
                    )
                };
                check("connect", r);
            }
            if recvs[i].is_null() {
                // SAFETY: a live listen comm and a valid out-pointer.
                let r = unsafe {
                    NET.accept.expect("accept")(listens[i], &mut recvs[i], std::ptr::null_mut())
                };
                check("accept", r);
            }
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    for l in listens {
        // SAFETY: a live listen comm, closed once.
        check("closeListen", unsafe {
            NET.close_listen.expect("closeListen")(l)
        });
    }
    let make = |i: usize| {
        let mut sbuf = vec![0u8; BUF];
        let mut rbuf = vec![0u8; BUF];
        let (mut smh, mut rmh) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: live comms; the buffers are registered for the rank's lifetime (they move
        // with it, but a Vec's heap block does not move).
        unsafe {
            check(
                "regMr",
                NET.reg_mr.expect("regMr")(
                    sends[i],
                    sbuf.as_mut_ptr().cast(),
                    BUF,
                    NCCL_PTR_HOST,
                    &mut smh,
                ),
            );
            check(
                "regMr",
                NET.reg_mr.expect("regMr")(
                    recvs[i],
                    rbuf.as_mut_ptr().cast(),
                    BUF,
                    NCCL_PTR_HOST,
                    &mut rmh,
                ),
            );
        }
        PluginRank {
            send: sends[i] as Ptr,
            recv: recvs[i] as Ptr,
            smh: smh as Ptr,
            rmh: rmh as Ptr,
            sbuf,
            rbuf,
        }
    };
    (make(0), make(1))
}

fn stats(mut samples: Vec<Duration>) -> (f64, f64) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    (at(0.5), at(0.99))
}

/// One block of `iters` round trips through the plugin; returns the samples.
fn bench_plugin(
    a: &mut PluginRank,
    b: PluginRank,
    size: usize,
    iters: usize,
) -> (Vec<Duration>, PluginRank) {
    let start = Arc::new(Barrier::new(2));
    let echo = {
        let start = start.clone();
        std::thread::spawn(move || {
            let mut b = b;
            let mut pending = b.irecv();
            start.wait();
            for _ in 0..iters {
                wait(pending);
                pending = b.irecv();
                let s = b.isend(size);
                wait(s);
            }
            // The ping side's 0-byte terminator completes the spare receive; answer it.
            wait(pending);
            let s = b.isend(0);
            wait(s);
            b
        })
    };
    let mut samples = Vec::with_capacity(iters);
    let mut pending = a.irecv();
    start.wait();
    for _ in 0..iters {
        let t = Instant::now();
        let s = a.isend(size);
        wait(pending);
        samples.push(t.elapsed());
        wait(s);
        pending = a.irecv();
    }
    let s = a.isend(0);
    wait(s);
    wait(pending);
    let b = echo.join().expect("echo thread");
    (samples, b)
}

struct VerbsSide {
    qp: QueuePair,
    cq: CompletionQueue,
    mr: MemoryRegion,
    /// Completions seen and not yet waited for: (sends, receives).
    seen: std::cell::Cell<(usize, usize)>,
}

impl VerbsSide {
    fn post_recv(&self) {
        self.qp
            .post_recv(&[RecvWr {
                wr_id: 1,
                local: self.mr.sge(BUF, BUF),
            }])
            .expect("post_recv");
    }
    fn send(&self, size: usize) {
        self.qp
            .post_send(&[SendWr {
                wr_id: 2,
                local: self.mr.sge(0, size),
                op: SendOp::Send { imm: None },
            }])
            .expect("post_send");
    }
    /// Waits until `sends` send and `recvs` receive completions have been seen, counting
    /// ones that arrived early (the peer's next message can come before our send completes).
    fn wait(&self, sends: usize, recvs: usize) {
        let mut wcs = [Completion::default(); 4];
        while self.seen.get().0 < sends || self.seen.get().1 < recvs {
            let n = self.cq.poll(&mut wcs).expect("poll");
            for c in &wcs[..n] {
                assert_eq!(c.wc.status, WcStatus::Success);
                let (s, r) = self.seen.get();
                self.seen.set(if c.wc.opcode == WcOpcode::Recv {
                    (s, r + 1)
                } else {
                    (s + 1, r)
                });
            }
        }
        let (s, r) = self.seen.get();
        self.seen.set((s - sends, r - recvs));
    }
}

/// A device on 127.0.0.1 whose engine runs in its callers' polls.
fn caller_device() -> Device {
    let config = DeviceConfig {
        engine: EngineConfig {
            progress: Progress::Caller,
            ..Default::default()
        },
        port: 0,
    };
    Device::open("127.0.0.1", config).expect("device")
}

/// A connected pair of queue pairs on `dev`.
fn verbs_pair_on(dev: &Device) -> (VerbsSide, VerbsSide) {
    let dev = dev.clone();
    let listener = Listener::bind(&dev, 0).expect("listen");
    let addr = listener.local_addr().expect("addr");
    let side = |dev: &Device| {
        let pd = dev.alloc_pd();
        let cq = dev.create_cq(64);
        let mr = pd.alloc_mr(2 * BUF, Access::LOCAL_WRITE).expect("mr");
        (pd, cq, mr)
    };
    let (spd, scq, smr) = side(&dev);
    let server = std::thread::spawn(move || {
        let c = listener
            .accept(
                &spd,
                &scq,
                &scq,
                &QpOptions::default(),
                Some(Duration::from_secs(10)),
            )
            .expect("accept");
        VerbsSide {
            qp: c.qp,
            cq: scq,
            mr: smr,
            seen: Default::default(),
        }
    });
    let (cpd, ccq, cmr) = side(&dev);
    let c = connect(&cpd, addr, &ccq, &ccq, &QpOptions::default()).expect("connect");
    let client = VerbsSide {
        qp: c.qp,
        cq: ccq,
        mr: cmr,
        seen: Default::default(),
    };
    (client, server.join().expect("server"))
}

/// One block of `iters` round trips through the verbs API; returns the samples.
fn bench_verbs(
    a: &VerbsSide,
    b: VerbsSide,
    size: usize,
    iters: usize,
) -> (Vec<Duration>, VerbsSide) {
    let start = Arc::new(Barrier::new(2));
    let echo = {
        let start = start.clone();
        std::thread::spawn(move || {
            b.post_recv();
            start.wait();
            for _ in 0..iters {
                b.wait(0, 1);
                b.post_recv();
                b.send(size);
                b.wait(1, 0);
            }
            b
        })
    };
    a.post_recv();
    start.wait();
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        a.send(size);
        a.wait(1, 1);
        samples.push(t.elapsed());
        a.post_recv();
    }
    let b = echo.join().expect("echo");
    (samples, b)
}

/// One block of `iters` round trips through the verbs API shaped as NCCL connections are: the
/// message on one queue pair (`a1` to `b1`), the reply on another (`b2` to `a2`).
fn bench_verbs2(
    a1: &VerbsSide,
    a2: &VerbsSide,
    b: (VerbsSide, VerbsSide),
    size: usize,
    iters: usize,
) -> (Vec<Duration>, (VerbsSide, VerbsSide)) {
    let start = Arc::new(Barrier::new(2));
    let echo = {
        let start = start.clone();
        std::thread::spawn(move || {
            let (b1, b2) = b;
            b1.post_recv();
            start.wait();
            for _ in 0..iters {
                b1.wait(0, 1);
                b1.post_recv();
                b2.send(size);
                b2.wait(1, 0);
            }
            (b1, b2)
        })
    };
    a2.post_recv();
    start.wait();
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        a1.send(size);
        a2.wait(0, 1);
        samples.push(t.elapsed());
        a1.wait(1, 0);
        a2.post_recv();
    }
    (samples, echo.join().expect("echo"))
}

fn main() {
    let iters: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    // SAFETY: set_var is called before any other thread of this process exists.
    unsafe {
        std::env::set_var("TBRDMA_IFACES", "127.0.0.1");
        std::env::set_var("TBRDMA_PROGRESS", "caller");
    }
    println!(
        "round trip over 127.0.0.1, caller progress; {iters} iterations at 8 B, {} at 512 KiB, \
         each in {ROUNDS} blocks alternating with the others'",
        (iters / 10).max(10)
    );
    println!(
        "{:>9} | {:>13} {:>9} | {:>13} {:>9} | {:>9} | {:>18}",
        "size",
        "plugin p50 µs",
        "p99 µs",
        "verbs p50 µs",
        "p99 µs",
        "overhead",
        "2-QP verbs p50 µs"
    );
    // Fresh connections for each size. With caller progress an idle connection is not kept
    // alive and fails after `idle_timeout` (3 s): each block is far shorter than that.
    for size in SIZES {
        let n = if size > 4096 {
            (iters / 10).max(10)
        } else {
            iters
        };
        let block = n.div_ceil(ROUNDS);
        let (va, mut vb) = verbs_pair_on(&caller_device());
        // Both of NCCL's connections go through the plugin's one device, as here.
        let two_qp_device = caller_device();
        let (wa1, wb1) = verbs_pair_on(&two_qp_device);
        let (wa2, wb2) = verbs_pair_on(&two_qp_device);
        let mut wb = (wb1, wb2);
        let (mut pa, mut pb) = plugin_pair();
        let (mut verbs, mut verbs2, mut plugin) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let (samples, b) = bench_verbs(&va, vb, size, block);
            verbs.extend(samples);
            vb = b;
            let (samples, b) = bench_verbs2(&wa1, &wa2, wb, size, block);
            verbs2.extend(samples);
            wb = b;
            let (samples, b) = bench_plugin(&mut pa, pb, size, block);
            plugin.extend(samples);
            pb = b;
        }
        drop((va, vb, wa1, wa2, wb));
        let ((v50, v99), (w50, _), (p50, p99)) = (stats(verbs), stats(verbs2), stats(plugin));
        for rank in [pa, pb] {
            // SAFETY: comms from connect/accept, closed once; no request outstanding.
            unsafe {
                check(
                    "closeSend",
                    NET.close_send.expect("closeSend")(rank.send as *mut c_void),
                );
                check(
                    "closeRecv",
                    NET.close_recv.expect("closeRecv")(rank.recv as *mut c_void),
                );
            }
        }
        println!(
            "{size:>9} | {p50:>13.1} {p99:>9.1} | {v50:>13.1} {v99:>9.1} | {:>8.1}% | {w50:>18.1}",
            (p50 / v50 - 1.0) * 100.0
        );
    }
}
