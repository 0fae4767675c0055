//! `drafter-svc train`: trains the block draft head on a target's own states, for any supported
//! target, CPU or CUDA (glance.md §3.2, the DFlash recipe GLANCE follows):
//! 1. the responses are regenerated with the target's own greedy decoding (in padded batches),
//!    cached on disk so a resumed run does not redo them;
//! 2. one teacher-forced target pass per row gives the tap states, cached on disk too;
//! 3. each step samples anchors among a row's response positions; each block sees the context
//!    strictly before its anchor and its own block bidirectionally;
//! 4. cross-entropy on the same-position labels, weighted exp(−(k−1)/γ) (with `--distill-top-k`,
//!    mixed with the cross-entropy against the target's own top-k distribution there, kept from
//!    one more teacher-forced pass per row and cached too), over the full vocabulary
//!    or (`--loss-vocab`) a sampled softmax: the step's labels, the training responses' most
//!    frequent tokens, the head's own current top predictions (hard negatives, refreshed every
//!    few steps) and a few uniform negatives, which cuts the LM-head cost of a large vocabulary
//!    (SmolLM2: 49,152 rows) several times;
//! 5. AdamW with cosine schedule and warm-up, gradient clipping.
//!
//! Held-out acceptance is measured on the greedy trajectory: at each anchor, how many of the
//! block's drafted tokens the target would accept as a chain and as a budget tree.

use std::path::{Path, PathBuf};
use std::time::Instant;

use glance_input::{ChatMessage, PromptBuilder, PromptOptions};
use glance_models::decode::{
    greedy_generate, teacher_forced, BatchedSequence, GreedyParams, ModelInputs, StepControl,
};
use glance_models::weights::Checkpoint;
use glance_models::LogitRows;
use glance_models::TargetModel;
use glance_spec::tree::{build_budget_tree, Marginals, Reach, TokenId, Tree};
use glance_train::rng::Rng;
use glance_train::save::{self, SaveError};
use glance_train::{cosine_lr, cross_entropy, AdamW};
use tch::{Device, Kind, Tensor};

use crate::draft_vocab::DraftVocab;
use crate::head::{DraftHead, DraftHeadConfig, HeadError};
use crate::init::{write_random_head, HeadSpec};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("head: {0}")]
    Head(#[from] HeadError),
    #[error("target: {0}")]
    Target(String),
    #[error("data: {0}")]
    Data(String),
    #[error(transparent)]
    Save(#[from] SaveError),
}

/// Where the training prompts come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    /// The toy world's training split (held-out split for evaluation), all tasks in turn.
    ToyWorld { seed: u64 },
    /// JSON lines `{"prompt": "...", "image": "path"?}` (image paths relative to the file).
    JsonLines(PathBuf),
    /// ShareGPT V3's first human turns, held out by conversation id (see [`crate::sharegpt`]).
    ShareGpt(PathBuf),
}

impl DataSource {
    /// `toyworld`, `sharegpt:PATH`, or a JSON-lines path (the `--data` spelling).
    pub fn parse(spec: &str, seed: u64) -> Self {
        match spec {
            "toyworld" => Self::ToyWorld { seed },
            _ => match spec.strip_prefix("sharegpt:") {
                Some(path) => Self::ShareGpt(PathBuf::from(path)),
                None => Self::JsonLines(PathBuf::from(spec)),
            },
        }
    }
}

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub target: PathBuf,
    pub out: PathBuf,
    /// Start from this head; else a fresh one from `fresh`.
    pub init: Option<PathBuf>,
    pub fresh: HeadSpec,
    pub data: DataSource,
    pub rows: usize,
    pub held_out_rows: usize,
    pub max_new_tokens: usize,
    pub steps: usize,
    pub anchors: usize,
    pub peak_lr: f64,
    pub warmup_ratio: f64,
    /// Loss decay: weight of offset k is exp(−(k−1)/γ).
    pub gamma: f64,
    /// Soft labels from the target's own distribution (None: the greedy token alone).
    pub distill: Option<Distill>,
    pub eval_every: usize,
    pub checkpoint_every: usize,
    pub resume: bool,
    pub seed: u64,
    pub device: Device,
    /// Prompts whose responses are regenerated together (padded, batched greedy).
    pub regen_batch: usize,
    pub loss_vocab: LossVocab,
    /// The dtype `model.safetensors` is written in (training itself runs in f32; with another
    /// dtype the f32 weights go into the training state, so a resumed run continues from them).
    pub save_kind: Kind,
}

/// Self-distillation: each label's loss mixes in the cross-entropy against the target's top-k
/// next-token distribution at that position (renormalized over the k), so a row teaches the
/// head which tokens the target nearly chose as well as the one it chose.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Distill {
    /// Tokens of the target's distribution kept per position.
    pub top_k: usize,
    /// The soft term's share of the loss (1 − weight stays on the greedy token).
    pub weight: f64,
}

/// How a block's loss is weighed: the decay over offsets and the soft labels' share.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossWeights {
    pub gamma: f64,
    /// The soft term's share where the row has the target's distribution (0: hard labels only).
    pub distill: f64,
}

impl LossWeights {
    /// The greedy token's cross-entropy alone.
    pub fn hard(gamma: f64) -> Self {
        Self { gamma, distill: 0.0 }
    }
}

impl TrainConfig {
    /// The block loss's weighing under this configuration.
    pub fn loss_weights(&self) -> LossWeights {
        LossWeights { gamma: self.gamma, distill: self.distill.map_or(0.0, |d| d.weight) }
    }
}

