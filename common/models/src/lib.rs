//! glance-models: the model library — target models in libtorch (the vision-language Qwen3-VL and
//! Qwen2.5-VL, the text-only Llama and Qwen3; one file per family, the shared language model in
//! `text`), loaded unchanged from Hugging Face model directories with their typed `config.json`
//! (`config`), checkpoint reading (`weights`), the preallocated KV cache, decoding (`decode`), the
//! sampler (`sampling`), what a pass reads back per row (`readout`: the choice, the entropy, the
//! log-probabilities) and the few-row matrix product for CPUs (`skinny_gemm`: bf16 and f16
//! weights where the CPU has no matrix instructions for them, small f32 ones; chosen by
//! `layers::linear`).

pub mod config;
pub mod decode;
pub mod kv_cache;
pub mod layers;
pub mod llama;
pub mod qwen2_5_vl;
pub mod qwen3;
pub mod qwen3_vl;
pub mod readout;
pub mod sampling;
pub mod skinny_gemm;
pub mod text;
pub mod weights;

use std::path::Path;

use tch::{Device, Kind, Tensor};

pub use config::{Family, TargetConfig};
/// The host/device crossings, where the model code and its callers have always found them.
pub use glance_device::{host_tensor, read_back, read_f64, read_i64, stage_to_host, upload, upload_tensor};
pub use text::{LogitRows, MropeLayout, RopeScaling, StepInput, StepOutput, TextConfig, VisionEmbeds};

use crate::kv_cache::{CacheError, KvCache};
use crate::weights::{Checkpoint, WeightsError};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("unsupported model_type {0:?} (supported: qwen3_vl, qwen2_5_vl, llama, qwen3)")]
    UnsupportedModel(String),
    #[error("this {0} model is text-only: it takes no images")]
    TextOnly(&'static str),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("bad model input: {0}")]
    Input(String),
}

/// The image token id given to the language model of a family without images (no id matches).
const NO_IMAGE_TOKEN: i64 = -1;

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

/// A loaded target model: a language model and, for the VLM families, a vision tower.
pub struct TargetModel {
    pub config: TargetConfig,
    pub family: Family,
    /// The multimodal token ids (`None` for a text-only family).
    pub ids: Option<MultimodalIds>,
    pub text: text::TextModel,
    vision: Option<VisionTower>,
    kind: Kind,
    device: Device,
}

impl TargetModel {
    /// Loads a model directory (config.json + safetensors) in `kind` on `device`. Every weight the
    /// architecture needs must be present with the configured shape.
    pub fn load(dir: &Path, kind: Kind, device: Device) -> Result<Self, ModelError> {
        let config = TargetConfig::read(dir)?;
        let mut ckpt = Checkpoint::open(dir, kind, device)?;
        let model = Self::from_checkpoint(&config, &mut ckpt)?;
        let unused = ckpt.remaining();
        if !unused.is_empty() {
            tracing::warn!(count = unused.len(), first = %unused[0], "checkpoint tensors not used by the model");
        }
        Ok(model)
    }

    /// Builds the model `config` describes from `ckpt` (stored, fresh or trainable weights).
    pub fn from_checkpoint(config: &TargetConfig, ckpt: &mut Checkpoint) -> Result<Self, ModelError> {
        let (kind, device) = (ckpt.kind(), ckpt.device());
        let (ids, text, vision) = match config.family {
            Family::Qwen3Vl => {
                let (ids, text, vision) = qwen3_vl::load(config, ckpt)?;
                (Some(ids), text, Some(VisionTower::Qwen3Vl(vision)))
            }
            Family::Qwen25Vl => {
                let (ids, text, vision) = qwen2_5_vl::load(config, ckpt)?;
                (Some(ids), text, Some(VisionTower::Qwen25Vl(vision)))
            }
            Family::Llama => (None, llama::load(config, ckpt)?, None),
            Family::Qwen3 => (None, qwen3::load(config, ckpt)?, None),
        };
        Ok(Self { config: config.clone(), family: config.family, ids, text, vision, kind, device })
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
    pub fn encode_images(
        &self,
        pixel_values: &Tensor,
        grids: &[[i64; 3]],
    ) -> Result<VisionEmbeds, ModelError> {
        let vision = self.vision.as_ref().ok_or(ModelError::TextOnly(self.family.model_type()))?;
        let pixels = upload_tensor(pixel_values, self.device).to_kind(self.kind);
        Ok(vision.encode(&pixels, grids))
    }

    pub fn forward(&self, input: &StepInput, cache: &mut KvCache) -> Result<StepOutput, ModelError> {
        self.text.forward(input, cache)
    }

    /// A KV cache for `capacity` positions in the model's dtype and device.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        self.text.new_cache(capacity, self.kind, self.device)
    }

    /// A KV cache for a pass with gradients (training the toy target).
    pub fn new_training_cache(&self, capacity: usize) -> KvCache {
        self.text.new_training_cache(capacity, self.kind, self.device)
    }
}

/// Multimodal token ids from the top level of `config.json`.
fn multimodal_ids(config: &TargetConfig, spatial_merge_size: i64) -> Result<MultimodalIds, ModelError> {
    let top = &config.top;
    let required = |id: Option<u32>, key: &str| {
        id.map(i64::from).ok_or_else(|| ModelError::Config {
            path: "config.json (top level)".into(),
            reason: format!("missing or invalid key {key:?}"),
        })
    };
    Ok(MultimodalIds {
        image_token_id: required(top.image_token_id, "image_token_id")?,
        video_token_id: top.video_token_id.map_or(-1, i64::from),
        vision_start_token_id: required(top.vision_start_token_id, "vision_start_token_id")?,
        vision_end_token_id: top.vision_end_token_id.map_or(-1, i64::from),
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
    let pos = upload(&flat, device).view([-1, 2]).to_kind(Kind::Float);
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
