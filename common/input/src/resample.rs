//! Bicubic resize of 8-bit RGB images, bit-exact with the two resizes transformers' Qwen-VL image
//! processors run, whichever backend `AutoImageProcessor` picks:
//! - Pillow's `Image.resize(size, BICUBIC)` (libImaging/Resample.c), in the PIL processor;
//! - torch's antialiased bicubic on uint8 tensors (`_upsample_bicubic2d_aa`, ATen's
//!   UpSampleKernel), which torchvision's `resize` calls in the torchvision processor.
//!
//! Both are separable convolutions with fixed-point weights and an 8-bit rounding between the
//! passes, and they differ in just the details that move a level here and there: the filter's
//! operation order, the weights' precision (Pillow: 22 bits; torch: as many as keep the largest
//! weight within an i16) and which pass runs first.
//!
//! Why not `fast_image_resize`: its convolution is modelled on Pillow-SIMD. For u8 images it
//! always runs the vertical pass first, which matches neither.

use image::RgbImage;

/// Whose bicubic a resize reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavour {
    Pillow,
    TorchAntialias,
}

/// Pillow keeps 8 bits for the result and 2 spare bits for the filter's negative lobes.
const PILLOW_PRECISION_BITS: u32 = 32 - 8 - 2;
/// torch stores weights as i16 and takes the largest precision below this many bits.
const TORCH_MAX_PRECISION_BITS: u32 = 22;
const BICUBIC_SUPPORT: f64 = 2.0;
const CHANNELS: usize = 3;
/// The bicubic's `a` both libraries use (Keys' Catmull-Rom choice).
const A: f64 = -0.5;

impl Flavour {
    /// The bicubic kernel, written in each library's operation order so the f64 weights are
    /// bit-identical to theirs (they differ on the outer lobe).
    fn filter(self, x: f64) -> f64 {
        let x = x.abs();
        if x < 1.0 {
            ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            match self {
                Flavour::Pillow => (((x - 5.0) * x + 8.0) * x - 4.0) * A,
                Flavour::TorchAntialias => ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A,
            }
        } else {
            0.0
        }
    }

    /// The fixed-point precision of one pass's weights, from its largest normalized weight.
    fn precision(self, max_weight: f64) -> u32 {
        match self {
            Flavour::Pillow => PILLOW_PRECISION_BITS,
            // ATen's `_compute_index_ranges_int16_weights`: stop at the first precision whose
            // next step would overflow an i16.
            Flavour::TorchAntialias => (0..TORCH_MAX_PRECISION_BITS)
                .find(|&p| (0.5 + max_weight * f64::from(1u32 << (p + 1))) as i32 >= 1 << 15)
                .unwrap_or(TORCH_MAX_PRECISION_BITS),
        }
    }

    /// Whether the vertical pass runs first (each rounds to 8 bits, so the order matters).
    fn vertical_first(self, src_w: usize, src_h: usize, dst_w: usize, dst_h: usize) -> bool {
        match self {
            Flavour::Pillow => pillow_vertical_first(src_w, src_h, dst_w, dst_h),
            // ATen resamples the contiguous (horizontal) dimension first, always.
            Flavour::TorchAntialias => false,
        }
    }
}

/// Per-output-pixel source window and fixed-point weights along one axis.
struct Kernel {
    /// (first source index, number of taps) for each output index.
    bounds: Vec<(usize, usize)>,
    /// `ksize` weights per output index; only the first `taps` of each row are used.
    weights: Vec<i32>,
    ksize: usize,
    /// Fractional bits of `weights`.
    precision: u32,
}

