//! Target vision-language models in libtorch: Qwen3-VL and Qwen2.5-VL, loaded unchanged from
//! Hugging Face model directories (one file per family; the shared language model is in `text`).

pub mod layers;
pub mod qwen2_5_vl;
pub mod qwen3_vl;
pub mod text;

use std::path::Path;

use serde_json::Value;
use tch::{Device, Kind, Tensor};

pub use text::{LogitRows, MropeLayout, StepInput, StepOutput, TextConfig, VisionEmbeds};

use crate::kv_cache::{CacheError, KvCache};
use crate::weights::{Checkpoint, WeightsError};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("unsupported model_type {0:?} (supported: qwen3_vl, qwen2_5_vl)")]
    UnsupportedModel(String),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("bad model input: {0}")]
    Input(String),
}

/// The two supported families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen3Vl,
    Qwen25Vl,
}

impl Family {
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen3Vl => "qwen3_vl",
            Self::Qwen25Vl => "qwen2_5_vl",
        }
    }
}

/// Token ids and geometry that the input pipeline and decoders need from `config.json`.
#[derive(Clone, Debug)]
pub struct MultimodalIds {
    pub image_token_id: i64,
    pub video_token_id: i64,
    pub vision_start_token_id: i64,
    pub vision_end_token_id: i64,
    pub spatial_merge_size: i64,
}

/// The vision tower of either family.
pub enum VisionTower {
    Qwen3Vl(qwen3_vl::VisionModel),
    Qwen25Vl(qwen2_5_vl::VisionModel),
}

impl VisionTower {
    fn encode(&self, pixel_values: &Tensor, grids: &[[i64; 3]]) -> VisionEmbeds {
        match self {
            Self::Qwen3Vl(v) => v.forward(pixel_values, grids),
            Self::Qwen25Vl(v) => v.forward(pixel_values, grids),
        }
    }
}

/// A loaded target VLM.
pub struct TargetModel {
    pub family: Family,
    pub ids: MultimodalIds,
    pub text: text::TextModel,
    vision: VisionTower,
    kind: Kind,
    device: Device,
}

impl TargetModel {
    /// Loads a model directory (config.json + safetensors) in `kind` on `device`. Every weight the
    /// architecture needs must be present with the configured shape.
    pub fn load(dir: &Path, kind: Kind, device: Device) -> Result<Self, ModelError> {
        let config = read_json(&dir.join("config.json"))?;
        let mut ckpt = Checkpoint::open(dir, kind, device)?;
        let model = Self::from_checkpoint(&config, &mut ckpt)?;
        let unused = ckpt.remaining();
        if !unused.is_empty() {
            tracing::warn!(count = unused.len(), first = %unused[0], "checkpoint tensors not used by the model");
        }
        Ok(model)
    }

