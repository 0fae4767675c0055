//! The bad-input table: every field of the public `GenerateRequest` with the bad values it can
//! carry, the gRPC status each gets (unary and streaming alike, before any token), and after each
//! one a good request still returns the greedy tokens: nothing a bad request did stays behind.

use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_tests::process::ServiceProcess;
use glance_tests::requests::{image, png_claiming, png_of_size, request, text, user};
use glance_tests::{fixtures, Case};
use tonic::transport::Channel;
use tonic::{Code, Status};

/// The limits the server under test runs with, small enough to reach in a test, and the image
/// processor of the reference case the good request checks against.
const SERVER_ARGS: [&str; 14] = [
    "--image-backend",
    "pil",
    "--max-images",
    "2",
    "--context-window",
    "256",
    "--max-new-tokens-limit",
    "64",
    "--max-image-bytes",
    "100000",
    "--max-request-bytes",
    "4000000",
    "--max-decoded-pixels",
    "1000000",
];

/// One row: what is wrong, the request, the status code and a piece of its message that names the
/// field or the limit.
struct BadInput {
    what: &'static str,
    request: pb::GenerateRequest,
    code: Code,
    needle: String,
}

fn row(what: &'static str, request: pb::GenerateRequest, code: Code, needle: &str) -> BadInput {
    BadInput { what, request, code, needle: needle.into() }
}

fn hi() -> Vec<pb::ChatMessage> {
    user(vec![text("hi")])
}

fn with_stop(stop: Vec<String>) -> pb::GenerateRequest {
    pb::GenerateRequest { stop, ..request(hi(), 8) }
}

fn with_decoding(decoding: pb::DecodingOptions) -> pb::GenerateRequest {
    pb::GenerateRequest { decoding: Some(decoding), ..request(hi(), 8) }
}

fn sampling(temperature: f32, top_k: u32, top_p: Option<f32>, min_p: f32) -> pb::GenerateRequest {
    with_decoding(pb::DecodingOptions { temperature, top_k, top_p, min_p, ..Default::default() })
}

fn with_role(role: &str) -> pb::GenerateRequest {
    request(
        vec![pb::ChatMessage {
            role: role.into(),
            content: vec![pb::ContentPart { part: Some(text("hi")) }],
        }],
        8,
    )
}

fn image_request(data: Vec<u8>, mime: &str) -> pb::GenerateRequest {
    request(user(vec![image(data, mime), text("hi")]), 8)
}

