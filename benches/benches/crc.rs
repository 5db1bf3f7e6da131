//! CRC-32C by `crc-fast` (what the wire format uses) and by `crc32c` (what it used before),
//! against CRC-32/IEEE (`crc32fast`), over the
//! datagram sizes tbrdma sends: a small control packet, a 1500-byte and a 9000-byte MTU, and a
//! 64 KiB thunderbolt-net datagram. Figures: `docs/performance.md`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn crc(c: &mut Criterion) {
    for size in [64usize, 1500, 9000, 64 << 10] {
        let data: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
        let mut group = c.benchmark_group(format!("crc/{size}"));
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function("crc-fast", |b| {
            b.iter(|| crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, black_box(&data)))
        });
        group.bench_function("crc32c", |b| b.iter(|| crc32c::crc32c(black_box(&data))));
        group.bench_function("crc32fast", |b| {
            b.iter(|| crc32fast::hash(black_box(&data)))
        });
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = crc
}
criterion_main!(benches);
