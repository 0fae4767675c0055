//! Randomly initialized draft heads for a given target: the fixture for tests and the starting
//! point of training. Writes a DFlash-style model directory (`config.json` as the public DFlash
//! checkpoints spell it, `model.safetensors` with DFlash's tensor names), or an EAGLE-3 one (as
//! EAGLE and SpecForge save theirs), whose dimensions follow the target's language model.
//! Initialization as transformers' PreTrainedModel does it: matrices N(0, std), RMSNorm weights 1;
//! a block head's layers may instead start as copies of target layers (`copy_target_layers`).
//! Seeded with a private generator, so the same spec gives the same bytes whatever else runs in
//! the process.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};
use tch::{Kind, Tensor};

use glance_models::TextConfig;
use glance_train::rng::{fnv1a, Rng};
use glance_train::save::{self, SaveError};

use crate::eagle3::{default_tap_layers, Eagle3Config};
use crate::head::{build_target_layer_ids, read_json, target_text_config, DraftHeadConfig, HeadError};

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(transparent)]
    Head(#[from] HeadError),
    #[error(transparent)]
    Save(#[from] SaveError),
    #[error("invalid head spec: {0}")]
    Spec(String),
}

/// What to build. Dimensions not named here (hidden size, heads, head_dim, RMSNorm eps) are the
/// target's; `None` fields default from the target too.
#[derive(Clone, Debug)]
pub struct HeadSpec {
    pub layers: usize,
    pub block_size: usize,
    /// Default: DFlash's tap rule for this target's depth and `layers`.
    pub tap_layers: Option<Vec<usize>>,
    /// Default: the target tokenizer's `<|vision_pad|>`, a reserved token the Qwen-VL processors
    /// never emit; for a tokenizer without it, its last added special token that is none of
    /// BOS, EOS, pad or unk (SmolLM2's `<empty_output>`).
    pub mask_token_id: Option<i64>,
    pub seed: u64,
    /// Default: the target's MLP width.
    pub intermediate_size: Option<i64>,
    /// Default: the target's language-model rope_theta.
    pub rope_theta: Option<f64>,
    /// Standard deviation of the matrix entries.
    pub init_std: f64,
    /// Initial weight of the head's final norm (the other norms start at 1). Below 1 it shrinks
    /// the fresh head's logits: its residual stream starts as the mask token's embedding, which the
    /// tied LM head of a real target scores at ~75 logits against ~0 for the label (loss ~50);
    /// a small scale starts near ln(vocab) instead, and the ranking the tree uses is unchanged.
    pub output_norm_init: f64,
    /// Stored dtype: F32, BF16 or F16.
    pub dtype: Kind,
    /// Start the head's layers as copies of these target layers (one per head layer), for a head
    /// trained on little data: their attention and MLP matrices and norms (q/k norms too where the
    /// target has them, else 1), `fc` the identity on the last tap and `hidden_norm` the first
    /// copied layer's input norm, so the context keys and values start as that layer's own.
    pub copy_target_layers: Option<Vec<usize>>,
}

impl HeadSpec {
    pub fn new(layers: usize, block_size: usize, seed: u64) -> Self {
        Self {
            layers,
            block_size,
            tap_layers: None,
            mask_token_id: None,
            seed,
            intermediate_size: None,
            rope_theta: None,
            init_std: 0.02,
            output_norm_init: 1.0,
            dtype: Kind::Float,
            copy_target_layers: None,
        }
    }
}

/// Writes `out_dir/config.json` and `out_dir/model.safetensors` for a random head fitting the
/// target in `target_dir`, and returns the config as the loader reads it back.
pub fn write_random_head(
    target_dir: &Path,
    out_dir: &Path,
    spec: &HeadSpec,
) -> Result<DraftHeadConfig, InitError> {
    let target = target_text_config(target_dir)?;
    check_spec(spec, &target)?;
    let taps =
        spec.tap_layers.clone().unwrap_or_else(|| build_target_layer_ids(target.num_layers, spec.layers));
    if let Some(&bad) = taps.iter().find(|&&t| t >= target.num_layers) {
        return Err(InitError::Spec(format!(
            "tap layer {bad}, but the target has {} layers",
            target.num_layers
        )));
    }
    let mask = match spec.mask_token_id {
        Some(id) => id,
        None => reserved_token_id(target_dir)?,
    };
    if !(0..target.vocab_size).contains(&mask) {
        return Err(InitError::Spec(format!(
            "mask token {mask} outside the vocabulary of {}",
            target.vocab_size
        )));
    }
    let config = head_config_json(&target, spec, &taps, mask);
    let mut tensors = random_weights(&target, spec, taps.len() as i64);
    if let Some(layers) = &spec.copy_target_layers {
        // Before anything is written: a refused copy leaves no half-made head directory.
        copy_target_layers(target_dir, &target, layers, &mut tensors, spec.dtype)?;
    }
    save::create_dir(out_dir)?;
    save::write_json(&out_dir.join("config.json"), &config)?;
    save::write_safetensors(&out_dir.join("model.safetensors"), &tensors)?;
    Ok(DraftHeadConfig::load(out_dir, Some(target.num_layers))?)
}

fn check_spec(spec: &HeadSpec, target: &TextConfig) -> Result<(), InitError> {
    if spec.layers == 0 || spec.block_size < 2 {
        return Err(InitError::Spec("need at least one layer and a block of at least 2".into()));
    }
    if !matches!(spec.dtype, Kind::Float | Kind::BFloat16 | Kind::Half) {
        return Err(InitError::Spec(format!("dtype {:?}", spec.dtype)));
    }
    if spec.tap_layers.as_ref().is_some_and(|t| t.is_empty()) {
        return Err(InitError::Spec("empty tap layer list".into()));
    }
    if let Some(copied) = &spec.copy_target_layers {
        if copied.len() != spec.layers || copied.iter().any(|&l| l >= target.num_layers) {
            return Err(InitError::Spec(format!(
                "copy target layers {copied:?}: one per head layer ({}) of the target's {}",
                spec.layers, target.num_layers
            )));
        }
        if spec.intermediate_size.is_some_and(|i| i != target.intermediate_size) {
            return Err(InitError::Spec("copied target layers keep the target's MLP width".into()));
        }
    }
    if target.num_layers < 4 && spec.tap_layers.is_none() {
        // DFlash's rule spreads taps over layers 1..n−3, which needs at least 4 target layers.
        return Err(InitError::Spec(format!(
            "the target has {} layers; name the tap layers explicitly",
            target.num_layers
        )));
    }
    Ok(())
}

/// A token the target never produces, for the mask: `<|vision_pad|>` among the tokenizer's added
/// tokens, else the last added special token that is not one the tokenizer config names (BOS,
/// EOS, pad, unk).
fn reserved_token_id(target_dir: &Path) -> Result<i64, InitError> {
    const VISION_PAD: &str = "<|vision_pad|>";
    let tokenizer = read_json(&target_dir.join("tokenizer.json"))?;
    let added: Vec<(&str, i64, bool)> = tokenizer
        .get("added_tokens")
        .and_then(Value::as_array)
        .map(|tokens| {
            tokens
                .iter()
                .filter_map(|t| {
                    let special = t.get("special").and_then(Value::as_bool).unwrap_or(false);
                    Some((t.get("content")?.as_str()?, t.get("id")?.as_i64()?, special))
                })
                .collect()
        })
        .unwrap_or_default();
    if let Some(&(_, id, _)) = added.iter().find(|(content, _, _)| *content == VISION_PAD) {
        return Ok(id);
    }
    let config = read_json(&target_dir.join("tokenizer_config.json")).unwrap_or(Value::Null);
    let named: Vec<&str> = ["bos_token", "eos_token", "pad_token", "unk_token"]
        .iter()
        .filter_map(|key| config.get(*key).and_then(Value::as_str))
        .collect();
    added
        .iter()
        .rev()
        .find(|(content, _, special)| *special && !named.contains(content))
        .map(|&(_, id, _)| id)
        .ok_or_else(|| {
            InitError::Spec("the target tokenizer has no reserved special token; pass mask_token_id".into())
        })
}

/// A dtype as a checkpoint's config.json spells it (HF's `dtype` field).
pub(crate) fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// `config.json` in the spelling of the public DFlash checkpoints (Qwen3Config keys, DFlash's
/// `block_size` and `dflash_config`).
fn head_config_json(target: &TextConfig, spec: &HeadSpec, taps: &[usize], mask: i64) -> Value {
    let dtype = dtype_name(spec.dtype);
    json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "block_size": spec.block_size,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": taps},
        "dtype": dtype,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size.unwrap_or(target.intermediate_size),
        "layer_types": vec!["full_attention"; spec.layers],
        "max_position_embeddings": 40960,
        "num_attention_heads": target.num_heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": target.num_kv_heads,
        "num_target_layers": target.num_layers,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_scaling": null,
        "rope_theta": spec.rope_theta.unwrap_or(target.rope_theta),
        "sliding_window": null,
        "tie_word_embeddings": false,
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": target.vocab_size,
    })
}

