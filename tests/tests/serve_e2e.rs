//! verifier-svc as a process on a loopback port: the served tokens equal the in-process greedy
//! decoder's, streaming equals unary, health and reflection answer, and a client that goes away
//! stops its generation. Bad requests have their own table in `bad_inputs.rs`.

use std::time::{Duration, Instant};

use glance_input::{PromptBuilder, PromptOptions};
use glance_models::decode::{greedy_generate, GreedyParams, StepControl};
use glance_models::TargetModel;
use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_tests::process::ServiceProcess;
use glance_tests::requests::{request, text, user};
use glance_tests::{fixtures, Case};
use tonic::transport::Channel;

async fn connect(url: &str) -> GenerationClient<Channel> {
    GenerationClient::connect(url.to_string()).await.expect("connect")
}

/// Sampled requests through the service: a request without a seed gets one back, and repeating
/// it with that seed repeats the tokens, unary or streamed, autoregressive or prompt lookup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_requests_return_their_seed_and_repeat_with_it() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let server = ServiceProcess::verifier(&dir, &[]);
    let mut client = connect(&server.url).await;
    let case = Case::load(&dir, "one_image");
    let sampled = |mode: pb::DecodingMode, seed: Option<u64>| pb::GenerateRequest {
        decoding: Some(pb::DecodingOptions {
            mode: mode as i32,
            temperature: 0.8,
            top_k: 40,
            seed,
            ignore_eos: true,
            ..Default::default()
        }),
        ..request(glance_tests::suite::to_proto(&case.chat_messages()), 24)
    };
    let first = client.generate(sampled(pb::DecodingMode::Autoregressive, None)).await.unwrap().into_inner();
    let seed = first.seed.expect("a sampled response carries its seed");
    let greedy: Vec<u32> = case.greedy_tokens[..24].iter().map(|&t| t as u32).collect();
    assert_ne!(first.token_ids, greedy, "temperature 0.8 gave the greedy tokens");
    for mode in [pb::DecodingMode::Autoregressive, pb::DecodingMode::PromptLookup] {
        let again = client.generate(sampled(mode, Some(seed))).await.unwrap().into_inner();
        assert_eq!((again.token_ids, again.seed), (first.token_ids.clone(), Some(seed)), "{mode:?}");
        let mut stream = client.generate_stream(sampled(mode, Some(seed))).await.unwrap().into_inner();
        let (mut ids, mut last_seed) = (Vec::new(), None);
        while let Some(chunk) = stream.message().await.unwrap() {
            ids.extend(chunk.token_ids);
            last_seed = last_seed.or(chunk.seed);
        }
        assert_eq!((ids, last_seed), (first.token_ids.clone(), Some(seed)), "{mode:?} streamed");
    }
    let greedy_response =
        client.generate(request(glance_tests::suite::to_proto(&case.chat_messages()), 4)).await;
    assert_eq!(greedy_response.unwrap().into_inner().seed, None, "a greedy response has no seed");
}

