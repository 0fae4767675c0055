//! Parity of the tch target models with Hugging Face transformers (float32): tapped hidden states
//! within 1e-4 and logits within 2e-5 of their largest magnitude on the reference's own inputs,
//! and identical greedy tokens through our whole input pipeline (with the image processor each
//! case was made with) — for every case of both families and both weight layouts. Then the
//! teeth: breaking one thing on purpose must change the greedy tokens.

use glance_models::decode::{greedy_generate_batch, GreedyParams, ModelInputs};
use glance_models::TargetModel;
use glance_tests::{
    fixtures, greedy, max_abs_diff, prompt_forward, reference_inputs, test_device, Case, FAMILIES,
};
use tch::Kind;

const TOLERANCE: f64 = 1e-4;
/// Logits grow with the strong random init (|logit| about 9 on Qwen2.5-VL), and f32 rounding
/// through the vision tower with them: their bound is relative to the largest, never below 1e-4.
const LOGIT_TOLERANCE: f64 = 2e-5;

fn load(dir: &std::path::Path) -> TargetModel {
    TargetModel::load(dir, Kind::Float, test_device()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

#[test]
fn logits_and_taps_match_transformers() {
    let Some(root) = fixtures() else { return };
    for (family, legacy) in FAMILIES {
        for dir in [family, legacy] {
            let model = load(&root.join(dir));
            for name in glance_tests::vlm_cases() {
                let case = Case::load(&root.join(family), name);
                let (logits, taps) = prompt_forward(&model, &reference_inputs(&case), &case.tap_layers);
                let reference = case.tensor("logits");
                let logit_diff = max_abs_diff(&logits, reference);
                let logit_bound = LOGIT_TOLERANCE * reference.abs().max().double_value(&[]).max(5.0);
                let tap_diff = case
                    .tap_layers
                    .iter()
                    .zip(&taps)
                    .map(|(layer, tap)| max_abs_diff(tap, case.tensor(&format!("hidden_{layer}"))))
                    .fold(0.0, f64::max);
                println!("{dir}/{name}: logits max|Δ| {logit_diff:.2e} (bound {logit_bound:.1e}), taps max|Δ| {tap_diff:.2e}");
                assert!(logit_diff <= logit_bound, "{dir}/{name}: logits differ by {logit_diff}");
                assert!(tap_diff <= TOLERANCE, "{dir}/{name}: tapped states differ by {tap_diff}");
            }
        }
    }
}

#[test]
fn greedy_tokens_match_transformers_through_our_pipeline() {
    let Some(root) = fixtures() else { return };
    for (family, _) in FAMILIES {
        let dir = root.join(family);
        let model = load(&dir);
        for name in glance_tests::vlm_cases() {
            let case = Case::load(&dir, name);
            let prompt = case.prompt_builder(&dir).build(&case.chat_messages()).expect("prompt");
            let inputs = prompt.model_inputs();
            assert_eq!(inputs.input_ids, case.input_ids, "{family}/{name}: input ids");
            let tokens = greedy(&model, &inputs, case.greedy_tokens.len());
            assert_eq!(tokens, case.greedy_tokens, "{family}/{name}: greedy tokens");
        }
    }
}

/// Batched greedy decoding over prompts with and without images (each prefilled with its own
/// vision features, its M-RoPE offset carried into the batch) gives every case transformers'
/// greedy tokens, in f32.
#[test]
fn batched_greedy_with_images_equals_the_reference_per_case() {
    let Some(root) = fixtures() else { return };
    for (family, _) in FAMILIES {
        let dir = root.join(family);
        let model = load(&dir);
        let cases: Vec<Case> = glance_tests::vlm_cases().iter().map(|name| Case::load(&dir, name)).collect();
        let inputs: Vec<ModelInputs> = cases.iter().map(reference_inputs).collect();
        assert!(inputs.iter().any(|i| i.pixel_values.is_some()) && inputs.iter().any(|i| i.rope_delta != 0));
        let n = cases.iter().map(|c| c.greedy_tokens.len()).min().expect("cases");
        let params =
            GreedyParams { max_new_tokens: n, eos_token_ids: &[], context_limit: 1 << 20, logprobs: None };
        let batched =
            greedy_generate_batch(&model, &inputs.iter().collect::<Vec<_>>(), &params).expect("batched");
        for (case, tokens) in cases.iter().zip(&batched) {
            assert_eq!(tokens[..], case.greedy_tokens[..n], "{family}/{}: batched greedy", case.case);
        }
    }
}

/// A parity suite that cannot see a broken model proves nothing: each deliberate break below
/// must change the greedy continuation of a case with images.
#[test]
fn parity_checks_have_teeth() {
    let Some(root) = fixtures() else { return };
    for (family, _) in FAMILIES {
        let dir = root.join(family);
        let case = Case::load(&dir, "two_images");
        let mut model = load(&dir);
        let inputs = reference_inputs(&case);
        let n = case.greedy_tokens.len();
        assert_eq!(greedy(&model, &inputs, n), case.greedy_tokens, "{family}: baseline");

        // 1-D positions instead of M-RoPE.
        let flat: Vec<i64> = (0..case.input_ids.len() as i64).collect();
        let one_d = ModelInputs {
            positions: [flat.clone(), flat.clone(), flat],
            rope_delta: 0,
            ..reference_inputs(&case)
        };
        assert_ne!(greedy(&model, &one_d, n), case.greedy_tokens, "{family}: 1-D positions went unnoticed");

        // Wrong image normalization (pixels shifted by half a standard deviation).
        let shifted = ModelInputs {
            pixel_values: inputs.pixel_values.as_ref().map(|p| p + 0.5),
            ..reference_inputs(&case)
        };
        assert_ne!(
            greedy(&model, &shifted, n),
            case.greedy_tokens,
            "{family}: wrong mean/std went unnoticed"
        );

        if family == "tiny-qwen3-vl" {
            model.text.set_deepstack_enabled(false);
            assert_ne!(
                greedy(&model, &inputs, n),
                case.greedy_tokens,
                "{family}: missing DeepStack went unnoticed"
            );
        }
    }
}

/// Half precision loads and runs end to end (vision tower included) and stays close to the f32
/// reference: a smoke test of every dtype conversion on the way.
#[test]
fn bf16_and_f16_run_close_to_the_f32_reference() {
    let Some(root) = fixtures() else { return };
    // One libtorch thread, as each service runs in the benchmarks: on a CPU without bf16 matrix
    // instructions a half-precision product then takes the few-row kernel (`skinny_gemm`).
    tch::set_num_threads(1);
    for (family, _) in FAMILIES {
        let dir = root.join(family);
        let case = Case::load(&dir, "two_images");
        let reference = case.tensor("logits");
        let scale = reference.abs().max().double_value(&[]);
        for kind in [Kind::BFloat16, Kind::Half] {
            let model = TargetModel::load(&dir, kind, test_device()).expect("half-precision load");
            let (logits, _) = prompt_forward(&model, &reference_inputs(&case), &[]);
            assert_eq!(logits.kind(), kind);
            let diff = max_abs_diff(&logits, reference);
            println!("{family} {kind:?}: logits max|Δ| {diff:.3} (reference max |logit| {scale:.2})");
            assert!(diff.is_finite() && diff < 0.25 * scale, "{family} {kind:?}: logits off by {diff}");
            let tokens = greedy(&model, &reference_inputs(&case), 4);
            assert_eq!(tokens.len(), 4);
        }
    }
}
