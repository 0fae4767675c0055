//! The EAGLE-3 draft head (SafeAILab/EAGLE `cnets.Model`; SpecForge and SGLang
//! `LlamaForCausalLMEagle3`), loaded unchanged from a public checkpoint directory, and its
//! autoregressive dynamic tree (EAGLE-2's `topK_genrate`): the matched peer of the GLANCE block
//! head, behind the same Draft stream and tree contract.
//!
//! One Llama decoder layer whose attention reads `[input_layernorm(embed(token)) ;
//! hidden_norm(x)]` (2·hidden wide), where x is `fc` of three target layers' states (3·target
//! hidden → hidden) or the head's own previous output; residual x; a SwiGLU MLP; its own final norm
//! and LM head over a reduced draft vocabulary, mapped to target ids by `d2t`
//! (`target = draft + d2t[draft]`). Draft position p reads the target state at p with the
//! embedding of token p+1, rotated at position p; the draft KV cache holds one row per committed
//! position, and tree rows only while a tree is grown.

use std::path::Path;

use glance_models::config::parse_rope_scaling;
use glance_models::kv_cache::KvCache;
use glance_models::layers::{
    inverse_frequencies, linear, Activation, FusedLinear, Linear, RmsNorm, Rotary, SwiGlu,
};
use glance_models::weights::{Checkpoint, WeightsError};
use glance_models::{RopeScaling, TextConfig};
use glance_spec::tree::{TokenId, Tree};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::head::{load_target_embedding, read_json, target_text_config, HeadError};

/// The head's hyper-parameters from its `config.json`, as EAGLE and SpecForge write it (Llama keys
/// plus `draft_vocab_size`, optional `target_hidden_size`, and the tapped layers under
/// `eagle_config.eagle_aux_hidden_state_layer_ids`).
#[derive(Clone, Debug)]
pub struct Eagle3Config {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    /// 10000 when the file names none (EAGLE's own configs do not, and EAGLE trains at 10000).
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// The target vocabulary (the embedding's rows).
    pub vocab_size: i64,
    /// The LM head's rows; equal to `vocab_size` when the head drafts over the whole vocabulary.
    pub draft_vocab_size: i64,
    /// Width of each target state `fc` reads (`target_hidden_size`, else `hidden_size`).
    pub target_hidden_size: i64,
    /// Target decoder layers whose outputs `fc` fuses, low to high.
    pub tap_layers: Vec<usize>,
    /// vLLM's speculators variant: normalize the hidden input before it becomes the residual.
    pub norm_before_residual: bool,
    /// SpecForge's `norm_output: false`: logits of the un-normed output.
    pub norm_output: bool,
    pub fc_bias: bool,
}

/// EAGLE's taps for an N-layer target: the inputs of layers 2, N/2 and N−3, i.e. the outputs of
/// layers 1, N/2−1 and N−4 (what `hidden_states[2, N/2, N−3]` of transformers holds). `None` when
/// the target is too shallow for three distinct ones.
pub fn default_tap_layers(num_target_layers: usize) -> Option<Vec<usize>> {
    let n = num_target_layers;
    let taps = vec![1, (n / 2).checked_sub(1)?, n.checked_sub(4)?];
    taps.windows(2).all(|w| w[0] < w[1]).then_some(taps)
}

impl Eagle3Config {
    pub fn load(head_dir: &Path, target: &TextConfig) -> Result<Self, HeadError> {
        let path = head_dir.join("config.json");
        Self::from_json(&read_json(&path)?, &path, target)
    }

