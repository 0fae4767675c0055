//! What a deployment relies on, against the real service processes on loopback: TLS on the public
//! API and mTLS on the drafter hop (certificates made here), the API key, health that matches the
//! greedy fallback (ready without a drafter, the drafter reported on its own name), the drains of
//! both services on SIGTERM, and reflection for v1 and v1alpha clients.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use glance_client::Server;
use glance_proto::drafter::v1 as dpb;
use glance_proto::v1 as pb;
use glance_security::ClientTlsFiles;
use glance_tests::pki::TestPki;
use glance_tests::process::ServiceProcess;
use glance_tests::suite::{self, SuitePrompt};
use glance_tests::{fixtures, free_port, metric, scrape};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const KEY: &str = "test-key-0123456789abcdef";

fn tiny_target() -> Option<PathBuf> {
    fixtures().map(|root| root.join("tiny-qwen3-vl"))
}

fn request(prompt: &SuitePrompt, mode: pb::DecodingMode, tokens: u32) -> pb::GenerateRequest {
    let mut request = suite::request(prompt, mode, 0);
    request.max_new_tokens = tokens;
    request.decoding.as_mut().unwrap().ignore_eos = true;
    request
}

fn port_of(service: &ServiceProcess) -> &str {
    service.addr().rsplit(':').next().unwrap()
}

/// The verifier at `https://localhost:PORT`, trusting `ca`, with an API key and a client
/// certificate when given.
fn https(service: &ServiceProcess, ca: &Path, key: Option<&str>, cert: Option<(&Path, &Path)>) -> Server {
    Server {
        addr: format!("https://localhost:{}", port_of(service)),
        tls: ClientTlsFiles {
            ca: Some(ca.into()),
            cert: cert.map(|c| c.0.into()),
            key: cert.map(|c| c.1.into()),
            domain: None,
        },
        api_key: key.map(String::from),
    }
}

fn key_file(pki: &TestPki) -> PathBuf {
    let path = pki.dir().join("api-keys");
    std::fs::write(&path, format!("# the keys this verifier accepts\n{KEY}\nanother-key-abcdefghijkl\n"))
        .unwrap();
    path
}

