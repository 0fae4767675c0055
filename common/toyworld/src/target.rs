//! The toy world's target: a tiny Qwen3-VL-architecture model trained from scratch (Rust/tch,
//! AdamW) on the toy tasks, written as an unmodified Hugging Face model directory that the loader,
//! both services and transformers read.
//!
//! Training packs several samples into one sequence (block-diagonal causal mask, positions
//! restarting per sample), so each step runs one forward/backward over a few hundred tokens.

use std::path::Path;
use std::time::Instant;

use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

use super::{sample, tokenizer, Sample, Split, Task};
use glance_input::{Prompt, PromptBuilder, PromptOptions};
use glance_models::decode::{greedy_generate, teacher_forced, GreedyParams, StepControl};
use glance_models::weights::{Checkpoint, RandomInit};
use glance_models::TargetConfig;
use glance_models::{LogitRows, StepInput, TargetModel};
use glance_train::save::{self, SaveError};
use glance_train::{cosine_lr, token_cross_entropy, AdamW};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("model: {0}")]
    Model(#[from] glance_models::ModelError),
    #[error("input: {0}")]
    Input(String),
    #[error(transparent)]
    Save(#[from] SaveError),
}

/// Sizes of the toy target.
#[derive(Clone, Debug)]
pub struct TargetSpec {
    pub hidden: i64,
    pub layers: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub intermediate: i64,
    pub mrope_section: [i64; 3],
    pub vision_hidden: i64,
    pub vision_depth: i64,
    pub vision_heads: i64,
    pub vision_intermediate: i64,
    pub deepstack: Vec<i64>,
    /// Learned vision position table side (side² entries, resampled to each image).
    pub position_side: i64,
}

impl Default for TargetSpec {
    fn default() -> Self {
        Self {
            hidden: 192,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 48,
            intermediate: 512,
            mrope_section: [8, 8, 8],
            vision_hidden: 128,
            vision_depth: 4,
            vision_heads: 4,
            vision_intermediate: 384,
            deepstack: vec![1, 2],
            position_side: 16,
        }
    }
}

/// The Qwen3-VL `config.json` (transformers 5.x layout) of the toy target.
pub fn config_json(spec: &TargetSpec, vocab_size: i64) -> Value {
    json!({
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "dtype": "bfloat16",
        "image_token_id": tokenizer::IMAGE_PAD_ID,
        "video_token_id": tokenizer::VIDEO_PAD_ID,
        "vision_start_token_id": tokenizer::VISION_START_ID,
        "vision_end_token_id": tokenizer::VISION_END_ID,
        "bos_token_id": tokenizer::ENDOFTEXT_ID,
        "eos_token_id": tokenizer::IM_END_ID,
        "pad_token_id": tokenizer::ENDOFTEXT_ID,
        "tie_word_embeddings": false,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "vocab_size": vocab_size,
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": spec.mrope_section,
                "mrope_interleaved": true
            },
            "bos_token_id": tokenizer::ENDOFTEXT_ID,
            "eos_token_id": tokenizer::IM_END_ID,
            "pad_token_id": tokenizer::ENDOFTEXT_ID
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision",
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_hidden,
            "hidden_act": "gelu_pytorch_tanh",
            "intermediate_size": spec.vision_intermediate,
            "num_heads": spec.vision_heads,
            "in_channels": 3,
            "patch_size": super::PATCH_SIZE,
            "spatial_merge_size": super::MERGE_SIZE,
            "temporal_patch_size": super::TEMPORAL_PATCH_SIZE,
            "out_hidden_size": spec.hidden,
            "num_position_embeddings": spec.position_side * spec.position_side,
            "deepstack_visual_indexes": spec.deepstack,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}
        }
    })
}

