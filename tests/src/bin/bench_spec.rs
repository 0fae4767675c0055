//! Benchmark of the speculative machinery: one prompt set, decoded autoregressively, with the
//! GLANCE tree, the chain and prompt lookup, through drafter-svc and verifier-svc as processes on
//! loopback, in one run. Prints tokens/s, tau, and where a round's time goes (draft, hop =
//! serialize + transfer + deserialize, verify), and checks every output against autoregressive.
//! With a random head (the default) tau is about 1: the figures measure the machinery's overhead.

use std::path::PathBuf;

use clap::Parser;
use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_tests::process::ServiceProcess;
use glance_tests::suite;

#[derive(Parser)]
#[command(about = "Speculative decoding benchmark: AR vs tree vs chain vs prompt lookup, one run")]
struct Args {
    /// Target model directory (default: the tiny Qwen3-VL reference model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Draft head directory (default: a freshly initialized random head).
    #[arg(long)]
    head: Option<PathBuf>,
    #[arg(long, default_value_t = 12)]
    prompts: usize,
    #[arg(long, default_value_t = 96)]
    max_new_tokens: u32,
    #[arg(long, default_value_t = 31)]
    tree_budget: u32,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Default, Debug, Clone, serde::Serialize)]
struct ModeResult {
    mode: String,
    tokens: u64,
    decode_ms: f64,
    tokens_per_s: f64,
    rounds: u64,
    tau: f64,
    draft_ms: f64,
    hop_ms: f64,
    verify_ms: f64,
    hop_share_of_round: f64,
    bytes_to_drafter: u64,
    fallback_rounds: u64,
    lossless: bool,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let model = args.model.clone().unwrap_or_else(|| {
        glance_tests::fixtures().expect("no fixtures: run scripts/setup.sh").join("tiny-qwen3-vl")
    });
    let head = args.head.clone().unwrap_or_else(|| {
        let out = std::env::temp_dir().join(format!("glance-bench-head-{}", std::process::id()));
        let spec = drafter_svc::init::HeadSpec {
            tap_layers: Some(vec![0, 1, 2]),
            ..drafter_svc::init::HeadSpec::new(1, 16, 0)
        };
        drafter_svc::init::write_random_head(&model, &out, &spec).expect("random head");
        out
    });
    let prompts = suite::build(&model, args.prompts, args.max_new_tokens);
    let drafter = ServiceProcess::block_head_drafter(&head, &model, &[]);
    let verifier = ServiceProcess::verifier(&model, &["--drafter", &drafter.url]);
    let mut client = GenerationClient::connect(verifier.url.clone()).await.expect("connect");
    let modes = [
        ("autoregressive", pb::DecodingMode::Autoregressive),
        ("tree", pb::DecodingMode::SpeculativeTree),
        ("chain", pb::DecodingMode::SpeculativeChain),
        ("prompt-lookup", pb::DecodingMode::PromptLookup),
    ];
    // Warm-up: one request per mode.
    for (_, mode) in modes {
        client.generate(suite::request(&prompts[0], mode, args.tree_budget)).await.expect("warm-up");
    }
    let mut results = Vec::new();
    for (name, mode) in modes {
        let mut r = ModeResult { mode: name.into(), lossless: true, ..Default::default() };
        for prompt in &prompts {
            let response = client
                .generate(suite::request(prompt, mode, args.tree_budget))
                .await
                .expect(name)
                .into_inner();
            let tokens: Vec<i64> = response.token_ids.iter().map(|&t| t as i64).collect();
            r.lossless &= tokens == prompt.greedy;
            let usage = response.usage.unwrap_or_default();
            let timings = response.timings.unwrap_or_default();
            r.tokens += usage.generated_tokens.saturating_sub(1) as u64;
            r.decode_ms += timings.decode_ms;
            if let Some(s) = response.speculative {
                r.rounds += s.rounds as u64;
                r.tau += s.mean_accepted_length * s.rounds as f64;
                r.draft_ms += s.draft_ms;
                r.hop_ms += s.hop_ms;
                r.verify_ms += s.verify_ms;
                r.bytes_to_drafter += s.bytes_to_drafter;
                r.fallback_rounds += s.fallback_rounds as u64;
            }
        }
        r.tokens_per_s = r.tokens as f64 / (r.decode_ms / 1e3);
        r.tau = if r.rounds > 0 { r.tau / r.rounds as f64 } else { 1.0 };
        let round_ms = r.draft_ms + r.hop_ms + r.verify_ms;
        r.hop_share_of_round = if round_ms > 0.0 { r.hop_ms / round_ms } else { 0.0 };
        results.push(r);
    }
    let ar = results[0].tokens_per_s;
    println!("| mode | tokens/s | vs AR | tau | draft ms | hop ms | verify ms | hop share | KiB to drafter | lossless |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &results {
        println!(
            "| {} | {:.0} | {:.2}x | {:.2} | {:.0} | {:.0} | {:.0} | {:.1}% | {:.0} | {} |",
            r.mode,
            r.tokens_per_s,
            r.tokens_per_s / ar,
            r.tau,
            r.draft_ms,
            r.hop_ms,
            r.verify_ms,
            100.0 * r.hop_share_of_round,
            r.bytes_to_drafter as f64 / 1024.0,
            r.lossless
        );
    }
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&results).unwrap()).expect("write json");
    }
    assert!(results.iter().all(|r| r.lossless), "an output differed from autoregressive decoding");
}