/// Every tensor of the head, by DFlash name, in the stored dtype.
fn random_weights(target: &TextConfig, spec: &HeadSpec, taps: i64) -> Vec<(String, Tensor)> {
    let d = target.hidden_size;
    let inter = spec.intermediate_size.unwrap_or(target.intermediate_size);
    let q_dim = target.num_heads * target.head_dim;
    let kv_dim = target.num_kv_heads * target.head_dim;
    let mut shapes: Vec<(String, Vec<i64>)> = vec![
        ("fc.weight".into(), vec![d, taps * d]),
        ("hidden_norm.weight".into(), vec![d]),
        ("norm.weight".into(), vec![d]),
    ];
    for i in 0..spec.layers {
        let p = format!("layers.{i}");
        shapes.extend([
            (format!("{p}.self_attn.q_proj.weight"), vec![q_dim, d]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv_dim, d]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv_dim, d]),
            (format!("{p}.self_attn.o_proj.weight"), vec![d, q_dim]),
            (format!("{p}.self_attn.q_norm.weight"), vec![target.head_dim]),
            (format!("{p}.self_attn.k_norm.weight"), vec![target.head_dim]),
            (format!("{p}.mlp.gate_proj.weight"), vec![inter, d]),
            (format!("{p}.mlp.up_proj.weight"), vec![inter, d]),
            (format!("{p}.mlp.down_proj.weight"), vec![d, inter]),
            (format!("{p}.input_layernorm.weight"), vec![d]),
            (format!("{p}.post_attention_layernorm.weight"), vec![d]),
        ]);
    }
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let tensor = if name == "norm.weight" {
                Tensor::full(shape.as_slice(), spec.output_norm_init, (Kind::Float, tch::Device::Cpu))
            } else if shape.len() == 1 {
                Tensor::ones(shape.as_slice(), (Kind::Float, tch::Device::Cpu))
            } else {
                normal_matrix(&name, &shape, spec)
            };
            (name, tensor.to_kind(spec.dtype))
        })
        .collect()
}

