//! The generation engine: `--max-concurrent` OS threads sharing the target model, each running one
//! admitted request at a time (batch 1, as the method is measured), streaming text back as it is
//! produced, in the decoding mode each request asked for.
//!
//! Admission is a bounded queue: a full queue is answered at once with RESOURCE_EXHAUSTED. A
//! request whose receiver is dropped (client gone, deadline passed) is stopped at the next token.
//! Shutdown is a [`Drain`]: what waits is refused at once, what runs finishes within a timeout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use glance_input::{Prompt, PromptBuilder};
use glance_models::decode::{
    generate, Emitted, FinishKind, Generation, GreedyParams, ModelInputs, StepControl,
};
use glance_models::readout::TokenLogprob;
use glance_models::sampling::Sampling;
use glance_models::TargetModel;
use glance_spec::session::DraftEngine;
use tokio::sync::mpsc;

use crate::drafter_client::{RemoteDrafter, RemoteProvider};
use crate::error::VerifierError;
use crate::local_drafter::LocalProvider;
use crate::metrics as names;
use crate::policy::{RoundPolicy, VerifyCost};
use crate::policy_memory::{Instruction, PolicyMemory};
use crate::speculative::{speculative_generate, DraftProvider, SpecParams, SpecStats};
use crate::stop::TextAssembler;

/// How one request is decoded. Every choice yields the tokens of autoregressive decoding: the
/// greedy ones, or with sampling the same draws.
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
    /// The cost-aware policy over GLANCE trees of at most `budget` nodes.
    Auto {
        budget: usize,
        branch_k: usize,
    },
}

/// A request that passed validation and preprocessing.
pub struct Job {
    pub prompt: Prompt,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    /// Tokens that end the generation like end-of-sequence, reported as a stop.
    pub stop_token_ids: Vec<i64>,
    pub ignore_eos: bool,
    pub decoding: Decoding,
    /// Greedy, or the draws' settings and seed.
    pub sampling: Sampling,
    /// Log each speculative round's root entropy and accepted count.
    pub log_rounds: bool,
    /// Report each token's log-probability with this many alternatives.
    pub logprobs: Option<usize>,
    pub events: mpsc::Sender<Event>,
    /// Its place in the engine, released when the job is dropped.
    pub admission: Admission,
    /// The request's span: engine work is recorded under it.
    pub span: tracing::Span,
    /// When the request arrived (time to first token counts from here).
    pub arrived: std::time::Instant,
}

/// What the engine reports about one request, in order: chunks, then exactly one `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// Tokens (with their log-probabilities when asked for, one each) and the text they made final.
    Chunk {
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    Done(Box<Summary>),
    Failed(VerifierError),
}

#[derive(Clone, Debug)]
pub struct Summary {
    /// `Stopped` for a stop string or a stop token id too.
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
    /// The draws' seed, when sampling.
    pub seed: Option<u64>,
}

/// Limits the engine enforces on every request.
#[derive(Clone, Debug)]
pub struct EngineLimits {
    pub context_window: usize,
    /// Generations running at once (engine threads).
    pub max_concurrent: usize,
    /// Admitted requests waiting for an engine thread.
    pub max_queue: usize,
    /// How long running generations may go on once the engine drains.
    pub drain_timeout: Duration,
}

/// Where drafts come from.
#[derive(Clone)]
pub struct Drafting {
    /// drafter-svc, when `--drafter` is configured.
    pub remote: Option<Arc<RemoteDrafter>>,
    /// The in-process prompt-lookup drafter.
    pub prompt_lookup: Arc<dyn DraftEngine>,
}

/// A place in the engine: held from admission until the request's generation ends, so that
/// running + waiting requests never exceed the limit.
pub struct Admission(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

/// The side of the engine that request handlers hold.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: std_mpsc::Sender<Job>,
    slots: Arc<tokio::sync::Semaphore>,
    capacity: usize,
    drain: Drain,
    pub prompts: Arc<PromptBuilder>,
}

