//! The public `glance.v1.Generation` service: validates requests, preprocesses them off the async
//! runtime, admits them to the engine and relays its events as unary or streamed responses.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use glance_input::{ChatMessage, ContentPart};
use glance_models::decode::FinishKind;
use glance_models::readout::{TokenLogprob, MAX_TOP_LOGPROBS};
use glance_models::sampling::Sampling;
use glance_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::engine::{Decoding, EngineHandle, Event, Job, Summary};
use crate::error::VerifierError;

/// Limits a request must respect; advertised by ModelInfo.
#[derive(Clone, Debug)]
pub struct RequestLimits {
    pub max_new_tokens: u32,
    pub max_images: usize,
    pub max_stop_strings: usize,
    pub max_stop_len: usize,
    /// Text bytes of all messages together.
    pub max_text_bytes: usize,
    /// Encoded bytes of one image.
    pub max_image_bytes: usize,
}

pub struct GenerationService {
    engine: EngineHandle,
    limits: RequestLimits,
    defaults: DecodingDefaults,
    info: pb::ModelInfoResponse,
    drafter: Option<Arc<crate::drafter_client::RemoteDrafter>>,
}

impl GenerationService {
    pub fn new(
        engine: EngineHandle,
        limits: RequestLimits,
        defaults: DecodingDefaults,
        info: pb::ModelInfoResponse,
        drafter: Option<Arc<crate::drafter_client::RemoteDrafter>>,
    ) -> Self {
        Self { engine, limits, defaults, info, drafter }
    }

    /// The engine's shutdown control (SIGTERM).
    pub fn drain(&self) -> crate::engine::Drain {
        self.engine.drain()
    }

    /// Validates, admits, preprocesses and queues a request; returns the engine's event receiver.
    async fn admit(
        &self,
        request: pb::GenerateRequest,
        span: &tracing::Span,
        arrived: Instant,
    ) -> Result<mpsc::Receiver<Event>, VerifierError> {
        if self.engine.drain().is_draining() {
            return Err(VerifierError::Unavailable(crate::engine::SHUTTING_DOWN.into()));
        }
        let ignore_eos = request.decoding.as_ref().is_some_and(|d| d.ignore_eos);
        let log_rounds = request.decoding.as_ref().is_some_and(|d| d.log_rounds);
        let decoding = decoding(request.decoding.as_ref(), &self.defaults)?;
        let sampling = sampling(request.decoding.as_ref(), self.info.vocab_size as usize)?;
        let stop_token_ids = stop_token_ids(request.decoding.as_ref(), self.info.vocab_size as usize)?;
        let logprobs = logprobs(request.decoding.as_ref())?;
        let (messages, max_new_tokens, stop) = validate(request, &self.limits)?;
        let admission = self.engine.admit()?;
        let prompts = Arc::clone(&self.engine.prompts);
        let prompt = tokio::task::spawn_blocking(move || prompts.build(&messages))
            .await
            .map_err(|e| VerifierError::Unavailable(format!("preprocessing failed: {e}")))??;
        if prompt.input_ids.len() >= self.info.context_window as usize {
            return Err(VerifierError::invalid(
                "messages",
                format!(
                    "prompt is {} tokens, the context window is {}",
                    prompt.input_ids.len(),
                    self.info.context_window
                ),
            ));
        }
        span.record("prompt_tokens", prompt.input_ids.len());
        let (events, receiver) = mpsc::channel(64);
        let job = Job {
            prompt,
            max_new_tokens,
            stop,
            stop_token_ids,
            ignore_eos,
            decoding,
            sampling,
            log_rounds,
            logprobs,
            events,
            admission,
            span: span.clone(),
            arrived,
        };
        self.engine.submit(job)?;
        Ok(receiver)
    }
}

