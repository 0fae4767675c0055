//! The cost shape of a speculative round: what verifying n rows costs against one greedy step, for
//! the toy target and for random-weight targets with the real text-layer shapes of Qwen3-VL-2B and
//! -8B (a few layers each, the full vocabulary), in f32 and bf16, at a filled context. Next to it
//! the draft pass of a head of matching width, the tap-state bytes a round sends, and the same
//! forward run by transformers on the same shapes in the same run (the peer). `--model DIR` adds
//! a real checkpoint (any family the model library loads; SmolLM2 after `scripts/setup.sh`), its
//! peer being transformers' own `from_pretrained` of the same directory.
//!
//! What is timed is the product's own code: the verifier's `greedy_step`-equivalent decode step
//! (`decode::forward_token` + argmax, no taps: plain greedy decoding) and `speculative::verify_round`
//! (mask, target pass with taps, argmax and entropy read back, acceptance walk, KV compaction,
//! tap gather) over a best-first tree of n−1 nodes plus the root; the drafter's block-head session
//! (`append_context` + `draft`: head pass, marginals, tree). Each figure is the best of
//! `--repeats` after a warm-up, so that a GPU pass is timed to completion by its read-back. Each
//! piece's host syncs per call (read-backs, counted at `glance-device`) are reported beside it.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use drafter_svc::engines::BlockHeadEngine;
use drafter_svc::head::{DraftHead, DraftHeadConfig};
use glance_models::kv_cache::KvCache;
use glance_models::sampling::Draw;
use glance_models::weights::{Checkpoint, RandomInit};
use glance_models::{TargetConfig, TargetModel};
use glance_spec::session::{DraftEngine, RoundInput, Session};
use glance_spec::tree::{build_budget_tree, Marginals, Reach, TokenId, Tree};
use glance_tests::process::ServiceProcess;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};
use verifier_svc::speculative::{verify_round, RoundReads, TreeMask};

#[derive(Parser)]
#[command(about = "Cost shape of a round: verify(n)/step, draft/step, bytes, and the transformers peer")]
struct Args {
    /// Built shapes to time [default: toy, 2b and 8b; none with `--model`].
    #[arg(long, value_delimiter = ',')]
    shapes: Option<Vec<Shape>>,
    /// A real checkpoint directory to time (after the shapes).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_delimiter = ',', default_values = ["f32", "bf16"])]
    dtypes: Vec<String>,
    /// Rows of the verify pass (root + n−1 tree nodes).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 8, 16, 32, 64])]
    rows: Vec<usize>,
    /// Positions already in the KV cache (random K/V: the cost does not depend on the values).
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Decoder layers of the random-weight targets (default: 4 for 2b, 2 for 8b).
    #[arg(long)]
    layers: Option<usize>,
    /// Vocabulary of the random-weight targets (Qwen3-VL's by default; the LM head is part of
    /// every row's cost).
    #[arg(long, default_value_t = 151_936)]
    vocab: i64,
    /// Decoder layers of the matching draft head.
    #[arg(long, default_value_t = 1)]
    head_layers: usize,
    /// Context rows a round sends the drafter (about tau).
    #[arg(long, default_value_t = 4)]
    rows_per_round: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// libtorch threads (one: the benchmark's default, as each service runs).
    #[arg(long, default_value_t = 1)]
    threads: i32,
    #[arg(long, default_value = "models/toy-target")]
    toy_target: PathBuf,
    /// Skip the transformers peer.
    #[arg(long)]
    no_peer: bool,
    /// Rounds of the loopback hop measurement (the toy head in a drafter-svc process); 0 skips it.
    #[arg(long, default_value_t = 200)]
    hop_rounds: usize,
    #[arg(long, default_value = "models/toy-head")]
    toy_head: PathBuf,
    #[arg(long, default_value = "bench-round.json")]
    json: PathBuf,
    #[arg(long, default_value = "bench-round.md")]
    markdown: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Shape {
    /// The toy world's trained target (its own weights).
    Toy,
    /// Qwen3-VL-2B's text layers: hidden 2048, 16 heads, 8 KV heads, head_dim 128, MLP 6144.
    #[value(name = "2b")]
    Qwen3Vl2b,
    /// Qwen3-VL-8B's text layers: hidden 4096, 32 heads, 8 KV heads, head_dim 128, MLP 12288.
    #[value(name = "8b")]
    Qwen3Vl8b,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.to_possible_value().expect("no skipped variants").get_name())
    }
}

