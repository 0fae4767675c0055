//! Qwen2.5-VL: vision tower with RMSNorm blocks, SwiGLU MLPs with bias, window attention except
//! in the `fullatt_block_indexes` blocks, and a 2×2 patch merger; Qwen2 language model (q/k/v
//! bias) with sectioned M-RoPE.

use serde::Deserialize;
use tch::Tensor;

use super::layers::{gemm_layout, Activation, Linear, RmsNorm, SwiGlu};
use super::text::{TextModel, VisionEmbeds};
use super::{
    multimodal_ids, per_frame_segments, vision_patch_coords, vision_rotary, ModelError, MultimodalIds,
    VisionAttention,
};
use crate::config::{RopeSection, TargetConfig};
use crate::weights::{Checkpoint, WeightsError};

const TEXT_PREFIX: &str = "model.language_model";
const VISION_PREFIX: &str = "model.visual";

/// `vision_config` of a Qwen2.5-VL `config.json`, with transformers' defaults.
#[derive(Clone, Debug, Deserialize)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_heads: i64,
    in_channels: Option<i64>,
    /// The 4.x hub spelling of `in_channels` (files saved by 4.x carry both).
    in_chans: Option<i64>,
    #[serde(default = "default_patch_size")]
    pub patch_size: i64,
    #[serde(default = "default_two")]
    pub temporal_patch_size: i64,
    #[serde(default = "default_two")]
    pub spatial_merge_size: i64,
    pub out_hidden_size: i64,
    #[serde(default = "default_window_size")]
    pub window_size: i64,
    #[serde(default)]
    pub fullatt_block_indexes: Vec<usize>,
    #[serde(rename = "hidden_act", default = "default_activation")]
    pub activation: Activation,
    #[serde(default)]
    pub rope_parameters: Option<RopeSection>,
}

fn default_patch_size() -> i64 {
    14
}

fn default_two() -> i64 {
    2
}

fn default_window_size() -> i64 {
    112
}

fn default_activation() -> Activation {
    Activation::Silu
}

impl VisionConfig {
    pub fn in_channels(&self) -> i64 {
        self.in_channels.or(self.in_chans).unwrap_or(3)
    }

    /// The vision rotary's base (10 000 unless the file says otherwise).
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters.as_ref().and_then(|r| r.rope_theta).unwrap_or(10_000.0)
    }
}

/// Loads the Qwen2.5-VL parts from its `config.json` and the checkpoint.
pub fn load(
    config: &TargetConfig,
    ckpt: &mut Checkpoint,
) -> Result<(MultimodalIds, TextModel, VisionModel), ModelError> {
    let vision_config: VisionConfig = config.vision()?;
    let ids = multimodal_ids(config, vision_config.spatial_merge_size)?;
    let text_config = config.text_config()?;
    let text = TextModel::load(ckpt, TEXT_PREFIX, text_config, ids.image_token_id)?;
    let vision = VisionModel::load(ckpt, vision_config)?;
    Ok((ids, text, vision))
}

struct VisionBlock {
    norm1: RmsNorm,
    attn: VisionAttention,
    norm2: RmsNorm,
    mlp: SwiGlu,
}

pub struct VisionModel {
    pub config: VisionConfig,
    patch_embed: Linear,
    blocks: Vec<VisionBlock>,
    merger_norm: RmsNorm,
    merger_fc1: Linear,
    merger_fc2: Linear,
}

impl VisionModel {
    fn load(ckpt: &mut Checkpoint, config: VisionConfig) -> Result<Self, WeightsError> {
        let c = &config;
        let dim = c.hidden_size;
        let p = VISION_PREFIX;
        let conv = ckpt.take(
            &format!("{p}.patch_embed.proj.weight"),
            &[dim, c.in_channels(), c.temporal_patch_size, c.patch_size, c.patch_size],
        )?;
        // Conv3d with kernel == stride over a whole patch is a linear map of the flattened patch.
        let patch_embed = Linear::from_weight(gemm_layout(conv.reshape([dim, -1])));
        let blocks = (0..c.depth)
            .map(|i| VisionBlock::load(ckpt, &format!("{p}.blocks.{i}"), c))
            .collect::<Result<Vec<_>, _>>()?;
        let merged = dim * c.spatial_merge_size * c.spatial_merge_size;
        Ok(Self {
            merger_norm: RmsNorm::load(ckpt, &format!("{p}.merger.ln_q"), dim, 1e-6)?,
            merger_fc1: Linear::load(ckpt, &format!("{p}.merger.mlp.0"), merged, merged, true)?,
            merger_fc2: Linear::load(ckpt, &format!("{p}.merger.mlp.2"), merged, c.out_hidden_size, true)?,
            config,
            patch_embed,
            blocks,
        })
    }