impl GenerationService {
    async fn generate_unary(
        &self,
        request: pb::GenerateRequest,
        span: &tracing::Span,
        arrived: Instant,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<pb::GenerateResponse, Status> {
        let mut events = self.admit(request, span, arrived).await?;
        let mut response = pb::GenerateResponse::default();
        while let Some(event) = next_event(&mut events, deadline).await {
            match event {
                Event::Chunk { text, token_ids, logprobs } => {
                    response.text.push_str(&text);
                    response.logprobs.extend(to_pb_logprobs(&token_ids, logprobs));
                    response.token_ids.extend(token_ids);
                }
                Event::Done(summary) => {
                    response.finish_reason = finish_reason(&summary) as i32;
                    response.usage = Some(usage(&summary));
                    response.timings = Some(timings(&summary));
                    response.speculative = speculative_stats(&summary);
                    response.seed = summary.seed;
                    return Ok(response);
                }
                Event::Failed(e) => return Err(e.into()),
            }
        }
        Err(VerifierError::Unavailable("engine ended the request without a result".into()).into())
    }
}

fn last_chunk(summary: &Summary) -> pb::GenerateStreamChunk {
    pb::GenerateStreamChunk {
        finish_reason: finish_reason(summary) as i32,
        usage: Some(usage(summary)),
        timings: Some(timings(summary)),
        speculative: speculative_stats(summary),
        seed: summary.seed,
        ..Default::default()
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamChunk, Status>> + Send>>;

/// The request's span, continuing the client's trace when it sent a `traceparent`.
fn request_span(name: &'static str, metadata: &tonic::metadata::MetadataMap) -> tracing::Span {
    let span = tracing::info_span!("request", rpc = name, prompt_tokens = tracing::field::Empty);
    glance_telemetry::continue_trace(&span, metadata);
    span
}

/// When this request must be answered by: the client's `grpc-timeout`, less a small margin so our
/// DEADLINE_EXCEEDED reaches the client before tonic's own timer answers CANCELLED.
fn deadline(metadata: &tonic::metadata::MetadataMap, arrived: Instant) -> Option<tokio::time::Instant> {
    let timeout = parse_grpc_timeout(metadata.get("grpc-timeout")?.to_str().ok()?)?;
    let margin = (timeout / 10).min(Duration::from_millis(10));
    Some(tokio::time::Instant::from_std(arrived + timeout - margin))
}

/// `grpc-timeout` is digits followed by a unit: H, M, S, m, u or n.
fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// The next engine event, or DEADLINE_EXCEEDED once the deadline has passed.
async fn next_event(
    events: &mut mpsc::Receiver<Event>,
    deadline: Option<tokio::time::Instant>,
) -> Option<Event> {
    match deadline {
        None => events.recv().await,
        Some(at) => match tokio::time::timeout_at(at, events.recv()).await {
            Ok(event) => event,
            Err(_) => Some(Event::Failed(VerifierError::DeadlineExceeded)),
        },
    }
}

/// Counts the request's outcome by status code.
fn record_outcome(result: Result<(), &Status>) {
    let outcome = match result {
        Ok(()) => "ok",
        Err(status) => match status.code() {
            tonic::Code::Cancelled => "cancelled",
            tonic::Code::DeadlineExceeded => "deadline_exceeded",
            tonic::Code::InvalidArgument => "invalid_argument",
            tonic::Code::ResourceExhausted => return, // counted at admission
            tonic::Code::Unavailable => "unavailable",
            tonic::Code::FailedPrecondition => "failed_precondition",
            _ => "error",
        },
    };
    metrics::counter!(crate::metrics::REQUESTS, "outcome" => outcome).increment(1);
}

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let arrived = Instant::now();
        let span = request_span("Generate", request.metadata());
        let deadline = deadline(request.metadata(), arrived);
        let result = self
            .generate_unary(request.into_inner(), &span, arrived, deadline)
            .instrument(span.clone())
            .await;
        record_outcome(result.as_ref().map(|_| ()));
        result.map(Response::new)
    }

    type GenerateStreamStream = ChunkStream;

    async fn generate_stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        let arrived = Instant::now();
        let span = request_span("GenerateStream", request.metadata());
        let deadline = deadline(request.metadata(), arrived);
        let mut events = match self.admit(request.into_inner(), &span, arrived).instrument(span.clone()).await
        {
            Ok(events) => events,
            Err(e) => {
                let status = Status::from(e);
                record_outcome(Err(&status));
                return Err(status);
            }
        };
        // A task relays events so the deadline holds between chunks too. Dropping the response
        // stream (client gone) ends the relay, which drops the engine's receiver and stops it.
        let (chunks, stream) = mpsc::channel(64);
        tokio::spawn(async move {
            let mut outcome = Err(Status::unavailable("engine ended the request without a result"));
            while let Some(event) = next_event(&mut events, deadline).await {
                let (chunk, done) = match event {
                    Event::Chunk { text, token_ids, logprobs } => {
                        let logprobs = to_pb_logprobs(&token_ids, logprobs);
                        (
                            Ok(pb::GenerateStreamChunk { text, token_ids, logprobs, ..Default::default() }),
                            false,
                        )
                    }
                    Event::Done(summary) => {
                        outcome = Ok(());
                        (Ok(last_chunk(&summary)), true)
                    }
                    Event::Failed(e) => {
                        let status = Status::from(e);
                        outcome = Err(status.clone());
                        (Err(status), true)
                    }
                };
                if chunks.send(chunk).await.is_err() {
                    outcome = Err(Status::cancelled("client went away"));
                    break;
                }
                if done {
                    break;
                }
            }
            record_outcome(outcome.as_ref().map(|_| ()));
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(stream))))
    }

    async fn model_info(
        &self,
        _: Request<pb::ModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfoResponse>, Status> {
        let mut info = self.info.clone();
        info.drafter_connected = self.drafter.as_ref().is_some_and(|d| d.is_connected());
        Ok(Response::new(info))
    }
}

