//! `x Wᵀ` for a few rows of f32 activations against a row-major weight in bf16, f16 or f32, on an
//! x86 CPU with AVX2, FMA and F16C (and, for bf16, AVX-512 where the CPU has it: [`avx512`]). It is
//! for CPUs without matrix instructions for bf16 (an AVX2-only EPYC of the Zen 3 generation, most
//! Intel client CPUs, and CPUs with AVX512-BF16 but no AMX): there libtorch's bf16 GEMM either
//! converts its operands element by element (AVX2: a 16-row pass costs about 16 one-row steps,
//! and its bf16 matrix-vector product reaches about 10 GB/s of the ~24 a core streams) or runs on
//! `vdpbf16ps`, which retires half the products a second of the f32 FMA on a Sapphire-Rapids-class
//! core. The weight converted to f32 a block at a time for MKL (the route
//! [`crate::layers::linear`] keeps for longer passes on AVX2) reads twice the bytes and pays MKL's
//! packing on every few-row call, and MKL's own f32 GEMM is slow at 2 to 16 rows too (2048 → 2048,
//! 4 rows: 1.10 ms against 0.51 here).
//!
//! Here each weight row is widened to f32 in registers (bf16: a 16-bit shift; f16: F16C) as it is
//! streamed, once per call, and multiplied against every activation row while it sits in the
//! core's caches. Every output element is summed the same way whatever the number of rows (its
//! lanes accumulated in order of the input index, the lanes added in one fixed order, then the
//! input's tail), so a row's result does not depend on how many rows share the call: a verify pass
//! over n rows and a one-row step compute each row's product bit for bit alike.
//!
//! Measured on one core of a Zen 3 EPYC, bf16, against libtorch's bf16 GEMM and the f32 blocks:
//! 2048 → 151,936 (a Qwen LM head) one row 38 against 63 ms, 4 rows 51 against 194, 16 rows 143
//! against 285; 576 → 3072 (SmolLM2's gate/up) one row 0.09 against 0.36 ms, 16 rows 0.70 against
//! 1.40.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
mod avx512;