/// How to train.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub seed: u64,
    pub steps: usize,
    /// Samples packed into one sequence per step.
    pub pack: usize,
    pub peak_lr: f64,
    pub warmup: usize,
    pub weight_decay: f64,
    /// Held-out samples per task for the periodic evaluation (0: none until the end).
    pub eval_samples: u64,
    pub eval_every: usize,
    /// Stop (and save) once every grounded task reaches this held-out exact match at an
    /// evaluation; `None` trains all `steps`.
    pub stop_at: Option<f64>,
    pub threads: Option<i32>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            steps: 4000,
            pack: 8,
            peak_lr: 2e-3,
            warmup: 200,
            weight_decay: 0.01,
            eval_samples: 32,
            eval_every: 500,
            stop_at: None,
            threads: None,
        }
    }
}

/// The order tasks are drawn in while training: the grounded tasks, whose answers must be read
/// exactly, twice as often as the open ones (one cycle per default step of 8 samples).
const TRAINING_MIX: [Task; 8] =
    [Task::Caption, Task::Sign, Task::Doc, Task::Chart, Task::Story, Task::Sign, Task::Doc, Task::Chart];

/// One sample made into model inputs: prompt (with image) then answer, and where the answer is.
struct Encoded {
    task: Task,
    prompt: Prompt,
    answer: Vec<u32>,
}

fn encode(prompts: &PromptBuilder, sample: &Sample) -> Result<Encoded, TrainError> {
    let prompt = prompts.build(&sample.messages()).map_err(|e| TrainError::Input(e.to_string()))?;
    let answer = tokenizer::answer_ids(prompts.tokenizer(), &sample.answer)
        .map_err(|e| TrainError::Input(e.to_string()))?;
    Ok(Encoded { task: sample.task, prompt, answer })
}

/// Several samples as one sequence: ids, M-RoPE positions restarting per sample, a
/// block-diagonal causal mask, all images, and the (row, label) pairs of the answers.
struct Packed {
    ids: Tensor,
    positions: Tensor,
    mask: Tensor,
    pixels: Tensor,
    grids: Vec<[i64; 3]>,
    label_rows: Tensor,
    labels: Tensor,
    /// The task of each label.
    label_tasks: Vec<Task>,
}

fn pack(samples: &[Encoded]) -> Packed {
    let (mut ids, mut t, mut h, mut w) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut pixels, mut grids, mut rows, mut labels, mut spans) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut label_tasks = Vec::new();
    for s in samples {
        let start = ids.len() as i64;
        let p = &s.prompt;
        ids.extend(p.input_ids.iter().map(|&i| i as i64));
        t.extend(&p.positions.t);
        h.extend(&p.positions.h);
        w.extend(&p.positions.w);
        for (k, &token) in s.answer.iter().enumerate() {
            let stream = (p.input_ids.len() + k) as i64;
            ids.push(token as i64);
            for axis in [&mut t, &mut h, &mut w] {
                axis.push(stream + p.rope_delta);
            }
            // The row before each answer token predicts it.
            rows.push(start + stream - 1);
            labels.push(token as i64);
            label_tasks.push(s.task);
        }
        for image in &p.images {
            pixels.extend_from_slice(&image.pixel_values);
            grids.push(image.grid_thw.map(|g| g as i64));
        }
        spans.push((start, ids.len() as i64));
    }
    let n = ids.len() as i64;
    let mut mask = vec![f32::NEG_INFINITY; (n * n) as usize];
    for (start, end) in spans {
        for row in start..end {
            for col in start..=row {
                mask[(row * n + col) as usize] = 0.0;
            }
        }
    }
    let patch_dim = (3 * super::TEMPORAL_PATCH_SIZE * super::PATCH_SIZE * super::PATCH_SIZE) as i64;
    let positions: Vec<i64> = t.into_iter().chain(h).chain(w).collect();
    Packed {
        ids: Tensor::from_slice(&ids),
        positions: Tensor::from_slice(&positions).view([3, n]),
        mask: Tensor::from_slice(&mask).view([n, n]),
        pixels: Tensor::from_slice(&pixels).view([-1, patch_dim]),
        grids,
        label_rows: Tensor::from_slice(&rows),
        labels: Tensor::from_slice(&labels),
        label_tasks,
    }
}