    /// Builds the model a parsed `config.json` describes from `ckpt` (stored, fresh or trainable
    /// weights).
    pub fn from_checkpoint(config: &Value, ckpt: &mut Checkpoint) -> Result<Self, ModelError> {
        let (kind, device) = (ckpt.kind(), ckpt.device());
        let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or_default();
        let (family, ids, text, vision) = match model_type {
            "qwen3_vl" => {
                let (ids, text, vision) = qwen3_vl::load(config, ckpt)?;
                (Family::Qwen3Vl, ids, text, VisionTower::Qwen3Vl(vision))
            }
            "qwen2_5_vl" => {
                let (ids, text, vision) = qwen2_5_vl::load(config, ckpt)?;
                (Family::Qwen25Vl, ids, text, VisionTower::Qwen25Vl(vision))
            }
            other => return Err(ModelError::UnsupportedModel(other.to_string())),
        };
        Ok(Self { family, ids, text, vision, kind, device })
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn text_config(&self) -> &TextConfig {
        &self.text.config
    }

    /// Runs the vision tower. `pixel_values`: (patches, C·T·P·P) f32 as the processor lays them
    /// out; `grids`: (t, h, w) in patches per image, in prompt order.
    pub fn encode_images(&self, pixel_values: &Tensor, grids: &[[i64; 3]]) -> VisionEmbeds {
        let pixels = pixel_values.to_device(self.device).to_kind(self.kind);
        self.vision.encode(&pixels, grids)
    }

    pub fn forward(&self, input: &StepInput, cache: &mut KvCache) -> Result<StepOutput, ModelError> {
        self.text.forward(input, cache)
    }

    /// A KV cache for `capacity` positions in the model's dtype and device.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        self.text.new_cache(capacity, self.kind, self.device)
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Value, ModelError> {
    let err = |reason: String| ModelError::Config { path: path.display().to_string(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| err(e.to_string()))
}

/// Typed access to a config object with the file named in errors.
pub(crate) struct ConfigView<'a> {
    pub value: &'a Value,
    pub section: &'static str,
}

impl<'a> ConfigView<'a> {
    pub fn new(value: &'a Value, section: &'static str) -> Self {
        Self { value, section }
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::Config {
            path: format!("config.json ({})", self.section),
            reason: format!("missing or invalid key {key:?}"),
        }
    }

    pub fn int(&self, key: &str) -> Result<i64, ModelError> {
        self.value.get(key).and_then(Value::as_i64).ok_or_else(|| self.missing(key))
    }

    pub fn int_or(&self, key: &str, default: i64) -> i64 {
        self.value.get(key).and_then(Value::as_i64).unwrap_or(default)
    }

    pub fn float_or(&self, key: &str, default: f64) -> f64 {
        self.value.get(key).and_then(Value::as_f64).unwrap_or(default)
    }

    pub fn bool_or(&self, key: &str, default: bool) -> bool {
        self.value.get(key).and_then(Value::as_bool).unwrap_or(default)
    }

    pub fn str_or(&self, key: &'a str, default: &'a str) -> &'a str {
        self.value.get(key).and_then(Value::as_str).unwrap_or(default)
    }

    pub fn int_list(&self, key: &str) -> Option<Vec<i64>> {
        self.value.get(key)?.as_array()?.iter().map(Value::as_i64).collect()
    }

    pub fn activation(&self, default: &str) -> Result<layers::Activation, ModelError> {
        let name = self.str_or("hidden_act", default);
        layers::Activation::from_name(name).ok_or_else(|| self.missing("hidden_act"))
    }
}

/// Reads the language-model section: `text_config` when present (all Qwen3-VL files and
/// transformers-5.x saves), else the top level (Qwen2.5-VL hub files). Rope settings may be
/// spelled `rope_parameters` (5.x) or `rope_scaling` + `rope_theta` (4.x).
pub(crate) fn text_config(
    root: &Value,
    default_theta: f64,
    interleaved_default: bool,
    qwen3_style: bool,
) -> Result<TextConfig, ModelError> {
    let section = root.get("text_config").unwrap_or(root);
    let c = ConfigView::new(section, "text_config");
    let rope = section.get("rope_parameters").or_else(|| section.get("rope_scaling"));
    let rope_view = rope.map(|r| ConfigView::new(r, "rope_parameters"));
    let rope_theta = rope_view
        .as_ref()
        .and_then(|r| r.value.get("rope_theta").and_then(Value::as_f64))
        .unwrap_or_else(|| c.float_or("rope_theta", default_theta));
    let sections = rope_view
        .as_ref()
        .and_then(|r| r.int_list("mrope_section"))
        .ok_or_else(|| c.missing("mrope_section"))?;
    let sections: Vec<usize> = sections.into_iter().map(|s| s as usize).collect();
    let interleaved = rope_view
        .as_ref()
        .map(|r| r.bool_or("mrope_interleaved", interleaved_default))
        .unwrap_or(interleaved_default);
    let hidden_size = c.int("hidden_size")?;
    let num_heads = c.int("num_attention_heads")?;
    let head_dim =
        if qwen3_style { c.int_or("head_dim", hidden_size / num_heads) } else { hidden_size / num_heads };
    if sections.iter().sum::<usize>() as i64 != head_dim / 2 {
        return Err(c.missing("mrope_section (must sum to head_dim/2)"));
    }
    let tie = root
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .or_else(|| section.get("tie_word_embeddings").and_then(Value::as_bool))
        .unwrap_or(false);
    let attention_bias = c.bool_or("attention_bias", false);
    Ok(TextConfig {
        vocab_size: c.int("vocab_size")?,
        hidden_size,
        intermediate_size: c.int("intermediate_size")?,
        num_layers: c.int("num_hidden_layers")? as usize,
        num_heads,
        num_kv_heads: c.int_or("num_key_value_heads", num_heads),
        head_dim,
        rms_norm_eps: c.float_or("rms_norm_eps", 1e-6),
        rope_theta,
        mrope: if interleaved {
            MropeLayout::Interleaved(sections)
        } else {
            MropeLayout::Sectioned(sections)
        },
        max_position_embeddings: c.int_or("max_position_embeddings", 32768) as usize,
        activation: c.activation("silu")?,
        tie_word_embeddings: tie,
        qkv_bias: if qwen3_style { attention_bias } else { true },
        o_bias: qwen3_style && attention_bias,
        qk_norm: qwen3_style,
    })
}

/// Multimodal token ids from the top level of `config.json`.
pub(crate) fn multimodal_ids(root: &Value, spatial_merge_size: i64) -> Result<MultimodalIds, ModelError> {
    let c = ConfigView::new(root, "top level");
    Ok(MultimodalIds {
        image_token_id: c.int("image_token_id")?,
        video_token_id: c.int_or("video_token_id", -1),
        vision_start_token_id: c.int("vision_start_token_id")?,
        vision_end_token_id: c.int_or("vision_end_token_id", -1),
        spatial_merge_size,
    })
}

/// Vision position ids (h, w) of each patch in spatial-merge block order, repeated per frame:
/// the order in which the processor lays out patches.
pub(crate) fn vision_patch_coords(grids: &[[i64; 3]], merge: i64) -> Vec<[i64; 2]> {
    let mut coords = Vec::new();
    for &[t, h, w] in grids {
        for _ in 0..t {
            for block_row in 0..h / merge {
                for block_col in 0..w / merge {
                    for in_row in 0..merge {
                        for in_col in 0..merge {
                            coords.push([block_row * merge + in_row, block_col * merge + in_col]);
                        }
                    }
                }
            }
        }
    }
    coords
}

/// cos/sin (N, head_dim) f32 of the vision tower's 2-D rotary embedding.
pub(crate) fn vision_rotary(
    coords: &[[i64; 2]],
    head_dim: i64,
    theta: f64,
    device: Device,
) -> (Tensor, Tensor) {
    let inv_freq = layers::inverse_frequencies(theta, head_dim / 2, device); // (hd/4)
    let flat: Vec<i64> = coords.iter().flat_map(|c| c.iter().copied()).collect();
    let pos = Tensor::from_slice(&flat).to_device(device).view([-1, 2]).to_kind(Kind::Float);
    let freqs = pos.unsqueeze(-1) * inv_freq; // (N, 2, hd/4)
    let n = coords.len() as i64;
    let hw = freqs.view([n, -1]); // (N, hd/2): h freqs then w freqs
    let angles = Tensor::cat(&[&hw, &hw], -1);
    (angles.cos(), angles.sin())
}

/// Vision self-attention (both families): fused qkv, 2-D rotary in f32, non-causal attention
/// within each segment, output projection.
pub(crate) struct VisionAttention {
    pub qkv: layers::Linear,
    pub proj: layers::Linear,
    pub num_heads: i64,
}

impl VisionAttention {
    pub fn load(ckpt: &mut Checkpoint, prefix: &str, dim: i64, num_heads: i64) -> Result<Self, WeightsError> {
        Ok(Self {
            qkv: layers::Linear::load(ckpt, &format!("{prefix}.qkv"), dim, 3 * dim, true)?,
            proj: layers::Linear::load(ckpt, &format!("{prefix}.proj"), dim, dim, true)?,
            num_heads,
        })
    }

