//! `chart`: a bar chart of 3–5 labelled bars whose values (1–9) are drawn both as bar heights and
//! as digits above the bars; the answer lists `label: value` left to right (ChartQA-like). Wider
//! than the other images (320 px) so that five three-letter labels keep a blank cell between them.

use super::canvas::{Canvas, Rect, CELL_H, CELL_W};
use super::lexicon::{BACKGROUNDS, INKS, LABELS, SHAPE_COLOURS};
use super::Parts;
use glance_train::rng::Rng;

pub(crate) const WIDTH: u32 = 320;
pub(crate) const HEIGHT: u32 = 192;
const COLS: u32 = WIDTH / CELL_W;
/// Each bar owns four glyph columns (64 px): a three-letter label and a blank column.
const SLOT_COLS: u32 = 4;
/// Values on the top token row, labels on the bottom one, bars in the four rows between.
const VALUE_ROW_Y: i32 = 0;
const LABEL_ROW_Y: i32 = 5 * CELL_H as i32;
const BASELINE_Y: i32 = LABEL_ROW_Y - 2;
/// Pixels per unit of value: 9 units reach the top of the bar area (y = 32).
const UNIT_PX: i32 = 14;
const PROMPTS: [&str; 3] =
    ["Read the chart.", "List the bars and their values.", "What does the chart show?"];

struct Bar {
    label: String,
    value: u32,
}

pub(crate) fn generate(rng: &mut Rng) -> Parts {
    let n = rng.range(3, 5);
    let bars = bars(rng, n as usize);
    let first_col = rng.range(0, COLS - SLOT_COLS * n);
    let image = draw(rng, &bars, first_col);
    let answer = bars.iter().map(|b| format!("{}: {}", b.label, b.value)).collect::<Vec<_>>().join(", ");
    Parts { image, prompt: rng.pick(&PROMPTS).to_string(), answer }
}

/// Distinct labels: three-letter words, or single letters (as in `a: 3, b: 7`).
fn bars(rng: &mut Rng, n: usize) -> Vec<Bar> {
    let labels: Vec<String> = if rng.percent(60) {
        rng.distinct(LABELS.len(), n).into_iter().map(|i| LABELS[i].to_string()).collect()
    } else {
        rng.distinct(26, n).into_iter().map(|i| char::from(b'a' + i as u8).to_string()).collect()
    };
    labels.into_iter().map(|label| Bar { label, value: rng.range(1, 9) }).collect()
}

fn draw(rng: &mut Rng, bars: &[Bar], first_col: u32) -> image::RgbImage {
    let mut canvas = Canvas::new(WIDTH, HEIGHT, *rng.pick(&BACKGROUNDS));
    let ink = *rng.pick(&INKS);
    let same_colour = rng.percent(50).then(|| rng.pick(&SHAPE_COLOURS).rgb);
    for (i, bar) in bars.iter().enumerate() {
        let slot_col = first_col + SLOT_COLS * i as u32;
        let slot_x = (slot_col * CELL_W) as i32;
        let height = bar.value as i32 * UNIT_PX;
        let colour = same_colour.unwrap_or_else(|| rng.pick(&SHAPE_COLOURS).rgb);
        canvas.fill(Rect::new(slot_x + 8, BASELINE_Y - height, 32, height), colour);
        let value_x = slot_x + CELL_W as i32;
        canvas.text(value_x, VALUE_ROW_Y, &bar.value.to_string(), ink);
        let label_col = slot_col + (SLOT_COLS - bar.label.len() as u32) / 2;
        canvas.text((label_col * CELL_W) as i32, LABEL_ROW_Y, &bar.label, ink);
    }
    let axis_x = (first_col * CELL_W) as i32;
    let axis_w = ((SLOT_COLS * bars.len() as u32 - 1) * CELL_W) as i32;
    canvas.fill(Rect::new(axis_x, BASELINE_Y, axis_w, 2), ink);
    canvas.into_image()
}
