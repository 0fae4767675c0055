//! The bf16 product on CPUs with AVX-512 (F and BW): sixteen f32 lanes per FMA instead of eight,
//! and a bf16 weight widened two instructions per 32 values (an even half by a 16-bit shift, an
//! odd half by masking off the low 16 bits) rather than by a zero-extending shuffle per eight.
//!
//! The odd/even split fixes where each input index lands: a 32-wide chunk of a weight row, read
//! as sixteen 32-bit lanes, holds index `2j` in lane `j`'s low half and `2j + 1` in its high half.
//! The activations are rearranged once per call to match (each chunk's sixteen even inputs, then
//! its sixteen odd ones, the last chunk zero-padded), so a chunk costs one load and two logic
//! instructions per weight row and four FMAs per activation row.
//!
//! AVX512-BF16's `vdpbf16ps` multiplies bf16 pairs directly but is not used: measured on one core
//! of a Sapphire-Rapids-class Xeon it retires 1.2-1.3 G instructions a second (41 G products)
//! against 5.4 G for the f32 FMA (86 G products), and a kernel built on it was no faster than the
//! eight-lane one at 4 to 64 rows.
//!
//! Every output element is summed in one fixed order whatever the number of rows: its sixteen
//! lanes accumulate chunk by chunk (the even product, then the odd), then
//! `_mm512_reduce_add_ps` adds the lanes in its fixed tree.

use std::arch::x86_64::*;
use std::cell::RefCell;

/// Input indices per chunk: one 512-bit load of bf16 weight.
const CHUNK: usize = 32;

/// Output columns per block, a multiple of every tile width below: the block's weight rows (24 ×
/// k × 2 bytes: 96 KiB at k = 2048) stay in L2 while every group of activation rows passes.
const BLOCK_COLUMNS: usize = 24;

/// Activation rows per group.
const GROUP_ROWS: usize = 4;

/// Whether this CPU runs [`multiply_bf16`].
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw")
}

