//! The Rust EAGLE-3 head against a torch re-statement of EAGLE's (`tests/reference/
//! make_eagle3_reference.py`): a random head in the public layout (`fc`, `midlayer.*`, `norm`,
//! `lm_head`, `d2t`, `t2d`; Llama 3.1 rope scaling at its own theta) on the tiny text-only Llama,
//! three context calls sharing one draft cache (20 rows, 3, 1), and the trees EAGLE-2's dynamic
//! expansion grows after the first two, through the engine's session as the service drives it.
//!
//! Fixture root: `$GLANCE_FIXTURES`, else `<workspace>/tests/fixtures`; the head and its dumps live
//! in `<root>/tiny-llama-eagle3/`. Skipped when absent unless `GLANCE_REQUIRE_FIXTURES=1`.

#![allow(clippy::disallowed_methods)] // tests build and read host tensors freely

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use drafter_svc::eagle3::Eagle3Head;
use drafter_svc::engines::Eagle3Engine;
use glance_spec::session::{DraftEngine, RoundInput};
use glance_spec::tree::{Reach, TokenId, Tree};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

const HEAD: &str = "tiny-llama-eagle3";
const TARGET: &str = "tiny-llama";
/// f32 on both sides; only summation order differs.
const TOLERANCE: f64 = 1e-4;

fn fixture_root() -> Option<PathBuf> {
    let root = std::env::var_os("GLANCE_FIXTURES").map(PathBuf::from).unwrap_or_else(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        manifest.parent().unwrap_or(manifest).join("tests/fixtures")
    });
    if root.join(HEAD).join("reference").is_dir() && root.join(TARGET).is_dir() {
        return Some(root);
    }
    assert!(
        std::env::var("GLANCE_REQUIRE_FIXTURES").as_deref() != Ok("1"),
        "GLANCE_REQUIRE_FIXTURES=1 but {} has no {HEAD}/reference (run tests/reference/make_eagle3_reference.py)",
        root.display()
    );
    eprintln!("SKIPPED: no EAGLE-3 reference under {}", root.display());
    None
}

struct Reference {
    meta: Value,
    tensors: HashMap<String, Tensor>,
}

impl Reference {
    fn load(head_dir: &Path) -> Self {
        let meta =
            serde_json::from_str(&std::fs::read_to_string(head_dir.join("reference/eagle3.json")).unwrap())
                .expect("eagle3.json");
        let tensors = Tensor::read_safetensors(head_dir.join("reference/eagle3.safetensors")).unwrap();
        Self { meta, tensors: tensors.into_iter().collect() }
    }

    fn calls(&self) -> &Vec<Value> {
        self.meta["calls"].as_array().expect("calls")
    }

    fn tensor(&self, name: &str) -> &Tensor {
        &self.tensors[name]
    }

    /// The token beside each state of call `i` (the next token of its position).
    fn tokens(&self, i: usize) -> Vec<i64> {
        self.calls()[i]["tokens"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect()
    }

    fn tree(&self, i: usize) -> BTreeMap<Vec<TokenId>, f64> {
        self.calls()[i]["tree"]
            .as_array()
            .expect("a tree")
            .iter()
            .map(|node| {
                let path =
                    node["path"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as TokenId).collect();
                (path, node["log_prob"].as_f64().unwrap())
            })
            .collect()
    }

    fn setting(&self, key: &str) -> usize {
        self.meta["tree"][key].as_u64().unwrap() as usize
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float)).abs().max().double_value(&[])
}

/// Every node's token path from the root, with its log-probability.
fn paths(tree: &Tree) -> BTreeMap<Vec<TokenId>, f64> {
    let mut paths: Vec<Vec<TokenId>> = Vec::new();
    for i in 0..tree.len() {
        let mut path = match usize::try_from(tree.parents[i]) {
            Ok(p) => paths[p].clone(),
            Err(_) => Vec::new(),
        };
        path.push(tree.tokens[i]);
        paths.push(path);
    }
    paths.into_iter().zip(tree.log_probs.iter().copied()).collect()
}

