//! The generation engine: one OS thread that owns the target model and runs admitted requests one
//! at a time (batch 1, as the method is measured), streaming text back as it is produced, in the
//! decoding mode each request asked for.
//!
//! Admission is a bounded queue: a full queue is answered at once with RESOURCE_EXHAUSTED. A
//! request whose receiver is dropped (client gone, deadline passed) is stopped at the next token.

use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread;

use drafter_svc::session::DraftEngine;
use glance_common::decode::{
    greedy_generate, FinishKind, Generation, GreedyParams, ModelInputs, StepControl,
};
use glance_common::input::{Prompt, PromptBuilder};
use glance_common::models::TargetModel;
use tokio::sync::mpsc;

use crate::drafter_client::{RemoteDrafter, RemoteProvider};
use crate::error::VerifierError;
use crate::local_drafter::LocalProvider;
use crate::speculative::{speculative_generate, DraftProvider, SpecParams, SpecStats};
use crate::stop::TextAssembler;

/// How one request is decoded. Every choice yields the greedy tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoding {
    Autoregressive,
    /// GLANCE: block draft, best-first tree of `budget` nodes with `branch_k` per offset.
    Tree {
        budget: usize,
        branch_k: usize,
    },
    /// Block draft, width 1.
    Chain,
    /// Prompt-lookup n-gram drafts.
    PromptLookup,
}

/// A request that passed validation and preprocessing.
pub struct Job {
    pub prompt: Prompt,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub decoding: Decoding,
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
    /// Present for speculative modes.
    pub speculative: Option<(Decoding, SpecParams, SpecStats)>,
}

/// Limits the engine enforces on every request.
#[derive(Clone, Debug)]
pub struct EngineLimits {
    pub context_window: usize,
    pub queue_size: usize,
}

/// Where drafts come from.
#[derive(Clone)]
pub struct Drafting {
    /// drafter-svc, when `--drafter` is configured.
    pub remote: Option<Arc<RemoteDrafter>>,
    /// The in-process prompt-lookup drafter.
    pub prompt_lookup: Arc<dyn DraftEngine>,
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
    drafting: Drafting,
) -> EngineHandle {
    let (jobs, queue) = std_mpsc::sync_channel::<Job>(limits.queue_size);
    let eos = prompts
        .eos_token_ids()
        .iter()
        .map(|&i| i as i64)
        .collect::<Vec<_>>();
    let worker = Worker {
        model,
        prompts: Arc::clone(&prompts),
        eos,
        limits,
        drafting,
    };
    thread::Builder::new()
        .name("glance-engine".into())
        .spawn(move || {
            for job in queue {
                worker.run_job(job);
            }
        })
        .expect("spawning the engine thread");
    EngineHandle { jobs, prompts }
}

struct Worker {
    model: TargetModel,
    prompts: Arc<PromptBuilder>,
    eos: Vec<i64>,
    limits: EngineLimits,
    drafting: Drafting,
}

impl Worker {
    fn run_job(&self, job: Job) {
        if job.events.is_closed() {
            return; // the client left while queued
        }
        let events = job.events.clone();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.generate(job)));
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

    fn generate(&self, job: Job) -> Result<Summary, VerifierError> {
        let inputs = model_inputs(&job.prompt);
        let detok = |ids: &[u32]| self.prompts.decode(ids, true).unwrap_or_default();
        let mut text = TextAssembler::new(detok, job.stop.clone());
        let mut stop_string = false;
        let params = GreedyParams {
            max_new_tokens: job.max_new_tokens,
            eos_token_ids: if job.ignore_eos { &[] } else { &self.eos },
            context_limit: self.limits.context_window,
        };
        let on_token = |token: i64| {
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
        };
        let (generation, speculative) = self.decode(&inputs, &params, job.decoding, on_token)?;
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
            speculative,
        })
    }

    /// Runs the requested decoding; speculative modes also report their stats.
    #[allow(clippy::type_complexity)]
    fn decode(
        &self,
        inputs: &ModelInputs,
        params: &GreedyParams,
        decoding: Decoding,
        on_token: impl FnMut(i64) -> StepControl,
    ) -> Result<(Generation, Option<(Decoding, SpecParams, SpecStats)>), VerifierError> {
        let (mut provider, spec): (Box<dyn DraftProvider>, SpecParams) = match decoding {
            Decoding::Autoregressive => {
                return Ok((
                    greedy_generate(&self.model, inputs, params, on_token)?,
                    None,
                ))
            }
            Decoding::Tree { budget, branch_k } => {
                (self.remote()?, SpecParams { budget, branch_k })
            }
            Decoding::Chain => {
                let provider = self.remote()?;
                let depth = provider.max_depth();
                (
                    provider,
                    SpecParams {
                        budget: depth,
                        branch_k: 1,
                    },
                )
            }
            Decoding::PromptLookup => {
                let provider = LocalProvider::new(Arc::clone(&self.drafting.prompt_lookup));
                let depth = provider.max_depth();
                (
                    Box::new(provider),
                    SpecParams {
                        budget: depth,
                        branch_k: 1,
                    },
                )
            }
        };
        let (generation, stats) = speculative_generate(
            &self.model,
            inputs,
            params,
            spec,
            provider.as_mut(),
            on_token,
        )?;
        Ok((generation, Some((decoding, spec, stats))))
    }

    /// The remote drafter; while none has ever answered, a provider that never drafts, so the
    /// request still completes with greedy steps.
    fn remote(&self) -> Result<Box<dyn DraftProvider>, VerifierError> {
        let drafter = self.drafting.remote.clone().ok_or_else(|| {
            VerifierError::NoDrafter("no drafter is configured on this server".into())
        })?;
        Ok(match RemoteProvider::new(drafter) {
            Some(provider) => Box::new(provider),
            None => Box::new(crate::speculative::NoDrafter),
        })
    }
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
