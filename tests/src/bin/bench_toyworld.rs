//! The toy-world benchmark: one command, one run, one process per service. For each task, held-out
//! prompts (after a warm-up) decoded autoregressively, with the GLANCE tree at several budgets, the
//! chain and prompt lookup; per task and geometric mean: tau pooled over rounds, speed-up (AR
//! ms/token ÷ mode ms/token, decode window), accepted-per-depth histogram, round breakdown, mean
//! root entropy, the per-prompt lossless check, and the entropy-law fit. Writes JSON and markdown.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Parser;
use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_spec::law::{self, Form, Round};
use glance_tests::law_plot;
use glance_tests::process::ServiceProcess;
use glance_toyworld::{sample, Split, Task};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Toy-world benchmark: AR vs GLANCE tree (budgets) vs chain vs prompt lookup, per task")]
struct Args {
    #[arg(long, default_value = "models/toy-target")]
    target: PathBuf,
    #[arg(long, default_value = "models/toy-head")]
    head: PathBuf,
    /// Held-out prompts per task.
    #[arg(long, default_value_t = 50)]
    prompts: u64,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: u32,
    #[arg(long, value_delimiter = ',', default_values_t = [15u32, 31, 63])]
    budgets: Vec<u32>,
    /// The budget whose round logs feed the entropy law.
    #[arg(long, default_value_t = 31)]
    law_budget: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value = "bench-toyworld.json")]
    json: PathBuf,
    #[arg(long, default_value = "bench-toyworld.md")]
    markdown: PathBuf,
    /// libtorch threads of each service (OMP_NUM_THREADS). On a 2-core machine one each keeps the
    /// verifier's and the drafter's thread pools from spinning against each other, as if each
    /// service had its own device (as in production).
    #[arg(long, default_value_t = 1)]
    threads_per_service: u32,
    /// The entropy-law decile plot.
    #[arg(long, default_value = "bench-toyworld-law.png")]
    plot: PathBuf,
    /// Off-distribution prompts: text-only requests the head never saw in training, each decoded
    /// for this many tokens with `ignore_eos` (0 skips them).
    #[arg(long, default_value_t = 200)]
    text_tokens: u32,
}

/// Text-only prompts for the off-distribution check: the toy world always shows an image, so the
/// head never saw a request without one (nor these words).
const OFF_DISTRIBUTION_PROMPTS: &[&str] = &[
    "Write a short poem about the sea.",
    "Explain how a bicycle works.",
    "List three colors and a fruit of each color.",
    "What is the capital of France?",
    "Tell me a joke about a cat and a dog.",
];

/// Totals of one (task, mode) cell.
#[derive(Default, Clone)]
struct Cell {
    ms_per_token: Vec<f64>,
    rounds: u64,
    committed: f64,
    accepted_per_depth: Vec<u64>,
    draft_ms: f64,
    hop_ms: f64,
    verify_ms: f64,
    lossless: u64,
    prompts: u64,
    round_logs: Vec<Round>,
}

impl Cell {
    fn tau(&self) -> f64 {
        if self.rounds == 0 {
            1.0
        } else {
            self.committed / self.rounds as f64
        }
    }

    fn ms_per_token(&self) -> f64 {
        self.ms_per_token.iter().sum::<f64>() / self.ms_per_token.len().max(1) as f64
    }
}

fn modes(budgets: &[u32]) -> Vec<(String, pb::DecodingMode, u32)> {
    let mut modes = vec![
        ("autoregressive".to_string(), pb::DecodingMode::Autoregressive, 0),
        ("auto".to_string(), pb::DecodingMode::Auto, 0),
    ];
    modes.extend(budgets.iter().map(|&b| (format!("tree-{b}"), pb::DecodingMode::SpeculativeTree, b)));
    modes.push(("chain".into(), pb::DecodingMode::SpeculativeChain, 0));
    modes.push(("prompt-lookup".into(), pb::DecodingMode::PromptLookup, 0));
    modes
}

