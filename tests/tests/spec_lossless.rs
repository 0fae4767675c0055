//! Losslessness through both services as processes on loopback: for a suite of 26 prompts per
//! family (two VLMs, half with images, and the two text-only families; 64 new tokens, some
//! stopping at EOS), every speculative mode returns
//! exactly the greedy tokens — with a randomly initialized block head (misses), with an oracle
//! drafter whose top branch is the true continuation (deep commits, compaction, EOS inside
//! accepted runs), with a garbage drafter that also sends malformed trees, with a random EAGLE-3
//! head (a reduced draft vocabulary), with a block head scoring only a draft vocabulary
//! (`--draft-vocab`), and with prompt lookup; the auto round policy runs over each
//! block-head, EAGLE-3, oracle and garbage drafter too.

use std::path::PathBuf;

use drafter_svc::draft_vocab::DraftVocab;
use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_tests::fixtures;
use glance_tests::process::ServiceProcess;
use glance_tests::suite::{self, SuitePrompt};

const PROMPTS_PER_FAMILY: usize = 26;

/// Prompts per family: 26, or `$GLANCE_LOSSLESS_PROMPTS` (the device check runs a shorter suite
/// to fit its time on the GPU machine).
fn prompts_per_family() -> usize {
    match std::env::var("GLANCE_LOSSLESS_PROMPTS") {
        Ok(n) => n.parse().unwrap_or_else(|_| panic!("GLANCE_LOSSLESS_PROMPTS={n:?}: a count")),
        Err(_) => PROMPTS_PER_FAMILY,
    }
}
const NEW_TOKENS: u32 = 64;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("glance-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Sends every prompt in `mode`; asserts greedy-identical tokens; returns the summed stats.
async fn run_suite(
    url: &str,
    suite: &[SuitePrompt],
    mode: pb::DecodingMode,
    what: &str,
) -> pb::SpeculativeStats {
    let mut client = GenerationClient::connect(url.to_string()).await.expect("connect");
    let mut total = pb::SpeculativeStats::default();
    for (i, prompt) in suite.iter().enumerate() {
        let response = client.generate(suite::request(prompt, mode, 0)).await.expect(what).into_inner();
        let tokens: Vec<i64> = response.token_ids.iter().map(|&t| t as i64).collect();
        assert_eq!(tokens, prompt.greedy, "{what}: prompt {i} differs from greedy decoding");
        let stats = response.speculative.expect("speculative stats");
        // A refused tree leaves its round to a plain greedy step, in every mode.
        assert!(stats.fallback_rounds >= stats.rejected_trees, "{what}: prompt {i}: {stats:?}");
        total.rounds += stats.rounds;
        total.fallback_rounds += stats.fallback_rounds;
        total.rejected_trees += stats.rejected_trees;
        total.mean_accepted_length += stats.mean_accepted_length * stats.rounds as f64;
        if let Some(auto) = stats.auto {
            let sum = total.auto.get_or_insert_with(Default::default);
            sum.overlapped_steps += auto.overlapped_steps;
            sum.stale_trees += auto.stale_trees;
            sum.lookup_rounds += auto.lookup_rounds;
            sum.lookup_accepted_tokens += auto.lookup_accepted_tokens;
        }
    }
    if total.rounds > 0 {
        total.mean_accepted_length /= total.rounds as f64;
    }
    println!(
        "{what}: {} prompts identical; {} rounds, tau {:.2}, {} fallback rounds, {} rejected trees",
        suite.len(),
        total.rounds,
        total.mean_accepted_length,
        total.fallback_rounds,
        total.rejected_trees
    );
    total
}

// One test per family, so that the harness runs two at a time on two cores (each family's
// services are tiny models: one core each, dispatch-bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_speculative_mode_equals_greedy_qwen3_vl() {
    every_speculative_mode_equals_greedy_through_both_services("tiny-qwen3-vl").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_speculative_mode_equals_greedy_qwen2_5_vl() {
    every_speculative_mode_equals_greedy_through_both_services("tiny-qwen2.5-vl").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_speculative_mode_equals_greedy_llama() {
    every_speculative_mode_equals_greedy_through_both_services("tiny-llama").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_speculative_mode_equals_greedy_qwen3() {
    every_speculative_mode_equals_greedy_through_both_services("tiny-qwen3").await;
}

async fn every_speculative_mode_equals_greedy_through_both_services(family: &str) {
    let Some(root) = fixtures() else { return };
    let scratch = scratch("lossless");
    let dir = root.join(family);
    let prompts = suite::build(&dir, prompts_per_family(), NEW_TOKENS);

    // Prompt lookup runs inside the verifier.
    let verifier = ServiceProcess::verifier(&dir, &[]);
    run_suite(&verifier.url, &prompts, pb::DecodingMode::PromptLookup, &format!("{family} prompt lookup"))
        .await;
    drop(verifier);

    let head = glance_tests::random_head(&dir, &format!("lossless-{family}"), 2, 7);
    let drafter = ServiceProcess::block_head_drafter(&head, &dir, &[]);
    let verifier = ServiceProcess::verifier(&dir, &["--drafter", &drafter.url]);
    let tree = run_suite(
        &verifier.url,
        &prompts,
        pb::DecodingMode::SpeculativeTree,
        &format!("{family} random head, tree"),
    )
    .await;
    assert!(tree.rounds > 0 && tree.fallback_rounds == 0, "the head drafted no rounds");
    run_suite(
        &verifier.url,
        &prompts,
        pb::DecodingMode::SpeculativeChain,
        &format!("{family} random head, chain"),
    )
    .await;
    let what = format!("{family} random head, auto");
    let auto =
        run_suite(&verifier.url, &prompts, pb::DecodingMode::Auto, &what).await.auto.unwrap_or_default();
    println!(
        "{what}: {} prompt-lookup rounds, {} tokens accepted",
        auto.lookup_rounds, auto.lookup_accepted_tokens
    );
    // Auto verifies prompt-lookup chains in place of the steps it takes without the (random,
    // never accepted) head: random-weight targets repeat themselves, so some must have matched.
    assert!(auto.lookup_rounds > 0, "{what}: no prompt-lookup chain was verified");
    drop((verifier, drafter));

    if family == "tiny-qwen3-vl" {
        // The same head scoring only a draft vocabulary (--draft-vocab, here by its env): the 48
        // most frequent tokens of the greedy outputs, so its trees hold tokens the target
        // takes and others it never would.
        let ranked = DraftVocab::from_responses(prompts.iter().map(|p| p.greedy.as_slice()));
        ranked.write(&head).expect("draft vocabulary");
        let drafter =
            ServiceProcess::block_head_drafter(&head, &dir, &[("GLANCE_DRAFTER_DRAFT_VOCAB", "48")]);
        let verifier = ServiceProcess::verifier(&dir, &["--drafter", &drafter.url]);
        let what = format!("{family} random head, draft vocabulary of 48, tree");
        let tree = run_suite(&verifier.url, &prompts, pb::DecodingMode::SpeculativeTree, &what).await;
        assert!(tree.rounds > 0 && tree.fallback_rounds == 0, "{what}: the head drafted no rounds");
    }

    // The EAGLE-3 peer: a random head over every third token of the vocabulary (a reduced
    // draft vocabulary, mapped back by d2t), drafting 4 deep.
    let draft_vocab = (0..1024).step_by(3).collect();
    let eagle = glance_tests::random_eagle3_head(&dir, &format!("lossless-{family}"), Some(draft_vocab), 9);
    let (eagle, target) = (eagle.to_str().unwrap(), dir.to_str().unwrap());
    let drafter = ServiceProcess::drafter(&[
        "--kind",
        "eagle3",
        "--head",
        eagle,
        "--target",
        target,
        "--eagle-depth",
        "3",
    ]);
    let verifier = ServiceProcess::verifier(&dir, &["--drafter", &drafter.url]);
    for mode in
        [pb::DecodingMode::SpeculativeTree, pb::DecodingMode::SpeculativeChain, pb::DecodingMode::Auto]
    {
        let what = format!("{family} random EAGLE-3 head, {mode:?}");
        let stats = run_suite(&verifier.url, &prompts, mode, &what).await;
        if mode != pb::DecodingMode::Auto {
            assert!(stats.rounds > 0 && stats.fallback_rounds == 0, "{what}: drafted no rounds: {stats:?}");
        }
    }
    drop((verifier, drafter));

    let oracle_file = scratch.join(format!("{family}-oracle.json"));
    std::fs::write(&oracle_file, suite::oracle_json(&prompts)).unwrap();
    let oracle_drafter = |extra: &[&str]| {
        let file = oracle_file.to_str().unwrap();
        let args = ["--kind", "test-oracle", "--oracle-file", file, "--vocab-size", "1024"];
        ServiceProcess::drafter(&[&args[..], extra].concat())
    };
    let drafter = oracle_drafter(&[]);
    let verifier = ServiceProcess::verifier(&dir, &["--drafter", &drafter.url]);
    let oracle =
        run_suite(&verifier.url, &prompts, pb::DecodingMode::SpeculativeTree, &format!("{family} oracle"))
            .await;
    assert!(
        oracle.mean_accepted_length > 8.0,
        "the oracle's true branch was not accepted: tau {}",
        oracle.mean_accepted_length
    );
    stop_strings_inside_accepted_runs(&verifier.url, &prompts, family).await;
    accepted_runs_past_the_token_limit(&verifier.url, &prompts, family).await;
    let auto =
        run_suite(&verifier.url, &prompts, pb::DecodingMode::Auto, &format!("{family} oracle, auto")).await;
    assert!(auto.rounds > 0, "auto never drafted with an oracle drafter");
    drop((verifier, drafter));

    // A drafter slower than a greedy step: auto steps while each tree is drafted, then
    // verifies the subtree below the tokens those steps committed.
    let drafter = oracle_drafter(&["--stall-every", "1", "--stall-ms", "4"]);
    let verifier = ServiceProcess::verifier(&dir, &["--drafter", &drafter.url]);
    let what = format!("{family} slow oracle, auto");
    let slow = run_suite(&verifier.url, &prompts, pb::DecodingMode::Auto, &what).await;
    let overlap = slow.auto.unwrap_or_default();
    assert!(overlap.overlapped_steps > 0, "{what}: no greedy step while drafting: {overlap:?}");
    // Whether a tree is still ahead of the steps when it arrives depends on how fast a step
    // is against the stall: on a fast machine the steps pass its whole depth (a stale tree).
    // Auto's prompt-lookup rounds are among the rounds; the oracle's own are the rest.
    let oracle_rounds = slow.rounds - overlap.lookup_rounds;
    assert!(oracle_rounds + overlap.stale_trees > 0, "{what}: no tree arrived: {overlap:?}");
    if oracle_rounds > 0 {
        let lookup_committed = overlap.lookup_rounds + overlap.lookup_accepted_tokens;
        let oracle_tau =
            (slow.mean_accepted_length * slow.rounds as f64 - lookup_committed as f64) / oracle_rounds as f64;
        // The oracle's first child below the steps' path is always right, so each of its rounds
        // commits that node and the bonus at least (exactly that where the steps left the
        // tree one level, on a fast machine); fewer means another subtree was verified.
        assert!(oracle_tau >= 2.0 - 1e-9, "{what}: the oracle's subtrees committed {oracle_tau} a round");
    }
    drop((verifier, drafter));

    let drafter = ServiceProcess::drafter(&[
        "--kind",
        "test-garbage",
        "--vocab-size",
        "1024",
        "--malformed-rate",
        "0.3",
    ]);
    let verifier = ServiceProcess::verifier(&dir, &["--drafter", &drafter.url]);
    let garbage =
        run_suite(&verifier.url, &prompts, pb::DecodingMode::SpeculativeTree, &format!("{family} garbage"))
            .await;
    assert!(garbage.rejected_trees > 0, "no malformed tree was refused");
    run_suite(&verifier.url, &prompts, pb::DecodingMode::Auto, &format!("{family} garbage, auto")).await;
}

/// An oracle's run past `max_new_tokens` is never verified beyond the limit, and the output is the
/// greedy output's prefix, in every drafting mode.
async fn accepted_runs_past_the_token_limit(url: &str, prompts: &[SuitePrompt], family: &str) {
    let mut client = GenerationClient::connect(url.to_string()).await.expect("connect");
    for mode in [pb::DecodingMode::SpeculativeTree, pb::DecodingMode::Auto] {
        for prompt in prompts.iter().filter(|p| p.greedy.len() > 8).take(4) {
            let mut request = suite::request(prompt, mode, 0);
            request.max_new_tokens = 5;
            let response = client.generate(request).await.expect("a short request").into_inner();
            let tokens: Vec<i64> = response.token_ids.iter().map(|&t| t as i64).collect();
            assert_eq!(tokens, prompt.greedy[..5], "{family} {mode:?}: a run past the limit");
            // The first token comes from the prefill, so a round can commit at most 4 (3 accepted
            // and the bonus): nothing deeper than 3 is worth a row of the verify pass.
            let stats = response.speculative.expect("speculative stats");
            let deepest =
                stats.accepted_per_depth.iter().rposition(|&rounds| rounds > 0).map_or(0, |d| d + 1);
            assert!(deepest <= 3, "{family} {mode:?}: accepted a node at depth {deepest} past the limit");
        }
    }
}

/// A stop string that falls inside a 16-token accepted run ends the output exactly where greedy
/// decoding with the same stop string ends it.
async fn stop_strings_inside_accepted_runs(url: &str, prompts: &[SuitePrompt], family: &str) {
    let mut client = GenerationClient::connect(url.to_string()).await.expect("connect");
    let mut checked = 0;
    for prompt in prompts.iter().filter(|p| p.ignore_eos) {
        let mut ar = suite::request(prompt, pb::DecodingMode::Autoregressive, 0);
        let full = client.generate(ar.clone()).await.unwrap().into_inner().text;
        let chars: Vec<char> = full.chars().collect();
        if chars.len() < 30 {
            continue;
        }
        let stop: String = chars[20..23].iter().collect();
        ar.stop = vec![stop.clone()];
        let mut spec = suite::request(prompt, pb::DecodingMode::SpeculativeTree, 0);
        spec.stop = vec![stop.clone()];
        let greedy = client.generate(ar).await.unwrap().into_inner();
        let speculative = client.generate(spec).await.unwrap().into_inner();
        assert_eq!(speculative.text, greedy.text, "{family}: stop {stop:?}");
        assert_eq!(speculative.token_ids, greedy.token_ids, "{family}: stop {stop:?}");
        assert_eq!(speculative.finish_reason, pb::FinishReason::Stop as i32);
        assert!(!greedy.text.contains(&stop));
        checked += 1;
    }
    // Five of the full suite's prompts; a shortened suite (the device check's) has fewer to offer.
    let wanted = if prompts.len() >= PROMPTS_PER_FAMILY { 5 } else { 1 };
    assert!(checked >= wanted, "{family}: only {checked} prompts were long enough for a stop-string check");
    println!("{family}: stop strings inside accepted runs honoured on {checked} prompts");
}