/// Log-probabilities through the service: one per token with its alternatives, unary and
/// streamed; the same values autoregressively and in prompt lookup (a speculative mode: its
/// tokens come from verify passes, whose rows give the values); greedy and sampled; none unless
/// asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_come_with_every_token_in_every_mode() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let server = ServiceProcess::verifier(&dir, &[]);
    let mut client = connect(&server.url).await;
    let case = Case::load(&dir, "one_image");
    let asking = |mode: pb::DecodingMode, temperature: f32| pb::GenerateRequest {
        decoding: Some(pb::DecodingOptions {
            mode: mode as i32,
            temperature,
            seed: Some(11),
            ignore_eos: true,
            logprobs: true,
            top_logprobs: 3,
            ..Default::default()
        }),
        ..request(glance_tests::suite::to_proto(&case.chat_messages()), 24)
    };
    for temperature in [0.0, 0.9] {
        let ar = client
            .generate(asking(pb::DecodingMode::Autoregressive, temperature))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ar.logprobs.len(), ar.token_ids.len(), "one log-probability per token");
        for (lp, &token) in ar.logprobs.iter().zip(&ar.token_ids) {
            assert_eq!(lp.token_id, token);
            assert!(lp.logprob <= 0.0 && lp.top_logprobs.len() == 3, "{lp:?}");
            assert!(lp.top_logprobs[0].logprob >= lp.logprob, "the best alternative is at least as likely");
            if temperature == 0.0 {
                assert_eq!(lp.top_logprobs[0].token_id, token, "greedy chooses the most likely token");
            }
        }
        let mut stream = client
            .generate_stream(asking(pb::DecodingMode::PromptLookup, temperature))
            .await
            .unwrap()
            .into_inner();
        let mut streamed = pb::GenerateResponse::default();
        while let Some(chunk) = stream.message().await.unwrap() {
            assert_eq!(chunk.logprobs.len(), chunk.token_ids.len(), "per chunk, one per token");
            streamed.token_ids.extend(chunk.token_ids);
            streamed.logprobs.extend(chunk.logprobs);
        }
        assert_eq!(streamed.token_ids, ar.token_ids);
        for (a, s) in ar.logprobs.iter().zip(&streamed.logprobs) {
            assert!((a.logprob - s.logprob).abs() <= 1e-5, "{a:?} vs {s:?}");
            let ids = |lp: &pb::TokenLogprob| lp.top_logprobs.iter().map(|t| t.token_id).collect::<Vec<_>>();
            assert_eq!(ids(a), ids(s));
        }
    }
    let plain = client.generate(request(glance_tests::suite::to_proto(&case.chat_messages()), 4)).await;
    assert!(plain.unwrap().into_inner().logprobs.is_empty(), "no log-probabilities unless asked");
}

/// A stop token id ends the generation at its first occurrence, as a stop: the greedy tokens up
/// to and including it, finish reason STOP, with `ignore_eos` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_token_id_ends_the_generation() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let server = ServiceProcess::verifier(&dir, &[]);
    let mut client = connect(&server.url).await;
    let case = Case::load(&dir, "one_image");
    let greedy: Vec<u32> = case.greedy_tokens.iter().map(|&t| t as u32).collect();
    let stop = greedy[6];
    let first = greedy.iter().position(|&t| t == stop).unwrap();
    for mode in [pb::DecodingMode::Autoregressive, pb::DecodingMode::PromptLookup] {
        let stopped = pb::GenerateRequest {
            decoding: Some(pb::DecodingOptions {
                mode: mode as i32,
                stop_token_ids: vec![stop],
                ignore_eos: true,
                ..Default::default()
            }),
            ..request(glance_tests::suite::to_proto(&case.chat_messages()), 32)
        };
        let response = client.generate(stopped).await.unwrap().into_inner();
        assert_eq!(response.token_ids, greedy[..=first], "{mode:?}");
        assert_eq!(response.finish_reason, pb::FinishReason::Stop as i32, "{mode:?}");
    }
}

