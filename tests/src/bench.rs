//! What the end-to-end benchmarks (`bench_toyworld`, `bench_chat`) share: the decoding modes they
//! compare, the per-(prompt set, mode) totals taken from each response, the outputs that differ
//! from autoregressive decoding (with the target's top-2 margin there), and the entropy-law report.

use glance_models::decode::{teacher_forced, ModelInputs};
use glance_models::{LogitRows, TargetModel};
use glance_proto::v1 as pb;
use glance_spec::law::{self, Form, Round};
use serde_json::json;
use std::path::Path;

/// One compared decoding mode: its report name, the wire mode, the tree budget (0: default), the
/// service pair that serves it (0: the benchmark's main verifier and block-head drafter) and the
/// drafter passes one of its rounds takes.
#[derive(Clone, Debug)]
pub struct Mode {
    pub name: String,
    pub mode: pb::DecodingMode,
    pub budget: u32,
    pub pair: usize,
    pub draft_passes: usize,
}

/// Autoregressive first (every other mode is checked against it and timed relative to it), then
/// auto, the tree at each budget, the chain and prompt lookup, all on the main pair.
pub fn modes(budgets: &[u32]) -> Vec<Mode> {
    let mode = |name: String, mode, budget| {
        let draft_passes = match mode {
            pb::DecodingMode::Autoregressive | pb::DecodingMode::PromptLookup => 0,
            _ => 1,
        };
        Mode { name, mode, budget, pair: 0, draft_passes }
    };
    let mut modes = vec![
        mode("autoregressive".into(), pb::DecodingMode::Autoregressive, 0),
        mode("auto".into(), pb::DecodingMode::Auto, 0),
    ];
    modes.extend(budgets.iter().map(|&b| mode(format!("tree-{b}"), pb::DecodingMode::SpeculativeTree, b)));
    modes.push(mode("chain".into(), pb::DecodingMode::SpeculativeChain, 0));
    modes.push(mode("prompt-lookup".into(), pb::DecodingMode::PromptLookup, 0));
    modes
}

/// The geometric mean of `values` (1 when there are none).
pub fn geomean(values: impl IntoIterator<Item = f64>) -> f64 {
    let (logs, n) = values.into_iter().fold((0.0, 0usize), |(sum, n), x| (sum + x.ln(), n + 1));
    (logs / n.max(1) as f64).exp()
}

/// Sorts `values` and returns their median (the upper one of an even count).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// An output that differs from the autoregressive one: where, and for greedy decoding the target's
/// top-2 logit margin there (a tie or near-tie in bf16 is rounding, not a bug). A sampled output
/// has no margin to report: its token is a draw, not an argmax.
pub struct Divergence {
    /// Which prompt, as the report names it.
    pub prompt: String,
    pub mode: String,
    /// The first generated step that differs.
    pub step: usize,
    pub margin: Option<f64>,
    /// The same margin computed in f32 on the same tokens, for a half-precision run: how near a
    /// tie the two candidates are before half precision rounds them.
    pub f32_margin: Option<f64>,
}

impl Divergence {
    /// A sampled run's divergence: its token is a draw, so it has no margin.
    pub fn sampled(prompt: String, mode: String, step: usize) -> Self {
        Divergence { prompt, mode, step, margin: None, f32_margin: None }
    }

    pub fn json(&self) -> serde_json::Value {
        json!({"prompt": self.prompt, "mode": self.mode, "step": self.step, "top2_margin": self.margin,
               "f32_top2_margin": self.f32_margin})
    }
}

/// The target in a run's dtype, and in f32 beside it for a half-precision run: the top-2 margins
/// at a divergence, both on the services' libtorch thread count (with more threads a short
/// half-precision pass leaves the few-row kernel for libtorch's GEMM, which rounds otherwise).
pub struct MarginProbe {
    model: TargetModel,
    in_f32: Option<TargetModel>,
}

impl MarginProbe {
    pub fn load(dir: &Path, kind: tch::Kind, device: tch::Device, threads: u32) -> Self {
        tch::set_num_threads(threads as i32);
        let load = |kind| TargetModel::load(dir, kind, device).expect("the target loads");
        let in_f32 = (kind != tch::Kind::Float).then(|| load(tch::Kind::Float));
        MarginProbe { model: load(kind), in_f32 }
    }

    /// The divergence of `mode` at `step`, with its margins after the prompt and `prefix` (the
    /// autoregressive tokens before the step).
    pub fn divergence(
        &self,
        (prompt, mode, step): (String, String, usize),
        inputs: &ModelInputs,
        prefix: &[u32],
    ) -> Divergence {
        let margin = Some(top2_margin(&self.model, inputs, prefix));
        let f32_margin = self.in_f32.as_ref().map(|model| top2_margin(model, inputs, prefix));
        Divergence { prompt, mode, step, margin, f32_margin }
    }
}

