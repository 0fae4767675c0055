//! Command-line and environment configuration of verifier-svc.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use glance_client::Mode;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "verifier-svc",
    version,
    about = "glance verifier: serves a target model (Qwen3-VL, Qwen2.5-VL, Llama, Qwen3) over gRPC"
)]
pub struct Args {
    /// Hugging Face model directory (config.json, safetensors, tokenizer; a VLM also its
    /// preprocessor config).
    #[arg(long, env = "GLANCE_MODEL")]
    pub model: PathBuf,
    /// Refuse to start unless the model's fingerprint (`--print-fingerprint`) is this: the
    /// deployment names the model it expects, and a wrong or half-copied directory fails loudly.
    #[arg(long, env = "GLANCE_EXPECT_FINGERPRINT")]
    pub expect_fingerprint: Option<String>,
    /// Print the model's fingerprint and exit (reads config.json and one embedding row; loads
    /// nothing else). Model loaders name versioned directories by it.
    #[arg(long)]
    pub print_fingerprint: bool,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, env = "GLANCE_DEVICE", default_value = "cpu")]
    pub device: String,
    /// `f32`, `bf16`, `f16`, or `auto` (f32 on CPU, bf16 on CUDA).
    #[arg(long, env = "GLANCE_DTYPE", default_value = "auto")]
    pub dtype: String,
    /// Address of the public gRPC server.
    #[arg(long, env = "GLANCE_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Serve TLS with this certificate chain (PEM) and --tls-key.
    #[arg(long, env = "GLANCE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "GLANCE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// With TLS: require client certificates that chain to this CA (PEM).
    #[arg(long, env = "GLANCE_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// API keys (one per line, `#` comments): the public API then answers UNAUTHENTICATED
    /// without `authorization: Bearer <key>`. Health stays open to probes.
    #[arg(long, env = "GLANCE_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Largest `max_new_tokens` a request may ask for.
    #[arg(long, env = "GLANCE_MAX_NEW_TOKENS_LIMIT", default_value_t = 4096)]
    pub max_new_tokens_limit: u32,
    /// Most images one request may carry.
    #[arg(long, env = "GLANCE_MAX_IMAGES", default_value_t = 8)]
    pub max_images: usize,
    /// Largest request message the transport accepts, in bytes.
    #[arg(long, env = "GLANCE_MAX_REQUEST_BYTES", default_value_t = 64 << 20)]
    pub max_request_bytes: usize,
    /// Most bytes of text all of a request's messages may hold together (default: what the
    /// context window can hold at the tokenizer's longest token, so nothing that could fit is
    /// refused and nothing that cannot is tokenized).
    #[arg(long, env = "GLANCE_MAX_TEXT_BYTES")]
    pub max_text_bytes: Option<usize>,
    /// Largest width x height of one image, read from its header before decoding (decompression
    /// bombs are refused without decoding a pixel; the processor resizes to --max-pixels later).
    #[arg(long, env = "GLANCE_MAX_DECODED_PIXELS", default_value_t = glance_input::DEFAULT_MAX_DECODED_PIXELS)]
    pub max_decoded_pixels: u64,
    /// Most encoded bytes of one image.
    #[arg(long, env = "GLANCE_MAX_IMAGE_BYTES", default_value_t = 32 << 20)]
    pub max_image_bytes: usize,
    /// Override the checkpoint's minimum pixels per image.
    #[arg(long, env = "GLANCE_MIN_PIXELS")]
    pub min_pixels: Option<usize>,
    /// Override the checkpoint's maximum pixels per image.
    #[arg(long, env = "GLANCE_MAX_PIXELS")]
    pub max_pixels: Option<usize>,
    /// What image transparency becomes: `composite` onto `--image-background` (what transformers'
    /// image processors and vLLM do) or `drop` (transformers' `load_image`: the colour channels
    /// as they are, so transparent pixels show whatever colour they carry, usually black).
    #[arg(long, env = "GLANCE_IMAGE_ALPHA", value_enum, default_value = "composite")]
    pub image_alpha: ImageAlpha,
    /// Whose resize and normalization image pixels reproduce bit for bit: `torchvision`
    /// (transformers' `Qwen2VLImageProcessor`, antialiased bicubic on uint8 tensors: what
    /// `AutoProcessor` picks whenever torchvision is installed, as in vLLM and SGLang
    /// deployments) or `pil` (`Qwen2VLImageProcessorPil`, Pillow's bicubic: transformers without
    /// torchvision, or `backend="pil"`). The two round differently, which can change greedy
    /// tokens after a few dozen steps: match the stack the model is compared against.
    #[arg(long, env = "GLANCE_IMAGE_BACKEND", value_enum, default_value_t = ImageBackend::Torchvision)]
    pub image_backend: ImageBackend,
    /// Background colour transparent images are composited onto, `R,G,B`.
    #[arg(long, env = "GLANCE_IMAGE_BACKGROUND", value_parser = parse_rgb, default_value = "255,255,255")]
    pub image_background: [u8; 3],
    /// Cap on prompt + generated tokens (default: the model's max_position_embeddings).
    #[arg(long, env = "GLANCE_CONTEXT_WINDOW")]
    pub context_window: Option<usize>,
    /// Generations that run at once (each on its own engine thread sharing the model).
    #[arg(long, env = "GLANCE_MAX_CONCURRENT", default_value_t = 1)]
    pub max_concurrent: usize,
    /// Requests that may wait for an engine thread; past running + waiting, requests are refused
    /// at once with RESOURCE_EXHAUSTED.
    #[arg(long, env = "GLANCE_MAX_QUEUE", default_value_t = 32)]
    pub max_queue: usize,
    /// On SIGTERM, waiting requests are refused at once with UNAVAILABLE and running generations
    /// may finish for this long; those still running then end with UNAVAILABLE. Keep
    /// Kubernetes' terminationGracePeriodSeconds above the preStop delay plus this.
    #[arg(long, env = "GLANCE_DRAIN_TIMEOUT_S", default_value_t = 120.0, value_parser = parse_seconds)]
    pub drain_timeout_s: f64,
    /// Prometheus metrics at http://ADDR/metrics, or `off`.
    #[arg(long, env = "GLANCE_METRICS_LISTEN", default_value = "127.0.0.1:9090")]
    pub metrics_listen: String,
    /// libtorch intra-op threads (default: libtorch's choice).
    #[arg(long, env = "GLANCE_THREADS")]
    pub threads: Option<i32>,
    /// drafter-svc address (e.g. http://127.0.0.1:50061). Without it only autoregressive and
    /// prompt-lookup decoding are served.
    #[arg(long, env = "GLANCE_DRAFTER_URL")]
    pub drafter: Option<String>,
    /// For an `https://` drafter URL: the CA (PEM) the drafters' certificates chain to.
    #[arg(long, env = "GLANCE_DRAFTER_CA")]
    pub drafter_ca: Option<PathBuf>,
    /// The name the drafters' certificates must carry (default: the drafter URL's host, e.g. the
    /// headless Service's name; pods are dialed by address but checked against this).
    #[arg(long, env = "GLANCE_DRAFTER_TLS_DOMAIN")]
    pub drafter_tls_domain: Option<String>,
    /// This verifier's client certificate (PEM) for mTLS to the drafters, with --drafter-client-key.
    #[arg(long, env = "GLANCE_DRAFTER_CLIENT_CERT")]
    pub drafter_client_cert: Option<PathBuf>,
    #[arg(long, env = "GLANCE_DRAFTER_CLIENT_KEY")]
    pub drafter_client_key: Option<PathBuf>,
    /// Per-round deadline for the drafter's tree; a later tree is not waited for and the round
    /// is decoded as a greedy step.
    #[arg(long, env = "GLANCE_DRAFTER_DEADLINE_MS", default_value_t = 1000)]
    pub drafter_deadline_ms: u64,
    /// Mode for requests that name none (default: auto with a drafter, else autoregressive).
    #[arg(long, env = "GLANCE_DEFAULT_MODE", value_enum)]
    pub default_mode: Option<Mode>,
    /// Default tree budget (nodes verified per round, root excluded).
    #[arg(long, env = "GLANCE_TREE_BUDGET", default_value_t = 31)]
    pub tree_budget: usize,
    /// Default candidates per block offset.
    #[arg(long, env = "GLANCE_BRANCH_K", default_value_t = 8)]
    pub branch_k: usize,
    /// Largest tree budget a request may ask for.
    #[arg(long, env = "GLANCE_MAX_TREE_BUDGET", default_value_t = 256)]
    pub max_tree_budget: usize,
    /// Block size of the in-process prompt-lookup drafter (it drafts up to this minus one).
    #[arg(long, env = "GLANCE_PROMPT_LOOKUP_BLOCK", default_value_t = 16)]
    pub prompt_lookup_block: usize,
}

