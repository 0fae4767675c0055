//! Random heads from `init::write_random_head` on the tiny targets: deterministic bytes, loadable,
//! and a draft cache that gives the same logits however the context is split across calls. Also
//! the selective tensor reader and the target fingerprint of `glance_models::weights`.
//!
//! Needs the tiny targets of `tests/reference/make_reference.py` under `$GLANCE_FIXTURES` (else
//! `<workspace>/tests/fixtures`); skipped when absent unless `GLANCE_REQUIRE_FIXTURES=1`.

#![allow(clippy::disallowed_methods)] // tests build and read host tensors freely

use std::path::{Path, PathBuf};

use anyhow::Result;
use drafter_svc::head::DraftHead;
use drafter_svc::init::{write_random_head, HeadSpec, InitError};
use glance_models::weights::{read_named_tensors, target_fingerprint};
use glance_models::TargetConfig;
use glance_models::TargetModel;
use tch::{Device, Kind, Tensor};

const QWEN3: &str = "tiny-qwen3-vl";
const QWEN3_LEGACY: &str = "tiny-qwen3-vl-legacy";
const QWEN25: &str = "tiny-qwen2.5-vl";

fn fixture_root() -> Option<PathBuf> {
    let root = std::env::var_os("GLANCE_FIXTURES").map(PathBuf::from).unwrap_or_else(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        manifest.parent().unwrap_or(manifest).join("tests/fixtures")
    });
    if root.join(QWEN3).is_dir() {
        return Some(root);
    }
    assert!(
        std::env::var("GLANCE_REQUIRE_FIXTURES").as_deref() != Ok("1"),
        "GLANCE_REQUIRE_FIXTURES=1 but {} has no {QWEN3}",
        root.display()
    );
    eprintln!("SKIPPED: no tiny targets under {} (run tests/reference/make_reference.py)", root.display());
    None
}

/// A scratch directory unique to this test process and name.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("glance-head-init-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn spec(seed: u64) -> HeadSpec {
    HeadSpec { tap_layers: Some(vec![0, 1, 3]), ..HeadSpec::new(2, 8, seed) }
}

fn random_context(rows: i64, width: i64, seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn([rows, width], (Kind::Float, Device::Cpu))
}

#[test]
fn same_seed_same_bytes() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let target = root.join(QWEN3);
    let (a, b, c) = (scratch("a"), scratch("b"), scratch("c"));
    let config = write_random_head(&target, &a, &spec(3))?;
    write_random_head(&target, &b, &spec(3))?;
    write_random_head(&target, &c, &spec(4))?;
    let read = |dir: &Path, file: &str| std::fs::read(dir.join(file)).unwrap();
    assert_eq!(read(&a, "config.json"), read(&b, "config.json"));
    assert_eq!(read(&a, "model.safetensors"), read(&b, "model.safetensors"));
    assert_ne!(read(&a, "model.safetensors"), read(&c, "model.safetensors"));
    assert_eq!(config.mask_token_id, 11, "the tiny tokenizer's <|vision_pad|>");
    assert_eq!(config.target_layer_ids, vec![0, 1, 3]);
    assert_eq!((config.block_size, config.num_layers), (8, 2));
    for dir in [a, b, c] {
        std::fs::remove_dir_all(dir)?;
    }
    Ok(())
}

/// A fresh head's final norm starts at `output_norm_init` (small first logits) and every other
/// norm at 1.
#[test]
fn the_output_norm_starts_at_its_init_scale() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let out = scratch("norm");
    write_random_head(&root.join(QWEN3), &out, &HeadSpec { output_norm_init: 0.1, ..spec(0) })?;
    let tensors: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(out.join("model.safetensors"))?.into_iter().collect();
    let mean = |name: &str| tensors[name].mean(Kind::Float).double_value(&[]);
    assert!((mean("norm.weight") - 0.1).abs() < 1e-6);
    assert!((mean("hidden_norm.weight") - 1.0).abs() < 1e-6);
    assert!((mean("layers.0.input_layernorm.weight") - 1.0).abs() < 1e-6);
    std::fs::remove_dir_all(out)?;
    Ok(())
}

#[test]
fn rejects_specs_that_do_not_fit_the_target() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let target = root.join(QWEN3);
    let out = scratch("bad");
    let bad_taps = HeadSpec { tap_layers: Some(vec![4]), ..spec(0) };
    let bad_mask = HeadSpec { mask_token_id: Some(1024), ..spec(0) };
    for bad in [bad_taps, bad_mask] {
        assert!(matches!(write_random_head(&target, &out, &bad), Err(InitError::Spec(_))));
    }
    // 3 target layers are too few for DFlash's default tap rule (layers 1..n−3).
    let default_taps = HeadSpec::new(2, 8, 0);
    let shallow = write_random_head(&root.join(QWEN25), &out, &default_taps);
    assert!(matches!(shallow, Err(InitError::Spec(_))));
    Ok(())
}

