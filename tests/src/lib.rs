//! glance-tests: shared helpers for the integration tests in `tests/tests/` — locating the
//! reference fixtures that `tests/reference/make_reference.py` writes (tiny Hugging Face models
//! and what transformers computed on them), reading them, and starting services as processes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use glance_models::decode::{greedy_generate, GreedyParams, ModelInputs, StepControl};
use glance_models::{LogitRows, StepInput, TargetModel};
use serde::Deserialize;
use tch::Tensor;

pub mod bench;
pub mod drafters;
pub mod law_plot;
pub mod matched;
pub mod pki;
pub mod process;
pub mod requests;
pub mod suite;

/// The device the tests load models on: `$GLANCE_TEST_DEVICE` (`cpu`, `cuda` or `cuda:N`), else
/// the CPU. The device check (`scripts/device-check.sh`) sets it, together with the services'
/// own `GLANCE_DEVICE` / `GLANCE_DRAFTER_DEVICE`, to run the suites on a GPU.
pub fn test_device() -> tch::Device {
    let name = std::env::var("GLANCE_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    glance_models::weights::parse_device(&name)
        .unwrap_or_else(|| panic!("GLANCE_TEST_DEVICE={name:?}: expected cpu, cuda or cuda:N"))
}

/// A file of `tests/reference` (the Python peers): where this build's sources were, else relative
/// to the working directory (the carried binaries of the device check run in another checkout).
pub fn reference_script(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("reference").join(name);
    if built.is_file() {
        built
    } else {
        Path::new("tests/reference").join(name)
    }
}

/// The two reference families and their model directories (5.x layout, then the sharded 4.x one).
pub const FAMILIES: [(&str, &str); 2] =
    [("tiny-qwen3-vl", "tiny-qwen3-vl-legacy"), ("tiny-qwen2.5-vl", "tiny-qwen2.5-vl-legacy")];
/// The VLM reference cases: through transformers' PIL image processor, then (`tv_*`) through its
/// torchvision one.
pub const CASES: [&str; 9] = [
    "text_only",
    "one_image",
    "two_images",
    "resized",
    "multi_turn",
    "alpha",
    "tv_two_images",
    "tv_resized",
    "tv_alpha",
];
/// The VLM cases a parity run checks: all of [`CASES`], or the subset `GLANCE_PARITY_CASES`
/// names (comma-separated; the device check leaves out the torchvision ones, whose inputs differ
/// only in their host-side preprocessing, to fit what travels to the GPU machine).
pub fn vlm_cases() -> Vec<&'static str> {
    let Ok(names) = std::env::var("GLANCE_PARITY_CASES") else { return CASES.to_vec() };
    names
        .split(',')
        .map(str::trim)
        .map(|name| {
            *CASES
                .iter()
                .find(|c| **c == name)
                .unwrap_or_else(|| panic!("GLANCE_PARITY_CASES: no case {name:?}"))
        })
        .collect()
}

/// The text-only reference families (`tests/reference/make_text_reference.py`) and their cases.
pub const TEXT_FAMILIES: [&str; 2] = ["tiny-llama", "tiny-qwen3"];
pub const TEXT_CASES: [&str; 4] = ["single_turn", "with_system", "multi_turn", "long"];

/// Where the reference fixtures live: `$GLANCE_FIXTURES`, else `<workspace>/tests/fixtures`.
/// Returns None (the caller skips) only when they are absent and not required by
/// `GLANCE_REQUIRE_FIXTURES=1`, which the test command sets.
pub fn fixtures() -> Option<PathBuf> {
    let root = std::env::var_os("GLANCE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures"));
    if root.join("tiny-qwen3-vl").is_dir() {
        return Some(root);
    }
    if std::env::var("GLANCE_REQUIRE_FIXTURES").as_deref() == Ok("1") {
        panic!("reference fixtures missing at {} (run scripts/setup.sh)", root.display());
    }
    eprintln!("skipping: no reference fixtures at {} (run scripts/setup.sh)", root.display());
    None
}

