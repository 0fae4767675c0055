//! The language model of every family: a Qwen2 (Qwen2.5-VL: q/k/v bias), Qwen3 (Qwen3-VL and
//! Qwen3: per-head q/k RMSNorm) or Llama decoder with GQA, SwiGLU and rotary positions, multimodal
//! (M-RoPE) for the VLMs and one axis for the text families, run over a preallocated KV cache with
//! explicit positions and an optional additive mask.

use tch::{Device, Kind, Tensor};

use super::layers::{
    causal_mask, inverse_frequencies, normalize_rms, Activation, FusedLinear, Linear, RmsNorm, Rotary, SwiGlu,
};
use super::ModelError;
use crate::kv_cache::KvCache;
use crate::weights::{Checkpoint, WeightsError};

/// How M-RoPE assigns the rotary frequency pairs to the temporal, height and width axes.
#[derive(Clone, Debug, PartialEq)]
pub enum MropeLayout {
    /// Qwen2/2.5-VL: contiguous sections [t, h, w] of the frequency pairs.
    Sectioned(Vec<usize>),
    /// Qwen3-VL: pairs interleaved t, h, w, t, h, w… up to 3·section[axis], the rest temporal.
    Interleaved(Vec<usize>),
    /// Text-only families: plain 1-D RoPE, every pair reads the first axis (the three position
    /// rows are equal for text anyway).
    Single,
}

impl MropeLayout {
    /// For each of the head_dim/2 frequency pairs, the position axis (0 = t, 1 = h, 2 = w) it reads.
    fn axis_per_pair(&self, pairs: usize) -> Vec<i64> {
        match self {
            Self::Sectioned(sections) => sections
                .iter()
                .enumerate()
                .flat_map(|(i, &len)| std::iter::repeat_n((i % 3) as i64, len))
                .chain(std::iter::repeat(0))
                .take(pairs)
                .collect(),
            Self::Interleaved(sections) => (0..pairs)
                .map(|j| {
                    let axis = j % 3;
                    if axis > 0 && j < sections.get(axis).copied().unwrap_or(0) * 3 {
                        axis as i64
                    } else {
                        0
                    }
                })
                .collect(),
            Self::Single => vec![0; pairs],
        }
    }
}

/// How the rotary frequencies are rescaled for a longer context than pretraining saw
/// (transformers' `rope_type`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

impl RopeScaling {
    /// `inv_freq` (head_dim/2,) f32 rescaled, in the order transformers computes it.
    pub fn apply(&self, inv_freq: Tensor) -> Tensor {
        match *self {
            Self::None => inv_freq,
            Self::Linear { factor } => inv_freq / factor,
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                let wavelen = inv_freq.reciprocal() * (2.0 * std::f64::consts::PI);
                let scaled = inv_freq.where_self(&wavelen.le(low_wavelen), &(&inv_freq / factor));
                let smooth =
                    ((wavelen.reciprocal() * old) - low_freq_factor) / (high_freq_factor - low_freq_factor);
                let smoothed: Tensor = (1.0 - &smooth) * &scaled / factor + &smooth * &scaled;
                let medium = wavelen.ge(high_wavelen).logical_and(&wavelen.le(low_wavelen));
                smoothed.where_self(&medium, &scaled)
            }
        }
    }
}

/// Hyper-parameters of the language model, read from `config.json` by the family loaders.
#[derive(Clone, Debug)]
pub struct TextConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_layers: usize,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub mrope: MropeLayout,
    pub max_position_embeddings: usize,
    pub activation: Activation,
    pub tie_word_embeddings: bool,
    /// Qwen2: bias on q/k/v. Qwen3: `attention_bias` (false in released checkpoints).
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// Llama's `mlp_bias`: bias on gate/up/down.
    pub mlp_bias: bool,
    /// Qwen3: RMSNorm over each head of q and k before the rotary embedding.
    pub qk_norm: bool,
}