/// Which vocabulary rows the training loss scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossVocab {
    /// The full softmax over every token.
    Full,
    /// A sampled softmax over each step's labels, the `frequent` most frequent tokens of the
    /// training responses, the head's own top predictions (refreshed every
    /// [`HARD_NEGATIVES_EVERY`] steps: what it over-predicts gets pushed down) and `negatives`
    /// uniform random ids. Tokens outside the set are not pushed down that step, so held-out
    /// acceptance (scored on the full vocabulary) is the judge of what it costs.
    Sampled { frequent: usize, negatives: usize },
}

/// The scored vocabulary of one step: sorted, distinct ids (the labels are added to them).
pub enum Scored<'a> {
    All,
    Subset(&'a [i64]),
}

/// A training row: the full sequence (prompt + the target's greedy response), where the response
/// starts, the target's tap states for every position and (when distilling) its distribution
/// at every response token.
pub struct Row {
    pub tokens: Vec<i64>,
    pub response_start: usize,
    pub states: Tensor,
    pub teacher: Option<TeacherTop>,
}

/// The target's top-k next-token distribution at each response token of a row, row-major
/// (response length × k): entry i·k + j is the j-th likeliest token where `response[i]` was
/// chosen, its probability renormalized over the k (so `ids[i·k]` is the greedy token itself).
#[derive(Clone, Debug, PartialEq)]
pub struct TeacherTop {
    pub k: usize,
    pub ids: Vec<i64>,
    pub probs: Vec<f32>,
}

impl Row {
    /// The positions a block can be anchored at: from the prompt's last token (its block drafts
    /// the response's start) to the second-to-last token (an anchor needs a label after it).
    pub fn anchor_positions(&self) -> std::ops::Range<usize> {
        self.response_start.saturating_sub(1)..self.tokens.len().saturating_sub(1)
    }
}

/// What one evaluation measured on held-out rows.
#[derive(Clone, Debug, Default)]
pub struct Acceptance {
    /// Mean tokens per round a chain draft would commit on the greedy trajectory (accepted + 1).
    pub chain_tau: f64,
    /// The same for a budget-31, top-8 tree.
    pub tree_tau: f64,
    pub anchors: usize,
}

pub fn train(config: &TrainConfig, mut log: impl FnMut(&str)) -> Result<Acceptance, TrainError> {
    let target = TargetModel::load(&config.target, Kind::Float, config.device)
        .map_err(|e| TrainError::Target(e.to_string()))?;
    let prompts = PromptBuilder::from_model_dir(&config.target, PromptOptions::default())
        .map_err(|e| TrainError::Target(e.to_string()))?;
    let head_dir = prepare_head_dir(config, &mut log)?;
    let head_config = DraftHeadConfig::load(&head_dir, Some(target.text_config().num_layers))?;
    let taps = head_config.target_layer_ids.clone();
    log(&format!(
        "regenerating {} training and {} held-out rows with the target",
        config.rows, config.held_out_rows
    ));
    let builder = RowBuilder {
        target: &target,
        prompts: &prompts,
        max_new_tokens: config.max_new_tokens,
        taps: &taps,
        cache: config.out.join("regenerated.jsonl"),
        batch: config.regen_batch,
        teacher_top: config.distill.map_or(0, |d| d.top_k),
    };
    let train_rows = builder.build(&config.data, false, config.rows)?;
    let held_out = builder.build(&config.data, true, config.held_out_rows)?;
    // Beside the head, for serving with `--draft-vocab`: from the training rows only, so the
    // held-out evaluation and benchmarks see nothing of their own prompts.
    response_vocab(&train_rows).write(&config.out).map_err(|e| TrainError::Data(e.to_string()))?;
    let mut ckpt = Checkpoint::open(&head_dir, Kind::Float, config.device)
        .map_err(|e| TrainError::Head(e.into()))?
        .into_trainable();
    let embed = target.text.embed_tokens().shallow_clone();
    let lm_head = target.text.lm_head().shallow_clone();
    let head = DraftHead::from_checkpoint(head_config.clone(), &mut ckpt, embed, lm_head)?;
    let named: Vec<(String, Tensor)> =
        ckpt.parameters().iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    let mut optimizer = AdamW::new(named.iter().map(|(_, t)| t.shallow_clone()).collect(), 0.0);
    let first_step = if config.resume { restore_state(&config.out, &named, &mut optimizer)? } else { 0 };
    let warmup = ((config.steps as f64) * config.warmup_ratio).ceil() as usize;
    let mut progress = Progress::new(config.steps, first_step);
    let mut rng = Rng::new(config.seed ^ 0x5EED);
    // Skip the randomness the resumed steps consumed, so a resumed run continues identically.
    for _ in 0..first_step {
        rng.next_u64();
    }
    let mut sampled = match config.loss_vocab {
        LossVocab::Full => None,
        LossVocab::Sampled { frequent, negatives } => {
            let (ids, coverage) = most_frequent_response_tokens(&train_rows, frequent);
            log(&format!(
                "sampled softmax: {} frequent tokens cover {:.1}% of the training responses",
                ids.len(),
                100.0 * coverage
            ));
            Some(SampledVocab { frequent: ids, hard: Vec::new(), negatives, vocab: head.vocab_size() })
        }
    };
    for step in first_step..config.steps {
        let row = rng.pick(&train_rows);
        if let Some(vocab) = sampled.as_mut().filter(|_| step % HARD_NEGATIVES_EVERY == 0) {
            tch::no_grad(|| vocab.refresh_hard_negatives(&head, row, &mut rng));
        }
        let ids = sampled.as_ref().map(|v| v.step_ids(&mut rng));
        let scored = match &ids {
            Some(ids) => Scored::Subset(ids),
            None => Scored::All,
        };
        let Some(loss) = row_loss(&head, row, config, &scored, &mut rng) else { continue };
        loss.backward();
        optimizer.clip_grad_norm(1.0);
        let lr = cosine_lr(step, config.steps, warmup, config.peak_lr, 0.0);
        optimizer.step(lr);
        progress.stepped(step, glance_models::read_f64(&loss));
        if due(config.eval_every, step, config.steps) {
            progress.evaluated(step, tch::no_grad(|| acceptance(&head, &held_out)), &mut log);
        }
        if due(config.checkpoint_every, step, config.steps) {
            save(&config.out, &head_dir, &named, &[], &optimizer, step + 1, config.save_kind)?;
        }
    }
    if config.eval_every == 0 {
        progress.last = tch::no_grad(|| acceptance(&head, &held_out));
    }
    Ok(progress.finish(&mut log))
}