async fn health(server: &Server, service: &str) -> Result<ServingStatus, tonic::Status> {
    let channel = server.channel().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let request = HealthCheckRequest { service: service.into() };
    Ok(HealthClient::new(channel).check(request).await?.into_inner().status())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_the_api_key_guard_the_public_api_and_health_stays_open() {
    let Some(dir) = tiny_target() else { return };
    let prompts = suite::build(&dir, 1, 8);
    let pki = TestPki::new("public");
    let server = pki.issue("verifier", &["localhost", "127.0.0.1"]);
    let keys = key_file(&pki);
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let mut args = server.serving_args();
    args.extend(["--api-key-file", keys.to_str().unwrap(), "--metrics-listen", &listen]);
    let verifier = ServiceProcess::verifier(&dir, &args);
    let good = request(&prompts[0], pb::DecodingMode::Autoregressive, 8);
    let mut client = https(&verifier, &pki.ca(), Some(KEY), None).connect().await.unwrap();
    let response = client.generate(good.clone()).await.expect("TLS with the key").into_inner();
    assert_eq!(response.token_ids.len(), 8);

    for (key, why) in [(None, "needs an API key"), (Some("wrong-key-0123456789abcdef"), "not valid")] {
        let mut client = https(&verifier, &pki.ca(), key, None).connect().await.unwrap();
        for status in [
            client.generate(good.clone()).await.expect_err("generated without a valid key"),
            client.generate_stream(good.clone()).await.map(|_| ()).expect_err("streamed without a valid key"),
            client
                .model_info(pb::ModelInfoRequest {})
                .await
                .map(|_| ())
                .expect_err("model info without a key"),
        ] {
            assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
            assert!(status.message().contains(why), "{status:?}");
        }
    }
    // Nothing was generated for the refused requests.
    let text = scrape(metrics_port);
    assert_eq!(metric(&text, "glance_generated_tokens_total"), 8.0, "{text}");
    // Health needs no key (probes send none).
    let open = https(&verifier, &pki.ca(), None, None);
    assert_eq!(health(&open, "glance.v1.Generation").await.unwrap(), ServingStatus::Serving);
    // Plaintext, or a CA that did not sign the server's certificate: no connection.
    let plain = Server { addr: verifier.url.clone(), ..Default::default() };
    let refused = plain.connect().await.map(|mut c| async move { c.generate(good).await });
    match refused {
        Err(_) => {}
        Ok(call) => assert!(call.await.is_err(), "plaintext reached a TLS port"),
    }
    let other = TestPki::new("other");
    assert!(
        https(&verifier, &other.ca(), Some(KEY), None).connect().await.is_err(),
        "an unknown CA was trusted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_api_with_a_client_ca_admits_only_certified_clients() {
    let Some(dir) = tiny_target() else { return };
    let prompts = suite::build(&dir, 1, 4);
    let pki = TestPki::new("mtls");
    let server = pki.issue("verifier", &["localhost"]);
    let client_cert = pki.issue("client", &["glance-client"]);
    let ca = pki.ca();
    let mut args = server.serving_args();
    args.extend(["--tls-client-ca", ca.to_str().unwrap()]);
    let verifier = ServiceProcess::verifier(&dir, &args);
    let good = request(&prompts[0], pb::DecodingMode::Autoregressive, 4);
    let certified = https(&verifier, &pki.ca(), None, Some((&client_cert.cert, &client_cert.key)));
    let mut client = certified.connect().await.unwrap();
    assert_eq!(client.generate(good.clone()).await.unwrap().into_inner().token_ids.len(), 4);
    let anonymous = https(&verifier, &pki.ca(), None, None);
    let refused = match anonymous.connect().await {
        Err(_) => true,
        Ok(mut client) => client.generate(good).await.is_err(),
    };
    assert!(refused, "a client without a certificate was served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drafter_hop_runs_over_mtls_and_the_drafter_refuses_clients_without_a_certificate() {
    let Some(dir) = tiny_target() else { return };
    let prompts = suite::build(&dir, 1, 24);
    let pki = TestPki::new("hop");
    let drafter_cert = pki.issue("drafter", &["localhost", "127.0.0.1"]);
    let verifier_cert = pki.issue("verifier-client", &["glance-verifier"]);
    let head = glance_tests::random_head(&dir, "mtls", 1, 5);
    let (head, target) = (head.to_str().unwrap(), dir.to_str().unwrap());
    let ca = pki.ca();
    let mut args = vec!["--kind", "block-head", "--head", head, "--target", target];
    args.extend(drafter_cert.serving_args());
    args.extend(["--tls-client-ca", ca.to_str().unwrap()]);
    let drafter = ServiceProcess::drafter(&args);
    let drafter_url = format!("https://localhost:{}", port_of(&drafter));
    let verifier = ServiceProcess::verifier(
        &dir,
        &[
            "--drafter",
            &drafter_url,
            "--drafter-ca",
            ca.to_str().unwrap(),
            "--drafter-client-cert",
            verifier_cert.cert.to_str().unwrap(),
            "--drafter-client-key",
            verifier_cert.key.to_str().unwrap(),
        ],
    );
    let mut client = pb::generation_client::GenerationClient::connect(verifier.url.clone()).await.unwrap();
    let tree = client.generate(request(&prompts[0], pb::DecodingMode::SpeculativeTree, 24)).await.unwrap();
    let tree = tree.into_inner();
    let stats = tree.speculative.expect("speculative stats");
    assert!(stats.rounds > 0 && stats.fallback_rounds == 0, "no drafted round over mTLS: {stats:?}");
    let ar = client.generate(request(&prompts[0], pb::DecodingMode::Autoregressive, 24)).await.unwrap();
    assert_eq!(tree.token_ids, ar.into_inner().token_ids);

    // TLS that trusts the drafter but presents no certificate: the handshake is refused.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&ca).unwrap()))
        .domain_name("localhost");
    let endpoint = Endpoint::from_shared(drafter_url.clone()).unwrap().tls_config(tls.clone()).unwrap();
    let anonymous = match endpoint.connect().await {
        Err(_) => true,
        Ok(channel) => dpb::drafter_client::DrafterClient::new(channel)
            .handshake(dpb::HandshakeRequest::default())
            .await
            .is_err(),
    };
    assert!(anonymous, "the drafter served a client without a certificate");
    // The same with the verifier's certificate is served.
    let identity = Identity::from_pem(
        std::fs::read(&verifier_cert.cert).unwrap(),
        std::fs::read(&verifier_cert.key).unwrap(),
    );
    let endpoint = Endpoint::from_shared(drafter_url).unwrap().tls_config(tls.identity(identity)).unwrap();
    let mut certified = dpb::drafter_client::DrafterClient::new(endpoint.connect().await.unwrap());
    assert!(certified.handshake(dpb::HandshakeRequest::default()).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_stays_serving_without_a_drafter_and_requests_decode_greedily() {
    let Some(dir) = tiny_target() else { return };
    let prompts = suite::build(&dir, 1, 12);
    let nobody = format!("http://127.0.0.1:{}", free_port());
    let verifier = ServiceProcess::verifier(&dir, &["--drafter", &nobody]);
    let server = Server { addr: verifier.url.clone(), ..Default::default() };
    assert_eq!(health(&server, "").await.unwrap(), ServingStatus::Serving);
    assert_eq!(health(&server, "glance.v1.Generation").await.unwrap(), ServingStatus::Serving);
    let mut drafter_status = ServingStatus::Unknown;
    for _ in 0..50 {
        drafter_status = health(&server, "glance.drafter").await.unwrap();
        if drafter_status == ServingStatus::NotServing {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(drafter_status, ServingStatus::NotServing, "glance.drafter must say the drafter is away");
    let mut client = server.connect().await.unwrap();
    let info = client.model_info(pb::ModelInfoRequest {}).await.unwrap().into_inner();
    assert!(!info.drafter_connected);
    let auto = client.generate(request(&prompts[0], pb::DecodingMode::Auto, 12)).await.unwrap().into_inner();
    let ar = client.generate(request(&prompts[0], pb::DecodingMode::Autoregressive, 12)).await.unwrap();
    assert_eq!(auto.token_ids, ar.into_inner().token_ids);
    assert_eq!(auto.speculative.unwrap().rounds, 0, "no drafter, no drafted round");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_refuses_waiting_requests_at_once_and_the_running_one_completes() {
    let Some(dir) = tiny_target() else { return };
    let prompts = suite::build(&dir, 1, 4);
    let mut verifier = ServiceProcess::verifier(
        &dir,
        &["--max-concurrent", "1", "--max-queue", "4", "--max-new-tokens-limit", "3000"],
    );
    let mut client = pb::generation_client::GenerationClient::connect(verifier.url.clone()).await.unwrap();
    let mut running =
        client.generate_stream(request(&prompts[0], pb::DecodingMode::Autoregressive, 3000)).await.unwrap();
    let mut tokens = running.get_mut().message().await.unwrap().unwrap().token_ids.len();
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let mut client = client.clone();
            let short = request(&prompts[0], pb::DecodingMode::Autoregressive, 4);
            tokio::spawn(async move {
                let result = client.generate(short).await;
                (Instant::now(), result)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let signalled = Instant::now();
    verifier.signal("TERM");
    for task in waiting {
        let (answered, result) = task.await.unwrap();
        let status = result.expect_err("a waiting request ran during the drain");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("shutting down"), "{status:?}");
        let after = answered.saturating_duration_since(signalled);
        assert!(after < Duration::from_secs(2), "refused {after:?} after SIGTERM, not at once");
    }
    while let Some(chunk) = running.get_mut().message().await.expect("the running stream finishes cleanly") {
        tokens += chunk.token_ids.len();
    }
    assert_eq!(tokens, 3000);
    let status = verifier.wait_exit(Duration::from_secs(20)).expect("no exit after the drain");
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_timeout_ends_a_generation_that_outlasts_it() {
    let Some(dir) = tiny_target() else { return };
    let prompts = suite::build(&dir, 1, 4);
    let mut verifier =
        ServiceProcess::verifier(&dir, &["--drain-timeout-s", "0.5", "--max-new-tokens-limit", "4000"]);
    let mut client = pb::generation_client::GenerationClient::connect(verifier.url.clone()).await.unwrap();
    // Seconds of decoding on the tiny model: far past the half-second drain timeout.
    let long = request(&prompts[0], pb::DecodingMode::Autoregressive, 4000);
    let mut stream = client.generate_stream(long).await.unwrap().into_inner();
    stream.message().await.unwrap().unwrap();
    let signalled = Instant::now();
    verifier.signal("TERM");
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("4000 tokens within the 0.5 s drain timeout"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("drain timeout"), "{status:?}");
    let status = verifier.wait_exit(Duration::from_secs(10)).expect("no exit after the drain timeout");
    assert!(status.success(), "{status:?}");
    let took = signalled.elapsed();
    assert!(took < Duration::from_secs(5), "exited {took:?} after SIGTERM with a 0.5 s drain timeout");
}

/// A session's first message and round for a drafter of `width`-wide states.
fn session_messages(width: u64, first: u64, rows: u64) -> dpb::DraftRequest {
    let states = dpb::TensorData {
        dtype: "f32".into(),
        shape: vec![rows, width],
        data: vec![0u8; (rows * width * 4) as usize].into(),
    };
    dpb::DraftRequest {
        context: Some(dpb::ContextRows {
            first_position: first,
            tokens: (0..rows as u32).map(|t| t + 1).collect(),
            states: Some(states),
        }),
        round: Some(dpb::RoundRequest {
            root_token: 1,
            root_position: first + rows,
            tree_budget: 7,
            branch_k: 2,
            ..Default::default()
        }),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drafter_on_sigterm_refuses_new_sessions_and_ends_open_ones_at_its_drain_timeout() {
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    let (head, target) = (models.join("toy-head"), models.join("toy-target"));
    let mut drafter = ServiceProcess::drafter(&[
        "--kind",
        "block-head",
        "--head",
        head.to_str().unwrap(),
        "--target",
        target.to_str().unwrap(),
        "--drain-timeout-s",
        "2",
    ]);
    let mut client = dpb::drafter_client::DrafterClient::connect(drafter.url.clone()).await.unwrap();
    let info = client.handshake(dpb::HandshakeRequest::default()).await.unwrap().into_inner();
    let width = (info.tap_layers.len() * info.hidden_size as usize) as u64;
    let (outbound, requests) = tokio::sync::mpsc::channel(4);
    let mut session = client.draft(ReceiverStream::new(requests)).await.unwrap().into_inner();
    outbound.send(session_messages(width, 0, 4)).await.unwrap();
    session.message().await.unwrap().expect("a tree");
    let signalled = Instant::now();
    drafter.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A new session (on a new connection, as a verifier's reconnect makes) is not served.
    let refused = match dpb::drafter_client::DrafterClient::connect(drafter.url.clone()).await {
        Err(_) => true,
        Ok(mut late) => {
            let (_keep, none) = tokio::sync::mpsc::channel::<dpb::DraftRequest>(1);
            match late.draft(ReceiverStream::new(none)).await {
                Err(status) => status.code() == Code::Unavailable,
                Ok(_) => false,
            }
        }
    };
    assert!(refused, "a new session was opened on a draining drafter");
    // The open session is still served, until the drain timeout ends it.
    outbound.send(session_messages(width, 4, 2)).await.unwrap();
    session.message().await.expect("the open session is served while draining").expect("a tree");
    let status = match session.message().await {
        Ok(Some(_)) => panic!("a tree without a request"),
        Ok(None) => panic!("the session ended without a status"),
        Err(status) => status,
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("drain timeout"), "{status:?}");
    let exited = drafter.wait_exit(Duration::from_secs(10)).expect("no exit after the drain");
    assert!(exited.success(), "{exited:?}");
    assert!(signalled.elapsed() < Duration::from_secs(8), "{:?}", signalled.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_answers_v1alpha_clients_too() {
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
    let Some(dir) = tiny_target() else { return };
    let verifier = ServiceProcess::verifier(&dir, &[]);
    let channel = Endpoint::from_shared(verifier.url.clone()).unwrap().connect().await.unwrap();
    let mut client = ServerReflectionClient::new(channel);
    let ask = |message: MessageRequest| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(message),
    };
    let requests = vec![
        ask(MessageRequest::ListServices(String::new())),
        ask(MessageRequest::FileContainingSymbol("glance.v1.Generation".into())),
    ];
    let mut replies = client.server_reflection_info(tokio_stream::iter(requests)).await.unwrap().into_inner();
    let listed = match replies.message().await.unwrap().unwrap().message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect::<Vec<_>>()
        }
        other => panic!("not a service list: {other:?}"),
    };
    assert!(listed.contains(&"glance.v1.Generation".to_string()), "{listed:?}");
    assert!(listed.contains(&"grpc.health.v1.Health".to_string()), "{listed:?}");
    assert!(!listed.iter().any(|s| s.contains("drafter")), "the internal API is listed: {listed:?}");
    match replies.message().await.unwrap().unwrap().message_response {
        Some(MessageResponse::FileDescriptorResponse(files)) => {
            let generate = files.file_descriptor_proto.iter().any(|f| {
                String::from_utf8_lossy(f).contains("GenerateStream") // the service's methods are in it
            });
            assert!(generate, "the descriptor of glance.v1.Generation was not returned");
        }
        other => panic!("not a descriptor: {other:?}"),
    }
    let server = Server { addr: verifier.url.clone(), ..Default::default() };
    assert_eq!(health(&server, "").await.unwrap(), ServingStatus::Serving);
}
