//! The block draft head: DFlash's block-diffusion decoder (z-lab/dflash `DFlashDraftModel`), as
//! GLANCE uses it unchanged. One non-causal pass over `[root, MASK×(B−1)]` reads the target's tap
//! states of the newly committed positions, injected as extra keys/values into every layer, and
//! yields B−1 per-offset marginals through the target's own LM head.
//!
//! Per pass (see glance.md §2.3): `ctx = hidden_norm(fc(taps))`; the block stream is the target
//! embedding of the block; every layer takes q from the block only and k/v from `[ctx ; block]`
//! (per-head q/k RMSNorm, 1-D RoPE on stream positions), attends without a mask over
//! `[cached ctx ; new ctx ; block]`, then a SwiGLU MLP. Only the context rows stay in the draft
//! cache; the block's rows are dropped, as DFlash crops its cache back to the root.

use std::path::Path;

use glance_models::config::TargetConfig;
use glance_models::kv_cache::{CacheError, KvCache};
use glance_models::layers::{
    gemm_layout, inverse_frequencies, linear, Activation, FusedLinear, Linear, RmsNorm, Rotary, SwiGlu,
};
use glance_models::weights::{read_named_tensors, Checkpoint, WeightsError};
use glance_models::{ModelError, TextConfig};
use glance_spec::tree::{Marginals, TokenId, TreeError};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    #[error("cannot read {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("unsupported draft head: {0}")]
    Unsupported(String),
    #[error("draft head does not fit the target: {0}")]
    Mismatch(String),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("bad draft input: {0}")]
    Input(String),
    #[error(transparent)]
    Marginals(#[from] TreeError),
}

/// What the head needs to know about its target: the language model of its `config.json`, as the
/// target models themselves resolve it.
pub fn target_text_config(target_dir: &Path) -> Result<TextConfig, HeadError> {
    Ok(TargetConfig::read(target_dir)?.text_config()?)
}

/// The head's hyper-parameters, read from its `config.json` as the public DFlash checkpoints spell
/// it: Qwen3Config keys plus `block_size`, `mask_token_id` and `target_layer_ids`, each either at
/// the top level or inside `dflash_config` (which wins, as in DFlash's `_draft_value`).
#[derive(Clone, Debug)]
pub struct DraftHeadConfig {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_layers: usize,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub attention_bias: bool,
    pub activation: Activation,
    /// `vocab_size` of the head's config when it has one (checked against the target).
    pub vocab_size: Option<i64>,
    pub block_size: usize,
    pub mask_token_id: i64,
    /// Target decoder layers read, in the order their states are concatenated.
    pub target_layer_ids: Vec<usize>,
    /// Newer DFlash knobs; 1.0 / 1.0 / none in every released DFlash-1 head.
    pub input_embedding_scale: f64,
    pub output_multiplier: f64,
    pub final_logit_softcapping: Option<f64>,
}

impl DraftHeadConfig {
    /// Reads `head_dir/config.json`. `num_target_layers` (the target's layer count) is the
    /// fallback for the tap rule when the config names neither taps nor `num_target_layers`.
    pub fn load(head_dir: &Path, num_target_layers: Option<usize>) -> Result<Self, HeadError> {
        let path = head_dir.join("config.json");
        Self::from_json(&read_json(&path)?, &path, num_target_layers)
    }

    pub fn from_json(root: &Value, path: &Path, num_target_layers: Option<usize>) -> Result<Self, HeadError> {
        reject_unsupported_variants(root)?;
        let view = JsonView::new(root, path);
        let draft = DraftValues::new(root);
        let hidden_size = view.int("hidden_size")?;
        let num_heads = view.int("num_attention_heads")?;
        let num_layers = view.usize("num_hidden_layers")?;
        let activation_name = root.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        let config = Self {
            hidden_size,
            intermediate_size: view.int("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads: view.int_or("num_key_value_heads", num_heads),
            head_dim: view.int_or("head_dim", hidden_size / num_heads.max(1)),
            rms_norm_eps: view.float_or("rms_norm_eps", 1e-6),
            rope_theta: rope_theta(root).unwrap_or(10000.0),
            attention_bias: root.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
            activation: Activation::from_name(activation_name)
                .ok_or_else(|| HeadError::Unsupported(format!("hidden_act {activation_name:?}")))?,
            vocab_size: root.get("vocab_size").and_then(Value::as_i64),
            block_size: draft
                .int("block_size")
                .map_or(Ok(16), |b| usize::try_from(b).map_err(|_| view.bad("block_size")))?,
            mask_token_id: draft.int("mask_token_id").ok_or_else(|| view.bad("mask_token_id"))?,
            target_layer_ids: target_layer_ids(&draft, &view, num_layers, num_target_layers)?,
            input_embedding_scale: draft.float("input_embedding_scale").unwrap_or(1.0),
            output_multiplier: draft.float("output_multiplier").unwrap_or(1.0),
            final_logit_softcapping: draft.float("final_logit_softcapping").filter(|&c| c > 0.0),
        };
        config.validate(&view)?;
        Ok(config)
    }

    fn validate(&self, view: &JsonView) -> Result<(), HeadError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(view.bad(key));
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(view.bad("num_key_value_heads (must divide num_attention_heads)"));
        }
        if self.head_dim % 2 != 0 {
            return Err(view.bad("head_dim (must be even for RoPE)"));
        }
        if self.block_size < 2 {
            return Err(view.bad("block_size (must be at least 2)"));
        }
        if self.num_layers == 0 || self.target_layer_ids.is_empty() {
            return Err(view.bad("num_hidden_layers / target_layer_ids (must not be empty)"));
        }
        if self.mask_token_id < 0 {
            return Err(view.bad("mask_token_id"));
        }
        Ok(())
    }
}

