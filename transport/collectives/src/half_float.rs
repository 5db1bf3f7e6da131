//! 16-bit floats (bf16 and IEEE f16): exact conversions to and from f32, and the reduction
//! kernels over them, compiled for several instruction-set levels and picked at run time.
//!
//! Why a module of their own: the generic lane kernels converted one element at a time
//! through the `half` crate, which measured 2.7 µs (bf16) and 29 µs (f16, a feature check and
//! a call per element) per 16 KiB on this project's 2-core VM, against 0.4 µs for f32; the
//! 16-bit reduction was most of a bf16 all-reduce's user time and made f16 all-reduce 5×
//! slower than f32. Here the conversions are branch-free integer and float arithmetic that
//! vectorises, data is moved through small `u16` blocks (byte-indexed loops do not vectorise),
//! and each kernel is cloned for AVX-512, AVX2 and the baseline by `multiversion`. f16 has
//! conversion instructions on x86-64 (F16C, on every CPU with AVX2): the clones built with them
//! run the f16 kernels of [`f16c`], 6× faster than the portable conversions here.
//!
//! Bits: every path rounds to nearest even exactly as the `half` crate does (unit tests compare
//! every f16 and a sample of f32 values). Where IEEE leaves a choice that a compiler may make
//! differently in different clones, the choice is fixed here, so that ranks on different CPUs
//! (an AVX-512 desktop and an AVX2 mini-PC) still compute the same bits: a NaN result is always
//! the canonical quiet NaN ([`BF16_NAN`], [`F16_NAN`]), and min/max order equal zeros
//! (min(-0, +0) = -0). With that, every operator here is commutative bit for bit, so the
//! kernels need not know which operand came first.

use multiversion::multiversion;
use multiversion::target::match_target;

#[cfg(target_arch = "x86_64")]
mod f16c;

use crate::reduce_op::ReduceOp;

/// The NaN every bf16 reduction that produces a NaN stores.
pub(crate) const BF16_NAN: u16 = 0x7fc0;
/// The NaN every f16 reduction that produces a NaN stores.
pub(crate) const F16_NAN: u16 = 0x7e00;

/// The value of a 16-bit float (exact).
#[inline(always)]
pub(crate) fn to_f32<const BF: bool>(bits: u16) -> f32 {
    let h = u32::from(bits);
    if BF {
        // bf16 is the top half of an f32.
        return f32::from_bits(h << 16);
    }
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    // Exponent and mantissa moved to their f32 places and scaled by 2^112 (exact, a power of
    // two): that rebiases normal halves and turns subnormal ones into normal floats.
    let finite = (f32::from_bits(em << 13) * f32::from_bits(0x7780_0000)).to_bits();
    // Infinity and NaN keep their mantissa under an all-ones exponent.
    let special = (em << 13) | 0x7f80_0000;
    f32::from_bits(if em >= 0x7c00 { special } else { finite } | sign)
}

/// `v` rounded to the nearest 16-bit float, ties to even; NaN becomes the canonical NaN.
#[inline(always)]
pub(crate) fn from_f32<const BF: bool>(v: f32) -> u16 {
    let x = v.to_bits();
    if BF {
        let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
        return if v.is_nan() { BF16_NAN } else { rounded };
    }
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7fff_ffff;
    // Below 2^-14 the half is subnormal: adding 0.5 lines the mantissa up so that the float
    // addition's own rounding (to nearest even) rounds it, and the half is the low bits.
    let subnormal = (f32::from_bits(a) + 0.5)
        .to_bits()
        .wrapping_sub(0x3f00_0000);
    // Normal: rebias the exponent (-112 << 23) and round the 13 dropped bits to nearest even.
    let normal = a.wrapping_add(0xc800_0fff).wrapping_add((a >> 13) & 1) >> 13;
    let h = if a < 0x3880_0000 { subnormal } else { normal };
    // From 65520 up (after rounding) the half is infinite.
    let h = if a >= 0x4780_0000 { 0x7c00 } else { h };
    if a > 0x7f80_0000 {
        F16_NAN
    } else {
        (h | sign) as u16
    }
}