/// The cross-entropy of every answer token of one packed sequence (with gradients).
fn token_losses(model: &TargetModel, batch: &Packed) -> Result<Tensor, TrainError> {
    let vision = model.encode_images(&batch.pixels, &batch.grids)?;
    let mut cache = model.new_training_cache(batch.ids.size()[0] as usize);
    let step = StepInput {
        token_ids: &batch.ids,
        positions: &batch.positions,
        mask: Some(&batch.mask),
        vision: Some(&vision),
        taps: &[],
        logits: LogitRows::All,
    };
    let logits = model.forward(&step, &mut cache)?.logits.expect("logits were requested");
    Ok(token_cross_entropy(&logits.index_select(0, &batch.label_rows), &batch.labels))
}

/// Running mean answer-token loss per task (exponentially smoothed), for the progress lines: the
/// grounded tasks' loss says how well the target reads long before exact match moves.
#[derive(Default)]
struct TaskLosses(Vec<(Task, f64)>);

impl TaskLosses {
    fn update(&mut self, per_token: &Tensor, tasks: &[Task]) {
        let values: Vec<f32> = Vec::try_from(per_token.detach()).unwrap_or_default();
        for task in Task::ALL {
            let picked: Vec<f32> =
                values.iter().zip(tasks).filter(|(_, t)| **t == task).map(|(v, _)| *v).collect();
            if picked.is_empty() {
                continue;
            }
            let mean = picked.iter().map(|&v| v as f64).sum::<f64>() / picked.len() as f64;
            match self.0.iter_mut().find(|(t, _)| *t == task) {
                Some((_, s)) => *s = 0.95 * *s + 0.05 * mean,
                None => self.0.push((task, mean)),
            }
        }
    }

    fn line(&self) -> String {
        self.0.iter().map(|(t, l)| format!("{} {l:.3}", t.name())).collect::<Vec<_>>().join(" ")
    }
}

/// Mean answer-token loss of `samples` packed into one sequence (with gradients): what one
/// training step minimizes.
pub fn batch_loss(
    model: &TargetModel,
    prompts: &PromptBuilder,
    samples: &[Sample],
) -> Result<Tensor, TrainError> {
    let encoded = samples.iter().map(|s| encode(prompts, s)).collect::<Result<Vec<_>, _>>()?;
    Ok(token_losses(model, &pack(&encoded))?.mean(Kind::Float))
}

/// A trainable model, its input pipeline and its parameters by checkpoint name.
pub type Trainable = (TargetModel, PromptBuilder, Vec<(String, Tensor)>);

/// A fresh trainable toy target for `out_dir` (tokenizer and config written there) and its named
/// parameters.
pub fn fresh_target(out_dir: &Path, spec: &TargetSpec, seed: u64) -> Result<Trainable, TrainError> {
    save::create_dir(out_dir)?;
    let toy = tokenizer::train_tokenizer(out_dir, seed).map_err(|e| TrainError::Tokenizer(e.to_string()))?;
    let vocab = (toy.vocab_size as i64 + 63) / 64 * 64;
    let config = config_json(spec, vocab);
    save::write_json(&out_dir.join("config.json"), &config)?;
    let prompts = PromptBuilder::from_model_dir(out_dir, PromptOptions::default())
        .map_err(|e| TrainError::Input(e.to_string()))?;
    tch::manual_seed(seed as i64);
    let mut ckpt = Checkpoint::random(RandomInit { std: 0.02 }, Kind::Float, Device::Cpu).into_trainable();
    let model = TargetModel::from_checkpoint(&TargetConfig::from_json(&config)?, &mut ckpt)?;
    let named = ckpt.parameters().iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    Ok((model, prompts, named))
}

/// One figure per task, in [`Task::ALL`] order.
pub type TaskFigures = Vec<(Task, f64)>;

