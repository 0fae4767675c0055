//! The whole speculative pipeline in one thread on the CPU, counted at the host/device boundary:
//! the verifier's rounds, the wire codec both ways and the drafter's session with the committed
//! toy head. Every crossing of the round code goes through `glance_device` (pinned non-blocking
//! uploads, staged non-blocking downloads, counted read-backs), so what a round would cost in host
//! syncs on a GPU is asserted here without one: the verifier reads back once per target pass (every
//! row's argmax and entropy in one copy, which also waits for the pass's tap states staged to the
//! host just before; a sent round then encodes host memory), the drafter once per tree (its
//! top-k). Every output is also checked against plain greedy decoding. The device check runs the
//! same test on the GPU, where a tensor on the wrong side fails or shows up in the counts.

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use drafter_svc::draft_vocab::DraftVocabChoice;
use drafter_svc::engines::BlockHeadEngine;
use glance_device::{crossings, Crossings};
use glance_input::{PromptBuilder, PromptOptions};
use glance_models::decode::{greedy_generate, GreedyParams, StepControl};
use glance_models::sampling::Sampling;
use glance_models::TargetModel;
use glance_spec::session::{DraftEngine, RoundInput, Session};
use glance_toyworld::{sample, Split, Task};
use tch::Kind;
use verifier_svc::speculative::{
    speculative_generate, DraftFailure, DraftProvider, DraftRound, DraftSession, Drafted, SpecParams,
};

/// The committed models: where this build's sources were, else `models/` of the working directory
/// (the device check's carried binaries run in another checkout).
fn models() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("models")
    }
}

/// What the drafter's half crossed, counted apart from the verifier's (same thread).
#[derive(Default)]
struct DrafterCounts {
    crossings: Crossings,
    drafts: u64,
}

/// The drafter's half of the pipeline, in this thread: the round's states go through the wire
/// codec as they do between the services.
struct WireProvider {
    engine: Arc<BlockHeadEngine>,
    taps: Vec<usize>,
    max_depth: usize,
    counts: Rc<RefCell<DrafterCounts>>,
}

struct WireSession {
    session: Box<dyn Session>,
    counts: Rc<RefCell<DrafterCounts>>,
    context_len: usize,
    ready: Option<Drafted>,
}

impl DraftProvider for WireProvider {
    fn open(&mut self) -> Option<Box<dyn DraftSession>> {
        let (session, counts) = (self.engine.new_session(), Rc::clone(&self.counts));
        Some(Box::new(WireSession { session, counts, context_len: 0, ready: None }))
    }

    fn tap_layers(&self) -> &[usize] {
        &self.taps
    }

    fn max_depth(&self) -> usize {
        self.max_depth
    }
}

impl DraftSession for WireSession {
    fn context_len(&self) -> usize {
        self.context_len
    }

    fn send(&mut self, round: DraftRound) -> Result<(), DraftFailure> {
        let started = Instant::now();
        // The verifier's side of the hop: the new rows' states serialized.
        let wire = round.states.map(|s| glance_codec::encode(s, Kind::Float));
        let before = crossings();
        // The drafter's side: decoded, uploaded (as drafter-svc does), appended, drafted.
        let device = glance_tests::test_device();
        let states = wire.map(|w| glance_models::upload_tensor(&glance_codec::decode(&w).unwrap(), device));
        let tokens: Vec<u32> = round.tokens.iter().map(|&t| t as u32).collect();
        self.session.append_context(round.first_position, &tokens, states).unwrap();
        let input = RoundInput {
            root_token: round.root_token as u32,
            root_position: round.root_position,
            budget: round.budget,
            branch_k: round.branch_k,
            spine: round.spine,
            reach: round.reach.clone(),
        };
        let tree = self.session.draft(&input).unwrap();
        let mut counts = self.counts.borrow_mut();
        counts.crossings = counts.crossings + (crossings() - before);
        counts.drafts += 1;
        self.context_len = round.root_position;
        let elapsed = started.elapsed();
        self.ready = Some(Drafted { tree, draft_time: elapsed, round_trip: elapsed });
        Ok(())
    }