/// The operators on widened values, with IEEE's free choices fixed (see the module docs).
#[inline(always)]
fn apply<const OP: u8>(a: f32, b: f32) -> f32 {
    match OP {
        SUM => a + b,
        PROD => a * b,
        // minNum/maxNum (a NaN loses to a number), with -0 below +0.
        MIN => {
            if a < b {
                a
            } else if b < a {
                b
            } else if a == b {
                f32::from_bits(a.to_bits() | b.to_bits())
            } else if a.is_nan() {
                b
            } else {
                a
            }
        }
        _ => {
            if a > b {
                a
            } else if b > a {
                b
            } else if a == b {
                f32::from_bits(a.to_bits() & b.to_bits())
            } else if a.is_nan() {
                b
            } else {
                a
            }
        }
    }
}

const SUM: u8 = 0;
const PROD: u8 = 1;
const MIN: u8 = 2;
const MAX: u8 = 3;

/// Runs `$kernel::<BF, OP>` for `$op` (avg adds: the caller divides at the end).
macro_rules! by_op {
    ($op:expr, $kernel:ident, $bf:ident, $($arg:expr),*) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => $kernel::<$bf, SUM>($($arg),*),
            ReduceOp::Prod => $kernel::<$bf, PROD>($($arg),*),
            ReduceOp::Min => $kernel::<$bf, MIN>($($arg),*),
            ReduceOp::Max => $kernel::<$bf, MAX>($($arg),*),
        }
    };
}

/// In a multiversioned kernel: runs `$kernel` (one of [`f16c`]'s) and is true in the clones
/// built with F16C; false in the others, where it is not compiled.
macro_rules! with_f16c {
    ($kernel:expr) => {
        match_target! {
            "x86_64+f16c" => {
                $kernel;
                true
            },
            _ => false,
        }
    };
}

/// The element at `i` of little-endian 16-bit data.
#[inline(always)]
fn get(bytes: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])
}

/// Typed views of byte buffers, when their addresses allow (buffers from the allocator and
/// registered slots always do): loops over `u16`/`u32` slices vectorise, loops over byte
/// chunks mostly do not. `None` sends a kernel to its element-at-a-time fallback.
fn halves(b: &[u8]) -> Option<&[u16]> {
    bytemuck::try_cast_slice(b).ok()
}

fn halves_mut(b: &mut [u8]) -> Option<&mut [u16]> {
    bytemuck::try_cast_slice_mut(b).ok()
}

/// The 32-bit words (bf16 pairs) of a buffer and the odd element after them, if any.
fn words(b: &[u8]) -> (Option<&[u32]>, &[u8]) {
    let (w, tail) = b.split_at(b.len() & !3);
    (bytemuck::try_cast_slice(w).ok(), tail)
}

fn words_mut(b: &mut [u8]) -> (Option<&mut [u32]>, &mut [u8]) {
    let (w, tail) = b.split_at_mut(b.len() & !3);
    (bytemuck::try_cast_slice_mut(w).ok(), tail)
}

/// One element of `op` on 16-bit values, rounded.
#[inline(always)]
fn one<const BF: bool, const OP: u8>(a: u16, b: u16) -> u16 {
    from_f32::<BF>(apply::<OP>(to_f32::<BF>(a), to_f32::<BF>(b)))
}

/// `acc = acc op x`, element-wise, rounded once per element.
pub(crate) fn combine<const BF: bool>(op: ReduceOp, acc: &mut [u8], x: &[u8]) {
    debug_assert_eq!(acc.len(), x.len());
    by_op!(op, combine_op, BF, acc, x)
}

#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+f16c",
    "x86_64+avx2+f16c",
    "x86_64+avx2"
))]
fn combine_op<const BF: bool, const OP: u8>(acc: &mut [u8], x: &[u8]) {
    if BF {
        // Two bf16 per 32-bit word, each widened in place (no shuffles): see `bf16_pair`.
        let ((aw, at), (xw, _)) = (words_mut(acc), words(x));
        if let (Some(aw), Some(xw)) = (aw, xw) {
            for (p, q) in aw.iter_mut().zip(xw) {
                *p = bf16_pair::<OP>(u32::from_le(*p), u32::from_le(*q)).to_le();
            }
            if !at.is_empty() {
                let n = x.len() / 2 - 1;
                at.copy_from_slice(&one::<true, OP>(get(at, 0), get(x, n)).to_le_bytes());
            }
            return;
        }
    }
    // f16, or bf16 whose buffers are 2- but not 4-byte aligned (a ring segment that starts at an
    // odd element): one element at a time, which still vectorises.
    if let (Some(a), Some(b)) = (halves_mut(acc), halves(x)) {
        if !BF && with_f16c!(f16c::combine::<OP>(a, b)) {
            return;
        }
        for (p, q) in a.iter_mut().zip(b) {
            *p = one::<BF, OP>(u16::from_le(*p), u16::from_le(*q)).to_le();
        }
        return;
    }
    for (i, p) in acc.chunks_exact_mut(2).enumerate() {
        p.copy_from_slice(&one::<BF, OP>(get(p, 0), get(x, i)).to_le_bytes());
    }
}