/// Held-out exact match per task, greedy decoding.
pub fn evaluate(model: &TargetModel, prompts: &PromptBuilder, seed: u64, per_task: u64) -> Vec<(Task, f64)> {
    per_task_means(seed, per_task, |s| {
        let hit = greedy_answer(model, prompts, s).is_some_and(|(_, text)| text == s.answer);
        Some(vec![f64::from(u8::from(hit))])
    })
}

/// Per task: held-out exact match and the target's mean next-token entropy (nats) along its own
/// greedy answers (how much image and prompt leave open: low where the answer is read). Each
/// sample is decoded once.
pub fn evaluate_with_entropy(
    model: &TargetModel,
    prompts: &PromptBuilder,
    seed: u64,
    per_task: u64,
) -> (TaskFigures, TaskFigures) {
    // Indexed like Task::ALL (its declaration order).
    let mut hits = [0u64; Task::ALL.len()];
    let entropy = per_task_means(seed, per_task, |s| {
        let (ids, text) = greedy_answer(model, prompts, s)?;
        hits[s.task as usize] += u64::from(text == s.answer);
        answer_entropies(model, prompts, s, &ids)
    });
    let exact = Task::ALL.iter().map(|&t| (t, hits[t as usize] as f64 / per_task.max(1) as f64)).collect();
    (exact, entropy)
}

/// Per task, the mean of all values `per_sample` gives for the first `per_task` held-out samples.
fn per_task_means(
    seed: u64,
    per_task: u64,
    mut per_sample: impl FnMut(&Sample) -> Option<Vec<f64>>,
) -> Vec<(Task, f64)> {
    Task::ALL
        .iter()
        .map(|&task| {
            let (mut sum, mut count) = (0.0, 0usize);
            for index in 0..per_task {
                if let Some(values) = per_sample(&sample(Split::HeldOut, task, seed, index)) {
                    sum += values.iter().sum::<f64>();
                    count += values.len();
                }
            }
            (task, sum / count.max(1) as f64)
        })
        .collect()
}

/// The model's greedy answer to a sample: token ids (with the end token) and text.
fn greedy_answer(model: &TargetModel, prompts: &PromptBuilder, s: &Sample) -> Option<(Vec<i64>, String)> {
    let eos: Vec<i64> = prompts.eos_token_ids().iter().map(|&i| i as i64).collect();
    let prompt = prompts.build(&s.messages()).ok()?;
    let inputs = prompt.model_inputs();
    let params =
        GreedyParams { max_new_tokens: 80, eos_token_ids: &eos, context_limit: 4096, logprobs: None };
    let ids = greedy_generate(model, &inputs, &params, |_| StepControl::Continue).ok()?.tokens;
    let text = prompts.decode(&ids.iter().map(|&t| t as u32).collect::<Vec<_>>(), true).ok()?;
    Some((ids, text))
}

/// The entropy of each next-token distribution that chose `answer` (the greedy answer to `s`).
fn answer_entropies(
    model: &TargetModel,
    prompts: &PromptBuilder,
    s: &Sample,
    answer: &[i64],
) -> Option<Vec<f64>> {
    let _no_grad = tch::no_grad_guard();
    let inputs = prompts.build(&s.messages()).ok()?.model_inputs();
    let fed = &answer[..answer.len().saturating_sub(1)];
    let pass = teacher_forced(model, &inputs, fed, &[], LogitRows::All).ok()?;
    let mut rows = vec![pass.prompt_logits];
    rows.extend(pass.continuation.and_then(|out| out.logits));
    let log_p = Tensor::cat(&rows, 0).to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let entropy = (log_p.exp() * &log_p).sum_dim_intlist(-1, false, Kind::Float).neg();
    Vec::<f64>::try_from(entropy.to_kind(Kind::Double)).ok()
}