thread_local! {
    /// The rearranged activations of the thread's last call, kept so that a call allocates
    /// nothing once the thread has seen its widest input.
    static ARRANGED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out (m, n) = x (m, k) · weightᵀ` for a bf16 weight (bit patterns).
///
/// # Safety
/// The CPU has AVX-512 F and BW ([`available`]), `x` holds m·k values, `weight` n·k and `out`
/// m·n.
pub(super) unsafe fn multiply_bf16(x: &[f32], weight: &[u16], [m, k, n]: [usize; 3], out: &mut [f32]) {
    ARRANGED.with_borrow_mut(|arranged| {
        arrange(x, m, k, arranged);
        let ops = Operands { x: arranged.as_ptr(), w: weight.as_ptr(), out: out.as_mut_ptr(), m, k, n };
        // SAFETY: the caller's guarantees, and `arranged` holds m rows of `padded(k)` values.
        unsafe { multiply_all(ops) }
    });
}

/// `k` rounded up to whole chunks: the length of a rearranged activation row.
fn padded(k: usize) -> usize {
    k.div_ceil(CHUNK) * CHUNK
}

/// Each row of `x` (m, k) chunk by chunk: the chunk's even-indexed values, then its odd ones; the
/// last chunk zero-padded.
fn arrange(x: &[f32], m: usize, k: usize, arranged: &mut Vec<f32>) {
    let row_len = padded(k);
    arranged.clear();
    arranged.resize(m * row_len, 0.0);
    for (row, to) in x.chunks_exact(k).zip(arranged.chunks_exact_mut(row_len)) {
        for (chunk, to) in row.chunks(CHUNK).zip(to.chunks_exact_mut(CHUNK)) {
            let (even, odd) = to.split_at_mut(CHUNK / 2);
            for (i, &value) in chunk.iter().enumerate() {
                if i % 2 == 0 {
                    even[i / 2] = value
                } else {
                    odd[i / 2] = value
                }
            }
        }
    }
}

/// A call's operands: the rearranged activations (m, padded k), the weight (n, k), `out` (m, n).
#[derive(Clone, Copy)]
struct Operands {
    x: *const f32,
    w: *const u16,
    out: *mut f32,
    m: usize,
    k: usize,
    n: usize,
}

/// Column blocks outermost (their weight rows read from memory once), groups of up to four
/// activation rows inside, each in tiles as wide as keep the accumulators, the activation chunks
/// and two widened weight halves in the 32 registers.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn multiply_all(ops: Operands) {
    let full_blocks = ops.n / BLOCK_COLUMNS * BLOCK_COLUMNS;
    let blocks = (0..full_blocks).step_by(BLOCK_COLUMNS).map(|first| (first, BLOCK_COLUMNS));
    let tail = (full_blocks < ops.n).then_some((full_blocks, ops.n - full_blocks));
    for (first, width) in blocks.chain(tail) {
        for row in (0..ops.m).step_by(GROUP_ROWS) {
            let rows = (ops.m - row).min(GROUP_ROWS);
            // SAFETY: rows and columns within the operands (the caller's guarantees).
            unsafe {
                match (rows, width == BLOCK_COLUMNS) {
                    (1, true) => tiles::<1, 8>(ops, row, first, width),
                    (2, true) => tiles::<2, 8>(ops, row, first, width),
                    (3, true) => tiles::<3, 6>(ops, row, first, width),
                    (_, true) => tiles::<4, 4>(ops, row, first, width),
                    (1, false) => tiles::<1, 1>(ops, row, first, width),
                    (2, false) => tiles::<2, 1>(ops, row, first, width),
                    (3, false) => tiles::<3, 1>(ops, row, first, width),
                    (_, false) => tiles::<4, 1>(ops, row, first, width),
                }
            }
        }
    }
}

/// Columns `first .. first + width` (a multiple of `C`) of rows `row .. row + R`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tiles<const R: usize, const C: usize>(ops: Operands, row: usize, first: usize, width: usize) {
    for column in (first..first + width).step_by(C) {
        unsafe { tile::<R, C>(ops, row, column) };
    }
}

/// Rows `row .. row + R` by columns `column .. column + C`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile<const R: usize, const C: usize>(ops: Operands, row: usize, column: usize) {
    let Operands { x, w, out, k, n, .. } = ops;
    let row_len = padded(k);
    // acc[c][r]: column c of row r, sixteen lanes.
    let mut acc = [[_mm512_setzero_ps(); R]; C];
    unsafe {
        let x_row = |r: usize| x.add((row + r) * row_len);
        let w_row = |c: usize| w.add((column + c) * k);
        for start in (0..k).step_by(CHUNK) {
            // Past the weight row's end the mask loads zeros, against the padding's zeros.
            let mask: __mmask32 = if k - start >= CHUNK { !0 } else { (1 << (k - start)) - 1 };
            let even_x: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(x_row(r).add(start)));
            let odd_x: [__m512; R] =
                std::array::from_fn(|r| _mm512_loadu_ps(x_row(r).add(start + CHUNK / 2)));
            for (c, acc_c) in acc.iter_mut().enumerate() {
                let (even_w, odd_w) = widen(w_row(c).add(start), mask);
                for (a, (&even, &odd)) in acc_c.iter_mut().zip(even_x.iter().zip(&odd_x)) {
                    *a = _mm512_fmadd_ps(even, even_w, *a);
                    *a = _mm512_fmadd_ps(odd, odd_w, *a);
                }
            }
        }
        for (c, acc_c) in acc.iter().enumerate() {
            for (r, a) in acc_c.iter().enumerate() {
                *out.add((row + r) * n + column + c) = _mm512_reduce_add_ps(*a);
            }
        }
    }
}

/// A chunk of bf16 weight (the lanes `mask` selects, zeros elsewhere) as its even-indexed and
/// odd-indexed values in f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen(p: *const u16, mask: __mmask32) -> (__m512, __m512) {
    let pairs = unsafe { _mm512_maskz_loadu_epi16(mask, p.cast()) };
    let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(pairs));
    let odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xffff_0000_u32 as i32)));
    (even, odd)
}
