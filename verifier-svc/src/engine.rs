//! The generation engine: one OS thread that owns the target model and runs admitted requests one
//! at a time (batch 1, as the method is measured), streaming text back as it is produced.
//!
//! Admission is a bounded queue: a full queue is answered at once with RESOURCE_EXHAUSTED. A
//! request whose receiver is dropped (client gone, deadline passed) is stopped at the next token.

use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread;

use glance_common::decode::{
    greedy_generate, FinishKind, Generation, GreedyParams, ModelInputs, StepControl,
};
use glance_common::input::{Prompt, PromptBuilder};
use glance_common::models::TargetModel;
use tokio::sync::mpsc;

use crate::error::VerifierError;
use crate::stop::TextAssembler;

/// A request that passed validation and preprocessing.
pub struct Job {
    pub prompt: Prompt,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub events: mpsc::Sender<Event>,
}

/// What the engine reports about one request, in order: chunks, then exactly one `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    Chunk { text: String, token_ids: Vec<u32> },
    Done(Summary),
    Failed(VerifierError),
}

#[derive(Clone, Debug)]
pub struct Summary {
    pub finish: FinishKind,
    /// True when the stop came from a stop string (rather than a cancelled client).
    pub stop_string: bool,
    pub prompt_tokens: usize,
    pub image_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_ms: f64,
    pub decode_ms: f64,
}

/// Limits the engine enforces on every request.
#[derive(Clone, Debug)]
pub struct EngineLimits {
    pub context_window: usize,
    pub queue_size: usize,
}

/// The side of the engine that request handlers hold.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: std_mpsc::SyncSender<Job>,
    pub prompts: Arc<PromptBuilder>,
}

impl EngineHandle {
    /// Queues a job, or refuses it at once when the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), VerifierError> {
        self.jobs.try_send(job).map_err(|e| match e {
            std_mpsc::TrySendError::Full(_) => {
                VerifierError::Busy("generation queue is full, retry later".into())
            }
            std_mpsc::TrySendError::Disconnected(_) => {
                VerifierError::Unavailable("engine stopped".into())
            }
        })
    }
}

/// Starts the engine thread. The model moves into it and never leaves.
pub fn start(
    model: TargetModel,
    prompts: Arc<PromptBuilder>,
    limits: EngineLimits,
) -> EngineHandle {
    let (jobs, queue) = std_mpsc::sync_channel::<Job>(limits.queue_size);
    let eos = prompts
        .eos_token_ids()
        .iter()
        .map(|&i| i as i64)
        .collect::<Vec<_>>();
    let detok = prompts.clone();
    thread::Builder::new()
        .name("glance-engine".into())
        .spawn(move || {
            for job in queue {
                run_job(&model, &detok, &eos, &limits, job);
            }
        })
        .expect("spawning the engine thread");
    EngineHandle { jobs, prompts }
}

fn run_job(
    model: &TargetModel,
    prompts: &Arc<PromptBuilder>,
    eos: &[i64],
    limits: &EngineLimits,
    job: Job,
) {
    if job.events.is_closed() {
        return; // the client left while queued
    }
    let events = job.events.clone();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        generate(model, prompts, eos, limits, job)
    }));
    let last = match outcome {
        Ok(Ok(summary)) => Event::Done(summary),
        Ok(Err(e)) => Event::Failed(e),
        Err(panic) => {
            let what = panic_message(&panic);
            tracing::error!(%what, "generation panicked");
            Event::Failed(VerifierError::Unavailable(format!(
                "generation failed: {what}"
            )))
        }
    };
    let _ = events.blocking_send(last);
}

fn generate(
    model: &TargetModel,
    prompts: &Arc<PromptBuilder>,
    eos: &[i64],
    limits: &EngineLimits,
    job: Job,
) -> Result<Summary, VerifierError> {
    let inputs = model_inputs(&job.prompt);
    let detok = |ids: &[u32]| prompts.decode(ids, true).unwrap_or_default();
    let mut text = TextAssembler::new(detok, job.stop.clone());
    let mut stop_string = false;
    let params = GreedyParams {
        max_new_tokens: job.max_new_tokens,
        eos_token_ids: if job.ignore_eos { &[] } else { eos },
        context_limit: limits.context_window,
    };
    let generation: Generation = greedy_generate(model, &inputs, &params, |token| {
        let piece = text.push(token as u32);
        stop_string |= piece.stop;
        let chunk = Event::Chunk {
            text: piece.text,
            token_ids: vec![token as u32],
        };
        if job.events.blocking_send(chunk).is_err() || piece.stop {
            StepControl::Stop
        } else {
            StepControl::Continue
        }
    })?;
    if job.events.is_closed() && !stop_string {
        return Err(VerifierError::Cancelled);
    }
    if generation.finish == FinishKind::Eos {
        // The end-of-sequence token is reported as a token but adds no text.
        let eos_token = *generation.tokens.last().expect("EOS is a generated token") as u32;
        let _ = job.events.blocking_send(Event::Chunk {
            text: String::new(),
            token_ids: vec![eos_token],
        });
    }
    let rest = text.finish();
    if !rest.is_empty() {
        let _ = job.events.blocking_send(Event::Chunk {
            text: rest,
            token_ids: Vec::new(),
        });
    }
    Ok(Summary {
        finish: generation.finish,
        stop_string,
        prompt_tokens: job.prompt.input_ids.len(),
        image_tokens: job.prompt.image_token_count,
        generated_tokens: generation.tokens.len(),
        prefill_ms: generation.prefill_time.as_secs_f64() * 1e3,
        decode_ms: generation.decode_time.as_secs_f64() * 1e3,
    })
}

/// Tensors for the model from a preprocessed prompt.
pub fn model_inputs(prompt: &Prompt) -> ModelInputs {
    let pixels: Vec<f32> = prompt
        .images
        .iter()
        .flat_map(|im| im.pixel_values.iter().copied())
        .collect();
    let pixel_values = (!prompt.images.is_empty()).then(|| {
        let patch_dim = prompt.images[0].patch_dim as i64;
        tch::Tensor::from_slice(&pixels).view([-1, patch_dim])
    });
    ModelInputs {
        input_ids: prompt.input_ids.iter().map(|&i| i as i64).collect(),
        positions: [
            prompt.positions.t.clone(),
            prompt.positions.h.clone(),
            prompt.positions.w.clone(),
        ],
        rope_delta: prompt.rope_delta,
        pixel_values,
        image_grids: prompt
            .images
            .iter()
            .map(|im| im.grid_thw.map(|g| g as i64))
            .collect(),
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
