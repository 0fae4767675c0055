//! Load and soak on loopback: both services as processes (the committed toy target and head),
//! N concurrent clients for a fixed time mixing decoding modes, images (every toy-world request
//! carries one), unary and streaming calls, some streams cancelled after their first chunk, and the
//! drafter killed and restarted twice mid-run. Every completed output is checked against the
//! greedy (autoregressive) tokens of the same request. Reports requests completed / refused /
//! cancelled / failed, latency percentiles, how fast overload was refused, and the verifier's and
//! drafter's RSS; exits non-zero on any failed or wrong request. Bounded: it stops by itself.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_tests::bench::{self, Mode};
use glance_tests::process::ServiceProcess;
use glance_toyworld::{sample, Split, Task};
use serde_json::json;
use tonic::Code;

#[derive(Parser)]
#[command(
    about = "Load and soak: concurrent mixed requests, drafter restarts, every output checked against greedy"
)]
struct Args {
    #[arg(long, default_value = "models/toy-target")]
    target: PathBuf,
    #[arg(long, default_value = "models/toy-head")]
    head: PathBuf,
    /// Concurrent clients.
    #[arg(long, default_value_t = 6)]
    clients: usize,
    /// How long the load runs.
    #[arg(long, default_value_t = 120)]
    seconds: u64,
    /// Drafter restarts, spread evenly over the run.
    #[arg(long, default_value_t = 2)]
    drafter_restarts: usize,
    /// Distinct held-out prompts (their greedy tokens are computed first).
    #[arg(long, default_value_t = 10)]
    prompts: u64,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: u32,
    /// Verifier engine threads and queue: with more clients than both, some requests are refused.
    #[arg(long, default_value_t = 2)]
    max_concurrent: usize,
    #[arg(long, default_value_t = 2)]
    max_queue: usize,
    #[arg(long, default_value = "bench-soak.json")]
    json: PathBuf,
}

/// What became of one request.
enum Outcome {
    Completed { latency: Duration, correct: bool },
    Refused(Duration),
    Cancelled,
    Failed(String),
}

#[derive(Default)]
struct Tally {
    latencies: Vec<f64>,
    refusals: Vec<f64>,
    wrong: usize,
    cancelled: usize,
    failures: Vec<String>,
}

impl Tally {
    fn add(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::Completed { latency, correct } => {
                self.latencies.push(latency.as_secs_f64() * 1e3);
                self.wrong += usize::from(!correct);
            }
            Outcome::Refused(after) => self.refusals.push(after.as_secs_f64() * 1e3),
            Outcome::Cancelled => self.cancelled += 1,
            Outcome::Failed(why) => self.failures.push(why),
        }
    }
}

fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Resident set size of a process, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

fn request(prompt: &pb::GenerateRequest, mode: &Mode) -> pb::GenerateRequest {
    pb::GenerateRequest {
        decoding: Some(bench::decoding(mode, bench::Sampling::GREEDY, 0)),
        ..prompt.clone()
    }
}