#[test]
fn outputs_over_calls_sharing_a_cache_equal_the_reference() {
    let Some(root) = fixture_root() else { return };
    let _no_grad = tch::no_grad_guard();
    let dir = root.join(HEAD);
    let reference = Reference::load(&dir);
    let head = Eagle3Head::load(&dir, &root.join(TARGET), Kind::Float, Device::Cpu).expect("the head loads");
    assert_eq!(head.config().tap_layers, [0, 1, 2]);
    let mut cache = head.new_cache(64);
    for i in 0..reference.calls().len() {
        let states = reference.tensor(&format!("states_{i}"));
        let rows = states.size()[0] as usize;
        let start = cache.len();
        let tokens = Tensor::from_slice(&reference.tokens(i));
        let positions = Tensor::arange_start(start as i64, (start + rows) as i64, (Kind::Int64, Device::Cpu));
        let visible = head.causal_visibility(start, rows);
        let out = head.forward(&mut cache, states, &tokens, &positions, &visible);
        cache.advance(rows);
        let out_diff = max_abs_diff(&out, reference.tensor(&format!("out_{i}")));
        let lp_diff = max_abs_diff(&head.log_probs(&out), reference.tensor(&format!("log_probs_{i}")));
        println!("call {i}: {rows} rows, outputs max|Δ| {out_diff:.2e}, log-probs max|Δ| {lp_diff:.2e}");
        assert!(out_diff <= TOLERANCE && lp_diff <= TOLERANCE, "call {i}: {out_diff} / {lp_diff}");
    }
}

#[test]
fn the_session_grows_eagle_trees_over_its_context() {
    let Some(root) = fixture_root() else { return };
    let _no_grad = tch::no_grad_guard();
    let dir = root.join(HEAD);
    let reference = Reference::load(&dir);
    let expansions = reference.setting("expansions");
    let engine = Eagle3Engine::load(&dir, &root.join(TARGET), Kind::Float, Device::Cpu, 512, expansions)
        .expect("the engine loads");
    let handshake = engine.handshake();
    assert_eq!(
        (handshake.block_size, handshake.tap_layers.as_slice()),
        (expansions + 2, &[0usize, 1, 2][..])
    );
    let mut session = engine.new_session();
    // Context rows carry the token at each position; the head pairs a state with the next one,
    // so a call's tokens (beside its states) are the context's shifted by one, the last the root.
    let mut committed: Vec<TokenId> = vec![7];
    for i in 0..2 {
        let next: Vec<TokenId> = reference.tokens(i).iter().map(|&t| t as TokenId).collect();
        let first = committed.len() - 1;
        let rows = next.len();
        let tokens = committed[first..].iter().chain(&next[..rows - 1]).copied().collect::<Vec<_>>();
        let states = reference.tensor(&format!("states_{i}")).shallow_clone();
        session.append_context(first, &tokens, Some(states)).expect("context");
        let round = RoundInput {
            root_token: next[rows - 1],
            root_position: first + rows,
            budget: reference.setting("budget"),
            branch_k: reference.setting("top_k"),
            spine: false,
            reach: Reach::unbounded(),
        };
        let tree = session.draft(&round).expect("a tree");
        let limits =
            glance_spec::tree::TreeLimits { vocab: 1024, max_nodes: 1024, max_depth: expansions + 1 };
        assert!(tree.validate(limits).is_ok(), "call {i}: an invalid tree");
        assert!(tree.log_probs.windows(2).all(|w| w[0] >= w[1]), "call {i}: not best-first");
        let (ours, theirs) = (paths(&tree), reference.tree(i));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "call {i}: other nodes"
        );
        let largest = ours.iter().map(|(p, v)| (v - theirs[p]).abs()).fold(0.0, f64::max);
        let deepest = ours.keys().map(Vec::len).max().unwrap_or(0);
        println!("call {i}: {} nodes, {deepest} deep, log-probs max|Δ| {largest:.2e}", tree.len());
        assert!(largest <= TOLERANCE, "call {i}: log-probabilities differ by {largest}");
        committed = tokens;
        committed.push(round.root_token);
    }
}