/// Whether something done every `every` steps (0: never) is due after step `step` (from 0) of
/// `steps`: at each multiple, and at the end.
pub(crate) fn due(every: usize, step: usize, steps: usize) -> bool {
    every > 0 && ((step + 1).is_multiple_of(every) || step + 1 == steps)
}

/// A training run's progress: the smoothed loss and the last held-out acceptance on the bar,
/// each evaluation logged.
pub(crate) struct Progress {
    bar: indicatif::ProgressBar,
    smoothed: f64,
    started: Instant,
    pub last: Acceptance,
}

impl Progress {
    pub(crate) fn new(steps: usize, first_step: usize) -> Self {
        let bar = progress_bar(steps, first_step);
        Self { bar, smoothed: f64::NAN, started: Instant::now(), last: Acceptance::default() }
    }

    /// Step `step` (from 0) ended with this loss.
    pub(crate) fn stepped(&mut self, step: usize, loss: f64) {
        self.smoothed = if self.smoothed.is_nan() { loss } else { 0.98 * self.smoothed + 0.02 * loss };
        self.bar.set_position(step as u64 + 1);
        self.bar.set_message(format!(
            "loss {:.3} | held-out chain tau {:.2}, tree tau {:.2}",
            self.smoothed, self.last.chain_tau, self.last.tree_tau
        ));
    }

    /// The held-out evaluation after step `step`.
    pub(crate) fn evaluated(&mut self, step: usize, acceptance: Acceptance, log: &mut impl FnMut(&str)) {
        self.last = acceptance;
        let line = format!(
            "step {}: loss {:.3}, held-out chain tau {:.2}, tree tau {:.2} ({} anchors), {:.0}s",
            step + 1,
            self.smoothed,
            self.last.chain_tau,
            self.last.tree_tau,
            self.last.anchors,
            self.started.elapsed().as_secs_f64()
        );
        self.bar.suspend(|| log(&line));
    }

    /// The run ended: its last acceptance, logged.
    pub(crate) fn finish(self, log: &mut impl FnMut(&str)) -> Acceptance {
        self.bar.finish();
        log(&format!(
            "final held-out chain tau {:.2}, tree tau {:.2}",
            self.last.chain_tau, self.last.tree_tau
        ));
        self.last
    }
}

pub(crate) fn progress_bar(total: usize, position: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_position(position as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// The head directory training starts from: `--init`, the output (when resuming), or a fresh
/// random head written to `out/init`.
fn prepare_head_dir(config: &TrainConfig, log: &mut impl FnMut(&str)) -> Result<PathBuf, TrainError> {
    if config.resume && config.out.join("model.safetensors").is_file() {
        return Ok(config.out.clone());
    }
    if let Some(init) = &config.init {
        return Ok(init.clone());
    }
    let fresh = config.out.join("init");
    log(&format!("initializing a fresh {}-layer head in {}", config.fresh.layers, fresh.display()));
    write_random_head(&config.target, &fresh, &config.fresh).map_err(|e| TrainError::Data(e.to_string()))?;
    Ok(fresh)
}

/// The training prompts of a data source.
fn prompts_of(
    source: &DataSource,
    held_out: bool,
    count: usize,
) -> Result<Vec<Vec<ChatMessage>>, TrainError> {
    match source {
        DataSource::ToyWorld { seed } => {
            use glance_toyworld::{sample, Split, Task};
            let split = if held_out { Split::HeldOut } else { Split::Train };
            Ok((0..count as u64)
                .map(|i| {
                    sample(split, Task::ALL[(i % Task::ALL.len() as u64) as usize], *seed, i / 5).messages()
                })
                .collect())
        }
        DataSource::JsonLines(path) => json_lines(path, held_out, count),
        DataSource::ShareGpt(path) => {
            let corpus = crate::sharegpt::read(path).map_err(|e| TrainError::Data(e.to_string()))?;
            let split = if held_out { corpus.held_out } else { corpus.train };
            Ok(split.into_iter().take(count).map(|p| user_message(p.text)).collect())
        }
    }
}

fn user_message(text: String) -> Vec<ChatMessage> {
    vec![ChatMessage { role: "user".into(), content: vec![glance_input::ContentPart::Text(text)] }]
}

/// JSON lines: the first `count` non-held-out lines, or (held out) every tenth line.
fn json_lines(path: &Path, held_out: bool, count: usize) -> Result<Vec<Vec<ChatMessage>>, TrainError> {
    use glance_input::ContentPart;
    let text =
        std::fs::read_to_string(path).map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?;
    let base = path.parent().unwrap_or(Path::new("."));
    let mut rows = Vec::new();
    for (i, line) in
        text.lines().enumerate().filter(|(i, l)| !l.trim().is_empty() && (i % 10 == 9) == held_out)
    {
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| TrainError::Data(format!("{}:{}: {e}", path.display(), i + 1)))?;
        let mut content = Vec::new();
        if let Some(image) = value.get("image").and_then(|v| v.as_str()) {
            let data =
                std::fs::read(base.join(image)).map_err(|e| TrainError::Data(format!("{image}: {e}")))?;
            content.push(ContentPart::Image { data, mime_type: String::new() });
        }
        let prompt = value.get("prompt").and_then(|v| v.as_str()).unwrap_or_default();
        content.push(ContentPart::Text(prompt.to_string()));
        rows.push(vec![ChatMessage { role: "user".into(), content }]);
        if rows.len() == count {
            break;
        }
    }
    Ok(rows)
}

/// Regenerates each prompt's response with greedy decoding (batched decoding keeps the tap states
/// of every position it passes through), else runs one teacher-forced pass over prompt + response
/// for them. The regenerated token rows (the expensive part) are kept in `cache` as JSON lines and
/// the states beside them, so a resumed or repeated run recomputes neither.
pub(crate) struct RowBuilder<'a> {
    pub(crate) target: &'a TargetModel,
    pub(crate) prompts: &'a PromptBuilder,
    pub(crate) max_new_tokens: usize,
    pub(crate) taps: &'a [usize],
    pub(crate) cache: PathBuf,
    /// Prompts regenerated together (one target pass per step for all).
    pub(crate) batch: usize,
    /// Keep the target's top-k distribution at each training row's response tokens (0: none;
    /// held-out rows are scored by acceptance alone and never get one).
    pub(crate) teacher_top: usize,
}

