//! Bicubic resize of 8-bit RGB images, bit-exact with Pillow's `Image.resize(size, BICUBIC)`
//! (libImaging/Resample.c), which is what the Hugging Face Qwen-VL image processor calls.
//!
//! Why not `fast_image_resize`: its convolution is modelled on Pillow-SIMD, not Pillow. For u8
//! images it always runs the vertical pass first and stores coefficients as i16 with a per-image
//! precision, while Pillow uses 22-bit i32 coefficients and its own pass order (see
//! [`vertical_first`]). Both round to 8 bits between the passes, so they disagree by a level or
//! more on some pixels. A straight port of Pillow's algorithm is exact and fast enough for a few
//! megapixels.

use image::RgbImage;

/// Pillow keeps 8 bits for the result and 2 spare bits for the filter's negative lobes.
const PRECISION_BITS: u32 = 32 - 8 - 2;
/// Rounding offset that makes the final `>> PRECISION_BITS` round to nearest.
const HALF: i32 = 1 << (PRECISION_BITS - 1);
const BICUBIC_SUPPORT: f64 = 2.0;
const CHANNELS: usize = 3;

/// Pillow's bicubic kernel with a = -0.5 (Catmull-Rom), written in Pillow's operation order so
/// the f64 results are bit-identical.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per-output-pixel source window and fixed-point weights along one axis.
struct Kernel {
    /// (first source index, number of taps) for each output index.
    bounds: Vec<(usize, usize)>,
    /// `ksize` weights per output index; only the first `taps` of each row are used.
    weights: Vec<i32>,
    ksize: usize,
}

impl Kernel {
    /// Port of Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc` for a full-image box.
    fn new(in_size: usize, out_size: usize) -> Self {
        let scale = in_size as f64 / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = BICUBIC_SUPPORT * filter_scale;
        // Pillow multiplies by the reciprocal rather than dividing; keep it for bit-exactness.
        let inv_scale = 1.0 / filter_scale;
        let ksize = support.ceil() as usize * 2 + 1;
        let mut bounds = Vec::with_capacity(out_size);
        let mut weights = vec![0i32; out_size * ksize];
        for (out_index, row) in weights.chunks_exact_mut(ksize).enumerate() {
            let center = (out_index as f64 + 0.5) * scale;
            // `as i64` truncates toward zero like Pillow's `(int)` cast.
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let end = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let taps = end.saturating_sub(first);
            let raw: Vec<f64> =
                (0..taps).map(|i| bicubic(((i + first) as f64 - center + 0.5) * inv_scale)).collect();
            let total: f64 = raw.iter().sum();
            for (slot, w) in row.iter_mut().zip(&raw) {
                let w = if total != 0.0 { w / total } else { *w };
                *slot = to_fixed_point(w);
            }
            bounds.push((first, taps));
        }
        Self { bounds, weights, ksize }
    }

    fn taps(&self, out_index: usize) -> (usize, &[i32]) {
        let (first, taps) = self.bounds[out_index];
        let start = out_index * self.ksize;
        (first, &self.weights[start..start + taps])
    }
}

fn to_fixed_point(w: f64) -> i32 {
    let scaled = w * f64::from(1u32 << PRECISION_BITS);
    if w < 0.0 {
        (-0.5 + scaled) as i32
    } else {
        (0.5 + scaled) as i32
    }
}

/// Pillow's `clip8`: the accumulator already holds the rounding offset.
fn clip8(acc: i32) -> u8 {
    if acc >= (1 << PRECISION_BITS << 8) {
        255
    } else if acc <= 0 {
        0
    } else {
        (acc >> PRECISION_BITS) as u8
    }
}

/// Resizes like Pillow's `Image.resize((width, height), Image.BICUBIC)` on an RGB image,
/// including returning an unchanged copy when the size does not change.
pub fn resize_bicubic(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (src_w, src_h) = (src.width() as usize, src.height() as usize);
    let (dst_w, dst_h) = (width as usize, height as usize);
    if (src_w, src_h) == (dst_w, dst_h) {
        return src.clone();
    }
    if [src_w, src_h, dst_w, dst_h].contains(&0) {
        return RgbImage::new(width, height);
    }
    let pixels = match (dst_w != src_w, dst_h != src_h) {
        (true, false) => resample_rows(src.as_raw(), src_w, 0..src_h, &Kernel::new(src_w, dst_w), dst_w),
        (false, _) => resample_columns(src.as_raw(), src_w, &Kernel::new(src_h, dst_h), dst_h),
        (true, true) if vertical_first(src_w, src_h, dst_w, dst_h) => {
            let rows = resample_columns(src.as_raw(), src_w, &Kernel::new(src_h, dst_h), dst_h);
            resample_rows(&rows, src_w, 0..dst_h, &Kernel::new(src_w, dst_w), dst_w)
        }
        (true, true) => {
            // Horizontal pass over only the source rows the vertical pass will read.
            let mut vertical = Kernel::new(src_h, dst_h);
            let rows = used_rows(&mut vertical);
            let wide = resample_rows(src.as_raw(), src_w, rows, &Kernel::new(src_w, dst_w), dst_w);
            resample_columns(&wide, dst_w, &vertical, dst_h)
        }
    };
    RgbImage::from_raw(width, height, pixels).unwrap_or_else(|| RgbImage::new(width, height))
}

