//! The real-model benchmark: held-out ShareGPT chat prompts (conversation ids training never saw)
//! on a real checkpoint with its trained head, one run, one process per service, one dtype per
//! run. Modes: autoregressive, auto, the GLANCE tree at several budgets, the chain and prompt
//! lookup. Reports tau, speed-up over our own autoregressive decoding (ms/token, decode window),
//! the round breakdown, accepted-per-depth, the entropy-law fit and, per prompt and mode, whether
//! the output equals the autoregressive one; where it does not (bf16 rounding), the step and the
//! target's top-2 logit margin there. The peer: transformers' own greedy `generate` on the same
//! prompts in the same run (`tests/reference/bench_hf.py --prompts-file`). With `--eagle3-head`
//! and `--ablate-states`, the paper's matched comparison on the real model (`glance_tests::matched`).

use std::path::{Path, PathBuf};

use clap::Parser;
use glance_input::{ChatMessage, ContentPart, PromptBuilder, PromptOptions};
use glance_proto::v1 as pb;
use glance_spec::law::Round;
use glance_tests::bench::{self, Cell, Divergence, Mode, Sampling};
use glance_tests::matched;
use serde_json::json;
use tch::Device;

#[derive(Parser)]
#[command(
    about = "Real-model benchmark on held-out ShareGPT prompts: AR vs tree vs chain vs prompt lookup vs auto"
)]
struct Args {
    #[arg(long, default_value = "models/smollm2-135m-instruct")]
    model: PathBuf,
    #[arg(long, default_value = "models/smollm2-head")]
    head: PathBuf,
    #[arg(long, default_value = "data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json")]
    data: PathBuf,
    /// Held-out prompts (the next one warms every mode up first).
    #[arg(long, default_value_t = 50)]
    prompts: usize,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: u32,
    /// Sampling temperature (0: greedy). When sampling, prompt i is drawn with seed i in every
    /// mode, so every mode must return the autoregressive tokens; transformers' greedy peer and
    /// the top-2 margins then do not apply and are skipped.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, value_delimiter = ',', default_values_t = [7u32, 15, 31])]
    budgets: Vec<u32>,
    /// Only these modes (by report name, e.g. `autoregressive,tree-15`); autoregressive always runs.
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// The tree budget whose round logs feed the entropy law.
    #[arg(long, default_value_t = 15)]
    law_budget: u32,
    /// The Python that runs transformers for the peer; `off` skips it.
    #[arg(long, default_value = ".venv/bin/python")]
    peer_python: String,
    #[command(flatten)]
    services: matched::ServiceArgs,
    /// Output prefix: PREFIX.json, PREFIX.md and PREFIX-law.png (default bench-chat-DTYPE); while
    /// it runs, PREFIX.partial.* hold the prompts done so far.
    #[arg(long)]
    out: Option<String>,
}

/// What transformers' greedy `generate` did on the same prompts.
#[derive(serde::Deserialize)]
struct PeerRun {
    tokens: Vec<Vec<u32>>,
    decode_tokens: u64,
    decode_ms: f64,
}

fn user(text: &str) -> Vec<ChatMessage> {
    vec![ChatMessage { role: "user".into(), content: vec![ContentPart::Text(text.to_string())] }]
}

fn request(prompt: &str, mode: &Mode, max_new: u32, sampling: Sampling, seed: u64) -> pb::GenerateRequest {
    pb::GenerateRequest {
        messages: glance_tests::suite::to_proto(&user(prompt)),
        max_new_tokens: max_new,
        stop: vec![],
        decoding: Some(bench::decoding(mode, sampling, seed)),
    }
}

