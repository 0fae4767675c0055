//! Drafter training: one step lowers the loss on a fixed batch, and a short run (seconds) produces
//! a head that loads in drafter-svc's engine unchanged and drafts.

#![allow(clippy::disallowed_methods)] // tests build and read host tensors freely

use std::collections::HashMap;
use std::path::PathBuf;

use drafter_svc::draft_vocab::DraftVocabChoice;
use drafter_svc::head::{DraftHead, DraftHeadConfig};
use drafter_svc::init::HeadSpec;
use drafter_svc::train::{
    block_loss, row_for, train, DataSource, Distill, LossVocab, LossWeights, Row, Scored, TeacherTop,
    TrainConfig,
};
use glance_input::{ChatMessage, ContentPart, PromptBuilder, PromptOptions};
use glance_models::weights::Checkpoint;
use glance_models::TargetModel;
use glance_spec::tree::Reach;
use glance_train::AdamW;
use tch::{Device, Kind, Tensor};

fn target_dir() -> Option<PathBuf> {
    let root = std::env::var_os("GLANCE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"));
    let dir = root.join("tiny-qwen3-vl");
    if dir.is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var("GLANCE_REQUIRE_FIXTURES").as_deref() != Ok("1"),
        "fixtures missing at {}",
        dir.display()
    );
    eprintln!("skipping: no fixtures at {}", dir.display());
    None
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("glance-train-{name}-{}", std::process::id()))
}

/// A fresh head over the tiny VLM, its trainable parameters, one row and its anchors.
fn fixed_batch(dir: &std::path::Path, name: &str) -> (DraftHead, Vec<tch::Tensor>, Row, Vec<i64>) {
    let head_dir = scratch(name);
    let spec = HeadSpec { tap_layers: Some(vec![0, 1, 2]), ..HeadSpec::new(1, 16, 3) };
    drafter_svc::init::write_random_head(dir, &head_dir, &spec).unwrap();
    let target = TargetModel::load(dir, Kind::Float, Device::Cpu).unwrap();
    let prompts = PromptBuilder::from_model_dir(dir, PromptOptions::default()).unwrap();
    let messages =
        vec![ChatMessage { role: "user".into(), content: vec![ContentPart::Text("Tell a story.".into())] }];
    let row = row_for(&target, &prompts, &messages, 40, &[0, 1, 2]).unwrap();
    let config = DraftHeadConfig::load(&head_dir, Some(4)).unwrap();
    let mut ckpt = Checkpoint::open(&head_dir, Kind::Float, Device::Cpu).unwrap().into_trainable();
    let head = DraftHead::from_checkpoint(
        config,
        &mut ckpt,
        target.text.embed_tokens().shallow_clone(),
        target.text.lm_head().shallow_clone(),
    )
    .unwrap();
    let params = ckpt.parameters().iter().map(|(_, t)| t.shallow_clone()).collect();
    let anchors: Vec<i64> = (row.response_start as i64..row.tokens.len() as i64 - 1).step_by(3).collect();
    std::fs::remove_dir_all(head_dir).ok();
    (head, params, row, anchors)
}

#[test]
fn one_step_lowers_the_loss_on_a_fixed_batch() {
    let Some(dir) = target_dir() else { return };
    let (head, params, row, anchors) = fixed_batch(&dir, "step");
    let mut optimizer = AdamW::new(params, 0.0);
    let before = block_loss(&head, &row, &anchors, LossWeights::hard(7.0), &Scored::All);
    before.backward();
    optimizer.step(1e-3);
    let after = tch::no_grad(|| block_loss(&head, &row, &anchors, LossWeights::hard(7.0), &Scored::All))
        .double_value(&[]);
    let before = before.double_value(&[]);
    assert!(after < before, "loss {before} -> {after}");
}

