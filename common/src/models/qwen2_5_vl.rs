//! Qwen2.5-VL: vision tower with RMSNorm blocks, SwiGLU MLPs with bias, window attention except
//! in the `fullatt_block_indexes` blocks, and a 2×2 patch merger; Qwen2 language model (q/k/v
//! bias) with sectioned M-RoPE.

use serde_json::Value;
use tch::Tensor;

use super::layers::{Activation, Linear, RmsNorm, SwiGlu};
use super::text::{TextModel, VisionEmbeds};
use super::{
    multimodal_ids, per_frame_segments, text_config, vision_patch_coords, vision_rotary, ConfigView,
    ModelError, MultimodalIds, VisionAttention,
};
use crate::weights::{Checkpoint, WeightsError};

const TEXT_PREFIX: &str = "model.language_model";
const VISION_PREFIX: &str = "model.visual";
/// transformers' default `rope_theta` for the Qwen2.5-VL text config.
const DEFAULT_ROPE_THETA: f64 = 1_000_000.0;

#[derive(Clone, Debug)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_heads: i64,
    pub in_channels: i64,
    pub patch_size: i64,
    pub temporal_patch_size: i64,
    pub spatial_merge_size: i64,
    pub out_hidden_size: i64,
    pub window_size: i64,
    pub fullatt_block_indexes: Vec<usize>,
    pub activation: Activation,
    pub rope_theta: f64,
}

impl VisionConfig {
    fn from_json(root: &Value) -> Result<Self, ModelError> {
        let section = root.get("vision_config").unwrap_or(&Value::Null);
        let c = ConfigView::new(section, "vision_config");
        Ok(Self {
            depth: c.int("depth")? as usize,
            hidden_size: c.int("hidden_size")?,
            intermediate_size: c.int("intermediate_size")?,
            num_heads: c.int("num_heads")?,
            // Hub files of the 4.x era spell it `in_chans`.
            in_channels: c
                .value
                .get("in_channels")
                .or_else(|| c.value.get("in_chans"))
                .and_then(Value::as_i64)
                .unwrap_or(3),
            patch_size: c.int_or("patch_size", 14),
            temporal_patch_size: c.int_or("temporal_patch_size", 2),
            spatial_merge_size: c.int_or("spatial_merge_size", 2),
            out_hidden_size: c.int("out_hidden_size")?,
            window_size: c.int_or("window_size", 112),
            fullatt_block_indexes: c
                .int_list("fullatt_block_indexes")
                .unwrap_or_default()
                .into_iter()
                .map(|i| i as usize)
                .collect(),
            activation: c.activation("silu")?,
            rope_theta: section
                .get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0),
        })
    }
}

/// Loads the Qwen2.5-VL parts from a parsed `config.json` and the checkpoint.
pub fn load(
    root: &Value,
    ckpt: &mut Checkpoint,
) -> Result<(MultimodalIds, TextModel, VisionModel), ModelError> {
    let vision_config = VisionConfig::from_json(root)?;
    let ids = multimodal_ids(root, vision_config.spatial_merge_size)?;
    let text_config = text_config(root, DEFAULT_ROPE_THETA, false, false)?;
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
            &[dim, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size],
        )?;
        // Conv3d with kernel == stride over a whole patch is a linear map of the flattened patch.
        let patch_embed = Linear::from_weight(conv.reshape([dim, -1]));
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
        let order = Tensor::from_slice(&windows.window_index).to_device(device);
        // Window attention needs each window's patches contiguous: reorder whole 2×2 merge units.
        let permute = |t: &Tensor| {
            let n = t.size()[0];
            t.view([n / unit, unit, -1]).index_select(0, &order).view([n, -1])
        };
        let x = permute(&self.patch_embed.forward(pixel_values));
        let coords = vision_patch_coords(grids, c.spatial_merge_size);
        let (cos, sin) = vision_rotary(&coords, c.hidden_size / c.num_heads, c.rope_theta, device);
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
        let restore = Tensor::from_slice(&windows.inverse_index()).to_device(device);
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
        VisionConfig {
            depth: 1,
            hidden_size: 8,
            intermediate_size: 8,
            num_heads: 1,
            in_channels: 3,
            patch_size: 14,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            out_hidden_size: 8,
            window_size,
            fullatt_block_indexes: vec![],
            activation: Activation::Silu,
            rope_theta: 10_000.0,
        }
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