/// What a cell times: a built shape or a checkpoint from disk.
enum Target {
    Shape(Shape),
    Model(PathBuf),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Shape(shape) => shape.fmt(f),
            Target::Model(dir) => f.write_str(&dir.file_name().unwrap_or(dir.as_os_str()).to_string_lossy()),
        }
    }
}

/// The text-layer dimensions the bench builds (and hands the peer).
#[derive(Clone, Debug, serde::Serialize)]
struct Dims {
    hidden: i64,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    intermediate: i64,
    layers: usize,
    vocab: i64,
}

/// Host syncs per call of each timed piece.
#[derive(Debug, serde::Serialize)]
struct HostSyncs {
    step: f64,
    /// A verify round of the largest n (its tap-state copy for the wire is the drafter hop's).
    verify: f64,
    draft: f64,
}

/// Read-backs per call of `f` over `calls` calls.
fn read_backs_per_call(calls: usize, f: impl FnOnce()) -> f64 {
    let before = glance_device::crossings();
    f();
    (glance_device::crossings() - before).read_backs as f64 / calls as f64
}

/// One (shape, dtype) cell of the table.
#[derive(Debug, serde::Serialize)]
struct Cell {
    shape: String,
    /// The checkpoint directory of a `--model` cell.
    model: Option<PathBuf>,
    dtype: String,
    dims: Dims,
    step_ms: f64,
    /// rows → ms of `verify_round`.
    verify_ms: Vec<(usize, f64)>,
    draft_ms: f64,
    /// Tap-state bytes one round sends (rows_per_round rows of taps·hidden).
    state_bytes_per_round: i64,
    /// Device → host read-backs (each a host sync on a GPU), counted at `glance-device`.
    host_syncs: HostSyncs,
    peer_step_ms: Option<f64>,
    peer_verify_ms: Vec<(usize, f64)>,
}

fn main() {
    let args = Args::parse();
    tch::set_num_threads(args.threads);
    tch::manual_seed(0);
    let device = glance_models::weights::parse_device(&args.device).expect("--device: cpu, cuda or cuda:N");
    let mut cells = Vec::new();
    let default_shapes =
        if args.model.is_some() { vec![] } else { vec![Shape::Toy, Shape::Qwen3Vl2b, Shape::Qwen3Vl8b] };
    let shapes = args.shapes.clone().unwrap_or(default_shapes);
    let targets = shapes.into_iter().map(Target::Shape).chain(args.model.clone().map(Target::Model));
    for target in targets {
        for dtype in &args.dtypes {
            let kind = glance_models::weights::parse_kind(dtype).expect("--dtypes: f32, bf16, f16");
            eprintln!("bench_round: {target} {dtype} ...");
            let mut cell = measure(&args, &target, dtype, kind, device);
            if !args.no_peer {
                peer(&args, &mut cell);
            }
            eprintln!("{}", row_markdown(&cell, &args.rows));
            cells.push(cell);
        }
    }
    let hop = (args.hop_rounds > 0).then(|| measure_hop(&args));
    let report = json!({
        "hop": hop,
        "context": args.context,
        "threads": args.threads,
        "device": args.device,
        "rows_per_round": args.rows_per_round,
        "head_layers": args.head_layers,
        "cells": cells,
    });
    std::fs::write(&args.json, serde_json::to_string_pretty(&report).expect("json")).expect("write json");
    let mut markdown = markdown(&cells, &args);
    if let Some(hop) = &hop {
        markdown.push_str(&format!(
            "\nHop (the verifier's drafter client to the toy head in drafter-svc on loopback, {} rounds of \
             {} context rows; round trip minus the drafter's own time): median {:.3} ms, p90 {:.3} ms, max \
             {:.3} ms per round to the reply's arrival on the verifier's I/O thread (what the verifier \
             reports), median {:.3} ms, p90 {:.3} ms to the waiting engine thread; {} bytes sent per round.\n",
            hop.rounds,
            args.rows_per_round,
            hop.median_ms,
            hop.p90_ms,
            hop.max_ms,
            hop.engine_median_ms,
            hop.engine_p90_ms,
            hop.bytes_per_round
        ));
    }
    std::fs::write(&args.markdown, &markdown).expect("write markdown");
    println!("{markdown}");
}

