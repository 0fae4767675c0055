//! `glance`: a small command-line client of the public API (generate, stream, compare, model info).

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, Subcommand};
use glance_client::v1 as pb;
use glance_client::{decode_ms_per_token, Client, Mode, Request, Sampling, Server};
use tonic_health::pb::health_check_response::ServingStatus;

#[derive(Parser)]
#[command(name = "glance", version, about = "Client for a glance verifier-svc")]
struct Cli {
    /// Address of verifier-svc (`https://` with --tls-ca).
    #[arg(long, env = "GLANCE_ADDR", default_value = "http://127.0.0.1:50051")]
    addr: String,
    /// API key, sent as `authorization: Bearer <key>`.
    #[arg(long, env = "GLANCE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The CA (PEM) the server's certificate chains to (for an https address).
    #[arg(long, env = "GLANCE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// The name the server's certificate must carry (default: the address's host).
    #[arg(long, env = "GLANCE_TLS_DOMAIN")]
    tls_domain: Option<String>,
    /// A client certificate and key (PEM), for a server that requires them (mTLS).
    #[arg(long, env = "GLANCE_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    #[arg(long, env = "GLANCE_TLS_KEY")]
    tls_key: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    fn server(&self) -> Server {
        Server {
            addr: self.addr.clone(),
            tls: glance_security::ClientTlsFiles {
                ca: self.tls_ca.clone(),
                cert: self.tls_cert.clone(),
                key: self.tls_key.clone(),
                domain: self.tls_domain.clone(),
            },
            api_key: self.api_key.clone(),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// One request; prints the answer, usage and timings.
    Generate(GenerateArgs),
    /// Like generate, printing text as it streams in.
    Stream(GenerateArgs),
    /// The same request autoregressively and in --mode; prints the answer, tau and the speed-up.
    Compare(CompareArgs),
    /// Prints the served model and its limits.
    Info,
    /// Asks grpc.health.v1 (no API key needed): exits 0 when SERVING, 1 otherwise. A container
    /// health check that loads no libtorch.
    Health {
        /// `""`: the process; `glance.v1.Generation`: ready to serve; `glance.drafter`: a drafter
        /// is connected (verifier); `glance.drafter.v1.Drafter`: a drafter ready for sessions.
        #[arg(long, default_value = "")]
        service: String,
    },
}

#[derive(clap::Args)]
struct CompareArgs {
    #[command(flatten)]
    request: GenerateArgs,
    /// Times each decoding runs, alternating; the speed-up is the ratio of the median ms/token (one
    /// short request's time on a shared machine varies by tens of percent).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeats: u32,
}

#[derive(clap::Args, Clone)]
struct GenerateArgs {
    /// The user's text.
    #[arg(long)]
    prompt: String,
    /// Image files, placed before the text in the user message.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// An optional system message.
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: u32,
    /// Stop strings.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Token ids that end the generation.
    #[arg(long = "stop-token-id")]
    stop_token_ids: Vec<u32>,
    #[arg(long, value_enum, default_value = "default")]
    mode: Mode,
    /// Tree budget (0: the server's default).
    #[arg(long, default_value_t = 0)]
    tree_budget: u32,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample from the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Sample from the most likely tokens holding this much probability (default 1: all).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens less likely than this times the most likely one (0: none).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Seed of the draws (default: the server's pick, printed; `compare` picks one for both runs).
    #[arg(long)]
    seed: Option<u64>,
    /// Report each token's log-probability (printed after the answer; in --json output).
    #[arg(long)]
    logprobs: bool,
    /// With each log-probability, the N most likely tokens (0-20; implies --logprobs).
    #[arg(long, default_value_t = 0)]
    top_logprobs: u32,
    /// Print the response as JSON (token ids included).
    #[arg(long)]
    json: bool,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("glance: {e}");
        std::process::exit(1);
    }
}

type Error = Box<dyn std::error::Error>;

async fn run(cli: Cli) -> Result<(), Error> {
    let server = cli.server();
    if let Command::Health { service } = &cli.command {
        return health(&server, service).await;
    }
    let mut client = server.connect().await?;
    match cli.command {
        Command::Health { .. } => unreachable!("answered above"),
        Command::Info => {
            let info = client.model_info(pb::ModelInfoRequest {}).await?.into_inner();
            println!("{info:#?}");
        }
        Command::Generate(args) => {
            let started = Instant::now();
            let response = client.generate(build_request(&args, args.mode)?).await?.into_inner();
            if args.json {
                print_json(&response);
            } else {
                println!("{}", response.text);
                print_summary(&response, started);
            }
        }
        Command::Stream(args) => stream(&mut client, &args).await?,
        Command::Compare(args) => compare(&mut client, &args).await?,
    }
    Ok(())
}

/// grpc.health.v1 Check of `service`: Ok when SERVING.
async fn health(server: &Server, service: &str) -> Result<(), Error> {
    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel().await?);
    let request = tonic_health::pb::HealthCheckRequest { service: service.to_string() };
    let status = health.check(request).await?.into_inner().status();
    println!("{:?}: {}", service, status.as_str_name());
    match status {
        ServingStatus::Serving => Ok(()),
        _ => Err(format!("{service:?} is {}", status.as_str_name()).into()),
    }
}

async fn stream(client: &mut Client, args: &GenerateArgs) -> Result<(), Error> {
    use std::io::Write;
    let started = Instant::now();
    let mut stream = client.generate_stream(build_request(args, args.mode)?).await?.into_inner();
    let mut last = pb::GenerateResponse::default();
    while let Some(chunk) = stream.message().await? {
        print!("{}", chunk.text);
        std::io::stdout().flush()?;
        last.token_ids.extend(chunk.token_ids);
        last.logprobs.extend(chunk.logprobs);
        if chunk.finish_reason != 0 {
            last.finish_reason = chunk.finish_reason;
            last.usage = chunk.usage;
            last.timings = chunk.timings;
            last.speculative = chunk.speculative;
            last.seed = chunk.seed;
        }
    }
    println!();
    print_summary(&last, started);
    Ok(())
}

/// Autoregressive first, then the requested mode (auto by default): the speed-up is the ratio of
/// decode milliseconds per token, both measured by the server on this request.
async fn compare(client: &mut Client, compare: &CompareArgs) -> Result<(), Error> {
    let args = &compare.request;
    let mode = if matches!(args.mode, Mode::Default | Mode::Autoregressive) { Mode::Auto } else { args.mode };
    let (mut ar_times, mut spec_times, mut identical) = (Vec::new(), Vec::new(), true);
    let mut last = None;
    for _ in 0..compare.repeats {
        let started = Instant::now();
        let ar = client.generate(build_request(args, Mode::Autoregressive)?).await?.into_inner();
        // Sampled: the same seed for both, so the same tokens are expected.
        let args = &GenerateArgs { seed: args.seed.or(ar.seed), ..args.clone() };
        let spec = client.generate(build_request(args, mode)?).await?.into_inner();
        identical &= ar.token_ids == spec.token_ids;
        ar_times.push(decode_ms_per_token(&ar));
        spec_times.push(decode_ms_per_token(&spec));
        last = Some((ar, spec, started));
    }
    let Some((ar, spec, started)) = last else { return Err("--repeats must be at least 1".into()) };
    println!("{}", spec.text);
    print_summary(&spec, started);
    if identical && !ar.logprobs.is_empty() {
        let largest = ar.logprobs.iter().zip(&spec.logprobs).map(|(a, s)| (a.logprob - s.logprob).abs());
        println!(
            "-- log-probabilities: largest |difference| to autoregressive {:.2e}",
            largest.fold(0.0, f32::max)
        );
    }
    let (ar_ms, spec_ms) = (median(&mut ar_times), median(&mut spec_times));
    let tau = spec.speculative.map(|s| s.mean_accepted_length).unwrap_or(1.0);
    println!(
        "-- {}: tau {tau:.2} | {spec_ms:.2} ms/token vs autoregressive {ar_ms:.2} ms/token{} = speed-up {:.2}x | tokens identical to autoregressive: {identical}",
        pb::DecodingMode::from(mode).as_str_name(),
        if compare.repeats > 1 { format!(" (medians of {} alternated runs)", compare.repeats) } else { String::new() },
        ar_ms / spec_ms
    );
    if !identical {
        return Err("speculative output differs from autoregressive decoding".into());
    }
    Ok(())
}

/// The median of `values` (the upper one of an even count).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn build_request(args: &GenerateArgs, mode: Mode) -> Result<pb::GenerateRequest, Error> {
    let request = Request {
        system: args.system.clone(),
        prompt: args.prompt.clone(),
        images: Vec::new(),
        max_new_tokens: args.max_new_tokens,
        stop: args.stop.clone(),
        stop_token_ids: args.stop_token_ids.clone(),
        mode: mode.into(),
        tree_budget: args.tree_budget,
        sampling: Sampling {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            seed: args.seed,
        },
        logprobs: (args.logprobs || args.top_logprobs > 0).then_some(args.top_logprobs),
    };
    Ok(request.with_image_files(&args.images)?.to_proto())
}