/// Overwrites the head layers' tensors with the target layers `layers` (head layer i from target
/// layer `layers[i]`), `fc` with the identity on the last tap's block and `hidden_norm` with the
/// first copied layer's input norm. The head's q/k norms stay 1 where the target has none (Llama).
fn copy_target_layers(
    target_dir: &Path,
    target: &TextConfig,
    layers: &[usize],
    tensors: &mut [(String, Tensor)],
    dtype: Kind,
) -> Result<(), InitError> {
    let wanted = copy_sources(layers, tensors);
    let found = read_copy_sources(target_dir, &wanted)?;
    for (name, sources) in &wanted {
        let Some(value) = sources.iter().find_map(|s| found.get(s)) else {
            if name.ends_with("q_norm.weight") || name.ends_with("k_norm.weight") {
                continue; // a target without q/k norms (Llama): the head's stay 1
            }
            return Err(InitError::Spec(format!("the target has no {}", sources.join(" or "))));
        };
        let Some((_, slot)) = tensors.iter_mut().find(|(n, _)| n == name) else { continue };
        if slot.size() != value.size() {
            return Err(InitError::Spec(format!(
                "{name} is {:?}, the target's {} is {:?}",
                slot.size(),
                sources[0],
                value.size()
            )));
        }
        *slot = value.to_kind(dtype);
    }
    let d = target.hidden_size;
    if let Some((_, fc)) = tensors.iter_mut().find(|(n, _)| n == "fc.weight") {
        let taps = fc.size()[1] / d;
        let identity = Tensor::eye(d, (Kind::Float, tch::Device::Cpu));
        let zeros = Tensor::zeros([d, (taps - 1) * d], (Kind::Float, tch::Device::Cpu));
        *fc = Tensor::cat(&[zeros, identity], 1).to_kind(dtype);
    }
    Ok(())
}