/// Our side of one cell: target step, verify(n), draft pass.
fn measure(args: &Args, target: &Target, dtype: &str, kind: Kind, device: Device) -> Cell {
    let _no_grad = tch::no_grad_guard();
    let model = match target {
        Target::Shape(shape) => built_target(args, *shape, kind, device),
        Target::Model(dir) => {
            TargetModel::load(dir, kind, device).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        }
    };
    let c = model.text_config();
    let dims = Dims {
        hidden: c.hidden_size,
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        intermediate: c.intermediate_size,
        layers: c.num_layers,
        vocab: c.vocab_size,
    };
    // The head reads up to five target layers, as the released DFlash heads do.
    let taps: Vec<usize> = (0..dims.layers).take(5).collect();
    let max_rows = args.rows.iter().copied().max().unwrap_or(1);
    let mut cache = model.new_cache(args.context + max_rows + 1);
    let mut mask = TreeMask::new(max_rows, cache.capacity(), model.kind(), model.device());
    fill_context(&mut cache, args.context, &model);
    // The verifier's history rows the tap states are gathered into (on the host, as it keeps them).
    let states = Tensor::zeros([max_rows as i64, taps.len() as i64 * dims.hidden], (kind, tch::Device::Cpu));
    let step_ms = best_of(args.repeats, || step(&model, &mut cache, args.context));
    let verify_ms = args
        .rows
        .iter()
        .map(|&n| {
            let tree = random_tree(n - 1, dims.vocab);
            (
                n,
                best_of(args.repeats, || {
                    verify(&model, &mut cache, &mut mask, &tree, &taps, &states, args.context)
                }),
            )
        })
        .collect();
    let step_syncs = read_backs_per_call(1, || step(&model, &mut cache, args.context));
    let tree = random_tree(max_rows - 1, dims.vocab);
    let verify_syncs =
        read_backs_per_call(1, || verify(&model, &mut cache, &mut mask, &tree, &taps, &states, args.context));
    drop(cache);
    let mut draft_ms = 0.0;
    // draft_pass_ms runs a context round, a warm-up and `repeats` rounds.
    let draft_syncs =
        read_backs_per_call(args.repeats.max(1) + 2, || draft_ms = draft_pass_ms(args, &model, &dims, &taps));
    let host_syncs = HostSyncs { step: step_syncs, verify: verify_syncs, draft: draft_syncs };
    let state_bytes_per_round =
        (args.rows_per_round * taps.len()) as i64 * dims.hidden * kind.elt_size_in_bytes() as i64;
    Cell {
        shape: target.to_string(),
        model: match target {
            Target::Model(dir) => Some(dir.clone()),
            Target::Shape(_) => None,
        },
        dtype: dtype.to_string(),
        dims,
        step_ms,
        verify_ms,
        draft_ms,
        state_bytes_per_round,
        host_syncs,
        peer_step_ms: None,
        peer_verify_ms: Vec::new(),
    }
}

/// The toy target from disk, or a random-weight Qwen3-VL with the shape's text layers (the toy's
/// tiny vision tower: only the text decoder is timed).
fn built_target(args: &Args, shape: Shape, kind: Kind, device: Device) -> TargetModel {
    let (hidden, heads, inter, default_layers) = match shape {
        Shape::Toy => return TargetModel::load(&args.toy_target, kind, device).expect("load the toy target"),
        Shape::Qwen3Vl2b => (2048, 16, 6144, 4),
        Shape::Qwen3Vl8b => (4096, 32, 12288, 2),
    };
    let text = std::fs::read_to_string(args.toy_target.join("config.json")).expect("toy config");
    let mut config: Value = serde_json::from_str(&text).expect("toy config json");
    let t = &mut config["text_config"];
    t["hidden_size"] = json!(hidden);
    t["num_attention_heads"] = json!(heads);
    t["num_key_value_heads"] = json!(8);
    t["head_dim"] = json!(128);
    t["intermediate_size"] = json!(inter);
    t["num_hidden_layers"] = json!(args.layers.unwrap_or(default_layers));
    t["vocab_size"] = json!(args.vocab);
    t["max_position_embeddings"] = json!(args.context + 4096);
    t["rope_parameters"]["mrope_section"] = json!([24, 20, 20]);
    t["rope_parameters"]["rope_theta"] = json!(5_000_000.0);
    config["vision_config"]["out_hidden_size"] = json!(hidden);
    let config = TargetConfig::from_json(&config).expect("bench target config");
    let mut ckpt = Checkpoint::random(RandomInit { std: 0.02 }, kind, device);
    TargetModel::from_checkpoint(&config, &mut ckpt).expect("random target")
}