/// The modes asked for (autoregressive always first).
fn selected(args: &Args, modes: Vec<Mode>) -> Vec<Mode> {
    modes
        .into_iter()
        .filter(|m| {
            m.mode == pb::DecodingMode::Autoregressive
                || args.modes.is_empty()
                || args.modes.contains(&m.name)
        })
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let sampling = Sampling { temperature: args.temperature };
    let out = args.out.clone().unwrap_or_else(|| match sampling.is_greedy() {
        true => format!("bench-chat-{}", args.services.dtype),
        false => format!("bench-chat-{}-t{}", args.services.dtype, args.temperature),
    });
    let corpus =
        drafter_svc::sharegpt::read(&args.data).expect("the ShareGPT file (scripts/setup-real-model.sh)");
    let prompts: Vec<String> = corpus.held_out.into_iter().take(args.prompts + 1).map(|p| p.text).collect();
    assert!(prompts.len() > args.prompts, "only {} held-out prompts", prompts.len() - 1);
    let (warm_up, prompts) = (&prompts[args.prompts], &prompts[..args.prompts]);
    let setup = matched::Setup::new(&args.model, &args.head, &args.budgets, args.law_budget, &args.services);
    let (mut pairs, modes) = matched::pairs_and_modes(&setup).await;
    let modes = selected(&args, modes);
    for mode in &modes {
        let warm = request(warm_up, mode, args.max_new_tokens, sampling, u64::MAX);
        pairs[mode.pair].client.generate(warm).await.expect("warm-up");
    }
    let bar = indicatif::ProgressBar::new((prompts.len() * modes.len()) as u64);
    let mut cells = vec![Cell::default(); modes.len()];
    let mut ar_tokens: Vec<Vec<u32>> = Vec::new();
    let mut diverged: Vec<(usize, String, usize)> = Vec::new();
    for (p, prompt) in prompts.iter().enumerate() {
        for (m, mode) in modes.iter().enumerate() {
            let asked = request(prompt, mode, args.max_new_tokens, sampling, p as u64);
            let r = pairs[mode.pair].client.generate(asked).await.expect("generate");
            let r = r.into_inner();
            if m == 0 {
                ar_tokens.push(r.token_ids.clone());
            }
            if !cells[m].record(&r, &ar_tokens[p]) {
                diverged.push((p, mode.name.clone(), bench::first_difference(&r.token_ids, &ar_tokens[p])));
            }
            bar.inc(1);
        }
        // A long run leaves its figures so far behind (no margins or peer yet), prompt by prompt.
        let partial = format!("{out}.partial");
        let (json, md) = report(&args, &setup, &modes, &cells, None, None, &ar_tokens, &partial);
        write_report(&partial, &json, &md);
    }
    bar.finish_and_clear();
    drop(pairs);
    let divergences = margins(&args, prompts, &ar_tokens, diverged);
    let peer = peer(&args, prompts);
    let (json, md) =
        report(&args, &setup, &modes, &cells, Some(&divergences), peer.as_ref(), &ar_tokens, &out);
    write_report(&out, &json, &md);
    let _ = std::fs::remove_file(format!("{out}.partial.json"));
    let _ = std::fs::remove_file(format!("{out}.partial.md"));
    let _ = std::fs::remove_file(format!("{out}.partial-law.png"));
    println!("{md}");
}

/// PREFIX.json and PREFIX.md.
fn write_report(prefix: &str, json: &serde_json::Value, md: &str) {
    std::fs::write(format!("{prefix}.json"), serde_json::to_string_pretty(json).unwrap()).expect("json");
    std::fs::write(format!("{prefix}.md"), md).expect("markdown");
}

/// The target's top-2 logit margin at each divergence, from one teacher-forced pass over the
/// prompt and the autoregressive tokens before the step (in the benchmark's dtype, and in f32
/// beside it for a bf16 run); none when sampling.
fn margins(
    args: &Args,
    prompts: &[String],
    ar: &[Vec<u32>],
    diverged: Vec<(usize, String, usize)>,
) -> Vec<Divergence> {
    if args.temperature > 0.0 {
        let sampled = |(prompt, mode, step): (usize, String, usize)| {
            Divergence::sampled(prompt.to_string(), mode, step)
        };
        return diverged.into_iter().map(sampled).collect();
    }
    if diverged.is_empty() {
        return Vec::new();
    }
    let kind = glance_models::weights::parse_kind(&args.services.dtype).expect("--dtype: f32 or bf16");
    let probe = bench::MarginProbe::load(&args.model, kind, Device::Cpu, args.services.threads_per_service);
    let builder = PromptBuilder::from_model_dir(&args.model, PromptOptions::default()).expect("prompts");
    diverged
        .into_iter()
        .map(|(prompt, mode, step)| {
            let inputs = builder.build(&user(&prompts[prompt])).expect("prompt").model_inputs();
            probe.divergence((prompt.to_string(), mode, step), &inputs, &ar[prompt][..step])
        })
        .collect()
}

/// transformers' greedy `generate` on the same prompts (None: skipped, as when sampling, or
/// failed, said on stderr).
fn peer(args: &Args, prompts: &[String]) -> Option<PeerRun> {
    if args.peer_python == "off" || args.temperature > 0.0 {
        return None;
    }
    let file = std::env::temp_dir().join(format!("bench-chat-prompts-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_string(prompts).unwrap()).ok()?;
    let dtype = if args.services.dtype == "bf16" { "bfloat16" } else { "float32" };
    let output = std::process::Command::new(&args.peer_python)
        .arg(Path::new("tests/reference/bench_hf.py"))
        .args(["--model", args.model.to_str()?, "--prompts-file", file.to_str()?, "--dtype", dtype])
        .args(["--max-new-tokens", &args.max_new_tokens.to_string()])
        .args(["--threads", &args.services.threads_per_service.to_string()])
        .output();
    std::fs::remove_file(&file).ok();
    match output {
        Ok(o) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout);
            serde_json::from_str(text.lines().last().unwrap_or_default())
                .map_err(|e| eprintln!("bench_chat: peer output: {e}"))
                .ok()
        }
        Ok(o) => {
            eprintln!("bench_chat: peer failed: {}", String::from_utf8_lossy(&o.stderr));
            None
        }
        Err(e) => {
            eprintln!("bench_chat: no peer ({}): {e}", args.peer_python);
            None
        }
    }
}