/// DFlash's tap rule (`build_target_layer_ids`, glance.md §2.2): one draft layer reads the middle
/// target layer; k > 1 draft layers read `round(1 + i·(n−4)/(k−1))`, Python's round (half to even).
pub fn build_target_layer_ids(num_target_layers: usize, num_draft_layers: usize) -> Vec<usize> {
    if num_draft_layers == 1 {
        return vec![num_target_layers / 2];
    }
    let span = num_target_layers as f64 - 4.0;
    let steps = num_draft_layers as f64 - 1.0;
    (0..num_draft_layers)
        .map(|i| (1.0 + (i as f64 * span) / steps).round_ties_even().max(0.0) as usize)
        .collect()
}

/// Variants whose extra machinery this head does not implement: refuse them rather than draft
/// with part of the model.
fn reject_unsupported_variants(root: &Value) -> Result<(), HeadError> {
    let unsupported = |what: &str| Err(HeadError::Unsupported(what.to_string()));
    let architectures = root.get("architectures").and_then(Value::as_array);
    if architectures.is_some_and(|a| a.iter().any(|v| v.as_str() == Some("DFlash2DraftModel"))) {
        return unsupported("DFlash2DraftModel (dynamic convolutions, candidate selector)");
    }
    let draft = DraftValues::new(root);
    if draft.get("conv_kernel_size").is_some() || draft.get("selector_rank").is_some() {
        return unsupported("DFlash 2 settings (conv_kernel_size / selector_rank)");
    }
    let layer_types = root.get("layer_types").and_then(Value::as_array);
    if layer_types.is_some_and(|t| t.iter().any(|v| v.as_str() != Some("full_attention"))) {
        return unsupported("layer_types other than full_attention (sliding-window layers)");
    }
    if root.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return unsupported("use_sliding_window");
    }
    if draft.get("is_causal").and_then(Value::as_bool) == Some(true) {
        return unsupported("is_causal (causal draft attention)");
    }
    let rope = root.get("rope_parameters").or_else(|| root.get("rope_scaling")).filter(|r| !r.is_null());
    if let Some(rope) = rope {
        let rope_type =
            rope.get("rope_type").or_else(|| rope.get("type")).and_then(Value::as_str).unwrap_or("default");
        if rope_type != "default" || rope.get("mrope_section").is_some() {
            return unsupported("rope scaling / M-RoPE in the head (GLANCE heads use plain 1-D RoPE)");
        }
    }
    Ok(())
}

