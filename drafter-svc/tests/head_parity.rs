//! The Rust draft head against a torch re-statement of DFlash's forward
//! (`tests/reference/make_dflash_reference.py`, itself checked to agree exactly with z-lab/dflash
//! `model/dflash.py`): a random 2-layer head on the tiny Qwen3-VL target and one on the tiny
//! text-only Llama (tied LM head, 4.x-free `model.embed_tokens` names), three draft calls that
//! share one draft cache (20 context rows, then 3, then 1).
//!
//! Fixture root: `$GLANCE_FIXTURES`, else `<workspace>/tests/fixtures`; the heads and their dumps
//! live in `<root>/<target>-dflash/`. Skipped when absent unless `GLANCE_REQUIRE_FIXTURES=1`.

#![allow(clippy::disallowed_methods)] // tests build and read host tensors freely

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use drafter_svc::head::{DraftHead, DraftHeadConfig, HeadError};
use glance_models::TargetModel;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

const HEAD: &str = "tiny-qwen3-vl-dflash";
const TARGET: &str = "tiny-qwen3-vl";
/// (head, target) pairs of the parity check.
const PAIRS: [(&str, &str); 2] = [(HEAD, TARGET), ("tiny-llama-dflash", "tiny-llama")];
/// f32 on both sides; only summation order differs.
const F32_TOLERANCE: f64 = 1e-4;

/// The fixture root holding the DFlash reference, or `None` when absent and not required.
fn fixture_root() -> Option<PathBuf> {
    let root = std::env::var_os("GLANCE_FIXTURES").map(PathBuf::from).unwrap_or_else(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        manifest.parent().unwrap_or(manifest).join("tests/fixtures")
    });
    if PAIRS
        .iter()
        .all(|(head, target)| root.join(head).join("reference").is_dir() && root.join(target).is_dir())
    {
        return Some(root);
    }
    assert!(
        std::env::var("GLANCE_REQUIRE_FIXTURES").as_deref() != Ok("1"),
        "GLANCE_REQUIRE_FIXTURES=1 but {} has no {HEAD}/reference (run \
         tests/reference/make_dflash_reference.py)",
        root.display()
    );
    eprintln!(
        "SKIPPED: no DFlash head reference under {} (run tests/reference/make_dflash_reference.py)",
        root.display()
    );
    None
}

struct Call {
    root_token: i64,
    root_position: usize,
    context: Tensor,
    logits: Tensor,
}

fn reference_calls(head_dir: &Path) -> Result<Vec<Call>> {
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(head_dir.join("reference/draft_calls.json"))?)?;
    let mut tensors: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(head_dir.join("reference/draft_calls.safetensors"))?.into_iter().collect();
    let calls = meta["calls"].as_array().context("calls")?;
    calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            Ok(Call {
                root_token: call["root_token"].as_i64().context("root_token")?,
                root_position: call["root_position"].as_u64().context("root_position")? as usize,
                context: tensors.remove(&format!("context_{i}")).context("context")?,
                logits: tensors.remove(&format!("logits_{i}")).context("logits")?,
            })
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float)).abs().max().double_value(&[])
}

/// Runs every call through one draft cache; returns the max |Δ| per call.
fn run_calls(head: &DraftHead, calls: &[Call]) -> Result<Vec<f64>> {
    let mut cache = head.new_cache(64);
    calls
        .iter()
        .map(|call| {
            let logits = head.draft(&mut cache, &call.context, call.root_token, call.root_position)?;
            assert_eq!(logits.size(), call.logits.size());
            assert_eq!(cache.len(), call.root_position, "only context rows persist");
            Ok(max_abs_diff(&logits, &call.logits))
        })
        .collect()
}

/// The fixture head `head_name` in f32 beside its `target`, and its directory (the dumps).
fn f32_head(root: &Path, head_name: &str, target: &str) -> Result<(PathBuf, DraftHead)> {
    let head_dir = root.join(head_name);
    let head = DraftHead::load(&head_dir, &root.join(target), Kind::Float, Device::Cpu)?;
    Ok((head_dir, head))
}

#[test]
fn draft_logits_match_the_torch_reference() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    for (head_name, target) in PAIRS {
        let (head_dir, head) = f32_head(&root, head_name, target)?;
        assert_eq!(head.block_size(), 16);
        assert_eq!(head.mask_token_id(), 11);
        assert_eq!(head.tap_layers(), &[0, 1, 2]);
        assert_eq!((head.hidden_size(), head.vocab_size()), (64, 1024));
        let calls = reference_calls(&head_dir)?;
        let diffs = run_calls(&head, &calls)?;
        eprintln!("{head_name}: draft logits max |Δ| per call (C = 20, 3, 1): {diffs:?}");
        for (i, diff) in diffs.iter().enumerate() {
            assert!(*diff <= F32_TOLERANCE, "{head_name} call {i}: max |Δ| {diff}");
        }
        // Serving precomputes the rotary tables: the same logits, bit for bit.
        let (_, mut served) = f32_head(&root, head_name, target)?;
        served.precompute_rotary(64);
        assert_eq!(
            run_calls(&served, &calls)?,
            diffs,
            "{head_name}: precomputed rotary tables change the logits"
        );
    }
    Ok(())
}