/// `out = a op b`, element-wise, in one pass.
pub(crate) fn combine3<const BF: bool>(op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    by_op!(op, combine3_op, BF, out, a, b)
}

#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+f16c",
    "x86_64+avx2+f16c",
    "x86_64+avx2"
))]
fn combine3_op<const BF: bool, const OP: u8>(out: &mut [u8], a: &[u8], b: &[u8]) {
    if BF {
        let ((ow, ot), (aw, _), (bw, _)) = (words_mut(out), words(a), words(b));
        if let (Some(ow), Some(aw), Some(bw)) = (ow, aw, bw) {
            for ((o, p), q) in ow.iter_mut().zip(aw).zip(bw) {
                *o = bf16_pair::<OP>(u32::from_le(*p), u32::from_le(*q)).to_le();
            }
            if !ot.is_empty() {
                let n = a.len() / 2 - 1;
                ot.copy_from_slice(&one::<true, OP>(get(a, n), get(b, n)).to_le_bytes());
            }
            return;
        }
    }
    if let (Some(o), Some(x), Some(y)) = (halves_mut(out), halves(a), halves(b)) {
        if !BF && with_f16c!(f16c::combine3::<OP>(o, x, y)) {
            return;
        }
        for ((o, p), q) in o.iter_mut().zip(x).zip(y) {
            *o = one::<BF, OP>(u16::from_le(*p), u16::from_le(*q)).to_le();
        }
        return;
    }
    for (i, o) in out.chunks_exact_mut(2).enumerate() {
        o.copy_from_slice(&one::<BF, OP>(get(a, i), get(b, i)).to_le_bytes());
    }
}

/// Two bf16 packed in a word (the first in the low half), combined: the high one is the word
/// with the low half cleared, the low one the word shifted up, both already f32; the results
/// are rounded and packed back. Same bits as one element at a time.
#[inline(always)]
fn bf16_pair<const OP: u8>(a: u32, b: u32) -> u32 {
    let high = apply::<OP>(
        f32::from_bits(a & 0xffff_0000),
        f32::from_bits(b & 0xffff_0000),
    );
    let low = apply::<OP>(f32::from_bits(a << 16), f32::from_bits(b << 16));
    (u32::from(from_f32::<true>(high)) << 16) | u32::from(from_f32::<true>(low))
}

/// `wide = f32(x)`, element-wise.
pub(crate) fn widen<const BF: bool>(wide: &mut Vec<f32>, x: &[u8]) {
    wide.clear();
    wide.resize(x.len() / 2, 0.0);
    widen_into::<BF>(wide, x)
}

#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+f16c",
    "x86_64+avx2+f16c",
    "x86_64+avx2"
))]
fn widen_into<const BF: bool>(wide: &mut [f32], x: &[u8]) {
    match halves(x) {
        Some(h) => {
            if !BF && with_f16c!(f16c::widen(wide, h)) {
                return;
            }
            for (w, q) in wide.iter_mut().zip(h) {
                *w = to_f32::<BF>(u16::from_le(*q));
            }
        }
        None => {
            for (i, w) in wide.iter_mut().enumerate() {
                *w = to_f32::<BF>(get(x, i));
            }
        }
    }
}

/// `wide = wide op f32(x)`, element-wise, unrounded.
pub(crate) fn widen_combine<const BF: bool>(op: ReduceOp, wide: &mut [f32], x: &[u8]) {
    by_op!(op, widen_combine_op, BF, wide, x)
}