/// `context` random K/V rows in every layer.
fn fill_context(cache: &mut KvCache, context: usize, model: &TargetModel) {
    let c = model.text_config();
    let shape = [c.num_kv_heads, context as i64, c.head_dim];
    for layer in 0..c.num_layers {
        let k = Tensor::randn(shape, (model.kind(), model.device()));
        let v = Tensor::randn(shape, (model.kind(), model.device()));
        let _ = cache.write(layer, &k, &v);
    }
    cache.advance(context);
}

/// A plain greedy decode step: one token, its logits, the argmax read back.
fn step(model: &TargetModel, cache: &mut KvCache, context: usize) {
    let out = glance_models::decode::forward_token(model, cache, 1, 0, &[]).expect("step");
    let _ = glance_models::decode::argmax_last(out.logits.as_ref().expect("logits"));
    cache.truncate(context);
}

/// One verify round as auto mode runs it (the next root's entropy read back, the committed rows'
/// tap states staged to the host and gathered into the history's buffer).
fn verify(
    model: &TargetModel,
    cache: &mut KvCache,
    mask: &mut TreeMask,
    tree: &Tree,
    taps: &[usize],
    states: &Tensor,
    context: usize,
) {
    let reads = RoundReads { next_entropy: true, ..RoundReads::default() };
    let verified = verify_round(model, cache, mask, 0, 1, tree, taps, reads, Draw::GREEDY).expect("verify");
    let rows = verified.tap_rows.len() as i64;
    verified.tap_rows.write_into(&states.narrow(0, 0, rows));
    cache.truncate(context);
}

/// A best-first tree of `nodes` nodes from random marginals over 15 offsets, branching 4.
fn random_tree(nodes: usize, vocab: i64) -> Tree {
    let logits = Tensor::randn([15, vocab], (Kind::Float, Device::Cpu)) * 3.0;
    let marginals = Marginals::top_k(&logits, 4).expect("marginals");
    let tree = build_budget_tree(&marginals, nodes, 4, &Reach::unbounded());
    assert_eq!(tree.len(), nodes, "a tree of the asked size");
    tree
}

/// The drafter's block-head session on a head of the target's width: one round of
/// `rows_per_round` new context rows after a `context`-row draft cache.
fn draft_pass_ms(args: &Args, model: &TargetModel, dims: &Dims, taps: &[usize]) -> f64 {
    let config = json!({
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": args.head_layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "rope_theta": 1_000_000.0,
        "block_size": 16,
        "vocab_size": dims.vocab,
        "dflash_config": {"mask_token_id": 11, "target_layer_ids": taps},
    });
    let config = DraftHeadConfig::from_json(&config, std::path::Path::new("bench-head"), Some(dims.layers))
        .expect("head config");
    let mut ckpt = Checkpoint::random(RandomInit { std: 0.02 }, model.kind(), model.device());
    let (embed, lm_head) = (model.text.embed_tokens().shallow_clone(), model.text.lm_head().shallow_clone());
    let head = DraftHead::from_checkpoint(config, &mut ckpt, embed, lm_head).expect("random head");
    let engine = BlockHeadEngine::new(head, "bench".into(), args.context + 64 * (args.repeats + 2));
    let mut session = engine.new_session();
    let width = taps.len() as i64 * dims.hidden;
    let mut position = 0;
    let mut round = |session: &mut Box<dyn Session>, rows: usize| {
        let tokens = vec![1 as TokenId; rows];
        let states = Tensor::randn([rows as i64, width], (model.kind(), model.device()));
        session.append_context(position, &tokens, Some(states)).expect("append context");
        position += rows;
        let input = RoundInput {
            root_token: 1,
            root_position: position,
            budget: 31,
            branch_k: 4,
            spine: false,
            reach: Reach::unbounded(),
        };
        session.draft(&input).expect("draft");
    };
    round(&mut session, args.context);
    best_of(args.repeats, || round(&mut session, args.rows_per_round))
}