/// One request as client `client`'s `n`-th: unary or streaming, and every fifth stream dropped
/// after its first chunk.
async fn run_one(
    client: &mut GenerationClient<tonic::transport::Channel>,
    request: pb::GenerateRequest,
    expected: &[u32],
    n: usize,
) -> Outcome {
    let started = Instant::now();
    let refused_or_failed = |status: tonic::Status| match status.code() {
        Code::ResourceExhausted => Outcome::Refused(started.elapsed()),
        _ => Outcome::Failed(format!("{:?}: {}", status.code(), status.message())),
    };
    if n.is_multiple_of(2) {
        return match client.generate(request).await {
            Ok(r) => Outcome::Completed {
                latency: started.elapsed(),
                correct: r.into_inner().token_ids == expected,
            },
            Err(status) => refused_or_failed(status),
        };
    }
    let mut stream = match client.generate_stream(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => return refused_or_failed(status),
    };
    let mut tokens = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => {
                tokens.extend(chunk.token_ids);
                if n % 5 == 1 {
                    return Outcome::Cancelled; // dropping the stream cancels the generation
                }
            }
            Ok(None) => {
                return Outcome::Completed { latency: started.elapsed(), correct: tokens == expected }
            }
            Err(status) => return refused_or_failed(status),
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let env = [("OMP_NUM_THREADS", "1")];
    let (head, target) = (args.head.to_str().expect("utf-8"), args.target.to_str().expect("utf-8"));
    let drafter_args = ["--kind", "block-head", "--head", head, "--target", target];
    let mut drafter = ServiceProcess::drafter_with_env(&drafter_args, &env);
    let drafter_addr = drafter.addr().to_string();
    let verifier = ServiceProcess::verifier_with_env(
        &args.target,
        &[
            "--drafter",
            &drafter.url,
            "--max-concurrent",
            &args.max_concurrent.to_string(),
            "--max-queue",
            &args.max_queue.to_string(),
            "--drafter-deadline-ms",
            "500",
        ],
        &env,
    );
    let mut client = GenerationClient::connect(verifier.url.clone()).await.expect("connect");
    // The greedy tokens of every prompt, the reference every completed output must equal.
    let modes = bench::modes(&[15]);
    let mut prompts = Vec::new();
    for index in 0..args.prompts {
        let task = Task::ALL[index as usize % Task::ALL.len()];
        let s = sample(Split::HeldOut, task, 7, index);
        let base = pb::GenerateRequest {
            messages: glance_tests::suite::to_proto(&s.messages()),
            max_new_tokens: args.max_new_tokens,
            stop: vec![],
            decoding: None,
        };
        let greedy =
            client.generate(request(&base, &modes[0])).await.expect("reference").into_inner().token_ids;
        prompts.push((base, greedy));
    }
    let prompts = Arc::new(prompts);
    let rss_start = (rss_mib(verifier.pid()), rss_mib(drafter.pid()));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let per_mode = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut clients = Vec::new();
    for c in 0..args.clients {
        let (url, prompts, tally, per_mode, stop, modes) = (
            verifier.url.clone(),
            Arc::clone(&prompts),
            Arc::clone(&tally),
            Arc::clone(&per_mode),
            Arc::clone(&stop),
            modes.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut client = GenerationClient::connect(url).await.expect("connect");
            let mut n = c;
            while !stop.load(Ordering::SeqCst) {
                let (prompt, expected) = &prompts[n % prompts.len()];
                let mode = &modes[(n / prompts.len() + c) % modes.len()];
                let outcome = run_one(&mut client, request(prompt, mode), expected, n).await;
                let refused = matches!(outcome, Outcome::Refused(_));
                if matches!(outcome, Outcome::Completed { .. }) {
                    *per_mode.lock().unwrap().entry(mode.name.clone()).or_default() += 1;
                }
                tally.lock().unwrap().add(outcome);
                if refused {
                    // As a client would: a short pause before trying again.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                n += args_clients_stride(c);
            }
        }));
    }
    // The drafter is killed and restarted on its address, evenly over the run; the verifier's
    // RSS is sampled at the end of the first minute (of the first fifth of a shorter run) for
    // the growth figure.
    let run = Duration::from_secs(args.seconds);
    let warm_at = if run >= Duration::from_secs(120) { Duration::from_secs(60) } else { run / 5 };
    let mut restarts = 0;
    let mut rss_warm = None;
    while started.elapsed() < run {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let due = (started.elapsed().as_secs_f64() / run.as_secs_f64() * (args.drafter_restarts + 1) as f64)
            as usize;
        if restarts < args.drafter_restarts && due > restarts {
            drafter.kill();
            tokio::time::sleep(Duration::from_millis(500)).await;
            drafter = ServiceProcess::drafter_listening(&drafter_addr, &drafter_args);
            restarts += 1;
            println!("soak: drafter restarted ({restarts}) at {:.0} s", started.elapsed().as_secs_f64());
        }
        if rss_warm.is_none() && started.elapsed() > warm_at {
            rss_warm = Some(rss_mib(verifier.pid()));
        }
    }
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        let _ = c.await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let rss_end = (rss_mib(verifier.pid()), rss_mib(drafter.pid()));
    let rss_warm = rss_warm.unwrap_or(rss_start.0);
    // The server still serves the greedy tokens after all that.
    let (prompt, expected) = &prompts[0];
    let after = client.generate(request(prompt, &modes[1])).await.map(|r| r.into_inner().token_ids);
    let tally = tally.lock().unwrap();
    let completed = tally.latencies.len();
    let report = json!({
        "seconds": elapsed,
        "clients": args.clients,
        "drafter_restarts": restarts,
        "completed": completed,
        "completed_per_mode": *per_mode.lock().unwrap(),
        "wrong": tally.wrong,
        "refused": tally.refusals.len(),
        "cancelled": tally.cancelled,
        "failed": tally.failures.len(),
        "failures": tally.failures.iter().take(10).collect::<Vec<_>>(),
        "latency_ms": {"p50": percentile(&tally.latencies, 0.5), "p99": percentile(&tally.latencies, 0.99)},
        "refusal_ms": {"p50": percentile(&tally.refusals, 0.5), "p99": percentile(&tally.refusals, 0.99), "max": percentile(&tally.refusals, 1.0)},
        "verifier_rss_mib": {"start": rss_start.0, "warm": rss_warm, "end": rss_end.0, "growth_after_warm_pct": (rss_end.0 / rss_warm - 1.0) * 100.0},
        "drafter_rss_mib": {"start": rss_start.1, "end_of_last_process": rss_end.1},
        "served_greedy_after": after.as_ref().is_ok_and(|t| t == expected),
    });
    std::fs::write(&args.json, serde_json::to_string_pretty(&report).unwrap()).expect("json");
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    let ok = tally.failures.is_empty()
        && tally.wrong == 0
        && completed > 0
        && after.as_ref().is_ok_and(|t| t == expected);
    if !ok {
        eprintln!("soak: FAILED (failed or wrong requests, nothing completed, or the server stopped serving greedy tokens)");
        std::process::exit(1);
    }
}

/// Clients step through the prompts and modes with different strides so that at any moment they
/// ask for different things.
fn args_clients_stride(client: usize) -> usize {
    1 + client % 3
}
