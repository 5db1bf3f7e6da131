//! Element types, reduction operators and the reduction kernels over little-endian bytes.
//!
//! Everything here works on byte slices, so buffers read out of registered memory need no
//! typed view (and the crate no `unsafe`). 16-bit floats are widened to f32 for every
//! operation and rounded once when stored. This module never moves data between ranks.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

/// An element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary64.
    F64,
    /// IEEE binary16 (accumulated in f32).
    F16,
    /// bfloat16 (accumulated in f32).
    Bf16,
    /// Signed 8-bit integer (wrapping).
    I8,
    /// Unsigned 8-bit integer (wrapping).
    U8,
    /// Signed 32-bit integer (wrapping).
    I32,
    /// Signed 64-bit integer (wrapping).
    I64,
}

impl DType {
    /// Every supported type.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::Bf16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::Bf16 => 2,
            DType::I8 | DType::U8 => 1,
        }
    }

    /// Name as the tools print it (nccl-tests spells f32 `float`; we use the Rust names).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    /// Whether it is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::Bf16)
    }

    /// Bit set of every supported type, exchanged in the configuration digest.
    pub fn support_mask() -> u32 {
        DType::ALL
            .iter()
            .enumerate()
            .fold(0, |m, (i, _)| m | (1 << i))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => DType::F32,
            "f64" | "double" | "float64" => DType::F64,
            "f16" | "half" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::Bf16,
            "i8" | "int8" => DType::I8,
            "u8" | "uint8" => DType::U8,
            "i32" | "int" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            _ => {
                return Err(format!(
                    "unknown type {s:?} (f32 f64 f16 bf16 i8 u8 i32 i64)"
                ));
            }
        })
    }
}

/// A reduction operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Sum divided by the number of ranks (truncating for integers).
    Avg,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// Name as the tools print it.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            _ => return Err(format!("unknown operator {s:?} (sum prod min max avg)")),
        })
    }
}

/// A Rust type that maps to a [`DType`], for the typed collective calls.
pub trait Element: Copy + Send + Sync + 'static {
    /// Its element type.
    const DTYPE: DType;
    /// Appends little-endian bytes of `values` to `out` (cleared first).
    fn to_bytes(values: &[Self], out: &mut Vec<u8>);
    /// Overwrites `values` from little-endian `bytes` (same element count).
    fn from_bytes(bytes: &[u8], values: &mut [Self]);
}

macro_rules! element {
    ($t:ty, $d:expr, $n:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn to_bytes(values: &[Self], out: &mut Vec<u8>) {
                out.clear();
                out.reserve(values.len() * $n);
                for v in values {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            fn from_bytes(bytes: &[u8], values: &mut [Self]) {
                for (v, b) in values.iter_mut().zip(bytes.chunks_exact($n)) {
                    *v = <$t>::from_le_bytes(b.try_into().expect("element width"));
                }
            }
        }
    };
}

element!(f32, DType::F32, 4);
element!(f64, DType::F64, 8);
element!(f16, DType::F16, 2);
element!(bf16, DType::Bf16, 2);
element!(i8, DType::I8, 1);
element!(u8, DType::U8, 1);
element!(i32, DType::I32, 4);
element!(i64, DType::I64, 8);

/// One element type's arithmetic, on its little-endian encoding.
trait Lane: Copy {
    const N: usize;
    fn load(b: &[u8]) -> Self;
    fn store(self, b: &mut [u8]);
    fn apply(op: ReduceOp, a: Self, b: Self) -> Self;
    fn divide(self, n: usize) -> Self;
}

macro_rules! float_lane {
    ($t:ty, $n:expr) => {
        impl Lane for $t {
            const N: usize = $n;
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("element width"))
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes());
            }
            #[inline(always)]
            fn apply(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            #[inline(always)]
            fn divide(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}

macro_rules! int_lane {
    ($t:ty, $n:expr) => {
        impl Lane for $t {
            const N: usize = $n;
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("element width"))
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes());
            }
            #[inline(always)]
            fn apply(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            #[inline(always)]
            fn divide(self, n: usize) -> Self {
                // n is a rank count (at most a few hundred); for u8 and i8 a count that does not
                // fit leaves the value as is, which cannot happen for real worlds.
                match <$t>::try_from(n) {
                    Ok(d) if d != 0 => self.wrapping_div(d),
                    _ => self,
                }
            }
        }
    };
}

float_lane!(f32, 4);
float_lane!(f64, 8);
int_lane!(i8, 1);
int_lane!(u8, 1);
int_lane!(i32, 4);
int_lane!(i64, 8);

/// A 16-bit float lane: arithmetic in f32, one rounding per store.
#[derive(Clone, Copy)]
struct Half<const BF: bool>(f32);