/// The hop of a round on loopback, through the verifier's own drafter client
/// (`drafter_client::RemoteSession`) to a drafter-svc process running the toy head: each round
/// sends `rows_per_round` new context rows (f32 tap states) and a round request from a plain
/// thread, as the verifier's engine thread does, and waits for the tree.
#[derive(Debug, serde::Serialize)]
struct Hop {
    rounds: usize,
    /// Round trip minus the drafter's own time, to the reply's arrival on the verifier's I/O
    /// thread: the hop the verifier reports and its policy plans with.
    median_ms: f64,
    p90_ms: f64,
    /// The slowest round: a stall the median hides (a reply held back by Nagle's algorithm until
    /// the verifier's delayed ACK, 40 ms, before the servers turned it off).
    max_ms: f64,
    /// The same to the moment the waiting engine thread has the tree (one more thread wake-up).
    engine_median_ms: f64,
    engine_p90_ms: f64,
    bytes_per_round: u64,
}

fn measure_hop(args: &Args) -> Hop {
    use glance_proto::drafter::v1 as dpb;
    use verifier_svc::drafter_client::{RemoteDrafter, RemoteProvider, TargetDescription};
    use verifier_svc::speculative::{DraftProvider, DraftRound};
    let drafter =
        ServiceProcess::block_head_drafter(&args.toy_head, &args.toy_target, &[("OMP_NUM_THREADS", "1")]);
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let info = runtime.block_on(async {
        let mut client =
            dpb::drafter_client::DrafterClient::connect(drafter.url.clone()).await.expect("connect");
        client.handshake(dpb::HandshakeRequest::default()).await.expect("handshake").into_inner()
    });
    let width = (info.tap_layers.len() * info.hidden_size as usize) as i64;
    let target = TargetDescription {
        fingerprint: info.target_fingerprint.clone(),
        hidden_size: info.hidden_size,
        vocab_size: info.vocab_size,
        num_layers: info.tap_layers.iter().max().map_or(1, |&l| l + 1),
        kind: Kind::Float,
    };
    let remote = RemoteDrafter::new(
        drafter.url.clone(),
        None,
        runtime.handle().clone(),
        target,
        Duration::from_secs(5),
    );
    runtime.block_on(remote.connect_now()).expect("the drafter fits");
    let mut session = RemoteProvider::new(remote).expect("a handshake").open().expect("a draft stream");
    let (mut position, mut hops, mut engine_hops, mut bytes) = (0, Vec::new(), Vec::new(), 0);
    for round in 0..args.hop_rounds + 1 {
        let rows = if round == 0 { args.context.min(256) } else { args.rows_per_round };
        let states = Tensor::zeros([rows as i64, width], (Kind::Float, Device::Cpu));
        let tokens = vec![1i64; rows];
        let sent_before = session.bytes_sent();
        let started = Instant::now();
        let request = DraftRound {
            first_position: position,
            tokens: &tokens,
            states: Some(&states),
            root_token: 1,
            root_position: position + rows,
            budget: 31,
            branch_k: 8,
            spine: false,
            reach: &Reach::unbounded(),
        };
        session.send(request).expect("send");
        let drafted = loop {
            if let Some(drafted) = session.receive(Duration::from_secs(5)).expect("a tree") {
                break drafted;
            }
        };
        let to_engine = started.elapsed();
        position += rows;
        bytes = session.bytes_sent() - sent_before;
        if round > 0 {
            hops.push((drafted.round_trip.saturating_sub(drafted.draft_time)).as_secs_f64() * 1e3);
            engine_hops.push((to_engine.saturating_sub(drafted.draft_time)).as_secs_f64() * 1e3);
        }
    }
    let (median_ms, p90_ms) = median_and_p90(&mut hops);
    let (engine_median_ms, engine_p90_ms) = median_and_p90(&mut engine_hops);
    let max_ms = hops.iter().copied().fold(0.0, f64::max);
    Hop {
        rounds: hops.len(),
        median_ms,
        p90_ms,
        max_ms,
        engine_median_ms,
        engine_p90_ms,
        bytes_per_round: bytes,
    }
}

fn median_and_p90(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.9))
}

/// Milliseconds of the fastest of `repeats` runs after one warm-up.
fn best_of(repeats: usize, mut run: impl FnMut()) -> f64 {
    run();
    (0..repeats.max(1))
        .map(|_| {
            let started = Instant::now();
            run();
            started.elapsed().as_secs_f64() * 1000.0
        })
        .fold(f64::INFINITY, f64::min)
}

