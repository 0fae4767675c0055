//! The toy-world benchmark: one command, one run, one process per service. For each task, held-out
//! prompts (after a warm-up) decoded autoregressively, with the GLANCE tree at several budgets, the
//! chain and prompt lookup; greedily and at each sampling temperature asked for (each prompt with
//! its own seed, the same in every mode). Per temperature, task and geometric mean: tau pooled over
//! rounds, speed-up (AR ms/token ÷ mode ms/token, decode window), accepted-per-depth histogram,
//! round breakdown, mean root entropy, the per-prompt lossless check (every output that differs
//! from the autoregressive one with the same seed; for greedy decoding with the target's top-2
//! margin there: in bf16 a verify pass and a one-row step may round differently), and the
//! entropy-law fit. Writes JSON and markdown.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Parser;
use glance_input::{PromptBuilder, PromptOptions};
use glance_proto::v1 as pb;
use glance_spec::law::Round;
use glance_tests::bench::{self, Cell, Divergence, Mode, Sampling};
use glance_tests::matched;
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
    /// The budget whose round logs feed the entropy law (when not among --budgets: the last of them).
    #[arg(long, default_value_t = 31)]
    law_budget: u32,
    /// Picks the held-out prompts and, when sampling, each prompt's seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Temperatures every mode runs at (0: greedy), each over the same prompts. A sampled run
    /// gives each prompt its own seed and every mode that seed, so every mode must return the
    /// autoregressive tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [0.0f32, 0.7, 1.0])]
    temperatures: Vec<f32>,
    #[arg(long, default_value = "bench-toyworld.json")]
    json: PathBuf,
    #[arg(long, default_value = "bench-toyworld.md")]
    markdown: PathBuf,
    /// The entropy-law decile plot (of the greedy run, else the first).
    #[arg(long, default_value = "bench-toyworld-law.png")]
    plot: PathBuf,
    /// Off-distribution prompts: text-only requests the head never saw in training, each decoded
    /// for this many tokens with `ignore_eos` (0 skips them).
    #[arg(long, default_value_t = 200)]
    text_tokens: u32,
    /// Sendings of each held-out request per mode, the modes taking turns (every mode once, then
    /// again), so that a slow spell of the machine falls on all of them; a prompt's figures are
    /// its sending with the median decode time. Every sending is checked against the
    /// autoregressive output.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    #[command(flatten)]
    services: matched::ServiceArgs,
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

fn request(
    s: &glance_toyworld::Sample,
    mode: &Mode,
    max_new: u32,
    sampling: Sampling,
    seed: u64,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        messages: glance_tests::suite::to_proto(&s.messages()),
        max_new_tokens: max_new,
        stop: vec![],
        decoding: Some(bench::decoding(mode, sampling, seed)),
    }
}

/// One prompt's sampling seed: distinct per task and prompt, the same in every mode.
fn prompt_seed(seed: u64, task: usize, index: u64) -> u64 {
    seed.wrapping_mul(1 << 40).wrapping_add((task as u64) << 32).wrapping_add(index)
}

/// Every task's prompts in every mode at one temperature.
struct Run {
    sampling: Sampling,
    /// By (task, mode).
    cells: BTreeMap<(usize, usize), Cell>,
    diverged: Vec<Diverged>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let setup = matched::Setup::new(&args.target, &args.head, &args.budgets, args.law_budget, &args.services);
    let (mut pairs, modes) = matched::pairs_and_modes(&setup).await;
    let warm_up = sample(Split::HeldOut, Task::Doc, args.seed, 10_000);
    for mode in &modes {
        let warm = request(&warm_up, mode, args.max_new_tokens, Sampling::GREEDY, 0);
        pairs[mode.pair].client.generate(warm).await.expect("warm-up");
    }
    let total =
        args.temperatures.len() * Task::ALL.len() * args.prompts as usize * modes.len() * args.repeats.max(1);
    let bar = indicatif::ProgressBar::new(total as u64);
    let mut runs = Vec::new();
    for &temperature in &args.temperatures {
        runs.push(run(&args, &mut pairs, &modes, Sampling { temperature }, &bar).await);
    }
    bar.finish_and_clear();
    let text = off_distribution(&args, &mut pairs, &modes).await;
    let plotted = runs.iter().position(|r| r.sampling.is_greedy()).unwrap_or(0);
    let mut json_runs = Vec::new();
    let mut md = format!(
        "{} held-out prompts per task, up to {} new tokens, {} in both services; each request sent {} time(s) per mode, the modes taking turns (a prompt's figures: its median sending).\n",
        args.prompts,
        args.max_new_tokens,
        args.services.dtype,
        args.repeats.max(1)
    );
    for (i, run) in runs.into_iter().enumerate() {
        let divergences = margins(&args, run.diverged, run.sampling);
        let (mut json, section) = report(&args, &modes, run.sampling, &run.cells, i == plotted);
        json["divergences"] = divergences.iter().map(Divergence::json).collect();
        md += &section;
        md += &bench::divergence_section(&divergences);
        if args.services.compares() {
            let tasks: Vec<&str> = Task::ALL.iter().map(|t| t.name()).collect();
            let (matched_json, matched_md) = matched::comparison(&setup, &tasks, &modes, &run.cells);
            json["matched"] = matched_json;
            md += &matched_md;
        }
        json_runs.push(json);
    }
    let mut report = json!({
        "runs": json_runs, "dtype": args.services.dtype, "prompts_per_task": args.prompts,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats.max(1),
    });
    if let Some((json, text_md)) = text {
        report["off_distribution"] = json;
        md += &text_md;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&report).unwrap()).expect("json");
    std::fs::write(&args.markdown, &md).expect("markdown");
    println!("{md}");
}

