//! The reduction kernels of the collectives over a 16 KiB buffer (one tensor-parallel
//! all-reduce of a 70B model's hidden state at batch 1): `acc = acc op x` and, for the 2-rank
//! one-shot all-reduce, `out = a op b`, for f32, bf16 and f16. Figures: `docs/performance.md`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tbrdma_collectives::{DType, ReduceOp, bf16, combine, f16, reduce_ranks};

/// 16 KiB of `dtype`, values near `base` (normal numbers, as activations are).
fn buffer(dtype: DType, base: f32) -> Vec<u8> {
    let n = (16 << 10) / dtype.size();
    let v = |i: usize| base + (i % 17) as f32 * 0.01;
    match dtype {
        DType::F32 => (0..n).flat_map(|i| v(i).to_le_bytes()).collect(),
        DType::Bf16 => (0..n)
            .flat_map(|i| bf16::from_f32(v(i)).to_bits().to_le_bytes())
            .collect(),
        _ => (0..n)
            .flat_map(|i| f16::from_f32(v(i)).to_bits().to_le_bytes())
            .collect(),
    }
}

fn reduce(c: &mut Criterion) {
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let (a, x) = (buffer(dtype, 1.0), buffer(dtype, -0.5));
        let mut group = c.benchmark_group(format!("reduce-16KiB/{dtype}"));
        group.throughput(Throughput::Bytes(a.len() as u64));
        let mut acc = a.clone();
        group.bench_function("combine", |b| {
            b.iter(|| {
                // Back to the start each time so the values stay where they began.
                acc.copy_from_slice(&a);
                combine(dtype, ReduceOp::Sum, black_box(&mut acc), black_box(&x))
            })
        });
        group.bench_function("copy alone (subtract from combine)", |b| {
            b.iter(|| acc.copy_from_slice(black_box(&a)))
        });
        let mut out = vec![0u8; a.len()];
        let mut wide = Vec::new();
        group.bench_function("two ranks into out", |b| {
            b.iter(|| {
                reduce_ranks(
                    dtype,
                    ReduceOp::Sum,
                    black_box(&mut out),
                    &[&a, &x],
                    &mut wide,
                )
            })
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
    targets = reduce
}
criterion_main!(benches);
