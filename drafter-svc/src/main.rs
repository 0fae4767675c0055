use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use drafter_svc::draft_vocab::DraftVocabChoice;
use drafter_svc::service::{DrafterService, SessionLimits};
use drafter_svc::{engines, testing};
use glance_models::weights::{parse_device, parse_kind};
use glance_models::TargetConfig;
use glance_proto::drafter::v1 as pb;
use glance_spec::prompt_lookup::PromptLookupEngine;
use glance_spec::session::DraftEngine;
use tch::{Device, Kind};
use tokio::net::TcpListener;

#[derive(Parser)]
#[command(
    name = "drafter-svc",
    version,
    about = "glance drafter: block-diffusion draft head and candidate trees over gRPC"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the internal Drafter API.
    Serve(ServeArgs),
    /// Write a randomly initialized draft head for a target (a starting point for training).
    Init(InitArgs),
    /// Train a draft head on the target's own states (CPU or CUDA).
    Train(TrainArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Kind_ {
    /// The GLANCE block head (needs --head and --target).
    BlockHead,
    /// An EAGLE-3 head in the public layout (needs --head and --target; --eagle-depth).
    Eagle3,
    /// Prompt-lookup n-gram drafting (no weights).
    PromptLookup,
    /// Test drafter: the known greedy continuation (needs --oracle-file).
    TestOracle,
    /// Test drafter: random trees.
    TestGarbage,
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(long, env = "GLANCE_DRAFTER_KIND", value_enum, default_value = "block-head")]
    kind: Kind_,
    /// Draft head directory (config.json + model.safetensors, DFlash layout).
    #[arg(long, env = "GLANCE_DRAFTER_HEAD")]
    head: Option<PathBuf>,
    /// Target model directory: its embedding and LM head are read from here, and its
    /// fingerprint is checked against the verifier's.
    #[arg(long, env = "GLANCE_DRAFTER_TARGET")]
    target: Option<PathBuf>,
    /// Refuse to start unless the target's fingerprint (`verifier-svc --print-fingerprint`) is
    /// this.
    #[arg(long, env = "GLANCE_DRAFTER_EXPECT_TARGET_FINGERPRINT")]
    expect_target_fingerprint: Option<String>,
    #[arg(long, env = "GLANCE_DRAFTER_DEVICE", default_value = "cpu")]
    device: String,
    /// `f32`, `bf16`, `f16` or `auto` (f32 on CPU, bf16 on CUDA).
    #[arg(long, env = "GLANCE_DRAFTER_DTYPE", default_value = "auto")]
    dtype: String,
    #[arg(long, env = "GLANCE_DRAFTER_LISTEN", default_value = "127.0.0.1:50061")]
    listen: std::net::SocketAddr,
    /// Serve TLS with this certificate chain (PEM) and --tls-key; verifiers then use an
    /// `https://` drafter URL and --drafter-ca.
    #[arg(long, env = "GLANCE_DRAFTER_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    #[arg(long, env = "GLANCE_DRAFTER_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// With TLS: admit only clients (verifiers) whose certificates chain to this CA (mTLS).
    #[arg(long, env = "GLANCE_DRAFTER_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf>,
    /// Prometheus metrics at http://ADDR/metrics, or `off`.
    #[arg(long, env = "GLANCE_DRAFTER_METRICS_LISTEN", default_value = "127.0.0.1:9091")]
    metrics_listen: String,
    /// Context positions one session may hold.
    #[arg(long, env = "GLANCE_DRAFTER_MAX_CONTEXT", default_value_t = 32768)]
    max_context: usize,
    /// Draft sessions (generations) open at once; more are refused with RESOURCE_EXHAUSTED and the
    /// verifier decodes them without a drafter. Each holds a draft KV cache, and the runtime has a
    /// worker thread per session (a session drafts on the worker that received its request).
    #[arg(long, env = "GLANCE_DRAFTER_MAX_SESSIONS", default_value_t = 64)]
    max_sessions: usize,
    /// A session that receives nothing for this long is closed and its cache freed (an abandoned
    /// stream; a verifier that comes back re-sends its context to a fresh session).
    #[arg(long, env = "GLANCE_DRAFTER_SESSION_IDLE_TIMEOUT_S", default_value_t = 300.0)]
    session_idle_timeout_s: f64,
    /// On SIGTERM the drafter turns NOT_SERVING and refuses new sessions with UNAVAILABLE; open
    /// sessions may go on for this long, then end with UNAVAILABLE (their verifiers decode on
    /// greedily and open their next session elsewhere). Keep Kubernetes'
    /// terminationGracePeriodSeconds above the preStop delay plus this.
    #[arg(long, env = "GLANCE_DRAFTER_DRAIN_TIMEOUT_S", default_value_t = 120.0)]
    drain_timeout_s: f64,
    /// Block head: which tokens a draft pass scores. `auto`: the most frequent tokens of the
    /// head's training responses (`draft_vocab.json` in the head directory, written by `train`)
    /// covering 98% of them (at least 4,096) when the directory has that file, else the whole
    /// vocabulary; `all`: the whole vocabulary; N: the N most frequent of the file's; P%: as many
    /// of the file's as cover P% of the responses' tokens. The LM-head matmul of a draft pass
    /// shrinks from the whole vocabulary to those rows. Tokens outside are never drafted; the
    /// output is the same.
    #[arg(long, env = "GLANCE_DRAFTER_DRAFT_VOCAB", default_value_t = DraftVocabChoice::Auto)]
    draft_vocab: DraftVocabChoice,
    /// EAGLE-3: passes per tree after the first, so trees reach `depth + 1` tokens (EAGLE's
    /// own settings: 5 to 7).
    #[arg(long, env = "GLANCE_DRAFTER_EAGLE_DEPTH", default_value_t = 6)]
    eagle_depth: usize,
    /// Test drafters: block size and vocabulary.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 0)]
    vocab_size: u32,
    /// Test oracle: JSON array of token sequences (prompt + greedy continuation).
    #[arg(long)]
    oracle_file: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Test garbage drafter: share of trees that break the protocol.
    #[arg(long, default_value_t = 0.0)]
    malformed_rate: f64,
    /// Fault injection: every N-th round of a session stalls for --stall-ms first (0: never).
    #[arg(long, default_value_t = 0)]
    stall_every: usize,
    #[arg(long, default_value_t = 0)]
    stall_ms: u64,
    /// Fault injection: every N-th round of a session panics inside the engine (0: never).
    #[arg(long, default_value_t = 0)]
    panic_every: usize,
    /// Ablation: zero every tap state the head receives (it then drafts from the tokens alone).
    #[arg(long)]
    zero_states: bool,
}