struct Attention {
    /// q, k and v in one matmul: (n, hidden) → (n, (heads + 2·kv_heads)·head_dim).
    qkv_proj: FusedLinear,
    o_proj: Linear,
    /// Qwen3: q_norm and k_norm, applied to the q and k heads together.
    qk_norm: Option<HeadNorms>,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

/// The per-head RMSNorms of q and k as one normalization over the (heads + kv_heads) q and k
/// heads, scaled by the two weights stacked per head.
struct HeadNorms {
    q: RmsNorm,
    k: RmsNorm,
    /// (heads + kv_heads, head_dim); `None` for a trainable checkpoint, whose parameters are `q`
    /// and `k` themselves (the stack is then built per pass).
    stacked: Option<Tensor>,
    num_heads: i64,
    num_kv_heads: i64,
}

impl HeadNorms {
    fn new(q: RmsNorm, k: RmsNorm, num_heads: i64, num_kv_heads: i64, trainable: bool) -> Self {
        let mut norms = Self { q, k, stacked: None, num_heads, num_kv_heads };
        if !trainable {
            norms.stacked = Some(norms.stack());
        }
        norms
    }

    fn stack(&self) -> Tensor {
        let dim = self.q.weight().size()[0];
        Tensor::cat(
            &[
                self.q.weight().expand([self.num_heads, dim], false),
                self.k.weight().expand([self.num_kv_heads, dim], false),
            ],
            0,
        )
    }

    /// qk: (n, heads + kv_heads, head_dim).
    fn forward(&self, qk: &Tensor) -> Tensor {
        let normed = normalize_rms(qk, self.q.eps());
        match &self.stacked {
            Some(weight) => weight * normed,
            None => self.stack() * normed,
        }
    }
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: SwiGlu,
}

/// Image features spliced into one forward pass: the merged patch embeddings that replace the
/// image placeholder tokens and, for Qwen3-VL, the DeepStack features added after the first layers.
pub struct VisionEmbeds {
    /// (image_tokens, hidden)
    pub embeds: Tensor,
    /// One (image_tokens, hidden) tensor per DeepStack layer, added to the output of layer i.
    pub deepstack: Vec<Tensor>,
}

/// Which rows of the final hidden state go through the LM head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    All,
    Last,
    None,
}

/// One forward pass over `n` new positions.
pub struct StepInput<'a> {
    /// (n,) int64 token ids.
    pub token_ids: &'a Tensor,
    /// (3, n) int64 M-RoPE positions (t, h, w).
    pub positions: &'a Tensor,
    /// Additive mask (n, cache_len + n) in the model dtype; `None` means causal.
    pub mask: Option<&'a Tensor>,
    /// Image features for the image placeholder tokens among `token_ids` (prefill only).
    pub vision: Option<&'a VisionEmbeds>,
    /// Decoder layers whose outputs to return (output of layer i = HF `hidden_states[i+1]`).
    pub taps: &'a [usize],
    pub logits: LogitRows,
}

pub struct StepOutput {
    /// (rows, vocab) in the model dtype, rows per [`LogitRows`].
    pub logits: Option<Tensor>,
    /// One (n, hidden) tensor per requested tap, in request order.
    pub taps: Vec<Tensor>,
}

pub struct TextModel {
    pub config: TextConfig,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    inv_freq: Tensor,
    axis_per_pair: Tensor,
    image_token_id: i64,
    deepstack_enabled: bool,
}