impl Kernel {
    /// Port of Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`, and of ATen's
    /// `_compute_indices_min_size_weights_aa` + `_compute_index_ranges_int16_weights`: the same
    /// window arithmetic, for a full-image box without align-corners.
    fn new(in_size: usize, out_size: usize, flavour: Flavour) -> Self {
        let scale = in_size as f64 / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = BICUBIC_SUPPORT * filter_scale;
        // Both multiply by the reciprocal rather than dividing; keep it for bit-exactness.
        let inv_scale = 1.0 / filter_scale;
        let ksize = support.ceil() as usize * 2 + 1;
        let mut bounds = Vec::with_capacity(out_size);
        let mut normalized = vec![0f64; out_size * ksize];
        for (out_index, row) in normalized.chunks_exact_mut(ksize).enumerate() {
            let center = (out_index as f64 + 0.5) * scale;
            // `as i64` truncates toward zero like the C `(int)` casts.
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let end = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let taps = end.saturating_sub(first).min(ksize);
            for (i, slot) in row[..taps].iter_mut().enumerate() {
                *slot = flavour.filter(((i + first) as f64 - center + 0.5) * inv_scale);
            }
            let total: f64 = row[..taps].iter().sum();
            if total != 0.0 {
                row[..taps].iter_mut().for_each(|w| *w /= total);
            }
            bounds.push((first, taps));
        }
        let max_weight = normalized.iter().copied().fold(0.0, f64::max);
        let precision = flavour.precision(max_weight);
        let weights = normalized.iter().map(|&w| to_fixed_point(w, precision)).collect();
        Self { bounds, weights, ksize, precision }
    }

    fn taps(&self, out_index: usize) -> (usize, &[i32]) {
        let (first, taps) = self.bounds[out_index];
        let start = out_index * self.ksize;
        (first, &self.weights[start..start + taps])
    }

    /// The accumulator's start: makes the final shift round to nearest.
    fn half(&self) -> i32 {
        1 << (self.precision - 1)
    }

    /// Pillow's `clip8` (torch's shift-and-clamp is the same function): the accumulator already
    /// holds the rounding offset.
    fn clip8(&self, acc: i32) -> u8 {
        (acc >> self.precision).clamp(0, 255) as u8
    }
}

fn to_fixed_point(w: f64, precision: u32) -> i32 {
    let scaled = w * f64::from(1u32 << precision);
    if w < 0.0 {
        (-0.5 + scaled) as i32
    } else {
        (0.5 + scaled) as i32
    }
}

/// Resizes like Pillow's `Image.resize((width, height), Image.BICUBIC)` on an RGB image,
/// including returning an unchanged copy when the size does not change.
pub fn resize_bicubic(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    resize(src, width, height, Flavour::Pillow)
}

/// Resizes like torchvision's `resize(image, (height, width), BICUBIC, antialias=True)` on a
/// uint8 CHW tensor of an RGB image (torch's native uint8 kernel, which torchvision calls on
/// CPU), unchanged when the size does not change.
pub fn resize_bicubic_torchvision(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    resize(src, width, height, Flavour::TorchAntialias)
}

fn resize(src: &RgbImage, width: u32, height: u32, flavour: Flavour) -> RgbImage {
    let (src_w, src_h) = (src.width() as usize, src.height() as usize);
    let (dst_w, dst_h) = (width as usize, height as usize);
    if (src_w, src_h) == (dst_w, dst_h) {
        return src.clone();
    }
    if [src_w, src_h, dst_w, dst_h].contains(&0) {
        return RgbImage::new(width, height);
    }
    let horizontal = || Kernel::new(src_w, dst_w, flavour);
    let vertical = || Kernel::new(src_h, dst_h, flavour);
    let pixels = match (dst_w != src_w, dst_h != src_h) {
        (true, false) => resample_rows(src.as_raw(), src_w, 0..src_h, &horizontal(), dst_w),
        (false, _) => resample_columns(src.as_raw(), src_w, &vertical(), dst_h),
        (true, true) if flavour.vertical_first(src_w, src_h, dst_w, dst_h) => {
            let rows = resample_columns(src.as_raw(), src_w, &vertical(), dst_h);
            resample_rows(&rows, src_w, 0..dst_h, &horizontal(), dst_w)
        }
        (true, true) => {
            // Horizontal pass over only the source rows the vertical pass will read.
            let mut vertical = vertical();
            let rows = used_rows(&mut vertical);
            let wide = resample_rows(src.as_raw(), src_w, rows, &horizontal(), dst_w);
            resample_columns(&wide, dst_w, &vertical, dst_h)
        }
    };
    RgbImage::from_raw(width, height, pixels).unwrap_or_else(|| RgbImage::new(width, height))
}

