//! `sign`: a sign on a post, or a label on a box, holding a word or a number; the question names
//! the holder and fixes the answer's form, so the answer is a pure function of image and prompt
//! (TextVQA-like: short, copied from the image).

use super::canvas::{Canvas, Rect, CELL_H, CELL_W};
use super::lexicon::{number, BACKGROUNDS, GROUNDS, INKS, PAPERS, SHAPE_COLOURS, SKIES, WOODS, WORDS};
use super::Parts;
use glance_train::rng::Rng;

pub(crate) const WIDTH: u32 = 256;
pub(crate) const HEIGHT: u32 = 128;
const COLS: u32 = WIDTH / CELL_W;
/// Longest text: one cell of margin each side of the board inside the 16-cell width.
const MAX_TEXT: usize = 12;
/// The board/label extends this far past the text cells, so text cells hold only glyph and board.
const BOARD_MARGIN: i32 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    Sign,
    Label,
}

impl Holder {
    fn noun(self) -> &'static str {
        match self {
            Holder::Sign => "sign",
            Holder::Label => "label",
        }
    }
}

pub(crate) fn generate(rng: &mut Rng) -> Parts {
    let holder = if rng.percent(50) { Holder::Sign } else { Holder::Label };
    let text = sign_text(rng);
    let cells = text_cells(rng, text.len());
    let mut canvas = match holder {
        Holder::Sign => sign_scene(rng, cells),
        Holder::Label => label_scene(rng, cells),
    };
    maybe_sun(rng, &mut canvas, cells.grown(BOARD_MARGIN + 16));
    canvas.text(cells.x, cells.y, &text, *rng.pick(&INKS));
    let (prompt, answer) = question(rng, holder, &text);
    Parts { image: canvas.into_image(), prompt, answer }
}

/// A word, a number, or two short items (`exit 4`, `milk bread`), at most [`MAX_TEXT`] chars.
fn sign_text(rng: &mut Rng) -> String {
    loop {
        let roll = rng.below(100);
        let text = if roll < 45 {
            rng.pick(&WORDS).to_string()
        } else if roll < 75 {
            let digits = rng.range(1, 4);
            number(rng, digits)
        } else {
            let second = if rng.percent(50) {
                rng.pick(&WORDS).to_string()
            } else {
                let digits = rng.range(1, 2);
                number(rng, digits)
            };
            format!("{} {second}", rng.pick(&WORDS))
        };
        if text.len() <= MAX_TEXT {
            return text;
        }
    }
}

/// The text's cell box: grid-aligned (whole patches horizontally, whole token rows vertically),
/// at a random column and row so the target has to find it.
fn text_cells(rng: &mut Rng, len: usize) -> Rect {
    let col = rng.range(1, COLS - 1 - len as u32);
    let row = rng.range(0, 2);
    Rect::new((col * CELL_W) as i32, (row * CELL_H) as i32, (len as u32 * CELL_W) as i32, CELL_H as i32)
}

fn sign_scene(rng: &mut Rng, cells: Rect) -> Canvas {
    let mut canvas = Canvas::new(WIDTH, HEIGHT, *rng.pick(&SKIES));
    let ground_top = rng.range(100, 112) as i32;
    canvas.fill(Rect::new(0, ground_top, WIDTH as i32, HEIGHT as i32 - ground_top), *rng.pick(&GROUNDS));
    let board = cells.grown(BOARD_MARGIN);
    let wood = *rng.pick(&WOODS);
    let post_x = board.x + board.w / 2 - 3;
    canvas.fill(Rect::new(post_x, board.y + board.h, 6, HEIGHT as i32), wood);
    canvas.fill(board, *rng.pick(&PAPERS));
    canvas.frame(board, 2, wood);
    canvas
}

fn label_scene(rng: &mut Rng, cells: Rect) -> Canvas {
    let mut canvas = Canvas::new(WIDTH, HEIGHT, *rng.pick(&BACKGROUNDS));
    let box_colour = if rng.percent(50) { *rng.pick(&WOODS) } else { rng.pick(&SHAPE_COLOURS).rgb };
    canvas.fill(cells.grown(rng.range(14, 24) as i32), box_colour);
    canvas.fill(cells.grown(BOARD_MARGIN - 2), *rng.pick(&PAPERS));
    canvas
}

/// Sometimes a sun in a top corner, away from the text, so not every scene is just a board.
fn maybe_sun(rng: &mut Rng, canvas: &mut Canvas, keep_clear: Rect) {
    if !rng.percent(40) {
        return;
    }
    let size = rng.range(18, 28) as i32;
    let x = if rng.percent(50) { 4 } else { WIDTH as i32 - size - 4 };
    let sun = Rect::new(x, 4, size, size);
    if !sun.overlaps(keep_clear) {
        canvas.shape(super::canvas::Shape::Circle, sun, [245, 200, 40]);
    }
}

/// The question and the answer form it asks for.
fn question(rng: &mut Rng, holder: Holder, text: &str) -> (String, String) {
    let noun = holder.noun();
    match rng.below(3) {
        0 => (format!("What does the {noun} say?"), format!("It says {text}.")),
        1 => (format!("Read the {noun}."), text.to_string()),
        _ => (format!("What is written on the {noun}?"), format!("The {noun} says {text}.")),
    }
}