impl RowBuilder<'_> {
    /// Prompts turned into model inputs at a time. A prompt's inputs hold its images' pixels, so
    /// tens of thousands of them at once do not fit in memory (30,000 toy-world rows took over
    /// 24 GB); only the rows' tokens and tap states are kept for training.
    const CHUNK: usize = 512;

    pub(crate) fn build(
        &self,
        source: &DataSource,
        held_out: bool,
        count: usize,
    ) -> Result<Vec<Row>, TrainError> {
        let messages = prompts_of(source, held_out, count)?;
        let path = self.cache.with_file_name(if held_out {
            "tap_states.held_out.safetensors"
        } else {
            "tap_states.train.safetensors"
        });
        let mut cached = read_state_cache(&path);
        let teacher_top = if held_out { 0 } else { self.teacher_top };
        let teacher_path = self.cache.with_file_name(format!("teacher_top{teacher_top}.train.safetensors"));
        let mut teachers = if teacher_top > 0 { read_state_cache(&teacher_path) } else { Default::default() };
        let mut taught = Vec::new();
        let mut teachers_computed = 0;
        let mut known = read_row_cache(&self.cache)?;
        let bar = progress_bar(messages.len(), 0);
        let mut rows = Vec::with_capacity(messages.len());
        let mut names = Vec::with_capacity(messages.len());
        let mut computed = 0;
        for chunk in messages.chunks(Self::CHUNK) {
            let inputs = chunk
                .iter()
                .map(|m| self.prompts.build(m).map(|p| p.model_inputs()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TrainError::Data(e.to_string()))?;
            let responses = self.responses(&inputs, &mut known)?;
            for (inputs, BatchedSequence { tokens: response, states: regenerated_states }) in
                inputs.iter().zip(responses)
            {
                let _no_grad = tch::no_grad_guard();
                let name = self.state_name(inputs, &response);
                let states = match cached.remove(&name) {
                    Some(states) => states.to_device(self.target.device()),
                    None => {
                        computed += 1;
                        match regenerated_states {
                            Some(states) => states,
                            None => teacher_forced_states(self.target, inputs, &response, self.taps)?,
                        }
                    }
                };
                let teacher = match teacher_top {
                    0 => None,
                    k => {
                        let cached = cached_teacher(&mut teachers, &name, response.len(), k);
                        let (ids, probs) = match cached {
                            Some(pair) => pair,
                            None => {
                                teachers_computed += 1;
                                teacher_top_k(self.target, inputs, &response, k)?
                            }
                        };
                        taught.push((format!("{name}.ids"), ids.shallow_clone()));
                        taught.push((format!("{name}.probs"), probs.shallow_clone()));
                        Some(TeacherTop::from_tensors(&ids, &probs))
                    }
                };
                let tokens = inputs.input_ids.iter().chain(&response).copied().collect();
                rows.push(Row { tokens, response_start: inputs.input_ids.len(), states, teacher });
                names.push(name);
                bar.inc(1);
            }
        }
        bar.finish_and_clear();
        if computed > 0 {
            let mut seen = std::collections::HashSet::new();
            let named: Vec<(String, Tensor)> = names
                .into_iter()
                .zip(&rows)
                .filter(|(n, _)| seen.insert(n.clone())) // a repeated prompt is one row of the cache
                .map(|(n, r)| (n, r.states.to_device(Device::Cpu)))
                .collect();
            save::write_safetensors(&path, &named)?;
        }
        if teachers_computed > 0 {
            let mut seen = std::collections::HashSet::new();
            taught.retain(|(name, _)| seen.insert(name.clone())); // a repeated prompt is one entry
            save::write_safetensors(&teacher_path, &taught)?;
        }
        Ok(rows)
    }

    /// A row's name in the tap-state cache: its prompt, response and tap layers, hashed.
    fn state_name(&self, inputs: &ModelInputs, response: &[i64]) -> String {
        let response: Vec<String> = response.iter().map(i64::to_string).collect();
        let key =
            format!("{}|{}|{:?}", CachedRow::key(inputs, self.max_new_tokens), response.join(","), self.taps);
        format!("{:016x}", glance_train::rng::hash_bytes(key.as_bytes()))
    }

    /// Each prompt's greedy response: from `known` (the cache's rows), else regenerated (`batch`
    /// prompts at a time, with the tap states the batched decoding passed through) and appended
    /// to the cache.
    fn responses(
        &self,
        inputs: &[ModelInputs],
        known: &mut std::collections::HashMap<String, Vec<i64>>,
    ) -> Result<Vec<BatchedSequence>, TrainError> {
        let keys: Vec<String> = inputs.iter().map(|i| CachedRow::key(i, self.max_new_tokens)).collect();
        let missing: Vec<usize> = (0..inputs.len()).filter(|&i| !known.contains_key(&keys[i])).collect();
        let mut fresh_states: Vec<Option<Tensor>> =
            std::iter::repeat_with(|| None).take(inputs.len()).collect();
        for chunk in missing.chunks(self.batch.max(1)) {
            let regenerated = if chunk.len() > 1 {
                let batch: Vec<&ModelInputs> = chunk.iter().map(|&i| &inputs[i]).collect();
                regenerate_batch(self.target, self.prompts, &batch, self.max_new_tokens, self.taps)?
            } else {
                let single = |&i: &usize| {
                    regenerate(self.target, self.prompts, &inputs[i], self.max_new_tokens)
                        .map(|tokens| BatchedSequence { tokens, states: None })
                };
                chunk.iter().map(single).collect::<Result<Vec<_>, _>>()?
            };
            for (&i, sequence) in chunk.iter().zip(regenerated) {
                append_row_cache(&self.cache, &keys[i], &sequence.tokens)?;
                known.insert(keys[i].clone(), sequence.tokens);
                fresh_states[i] = sequence.states;
            }
        }
        let sequence = |(key, states)| BatchedSequence { tokens: known[key].clone(), states };
        Ok(keys.iter().zip(fresh_states).map(sequence).collect())
    }
}

