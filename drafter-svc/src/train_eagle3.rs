//! `drafter-svc train --kind eagle3`: trains an EAGLE-3 head on the same rows as the GLANCE block
//! head (the same data source, seed and greedy regeneration, cached alike), so the two can be
//! compared as the paper does, trained on one corpus:
//! 1. the rows and their tap states come from [`RowBuilder`] (three taps: low, middle, high);
//! 2. the draft vocabulary is the training responses' most frequent tokens (EAGLE's rule), fixed
//!    in a fresh head's `d2t`/`t2d`;
//! 3. each step runs EAGLE-3's training-time test over one row: the head unrolled
//!    `ttt_length` steps, step k reading its own step-(k−1) outputs and predicting k tokens further
//!    ([`Eagle3Head::forward_ttt`]), the loss of step k weighted 0.8^k. The labels are the row's
//!    tokens, which are the target's own greedy choices (its argmax, where EAGLE scores the
//!    target's whole distribution); positions whose label lies outside the draft vocabulary, or in
//!    the prompt, weigh nothing;
//! 4. AdamW with cosine schedule and warm-up, gradient clipping, as the block head.
//!
//! Held-out acceptance is measured as the service drafts: at anchors of each held-out row, the
//! chain and the budget-31 tree the head grows (EAGLE-2's expansion), against the greedy
//! trajectory.

use std::collections::HashMap;
use std::path::PathBuf;

use glance_input::{PromptBuilder, PromptOptions};
use glance_models::weights::Checkpoint;
use glance_models::TargetModel;
use glance_spec::tree::TokenId;
use glance_train::rng::Rng;
use glance_train::{cosine_lr, cross_entropy, AdamW};
use tch::{Kind, Tensor};

use crate::eagle3::{default_tap_layers, Eagle3Config, Eagle3Head, TreeShape};
use crate::init::{write_random_eagle3_head, Eagle3Spec};
use crate::train::{
    accepted_in_tree, due, most_frequent_response_tokens, restore_state, save, Acceptance, Progress, Row,
    RowBuilder, TrainConfig, TrainError,
};

/// What an EAGLE-3 run adds to the common settings.
#[derive(Clone, Debug)]
pub struct Eagle3TrainConfig {
    /// Target, data, rows, schedule, output (the block head's `anchors`, `gamma`, `loss_vocab`
    /// and `fresh` do not apply).
    pub base: TrainConfig,
    /// Unroll steps of the training-time test (EAGLE-3: 7).
    pub ttt_length: usize,
    /// Tokens of a fresh head's draft vocabulary (EAGLE: 32,000; at most the vocabulary).
    pub draft_vocab: usize,
    /// The three tapped layers (default: EAGLE's for the target's depth).
    pub taps: Option<Vec<usize>>,
    /// Expansion passes of the trees the held-out evaluation grows (the service's --eagle-depth).
    pub eval_depth: usize,
}

/// Weight of unroll step k: 0.8^k (EAGLE-3's `ploss` decay).
const STEP_DECAY: f64 = 0.8;
/// Anchors per held-out row the evaluation grows a tree and a chain at.
const EVAL_ANCHORS: usize = 16;