#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+f16c",
    "x86_64+avx2+f16c",
    "x86_64+avx2"
))]
fn widen_combine_op<const BF: bool, const OP: u8>(wide: &mut [f32], x: &[u8]) {
    match halves(x) {
        Some(h) => {
            if !BF && with_f16c!(f16c::widen_combine::<OP>(wide, h)) {
                return;
            }
            for (w, q) in wide.iter_mut().zip(h) {
                *w = apply::<OP>(*w, to_f32::<BF>(u16::from_le(*q)));
            }
        }
        None => {
            for (i, w) in wide.iter_mut().enumerate() {
                *w = apply::<OP>(*w, to_f32::<BF>(get(x, i)));
            }
        }
    }
}

/// `out = round(wide / divisor)` (`divisor` 1 but for avg), element-wise.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+f16c",
    "x86_64+avx2+f16c",
    "x86_64+avx2"
))]
pub(crate) fn narrow<const BF: bool>(divisor: f32, out: &mut [u8], wide: &[f32]) {
    let round = |v: f32| from_f32::<BF>(if divisor == 1.0 { v } else { v / divisor });
    match halves_mut(out) {
        Some(h) => {
            if !BF && with_f16c!(f16c::narrow(divisor, h, wide)) {
                return;
            }
            for (o, v) in h.iter_mut().zip(wide) {
                *o = round(*v).to_le();
            }
        }
        None => {
            for (o, v) in out.chunks_exact_mut(2).zip(wide) {
                o.copy_from_slice(&round(*v).to_le_bytes());
            }
        }
    }
}

