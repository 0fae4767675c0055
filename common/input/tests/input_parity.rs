//! Parity of the input pipeline with Hugging Face transformers' Qwen-VL processors, against the
//! dumps of `tests/reference/make_reference.py` (tiny checkpoints plus one JSON + safetensors per
//! case). Fixture root: `$GLANCE_FIXTURES`, else `<workspace>/tests/fixtures`.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Context, Result};
use glance_input::{
    decode_image, flatten_alpha, resize_for_model, ChatMessage, ContentPart, ImageBackend, Prompt,
    PromptBuilder, PromptOptions,
};
use safetensors::SafeTensors;
use serde_json::Value;

const MODELS: [&str; 2] = ["tiny-qwen3-vl", "tiny-qwen2.5-vl"];
/// Pixel values go through the same f32 arithmetic as the processor's (numpy's or torch's); in
/// practice they are identical.
const PIXEL_TOLERANCE: f32 = 1e-5;

/// The fixture root, or `None` when fixtures are absent and not required.
fn fixture_root() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("GLANCE_FIXTURES") {
        return Some(PathBuf::from(dir));
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let default = manifest.parent().unwrap_or(manifest).join("tests/fixtures");
    if default.is_dir() {
        return Some(default);
    }
    assert!(
        std::env::var("GLANCE_REQUIRE_FIXTURES").as_deref() != Ok("1"),
        "GLANCE_REQUIRE_FIXTURES=1 but neither GLANCE_FIXTURES nor {} exists",
        default.display()
    );
    eprintln!(
        "SKIPPED: no fixtures (set GLANCE_FIXTURES or create {}; run tests/reference/make_reference.py)",
        default.display()
    );
    None
}

#[test]
fn qwen3_vl_inputs_match_transformers() -> Result<()> {
    check_model(MODELS[0])
}

#[test]
fn qwen2_5_vl_inputs_match_transformers() -> Result<()> {
    check_model(MODELS[1])
}

fn check_model(model: &str) -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let model_dir = root.join(model);
    let cases = case_files(&model_dir.join("reference"))?;
    ensure!(!cases.is_empty(), "{model}: no reference cases");
    let mut backends = Vec::new();
    for case in cases {
        let backend =
            check_case(&model_dir, &case).with_context(|| format!("{model}: {}", case.display()))?;
        backends.push(backend);
    }
    for backend in [ImageBackend::Pil, ImageBackend::Torchvision] {
        ensure!(backends.contains(&backend), "{model}: no case made with the {} processor", backend.name());
    }
    Ok(())
}

fn case_files(reference: &Path) -> Result<Vec<PathBuf>> {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(reference)
        .with_context(|| format!("reading {}", reference.display()))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    cases.retain(|p| p.extension().is_some_and(|e| e == "json"));
    cases.sort();
    Ok(cases)
}

/// One reference case: its JSON, its tensors and the directory image paths are relative to.
struct Case {
    json: Value,
    tensors: Vec<u8>,
    dir: PathBuf,
}

impl Case {
    fn load(path: &Path) -> Result<Self> {
        let json: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        let tensors = std::fs::read(path.with_extension("safetensors"))?;
        let dir = path.parent().context("case has no directory")?.to_path_buf();
        Ok(Self { json, tensors, dir })
    }

    /// `Qwen2VLImageProcessorPil` made it with the PIL backend, `Qwen2VLImageProcessor` with torchvision.
    fn image_backend(&self) -> Result<ImageBackend> {
        let class = self.field("image_processor_class")?.as_str();
        match class.and_then(ImageBackend::of_processor_class) {
            Some(backend) => Ok(backend),
            None => bail!("unknown image_processor_class {class:?}"),
        }
    }

    fn field(&self, key: &str) -> Result<&Value> {
        self.json.get(key).ok_or_else(|| anyhow!("no {key}"))
    }

    /// A float32 tensor as (shape, values).
    fn tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let tensors = SafeTensors::deserialize(&self.tensors)?;
        let view = tensors.tensor(name)?;
        ensure!(view.dtype() == safetensors::Dtype::F32, "{name} is not float32");
        let values =
            view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok((view.shape().to_vec(), values))
    }

    fn messages(&self) -> Result<Vec<ChatMessage>> {
        let messages = self.field("messages")?.as_array().context("messages")?;
        messages.iter().map(|m| self.message(m)).collect()
    }

    fn message(&self, message: &Value) -> Result<ChatMessage> {
        let role = message["role"].as_str().context("role")?.to_string();
        let parts = message["content"].as_array().context("content")?;
        let content = parts.iter().map(|p| self.part(p)).collect::<Result<_>>()?;
        Ok(ChatMessage { role, content })
    }

    fn part(&self, part: &Value) -> Result<ContentPart> {
        match part["type"].as_str() {
            Some("text") => Ok(ContentPart::Text(part["text"].as_str().context("text")?.into())),
            Some("image") => {
                let path = part["path"].as_str().context("image path")?;
                let data = std::fs::read(self.dir.join(path))?;
                Ok(ContentPart::Image { data, mime_type: mime_for(path).into() })
            }
            other => bail!("unknown part type {other:?}"),
        }
    }
}

fn mime_for(path: &str) -> &'static str {
    match path.rsplit('.').next() {
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("webp") => "image/webp",
        _ => "",
    }
}