/// Checks every field and converts the messages; nothing reaches the engine unless all hold.
fn validate(
    request: pb::GenerateRequest,
    limits: &RequestLimits,
) -> Result<(Vec<ChatMessage>, usize, Vec<String>), VerifierError> {
    if request.max_new_tokens == 0 {
        return Err(VerifierError::invalid("max_new_tokens", "must be at least 1"));
    }
    if request.max_new_tokens > limits.max_new_tokens {
        return Err(VerifierError::invalid(
            "max_new_tokens",
            format!("{} is over the server limit of {}", request.max_new_tokens, limits.max_new_tokens),
        ));
    }
    if request.stop.len() > limits.max_stop_strings {
        return Err(VerifierError::invalid(
            "stop",
            format!("at most {} stop strings", limits.max_stop_strings),
        ));
    }
    if let Some(i) = request.stop.iter().position(|s| s.is_empty() || s.len() > limits.max_stop_len) {
        return Err(VerifierError::invalid(
            format!("stop[{i}]"),
            format!("must be 1 to {} bytes", limits.max_stop_len),
        ));
    }
    if request.messages.is_empty() {
        return Err(VerifierError::invalid("messages", "at least one message is required"));
    }
    let mut images = 0;
    let mut text_bytes = 0;
    let mut messages = Vec::with_capacity(request.messages.len());
    for (m, message) in request.messages.into_iter().enumerate() {
        let mut content = Vec::with_capacity(message.content.len());
        for (p, part) in message.content.into_iter().enumerate() {
            let field = format!("messages[{m}].content[{p}]");
            match part.part {
                Some(pb::content_part::Part::Text(text)) => {
                    text_bytes += text.len();
                    if text_bytes > limits.max_text_bytes {
                        return Err(VerifierError::invalid(
                            field,
                            format!(
                                "the messages' text reaches {text_bytes} bytes here, over the limit of {} \
                                 (what the context window can hold; --max-text-bytes)",
                                limits.max_text_bytes
                            ),
                        ));
                    }
                    content.push(ContentPart::Text(text))
                }
                Some(pb::content_part::Part::Image(image)) => {
                    images += 1;
                    if images > limits.max_images {
                        return Err(VerifierError::invalid(
                            field,
                            format!("too many images: at most {} per request", limits.max_images),
                        ));
                    }
                    if image.data.len() > limits.max_image_bytes {
                        return Err(VerifierError::invalid(
                            format!("{field}.image.data"),
                            format!(
                                "{} bytes, over the limit of {} per image (--max-image-bytes)",
                                image.data.len(),
                                limits.max_image_bytes
                            ),
                        ));
                    }
                    content.push(ContentPart::Image { data: image.data, mime_type: image.mime_type });
                }
                None => return Err(VerifierError::invalid(field, "empty content part")),
            }
        }
        messages.push(ChatMessage { role: message.role, content });
    }
    Ok((messages, request.max_new_tokens as usize, request.stop))
}