/// The JSON report and its markdown.
#[allow(clippy::too_many_arguments)]
fn report(
    args: &Args,
    setup: &matched::Setup,
    modes: &[Mode],
    cells: &[Cell],
    // None in a partial report: the margins are computed once every prompt has run.
    divergences: Option<&[Divergence]>,
    peer: Option<&PeerRun>,
    ar_tokens: &[Vec<u32>],
    out: &str,
) -> (serde_json::Value, String) {
    let ar = cells[0].ms_per_token();
    let model = args.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut md = format!(
        "{model} ({}, {}), {} held-out ShareGPT prompts, up to {} new tokens, {} thread(s) per service{}\n\n\
         | mode | tau | speed-up | ms/token | draft / hop ms per verify round, verify ms per target pass | rounds accepting depth 1 / 2 / 3 / 4 / 6 / 8 | identical to AR |\n\
         |---|---|---|---|---|---|---|\n",
        args.services.dtype,
        Sampling { temperature: args.temperature }.label(),
        cells[0].prompts,
        args.max_new_tokens,
        args.services.threads_per_service,
        match args.services.draft_vocab.resolve(&args.head) {
            Ok(Some((tokens, _))) => format!(
                ", the head's draft vocabulary (`--draft-vocab {}`): {} of its training responses' tokens",
                args.services.draft_vocab,
                tokens.len()
            ),
            _ => String::new(),
        }
    );
    let mut json_modes = Vec::new();
    for (mode, c) in modes.iter().zip(cells) {
        let speedup = ar / c.ms_per_token();
        let [draft, hop, verify] = c.round_breakdown();
        let share = |d: usize| {
            let n = c.accepted_per_depth.get(d - 1).copied().unwrap_or(0);
            format!("{:.0}%", 100.0 * n as f64 / c.rounds.max(1) as f64)
        };
        let depths = [1, 2, 3, 4, 6, 8].map(share).join(" / ");
        let breakdown =
            if c.rounds == 0 { "-".to_string() } else { format!("{draft:.1} / {hop:.2} / {verify:.1}") };
        md += &format!(
            "| {} | {:.2} | {speedup:.2}x | {:.1} | {breakdown} | {} | {}/{} |\n",
            mode.name,
            c.tau(),
            c.ms_per_token(),
            if c.rounds == 0 { "-".to_string() } else { depths },
            c.lossless,
            c.prompts
        );
        json_modes.push(c.json(&mode.name, speedup));
    }
    let law_name = format!("tree-{}", args.law_budget);
    let logs: &[Round] =
        modes.iter().position(|m| m.name == law_name).map_or(&[], |m| cells[m].round_logs.as_slice());
    md += &bench::law_table([(law_name.as_str(), logs)]);
    if let Err(e) = bench::law_plot(
        Path::new(&format!("{out}-law.png")),
        &format!("accepted length vs target entropy ({model}, {law_name}, held-out chat)"),
        &[(law_name.as_str(), logs)],
    ) {
        eprintln!("bench_chat: no plot: {e}");
    }
    let peer_json = peer.map(|p| peer_section(p, &cells[0], ar_tokens, &args.services.dtype, &mut md));
    md += &match divergences {
        Some(divergences) => bench::divergence_section(divergences),
        None => "\nThe step and top-2 margin of each divergence come with the final report.\n".into(),
    };
    let matched = setup.services.compares().then(|| {
        let cells: matched::Cells = cells.iter().enumerate().map(|(m, c)| ((0, m), c.clone())).collect();
        let (json, section) = matched::comparison(setup, &["held-out chat"], modes, &cells);
        md += &section;
        json
    });
    let json = json!({
        "model": model, "dtype": args.services.dtype, "temperature": args.temperature, "prompts": cells[0].prompts, "max_new_tokens": args.max_new_tokens,
        "threads_per_service": args.services.threads_per_service, "draft_vocab": args.services.draft_vocab.to_string(), "modes": json_modes, "law": bench::law_json(logs),
        "law_mode": law_name, "peer": peer_json, "matched": matched,
        "divergences": divergences.map(|d| d.iter().map(Divergence::json).collect::<Vec<_>>()),
    });
    (json, md)
}

/// Our autoregressive decode rate against transformers' (pooled over the prompts), and how many
/// of its greedy outputs equal ours.
fn peer_section(
    peer: &PeerRun,
    ar: &Cell,
    ar_tokens: &[Vec<u32>],
    dtype: &str,
    md: &mut String,
) -> serde_json::Value {
    let ours = ar.decode_tokens as f64 / (ar.decode_ms / 1000.0);
    let theirs = peer.decode_tokens as f64 / (peer.decode_ms / 1000.0);
    let same = peer.tokens.iter().zip(ar_tokens).filter(|(a, b)| a == b).count();
    *md += &format!(
        "\nAR peer: transformers' greedy `generate` on the same prompts ({dtype}): {theirs:.1} tokens/s; ours \
         {ours:.1} tokens/s (**{:.2}x**); its outputs equal ours on {same}/{} prompts.\n",
        ours / theirs,
        ar_tokens.len()
    );
    json!({"tokens_per_s": theirs, "ours_tokens_per_s": ours, "ratio": ours / theirs, "identical": same})
}