/// Checks one case through the input pipeline of the processor that made it; returns which.
fn check_case(model_dir: &Path, path: &Path) -> Result<ImageBackend> {
    let case = Case::load(path)?;
    let backend = case.image_backend()?;
    let builder = PromptBuilder::from_model_dir(
        model_dir,
        PromptOptions { image_backend: backend, ..Default::default() },
    )
    .with_context(|| format!("loading {}", model_dir.display()))?;
    let prompt = builder.build(&case.messages()?)?;
    ensure!(
        prompt.text == case.field("prompt_text")?.as_str().unwrap_or_default(),
        "prompt text differs:\n{}",
        prompt.text
    );
    let expected_ids: Vec<u32> = serde_json::from_value(case.field("input_ids")?.clone())?;
    ensure!(prompt.input_ids == expected_ids, "input_ids differ: {:?}", prompt.input_ids);
    check_positions(&case, &prompt)?;
    check_images(&builder, &case, &prompt)?;
    Ok(backend)
}

fn check_positions(case: &Case, prompt: &Prompt) -> Result<()> {
    let expected: Vec<Vec<i64>> = serde_json::from_value(case.field("position_ids")?.clone())?;
    let actual = [&prompt.positions.t, &prompt.positions.h, &prompt.positions.w];
    for (axis, (want, got)) in ["t", "h", "w"].iter().zip(expected.iter().zip(actual)) {
        ensure!(want == got, "position_ids {axis} differ: {got:?}");
    }
    let delta = case.field("rope_delta")?.as_i64().context("rope_delta")?;
    ensure!(prompt.rope_delta == delta, "rope_delta {} != {delta}", prompt.rope_delta);
    Ok(())
}

fn check_images(builder: &PromptBuilder, case: &Case, prompt: &Prompt) -> Result<()> {
    let grids: Vec<[usize; 3]> = serde_json::from_value(case.field("image_grid_thw")?.clone())?;
    let actual: Vec<[usize; 3]> = prompt.images.iter().map(|i| i.grid_thw).collect();
    ensure!(actual == grids, "image_grid_thw {actual:?} != {grids:?}");
    if prompt.images.is_empty() {
        return Ok(());
    }
    let (shape, reference) = case.tensor("pixel_values")?;
    let mut offset = 0;
    for (k, image) in prompt.images.iter().enumerate() {
        ensure!(shape[1] == image.patch_dim, "patch_dim {} != {}", image.patch_dim, shape[1]);
        let rows = &reference[offset..offset + image.pixel_values.len()];
        offset += image.pixel_values.len();
        check_resized(builder, case, k)?;
        let diff = max_abs_diff(&image.pixel_values, rows);
        println!("{} image {k}: pixel_values max abs difference {diff:e}", case_name(case));
        ensure!(diff <= PIXEL_TOLERANCE, "image {k}: pixel_values differ by {diff} (> {PIXEL_TOLERANCE})");
    }
    ensure!(offset == reference.len(), "pixel_values has {} values, expected {offset}", reference.len());
    Ok(())
}

/// For a resized image, first checks the resized 8-bit image against the reference processor's:
/// the decoder and both resizes are bit-exact, so they must be identical.
fn check_resized(builder: &PromptBuilder, case: &Case, k: usize) -> Result<()> {
    let meta = &case.field("images")?[k];
    if meta["orig_hw"] == meta["resized_hw"] {
        return Ok(());
    }
    let path = meta["path"].as_str().context("image path")?;
    let data = std::fs::read(case.dir.join(path))?;
    let cfg = builder.image_config().expect("a VLM");
    let rgb = flatten_alpha(&decode_image(&data, mime_for(path))?, cfg.alpha);
    report_decode_difference(case, k, &rgb, path)?;
    let resized = resize_for_model(&rgb, cfg)?;
    let (shape, reference) = case.tensor(&format!("resized_{k}"))?;
    let size = [resized.height() as usize, resized.width() as usize, 3];
    ensure!(shape == size, "resized_{k}: shape {size:?} != {shape:?}");
    let actual: Vec<f32> = resized.as_raw().iter().map(|&v| f32::from(v)).collect();
    let levels = max_abs_diff(&actual, &reference);
    println!(
        "{} {path}: resized image max 8-bit difference vs {}: {levels}",
        case_name(case),
        cfg.backend.name()
    );
    ensure!(levels == 0.0, "resized_{k} differs by {levels} levels");
    Ok(())
}

/// JPEG decoders may round differently from libjpeg; printed to tell that apart from resizing.
fn report_decode_difference(case: &Case, k: usize, rgb: &image::RgbImage, path: &str) -> Result<()> {
    let Ok((_, reference)) = case.tensor(&format!("decoded_{k}")) else {
        return Ok(());
    };
    let actual: Vec<f32> = rgb.as_raw().iter().map(|&v| f32::from(v)).collect();
    ensure!(actual.len() == reference.len(), "decoded_{k}: size differs");
    let levels = max_abs_diff(&actual, &reference);
    println!("{} {path}: decoded image max 8-bit difference vs PIL: {levels}", case_name(case));
    Ok(())
}

fn case_name(case: &Case) -> String {
    let model = case.json["model_dir"].as_str().unwrap_or("?");
    let name = case.json["case"].as_str().unwrap_or("?");
    format!("{model}/{name}")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