#[test]
fn d2t_maps_the_draft_vocabulary_onto_t2d() {
    let Some(root) = fixture_root() else { return };
    let dir = root.join(HEAD);
    let head = Eagle3Head::load(&dir, &root.join(TARGET), Kind::Float, Device::Cpu).expect("the head loads");
    let weights: HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("model.safetensors")).unwrap().into_iter().collect();
    let t2d = Vec::<bool>::try_from(weights["t2d"].to_kind(Kind::Bool)).unwrap();
    let marked: Vec<i64> = t2d.iter().enumerate().filter(|(_, &m)| m).map(|(i, _)| i as i64).collect();
    assert_eq!(head.draft_to_target_host(), marked.as_slice(), "d2t and t2d name other tokens");
    let draft_ids = Tensor::from_slice(&[0i64, 5, 255]);
    let mapped = Vec::<i64>::try_from(head.to_target(&draft_ids)).unwrap();
    assert_eq!(mapped, [marked[0], marked[5], marked[255]]);
}

/// The training-time test's unroll computes, at every position, what the head computes when it
/// drafts a chain from there at inference: step k at index s equals the depth-k node drafted after
/// the context up to s, with the true tokens as the chain.
#[test]
fn the_training_unroll_sees_what_a_drafted_chain_sees() {
    let Some(root) = fixture_root() else { return };
    let _no_grad = tch::no_grad_guard();
    let head = Eagle3Head::load(&root.join(HEAD), &root.join(TARGET), Kind::Float, Device::Cpu)
        .expect("the head loads");
    tch::manual_seed(3);
    let (n, width) = (12i64, 3 * head.config().target_hidden_size);
    let states = Tensor::randn([n - 1, width], (Kind::Float, Device::Cpu));
    let tokens: Vec<i64> = (0..n).map(|i| (i * 37 + 5) % 1024).collect();
    let steps = 3usize;
    let mut unrolled = Vec::new();
    let (mut hidden, mut cache) = (states.shallow_clone(), Vec::new());
    for k in 0..steps as i64 {
        let step_tokens: Vec<i64> =
            (0..n - 1).map(|s| tokens.get((s + 1 + k) as usize).copied().unwrap_or(0)).collect();
        let positions = Tensor::arange_start(k, k + n - 1, (Kind::Int64, Device::Cpu));
        let out = head.forward_ttt(&hidden, &Tensor::from_slice(&step_tokens), &positions, &mut cache);
        unrolled.push(out.shallow_clone());
        hidden = out;
    }
    for s in [0usize, 4, 7] {
        let mut kv = head.new_cache(32);
        let rows = s + 1;
        let context_tokens = Tensor::from_slice(&tokens[1..=rows]);
        let positions = Tensor::arange(rows as i64, (Kind::Int64, Device::Cpu));
        let visible = head.causal_visibility(0, rows);
        let out =
            head.forward(&mut kv, &states.narrow(0, 0, rows as i64), &context_tokens, &positions, &visible);
        kv.advance(rows);
        let mut node = out.narrow(0, s as i64, 1);
        let mut largest = max_abs_diff(&node, &unrolled[0].narrow(0, s as i64, 1));
        for (k, step) in unrolled.iter().enumerate().skip(1) {
            let token = Tensor::from_slice(&[tokens[s + 1 + k]]);
            let position = Tensor::from_slice(&[(s + k) as i64]);
            let visible = Tensor::ones([1, (rows + k) as i64], (Kind::Bool, Device::Cpu));
            node = head.forward(&mut kv, &node, &token, &position, &visible);
            kv.advance(1);
            largest = largest.max(max_abs_diff(&node, &step.narrow(0, s as i64, 1)));
        }
        println!("index {s}: the unroll against the drafted chain, max|Δ| {largest:.2e}");
        assert!(largest <= TOLERANCE, "index {s}: {largest}");
    }
}