impl<const BF: bool> Lane for Half<BF> {
    const N: usize = 2;
    #[inline(always)]
    fn load(b: &[u8]) -> Self {
        Half(half_to_f32::<BF>([b[0], b[1]]))
    }
    #[inline(always)]
    fn store(self, b: &mut [u8]) {
        b.copy_from_slice(&f32_to_half::<BF>(self.0));
    }
    #[inline(always)]
    fn apply(op: ReduceOp, a: Self, b: Self) -> Self {
        Half(f32::apply(op, a.0, b.0))
    }
    #[inline(always)]
    fn divide(self, n: usize) -> Self {
        Half(self.0 / n as f32)
    }
}

#[inline(always)]
fn half_to_f32<const BF: bool>(b: [u8; 2]) -> f32 {
    let bits = u16::from_le_bytes(b);
    if BF {
        // bf16 is the top half of an f32: widening is a shift (what `half` computes, written
        // so the compiler vectorises the loops around it).
        f32::from_bits(u32::from(bits) << 16)
    } else {
        f16::from_bits(bits).to_f32()
    }
}

/// f32 to bf16, rounding to nearest even, NaN kept quiet: bit-identical to
/// `half::bf16::from_f32` (a unit test checks), without its branches.
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    if v.is_nan() {
        ((x >> 16) | 0x40) as u16
    } else {
        let round = 0x7fff + ((x >> 16) & 1);
        (x.wrapping_add(round) >> 16) as u16
    }
}

#[inline(always)]
fn f32_to_half<const BF: bool>(v: f32) -> [u8; 2] {
    let bits = if BF {
        f32_to_bf16_bits(v)
    } else {
        f16::from_f32(v).to_bits()
    };
    bits.to_le_bytes()
}

fn combine_lane<L: Lane>(op: ReduceOp, acc: &mut [u8], x: &[u8]) {
    for (a, b) in acc.chunks_exact_mut(L::N).zip(x.chunks_exact(L::N)) {
        L::apply(op, L::load(a), L::load(b)).store(a);
    }
}

fn divide_lane<L: Lane>(buf: &mut [u8], n: usize) {
    for a in buf.chunks_exact_mut(L::N) {
        L::load(a).divide(n).store(a);
    }
}

macro_rules! dispatch {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<Half<false>>($($arg),*),
            DType::Bf16 => $f::<Half<true>>($($arg),*),
            DType::I8 => $f::<i8>($($arg),*),
            DType::U8 => $f::<u8>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
        }
    };
}

/// `acc = acc op x`, element-wise (avg adds; [`finish_avg`] divides). 16-bit floats are
/// rounded once per element. `acc` holds the earlier ranks' contribution: the operators are
/// commutative, so the order inside one step does not change the bits.
pub fn combine(dtype: DType, op: ReduceOp, acc: &mut [u8], x: &[u8]) {
    debug_assert_eq!(acc.len(), x.len());
    dispatch!(dtype, combine_lane, op, acc, x)
}

/// Divides every element by `world` (the last step of avg).
pub fn finish_avg(dtype: DType, buf: &mut [u8], world: usize) {
    dispatch!(dtype, divide_lane, buf, world)
}

/// Reduces `inputs` (one per rank, in rank order) into `out`: `((x0 op x1) op x2) …`, then
/// divides for avg. 16-bit floats accumulate in `wide` (f32) and are rounded once at the end,
/// so the result does not depend on anything but the inputs.
pub fn reduce_ranks<B: AsRef<[u8]>>(
    dtype: DType,
    op: ReduceOp,
    out: &mut [u8],
    inputs: &[B],
    wide: &mut Vec<f32>,
) {
    let world = inputs.len();
    let Some((first, rest)) = inputs.split_first() else {
        return;
    };
    match dtype {
        DType::F16 => reduce_wide::<false, B>(op, out, first.as_ref(), rest, world, wide),
        DType::Bf16 => reduce_wide::<true, B>(op, out, first.as_ref(), rest, world, wide),
        _ => {
            out.copy_from_slice(first.as_ref());
            for x in rest {
                combine(dtype, op, out, x.as_ref());
            }
            if op == ReduceOp::Avg {
                finish_avg(dtype, out, world);
            }
        }
    }
}

