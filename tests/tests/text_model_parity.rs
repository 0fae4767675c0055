//! Parity of the text-only target families (Llama, Qwen3) with Hugging Face transformers
//! (float32): logits and every layer's hidden state within 1e-4 on the reference's own token ids,
//! and the same prompt ids and 32 greedy tokens through our whole input pipeline. The tiny
//! checkpoints (`tests/reference/make_text_reference.py`) are built so that a loader mistake shows:
//! the teeth below change one config value and expect different tokens. A text model refuses
//! images with the field named, and unsupported configs fail at load with the key named.

use std::path::{Path, PathBuf};

use glance_input::{ChatMessage, ContentPart, InputError, PromptBuilder, PromptOptions};
use glance_models::decode::{GreedyParams, ModelInputs};
use glance_models::{Family, TargetModel};
use glance_tests::{
    fixtures, greedy, max_abs_diff, prompt_forward, reference_inputs, test_device, Case, TEXT_CASES,
    TEXT_FAMILIES,
};
use tch::{Kind, Tensor};

const TOLERANCE: f64 = 1e-4;
/// Logits grow with the strong random init (|logit| about 12 on the tiny Llama): as for the VLM
/// families, their bound is relative to the largest, never below 1e-4. The order a matrix product
/// sums in moves them by a few f32 units in the last place of that size (MKL's, transformers' own,
/// and the few-row kernel's differ).
const LOGIT_TOLERANCE: f64 = 2e-5;

fn load(dir: &Path, kind: Kind) -> TargetModel {
    TargetModel::load(dir, kind, test_device()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

#[test]
fn logits_and_taps_match_transformers() {
    let Some(root) = fixtures() else { return };
    for family in TEXT_FAMILIES {
        let model = load(&root.join(family), Kind::Float);
        assert!(!model.family.is_multimodal(), "{family}: loaded as {:?}", model.family);
        for name in TEXT_CASES {
            let case = Case::load(&root.join(family), name);
            let (logits, taps) = prompt_forward(&model, &reference_inputs(&case), &case.tap_layers);
            let logit_diff = max_abs_diff(&logits, case.tensor("logits"));
            let tap_diff = case
                .tap_layers
                .iter()
                .zip(&taps)
                .map(|(layer, tap)| max_abs_diff(tap, case.tensor(&format!("hidden_{layer}"))))
                .fold(0.0, f64::max);
            let logit_bound = LOGIT_TOLERANCE * case.tensor("logits").abs().max().double_value(&[]).max(5.0);
            println!(
                "{family}/{name}: logits max|Δ| {logit_diff:.2e} (bound {logit_bound:.1e}), taps max|Δ| {tap_diff:.2e}"
            );
            assert!(logit_diff <= logit_bound, "{family}/{name}: logits differ by {logit_diff}");
            assert!(tap_diff <= TOLERANCE, "{family}/{name}: tapped states differ by {tap_diff}");
        }
    }
}

#[test]
fn greedy_tokens_match_transformers_through_our_pipeline() {
    let Some(root) = fixtures() else { return };
    for family in TEXT_FAMILIES {
        let dir = root.join(family);
        let model = load(&dir, Kind::Float);
        let prompts = PromptBuilder::from_model_dir(&dir, PromptOptions::default()).expect("prompt builder");
        assert!(!prompts.takes_images() && prompts.image_config().is_none());
        for name in TEXT_CASES {
            let case = Case::load(&dir, name);
            let inputs = prompts.build(&case.chat_messages()).expect("prompt").model_inputs();
            assert_eq!(inputs.input_ids, case.input_ids, "{family}/{name}: input ids");
            assert_eq!(inputs.positions[0], case.position_ids[0], "{family}/{name}: positions");
            let tokens = greedy(&model, &inputs, case.greedy_tokens.len());
            assert_eq!(tokens, case.greedy_tokens, "{family}/{name}: greedy tokens");
        }
    }
}

#[test]
fn a_text_model_refuses_images_naming_the_field() {
    let Some(root) = fixtures() else { return };
    let prompts = PromptBuilder::from_model_dir(&root.join("tiny-llama"), PromptOptions::default()).unwrap();
    let png = std::fs::read(root.join("tiny-qwen3-vl/reference/images/square.png")).expect("a fixture image");
    let messages = [ChatMessage {
        role: "user".into(),
        content: vec![
            ContentPart::Text("What is this?".into()),
            ContentPart::Image { data: png, mime_type: String::new() },
        ],
    }];
    let err = prompts.build(&messages).unwrap_err();
    assert!(matches!(err, InputError::ImagesUnsupported { .. }), "{err:?}");
    assert!(err.to_string().starts_with("messages[0].content[1].image:"), "{err}");
    assert!(err.to_string().contains("llama"), "{err}");
}

/// A copy of `src` (weights linked) whose `config.json` went through `edit`.
fn edited_copy(src: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("glance-text-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() && path.file_name().unwrap() != "config.json" {
            std::os::unix::fs::symlink(&path, dst.join(path.file_name().unwrap())).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dst.join("config.json"), config.to_string()).unwrap();
    dst
}

/// Parity that cannot see a misread config proves nothing: each edit below changes how the
/// model must run, and the tokens of the longest case must change with it.
#[test]
fn config_values_have_teeth() {
    let Some(root) = fixtures() else { return };
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, &str, Edit); 3] = [
        ("tiny-llama", "no-llama3-scaling", |c| c["rope_parameters"]["rope_type"] = "default".into()),
        ("tiny-llama", "theta", |c| c["rope_parameters"]["rope_theta"] = 20000.0.into()),
        ("tiny-qwen3", "theta", |c| c["rope_parameters"]["rope_theta"] = 2000.0.into()),
    ];
    for (family, what, edit) in edits {
        let case = Case::load(&root.join(family), "long");
        let dir = edited_copy(&root.join(family), &format!("{family}-{what}"), edit);
        let tokens = greedy(&load(&dir, Kind::Float), &reference_inputs(&case), case.greedy_tokens.len());
        assert_ne!(tokens, case.greedy_tokens, "{family}: {what} went unnoticed");
        std::fs::remove_dir_all(dir).ok();
    }
}