/// The shape of a fresh draft head (`init`, and `train` without `--init`).
#[derive(clap::Args)]
struct HeadShapeArgs {
    #[arg(long, default_value_t = 1)]
    layers: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Target layers to read (default: the DFlash rule for the target's depth).
    #[arg(long, value_delimiter = ',')]
    taps: Option<Vec<usize>>,
    /// Token id used as the mask (must not be a token the model produces; default: a reserved
    /// special token of the target's tokenizer).
    #[arg(long)]
    mask_token_id: Option<i64>,
    /// Initial weight of the head's final norm (below 1: smaller first logits, see HeadSpec).
    #[arg(long, default_value_t = 1.0)]
    output_norm_init: f64,
    /// Start the head's layers as copies of these target layers, one per head layer (a head
    /// trained on little data starts from the target's own weights; see HeadSpec).
    #[arg(long, value_delimiter = ',')]
    copy_target_layers: Option<Vec<usize>>,
}

impl HeadShapeArgs {
    fn spec(self, seed: u64) -> drafter_svc::init::HeadSpec {
        drafter_svc::init::HeadSpec {
            tap_layers: self.taps,
            mask_token_id: self.mask_token_id,
            output_norm_init: self.output_norm_init,
            copy_target_layers: self.copy_target_layers,
            ..drafter_svc::init::HeadSpec::new(self.layers, self.block_size, seed)
        }
    }
}

#[derive(clap::Args)]
struct InitArgs {
    /// Which head: the GLANCE block head (DFlash layout) or an EAGLE-3 head (its public layout;
    /// the target's width, --taps three layers or EAGLE's default).
    #[arg(long, value_enum, default_value = "block-head")]
    kind: HeadKind,
    /// Target model directory the head is for.
    #[arg(long)]
    target: PathBuf,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    shape: HeadShapeArgs,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Which head: the GLANCE block head or an EAGLE-3 head (trained with EAGLE-3's
    /// training-time test on the same rows).
    #[arg(long, value_enum, default_value = "block-head")]
    kind: HeadKind,
    /// EAGLE-3: unroll steps of the training-time test.
    #[arg(long, default_value_t = 7)]
    ttt_length: usize,
    /// EAGLE-3: tokens of a fresh head's draft vocabulary (the most frequent response tokens).
    #[arg(long, default_value_t = 32000)]
    draft_vocab: usize,
    /// EAGLE-3: expansion passes of the trees the held-out evaluation grows.
    #[arg(long, default_value_t = 6)]
    eval_depth: usize,
    /// Target model directory.
    #[arg(long)]
    target: PathBuf,
    /// Output head directory (config.json, model.safetensors, train_state.safetensors).
    #[arg(long)]
    out: PathBuf,
    /// Start from this head (default: a fresh one, see --layers / --taps).
    #[arg(long)]
    init: Option<PathBuf>,
    /// Training prompts: `toyworld`, `sharegpt:PATH` (ShareGPT V3's first human turns, held out
    /// by conversation id) or a JSON-lines file of {"prompt", "image"?}.
    #[arg(long, default_value = "toyworld")]
    data: String,
    #[arg(long, default_value_t = 2000)]
    rows: usize,
    #[arg(long, default_value_t = 50)]
    held_out_rows: usize,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 3000)]
    steps: usize,
    /// Blocks sampled per row and step.
    #[arg(long, default_value_t = 16)]
    anchors: usize,
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    #[arg(long, default_value_t = 0.04)]
    warmup_ratio: f64,
    /// Loss decay over block offsets (7 for B = 16).
    #[arg(long, default_value_t = 7.0)]
    gamma: f64,
    /// Self-distillation: keep the target's top-k distribution at every training response token
    /// (one more teacher-forced pass per row, cached beside the rows) and mix its cross-entropy
    /// into each label's loss; 0: the greedy token alone.
    #[arg(long, default_value_t = 0)]
    distill_top_k: usize,
    /// The soft labels' share of each label's loss (with --distill-top-k).
    #[arg(long, default_value_t = 0.5)]
    distill_weight: f64,
    #[arg(long, default_value_t = 500)]
    eval_every: usize,
    #[arg(long, default_value_t = 500)]
    checkpoint_every: usize,
    /// Continue from the state in --out (the regenerated rows are reused either way).
    #[arg(long)]
    resume: bool,
    /// Prompts regenerated together by padded, batched greedy decoding.
    #[arg(long, default_value_t = 16)]
    regen_batch: usize,
    /// A sampled softmax over this many of the training responses' most frequent tokens (plus
    /// each step's labels and --loss-negatives random ids); 0: the full vocabulary.
    #[arg(long, default_value_t = 0)]
    loss_vocab: usize,
    /// Uniform random negatives per step of the sampled softmax.
    #[arg(long, default_value_t = 512)]
    loss_negatives: usize,
    /// The fresh head's shape (without --init).
    #[command(flatten)]
    shape: HeadShapeArgs,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    threads: Option<i32>,
    /// The dtype the head's model.safetensors is written in (`f32` or `bf16`: half the bytes;
    /// training runs in f32 either way, and a resumed run continues from the f32 weights).
    #[arg(long, default_value = "f32")]
    save_dtype: String,
}

