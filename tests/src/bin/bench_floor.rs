//! Benchmark: the floor of auto, what the speculative loop costs where it only takes greedy steps.
//! Where drafting cannot pay (a doc page the head reads poorly, a 5-token sign), auto decodes by
//! greedy steps and can only lose its own machinery's cost against plain greedy decoding. Through
//! the services that cost (a few percent) drowns in a shared machine's noise; here one process
//! decodes the same held-out toy-world request, alternating:
//! - `ar`: plain greedy decoding (`greedy_generate`, what the autoregressive mode runs);
//! - `loop`: the speculative loop with no drafter and no taps (its bookkeeping per step);
//! - `taps`: the same keeping each step's tap states for a drafter (the history a round sends);
//! - `auto`: taps and the auto policy (its entropy read and decisions per step).
//!
//! Prompt lookup is not included (it needs a drafter session to stand aside for).

use std::time::Duration;

use clap::Parser;
use glance_input::{PromptBuilder, PromptOptions};
use glance_models::decode::{greedy_generate, Emitted, Generation, GreedyParams, ModelInputs, StepControl};
use glance_models::sampling::Sampling;
use glance_models::TargetModel;
use glance_tests::bench::median;
use glance_toyworld::{sample, Split, Task};
use verifier_svc::policy::RoundPolicy;
use verifier_svc::speculative::{
    measure_verify_costs, speculative_generate, DraftProvider, DraftSession, SpecParams,
};

#[derive(Parser)]
#[command(about = "Auto's floor: the speculative loop's greedy steps against plain greedy decoding")]
struct Args {
    #[arg(long, default_value = "models/toy-target")]
    model: std::path::PathBuf,
    /// Held-out toy-world request of this task (doc: the task auto decodes greedily).
    #[arg(long, default_value = "doc")]
    task: Task,
    #[arg(long, default_value_t = 0)]
    index: u64,
    /// Tokens per request (EOS ignored, so every mode decodes as many).
    #[arg(long, default_value_t = 40)]
    tokens: usize,
    /// Measured requests per mode (the modes take turns).
    #[arg(long, default_value_t = 150)]
    repeats: usize,
    /// Time the whole request (prefill and decode) instead of the decode alone (the prefill keeps
    /// the prompt's tap states too).
    #[arg(long)]
    whole: bool,
}

/// A provider that never opens a session but asks for the toy head's taps: the loop keeps the
/// states a drafter would be sent, and every round is a greedy step.
struct TapsOnly(Vec<usize>);

impl DraftProvider for TapsOnly {
    fn open(&mut self) -> Option<Box<dyn DraftSession>> {
        None
    }

    fn tap_layers(&self) -> &[usize] {
        &self.0
    }

    fn max_depth(&self) -> usize {
        15
    }
}

#[derive(Clone, Copy)]
enum Mode {
    Ar,
    Loop,
    Taps,
    Auto,
}

const MODES: [(Mode, &str); 4] =
    [(Mode::Ar, "ar"), (Mode::Loop, "loop"), (Mode::Taps, "taps"), (Mode::Auto, "auto")];

fn main() {
    let args = Args::parse();
    tch::set_num_threads(1);
    let task = args.task;
    let prompts =
        PromptBuilder::from_model_dir(&args.model, PromptOptions::default()).expect("prompt builder");
    let model = TargetModel::load(&args.model, tch::Kind::Float, tch::Device::Cpu).expect("target");
    let prompt = prompts.build(&sample(Split::HeldOut, task, 0, args.index).messages()).expect("prompt");
    let inputs = prompt.model_inputs();
    let policy = RoundPolicy::with_costs(measure_verify_costs(&model, 32).expect("verify costs"));
    let params = GreedyParams {
        max_new_tokens: args.tokens,
        eos_token_ids: &[],
        context_limit: 1 << 20,
        logprobs: None,
    };
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); MODES.len()];
    for repeat in 0..args.repeats + 5 {
        for ((mode, _), samples) in MODES.iter().zip(&mut times) {
            let time = request_time(&model, &inputs, &params, &policy, *mode, args.whole);
            if repeat >= 5 {
                samples.push(time.as_secs_f64() * 1e3);
            }
        }
    }
    println!(
        "{} tokens of held-out {task:?} request {} ({} prompt tokens), {} requests per mode, f32, one thread, {}",
        args.tokens,
        args.index,
        inputs.input_ids.len(),
        args.repeats,
        if args.whole { "prefill and decode timed" } else { "decode timed" }
    );
    let ar = median(&mut times[0].clone());
    for ((_, name), samples) in MODES.iter().zip(&mut times) {
        let m = median(samples);
        let per_token_us = (m - ar) * 1e3 / args.tokens as f64;
        println!(
            "{name:5} median {m:.3} ms, min {:.3} ms | {:+.2}% against ar, {per_token_us:+.1} µs a token",
            samples[0],
            (m / ar - 1.0) * 100.0
        );
    }
}

/// One request's decode time (with `whole`, prefill and decode).
fn request_time(
    model: &TargetModel,
    inputs: &ModelInputs,
    params: &GreedyParams,
    policy: &RoundPolicy,
    mode: Mode,
    whole: bool,
) -> Duration {
    let spec = SpecParams { budget: 15, branch_k: 4, log_rounds: false, sampling: Sampling::GREEDY };
    let go = |_: Emitted<'_>| StepControl::Continue;
    let (taps, mut policy) = match mode {
        Mode::Ar => return timed(&greedy_generate(model, inputs, params, go).expect("generate"), whole),
        Mode::Loop => (vec![], None),
        Mode::Taps => (vec![0, 1, 2, 3], None),
        Mode::Auto => (vec![0, 1, 2, 3], Some(policy.for_new_request())),
    };
    let (generation, _) =
        speculative_generate(model, inputs, params, spec, &mut TapsOnly(taps), policy.as_mut(), go)
            .expect("speculative loop");
    timed(&generation, whole)
}

fn timed(generation: &Generation, whole: bool) -> Duration {
    generation.decode_time + if whole { generation.prefill_time } else { Duration::ZERO }
}