    /// x: (N, dim); cos/sin: (N, head_dim) f32; segments: (start, len) ranges attended separately.
    pub fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, segments: &[(i64, i64)]) -> Tensor {
        let n = x.size()[0];
        let qkv = self.qkv.forward(x).view([n, 3, self.num_heads, -1]).permute([1, 0, 2, 3]);
        let (cos, sin) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let rope = |t: Tensor| layers::apply_rotary(&t.to_kind(Kind::Float), &cos, &sin).to_kind(x.kind());
        let q = rope(qkv.get(0)).transpose(0, 1);
        let k = rope(qkv.get(1)).transpose(0, 1);
        let v = qkv.get(2).transpose(0, 1);
        self.proj.forward(&layers::segmented_attention(&q, &k, &v, segments))
    }
}

/// Consecutive (start, len) segments with one image (one frame) each.
pub(crate) fn per_frame_segments(grids: &[[i64; 3]]) -> Vec<(i64, i64)> {
    let mut segments = Vec::new();
    let mut start = 0;
    for &[t, h, w] in grids {
        for _ in 0..t {
            segments.push((start, h * w));
            start += h * w;
        }
    }
    segments
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_coords_follow_merge_blocks() {
        let coords = vision_patch_coords(&[[1, 2, 4]], 2);
        assert_eq!(&coords[..6], &[[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3]]);
        assert_eq!(coords.len(), 8);
    }
}