    pub fn from_json(root: &Value, path: &Path, target: &TextConfig) -> Result<Self, HeadError> {
        let bad = |key: &str| HeadError::Config {
            path: path.display().to_string(),
            reason: format!("bad or missing {key}"),
        };
        let int = |key: &str| root.get(key).and_then(Value::as_i64).ok_or_else(|| bad(key));
        let flag = |key: &str, default: bool| root.get(key).and_then(Value::as_bool).unwrap_or(default);
        reject_unsupported(root)?;
        let hidden_size = int("hidden_size")?;
        let num_heads = int("num_attention_heads")?;
        let vocab_size = int("vocab_size")?;
        let max_positions =
            root.get("max_position_embeddings").and_then(Value::as_u64).unwrap_or(2048) as usize;
        let config = Self {
            hidden_size,
            intermediate_size: int("intermediate_size")?,
            num_heads,
            num_kv_heads: root.get("num_key_value_heads").and_then(Value::as_i64).unwrap_or(num_heads),
            head_dim: root.get("head_dim").and_then(Value::as_i64).unwrap_or(hidden_size / num_heads.max(1)),
            rms_norm_eps: root.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-5),
            rope_theta: root.get("rope_theta").and_then(Value::as_f64).unwrap_or(10000.0),
            rope_scaling: parse_rope_scaling(root.get("rope_scaling").unwrap_or(&Value::Null), max_positions)?,
            vocab_size,
            draft_vocab_size: root.get("draft_vocab_size").and_then(Value::as_i64).unwrap_or(vocab_size),
            target_hidden_size: root.get("target_hidden_size").and_then(Value::as_i64).unwrap_or(hidden_size),
            tap_layers: tap_layers(root, target.num_layers).ok_or_else(|| {
                bad("eagle_config.eagle_aux_hidden_state_layer_ids (the target is too shallow for the default taps)")
            })?,
            norm_before_residual: flag("norm_before_residual", false),
            norm_output: flag("norm_output", true),
            fc_bias: flag("bias", false),
        };
        config.check(target, &bad)?;
        Ok(config)
    }

    fn check(&self, target: &TextConfig, bad: &dyn Fn(&str) -> HeadError) -> Result<(), HeadError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("draft_vocab_size", self.draft_vocab_size),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(bad(key));
        }
        if self.num_heads % self.num_kv_heads != 0 || self.head_dim % 2 != 0 {
            return Err(bad("num_key_value_heads / head_dim (heads must group, head_dim be even)"));
        }
        if self.draft_vocab_size > self.vocab_size {
            return Err(bad("draft_vocab_size (larger than vocab_size)"));
        }
        let mismatch = |what: String| Err(HeadError::Mismatch(what));
        if self.vocab_size != target.vocab_size {
            return mismatch(format!(
                "head vocab size {} but target vocab size {}",
                self.vocab_size, target.vocab_size
            ));
        }
        if self.target_hidden_size != target.hidden_size {
            return mismatch(format!(
                "head reads target states of width {} but the target's hidden size is {}",
                self.target_hidden_size, target.hidden_size
            ));
        }
        if self.hidden_size != target.hidden_size {
            return mismatch(format!(
                "head hidden size {} differs from the target's {}: the head embeds tokens with the \
                 target's embedding, which a checkpoint of another width would have to carry",
                self.hidden_size, target.hidden_size
            ));
        }
        if let Some(&bad_layer) = self.tap_layers.iter().find(|&&l| l >= target.num_layers) {
            return mismatch(format!(
                "tap layer {bad_layer} but the target has {} layers",
                target.num_layers
            ));
        }
        Ok(())
    }
}

/// The tapped layers: `eagle_aux_hidden_state_layer_ids` (inside `eagle_config` or at the top
/// level) read as SGLang and SpecForge read them, the output of layer i; else EAGLE's default.
fn tap_layers(root: &Value, num_target_layers: usize) -> Option<Vec<usize>> {
    let key = "eagle_aux_hidden_state_layer_ids";
    let named = root.get("eagle_config").and_then(|c| c.get(key)).or_else(|| root.get(key));
    match named {
        Some(ids) => ids.as_array()?.iter().map(|v| v.as_u64().map(|x| x as usize)).collect(),
        None => default_tap_layers(num_target_layers),
    }
}

/// Variants whose extra parts this head does not implement: refused rather than run with part of
/// the model.
fn reject_unsupported(root: &Value) -> Result<(), HeadError> {
    let unsupported = |what: &str| Err(HeadError::Unsupported(what.to_string()));
    if root.get("fc_norm").and_then(Value::as_bool) == Some(true) {
        return unsupported("fc_norm (per-tap norms before fc)");
    }
    let eagle = root.get("eagle_config");
    if eagle.and_then(|c| c.get("use_aux_hidden_state")).and_then(Value::as_bool) == Some(false) {
        return unsupported("use_aux_hidden_state: false (a head without fc)");
    }
    if root.get("num_hidden_layers").and_then(Value::as_u64).is_some_and(|n| n != 1) {
        return unsupported("num_hidden_layers other than 1");
    }
    let act = root.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
    if act != "silu" {
        return unsupported(&format!("hidden_act {act:?}"));
    }
    Ok(())
}

