//! Log-probabilities. Against transformers: on the four tiny parity models, the chosen tokens'
//! values equal `compute_transition_scores(normalize_logits=True)` of `generate`'s scores and the
//! top-5 alternatives equal the top-5 of their log-softmax (`tests/reference/make_logprob_reference.py`),
//! greedy through our decoder, sampled on transformers' own draws (their RNG is not ours).
//! Between our modes: every speculative mode reports, for the same tokens, the values
//! autoregressive decoding reports (f32, within 1e-5; 5e-5 on the tiny Llama; over the temperature
//! when sampling below 1, see `modes_tolerance`), computed from the verify pass's rows.

use glance_models::decode::{generate, teacher_forced, GreedyParams, StepControl};
use glance_models::readout::{log_probs, read_rows, Reads, TokenLogprob};
use glance_models::sampling::Sampling;
use glance_models::{LogitRows, TargetModel};
use glance_tests::drafters::scripted;
use glance_tests::{fixtures, Case};
use serde::Deserialize;
use tch::{Kind, Tensor};
use verifier_svc::speculative::{speculative_generate, SpecParams};

#[derive(Deserialize)]
struct Reference {
    case: String,
    new_tokens: usize,
    top: usize,
    settings: Vec<Setting>,
}

#[derive(Deserialize)]
struct Setting {
    name: String,
    temperature: f64,
    top_k: usize,
    top_p: f64,
    min_p: f64,
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    top_ids: Vec<Vec<i64>>,
    top_logprobs: Vec<Vec<f32>>,
}

impl Setting {
    fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: 0,
        }
    }
}

/// How far transformers' values may be: the models' own parity (their logits agree within
/// about 2e-5 of the largest logit).
const TRANSFORMERS_TOLERANCE: f32 = 1e-4;
/// Between a verify pass and a step of the same model (f32): the 1e-5 for greedy decoding.
/// The tiny Llama's strong initialization (logits up to 10, llama3 rope scaling) makes its verify
/// rows and steps round apart by up to ~4e-5 in the logits themselves (5.8e-5 in its values with
/// the AVX-512 kernels of a Zen 4 core), so its values get the models' parity bound
/// ([`TRANSFORMERS_TOLERANCE`]).
/// Sampling divides the logits by the temperature before the softmax, and their rounding with
/// them: below temperature 1 the bound grows by 1/temperature.
fn modes_tolerance(family: &str, sampling: &Sampling) -> f32 {
    let greedy: f32 = if family == "tiny-llama" { TRANSFORMERS_TOLERANCE } else { 1e-5 };
    let scale = if sampling.temperature > 0.0 { (1.0 / sampling.temperature as f32).max(1.0) } else { 1.0 };
    greedy * scale
}

/// The largest |difference| of the chosen values and of the alternatives, which must be the same
/// tokens in the same order.
fn compare(what: &str, ours: &[TokenLogprob], chosen: &[f32], top_ids: &[Vec<i64>], top: &[Vec<f32>]) -> f32 {
    assert_eq!(ours.len(), chosen.len(), "{what}: one log-probability per token");
    let mut largest = 0f32;
    for (step, lp) in ours.iter().enumerate() {
        largest = largest.max((lp.logprob - chosen[step]).abs());
        let ids: Vec<i64> = lp.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, top_ids[step], "{what}: step {step}: other alternatives");
        for (&(_, value), &theirs) in lp.top.iter().zip(&top[step]) {
            largest = largest.max((value - theirs).abs());
        }
    }
    largest
}

#[test]
fn logprobs_equal_transformers_transition_scores() {
    let Some(root) = fixtures() else { return };
    let _no_grad = tch::no_grad_guard();
    for family in ["tiny-qwen3-vl", "tiny-qwen2.5-vl", "tiny-llama", "tiny-qwen3"] {
        let dir = root.join(family);
        let text = std::fs::read_to_string(dir.join("logprobs.json")).expect("logprobs.json");
        let reference: Reference = serde_json::from_str(&text).expect("logprobs.json parses");
        let model = TargetModel::load(&dir, Kind::Float, glance_tests::test_device()).expect("model");
        let inputs = glance_tests::reference_inputs(&Case::load(&dir, &reference.case));
        let params = GreedyParams {
            max_new_tokens: reference.new_tokens,
            eos_token_ids: &[],
            context_limit: 4096,
            logprobs: Some(reference.top),
        };
        assert!(reference.settings.len() >= 3 && reference.settings[0].temperature == 0.0);
        for setting in &reference.settings {
            let what = format!("{family} {}", setting.name);
            let ours = if setting.temperature == 0.0 {
                let generation =
                    generate(&model, &inputs, &params, &Sampling::GREEDY, |_| StepControl::Continue)
                        .expect("greedy");
                assert_eq!(generation.tokens, setting.tokens, "{what}: other tokens than transformers");
                generation.logprobs
            } else {
                forced_logprobs(&model, &inputs, setting, reference.top)
            };
            let largest = compare(&what, &ours, &setting.logprobs, &setting.top_ids, &setting.top_logprobs);
            println!("{what}: {} tokens, max |Δ logprob| {largest:.1e}", ours.len());
            assert!(largest <= TRANSFORMERS_TOLERANCE, "{what}: log-probabilities differ by {largest}");
        }
    }
}