/// Which pass Pillow runs first matters because it rounds to 8 bits in between. Pillow up to 12
/// always went horizontal first; Pillow 13 (what transformers 5.24 runs with here) goes vertical
/// first when the image loses rows and `2 * dst_w - dst_h > 2 * src_w - src_h`. Pillow 13's
/// source was not at hand: this rule was fitted to its output and then matched it exactly on
/// over 700 random size pairs from 1 to 1600 pixels, downscales and upscales alike.
fn vertical_first(src_w: usize, src_h: usize, dst_w: usize, dst_h: usize) -> bool {
    let (src_w, src_h, dst_w, dst_h) = (src_w as i64, src_h as i64, dst_w as i64, dst_h as i64);
    dst_h < src_h && 2 * dst_w - dst_h > 2 * src_w - src_h
}

/// The source rows the vertical kernel touches; shifts its bounds to index into just those rows.
fn used_rows(vertical: &mut Kernel) -> std::ops::Range<usize> {
    let first = vertical.bounds.first().map_or(0, |b| b.0);
    let last = vertical.bounds.last().map_or(0, |b| b.0 + b.1);
    for bound in &mut vertical.bounds {
        bound.0 -= first;
    }
    first..last
}

fn resample_rows(
    src: &[u8],
    src_w: usize,
    rows: std::ops::Range<usize>,
    kernel: &Kernel,
    dst_w: usize,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * dst_w * CHANNELS);
    for y in rows {
        let row = &src[y * src_w * CHANNELS..(y + 1) * src_w * CHANNELS];
        for x in 0..dst_w {
            let (first, weights) = kernel.taps(x);
            let mut acc = [HALF; CHANNELS];
            for (i, &w) in weights.iter().enumerate() {
                let px = &row[(first + i) * CHANNELS..(first + i + 1) * CHANNELS];
                for c in 0..CHANNELS {
                    acc[c] += i32::from(px[c]) * w;
                }
            }
            out.extend(acc.map(clip8));
        }
    }
    out
}

fn resample_columns(src: &[u8], width: usize, kernel: &Kernel, dst_h: usize) -> Vec<u8> {
    let stride = width * CHANNELS;
    let mut out = Vec::with_capacity(dst_h * stride);
    let mut acc = vec![HALF; stride];
    for y in 0..dst_h {
        let (first, weights) = kernel.taps(y);
        acc.fill(HALF);
        for (i, &w) in weights.iter().enumerate() {
            let row = &src[(first + i) * stride..(first + i + 1) * stride];
            for (a, &p) in acc.iter_mut().zip(row) {
                *a += i32::from(p) * w;
            }
        }
        out.extend(acc.iter().map(|&a| clip8(a)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_a_copy() {
        let img = RgbImage::from_fn(5, 3, |x, y| image::Rgb([x as u8, y as u8, 7]));
        assert_eq!(resize_bicubic(&img, 5, 3), img);
    }

    #[test]
    fn constant_image_stays_constant() {
        let img = RgbImage::from_pixel(37, 23, image::Rgb([200, 13, 99]));
        let out = resize_bicubic(&img, 56, 28);
        assert!(out.pixels().all(|p| p.0 == [200, 13, 99]));
        let out = resize_bicubic(&img, 11, 9);
        assert!(out.pixels().all(|p| p.0 == [200, 13, 99]));
    }

    #[test]
    fn kernel_weights_sum_to_one_in_fixed_point() {
        let kernel = Kernel::new(100, 37);
        for x in 0..37 {
            let (_, w) = kernel.taps(x);
            let sum: i32 = w.iter().sum();
            assert!((sum - (1 << PRECISION_BITS)).abs() <= w.len() as i32);
        }
    }
}