/// The sampled softmax scores exactly the full logits' columns it names, and a step on it (a
/// tenth of the vocabulary) lowers the full-vocabulary loss.
#[test]
fn a_sampled_softmax_step_lowers_the_full_loss() {
    let Some(dir) = target_dir() else { return };
    let (head, params, row, anchors) = fixed_batch(&dir, "sampled");
    let tokens: Vec<i64> = anchors.iter().map(|&a| row.tokens[a as usize]).collect();
    let hidden = tch::no_grad(|| head.forward_train_hidden(&row.states, &anchors, &tokens));
    let subset: Vec<i64> = (0..head.vocab_size()).step_by(10).collect();
    let ids = tch::Tensor::from_slice(&subset);
    let full = tch::no_grad(|| head.logits(&hidden).index_select(2, &ids));
    let over = tch::no_grad(|| head.logits_over(&hidden, &ids));
    assert!(full.allclose(&over, 1e-5, 1e-5, false));
    let mut optimizer = AdamW::new(params, 0.0);
    let full_loss = |head: &DraftHead| {
        tch::no_grad(|| block_loss(head, &row, &anchors, LossWeights::hard(7.0), &Scored::All))
            .double_value(&[])
    };
    let before = full_loss(&head);
    block_loss(&head, &row, &anchors, LossWeights::hard(7.0), &Scored::Subset(&subset)).backward();
    optimizer.step(1e-3);
    let after = full_loss(&head);
    assert!(after < before, "full loss {before} -> {after}");
}

/// The target's own top-k at each response token: sorted, renormalized, led by the greedy token
/// the response holds there (the teacher-forced pass and greedy decoding agree on the argmax).
#[test]
fn the_teacher_distribution_is_the_targets_own_top_k_led_by_its_greedy_token() {
    let Some(dir) = target_dir() else { return };
    let (_, _, row, _) = fixed_batch(&dir, "teacher");
    let teacher = teacher_of(&dir, &row, 5);
    let response = &row.tokens[row.response_start..];
    assert_eq!((teacher.k, teacher.ids.len()), (5, 5 * response.len()));
    for (i, &token) in response.iter().enumerate() {
        let (ids, probs) = teacher.at(i);
        assert_eq!(ids[0], token, "response token {i}");
        assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-5, "{probs:?}");
        assert!(probs.windows(2).all(|w| w[0] >= w[1]), "{probs:?}");
    }
}

/// The row's teacher distribution for the tiny VLM, as `train --distill-top-k` keeps it.
fn teacher_of(dir: &std::path::Path, row: &Row, k: usize) -> TeacherTop {
    let target = TargetModel::load(dir, Kind::Float, Device::Cpu).unwrap();
    let prompts = PromptBuilder::from_model_dir(dir, PromptOptions::default()).unwrap();
    let messages =
        vec![ChatMessage { role: "user".into(), content: vec![ContentPart::Text("Tell a story.".into())] }];
    let inputs = prompts.build(&messages).unwrap().model_inputs();
    assert_eq!(inputs.input_ids[..], row.tokens[..row.response_start], "the row's prompt");
    let (ids, probs) =
        drafter_svc::train::teacher_top_k(&target, &inputs, &row.tokens[row.response_start..], k).unwrap();
    TeacherTop::from_tensors(&ids, &probs)
}

