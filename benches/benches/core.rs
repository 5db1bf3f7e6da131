//! The protocol core alone, on one thread: RDMA WRITE throughput between two connections with
//! no network in between. Both endpoints run on the benchmark's thread, so the time per message
//! is the requester's *and* the responder's work together.
//!
//! - `core/sim`: a `sim::Pair` over a perfect link (no latency, no bandwidth limit), which
//!   includes the simulator's own costs (a `Vec` per datagram, a heap of arrivals).
//! - `core/direct`: two `Connection`s joined by a minimal loop (`poll_transmit` into one
//!   buffer, `handle_datagram` on the other side at once), the honest "core only" figure.
//!
//! Figures: `docs/performance.md`.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tbrdma_proto::connection::ConnectParams;
use tbrdma_proto::sim::{LinkConfig, Pair, PairConfig, SimMemory};
use tbrdma_proto::{
    Access, Config, Connection, ConnectionState, Psn, Region, RemoteAddr, SendOp, SendWr, Sge,
    Time, WcStatus,
};

/// Message sizes measured, and how many WRITEs one iteration posts before driving them home.
const CASES: [(usize, usize); 2] = [(64, 512), (64 << 10, 64)];

fn write(wr_id: u64, src: &Region, dst: &Region, len: usize) -> SendWr {
    SendWr {
        wr_id,
        local: Sge {
            addr: src.addr,
            len: len as u64,
            lkey: src.lkey,
        },
        op: SendOp::Write {
            remote: RemoteAddr {
                addr: dst.addr,
                rkey: dst.rkey,
            },
        },
    }
}

fn sim(c: &mut Criterion) {
    let mut group = c.benchmark_group("core/sim");
    for (len, batch) in CASES {
        let mut pair = Pair::new(PairConfig {
            link: LinkConfig {
                latency: Duration::ZERO,
                bandwidth: None,
                ..LinkConfig::default()
            },
            ..PairConfig::default()
        });
        assert_eq!(pair.a.conn.state(), ConnectionState::Established);
        let src = pair.a.mem.alloc(len, Access::empty());
        let dst = pair
            .b
            .mem
            .alloc(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        for (name, throughput) in [
            ("messages", Throughput::Elements(batch as u64)),
            ("bytes", Throughput::Bytes((batch * len) as u64)),
        ] {
            group.throughput(throughput);
            group.bench_function(format!("{name}/{len}B"), |b| {
                b.iter(|| {
                    for i in 0..batch {
                        pair.a.post_send(write(i as u64, &src, &dst, len)).unwrap();
                    }
                    assert!(pair.drive(1_000_000), "pair did not settle");
                    let completions = pair.a.take_completions();
                    assert_eq!(completions.len(), batch);
                    assert!(completions.iter().all(|wc| wc.status == WcStatus::Success));
                })
            });
        }
    }
    group.finish();
}

/// Two connections and their memory, handshake done.
struct Direct {
    a: Connection,
    b: Connection,
    mem_a: SimMemory,
    mem_b: SimMemory,
    buf: Vec<u8>,
    now: Time,
}

impl Direct {
    fn new() -> Direct {
        let config = Config::default();
        let params = |local_qpn, remote_qpn, psn| ConnectParams {
            token: 0x5eed,
            local_qpn,
            remote_qpn,
            initial_psn: Psn(psn),
        };
        let now = Time::ZERO;
        let mut direct = Direct {
            a: Connection::connect(config.clone(), params(1, 2, u32::MAX - 100), now),
            b: Connection::accept(config.clone(), params(2, 1, 1000), now),
            mem_a: SimMemory::new(1),
            mem_b: SimMemory::new(2),
            buf: vec![0; config.max_datagram],
            now,
        };
        direct.run(|d| d.a.state() == ConnectionState::Established);
        assert_eq!(direct.b.state(), ConnectionState::Established);
        direct
    }

    /// Moves datagrams between the two until `done`, jumping time to the next deadline when
    /// neither has anything to send (a delayed acknowledgement).
    fn run(&mut self, mut done: impl FnMut(&mut Direct) -> bool) {
        for _ in 0..1_000_000 {
            if done(self) {
                return;
            }
            let mut progressed = false;
            while let Some(n) = self.a.poll_transmit(self.now, &mut self.buf, &self.mem_a) {
                self.b
                    .handle_datagram(self.now, &self.buf[..n], &mut self.mem_b);
                progressed = true;
            }
            while let Some(n) = self.b.poll_transmit(self.now, &mut self.buf, &self.mem_b) {
                self.a
                    .handle_datagram(self.now, &self.buf[..n], &mut self.mem_a);
                progressed = true;
            }
            if !progressed {
                let next = [self.a.poll_timeout(), self.b.poll_timeout()]
                    .into_iter()
                    .flatten()
                    .min()
                    .expect("an established connection always has a deadline");
                self.now = next.max(self.now + Duration::from_nanos(1));
                self.a.handle_timeout(self.now);
                self.b.handle_timeout(self.now);
            }
        }
        panic!("the connections did not get there");
    }
}

fn direct(c: &mut Criterion) {
    let mut group = c.benchmark_group("core/direct");
    for (len, batch) in CASES {
        let mut d = Direct::new();
        let src = d.mem_a.alloc(len, Access::empty());
        let dst = d
            .mem_b
            .alloc(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        for (name, throughput) in [
            ("messages", Throughput::Elements(batch as u64)),
            ("bytes", Throughput::Bytes((batch * len) as u64)),
        ] {
            group.throughput(throughput);
            group.bench_function(format!("{name}/{len}B"), |b| {
                b.iter(|| {
                    for i in 0..batch {
                        d.a.post_send(write(i as u64, &src, &dst, len), &d.mem_a)
                            .unwrap();
                    }
                    let mut completed = 0;
                    d.run(|d| {
                        while let Some(wc) = d.a.poll_completion() {
                            assert_eq!(wc.status, WcStatus::Success);
                            completed += 1;
                        }
                        completed == batch && d.a.is_idle() && d.b.is_idle()
                    });
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    targets = sim, direct
}
criterion_main!(benches);