/// Runs `tests/reference/bench_round_peer.py` on the cell's shapes.
fn peer(args: &Args, cell: &mut Cell) {
    let dtype = match cell.dtype.as_str() {
        "bf16" | "bfloat16" => "bfloat16",
        "f16" | "float16" => "float16",
        _ => "float32",
    };
    let d = &cell.dims;
    let shape = json!({
        "hidden": d.hidden, "heads": d.heads, "kv_heads": d.kv_heads, "head_dim": d.head_dim,
        "intermediate": d.intermediate, "layers": d.layers, "vocab": d.vocab, "dtype": dtype,
        "device": if args.device.starts_with("cuda") { "cuda" } else { "cpu" },
        "context": args.context, "rows": args.rows, "repeats": args.repeats, "threads": args.threads,
        "model": cell.model,
    });
    let script = glance_tests::reference_script("bench_round_peer.py");
    let output = Command::new("python").arg(&script).arg("--shape").arg(shape.to_string()).output();
    let output = match output {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            eprintln!("peer failed: {}", String::from_utf8_lossy(&o.stderr));
            return;
        }
        Err(e) => {
            eprintln!("peer not run ({e}); is the venv active (source scripts/env.sh)?");
            return;
        }
    };
    let line = String::from_utf8_lossy(&output.stdout);
    let parsed: Value = serde_json::from_str(line.trim()).expect("peer JSON");
    cell.peer_step_ms = parsed["step_ms"].as_f64();
    cell.peer_verify_ms = args
        .rows
        .iter()
        .filter_map(|&n| parsed["verify_ms"][n.to_string()].as_f64().map(|ms| (n, ms)))
        .collect();
}

fn markdown(cells: &[Cell], args: &Args) -> String {
    let rows = &args.rows;
    let mut out = format!(
        "Context {} positions, {} libtorch thread(s), {}; a round sends {} context rows; draft head: \
         {} layer(s), block 16, budget 31.\n\n",
        args.context, args.threads, args.device, args.rows_per_round, args.head_layers
    );
    out.push_str("| target | dtype | step ms |");
    for n in rows {
        out.push_str(&format!(" v({n})/step |"));
    }
    out.push_str(" draft/step | state KiB/round | host syncs step / verify / draft | peer step ms |");
    for n in rows {
        out.push_str(&format!(" peer v({n})/step |"));
    }
    out.push_str(" ours/peer v(16) |\n|---|---|---|");
    out.push_str(&"---|".repeat(2 * rows.len() + 5));
    out.push('\n');
    for cell in cells {
        out.push_str(&row_markdown(cell, rows));
        out.push('\n');
    }
    out
}

fn row_markdown(cell: &Cell, rows: &[usize]) -> String {
    let ratio =
        |list: &[(usize, f64)], n: usize, step: Option<f64>| match (list.iter().find(|(m, _)| *m == n), step)
        {
            (Some((_, ms)), Some(step)) => format!(" {:.2} |", ms / step),
            _ => " – |".to_string(),
        };
    let d = &cell.dims;
    let mut line = format!(
        "| {} ({}L, d {}, V {}) | {} | {:.2} |",
        cell.shape, d.layers, d.hidden, d.vocab, cell.dtype, cell.step_ms
    );
    for &n in rows {
        line.push_str(&ratio(&cell.verify_ms, n, Some(cell.step_ms)));
    }
    let syncs = &cell.host_syncs;
    line.push_str(&format!(
        " {:.2} | {:.1} | {} / {} / {} |",
        cell.draft_ms / cell.step_ms,
        cell.state_bytes_per_round as f64 / 1024.0,
        syncs.step,
        syncs.verify,
        syncs.draft
    ));
    line.push_str(&cell.peer_step_ms.map_or(" – |".to_string(), |ms| format!(" {ms:.2} |")));
    for &n in rows {
        line.push_str(&ratio(&cell.peer_verify_ms, n, cell.peer_step_ms));
    }
    let ours_16 = cell.verify_ms.iter().find(|(n, _)| *n == 16);
    let peer_16 = cell.peer_verify_ms.iter().find(|(n, _)| *n == 16);
    line.push_str(&match (ours_16, peer_16) {
        (Some((_, a)), Some((_, b))) => format!(" {:.2} |", a / b),
        _ => " – |".to_string(),
    });
    line
}
