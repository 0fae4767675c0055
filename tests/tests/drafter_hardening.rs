//! drafter-svc against a peer that breaks the protocol, message by message: every bad message
//! ends its stream with a status naming what was wrong (never a panic, never a silent OK), and
//! the drafter keeps serving good sessions afterwards. Also its admission limit, its idle
//! timeout, and a panic inside the engine answered as INTERNAL.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use glance_proto::drafter::v1 as pb;
use glance_tests::process::ServiceProcess;
use pb::drafter_client::DrafterClient;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Code;

fn models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
}

fn toy_head_drafter(extra: &[&str]) -> ServiceProcess {
    let (head, target) = (models().join("toy-head"), models().join("toy-target"));
    let mut args =
        vec!["--kind", "block-head", "--head", head.to_str().unwrap(), "--target", target.to_str().unwrap()];
    args.extend_from_slice(extra);
    ServiceProcess::drafter(&args)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// What the drafter states of itself, for building messages.
struct Shape {
    width: u64,
    vocab: u32,
}

async fn shape(client: &mut DrafterClient<Channel>) -> Shape {
    let info = client.handshake(pb::HandshakeRequest::default()).await.unwrap().into_inner();
    Shape { width: info.tap_layers.len() as u64 * u64::from(info.hidden_size), vocab: info.vocab_size }
}

fn states(rows: u64, width: u64) -> pb::TensorData {
    pb::TensorData {
        dtype: "f32".into(),
        shape: vec![rows, width],
        data: vec![0u8; (rows * width * 4) as usize].into(),
    }
}

fn context(first: u64, tokens: Vec<u32>, states: Option<pb::TensorData>) -> pb::DraftRequest {
    pb::DraftRequest { context: Some(pb::ContextRows { first_position: first, tokens, states }), round: None }
}

fn round(root_token: u32, root_position: u64) -> pb::RoundRequest {
    pb::RoundRequest { root_token, root_position, tree_budget: 15, branch_k: 4, ..Default::default() }
}

/// Sends `messages` on a fresh stream, closes it, and collects the replies up to the stream's end:
/// the trees, or the status it ended with.
async fn exchange(
    client: &mut DrafterClient<Channel>,
    messages: Vec<pb::DraftRequest>,
) -> Result<Vec<pb::DraftResponse>, tonic::Status> {
    let (outbound, requests) = tokio::sync::mpsc::channel(messages.len().max(1));
    for message in messages {
        outbound.send(message).await.unwrap();
    }
    drop(outbound);
    let mut inbound = client.draft(ReceiverStream::new(requests)).await?.into_inner();
    let mut trees = Vec::new();
    while let Some(reply) = inbound.message().await? {
        trees.push(reply);
    }
    Ok(trees)
}

/// A good session: a few context rows with states, then a round at their end.
fn good_session(s: &Shape) -> Vec<pb::DraftRequest> {
    let mut first = context(0, vec![1, 2, 3, 4], Some(states(4, s.width)));
    first.round = Some(round(5, 4));
    vec![first]
}

#[test]
fn bad_messages_end_the_stream_with_a_status_naming_the_fault() {
    let drafter = toy_head_drafter(&[]);
    runtime().block_on(async {
        let mut client = DrafterClient::connect(drafter.url.clone())
            .await
            .unwrap()
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20);
        let s = shape(&mut client).await;
        let w = s.width;
        let with_round = |mut m: pb::DraftRequest, r: pb::RoundRequest| {
            m.round = Some(r);
            m
        };
        let tensor = |dtype: &str, shape: Vec<u64>, bytes: usize| pb::TensorData {
            dtype: dtype.into(),
            shape,
            data: vec![0u8; bytes].into(),
        };
        // 40,000 rows past the 32,768-position limit, in chunks as a verifier sends them.
        let past_limit: Vec<pb::DraftRequest> =
            (0..10).map(|i| context(i * 4000, vec![1; 4000], Some(states(4000, w)))).collect();
        let cases: Vec<(&str, Vec<pb::DraftRequest>, Code, &str)> = vec![
            (
                "a shape whose zero hides a dimension past i64",
                vec![context(0, vec![], Some(tensor("f32", vec![0, (1 << 63) + 5], 0)))],
                Code::InvalidArgument,
                "shape",
            ),
            (
                "an unknown dtype",
                vec![context(0, vec![1], Some(tensor("int8", vec![1, w], w as usize)))],
                Code::InvalidArgument,
                "dtype",
            ),
            (
                "too few bytes for the shape",
                vec![context(0, vec![1], Some(tensor("f32", vec![1, w], 4 * w as usize - 1)))],
                Code::InvalidArgument,
                "bytes",
            ),
            (
                "states for more rows than tokens",
                vec![context(0, vec![1], Some(states(2, w)))],
                Code::InvalidArgument,
                "states",
            ),
            (
                "states of the wrong width",
                vec![context(0, vec![1], Some(states(1, w + 1)))],
                Code::InvalidArgument,
                "shape",
            ),
            (
                "a context token outside the vocabulary",
                vec![context(0, vec![s.vocab], Some(states(1, w)))],
                Code::InvalidArgument,
                "vocabulary",
            ),
            (
                "a root token outside the vocabulary",
                vec![with_round(context(0, vec![1], Some(states(1, w))), round(u32::MAX, 1))],
                Code::InvalidArgument,
                "root_token",
            ),
            ("context past the context limit", past_limit, Code::InvalidArgument, "context limit of 32768"),
            (
                "a root past the context limit",
                vec![pb::DraftRequest { context: None, round: Some(round(1, 1 << 40)) }],
                Code::InvalidArgument,
                "context limit",
            ),
            (
                "a gap before the context rows",
                vec![context(5, vec![1], Some(states(1, w)))],
                Code::InvalidArgument,
                "position",
            ),
            (
                "a root that is not at the context's end",
                vec![with_round(context(0, vec![1], Some(states(1, w))), round(1, 3))],
                Code::InvalidArgument,
                "root",
            ),
            (
                "rows without the states the head reads",
                vec![context(0, vec![1], None)],
                Code::InvalidArgument,
                "states",
            ),
            (
                "a message over the transport's size limit",
                vec![context(0, vec![1; 4], Some(tensor("f32", vec![4, w], 65 << 20)))],
                Code::OutOfRange,
                "",
            ),
        ];
        for (what, messages, code, says) in cases {
            let status = exchange(&mut client, messages).await.expect_err(what);
            assert_eq!(status.code(), code, "{what}: {status:?}");
            assert!(status.message().contains(says), "{what}: {:?} does not say {says:?}", status.message());
            // The drafter keeps serving.
            let trees = exchange(&mut client, good_session(&s))
                .await
                .unwrap_or_else(|e| panic!("after {what}: {e:?}"));
            assert_eq!(trees.len(), 1, "after {what}");
            assert!(!trees[0].tokens.is_empty(), "after {what}: an empty tree");
        }
    });
}