impl TextModel {
    /// `prefix` is the checkpoint name of the language model (`model.language_model` in a 5.x VLM,
    /// `model` in a text-only one); `image_token_id` is -1 for a model without images.
    pub fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        config: TextConfig,
        image_token_id: i64,
    ) -> Result<Self, WeightsError> {
        let c = &config;
        let embed_tokens =
            ckpt.take(&format!("{prefix}.embed_tokens.weight"), &[c.vocab_size, c.hidden_size])?;
        let layers = (0..c.num_layers)
            .map(|i| DecoderLayer::load(ckpt, &format!("{prefix}.layers.{i}"), c))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = RmsNorm::load(ckpt, &format!("{prefix}.norm"), c.hidden_size, c.rms_norm_eps)?;
        let lm_head = if ckpt.contains("lm_head.weight") {
            Linear::load(ckpt, "lm_head", c.hidden_size, c.vocab_size, false)?
        } else if c.tie_word_embeddings {
            Linear::from_weight(embed_tokens.shallow_clone())
        } else {
            return Err(WeightsError::Missing { name: "lm_head.weight".into(), alternatives: vec![] });
        };
        let device = ckpt.device();
        let inv_freq = c.rope_scaling.apply(inverse_frequencies(c.rope_theta, c.head_dim, device));
        let axes = c.mrope.axis_per_pair((c.head_dim / 2) as usize);
        let axis_per_pair = crate::upload(&axes, device);
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
            axis_per_pair,
            image_token_id,
            deepstack_enabled: true,
            config,
        })
    }

    /// The input embedding matrix (vocab, hidden).
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// The LM head matrix (vocab, hidden).
    pub fn lm_head(&self) -> &Tensor {
        self.lm_head.weight()
    }

    /// Ablation switch for tests that prove the parity checks can see DeepStack.
    pub fn set_deepstack_enabled(&mut self, enabled: bool) {
        self.deepstack_enabled = enabled;
    }

    pub fn new_cache(&self, capacity: usize, kind: Kind, device: Device) -> KvCache {
        let c = &self.config;
        KvCache::new(c.num_layers, c.num_kv_heads, c.head_dim, capacity, kind, device)
    }

    /// A cache for `batch` sequences decoded together (see [`KvCache::batched`]).
    pub fn new_batched_cache(&self, batch: usize, capacity: usize, kind: Kind, device: Device) -> KvCache {
        let c = &self.config;
        KvCache::batched(c.num_layers, batch, c.num_kv_heads, c.head_dim, capacity, kind, device)
    }

    /// A cache for a pass with gradients (see [`KvCache::for_training`]).
    pub fn new_training_cache(&self, capacity: usize, kind: Kind, device: Device) -> KvCache {
        let c = &self.config;
        KvCache::for_training(c.num_layers, c.num_kv_heads, c.head_dim, capacity, kind, device)
    }

    /// One pass over `n` new positions of each sequence in `cache` (batch 1 when serving; a
    /// [`KvCache::batched`] cache takes the sequences' rows one after the other, `batch·n` in all).
    pub fn forward(&self, input: &StepInput, cache: &mut KvCache) -> Result<StepOutput, ModelError> {
        let batch = cache.batch() as i64;
        let n = input.token_ids.size()[0] / batch;
        check_step_shapes(input, batch, cache.len() as i64, self.config.num_layers)?;
        cache.ensure_room(n as usize)?;
        let mut hidden = self.embed_tokens.index_select(0, input.token_ids);
        let image_rows = match input.vision {
            Some(vision) => Some(self.splice_images(&mut hidden, input.token_ids, vision)?),
            None => None,
        };
        let rotary = self.rotary(input.positions, hidden.kind());
        let past = cache.len() as i64;
        let default_mask = (input.mask.is_none() && n > 1 && past > 0)
            .then(|| causal_mask(past, n, hidden.kind(), hidden.device()));
        let mask = input.mask.or(default_mask.as_ref());
        let mut taps: Vec<Option<Tensor>> = input.taps.iter().map(|_| None).collect();
        let last_layer = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            hidden = layer.forward(&hidden, &rotary, mask, i, cache);
            // HF records hidden_states[i+1] before the DeepStack injection; the last one is
            // replaced by the final-norm output (see below).
            if i != last_layer {
                record_taps(&mut taps, input.taps, i, &hidden);
            }
            if let (Some(vision), Some(rows)) = (input.vision, image_rows.as_ref()) {
                if self.deepstack_enabled && i < vision.deepstack.len() {
                    hidden = hidden.index_add(0, rows, &vision.deepstack[i].to_kind(hidden.kind()));
                }
            }
        }
        cache.advance(n as usize);
        let normed = self.norm.forward(&hidden);
        record_taps(&mut taps, input.taps, last_layer, &normed);
        let logits = match input.logits {
            LogitRows::All => Some(self.lm_head.forward(&normed)),
            // Each sequence's last row: (batch, vocab).
            LogitRows::Last => Some(self.lm_head.forward(&normed.view([batch, n, -1]).select(1, n - 1))),
            LogitRows::None => None,
        };
        let taps = taps.into_iter().map(|t| t.expect("every tap index was validated")).collect();
        Ok(StepOutput { logits, taps })
    }

    /// Replaces the image placeholder rows of `hidden` with the image features, in order; returns
    /// the indices of those rows.
    fn splice_images(
        &self,
        hidden: &mut Tensor,
        ids: &Tensor,
        vision: &VisionEmbeds,
    ) -> Result<Tensor, ModelError> {
        let rows = ids.eq(self.image_token_id).nonzero().squeeze_dim(1);
        let expected = vision.embeds.size()[0];
        if rows.size()[0] != expected {
            return Err(ModelError::Input(format!(
                "{} image placeholder tokens but {expected} image features",
                rows.size()[0]
            )));
        }
        *hidden = hidden.index_copy(0, &rows, &vision.embeds.to_kind(hidden.kind()));
        Ok(rows)
    }

    /// Rotary tables (n, 1, head_dim) for M-RoPE positions (3, n), broadcast over the heads.
    fn rotary(&self, positions: &Tensor, kind: Kind) -> Rotary {
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * &self.inv_freq; // (3, n, hd/2)
        let n = positions.size()[1];
        let pairs = self.inv_freq.size()[0];
        let axis = self.axis_per_pair.view([1, 1, pairs]).expand([1, n, pairs], false);
        let chosen = freqs.gather(0, &axis, false).view([n, 1, pairs]); // (n, 1, hd/2)
        Rotary::from_half_angles(&chosen, kind)
    }
}