/// A loaded EAGLE-3 head with the target's embedding.
pub struct Eagle3Head {
    config: Eagle3Config,
    fc: Linear,
    hidden_norm: RmsNorm,
    /// On the token embedding.
    input_layernorm: RmsNorm,
    q_proj: Linear,
    /// k and v in one matmul over the 2·hidden attention input.
    kv_proj: FusedLinear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    mlp: SwiGlu,
    norm: RmsNorm,
    /// (draft_vocab, hidden).
    lm_head: Tensor,
    /// Target id of each draft id, (draft_vocab,) int64, on the device and on the host.
    draft_to_target: Tensor,
    draft_to_target_host: Vec<i64>,
    /// (vocab, hidden), the target's.
    embed: Tensor,
    inv_freq: Tensor,
    kind: Kind,
    device: Device,
}

impl Eagle3Head {
    /// Loads the head from `head_dir` (safetensors) and the target's input embedding from
    /// `target_dir`, checking that they fit.
    pub fn load(head_dir: &Path, target_dir: &Path, kind: Kind, device: Device) -> Result<Self, HeadError> {
        let target = target_text_config(target_dir)?;
        let config = Eagle3Config::load(head_dir, &target)?;
        let embed = load_target_embedding(target_dir, kind, device)?;
        let mut ckpt = Checkpoint::open(head_dir, kind, device)?;
        Self::from_checkpoint(config, &mut ckpt, embed)
    }

    pub fn from_checkpoint(
        config: Eagle3Config,
        ckpt: &mut Checkpoint,
        embed: Tensor,
    ) -> Result<Self, HeadError> {
        let (kind, device) = (ckpt.kind(), ckpt.device());
        let c = &config;
        if embed.size() != [c.vocab_size, c.hidden_size] {
            return Err(HeadError::Mismatch(format!(
                "target embedding {:?}, expected [{}, {}]",
                embed.size(),
                c.vocab_size,
                c.hidden_size
            )));
        }
        let top = ["", "model."].into_iter().find(|p| ckpt.contains(&format!("{p}fc.weight"))).ok_or_else(
            || WeightsError::Missing {
                name: "fc.weight".into(),
                alternatives: vec!["model.fc.weight".into()],
            },
        )?;
        let layer = ["midlayer", "layers.0"]
            .into_iter()
            .map(|l| format!("{top}{l}"))
            .find(|l| ckpt.contains(&format!("{l}.input_layernorm.weight")))
            .ok_or_else(|| WeightsError::Missing {
                name: "midlayer.input_layernorm.weight".into(),
                alternatives: vec!["layers.0.input_layernorm.weight".into()],
            })?;
        let (h, q_dim, kv_dim) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let norm = |ckpt: &mut Checkpoint, name: &str| RmsNorm::load(ckpt, name, h, c.rms_norm_eps);
        let attn = format!("{layer}.self_attn");
        let kv_parts = [(format!("{attn}.k_proj"), kv_dim), (format!("{attn}.v_proj"), kv_dim)];
        let head = Self {
            fc: Linear::load(ckpt, &format!("{top}fc"), 3 * c.target_hidden_size, h, c.fc_bias)?,
            hidden_norm: norm(ckpt, &format!("{layer}.hidden_norm"))?,
            input_layernorm: norm(ckpt, &format!("{layer}.input_layernorm"))?,
            q_proj: Linear::load(ckpt, &format!("{attn}.q_proj"), 2 * h, q_dim, false)?,
            kv_proj: FusedLinear::load(ckpt, &kv_parts, 2 * h, false)?,
            o_proj: Linear::load(ckpt, &format!("{attn}.o_proj"), q_dim, h, false)?,
            post_attention_layernorm: norm(ckpt, &format!("{layer}.post_attention_layernorm"))?,
            mlp: SwiGlu::load(
                ckpt,
                &format!("{layer}.mlp"),
                h,
                c.intermediate_size,
                false,
                Activation::Silu,
            )?,
            norm: norm(ckpt, &format!("{top}norm"))?,
            lm_head: ckpt.take_matrix("lm_head.weight", &[c.draft_vocab_size, h])?,
            draft_to_target: Tensor::zeros([0], (Kind::Int64, device)),
            draft_to_target_host: Vec::new(),
            embed: embed.to_device(device).to_kind(kind),
            inv_freq: c.rope_scaling.apply(inverse_frequencies(c.rope_theta, c.head_dim, device)),
            kind,
            device,
            config,
        };
        let head = head.with_vocabulary_map(ckpt, top)?;
        // A head that carries its own embedding (vLLM's format) is read from the target instead,
        // as every EAGLE-3 runtime does when the widths agree; `t2d` is `d2t`'s inverse.
        let ignored: Vec<String> = ckpt
            .remaining()
            .into_iter()
            .filter(|n| !n.ends_with("embed_tokens.weight") && !n.ends_with("t2d"))
            .collect();
        if !ignored.is_empty() {
            tracing::warn!(count = ignored.len(), first = %ignored[0], "EAGLE-3 head tensors not used");
        }
        Ok(head)
    }