pub fn train_eagle3(config: &Eagle3TrainConfig, mut log: impl FnMut(&str)) -> Result<Acceptance, TrainError> {
    let base = &config.base;
    let target = TargetModel::load(&base.target, Kind::Float, base.device)
        .map_err(|e| TrainError::Target(e.to_string()))?;
    let prompts = PromptBuilder::from_model_dir(&base.target, PromptOptions::default())
        .map_err(|e| TrainError::Target(e.to_string()))?;
    let text = target.text_config().clone();
    let taps = match &config.taps {
        Some(taps) => taps.clone(),
        None => default_tap_layers(text.num_layers).ok_or_else(|| {
            TrainError::Data(format!(
                "the target has {} layers: name the three taps (--taps)",
                text.num_layers
            ))
        })?,
    };
    log(&format!(
        "regenerating {} training and {} held-out rows with the target",
        base.rows, base.held_out_rows
    ));
    let builder = RowBuilder {
        target: &target,
        prompts: &prompts,
        max_new_tokens: base.max_new_tokens,
        taps: &taps,
        cache: base.out.join("regenerated.jsonl"),
        batch: base.regen_batch,
        teacher_top: 0, // EAGLE-3's training-time test scores the greedy tokens only
    };
    let train_rows = builder.build(&base.data, false, base.rows)?;
    let held_out = builder.build(&base.data, true, base.held_out_rows)?;
    let head_dir = prepare_eagle3_dir(config, &taps, &train_rows, &mut log)?;
    let head_config = Eagle3Config::load(&head_dir, &text)?;
    let mut ckpt = Checkpoint::open(&head_dir, Kind::Float, base.device)
        .map_err(|e| TrainError::Head(e.into()))?
        .into_trainable();
    let head =
        Eagle3Head::from_checkpoint(head_config, &mut ckpt, target.text.embed_tokens().shallow_clone())?;
    let named: Vec<(String, Tensor)> =
        ckpt.parameters().iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    let buffers = vocabulary_maps(&head_dir)?;
    let draft_of: HashMap<i64, i64> =
        head.draft_to_target_host().iter().enumerate().map(|(d, &t)| (t, d as i64)).collect();
    let mut optimizer = AdamW::new(named.iter().map(|(_, t)| t.shallow_clone()).collect(), 0.0);
    let first_step = if base.resume { restore_state(&base.out, &named, &mut optimizer)? } else { 0 };
    let warmup = ((base.steps as f64) * base.warmup_ratio).ceil() as usize;
    let mut progress = Progress::new(base.steps, first_step);
    let mut rng = Rng::new(base.seed ^ 0xEA61E3);
    for _ in 0..first_step {
        rng.next_u64();
    }
    for step in first_step..base.steps {
        let row = rng.pick(&train_rows);
        let Some(loss) = ttt_loss(&head, row, config.ttt_length, &draft_of) else { continue };
        loss.backward();
        optimizer.clip_grad_norm(1.0);
        optimizer.step(cosine_lr(step, base.steps, warmup, base.peak_lr, 0.0));
        progress.stepped(step, glance_models::read_f64(&loss));
        if due(base.eval_every, step, base.steps) {
            let acceptance = tch::no_grad(|| eagle3_acceptance(&head, &held_out, config.eval_depth));
            progress.evaluated(step, acceptance, &mut log);
        }
        if due(base.checkpoint_every, step, base.steps) {
            save(&base.out, &head_dir, &named, &buffers, &optimizer, step + 1, base.save_kind)?;
        }
    }
    if base.eval_every == 0 {
        progress.last = tch::no_grad(|| eagle3_acceptance(&head, &held_out, config.eval_depth));
    }
    Ok(progress.finish(&mut log))
}

/// The head training starts from: the output when resuming, `--init`, or a fresh random head in
/// `out/init` whose draft vocabulary is the training responses' most frequent tokens.
fn prepare_eagle3_dir(
    config: &Eagle3TrainConfig,
    taps: &[usize],
    rows: &[Row],
    log: &mut impl FnMut(&str),
) -> Result<PathBuf, TrainError> {
    let base = &config.base;
    if base.resume && base.out.join("model.safetensors").is_file() {
        return Ok(base.out.clone());
    }
    if let Some(init) = &base.init {
        return Ok(init.clone());
    }
    let (vocabulary, coverage) = most_frequent_response_tokens(rows, config.draft_vocab);
    log(&format!(
        "a fresh EAGLE-3 head: taps {taps:?}, a draft vocabulary of the {} most frequent response tokens ({:.1}% of them)",
        vocabulary.len(),
        100.0 * coverage
    ));
    let fresh = base.out.join("init");
    let spec = Eagle3Spec {
        tap_layers: Some(taps.to_vec()),
        draft_vocab: Some(vocabulary),
        ..Eagle3Spec::new(base.seed)
    };
    write_random_eagle3_head(&base.target, &fresh, &spec).map_err(|e| TrainError::Data(e.to_string()))?;
    Ok(fresh)
}

/// The head's fixed vocabulary maps (`d2t`, `t2d`), saved beside the trained weights as they are.
fn vocabulary_maps(head_dir: &std::path::Path) -> Result<Vec<(String, Tensor)>, TrainError> {
    let path = head_dir.join("model.safetensors");
    let tensors =
        Tensor::read_safetensors(&path).map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?;
    Ok(tensors.into_iter().filter(|(name, _)| name == "d2t" || name == "t2d").collect())
}

