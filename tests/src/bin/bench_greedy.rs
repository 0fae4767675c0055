//! Benchmark: greedy decode tokens/s of our tch target vs Hugging Face transformers' `generate` on
//! the same checkpoint and prompt (a reference case of a tiny VLM, or `--prompt` for a text model
//! such as the real SmolLM2), in f32 or bf16, measured side by side in one run and printed as a
//! ratio. Alternates the two implementations so drift on a shared machine hits both alike.

use std::path::PathBuf;
use std::process::Command;

use clap::Parser;
use glance_input::{ChatMessage, ContentPart, PromptBuilder, PromptOptions};
use glance_models::decode::{greedy_generate, GreedyParams, StepControl};
use glance_models::TargetModel;
use glance_tests::bench::median;
use glance_tests::Case;

#[derive(Parser)]
#[command(about = "Greedy decode speed: glance (tch) vs HF transformers, same model and prompt")]
struct Args {
    /// Model directory (default: the tiny Qwen3-VL reference model).
    #[arg(long, env = "GLANCE_BENCH_MODEL")]
    model: Option<PathBuf>,
    /// Reference case whose messages are the prompt.
    #[arg(long, default_value = "one_image")]
    case: String,
    /// A text model's user message (instead of --case).
    #[arg(long)]
    prompt: Option<String>,
    /// `f32` or `bf16` (both implementations).
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Measured rounds; each round times both implementations.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// CPU threads for both implementations.
    #[arg(long, default_value_t = 2)]
    threads: i32,
}

fn main() {
    let args = Args::parse();
    let model_dir = args.model.clone().unwrap_or_else(|| {
        glance_tests::fixtures().expect("no fixtures: run scripts/setup.sh").join("tiny-qwen3-vl")
    });
    tch::set_num_threads(args.threads);
    let messages = match &args.prompt {
        Some(text) => {
            vec![ChatMessage { role: "user".into(), content: vec![ContentPart::Text(text.clone())] }]
        }
        None => {
            if !Case::json_path(&model_dir, &args.case).exists() {
                // A model without the reference cases (a real checkpoint, a text model) is asked a
                // question instead.
                eprintln!(
                    "bench_greedy: {} has no reference case {}: pass --prompt TEXT",
                    model_dir.display(),
                    args.case
                );
                std::process::exit(2);
            }
            Case::load(&model_dir, &args.case).chat_messages()
        }
    };
    let prompts =
        PromptBuilder::from_model_dir(&model_dir, PromptOptions::default()).expect("prompt builder");
    let kind = glance_models::weights::parse_kind(&args.dtype).expect("--dtype f32 or bf16");
    let model = TargetModel::load(&model_dir, kind, tch::Device::Cpu).expect("model");
    let prompt = prompts.build(&messages).expect("prompt");
    let inputs = prompt.model_inputs();
    let params = GreedyParams {
        max_new_tokens: args.max_new_tokens,
        eos_token_ids: &[],
        context_limit: 1 << 20,
        logprobs: None,
    };
    let ours = || {
        let generation =
            greedy_generate(&model, &inputs, &params, |_| StepControl::Continue).expect("generate");
        let rate = (generation.tokens.len() - 1) as f64 / generation.decode_time.as_secs_f64();
        (rate, generation.prefill_time.as_secs_f64() * 1e3)
    };
    ours(); // warm-up
    let (mut glance_rates, mut hf_rates) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let (rate, prefill) = ours();
        let hf = hf_rate(&model_dir, &args);
        println!(
            "round {round}: glance {rate:.1} tok/s (prefill {prefill:.1} ms) | hf-transformers {hf:.1} tok/s"
        );
        glance_rates.push(rate);
        hf_rates.push(hf);
    }
    let (glance, hf) = (median(&mut glance_rates), median(&mut hf_rates));
    println!(
        "{}",
        serde_json::json!({
            "model": model_dir.file_name().map(|n| n.to_string_lossy().into_owned()),
            "case": if args.prompt.is_some() { "prompt" } else { args.case.as_str() },
            "dtype": args.dtype,
            "new_tokens": args.max_new_tokens,
            "threads": args.threads,
            "glance_tokens_per_s": glance,
            "hf_tokens_per_s": hf,
            "speedup_vs_hf": glance / hf,
        })
    );
    println!(
        "greedy decode: glance {glance:.1} tok/s vs hf-transformers {hf:.1} tok/s = {:.2}x",
        glance / hf
    );
}

/// Runs `tests/reference/bench_hf.py` once and reads its decode tokens/s.
fn hf_rate(model_dir: &std::path::Path, args: &Args) -> f64 {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("reference/bench_hf.py");
    let mut command = Command::new("python");
    command.arg(&script).arg("--model").arg(model_dir);
    match &args.prompt {
        Some(text) => command.args(["--prompt", text]),
        None => command.arg("--case").arg(Case::json_path(model_dir, &args.case)),
    };
    let dtype = if args.dtype == "bf16" { "bfloat16" } else { "float32" };
    let output = command
        .args(["--dtype", dtype])
        .args(["--max-new-tokens", &args.max_new_tokens.to_string(), "--runs", "1"])
        .args(["--threads", &args.threads.to_string()])
        .output()
        .expect("running bench_hf.py (is the project venv on PATH? source scripts/env.sh)");
    assert!(output.status.success(), "bench_hf.py failed: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).expect("bench_hf.py printed no JSON");
    let value: serde_json::Value = serde_json::from_str(line).expect("bench_hf.py JSON");
    value["tokens_per_s_decode"].as_f64().expect("tokens_per_s_decode")
}