/// The engine's queue, shared by the engine threads (one waits on it at a time) and the drain.
type Queue = Arc<Mutex<std_mpsc::Receiver<Job>>>;

/// How the engine shuts down (SIGTERM). [`Drain::begin`] refuses every request that waits for an
/// engine thread, and every one submitted from then on, with UNAVAILABLE at once (the client
/// retries on another replica), while running generations go on; [`Drain::expire`] (the drain
/// timeout) stops those too, with UNAVAILABLE and the reason.
#[derive(Clone)]
pub struct Drain {
    state: Arc<DrainState>,
    queue: Queue,
}

#[derive(Default)]
struct DrainState {
    draining: AtomicBool,
    expired: AtomicBool,
    timeout: Duration,
}

/// What a request refused by the drain is told.
pub const SHUTTING_DOWN: &str = "the server is shutting down; retry on another replica";

impl Drain {
    /// Refuses what waits and what comes; returns how many waiting requests were refused.
    pub fn begin(&self) -> usize {
        self.state.draining.store(true, Ordering::SeqCst);
        // An engine thread waiting for a job holds the queue's lock, and then the queue is empty.
        let Ok(queue) = self.queue.try_lock() else { return 0 };
        let mut refused = 0;
        while let Ok(job) = queue.try_recv() {
            metrics::gauge!(names::QUEUE_SIZE).decrement(1.0);
            refuse(job);
            refused += 1;
        }
        refused
    }

    /// The drain timeout passed: running generations stop at their next token.
    pub fn expire(&self) {
        self.state.expired.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.state.draining.load(Ordering::SeqCst)
    }

    /// How long running generations may take once draining (`--drain-timeout-s`).
    pub fn timeout(&self) -> Duration {
        self.state.timeout
    }
}

/// Answers a job the drain refused.
fn refuse(job: Job) {
    let _ = job.events.try_send(Event::Failed(VerifierError::Unavailable(SHUTTING_DOWN.into())));
}

impl EngineHandle {
    /// The engine's shutdown control.
    pub fn drain(&self) -> Drain {
        self.drain.clone()
    }

    /// Takes a place for a new request, or refuses at once when running + waiting requests are
    /// at the limit. Done before any preprocessing, so an overloaded server answers fast.
    pub fn admit(&self) -> Result<Admission, VerifierError> {
        let permit = Arc::clone(&self.slots).try_acquire_owned().map_err(|_| {
            metrics::counter!(names::REQUESTS, "outcome" => "rejected").increment(1);
            VerifierError::Busy(format!("{} requests are running or queued, retry later", self.capacity))
        })?;
        Ok(Admission(permit))
    }

    /// Queues an admitted job (refused while draining).
    pub fn submit(&self, job: Job) -> Result<(), VerifierError> {
        if self.drain.is_draining() {
            return Err(VerifierError::Unavailable(SHUTTING_DOWN.into()));
        }
        metrics::gauge!(names::QUEUE_SIZE).increment(1.0);
        self.jobs.send(job).map_err(|_| {
            metrics::gauge!(names::QUEUE_SIZE).decrement(1.0);
            VerifierError::Unavailable("engine stopped".into())
        })
    }
}

/// The model shared by the engine threads.
struct SharedModel(TargetModel);

// SAFETY: after loading, the model's tensors are only read; every generation has its own KV
// cache, so concurrent forward passes on the engine threads share nothing mutable.
unsafe impl Sync for SharedModel {}

