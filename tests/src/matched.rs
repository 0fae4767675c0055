//! The paper's matched comparison, for any benchmark's prompt sets (the toy world's tasks, the real
//! model's held-out chat): the GLANCE block head against an EAGLE-3 head trained on the same rows,
//! each behind a service pair of its own, and the paper's ablations (the head blind, tree against
//! chain, the budget sweep), each figure beside the paper's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use serde_json::json;

use crate::bench::{self, Cell, Mode};
use crate::process::ServiceProcess;

/// Cells by (prompt set, mode).
pub type Cells = BTreeMap<(usize, usize), Cell>;

/// The benchmarks' service flags: how each service runs, and the drafters of the matched
/// comparison.
#[derive(clap::Args, Clone, Debug)]
pub struct ServiceArgs {
    /// `f32`, `bf16` or `f16` (bench_chat: `f32` or `bf16`, the two its transformers peer runs):
    /// both services, the target's top-2 margins at divergences, and bench_chat's peer.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// The drafters' dtype when it differs from `--dtype` (drafter-svc `--dtype`: `f32`, `bf16`,
    /// `f16` or `auto`). A drafter's precision changes its trees, never the output.
    #[arg(long)]
    pub drafter_dtype: Option<String>,
    /// libtorch threads of each service (OMP_NUM_THREADS; also bench_chat's peer and the margin
    /// pass at divergences). On a 2-core machine one each keeps the verifier's and the drafter's
    /// thread pools from spinning against each other, as if each service had its own device (as
    /// in production).
    #[arg(long, default_value_t = 1)]
    pub threads_per_service: u32,
    /// Which tokens the block head's drafter scores (drafter-svc `--draft-vocab`): `auto`, the
    /// most frequent tokens of its training responses covering 98% of them (at least 4,096) when
    /// the head directory has their `draft_vocab.json`, else all; `all`; N, the N most frequent
    /// of the file's; or P%, as many as cover P% of them.
    #[arg(long, default_value_t = drafter_svc::draft_vocab::DraftVocabChoice::Auto)]
    pub draft_vocab: drafter_svc::draft_vocab::DraftVocabChoice,
    /// An EAGLE-3 head trained on the same rows (the matched comparison): adds its chains of
    /// depth 3 and 7 and its budget-31 tree, each through a drafter (`--eagle-depth`) and a
    /// verifier of its own, and a section comparing them with the block head.
    #[arg(long)]
    pub eagle3_head: Option<PathBuf>,
    /// The paper's ablation: adds the block head with its conditioning states zeroed (a tree at
    /// the law budget), through its own drafter and verifier.
    #[arg(long)]
    pub ablate_states: bool,
}

impl ServiceArgs {
    /// Whether the run makes the matched comparison (an EAGLE-3 head or the ablation asked for).
    pub fn compares(&self) -> bool {
        self.eagle3_head.is_some() || self.ablate_states
    }
}

/// What the service pairs of a benchmark run serve.
#[derive(Clone, Debug)]
pub struct Setup {
    pub target: PathBuf,
    /// The GLANCE block head (the main pair).
    pub head: PathBuf,
    pub budgets: Vec<u32>,
    /// The tree budget of the blinded head.
    pub law_budget: u32,
    pub services: ServiceArgs,
}

impl Setup {
    pub fn new(target: &Path, head: &Path, budgets: &[u32], law_budget: u32, services: &ServiceArgs) -> Self {
        let (target, head, budgets) = (target.to_path_buf(), head.to_path_buf(), budgets.to_vec());
        Self { target, head, budgets, law_budget, services: services.clone() }
    }
}

/// A verifier and the drafter behind it.
pub struct Pair {
    _drafter: ServiceProcess,
    _verifier: ServiceProcess,
    pub client: GenerationClient<tonic::transport::Channel>,
}

impl Pair {
    pub async fn start(setup: &Setup, drafter_args: &[&str]) -> Self {
        let threads = setup.services.threads_per_service.to_string();
        let env = [("OMP_NUM_THREADS", threads.as_str())];
        let dtype =
            ["--dtype", setup.services.drafter_dtype.as_ref().unwrap_or(&setup.services.dtype).as_str()];
        let drafter = ServiceProcess::drafter_with_env(&[drafter_args, &dtype].concat(), &env);
        let verifier = ServiceProcess::verifier_with_env(
            &setup.target,
            &["--drafter", &drafter.url, "--max-tree-budget", "256", "--dtype", &setup.services.dtype],
            &env,
        );
        let client = GenerationClient::connect(verifier.url.clone()).await.expect("connect");
        Self { _drafter: drafter, _verifier: verifier, client }
    }
}

