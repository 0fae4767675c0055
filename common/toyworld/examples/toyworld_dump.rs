//! Writes toy-world samples for a person to look at: one PNG per sample and `samples.jsonl`
//! (task, split, index, seed, prompt, answer, image file).
//!
//! cargo run --release -p glance-toyworld --example toyworld_dump -- --out DIR [--per-task 4]
//!     [--seed 0] [--split train|held_out]

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use glance_toyworld::{sample, Split, Task};

struct Args {
    out: PathBuf,
    per_task: u64,
    seed: u64,
    split: Split,
}

fn parse_args() -> Result<Args> {
    let mut args = Args { out: PathBuf::new(), per_task: 4, seed: 0, split: Split::Train };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => args.out = PathBuf::from(value),
            "--per-task" => args.per_task = value.parse().context("--per-task")?,
            "--seed" => args.seed = value.parse().context("--seed")?,
            "--split" => {
                args.split = match value.as_str() {
                    "train" => Split::Train,
                    "held_out" => Split::HeldOut,
                    other => bail!("--split {other:?}: expected train or held_out"),
                }
            }
            other => bail!("unknown flag {other:?} (expected --out, --per-task, --seed, --split)"),
        }
    }
    if args.out.as_os_str().is_empty() {
        bail!("usage: toyworld_dump --out DIR [--per-task N] [--seed S] [--split train|held_out]");
    }
    Ok(args)
}

fn main() -> Result<()> {
    let args = parse_args()?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("{}", args.out.display()))?;
    let jsonl_path = args.out.join("samples.jsonl");
    let mut jsonl =
        std::fs::File::create(&jsonl_path).with_context(|| format!("{}", jsonl_path.display()))?;
    for task in Task::ALL {
        for index in 0..args.per_task {
            let s = sample(args.split, task, args.seed, index);
            let file = format!("{}_{}_{index:04}.png", task.name(), args.split.name());
            std::fs::write(args.out.join(&file), s.png()).with_context(|| file.clone())?;
            let row = serde_json::json!({
                "task": task.name(),
                "split": args.split.name(),
                "index": index,
                "seed": s.seed.to_string(),
                "prompt": s.prompt,
                "answer": s.answer,
                "image": file,
            });
            writeln!(jsonl, "{row}")?;
        }
    }
    println!("wrote {} samples to {}", args.per_task * Task::ALL.len() as u64, args.out.display());
    Ok(())
}