    /// `d2t` (offsets: target = draft + d2t[draft]) as a table of target ids; the identity when
    /// the head drafts over the whole vocabulary and stores none.
    fn with_vocabulary_map(mut self, ckpt: &mut Checkpoint, top: &str) -> Result<Self, HeadError> {
        let (draft, vocab) = (self.config.draft_vocab_size, self.config.vocab_size);
        let offsets = match ckpt.take_raw(&format!("{top}d2t")) {
            Ok(d2t) => d2t.to_device(Device::Cpu).to_kind(Kind::Int64),
            Err(_) if draft == vocab => Tensor::zeros([draft], (Kind::Int64, Device::Cpu)),
            Err(e) => return Err(e.into()),
        };
        if offsets.size() != [draft] {
            return Err(HeadError::Mismatch(format!(
                "d2t of shape {:?}, expected [{draft}]",
                offsets.size()
            )));
        }
        let offsets = Vec::<i64>::try_from(offsets).map_err(|e| HeadError::Input(e.to_string()))?;
        let targets: Vec<i64> = offsets.iter().enumerate().map(|(i, &d)| i as i64 + d).collect();
        if targets.iter().any(|&t| !(0..vocab).contains(&t)) || targets.windows(2).any(|w| w[0] >= w[1]) {
            return Err(HeadError::Mismatch(
                "d2t maps draft ids outside the vocabulary or not in increasing order".into(),
            ));
        }
        self.draft_to_target = glance_models::upload(&targets, self.device);
        self.draft_to_target_host = targets;
        Ok(self)
    }