/// Context split over calls or given at once: the same draft-cache contents, the same logits.
#[test]
fn draft_cache_is_independent_of_how_context_arrives() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let target = root.join(QWEN3);
    let dir = scratch("split");
    write_random_head(&target, &dir, &spec(9))?;
    let head = DraftHead::load(&dir, &target, Kind::Float, Device::Cpu)?;
    let context = random_context(15, 3 * 64, 1);

    let mut split = head.new_cache(32);
    let first = head.draft(&mut split, &context.narrow(0, 0, 10), 42, 10)?;
    assert_eq!(first.size(), [7, 1024]);
    let in_two = head.draft(&mut split, &context.narrow(0, 10, 5), 7, 15)?;
    let mut whole = head.new_cache(32);
    let at_once = head.draft(&mut whole, &context, 7, 15)?;

    assert_eq!(in_two.size(), [7, 1024]);
    assert_eq!((split.len(), whole.len()), (15, 15));
    let diff = (&in_two - &at_once).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "max |Δ| {diff}");
    // A call with no new context rows redrafts from the same cache.
    let again = head.draft(&mut whole, &context.narrow(0, 0, 0), 7, 15)?;
    assert!((&again - &at_once).abs().max().double_value(&[]) < 1e-6);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// Qwen2.5-VL ties its LM head to the embedding: the head must use the embedding as LM head.
#[test]
fn tied_target_and_bf16_head() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let target_dir = root.join(QWEN25);
    let dir = scratch("tied");
    let spec = HeadSpec { tap_layers: Some(vec![0, 1, 2]), dtype: Kind::BFloat16, ..HeadSpec::new(1, 4, 5) };
    write_random_head(&target_dir, &dir, &spec)?;
    let head = DraftHead::load(&dir, &target_dir, Kind::Float, Device::Cpu)?;
    let logits = head.draft(&mut head.new_cache(16), &random_context(3, 3 * 64, 2), 100, 3)?;
    assert_eq!(logits.size(), [3, head.vocab_size()]);
    assert!(bool::try_from(logits.isfinite().all())?);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn selective_reader_matches_the_full_loader() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    const EMBED: &str = "model.language_model.embed_tokens.weight";
    const LEGACY_EMBED: &str = "model.embed_tokens.weight";
    let target = TargetModel::load(&root.join(QWEN3), Kind::Float, Device::Cpu)?;
    let names = [EMBED, LEGACY_EMBED, "lm_head.weight", "no.such.tensor"];
    let found = read_named_tensors(&root.join(QWEN3), &names, Kind::Float, Device::Cpu)?;
    assert!(found[EMBED].equal(target.text.embed_tokens()));
    assert!(found["lm_head.weight"].equal(target.text.lm_head()));
    assert_eq!(found.len(), 2, "absent names are left out");
    if root.join(QWEN3_LEGACY).is_dir() {
        // Sharded, with 4.x names.
        let legacy = read_named_tensors(&root.join(QWEN3_LEGACY), &names, Kind::Float, Device::Cpu)?;
        assert!(legacy[LEGACY_EMBED].equal(target.text.embed_tokens()));
        assert!(legacy["lm_head.weight"].equal(target.text.lm_head()));
    }
    let bf16 = read_named_tensors(&root.join(QWEN3), &[EMBED], Kind::BFloat16, Device::Cpu)?;
    assert_eq!(bf16[EMBED].kind(), Kind::BFloat16);
    Ok(())
}

#[test]
fn fingerprint_identifies_the_target() -> Result<()> {
    let Some(root) = fixture_root() else {
        return Ok(());
    };
    let fingerprint = |name: &str| -> Result<String> {
        let dir = root.join(name);
        Ok(target_fingerprint(&dir, &TargetConfig::read(&dir)?)?)
    };
    let qwen3 = fingerprint(QWEN3)?;
    assert_eq!(qwen3.len(), 16);
    assert_eq!(qwen3, fingerprint(QWEN3)?);
    assert_ne!(qwen3, fingerprint(QWEN25)?);
    if root.join(QWEN3_LEGACY).is_dir() {
        assert_eq!(qwen3, fingerprint(QWEN3_LEGACY)?);
    }
    assert!(fingerprint("no-such-model").is_err());
    Ok(())
}