/// `--image-backend` picks the transformers image processor the pixels reproduce: by default the
/// torchvision one, on request the PIL one; each serves its reference case's greedy tokens (the
/// pixels themselves are compared in `common/input/tests/input_parity.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_backend_flag_picks_the_processor() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen2.5-vl");
    for (args, backend, case) in
        [(&[][..], "torchvision", "tv_alpha"), (&["--image-backend", "pil"][..], "pil", "alpha")]
    {
        let server = ServiceProcess::verifier(&dir, args);
        let mut client = connect(&server.url).await;
        let info = client.model_info(pb::ModelInfoRequest {}).await.unwrap().into_inner();
        assert_eq!(info.image_backend, backend);
        let options =
            ["temperature", "top_k", "top_p", "min_p", "seed", "stop_token_ids", "logprobs", "top_logprobs"];
        assert_eq!(info.sampling_options, options);
        assert_eq!(info.max_top_logprobs, 20);
        let case = Case::load(&dir, case);
        assert_eq!(case.image_backend().name(), backend);
        let request = pb::GenerateRequest {
            decoding: Some(pb::DecodingOptions { ignore_eos: true, ..Default::default() }),
            ..request(glance_tests::suite::to_proto(&case.chat_messages()), 32)
        };
        let served = client.generate(request).await.unwrap().into_inner().token_ids;
        let expected: Vec<u32> = case.greedy_tokens.iter().map(|&t| t as u32).collect();
        assert_eq!(served, expected, "{backend}: served tokens differ from transformers'");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_tokens_equal_in_process_greedy() {
    let Some(root) = fixtures() else { return };
    for family in ["tiny-qwen3-vl", "tiny-qwen2.5-vl"] {
        let dir = root.join(family);
        let case = Case::load(&dir, "two_images");
        let messages = case.chat_messages();
        // In process: the same pipeline and decoder, with the model's own EOS.
        let prompts = PromptBuilder::from_model_dir(&dir, PromptOptions::default()).unwrap();
        let model = TargetModel::load(&dir, tch::Kind::Float, tch::Device::Cpu).unwrap();
        let prompt = prompts.build(&messages).unwrap();
        let eos: Vec<i64> = prompts.eos_token_ids().iter().map(|&i| i as i64).collect();
        let params =
            GreedyParams { max_new_tokens: 48, eos_token_ids: &eos, context_limit: 4096, logprobs: None };
        let inputs = prompt.model_inputs();
        let expected = greedy_generate(&model, &inputs, &params, |_| StepControl::Continue).unwrap().tokens;

        let server = ServiceProcess::verifier(&dir, &[]);
        let mut client = connect(&server.url).await;
        let unary = client
            .generate(request(glance_tests::suite::to_proto(&messages), 48))
            .await
            .unwrap()
            .into_inner();
        let served: Vec<i64> = unary.token_ids.iter().map(|&t| t as i64).collect();
        assert_eq!(served, expected, "{family}: served tokens differ from in-process greedy");
        let usage = unary.usage.unwrap();
        assert_eq!(usage.prompt_tokens as usize, prompt.input_ids.len());
        assert_eq!(usage.image_tokens as usize, prompt.image_token_count);
        assert_eq!(usage.generated_tokens as usize, expected.len());

        let mut stream = client
            .generate_stream(request(glance_tests::suite::to_proto(&messages), 48))
            .await
            .unwrap()
            .into_inner();
        let (mut streamed_text, mut streamed_ids, mut finish) = (String::new(), Vec::new(), 0);
        while let Some(chunk) = stream.message().await.unwrap() {
            streamed_text.push_str(&chunk.text);
            streamed_ids.extend(chunk.token_ids);
            if chunk.finish_reason != 0 {
                finish = chunk.finish_reason;
            }
        }
        assert_eq!(streamed_ids, unary.token_ids, "{family}: stream tokens");
        assert_eq!(streamed_text, unary.text, "{family}: stream text");
        assert_eq!(finish, unary.finish_reason);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reflection_and_model_info() {
    let Some(root) = fixtures() else { return };
    let server = ServiceProcess::verifier(&root.join("tiny-qwen3-vl"), &[]);
    let channel = Channel::from_shared(server.url.clone()).unwrap().connect().await.unwrap();

    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for service in ["", "glance.v1.Generation"] {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest { service: service.into() })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service:?}"
        );
    }

    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(channel.clone());
    let ask = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies =
        reflection.server_reflection_info(tokio_stream::iter([ask])).await.unwrap().into_inner();
    let reply = replies.message().await.unwrap().expect("a reflection reply");
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("no service list")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains(&"glance.v1.Generation".to_string()), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health".to_string()), "{names:?}");
    assert!(!names.iter().any(|n| n.contains("Drafter")), "the internal service is advertised: {names:?}");

    let info = connect(&server.url).await.model_info(pb::ModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.model_type, "qwen3_vl");
    assert_eq!(info.vocab_size, 1024);
    assert!(info.context_window > 0 && info.max_new_tokens_limit > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_client_stops_its_generation() {
    let Some(root) = fixtures() else { return };
    let server = ServiceProcess::verifier(&root.join("tiny-qwen3-vl"), &["--max-new-tokens-limit", "4000"]);
    let mut client = connect(&server.url).await;
    let mut long = request(user(vec![text("Tell a long story.")]), 4000);
    long.decoding = Some(pb::DecodingOptions { ignore_eos: true, ..Default::default() });
    let mut stream = client.generate_stream(long).await.unwrap().into_inner();
    // Measure this request's own pace, then walk away.
    let started = Instant::now();
    let mut received = 0usize;
    while received < 50 {
        let chunk = stream.message().await.unwrap().expect("stream ended early");
        received += chunk.token_ids.len();
    }
    let per_token = started.elapsed() / received as u32;
    drop(stream);
    drop(client);
    // Had it kept going, the next request would queue behind ~3950 more tokens.
    let remaining = per_token * 3950;
    let mut client = connect(&server.url).await;
    let asked = Instant::now();
    client.generate(request(user(vec![text("hi")]), 1)).await.expect("next request");
    let waited = asked.elapsed();
    assert!(
        waited < remaining / 4 + Duration::from_millis(500),
        "the next request waited {waited:?}; the abandoned generation had ~{remaining:?} of work left"
    );
}

/// Runs `verifier-svc ARGS…` expecting it to refuse to start: returns its stderr.
fn refused_start(args: &[&str]) -> String {
    let output = std::process::Command::new(glance_tests::process::binary("verifier-svc"))
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "off"])
        .output()
        .expect("running verifier-svc");
    assert!(!output.status.success(), "verifier-svc started with {args:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_missing_or_inconsistent_model_directory_stops_the_start_up() {
    let Some(root) = fixtures() else { return };
    let missing = refused_start(&["--model", "/nonexistent/model"]);
    assert!(missing.contains("model directory /nonexistent/model"), "{missing}");
    assert!(!missing.contains("panicked"), "{missing}");

    // A config whose layer width disagrees with the weights.
    let broken = std::env::temp_dir().join(format!("glance-broken-model-{}", std::process::id()));
    std::fs::create_dir_all(&broken).unwrap();
    let source = root.join("tiny-qwen3-vl");
    for entry in std::fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, broken.join(path.file_name().unwrap())).unwrap();
        }
    }
    let config = std::fs::read_to_string(source.join("config.json")).unwrap();
    std::fs::write(
        broken.join("config.json"),
        config.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"),
    )
    .unwrap();
    let inconsistent = refused_start(&["--model", broken.to_str().unwrap()]);
    assert!(inconsistent.contains("mlp") && inconsistent.contains("shape"), "{inconsistent}");
    assert!(!inconsistent.contains("panicked"), "{inconsistent}");

    std::fs::remove_file(broken.join("model.safetensors")).unwrap();
    let no_weights = refused_start(&["--model", broken.to_str().unwrap()]);
    assert!(no_weights.contains("model.safetensors"), "{no_weights}");
}