    /// A draft KV cache for `capacity` positions (context plus the rows of one tree).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let c = &self.config;
        KvCache::new(1, c.num_kv_heads, c.head_dim, capacity, self.kind, self.device)
    }

    /// One pass over n rows: `hidden` (n, 3·target hidden) target states or (n, hidden) the
    /// head's own outputs, `tokens` (n,) target ids of the next token of each, `positions` (n,)
    /// int64, `visible` (n, cache.len() + n) bool: which cached and new rows each row attends to.
    /// Writes the rows' K/V at `cache.len()..` (the caller advances or truncates the cache) and
    /// returns the pre-norm outputs (n, hidden), which are fed back as the next rows' hidden.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        hidden: &Tensor,
        tokens: &Tensor,
        positions: &Tensor,
        visible: &Tensor,
    ) -> Tensor {
        let c = &self.config;
        let n = hidden.size()[0];
        let (residual, q, k, v) = self.project(hidden, tokens, positions);
        let (keys, values) = cache.write(0, &k, &v);
        let out = Tensor::scaled_dot_product_attention(
            &q.unsqueeze(0),
            &keys.unsqueeze(0),
            &values.unsqueeze(0),
            Some(visible.view([1, 1, n, -1])),
            0.0,
            false,
            None,
            c.num_heads != c.num_kv_heads,
        ); // (1, heads, n, head_dim)
        self.finish(&residual, &out.squeeze_dim(0))
    }

    /// The layer up to attention: the residual (n, hidden) and the rotated q (heads, n, hd), k and
    /// v (kv_heads, n, hd) of n rows.
    fn project(
        &self,
        hidden: &Tensor,
        tokens: &Tensor,
        positions: &Tensor,
    ) -> (Tensor, Tensor, Tensor, Tensor) {
        let c = &self.config;
        let n = hidden.size()[0];
        let hidden = hidden.to_kind(self.kind);
        let x = if hidden.size()[1] == c.hidden_size { hidden } else { self.fc.forward(&hidden) };
        let embedded = self.embed.index_select(0, tokens);
        let normed = self.hidden_norm.forward(&x);
        let residual = if c.norm_before_residual { normed.shallow_clone() } else { x };
        let input = Tensor::cat(&[self.input_layernorm.forward(&embedded), normed], -1);
        let rotary = self.rotary_at(positions);
        let q = self.q_proj.forward(&input).view([n, c.num_heads, c.head_dim]).transpose(0, 1);
        let kv = self.kv_proj.forward(&input).view([n, 2 * c.num_kv_heads, c.head_dim]);
        let k = kv.narrow(1, 0, c.num_kv_heads).transpose(0, 1);
        let v = kv.narrow(1, c.num_kv_heads, c.num_kv_heads).transpose(0, 1);
        (residual, rotary.apply(&q), rotary.apply(&k), v)
    }

    /// The layer after attention: `attended` (heads, n, hd) projected onto the residual, then
    /// the MLP; the pre-norm output (n, hidden).
    fn finish(&self, residual: &Tensor, attended: &Tensor) -> Tensor {
        let c = &self.config;
        let n = attended.size()[1];
        let out = attended.transpose(0, 1).contiguous().view([n, c.num_heads * c.head_dim]);
        let x = residual + self.o_proj.forward(&out);
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }

    /// One step of the training-time test (EAGLE-3's training unroll) over the L rows of a
    /// sequence: step 0 reads the target states (L, 3·target hidden) with the tokens after them,
    /// step k the head's own step-(k−1) outputs with the tokens k further on, rotated k positions
    /// further. A row of step k attends causally to the step-0 rows and to its own rows of steps
    /// 1..k (the chain of its own predictions, as a depth-k tree node sees its ancestors); `steps`
    /// holds the earlier steps' keys and values and receives this one's. Returns the pre-norm
    /// outputs (L, hidden).
    pub fn forward_ttt(
        &self,
        hidden: &Tensor,
        tokens: &Tensor,
        positions: &Tensor,
        steps: &mut Vec<(Tensor, Tensor)>,
    ) -> Tensor {
        let c = &self.config;
        let groups = c.num_heads / c.num_kv_heads;
        let (residual, q, k, v) = self.project(hidden, tokens, positions);
        let widen = |t: &Tensor| {
            if groups > 1 {
                t.repeat_interleave_self_int(groups, 0, None)
            } else {
                t.shallow_clone()
            }
        };
        steps.push((widen(&k), widen(&v)));
        let n = q.size()[1];
        let scale = (c.head_dim as f64).powf(-0.5);
        let (k0, v0) = &steps[0];
        let causal = Tensor::ones([n, n], (Kind::Bool, self.device)).tril(0);
        let context = q
            .matmul(&k0.transpose(1, 2))
            .multiply_scalar(scale)
            .masked_fill(&causal.logical_not(), f64::NEG_INFINITY);
        // Each later step's key at the row's own index: one score per row.
        let mut scores = vec![context];
        scores.extend(steps[1..].iter().map(|(kj, _)| (&q * kj).sum_dim_intlist(-1, true, q.kind()) * scale));
        let scores = Tensor::cat(&scores, -1);
        let weights = scores.softmax(-1, Kind::Float).to_kind(q.kind());
        let mut attended = weights.narrow(-1, 0, n).matmul(v0);
        for (j, (_, vj)) in steps[1..].iter().enumerate() {
            attended += weights.narrow(-1, n + j as i64, 1) * vj;
        }
        self.finish(&residual, &attended)
    }

    /// The draft logits of pre-norm outputs over the draft vocabulary, (…, draft vocab).
    pub fn logits(&self, out: &Tensor) -> Tensor {
        let normed = if self.config.norm_output { self.norm.forward(out) } else { out.shallow_clone() };
        linear(&normed, &self.lm_head, None)
    }

    /// Log-probabilities over the draft vocabulary of pre-norm outputs (…, hidden).
    pub fn log_probs(&self, out: &Tensor) -> Tensor {
        self.logits(out).log_softmax(-1, self.kind)
    }

    /// Target ids of draft ids (a device tensor of any shape).
    pub fn to_target(&self, draft_ids: &Tensor) -> Tensor {
        self.draft_to_target.index_select(0, &draft_ids.reshape([-1])).view(draft_ids.size().as_slice())
    }

    /// The causal visibility of `n` new rows after `cached` committed ones: every cached row and
    /// the new rows up to their own.
    pub fn causal_visibility(&self, cached: usize, n: usize) -> Tensor {
        let columns = Tensor::arange((cached + n) as i64, (Kind::Int64, self.device));
        let rows = Tensor::arange_start(cached as i64, (cached + n) as i64, (Kind::Int64, self.device));
        columns.unsqueeze(0).le_tensor(&rows.unsqueeze(1))
    }

    fn rotary_at(&self, positions: &Tensor) -> Rotary {
        let angles = positions.to_kind(Kind::Float).unsqueeze(1) * self.inv_freq.unsqueeze(0);
        Rotary::from_half_angles(&angles, self.kind)
    }

    pub fn config(&self) -> &Eagle3Config {
        &self.config
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The draft-to-target id map on the host.
    pub fn draft_to_target_host(&self) -> &[i64] {
        &self.draft_to_target_host
    }
}