/// A weight matrix (n, k), row-major, in a format the kernel reads: bf16 or f16 bit patterns, or
/// f32.
#[derive(Clone, Copy, Debug)]
pub enum WeightRows<'a> {
    BFloat16(&'a [u16]),
    Float16(&'a [u16]),
    Float32(&'a [f32]),
}

impl WeightRows<'_> {
    fn len(&self) -> usize {
        match self {
            Self::BFloat16(bits) | Self::Float16(bits) => bits.len(),
            Self::Float32(values) => values.len(),
        }
    }
}

/// Whether this CPU runs [`multiply`].
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out (m, n) = x (m, k) · weightᵀ`, on AVX-512 where this CPU has it and the weight is bf16
/// ([`avx512`]), else on AVX2.
///
/// # Panics
/// When the slices' lengths disagree with `m`, `k` and `n`, or [`available`] is false.
pub fn multiply(x: &[f32], weight: WeightRows<'_>, dims: [usize; 3], out: &mut [f32]) {
    multiply_on(x, weight, dims, out, wide_available());
}

/// Whether this CPU runs the AVX-512 kernel.
fn wide_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`multiply`], on AVX-512 for a bf16 weight if `wide` (the CPU must have it).
fn multiply_on(x: &[f32], weight: WeightRows<'_>, [m, k, n]: [usize; 3], out: &mut [f32], wide: bool) {
    assert_eq!(x.len(), m * k, "x is not (m, k)");
    assert_eq!(weight.len(), n * k, "the weight is not (n, k)");
    assert_eq!(out.len(), m * n, "out is not (m, n)");
    assert!(available(), "skinny_gemm::multiply needs AVX2, FMA and F16C");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has the features (asserted; AVX-512 where `wide`, as the callers check) and
    // the slices have the asserted lengths, which are all the kernels read and write.
    unsafe {
        let (xp, outp, s) = (x.as_ptr(), out.as_mut_ptr(), Shape { m, k, n });
        match weight {
            WeightRows::BFloat16(bits) if wide => avx512::multiply_bf16(x, bits, [m, k, n], out),
            WeightRows::BFloat16(bits) => {
                multiply_all::<Bf16>(Operands { x: xp, w: bits.as_ptr(), out: outp, s })
            }
            WeightRows::Float16(bits) => {
                multiply_all::<F16>(Operands { x: xp, w: bits.as_ptr(), out: outp, s })
            }
            WeightRows::Float32(values) => {
                multiply_all::<F32>(Operands { x: xp, w: values.as_ptr(), out: outp, s })
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, out, wide);
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
}

/// A call's operands: `x` (m, k), the weight (n, k) in `B`, `out` (m, n), all row-major.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Operands<B> {
    x: *const f32,
    w: *const B,
    out: *mut f32,
    s: Shape,
}

/// Output columns per block: a multiple of every tile width below, so that a block's weight rows
/// (24 × k × 2 bytes: 96 KiB at k = 2048) stay in L2 while every group of activation rows passes.
#[cfg(target_arch = "x86_64")]
const BLOCK_COLUMNS: usize = 24;

/// A float format widened to f32.
#[cfg(target_arch = "x86_64")]
trait Widen {
    type Bits: Copy;
    /// Eight consecutive values as f32 lanes.
    unsafe fn load8(p: *const Self::Bits) -> __m256;
    fn widen(bits: Self::Bits) -> f32;
}

#[cfg(target_arch = "x86_64")]
struct F32;

#[cfg(target_arch = "x86_64")]
impl Widen for F32 {
    type Bits = f32;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }

    fn widen(value: f32) -> f32 {
        value
    }
}

#[cfg(target_arch = "x86_64")]
struct Bf16;

#[cfg(target_arch = "x86_64")]
impl Widen for Bf16 {
    type Bits = u16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u16) -> __m256 {
        let bits = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(p.cast()) });
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
    }

    fn widen(bits: u16) -> f32 {
        f32::from_bits(u32::from(bits) << 16)
    }
}

#[cfg(target_arch = "x86_64")]
struct F16;

#[cfg(target_arch = "x86_64")]
impl Widen for F16 {
    type Bits = u16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    fn widen(bits: u16) -> f32 {
        half::f16::from_bits(bits).to_f32()
    }
}

/// Column blocks outermost (their weight rows read from memory once), groups of up to four
/// activation rows inside, each group in tiles of as many columns as keep twelve accumulators in
/// registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn multiply_all<W: Widen>(ops: Operands<W::Bits>) {
    let s = ops.s;
    let full_blocks = s.n / BLOCK_COLUMNS * BLOCK_COLUMNS;
    for block in (0..full_blocks).step_by(BLOCK_COLUMNS) {
        for row in (0..s.m).step_by(4) {
            unsafe {
                match s.m - row {
                    1 => tiles::<W, 1, 8>(ops, row, block, BLOCK_COLUMNS),
                    2 => tiles::<W, 2, 6>(ops, row, block, BLOCK_COLUMNS),
                    3 => tiles::<W, 3, 4>(ops, row, block, BLOCK_COLUMNS),
                    _ => tiles::<W, 4, 3>(ops, row, block, BLOCK_COLUMNS),
                }
            }
        }
    }
    for row in (0..s.m).step_by(4) {
        let width = s.n - full_blocks;
        unsafe {
            match s.m - row {
                1 => tiles::<W, 1, 1>(ops, row, full_blocks, width),
                2 => tiles::<W, 2, 1>(ops, row, full_blocks, width),
                3 => tiles::<W, 3, 1>(ops, row, full_blocks, width),
                _ => tiles::<W, 4, 1>(ops, row, full_blocks, width),
            }
        }
    }
}

/// Columns `first .. first + width` (a multiple of `C`) of rows `row .. row + R`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiles<W: Widen, const R: usize, const C: usize>(
    ops: Operands<W::Bits>,
    row: usize,
    first: usize,
    width: usize,
) {
    for column in (first..first + width).step_by(C) {
        unsafe { tile::<W, R, C>(ops, row, column) };
    }
}

/// Rows `row .. row + R` by columns `column .. column + C`, every element summed as the module
/// documentation says.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<W: Widen, const R: usize, const C: usize>(ops: Operands<W::Bits>, row: usize, column: usize) {
    let Operands { x, w, out, s } = ops;
    let body = s.k / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    unsafe {
        let x_row = |r: usize| x.add((row + r) * s.k);
        let w_row = |c: usize| w.add((column + c) * s.k);
        for i in (0..body).step_by(8) {
            let mut wv = [_mm256_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = W::load8(w_row(c).add(i));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x_row(r).add(i));
                for (a, v) in acc_r.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, *v, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (c, a) in acc_r.iter().enumerate() {
                let mut sum = lane_sum(*a);
                for i in body..s.k {
                    sum += *x_row(r).add(i) * W::widen(*w_row(c).add(i));
                }
                *out.add((row + r) * s.n + column + c) = sum;
            }
        }
    }
}

/// The eight lanes added in one fixed order.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_sum(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps::<1>(pair, pair)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic spread of values in [-0.5, 0.5).
    fn values(count: usize, seed: usize) -> Vec<f32> {
        (0..count).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 1000.0 - 0.5).collect()
    }

    /// A weight in each format, with its values as the kernel reads them.
    #[derive(Clone)]
    enum Stored {
        BFloat16(Vec<u16>),
        Float16(Vec<u16>),
        Float32(Vec<f32>),
    }

    impl Stored {
        fn all(weight: &[f32]) -> [Stored; 3] {
            [
                Stored::BFloat16(weight.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()),
                Stored::Float16(weight.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect()),
                Stored::Float32(weight.to_vec()),
            ]
        }

        fn rows(&self) -> WeightRows<'_> {
            match self {
                Stored::BFloat16(bits) => WeightRows::BFloat16(bits),
                Stored::Float16(bits) => WeightRows::Float16(bits),
                Stored::Float32(values) => WeightRows::Float32(values),
            }
        }

        fn value(&self, i: usize) -> f64 {
            f64::from(match self {
                Stored::BFloat16(bits) => half::bf16::from_bits(bits[i]).to_f32(),
                Stored::Float16(bits) => half::f16::from_bits(bits[i]).to_f32(),
                Stored::Float32(values) => values[i],
            })
        }
    }

    /// `wide` (AVX-512) or not, for each kernel this CPU runs.
    fn kernels() -> Vec<bool> {
        [false, true].into_iter().filter(|&wide| available() && (!wide || wide_available())).collect()
    }

    #[test]
    fn every_element_is_the_dot_product_of_its_row_and_the_widened_weight_row() {
        // Inputs with and without a tail past the eight lanes; outputs short of one block, one
        // block and a tail, several blocks; every count of rows in a group of four, and two groups.
        for (k, n, wide) in [(3, 5), (8, 24), (67, 53), (192, 100)]
            .into_iter()
            .flat_map(|(k, n)| kernels().into_iter().map(move |wide| (k, n, wide)))
        {
            for weight in Stored::all(&values(n * k, 1)) {
                for m in [1, 2, 3, 4, 5, 7, 9] {
                    let x = values(m * k, m);
                    let mut out = vec![f32::NAN; m * n];
                    multiply_on(&x, weight.rows(), [m, k, n], &mut out, wide);
                    for (i, j) in (0..m).flat_map(|i| (0..n).map(move |j| (i, j))) {
                        let exact: f64 =
                            (0..k).map(|t| f64::from(x[i * k + t]) * weight.value(j * k + t)).sum();
                        let got = f64::from(out[i * n + j]);
                        let format = weight.rows();
                        assert!(
                            (got - exact).abs() <= 1e-5 * (1.0 + exact.abs()),
                            "{m}x{k}x{n} [{i}, {j}] of {format:?}, wide {wide}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_comes_out_bit_for_bit_alike_whatever_rows_share_the_call() {
        let (k, n) = (100, 61);
        let x = values(16 * k, 3);
        for (weight, wide) in Stored::all(&values(n * k, 2))
            .into_iter()
            .flat_map(|weight| kernels().into_iter().map(move |wide| (weight.clone(), wide)))
        {
            let mut pass = vec![0.0; 16 * n];
            multiply_on(&x, weight.rows(), [16, k, n], &mut pass, wide);
            for (m, first) in [(1, 0), (2, 1), (3, 5), (4, 12)] {
                let mut part = vec![0.0; m * n];
                multiply_on(&x[first * k..(first + m) * k], weight.rows(), [m, k, n], &mut part, wide);
                assert_eq!(
                    part,
                    pass[first * n..(first + m) * n],
                    "rows {first}..{}, wide {wide}",
                    first + m
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "the weight is not (n, k)")]
    fn a_weight_of_the_wrong_size_is_refused() {
        multiply(&[0.0; 8], WeightRows::BFloat16(&[0; 15]), [1, 8, 2], &mut [0.0; 2]);
    }
}