fn target_layer_ids(
    draft: &DraftValues,
    view: &JsonView,
    num_layers: usize,
    num_target_layers: Option<usize>,
) -> Result<Vec<usize>, HeadError> {
    if let Some(ids) = draft.get("target_layer_ids") {
        return ids
            .as_array()
            .and_then(|a| a.iter().map(|v| v.as_u64().map(|x| x as usize)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| view.bad("target_layer_ids"));
    }
    let from_config = view.value.get("num_target_layers").and_then(Value::as_u64).map(|n| n as usize);
    let target_layers = from_config
        .or(num_target_layers)
        .ok_or_else(|| view.bad("target_layer_ids (and no num_target_layers to derive them)"))?;
    Ok(build_target_layer_ids(target_layers, num_layers))
}

/// A loaded draft head with the target's embedding and LM head.
pub struct DraftHead {
    config: DraftHeadConfig,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<HeadLayer>,
    norm: RmsNorm,
    /// (vocab, hidden), the target's.
    embed: Tensor,
    /// (vocab, hidden), the target's.
    lm_head: Tensor,
    inv_freq: Tensor,
    /// Rotary tables of positions 0.. precomputed for serving ([`DraftHead::precompute_rotary`]);
    /// a round then slices its rows instead of computing them.
    rotary_table: Option<Rotary>,
    /// The tokens a served draft pass scores ([`DraftHead::restrict_vocab`]); all when `None`.
    draft_vocab: Option<RestrictedVocab>,
    kind: Kind,
    device: Device,
}

/// A draft vocabulary in place: its token ids and their rows of the LM head.
struct RestrictedVocab {
    ids: Vec<TokenId>,
    /// (ids, hidden): `lm_head[ids]`, gathered once.
    lm_head: Tensor,
}

struct HeadLayer {
    input_layernorm: RmsNorm,
    attn: HeadAttention,
    post_attention_layernorm: RmsNorm,
    mlp: SwiGlu,
}

struct HeadAttention {
    q_proj: Linear,
    /// k and v in one matmul over [ctx ; block]: (rows, d) → (rows, 2·kv_heads·head_dim).
    kv_proj: FusedLinear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

impl DraftHead {
    /// Loads the head from `head_dir` and, from `target_dir`, only the two target tensors it
    /// shares (input embedding and LM head), checking that head and target fit together.
    pub fn load(head_dir: &Path, target_dir: &Path, kind: Kind, device: Device) -> Result<Self, HeadError> {
        let target = target_text_config(target_dir)?;
        let config = DraftHeadConfig::load(head_dir, Some(target.num_layers))?;
        check_fits_target(&config, &target)?;
        let (embed, lm_head) = load_target_matrices(target_dir, &target, kind, device)?;
        Self::from_parts(config, head_dir, embed, lm_head, kind, device)
    }

    /// Builds the head from a parsed config, the head's weights in `head_weights_dir`, and the
    /// target's embedding and LM head matrices (vocab, hidden) — e.g. from a loaded
    /// `TargetModel` (`text.embed_tokens()`, `text.lm_head()`). The caller checks that the tap
    /// layers exist in its target.
    pub fn from_parts(
        config: DraftHeadConfig,
        head_weights_dir: &Path,
        embed: Tensor,
        lm_head: Tensor,
        kind: Kind,
        device: Device,
    ) -> Result<Self, HeadError> {
        let mut ckpt = Checkpoint::open(head_weights_dir, kind, device)?;
        Self::from_checkpoint(config, &mut ckpt, embed, lm_head)
    }

    /// Builds the head from `ckpt` (stored weights, or trainable ones for `drafter-svc train`)
    /// and the target's frozen embedding and LM head.
    pub fn from_checkpoint(
        config: DraftHeadConfig,
        ckpt: &mut Checkpoint,
        embed: Tensor,
        lm_head: Tensor,
    ) -> Result<Self, HeadError> {
        let (kind, device) = (ckpt.kind(), ckpt.device());
        let embed = embed.detach().to_device(device).to_kind(kind);
        let lm_head = lm_head.detach().to_device(device).to_kind(kind);
        // A tied LM head stays the embedding's storage: a second copy of a large vocabulary's
        // matrix is not worth the few percent of a full-vocabulary draft it would save.
        let tied = lm_head.data_ptr() == embed.data_ptr();
        let lm_head = if ckpt.is_trainable() || tied { lm_head } else { gemm_layout(lm_head) };
        check_shared_matrices(&config, &embed, &lm_head)?;
        let prefix = weight_prefix(ckpt)?;
        let c = &config;
        let taps = c.target_layer_ids.len() as i64;
        let fc = Linear::load(ckpt, &format!("{prefix}fc"), taps * c.hidden_size, c.hidden_size, false)?;
        let norm_of = |ckpt: &mut Checkpoint, name: &str| {
            RmsNorm::load(ckpt, &format!("{prefix}{name}"), c.hidden_size, c.rms_norm_eps)
        };
        let hidden_norm = norm_of(ckpt, "hidden_norm")?;
        let norm = norm_of(ckpt, "norm")?;
        let layers = (0..c.num_layers)
            .map(|i| HeadLayer::load(ckpt, &format!("{prefix}layers.{i}"), c))
            .collect::<Result<Vec<_>, _>>()?;
        let unused = ckpt.remaining();
        if !unused.is_empty() {
            tracing::warn!(count = unused.len(), first = %unused[0], "draft head tensors not used");
        }
        let inv_freq = inverse_frequencies(c.rope_theta, c.head_dim, device);
        Ok(Self {
            fc,
            hidden_norm,
            layers,
            norm,
            embed,
            lm_head,
            inv_freq,
            rotary_table: None,
            draft_vocab: None,
            kind,
            device,
            config,
        })
    }

    /// Precomputes the rotary tables of positions `0..positions` (a serving session's context
    /// limit plus a block): each round then takes its rows as two views instead of computing them
    /// (about ten libtorch calls). Positions beyond are still computed.
    pub fn precompute_rotary(&mut self, positions: usize) {
        let _no_grad = tch::no_grad_guard();
        self.rotary_table =
            Some(self.rotary_at(Tensor::arange(positions as i64, (Kind::Int64, self.device))));
    }

    /// From now on a draft pass scores only `ids` (distinct tokens of the target's vocabulary), so
    /// its marginals are the head's distribution renormalized over them (see [`crate::draft_vocab`]).
    /// Training is unaffected: its logits cover the whole vocabulary.
    pub fn restrict_vocab(&mut self, ids: &[i64]) -> Result<(), HeadError> {
        let vocab = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| !(0..vocab).contains(&id)) {
            return Err(HeadError::Input(format!(
                "draft vocabulary token {bad} outside the target's vocabulary of {vocab}"
            )));
        }
        if ids.is_empty() || ids.iter().collect::<std::collections::HashSet<_>>().len() != ids.len() {
            return Err(HeadError::Input("a draft vocabulary needs distinct tokens, at least one".into()));
        }
        let rows = glance_models::upload(ids, self.device);
        let lm_head = tch::no_grad(|| gemm_layout(self.lm_head.index_select(0, &rows)));
        let ids = ids.iter().map(|&id| id as TokenId).collect();
        self.draft_vocab = Some(RestrictedVocab { ids, lm_head });
        Ok(())
    }

    /// Tokens a draft pass scores: the draft vocabulary's size, else the whole vocabulary's.
    pub fn draft_vocab_size(&self) -> usize {
        self.draft_vocab.as_ref().map_or(self.vocab_size() as usize, |v| v.ids.len())
    }

    /// One draft pass ([`DraftHead::draft`]) reduced to the `k` best tokens per offset, in the
    /// target's token ids (a draft vocabulary's positions mapped back).
    pub fn draft_marginals(
        &self,
        cache: &mut KvCache,
        context: &Tensor,
        root_token: i64,
        root_position: usize,
        k: usize,
    ) -> Result<Marginals, HeadError> {
        let logits = self.draft(cache, context, root_token, root_position)?;
        let mut marginals = Marginals::top_k(&logits, k)?;
        if let Some(vocab) = &self.draft_vocab {
            for id in marginals.ids.iter_mut().flatten() {
                *id = vocab.ids[*id as usize];
            }
        }
        Ok(marginals)
    }

    /// An empty draft KV cache for `capacity` stream positions (context rows plus one block).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let c = &self.config;
        KvCache::new(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.kind, self.device)
    }

    /// One draft pass. `context`: (C, taps·hidden) tap states (any float dtype) of the C committed
    /// positions not yet in `cache`, which must end right before `root_position`; `root_token` is
    /// the pending token at `root_position`. Appends the C context rows to `cache` and returns the
    /// (B−1, vocab) draft logits for positions `root_position+1 ..= root_position+B−1`; with a
    /// draft vocabulary, (B−1, its size), column i scoring its i-th token.
    pub fn draft(
        &self,
        cache: &mut KvCache,
        context: &Tensor,
        root_token: i64,
        root_position: usize,
    ) -> Result<Tensor, HeadError> {
        self.check_draft_input(cache, context, root_token, root_position)?;
        Ok(tch::no_grad(|| self.forward(cache, context, root_token)))
    }

    /// Takes `context` (C, taps·hidden), the tap states of the C committed positions after those
    /// in `cache`, into `cache` ahead of the next draft pass: the keys and values that pass would
    /// write for them (a context row's read only the fused context, never the block), so the pass
    /// then carries only the rows after them: the first messages of a context too large for one
    /// are taken in while the rest is on its way.
    pub fn ingest(&self, cache: &mut KvCache, context: &Tensor) -> Result<(), HeadError> {
        let rows = self.check_context(context)?;
        // Room for the block too: the pass that follows must fit.
        cache.ensure_room(rows + self.config.block_size)?;
        tch::no_grad(|| {
            let ctx = self.fused_context(context);
            let rotary = self.rotary(cache.len() as i64, rows as i64);
            for (i, layer) in self.layers.iter().enumerate() {
                let (k, v) = layer.attn.keys_values(&ctx, &rotary);
                let _live = cache.write(i, &k, &v);
            }
            cache.advance(rows);
        });
        Ok(())
    }

    /// The context's shape and dtype; its rows.
    fn check_context(&self, context: &Tensor) -> Result<usize, HeadError> {
        let width = self.config.target_layer_ids.len() as i64 * self.config.hidden_size;
        let size = context.size();
        if size.len() != 2 || size[1] != width {
            return Err(HeadError::Input(format!("context states {size:?}, expected [rows, {width}]")));
        }
        if !matches!(context.kind(), Kind::Float | Kind::BFloat16 | Kind::Half | Kind::Double) {
            return Err(HeadError::Input(format!(
                "context states of dtype {:?}, expected a float dtype",
                context.kind()
            )));
        }
        Ok(size[0] as usize)
    }

    /// `hidden_norm(fc(taps))`: the context rows as every layer's keys and values read them, (C, d).
    fn fused_context(&self, context: &Tensor) -> Tensor {
        let context = context.to_device(self.device).to_kind(self.kind);
        self.hidden_norm.forward(&self.fc.forward(&context))
    }

    fn check_draft_input(
        &self,
        cache: &KvCache,
        context: &Tensor,
        root_token: i64,
        root_position: usize,
    ) -> Result<(), HeadError> {
        let rows = self.check_context(context)?;
        if cache.len() + rows != root_position {
            return Err(HeadError::Input(format!(
                "draft cache holds {} positions and {rows} new context rows follow, so the root \
                 must be at {}, not {root_position}",
                cache.len(),
                cache.len() + rows
            )));
        }
        if !(0..self.vocab_size()).contains(&root_token) {
            return Err(HeadError::Input(format!(
                "root token {root_token} outside the vocabulary of {}",
                self.vocab_size()
            )));
        }
        cache.ensure_room(rows + self.config.block_size)?;
        Ok(())
    }

    fn forward(&self, cache: &mut KvCache, context: &Tensor, root_token: i64) -> Tensor {
        let rows = context.size()[0];
        let block = self.config.block_size as i64;
        let ctx = self.fused_context(context);
        let mut hidden = self.block_embedding(root_token);
        let rotary = self.rotary(cache.len() as i64, rows + block);
        for (i, layer) in self.layers.iter().enumerate() {
            hidden = layer.forward(&hidden, &ctx, &rotary, i, cache);
        }
        // Only the context rows persist; the block's rows past them are left to be overwritten.
        cache.advance(rows as usize);
        let out = self.norm.forward(&hidden.narrow(0, 1, block - 1));
        match &self.draft_vocab {
            Some(vocab) => self.scale_logits(linear(&out, &vocab.lm_head, None)),
            None => self.logits(&out),
        }
    }

    /// Teacher-forced training pass over one row. `context`: (S, taps·hidden) tap states of the
    /// row's positions 0..S; one block per anchor a: `[token at a, MASK × (B−1)]` at positions
    /// a..a+B−1, seeing the context rows strictly before a and its own block (bidirectionally),
    /// as at inference. Returns the draft logits (anchors, B−1, vocab) for positions a+1..a+B−1.
    pub fn forward_train(&self, context: &Tensor, anchors: &[i64], anchor_tokens: &[i64]) -> Tensor {
        self.logits(&self.forward_train_hidden(context, anchors, anchor_tokens))
    }

    /// [`Self::forward_train`] before the LM head: the normed hidden states (anchors, B−1, hidden),
    /// for a loss that scores only some of the vocabulary ([`Self::logits_over`]).
    pub fn forward_train_hidden(&self, context: &Tensor, anchors: &[i64], anchor_tokens: &[i64]) -> Tensor {
        let block = self.config.block_size as i64;
        let rows = context.size()[0];
        let count = anchors.len() as i64;
        let ctx = self.hidden_norm.forward(&self.fc.forward(&context.to_kind(self.kind)));
        let mut ids = Vec::with_capacity((count * block) as usize);
        let mut positions: Vec<i64> = (0..rows).collect();
        for (&a, &token) in anchors.iter().zip(anchor_tokens) {
            ids.push(token);
            ids.extend(std::iter::repeat_n(self.config.mask_token_id, block as usize - 1));
            positions.extend(a..a + block);
        }
        let mut hidden = self.embed_tokens(&ids);
        let rotary = self.rotary_at(glance_models::upload(&positions, self.device));
        let mask = training_mask(anchors, rows, block, self.kind, self.device);
        for layer in &self.layers {
            hidden = layer.forward_masked(&hidden, &ctx, &rotary, &mask);
        }
        self.norm.forward(&hidden).view([count, block, -1]).narrow(1, 1, block - 1)
    }

    /// The logits of `hidden` (…, hidden) for the vocabulary rows `ids` (k,) only: (…, k), each
    /// equal to the matching column of the full logits.
    pub fn logits_over(&self, hidden: &Tensor, ids: &Tensor) -> Tensor {
        self.scale_logits(linear(hidden, &self.lm_head.index_select(0, ids), None))
    }

    /// Rotary tables (n, head_dim) for the 1-D int64 `positions` (n,); angles in f32 as
    /// transformers' Qwen3RotaryEmbedding computes them.
    fn rotary_at(&self, positions: Tensor) -> Rotary {
        let positions = positions.to_device(self.device).to_kind(Kind::Float);
        let half_angles = positions.unsqueeze(1) * self.inv_freq.unsqueeze(0); // (n, hd/2)
        Rotary::from_half_angles(&half_angles, self.kind)
    }

    /// Target embedding of `[root, MASK × (B−1)]`, (B, hidden).
    fn block_embedding(&self, root_token: i64) -> Tensor {
        let mut ids = vec![self.config.mask_token_id; self.config.block_size];
        ids[0] = root_token;
        self.embed_tokens(&ids)
    }

    /// The target's (scaled) input embedding of `ids`, (n, hidden).
    fn embed_tokens(&self, ids: &[i64]) -> Tensor {
        let embedded = self.embed.index_select(0, &glance_models::upload(ids, self.device));
        match self.config.input_embedding_scale {
            scale if scale != 1.0 => embedded * scale,
            _ => embedded,
        }
    }

    /// The draft logits of `hidden` (…, hidden) over the whole vocabulary: (…, vocab).
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        self.scale_logits(linear(hidden, &self.lm_head, None))
    }

    /// The output multiplier and soft-capping of the target's LM head.
    fn scale_logits(&self, mut logits: Tensor) -> Tensor {
        if self.config.output_multiplier != 1.0 {
            logits *= self.config.output_multiplier;
        }
        if let Some(cap) = self.config.final_logit_softcapping {
            logits = (logits / cap).tanh() * cap;
        }
        logits
    }

    /// Rotary tables (n, head_dim) for the positions `start..start+n`.
    fn rotary(&self, start: i64, n: i64) -> Rotary {
        match &self.rotary_table {
            Some(table) if start + n <= table.len() => table.rows(start, n),
            _ => self.rotary_at(Tensor::arange_start(start, start + n, (Kind::Int64, self.device))),
        }
    }

    pub fn config(&self) -> &DraftHeadConfig {
        &self.config
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    pub fn mask_token_id(&self) -> i64 {
        self.config.mask_token_id
    }

    pub fn tap_layers(&self) -> &[usize] {
        &self.config.target_layer_ids
    }

    pub fn hidden_size(&self) -> i64 {
        self.config.hidden_size
    }

    pub fn vocab_size(&self) -> i64 {
        self.lm_head.size()[0]
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn device(&self) -> Device {
        self.device
    }
}

/// `""` or `"model."`: the prefix under which this checkpoint stores the head's tensors.
fn weight_prefix(ckpt: &Checkpoint) -> Result<&'static str, HeadError> {
    ["", "model."].into_iter().find(|prefix| ckpt.contains(&format!("{prefix}fc.weight"))).ok_or_else(|| {
        HeadError::Weights(WeightsError::Missing {
            name: "fc.weight".into(),
            alternatives: vec!["model.fc.weight".into()],
        })
    })
}