    fn receive(&mut self, _wait: Duration) -> Result<Option<Drafted>, DraftFailure> {
        Ok(self.ready.take())
    }

    fn bytes_sent(&self) -> u64 {
        0
    }
}

#[test]
fn a_round_crosses_the_host_device_boundary_as_counted() {
    let _no_grad = tch::no_grad_guard();
    let (target, head) = (models().join("toy-target"), models().join("toy-head"));
    // On the CPU by default; the device check runs it on the GPU (`GLANCE_TEST_DEVICE`), where a
    // tensor on the wrong device fails the pass instead of passing unnoticed.
    let device = glance_tests::test_device();
    let model = TargetModel::load(&target, Kind::Float, device).expect("toy target");
    let engine = BlockHeadEngine::load(&head, &target, Kind::Float, device, 4096, DraftVocabChoice::All)
        .expect("toy head");
    let handshake = engine.handshake();
    let counts = Rc::new(RefCell::new(DrafterCounts::default()));
    let mut provider = WireProvider {
        taps: handshake.tap_layers.clone(),
        max_depth: handshake.block_size - 1,
        engine: Arc::new(engine),
        counts: Rc::clone(&counts),
    };
    let prompts = PromptBuilder::from_model_dir(&target, PromptOptions::default()).expect("prompts");
    let params = GreedyParams { max_new_tokens: 48, eos_token_ids: &[], context_limit: 4096, logprobs: None };
    let spec = SpecParams { budget: 15, branch_k: 4, log_rounds: false, sampling: Sampling::GREEDY };
    for task in [Task::Chart, Task::Doc] {
        let inputs = prompts.build(&sample(Split::HeldOut, task, 0, 3).messages()).unwrap().model_inputs();
        let greedy = greedy_generate(&model, &inputs, &params, |_| StepControl::Continue).unwrap();
        *counts.borrow_mut() = DrafterCounts::default();
        let before = crossings();
        let (generation, stats) =
            speculative_generate(&model, &inputs, &params, spec, &mut provider, None, |_| {
                StepControl::Continue
            })
            .expect("speculative");
        let all = crossings() - before;
        let drafter = std::mem::take(&mut *counts.borrow_mut());
        let verifier = all - drafter.crossings;
        assert_eq!(generation.tokens, greedy.tokens, "{task:?}: differs from greedy");
        let passes = (stats.rounds + stats.fallback_rounds) as u64; // verify passes + greedy steps
        assert!(stats.rounds > 3 && stats.fallback_rounds == 0, "{task:?}: {stats:?}");
        println!(
            "{task:?}: {} rounds (tau {:.2}); verifier {verifier:?}, drafter {:?} over {} drafts",
            stats.rounds,
            stats.tau(),
            drafter.crossings,
            drafter.drafts
        );
        // The verifier: one host sync for the prefill's root, one per target pass; sending a
        // round reads nothing back (its tap states are on the host already).
        assert!(drafter.drafts <= passes, "{task:?}");
        assert_eq!(verifier.read_backs, 1 + passes, "{task:?}: verifier read-backs");
        // The tap states ride on those syncs: staged once by the prefill (all taps in one
        // tensor) and once per tapped layer by every pass.
        let taps = provider.taps.len() as u64;
        assert_eq!(verifier.staged, 1 + taps * passes, "{task:?}: verifier staged copies");
        // Uploads never block; at most two per pass (the pass's inputs, the rows kept of the KV
        // cache).
        assert!(verifier.uploads <= 2 * passes + 2, "{task:?}: verifier uploads {}", verifier.uploads);
        // The drafter: one read-back per tree (its top-k values and ids in one copy).
        assert_eq!(drafter.crossings.read_backs, drafter.drafts, "{task:?}: drafter read-backs");
    }
}
