//! Start-up and serving: loads the model (refusing an inconsistent directory before any request),
//! starts the engine, and serves the public API with grpc.health.v1 and reflection.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use glance_input::{PromptBuilder, PromptOptions};
use glance_models::weights::{parse_device, parse_kind, target_fingerprint};
use glance_models::TargetModel;
use glance_proto::v1 as pb;
use glance_spec::prompt_lookup::PromptLookupEngine;
use tch::{Device, Kind};
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;

use crate::config::Args;
use crate::drafter_client::{DrafterError, RemoteDrafter, TargetDescription};
use crate::engine::{self, Drafting, EngineLimits};
use crate::policy::VerifyCost;
use crate::speculative::measure_verify_costs;

/// Largest pass the start-up sweep times (larger ones are extrapolated, then measured online).
const CALIBRATION_ROWS: usize = 64;
use crate::service::{DecodingDefaults, GenerationService, RequestLimits};

/// Why the service could not start; printed and turned into a non-zero exit.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("--device {0:?}: expected cpu, cuda or cuda:N")]
    Device(String),
    #[error("--dtype {0:?}: expected auto, f32, bf16 or f16")]
    Dtype(String),
    #[error("--device {0}: CUDA is not available in this build or on this machine")]
    NoCuda(String),
    #[error("model directory {dir}: {reason}")]
    Model { dir: String, reason: String },
    #[error("cannot listen on {addr}: {reason}")]
    Listen { addr: String, reason: String },
    #[error("metrics: {0}")]
    Metrics(String),
    #[error("server failed: {0}")]
    Serve(String),
    #[error(transparent)]
    Security(#[from] glance_security::SecurityError),
    #[error("--drafter {url}: {reason}")]
    DrafterUrl { url: String, reason: String },
}

/// Everything loaded at start-up, ready to serve.
pub struct Loaded {
    pub service: GenerationService,
    pub drafter: Option<Arc<RemoteDrafter>>,
    /// The transport's cap on one request message.
    pub max_request_bytes: usize,
    /// TLS of the public server (None: plaintext).
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// The public API's keys (None: open).
    pub api_keys: Option<glance_security::ApiKeys>,
}

pub fn resolve_device(args: &Args) -> Result<(Device, Kind), StartupError> {
    let device = parse_device(&args.device).ok_or_else(|| StartupError::Device(args.device.clone()))?;
    if matches!(device, Device::Cuda(_)) && !tch::Cuda::is_available() {
        return Err(StartupError::NoCuda(args.device.clone()));
    }
    let kind = match args.dtype.as_str() {
        "auto" if device == Device::Cpu => Kind::Float,
        "auto" => Kind::BFloat16,
        name => parse_kind(name).ok_or_else(|| StartupError::Dtype(args.dtype.clone()))?,
    };
    Ok((device, kind))
}