/// One line of the regenerated-rows cache: the prompt's ids (with the token limit, and a hash of
/// its pixels when it has images: two images of one size give the same ids) as the key.
#[derive(serde::Serialize, serde::Deserialize)]
struct CachedRow {
    key: String,
    response: Vec<i64>,
}

impl CachedRow {
    fn key(inputs: &ModelInputs, max_new_tokens: usize) -> String {
        let ids: Vec<String> = inputs.input_ids.iter().map(i64::to_string).collect();
        let key = format!("{max_new_tokens}:{}", ids.join(","));
        match &inputs.pixel_values {
            Some(pixels) => format!("{key}:pixels {:016x}", pixel_hash(pixels)),
            None => key,
        }
    }
}

fn pixel_hash(pixels: &Tensor) -> u64 {
    let values = Vec::<f32>::try_from(pixels.to_kind(Kind::Float).flatten(0, -1).to_device(Device::Cpu))
        .unwrap_or_default();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    glance_train::rng::hash_bytes(&bytes)
}

/// The tap states computed by an earlier run, by row name (none when the file is absent or
/// unreadable: they are recomputed).
fn read_state_cache(path: &Path) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(path).map(|named| named.into_iter().collect()).unwrap_or_default()
}

fn read_row_cache(path: &Path) -> Result<std::collections::HashMap<String, Vec<i64>>, TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(Default::default()) };
    // A line cut short by an interrupted run is dropped (its row is regenerated).
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str::<CachedRow>(line).ok())
        .map(|row| (row.key, row.response))
        .collect())
}

