//! Qwen3-VL (dense): vision tower with a learned, bilinearly resampled position table, 2-D rotary,
//! LayerNorm blocks, a 2×2 patch merger and DeepStack mergers whose features are added to the
//! first language-model layers; Qwen3 language model with interleaved M-RoPE.

use serde::Deserialize;
use tch::{Kind, Tensor};

use super::layers::{gemm_layout, Activation, LayerNorm, Linear};
use super::text::{TextModel, VisionEmbeds};
use super::{
    multimodal_ids, per_frame_segments, vision_patch_coords, vision_rotary, ModelError, MultimodalIds,
    VisionAttention,
};
use crate::config::{RopeSection, TargetConfig};
use crate::weights::{Checkpoint, WeightsError};

const TEXT_PREFIX: &str = "model.language_model";
const VISION_PREFIX: &str = "model.visual";

/// `vision_config` of a Qwen3-VL `config.json`, with transformers' defaults.
#[derive(Clone, Debug, Deserialize)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_heads: i64,
    #[serde(default = "default_in_channels")]
    pub in_channels: i64,
    #[serde(default = "default_patch_size")]
    pub patch_size: i64,
    #[serde(default = "default_two")]
    pub temporal_patch_size: i64,
    #[serde(default = "default_two")]
    pub spatial_merge_size: i64,
    pub out_hidden_size: i64,
    pub num_position_embeddings: i64,
    #[serde(default)]
    pub deepstack_visual_indexes: Vec<usize>,
    #[serde(rename = "hidden_act", default = "default_activation")]
    pub activation: Activation,
    #[serde(default)]
    pub rope_parameters: Option<RopeSection>,
}

fn default_in_channels() -> i64 {
    3
}

fn default_patch_size() -> i64 {
    16
}

fn default_two() -> i64 {
    2
}

fn default_activation() -> Activation {
    Activation::GeluTanh
}

impl VisionConfig {
    /// The vision rotary's base (10 000 unless the file says otherwise).
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters.as_ref().and_then(|r| r.rope_theta).unwrap_or(10_000.0)
    }

    fn patch_dim(&self) -> i64 {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// Loads the Qwen3-VL parts from its `config.json` and the checkpoint.
pub fn load(
    config: &TargetConfig,
    ckpt: &mut Checkpoint,
) -> Result<(MultimodalIds, TextModel, VisionModel), ModelError> {
    let vision_config: VisionConfig = config.vision()?;
    let ids = multimodal_ids(config, vision_config.spatial_merge_size)?;
    let text_config = config.text_config()?;
    if vision_config.out_hidden_size != text_config.hidden_size {
        return Err(ModelError::Config {
            path: "config.json".into(),
            reason: "vision_config.out_hidden_size must equal the text hidden_size".into(),
        });
    }
    let text = TextModel::load(ckpt, TEXT_PREFIX, text_config, ids.image_token_id)?;
    let vision = VisionModel::load(ckpt, vision_config)?;
    Ok((ids, text, vision))
}

struct VisionMlp {
    fc1: Linear,
    fc2: Linear,
    activation: Activation,
}

struct VisionBlock {
    norm1: LayerNorm,
    attn: VisionAttention,
    norm2: LayerNorm,
    mlp: VisionMlp,
}

/// 2×2 merger: LayerNorm (before or after gathering the 4 patches), fc1, exact GELU, fc2.
struct PatchMerger {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    merged_dim: i64,
    postshuffle_norm: bool,
}

pub struct VisionModel {
    pub config: VisionConfig,
    patch_embed: Linear,
    pos_embed: Tensor,
    blocks: Vec<VisionBlock>,
    merger: PatchMerger,
    deepstack_mergers: Vec<PatchMerger>,
}

impl VisionModel {
    fn load(ckpt: &mut Checkpoint, config: VisionConfig) -> Result<Self, WeightsError> {
        let c = &config;
        let dim = c.hidden_size;
        let p = VISION_PREFIX;
        // Conv3d with kernel == stride over a whole patch is a linear map of the flattened patch.
        let conv = ckpt.take(
            &format!("{p}.patch_embed.proj.weight"),
            &[dim, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size],
        )?;
        let conv_bias = ckpt.take(&format!("{p}.patch_embed.proj.bias"), &[dim])?;
        let patch_embed_weight = gemm_layout(conv.reshape([dim, c.patch_dim()]));
        let patch_embed = Linear::from_parts(patch_embed_weight, Some(conv_bias));
        let pos_embed = ckpt.take(&format!("{p}.pos_embed.weight"), &[c.num_position_embeddings, dim])?;
        let blocks = (0..c.depth)
            .map(|i| VisionBlock::load(ckpt, &format!("{p}.blocks.{i}"), c))
            .collect::<Result<Vec<_>, _>>()?;
        let merger = PatchMerger::load(ckpt, &format!("{p}.merger"), c, false)?;
        let deepstack_mergers = (0..c.deepstack_visual_indexes.len())
            .map(|i| PatchMerger::load(ckpt, &format!("{p}.deepstack_merger_list.{i}"), c, true))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { config, patch_embed, pos_embed, blocks, merger, deepstack_mergers })
    }

    /// pixel_values: (patches, patch_dim) → merged embeddings (patches/4, out_hidden) and the
    /// DeepStack features.
    pub fn forward(&self, pixel_values: &Tensor, grids: &[[i64; 3]]) -> VisionEmbeds {
        let c = &self.config;
        let device = pixel_values.device();
        let mut x = self.patch_embed.forward(pixel_values);
        x = &x + self.interpolated_position_embeddings(grids).to_kind(x.kind());
        let coords = vision_patch_coords(grids, c.spatial_merge_size);
        let (cos, sin) = vision_rotary(&coords, c.hidden_size / c.num_heads, c.rope_theta(), device);
        let segments = per_frame_segments(grids);
        let mut deepstack = Vec::new();
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, &cos, &sin, &segments);
            if let Some(k) = c.deepstack_visual_indexes.iter().position(|&d| d == i) {
                deepstack.push(self.deepstack_mergers[k].forward(&x));
            }
        }
        VisionEmbeds { embeds: self.merger.forward(&x), deepstack }
    }

    /// The learned (side × side) position table resampled to each image's patch grid with
    /// bilinear interpolation (align_corners), in merge-block patch order: (patches, hidden).
    fn interpolated_position_embeddings(&self, grids: &[[i64; 3]]) -> Tensor {
        let side = (self.config.num_position_embeddings as f64).sqrt().round() as i64;
        let coords = vision_patch_coords(grids, self.config.spatial_merge_size);
        let mut heights = Vec::with_capacity(coords.len());
        let mut widths = Vec::with_capacity(coords.len());
        for &[t, h, w] in grids {
            let count = (t * h * w) as usize;
            heights.extend(std::iter::repeat_n(h, count));
            widths.extend(std::iter::repeat_n(w, count));
        }
        let mut indices = Vec::with_capacity(coords.len() * 4);
        let mut weights = Vec::with_capacity(coords.len() * 4);
        for ((&[row, col], &h), &w) in coords.iter().zip(&heights).zip(&widths) {
            let (h_taps, h_weights) = bilinear_taps(row, h, side);
            let (w_taps, w_weights) = bilinear_taps(col, w, side);
            for (ht, hw) in h_taps.iter().zip(h_weights) {
                for (wt, ww) in w_taps.iter().zip(w_weights) {
                    indices.push(ht * side + wt);
                    weights.push(hw * ww);
                }
            }
        }
        let device = self.pos_embed.device();
        let n = coords.len() as i64;
        let indices = crate::upload(&indices, device);
        let weights = crate::upload(&weights, device).view([n, 4, 1]);
        let gathered = self.pos_embed.index_select(0, &indices).view([n, 4, -1]);
        // f32 like the reference (f32 weights promote the product), cast by the caller.
        (gathered.to_kind(Kind::Float) * weights).sum_dim_intlist(1, false, None::<Kind>)
    }
}

