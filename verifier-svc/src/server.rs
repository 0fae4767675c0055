//! Start-up and serving: loads the model (refusing an inconsistent directory before any request),
//! starts the engine, and serves the public API with grpc.health.v1 and reflection.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use glance_common::input::{PromptBuilder, PromptOptions};
use glance_common::models::TargetModel;
use glance_common::weights::{parse_device, parse_kind};
use glance_proto::v1 as pb;
use tch::{Device, Kind};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use crate::config::Args;
use crate::engine::{self, EngineLimits};
use crate::service::{GenerationService, RequestLimits};

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
    #[error("server failed: {0}")]
    Serve(String),
}

/// Everything loaded at start-up, ready to serve.
pub struct Loaded {
    pub service: GenerationService,
}

pub fn resolve_device(args: &Args) -> Result<(Device, Kind), StartupError> {
    let device =
        parse_device(&args.device).ok_or_else(|| StartupError::Device(args.device.clone()))?;
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
    let model_err = |reason: String| StartupError::Model {
        dir: args.model.display().to_string(),
        reason,
    };
    if !args.model.is_dir() {
        return Err(model_err("not a directory".into()));
    }
    let options = PromptOptions {
        min_pixels: args.min_pixels,
        max_pixels: args.max_pixels,
        max_images: args.max_images,
        ..PromptOptions::default()
    };
    let prompts = PromptBuilder::from_model_dir(&args.model, options)
        .map_err(|e| model_err(e.to_string()))?;
    let model =
        TargetModel::load(&args.model, kind, device).map_err(|e| model_err(e.to_string()))?;
    let context_window = args
        .context_window
        .unwrap_or(model.text_config().max_position_embeddings)
        .min(model.text_config().max_position_embeddings);
    let info = model_info(args, &model, &prompts, context_window);
    let prompts = Arc::new(prompts);
    let limits = EngineLimits {
        context_window,
        queue_size: args.queue_size,
    };
    let engine = engine::start(model, prompts, limits);
    let request_limits = RequestLimits {
        max_new_tokens: args.max_new_tokens_limit,
        max_images: args.max_images,
        max_stop_strings: 16,
        max_stop_len: 256,
    };
    Ok(Loaded {
        service: GenerationService::new(engine, request_limits, info),
    })
}

fn model_info(
    args: &Args,
    model: &TargetModel,
    prompts: &PromptBuilder,
    context_window: usize,
) -> pb::ModelInfoResponse {
    let image_config = prompts.image_config();
    let (min_pixels, max_pixels) = (image_config.min_pixels, image_config.max_pixels);
    pb::ModelInfoResponse {
        model_type: model.family.model_type().to_string(),
        model_id: model_id(&args.model),
        dtype: format!("{:?}", model.kind()),
        device: args.device.clone(),
        vocab_size: model.text_config().vocab_size as u32,
        context_window: context_window as u32,
        max_new_tokens_limit: args.max_new_tokens_limit,
        max_images_per_request: args.max_images as u32,
        min_pixels: min_pixels as u64,
        max_pixels: max_pixels as u64,
        supported_modes: vec![pb::DecodingMode::Autoregressive as i32],
        default_mode: pb::DecodingMode::Autoregressive as i32,
    }
}

fn model_id(dir: &Path) -> String {
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    canonical
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    loaded: Loaded,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartupError> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<pb::generation_server::GenerationServer<GenerationService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| StartupError::Serve(e.to_string()))?;
    let generation = pb::generation_server::GenerationServer::new(loaded.service)
        .max_decoding_message_size(64 * 1024 * 1024);
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .add_service(generation)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
        .map_err(|e| StartupError::Serve(e.to_string()))
}

/// Binds the configured address.
pub async fn bind(args: &Args) -> Result<TcpListener, StartupError> {
    TcpListener::bind(args.listen)
        .await
        .map_err(|e| StartupError::Listen {
            addr: args.listen.to_string(),
            reason: e.to_string(),
        })
}