fn append_row_cache(path: &Path, key: &str, response: &[i64]) -> Result<(), TrainError> {
    use std::io::Write;
    let row = CachedRow { key: key.to_string(), response: response.to_vec() };
    let line = serde_json::to_string(&row).map_err(|e| TrainError::Data(e.to_string()))?;
    let io = |e: std::io::Error| TrainError::Data(format!("{}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(io)?;
    writeln!(file, "{line}").map_err(io)
}

/// The target's greedy responses to several prompts, decoded as one batch, each with the tap
/// states of prompt + response (see [`teacher_forced_states`]).
fn regenerate_batch(
    target: &TargetModel,
    prompts: &PromptBuilder,
    inputs: &[&ModelInputs],
    max_new_tokens: usize,
    taps: &[usize],
) -> Result<Vec<BatchedSequence>, TrainError> {
    let eos: Vec<i64> = prompts.eos_token_ids().iter().map(|&i| i as i64).collect();
    let params = GreedyParams { max_new_tokens, eos_token_ids: &eos, context_limit: 1 << 16, logprobs: None };
    glance_models::decode::greedy_generate_batch_with_taps(target, inputs, &params, taps)
        .map_err(|e| TrainError::Target(e.to_string()))
}

/// The target's greedy response to a prompt, up to EOS or `max_new_tokens`.
fn regenerate(
    target: &TargetModel,
    prompts: &PromptBuilder,
    inputs: &ModelInputs,
    max_new_tokens: usize,
) -> Result<Vec<i64>, TrainError> {
    let _no_grad = tch::no_grad_guard();
    let eos: Vec<i64> = prompts.eos_token_ids().iter().map(|&i| i as i64).collect();
    let params = GreedyParams { max_new_tokens, eos_token_ids: &eos, context_limit: 1 << 16, logprobs: None };
    let generation = greedy_generate(target, inputs, &params, |_| StepControl::Continue)
        .map_err(|e| TrainError::Target(e.to_string()))?;
    Ok(generation.tokens)
}

/// Tap states of prompt + response, (n, taps·hidden): the prompt's prefill (with its images),
/// then the response tokens in one causal pass over the cache (a response that happens to
/// contain an image placeholder token must not be taken for an image).
fn teacher_forced_states(
    target: &TargetModel,
    inputs: &ModelInputs,
    response: &[i64],
    taps: &[usize],
) -> Result<Tensor, TrainError> {
    let pass = teacher_forced(target, inputs, response, taps, LogitRows::None)
        .map_err(|e| TrainError::Target(e.to_string()))?;
    let prompt_states = pass.prompt_states.expect("taps were requested");
    Ok(match pass.continuation {
        Some(out) => Tensor::cat(&[prompt_states, Tensor::cat(&out.taps, -1)], 0),
        None => prompt_states,
    })
}

/// A row's teacher distribution from an earlier run's cache, (ids, probs), removed from it.
/// (An entry of another shape than (`rows`, `k`) is not this row's: it is recomputed.)
fn cached_teacher(
    cache: &mut std::collections::HashMap<String, Tensor>,
    name: &str,
    rows: usize,
    k: usize,
) -> Option<(Tensor, Tensor)> {
    let ids = cache.remove(&format!("{name}.ids"))?;
    let probs = cache.remove(&format!("{name}.probs"))?;
    let fits = |t: &Tensor| t.size() == [rows as i64, k as i64];
    (fits(&ids) && fits(&probs)).then_some((ids, probs))
}

/// The target's top-`k` next-token distribution at each response token, renormalized over the
/// k: ids (m, k) int64 and probabilities (m, k) f32 on the host, row i the distribution
/// `response[i]` was chosen from (the prompt's last row, then the response's own rows in one
/// teacher-forced pass).
pub fn teacher_top_k(
    target: &TargetModel,
    inputs: &ModelInputs,
    response: &[i64],
    k: usize,
) -> Result<(Tensor, Tensor), TrainError> {
    let _no_grad = tch::no_grad_guard();
    let shorter = &response[..response.len().saturating_sub(1)];
    let pass = teacher_forced(target, inputs, shorter, &[], LogitRows::All)
        .map_err(|e| TrainError::Target(e.to_string()))?;
    let logits = match pass.continuation.and_then(|out| out.logits) {
        Some(rows) => Tensor::cat(&[pass.prompt_logits, rows], 0),
        None => pass.prompt_logits,
    };
    let logits = logits.narrow(0, 0, response.len() as i64).to_kind(Kind::Float);
    let k = (k as i64).min(logits.size()[1]);
    let (values, ids) = logits.topk(k, -1, true, true);
    Ok((ids.to_device(Device::Cpu), values.softmax(-1, Kind::Float).to_device(Device::Cpu)))
}

impl TeacherTop {
    /// From [`teacher_top_k`]'s (ids, probs).
    pub fn from_tensors(ids: &Tensor, probs: &Tensor) -> Self {
        let k = ids.size().last().copied().unwrap_or(0) as usize;
        let ids = Vec::<i64>::try_from(ids.flatten(0, -1)).unwrap_or_default();
        let probs = Vec::<f32>::try_from(probs.to_kind(Kind::Float).flatten(0, -1)).unwrap_or_default();
        Self { k, ids, probs }
    }

    /// The distribution `response[i]` was chosen from: (ids, probs), k each.
    pub fn at(&self, i: usize) -> (&[i64], &[f32]) {
        (&self.ids[i * self.k..(i + 1) * self.k], &self.probs[i * self.k..(i + 1) * self.k])
    }
}

/// The `count` most frequent tokens of the rows' responses (sorted by id) and the share of response
/// tokens they cover.
pub(crate) fn most_frequent_response_tokens(rows: &[Row], count: usize) -> (Vec<i64>, f64) {
    let ranked = response_vocab(rows);
    let mut ids = ranked.top(count).to_vec();
    ids.sort_unstable();
    (ids, ranked.coverage(count))
}

/// The tokens of the rows' responses, ranked by frequency.
pub(crate) fn response_vocab(rows: &[Row]) -> DraftVocab {
    DraftVocab::from_responses(rows.iter().map(|row| &row.tokens[row.response_start..]))
}

/// Steps between refreshes of the sampled softmax's hard negatives (each refresh is one
/// full-vocabulary forward over a row's blocks, without gradients).
pub const HARD_NEGATIVES_EVERY: usize = 4;

/// The head's top predictions per block position kept as hard negatives.
const HARD_NEGATIVES_TOP: i64 = 8;

/// The sampled softmax's vocabulary (see [`LossVocab::Sampled`]).
struct SampledVocab {
    frequent: Vec<i64>,
    hard: Vec<i64>,
    negatives: usize,
    vocab: i64,
}

impl SampledVocab {
    /// One step's scored ids: frequent, hard and fresh uniform negatives, sorted and distinct.
    fn step_ids(&self, rng: &mut Rng) -> Vec<i64> {
        let mut ids: Vec<i64> = self.frequent.iter().chain(&self.hard).copied().collect();
        ids.extend((0..self.negatives).map(|_| rng.below(self.vocab as usize) as i64));
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Replaces the hard negatives with the head's current top predictions at random anchors
    /// of `row`.
    fn refresh_hard_negatives(&mut self, head: &DraftHead, row: &Row, rng: &mut Rng) {
        let pool: Vec<usize> = row.anchor_positions().collect();
        if pool.is_empty() {
            return;
        }
        let mut anchors: Vec<i64> = (0..16).map(|_| pool[rng.below(pool.len())] as i64).collect();
        anchors.sort_unstable();
        anchors.dedup();
        let tokens: Vec<i64> = anchors.iter().map(|&a| row.tokens[a as usize]).collect();
        let logits = head.forward_train(&row.states, &anchors, &tokens);
        let (_, top) = logits.topk(HARD_NEGATIVES_TOP, -1, true, false);
        let mut hard = Vec::<i64>::try_from(top.flatten(0, -1).to_device(Device::Cpu)).unwrap_or_default();
        hard.sort_unstable();
        hard.dedup();
        self.hard = hard;
    }
}

/// The weighted block loss of one row at freshly sampled anchors (None: no response to learn).
fn row_loss(
    head: &DraftHead,
    row: &Row,
    config: &TrainConfig,
    scored: &Scored,
    rng: &mut Rng,
) -> Option<Tensor> {
    // An anchor needs at least one label after it.
    let mut pool: Vec<usize> = row.anchor_positions().collect();
    if pool.is_empty() {
        return None;
    }
    let mut anchors: Vec<i64> = Vec::new();
    while anchors.len() < config.anchors && !pool.is_empty() {
        let pick = pool.swap_remove(rng.below(pool.len()));
        anchors.push(pick as i64);
    }
    anchors.sort_unstable();
    Some(block_loss(head, row, &anchors, config.loss_weights(), scored))
}

/// Cross-entropy of the blocks at `anchors` (sorted): offset k predicts the token at a+k, weighted
/// exp(−(k−1)/γ); labels past the row's end weigh nothing. Where the row has the target's
/// distribution and `loss.distill` > 0, each label's term is (1 − d)·CE(greedy token) +
/// d·CE(target's top-k). The softmax runs over `scored` (the labels and the teacher's tokens are
/// added to a subset).
pub fn block_loss(
    head: &DraftHead,
    row: &Row,
    anchors: &[i64],
    loss: LossWeights,
    scored: &Scored,
) -> Tensor {
    let tokens: Vec<i64> = anchors.iter().map(|&a| row.tokens[a as usize]).collect();
    let hidden = head.forward_train_hidden(&row.states, anchors, &tokens);
    let targets = BlockTargets::of(row, anchors, head.block_size() as i64, loss);
    let device = hidden.device();
    let (logits, labels, soft_ids) = match scored {
        Scored::All => (head.logits(&hidden), targets.labels, targets.soft_ids),
        Scored::Subset(base) => {
            let mut ids: Vec<i64> =
                base.iter().chain(&targets.labels).chain(&targets.soft_ids).copied().collect();
            ids.sort_unstable();
            ids.dedup();
            let index = |t: &i64| ids.binary_search(t).expect("every label is scored") as i64;
            let labels = targets.labels.iter().map(index).collect();
            let soft_ids = targets.soft_ids.iter().map(index).collect();
            (head.logits_over(&hidden, &glance_models::upload(&ids, device)), labels, soft_ids)
        }
    };
    let vocab = logits.size()[2];
    let logits = logits.view([-1, vocab]);
    let labels = glance_models::upload(&labels, device);
    let weights = glance_models::upload(&targets.weights, device);
    if targets.soft_k == 0 {
        return cross_entropy(&logits, &labels, Some(&weights));
    }
    let log_probs = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let hard = log_probs.gather(1, &labels.unsqueeze(1), false).squeeze_dim(1).neg();
    let soft_ids = glance_models::upload(&soft_ids, device).view([-1, targets.soft_k]);
    let soft_probs = glance_models::upload(&targets.soft_probs, device).view([-1, targets.soft_k]);
    let soft =
        (log_probs.gather(1, &soft_ids, false) * soft_probs).sum_dim_intlist(-1, false, Kind::Float).neg();
    let per_label = hard * (1.0 - loss.distill) + soft * loss.distill;
    (per_label * &weights).sum(Kind::Float) / weights.sum(Kind::Float).clamp_min(1e-9)
}

/// What the blocks at some anchors are scored against, one entry per (anchor, offset 1..B):
/// the greedy token and its weight, and (when distilling) the target's top-k there.
struct BlockTargets {
    labels: Vec<i64>,
    weights: Vec<f32>,
    /// k of the soft labels (0: none), then (labels × k) ids and probabilities.
    soft_k: i64,
    soft_ids: Vec<i64>,
    soft_probs: Vec<f32>,
}

impl BlockTargets {
    fn of(row: &Row, anchors: &[i64], block: i64, loss: LossWeights) -> Self {
        let n = row.tokens.len();
        let teacher = row.teacher.as_ref().filter(|_| loss.distill > 0.0);
        let soft_k = teacher.map_or(0, |t| t.k);
        let mut targets = Self {
            labels: Vec::new(),
            weights: Vec::new(),
            soft_k: soft_k as i64,
            soft_ids: Vec::new(),
            soft_probs: Vec::new(),
        };
        for &a in anchors {
            for k in 1..block {
                let position = (a + k) as usize;
                let label = if position < n { row.tokens[position] } else { 0 };
                let weight = if position < n { (-((k - 1) as f64) / loss.gamma).exp() } else { 0.0 };
                targets.labels.push(label);
                targets.weights.push(weight as f32);
                let Some(teacher) = teacher else { continue };
                match position.checked_sub(row.response_start).filter(|_| position < n) {
                    Some(i) => {
                        let (ids, probs) = teacher.at(i);
                        targets.soft_ids.extend_from_slice(ids);
                        targets.soft_probs.extend_from_slice(probs);
                    }
                    // A prompt token or past the end: the label alone (past the end weighs 0).
                    None => {
                        targets.soft_ids.extend(std::iter::repeat_n(label, soft_k));
                        targets.soft_probs.push(1.0);
                        targets.soft_probs.extend(std::iter::repeat_n(0.0, soft_k - 1));
                    }
                }
            }
        }
        targets
    }
}

/// Builds one training row for a prompt: the target's greedy response and the tap states.
pub fn row_for(
    target: &TargetModel,
    prompts: &PromptBuilder,
    messages: &[ChatMessage],
    max_new_tokens: usize,
    taps: &[usize],
) -> Result<Row, TrainError> {
    let _no_grad = tch::no_grad_guard();
    let prompt = prompts.build(messages).map_err(|e| TrainError::Data(e.to_string()))?;
    let inputs = prompt.model_inputs();
    let response = regenerate(target, prompts, &inputs, max_new_tokens)?;
    let states = teacher_forced_states(target, &inputs, &response, taps)?;
    Ok(Row {
        tokens: inputs.input_ids.iter().chain(&response).copied().collect(),
        response_start: inputs.input_ids.len(),
        states,
        teacher: None,
    })
}

/// Accepted length on the greedy trajectory at every response anchor of the held-out rows.
pub fn acceptance(head: &DraftHead, rows: &[Row]) -> Acceptance {
    let block = head.block_size();
    let (mut chain, mut tree, mut anchors) = (0usize, 0usize, 0usize);
    for row in rows {
        let n = row.tokens.len();
        let positions: Vec<i64> = row.anchor_positions().map(|a| a as i64).collect();
        for batch in positions.chunks(16) {
            let tokens: Vec<i64> = batch.iter().map(|&a| row.tokens[a as usize]).collect();
            let logits = head.forward_train(&row.states, batch, &tokens);
            for (i, &a) in batch.iter().enumerate() {
                let truth: Vec<TokenId> = row.tokens[(a as usize + 1)..n.min(a as usize + block)]
                    .iter()
                    .map(|&t| t as TokenId)
                    .collect();
                let Ok(marginals) = Marginals::top_k(&logits.get(i as i64), 8) else { continue };
                chain += marginals.ids.iter().zip(&truth).take_while(|(top, t)| top[0] == **t).count() + 1;
                tree +=
                    accepted_in_tree(&build_budget_tree(&marginals, 31, 8, &Reach::unbounded()), &truth) + 1;
                anchors += 1;
            }
        }
    }
    let mean = |total: usize| if anchors == 0 { 0.0 } else { total as f64 / anchors as f64 };
    Acceptance { chain_tau: mean(chain), tree_tau: mean(tree), anchors }
}

/// How deep the true continuation goes into the tree: the acceptance walk with a target that
/// always chooses the truth (past its end, nothing matches).
pub(crate) fn accepted_in_tree(tree: &Tree, truth: &[TokenId]) -> usize {
    let choice = |depth: usize| truth.get(depth).copied().unwrap_or(TokenId::MAX);
    let choices: Vec<TokenId> =
        std::iter::once(choice(0)).chain(tree.depths.iter().map(|&d| choice(d as usize))).collect();
    tree.accepted_path(&choices).0.len()
}

/// Writes the head (config.json + model.safetensors: the trained `named` weights and the fixed
/// `buffers`, such as an EAGLE-3 head's vocabulary maps) and the optimizer state.
pub(crate) fn save(
    out: &Path,
    head_dir: &Path,
    named: &[(String, Tensor)],
    buffers: &[(String, Tensor)],
    optimizer: &AdamW,
    step: usize,
    save_kind: Kind,
) -> Result<(), TrainError> {
    let _no_grad = tch::no_grad_guard();
    save::create_dir(out)?;
    if head_dir != out {
        save::copy_file(&head_dir.join("config.json"), &out.join("config.json"))?;
    }
    let as_saved = |t: &Tensor| match t.is_floating_point() {
        true => t.detach().to_kind(save_kind).contiguous(),
        false => t.detach().contiguous(),
    };
    let weights: Vec<(String, Tensor)> =
        named.iter().chain(buffers).map(|(n, t)| (n.clone(), as_saved(t))).collect();
    save::write_safetensors(&out.join("model.safetensors"), &weights)?;
    if save_kind != Kind::Float {
        record_dtype(&out.join("config.json"), save_kind)?;
    }
    let (first, second) = optimizer.moments();
    let mut state: Vec<(String, Tensor)> = Vec::new();
    for (((name, weight), m), v) in named.iter().zip(first).zip(second) {
        state.push((format!("adam.m.{name}"), m.shallow_clone()));
        state.push((format!("adam.v.{name}"), v.shallow_clone()));
        if save_kind != Kind::Float {
            state.push((format!("{MASTER}{name}"), weight.detach().contiguous()));
        }
    }
    state.push(("step".into(), glance_models::host_tensor(&[step as i64])));
    Ok(save::write_safetensors(&out.join("train_state.safetensors"), &state)?)
}

/// Restores the optimizer from `out/train_state.safetensors`; returns the step to continue from.
pub(crate) fn restore_state(
    out: &Path,
    named: &[(String, Tensor)],
    optimizer: &mut AdamW,
) -> Result<usize, TrainError> {
    let path = out.join("train_state.safetensors");
    let state: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&path)
        .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?
        .into_iter()
        .collect();
    let get = |key: &str| {
        state.get(key).map(|t| t.shallow_clone()).ok_or_else(|| TrainError::Data(format!("{key} missing")))
    };
    let first = named.iter().map(|(n, _)| get(&format!("adam.m.{n}"))).collect::<Result<Vec<_>, _>>()?;
    let second = named.iter().map(|(n, _)| get(&format!("adam.v.{n}"))).collect::<Result<Vec<_>, _>>()?;
    let step = glance_models::read_i64(&get("step")?);
    optimizer.restore(step, first, second);
    // A head saved in another dtype than f32 left its f32 weights here: continue from those.
    let _no_grad = tch::no_grad_guard();
    for (name, weight) in named {
        if let Some(master) = state.get(&format!("{MASTER}{name}")) {
            let mut weight = weight.shallow_clone();
            weight.copy_(master);
        }
    }
    Ok(step as usize)
}

/// Prefix of the f32 weights in the training state of a head saved in another dtype.
const MASTER: &str = "master.";

/// Sets the `dtype` a head's config.json declares (HF's field: what its weights are stored in).
fn record_dtype(config: &Path, kind: Kind) -> Result<(), TrainError> {
    let text = std::fs::read_to_string(config)
        .map_err(|e| TrainError::Data(format!("{}: {e}", config.display())))?;
    let mut json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| TrainError::Data(format!("{}: {e}", config.display())))?;
    json["dtype"] = serde_json::Value::from(crate::init::dtype_name(kind));
    let text = serde_json::to_string_pretty(&json).map_err(|e| TrainError::Data(e.to_string()))?;
    std::fs::write(config, text + "\n").map_err(|e| TrainError::Data(format!("{}: {e}", config.display())))
}