/// Two taps and weights on one axis, as `F.interpolate(bilinear, align_corners=True)` computes
/// them in f32: source = index·(side−1)/max(size−1, 1).
fn bilinear_taps(index: i64, size: i64, side: i64) -> ([i64; 2], [f32; 2]) {
    let src = (index as f32 * (side - 1) as f32) / ((size - 1).max(1) as f32);
    let floor = src.floor();
    let taps = [floor as i64, floor as i64 + 1].map(|t| t.clamp(0, side - 1));
    let weights = [0.0f32, 1.0].map(|offset| (1.0 - (src - floor - offset).abs()).max(0.0));
    (taps, weights)
}

impl VisionBlock {
    fn load(ckpt: &mut Checkpoint, prefix: &str, c: &VisionConfig) -> Result<Self, WeightsError> {
        let dim = c.hidden_size;
        Ok(Self {
            norm1: LayerNorm::load(ckpt, &format!("{prefix}.norm1"), dim, 1e-6)?,
            attn: VisionAttention::load(ckpt, &format!("{prefix}.attn"), dim, c.num_heads)?,
            norm2: LayerNorm::load(ckpt, &format!("{prefix}.norm2"), dim, 1e-6)?,
            mlp: VisionMlp {
                fc1: Linear::load(ckpt, &format!("{prefix}.mlp.linear_fc1"), dim, c.intermediate_size, true)?,
                fc2: Linear::load(ckpt, &format!("{prefix}.mlp.linear_fc2"), c.intermediate_size, dim, true)?,
                activation: c.activation,
            },
        })
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, segments: &[(i64, i64)]) -> Tensor {
        let h = x + self.attn.forward(&self.norm1.forward(x), cos, sin, segments);
        let mlp = &self.mlp;
        &h + mlp.fc2.forward(&mlp.activation.apply(&mlp.fc1.forward(&self.norm2.forward(&h))))
    }
}

impl PatchMerger {
    fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        c: &VisionConfig,
        postshuffle_norm: bool,
    ) -> Result<Self, WeightsError> {
        let merged_dim = c.hidden_size * c.spatial_merge_size * c.spatial_merge_size;
        let norm_dim = if postshuffle_norm { merged_dim } else { c.hidden_size };
        Ok(Self {
            norm: LayerNorm::load(ckpt, &format!("{prefix}.norm"), norm_dim, 1e-6)?,
            fc1: Linear::load(ckpt, &format!("{prefix}.linear_fc1"), merged_dim, merged_dim, true)?,
            fc2: Linear::load(ckpt, &format!("{prefix}.linear_fc2"), merged_dim, c.out_hidden_size, true)?,
            merged_dim,
            postshuffle_norm,
        })
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let merged = if self.postshuffle_norm {
            self.norm.forward(&x.view([-1, self.merged_dim]))
        } else {
            self.norm.forward(x).view([-1, self.merged_dim])
        };
        self.fc2.forward(&self.fc1.forward(&merged).gelu("none"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bilinear_taps_hit_the_corners() {
        assert_eq!(bilinear_taps(0, 4, 8), ([0, 1], [1.0, 0.0]));
        let (taps, weights) = bilinear_taps(3, 4, 8);
        assert_eq!(taps, [7, 7]);
        assert_eq!(weights[0], 1.0);
        let (taps, weights) = bilinear_taps(1, 3, 8); // src 3.5
        assert_eq!(taps, [3, 4]);
        assert_eq!(weights, [0.5, 0.5]);
    }
}