/// Transformers' sampled tokens scored by our readout: one teacher-forced pass over them, each
/// row's processed log-probabilities (the same `log_probs` a decoder's read-back computes) at the
/// token drawn there, and the row's alternatives from `read_rows`.
fn forced_logprobs(
    model: &TargetModel,
    inputs: &glance_models::decode::ModelInputs,
    setting: &Setting,
    top: usize,
) -> Vec<TokenLogprob> {
    let forced = teacher_forced(model, inputs, &setting.tokens, &[], LogitRows::All).expect("forward");
    let continuation = forced.continuation.expect("tokens").logits.expect("logits");
    let n = setting.tokens.len() as i64;
    // Row j: the distribution token j was drawn from.
    let rows = Tensor::cat(&[forced.prompt_logits, continuation.narrow(0, 0, n - 1)], 0);
    let sampling = setting.sampling();
    let chosen = log_probs(&rows, &sampling)
        .gather(-1, &Tensor::from_slice(&setting.tokens).view([n, 1]), false)
        .view([-1]);
    let chosen = Vec::<f32>::try_from(chosen).expect("f32");
    let numerators = Tensor::zeros([n], (Kind::Int64, tch::Device::Cpu));
    let alternatives =
        read_rows(&rows, &sampling, Some(&numerators), Reads { entropy: false, logprobs: Some(top) });
    alternatives
        .logprobs
        .into_iter()
        .zip(chosen)
        .map(|(lp, logprob)| TokenLogprob { logprob, top: lp.top })
        .collect()
}

/// Every speculative mode reports the autoregressive values for the same tokens: an oracle-like
/// tree and chain (deep acceptance: most tokens come from verify rows below the root) and a poor
/// drafter (most from the root row), greedy and sampled, on a VLM and a text family.
#[test]
fn speculative_logprobs_equal_autoregressive() {
    let Some(root) = fixtures() else { return };
    let _no_grad = tch::no_grad_guard();
    for family in ["tiny-qwen3-vl", "tiny-llama"] {
        let dir = root.join(family);
        let model = TargetModel::load(&dir, Kind::Float, glance_tests::test_device()).expect("model");
        let vocab = model.text_config().vocab_size as u32;
        let case = Case::load(&dir, if family == "tiny-llama" { "single_turn" } else { "one_image" });
        let inputs = glance_tests::reference_inputs(&case);
        let params =
            GreedyParams { max_new_tokens: 40, eos_token_ids: &[], context_limit: 4096, logprobs: Some(5) };
        for sampling in [
            Sampling::GREEDY,
            Sampling { temperature: 0.7, top_k: 20, top_p: 0.95, seed: 5, ..Sampling::GREEDY },
            Sampling { temperature: 1.2, min_p: 0.05, seed: 6, ..Sampling::GREEDY },
        ] {
            let ar = generate(&model, &inputs, &params, &sampling, |_| StepControl::Continue).expect("AR");
            assert_eq!(ar.logprobs.len(), ar.tokens.len());
            let oracle: Vec<i64> = inputs.input_ids.iter().chain(&ar.tokens).copied().collect();
            let poor: Vec<i64> = (0..oracle.len() as i64).map(|t| (t * 37 + 11) % i64::from(vocab)).collect();
            for (what, script, depth, siblings) in [
                ("oracle tree", &oracle, 8, true),
                ("oracle chain", &oracle, 8, false),
                ("poor tree", &poor, 4, true),
            ] {
                let mut provider = scripted(script.clone(), depth, siblings, vocab);
                let spec = SpecParams { budget: 2 * depth, branch_k: 2, log_rounds: false, sampling };
                let mut streamed = Vec::new();
                let (generation, stats) =
                    speculative_generate(&model, &inputs, &params, spec, &mut provider, None, |emitted| {
                        streamed.push(emitted.logprob.cloned().expect("a log-probability with each token"));
                        StepControl::Continue
                    })
                    .expect("speculative");
                let label = format!("{family} {sampling:?} {what}");
                assert_eq!(generation.tokens, ar.tokens, "{label}: other tokens");
                assert_eq!(streamed, generation.logprobs, "{label}: what on_token saw");
                let ids = |lps: &[TokenLogprob]| -> Vec<Vec<i64>> {
                    lps.iter().map(|lp| lp.top.iter().map(|&(id, _)| id).collect()).collect()
                };
                let values = |lps: &[TokenLogprob]| -> Vec<Vec<f32>> {
                    lps.iter().map(|lp| lp.top.iter().map(|&(_, v)| v).collect()).collect()
                };
                let chosen: Vec<f32> = ar.logprobs.iter().map(|lp| lp.logprob).collect();
                let largest =
                    compare(&label, &generation.logprobs, &chosen, &ids(&ar.logprobs), &values(&ar.logprobs));
                println!("{label}: tau {:.2}, max |Δ logprob| {largest:.1e}", stats.tau());
                let tolerance = modes_tolerance(family, &sampling);
                assert!(largest <= tolerance, "{label}: log-probabilities differ by {largest}");
                if what.starts_with("oracle") {
                    assert!(stats.tau() > 4.0, "{label}: tau {}", stats.tau());
                }
            }
        }
    }
}