    /// pixel_values: (patches, patch_dim) → merged embeddings (patches/4, out_hidden).
    pub fn forward(&self, pixel_values: &Tensor, grids: &[[i64; 3]]) -> VisionEmbeds {
        let c = &self.config;
        let device = pixel_values.device();
        let unit = c.spatial_merge_size * c.spatial_merge_size;
        let windows = WindowPartition::new(grids, c);
        let order = crate::upload(&windows.window_index, device);
        // Window attention needs each window's patches contiguous: reorder whole 2×2 merge units.
        let permute = |t: &Tensor| {
            let n = t.size()[0];
            t.view([n / unit, unit, -1]).index_select(0, &order).view([n, -1])
        };
        let x = permute(&self.patch_embed.forward(pixel_values));
        let coords = vision_patch_coords(grids, c.spatial_merge_size);
        let (cos, sin) = vision_rotary(&coords, c.hidden_size / c.num_heads, c.rope_theta(), device);
        let (cos, sin) = (permute(&cos), permute(&sin));
        let full_segments = per_frame_segments(grids);
        let mut x = x;
        for (i, block) in self.blocks.iter().enumerate() {
            let segments =
                if c.fullatt_block_indexes.contains(&i) { &full_segments } else { &windows.segments };
            x = block.forward(&x, &cos, &sin, segments);
        }
        let merged = self.merger_norm.forward(&x).view([-1, c.hidden_size * unit]);
        let merged = self.merger_fc2.forward(&self.merger_fc1.forward(&merged).gelu("none"));
        let restore = crate::upload(&windows.inverse_index(), device);
        VisionEmbeds { embeds: merged.index_select(0, &restore), deepstack: Vec::new() }
    }
}

/// The window layout of Qwen2.5-VL's vision attention: merge units reordered window by window,
/// and the (start, len) patch range of each non-empty window.
struct WindowPartition {
    window_index: Vec<i64>,
    segments: Vec<(i64, i64)>,
}

impl WindowPartition {
    fn new(grids: &[[i64; 3]], c: &VisionConfig) -> Self {
        let merge = c.spatial_merge_size;
        let unit = merge * merge;
        let span = c.window_size / merge / c.patch_size; // window side in merge units
        let mut window_index = Vec::new();
        let mut segments = Vec::new();
        let (mut offset, mut patch_start) = (0i64, 0i64);
        for &[t, h, w] in grids {
            let (rows, cols) = (h / merge, w / merge);
            // Like the reference, a side that divides evenly still gets one (empty) padded window.
            let windows_down = (rows + span - rows % span) / span;
            let windows_across = (cols + span - cols % span) / span;
            for frame in 0..t {
                for wr in 0..windows_down {
                    for wc in 0..windows_across {
                        let before = window_index.len();
                        for r in (wr * span)..((wr + 1) * span).min(rows) {
                            for col in (wc * span)..((wc + 1) * span).min(cols) {
                                window_index.push(offset + frame * rows * cols + r * cols + col);
                            }
                        }
                        let units = (window_index.len() - before) as i64;
                        if units > 0 {
                            segments.push((patch_start, units * unit));
                            patch_start += units * unit;
                        }
                    }
                }
            }
            offset += t * rows * cols;
        }
        Self { window_index, segments }
    }

    /// The permutation that puts window order back into raster (processor) order.
    fn inverse_index(&self) -> Vec<i64> {
        let mut inverse = vec![0i64; self.window_index.len()];
        for (position, &unit) in self.window_index.iter().enumerate() {
            inverse[unit as usize] = position as i64;
        }
        inverse
    }
}

impl VisionBlock {
    fn load(ckpt: &mut Checkpoint, prefix: &str, c: &VisionConfig) -> Result<Self, WeightsError> {
        let dim = c.hidden_size;
        Ok(Self {
            norm1: RmsNorm::load(ckpt, &format!("{prefix}.norm1"), dim, 1e-6)?,
            attn: VisionAttention::load(ckpt, &format!("{prefix}.attn"), dim, c.num_heads)?,
            norm2: RmsNorm::load(ckpt, &format!("{prefix}.norm2"), dim, 1e-6)?,
            mlp: SwiGlu::load(ckpt, &format!("{prefix}.mlp"), dim, c.intermediate_size, true, c.activation)?,
        })
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, segments: &[(i64, i64)]) -> Tensor {
        let h = x + self.attn.forward(&self.norm1.forward(x), cos, sin, segments);
        &h + self.mlp.forward(&self.norm2.forward(&h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(window_size: i64) -> VisionConfig {
        let section = serde_json::json!({
            "depth": 1, "hidden_size": 8, "intermediate_size": 8, "num_heads": 1,
            "out_hidden_size": 8, "window_size": window_size, "in_chans": 3
        });
        serde_json::from_value(section).expect("a vision config")
    }

    #[test]
    fn windows_partition_a_3x5_unit_grid() {
        // 6x10 patches = 3x5 merge units, windows of 2x2 units.
        let part = WindowPartition::new(&[[1, 6, 10]], &config(56));
        assert_eq!(&part.window_index[..4], &[0, 1, 5, 6]);
        assert_eq!(&part.window_index[4..8], &[2, 3, 7, 8]);
        assert_eq!(part.window_index.len(), 15);
        let lens: Vec<i64> = part.segments.iter().map(|s| s.1 / 4).collect();
        assert_eq!(lens, vec![4, 4, 2, 2, 2, 1]);
        let inverse = part.inverse_index();
        for (pos, &unit) in part.window_index.iter().enumerate() {
            assert_eq!(inverse[unit as usize], pos as i64);
        }
    }
}