fn check_fits_target(config: &DraftHeadConfig, target: &TextConfig) -> Result<(), HeadError> {
    if config.hidden_size != target.hidden_size {
        return Err(HeadError::Mismatch(format!(
            "head hidden size {} but target hidden size {}",
            config.hidden_size, target.hidden_size
        )));
    }
    if let Some(&bad) = config.target_layer_ids.iter().find(|&&l| l >= target.num_layers) {
        return Err(HeadError::Mismatch(format!(
            "tap layer {bad} but the target has {} layers",
            target.num_layers
        )));
    }
    if config.vocab_size.is_some_and(|v| v != target.vocab_size) {
        return Err(HeadError::Mismatch(format!(
            "head vocab size {:?} but target vocab size {}",
            config.vocab_size, target.vocab_size
        )));
    }
    Ok(())
}

fn check_shared_matrices(
    config: &DraftHeadConfig,
    embed: &Tensor,
    lm_head: &Tensor,
) -> Result<(), HeadError> {
    let embed_size = embed.size();
    let (vocab, hidden) = match embed_size[..] {
        [v, h] => (v, h),
        _ => return Err(HeadError::Mismatch(format!("embedding of shape {embed_size:?}"))),
    };
    if hidden != config.hidden_size || lm_head.size() != [vocab, hidden] {
        return Err(HeadError::Mismatch(format!(
            "embedding {embed_size:?} and LM head {:?}, expected [vocab, {}] both",
            lm_head.size(),
            config.hidden_size
        )));
    }
    if config.mask_token_id >= vocab {
        return Err(HeadError::Mismatch(format!(
            "mask token {} outside the target vocabulary of {vocab}",
            config.mask_token_id
        )));
    }
    Ok(())
}