/// The training-time-test loss of one row (None: too short to learn from). Over the L = T−1
/// state positions s, step k reads token x[s+1+k] at position s+k and predicts x[s+2+k].
pub fn ttt_loss(head: &Eagle3Head, row: &Row, steps: usize, draft_of: &HashMap<i64, i64>) -> Option<Tensor> {
    let n = row.tokens.len();
    if n < 3 || row.response_start + 1 >= n {
        return None;
    }
    let l = n - 1;
    let device = head.device();
    let mut hidden = row.states.narrow(0, 0, l as i64);
    let mut cache = Vec::new();
    let mut total: Option<Tensor> = None;
    for k in 0..steps {
        let token = |i: usize| row.tokens.get(i).copied().unwrap_or(0);
        let tokens: Vec<i64> = (0..l).map(|s| token(s + 1 + k)).collect();
        let positions: Vec<i64> = (0..l).map(|s| (s + k) as i64).collect();
        let (mut labels, mut weights) = (Vec::with_capacity(l), Vec::with_capacity(l));
        for s in 0..l {
            let at = s + 2 + k;
            let draft = (at < n && at >= row.response_start).then(|| draft_of.get(&row.tokens[at])).flatten();
            labels.push(draft.copied().unwrap_or(0));
            weights.push(if draft.is_some() { 1.0f32 } else { 0.0 });
        }
        if weights.iter().all(|&w| w == 0.0) {
            break;
        }
        let out = head.forward_ttt(
            &hidden,
            &glance_models::upload(&tokens, device),
            &glance_models::upload(&positions, device),
            &mut cache,
        );
        let logits = head.logits(&out);
        let labels = glance_models::upload(&labels, device);
        let weights = glance_models::upload(&weights, device);
        let loss = cross_entropy(&logits, &labels, Some(&weights)) * STEP_DECAY.powi(k as i32);
        total = Some(match total {
            Some(t) => t + loss,
            None => loss,
        });
        hidden = out;
    }
    total
}

/// Accepted length (accepted + 1) of the chains and budget-31, top-8 trees the head grows at
/// anchors of each held-out row, on its greedy trajectory: one causal pass over the row fills the
/// draft cache, then anchors are taken from the last back (each tree leaves the cache truncated
/// to its anchor, which holds only what every earlier anchor needs).
pub fn eagle3_acceptance(head: &Eagle3Head, rows: &[Row], depth: usize) -> Acceptance {
    let (mut chain, mut tree, mut anchors) = (0usize, 0usize, 0usize);
    for row in rows {
        let n = row.tokens.len();
        if n < 3 || row.response_start + 1 >= n {
            continue;
        }
        let l = n - 1;
        let device = head.device();
        let mut cache = head.new_cache(n + depth * 8 + 8);
        let tokens = glance_models::upload(&row.tokens[1..], device);
        let positions = Tensor::arange(l as i64, (Kind::Int64, device));
        let out = head.forward(
            &mut cache,
            &row.states.narrow(0, 0, l as i64),
            &tokens,
            &positions,
            &head.causal_visibility(0, l),
        );
        cache.advance(l);
        // Roots at response positions a (its token x[a] drafted from, x[a+1..] the truth).
        let roots: Vec<usize> = (row.response_start.max(1)..n - 1).collect();
        let step = (roots.len() / EVAL_ANCHORS).max(1);
        for &a in roots.iter().step_by(step).rev() {
            cache.truncate(a);
            let last = out.narrow(0, a as i64 - 1, 1);
            let truth: Vec<TokenId> =
                row.tokens[a + 1..n.min(a + 2 + depth)].iter().map(|&t| t as TokenId).collect();
            let grow = |cache: &mut _, top_k, budget| {
                head.grow_tree(cache, &last, a, TreeShape { top_k, expansions: depth, budget })
            };
            let (Ok(t), Ok(c)) = (grow(&mut cache, 8, 31), grow(&mut cache, 1, depth + 1)) else { continue };
            tree += accepted_in_tree(&t, &truth) + 1;
            chain += accepted_in_tree(&c, &truth) + 1;
            anchors += 1;
        }
    }
    let mean = |total: usize| if anchors == 0 { 0.0 } else { total as f64 / anchors as f64 };
    Acceptance { chain_tau: mean(chain), tree_tau: mean(tree), anchors }
}
