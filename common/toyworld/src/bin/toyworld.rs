//! `toyworld`: the toy world's command line — train the tiny target from its seed, evaluate a
//! trained one, or dump samples to look at.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use glance_input::{PromptBuilder, PromptOptions};
use glance_models::TargetModel;
use glance_toyworld::target::{evaluate_with_entropy, format_scores, train_target, TargetSpec, TrainOptions};
use glance_toyworld::{sample, Split, Task};

#[derive(Parser)]
#[command(name = "toyworld", about = "The toy world: train and evaluate the tiny grounded target")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train the toy target from scratch into --out (tokenizer, config, bf16 weights).
    TrainTarget {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 4000)]
        steps: usize,
        /// Samples packed per step.
        #[arg(long, default_value_t = 8)]
        pack: usize,
        #[arg(long, default_value_t = 2e-3)]
        lr: f64,
        #[arg(long, default_value_t = 500)]
        eval_every: usize,
        #[arg(long, default_value_t = 32)]
        eval_samples: u64,
        /// Stop once sign, doc and chart all reach this held-out exact match at an evaluation.
        #[arg(long)]
        stop_at: Option<f64>,
        #[arg(long)]
        threads: Option<i32>,
    },
    /// Writes one held-out sample's image as PNG and prints its prompt and expected answer.
    Sample {
        #[arg(long, default_value = "doc")]
        task: Task,
        #[arg(long, default_value_t = 0)]
        index: u64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The PNG to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// Held-out exact match per task of a trained target.
    Eval {
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 100)]
        samples: u64,
    },
}

fn main() {
    let result = match Cli::parse().command {
        Command::TrainTarget { out, seed, steps, pack, lr, eval_every, eval_samples, stop_at, threads } => {
            let options = TrainOptions {
                seed,
                steps,
                pack,
                peak_lr: lr,
                eval_every,
                eval_samples,
                stop_at,
                threads,
                ..TrainOptions::default()
            };
            train_target(&out, &TargetSpec::default(), &options, |line| println!("{line}"))
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
        Command::Eval { model, seed, samples } => eval(&model, seed, samples),
        Command::Sample { task, index, seed, out } => write_sample(task, index, seed, &out),
    };
    if let Err(e) = result {
        eprintln!("toyworld: {e}");
        std::process::exit(1);
    }
}

fn write_sample(task: Task, index: u64, seed: u64, out: &std::path::Path) -> Result<(), String> {
    let s = sample(Split::HeldOut, task, seed, index);
    std::fs::write(out, s.png()).map_err(|e| format!("{}: {e}", out.display()))?;
    println!("prompt: {}\nexpected answer:\n{}", s.prompt, s.answer);
    Ok(())
}

fn eval(dir: &std::path::Path, seed: u64, samples: u64) -> Result<(), String> {
    let prompts = PromptBuilder::from_model_dir(dir, PromptOptions::default()).map_err(|e| e.to_string())?;
    let model = TargetModel::load(dir, tch::Kind::Float, tch::Device::Cpu).map_err(|e| e.to_string())?;
    let (scores, entropy) = evaluate_with_entropy(&model, &prompts, seed, samples);
    println!("held-out exact match ({samples} per task): {}", format_scores(&scores));
    let line: Vec<String> = entropy.iter().map(|(t, h)| format!("{t} {h:.3}")).collect();
    println!("mean next-token entropy along the greedy answers (nats): {}", line.join(", "));
    Ok(())
}
