//! Fuzzing the input pipeline (property tests on stable Rust): mutated PNG, JPEG and WebP bytes
//! through decoding and the Qwen-VL preprocessing, and arbitrary conversations (any Unicode,
//! special-token strings, template syntax, many parts) through prompt building on the committed
//! toy checkpoint, and both bicubic resizes at arbitrary sizes. Every case is an `Ok` or an error
//! naming what was wrong, never a panic.
//! `GLANCE_FUZZ_CASES` sets the number of cases.

use std::io::Cursor;
use std::path::PathBuf;
use std::sync::OnceLock;

use glance_input::{
    decode_image_with_limit, preprocess_image, resize_bicubic, resize_bicubic_torchvision, ChatMessage,
    ContentPart, ImageBackend, ImageProcessorConfig, PromptBuilder, PromptOptions,
};
use image::{DynamicImage, ImageFormat, RgbImage};
use proptest::prelude::*;

fn cases(default: u32) -> u32 {
    std::env::var("GLANCE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn data(name: &str) -> Vec<u8> {
    std::fs::read(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/pil").join(name)).unwrap()
}

fn encoded(image: &DynamicImage, format: ImageFormat) -> Vec<u8> {
    let mut bytes = Cursor::new(Vec::new());
    image.write_to(&mut bytes, format).unwrap();
    bytes.into_inner()
}

/// Valid images of every colour type the decoders take, to mutate.
fn seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let png = data("src.png");
        let rgb = image::load_from_memory(&png).unwrap();
        vec![
            png,
            data("photo.jpg"),
            encoded(&rgb, ImageFormat::WebP),
            encoded(&DynamicImage::ImageRgba8(rgb.to_rgba8()), ImageFormat::Png),
            encoded(&DynamicImage::ImageRgba16(rgb.to_rgba16()), ImageFormat::Png),
            encoded(&DynamicImage::ImageLumaA8(rgb.to_luma_alpha8()), ImageFormat::Png),
            encoded(&DynamicImage::ImageLuma8(rgb.to_luma8()), ImageFormat::Jpeg),
        ]
    })
}

/// A seed with some bytes overwritten, some inserted, and maybe cut short.
fn mutated_image() -> impl Strategy<Value = Vec<u8>> {
    (
        0..7usize,
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..2),
        prop::option::weighted(0.2, any::<prop::sample::Index>()),
    )
        .prop_map(|(seed, overwrites, inserts, cut)| {
            let mut bytes = seeds()[seed].clone();
            for (at, byte) in overwrites {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
            for (at, byte) in inserts {
                let i = at.index(bytes.len() + 1);
                bytes.insert(i, byte);
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len() + 1));
            }
            bytes
        })
}

/// Mostly "detect from the bytes", sometimes a claim that may not match them.
fn backend() -> impl Strategy<Value = ImageBackend> {
    prop_oneof![Just(ImageBackend::Pil), Just(ImageBackend::Torchvision)]
}

fn mime() -> impl Strategy<Value = String> {
    let claimed =
        prop::sample::select(vec!["image/png", "image/jpeg", "image/webp", "image/gif", "text/plain"]);
    prop_oneof![4 => Just(String::new()), 1 => claimed.prop_map(str::to_string)]
}

fn toy_prompts() -> &'static PromptBuilder {
    static PROMPTS: OnceLock<PromptBuilder> = OnceLock::new();
    PROMPTS.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/toy-target");
        PromptBuilder::from_model_dir(&dir, PromptOptions::default()).expect("the committed toy target")
    })
}

/// Text a client might send: any Unicode, and the strings a tokenizer or template treats specially.
fn text() -> impl Strategy<Value = String> {
    let special = prop::sample::select(vec![
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
        "<|endoftext|>",
        "{{ messages }}",
        "{% for m in messages %}",
        "{#",
        "\u{0}",
        "\u{202e}",
        "\u{feff}",
        "assistant\n",
    ]);
    let piece = prop_oneof![3 => any::<String>(), 2 => special.prop_map(str::to_string), 1 => "[a-z ]{0,20}"];
    (prop::collection::vec(piece, 0..6), 1usize..4)
        .prop_map(|(pieces, repeat)| pieces.concat().repeat(repeat))
}

fn message() -> impl Strategy<Value = ChatMessage> {
    let role = prop_oneof![
        30 => prop::sample::select(vec!["user", "assistant", "system"]).prop_map(str::to_string),
        1 => any::<String>(),
    ];
    let part = prop_oneof![
        12 => text().prop_map(ContentPart::Text),
        1 => (mutated_image(), mime()).prop_map(|(data, mime_type)| ContentPart::Image { data, mime_type }),
    ];
    (role, prop::collection::vec(part, 1..5)).prop_map(|(role, content)| ChatMessage { role, content })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(3_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_images_decode_and_preprocess_or_fail_cleanly(
        bytes in mutated_image(),
        mime in mime(),
        backend in backend(),
    ) {
        // A cap well below the product's keeps each case fast; the checks are the same.
        if let Ok(image) = decode_image_with_limit(&bytes, &mime, 1 << 20) {
            prop_assert!(image.width() > 0 && image.height() > 0);
            let config = ImageProcessorConfig { backend, ..ImageProcessorConfig::default() };
            if let Ok(prepared) = preprocess_image(&image, &config) {
                prop_assert_eq!(prepared.pixel_values.len(), prepared.n_patches * prepared.patch_dim);
                prop_assert!(prepared.pixel_values.iter().all(|v| v.is_finite()));
            }
        }
    }

    #[test]
    fn resizes_of_any_size_keep_a_constant_image_constant(
        from in (1u32..200, 1u32..200),
        to in (1u32..200, 1u32..200),
        colour in any::<[u8; 3]>(),
    ) {
        // Every window and weight of both kernels, at sizes no test picked; a constant image
        // must come out constant (the weights of each output sum to one in fixed point).
        let src = RgbImage::from_pixel(from.0, from.1, image::Rgb(colour));
        for resize in [resize_bicubic, resize_bicubic_torchvision] {
            let out = resize(&src, to.0, to.1);
            prop_assert_eq!(out.dimensions(), to);
            prop_assert!(out.pixels().all(|p| p.0 == colour));
        }
    }

    #[test]
    fn any_conversation_builds_a_prompt_or_an_error(messages in prop::collection::vec(message(), 1..8)) {
        if let Ok(prompt) = toy_prompts().build(&messages) {
            let vocab = toy_prompts().tokenizer().get_vocab_size(true) as u32;
            prop_assert!(prompt.input_ids.iter().all(|&t| t < vocab));
        }
    }
}