#[test]
fn the_model_is_the_one_the_deployment_names() {
    let Some(root) = fixtures() else { return };
    let (model, other) = (root.join("tiny-qwen3-vl"), root.join("tiny-qwen2.5-vl"));
    let print = |dir: &std::path::Path| {
        let output = std::process::Command::new(glance_tests::process::binary("verifier-svc"))
            .args(["--print-fingerprint", "--model", dir.to_str().unwrap()])
            .output()
            .expect("running verifier-svc");
        assert!(output.status.success());
        String::from_utf8(output.stdout).unwrap().trim().to_string()
    };
    let (ours, theirs) = (print(&model), print(&other));
    assert_eq!(ours.len(), 16);
    assert_ne!(ours, theirs);
    let refused = refused_start(&["--model", model.to_str().unwrap(), "--expect-fingerprint", &theirs]);
    assert!(refused.contains("--expect-fingerprint") && refused.contains(&ours), "{refused}");
    let served = ServiceProcess::verifier(&model, &["--expect-fingerprint", &ours]);
    drop(served);
    // The drafter checks its --target the same way.
    let drafter = std::process::Command::new(glance_tests::process::binary("drafter-svc"))
        .args(["serve", "--kind", "prompt-lookup", "--target", model.to_str().unwrap()])
        .args(["--expect-target-fingerprint", &theirs, "--listen", "127.0.0.1:0", "--metrics-listen", "off"])
        .output()
        .expect("running drafter-svc");
    assert!(!drafter.status.success());
    let stderr = String::from_utf8_lossy(&drafter.stderr);
    assert!(stderr.contains("--expect-target-fingerprint"), "{stderr}");
}

/// A drafter serving a random block head made for the target in `target` (written to a
/// temporary directory named after `name`).
fn head_drafter_for(target: &std::path::Path, name: &str) -> ServiceProcess {
    let head = std::env::temp_dir().join(format!("glance-{name}-head-{}", std::process::id()));
    let spec = drafter_svc::init::HeadSpec {
        tap_layers: Some(vec![0, 1, 2]),
        ..drafter_svc::init::HeadSpec::new(1, 16, 1)
    };
    drafter_svc::init::write_random_head(target, &head, &spec).unwrap();
    ServiceProcess::block_head_drafter(&head, target, &[])
}