/// Every task's held-out prompts in every mode at one temperature; each output is checked against
/// the autoregressive one of the same prompt (and seed).
async fn run(
    args: &Args,
    pairs: &mut [matched::Pair],
    modes: &[Mode],
    sampling: Sampling,
    bar: &indicatif::ProgressBar,
) -> Run {
    let mut cells: BTreeMap<(usize, usize), Cell> = BTreeMap::new();
    let mut diverged = Vec::new();
    for (t, &task) in Task::ALL.iter().enumerate() {
        for index in 0..args.prompts {
            let s = sample(Split::HeldOut, task, args.seed, index);
            let seed = prompt_seed(args.seed, t, index);
            let mut sendings: Vec<Vec<pb::GenerateResponse>> = vec![Vec::new(); modes.len()];
            for _ in 0..args.repeats.max(1) {
                for (m, mode) in modes.iter().enumerate() {
                    let asked = request(&s, mode, args.max_new_tokens, sampling, seed);
                    let r = pairs[mode.pair].client.generate(asked).await.expect("generate").into_inner();
                    sendings[m].push(r);
                    bar.inc(1);
                }
            }
            let mut reference: Option<Vec<u32>> = None;
            for (m, responses) in sendings.into_iter().enumerate() {
                let ar = reference.get_or_insert_with(|| responses[0].token_ids.clone());
                let r = representative(responses, ar);
                if !cells.entry((t, m)).or_default().record(&r, ar) {
                    let step = bench::first_difference(&r.token_ids, ar);
                    let label = format!("{}/{index}", task.name());
                    diverged.push((label, s.messages(), ar[..step].to_vec(), modes[m].name.clone(), step));
                }
            }
        }
    }
    Run { sampling, cells, diverged }
}

/// The sending a prompt's figures come from: the first whose tokens differ from `reference` when
/// one does (so that the divergence is counted and reported), else the one with the median decode
/// time.
fn representative(mut responses: Vec<pb::GenerateResponse>, reference: &[u32]) -> pb::GenerateResponse {
    if let Some(i) = responses.iter().position(|r| r.token_ids != reference) {
        return responses.swap_remove(i);
    }
    let decode_ms = |r: &pb::GenerateResponse| r.timings.map_or(0.0, |t| t.decode_ms);
    responses.sort_by(|a, b| decode_ms(a).total_cmp(&decode_ms(b)));
    let median = responses.len() / 2;
    responses.swap_remove(median)
}

/// An output that differs from the autoregressive one: the prompt's label and messages, the
/// autoregressive tokens before the step, the mode and the step.
type Diverged = (String, Vec<glance_input::ChatMessage>, Vec<u32>, String, usize);

/// The target's top-2 margin at each divergence of a greedy run, in the run's dtype (and in f32
/// beside it for a half-precision run), on the tests' device (`GLANCE_TEST_DEVICE`); a sampled
/// run's divergences have none.
fn margins(args: &Args, diverged: Vec<Diverged>, sampling: Sampling) -> Vec<Divergence> {
    if !sampling.is_greedy() {
        let sampled = |(prompt, _, _, mode, step)| Divergence::sampled(prompt, mode, step);
        return diverged.into_iter().map(sampled).collect();
    }
    if diverged.is_empty() {
        return Vec::new();
    }
    let kind = glance_models::weights::parse_kind(&args.services.dtype).expect("--dtype: f32, bf16 or f16");
    let threads = args.services.threads_per_service;
    let probe = bench::MarginProbe::load(&args.target, kind, glance_tests::test_device(), threads);
    let builder = PromptBuilder::from_model_dir(&args.target, PromptOptions::default()).expect("prompts");
    diverged
        .into_iter()
        .map(|(prompt, messages, prefix, mode, step)| {
            let inputs = builder.build(&messages).expect("prompt").model_inputs();
            probe.divergence((prompt, mode, step), &inputs, &prefix)
        })
        .collect()
}