/// The distilled loss: a teacher certain of the greedy token changes nothing; a spread one is
/// scored label by label against the distribution at that label's position (computed here from
/// the full logits by hand), over the whole vocabulary and a subset alike.
#[test]
fn the_distilled_loss_scores_each_label_against_the_teacher_at_its_position() {
    let Some(dir) = target_dir() else { return };
    let (head, _, mut row, anchors) = fixed_batch(&dir, "distill");
    let loss = |row: &Row, weights: LossWeights, scored: &Scored| {
        tch::no_grad(|| block_loss(&head, row, &anchors, weights, scored)).double_value(&[])
    };
    let subset: Vec<i64> = (0..head.vocab_size()).step_by(10).collect();
    let hard = [
        loss(&row, LossWeights::hard(7.0), &Scored::All),
        loss(&row, LossWeights::hard(7.0), &Scored::Subset(&subset)),
    ];
    let response = row.tokens[row.response_start..].to_vec();
    let certain = TeacherTop {
        k: 3,
        ids: response.iter().flat_map(|&t| [t, 0, 10]).collect(), // 0 and 10 are in the subset
        probs: response.iter().flat_map(|_| [1.0, 0.0, 0.0]).collect(),
    };
    row.teacher = Some(certain);
    let distilled = LossWeights { gamma: 7.0, distill: 0.7 };
    for (scored, hard) in [(Scored::All, hard[0]), (Scored::Subset(&subset), hard[1])] {
        let got = loss(&row, distilled, &scored);
        assert!((got - hard).abs() < 1e-5, "certain teacher: {got} vs {hard}");
    }

    row.teacher = Some(teacher_of(&dir, &row, 4));
    let teacher = row.teacher.as_ref().unwrap();
    let tokens: Vec<i64> = anchors.iter().map(|&a| row.tokens[a as usize]).collect();
    let log_probs = tch::no_grad(|| {
        head.logits(&head.forward_train_hidden(&row.states, &anchors, &tokens)).log_softmax(-1, Kind::Float)
    });
    let (mut total, mut weights) = (0.0, 0.0);
    for (b, &a) in anchors.iter().enumerate() {
        for k in 1..16i64 {
            let position = (a + k) as usize;
            if position >= row.tokens.len() {
                continue;
            }
            let at = |t: i64| log_probs.double_value(&[b as i64, k - 1, t]);
            let (ids, probs) = teacher.at(position - row.response_start);
            let soft: f64 = ids.iter().zip(probs).map(|(&t, &p)| -(p as f64) * at(t)).sum();
            let weight = (-((k - 1) as f64) / 7.0).exp();
            total += weight * (0.3 * -at(row.tokens[position]) + 0.7 * soft);
            weights += weight;
        }
    }
    let expected = total / weights;
    let got = loss(&row, distilled, &Scored::All);
    assert!((got - expected).abs() < 1e-4, "spread teacher: {got} vs {expected} by hand");
    assert!((got - hard[0]).abs() > 1e-3, "the soft term moved nothing");
}

