//! A randomly initialized draft head for a given target: the fixture for tests today and the
//! starting point of training later. Writes a DFlash-style model directory (`config.json` as
//! the public DFlash checkpoints spell it, `model.safetensors` with DFlash's tensor names) whose
//! dimensions follow the target's language model. Initialization as transformers'
//! Qwen3PreTrainedModel does it: matrices N(0, std), RMSNorm weights 1. Seeded with a private
//! generator, so the same spec gives the same bytes whatever else runs in the process.

use std::path::Path;

use serde_json::{json, Value};
use tch::{Kind, Tensor};

use glance_models::TextConfig;
use glance_train::rng::{fnv1a, Rng};
use glance_train::save::{self, SaveError};

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
    save::create_dir(out_dir)?;
    save::write_json(&out_dir.join("config.json"), &config)?;
    let tensors = random_weights(&target, spec, taps.len() as i64);
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

/// `config.json` in the spelling of the public DFlash checkpoints (Qwen3Config keys, DFlash's
/// `block_size` and `dflash_config`).
fn head_config_json(target: &TextConfig, spec: &HeadSpec, taps: &[usize], mask: i64) -> Value {
    let dtype = match spec.dtype {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    };
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

/// N(0, std) entries from a stream seeded by (seed, tensor name), so one tensor's values do not
/// depend on which others exist.
fn normal_matrix(name: &str, shape: &[i64], spec: &HeadSpec) -> Tensor {
    let count: i64 = shape.iter().product();
    let mut rng = Rng::new(spec.seed ^ fnv1a(name.as_bytes()));
    let values: Vec<f32> = (0..count).map(|_| (rng.standard_normal() * spec.init_std) as f32).collect();
    Tensor::from_slice(&values).view(shape)
}
