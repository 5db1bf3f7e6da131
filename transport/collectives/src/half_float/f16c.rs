//! The f16 kernels through F16C, the x86-64 instructions that widen eight f16 to f32 exactly
//! (VCVTPH2PS) and round eight f32 to f16, to nearest even (VCVTPS2PH): two instructions where
//! the portable conversions of the parent module take a few dozen per element pair, so an f16
//! reduction costs about what a bf16 one does instead of 5× more (figures:
//! `docs/performance.md`, "f16 through F16C").
//!
//! Same bits as the portable kernels: the hardware rounds exactly as [`super::from_f32`] does
//! (IEEE round to nearest even, subnormals kept, overflow to infinity), and the one place it
//! differs, the NaN it stores, is fixed here by canonicalising every NaN before rounding.
//! Widening quiets a signalling NaN, which changes no result: every result is rounded, and
//! rounding canonicalises NaN.
//!
//! These functions carry `#[target_feature]`: the parent's multiversioned kernels call them
//! from their F16C clones only (`match_target!`), so no caller needs `unsafe`. Data is in
//! native byte order, which on x86-64 is the little-endian order of the wire.

use std::arch::x86_64::{_MM_FROUND_TO_NEAREST_INT, _mm256_cvtph_ps, _mm256_cvtps_ph};

use super::{apply, from_f32, to_f32};

/// Elements per conversion instruction.
const LANES: usize = 8;

/// Eight f16 as f32, exactly.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn widen8(h: &[u16]) -> [f32; LANES] {
    let h: [u16; LANES] = h.try_into().expect("eight halves");
    bytemuck::cast(_mm256_cvtph_ps(bytemuck::cast(h)))
}

/// Eight f32 rounded to f16, to nearest even; a NaN becomes [`super::F16_NAN`].
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn narrow8(v: [f32; LANES]) -> [u16; LANES] {
    // The instruction keeps a NaN's sign and payload; the quiet f32 NaN becomes F16_NAN.
    let v = v.map(|x| {
        if x.is_nan() {
            f32::from_bits(0x7fc0_0000)
        } else {
            x
        }
    });
    bytemuck::cast(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
        bytemuck::cast(v),
    ))
}

/// Where the whole groups of eight end in a buffer of `len` elements.
fn whole(len: usize) -> usize {
    len / LANES * LANES
}

/// `acc = acc op x`.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn combine<const OP: u8>(acc: &mut [u16], x: &[u16]) {
    let end = whole(acc.len());
    for (p, q) in acc[..end]
        .chunks_exact_mut(LANES)
        .zip(x.chunks_exact(LANES))
    {
        let (a, b) = (widen8(p), widen8(q));
        p.copy_from_slice(&narrow8(std::array::from_fn(|i| apply::<OP>(a[i], b[i]))));
    }
    for (p, q) in acc[end..].iter_mut().zip(&x[end..]) {
        *p = from_f32::<false>(apply::<OP>(to_f32::<false>(*p), to_f32::<false>(*q)));
    }
}

/// `out = a op b`.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn combine3<const OP: u8>(out: &mut [u16], a: &[u16], b: &[u16]) {
    let end = whole(out.len());
    let groups = a.chunks_exact(LANES).zip(b.chunks_exact(LANES));
    for (o, (p, q)) in out[..end].chunks_exact_mut(LANES).zip(groups) {
        let (a, b) = (widen8(p), widen8(q));
        o.copy_from_slice(&narrow8(std::array::from_fn(|i| apply::<OP>(a[i], b[i]))));
    }
    for ((o, p), q) in out[end..].iter_mut().zip(&a[end..]).zip(&b[end..]) {
        *o = from_f32::<false>(apply::<OP>(to_f32::<false>(*p), to_f32::<false>(*q)));
    }
}

/// `wide = f32(x)`.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn widen(wide: &mut [f32], x: &[u16]) {
    let end = whole(wide.len());
    for (w, q) in wide[..end]
        .chunks_exact_mut(LANES)
        .zip(x.chunks_exact(LANES))
    {
        w.copy_from_slice(&widen8(q));
    }
    for (w, q) in wide[end..].iter_mut().zip(&x[end..]) {
        *w = to_f32::<false>(*q);
    }
}

/// `wide = wide op f32(x)`, unrounded.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn widen_combine<const OP: u8>(wide: &mut [f32], x: &[u16]) {
    let end = whole(wide.len());
    for (w, q) in wide[..end]
        .chunks_exact_mut(LANES)
        .zip(x.chunks_exact(LANES))
    {
        let b = widen8(q);
        for (w, b) in w.iter_mut().zip(b) {
            *w = apply::<OP>(*w, b);
        }
    }
    for (w, q) in wide[end..].iter_mut().zip(&x[end..]) {
        *w = apply::<OP>(*w, to_f32::<false>(*q));
    }
}

/// `out = round(wide / divisor)`.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn narrow(divisor: f32, out: &mut [u16], wide: &[f32]) {
    let end = whole(out.len());
    for (o, w) in out[..end]
        .chunks_exact_mut(LANES)
        .zip(wide.chunks_exact(LANES))
    {
        o.copy_from_slice(&narrow8(std::array::from_fn(|i| w[i] / divisor)));
    }
    for (o, w) in out[end..].iter_mut().zip(&wide[end..]) {
        *o = from_f32::<false>(w / divisor);
    }
}

/// `buf = round(f32(buf) / divisor)`.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn divide(buf: &mut [u16], divisor: f32) {
    let end = whole(buf.len());
    for p in buf[..end].chunks_exact_mut(LANES) {
        let a = widen8(p);
        p.copy_from_slice(&narrow8(a.map(|v| v / divisor)));
    }
    for p in &mut buf[end..] {
        *p = from_f32::<false>(to_f32::<false>(*p) / divisor);
    }
}