/// The service pairs and the modes they serve: the block head's (`bench::modes`) on pair 0, then
/// the EAGLE-3 ones and the ablation when the setup asks for them.
pub async fn pairs_and_modes(setup: &Setup) -> (Vec<Pair>, Vec<Mode>) {
    let (head, target) = (setup.head.to_str().expect("utf-8"), setup.target.to_str().expect("utf-8"));
    let draft_vocab = setup.services.draft_vocab.to_string();
    let block_head =
        ["--kind", "block-head", "--head", head, "--target", target, "--draft-vocab", &draft_vocab];
    let mut pairs = vec![Pair::start(setup, &block_head).await];
    let mut modes = bench::modes(&setup.budgets);
    if let Some(eagle) = &setup.services.eagle3_head {
        let eagle = eagle.to_str().expect("utf-8");
        for (depth, chain, tree) in
            [(2usize, "eagle3-chain-3", None), (6, "eagle3-chain-7", Some("eagle3-tree-31"))]
        {
            let depth_arg = depth.to_string();
            let drafter =
                ["--kind", "eagle3", "--head", eagle, "--target", target, "--eagle-depth", &depth_arg];
            pairs.push(Pair::start(setup, &drafter).await);
            let pair = pairs.len() - 1;
            let passes = depth + 1;
            let mode = |name: &str, mode, budget| Mode {
                name: name.into(),
                mode,
                budget,
                pair,
                draft_passes: passes,
            };
            modes.push(mode(chain, pb::DecodingMode::SpeculativeChain, 0));
            if let Some(tree) = tree {
                modes.push(mode(tree, pb::DecodingMode::SpeculativeTree, 31));
            }
        }
    }
    if setup.services.ablate_states {
        let blind = ["--kind", "block-head", "--head", head, "--target", target, "--zero-states"];
        pairs.push(Pair::start(setup, &blind).await);
        modes.push(Mode {
            name: blind_mode(setup.law_budget),
            mode: pb::DecodingMode::SpeculativeTree,
            budget: setup.law_budget,
            pair: pairs.len() - 1,
            draft_passes: 1,
        });
    }
    (pairs, modes)
}

/// The report name of the blinded head's tree.
fn blind_mode(budget: u32) -> String {
    format!("tree-{budget}-no-states")
}

/// The pairs of modes whose tau ratio the comparison reports: the paper's (its GLANCE at budget
/// 63 against the matched EAGLE-3 head's depth-3 chain: pooled 4.37 / 1.60 = 2.7x, 4.0x on
/// ChartQA) and the like-for-like one (both trees at budget 31).
const RATIOS: [(&str, &str, &str); 2] = [
    ("tree-63", "eagle3-chain-3", "paper: 2.7x pooled, 4.0x ChartQA"),
    ("tree-31", "eagle3-tree-31", "no paper figure"),
];

/// The modes the comparison shows (with the blinded head's).
const SHOWN: [&str; 8] = [
    "tree-31",
    "tree-63",
    "chain",
    "eagle3-chain-3",
    "eagle3-chain-7",
    "eagle3-tree-31",
    "prompt-lookup",
    "auto",
];

/// The matched comparison on one run over the named prompt sets (mode 0 autoregressive): per set,
/// the block head's trees at budgets 31 and 63 and its chain, EAGLE-3's chains of depth 3 and 7
/// and its budget-31 tree, the blinded head: tau, drafter passes and milliseconds per round,
/// speed-up, lossless prompts; the matched-training tau ratios of `RATIOS`, per set and pooled
/// over the sets; and the ablations.
pub fn comparison(
    setup: &Setup,
    sets: &[&str],
    modes: &[Mode],
    cells: &Cells,
) -> (serde_json::Value, String) {
    let ablation = blind_mode(setup.law_budget);
    let shown: Vec<usize> = modes
        .iter()
        .enumerate()
        .filter(|(_, m)| SHOWN.contains(&m.name.as_str()) || m.name == ablation)
        .map(|(i, _)| i)
        .collect();
    let find = |name: &str| modes.iter().position(|m| m.name == name);
    let ratios: Vec<(String, usize, usize)> = RATIOS
        .iter()
        .filter_map(|(g, e, paper)| Some((format!("{g} / {e} tau ({paper})"), find(g)?, find(e)?)))
        .collect();
    let mut md = String::from(
        "\nMatched comparison (the block head and EAGLE-3 trained on the same rows): tau / drafter passes per round / draft ms per round / speed-up / lossless prompts\n\n| prompts |",
    );
    for &m in shown.iter() {
        md += &format!(" {} |", modes[m].name);
    }
    for (name, _, _) in &ratios {
        md += &format!(" {name} |");
    }
    md += "\n|---|";
    md += &"---|".repeat(shown.len() + ratios.len());
    md += "\n";
    let mut json_sets = Vec::new();
    for (t, set) in sets.iter().enumerate() {
        let ar = cells[&(t, 0)].ms_per_token();
        md += &format!("| {set} |");
        let mut json_modes = Vec::new();
        for &m in &shown {
            let c = &cells[&(t, m)];
            // A mode that verified no drafted round (auto stepping greedily) has no per-round cost.
            let draft_ms = (c.rounds > 0).then(|| c.round_breakdown()[0]);
            md += &format!(
                " {:.2} / {} / {} / {:.2}x / {}/{} |",
                c.tau(),
                modes[m].draft_passes,
                draft_ms.map_or("-".to_string(), |ms| format!("{ms:.1}")),
                ar / c.ms_per_token(),
                c.lossless,
                c.prompts
            );
            json_modes.push(json!({"mode": modes[m].name, "tau": c.tau(), "draft_passes": modes[m].draft_passes, "draft_ms_per_round": draft_ms, "speedup": ar / c.ms_per_token(), "lossless": c.lossless, "prompts": c.prompts}));
        }
        let mut json_ratios = Vec::new();
        for (name, g, e) in &ratios {
            let ratio = cells[&(t, *g)].tau() / cells[&(t, *e)].tau();
            md += &format!(" {ratio:.2}x |");
            json_ratios.push(json!({"ratio": name, "value": ratio}));
        }
        md += "\n";
        json_sets.push(json!({"task": set, "modes": json_modes, "tau_ratios": json_ratios}));
    }
    let mut json_pooled = Vec::new();
    for (name, g, e) in &ratios {
        let pooled = pooled_tau(sets.len(), cells, *g) / pooled_tau(sets.len(), cells, *e);
        let geo = geo_ratio(sets.len(), cells, *g, *e);
        md += &format!(
            "\n{name}: pooled over the prompt sets' rounds {pooled:.2}x, geometric mean of the sets {geo:.2}x.\n"
        );
        json_pooled.push(json!({"ratio": name, "pooled": pooled, "geomean": geo}));
    }
    let (ablations_json, ablations_md) = ablations(setup, sets.len(), modes, cells);
    md += &ablations_md;
    (json!({"tasks": json_sets, "tau_ratios": json_pooled, "ablations": ablations_json}), md)
}