/// Context rows taken in ahead of the draft pass (drafter-svc does so for context-only messages)
/// give the reference's logits: the pass then carries no rows of its own.
#[test]
fn context_taken_in_ahead_matches_the_torch_reference() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    for (head_name, target) in PAIRS {
        let (head_dir, head) = f32_head(&root, head_name, target)?;
        let mut cache = head.new_cache(64);
        for (i, call) in reference_calls(&head_dir)?.iter().enumerate() {
            head.ingest(&mut cache, &call.context)?;
            assert_eq!(cache.len(), call.root_position);
            let none = call.context.narrow(0, 0, 0);
            let logits = head.draft(&mut cache, &none, call.root_token, call.root_position)?;
            let diff = max_abs_diff(&logits, &call.logits);
            assert!(diff <= F32_TOLERANCE, "{head_name} call {i}: max |Δ| {diff}");
        }
        // Rows that do not fit are refused before anything is written.
        let mut full = head.new_cache(20);
        let rows = Tensor::zeros([8, 3 * 64], (Kind::Float, Device::Cpu));
        assert!(matches!(head.ingest(&mut full, &rows), Err(HeadError::Cache(_))));
        assert_eq!(full.len(), 0);
    }
    Ok(())
}

/// The verifier-side constructor, from an already loaded target, gives the same logits.
#[test]
fn from_parts_with_a_loaded_target_matches() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let head_dir = root.join(HEAD);
    let target = TargetModel::load(&root.join(TARGET), Kind::Float, Device::Cpu)?;
    let config = DraftHeadConfig::load(&head_dir, Some(target.text_config().num_layers))?;
    let head = DraftHead::from_parts(
        config,
        &head_dir,
        target.text.embed_tokens().shallow_clone(),
        target.text.lm_head().shallow_clone(),
        Kind::Float,
        Device::Cpu,
    )?;
    let diffs = run_calls(&head, &reference_calls(&head_dir)?)?;
    assert!(diffs.iter().all(|d| *d <= F32_TOLERANCE), "{diffs:?}");
    Ok(())
}

/// bf16 weights and bf16 tap states: same argmax almost everywhere, logits close.
#[test]
fn bf16_head_stays_close() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let head_dir = root.join(HEAD);
    let head = DraftHead::load(&head_dir, &root.join(TARGET), Kind::BFloat16, Device::Cpu)?;
    let mut calls = reference_calls(&head_dir)?;
    for call in &mut calls {
        call.context = call.context.to_kind(Kind::BFloat16);
    }
    let diffs = run_calls(&head, &calls)?;
    eprintln!("bf16 draft logits max |Δ| per call: {diffs:?}");
    assert!(diffs.iter().all(|d| *d < 0.25), "{diffs:?}");
    Ok(())
}

#[test]
fn refuses_inputs_that_would_desync_the_cache() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let (head_dir, head) = f32_head(&root, HEAD, TARGET)?;
    let calls = reference_calls(&head_dir)?;
    let first = &calls[0];
    let mut cache = head.new_cache(64);
    let input_err = |r: Result<Tensor, HeadError>| matches!(r, Err(HeadError::Input(_)));
    // Root position not right after the cached + new rows.
    assert!(input_err(head.draft(&mut cache, &first.context, 5, first.root_position + 1)));
    // Wrong width, wrong rank, non-float states, token outside the vocabulary.
    let narrow = first.context.narrow(1, 0, 64);
    assert!(input_err(head.draft(&mut cache, &narrow, 5, first.root_position)));
    assert!(input_err(head.draft(&mut cache, &first.context.flatten(0, -1), 5, 3840)));
    let ints = first.context.to_kind(Kind::Int64);
    assert!(input_err(head.draft(&mut cache, &ints, 5, first.root_position)));
    assert!(input_err(head.draft(&mut cache, &first.context, 1024, first.root_position)));
    assert!(input_err(head.draft(&mut cache, &first.context, -1, first.root_position)));
    // No room for context + block.
    let mut small = head.new_cache(first.root_position + 15);
    let full = head.draft(&mut small, &first.context, 5, first.root_position);
    assert!(matches!(full, Err(HeadError::Cache(_))));
    assert_eq!(cache.len(), 0, "failed calls leave the cache untouched");
    // A good call still works afterwards.
    let logits = head.draft(&mut cache, &first.context, first.root_token, first.root_position)?;
    assert!(max_abs_diff(&logits, &first.logits) <= F32_TOLERANCE);
    Ok(())
}