fn request(
    s: &glance_toyworld::Sample,
    mode: pb::DecodingMode,
    budget: u32,
    max_new: u32,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        messages: glance_tests::suite::to_proto(&s.messages()),
        max_new_tokens: max_new,
        stop: vec![],
        decoding: Some(pb::DecodingOptions {
            mode: mode as i32,
            tree_budget: budget,
            log_rounds: true,
            ..Default::default()
        }),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let threads = args.threads_per_service.to_string();
    let env = [("OMP_NUM_THREADS", threads.as_str())];
    let drafter = ServiceProcess::block_head_drafter(&args.head, &args.target, &env);
    let verifier = ServiceProcess::verifier_with_env(
        &args.target,
        &["--drafter", &drafter.url, "--max-tree-budget", "256"],
        &env,
    );
    let mut client = GenerationClient::connect(verifier.url.clone()).await.expect("connect");
    let modes = modes(&args.budgets);
    let warm_up = sample(Split::HeldOut, Task::Doc, args.seed, 10_000);
    for (_, mode, budget) in &modes {
        client.generate(request(&warm_up, *mode, *budget, args.max_new_tokens)).await.expect("warm-up");
    }
    let bar = indicatif::ProgressBar::new(Task::ALL.len() as u64 * args.prompts * modes.len() as u64);
    let mut cells: BTreeMap<(usize, usize), Cell> = BTreeMap::new();
    for (t, &task) in Task::ALL.iter().enumerate() {
        for index in 0..args.prompts {
            let s = sample(Split::HeldOut, task, args.seed, index);
            let mut reference = None;
            for (m, (_, mode, budget)) in modes.iter().enumerate() {
                let response = client
                    .generate(request(&s, *mode, *budget, args.max_new_tokens))
                    .await
                    .expect("generate");
                let r = response.into_inner();
                let cell = cells.entry((t, m)).or_default();
                record(cell, &r, reference.get_or_insert_with(|| r.token_ids.clone()));
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    let text = off_distribution(&args, &mut client, &modes).await;
    let mut report = report(&args, &modes, &cells);
    if let Some((json, md)) = text {
        report.0["off_distribution"] = json;
        report.1 += &md;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&report.0).unwrap()).expect("json");
    std::fs::write(&args.markdown, &report.1).expect("markdown");
    println!("{}", report.1);
}

/// The off-distribution check: text-only prompts, `ignore_eos`, every mode; per mode tau and the
/// speed-up over autoregressive (ms/token pooled over the prompts), and whether every output was
/// identical to the autoregressive one.
async fn off_distribution(
    args: &Args,
    client: &mut GenerationClient<tonic::transport::Channel>,
    modes: &[(String, pb::DecodingMode, u32)],
) -> Option<(serde_json::Value, String)> {
    if args.text_tokens == 0 {
        return None;
    }
    let mut cells = vec![Cell::default(); modes.len()];
    for prompt in OFF_DISTRIBUTION_PROMPTS {
        let user = glance_input::ChatMessage {
            role: "user".into(),
            content: vec![glance_input::ContentPart::Text(prompt.to_string())],
        };
        let messages = glance_tests::suite::to_proto(&[user]);
        let mut reference = None;
        for (m, (_, mode, budget)) in modes.iter().enumerate() {
            let request = pb::GenerateRequest {
                messages: messages.clone(),
                max_new_tokens: args.text_tokens,
                stop: vec![],
                decoding: Some(pb::DecodingOptions {
                    mode: *mode as i32,
                    tree_budget: *budget,
                    ignore_eos: true,
                    ..Default::default()
                }),
            };
            let r = client.generate(request).await.expect("generate").into_inner();
            record(&mut cells[m], &r, reference.get_or_insert_with(|| r.token_ids.clone()));
        }
    }
    let ar = cells[0].ms_per_token();
    let mut md = format!(
        "\nOff distribution ({} text-only prompts, {} tokens each, `ignore_eos`):\n\n| mode | tau | speed-up | lossless |\n|---|---|---|---|\n",
        OFF_DISTRIBUTION_PROMPTS.len(),
        args.text_tokens
    );
    let mut json_modes = Vec::new();
    for ((name, _, _), c) in modes.iter().zip(&cells) {
        let speedup = ar / c.ms_per_token();
        md += &format!("| {name} | {:.2} | {speedup:.2}x | {}/{} |\n", c.tau(), c.lossless, c.prompts);
        json_modes.push(json!({"mode": name, "tau": c.tau(), "speedup": speedup, "ms_per_token": c.ms_per_token(), "lossless": format!("{}/{}", c.lossless, c.prompts)}));
    }
    Some((json!({"prompts": OFF_DISTRIBUTION_PROMPTS, "tokens": args.text_tokens, "modes": json_modes}), md))
}

fn record(cell: &mut Cell, r: &pb::GenerateResponse, reference: &[u32]) {
    let usage = r.usage.unwrap_or_default();
    let timings = r.timings.unwrap_or_default();
    cell.prompts += 1;
    cell.lossless += (r.token_ids == reference) as u64;
    cell.ms_per_token.push(timings.decode_ms / usage.generated_tokens.max(1) as f64);
    if let Some(s) = &r.speculative {
        cell.rounds += s.rounds as u64;
        cell.committed += s.mean_accepted_length * s.rounds as f64;
        if cell.accepted_per_depth.len() < s.accepted_per_depth.len() {
            cell.accepted_per_depth.resize(s.accepted_per_depth.len(), 0);
        }
        for (d, &c) in s.accepted_per_depth.iter().enumerate() {
            cell.accepted_per_depth[d] += c;
        }
        cell.draft_ms += s.draft_ms;
        cell.hop_ms += s.hop_ms;
        cell.verify_ms += s.verify_ms;
        cell.round_logs.extend(
            s.round_logs
                .iter()
                .map(|l| Round { entropy: l.root_entropy as f64, accepted: l.accepted as f64 }),
        );
    }
}

/// JSON and the markdown table.
fn report(
    args: &Args,
    modes: &[(String, pb::DecodingMode, u32)],
    cells: &BTreeMap<(usize, usize), Cell>,
) -> (serde_json::Value, String) {
    let law_mode = modes.iter().position(|(n, _, _)| *n == format!("tree-{}", args.law_budget));
    let mut md = String::from("| task | mean H (nats) | ");
    md += &modes.iter().map(|(n, _, _)| format!("{n} tau / speed-up")).collect::<Vec<_>>().join(" | ");
    md += " | lossless |\n|---|---|";
    md += &"---|".repeat(modes.len() + 1);
    md += "\n";
    let mut json_tasks = Vec::new();
    let mut speedups: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut pooled: Vec<Round> = Vec::new();
    let mut per_task_logs: Vec<(Task, Vec<Round>)> = Vec::new();
    for (t, task) in Task::ALL.iter().enumerate() {
        let ar = cells[&(t, 0)].ms_per_token();
        let logs = law_mode.map(|m| cells[&(t, m)].round_logs.clone()).unwrap_or_default();
        pooled.extend(&logs);
        per_task_logs.push((*task, logs.clone()));
        let mean_h = logs.iter().map(|r| r.entropy).sum::<f64>() / logs.len().max(1) as f64;
        let lossless = (0..modes.len()).all(|m| cells[&(t, m)].lossless == cells[&(t, m)].prompts);
        md += &format!("| {} | {mean_h:.2} |", task.name());
        let mut json_modes = Vec::new();
        for (m, (name, _, _)) in modes.iter().enumerate() {
            let c = &cells[&(t, m)];
            let speedup = ar / c.ms_per_token();
            speedups[m].push(speedup);
            md += &format!(" {:.2} / {:.2}x |", c.tau(), speedup);
            let round_ms = c.draft_ms + c.hop_ms + c.verify_ms;
            json_modes.push(json!({
                "mode": name, "tau": c.tau(), "speedup": speedup, "ms_per_token": c.ms_per_token(), "rounds": c.rounds,
                "accepted_per_depth": c.accepted_per_depth, "draft_ms": c.draft_ms, "hop_ms": c.hop_ms,
                "verify_ms": c.verify_ms, "hop_share": if round_ms > 0.0 { c.hop_ms / round_ms } else { 0.0 },
                "lossless": format!("{}/{}", c.lossless, c.prompts),
            }));
        }
        md += &format!(" {} |\n", if lossless { "all" } else { "NO" });
        json_tasks.push(json!({"task": task.name(), "mean_root_entropy": mean_h, "modes": json_modes, "law": law_json(&logs)}));
    }
    md += "| geomean | |";
    for s in &speedups {
        let geo = (s.iter().map(|x| x.ln()).sum::<f64>() / s.len().max(1) as f64).exp();
        md += &format!(" {geo:.2}x |");
    }
    md += " |\n";
    md += &law_table(&per_task_logs, &pooled);
    if let Err(e) = plot(&args.plot, &per_task_logs, &pooled) {
        eprintln!("bench_toyworld: no plot: {e}");
    }
    let value = json!({"tasks": json_tasks, "pooled_law": law_json(&pooled), "prompts_per_task": args.prompts, "max_new_tokens": args.max_new_tokens});
    (value, md)
}

fn law_json(rounds: &[Round]) -> serde_json::Value {
    let fit = |form| {
        law::fit(form, rounds, 15)
            .map(|f| json!({"b0": f.b0, "b1": f.b1, "r2_rounds": f.r2_rounds, "r2_deciles": f.r2_deciles}))
    };
    json!({
        "rounds": rounds.len(),
        "spearman": law::spearman(rounds),
        "capped_geometric": fit(Form::CappedGeometric),
        "finite_horizon": fit(Form::FiniteHorizon),
        "deciles": law::deciles(rounds).iter().map(|d| json!({"entropy": d.entropy, "accepted": d.accepted, "rounds": d.rounds})).collect::<Vec<_>>(),
    })
}

/// The fitted entropy law per task and pooled (finite-horizon and capped-geometric slopes).
fn law_table(per_task: &[(Task, Vec<Round>)], pooled: &[Round]) -> String {
    let mut md = String::from(
        "\n| entropy law | rounds | mean H | b0 / b1 (finite horizon) | R² deciles | b0 / b1 (capped) | Spearman ρ |\n|---|---|---|---|---|---|---|\n",
    );
    let rows = per_task.iter().map(|(t, logs)| (t.name(), logs.as_slice())).chain([("pooled", pooled)]);
    for (name, logs) in rows {
        let mean_h = logs.iter().map(|r| r.entropy).sum::<f64>() / logs.len().max(1) as f64;
        let show = |f: Option<law::Fit>| f.map_or("-".to_string(), |f| format!("{:.2} / {:.2}", f.b0, f.b1));
        let finite = law::fit(Form::FiniteHorizon, logs, 15);
        let r2 = finite.as_ref().map_or("-".to_string(), |f| format!("{:.2}", f.r2_deciles));
        md += &format!(
            "| {name} | {} | {mean_h:.2} | {} | {r2} | {} | {:.2} |\n",
            logs.len(),
            show(finite.clone()),
            show(law::fit(Form::CappedGeometric, logs, 15)),
            law::spearman(logs)
        );
    }
    md
}

/// The decile plot: one curve per task and the pooled one, each with its finite-horizon fit.
fn plot(path: &std::path::Path, per_task: &[(Task, Vec<Round>)], pooled: &[Round]) -> Result<(), String> {
    let named: Vec<(&str, &[Round])> =
        per_task.iter().map(|(t, l)| (t.name(), l.as_slice())).chain([("pooled", pooled)]).collect();
    let deciles: Vec<Vec<law::Decile>> = named.iter().map(|(_, l)| law::deciles(l)).collect();
    let fits: Vec<Option<law::Fit>> =
        named.iter().map(|(_, l)| law::fit(Form::FiniteHorizon, l, 15)).collect();
    let series: Vec<law_plot::Series> = named
        .iter()
        .zip(&deciles)
        .zip(&fits)
        .map(|(((name, _), d), f)| law_plot::Series { name, deciles: d, fit: f.as_ref() })
        .collect();
    law_plot::draw(path, "accepted length vs target entropy (toy world, glance tree)", &series, 15)
}
