//! Bit-exactness with Pillow 13, the library HF's Qwen-VL processor resizes and decodes with, on
//! small images committed under `tests/data/pil` (see `generate.py` there). Needs no fixtures.

use std::path::{Path, PathBuf};

use glance_input::{decode_image, resize_bicubic, to_rgb8};
use image::RgbImage;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/pil")
}

fn load_png(name: &str) -> RgbImage {
    let path = data_dir().join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    to_rgb8(&decode_image(&bytes, "image/png").expect("test image decodes"))
}

/// `src_to_WxH.png` -> (W, H).
fn target_size(name: &str) -> Option<(u32, u32)> {
    let size = name.strip_prefix("src_to_")?.strip_suffix(".png")?;
    let (w, h) = size.split_once('x')?;
    Some((w.parse().ok()?, h.parse().ok()?))
}

#[test]
fn bicubic_resize_is_bit_exact_with_pillow() {
    let src = load_png("src.png");
    let mut checked = 0;
    for entry in std::fs::read_dir(data_dir()).expect("data dir") {
        let name = entry.expect("dir entry").file_name().to_string_lossy().into_owned();
        let Some((width, height)) = target_size(&name) else {
            continue;
        };
        let expected = load_png(&name);
        let actual = resize_bicubic(&src, width, height);
        assert!(actual == expected, "{name}: differs from Pillow");
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} reference resizes found");
}

#[test]
fn jpeg_decodes_like_hf_load_image() {
    let bytes = std::fs::read(data_dir().join("photo.jpg")).expect("photo.jpg");
    // Progressive 4:2:0 with EXIF orientation 6: exercises libjpeg's IDCT, fancy upsampling and
    // the rotation `load_image` applies.
    let actual = to_rgb8(&decode_image(&bytes, "image/jpeg").expect("photo decodes"));
    let expected = load_png("photo.pil.png");
    assert_eq!(actual.dimensions(), expected.dimensions());
    assert!(actual == expected, "photo.jpg: decoded pixels differ from PIL");
}

#[test]
fn truncated_jpeg_is_refused_like_pil() {
    let bytes = std::fs::read(data_dir().join("photo.jpg")).expect("photo.jpg");
    for cut in [2, bytes.len() / 2] {
        let err = decode_image(&bytes[..bytes.len() - cut], "image/jpeg")
            .expect_err("PIL raises 'image file is truncated'");
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}
