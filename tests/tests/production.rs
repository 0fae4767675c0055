//! The production surface: traces across the hop, metrics that add up, overload, deadlines and
//! graceful drain — each against the real service processes on loopback.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_tests::process::ServiceProcess;
use glance_tests::suite::{self, SuitePrompt};
use glance_tests::{fixtures, free_port, metric, scrape};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use tonic::Code;

fn long_request(prompt: &SuitePrompt, tokens: u32) -> pb::GenerateRequest {
    let mut request = suite::request(prompt, pb::DecodingMode::Autoregressive, 0);
    request.max_new_tokens = tokens;
    request.decoding.as_mut().unwrap().ignore_eos = true;
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_decode_counters_add_up() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let prompts = suite::build(&dir, 4, 40);
    let head = glance_tests::random_head(&dir, "metrics", 1, 5);
    let drafter = ServiceProcess::block_head_drafter(&head, &dir, &[]);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let verifier = ServiceProcess::verifier(&dir, &["--drafter", &drafter.url, "--metrics-listen", &listen]);
    let mut client = GenerationClient::connect(verifier.url.clone()).await.unwrap();
    let mut generated = 0;
    for mode in [pb::DecodingMode::SpeculativeTree, pb::DecodingMode::Auto] {
        for prompt in &prompts {
            let response = client.generate(suite::request(prompt, mode, 0)).await.unwrap();
            generated += response.into_inner().usage.unwrap().generated_tokens as usize;
        }
    }
    let text = scrape(port);
    let requests = 2.0 * prompts.len() as f64;
    assert_eq!(metric(&text, "glance_requests_total{outcome=\"ok\"}"), requests, "{text}");
    assert_eq!(metric(&text, "glance_generated_tokens_total"), generated as f64);
    let accepted = metric(&text, "glance_spec_decode_num_accepted_tokens_total");
    let drafts = metric(&text, "glance_spec_decode_num_drafts_total");
    let fallback = metric(&text, "glance_spec_decode_fallback_rounds_total");
    let auto_steps = ["greedy_steps", "declined_trees", "overlapped_steps", "stale_trees"]
        .iter()
        .map(|name| metric(&text, &format!("glance_auto_{name}_total")))
        .sum::<f64>();
    // Each request's first token comes from the prefill; every round then commits its accepted
    // draft tokens plus one token of the target's (with an untrained head no round is cut short),
    // and every greedy step one token (auto's: not asking, a declined tree, a step while the
    // drafter works, a tree those steps left).
    assert_eq!(accepted + drafts + fallback + auto_steps + requests, generated as f64, "{text}");
    // Auto drafted: with this untrained head its trees mostly miss the token of the greedy step
    // taken while they were drafted (stale), the rest are verified.
    let auto_drafted =
        metric(&text, "glance_auto_stale_trees_total") + metric(&text, "glance_auto_verified_nodes_total");
    assert!(auto_drafted > 0.0, "auto never drafted: {text}");
    assert!(text.contains("glance_auto_verified_nodes_total"), "{text}");
    assert!(drafts > 0.0);
    assert_eq!(metric(&text, "glance_spec_decode_num_accepted_tokens_per_pos_total"), accepted);
    assert!(metric(&text, "glance_spec_decode_num_draft_tokens_total") >= drafts);
    assert!(metric(&text, "glance_time_to_first_token_seconds_count") >= requests);
    // Every round drafted by the drafter was timed; auto's prompt-lookup rounds (drafts too,
    // their tokens among the accepted) never went to it.
    let lookups = metric(&text, "glance_auto_lookup_rounds_total");
    let looked_up = metric(&text, "glance_auto_lookup_accepted_tokens_total")
        + metric(&text, "glance_auto_grafted_lookup_accepted_tokens_total");
    assert!(looked_up <= accepted, "{text}");
    assert!(metric(&text, "glance_drafter_round_latency_seconds_count") >= drafts - lookups);
    assert_eq!(metric(&text, "glance_drafter_connected"), 1.0);
    assert_eq!(metric(&text, "glance_requests_running"), 0.0);
    assert_eq!(metric(&text, "glance_queue_size"), 0.0);
    println!(
        "metrics: {generated} tokens = {accepted} accepted + {drafts} rounds + {fallback} fallback + {auto_steps} auto steps + {requests} prefill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_beyond_the_limit_is_refused_at_once_and_the_rest_complete() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let prompts = suite::build(&dir, 1, 1);
    // Limit N = 3: one running, two waiting.
    let verifier = ServiceProcess::verifier(&dir, &["--max-concurrent", "1", "--max-queue", "2"]);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (url, request) = (verifier.url.clone(), long_request(&prompts[0], 1200));
        tasks.push(tokio::spawn(async move {
            let mut client = GenerationClient::connect(url).await.unwrap();
            let started = Instant::now();
            let result = client.generate(request).await;
            (result.map(|r| r.into_inner().usage.unwrap().generated_tokens), started.elapsed())
        }));
    }
    let mut completed = Vec::new();
    let mut refused = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            (Ok(tokens), took) => completed.push((tokens, took)),
            (Err(status), took) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                refused.push(took);
            }
        }
    }
    assert_eq!(refused.len(), 1, "exactly the one request beyond the limit is refused");
    assert_eq!(completed.len(), 3);
    assert!(completed.iter().all(|(tokens, _)| *tokens == 1200));
    let fastest_completion = completed.iter().map(|(_, t)| *t).min().unwrap();
    assert!(refused[0] < fastest_completion / 4, "refused after {:?}, not at once", refused[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_deadline_is_deadline_exceeded_and_frees_the_engine() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let prompts = suite::build(&dir, 1, 1);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let verifier =
        ServiceProcess::verifier(&dir, &["--metrics-listen", &listen, "--max-new-tokens-limit", "4000"]);
    let mut client = GenerationClient::connect(verifier.url.clone()).await.unwrap();
    for streaming in [false, true] {
        let mut request = tonic::Request::new(long_request(&prompts[0], 4000));
        request.set_timeout(Duration::from_millis(300));
        let status = if streaming {
            match client.generate_stream(request).await {
                Err(status) => status,
                Ok(response) => {
                    let mut stream = response.into_inner();
                    loop {
                        match stream.message().await {
                            Ok(Some(_)) => continue,
                            Ok(None) => panic!("a 4000-token stream finished inside 300 ms"),
                            Err(status) => break status,
                        }
                    }
                }
            }
        } else {
            client.generate(request).await.expect_err("4000 tokens inside 300 ms")
        };
        assert_eq!(status.code(), Code::DeadlineExceeded, "streaming {streaming}: {status:?}");
    }
    // The engine let go of both sessions.
    let mut idle = false;
    for _ in 0..50 {
        let text = scrape(port);
        if metric(&text, "glance_requests_running") == 0.0 && metric(&text, "glance_queue_size") == 0.0 {
            assert_eq!(metric(&text, "glance_requests_total{outcome=\"deadline_exceeded\"}"), 2.0, "{text}");
            idle = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(idle, "the engine kept working on expired requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_running_requests_then_exits_zero() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let prompts = suite::build(&dir, 1, 1);
    let mut verifier = ServiceProcess::verifier(&dir, &["--max-new-tokens-limit", "3000"]);
    let mut client = GenerationClient::connect(verifier.url.clone()).await.unwrap();
    let mut stream = client.generate_stream(long_request(&prompts[0], 3000)).await.unwrap().into_inner();
    let mut tokens = stream.message().await.unwrap().unwrap().token_ids.len();
    verifier.signal("TERM");
    // New work is refused while the running stream completes in full.
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Ok(mut late) = GenerationClient::connect(verifier.url.clone()).await {
        let status = late.generate(long_request(&prompts[0], 5)).await.expect_err("accepted while draining");
        assert!(matches!(status.code(), Code::Unavailable | Code::Cancelled), "{status:?}");
    }
    while let Some(chunk) = stream.message().await.expect("the running stream must finish cleanly") {
        tokens += chunk.token_ids.len();
    }
    assert_eq!(tokens, 3000);
    let status = verifier.wait_exit(Duration::from_secs(20)).expect("the server did not exit after draining");
    assert!(status.success(), "exit status {status:?}");
}

/// One span as the receiver got it.
#[derive(Clone, Debug)]
struct ReceivedSpan {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An in-process OTLP/gRPC receiver that keeps every span it is sent.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref())
                .map(|v| format!("{:?}", v.value))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    spans.push(ReceivedSpan {
                        service: service.clone(),
                        name: span.name,
                        trace: hex(&span.trace_id),
                        id: hex(&span.span_id),
                        parent: hex(&span.parent_span_id),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_both_services() {
    let Some(root) = fixtures() else { return };
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let server = collector.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(server))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    let otel = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let dir = root.join("tiny-qwen3-vl");
    let prompts = suite::build(&dir, 1, 24);
    let head = glance_tests::random_head(&dir, "trace", 1, 5);
    let mut drafter = ServiceProcess::drafter_with_env(
        &["--kind", "block-head", "--head", head.to_str().unwrap(), "--target", dir.to_str().unwrap()],
        &otel,
    );
    let mut verifier = ServiceProcess::verifier_with_env(&dir, &["--drafter", &drafter.url], &otel);
    let mut client = GenerationClient::connect(verifier.url.clone()).await.unwrap();
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let mut request = tonic::Request::new(suite::request(&prompts[0], pb::DecodingMode::SpeculativeTree, 0));
    request.metadata_mut().insert("traceparent", format!("00-{trace_id}-{client_span}-01").parse().unwrap());
    client.generate(request).await.unwrap();
    // Flushed on shutdown.
    verifier.signal("TERM");
    drafter.signal("TERM");
    verifier.wait_exit(Duration::from_secs(20));
    drafter.wait_exit(Duration::from_secs(20));
    tokio::time::sleep(Duration::from_millis(300)).await;

    let spans = collector.spans.lock().unwrap().clone();
    let ours: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.trace == trace_id).collect();
    let by_id: HashMap<&str, &ReceivedSpan> = ours.iter().map(|s| (s.id.as_str(), *s)).collect();
    let named = |name: &str| ours.iter().filter(|s| s.name == name).copied().collect::<Vec<_>>();
    let parent_name = |s: &ReceivedSpan| by_id.get(s.parent.as_str()).map(|p| p.name.clone());
    let request_span = named("request");
    assert_eq!(
        request_span.len(),
        1,
        "spans received: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    assert_eq!(request_span[0].parent, client_span, "the request span continues the client's trace");
    assert!(request_span[0].service.contains("verifier-svc"));
    for (child, parent) in
        [("prefill", "request"), ("round", "request"), ("draft", "round"), ("verify", "round")]
    {
        let found = named(child);
        assert!(!found.is_empty(), "no {child} span");
        assert!(
            found.iter().all(|s| parent_name(s).as_deref() == Some(parent)),
            "{child} must be a child of {parent}"
        );
    }
    let session = named("draft_session");
    assert_eq!(session.len(), 1, "the drafter's session joins the request's trace");
    assert!(session[0].service.contains("drafter-svc"));
    assert_eq!(parent_name(session[0]).as_deref(), Some("request"));
    let rounds = named("draft_round");
    assert!(!rounds.is_empty() && rounds.iter().all(|s| parent_name(s).as_deref() == Some("draft_session")));
    println!("trace {trace_id}: {} spans from both services", ours.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_logs_carry_the_entropy_law_data() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen2.5-vl");
    let prompts = suite::build(&dir, 2, 30);
    let head = glance_tests::random_head(&dir, "rounds", 1, 5);
    let drafter = ServiceProcess::block_head_drafter(&head, &dir, &[]);
    let verifier = ServiceProcess::verifier(&dir, &["--drafter", &drafter.url]);
    let mut client = GenerationClient::connect(verifier.url.clone()).await.unwrap();
    for prompt in &prompts {
        let mut request = suite::request(prompt, pb::DecodingMode::SpeculativeTree, 15);
        request.decoding.as_mut().unwrap().log_rounds = true;
        let response = client.generate(request).await.unwrap().into_inner();
        let tokens: Vec<i64> = response.token_ids.iter().map(|&t| t as i64).collect();
        assert_eq!(tokens, prompt.greedy);
        let stats = response.speculative.unwrap();
        assert_eq!(stats.round_logs.len(), stats.rounds as usize);
        let vocab_entropy = (1024f32).ln();
        assert!(stats
            .round_logs
            .iter()
            .all(|r| r.root_entropy >= 0.0 && r.root_entropy <= vocab_entropy + 1e-3));
        assert!(stats.round_logs.iter().all(|r| r.tree_size >= 1 && r.tree_size <= 15));
        let accepted: u64 = stats.round_logs.iter().map(|r| r.accepted as u64).sum();
        // Each accepted token is counted once at its depth.
        assert_eq!(accepted, stats.accepted_per_depth.iter().sum::<u64>());
    }
}
