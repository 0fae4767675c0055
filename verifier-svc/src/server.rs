//! Start-up and serving: loads the model (refusing an inconsistent directory before any request),
//! starts the engine, and serves the public API with grpc.health.v1 and reflection.

use std::future::Future;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use glance_input::{PromptBuilder, PromptOptions};
use glance_models::weights::{parse_device, parse_kind, target_fingerprint};
use glance_models::TargetModel;
use glance_proto::v1 as pb;
use glance_spec::prompt_lookup::PromptLookupEngine;
use tch::{Device, Kind};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

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
    #[error("--drafter: {0}")]
    Drafter(String),
    #[error("server failed: {0}")]
    Serve(String),
}

/// Everything loaded at start-up, ready to serve.
pub struct Loaded {
    pub service: GenerationService,
    pub drafter: Option<Arc<RemoteDrafter>>,
    /// The transport's cap on one request message.
    pub max_request_bytes: usize,
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
    let prompts =
        PromptBuilder::from_model_dir(&args.model, options).map_err(|e| model_err(e.to_string()))?;
    let model = TargetModel::load(&args.model, kind, device).map_err(|e| model_err(e.to_string()))?;
    let context_window = args
        .context_window
        .unwrap_or(model.text_config().max_position_embeddings)
        .min(model.text_config().max_position_embeddings);
    let drafter = connect_drafter(args, &model)?;
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
    let limits =
        EngineLimits { context_window, max_concurrent: args.max_concurrent, max_queue: args.max_queue };
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
    let engine = engine::start(model, prompts, limits, drafting, costs);
    let service = GenerationService::new(engine, request_limits, defaults, info, drafter.clone());
    Ok(Loaded { service, drafter, max_request_bytes: args.max_request_bytes })
}

/// With `--drafter`, connects and checks the handshake before serving: a drafter built for another
/// target stops the start-up; one that is not up yet is retried in the background.
fn connect_drafter(args: &Args, model: &TargetModel) -> Result<Option<Arc<RemoteDrafter>>, StartupError> {
    let Some(url) = args.drafter.clone() else {
        return Ok(None);
    };
    let config = model.text_config();
    let target = TargetDescription {
        fingerprint: target_fingerprint(&args.model, &model.config).map_err(|e| StartupError::Model {
            dir: args.model.display().to_string(),
            reason: e.to_string(),
        })?,
        hidden_size: config.hidden_size as u32,
        vocab_size: config.vocab_size as u32,
        num_layers: config.num_layers as u32,
        kind: model.kind(),
    };
    let runtime = tokio::runtime::Handle::current();
    let deadline = Duration::from_millis(args.drafter_deadline_ms);
    let drafter = RemoteDrafter::new(url, runtime.clone(), target, deadline);
    match runtime.block_on(drafter.connect_now()) {
        Ok(info) => {
            tracing::info!(kind = info.handshake.kind, taps = ?info.tap_layers, "drafter ready")
        }
        Err(e @ DrafterError::Mismatch { .. }) => return Err(StartupError::Drafter(e.to_string())),
        Err(e) => {
            tracing::warn!(error = %e, "drafter not reachable yet; requests decode greedily until it is")
        }
    }
    Ok(Some(drafter))
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

/// Health service names: `""` is liveness (serving while the process works, also while it
/// drains), `glance.v1.Generation` is readiness (not serving while draining, or while a configured
/// drafter is not connected: speculation unavailable).
const READINESS: &str = "glance.v1.Generation";

/// Serves on `listener` until `signal` resolves, then drains: readiness turns NOT_SERVING, new
/// requests are refused with UNAVAILABLE, running ones finish, and only then does this return.
pub async fn serve(
    loaded: Loaded,
    listener: TcpListener,
    signal: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartupError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    let draining = loaded.service.draining();
    let drafter = loaded.drafter.clone();
    tokio::spawn(watch_readiness(health.clone(), drafter, Arc::clone(&draining)));
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| StartupError::Serve(e.to_string()))?;
    let generation = pb::generation_server::GenerationServer::new(loaded.service)
        .max_decoding_message_size(loaded.max_request_bytes);
    let shutdown = async move {
        signal.await;
        tracing::info!("draining: refusing new requests, finishing running ones");
        draining.store(true, Ordering::SeqCst);
        health.set_service_status(READINESS, tonic_health::ServingStatus::NotServing).await;
    };
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(health_service)
        .add_service(reflection)
        .add_service(generation)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
        .map_err(|e| StartupError::Serve(e.to_string()))
}

/// Keeps readiness and the drafter gauge current, reconnecting to the drafter in the background.
async fn watch_readiness(
    health: tonic_health::server::HealthReporter,
    drafter: Option<Arc<RemoteDrafter>>,
    draining: Arc<std::sync::atomic::AtomicBool>,
) {
    loop {
        let connected = match &drafter {
            Some(d) => {
                let d = Arc::clone(d);
                tokio::task::spawn_blocking(move || d.ensure_connected()).await.unwrap_or(false)
            }
            None => true,
        };
        metrics::gauge!(crate::metrics::DRAFTER_CONNECTED).set(if drafter.is_some() && connected {
            1.0
        } else {
            0.0
        });
        let ready = connected && !draining.load(Ordering::SeqCst);
        let status = if ready {
            tonic_health::ServingStatus::Serving
        } else {
            tonic_health::ServingStatus::NotServing
        };
        health.set_service_status(READINESS, status).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Binds the configured address.
pub async fn bind(args: &Args) -> Result<TcpListener, StartupError> {
    TcpListener::bind(args.listen)
        .await
        .map_err(|e| StartupError::Listen { addr: args.listen.to_string(), reason: e.to_string() })
}
