//! Auto's rounds in process: the drafter's tree with a prompt-lookup tree grafted on.

use glance_models::decode::{generate, GreedyParams, ModelInputs, StepControl};
use glance_models::sampling::Sampling;
use glance_models::TargetModel;
use glance_spec::tree::Tree;
use glance_tests::drafters::FnProvider;
use glance_tests::fixtures;
use tch::Kind;
use verifier_svc::policy::RoundPolicy;
use verifier_svc::speculative::{speculative_generate, SpecParams};

/// A drafter that fills its whole allowance every round (the budget and the spine auto asks for)
/// with tokens the target never takes, on text that holds every token twice, so that prompt
/// lookup matches from the first round on: the policy's first rounds verify every node of the
/// union (its warm-up), the widest pass auto can ask for. It must fit the verify buffers, graft
/// the lookup on, and leave the output that of greedy decoding.
#[test]
fn the_widest_grafted_round_fits_one_pass_and_stays_lossless() {
    let Some(root) = fixtures() else { return };
    let _no_grad = tch::no_grad_guard();
    let model =
        TargetModel::load(&root.join("tiny-llama"), Kind::Float, glance_tests::test_device()).expect("model");
    let vocab = model.text_config().vocab_size;
    let ids: Vec<i64> = (0..vocab).chain(0..vocab).collect();
    let positions: Vec<i64> = (0..ids.len() as i64).collect();
    let inputs = ModelInputs {
        input_ids: ids,
        positions: [positions.clone(), positions.clone(), positions],
        rope_delta: 0,
        pixel_values: None,
        image_grids: Vec::new(),
    };
    let params = GreedyParams { max_new_tokens: 24, eos_token_ids: &[], context_limit: 4096, logprobs: None };
    let greedy =
        generate(&model, &inputs, &params, &Sampling::GREEDY, |_| StepControl::Continue).expect("AR");

    let max_depth = 15;
    let mut provider = FnProvider::new(max_depth, move |_context, root, budget| {
        // A chain as deep as the block goes, then siblings of the root, up to budget + spine.
        let foreign = |i: usize| ((root + 500 + i as i64) % vocab) as u32;
        let mut tree = Tree::default();
        for depth in 0..max_depth {
            tree.push(foreign(depth), depth as i32 - 1, -0.1 * (depth + 1) as f64);
        }
        while tree.len() < budget + max_depth {
            tree.push(foreign(tree.len()), -1, -3.0);
        }
        tree
    });
    let mut policy = RoundPolicy::default().for_new_request();
    let spec = SpecParams { budget: 31, branch_k: 4, log_rounds: false, sampling: Sampling::GREEDY };
    let (generation, stats) =
        speculative_generate(&model, &inputs, &params, spec, &mut provider, Some(&mut policy), |_| {
            StepControl::Continue
        })
        .expect("a grafted round of 1 + 46 + 15 rows is verified");
    assert_eq!(generation.tokens, greedy.tokens, "auto with grafted lookups differs from greedy");
    let chose = stats.policy.expect("auto's stats");
    assert!(chose.grafted_rounds > 0 && chose.grafted_nodes >= max_depth, "nothing grafted: {chose:?}");
}