/// Pillow up to 12 always went horizontal first; Pillow 13 (what transformers 5.24 runs with
/// here) goes vertical first when the image loses rows and `2 * dst_w - dst_h > 2 * src_w - src_h`.
/// Pillow 13's source was not at hand: this rule was fitted to its output and then matched it
/// exactly on over 700 random size pairs from 1 to 1600 pixels, downscales and upscales alike.
fn pillow_vertical_first(src_w: usize, src_h: usize, dst_w: usize, dst_h: usize) -> bool {
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
            let mut acc = [kernel.half(); CHANNELS];
            for (i, &w) in weights.iter().enumerate() {
                let px = &row[(first + i) * CHANNELS..(first + i + 1) * CHANNELS];
                for c in 0..CHANNELS {
                    acc[c] += i32::from(px[c]) * w;
                }
            }
            out.extend(acc.map(|a| kernel.clip8(a)));
        }
    }
    out
}

fn resample_columns(src: &[u8], width: usize, kernel: &Kernel, dst_h: usize) -> Vec<u8> {
    let stride = width * CHANNELS;
    let mut out = Vec::with_capacity(dst_h * stride);
    let mut acc = vec![kernel.half(); stride];
    for y in 0..dst_h {
        let (first, weights) = kernel.taps(y);
        acc.fill(kernel.half());
        for (i, &w) in weights.iter().enumerate() {
            let row = &src[(first + i) * stride..(first + i + 1) * stride];
            for (a, &p) in acc.iter_mut().zip(row) {
                *a += i32::from(p) * w;
            }
        }
        out.extend(acc.iter().map(|&a| kernel.clip8(a)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: [fn(&RgbImage, u32, u32) -> RgbImage; 2] = [resize_bicubic, resize_bicubic_torchvision];

    #[test]
    fn same_size_is_a_copy() {
        let img = RgbImage::from_fn(5, 3, |x, y| image::Rgb([x as u8, y as u8, 7]));
        for resize in BOTH {
            assert_eq!(resize(&img, 5, 3), img);
        }
    }

    #[test]
    fn constant_image_stays_constant() {
        let img = RgbImage::from_pixel(37, 23, image::Rgb([200, 13, 99]));
        for resize in BOTH {
            for (w, h) in [(56, 28), (11, 9), (37, 5), (3, 23)] {
                let out = resize(&img, w, h);
                assert!(out.pixels().all(|p| p.0 == [200, 13, 99]), "{w}x{h}");
            }
        }
    }

    #[test]
    fn torch_precision_keeps_the_largest_weight_in_an_i16() {
        for (from, to) in [(100, 37), (37, 100), (1000, 3), (3, 1000), (28, 28 * 9)] {
            let kernel = Kernel::new(from, to, Flavour::TorchAntialias);
            let largest = kernel.weights.iter().copied().max().unwrap_or(0);
            let full = largest >= 1 << 14 || kernel.precision == TORCH_MAX_PRECISION_BITS;
            assert!(largest < 1 << 15 && full, "{from}->{to}: {largest}");
        }
    }

    #[test]
    fn kernel_weights_sum_to_one_in_fixed_point() {
        let kernel = Kernel::new(100, 37, Flavour::Pillow);
        for x in 0..37 {
            let (_, w) = kernel.taps(x);
            let sum: i32 = w.iter().sum();
            assert!((sum - (1 << PILLOW_PRECISION_BITS)).abs() <= w.len() as i32);
        }
    }
}