/// Every field of `GenerateRequest` and its parts, each with the ways it can be wrong.
fn table(good_png: &[u8], text_limit: usize) -> Vec<BadInput> {
    use Code::{FailedPrecondition, InvalidArgument, OutOfRange};
    let n_stops = |n: usize| (0..n).map(|i| format!("stop{i}")).collect::<Vec<_>>();
    vec![
        // max_new_tokens
        row("max_new_tokens 0", request(hi(), 0), InvalidArgument, "max_new_tokens: must be at least 1"),
        row(
            "max_new_tokens over the limit",
            request(hi(), 65),
            InvalidArgument,
            "over the server limit of 64",
        ),
        // stop
        row("17 stop strings", with_stop(n_stops(17)), InvalidArgument, "stop: at most 16"),
        row("an empty stop string", with_stop(vec!["a".into(), String::new()]), InvalidArgument, "stop[1]"),
        row(
            "a 257-byte stop string",
            with_stop(vec!["x".repeat(257)]),
            InvalidArgument,
            "stop[0]: must be 1 to 256",
        ),
        // messages and roles
        row("no messages", request(vec![], 8), InvalidArgument, "messages"),
        row("an unknown role", with_role("wizard"), InvalidArgument, "role \"wizard\""),
        row("an empty role", with_role(""), InvalidArgument, "role \"\""),
        // content parts
        row(
            "a part with neither text nor image",
            request(
                vec![pb::ChatMessage { role: "user".into(), content: vec![pb::ContentPart { part: None }] }],
                8,
            ),
            InvalidArgument,
            "messages[0].content[0]: empty content part",
        ),
        // text
        row(
            "text holding the image placeholder",
            request(user(vec![text("look: <|image_pad|>")]), 8),
            InvalidArgument,
            "placeholder",
        ),
        row(
            // Refused by its size, before any tokenizing (the context-window check comes after).
            "text past what the context window can hold",
            request(user(vec![text("hi"), text(&"x".repeat(text_limit))]), 8),
            InvalidArgument,
            "messages[0].content[1]: the messages' text reaches",
        ),
        row(
            "a prompt longer than the context window",
            request(user(vec![text(&"many words here ".repeat(200))]), 8),
            InvalidArgument,
            "context window",
        ),
        // image.data
        row("empty image data", image_request(vec![], "image/png"), InvalidArgument, "no data"),
        row(
            "corrupt image data",
            image_request(b"\x89PNG\r\n\x1a\nnot really".to_vec(), "image/png"),
            InvalidArgument,
            "messages[0].content[0]",
        ),
        row(
            "a truncated PNG",
            image_request(good_png[..good_png.len() / 2].to_vec(), "image/png"),
            InvalidArgument,
            "corrupt PNG",
        ),
        row(
            "an image past the byte limit, before decoding",
            image_request(vec![0u8; 100_001], "image/png"),
            InvalidArgument,
            "max-image-bytes",
        ),
        row(
            "a header claiming 10^10 pixels",
            image_request(png_claiming(100_000, 100_000), ""),
            InvalidArgument,
            "pixels",
        ),
        row(
            "just past --max-decoded-pixels",
            image_request(png_claiming(1001, 1000), "image/png"),
            InvalidArgument,
            "1000000",
        ),
        row(
            "an image with no pixels",
            image_request(png_claiming(0, 16), "image/png"),
            InvalidArgument,
            "content[0]",
        ),
        row(
            "an aspect ratio over 200",
            image_request(png_of_size(402, 2), ""),
            InvalidArgument,
            "aspect ratio",
        ),
        // image.mime_type
        row(
            "an unsupported MIME type",
            image_request(good_png.to_vec(), "image/gif"),
            InvalidArgument,
            "mime",
        ),
        row(
            "PNG bytes declared as JPEG",
            image_request(good_png.to_vec(), "image/jpeg"),
            InvalidArgument,
            "look like Png",
        ),
        // image count
        row(
            "three images, two allowed",
            request(
                user(vec![
                    image(good_png.to_vec(), ""),
                    image(good_png.to_vec(), ""),
                    image(good_png.to_vec(), ""),
                    text("hi"),
                ]),
                8,
            ),
            InvalidArgument,
            "at most 2 per request",
        ),
        // decoding
        row(
            "an unknown decoding mode",
            with_decoding(pb::DecodingOptions { mode: 99, ..Default::default() }),
            InvalidArgument,
            "decoding.mode",
        ),
        row(
            "a speculative mode on a server without a drafter",
            with_decoding(pb::DecodingOptions {
                mode: pb::DecodingMode::SpeculativeTree as i32,
                ..Default::default()
            }),
            FailedPrecondition,
            "needs a drafter",
        ),
        row(
            "a tree budget over the limit",
            with_decoding(pb::DecodingOptions { tree_budget: 1_000_000, ..Default::default() }),
            InvalidArgument,
            "decoding.tree_budget",
        ),
        row(
            "branch_k over the limit",
            with_decoding(pb::DecodingOptions { branch_k: 65, ..Default::default() }),
            InvalidArgument,
            "decoding.branch_k: must be 1 to 64",
        ),
        // sampling
        row("a negative temperature", sampling(-0.5, 0, None, 0.0), InvalidArgument, "decoding.temperature"),
        row("a NaN temperature", sampling(f32::NAN, 0, None, 0.0), InvalidArgument, "decoding.temperature"),
        row(
            "top_k past the vocabulary",
            sampling(1.0, 1_000_000, None, 0.0),
            InvalidArgument,
            "decoding.top_k",
        ),
        row(
            "top_p of 0",
            sampling(1.0, 0, Some(0.0), 0.0),
            InvalidArgument,
            "decoding.top_p: must be in (0, 1]",
        ),
        row("top_p over 1", sampling(1.0, 0, Some(1.5), 0.0), InvalidArgument, "decoding.top_p"),
        row(
            "min_p over 1",
            sampling(1.0, 0, None, 2.0),
            InvalidArgument,
            "decoding.min_p: must be in [0, 1]",
        ),
        row(
            "a stop token id past the vocabulary",
            with_decoding(pb::DecodingOptions { stop_token_ids: vec![5, 1_000_000], ..Default::default() }),
            InvalidArgument,
            "decoding.stop_token_ids[1]",
        ),
        row(
            "17 stop token ids",
            with_decoding(pb::DecodingOptions { stop_token_ids: vec![5; 17], ..Default::default() }),
            InvalidArgument,
            "decoding.stop_token_ids: at most 16",
        ),
        row(
            "top_logprobs over 20",
            with_decoding(pb::DecodingOptions { logprobs: true, top_logprobs: 21, ..Default::default() }),
            InvalidArgument,
            "decoding.top_logprobs: must be 0 to 20",
        ),
        row(
            "top_logprobs without logprobs",
            with_decoding(pb::DecodingOptions { top_logprobs: 3, ..Default::default() }),
            InvalidArgument,
            "decoding.top_logprobs: needs decoding.logprobs",
        ),
        // the request as a whole
        row(
            "a request past the transport's limit",
            request(user(vec![text(&"x".repeat(4_000_001))]), 8),
            OutOfRange,
            "the limit is: 4000000 bytes",
        ),
    ]
}