/// The target's input embedding (vocab, hidden), read alone from its checkpoint.
pub fn load_target_embedding(target_dir: &Path, kind: Kind, device: Device) -> Result<Tensor, HeadError> {
    let mut found = read_named_tensors(target_dir, &TARGET_EMBEDDING, kind, device)?;
    TARGET_EMBEDDING.iter().find_map(|name| found.remove(*name)).ok_or_else(|| {
        HeadError::Weights(WeightsError::Missing {
            name: TARGET_EMBEDDING[0].into(),
            alternatives: vec![TARGET_EMBEDDING[1].into()],
        })
    })
}

/// The target's input embedding under its transformers 5.x and 4.x names.
const TARGET_EMBEDDING: [&str; 2] = ["model.language_model.embed_tokens.weight", "model.embed_tokens.weight"];

/// The target's input embedding and LM head (tied to the embedding when the target says so),
/// read alone from its checkpoint.
fn load_target_matrices(
    target_dir: &Path,
    target: &TextConfig,
    kind: Kind,
    device: Device,
) -> Result<(Tensor, Tensor), HeadError> {
    const EMBED: [&str; 2] = TARGET_EMBEDDING;
    const LM_HEAD: &str = "lm_head.weight";
    let mut found = read_named_tensors(target_dir, &[EMBED[0], EMBED[1], LM_HEAD], kind, device)?;
    let embed = EMBED.iter().find_map(|name| found.remove(*name)).ok_or_else(|| WeightsError::Missing {
        name: EMBED[0].into(),
        alternatives: vec![EMBED[1].into()],
    })?;
    let lm_head = match found.remove(LM_HEAD) {
        Some(t) => t,
        None if target.tie_word_embeddings => embed.shallow_clone(),
        None => {
            return Err(HeadError::Weights(WeightsError::Missing {
                name: LM_HEAD.into(),
                alternatives: vec![],
            }))
        }
    };
    Ok((embed, lm_head))
}

