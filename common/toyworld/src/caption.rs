//! `caption`: one to four coloured shapes on a plain background, described in one sentence. The
//! facts come from the image; the phrasing and the order of the shapes come from the seed, so the
//! target keeps real entropy at the choice points (as COCO captions do).

use super::canvas::{Canvas, Rect, Shape};
use super::lexicon::{article, capitalize, count_word, join_list, Named, BACKGROUNDS, SHAPE_COLOURS};
use super::Parts;
use glance_train::rng::Rng;

pub(crate) const WIDTH: u32 = 256;
pub(crate) const HEIGHT: u32 = 128;
/// Shapes sit in a 4 x 2 grid of 64-px slots (2 x 2 visual tokens each), so they never touch.
const SLOT: i32 = 64;
const SLOTS_X: usize = (WIDTH as i32 / SLOT) as usize;
const SLOTS: usize = SLOTS_X * (HEIGHT as i32 / SLOT) as usize;
const MAX_SHAPES: u32 = 4;

const PROMPTS: [&str; 3] = ["Describe the image.", "What is in the picture?", "Describe the picture."];

/// One drawn shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item {
    pub colour: Named,
    pub shape: Shape,
}

impl Item {
    /// `a red square`, `an orange circle`.
    fn phrase(self) -> String {
        let colour = self.colour.name;
        format!("{} {colour} {}", article(colour), self.shape.name())
    }
}

pub(crate) fn generate(rng: &mut Rng) -> Parts {
    let mut canvas = Canvas::new(WIDTH, HEIGHT, *rng.pick(&BACKGROUNDS));
    let items = draw_shapes(rng, &mut canvas);
    let prompt = rng.pick(&PROMPTS).to_string();
    let answer = describe(rng, &items);
    Parts { image: canvas.into_image(), prompt, answer }
}

/// Draws 1–4 shapes with distinct (colour, shape) pairs in distinct slots; also the story
/// task's (irrelevant) scene.
pub(crate) fn draw_shapes(rng: &mut Rng, canvas: &mut Canvas) -> Vec<Item> {
    let n = rng.range(1, MAX_SHAPES) as usize;
    let slots = rng.distinct(SLOTS, n);
    let kinds = rng.distinct(SHAPE_COLOURS.len() * Shape::ALL.len(), n);
    slots
        .into_iter()
        .zip(kinds)
        .map(|(slot, kind)| {
            let item = Item {
                colour: SHAPE_COLOURS[kind % SHAPE_COLOURS.len()],
                shape: Shape::ALL[kind / SHAPE_COLOURS.len()],
            };
            canvas.shape(item.shape, place_in_slot(rng, slot), item.colour.rgb);
            item
        })
        .collect()
}

/// A 36–56 px square box somewhere inside slot `slot`.
fn place_in_slot(rng: &mut Rng, slot: usize) -> Rect {
    let size = rng.range(36, 56) as i32;
    let x = (slot % SLOTS_X) as i32 * SLOT + rng.range(0, (SLOT - size) as u32) as i32;
    let y = (slot / SLOTS_X) as i32 * SLOT + rng.range(0, (SLOT - size) as u32) as i32;
    Rect::new(x, y, size, size)
}

/// One of four phrasings, shapes in a random order.
fn describe(rng: &mut Rng, items: &[Item]) -> String {
    let mut order: Vec<Item> = items.to_vec();
    rng.shuffle(&mut order);
    let list = join_list(&order.iter().map(|i| i.phrase()).collect::<Vec<_>>());
    let n = items.len();
    let plural = if n == 1 { "" } else { "s" };
    match rng.below(4) {
        0 if n == 1 => format!("There is {list}."),
        0 => format!("There are {} shapes: {list}.", count_word(n)),
        1 => format!("{}.", capitalize(&list)),
        2 => format!("I see {} shape{plural}: {list}.", count_word(n)),
        _ => format!("The image shows {list}."),
    }
}
