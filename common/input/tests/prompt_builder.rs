//! `PromptBuilder` on a synthetic checkpoint directory (word-level tokenizer, Qwen-style template):
//! the end-to-end shape of a prompt, and that every bad request comes back as an error naming the
//! offending field. Needs no fixtures.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use glance_input::{ChatMessage, ContentPart, InputError, PromptBuilder, PromptOptions};

const VISION_START: u32 = 2;
const IMAGE_PAD: u32 = 4;

const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% for c in m.content %}\
{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c.text }}{% endif %}\
{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A checkpoint directory in the system temp dir, removed on drop.
struct TinyModel {
    dir: PathBuf,
}

impl TinyModel {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("glance-input-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        write(&dir, "tokenizer.json", &tokenizer_json());
        write(&dir, "chat_template.jinja", TEMPLATE);
        write(
            &dir,
            "config.json",
            r#"{"model_type": "qwen2_5_vl", "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 32,
                "image_token_id": 4, "vision_start_token_id": 2, "video_token_id": 5,
                "eos_token_id": 1, "vision_config": {"spatial_merge_size": 2}}"#,
        );
        write(
            &dir,
            "preprocessor_config.json",
            r#"{"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                "min_pixels": 3136, "max_pixels": 50176}"#,
        );
        write(&dir, "generation_config.json", r#"{"eos_token_id": [9, 1]}"#);
        Self { dir }
    }

    fn builder(&self, options: PromptOptions) -> PromptBuilder {
        PromptBuilder::from_model_dir(&self.dir, options).expect("tiny model loads")
    }
}

impl Drop for TinyModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).expect("write fixture file");
}

fn tokenizer_json() -> String {
    let specials = [
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ];
    let words = ["[UNK]", "user", "assistant", "system", "hello", "look"];
    let added: Vec<String> = specials
        .iter()
        .enumerate()
        .map(|(id, t)| {
            format!(
                r#"{{"id": {id}, "content": "{t}", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true}}"#
            )
        })
        .collect();
    let vocab: Vec<String> =
        specials.iter().chain(&words).enumerate().map(|(id, t)| format!(r#""{t}": {id}"#)).collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{}], "normalizer": null,
            "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null, "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "[UNK]"}}}}"#,
        added.join(","),
        vocab.join(",")
    )
}

fn png(width: u32, height: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, 99]));
    let mut bytes = Cursor::new(Vec::new());
    img.write_to(&mut bytes, image::ImageFormat::Png).expect("encode png");
    bytes.into_inner()
}

fn text(t: &str) -> ContentPart {
    ContentPart::Text(t.into())
}

fn image(data: Vec<u8>, mime: &str) -> ContentPart {
    ContentPart::Image { data, mime_type: mime.into() }
}

fn user(content: Vec<ContentPart>) -> ChatMessage {
    ChatMessage { role: "user".into(), content }
}

#[test]
fn builds_expanded_ids_and_positions() {
    let model = TinyModel::new("build");
    let builder = model.builder(PromptOptions::default());
    let prompt =
        builder.build(&[user(vec![image(png(56, 56), ""), text("hello look")])]).expect("prompt builds");
    assert_eq!(
        prompt.text,
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hello look<|im_end|>\n<|im_start|>assistant\n"
    );
    // 56x56 pixels -> 4x4 patches of 14 -> 2x2 merged tokens.
    assert_eq!(prompt.images[0].grid_thw, [1, 4, 4]);
    assert_eq!(prompt.image_token_count, 4);
    let first_pad = prompt.input_ids.iter().position(|&id| id == IMAGE_PAD);
    assert_eq!(first_pad, Some(3));
    assert_eq!(prompt.input_ids[2], VISION_START);
    assert_eq!(prompt.input_ids[3..7], [IMAGE_PAD; 4]);
    assert_eq!(prompt.positions.len(), prompt.input_ids.len());
    assert_eq!(prompt.positions.h[3..7], [3, 3, 4, 4]);
    assert_eq!(prompt.positions.w[3..7], [3, 4, 3, 4]);
    // Text resumes at 3 + 2 after the image, so the sequence ends 2 positions early.
    assert_eq!(prompt.rope_delta, -2);
    assert_eq!(builder.eos_token_ids(), [9, 1]);
}

fn build_error(builder: &PromptBuilder, messages: &[ChatMessage]) -> String {
    builder.build(messages).map(|_| ()).expect_err("request must be refused").to_string()
}

#[test]
fn bad_requests_name_the_field() {
    let model = TinyModel::new("errors");
    let builder = model.builder(PromptOptions { max_images: 1, ..PromptOptions::default() });
    assert!(matches!(builder.build(&[]), Err(InputError::EmptyConversation)));

    let tool = ChatMessage { role: "tool".into(), content: vec![text("hello")] };
    let err = build_error(&builder, &[user(vec![text("hello")]), tool]);
    assert!(err.starts_with("messages[1].role: role \"tool\""), "{err}");

    let err = build_error(&builder, &[user(vec![text("a <|image_pad|> b")])]);
    assert!(err.starts_with("messages[0].content[0].text:"), "{err}");

    let two = vec![image(png(56, 56), ""), image(png(56, 56), "")];
    let err = build_error(&builder, &[user(two)]);
    assert!(err.contains("2 images"), "{err}");

    let mut broken = png(56, 56);
    broken.truncate(60);
    let err = build_error(&builder, &[user(vec![text("look"), image(broken, "image/png")])]);
    assert!(err.starts_with("messages[0].content[1].image: corrupt PNG data:"), "{err}");

    let err = build_error(&builder, &[user(vec![image(png(56, 56), "image/gif")])]);
    assert!(err.starts_with("messages[0].content[0].image: unsupported mime type"), "{err}");

    let err = build_error(&builder, &[user(vec![image(png(56, 56), "image/jpeg")])]);
    assert!(err.contains("look like Png"), "{err}");

    let err = build_error(&builder, &[user(vec![image(png(1, 300), "")])]);
    assert!(err.contains("aspect ratio"), "{err}");
}

#[test]
fn decoded_pixel_cap_is_enforced_before_decoding() {
    let model = TinyModel::new("cap");
    let builder = model.builder(PromptOptions { max_decoded_pixels: 100 * 100, ..PromptOptions::default() });
    let err = build_error(&builder, &[user(vec![image(png(101, 100), "image/png")])]);
    assert!(err.starts_with("messages[0].content[0].image: image is 101x100 pixels"), "{err}");
}

#[test]
fn pixel_overrides_are_validated() {
    let model = TinyModel::new("overrides");
    let options =
        PromptOptions { min_pixels: Some(10_000), max_pixels: Some(5_000), ..PromptOptions::default() };
    let err = PromptBuilder::from_model_dir(&model.dir, options).expect_err("min > max");
    assert!(err.to_string().contains("min_pixels"), "{err}");
}