/// The request's decoding choice, with the server's defaults filled in.
fn decoding(
    options: Option<&pb::DecodingOptions>,
    defaults: &DecodingDefaults,
) -> Result<Decoding, VerifierError> {
    let options = options.cloned().unwrap_or_default();
    let mode = match pb::DecodingMode::try_from(options.mode) {
        Ok(pb::DecodingMode::Unspecified) => defaults.mode,
        Ok(mode) => mode,
        Err(_) => {
            return Err(VerifierError::invalid("decoding.mode", format!("unknown mode {}", options.mode)))
        }
    };
    let needs_drafter = matches!(
        mode,
        pb::DecodingMode::SpeculativeTree | pb::DecodingMode::SpeculativeChain | pb::DecodingMode::Auto
    );
    if needs_drafter && !defaults.drafter_configured {
        return Err(VerifierError::NoDrafter(format!(
            "decoding.mode {} needs a drafter; this server runs without one (start it with --drafter)",
            mode.as_str_name()
        )));
    }
    let budget = if options.tree_budget == 0 { defaults.tree_budget } else { options.tree_budget as usize };
    let branch_k = if options.branch_k == 0 { defaults.branch_k } else { options.branch_k as usize };
    if !(1..=defaults.max_tree_budget).contains(&budget) {
        return Err(VerifierError::invalid(
            "decoding.tree_budget",
            format!("must be 1 to {}", defaults.max_tree_budget),
        ));
    }
    if !(1..=MAX_BRANCH_K).contains(&branch_k) {
        return Err(VerifierError::invalid("decoding.branch_k", format!("must be 1 to {MAX_BRANCH_K}")));
    }
    Ok(match mode {
        pb::DecodingMode::SpeculativeTree => Decoding::Tree { budget, branch_k },
        pb::DecodingMode::Auto => Decoding::Auto { budget, branch_k },
        pb::DecodingMode::SpeculativeChain => Decoding::Chain,
        pb::DecodingMode::PromptLookup => Decoding::PromptLookup,
        _ => Decoding::Autoregressive,
    })
}

const MAX_BRANCH_K: usize = 64;
/// Below this temperature a request decodes greedily (the logits divided by it would overflow).
const MIN_TEMPERATURE: f64 = 1e-5;

/// The request's sampling settings: greedy at temperature 0, else each option checked, naming
/// the field, and a seed drawn for it when it brought none.
fn sampling(options: Option<&pb::DecodingOptions>, vocab: usize) -> Result<Sampling, VerifierError> {
    let unset = pb::DecodingOptions::default();
    let options = options.unwrap_or(&unset);
    let temperature = f64::from(options.temperature);
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(VerifierError::invalid("decoding.temperature", "must be 0 (greedy) or positive"));
    }
    if temperature < MIN_TEMPERATURE {
        return Ok(Sampling::GREEDY);
    }
    let top_k = options.top_k as usize;
    if top_k > vocab {
        return Err(VerifierError::invalid(
            "decoding.top_k",
            format!("must be 0 (all) to {vocab}, the vocabulary"),
        ));
    }
    let top_p = options.top_p.map_or(1.0, f64::from);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(VerifierError::invalid("decoding.top_p", "must be in (0, 1]"));
    }
    let min_p = f64::from(options.min_p);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(VerifierError::invalid("decoding.min_p", "must be in [0, 1]"));
    }
    let seed = options.seed.unwrap_or_else(fresh_seed);
    Ok(Sampling { temperature, top_k, top_p, min_p, seed })
}

/// Most stop token ids a request may carry.
const MAX_STOP_TOKEN_IDS: usize = 16;