/// Tau of mode `m` pooled over every set's rounds (committed tokens over rounds), as the paper
/// pools its five tasks.
fn pooled_tau(sets: usize, cells: &Cells, m: usize) -> f64 {
    let (committed, rounds) = (0..sets)
        .map(|t| &cells[&(t, m)])
        .fold((0.0, 0u64), |(c, r), cell| (c + cell.committed, r + cell.rounds));
    if rounds == 0 {
        1.0
    } else {
        committed / rounds as f64
    }
}

/// The geometric mean over the sets of `value(set index)`.
fn over_sets(sets: usize, value: impl Fn(usize) -> f64) -> f64 {
    bench::geomean((0..sets).map(value))
}

/// The geometric mean over the sets of mode `g`'s tau over mode `e`'s.
fn geo_ratio(sets: usize, cells: &Cells, g: usize, e: usize) -> f64 {
    over_sets(sets, |t| cells[&(t, g)].tau() / cells[&(t, e)].tau())
}

/// The paper's ablations over all sets, each beside the paper's figure: the block head blind
/// (states zeroed), its tree against its own chain, and the speed-up over the tree budgets.
fn ablations(setup: &Setup, sets: usize, modes: &[Mode], cells: &Cells) -> (serde_json::Value, String) {
    let find = |name: &str| modes.iter().position(|m| m.name == name);
    let speedup =
        |m: usize| over_sets(sets, |t| cells[&(t, 0)].ms_per_token() / cells[&(t, m)].ms_per_token());
    let mut md = String::from("\nAblations (geometric means over the prompt sets), beside the paper:\n\n");
    let mut json = json!({});
    if let Some(blind) = find(&blind_mode(setup.law_budget)) {
        let blind_tau = over_sets(sets, |t| cells[&(t, blind)].tau());
        md += &format!("- block head with its states zeroed: tree tau {blind_tau:.2} (paper: 1.11)\n");
        json["no_states_tau"] = json!(blind_tau);
    }
    if let (Some(tree), Some(chain)) = (find("tree-31"), find("chain")) {
        let ratio = geo_ratio(sets, cells, tree, chain);
        md +=
            &format!("- tree (budget 31) tau over the same head's chain: {ratio:.2}x (paper: 1.45-1.49x)\n");
        json["tree_over_chain_tau"] = json!(ratio);
    }
    let sweep: Vec<(u32, f64)> =
        setup.budgets.iter().filter_map(|b| find(&format!("tree-{b}")).map(|m| (*b, speedup(m)))).collect();
    if !sweep.is_empty() {
        let shown: Vec<String> = sweep.iter().map(|(b, s)| format!("{b}: {s:.2}x")).collect();
        md += &format!(
            "- tree speed-up by budget: {} (paper: rises from 15 to 31, then flattens)\n",
            shown.join(", ")
        );
        json["speedup_by_budget"] = sweep.iter().map(|(b, s)| json!({"budget": b, "speedup": s})).collect();
    }
    (json, md)
}