/// Divides every element by `n`, rounding once (the last step of avg).
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+f16c",
    "x86_64+avx2+f16c",
    "x86_64+avx2"
))]
pub(crate) fn divide<const BF: bool>(buf: &mut [u8], n: usize) {
    let divisor = n as f32;
    let quotient = |h: u16| from_f32::<BF>(to_f32::<BF>(h) / divisor);
    match halves_mut(buf) {
        Some(h) => {
            if !BF && with_f16c!(f16c::divide(h, divisor)) {
                return;
            }
            for p in h {
                *p = quotient(u16::from_le(*p)).to_le();
            }
        }
        None => {
            for p in buf.chunks_exact_mut(2) {
                p.copy_from_slice(&quotient(get(p, 0)).to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// xorshift32 bit patterns, plus the values at the edges of every range.
    fn f32_samples() -> Vec<f32> {
        let mut values = vec![
            0.0,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0x3f80_8000),
            65504.0,
            65519.99,
            65520.0,
            6.1035156e-5,
            6.1035156e-5 * 0.5,
            5.9604645e-8,
            2.9802322e-8,
            2.9802326e-8,
        ];
        let mut x = 0x1234_5678u32;
        for _ in 0..300_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            values.push(f32::from_bits(x));
        }
        // Every 16th f32 around the f16 range (|v| from 2^-26 to 2^17), both signs.
        for bits in (0x3280_0000u32..0x4800_0000).step_by(4093) {
            values.push(f32::from_bits(bits));
            values.push(-f32::from_bits(bits));
        }
        values
    }

    #[test]
    fn widening_is_exact_for_every_16_bit_value() {
        for bits in 0..=u16::MAX {
            let (want_h, want_b) = (
                f16::from_bits(bits).to_f32(),
                bf16::from_bits(bits).to_f32(),
            );
            let (got_h, got_b) = (to_f32::<false>(bits), to_f32::<true>(bits));
            // NaN payloads may differ in the quiet bit; a NaN stays a NaN.
            assert!(
                got_h.to_bits() == want_h.to_bits() || (got_h.is_nan() && want_h.is_nan()),
                "f16 {bits:#06x}: {:#x} vs {:#x}",
                got_h.to_bits(),
                want_h.to_bits()
            );
            assert!(
                got_b.to_bits() == want_b.to_bits() || (got_b.is_nan() && want_b.is_nan()),
                "bf16 {bits:#06x}"
            );
        }
    }

    #[test]
    fn rounding_matches_the_half_crate_and_nan_is_canonical() {
        for v in f32_samples() {
            let (h, b) = (from_f32::<false>(v), from_f32::<true>(v));
            if v.is_nan() {
                assert_eq!((h, b), (F16_NAN, BF16_NAN), "{:#x}", v.to_bits());
            } else {
                assert_eq!(
                    h,
                    f16::from_f32(v).to_bits(),
                    "f16 of {v:e} ({:#x})",
                    v.to_bits()
                );
                assert_eq!(
                    b,
                    bf16::from_f32(v).to_bits(),
                    "bf16 of {v:e} ({:#x})",
                    v.to_bits()
                );
            }
        }
    }

    fn le(v: &[u16]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// `op` on two 16-bit values one element at a time, through the portable conversions.
    fn portable<const BF: bool>(op: ReduceOp, p: u16, q: u16) -> u16 {
        let (p, q) = (to_f32::<BF>(p), to_f32::<BF>(q));
        from_f32::<BF>(match op {
            ReduceOp::Sum | ReduceOp::Avg => apply::<SUM>(p, q),
            ReduceOp::Prod => apply::<PROD>(p, q),
            ReduceOp::Min => apply::<MIN>(p, q),
            ReduceOp::Max => apply::<MAX>(p, q),
        })
    }

    #[test]
    fn every_f16_value_through_every_kernel_matches_the_portable_conversions() {
        // Every f16 against partners at the edges (zeros, one, the smallest subnormal, the
        // largest finite, infinities, NaNs quiet and signalling) and against every f16 again
        // in another order. On x86-64 with F16C (any AVX2 CPU) this checks the F16C kernels,
        // elsewhere the portable ones. Buffers start 3 elements in, so the last groups of eight
        // are partial and take the element-at-a-time tails.
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let edges = [
            0x0000, 0x8000, 0x3c00, 0xbc00, 0x0001, 0x83ff, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00,
            0x7d01,
        ];
        let mut partners: Vec<Vec<u16>> = edges.iter().map(|&e| vec![e; all.len()]).collect();
        partners.push(
            (0..all.len())
                .map(|i| (i * 40_503 % 65_536) as u16)
                .collect(),
        );
        let a = &le(&all)[6..];
        for b in &partners {
            let b = &le(b)[6..];
            for op in ReduceOp::ALL {
                let want: Vec<u16> = (0..a.len() / 2)
                    .map(|i| portable::<false>(op, get(a, i), get(b, i)))
                    .collect();
                let mut out = vec![0u8; a.len()];
                combine3::<false>(op, &mut out, a, b);
                assert_eq!(out, le(&want), "combine3 {op}");
                let mut acc = a.to_vec();
                combine::<false>(op, &mut acc, b);
                assert_eq!(acc, le(&want), "combine {op}");
                // The accumulator path (three ranks or more, and avg): widen, combine, narrow.
                let mut wide = Vec::new();
                widen::<false>(&mut wide, a);
                widen_combine::<false>(op, &mut wide, b);
                let mut out = vec![0u8; a.len()];
                narrow::<false>(1.0, &mut out, &wide);
                assert_eq!(out, le(&want), "widen, combine, narrow {op}");
            }
            let mut buf = b.to_vec();
            divide::<false>(&mut buf, 3);
            let want: Vec<u16> = (0..b.len() / 2)
                .map(|i| from_f32::<false>(to_f32::<false>(get(b, i)) / 3.0))
                .collect();
            assert_eq!(buf, le(&want), "divide");
            let wide: Vec<f32> = (0..b.len() / 2)
                .map(|i| to_f32::<false>(get(b, i)))
                .collect();
            let mut out = vec![0u8; b.len()];
            narrow::<false>(3.0, &mut out, &wide);
            assert_eq!(out, le(&want), "narrow with a divisor");
        }
    }

    #[test]
    fn kernels_agree_with_one_element_at_a_time_in_any_operand_order() {
        // Odd length: the element after the last bf16 pair.
        let n = 3 * 64 + 5;
        let mut x = 0x9e37_79b9u32;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        let specials: [u16; 6] = [0x0000, 0x8000, 0x7c00, 0x7fc0, 0x7e01, 0xffff];
        let mut a: Vec<u16> = (0..n).map(|_| next() as u16).collect();
        let b: Vec<u16> = (0..n).map(|_| next() as u16).collect();
        // Equal zeros of both signs and NaN meeting NaN, where IEEE leaves choices.
        a[..6].copy_from_slice(&specials);
        let mut b = b;
        b[..6].copy_from_slice(&[0x8000, 0x0000, 0x7c00, 0xffc1, 0x7e00, 0x7fff]);
        for op in ReduceOp::ALL {
            for bf in [false, true] {
                let one = |p: u16, q: u16| -> u16 {
                    let (p, q) = if bf {
                        (to_f32::<true>(p), to_f32::<true>(q))
                    } else {
                        (to_f32::<false>(p), to_f32::<false>(q))
                    };
                    let v = match op {
                        ReduceOp::Sum | ReduceOp::Avg => apply::<SUM>(p, q),
                        ReduceOp::Prod => apply::<PROD>(p, q),
                        ReduceOp::Min => apply::<MIN>(p, q),
                        ReduceOp::Max => apply::<MAX>(p, q),
                    };
                    if bf {
                        from_f32::<true>(v)
                    } else {
                        from_f32::<false>(v)
                    }
                };
                let want: Vec<u16> = a.iter().zip(&b).map(|(&p, &q)| one(p, q)).collect();
                let swapped: Vec<u16> = a.iter().zip(&b).map(|(&p, &q)| one(q, p)).collect();
                assert_eq!(want, swapped, "{op} bf16={bf}: not commutative bit for bit");
                let (mut acc, mut out) = (le(&a), vec![0u8; 2 * n]);
                if bf {
                    combine::<true>(op, &mut acc, &le(&b));
                    combine3::<true>(op, &mut out, &le(&b), &le(&a));
                } else {
                    combine::<false>(op, &mut acc, &le(&b));
                    combine3::<false>(op, &mut out, &le(&b), &le(&a));
                }
                assert_eq!(acc, le(&want), "combine {op} bf16={bf}");
                assert_eq!(out, le(&want), "combine3 {op} bf16={bf}");
                // Buffers at an odd address take the element-at-a-time fallbacks.
                let (mut acc, mut out) = (vec![0u8; 2 * n + 1], vec![0u8; 2 * n + 1]);
                acc[1..].copy_from_slice(&le(&a));
                let mut bx = vec![0u8; 2 * n + 1];
                bx[1..].copy_from_slice(&le(&b));
                if bf {
                    combine::<true>(op, &mut acc[1..], &bx[1..]);
                    combine3::<true>(op, &mut out[1..], &bx[1..], &le(&a));
                } else {
                    combine::<false>(op, &mut acc[1..], &bx[1..]);
                    combine3::<false>(op, &mut out[1..], &bx[1..], &le(&a));
                }
                assert_eq!(acc[1..], le(&want), "unaligned combine {op} bf16={bf}");
                assert_eq!(out[1..], le(&want), "unaligned combine3 {op} bf16={bf}");
                // At 2 bytes past a 4-byte boundary bf16 takes the element-wise path. (A
                // `Vec<u32>` backs the buffers so that offset 2 is exactly that.)
                let words = (2 * n + 6) / 4;
                let (mut acc, mut out, mut bx) =
                    (vec![0u32; words], vec![0u32; words], vec![0u32; words]);
                let (acc, out, bx): (&mut [u8], &mut [u8], &mut [u8]) = (
                    bytemuck::cast_slice_mut(&mut acc),
                    bytemuck::cast_slice_mut(&mut out),
                    bytemuck::cast_slice_mut(&mut bx),
                );
                let r = 2..2 + 2 * n;
                acc[r.clone()].copy_from_slice(&le(&a));
                bx[r.clone()].copy_from_slice(&le(&b));
                if bf {
                    combine::<true>(op, &mut acc[r.clone()], &bx[r.clone()]);
                    combine3::<true>(op, &mut out[r.clone()], &bx[r.clone()], &le(&a));
                } else {
                    combine::<false>(op, &mut acc[r.clone()], &bx[r.clone()]);
                    combine3::<false>(op, &mut out[r.clone()], &bx[r.clone()], &le(&a));
                }
                assert_eq!(
                    acc[r.clone()],
                    le(&want),
                    "2-aligned combine {op} bf16={bf}"
                );
                assert_eq!(out[r], le(&want), "2-aligned combine3 {op} bf16={bf}");
            }
        }
    }
}