#[test]
fn unsupported_configs_fail_at_load_naming_the_key() {
    let Some(root) = fixtures() else { return };
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, &str, Edit); 2] = [
        ("yarn", "rope_type", |c| c["rope_parameters"]["rope_type"] = "yarn".into()),
        ("sliding", "use_sliding_window", |c| c["use_sliding_window"] = true.into()),
    ];
    for (what, key, edit) in edits {
        let dir = edited_copy(&root.join("tiny-qwen3"), what, edit);
        let err = TargetModel::load(&dir, Kind::Float, test_device()).err().expect("refused");
        assert!(err.to_string().contains(key), "{what}: {err}");
        std::fs::remove_dir_all(dir).ok();
    }
}

/// bf16 loads and runs, close to the f32 reference.
#[test]
fn bf16_runs_close_to_the_f32_reference() {
    let Some(root) = fixtures() else { return };
    // One libtorch thread, as each service runs in the benchmarks: on a CPU without bf16 matrix
    // instructions a half-precision product then takes the few-row kernel (`skinny_gemm`).
    tch::set_num_threads(1);
    for family in TEXT_FAMILIES {
        let dir = root.join(family);
        let case = Case::load(&dir, "long");
        let reference = case.tensor("logits");
        let scale = reference.abs().max().double_value(&[]);
        let model = load(&dir, Kind::BFloat16);
        assert_eq!(model.family, if family == "tiny-llama" { Family::Llama } else { Family::Qwen3 });
        let (logits, _) = prompt_forward(&model, &reference_inputs(&case), &[]);
        assert_eq!(logits.kind(), Kind::BFloat16);
        let diff = max_abs_diff(&logits, reference);
        println!("{family} bf16: logits max|Δ| {diff:.3} (reference max |logit| {scale:.2})");
        // The same bound as the VLM families: the strong init amplifies bf16 rounding.
        assert!(diff.is_finite() && diff < 0.25 * scale, "{family}: bf16 logits off by {diff}");
    }
}