impl HeadLayer {
    fn load(ckpt: &mut Checkpoint, prefix: &str, c: &DraftHeadConfig) -> Result<Self, WeightsError> {
        let norm = |ckpt: &mut Checkpoint, name: &str| {
            RmsNorm::load(ckpt, &format!("{prefix}.{name}"), c.hidden_size, c.rms_norm_eps)
        };
        Ok(Self {
            input_layernorm: norm(ckpt, "input_layernorm")?,
            attn: HeadAttention::load(ckpt, &format!("{prefix}.self_attn"), c)?,
            post_attention_layernorm: norm(ckpt, "post_attention_layernorm")?,
            mlp: SwiGlu::load(
                ckpt,
                &format!("{prefix}.mlp"),
                c.hidden_size,
                c.intermediate_size,
                false,
                c.activation,
            )?,
        })
    }

    /// hidden: (B, d) block stream; ctx: (C, d) fused context, the same for every layer.
    fn forward(
        &self,
        hidden: &Tensor,
        ctx: &Tensor,
        rotary: &Rotary,
        layer: usize,
        cache: &mut KvCache,
    ) -> Tensor {
        let x = self.input_layernorm.forward(hidden);
        let h = hidden + self.attn.forward(&x, ctx, rotary, layer, cache);
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h))
    }
}

impl HeadLayer {
    /// Training variant of `forward`: no cache, an explicit mask; the rotary tables cover ctx then
    /// block rows.
    fn forward_masked(&self, hidden: &Tensor, ctx: &Tensor, rotary: &Rotary, mask: &Tensor) -> Tensor {
        let x = self.input_layernorm.forward(hidden);
        let (q, k, v) = self.attn.project(&x, ctx, rotary);
        let h = hidden + self.attn.attend(&q, &k, &v, Some(mask));
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h))
    }
}