/// `--image-alpha`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageAlpha {
    Composite,
    Drop,
}

/// `--image-backend`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageBackend {
    Torchvision,
    Pil,
}

impl Args {
    /// The public server's TLS files.
    pub fn server_tls(&self) -> glance_security::ServerTlsFiles {
        glance_security::ServerTlsFiles {
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            client_ca: self.tls_client_ca.clone(),
        }
    }

    /// The drafter hop's TLS files.
    pub fn drafter_tls(&self) -> glance_security::ClientTlsFiles {
        glance_security::ClientTlsFiles {
            ca: self.drafter_ca.clone(),
            cert: self.drafter_client_cert.clone(),
            key: self.drafter_client_key.clone(),
            domain: self.drafter_tls_domain.clone(),
        }
    }

    /// Whose image processor the pixels reproduce.
    pub fn image_backend(&self) -> glance_input::ImageBackend {
        match self.image_backend {
            ImageBackend::Torchvision => glance_input::ImageBackend::Torchvision,
            ImageBackend::Pil => glance_input::ImageBackend::Pil,
        }
    }

    /// The input pipeline's handling of transparency.
    pub fn alpha(&self) -> glance_input::Alpha {
        match self.image_alpha {
            ImageAlpha::Composite => glance_input::Alpha::Composite(self.image_background),
            ImageAlpha::Drop => glance_input::Alpha::Drop,
        }
    }
}

/// A non-negative, finite number of seconds.
fn parse_seconds(text: &str) -> Result<f64, String> {
    let seconds: f64 = text.trim().parse().map_err(|e| format!("{text:?}: {e}"))?;
    if seconds.is_finite() && seconds >= 0.0 {
        Ok(seconds)
    } else {
        Err(format!("{text:?}: expected a non-negative number of seconds"))
    }
}

fn parse_rgb(text: &str) -> Result<[u8; 3], String> {
    let channels: Vec<u8> = text
        .split(',')
        .map(|c| c.trim().parse::<u8>().map_err(|e| format!("{c:?}: {e}")))
        .collect::<Result<_, _>>()?;
    channels
        .try_into()
        .map_err(|c: Vec<u8>| format!("expected R,G,B (three values 0-255), got {} values", c.len()))
}