/// The off-distribution check (greedy): text-only prompts, `ignore_eos`, every mode; per mode tau and the
/// speed-up over autoregressive (ms/token pooled over the prompts), and whether every output was
/// identical to the autoregressive one.
async fn off_distribution(
    args: &Args,
    pairs: &mut [matched::Pair],
    modes: &[Mode],
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
        for (m, mode) in modes.iter().enumerate() {
            let request = pb::GenerateRequest {
                messages: messages.clone(),
                max_new_tokens: args.text_tokens,
                stop: vec![],
                decoding: Some(pb::DecodingOptions {
                    ignore_eos: true,
                    ..bench::decoding(mode, Sampling::GREEDY, 0)
                }),
            };
            let r = pairs[mode.pair].client.generate(request).await.expect("generate").into_inner();
            cells[m].record(&r, reference.get_or_insert_with(|| r.token_ids.clone()));
        }
    }
    let ar = cells[0].ms_per_token();
    let mut md = format!(
        "\nOff distribution ({} text-only prompts, {} tokens each, `ignore_eos`):\n\n| mode | tau | speed-up | lossless |\n|---|---|---|---|\n",
        OFF_DISTRIBUTION_PROMPTS.len(),
        args.text_tokens
    );
    let mut json_modes = Vec::new();
    for (mode, c) in modes.iter().zip(&cells) {
        let speedup = ar / c.ms_per_token();
        md += &format!("| {} | {:.2} | {speedup:.2}x | {}/{} |\n", mode.name, c.tau(), c.lossless, c.prompts);
        json_modes.push(json!({"mode": mode.name, "tau": c.tau(), "speedup": speedup, "ms_per_token": c.ms_per_token(), "lossless": format!("{}/{}", c.lossless, c.prompts)}));
    }
    Some((json!({"prompts": OFF_DISTRIBUTION_PROMPTS, "tokens": args.text_tokens, "modes": json_modes}), md))
}

/// One temperature's JSON and markdown section (its table and entropy law; the decile plot when
/// `plot`).
fn report(
    args: &Args,
    modes: &[Mode],
    sampling: Sampling,
    cells: &BTreeMap<(usize, usize), Cell>,
    plot: bool,
) -> (serde_json::Value, String) {
    // The law's budget, else the largest tree run.
    let law_mode = modes
        .iter()
        .position(|m| m.name == format!("tree-{}", args.law_budget))
        .or_else(|| modes.iter().rposition(|m| m.mode == pb::DecodingMode::SpeculativeTree));
    let seeds = if sampling.is_greedy() { "" } else { ", each prompt with its own seed in every mode" };
    let mut md = format!("\n#### {}{seeds}\n\n| task | mean H (nats) | ", sampling.label());
    md += &modes.iter().map(|m| format!("{} tau / speed-up", m.name)).collect::<Vec<_>>().join(" | ");
    md += " | lossless |\n|---|---|";
    md += &"---|".repeat(modes.len() + 1);
    md += "\n";
    let mut json_tasks = Vec::new();
    let mut speedups: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    // AR's request time (prefill + decode) over the mode's, per task.
    let mut request_ratios: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
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
        for (m, mode) in modes.iter().enumerate() {
            let c = &cells[&(t, m)];
            let speedup = ar / c.ms_per_token();
            speedups[m].push(speedup);
            request_ratios[m].push(cells[&(t, 0)].request_ms() / c.request_ms());
            md += &format!(" {:.2} / {:.2}x |", c.tau(), speedup);
            json_modes.push(c.json(&mode.name, speedup));
        }
        md += &format!(" {} |\n", if lossless { "all" } else { "NO" });
        json_tasks.push(json!({"task": task.name(), "mean_root_entropy": mean_h, "modes": json_modes, "law": bench::law_json(&logs)}));
    }
    md += "| geomean | |";
    for s in &speedups {
        md += &format!(" {:.2}x |", bench::geomean(s.iter().copied()));
    }
    md += " |\n| geomean, whole request (prefill + decode) | |";
    for r in &request_ratios {
        md += &format!(" {:.2}x |", bench::geomean(r.iter().copied()));
    }
    md += " |\n";
    md += &law_table(&per_task_logs, &pooled);
    if plot {
        if let Err(e) = law_plot(&args.plot, &per_task_logs, &pooled) {
            eprintln!("bench_toyworld: no plot: {e}");
        }
    }
    let value = json!({"temperature": sampling.temperature, "tasks": json_tasks, "pooled_law": bench::law_json(&pooled)});
    (value, md)
}

/// The fitted entropy law per task and pooled (finite-horizon and capped-geometric slopes).
fn law_table(per_task: &[(Task, Vec<Round>)], pooled: &[Round]) -> String {
    let rows = per_task.iter().map(|(t, logs)| (t.name(), logs.as_slice())).chain([("pooled", pooled)]);
    bench::law_table(rows)
}
/// The decile plot: one curve per task and the pooled one, each with its finite-horizon fit.
fn law_plot(path: &std::path::Path, per_task: &[(Task, Vec<Round>)], pooled: &[Round]) -> Result<(), String> {
    let named: Vec<(&str, &[Round])> =
        per_task.iter().map(|(t, l)| (t.name(), l.as_slice())).chain([("pooled", pooled)]).collect();
    bench::law_plot(path, "accepted length vs target entropy (toy world, glance tree)", &named)
}