impl HeadAttention {
    fn load(ckpt: &mut Checkpoint, prefix: &str, c: &DraftHeadConfig) -> Result<Self, WeightsError> {
        let q_dim = c.num_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        let bias = c.attention_bias;
        let proj = |ckpt: &mut Checkpoint, name: &str, i: i64, o: i64| {
            Linear::load(ckpt, &format!("{prefix}.{name}"), i, o, bias)
        };
        let norm = |ckpt: &mut Checkpoint, name: &str| {
            RmsNorm::load(ckpt, &format!("{prefix}.{name}"), c.head_dim, c.rms_norm_eps)
        };
        Ok(Self {
            q_proj: proj(ckpt, "q_proj", c.hidden_size, q_dim)?,
            kv_proj: FusedLinear::load(
                ckpt,
                &[(format!("{prefix}.k_proj"), kv_dim), (format!("{prefix}.v_proj"), kv_dim)],
                c.hidden_size,
                bias,
            )?,
            o_proj: proj(ckpt, "o_proj", q_dim, c.hidden_size)?,
            q_norm: norm(ckpt, "q_norm")?,
            k_norm: norm(ckpt, "k_norm")?,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        })
    }

    /// Queries from the block x (B, d); keys/values from [ctx ; x] (C+B rows) appended to the
    /// layer's cache; non-causal attention over everything cached. Rotary tables: (C+B, head_dim).
    fn forward(
        &self,
        x: &Tensor,
        ctx: &Tensor,
        rotary: &Rotary,
        layer: usize,
        cache: &mut KvCache,
    ) -> Tensor {
        let (q, k, v) = self.project(x, ctx, rotary);
        let (keys, values) = cache.write(layer, &k, &v);
        self.attend(&q, &keys, &values, None)
    }

    /// q (heads, B, hd) from the block rows; k, v (kv_heads, C+B, hd) from [ctx ; x]; q/k normed
    /// per head and rotated (queries at the last B positions of the tables).
    fn project(&self, x: &Tensor, ctx: &Tensor, rotary: &Rotary) -> (Tensor, Tensor, Tensor) {
        let block = x.size()[0];
        let rows = ctx.size()[0] + block;
        let q = self.q_proj.forward(x).view([block, self.num_heads, self.head_dim]);
        let q = self.q_norm.forward(&q).transpose(0, 1);
        let (k, v) = self.keys_values(&Tensor::cat(&[ctx, x], 0), rotary);
        // (heads, n, hd) against (n, hd) tables: broadcast over the heads.
        let q = rotary.rows(rows - block, block).apply(&q);
        (q, k, v)
    }

    /// k, v (kv_heads, n, hd) of the rows `input` (n, d): k normed per head and rotated by the
    /// tables `rotary` (n, head_dim).
    fn keys_values(&self, input: &Tensor, rotary: &Rotary) -> (Tensor, Tensor) {
        let rows = input.size()[0];
        let kv = self.kv_proj.forward(input).view([rows, 2 * self.num_kv_heads, self.head_dim]);
        let k = self.k_norm.forward(&kv.narrow(1, 0, self.num_kv_heads)).transpose(0, 1);
        let v = kv.narrow(1, self.num_kv_heads, self.num_kv_heads).transpose(0, 1);
        (rotary.apply(&k), v)
    }

    /// Attention of q over keys/values (no mask: the block sees everything), output projection.
    fn attend(&self, q: &Tensor, keys: &Tensor, values: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let block = q.size()[1];
        let out = Tensor::scaled_dot_product_attention(
            &q.unsqueeze(0),
            &keys.unsqueeze(0),
            &values.unsqueeze(0),
            mask.map(|m| m.view([1, 1, block, -1])),
            0.0,
            false,
            None,
            self.num_heads != self.num_kv_heads,
        ); // (1, heads, B, hd)
        let out =
            out.squeeze_dim(0).transpose(0, 1).contiguous().view([block, self.num_heads * self.head_dim]);
        self.o_proj.forward(&out)
    }
}

/// Additive mask (anchors·B, S + anchors·B) of a training row: block b's rows see the context
/// columns before its anchor and the B columns of their own block.
fn training_mask(anchors: &[i64], rows: i64, block: i64, kind: Kind, device: Device) -> Tensor {
    let count = anchors.len() as i64;
    let width = rows + count * block;
    let mut mask = vec![f32::NEG_INFINITY; (count * block * width) as usize];
    for (b, &anchor) in anchors.iter().enumerate() {
        let b = b as i64;
        for j in 0..block {
            let row = (b * block + j) * width;
            for col in 0..anchor.min(rows) {
                mask[(row + col) as usize] = 0.0;
            }
            for col in 0..block {
                mask[(row + rows + b * block + col) as usize] = 0.0;
            }
        }
    }
    glance_models::upload(&mask, device).view([count * block, width]).to_kind(kind)
}

pub(crate) fn read_json(path: &Path) -> Result<Value, HeadError> {
    let err = |reason: String| HeadError::Config { path: path.display().to_string(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| err(e.to_string()))
}

/// `rope_parameters.rope_theta` (transformers 5.x) or the top-level `rope_theta` (4.x).
fn rope_theta(section: &Value) -> Option<f64> {
    section
        .get("rope_parameters")
        .and_then(|r| r.get("rope_theta"))
        .and_then(Value::as_f64)
        .or_else(|| section.get("rope_theta").and_then(Value::as_f64))
}

/// DFlash's `_draft_value`: a key of `dflash_config` first, else of the top level.
struct DraftValues<'a> {
    root: &'a Value,
}

