//! No request is lost to the drafter: a drafter killed mid-generation, one that stalls past the
//! per-round deadline, and one restarted while requests run — every request still completes with
//! exactly the greedy tokens, the stats show the fallback rounds, and drafting resumes once the
//! drafter is back.

use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_tests::fixtures;
use glance_tests::process::ServiceProcess;
use glance_tests::suite::{self, SuitePrompt};

/// Streams one request in `mode`; calls `midway` once `after` tokens have arrived; returns the
/// tokens and the final stats.
async fn stream_with(
    url: &str,
    prompt: &SuitePrompt,
    mode: pb::DecodingMode,
    after: usize,
    midway: impl FnOnce(),
) -> (Vec<i64>, pb::SpeculativeStats) {
    let mut client = GenerationClient::connect(url.to_string()).await.expect("connect");
    let request = suite::request(prompt, mode, 0);
    let mut stream = client.generate_stream(request).await.expect("stream").into_inner();
    let (mut tokens, mut stats, mut midway) = (Vec::new(), None, Some(midway));
    while let Some(chunk) = stream.message().await.expect("the stream must end cleanly") {
        tokens.extend(chunk.token_ids.iter().map(|&t| t as i64));
        if tokens.len() >= after {
            if let Some(f) = midway.take() {
                f();
            }
        }
        if chunk.speculative.is_some() {
            stats = chunk.speculative;
        }
    }
    (tokens, stats.expect("final chunk carries the stats"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_then_restarted_drafter_loses_no_request() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let prompts = suite::build(&dir, 2, 2500);
    let head = glance_tests::random_head(&dir, "faults-kill", 1, 3);
    let drafter_args =
        ["--kind", "block-head", "--head", head.to_str().unwrap(), "--target", dir.to_str().unwrap()];
    let mut drafter = ServiceProcess::drafter(&drafter_args);
    let drafter_addr = drafter.addr().to_string();
    let verifier =
        ServiceProcess::verifier(&dir, &["--drafter", &drafter.url, "--max-new-tokens-limit", "3000"]);

    // Kill the drafter 100 tokens into a long generation.
    let long = prompts.iter().find(|p| p.ignore_eos).expect("a prompt that ignores EOS");
    let tree = pb::DecodingMode::SpeculativeTree;
    let (tokens, stats) = stream_with(&verifier.url, long, tree, 100, || drafter.kill()).await;
    assert_eq!(tokens, long.greedy, "tokens changed when the drafter died");
    assert!(stats.rounds > 0, "nothing was drafted before the kill");
    assert!(stats.fallback_rounds > 0, "no fallback rounds after the kill: {stats:?}");
    println!("killed: {} drafted rounds, {} fallback rounds", stats.rounds, stats.fallback_rounds);

    // Restart it where the verifier expects it while a generation runs.
    let mut restarted = None;
    let (tokens, stats) = stream_with(&verifier.url, long, tree, 100, || {
        restarted = Some(ServiceProcess::drafter_at(&drafter_addr, &drafter_args));
    })
    .await;
    assert_eq!(tokens, long.greedy, "tokens changed across the restart");
    println!(
        "restart mid-request: {} drafted rounds, {} fallback rounds",
        stats.rounds, stats.fallback_rounds
    );

    // Once it is back, requests speculate again with no fallback.
    let mut client = GenerationClient::connect(verifier.url.clone()).await.unwrap();
    let mut resumed = None;
    for _ in 0..50 {
        let response =
            client.generate(suite::request(&prompts[0], pb::DecodingMode::SpeculativeTree, 0)).await.unwrap();
        let response = response.into_inner();
        let got: Vec<i64> = response.token_ids.iter().map(|&t| t as i64).collect();
        assert_eq!(got, prompts[0].greedy);
        let stats = response.speculative.unwrap();
        if stats.fallback_rounds == 0 && stats.rounds > 0 {
            resumed = Some(stats);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(resumed.is_some(), "speculation did not resume after the drafter came back");

    // The auto policy under the same faults: killed mid-request, then back.
    let (tokens, _) =
        stream_with(&verifier.url, long, pb::DecodingMode::Auto, 100, || drop(restarted.take())).await;
    assert_eq!(tokens, long.greedy, "auto: tokens changed when the drafter died");
    let mut back = None;
    let (tokens, _) = stream_with(&verifier.url, long, pb::DecodingMode::Auto, 100, || {
        back = Some(ServiceProcess::drafter_at(&drafter_addr, &drafter_args));
    })
    .await;
    assert_eq!(tokens, long.greedy, "auto: tokens changed across the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalling_drafter_is_not_waited_for() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen2.5-vl");
    let prompts = suite::build(&dir, 4, 200);
    let head = glance_tests::random_head(&dir, "faults-stall", 1, 3);
    // Every 7th round of a session stalls 1.5 s; the verifier waits 150 ms per round.
    let drafter = ServiceProcess::drafter(&[
        "--kind",
        "block-head",
        "--head",
        head.to_str().unwrap(),
        "--target",
        dir.to_str().unwrap(),
        "--stall-every",
        "7",
        "--stall-ms",
        "1500",
    ]);
    let verifier =
        ServiceProcess::verifier(&dir, &["--drafter", &drafter.url, "--drafter-deadline-ms", "150"]);
    let mut fallback = 0;
    for prompt in &prompts {
        let (tokens, stats) =
            stream_with(&verifier.url, prompt, pb::DecodingMode::SpeculativeTree, usize::MAX, || {}).await;
        assert_eq!(tokens, prompt.greedy, "tokens changed under a stalling drafter");
        fallback += stats.fallback_rounds;
    }
    assert!(fallback > 0, "the stalls never hit the deadline");
    println!("stalling drafter: {fallback} fallback rounds, all outputs identical");
}
