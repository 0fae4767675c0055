//! `doc`: a page of 3–5 lines of words and numbers on a desk; the answer is its transcription,
//! line by line. Long, grounded and nearly entropy-free: the best case for speculation (DocVQA).

use super::canvas::{Canvas, Rect, CELL_H, CELL_W};
use super::lexicon::{number, DESKS, INKS, PAPERS, WORDS};
use super::tokenizer::pre_token_count;
use super::Parts;
use glance_train::rng::Rng;

pub(crate) const WIDTH: u32 = 256;
pub(crate) const HEIGHT: u32 = 192;
const COLS: u32 = WIDTH / CELL_W;
const ROWS: u32 = HEIGHT / CELL_H;
/// Every doc answer has at least this many tokens under any BPE on the Qwen2 pre-tokenizer
/// (it has at least this many pre-tokens, see [`pre_token_count`]).
pub(crate) const MIN_ANSWER_TOKENS: usize = 20;
const PROMPTS: [&str; 4] = [
    "Transcribe the document.",
    "Read the document line by line.",
    "What is written on the page?",
    "Copy the text.",
];

pub(crate) fn generate(rng: &mut Rng) -> Parts {
    let n_lines = rng.range(3, 5);
    let first_col = rng.range(1, 2);
    let first_row = rng.range(0, ROWS - n_lines);
    let max_len = (COLS - 1 - first_col) as usize;
    let lines = loop {
        let lines: Vec<String> = (0..n_lines).map(|_| line(rng, max_len)).collect();
        if pre_token_count(&lines.join("\n")) >= MIN_ANSWER_TOKENS {
            break lines;
        }
    };
    let image = draw(rng, &lines, first_col, first_row, max_len);
    Parts { image, prompt: rng.pick(&PROMPTS).to_string(), answer: lines.join("\n") }
}

fn draw(rng: &mut Rng, lines: &[String], col: u32, row: u32, max_len: usize) -> image::RgbImage {
    let mut canvas = Canvas::new(WIDTH, HEIGHT, *rng.pick(&DESKS));
    let widest = lines.iter().map(String::len).max().unwrap_or(1);
    let page_cols = rng.range(widest as u32, max_len as u32);
    let text_box = Rect::new(
        (col * CELL_W) as i32,
        (row * CELL_H) as i32,
        (page_cols * CELL_W) as i32,
        (lines.len() as u32 * CELL_H) as i32,
    );
    let page = text_box.grown(8);
    canvas.fill(Rect::new(page.x + 4, page.y + 4, page.w, page.h), [50, 45, 40]);
    canvas.fill(page, *rng.pick(&PAPERS));
    let ink = *rng.pick(&INKS);
    for (i, text) in lines.iter().enumerate() {
        canvas.text(text_box.x, text_box.y + (i as u32 * CELL_H) as i32, text, ink);
    }
    canvas.into_image()
}

/// One line: `word: number` records or a run of words and numbers, at most `max_len` chars.
fn line(rng: &mut Rng, max_len: usize) -> String {
    let mut items: Vec<String> = Vec::new();
    if rng.percent(30) {
        let digits = rng.range(1, 3);
        items.push(format!("{}: {}", rng.pick(&WORDS), number(rng, digits)));
    }
    let target = rng.range(8, max_len as u32) as usize;
    for _ in 0..8 {
        let item = item(rng);
        let len = joined_len(&items) + item.len() + usize::from(!items.is_empty());
        if len > max_len {
            continue;
        }
        items.push(item);
        if len >= target && items.len() >= 2 {
            break;
        }
    }
    items.join(" ")
}

fn joined_len(items: &[String]) -> usize {
    items.iter().map(String::len).sum::<usize>() + items.len().saturating_sub(1)
}

/// A word (60 %), a number of 1–3 digits (35 %), or a range like `12-40`.
fn item(rng: &mut Rng) -> String {
    let roll = rng.below(100);
    if roll < 60 {
        rng.pick(&WORDS).to_string()
    } else if roll < 95 {
        let digits = rng.range(1, 3);
        number(rng, digits)
    } else {
        let (a, b) = (rng.range(1, 2), rng.range(1, 2));
        format!("{}-{}", number(rng, a), number(rng, b))
    }
}