/// Trains the toy target into `out_dir` (tokenizer, config, weights in bf16). Progress lines go to
/// `log`.
pub fn train_target(
    out_dir: &Path,
    spec: &TargetSpec,
    options: &TrainOptions,
    mut log: impl FnMut(&str),
) -> Result<Vec<(Task, f64)>, TrainError> {
    if let Some(threads) = options.threads {
        tch::set_num_threads(threads);
    }
    let (model, prompts, named) = fresh_target(out_dir, spec, options.seed)?;
    let count: i64 = named.iter().map(|(_, t)| t.numel() as i64).sum();
    log(&format!("toy target: {count} parameters, vocabulary {}", model.text_config().vocab_size));
    let mut optimizer =
        AdamW::new(named.iter().map(|(_, t)| t.shallow_clone()).collect(), options.weight_decay);
    let started = Instant::now();
    let mut smoothed = None;
    let mut task_losses = TaskLosses::default();
    let mut scores = None;
    for step in 0..options.steps {
        let batch: Vec<Encoded> = (0..options.pack as u64)
            .map(|k| {
                let index = (step * options.pack) as u64 + k + 1;
                let task = TRAINING_MIX[((index - 1) % TRAINING_MIX.len() as u64) as usize];
                encode(&prompts, &sample(Split::Train, task, options.seed, index))
            })
            .collect::<Result<_, _>>()?;
        let packed = pack(&batch);
        let per_token = token_losses(&model, &packed)?;
        let loss = per_token.mean(Kind::Float);
        loss.backward();
        optimizer.clip_grad_norm(1.0);
        let lr = cosine_lr(step, options.steps, options.warmup, options.peak_lr, 0.05);
        optimizer.step(lr);
        let value = loss.double_value(&[]);
        smoothed = Some(smoothed.map_or(value, |s: f64| 0.95 * s + 0.05 * value));
        task_losses.update(&per_token, &packed.label_tasks);
        if step % 50 == 0 || step + 1 == options.steps {
            log(&format!(
                "step {step:>5}/{} loss {value:.3} (smoothed {:.3}; {}) lr {lr:.2e} {:.0}s",
                options.steps,
                smoothed.unwrap_or(value),
                task_losses.line(),
                started.elapsed().as_secs_f64()
            ));
        }
        if options.eval_samples > 0 && options.eval_every > 0 && (step + 1) % options.eval_every == 0 {
            // Saved at every evaluation, so a long run always leaves its latest model behind.
            save_weights(out_dir, &named)?;
            let at_step = evaluate(&model, &prompts, options.seed, options.eval_samples);
            log(&format!("eval at step {}: {}", step + 1, format_scores(&at_step)));
            let reads = |bar: f64| at_step.iter().filter(|(t, _)| t.is_grounded()).all(|(_, s)| *s >= bar);
            if options.stop_at.is_some_and(reads) {
                log(&format!("every grounded task reached the bar at step {}: stopping", step + 1));
                scores = Some(at_step);
                break;
            }
        }
    }
    let scores = match scores {
        // Saved at the evaluation that stopped the run.
        Some(s) => s,
        None => {
            save_weights(out_dir, &named)?;
            evaluate(&model, &prompts, options.seed, options.eval_samples.max(1))
        }
    };
    log(&format!("final held-out exact match: {}", format_scores(&scores)));
    Ok(scores)
}

pub fn format_scores(scores: &[(Task, f64)]) -> String {
    scores.iter().map(|(t, s)| format!("{} {:.1}%", t.name(), 100.0 * s)).collect::<Vec<_>>().join(", ")
}

/// `model.safetensors` in bf16 under the checkpoint names.
fn save_weights(out_dir: &Path, named: &[(String, Tensor)]) -> Result<(), TrainError> {
    let _no_grad = tch::no_grad_guard();
    let converted: Vec<(String, Tensor)> =
        named.iter().map(|(n, t)| (n.clone(), t.detach().to_kind(Kind::BFloat16).contiguous())).collect();
    Ok(save::write_safetensors(&out_dir.join("model.safetensors"), &converted)?)
}