fn main() {
    let command = Cli::parse().command;
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Command::Serve(args) = &command {
        // Sessions draft on the runtime's workers (see `service::worker_threads`).
        runtime.worker_threads(drafter_svc::service::worker_threads(args.max_sessions));
    }
    let runtime = runtime.enable_all().build().unwrap_or_else(|e| {
        eprintln!("drafter-svc: cannot start the runtime: {e}");
        std::process::exit(1);
    });
    let result = runtime.block_on(async {
        let telemetry = glance_telemetry::init("drafter-svc").map_err(|e| e.to_string())?;
        let result = match command {
            Command::Serve(args) => serve(args).await,
            Command::Init(args) => init(args),
            Command::Train(args) => train(args),
        };
        telemetry.shutdown();
        result
    });
    if let Err(e) = result {
        eprintln!("drafter-svc: {e}");
        std::process::exit(1);
    }
}

fn device_and_kind(device: &str, dtype: &str) -> Result<(Device, Kind), String> {
    let device =
        parse_device(device).ok_or_else(|| format!("--device {device:?}: expected cpu, cuda or cuda:N"))?;
    let kind = match dtype {
        "auto" if device == Device::Cpu => Kind::Float,
        "auto" => Kind::BFloat16,
        name => {
            parse_kind(name).ok_or_else(|| format!("--dtype {name:?}: expected auto, f32, bf16 or f16"))?
        }
    };
    Ok((device, kind))
}