/// How a tree is grown: `top_k` children per expanded node and `top_k` nodes expanded per depth
/// (EAGLE-2's `topK_genrate`), `expansions` passes after the first, `budget` nodes kept.
#[derive(Clone, Copy, Debug)]
pub struct TreeShape {
    pub top_k: usize,
    pub expansions: usize,
    pub budget: usize,
}

/// A candidate node while a tree grows: its target token, cumulative log-probability, parent
/// candidate, and the cache row it was written to once expanded.
struct Candidate {
    token: i64,
    score: f64,
    parent: Option<usize>,
    depth: usize,
    row: Option<i64>,
}

impl Eagle3Head {
    /// Grows a tree from `last` (1, hidden), the head's output at the position before the root's
    /// next token, which is at `position`: the top-k children of the root, then `expansions`
    /// passes that each expand the best `top_k` of the previous depth's children (every pass one
    /// host read-back of its top-k). Keeps the `budget` best candidates by cumulative
    /// log-probability (ancestors first), best-first. The tree's rows leave the cache as it was.
    pub fn grow_tree(
        &self,
        cache: &mut KvCache,
        last: &Tensor,
        position: usize,
        shape: TreeShape,
    ) -> Result<Tree, HeadError> {
        let k = shape.top_k.clamp(1, self.config.draft_vocab_size as usize);
        cache.ensure_room(k * shape.expansions)?;
        let committed = cache.len();
        let (scores, ids) = self.top_k_host(last, k);
        let mut candidates: Vec<Candidate> = (0..k)
            .map(|j| Candidate { token: ids[j], score: scores[j], parent: None, depth: 1, row: None })
            .collect();
        let mut frontier: Vec<usize> = (0..k).collect();
        let mut hidden = last.expand([k as i64, -1], false);
        for depth in 1..=shape.expansions {
            let start = cache.len() as i64;
            for (i, &f) in frontier.iter().enumerate() {
                candidates[f].row = Some(start + i as i64);
            }
            let tokens: Vec<i64> = frontier.iter().map(|&f| candidates[f].token).collect();
            let tokens = glance_models::upload(&tokens, self.device);
            let positions =
                Tensor::full([k as i64], (position + depth - 1) as i64, (Kind::Int64, self.device));
            let visible = self.tree_visibility(committed, start as usize + k, &frontier, &candidates);
            let out = self.forward(cache, &hidden, &tokens, &positions, &visible);
            cache.advance(k);
            let (child_scores, child_ids) = self.top_k_host(&out, k);
            let first_child = candidates.len();
            for (i, &parent) in frontier.iter().enumerate() {
                for j in 0..k {
                    candidates.push(Candidate {
                        token: child_ids[i * k + j],
                        score: candidates[parent].score + child_scores[i * k + j],
                        parent: Some(parent),
                        depth: depth + 1,
                        row: None,
                    });
                }
            }
            let mut children: Vec<usize> = (first_child..candidates.len()).collect();
            children.sort_by(|&a, &b| candidates[b].score.total_cmp(&candidates[a].score));
            children.truncate(k);
            let parent_rows: Vec<i64> = children
                .iter()
                .map(|&c| {
                    frontier.iter().position(|&f| Some(f) == candidates[c].parent).expect("a frontier parent")
                        as i64
                })
                .collect();
            hidden = out.index_select(0, &glance_models::upload(&parent_rows, self.device));
            frontier = children;
        }
        cache.truncate(committed);
        Ok(best_first_tree(&candidates, shape.budget))
    }