#[test]
fn sessions_are_admitted_up_to_the_limit_and_idle_ones_are_closed() {
    let drafter = toy_head_drafter(&["--max-sessions", "1", "--session-idle-timeout-s", "1"]);
    runtime().block_on(async {
        let mut client = DrafterClient::connect(drafter.url.clone()).await.unwrap();
        let s = shape(&mut client).await;
        // A session that sends nothing holds the one permit...
        let (_idle_sender, idle_requests) = tokio::sync::mpsc::channel::<pb::DraftRequest>(1);
        let mut idle = client.draft(ReceiverStream::new(idle_requests)).await.unwrap().into_inner();
        let refused = exchange(&mut client, good_session(&s)).await.expect_err("a second session");
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        assert!(refused.message().contains("max-sessions"), "{refused:?}");
        // ...until the idle timeout closes it, with a status that says so.
        let opened = Instant::now();
        let closed = idle.message().await.expect_err("the idle session is closed");
        assert_eq!(closed.code(), Code::DeadlineExceeded, "{closed:?}");
        assert!(opened.elapsed() < Duration::from_secs(10));
        // Its permit is back: a new session is admitted (the thread may take a moment to end).
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match exchange(&mut client, good_session(&s)).await {
                Ok(trees) => {
                    assert_eq!(trees.len(), 1);
                    break;
                }
                Err(e) if e.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("after the idle session closed: {e:?}"),
            }
        }
    });
}

#[test]
fn a_panic_inside_the_engine_is_answered_as_internal() {
    let drafter = toy_head_drafter(&["--panic-every", "2"]);
    runtime().block_on(async {
        let mut client = DrafterClient::connect(drafter.url.clone()).await.unwrap();
        let s = shape(&mut client).await;
        let mut messages = good_session(&s);
        let mut second = context(4, vec![6], Some(states(1, s.width)));
        second.round = Some(round(7, 5));
        messages.push(second);
        let status = exchange(&mut client, messages).await.expect_err("the second round panics");
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        assert!(status.message().contains("injected fault"), "{status:?}");
        // Other sessions are unaffected (each round 1 of its own session).
        assert_eq!(exchange(&mut client, good_session(&s)).await.unwrap().len(), 1);
    });
}