/// The first index where two token sequences differ (the shorter length when one is a prefix).
pub fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()))
}

/// The target's top-2 logit margin after the prompt and `prefix` (the autoregressive tokens before
/// the step that differs): one teacher-forced pass in the model's own dtype.
pub fn top2_margin(model: &TargetModel, inputs: &ModelInputs, prefix: &[u32]) -> f64 {
    let _no_grad = tch::no_grad_guard();
    let prefix: Vec<i64> = prefix.iter().map(|&t| i64::from(t)).collect();
    let pass = teacher_forced(model, inputs, &prefix, &[], LogitRows::Last).expect("teacher-forced pass");
    let logits = match pass.continuation.and_then(|c| c.logits) {
        Some(rows) => rows.get(-1),
        None => pass.prompt_logits.get(-1),
    };
    let (top, _) = logits.to_kind(tch::Kind::Float).topk(2, -1, true, true);
    top.double_value(&[0]) - top.double_value(&[1])
}

/// The report's divergence section (markdown).
pub fn divergence_section(divergences: &[Divergence]) -> String {
    if divergences.is_empty() {
        return "\nEvery output equals the autoregressive one.\n".into();
    }
    let mut md = format!(
        "\n{} outputs differ from the autoregressive one (step, target top-2 logit margin there):\n\n",
        divergences.len()
    );
    for d in divergences {
        let margin = d.margin.map_or("sampled".to_string(), |m| format!("margin {m:.4}"));
        let in_f32 = d.f32_margin.map_or(String::new(), |m| format!(" (f32 {m:.4})"));
        md += &format!("- prompt {} {}: step {}, {margin}{in_f32}\n", d.prompt, d.mode, d.step);
    }
    let largest =
        |margin: fn(&Divergence) -> Option<f64>| divergences.iter().filter_map(margin).reduce(f64::max);
    if let Some(run) = largest(|d| d.margin) {
        md += &format!("\nLargest top-2 margin at a divergence: {run:.4}");
        if let Some(in_f32) = largest(|d| d.f32_margin) {
            md += &format!("; computed in f32 on the same tokens, the largest is {in_f32:.4}");
        }
        md += ".\n";
    }
    md
}

/// How a benchmark run chooses tokens: greedily (temperature 0) or by sampling at a temperature,
/// each prompt with its own seed and that seed in every mode. Lossless speculative sampling
/// commits exactly the draws autoregressive sampling makes with the same seed, so every mode must
/// return the autoregressive tokens either way.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling { temperature: 0.0 };

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// How reports name it.
    pub fn label(&self) -> String {
        if self.is_greedy() {
            "greedy".into()
        } else {
            format!("temperature {}", self.temperature)
        }
    }
}

/// The decoding options of a benchmark request in `mode` (round logs on, for the entropy law),
/// sampling with `seed` unless greedy.
pub fn decoding(mode: &Mode, sampling: Sampling, seed: u64) -> pb::DecodingOptions {
    pb::DecodingOptions {
        mode: mode.mode as i32,
        tree_budget: mode.budget,
        log_rounds: true,
        temperature: sampling.temperature,
        seed: (!sampling.is_greedy()).then_some(seed),
        ..Default::default()
    }
}

/// Totals of one (prompt set, mode) cell.
#[derive(Default, Clone)]
pub struct Cell {
    pub ms_per_token: Vec<f64>,
    /// Per request, prefill (time to first token) plus decode, milliseconds: what a client waits.
    pub request_ms: Vec<f64>,
    pub prefill_ms: f64,
    /// Decode-window totals (tokens after the first, and their milliseconds) for a pooled rate.
    pub decode_tokens: u64,
    pub decode_ms: f64,
    pub rounds: u64,
    /// Target passes: verify rounds, greedy steps (auto's, and fallbacks without a drafter).
    pub target_passes: u64,
    pub committed: f64,
    pub accepted_per_depth: Vec<u64>,
    pub draft_ms: f64,
    pub hop_ms: f64,
    pub verify_ms: f64,
    pub lossless: u64,
    pub prompts: u64,
    pub round_logs: Vec<Round>,
}

impl Cell {
    /// Tokens committed per drafted round (1 when nothing was drafted).
    pub fn tau(&self) -> f64 {
        if self.rounds == 0 {
            1.0
        } else {
            self.committed / self.rounds as f64
        }
    }

    /// Mean over prompts of decode ms per generated token.
    pub fn ms_per_token(&self) -> f64 {
        self.ms_per_token.iter().sum::<f64>() / self.ms_per_token.len().max(1) as f64
    }

    /// Mean over prompts of a request's prefill plus decode milliseconds.
    pub fn request_ms(&self) -> f64 {
        self.request_ms.iter().sum::<f64>() / self.request_ms.len().max(1) as f64
    }