fn record_taps(taps: &mut [Option<Tensor>], wanted: &[usize], layer: usize, hidden: &Tensor) {
    for (slot, &tap) in taps.iter_mut().zip(wanted) {
        if tap == layer {
            *slot = Some(hidden.shallow_clone());
        }
    }
}

fn check_step_shapes(input: &StepInput, batch: i64, past: i64, layers: usize) -> Result<(), ModelError> {
    let rows = input.token_ids.size()[0];
    if rows == 0 || rows % batch != 0 {
        return Err(ModelError::Input(format!(
            "{rows} token rows for a batch of {batch} (at least one each)"
        )));
    }
    let n = rows / batch;
    if input.positions.size() != [3, rows] {
        return Err(ModelError::Input(format!(
            "positions {:?}, expected [3, {rows}]",
            input.positions.size()
        )));
    }
    if let Some(mask) = input.mask {
        let expected = if batch == 1 { vec![n, past + n] } else { vec![batch, n, past + n] };
        if mask.size() != expected {
            return Err(ModelError::Input(format!("mask {:?}, expected {expected:?}", mask.size())));
        }
    }
    if let Some(&bad) = input.taps.iter().find(|&&t| t >= layers) {
        return Err(ModelError::Input(format!("tap layer {bad} out of range (model has {layers} layers)")));
    }
    Ok(())
}

impl DecoderLayer {
    fn load(ckpt: &mut Checkpoint, prefix: &str, c: &TextConfig) -> Result<Self, WeightsError> {
        Ok(Self {
            input_layernorm: RmsNorm::load(
                ckpt,
                &format!("{prefix}.input_layernorm"),
                c.hidden_size,
                c.rms_norm_eps,
            )?,
            attn: Attention::load(ckpt, &format!("{prefix}.self_attn"), c)?,
            post_attention_layernorm: RmsNorm::load(
                ckpt,
                &format!("{prefix}.post_attention_layernorm"),
                c.hidden_size,
                c.rms_norm_eps,
            )?,
            mlp: SwiGlu::load(
                ckpt,
                &format!("{prefix}.mlp"),
                c.hidden_size,
                c.intermediate_size,
                c.mlp_bias,
                c.activation,
            )?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        mask: Option<&Tensor>,
        layer: usize,
        cache: &mut KvCache,
    ) -> Tensor {
        let h = x + self.attn.forward(&self.input_layernorm.forward(x), rotary, mask, layer, cache);
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h))
    }
}