/// The status a streamed request ends with; it must end before any token is sent.
async fn streamed_status(client: &mut GenerationClient<Channel>, req: pb::GenerateRequest) -> Status {
    let mut stream = match client.generate_stream(req).await {
        Err(status) => return status,
        Ok(response) => response.into_inner(),
    };
    match stream.message().await {
        Err(status) => status,
        Ok(chunk) => panic!("a bad streamed request produced {chunk:?} instead of a status"),
    }
}

fn check(what: &str, transport: &str, status: &Status, code: Code, needle: &str) {
    assert_eq!(status.code(), code, "{what} ({transport}): {}", status.message());
    assert!(
        status.message().contains(needle),
        "{what} ({transport}): {:?} lacks {needle:?}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_field_gets_its_status_and_the_server_keeps_serving() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let server = ServiceProcess::verifier(&dir, &SERVER_ARGS);
    let mut client = GenerationClient::connect(server.url.clone())
        .await
        .expect("connect")
        .max_encoding_message_size(64 << 20);
    let info = client.model_info(pb::ModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.max_image_bytes, info.max_request_bytes), (100_000, 4_000_000));
    assert_eq!((info.max_decoded_pixels, info.max_images_per_request), (1_000_000, 2));
    // The text bound is what 256 tokens can hold, and no less than 256 bytes.
    let text_limit = info.max_text_bytes as usize;
    assert!((256..4_000_000).contains(&text_limit), "{text_limit}");

    // The good request: a reference case, whose greedy tokens transformers computed.
    let case = Case::load(&dir, "one_image");
    let good_png = std::fs::read(dir.join("reference/images/square.png")).unwrap();
    let good = pb::GenerateRequest {
        decoding: Some(pb::DecodingOptions { ignore_eos: true, ..Default::default() }),
        ..request(glance_tests::suite::to_proto(&case.chat_messages()), 8)
    };
    let expected: Vec<u32> = case.greedy_tokens[..8].iter().map(|&t| t as u32).collect();

    let rows = table(&good_png, text_limit);
    assert!(rows.len() >= 36, "the table lost rows");
    for BadInput { what, request, code, needle } in rows {
        let unary = client.generate(request.clone()).await.expect_err(what);
        check(what, "unary", &unary, code, &needle);
        let streamed = streamed_status(&mut client, request).await;
        check(what, "stream", &streamed, code, &needle);
        let answer = client.generate(good.clone()).await.unwrap_or_else(|e| panic!("after {what}: {e}"));
        assert_eq!(
            answer.into_inner().token_ids,
            expected,
            "after {what}: the good request's tokens changed"
        );
    }
}