impl<'a> DraftValues<'a> {
    fn new(root: &'a Value) -> Self {
        Self { root }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.root
            .get("dflash_config")
            .and_then(|d| d.get(key))
            .or_else(|| self.root.get(key))
            .filter(|v| !v.is_null())
    }

    fn int(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }

    fn float(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }
}

/// Typed reads of a config object, naming the file in errors.
struct JsonView<'a> {
    value: &'a Value,
    path: &'a Path,
}

impl<'a> JsonView<'a> {
    fn new(value: &'a Value, path: &'a Path) -> Self {
        Self { value, path }
    }

    fn bad(&self, key: &str) -> HeadError {
        HeadError::Config {
            path: self.path.display().to_string(),
            reason: format!("missing or invalid key {key:?}"),
        }
    }

    fn int(&self, key: &str) -> Result<i64, HeadError> {
        self.value.get(key).and_then(Value::as_i64).ok_or_else(|| self.bad(key))
    }

    fn usize(&self, key: &str) -> Result<usize, HeadError> {
        self.value.get(key).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| self.bad(key))
    }

    fn int_or(&self, key: &str, default: i64) -> i64 {
        self.value.get(key).and_then(Value::as_i64).unwrap_or(default)
    }

    fn float_or(&self, key: &str, default: f64) -> f64 {
        self.value.get(key).and_then(Value::as_f64).unwrap_or(default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(value: Value, target_layers: Option<usize>) -> Result<DraftHeadConfig, HeadError> {
        DraftHeadConfig::from_json(&value, Path::new("config.json"), target_layers)
    }

    /// The shape of z-lab/SpecForge DFlash configs (Qwen3-8B head, SpecForge configs dir).
    fn qwen3_8b_like() -> Value {
        json!({
            "architectures": ["DFlashDraftModel"],
            "attention_bias": false,
            "block_size": 16,
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "layer_types": vec!["full_attention"; 5],
            "model_type": "qwen3",
            "num_attention_heads": 32,
            "num_hidden_layers": 5,
            "num_key_value_heads": 8,
            "num_target_layers": 36,
            "rms_norm_eps": 1e-6,
            "rope_scaling": null,
            "rope_theta": 1000000,
            "sliding_window": null,
            "use_sliding_window": false,
            "vocab_size": 151936
        })
    }

    #[test]
    fn tap_rule_matches_dflash() {
        assert_eq!(build_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(build_target_layer_ids(28, 5), vec![1, 7, 13, 19, 25]);
        assert_eq!(build_target_layer_ids(36, 1), vec![18]);
        // 1 + 1·3/2 = 2.5 rounds to 2 under Python's round.
        assert_eq!(build_target_layer_ids(7, 3), vec![1, 2, 4]);
        assert_eq!(build_target_layer_ids(4, 2), vec![1, 1]);
    }

    #[test]
    fn reads_dflash_config_spellings() {
        let c = parse(qwen3_8b_like(), None).unwrap();
        assert_eq!(c.block_size, 16);
        assert_eq!(c.mask_token_id, 151669);
        assert_eq!(c.target_layer_ids, vec![1, 9, 17, 25, 33]);
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.vocab_size, Some(151936));
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (32, 8, 128));

        // Top-level mask/taps (some published heads) and rope_parameters (transformers 5.x).
        let mut top = qwen3_8b_like();
        top.as_object_mut().unwrap().remove("dflash_config");
        top["mask_token_id"] = json!(7);
        top["target_layer_ids"] = json!([2, 3]);
        top["rope_parameters"] = json!({"rope_theta": 5e6, "rope_type": "default"});
        let c = parse(top, None).unwrap();
        assert_eq!((c.mask_token_id, c.target_layer_ids.clone()), (7, vec![2, 3]));
        assert_eq!(c.rope_theta, 5e6);
    }

    #[test]
    fn derives_taps_when_the_config_has_none() {
        let mut v = qwen3_8b_like();
        v["dflash_config"] = json!({"mask_token_id": 3});
        assert_eq!(parse(v.clone(), Some(4)).unwrap().target_layer_ids, vec![1, 9, 17, 25, 33]);
        v.as_object_mut().unwrap().remove("num_target_layers");
        assert_eq!(parse(v.clone(), Some(28)).unwrap().target_layer_ids, vec![1, 7, 13, 19, 25]);
        assert!(parse(v, None).is_err());
    }

    #[test]
    fn refuses_variants_it_does_not_implement() {
        let cases = [
            ("layer_types", json!(vec!["sliding_attention"; 5])),
            ("use_sliding_window", json!(true)),
            ("architectures", json!(["DFlash2DraftModel"])),
            ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0})),
            ("rope_scaling", json!({"mrope_section": [24, 20, 20], "type": "default"})),
        ];
        for (key, value) in cases {
            let mut v = qwen3_8b_like();
            v[key] = value;
            assert!(matches!(parse(v, None), Err(HeadError::Unsupported(_))), "{key}");
        }
        let mut v = qwen3_8b_like();
        v["dflash_config"]["conv_kernel_size"] = json!(4);
        assert!(matches!(parse(v, None), Err(HeadError::Unsupported(_))));
        let mut v = qwen3_8b_like();
        v["dflash_config"].as_object_mut().unwrap().remove("mask_token_id");
        assert!(matches!(parse(v, None), Err(HeadError::Config { .. })));
        let mut v = qwen3_8b_like();
        v["num_key_value_heads"] = json!(5);
        assert!(parse(v, None).is_err());
    }
}