#[test]
fn a_short_run_produces_a_head_that_loads_and_drafts() {
    let Some(dir) = target_dir() else { return };
    let out = scratch("run");
    let config = TrainConfig {
        target: dir.clone(),
        out: out.clone(),
        init: None,
        fresh: HeadSpec { tap_layers: Some(vec![0, 1, 2]), ..HeadSpec::new(1, 16, 0) },
        data: DataSource::ToyWorld { seed: 0 },
        rows: 10,
        held_out_rows: 2,
        max_new_tokens: 24,
        steps: 20,
        anchors: 8,
        peak_lr: 1e-3,
        warmup_ratio: 0.1,
        gamma: 7.0,
        distill: None,
        eval_every: 10,
        checkpoint_every: 10,
        resume: false,
        seed: 0,
        device: Device::Cpu,
        regen_batch: 4,
        loss_vocab: LossVocab::Full,
        save_kind: Kind::Float,
    };
    let acceptance = train(&config, |_| {}).unwrap();
    assert!(acceptance.anchors > 0 && acceptance.chain_tau >= 1.0);
    // The output is a DFlash-layout head the service loads unchanged.
    let tree = served_tree(&out, &dir, DraftVocabChoice::All, false, Opening::Cold, &Reach::unbounded());
    assert_eq!(tree.len(), 15);
    // A session warmed when it opens (drafter-svc does so when the head sat idle) drafts the same.
    assert_eq!(
        served_tree(&out, &dir, DraftVocabChoice::All, false, Opening::Warmed, &Reach::unbounded()),
        tree
    );
    // Its context in two messages, the first taken in ahead (drafter-svc does so for a
    // context-only message): the same tree.
    assert_eq!(
        served_tree(&out, &dir, DraftVocabChoice::All, false, Opening::ContextInTwo, &Reach::unbounded()),
        tree
    );
    // Asked for its spine (as auto asks), the same tree with the top token of every offset down
    // to the block's last appended below it.
    let spined = served_tree(&out, &dir, DraftVocabChoice::All, true, Opening::Cold, &Reach::unbounded());
    let mut head_of_it = spined.clone();
    head_of_it.truncate(15);
    assert_eq!(head_of_it, tree);
    assert_eq!(spined.depths.iter().max(), Some(&15), "{spined:?}");
    let limits = glance_spec::tree::TreeLimits { vocab: 1 << 20, max_nodes: 30, max_depth: 15 };
    assert_eq!(spined.validate(limits), Ok(()));
    // Told that its likeliest first token ends the generation and that a round can commit three
    // tokens deep at most, the head spends the whole budget on nodes within that reach, its spine
    // included (the spine above ran 15 deep).
    let reach = Reach { max_depth: 3, ends: vec![tree.tokens[0]] };
    let reached = served_tree(&out, &dir, DraftVocabChoice::All, true, Opening::Cold, &reach);
    assert!(reached.len() >= 15, "{reached:?}");
    assert!(reached.depths.iter().all(|&d| d <= 3), "{reached:?}");
    assert_eq!(reached.clone().within(&reach), reached, "nothing below an end token");

    // Beside it, the training responses' tokens ranked by frequency; served with --draft-vocab 6
    // the head drafts only the six most frequent, and by default (auto) only the file's tokens.
    let ranked = drafter_svc::draft_vocab::DraftVocab::read(&out).unwrap();
    assert!(ranked.ranked.len() > 6 && ranked.counts.windows(2).all(|w| w[0] >= w[1]));
    for (choice, allowed) in
        [(DraftVocabChoice::Top(6), ranked.top(6)), (DraftVocabChoice::Auto, &ranked.ranked[..])]
    {
        let tree = served_tree(&out, &dir, choice, false, Opening::Cold, &Reach::unbounded());
        assert_eq!(tree.len(), 15);
        let allowed: Vec<u32> = allowed.iter().map(|&t| t as u32).collect();
        assert!(
            tree.tokens.iter().all(|t| allowed.contains(t)),
            "{choice}: {:?} outside {allowed:?}",
            tree.tokens
        );
    }
}

/// How a served session starts before its round.
#[derive(Clone, Copy)]
enum Opening {
    Cold,
    /// Warmed as drafter-svc warms a session opening on an idle head.
    Warmed,
    /// Its first three context rows in a message of their own, taken in ahead of the round.
    ContextInTwo,
}

/// A budget-15 tree from `head` as drafter-svc's engine serves it (`draft_vocab` as its flag),
/// with its spine to the block's last offset if `spine`, from a session opened as `opening` says,
/// within `reach`.
fn served_tree(
    head: &std::path::Path,
    target: &std::path::Path,
    draft_vocab: DraftVocabChoice,
    spine: bool,
    opening: Opening,
    reach: &Reach,
) -> glance_spec::tree::Tree {
    use drafter_svc::engines::BlockHeadEngine;
    use glance_spec::session::{DraftEngine, RoundInput};
    let engine = BlockHeadEngine::load(head, target, Kind::Float, Device::Cpu, 4096, draft_vocab).unwrap();
    let mut session = engine.new_session();
    let states = |rows: i64| tch::Tensor::zeros([rows, 3 * 64], (Kind::Float, Device::Cpu));
    match opening {
        Opening::Cold => session.append_context(0, &[1, 2, 3, 4, 5], Some(states(5))).unwrap(),
        Opening::Warmed => {
            session.warm();
            session.append_context(0, &[1, 2, 3, 4, 5], Some(states(5))).unwrap();
        }
        Opening::ContextInTwo => {
            session.append_context(0, &[1, 2, 3], Some(states(3))).unwrap();
            session.ingest().unwrap();
            session.append_context(3, &[4, 5], Some(states(2))).unwrap();
        }
    }
    session
        .draft(&RoundInput {
            root_token: 7,
            root_position: 5,
            budget: 15,
            branch_k: 4,
            spine,
            reach: reach.clone(),
        })
        .unwrap()
}