/// Starts `max_concurrent` engine threads sharing the model; `costs` is the verify cost curve the
/// auto policy starts from.
pub fn start(
    model: TargetModel,
    prompts: Arc<PromptBuilder>,
    limits: EngineLimits,
    drafting: Drafting,
    costs: VerifyCost,
) -> EngineHandle {
    let (jobs, queue) = std_mpsc::channel::<Job>();
    let queue: Queue = Arc::new(Mutex::new(queue));
    let drain_state = DrainState { timeout: limits.drain_timeout, ..DrainState::default() };
    let drain = Drain { state: Arc::new(drain_state), queue: Arc::clone(&queue) };
    let eos = prompts.eos_token_ids().iter().map(|&i| i as i64).collect::<Vec<_>>();
    let capacity = limits.max_concurrent.max(1) + limits.max_queue;
    let policies = Mutex::new(PolicyMemory::new(RoundPolicy::with_costs(costs)));
    let worker = Arc::new(Worker {
        model: SharedModel(model),
        prompts: Arc::clone(&prompts),
        eos,
        limits: limits.clone(),
        drafting,
        policies,
        drain: Arc::clone(&drain.state),
    });
    for i in 0..limits.max_concurrent.max(1) {
        let (worker, queue) = (Arc::clone(&worker), Arc::clone(&queue));
        thread::Builder::new()
            .name(format!("glance-engine-{i}"))
            .spawn(move || loop {
                let job = match queue.lock().map(|q| q.recv()) {
                    Ok(Ok(job)) => job,
                    _ => return,
                };
                metrics::gauge!(names::QUEUE_SIZE).decrement(1.0);
                worker.run_job(job);
            })
            .expect("spawning an engine thread");
    }
    EngineHandle { jobs, slots: Arc::new(tokio::sync::Semaphore::new(capacity)), capacity, drain, prompts }
}

struct Worker {
    model: SharedModel,
    prompts: Arc<PromptBuilder>,
    eos: Vec<i64>,
    limits: EngineLimits,
    drafting: Drafting,
    /// The auto policies earlier auto requests left: what the next one starts from (costs,
    /// calibration, the entropy law, the probe back-off), per instruction.
    policies: Mutex<PolicyMemory>,
    drain: Arc<DrainState>,
}