fn print_summary(response: &pb::GenerateResponse, started: Instant) {
    let finish = pb::FinishReason::try_from(response.finish_reason).map(|f| f.as_str_name()).unwrap_or("?");
    let usage = response.usage.unwrap_or_default();
    let timings = response.timings.unwrap_or_default();
    println!(
        "-- finish {finish} | prompt {} tokens ({} image) | generated {} | prefill {:.1} ms | decode {:.1} ms ({:.1} tok/s) | wall {:.1} ms",
        usage.prompt_tokens,
        usage.image_tokens,
        usage.generated_tokens,
        timings.prefill_ms,
        timings.decode_ms,
        timings.decode_tokens_per_second,
        started.elapsed().as_secs_f64() * 1e3
    );
    if let Some(seed) = response.seed {
        println!("-- sampled with seed {seed}");
    }
    for lp in &response.logprobs {
        let top: Vec<String> =
            lp.top_logprobs.iter().map(|t| format!("{} {:.4}", t.token_id, t.logprob)).collect();
        println!("-- token {} logprob {:.4}  top: {}", lp.token_id, lp.logprob, top.join(", "));
    }
    if let Some(s) = &response.speculative {
        println!(
            "-- {} | rounds {} | tau {:.2} | draft {:.1} ms, hop {:.1} ms, verify {:.1} ms | {} fallback rounds",
            pb::DecodingMode::try_from(s.mode).map(|m| m.as_str_name()).unwrap_or("?"),
            s.rounds,
            s.mean_accepted_length,
            s.draft_ms,
            s.hop_ms,
            s.verify_ms,
            s.fallback_rounds
        );
        if let Some(auto) = &s.auto {
            println!(
                "-- auto: {} greedy steps ({} while drafting), {} trees declined, {} stale, {:.1} nodes verified per round, calibration error {:.2} tokens/round",
                auto.greedy_steps + auto.overlapped_steps,
                auto.overlapped_steps,
                auto.declined_trees,
                auto.stale_trees,
                auto.mean_verified_nodes,
                auto.calibration_error
            );
            println!(
                "-- auto: {} prompt-lookup rounds in place of steps, {} of their {} tokens accepted",
                auto.lookup_rounds, auto.lookup_accepted_tokens, auto.lookup_verified_nodes
            );
            println!(
                "-- auto: {} drafted rounds with prompt-lookup nodes grafted on, {} tokens accepted past the drafter's path from their {} nodes",
                auto.grafted_rounds, auto.grafted_accepted_tokens, auto.grafted_nodes
            );
            println!(
                "-- auto: a greedy step costs {:.3} ms alone, {:.3} ms while the drafter works",
                auto.step_ms, auto.overlapped_step_ms
            );
        }
    }
}