fn reduce_wide<const BF: bool, B: AsRef<[u8]>>(
    op: ReduceOp,
    out: &mut [u8],
    first: &[u8],
    rest: &[B],
    world: usize,
    wide: &mut Vec<f32>,
) {
    wide.clear();
    wide.extend(
        first
            .chunks_exact(2)
            .map(|b| half_to_f32::<BF>([b[0], b[1]])),
    );
    for x in rest {
        for (a, b) in wide.iter_mut().zip(x.as_ref().chunks_exact(2)) {
            *a = f32::apply(op, *a, half_to_f32::<BF>([b[0], b[1]]));
        }
    }
    for (o, a) in out.chunks_exact_mut(2).zip(wide.iter()) {
        let v = if op == ReduceOp::Avg {
            a / world as f32
        } else {
            *a
        };
        o.copy_from_slice(&f32_to_half::<BF>(v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Element>(v: &[T]) -> Vec<u8> {
        let mut out = Vec::new();
        T::to_bytes(v, &mut out);
        out
    }

    #[test]
    fn integer_operators_wrap_and_divide_truncating() {
        let a = bytes(&[100i8, -100, 7, 3]);
        let b = bytes(&[100i8, -100, -9, 2]);
        let mut wide = Vec::new();
        let mut out = vec![0u8; 4];
        reduce_ranks(DType::I8, ReduceOp::Sum, &mut out, &[&a, &b], &mut wide);
        assert_eq!(out, bytes(&[-56i8, 56, -2, 5]));
        reduce_ranks(DType::I8, ReduceOp::Avg, &mut out, &[&a, &b], &mut wide);
        assert_eq!(out, bytes(&[-28i8, 28, -1, 2]));
        reduce_ranks(DType::I8, ReduceOp::Min, &mut out, &[&a, &b], &mut wide);
        assert_eq!(out, bytes(&[100i8, -100, -9, 2]));
        reduce_ranks(DType::I8, ReduceOp::Prod, &mut out, &[&a, &b], &mut wide);
        assert_eq!(out, bytes(&[100i8.wrapping_mul(100), 16, -63, 6]));
    }

    #[test]
    fn half_types_accumulate_in_f32_and_round_once() {
        // 256 + 1 + 1 in bf16: rounding after each step loses both ones (bf16 has 8 bits of
        // mantissa), accumulating in f32 keeps them and rounds 258 exactly.
        let big = bytes(&[bf16::from_f32(256.0)]);
        let one = bytes(&[bf16::from_f32(1.0)]);
        let mut wide = Vec::new();
        let mut out = vec![0u8; 2];
        reduce_ranks(
            DType::Bf16,
            ReduceOp::Sum,
            &mut out,
            &[&big, &one, &one],
            &mut wide,
        );
        let mut got = [bf16::ZERO];
        bf16::from_bytes(&out, &mut got);
        assert_eq!(got[0].to_f32(), 258.0);
        // The per-step kernel rounds every time.
        let mut acc = big.clone();
        combine(DType::Bf16, ReduceOp::Sum, &mut acc, &one);
        combine(DType::Bf16, ReduceOp::Sum, &mut acc, &one);
        bf16::from_bytes(&acc, &mut got);
        assert_eq!(got[0].to_f32(), 256.0);
    }

    #[test]
    fn float_operators_and_avg() {
        let a = bytes(&[1.5f32, -2.0, 3.0]);
        let b = bytes(&[2.5f32, 4.0, -1.0]);
        let mut wide = Vec::new();
        let mut out = vec![0u8; 12];
        let mut got = [0f32; 3];
        for (op, want) in [
            (ReduceOp::Sum, [4.0, 2.0, 2.0]),
            (ReduceOp::Prod, [3.75, -8.0, -3.0]),
            (ReduceOp::Min, [1.5, -2.0, -1.0]),
            (ReduceOp::Max, [2.5, 4.0, 3.0]),
            (ReduceOp::Avg, [2.0, 1.0, 1.0]),
        ] {
            reduce_ranks(DType::F32, op, &mut out, &[&a, &b], &mut wide);
            f32::from_bytes(&out, &mut got);
            assert_eq!(got, want, "{op}");
        }
        let mut h = vec![0u8; 6];
        reduce_ranks(
            DType::F16,
            ReduceOp::Max,
            &mut h,
            &[
                &bytes(&[f16::from_f32(1.0), f16::from_f32(-3.0), f16::from_f32(0.5)]),
                &bytes(&[f16::from_f32(2.0), f16::from_f32(-4.0), f16::from_f32(0.25)]),
            ],
            &mut wide,
        );
        assert_eq!(
            h,
            bytes(&[f16::from_f32(2.0), f16::from_f32(-3.0), f16::from_f32(0.5)])
        );
    }

    #[test]
    fn bf16_conversions_match_the_half_crate() {
        let mut x = 0x1234_5678u32;
        let mut values: Vec<f32> = vec![0.0, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, f32::INFINITY];
        values.extend([
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0x3f80_8000),
        ]);
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            values.push(f32::from_bits(x));
        }
        for v in values {
            assert_eq!(
                f32_to_bf16_bits(v),
                bf16::from_f32(v).to_bits(),
                "{v:e} {:#x}",
                v.to_bits()
            );
            let b = bf16::from_f32(v).to_bits().to_le_bytes();
            assert_eq!(
                half_to_f32::<true>(b).to_bits(),
                bf16::from_bits(u16::from_le_bytes(b)).to_f32().to_bits()
            );
        }
    }

    #[test]
    fn names_parse_back() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
        }
        for op in ReduceOp::ALL {
            assert_eq!(op.name().parse::<ReduceOp>(), Ok(op));
        }
        assert!("f8".parse::<DType>().is_err());
    }
}