    /// Visibility of the frontier's rows (written at `end − k..end`): the committed context and
    /// each row's ancestors' rows and its own.
    fn tree_visibility(
        &self,
        committed: usize,
        end: usize,
        frontier: &[usize],
        candidates: &[Candidate],
    ) -> Tensor {
        let width = end - committed;
        let mut tree = vec![false; frontier.len() * width];
        for (i, &f) in frontier.iter().enumerate() {
            let mut node = Some(f);
            while let Some(n) = node {
                if let Some(row) = candidates[n].row {
                    tree[i * width + (row as usize - committed)] = true;
                }
                node = candidates[n].parent;
            }
        }
        let tree = glance_models::upload(&tree, self.device).view([frontier.len() as i64, width as i64]);
        let context = Tensor::ones([frontier.len() as i64, committed as i64], (Kind::Bool, self.device));
        Tensor::cat(&[context, tree], 1)
    }

    /// The top `k` draft log-probabilities of each row of outputs (rows, hidden) and their target
    /// ids, read back in one copy: (rows·k) each, row-major.
    fn top_k_host(&self, out: &Tensor, k: usize) -> (Vec<f64>, Vec<i64>) {
        let (values, ids) = self.log_probs(out).topk(k as i64, -1, true, true);
        let packed = Tensor::cat(
            &[values.to_kind(Kind::Double).reshape([-1]), ids.to_kind(Kind::Double).reshape([-1])],
            0,
        );
        let host = Vec::<f64>::try_from(glance_models::read_back(&packed)).expect("a 1-D f64 tensor");
        let (values, ids) = host.split_at(host.len() / 2);
        // log_softmax can round a certain token's value above 0; a path never gains probability.
        let values = values.iter().map(|v| v.min(0.0)).collect();
        let ids = ids.iter().map(|&d| self.draft_to_target_host[d as usize]).collect();
        (values, ids)
    }
}

/// The `budget` best candidates by cumulative log-probability (ties: shallower first), each taken
/// only once its parent is (so the tree is ancestor-closed even under ties), in that order: a
/// best-first tree, every prefix of which is itself a tree.
fn best_first_tree(candidates: &[Candidate], budget: usize) -> Tree {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| {
        candidates[b]
            .score
            .total_cmp(&candidates[a].score)
            .then(candidates[a].depth.cmp(&candidates[b].depth))
    });
    let mut index: Vec<Option<i32>> = vec![None; candidates.len()];
    let mut tree = Tree::default();
    for c in order {
        if tree.len() == budget {
            break;
        }
        let parent = match candidates[c].parent {
            None => -1,
            Some(p) => match index[p] {
                Some(i) => i,
                None => continue,
            },
        };
        index[c] = Some(tree.push(candidates[c].token as TokenId, parent, candidates[c].score));
    }
    tree
}