/// Loads model and input pipeline and starts the engine.
pub fn load(args: &Args) -> Result<Loaded, StartupError> {
    // Security settings first: a wrong file should not wait for a model load to be reported.
    let tls = args.server_tls().config()?;
    let api_keys = args.api_key_file.as_deref().map(glance_security::ApiKeys::from_file).transpose()?;
    if let Some(threads) = args.threads {
        tch::set_num_threads(threads);
    }
    let (device, kind) = resolve_device(args)?;
    let model_err = |reason: String| StartupError::Model { dir: args.model.display().to_string(), reason };
    if !args.model.is_dir() {
        return Err(model_err("not a directory".into()));
    }
    let options = PromptOptions {
        min_pixels: args.min_pixels,
        max_pixels: args.max_pixels,
        max_images: args.max_images,
        alpha: args.alpha(),
        max_decoded_pixels: args.max_decoded_pixels,
        image_backend: args.image_backend(),
    };
    let fingerprint = checked_fingerprint(args)?;
    let prompts =
        PromptBuilder::from_model_dir(&args.model, options).map_err(|e| model_err(e.to_string()))?;
    let model = TargetModel::load(&args.model, kind, device).map_err(|e| model_err(e.to_string()))?;
    let context_window = args
        .context_window
        .unwrap_or(model.text_config().max_position_embeddings)
        .min(model.text_config().max_position_embeddings);
    let drafter = connect_drafter(args, &model, fingerprint)?;
    let defaults = decoding_defaults(args, drafter.is_some());
    let request_limits = RequestLimits {
        max_new_tokens: args.max_new_tokens_limit,
        max_images: args.max_images,
        max_stop_strings: 16,
        max_stop_len: 256,
        max_text_bytes: args.max_text_bytes.unwrap_or_else(|| prompts.max_text_bytes(context_window)),
        max_image_bytes: args.max_image_bytes,
    };
    let info = model_info(args, &model, &prompts, context_window, &defaults, &request_limits);
    let prompts = Arc::new(prompts);
    let limits = EngineLimits {
        context_window,
        max_concurrent: args.max_concurrent,
        max_queue: args.max_queue,
        drain_timeout: Duration::from_secs_f64(args.drain_timeout_s),
    };
    let vocab = model.text_config().vocab_size as usize;
    let drafting = Drafting {
        remote: drafter.clone(),
        prompt_lookup: Arc::new(PromptLookupEngine::new(args.prompt_lookup_block, vocab)),
    };
    // The auto policy's cost curve, measured on this model and device before serving.
    let costs = match drafter.is_some() {
        true => measure_verify_costs(&model, CALIBRATION_ROWS).map_err(|e| model_err(e.to_string()))?,
        false => VerifyCost::default(),
    };
    tracing::info!(rows_1_2_4_8_16_32_64 = ?[1, 2, 4, 8, 16, 32, 64].map(|r| costs.estimate(r).map(|s| (s * 1e4).round() / 10.0)), "verify cost (ms) by rows");
    warn_of_a_steep_cost_curve(&costs);
    let engine = engine::start(model, prompts, limits, drafting, costs);
    let service = GenerationService::new(engine, request_limits, defaults, info, drafter.clone());
    Ok(Loaded { service, drafter, max_request_bytes: args.max_request_bytes, tls, api_keys })
}

/// Verifying 16 rows at the cost of more than this many one-row steps leaves a tree little to
/// win: the method assumes a pass that costs about one step up to some width (a memory-bound
/// target, 1.1-1.5x on a GPU or a CPU with instructions for the weights' dtype).
const STEEP_VERIFY_16: f64 = 3.0;

/// Tells the operator at start-up when this device's cost shape leaves speculation little room,
/// so that auto's greedy steps and small trees are not a surprise.
fn warn_of_a_steep_cost_curve(costs: &VerifyCost) {
    if let (Some(step), Some(sixteen)) = (costs.estimate(1), costs.estimate(16)) {
        let ratio = sixteen / step;
        if ratio > STEEP_VERIFY_16 {
            tracing::warn!(
                verify_16_over_step = (ratio * 100.0).round() / 100.0,
                "verifying 16 rows costs more than {STEEP_VERIFY_16} steps on this device: auto will \
                 mostly take greedy steps and small trees (the method assumes about one step, as a \
                 memory-bound target on a GPU has; on a CPU a wide pass is arithmetic)"
            );
        }
    }
}

/// The model directory's fingerprint (config.json and one embedding row, before the weights are
/// loaded), checked against `--expect-fingerprint` when given.
pub fn checked_fingerprint(args: &Args) -> Result<String, StartupError> {
    let model_err = |reason: String| StartupError::Model { dir: args.model.display().to_string(), reason };
    let config = glance_models::TargetConfig::read(&args.model).map_err(|e| model_err(e.to_string()))?;
    let fingerprint = target_fingerprint(&args.model, &config).map_err(|e| model_err(e.to_string()))?;
    match &args.expect_fingerprint {
        Some(expected) if *expected != fingerprint => Err(model_err(format!(
            "its fingerprint is {fingerprint}, but --expect-fingerprint says {expected}: not the model this deployment names"
        ))),
        _ => Ok(fingerprint),
    }
}