/// A draft vocabulary changes only which tokens are scored: the marginals are the full pass's
/// logits renormalized over the subset, in the target's token ids.
#[test]
fn a_draft_vocabulary_renormalizes_the_full_marginals_over_its_tokens() {
    let Some(dir) = target_dir() else { return };
    let head_dir = scratch("vocab-head");
    let spec = HeadSpec { tap_layers: Some(vec![0, 1, 2]), ..HeadSpec::new(1, 16, 5) };
    drafter_svc::init::write_random_head(&dir, &head_dir, &spec).unwrap();
    let mut head = DraftHead::load(&head_dir, &dir, Kind::Float, Device::Cpu).unwrap();
    std::fs::remove_dir_all(&head_dir).ok();
    let context = tch::Tensor::randn([6, 3 * 64], (Kind::Float, Device::Cpu));
    let full = head.draft(&mut head.new_cache(64), &context, 9, 6).unwrap(); // (15, vocab)
    let subset: Vec<i64> = (0..head.vocab_size()).filter(|t| t % 7 == 3).rev().collect();
    head.restrict_vocab(&subset).unwrap();
    let restricted = head.draft_marginals(&mut head.new_cache(64), &context, 9, 6, 4).unwrap();
    let mut mask = vec![f32::NEG_INFINITY; head.vocab_size() as usize];
    for &t in &subset {
        mask[t as usize] = 0.0;
    }
    let masked = &full + tch::Tensor::from_slice(&mask);
    let expected = glance_spec::tree::Marginals::top_k(&masked, 4).unwrap();
    assert_eq!(restricted.ids, expected.ids);
    for (got, want) in restricted.log_probs.iter().flatten().zip(expected.log_probs.iter().flatten()) {
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }
    assert!(head.restrict_vocab(&[1, 1]).is_err() && head.restrict_vocab(&[head.vocab_size()]).is_err());
}