/// Each head tensor a copy overwrites, with the target's names for its source (the transformers
/// 5.x and 4.x spellings).
fn copy_sources(layers: &[usize], tensors: &[(String, Tensor)]) -> Vec<(String, Vec<String>)> {
    let spellings = |layer: usize, suffix: &str| {
        glance_models::weights::spellings(&format!("model.language_model.layers.{layer}.{suffix}"))
    };
    let mut wanted = Vec::new();
    for (i, &layer) in layers.iter().enumerate() {
        let prefix = format!("layers.{i}.");
        for (name, _) in tensors.iter().filter(|(n, _)| n.starts_with(&prefix)) {
            wanted.push((name.clone(), spellings(layer, &name[prefix.len()..])));
        }
    }
    wanted.push(("hidden_norm.weight".into(), spellings(layers[0], "input_layernorm.weight")));
    wanted
}

/// The target tensors `wanted` names, refusing a target whose copied layers have biases (Qwen2-
/// style attention, Llama's `mlp_bias`): a DFlash head's layers have none, so they would be lost.
fn read_copy_sources(
    target_dir: &Path,
    wanted: &[(String, Vec<String>)],
) -> Result<HashMap<String, Tensor>, InitError> {
    let sources = || wanted.iter().flat_map(|(_, s)| s.iter());
    let biases: Vec<String> =
        sources().filter(|s| s.ends_with("_proj.weight")).map(|s| s.replace(".weight", ".bias")).collect();
    let names: Vec<&str> = sources().chain(&biases).map(String::as_str).collect();
    let found = glance_models::weights::read_named_tensors(target_dir, &names, Kind::Float, tch::Device::Cpu)
        .map_err(|e| InitError::Head(e.into()))?;
    match biases.iter().find(|b| found.contains_key(b.as_str())) {
        Some(bias) => Err(InitError::Spec(format!(
            "cannot copy target layers with biases ({bias}): a DFlash head's layers have none"
        ))),
        None => Ok(found),
    }
}

/// N(0, std) entries from a stream seeded by (seed, tensor name), so one tensor's values do not
/// depend on which others exist.
fn normal_matrix(name: &str, shape: &[i64], spec: &HeadSpec) -> Tensor {
    let count: i64 = shape.iter().product();
    let mut rng = Rng::new(spec.seed ^ fnv1a(name.as_bytes()));
    let values: Vec<f32> = (0..count).map(|_| (rng.standard_normal() * spec.init_std) as f32).collect();
    glance_models::host_tensor(&values).view(shape)
}

/// What EAGLE-3 head to build; dimensions are the target's (one decoder layer of its width).
#[derive(Clone, Debug)]
pub struct Eagle3Spec {
    /// Default: EAGLE's taps for the target's depth (outputs of layers 1, N/2−1, N−4).
    pub tap_layers: Option<Vec<usize>>,
    /// The draft vocabulary: target ids, increasing (EAGLE takes the most frequent tokens of the
    /// training responses); `None` drafts over the whole vocabulary (no `d2t`).
    pub draft_vocab: Option<Vec<i64>>,
    pub seed: u64,
    pub init_std: f64,
}

impl Eagle3Spec {
    pub fn new(seed: u64) -> Self {
        Self { tap_layers: None, draft_vocab: None, seed, init_std: 0.02 }
    }
}