/// With `--drafter`, connects and checks the handshake before serving. A drafter that is not up
/// yet, or that was built for another target (a head upgrade rolling out, a misdeployed pool), is
/// logged and retried in the background: the server decodes without it meanwhile, losslessly, and
/// never crash-loops over its drafter.
fn connect_drafter(
    args: &Args,
    model: &TargetModel,
    fingerprint: String,
) -> Result<Option<Arc<RemoteDrafter>>, StartupError> {
    let Some(url) = args.drafter.clone() else {
        return Ok(None);
    };
    let config = model.text_config();
    let target = TargetDescription {
        fingerprint,
        hidden_size: config.hidden_size as u32,
        vocab_size: config.vocab_size as u32,
        num_layers: config.num_layers as u32,
        kind: model.kind(),
    };
    let runtime = tokio::runtime::Handle::current();
    let deadline = Duration::from_millis(args.drafter_deadline_ms);
    let drafter =
        RemoteDrafter::new(url.clone(), drafter_tls(args, &url)?, runtime.clone(), target, deadline);
    match runtime.block_on(drafter.connect_now()) {
        Ok(info) => {
            tracing::info!(kind = info.handshake.kind, taps = ?info.tap_layers, "drafter ready")
        }
        Err(e @ DrafterError::Mismatch { .. }) => {
            tracing::error!(error = %e, "drafter does not fit this target; requests decode without it until one does")
        }
        Err(e) => {
            tracing::warn!(error = %e, "drafter not reachable yet; requests decode greedily until it is")
        }
    }
    Ok(Some(drafter))
}

/// The drafter hop's TLS: for an `https` URL, from the --drafter-ca / --drafter-client-* files.
fn drafter_tls(args: &Args, url: &str) -> Result<Option<tonic::transport::ClientTlsConfig>, StartupError> {
    let bad = |reason: String| StartupError::DrafterUrl { url: url.to_string(), reason };
    let uri: tonic::transport::Uri = url.parse().map_err(|e| bad(format!("invalid URL: {e}")))?;
    let host = uri.host().ok_or_else(|| bad("the URL names no host".into()))?;
    let flags = glance_security::ClientTlsFlags {
        ca: "--drafter-ca",
        cert: "--drafter-client-cert",
        key: "--drafter-client-key",
    };
    Ok(args.drafter_tls().config(flags, uri.scheme_str() == Some("https"), host)?)
}

fn decoding_defaults(args: &Args, drafter_configured: bool) -> DecodingDefaults {
    let mode = match args.default_mode.map(pb::DecodingMode::from) {
        Some(pb::DecodingMode::Unspecified) | None if drafter_configured => pb::DecodingMode::Auto,
        Some(pb::DecodingMode::Unspecified) | None => pb::DecodingMode::Autoregressive,
        Some(mode) => mode,
    };
    DecodingDefaults {
        mode,
        tree_budget: args.tree_budget,
        branch_k: args.branch_k,
        max_tree_budget: args.max_tree_budget,
        drafter_configured,
    }
}

fn model_info(
    args: &Args,
    model: &TargetModel,
    prompts: &PromptBuilder,
    context_window: usize,
    defaults: &DecodingDefaults,
    limits: &RequestLimits,
) -> pb::ModelInfoResponse {
    // A text-only model takes no images: zero images and pixels say so.
    let (min_pixels, max_pixels) = prompts.image_config().map_or((0, 0), |c| (c.min_pixels, c.max_pixels));
    let max_images = if prompts.takes_images() { args.max_images as u32 } else { 0 };
    let mut modes = vec![pb::DecodingMode::Autoregressive, pb::DecodingMode::PromptLookup];
    if defaults.drafter_configured {
        modes.extend([
            pb::DecodingMode::Auto,
            pb::DecodingMode::SpeculativeTree,
            pb::DecodingMode::SpeculativeChain,
        ]);
    }
    pb::ModelInfoResponse {
        model_type: model.family.model_type().to_string(),
        model_id: model_id(&args.model),
        dtype: format!("{:?}", model.kind()),
        device: args.device.clone(),
        vocab_size: model.text_config().vocab_size as u32,
        context_window: context_window as u32,
        max_new_tokens_limit: args.max_new_tokens_limit,
        max_images_per_request: max_images,
        min_pixels: min_pixels as u64,
        max_pixels: max_pixels as u64,
        supported_modes: modes.into_iter().map(|m| m as i32).collect(),
        default_mode: defaults.mode as i32,
        drafter_connected: false,
        default_tree_budget: defaults.tree_budget as u32,
        default_branch_k: defaults.branch_k as u32,
        max_request_bytes: args.max_request_bytes as u64,
        max_text_bytes: limits.max_text_bytes as u64,
        max_image_bytes: if prompts.takes_images() { limits.max_image_bytes as u64 } else { 0 },
        max_decoded_pixels: if prompts.takes_images() { args.max_decoded_pixels } else { 0 },
        image_backend: if prompts.takes_images() {
            args.image_backend().name().to_string()
        } else {
            String::new()
        },
        sampling_options: [
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "seed",
            "stop_token_ids",
            "logprobs",
            "top_logprobs",
        ]
        .map(String::from)
        .to_vec(),
        max_top_logprobs: glance_models::readout::MAX_TOP_LOGPROBS as u32,
    }
}

