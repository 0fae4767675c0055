//! The toy target's trainer: one AdamW step lowers the packed answer loss on a fixed batch.

use glance_toyworld::target::{batch_loss, fresh_target, TargetSpec};
use glance_toyworld::{sample, Split, Task};
use glance_train::AdamW;

#[test]
fn one_step_lowers_the_loss_on_a_fixed_batch() {
    let dir = std::env::temp_dir().join(format!("glance-toy-step-{}", std::process::id()));
    let spec = TargetSpec {
        hidden: 64,
        layers: 2,
        heads: 2,
        kv_heads: 1,
        head_dim: 32,
        intermediate: 128,
        mrope_section: [6, 5, 5],
        vision_hidden: 32,
        vision_depth: 2,
        vision_heads: 2,
        vision_intermediate: 64,
        deepstack: vec![0],
        position_side: 8,
    };
    let (model, prompts, named) = fresh_target(&dir, &spec, 0).unwrap();
    let batch: Vec<_> = Task::ALL.iter().map(|&task| sample(Split::Train, task, 0, 1)).collect();
    let mut optimizer = AdamW::new(named.iter().map(|(_, t)| t.shallow_clone()).collect(), 0.0);
    let before = batch_loss(&model, &prompts, &batch).unwrap();
    before.backward();
    optimizer.step(3e-3);
    let after = tch::no_grad(|| batch_loss(&model, &prompts, &batch).unwrap()).double_value(&[]);
    let before = before.double_value(&[]);
    assert!(after < before, "loss {before} -> {after}");
}