/// The real pretrained model that `scripts/setup-real-model.sh` converts from PyPI
/// (SmolLM2-135M-Instruct): `$GLANCE_REAL_MODEL`, else `<workspace>/models/smollm2-135m-instruct`.
/// Like [`fixtures`], None (skip) only when absent and not required by `GLANCE_REQUIRE_FIXTURES=1`.
pub fn real_model() -> Option<PathBuf> {
    let dir = std::env::var_os("GLANCE_REAL_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m-instruct"));
    if dir.join("reference/greedy.json").is_file() {
        return Some(dir);
    }
    if std::env::var("GLANCE_REQUIRE_FIXTURES").as_deref() == Ok("1") {
        panic!("the real model is missing at {} (run scripts/setup.sh)", dir.display());
    }
    eprintln!("skipping: no real model at {} (run scripts/setup.sh)", dir.display());
    None
}

/// One reference case: what the HF processor produced and what the HF model computed.
#[derive(Deserialize)]
pub struct Case {
    pub case: String,
    pub messages: Vec<serde_json::Value>,
    pub input_ids: Vec<i64>,
    pub image_grid_thw: Vec<[i64; 3]>,
    pub position_ids: Vec<Vec<i64>>,
    pub rope_delta: i64,
    pub greedy_tokens: Vec<i64>,
    pub tap_layers: Vec<usize>,
    /// The transformers image processor class that made the pixels.
    #[serde(default)]
    pub image_processor_class: String,
    #[serde(skip)]
    pub tensors: HashMap<String, Tensor>,
    #[serde(skip)]
    pub dir: PathBuf,
}

impl Case {
    /// Where the reference case `name` of the model in `model_dir` keeps its messages and expected
    /// values (its tensors lie beside it, `name.safetensors`).
    pub fn json_path(model_dir: &Path, name: &str) -> PathBuf {
        model_dir.join("reference").join(format!("{name}.json"))
    }

    pub fn load(model_dir: &Path, name: &str) -> Case {
        let reference = model_dir.join("reference");
        let text = std::fs::read_to_string(Case::json_path(model_dir, name)).expect("case json");
        let mut case: Case = serde_json::from_str(&text).expect("case json parses");
        let tensors =
            Tensor::read_safetensors(reference.join(format!("{name}.safetensors"))).expect("case tensors");
        case.tensors = tensors.into_iter().collect();
        case.dir = reference;
        case
    }

    /// The image backend that reproduces this case's pixels.
    pub fn image_backend(&self) -> glance_input::ImageBackend {
        glance_input::ImageBackend::of_processor_class(&self.image_processor_class)
            .unwrap_or_else(|| panic!("case {}: image processor {:?}", self.case, self.image_processor_class))
    }

    /// The input pipeline this case was made with.
    pub fn prompt_builder(&self, model_dir: &Path) -> glance_input::PromptBuilder {
        let options =
            glance_input::PromptOptions { image_backend: self.image_backend(), ..Default::default() };
        glance_input::PromptBuilder::from_model_dir(model_dir, options).expect("prompt builder")
    }

    pub fn tensor(&self, name: &str) -> &Tensor {
        self.tensors.get(name).unwrap_or_else(|| panic!("case {} has no tensor {name}", self.case))
    }

    /// The case's messages in the input pipeline's form, images read from the fixture files.
    pub fn chat_messages(&self) -> Vec<glance_input::ChatMessage> {
        use glance_input::{ChatMessage, ContentPart};
        self.messages
            .iter()
            .map(|m| {
                let parts = m["content"].as_array().cloned().unwrap_or_default();
                let content = parts
                    .iter()
                    .map(|p| match p["type"].as_str() {
                        Some("image") => {
                            let path = self.dir.join(p["path"].as_str().expect("image path"));
                            ContentPart::Image {
                                data: std::fs::read(path).expect("image file"),
                                mime_type: String::new(),
                            }
                        }
                        _ => ContentPart::Text(p["text"].as_str().unwrap_or_default().to_string()),
                    })
                    .collect();
                ChatMessage { role: m["role"].as_str().unwrap_or_default().to_string(), content }
            })
            .collect()
    }
}