fn model_id(dir: &Path) -> String {
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    canonical.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Health service names. `""` is liveness: serving while the process works, also while it drains.
/// `glance.v1.Generation` is readiness: serving until the drain begins. A missing drafter does not
/// make the server unready (it decodes losslessly without one); that is [`DRAFTER_HEALTH`].
const READINESS: &str = "glance.v1.Generation";
/// Serving while a drafter that fits this target is connected (speculative decoding available);
/// also `glance_drafter_connected` and `ModelInfo.drafter_connected`.
pub const DRAFTER_HEALTH: &str = "glance.drafter";

/// Serves on `listener` until `signal` resolves, then drains: readiness turns NOT_SERVING, waiting
/// and new requests are refused with UNAVAILABLE, running ones finish within the drain timeout
/// (then end with UNAVAILABLE), and only then does this return.
pub async fn serve(
    loaded: Loaded,
    listener: TcpListener,
    signal: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartupError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    health.set_service_status(READINESS, tonic_health::ServingStatus::Serving).await;
    // Away until the first connection attempt says otherwise: a probe before it gets an answer,
    // not NOT_FOUND.
    health.set_service_status(DRAFTER_HEALTH, tonic_health::ServingStatus::NotServing).await;
    let drain = loaded.service.drain();
    tokio::spawn(watch_drafter(health.clone(), loaded.drafter.clone()));
    // Reflection in both versions: grpcurl before 1.9, older grpcui, Postman and Python's
    // grpc_reflection clients speak only v1alpha.
    let reflection_v1 = reflection().build_v1().map_err(|e| StartupError::Serve(e.to_string()))?;
    let reflection_v1alpha = reflection().build_v1alpha().map_err(|e| StartupError::Serve(e.to_string()))?;
    // The API key guards the public API and its reflection; health stays open to probes.
    let auth = glance_security::RequireApiKey(loaded.api_keys);
    let generation = pb::generation_server::GenerationServer::new(loaded.service)
        .max_decoding_message_size(loaded.max_request_bytes);
    let generation = InterceptedService::new(generation, auth.clone());
    let reflection_v1 = InterceptedService::new(reflection_v1, auth.clone());
    let reflection_v1alpha = InterceptedService::new(reflection_v1alpha, auth);
    let shutdown = async move {
        signal.await;
        let refused = drain.begin();
        let timeout = drain.timeout();
        tracing::info!(refused, ?timeout, "draining: waiting requests refused, running ones finishing");
        health.set_service_status(READINESS, tonic_health::ServingStatus::NotServing).await;
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            tracing::warn!(?timeout, "drain timeout: stopping the generations still running");
            drain.expire();
        });
    };
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = loaded.tls {
        server = server.tls_config(tls).map_err(|e| StartupError::Serve(format!("TLS: {e}")))?;
    }
    server
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(generation)
        .serve_with_incoming_shutdown(glance_proto::transport::accepted_connections(listener), shutdown)
        .await
        .map_err(|e| StartupError::Serve(e.to_string()))
}

/// Reflection over the public services only (the Generation API and health).
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Keeps the drafter's health status and gauge current, reconnecting to it in the background.
async fn watch_drafter(health: tonic_health::server::HealthReporter, drafter: Option<Arc<RemoteDrafter>>) {
    let Some(drafter) = drafter else {
        metrics::gauge!(crate::metrics::DRAFTER_CONNECTED).set(0.0);
        health.set_service_status(DRAFTER_HEALTH, tonic_health::ServingStatus::NotServing).await;
        return;
    };
    loop {
        let d = Arc::clone(&drafter);
        let connected = tokio::task::spawn_blocking(move || d.ensure_connected()).await.unwrap_or(false);
        metrics::gauge!(crate::metrics::DRAFTER_CONNECTED).set(if connected { 1.0 } else { 0.0 });
        let status = match connected {
            true => tonic_health::ServingStatus::Serving,
            false => tonic_health::ServingStatus::NotServing,
        };
        health.set_service_status(DRAFTER_HEALTH, status).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Binds the configured address.
pub async fn bind(args: &Args) -> Result<TcpListener, StartupError> {
    TcpListener::bind(args.listen)
        .await
        .map_err(|e| StartupError::Listen { addr: args.listen.to_string(), reason: e.to_string() })
}