/// A family's tiny model in f32, its text cases and their inputs.
fn f32_model_and_cases(root: &Path, family: &str) -> (TargetModel, Vec<Case>, Vec<ModelInputs>) {
    let dir = root.join(family);
    let cases: Vec<Case> = TEXT_CASES.iter().map(|name| Case::load(&dir, name)).collect();
    let inputs = cases.iter().map(reference_inputs).collect();
    (load(&dir, Kind::Float), cases, inputs)
}

/// Batched greedy decoding (left-padded prompts of different lengths, one pass per step for all)
/// gives every prompt transformers' own greedy tokens, in f32.
#[test]
fn batched_greedy_equals_the_reference_per_prompt() {
    let Some(root) = fixtures() else { return };
    for family in TEXT_FAMILIES {
        let (model, cases, inputs) = f32_model_and_cases(&root, family);
        let lengths: Vec<usize> = inputs.iter().map(|i| i.input_ids.len()).collect();
        assert!(lengths.iter().any(|&l| l != lengths[0]), "the batch needs padding: {lengths:?}");
        let params =
            GreedyParams { max_new_tokens: 32, eos_token_ids: &[], context_limit: 1 << 20, logprobs: None };
        let batched =
            glance_models::decode::greedy_generate_batch(&model, &inputs.iter().collect::<Vec<_>>(), &params)
                .expect("batched");
        for (case, tokens) in cases.iter().zip(&batched) {
            assert_eq!(tokens, &case.greedy_tokens, "{family}/{}: batched greedy", case.case);
        }
        // An EOS ends one sequence early without touching the others.
        let eos = [cases[0].greedy_tokens[3]];
        let params =
            GreedyParams { max_new_tokens: 32, eos_token_ids: &eos, context_limit: 1 << 20, logprobs: None };
        let stopped =
            glance_models::decode::greedy_generate_batch(&model, &inputs.iter().collect::<Vec<_>>(), &params)
                .expect("batched");
        for (case, tokens) in cases.iter().zip(&stopped) {
            let end = case.greedy_tokens.iter().position(|t| *t == eos[0]).map_or(32, |p| p + 1);
            assert_eq!(tokens[..], case.greedy_tokens[..end], "{family}/{}: EOS", case.case);
        }
    }
}

/// Batched greedy decoding that keeps the taps (drafter training's regeneration) gives each
/// prompt the tap states a teacher-forced pass over its tokens gives, in f32, also for a sequence
/// an EOS ended early (its last token is read by a step it only rides along in) and for the ones
/// whose last token is read by the one step taken after every sequence is done.
#[test]
fn batched_greedy_keeps_the_states_of_a_teacher_forced_pass() {
    use glance_models::decode::{greedy_generate_batch_with_taps, teacher_forced};
    let Some(root) = fixtures() else { return };
    for family in TEXT_FAMILIES {
        let (model, cases, inputs) = f32_model_and_cases(&root, family);
        let taps = &cases[0].tap_layers;
        let eos = [cases[0].greedy_tokens[3]];
        let params =
            GreedyParams { max_new_tokens: 12, eos_token_ids: &eos, context_limit: 1 << 20, logprobs: None };
        let batch = inputs.iter().collect::<Vec<_>>();
        let sequences = greedy_generate_batch_with_taps(&model, &batch, &params, taps).expect("batched");
        let lengths: Vec<usize> = sequences.iter().map(|s| s.tokens.len()).collect();
        assert!(
            lengths.iter().any(|&l| l < 12) && lengths.contains(&12),
            "{family}: an early EOS and a full row: {lengths:?}"
        );
        for ((case, input), sequence) in cases.iter().zip(&inputs).zip(&sequences) {
            let states = sequence.states.as_ref().expect("every token was read");
            let pass = teacher_forced(&model, input, &sequence.tokens, taps, glance_models::LogitRows::None)
                .expect("teacher forced");
            let continuation = Tensor::cat(&pass.continuation.expect("tokens").taps, -1);
            let expected = Tensor::cat(&[pass.prompt_states.expect("taps"), continuation], 0);
            assert_eq!(states.size(), expected.size(), "{family}/{}", case.case);
            let diff = max_abs_diff(states, &expected);
            assert!(diff < 1e-4, "{family}/{}: tap states off by {diff}", case.case);
        }
        let plain = glance_models::decode::greedy_generate_batch(&model, &batch, &params).expect("batched");
        assert_eq!(
            plain,
            sequences.into_iter().map(|s| s.tokens).collect::<Vec<_>>(),
            "{family}: same tokens"
        );
    }
}

