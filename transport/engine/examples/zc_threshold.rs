//! Measures send throughput of the io_uring engine with copying `SENDMSG` against zero-copy
//! `SENDMSG_ZC`, and the sockets engine (`sendmmsg`) as the floor, over loopback at datagram
//! sizes from 1 KiB to 64 KiB. Its output chose `DEFAULT_ZERO_COPY_THRESHOLD`.
//!
//! `cargo run --release -p tbrdma-engine --example zc_threshold [seconds-per-run] [dest]`
//!
//! Without `dest`, each run sends 32-datagram batches over loopback for the given time while a
//! thread drains a blocking receiver. With `dest` (`ip:port`, e.g. the far end of a veth pair
//! in another network namespace) it sends there instead, to a sink started with
//! `zc_threshold sink ip:port`, and the receive rate is not measured. Reported: the rate the
//! sender handed datagrams to the kernel, the rate that arrived, and the sender thread's CPU
//! time per GB sent. Best of three runs by send rate.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::resource::{UsageWho, getrusage};
use tbrdma_engine::io::sockets::SocketIo;
use tbrdma_engine::io::uring::{UringConfig, UringIo};
use tbrdma_engine::io::{DatagramIo, TxBatch};
use tbrdma_engine::socket::bind_udp;

const SIZES: &[usize] = &[1024, 2048, 4096, 8192, 16384, 32768, 65000];
const BATCH: usize = 32;

#[derive(Clone, Copy, Debug)]
enum Mode {
    Sockets,
    Copy,
    ZeroCopy,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Sockets => "sockets sendmmsg",
            Mode::Copy => "uring SENDMSG",
            Mode::ZeroCopy => "uring SENDMSG_ZC",
        }
    }
}

struct Run {
    sent_gbps: f64,
    received_gbps: f64,
    cpu_ms_per_gb: f64,
}

fn thread_cpu() -> Duration {
    match getrusage(UsageWho::RUSAGE_THREAD) {
        Ok(usage) => {
            let user = usage.user_time();
            let sys = usage.system_time();
            Duration::new(user.tv_sec() as u64, user.tv_usec() as u32 * 1000)
                + Duration::new(sys.tv_sec() as u64, sys.tv_usec() as u32 * 1000)
        }
        Err(_) => Duration::ZERO,
    }
}

/// Drains `socket` until `stop`, counting bytes.
fn drain(socket: UdpSocket, stop: &AtomicBool, received: &AtomicU64) {
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        if let Ok(n) = socket.recv(&mut buf) {
            received.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
}

fn run(mode: Mode, size: usize, seconds: f64, dest: Option<SocketAddr>) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let (to, bind_ip, drainer) = match dest {
        Some(to) => (to, IpAddr::V4(Ipv4Addr::UNSPECIFIED), None),
        None => {
            let receiver = bind_udp(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), 32 << 20, 0)
                .expect("bind receiver");
            receiver
                .set_read_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            let to = receiver.local_addr().unwrap();
            let (stop, received) = (stop.clone(), received.clone());
            let drainer = std::thread::spawn(move || drain(receiver, &stop, &received));
            (to, IpAddr::V4(Ipv4Addr::LOCALHOST), Some(drainer))
        }
    };

    let sender: UdpSocket = bind_udp(SocketAddr::new(bind_ip, 0), 0, 4 << 20).expect("bind sender");
    let mut io: Box<dyn DatagramIo> = match mode {
        Mode::Sockets => Box::new(SocketIo::new(sender, size).unwrap()),
        Mode::Copy | Mode::ZeroCopy => {
            let zero_copy_threshold = matches!(mode, Mode::ZeroCopy).then_some(0);
            let config = UringConfig {
                single_issuer: true,
                zero_copy_threshold,
                ..UringConfig::default()
            };
            let io = UringIo::with_config(sender, size, config).expect("io_uring engine");
            if matches!(mode, Mode::ZeroCopy) {
                assert!(
                    io.setup().zero_copy_threshold.is_some(),
                    "kernel lacks SENDMSG_ZC"
                );
            }
            Box::new(io)
        }
    };
    let mut batch = TxBatch::new(BATCH, size);
    let payload = vec![0xa5u8; size];
    let deadline = Duration::from_secs_f64(seconds);
    let cpu0 = thread_cpu();
    let start = Instant::now();
    let received0 = received.load(Ordering::Relaxed);
    let mut sent = 0u64;
    while start.elapsed() < deadline {
        while !batch.is_full() {
            batch.next_buf().unwrap()[..size].copy_from_slice(&payload);
            batch.commit(size, to);
        }
        io.send(&mut batch).expect("send");
        sent += (BATCH * size) as u64;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = (thread_cpu() - cpu0).as_secs_f64();
    // Let the receiver catch up with what is already queued, then stop it.
    std::thread::sleep(Duration::from_millis(100));
    let got = received.load(Ordering::Relaxed) - received0;
    stop.store(true, Ordering::Relaxed);
    if let Some(drainer) = drainer {
        drainer.join().unwrap();
    }
    let sent = sent - io.send_drops() * size as u64;
    Run {
        sent_gbps: sent as f64 * 8.0 / elapsed / 1e9,
        received_gbps: got as f64 * 8.0 / elapsed / 1e9,
        cpu_ms_per_gb: cpu * 1e3 / (sent as f64 / 1e9),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("sink") {
        let at: SocketAddr = args
            .get(2)
            .and_then(|s| s.parse().ok())
            .expect("usage: zc_threshold sink ip:port");
        let socket = bind_udp(at, 32 << 20, 0).expect("bind sink");
        drain(socket, &AtomicBool::new(false), &AtomicU64::new(0));
        return;
    }
    let seconds: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0.4);
    let dest: Option<SocketAddr> = args.get(2).and_then(|s| s.parse().ok());
    match dest {
        Some(to) => println!(
            "to {to}, {BATCH}-datagram batches, {seconds} s per run, best of 3 (by send rate)"
        ),
        None => println!(
            "loopback, {BATCH}-datagram batches, {seconds} s per run, best of 3 (by send rate)"
        ),
    }
    println!(
        "{:>6}  {:<17} {:>10} {:>10} {:>12}",
        "size", "mode", "sent Gb/s", "recv Gb/s", "CPU ms/GB"
    );
    for &size in SIZES {
        let mut copy_rate = 0.0;
        for mode in [Mode::Sockets, Mode::Copy, Mode::ZeroCopy] {
            let best = (0..3)
                .map(|_| run(mode, size, seconds, dest))
                .max_by(|a, b| a.sent_gbps.total_cmp(&b.sent_gbps))
                .unwrap();
            let ratio = match mode {
                Mode::Copy => {
                    copy_rate = best.sent_gbps;
                    String::new()
                }
                Mode::ZeroCopy => format!("  zc/copy {:.2}", best.sent_gbps / copy_rate),
                Mode::Sockets => String::new(),
            };
            println!(
                "{size:>6}  {:<17} {:>10.2} {:>10.2} {:>12.1}{ratio}",
                mode.name(),
                best.sent_gbps,
                best.received_gbps,
                best.cpu_ms_per_gb
            );
        }
    }
}