/// Training on ShareGPT-shaped data for a text-only target: the regenerated responses and their
/// tap states are cached beside the head, so a resumed run recomputes neither.
#[test]
fn sharegpt_rows_are_regenerated_once_and_cached() {
    let Some(vlm) = target_dir() else { return };
    let target = vlm.with_file_name("tiny-llama");
    let out = scratch("sharegpt");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let data = out.join("sharegpt.json");
    let record = |i: usize| {
        let question = format!("Question {i}: describe the red square and the blue circle, please.");
        serde_json::json!({"id": format!("c{i}_0"), "conversations": [
            {"from": "human", "value": question}, {"from": "gpt", "value": "An answer."}
        ]})
    };
    let records: Vec<serde_json::Value> = (0..60).map(record).collect();
    let text = serde_json::to_string(&records).unwrap();
    std::fs::write(&data, &text[..text.len() - 20]).unwrap(); // cut off mid-record, as in the wheel
    let mut config = TrainConfig {
        target: target.clone(),
        out: out.join("head"),
        init: None,
        fresh: HeadSpec { tap_layers: Some(vec![0, 1, 2]), ..HeadSpec::new(1, 16, 0) },
        data: DataSource::parse(&format!("sharegpt:{}", data.display()), 0),
        rows: 4,
        held_out_rows: 2,
        max_new_tokens: 12,
        steps: 4,
        anchors: 4,
        peak_lr: 1e-3,
        warmup_ratio: 0.1,
        gamma: 7.0,
        distill: None,
        eval_every: 0,
        checkpoint_every: 4,
        resume: false,
        seed: 0,
        device: Device::Cpu,
        regen_batch: 4,
        loss_vocab: LossVocab::Sampled { frequent: 16, negatives: 8 },
        save_kind: Kind::Float,
    };
    let first = train(&config, |_| {}).unwrap();
    let cache = config.out.join("regenerated.jsonl");
    let cached = std::fs::read_to_string(&cache).expect("the regenerated rows are cached");
    assert_eq!(cached.lines().count(), 6, "4 training + 2 held-out rows");
    config.resume = true;
    config.steps = 8;
    let second = train(&config, |_| {}).unwrap();
    assert_eq!(std::fs::read_to_string(&cache).unwrap(), cached, "a resumed run regenerated rows");
    for split in ["train", "held_out"] {
        let states = config.out.join(format!("tap_states.{split}.safetensors"));
        assert!(states.is_file(), "the {split} tap states are cached");
    }
    let states = config.out.join("tap_states.train.safetensors");
    let modified = std::fs::metadata(&states).unwrap().modified().unwrap();
    config.steps = 10;
    train(&config, |_| {}).unwrap();
    assert_eq!(std::fs::metadata(&states).unwrap().modified().unwrap(), modified, "states were recomputed");
    assert_eq!(first.anchors, second.anchors, "the same held-out rows");

    // Saved in bf16: half the bytes, the config says so, and a resumed run continues from the f32
    // weights the training state keeps (to the bit the f32 run's, not their bf16 rounding).
    let f32_head = config.out.clone();
    config.out = out.join("head-bf16");
    (config.save_kind, config.resume, config.steps) = (Kind::BFloat16, false, 4);
    train(&config, |_| {}).unwrap();
    let saved = Tensor::read_safetensors(config.out.join("model.safetensors")).unwrap();
    assert!(saved.iter().all(|(_, t)| !t.is_floating_point() || t.kind() == Kind::BFloat16));
    let declared: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(config.out.join("config.json")).unwrap()).unwrap();
    assert_eq!(declared["dtype"], "bfloat16");
    // The f32 run's resumes (8 steps, then 10), the same batches.
    for steps in [8, 10] {
        (config.resume, config.steps) = (true, steps);
        train(&config, |_| {}).unwrap();
    }
    let masters: HashMap<String, Tensor> =
        Tensor::read_safetensors(config.out.join("train_state.safetensors")).unwrap().into_iter().collect();
    let mut compared = 0;
    for (name, weight) in Tensor::read_safetensors(f32_head.join("model.safetensors")).unwrap() {
        if let Some(master) = masters.get(&format!("master.{name}")) {
            let gap = (master - &weight).abs().max().double_value(&[]);
            assert!(gap < 1e-6, "{name}: the resumed bf16 run is {gap} off the f32 run's weights");
            compared += 1;
        }
    }
    assert!(compared > 0, "no f32 weights kept in the training state");

    // Distilled: the target's top-4 at every training response token is cached beside the rows
    // (none for the held-out rows, which only acceptance scores), and a resumed run reuses it.
    config.out = out.join("head-distilled");
    (config.save_kind, config.resume, config.steps) = (Kind::Float, false, 4);
    config.distill = Some(Distill { top_k: 4, weight: 0.5 });
    train(&config, |_| {}).unwrap();
    let teachers = config.out.join("teacher_top4.train.safetensors");
    let kept = Tensor::read_safetensors(&teachers).expect("the teacher distributions are cached");
    assert_eq!(kept.len(), 2 * 4, "ids and probabilities of the 4 training rows");
    assert!(kept.iter().all(|(_, t)| t.size()[1] == 4), "{kept:?}");
    let modified = std::fs::metadata(&teachers).unwrap().modified().unwrap();
    (config.resume, config.steps) = (true, 8);
    train(&config, |_| {}).unwrap();
    assert_eq!(std::fs::metadata(&teachers).unwrap().modified().unwrap(), modified, "recomputed");
    std::fs::remove_dir_all(out).ok();
}
