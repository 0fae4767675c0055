//! Client-side balancing across a drafter pool, on loopback: two drafter processes on
//! 127.0.0.2:PORT and 127.0.0.3:PORT behind one name, as a headless Service's DNS name resolves to
//! every drafter pod. No name resolves to two loopback addresses here, so the verifier is given
//! the name's addresses with `GLANCE_DRAFTER_RESOLVE` (no /etc/hosts edit).
//!
//! The verifier starts while only the first drafter is up; the second joins the pool at the next
//! re-resolution. Sessions then spread over both, each pinned to one drafter for its whole
//! generation (its rounds all land on one drafter). Killing a drafter under a session pinned to it
//! loses no request, and speculation goes on with the other one. Every output equals greedy.

use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_tests::process::ServiceProcess;
use glance_tests::suite::{self, SuitePrompt};
use glance_tests::{fixtures, free_port, metric, scrape};
use tonic::transport::Channel;

const POOL_NAME: &str = "drafter-pool.glance.test";
const POOL_IPS: [&str; 2] = ["127.0.0.2", "127.0.0.3"];
const PROMPTS: usize = 12;
/// Long generations (for the kill) use a small tree, so they last many rounds.
const LONG_TOKENS: u32 = 160;
const LONG_TREE_BUDGET: u32 = 4;
const SHORT_TOKENS: u32 = 24;
/// Each drafter round takes this long (a stand-in for a real head's forward).
const ROUND_MS: &str = "30";
const MEASURED_SESSIONS: usize = 40;
/// The verifier re-resolves every 5 s; joining takes at most that plus a handshake.
const JOIN_LIMIT: Duration = Duration::from_secs(30);
/// The verifier's reconnect backoff is at most 2 s.
const RECOVERY_LIMIT: Duration = Duration::from_secs(10);

/// A port free on both pool addresses (the pods of a headless Service share their port).
fn shared_port() -> u16 {
    for _ in 0..50 {
        let first = TcpListener::bind((POOL_IPS[0], 0)).expect("loopback address 127.0.0.2");
        let port = first.local_addr().unwrap().port();
        if TcpListener::bind((POOL_IPS[1], port)).is_ok() {
            return port;
        }
    }
    panic!("no port is free on both {POOL_IPS:?}");
}

/// One drafter "pod": an oracle drafter on a pool address, with its metrics port.
struct Pod {
    process: ServiceProcess,
    metrics_port: u16,
}

impl Pod {
    fn start(ip: &str, port: u16, oracle: &Path) -> Self {
        let metrics_port = free_port();
        let metrics = format!("127.0.0.1:{metrics_port}");
        let args = [
            "--kind",
            "test-oracle",
            "--oracle-file",
            oracle.to_str().unwrap(),
            "--vocab-size",
            "1024",
            "--metrics-listen",
            &metrics,
            // The oracle answers in microseconds: a real drafter's round time keeps a long
            // generation running long enough to kill its drafter under it.
            "--stall-every",
            "1",
            "--stall-ms",
            ROUND_MS,
        ];
        Self { process: ServiceProcess::drafter_listening(&format!("{ip}:{port}"), &args), metrics_port }
    }

    fn rounds(&self) -> f64 {
        metric(&scrape(self.metrics_port), "glance_drafter_rounds_total")
    }

    fn sessions_open(&self) -> f64 {
        metric(&scrape(self.metrics_port), "glance_drafter_sessions_open")
    }
}

/// A short speculative request and the greedy tokens it must return (greedy's prefix).
fn short(prompt: &SuitePrompt) -> (pb::GenerateRequest, &[i64]) {
    let mut request = suite::request(prompt, pb::DecodingMode::SpeculativeTree, 0);
    request.max_new_tokens = SHORT_TOKENS;
    (request, &prompt.greedy[..prompt.greedy.len().min(SHORT_TOKENS as usize)])
}

