//! JPEG pixels decoded with libjpeg-turbo's arithmetic (through mozjpeg, a libjpeg-turbo fork that
//! builds from source with the C compiler alone). PIL decodes with libjpeg-turbo using its defaults
//! (accurate integer IDCT, fancy upsampling), and the pure-Rust decoder of the `image` crate
//! rounds its IDCT and colour conversion differently: up to 3 levels apart on the reference
//! images, against 0 here.

use std::panic::{catch_unwind, AssertUnwindSafe};

use image::RgbImage;
use mozjpeg::{ColorSpace, Decompress};

/// Each progressive scan costs a pass over the whole image; real encoders emit about ten. The cap
/// stops files crafted with thousands of tiny scans from pinning a core.
const MAX_SCANS: usize = 128;

/// What came of decoding with libjpeg.
pub(super) enum JpegPixels {
    Rgb(RgbImage),
    /// CMYK/YCCK, which libjpeg cannot turn into RGB; the caller decodes it another way.
    NotRgb,
}

/// Decodes to 8-bit RGB (grayscale replicated), like PIL's `convert("RGB")` after `Image.open`.
pub(super) fn decode_jpeg(data: &[u8]) -> Result<JpegPixels, String> {
    let scans = count_scans(data);
    if scans > MAX_SCANS {
        return Err(format!("{scans} scans, at most {MAX_SCANS} are accepted"));
    }
    // libjpeg pads a truncated stream with gray and only warns; PIL refuses it ("image file is
    // truncated"), and so do we.
    if is_truncated(data) {
        return Err("truncated: no end-of-image marker after the last scan".into());
    }
    // libjpeg reports fatal errors through a callback that must not return; mozjpeg turns them
    // into an unwind that is caught here (it bypasses the panic hook, so nothing is printed).
    // This relies on panic = "unwind", the default; with "abort" a corrupt JPEG would abort.
    catch_unwind(AssertUnwindSafe(|| decode_unwinding(data)))
        .unwrap_or_else(|payload| Err(panic_message(payload.as_ref())))
}

fn decode_unwinding(data: &[u8]) -> Result<JpegPixels, String> {
    let decompress = Decompress::new_mem(data).map_err(|e| e.to_string())?;
    if matches!(decompress.color_space(), ColorSpace::JCS_CMYK | ColorSpace::JCS_YCCK) {
        return Ok(JpegPixels::NotRgb);
    }
    let mut started = decompress.rgb().map_err(|e| e.to_string())?;
    let (width, height) = (started.width(), started.height());
    let pixels = started.read_scanlines::<u8>().map_err(|e| e.to_string())?;
    started.finish().map_err(|e| e.to_string())?;
    let (w, h) = (u32::try_from(width), u32::try_from(height));
    match (w, h) {
        (Ok(w), Ok(h)) => RgbImage::from_raw(w, h, pixels)
            .map(JpegPixels::Rgb)
            .ok_or_else(|| "decoder returned fewer pixels than the image size".into()),
        _ => Err(format!("{width}x{height} is too large")),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "libjpeg failed".into())
}

/// Start-of-scan markers in the stream. Entropy-coded data cannot contain one (a 0xFF byte there
/// is always followed by 0x00 or a restart marker), so this counts scans, plus those of any
/// embedded thumbnail.
fn count_scans(data: &[u8]) -> usize {
    data.windows(2).filter(|w| w == &[0xFF, 0xDA]).count()
}

/// True when no end-of-image marker follows the last start-of-scan (neither can occur inside
/// entropy-coded data, so this is exactly "the last scan's data was cut off").
fn is_truncated(data: &[u8]) -> bool {
    let last_scan = data.windows(2).rposition(|w| w == [0xFF, 0xDA]).unwrap_or(0);
    !data[last_scan..].windows(2).any(|w| w == [0xFF, 0xD9])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let err = decode_jpeg(&[0xFF, 0xD8, 0xFF, 0xE0, 0, 2, 1, 2, 3]).err();
        assert!(err.is_some());
    }

    #[test]
    fn missing_end_marker_means_truncated() {
        assert!(is_truncated(&[0xFF, 0xD8, 0xFF, 0xDA, 1, 2, 3]));
        assert!(!is_truncated(&[0xFF, 0xD8, 0xFF, 0xDA, 1, 2, 0xFF, 0xD9, 7]));
    }

    #[test]
    fn scan_bombs_are_refused() {
        let mut data = vec![0xFF, 0xD8];
        for _ in 0..=MAX_SCANS {
            data.extend([0xFF, 0xDA, 0, 2]);
        }
        let err = decode_jpeg(&data).err().unwrap_or_default();
        assert!(err.contains("scans"), "{err}");
    }
}