impl Attention {
    fn load(ckpt: &mut Checkpoint, prefix: &str, c: &TextConfig) -> Result<Self, WeightsError> {
        let q_dim = c.num_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        let parts = [
            (format!("{prefix}.q_proj"), q_dim),
            (format!("{prefix}.k_proj"), kv_dim),
            (format!("{prefix}.v_proj"), kv_dim),
        ];
        let norm = |ckpt: &mut Checkpoint, name: &str| {
            RmsNorm::load(ckpt, &format!("{prefix}.{name}"), c.head_dim, c.rms_norm_eps)
        };
        let qk_norm = if c.qk_norm {
            let (q, k) = (norm(ckpt, "q_norm")?, norm(ckpt, "k_norm")?);
            Some(HeadNorms::new(q, k, c.num_heads, c.num_kv_heads, ckpt.is_trainable()))
        } else {
            None
        };
        Ok(Self {
            qkv_proj: FusedLinear::load(ckpt, &parts, c.hidden_size, c.qkv_bias)?,
            o_proj: Linear::load(ckpt, &format!("{prefix}.o_proj"), q_dim, c.hidden_size, c.o_bias)?,
            qk_norm,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        })
    }

    /// x: (batch·n, hidden) → (batch·n, hidden), the cache's sequences one after the other. New
    /// K/V rows go into the cache at its current length.
    fn forward(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        mask: Option<&Tensor>,
        layer: usize,
        cache: &mut KvCache,
    ) -> Tensor {
        let (rows, batch) = (x.size()[0], cache.batch() as i64);
        let n = rows / batch;
        let (heads, kv_heads, head_dim) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let qkv = self.qkv_proj.forward(x).view([rows, heads + 2 * kv_heads, head_dim]);
        // q and k heads are normalized (Qwen3) and rotated together: one call each, not two.
        let qk = qkv.narrow(1, 0, heads + kv_heads);
        let qk = match &self.qk_norm {
            Some(norms) => norms.forward(&qk),
            None => qk,
        };
        let by_sequence = |t: Tensor, width: i64| t.view([batch, n, width, head_dim]).transpose(1, 2);
        let qk = by_sequence(rotary.apply(&qk), heads + kv_heads); // (batch, heads + kv_heads, n, head_dim)
        let q = qk.narrow(1, 0, heads);
        let k = qk.narrow(1, heads, kv_heads);
        let v = by_sequence(qkv.narrow(1, heads + kv_heads, kv_heads), kv_heads);
        let (keys, values) = cache.write_batch(layer, &k, &v);
        let causal = mask.is_none() && n > 1;
        let out = Tensor::scaled_dot_product_attention(
            &q,
            &keys,
            &values,
            // (n, context) for batch 1, (batch, n, context) for a batch.
            mask.map(|m| m.view([-1, 1, n, m.size()[m.dim() - 1]])),
            0.0,
            causal,
            None,
            heads != kv_heads,
        ); // (batch, heads, n, head_dim)
        let out = out.transpose(1, 2).contiguous().view([rows, heads * head_dim]);
        self.o_proj.forward(&out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mrope_axis_layouts() {
        // Qwen2.5-VL: [2, 3, 3] → t t h h h w w w
        assert_eq!(MropeLayout::Sectioned(vec![2, 3, 3]).axis_per_pair(8), vec![0, 0, 1, 1, 1, 2, 2, 2]);
        // Qwen3-VL interleaved: t h w t h w t h, h and w limited to 3·section.
        assert_eq!(MropeLayout::Interleaved(vec![2, 3, 3]).axis_per_pair(8), vec![0, 1, 2, 0, 1, 2, 0, 1]);
        assert_eq!(MropeLayout::Interleaved(vec![4, 2, 2]).axis_per_pair(8), vec![0, 1, 2, 0, 1, 2, 0, 0]);
    }
}
