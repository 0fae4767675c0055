//! Bit-exactness with Pillow 13, the library HF's Qwen-VL processors decode with and the PIL one
//! resizes with, and with torchvision 0.28, which the other one resizes with, on small images
//! committed under `tests/data/pil` (see `generate.py` there). Needs no fixtures.

use std::path::{Path, PathBuf};

use glance_input::{decode_image, resize_bicubic, resize_bicubic_torchvision, to_rgb8};
use image::RgbImage;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/pil")
}

fn load_png(name: &str) -> RgbImage {
    let path = data_dir().join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    to_rgb8(&decode_image(&bytes, "image/png").expect("test image decodes"))
}

/// `{prefix}WxH.png` -> (W, H).
fn target_size(name: &str, prefix: &str) -> Option<(u32, u32)> {
    let size = name.strip_prefix(prefix)?.strip_suffix(".png")?;
    let (w, h) = size.split_once('x')?;
    Some((w.parse().ok()?, h.parse().ok()?))
}

/// Resizes `src.png` to the size of every `{prefix}WxH.png` and compares pixel for pixel.
fn check_resizes(prefix: &str, resize: fn(&RgbImage, u32, u32) -> RgbImage, library: &str) {
    let src = load_png("src.png");
    let mut checked = 0;
    for entry in std::fs::read_dir(data_dir()).expect("data dir") {
        let name = entry.expect("dir entry").file_name().to_string_lossy().into_owned();
        let Some((width, height)) = target_size(&name, prefix) else {
            continue;
        };
        let expected = load_png(&name);
        let actual = resize(&src, width, height);
        assert!(actual == expected, "{name}: differs from {library}");
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} reference resizes found");
}

#[test]
fn bicubic_resize_is_bit_exact_with_pillow() {
    check_resizes("src_to_", resize_bicubic, "Pillow");
}

#[test]
fn antialiased_bicubic_resize_is_bit_exact_with_torchvision() {
    check_resizes("src_tv_to_", resize_bicubic_torchvision, "torchvision");
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

/// Each transparent image of `generate.py`'s `alpha_images`, with what Pillow makes of it: composited
/// onto white (transformers' `convert_to_rgb`), onto another colour (`alpha_composite`, as vLLM's
/// `rgba_background_color`), and with alpha dropped (`load_image`).
#[test]
fn transparency_is_composited_or_dropped_like_pillow() {
    use glance_input::{flatten_alpha, Alpha};
    let sources = [
        "alpha_rgba.png",
        "alpha_la.png",
        "alpha_p_trns.png",
        "alpha_rgb_trns.png",
        "alpha_rgba.webp",
        "alpha_rgba16.png",
        "alpha_la16.png",
    ];
    for name in sources {
        let bytes = std::fs::read(data_dir().join(name)).expect("alpha test image");
        let decoded = decode_image(&bytes, "").expect("decodes");
        let stem = name.replace('.', "_");
        for (alpha, suffix) in [
            (Alpha::Composite([255, 255, 255]), "white"),
            (Alpha::Composite([18, 140, 77]), "green"),
            (Alpha::Drop, "drop"),
        ] {
            let expected = load_png(&format!("{stem}.{suffix}.png"));
            let actual = flatten_alpha(&decoded, alpha);
            assert!(actual == expected, "{name} {suffix}: differs from Pillow");
        }
    }
}

/// The serving option reaches the model's pixels: a transparent image through the committed toy
/// checkpoint's prompt builder gives the pixel values of Pillow's flattened image, by default
/// composited onto white, with `Alpha::Drop` the colour channels as they are.
#[test]
fn the_prompt_builder_flattens_transparency_as_configured() {
    use glance_input::{Alpha, ChatMessage, ContentPart, PromptBuilder, PromptOptions};
    let toy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/toy-target");
    let pixels = |alpha: Alpha, file: &str| {
        let prompts =
            PromptBuilder::from_model_dir(&toy, PromptOptions { alpha, ..PromptOptions::default() }).unwrap();
        let data = std::fs::read(data_dir().join(file)).unwrap();
        let message = ChatMessage {
            role: "user".into(),
            content: vec![
                ContentPart::Image { data, mime_type: String::new() },
                ContentPart::Text("Read it.".into()),
            ],
        };
        prompts.build(&[message]).unwrap().images.remove(0).pixel_values
    };
    let white = pixels(Alpha::default(), "alpha_rgba_png.white.png");
    assert_eq!(pixels(Alpha::default(), "alpha_rgba.png"), white);
    assert_eq!(pixels(Alpha::Drop, "alpha_rgba.png"), pixels(Alpha::Drop, "alpha_rgba_png.drop.png"));
    assert_ne!(pixels(Alpha::Drop, "alpha_rgba.png"), white, "the two modes differ on this image");
}