/// A draft head started from target layers (`HeadSpec::copy_target_layers`) holds their weights
/// under the DFlash names (Qwen3's q/k norms too), `fc` the identity on the last tap and
/// `hidden_norm` the first copied layer's input norm; a list that is not one layer per head layer
/// is refused, and so is a target whose layers have biases (the tiny Llama's), which a DFlash head
/// has not. (SmolLM2, a Llama without biases or q/k norms, leaves the head's q/k norms at 1.)
#[test]
fn a_head_started_from_target_layers_holds_their_weights() {
    use drafter_svc::init::{write_random_head, HeadSpec};
    use glance_models::weights::read_named_tensors;
    let Some(root) = fixtures() else { return };
    let spec = HeadSpec {
        tap_layers: Some(vec![0, 1]),
        copy_target_layers: Some(vec![2, 1]),
        ..HeadSpec::new(2, 16, 3)
    };
    let out = std::env::temp_dir().join(format!("glance-copied-head-{}", std::process::id()));
    let err = write_random_head(&root.join("tiny-llama"), &out, &spec).unwrap_err();
    assert!(err.to_string().contains("biases (model.layers.2."), "{err}");
    assert!(!out.exists(), "a refused copy writes nothing");

    let target = root.join("tiny-qwen3");
    write_random_head(&target, &out, &spec).expect("copied head");
    let load = |dir: &Path, name: &str| {
        let mut found = read_named_tensors(dir, &[name], Kind::Float, tch::Device::Cpu).unwrap();
        found.remove(name).unwrap_or_else(|| panic!("{name} in {}", dir.display()))
    };
    for (head_layer, target_layer) in [(0, 2), (1, 1)] {
        for suffix in ["self_attn.q_proj.weight", "self_attn.q_norm.weight", "mlp.down_proj.weight"] {
            let copied = load(&out, &format!("layers.{head_layer}.{suffix}"));
            let source = load(&target, &format!("model.layers.{target_layer}.{suffix}"));
            assert!(copied.equal(&source), "layers.{head_layer}.{suffix}");
        }
    }
    assert!(load(&out, "hidden_norm.weight").equal(&load(&target, "model.layers.2.input_layernorm.weight")));
    let fc = load(&out, "fc.weight");
    let d = fc.size()[0];
    assert!(fc.narrow(1, d, d).equal(&Tensor::eye(d, (Kind::Float, tch::Device::Cpu))), "fc: the last tap");
    assert_eq!(fc.narrow(1, 0, d).abs().sum(Kind::Float).double_value(&[]), 0.0, "fc: the other tap");
    let bad = HeadSpec { copy_target_layers: Some(vec![1]), ..spec };
    let err = write_random_head(&target, &out, &bad).unwrap_err();
    assert!(err.to_string().contains("one per head layer"), "{err}");
    std::fs::remove_dir_all(&out).ok();
}
