//! Element types and the reduction kernels over little-endian bytes (the operators are
//! [`crate::reduce_op`]'s).
//!
//! Everything here works on byte slices, so buffers read out of registered memory need no
//! typed view (and the crate no `unsafe`). 16-bit floats are widened to f32 for every
//! operation and rounded once when stored; their kernels live in [`crate::half_float`]. This
//! module never moves data between ranks.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::half_float;
use crate::reduce_op::ReduceOp;

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

/// Operators as const parameters, so each kernel below is compiled once per operator with the
/// `match` in [`Lane::apply`] folded away: the loops then vectorise (a runtime operator per
/// element kept them scalar, about 8× slower at 16 KiB of f32).
const SUM: u8 = 0;
const PROD: u8 = 1;
const MIN: u8 = 2;
const MAX: u8 = 3;

#[inline(always)]
fn op_of(code: u8) -> ReduceOp {
    match code {
        SUM => ReduceOp::Sum,
        PROD => ReduceOp::Prod,
        MIN => ReduceOp::Min,
        _ => ReduceOp::Max,
    }
}

/// How a kernel combines its operands.
#[derive(Clone, Copy)]
enum Form {
    /// `acc = acc op x`.
    Right,
    /// `acc = x op acc`.
    Left,
}

fn zip_lanes<L: Lane, const OP: u8>(form: Form, acc: &mut [u8], x: &[u8]) {
    let op = op_of(OP);
    let pairs = acc.chunks_exact_mut(L::N).zip(x.chunks_exact(L::N));
    match form {
        Form::Right => pairs.for_each(|(a, b)| L::apply(op, L::load(a), L::load(b)).store(a)),
        Form::Left => pairs.for_each(|(a, b)| L::apply(op, L::load(b), L::load(a)).store(a)),
    }
}

fn zip3_lanes<L: Lane, const OP: u8>(out: &mut [u8], a: &[u8], b: &[u8]) {
    let op = op_of(OP);
    for ((o, x), y) in out
        .chunks_exact_mut(L::N)
        .zip(a.chunks_exact(L::N))
        .zip(b.chunks_exact(L::N))
    {
        L::apply(op, L::load(x), L::load(y)).store(o);
    }
}

fn combine_lane<L: Lane>(op: ReduceOp, form: Form, acc: &mut [u8], x: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_lanes::<L, SUM>(form, acc, x),
        ReduceOp::Prod => zip_lanes::<L, PROD>(form, acc, x),
        ReduceOp::Min => zip_lanes::<L, MIN>(form, acc, x),
        ReduceOp::Max => zip_lanes::<L, MAX>(form, acc, x),
    }
}

fn combine3_lane<L: Lane>(op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip3_lanes::<L, SUM>(out, a, b),
        ReduceOp::Prod => zip3_lanes::<L, PROD>(out, a, b),
        ReduceOp::Min => zip3_lanes::<L, MIN>(out, a, b),
        ReduceOp::Max => zip3_lanes::<L, MAX>(out, a, b),
    }
}

fn divide_lane<L: Lane>(buf: &mut [u8], n: usize) {
    for a in buf.chunks_exact_mut(L::N) {
        L::load(a).divide(n).store(a);
    }
}

/// Runs `half_float::$f` for the 16-bit float `$dtype`: the bf16 kernel or the f16 one.
macro_rules! half {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        if $dtype == DType::Bf16 {
            half_float::$f::<true>($($arg),*)
        } else {
            half_float::$f::<false>($($arg),*)
        }
    };
}