fn print_json(response: &pb::GenerateResponse) {
    let usage = response.usage.unwrap_or_default();
    let timings = response.timings.unwrap_or_default();
    let spec = response.speculative.clone().unwrap_or_default();
    let value = serde_json::json!({
        "text": response.text,
        "token_ids": response.token_ids,
        "logprobs": response.logprobs.iter().map(|lp| serde_json::json!({
            "token_id": lp.token_id, "logprob": lp.logprob,
            "top_logprobs": lp.top_logprobs.iter().map(|t| serde_json::json!({"token_id": t.token_id, "logprob": t.logprob})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "finish_reason": pb::FinishReason::try_from(response.finish_reason).map(|f| f.as_str_name()).unwrap_or("?"),
        "usage": {"prompt_tokens": usage.prompt_tokens, "image_tokens": usage.image_tokens, "generated_tokens": usage.generated_tokens},
        "timings": {"prefill_ms": timings.prefill_ms, "decode_ms": timings.decode_ms, "decode_tokens_per_second": timings.decode_tokens_per_second},
        "speculative": response.speculative.as_ref().map(|_| serde_json::json!({
            "rounds": spec.rounds, "tau": spec.mean_accepted_length, "accepted_per_depth": spec.accepted_per_depth,
            "draft_ms": spec.draft_ms, "hop_ms": spec.hop_ms, "verify_ms": spec.verify_ms,
            "bytes_to_drafter": spec.bytes_to_drafter, "fallback_rounds": spec.fallback_rounds,
        })),
    });
    println!("{value}");
}