fn build_engine(args: &ServeArgs, device: Device, kind: Kind) -> Result<Box<dyn DraftEngine>, String> {
    let need = |what: &Option<PathBuf>, flag: &str| {
        what.clone().ok_or_else(|| format!("--kind {:?} needs {flag}", args.kind))
    };
    let explicit_vocab = matches!(args.draft_vocab, DraftVocabChoice::Top(_) | DraftVocabChoice::Covering(_));
    if explicit_vocab && !matches!(args.kind, Kind_::BlockHead) {
        return Err(format!(
            "--draft-vocab is for --kind block-head, not {:?} (an EAGLE-3 head carries its own, d2t)",
            args.kind
        ));
    }
    let engine: Box<dyn DraftEngine> = match args.kind {
        Kind_::BlockHead => {
            let head = need(&args.head, "--head")?;
            let target = need(&args.target, "--target")?;
            Box::new(
                engines::BlockHeadEngine::load(
                    &head,
                    &target,
                    kind,
                    device,
                    args.max_context,
                    args.draft_vocab,
                )
                .map_err(|e| e.to_string())?,
            )
        }
        Kind_::Eagle3 => {
            let head = need(&args.head, "--head")?;
            let target = need(&args.target, "--target")?;
            Box::new(
                engines::Eagle3Engine::load(&head, &target, kind, device, args.max_context, args.eagle_depth)
                    .map_err(|e| e.to_string())?,
            )
        }
        Kind_::PromptLookup => {
            let target = need(&args.target, "--target")?;
            let config = TargetConfig::read(&target).map_err(|e| e.to_string())?;
            Box::new(PromptLookupEngine::new(args.block_size, config.text.vocab_size as usize))
        }
        Kind_::TestOracle => {
            let file = need(&args.oracle_file, "--oracle-file")?;
            let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            Box::new(testing::OracleEngine::from_json(&text, args.block_size, args.vocab_size, args.seed)?)
        }
        Kind_::TestGarbage => Box::new(testing::GarbageEngine::new(
            args.block_size,
            args.vocab_size,
            args.seed,
            args.malformed_rate,
        )),
    };
    let engine: Box<dyn DraftEngine> = match args.zero_states {
        true => Box::new(testing::ZeroStatesEngine { inner: engine }),
        false => engine,
    };
    if args.stall_every > 0 || args.panic_every > 0 {
        return Ok(Box::new(testing::FaultyEngine {
            inner: engine,
            stall_every: args.stall_every,
            stall: Duration::from_millis(args.stall_ms),
            panic_every: args.panic_every,
        }));
    }
    Ok(engine)
}

async fn serve(args: ServeArgs) -> Result<(), String> {
    let (device, kind) = device_and_kind(&args.device, &args.dtype)?;
    let tls = glance_security::ServerTlsFiles {
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
        client_ca: args.tls_client_ca.clone(),
    }
    .config()
    .map_err(|e| e.to_string())?;
    if args.metrics_listen != "off" {
        let addr = args
            .metrics_listen
            .parse()
            .map_err(|e| format!("--metrics-listen {}: {e}", args.metrics_listen))?;
        glance_telemetry::serve_metrics(addr, &drafter_svc::metrics::buckets()).map_err(|e| e.to_string())?;
        drafter_svc::metrics::register();
    }
    let engine: Arc<dyn DraftEngine> = Arc::from(build_engine(&args, device, kind)?);
    if let Some(expected) = &args.expect_target_fingerprint {
        let loaded = engine.handshake().target_fingerprint;
        if loaded != *expected {
            return Err(format!(
                "--target's fingerprint is {loaded:?}, but --expect-target-fingerprint says {expected}: not the target this deployment names"
            ));
        }
    }
    let listener =
        TcpListener::bind(args.listen).await.map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<pb::drafter_server::DrafterServer<DrafterService>>().await;
    let limits = SessionLimits {
        max_sessions: args.max_sessions,
        max_context: args.max_context,
        idle_timeout: Duration::try_from_secs_f64(args.session_idle_timeout_s)
            .map_err(|e| format!("--session-idle-timeout-s {}: {e}", args.session_idle_timeout_s))?,
    };
    let drain_timeout = Duration::try_from_secs_f64(args.drain_timeout_s)
        .map_err(|e| format!("--drain-timeout-s {}: {e}", args.drain_timeout_s))?;
    let service = DrafterService::new(engine, device, limits);
    let shutdown = drain_on_signal(service.drain(), health_reporter, drain_timeout);
    let drafter = pb::drafter_server::DrafterServer::new(service)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    // Scripts and tests wait for this line.
    println!("drafter-svc listening on {addr}");
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls).map_err(|e| format!("TLS: {e}"))?;
    }
    server
        .initial_stream_window_size(Some(glance_proto::drafter::HOP_WINDOW))
        .initial_connection_window_size(Some(glance_proto::drafter::HOP_WINDOW))
        .add_service(health_service)
        .add_service(drafter)
        .serve_with_incoming_shutdown(glance_proto::transport::accepted_connections(listener), shutdown)
        .await
        .map_err(|e| e.to_string())
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum HeadKind {
    BlockHead,
    Eagle3,
}