/// Writes a random EAGLE-3 head fitting the target in `target_dir` to `out_dir` (`config.json`,
/// `model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head`, and `d2t`/`t2d` for a reduced
/// draft vocabulary) and returns the config as the loader reads it back.
pub fn write_random_eagle3_head(
    target_dir: &Path,
    out_dir: &Path,
    spec: &Eagle3Spec,
) -> Result<Eagle3Config, InitError> {
    let target = target_text_config(target_dir)?;
    let taps = match &spec.tap_layers {
        Some(taps) => taps.clone(),
        None => default_tap_layers(target.num_layers).ok_or_else(|| {
            InitError::Spec(format!("the target has {} layers; name the three tap layers", target.num_layers))
        })?,
    };
    if taps.len() != 3 || taps.iter().any(|&t| t >= target.num_layers) {
        return Err(InitError::Spec(format!(
            "tap layers {taps:?}: three layers of the target's {}",
            target.num_layers
        )));
    }
    let vocab = target.vocab_size;
    let draft_vocab = spec.draft_vocab.clone().unwrap_or_else(|| (0..vocab).collect());
    if draft_vocab.is_empty()
        || draft_vocab.windows(2).any(|w| w[0] >= w[1])
        || draft_vocab.iter().any(|&t| !(0..vocab).contains(&t))
    {
        return Err(InitError::Spec("the draft vocabulary must be increasing target ids".into()));
    }
    let (d, inter, heads, kv_heads, head_dim) = (
        target.hidden_size,
        target.intermediate_size,
        target.num_heads,
        target.num_kv_heads,
        target.head_dim,
    );
    let config = json!({
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": d,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": 40960,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab.len(),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps},
    });
    let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
    let shapes: Vec<(&str, Vec<i64>)> = vec![
        ("fc.weight", vec![d, 3 * d]),
        ("midlayer.hidden_norm.weight", vec![d]),
        ("midlayer.input_layernorm.weight", vec![d]),
        ("midlayer.self_attn.q_proj.weight", vec![q_dim, 2 * d]),
        ("midlayer.self_attn.k_proj.weight", vec![kv_dim, 2 * d]),
        ("midlayer.self_attn.v_proj.weight", vec![kv_dim, 2 * d]),
        ("midlayer.self_attn.o_proj.weight", vec![d, q_dim]),
        ("midlayer.post_attention_layernorm.weight", vec![d]),
        ("midlayer.mlp.gate_proj.weight", vec![inter, d]),
        ("midlayer.mlp.up_proj.weight", vec![inter, d]),
        ("midlayer.mlp.down_proj.weight", vec![d, inter]),
        ("norm.weight", vec![d]),
        ("lm_head.weight", vec![draft_vocab.len() as i64, d]),
    ];
    let matrix_spec = HeadSpec { seed: spec.seed, init_std: spec.init_std, ..HeadSpec::new(1, 2, spec.seed) };
    let mut tensors: Vec<(String, Tensor)> = shapes
        .into_iter()
        .map(|(name, shape)| {
            let tensor = match shape.len() {
                1 => Tensor::ones(shape.as_slice(), (Kind::Float, tch::Device::Cpu)),
                _ => normal_matrix(name, &shape, &matrix_spec),
            };
            (name.to_string(), tensor)
        })
        .collect();
    if draft_vocab.len() as i64 != vocab {
        let offsets: Vec<i64> = draft_vocab.iter().enumerate().map(|(i, &t)| t - i as i64).collect();
        let mut mask = vec![false; vocab as usize];
        draft_vocab.iter().for_each(|&t| mask[t as usize] = true);
        tensors.push(("d2t".into(), glance_models::host_tensor(&offsets)));
        tensors.push(("t2d".into(), glance_models::host_tensor(&mask)));
    }
    save::create_dir(out_dir)?;
    save::write_json(&out_dir.join("config.json"), &config)?;
    save::write_safetensors(&out_dir.join("model.safetensors"), &tensors)?;
    Ok(Eagle3Config::load(out_dir, &target)?)
}