/// The request's stop token ids, each checked against the vocabulary.
fn stop_token_ids(options: Option<&pb::DecodingOptions>, vocab: usize) -> Result<Vec<i64>, VerifierError> {
    let ids = options.map(|o| o.stop_token_ids.as_slice()).unwrap_or_default();
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(VerifierError::invalid(
            "decoding.stop_token_ids",
            format!("at most {MAX_STOP_TOKEN_IDS} stop token ids"),
        ));
    }
    if let Some(i) = ids.iter().position(|&id| id as usize >= vocab) {
        return Err(VerifierError::invalid(
            format!("decoding.stop_token_ids[{i}]"),
            format!("{} is not below the vocabulary size {vocab}", ids[i]),
        ));
    }
    Ok(ids.iter().map(|&id| i64::from(id)).collect())
}

/// How many alternatives each token's log-probability lists, when the request asks for
/// log-probabilities at all.
fn logprobs(options: Option<&pb::DecodingOptions>) -> Result<Option<usize>, VerifierError> {
    let (wanted, top) = options.map_or((false, 0), |o| (o.logprobs, o.top_logprobs as usize));
    if top > MAX_TOP_LOGPROBS {
        return Err(VerifierError::invalid(
            "decoding.top_logprobs",
            format!("must be 0 to {MAX_TOP_LOGPROBS}"),
        ));
    }
    if top > 0 && !wanted {
        return Err(VerifierError::invalid("decoding.top_logprobs", "needs decoding.logprobs set"));
    }
    Ok(wanted.then_some(top))
}

/// The engine's log-probabilities of `token_ids` (one each, or none) in the API's form.
fn to_pb_logprobs(token_ids: &[u32], logprobs: Vec<TokenLogprob>) -> Vec<pb::TokenLogprob> {
    token_ids
        .iter()
        .zip(logprobs)
        .map(|(&token_id, lp)| pb::TokenLogprob {
            token_id,
            logprob: lp.logprob,
            top_logprobs: lp
                .top
                .into_iter()
                .map(|(id, logprob)| pb::TopLogprob { token_id: id as u32, logprob })
                .collect(),
        })
        .collect()
}

/// A seed no earlier request is likely to have had: the process's random hasher keys and the clock.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos(),
    );
    hasher.finish()
}

/// Server-side defaults and bounds for the decoding options.
#[derive(Clone, Debug)]
pub struct DecodingDefaults {
    pub mode: pb::DecodingMode,
    pub tree_budget: usize,
    pub branch_k: usize,
    pub max_tree_budget: usize,
    pub drafter_configured: bool,
}

fn speculative_stats(summary: &Summary) -> Option<pb::SpeculativeStats> {
    let (decoding, spec, stats) = summary.speculative.as_ref()?;
    let mode = match decoding {
        Decoding::Tree { .. } => pb::DecodingMode::SpeculativeTree,
        Decoding::Auto { .. } => pb::DecodingMode::Auto,
        Decoding::Chain => pb::DecodingMode::SpeculativeChain,
        Decoding::PromptLookup => pb::DecodingMode::PromptLookup,
        Decoding::Autoregressive => pb::DecodingMode::Autoregressive,
    };
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    Some(pb::SpeculativeStats {
        mode: mode as i32,
        rounds: stats.rounds as u32,
        mean_accepted_length: stats.tau(),
        accepted_per_depth: stats.accepted_per_depth.clone(),
        draft_ms: ms(stats.draft_time),
        hop_ms: ms(stats.hop_time),
        verify_ms: ms(stats.verify_time),
        bytes_to_drafter: stats.bytes_sent,
        fallback_rounds: stats.fallback_rounds as u32,
        rejected_trees: stats.rejected_trees as u32,
        tree_budget: spec.budget as u32,
        branch_k: spec.branch_k as u32,
        round_logs: stats
            .round_logs
            .iter()
            .map(|r| pb::RoundLog {
                root_entropy: r.root_entropy,
                accepted: r.accepted as u32,
                tree_size: r.tree_size as u32,
            })
            .collect(),
        auto: stats.policy.map(|p| pb::AutoStats {
            greedy_steps: p.greedy_steps as u32,
            declined_trees: p.declined_trees as u32,
            mean_verified_nodes: p.mean_nodes(),
            calibration_error: p.calibration_error(),
            overlapped_steps: p.overlapped_steps as u32,
            stale_trees: p.stale_trees as u32,
            lookup_rounds: p.lookup_rounds as u32,
            lookup_verified_nodes: p.lookup_nodes as u32,
            lookup_accepted_tokens: p.lookup_accepted as u32,
            step_ms: p.step_secs * 1e3,
            overlapped_step_ms: p.overlapped_step_secs * 1e3,
            grafted_rounds: p.grafted_rounds as u32,
            grafted_nodes: p.grafted_nodes as u32,
            grafted_accepted_tokens: p.grafted_accepted as u32,
        }),
    })
}