impl Worker {
    fn run_job(&self, job: Job) {
        if job.events.is_closed() {
            metrics::counter!(names::REQUESTS, "outcome" => "cancelled").increment(1);
            return; // the client left while queued
        }
        if self.drain.draining.load(Ordering::SeqCst) {
            return refuse(job); // queued before the drain began, picked up after
        }
        let span = job.span.clone();
        let _entered = span.enter();
        let events = job.events.clone();
        metrics::gauge!(names::RUNNING).increment(1.0);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.generate(job)));
        metrics::gauge!(names::RUNNING).decrement(1.0);
        let last = match outcome {
            Ok(Ok(summary)) => {
                record_summary(&summary);
                Event::Done(Box::new(summary))
            }
            Ok(Err(e)) => Event::Failed(e),
            Err(panic) => {
                let what = panic_message(&panic);
                tracing::error!(%what, "generation panicked");
                Event::Failed(VerifierError::Unavailable(format!("generation failed: {what}")))
            }
        };
        let _ = events.blocking_send(last);
    }

    fn generate(&self, job: Job) -> Result<Summary, VerifierError> {
        let inputs = job.prompt.model_inputs();
        let detok = |ids: &[u32]| self.prompts.decode(ids, true).unwrap_or_default();
        let mut text = TextAssembler::new(detok, job.stop.clone());
        let mut stop_string = false;
        let mut ending = if job.ignore_eos { Vec::new() } else { self.eos.clone() };
        ending.extend(&job.stop_token_ids);
        let params = GreedyParams {
            max_new_tokens: job.max_new_tokens,
            eos_token_ids: &ending,
            context_limit: self.limits.context_window,
            logprobs: job.logprobs,
        };
        let mut last_token_at: Option<std::time::Instant> = None;
        let mut expired = false;
        let on_token = |emitted: Emitted<'_>| {
            let token = emitted.token;
            let now = std::time::Instant::now();
            match last_token_at {
                None => metrics::histogram!(names::TTFT).record((now - job.arrived).as_secs_f64()),
                Some(previous) => metrics::histogram!(names::ITL).record((now - previous).as_secs_f64()),
            }
            last_token_at = Some(now);
            let piece = text.push(token as u32);
            stop_string |= piece.stop;
            let logprobs = emitted.logprob.cloned().into_iter().collect();
            let chunk = Event::Chunk { text: piece.text, token_ids: vec![token as u32], logprobs };
            expired = self.drain.expired.load(Ordering::SeqCst);
            if job.events.blocking_send(chunk).is_err() || piece.stop || expired {
                StepControl::Stop
            } else {
                StepControl::Continue
            }
        };
        let (generation, speculative) = self.decode(&job, &inputs, &params, on_token)?;
        if job.events.is_closed() && !stop_string {
            return Err(VerifierError::Cancelled);
        }
        if expired && generation.finish == FinishKind::Stopped && !stop_string {
            return Err(VerifierError::Unavailable(format!(
                "{SHUTTING_DOWN}: its drain timeout ({:?}, --drain-timeout-s) passed before this generation finished",
                self.drain.timeout
            )));
        }
        let mut finish = generation.finish;
        if finish == FinishKind::Eos {
            // The end-of-sequence (or stop) token is reported as a token but adds no text.
            let eos_token = *generation.tokens.last().expect("EOS is a generated token");
            let logprobs = generation.logprobs.last().cloned().into_iter().collect();
            let chunk = Event::Chunk { text: String::new(), token_ids: vec![eos_token as u32], logprobs };
            let _ = job.events.blocking_send(chunk);
            if job.stop_token_ids.contains(&eos_token) {
                finish = FinishKind::Stopped;
            }
        }
        let rest = text.finish();
        if !rest.is_empty() {
            let _ = job.events.blocking_send(Event::Chunk {
                text: rest,
                token_ids: Vec::new(),
                logprobs: Vec::new(),
            });
        }
        Ok(Summary {
            finish,
            stop_string,
            prompt_tokens: job.prompt.input_ids.len(),
            image_tokens: job.prompt.image_token_count,
            generated_tokens: generation.tokens.len(),
            prefill_ms: generation.prefill_time.as_secs_f64() * 1e3,
            decode_ms: generation.decode_time.as_secs_f64() * 1e3,
            speculative,
            seed: (!job.sampling.is_greedy()).then_some(job.sampling.seed),
        })
    }

    /// Runs the requested decoding; speculative modes also report their stats.
    #[allow(clippy::type_complexity)]
    fn decode(
        &self,
        job: &Job,
        inputs: &ModelInputs,
        params: &GreedyParams,
        on_token: impl FnMut(Emitted<'_>) -> StepControl,
    ) -> Result<(Generation, Option<(Decoding, SpecParams, SpecStats)>), VerifierError> {
        let (decoding, sampling, log_rounds) = (job.decoding, job.sampling, job.log_rounds);
        let spec = |budget, branch_k| SpecParams { budget, branch_k, log_rounds, sampling };
        let (mut provider, spec): (Box<dyn DraftProvider>, SpecParams) = match decoding {
            Decoding::Autoregressive => {
                return Ok((generate(&self.model.0, inputs, params, &sampling, on_token)?, None))
            }
            Decoding::Tree { budget, branch_k } => (self.remote()?, spec(budget, branch_k)),
            Decoding::Chain => {
                let provider = self.remote()?;
                let depth = provider.max_depth();
                (provider, spec(depth, 1))
            }
            Decoding::PromptLookup => {
                let provider = LocalProvider::new(Arc::clone(&self.drafting.prompt_lookup));
                let depth = provider.max_depth();
                (Box::new(provider), spec(depth, 1))
            }
            Decoding::Auto { budget, branch_k } => (self.remote()?, spec(budget, branch_k)),
        };
        let instruction = Instruction::of(&job.prompt.text, sampling.temperature);
        let mut policy = matches!(decoding, Decoding::Auto { .. }).then(|| self.policy(instruction));
        let (generation, stats) = speculative_generate(
            &self.model.0,
            inputs,
            params,
            spec,
            provider.as_mut(),
            policy.as_mut(),
            on_token,
        )?;
        if let Some(policy) = policy {
            self.keep_policy(instruction, policy);
        }
        Ok((generation, Some((decoding, spec, stats))))
    }

    /// An auto policy for a request of `instruction`, starting from what earlier requests learnt,
    /// with fresh stats.
    fn policy(&self, instruction: Instruction) -> RoundPolicy {
        let Ok(mut memory) = self.policies.lock() else { return RoundPolicy::default() };
        let (policy, known) = memory.policy_for(instruction);
        if known {
            metrics::counter!(names::AUTO_KNOWN_INSTRUCTIONS).increment(1);
        }
        policy
    }

    /// Keeps what a finished auto request learnt for the next ones.
    fn keep_policy(&self, instruction: Instruction, policy: RoundPolicy) {
        if let Ok(mut memory) = self.policies.lock() {
            memory.keep(instruction, policy);
        }
    }

    /// The remote drafter; while none has ever answered, a provider that never drafts, so the
    /// request still completes with greedy steps.
    fn remote(&self) -> Result<Box<dyn DraftProvider>, VerifierError> {
        let drafter = self
            .drafting
            .remote
            .clone()
            .ok_or_else(|| VerifierError::NoDrafter("no drafter is configured on this server".into()))?;
        Ok(match RemoteProvider::new(drafter) {
            Some(provider) => Box::new(provider),
            None => Box::new(crate::speculative::NoDrafter),
        })
    }
}