/// Model inputs exactly as the reference processor produced them (a text case has no pixels).
pub fn reference_inputs(case: &Case) -> ModelInputs {
    let pixel_values = case.tensors.get("pixel_values").map(|t| t.shallow_clone());
    ModelInputs {
        input_ids: case.input_ids.clone(),
        positions: [case.position_ids[0].clone(), case.position_ids[1].clone(), case.position_ids[2].clone()],
        rope_delta: case.rope_delta,
        pixel_values,
        image_grids: case.image_grid_thw.clone(),
    }
}

/// One prompt forward (with its images) with the `taps` layers tapped: (logits (n, vocab), taps).
pub fn prompt_forward(model: &TargetModel, inputs: &ModelInputs, taps: &[usize]) -> (Tensor, Vec<Tensor>) {
    let _guard = tch::no_grad_guard();
    let device = model.device();
    let vision = inputs
        .pixel_values
        .as_ref()
        .map(|p| model.encode_images(&p.to_device(device), &inputs.image_grids).unwrap());
    let ids = glance_models::upload(&inputs.input_ids, device);
    let positions = inputs.positions_tensor().to_device(device);
    let mut cache = model.new_cache(inputs.input_ids.len());
    let step = StepInput {
        token_ids: &ids,
        positions: &positions,
        mask: None,
        vision: vision.as_ref(),
        taps,
        logits: LogitRows::All,
    };
    let out = model.forward(&step, &mut cache).expect("forward");
    (out.logits.expect("logits"), out.taps)
}

/// `n` greedy tokens with EOS disabled.
pub fn greedy(model: &TargetModel, inputs: &ModelInputs, n: usize) -> Vec<i64> {
    let params =
        GreedyParams { max_new_tokens: n, eos_token_ids: &[], context_limit: 1 << 20, logprobs: None };
    greedy_generate(model, inputs, &params, |_| StepControl::Continue).expect("greedy").tokens
}

/// Writes a randomly initialized draft head (`layers` layers, block 16, seeded) for `target` into
/// a scratch directory named after `name` and returns it. The tiny targets are too shallow for
/// DFlash's tap rule (layers 1..n−3), so the taps are named: 0, 1, 2.
pub fn random_head(target: &Path, name: &str, layers: usize, seed: u64) -> PathBuf {
    let out = std::env::temp_dir().join(format!("glance-head-{name}-{}", std::process::id()));
    let spec = drafter_svc::init::HeadSpec {
        tap_layers: Some(vec![0, 1, 2]),
        ..drafter_svc::init::HeadSpec::new(layers, 16, seed)
    };
    drafter_svc::init::write_random_head(target, &out, &spec).expect("random head");
    out
}

/// A random EAGLE-3 head (taps 0, 1, 2: the tiny targets are too shallow for EAGLE's default)
/// for `target`, in the system's temporary directory; `draft_vocab` target ids, or the whole
/// vocabulary.
pub fn random_eagle3_head(target: &Path, name: &str, draft_vocab: Option<Vec<i64>>, seed: u64) -> PathBuf {
    let out = std::env::temp_dir().join(format!("glance-eagle3-{name}-{}", std::process::id()));
    let spec = drafter_svc::init::Eagle3Spec {
        tap_layers: Some(vec![0, 1, 2]),
        draft_vocab,
        ..drafter_svc::init::Eagle3Spec::new(seed)
    };
    drafter_svc::init::write_random_eagle3_head(target, &out, &spec).expect("random EAGLE-3 head");
    out
}

/// A loopback port free right now (for a service's fixed metrics address).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("address").port()
}

/// `GET /metrics` from a service's Prometheus port, as text.
pub fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics port");
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response.split("\r\n\r\n").nth(1).unwrap_or_default().to_string()
}

/// Sum of the samples whose line starts with `prefix` (a metric name, or a name with labels); a
/// metric never touched reads 0.
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(prefix) && l[prefix.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Largest absolute difference of two tensors, in f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    let host = |t: &Tensor| t.to_device(tch::Device::Cpu).to_kind(tch::Kind::Double);
    (host(a) - host(b)).abs().max().double_value(&[])
}
