//! Sampling. The sampler against transformers: the processed scores of temperature, top-k, top-p
//! and min-p (the list `generate` assembles, in its order) on random logits with ties at the
//! cut-offs, the same tokens removed and the rest within 1e-6
//! (`tests/reference/make_sampling_reference.py`). Then seeded sampling through the decoders:
//! deterministic per seed, and the same tokens in every speculative mode as autoregressive.

use glance_models::decode::{generate, GreedyParams, StepControl};
use glance_models::sampling::{warped_scores, Sampling};
use glance_models::TargetModel;
use glance_tests::drafters::scripted;
use glance_tests::{fixtures, max_abs_diff, Case};
use serde::Deserialize;
use tch::{Kind, Tensor};
use verifier_svc::speculative::{speculative_generate, SpecParams};

#[derive(Deserialize)]
struct Warpers {
    configs: Vec<WarperConfig>,
}

#[derive(Deserialize)]
struct WarperConfig {
    temperature: f64,
    top_k: usize,
    top_p: f64,
    min_p: f64,
}

#[test]
fn processed_scores_equal_transformers_warpers() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("sampling");
    let text = std::fs::read_to_string(dir.join("warpers.json")).expect("warpers.json");
    let warpers: Warpers = serde_json::from_str(&text).expect("warpers.json parses");
    let tensors: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("warpers.safetensors"))
            .expect("warpers.safetensors")
            .into_iter()
            .collect();
    let logits = &tensors["logits"];
    assert!(warpers.configs.len() >= 8, "the reference lost configurations");
    for (i, c) in warpers.configs.iter().enumerate() {
        let sampling =
            Sampling { temperature: c.temperature, top_k: c.top_k, top_p: c.top_p, min_p: c.min_p, seed: 0 };
        let ours = warped_scores(logits, &sampling);
        let theirs = &tensors[&format!("scores_{i}")];
        let (kept, kept_theirs) = (ours.isfinite(), theirs.isfinite());
        assert!(kept.equal(&kept_theirs), "config {i}: the removed tokens differ");
        let diff = max_abs_diff(
            &ours.masked_fill(&kept.logical_not(), 0.0),
            &theirs.masked_fill(&kept.logical_not(), 0.0),
        );
        let count = kept.sum(tch::Kind::Int64).int64_value(&[]);
        println!("config {i} {sampling:?}: {count} kept, max |Δ| {diff:.1e}");
        assert!(diff <= 1e-6, "config {i}: scores differ by {diff}");
    }
    // Teeth: the order matters. Top-p before the temperature keeps another set on config 3.
    let c = &warpers.configs[3];
    let top_p_only = Sampling { temperature: 1.0, top_p: c.top_p, ..Sampling::GREEDY };
    let temperature_only = Sampling { temperature: c.temperature, ..Sampling::GREEDY };
    let swapped = warped_scores(&warped_scores(logits, &top_p_only), &temperature_only);
    assert!(
        !swapped.isfinite().equal(&tensors["scores_3"].isfinite()),
        "top-p before temperature went unnoticed"
    );
}

fn spec_params(budget: usize, sampling: Sampling) -> SpecParams {
    SpecParams { budget, branch_k: 2, log_rounds: false, sampling }
}

/// Sampled decoding is a function of the request and its seed: twice the same request gives the
/// same tokens, another seed others; and every speculative mode commits exactly the tokens
/// autoregressive sampling draws, with an oracle-like drafter (deep acceptance), a poor one, as
/// a chain and as a tree. (Each generated index has its own uniform: see `glance_models::sampling`.)
#[test]
fn sampling_is_seeded_and_every_mode_draws_the_autoregressive_tokens() {
    let Some(root) = fixtures() else { return };
    let _no_grad = tch::no_grad_guard();
    for family in ["tiny-qwen3-vl", "tiny-llama"] {
        let dir = root.join(family);
        let model = TargetModel::load(&dir, Kind::Float, glance_tests::test_device()).expect("model");
        let vocab = model.text_config().vocab_size as u32;
        let case = Case::load(&dir, if family == "tiny-llama" { "single_turn" } else { "one_image" });
        let inputs = glance_tests::reference_inputs(&case);
        let params =
            GreedyParams { max_new_tokens: 40, eos_token_ids: &[], context_limit: 4096, logprobs: None };
        let sample = |sampling: &Sampling| {
            generate(&model, &inputs, &params, sampling, |_| StepControl::Continue).expect("sampling").tokens
        };
        for (i, base) in [
            Sampling { temperature: 1.0, ..Sampling::GREEDY },
            Sampling { temperature: 0.7, top_k: 20, top_p: 0.95, ..Sampling::GREEDY },
            Sampling { temperature: 1.2, min_p: 0.05, ..Sampling::GREEDY },
        ]
        .into_iter()
        .enumerate()
        {
            let sampling = Sampling { seed: 1000 + i as u64, ..base };
            let tokens = sample(&sampling);
            assert_eq!(sample(&sampling), tokens, "{family} {sampling:?}: the same seed twice");
            let other = sample(&Sampling { seed: sampling.seed + 77, ..sampling });
            assert_ne!(other, tokens, "{family} {sampling:?}: another seed, the same tokens");
            assert_ne!(
                tokens[..32],
                case.greedy_tokens[..],
                "{family} {sampling:?}: sampled the greedy tokens"
            );

            let oracle: Vec<i64> = inputs.input_ids.iter().copied().chain(tokens.iter().copied()).collect();
            let poor: Vec<i64> = (0..oracle.len() as i64).map(|t| (t * 37 + 11) % i64::from(vocab)).collect();
            for (what, script, depth, siblings) in [
                ("oracle tree", &oracle, 8, true),
                ("oracle chain", &oracle, 8, false),
                ("poor tree", &poor, 4, true),
            ] {
                let mut provider = scripted(script.clone(), depth, siblings, vocab);
                let (generation, stats) = speculative_generate(
                    &model,
                    &inputs,
                    &params,
                    spec_params(2 * depth, sampling),
                    &mut provider,
                    None,
                    |_| StepControl::Continue,
                )
                .expect("speculative sampling");
                assert_eq!(
                    generation.tokens, tokens,
                    "{family} {sampling:?} {what}: differs from autoregressive"
                );
                println!("{family} {sampling:?} {what}: identical, tau {:.2}", stats.tau());
                if what.starts_with("oracle") {
                    assert!(
                        stats.tau() > 4.0,
                        "{what}: the true branch was not followed: tau {}",
                        stats.tau()
                    );
                }
            }
        }
    }
}