fn finish_reason(summary: &Summary) -> pb::FinishReason {
    match summary.finish {
        FinishKind::Eos => pb::FinishReason::Eos,
        FinishKind::Length => pb::FinishReason::Length,
        FinishKind::Stopped => pb::FinishReason::Stop,
        FinishKind::Context => pb::FinishReason::Context,
    }
}

fn usage(summary: &Summary) -> pb::Usage {
    pb::Usage {
        prompt_tokens: summary.prompt_tokens as u32,
        image_tokens: summary.image_tokens as u32,
        generated_tokens: summary.generated_tokens as u32,
    }
}

fn timings(summary: &Summary) -> pb::Timings {
    let after_first = summary.generated_tokens.saturating_sub(1) as f64;
    let rate = if summary.decode_ms > 0.0 { after_first / (summary.decode_ms / 1e3) } else { 0.0 };
    pb::Timings {
        prefill_ms: summary.prefill_ms,
        decode_ms: summary.decode_ms,
        decode_tokens_per_second: rate,
    }
}

#[cfg(test)]
mod fuzz {
    //! The public request's validation under arbitrary requests (property tests on stable Rust):
    //! every request is converted or refused with INVALID_ARGUMENT / FAILED_PRECONDITION naming
    //! a field, never a panic, and what passes is within the limits. `GLANCE_FUZZ_CASES` sets the
    //! number of cases.

    use proptest::prelude::*;

    use super::*;

