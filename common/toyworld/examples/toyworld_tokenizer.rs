//! Trains the toy tokenizer into a directory, then prints per-task token counts: the answer
//! (with its `<|im_end|>`) and the whole training sequence (chat template + visual tokens +
//! prompt + answer) over held-out samples.
//!
//! cargo run --release -p glance-toyworld --example toyworld_tokenizer -- --out DIR [--seed 0]
//!     [--samples 500]

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use glance_input::{ChatTemplate, TemplateMessage, TemplatePart};
use glance_toyworld::tokenizer::{answer_ids, train_tokenizer, QWEN3_VL_CHAT_TEMPLATE};
use glance_toyworld::{sample, Split, Task};
use tokenizers::Tokenizer;

fn main() -> Result<()> {
    let (out, seed, samples) = parse_args()?;
    let start = Instant::now();
    let trained = train_tokenizer(&out, seed)?;
    println!(
        "trained on {} text pieces in {:.2} s: vocabulary {} (written to {})",
        trained.corpus_texts,
        start.elapsed().as_secs_f64(),
        trained.vocab_size,
        out.display()
    );
    let template = ChatTemplate::from_source(QWEN3_VL_CHAT_TEMPLATE)?;
    println!("(held-out, {samples} each; token counts min/mean/max; answer includes <|im_end|>)");
    println!("task     visual  prompt            answer            whole sequence");
    for task in Task::ALL {
        let stats = task_stats(&trained.tokenizer, &template, task, seed, samples)?;
        println!(
            "{:<8} {:>6}  {}  {}  {}",
            task.name(),
            task.visual_tokens(),
            stats.prompt,
            stats.answer,
            stats.sequence
        );
    }
    Ok(())
}

fn parse_args() -> Result<(PathBuf, u64, u64)> {
    let (mut out, mut seed, mut samples) = (None, 0, 500);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => out = Some(PathBuf::from(value)),
            "--seed" => seed = value.parse().context("--seed")?,
            "--samples" => samples = value.parse().context("--samples")?,
            other => bail!("unknown flag {other:?} (expected --out, --seed, --samples)"),
        }
    }
    let out = out.context("usage: toyworld_tokenizer --out DIR [--seed S] [--samples N]")?;
    Ok((out, seed, samples))
}

#[derive(Default)]
struct Range {
    min: usize,
    max: usize,
    sum: usize,
    n: usize,
}

impl Range {
    fn add(&mut self, v: usize) {
        self.min = if self.n == 0 { v } else { self.min.min(v) };
        self.max = self.max.max(v);
        self.sum += v;
        self.n += 1;
    }

    fn mean(&self) -> f64 {
        self.sum as f64 / self.n.max(1) as f64
    }
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:>4} {:>6.1} {:>4}", self.min, self.mean(), self.max)
    }
}

struct Stats {
    prompt: Range,
    answer: Range,
    sequence: Range,
}

fn task_stats(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    task: Task,
    seed: u64,
    samples: u64,
) -> Result<Stats> {
    let mut stats = Stats { prompt: Range::default(), answer: Range::default(), sequence: Range::default() };
    for index in 0..samples {
        let s = sample(Split::HeldOut, task, seed, index);
        let prompt = tokenizer.encode(s.prompt.as_str(), false).map_err(anyhow::Error::msg)?;
        stats.prompt.add(prompt.len());
        let answer = answer_ids(tokenizer, &s.answer).map_err(anyhow::Error::msg)?;
        stats.answer.add(answer.len());
        let text = template.render(&conversation(&s.prompt, &s.answer), false)?;
        let ids = tokenizer.encode(text, false).map_err(anyhow::Error::msg)?;
        // The one image placeholder becomes `visual_tokens` image tokens.
        stats.sequence.add(ids.len() - 1 + task.visual_tokens() as usize);
    }
    Ok(stats)
}

fn conversation(prompt: &str, answer: &str) -> Vec<TemplateMessage> {
    let text = |t: &str| TemplatePart::Text { text: t.into() };
    vec![
        TemplateMessage { role: "user".into(), content: vec![TemplatePart::Image, text(prompt)].into() },
        TemplateMessage { role: "assistant".into(), content: vec![text(answer)].into() },
    ]
}