/// Counters and gauges of a finished generation (see `names` for what each one means).
fn record_summary(summary: &Summary) {
    metrics::counter!(names::GENERATED_TOKENS).increment(summary.generated_tokens as u64);
    let Some((_, _, stats)) = &summary.speculative else { return };
    metrics::counter!(names::SPEC_DRAFTS).increment(stats.rounds as u64);
    metrics::counter!(names::SPEC_DRAFT_TOKENS).increment(stats.draft_tokens as u64);
    metrics::counter!(names::SPEC_ACCEPTED_TOKENS).increment(stats.accepted_committed as u64);
    for (position, &count) in stats.accepted_per_depth.iter().enumerate() {
        if count > 0 {
            metrics::counter!(names::SPEC_ACCEPTED_PER_POS, "position" => position.to_string())
                .increment(count);
        }
    }
    metrics::counter!(names::SPEC_FALLBACK_ROUNDS).increment(stats.fallback_rounds as u64);
    metrics::counter!(names::SPEC_REJECTED_TREES).increment(stats.rejected_trees as u64);
    metrics::counter!(names::DRAFTER_BYTES).increment(stats.bytes_sent);
    if stats.rounds > 0 {
        metrics::gauge!(names::SPEC_TAU).set(stats.tau());
    }
    if let Some(policy) = &stats.policy {
        metrics::counter!(names::AUTO_GREEDY_STEPS).increment(policy.greedy_steps as u64);
        metrics::counter!(names::AUTO_DECLINED_TREES).increment(policy.declined_trees as u64);
        metrics::counter!(names::AUTO_OVERLAPPED_STEPS).increment(policy.overlapped_steps as u64);
        metrics::counter!(names::AUTO_STALE_TREES).increment(policy.stale_trees as u64);
        metrics::counter!(names::AUTO_VERIFIED_NODES).increment(policy.verified_nodes as u64);
        metrics::counter!(names::AUTO_LOOKUP_ROUNDS).increment(policy.lookup_rounds as u64);
        metrics::counter!(names::AUTO_LOOKUP_ACCEPTED).increment(policy.lookup_accepted as u64);
        metrics::counter!(names::AUTO_GRAFTED_ACCEPTED).increment(policy.grafted_accepted as u64);
        if policy.verified_rounds > 0 {
            metrics::gauge!(names::AUTO_CALIBRATION_ERROR).set(policy.calibration_error());
        }
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