async fn generate_short(
    client: &mut GenerationClient<Channel>,
    prompt: &SuitePrompt,
    what: &str,
) -> pb::SpeculativeStats {
    let (request, greedy) = short(prompt);
    let response = client.generate(request).await.expect(what).into_inner();
    let tokens: Vec<i64> = response.token_ids.iter().map(|&t| t as i64).collect();
    assert_eq!(tokens, greedy, "{what}: differs from greedy decoding");
    response.speculative.expect("speculative stats")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_spread_over_the_pool_and_survive_losing_a_drafter() {
    let Some(root) = fixtures() else { return };
    let dir = root.join("tiny-qwen3-vl");
    let prompts = suite::build(&dir, PROMPTS, LONG_TOKENS);
    let oracle = std::env::temp_dir().join(format!("glance-balancing-oracle-{}.json", std::process::id()));
    std::fs::write(&oracle, suite::oracle_json(&prompts)).unwrap();

    let port = shared_port();
    let first = Pod::start(POOL_IPS[0], port, &oracle);
    let drafter_url = format!("http://{POOL_NAME}:{port}");
    let resolve = format!("{POOL_NAME}={}", POOL_IPS.join(","));
    let verifier = ServiceProcess::verifier_with_env(
        &dir,
        &["--drafter", &drafter_url],
        &[("GLANCE_DRAFTER_RESOLVE", &resolve)],
    );
    let mut client = GenerationClient::connect(verifier.url.clone()).await.expect("connect");

    // The second drafter comes up after the verifier, as a scaled-up pod would.
    let mut pods = [first, Pod::start(POOL_IPS[1], port, &oracle)];
    let joined_after = until_pod_joins(&mut client, &prompts, &pods[1]).await;
    println!("second drafter joined the pool after {:.1} s", joined_after.as_secs_f64());

    let split = measure_split(&mut client, &prompts, &pods).await;
    println!(
        "sessions per drafter over {MEASURED_SESSIONS}: {} on {}, {} on {}",
        split[0], POOL_IPS[0], split[1], POOL_IPS[1]
    );
    for (count, ip) in split.iter().zip(POOL_IPS) {
        assert!(
            *count >= MEASURED_SESSIONS / 5,
            "drafter {ip} served only {count} of {MEASURED_SESSIONS} sessions"
        );
    }

    let (killed, killed_at) = kill_under_a_pinned_session(&mut client, &prompts, &mut pods, 1).await;
    println!(
        "killed mid-stream: {} drafted rounds, {} fallback rounds, output identical",
        killed.rounds, killed.fallback_rounds
    );
    assert!(killed.fallback_rounds > 0, "the killed drafter's session never failed: {killed:?}");

    let resumed_after = speculation_goes_on_with(&mut client, &prompts, &pods[0], killed_at).await;
    println!(
        "speculation resumed on the surviving drafter {:.2} s after the kill",
        resumed_after.as_secs_f64()
    );
}

/// Sends short requests until `pod` has drafted a round; returns how long that took.
async fn until_pod_joins(
    client: &mut GenerationClient<Channel>,
    prompts: &[SuitePrompt],
    pod: &Pod,
) -> Duration {
    let started = Instant::now();
    for prompt in prompts.iter().cycle() {
        if pod.rounds() > 0.0 {
            break;
        }
        assert!(started.elapsed() < JOIN_LIMIT, "the second drafter never joined the pool");
        generate_short(client, prompt, "while the second drafter joins").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    started.elapsed()
}

/// Sends sequential short requests and attributes each session to the drafter whose round count
/// grew: exactly one must (a session is pinned to its drafter). Returns sessions per drafter.
async fn measure_split(
    client: &mut GenerationClient<Channel>,
    prompts: &[SuitePrompt],
    pods: &[Pod; 2],
) -> [usize; 2] {
    let mut split = [0; 2];
    for (i, prompt) in prompts.iter().cycle().take(MEASURED_SESSIONS).enumerate() {
        let before = pods.each_ref().map(Pod::rounds);
        let stats = generate_short(client, prompt, &format!("session {i}")).await;
        assert_eq!(stats.fallback_rounds, 0, "session {i}: a healthy pool answers every round");
        let grew: Vec<usize> = (0..2).filter(|&p| pods[p].rounds() > before[p]).collect();
        assert_eq!(grew.len(), 1, "session {i}: rounds went to drafters {grew:?}, not to exactly one");
        split[grew[0]] += 1;
    }
    split
}

/// Streams long requests until one is pinned to `pods[victim]`, then kills that drafter while
/// the stream runs; returns the killed request's stats (its tokens must still equal greedy) and
/// when the kill happened.
async fn kill_under_a_pinned_session(
    client: &mut GenerationClient<Channel>,
    prompts: &[SuitePrompt],
    pods: &mut [Pod; 2],
    victim: usize,
) -> (pb::SpeculativeStats, Instant) {
    let long: Vec<&SuitePrompt> = prompts.iter().filter(|p| p.ignore_eos).collect();
    for prompt in long.iter().cycle().take(30) {
        let request = suite::request(prompt, pb::DecodingMode::SpeculativeTree, LONG_TREE_BUDGET);
        let before = pods.each_ref().map(Pod::rounds);
        let mut stream = client.generate_stream(request).await.expect("stream").into_inner();
        let (mut tokens, mut stats, mut decided, mut killed) = (Vec::new(), None, false, None);
        while let Some(chunk) = stream.message().await.expect("the stream must end cleanly") {
            tokens.extend(chunk.token_ids.iter().map(|&t| t as i64));
            if chunk.speculative.is_some() {
                stats = chunk.speculative;
            }
            if !decided {
                // The drafter holding this stream's session is the one whose rounds grow.
                let now = pods.each_ref().map(Pod::rounds);
                let grew = [now[0] > before[0], now[1] > before[1]];
                decided = grew[0] || grew[1];
                let pinned_to_victim = grew[victim] && !grew[1 - victim];
                if pinned_to_victim && pods[victim].sessions_open() >= 1.0 {
                    pods[victim].process.kill();
                    killed = Some(Instant::now());
                }
            }
        }
        assert_eq!(tokens, prompt.greedy, "a long request differs from greedy decoding (killed: {killed:?})");
        if let Some(killed_at) = killed {
            return (stats.expect("the last chunk carries the stats"), killed_at);
        }
    }
    panic!("no long request landed on drafter {} in 30 tries", POOL_IPS[victim]);
}

/// After the kill, speculation resumes on the survivor alone (once the verifier's reconnect
/// backoff has passed): requests draft every round again. Returns how long that took.
async fn speculation_goes_on_with(
    client: &mut GenerationClient<Channel>,
    prompts: &[SuitePrompt],
    survivor: &Pod,
    killed_at: Instant,
) -> Duration {
    let before = survivor.rounds();
    let mut requests = prompts.iter().cycle().enumerate();
    let resumed_after = loop {
        let (i, prompt) = requests.next().unwrap();
        let stats = generate_short(client, prompt, &format!("after the kill, request {i}")).await;
        if stats.rounds > 0 && stats.fallback_rounds == 0 {
            break killed_at.elapsed();
        }
        assert!(killed_at.elapsed() < RECOVERY_LIMIT, "speculation did not resume on the surviving drafter");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for (i, prompt) in requests.take(10) {
        let stats = generate_short(client, prompt, &format!("after the kill, request {i}")).await;
        assert_eq!(stats.fallback_rounds, 0, "request {i}: the pool of one did not answer every round");
    }
    assert!(survivor.rounds() > before, "the surviving drafter drafted nothing after the kill");
    resumed_after
}