    /// Draft and hop milliseconds per verify round, and verify milliseconds per target pass (in
    /// a fixed mode with a drafter, per round; in auto, whose verify time also covers its greedy
    /// steps, per pass of any kind).
    pub fn round_breakdown(&self) -> [f64; 3] {
        let rounds = self.rounds.max(1) as f64;
        [self.draft_ms / rounds, self.hop_ms / rounds, self.verify_ms / self.target_passes.max(1) as f64]
    }

    /// Adds one response; returns whether its tokens equal `reference`.
    pub fn record(&mut self, r: &pb::GenerateResponse, reference: &[u32]) -> bool {
        let usage = r.usage.unwrap_or_default();
        let timings = r.timings.unwrap_or_default();
        let identical = r.token_ids == reference;
        self.prompts += 1;
        self.lossless += identical as u64;
        self.ms_per_token.push(timings.decode_ms / usage.generated_tokens.max(1) as f64);
        self.request_ms.push(timings.prefill_ms + timings.decode_ms);
        self.prefill_ms += timings.prefill_ms;
        self.decode_tokens += u64::from(usage.generated_tokens.saturating_sub(1));
        self.decode_ms += timings.decode_ms;
        if let Some(s) = &r.speculative {
            self.add_speculative(s);
        }
        identical
    }

    fn add_speculative(&mut self, s: &pb::SpeculativeStats) {
        self.rounds += s.rounds as u64;
        // Auto's steps: not asked, beside the drafter, and in place of a declined or stale tree.
        let steps = s
            .auto
            .as_ref()
            .map_or(0, |a| a.greedy_steps + a.overlapped_steps + a.declined_trees + a.stale_trees);
        self.target_passes += u64::from(s.rounds + s.fallback_rounds + steps);
        self.committed += s.mean_accepted_length * s.rounds as f64;
        if self.accepted_per_depth.len() < s.accepted_per_depth.len() {
            self.accepted_per_depth.resize(s.accepted_per_depth.len(), 0);
        }
        for (d, &c) in s.accepted_per_depth.iter().enumerate() {
            self.accepted_per_depth[d] += c;
        }
        self.draft_ms += s.draft_ms;
        self.hop_ms += s.hop_ms;
        self.verify_ms += s.verify_ms;
        self.round_logs.extend(
            s.round_logs
                .iter()
                .map(|l| Round { entropy: l.root_entropy as f64, accepted: l.accepted as f64 }),
        );
    }

    /// The cell as JSON, with its speed-up over autoregressive.
    pub fn json(&self, name: &str, speedup: f64) -> serde_json::Value {
        let round_ms = self.draft_ms + self.hop_ms + self.verify_ms;
        json!({
            "mode": name, "tau": self.tau(), "speedup": speedup, "ms_per_token": self.ms_per_token(),
            "request_ms": self.request_ms(), "prefill_ms": self.prefill_ms / self.prompts.max(1) as f64,
            "rounds": self.rounds, "target_passes": self.target_passes, "accepted_per_depth": self.accepted_per_depth, "draft_ms": self.draft_ms,
            "hop_ms": self.hop_ms, "verify_ms": self.verify_ms,
            "hop_share": if round_ms > 0.0 { self.hop_ms / round_ms } else { 0.0 },
            "lossless": format!("{}/{}", self.lossless, self.prompts),
        })
    }
}

/// The entropy law fitted to round logs, as JSON (both forms, Spearman, deciles).
pub fn law_json(rounds: &[Round]) -> serde_json::Value {
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

/// A markdown table of the fitted entropy law, one row per named set of round logs.
pub fn law_table<'a>(rows: impl IntoIterator<Item = (&'a str, &'a [Round])>) -> String {
    let mut md = String::from(
        "\n| entropy law | rounds | mean H | b0 / b1 (finite horizon) | R² deciles | b0 / b1 (capped) | Spearman ρ |\n|---|---|---|---|---|---|---|\n",
    );
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

/// The decile plot of named round logs, each with its finite-horizon fit.
pub fn law_plot(path: &std::path::Path, title: &str, named: &[(&str, &[Round])]) -> Result<(), String> {
    let deciles: Vec<Vec<law::Decile>> = named.iter().map(|(_, l)| law::deciles(l)).collect();
    let fits: Vec<Option<law::Fit>> =
        named.iter().map(|(_, l)| law::fit(Form::FiniteHorizon, l, 15)).collect();
    let series: Vec<crate::law_plot::Series> = named
        .iter()
        .zip(&deciles)
        .zip(&fits)
        .map(|(((name, _), d), f)| crate::law_plot::Series { name, deciles: d, fit: f.as_ref() })
        .collect();
    crate::law_plot::draw(path, title, &series, 15)
}