/// Runs the lane kernel `$f` for `$dtype`, or `$half` for the 16-bit floats, which have kernels
/// of their own ([`crate::half_float`]).
macro_rules! dispatch {
    ($dtype:expr, $half:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 | DType::Bf16 => $half,
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
    combine_form(dtype, op, Form::Right, acc, x)
}

/// [`combine`] with the operand order given: `acc op x` or `x op acc`. (The 16-bit float
/// operators are commutative bit for bit, NaN included, so their kernels ignore it.)
fn combine_form(dtype: DType, op: ReduceOp, form: Form, acc: &mut [u8], x: &[u8]) {
    dispatch!(
        dtype,
        half!(dtype, combine(op, acc, x)),
        combine_lane,
        op,
        form,
        acc,
        x
    )
}

/// `out = a op b`, element-wise, in one pass (as [`combine`] on a copy of `a`, without the copy).
pub(crate) fn combine_into(dtype: DType, op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    dispatch!(
        dtype,
        half!(dtype, combine3(op, out, a, b)),
        combine3_lane,
        op,
        out,
        a,
        b
    )
}

/// Divides every element by `world` (the last step of avg).
pub fn finish_avg(dtype: DType, buf: &mut [u8], world: usize) {
    dispatch!(
        dtype,
        half!(dtype, divide(buf, world)),
        divide_lane,
        buf,
        world
    )
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
    let mut scratch = FoldScratch {
        wide: std::mem::take(wide),
        partial: Vec::new(),
    };
    fold_ranks(
        Fold {
            dtype,
            op,
            world: inputs.len(),
            local: None,
        },
        out,
        &|p, f| f(inputs[p].as_ref()),
        &mut scratch,
    );
    *wide = scratch.wide;
}

/// Buffers a reduction reuses from call to call.
#[derive(Debug, Default)]
pub(crate) struct FoldScratch {
    /// f32 accumulator for 16-bit floats.
    pub wide: Vec<f32>,
    /// The earlier ranks' partial result when this rank's input is already in the output.
    pub partial: Vec<u8>,
}

/// What a [`fold_ranks`] reduces.
#[derive(Clone, Copy)]
pub(crate) struct Fold<'a> {
    pub dtype: DType,
    pub op: ReduceOp,
    /// Contributions, one per rank.
    pub world: usize,
    /// This rank and its contribution: a separate input, or `None` when it is already in the
    /// output (in place). `None` altogether when every contribution comes from `peer`.
    pub local: Option<(usize, Option<&'a [u8]>)>,
}

/// Lends rank `p`'s contribution to the closure it is given (see [`fold_ranks`]).
pub(crate) type Lend<'a> = &'a dyn Fn(usize, &mut dyn FnMut(&[u8]));

/// Reduces one contribution per rank into `out`, in rank order (`((x0 op x1) op x2) …`, then
/// the division of avg; 16-bit floats accumulate in f32 and round once), so every rank gets the
/// same bits. Every contribution but the local one is lent by `peer(p, f)`, which calls `f`
/// with rank `p`'s bytes — a view of a received slot, so nothing is copied on the way in.
pub(crate) fn fold_ranks(
    fold: Fold<'_>,
    out: &mut [u8],
    peer: Lend<'_>,
    scratch: &mut FoldScratch,
) {
    let Fold {
        dtype, op, world, ..
    } = fold;
    if world == 0 {
        return;
    }
    let (local, input) = fold.local.unwrap_or((usize::MAX, None));
    match dtype {
        // Two ranks: `round(f32(x0) op f32(x1))` is what the 16-bit lanes compute directly, one
        // rounding as in the f32 accumulator, so skip the accumulator's three passes (avg would
        // round twice that way: it keeps the accumulator).
        DType::F16 | DType::Bf16 if world == 2 && op != ReduceOp::Avg => {}
        DType::F16 | DType::Bf16 => {
            let wide = &mut scratch.wide;
            for p in 0..world {
                let mut step = |x: &[u8]| match (p, dtype) {
                    (0, DType::Bf16) => half_float::widen::<true>(wide, x),
                    (0, _) => half_float::widen::<false>(wide, x),
                    (_, DType::Bf16) => half_float::widen_combine::<true>(op, wide, x),
                    _ => half_float::widen_combine::<false>(op, wide, x),
                };
                match (p == local, input) {
                    (true, Some(x)) => step(x),
                    (true, None) => step(out),
                    _ => peer(p, &mut step),
                }
            }
            let divisor = if op == ReduceOp::Avg {
                world as f32
            } else {
                1.0
            };
            half!(dtype, narrow(divisor, out, wide));
            return;
        }
        _ => {}
    }
    // With rank p's bytes, whichever side holds them (never the in-place output).
    let with = |p: usize, f: &mut dyn FnMut(&[u8])| match (p == local, input) {
        (true, Some(x)) => f(x),
        _ => peer(p, f),
    };
    let in_place = local < world && input.is_none();
    let next = if in_place {
        match local {
            // `out` already holds x0.
            0 => {}
            // out = x0 op out.
            1 => with(0, &mut |x0| combine_form(dtype, op, Form::Left, out, x0)),
            _ => {
                let partial = &mut scratch.partial;
                partial.resize(out.len(), 0);
                with(0, &mut |x0| tbrdma_verbs::copy_slice(partial, x0));
                for p in 1..local {
                    with(p, &mut |x| combine(dtype, op, partial, x));
                }
                combine_form(dtype, op, Form::Left, out, partial);
            }
        }
        local + 1
    } else if world == 1 {
        with(0, &mut |x0| tbrdma_verbs::copy_slice(out, x0));
        1
    } else {
        // out = x0 op x1 in one pass, with no copy of x0 first.
        with(0, &mut |x0| {
            with(1, &mut |x1| combine_into(dtype, op, out, x0, x1))
        });
        2
    };
    for p in next..world {
        with(p, &mut |x| combine(dtype, op, out, x));
    }
    if op == ReduceOp::Avg {
        finish_avg(dtype, out, world);
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

    /// Rank-order reference, one element at a time on typed values.
    fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
        fn typed<T: Element + Copy>(
            inputs: &[Vec<u8>],
            zero: T,
            step: impl Fn(T, T) -> T,
            finish: impl Fn(T) -> T,
        ) -> Vec<u8> {
            let n = inputs[0].len() / std::mem::size_of::<T>();
            let vals: Vec<Vec<T>> = inputs
                .iter()
                .map(|b| {
                    let mut v = vec![zero; n];
                    T::from_bytes(b, &mut v);
                    v
                })
                .collect();
            let acc: Vec<T> = (0..n)
                .map(|i| finish(vals[1..].iter().fold(vals[0][i], |a, v| step(a, v[i]))))
                .collect();
            let mut out = Vec::new();
            T::to_bytes(&acc, &mut out);
            out
        }
        let world = inputs.len();
        match dtype {
            DType::F32 => typed(
                inputs,
                0f32,
                |a, b| f32::apply(op, a, b),
                |a| {
                    if op == ReduceOp::Avg {
                        a / world as f32
                    } else {
                        a
                    }
                },
            ),
            DType::I32 => typed(
                inputs,
                0i32,
                |a, b| i32::apply(op, a, b),
                |a| {
                    if op == ReduceOp::Avg {
                        a.divide(world)
                    } else {
                        a
                    }
                },
            ),
            DType::Bf16 | DType::F16 => {
                // Widen every input, reduce in f32, round once.
                let widen = |b: &[u8]| -> f32 {
                    let bits = u16::from_le_bytes([b[0], b[1]]);
                    if dtype == DType::Bf16 {
                        bf16::from_bits(bits).to_f32()
                    } else {
                        f16::from_bits(bits).to_f32()
                    }
                };
                let wide: Vec<Vec<u8>> = inputs
                    .iter()
                    .map(|b| bytes(&b.chunks_exact(2).map(widen).collect::<Vec<f32>>()))
                    .collect();
                let sum = reference(DType::F32, op, &wide);
                let mut f = vec![0f32; sum.len() / 4];
                f32::from_bytes(&sum, &mut f);
                // A NaN result is the canonical NaN (see `half_float`).
                if dtype == DType::Bf16 {
                    let round = |v: f32| match v.is_nan() {
                        true => bf16::from_bits(half_float::BF16_NAN),
                        false => bf16::from_f32(v),
                    };
                    bytes(&f.iter().map(|&v| round(v)).collect::<Vec<bf16>>())
                } else {
                    let round = |v: f32| match v.is_nan() {
                        true => f16::from_bits(half_float::F16_NAN),
                        false => f16::from_f32(v),
                    };
                    bytes(&f.iter().map(|&v| round(v)).collect::<Vec<f16>>())
                }
            }
            _ => unreachable!("not used by the test"),
        }
    }

    #[test]
    fn fold_matches_the_rank_order_reference_wherever_the_local_input_sits() {
        let mut seed = 0x9e37_79b9u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        let mut scratch = FoldScratch::default();
        for dtype in [DType::F32, DType::I32, DType::Bf16, DType::F16] {
            for world in 1..=4 {
                // Magnitudes from 1e-3 to 1e5 so a sum in another order gives other bits.
                let inputs: Vec<Vec<u8>> = (0..world)
                    .map(|_| {
                        let vals: Vec<f32> = (0..37)
                            .map(|_| {
                                let m = (next() % 1000) as f32 - 500.0;
                                m * 10f32.powi((next() % 9) as i32 - 3)
                            })
                            .collect();
                        match dtype {
                            DType::F32 => bytes(&vals),
                            DType::I32 => {
                                bytes(&vals.iter().map(|&v| v as i32).collect::<Vec<_>>())
                            }
                            DType::F16 => {
                                bytes(&vals.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>())
                            }
                            _ => {
                                bytes(&vals.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>())
                            }
                        }
                    })
                    .collect();
                for op in ReduceOp::ALL {
                    let want = reference(dtype, op, &inputs);
                    let mut locals = vec![None];
                    for r in 0..world {
                        locals.push(Some((r, true)));
                        locals.push(Some((r, false)));
                    }
                    for local in locals {
                        // In place: the output starts as the local input.
                        let mut out = match local {
                            Some((r, false)) => inputs[r].clone(),
                            _ => vec![0xAA; inputs[0].len()],
                        };
                        let peer = |p: usize, f: &mut dyn FnMut(&[u8])| {
                            assert!(local.is_none_or(|(r, _)| r != p), "asked for its own input");
                            f(&inputs[p])
                        };
                        let fold = Fold {
                            dtype,
                            op,
                            world,
                            local: local
                                .map(|(r, separate)| (r, separate.then_some(&inputs[r][..]))),
                        };
                        fold_ranks(fold, &mut out, &peer, &mut scratch);
                        assert_eq!(out, want, "{dtype} {op} world {world} local {local:?}");
                    }
                }
            }
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