fn init(args: InitArgs) -> Result<(), String> {
    match args.kind {
        HeadKind::BlockHead => {
            let spec = args.shape.spec(args.seed);
            drafter_svc::init::write_random_head(&args.target, &args.out, &spec)
                .map_err(|e| e.to_string())?;
        }
        HeadKind::Eagle3 => {
            let spec = drafter_svc::init::Eagle3Spec {
                tap_layers: args.shape.taps,
                ..drafter_svc::init::Eagle3Spec::new(args.seed)
            };
            drafter_svc::init::write_random_eagle3_head(&args.target, &args.out, &spec)
                .map_err(|e| e.to_string())?;
        }
    }
    println!("wrote a random {:?} head to {}", args.kind, args.out.display());
    Ok(())
}

fn train(args: TrainArgs) -> Result<(), String> {
    use drafter_svc::train::{DataSource, TrainConfig};
    if let Some(threads) = args.threads {
        tch::set_num_threads(threads);
    }
    let device = parse_device(&args.device).ok_or_else(|| format!("--device {:?}", args.device))?;
    let data = DataSource::parse(&args.data, args.seed);
    let fresh = args.shape.spec(args.seed);
    let config = TrainConfig {
        target: args.target,
        out: args.out,
        init: args.init,
        fresh,
        data,
        rows: args.rows,
        held_out_rows: args.held_out_rows,
        max_new_tokens: args.max_new_tokens,
        steps: args.steps,
        anchors: args.anchors,
        peak_lr: args.lr,
        warmup_ratio: args.warmup_ratio,
        gamma: args.gamma,
        distill: distill(args.distill_top_k, args.distill_weight)?,
        eval_every: args.eval_every,
        checkpoint_every: args.checkpoint_every,
        resume: args.resume,
        seed: args.seed,
        device,
        regen_batch: args.regen_batch,
        loss_vocab: match args.loss_vocab {
            0 => drafter_svc::train::LossVocab::Full,
            frequent => drafter_svc::train::LossVocab::Sampled { frequent, negatives: args.loss_negatives },
        },
        save_kind: glance_models::weights::parse_kind(&args.save_dtype)
            .ok_or_else(|| format!("--save-dtype: f32, bf16 or f16, not {}", args.save_dtype))?,
    };
    if config.distill.is_some() && matches!(args.kind, HeadKind::Eagle3) {
        return Err(
            "--distill-top-k trains the block head; EAGLE-3's training-time test scores greedy tokens".into(),
        );
    }
    let trained = match args.kind {
        HeadKind::BlockHead => {
            tokio::task::block_in_place(|| drafter_svc::train::train(&config, |line| println!("{line}")))
        }
        HeadKind::Eagle3 => {
            let eagle = drafter_svc::train_eagle3::Eagle3TrainConfig {
                taps: config.fresh.tap_layers.clone(),
                base: config,
                ttt_length: args.ttt_length,
                draft_vocab: args.draft_vocab,
                eval_depth: args.eval_depth,
            };
            tokio::task::block_in_place(|| {
                drafter_svc::train_eagle3::train_eagle3(&eagle, |line| println!("{line}"))
            })
        }
    };
    trained.map(|_| ()).map_err(|e| e.to_string())
}

/// `--distill-top-k` / `--distill-weight` as a training option (None without soft labels).
fn distill(top_k: usize, weight: f64) -> Result<Option<drafter_svc::train::Distill>, String> {
    if !(0.0..=1.0).contains(&weight) {
        return Err(format!("--distill-weight is a share of the loss, in [0, 1], not {weight}"));
    }
    Ok((top_k > 0).then_some(drafter_svc::train::Distill { top_k, weight }))
}

/// Resolves on SIGTERM (or Ctrl-C) once the drain has begun: readiness NOT_SERVING, new sessions
/// refused; the server then waits for the open ones, which the drain timeout ends if they last.
async fn drain_on_signal(
    drain: drafter_svc::service::SessionDrain,
    health: tonic_health::server::HealthReporter,
    timeout: Duration,
) {
    shutdown_signal().await;
    tracing::info!(?timeout, "draining: new sessions refused, open ones finishing");
    drain.begin();
    health.set_not_serving::<pb::drafter_server::DrafterServer<DrafterService>>().await;
    tokio::spawn(async move {
        tokio::time::sleep(timeout).await;
        tracing::warn!(?timeout, "drain timeout: ending the sessions still open");
        drain.expire();
    });
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
}