/// The verifier retries a drafter that does not fit in the background; its API keeps answering
/// meanwhile, even on a single runtime worker (a reconnection attempt once held the drafter's
/// state lock while it waited for that worker, and `model_info` waited for the lock: a hang).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_answers_while_a_mismatched_drafter_is_retried() {
    let Some(root) = fixtures() else { return };
    let drafter = head_drafter_for(&root.join("tiny-qwen2.5-vl"), "retried");
    let model = root.join("tiny-qwen3-vl");
    let verifier = ServiceProcess::verifier_with_env(
        &model,
        &["--drafter", &drafter.url],
        &[("TOKIO_WORKER_THREADS", "1")],
    );
    let mut client = connect(&verifier.url).await;
    // Attempts come at start-up and then every 0.25-2 s; asking every few ms for 4.5 s lands
    // calls inside several of them.
    let until = Instant::now() + Duration::from_millis(4500);
    let mut answered = 0;
    while Instant::now() < until {
        let info = tokio::time::timeout(Duration::from_secs(10), client.model_info(pb::ModelInfoRequest {}))
            .await
            .expect("model_info hung while the drafter was retried")
            .unwrap()
            .into_inner();
        assert!(!info.drafter_connected);
        answered += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let case = Case::load(&model, "one_image");
    let mut auto = request(glance_tests::suite::to_proto(&case.chat_messages()), 8);
    auto.decoding = Some(pb::DecodingOptions { ignore_eos: true, ..Default::default() });
    let response = tokio::time::timeout(Duration::from_secs(60), client.generate(auto))
        .await
        .expect("generate hung while the drafter was retried")
        .expect("served without the drafter")
        .into_inner();
    assert_eq!(response.token_ids, case.greedy_tokens[..8].iter().map(|&t| t as u32).collect::<Vec<_>>());
    assert!(answered > 100, "{answered} answers in 4.5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drafter_built_for_another_target_is_left_out_and_requests_decode_without_it() {
    let Some(root) = fixtures() else { return };
    // Same vocabulary and width, another target: only the fingerprint tells them apart.
    let other = root.join("tiny-qwen2.5-vl");
    let drafter = ServiceProcess::drafter(&["--kind", "prompt-lookup", "--target", other.to_str().unwrap()]);
    let head_drafter = head_drafter_for(&other, "mismatch");
    let model = root.join("tiny-qwen3-vl");
    // A head upgrade rolling out, say: the verifier starts and serves, without that drafter.
    let port = glance_tests::free_port();
    let listen = format!("127.0.0.1:{port}");
    let verifier =
        ServiceProcess::verifier(&model, &["--drafter", &head_drafter.url, "--metrics-listen", &listen]);
    let mut client = connect(&verifier.url).await;
    let info = client.model_info(pb::ModelInfoRequest {}).await.unwrap().into_inner();
    assert!(!info.drafter_connected);
    let case = Case::load(&model, "one_image");
    let mut tree = request(glance_tests::suite::to_proto(&case.chat_messages()), 8);
    tree.decoding = Some(pb::DecodingOptions {
        mode: pb::DecodingMode::SpeculativeTree as i32,
        ignore_eos: true,
        ..Default::default()
    });
    let response = client.generate(tree).await.expect("served without the drafter").into_inner();
    assert_eq!(response.token_ids, case.greedy_tokens[..8].iter().map(|&t| t as u32).collect::<Vec<_>>());
    let stats = response.speculative.unwrap();
    assert_eq!(stats.rounds, 0, "{stats:?}");
    let mismatches = glance_tests::metric(&glance_tests::scrape(port), "glance_drafter_mismatches_total");
    assert!(mismatches >= 1.0, "the mismatch was not counted");
    // Prompt lookup works with any target of the same vocabulary, so it is accepted.
    let accepted = ServiceProcess::verifier(&model, &["--drafter", &drafter.url]);
    let mut client = connect(&accepted.url).await;
    let mut connected = false;
    for _ in 0..30 {
        connected = client.model_info(pb::ModelInfoRequest {}).await.unwrap().into_inner().drafter_connected;
        if connected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(connected);
}