    fn cases(default: u32) -> u32 {
        std::env::var("GLANCE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
    }

    const LIMITS: RequestLimits = RequestLimits {
        max_new_tokens: 64,
        max_images: 2,
        max_stop_strings: 16,
        max_stop_len: 256,
        max_text_bytes: 300,
        max_image_bytes: 100,
    };

    fn part() -> impl Strategy<Value = pb::ContentPart> {
        let text = prop_oneof![any::<String>(), "[a-z ]{0,120}"].prop_map(pb::content_part::Part::Text);
        let image = (prop::collection::vec(any::<u8>(), 0..160), any::<String>())
            .prop_map(|(data, mime_type)| pb::content_part::Part::Image(pb::Image { data, mime_type }));
        prop::option::weighted(0.95, prop_oneof![3 => text, 1 => image])
            .prop_map(|part| pb::ContentPart { part })
    }

    /// Temperatures, filters, seeds and stop token ids: plausible values, edges and any bits (NaN,
    /// infinities).
    fn sampling_options() -> impl Strategy<Value = pb::DecodingOptions> {
        let unit = prop_oneof![0.0f32..=1.0, Just(0.0), Just(1.0), any::<f32>()];
        (
            prop_oneof![0.0f32..3.0, Just(0.0), any::<f32>()],
            prop_oneof![0u32..2000, any::<u32>()],
            prop::option::of(unit.clone()),
            unit,
            any::<Option<u64>>(),
            prop::collection::vec(prop_oneof![0u32..1200, any::<u32>()], 0..20),
            (any::<bool>(), prop_oneof![0u32..25, any::<u32>()]),
        )
            .prop_map(
                |(temperature, top_k, top_p, min_p, seed, stop_token_ids, (logprobs, top_logprobs))| {
                    pb::DecodingOptions {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        seed,
                        stop_token_ids,
                        logprobs,
                        top_logprobs,
                        ..Default::default()
                    }
                },
            )
    }

    fn request() -> impl Strategy<Value = pb::GenerateRequest> {
        let message = (any::<String>(), prop::collection::vec(part(), 0..4))
            .prop_map(|(role, content)| pb::ChatMessage { role, content });
        let options = (
            any::<i32>(),
            prop_oneof![0u32..300, any::<u32>()],
            prop_oneof![0u32..20, any::<u32>()],
            any::<bool>(),
            any::<bool>(),
            sampling_options(),
        )
            .prop_map(|(mode, tree_budget, branch_k, ignore_eos, log_rounds, sampling)| {
                pb::DecodingOptions {
                    mode: mode.rem_euclid(8),
                    tree_budget,
                    branch_k,
                    ignore_eos,
                    log_rounds,
                    ..sampling
                }
            });
        (
            prop::collection::vec(message, 0..4),
            prop_oneof![0u32..100, any::<u32>()],
            prop::collection::vec(prop_oneof!["[a-z]{0,8}", any::<String>()], 0..20),
            prop::option::of(options),
        )
            .prop_map(|(messages, max_new_tokens, stop, decoding)| pb::GenerateRequest {
                messages,
                max_new_tokens,
                stop,
                decoding,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(20_000), failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn any_request_is_converted_within_the_limits_or_refused(request in request(), drafter in any::<bool>()) {
            let defaults = DecodingDefaults {
                mode: pb::DecodingMode::Autoregressive,
                tree_budget: 31,
                branch_k: 8,
                max_tree_budget: 256,
                drafter_configured: drafter,
            };
            let options = request.decoding.clone();
            if let Err(e) = decoding(options.as_ref(), &defaults) {
                prop_assert!(e.to_string().starts_with("decoding."), "names the field: {e}");
            }
            match stop_token_ids(options.as_ref(), 1000) {
                Ok(ids) => prop_assert!(ids.len() <= 16 && ids.iter().all(|&id| (0..1000).contains(&id))),
                Err(e) => prop_assert!(e.to_string().starts_with("decoding.stop_token_ids"), "names the field: {e}"),
            }
            match logprobs(options.as_ref()) {
                Ok(Some(top)) => prop_assert!(top <= 20 && options.as_ref().is_some_and(|o| o.logprobs)),
                Ok(None) => prop_assert!(options.as_ref().is_none_or(|o| !o.logprobs && o.top_logprobs == 0)),
                Err(e) => prop_assert!(e.to_string().starts_with("decoding.top_logprobs"), "names the field: {e}"),
            }
            match sampling(options.as_ref(), 1000) {
                Ok(s) if !s.is_greedy() => {
                    prop_assert!(s.temperature.is_finite() && s.temperature >= MIN_TEMPERATURE);
                    prop_assert!(s.top_k <= 1000 && s.top_p > 0.0 && s.top_p <= 1.0 && (0.0..=1.0).contains(&s.min_p));
                    if let Some(seed) = options.as_ref().and_then(|o| o.seed) {
                        prop_assert_eq!(s.seed, seed);
                    }
                }
                Ok(_) => {}
                Err(e) => prop_assert!(e.to_string().starts_with("decoding."), "names the field: {e}"),
            }
            match validate(request, &LIMITS) {
                Ok((messages, max_new_tokens, stop)) => {
                    prop_assert!((1..=64).contains(&max_new_tokens));
                    prop_assert!(stop.len() <= 16 && stop.iter().all(|s| !s.is_empty() && s.len() <= 256));
                    let text: usize = messages.iter().flat_map(|m| &m.content).map(|p| match p {
                        ContentPart::Text(t) => t.len(),
                        ContentPart::Image { .. } => 0,
                    }).sum();
                    prop_assert!(text <= 300);
                    let images = messages.iter().flat_map(|m| &m.content).filter(|p| matches!(p, ContentPart::Image { .. })).count();
                    prop_assert!(images <= 2);
                }
                Err(e) => {
                    let named = ["messages", "max_new_tokens", "stop"].iter().any(|f| e.to_string().starts_with(f));
                    prop_assert!(named, "names the field: {e}");
                }
            }
        }
    }
}
