//! Integer-only drawing: rectangles, the four shape kinds, and text in the 8x8 bitmap font scaled
//! to one glyph per [`CELL_W`] x [`CELL_H`] cell. Nothing here uses floating point, so a scene
//! renders to the same bytes on every platform.

use image::RgbImage;

/// An RGB colour.
pub(crate) type Rgb = [u8; 3];

/// Width of one glyph cell: one 16-px vision patch.
pub const CELL_W: u32 = 16;
/// Height of one glyph cell: two patches, i.e. one row of merged (32 x 32 px) visual tokens, so
/// every text line fills exactly one token row and each visual token holds two characters.
pub const CELL_H: u32 = 32;
const GLYPH_SCALE_X: u32 = CELL_W / 8;
const GLYPH_SCALE_Y: u32 = CELL_H / 8;

/// Characters the generator ever renders; all other text lives only in prompts and answers.
pub const ALPHABET: &str = "abcdefghijklmnopqrstuvwxyz0123456789 .,:-";

/// Whether `c` can be drawn (see [`ALPHABET`]).
pub fn is_renderable(c: char) -> bool {
    ALPHABET.contains(c)
}

/// A rectangle in pixels; may extend past the canvas (drawing clips).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rect {
    pub x: i32,
    pub y: i32,
    pub w: i32,
    pub h: i32,
}

impl Rect {
    pub(crate) fn new(x: i32, y: i32, w: i32, h: i32) -> Self {
        Self { x, y, w, h }
    }

    /// The rectangle grown by `by` pixels on every side.
    pub(crate) fn grown(self, by: i32) -> Self {
        Self::new(self.x - by, self.y - by, self.w + 2 * by, self.h + 2 * by)
    }

    pub(crate) fn overlaps(self, other: Rect) -> bool {
        self.x < other.x + other.w
            && other.x < self.x + self.w
            && self.y < other.y + other.h
            && other.y < self.y + self.h
    }
}

/// The shapes of the caption world.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Square,
    Circle,
    Triangle,
    Diamond,
    Bar,
}

impl Shape {
    pub(crate) const ALL: [Shape; 5] =
        [Shape::Square, Shape::Circle, Shape::Triangle, Shape::Diamond, Shape::Bar];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Shape::Square => "square",
            Shape::Circle => "circle",
            Shape::Triangle => "triangle",
            Shape::Diamond => "diamond",
            Shape::Bar => "bar",
        }
    }
}

pub(crate) struct Canvas {
    image: RgbImage,
}

impl Canvas {
    pub(crate) fn new(width: u32, height: u32, background: Rgb) -> Self {
        Self { image: RgbImage::from_pixel(width, height, image::Rgb(background)) }
    }

    pub(crate) fn into_image(self) -> RgbImage {
        self.image
    }

    fn put(&mut self, x: i32, y: i32, colour: Rgb) {
        let inside = x >= 0 && y >= 0 && (x as u32) < self.image.width() && (y as u32) < self.image.height();
        if inside {
            self.image.put_pixel(x as u32, y as u32, image::Rgb(colour));
        }
    }

    /// Fills the pixels of row `y` from `x0` to `x1` inclusive.
    fn span(&mut self, y: i32, x0: i32, x1: i32, colour: Rgb) {
        for x in x0..=x1 {
            self.put(x, y, colour);
        }
    }

    pub(crate) fn fill(&mut self, r: Rect, colour: Rgb) {
        for y in r.y..r.y + r.h {
            self.span(y, r.x, r.x + r.w - 1, colour);
        }
    }

    /// A `thickness`-px frame just inside `r`.
    pub(crate) fn frame(&mut self, r: Rect, thickness: i32, colour: Rgb) {
        let t = thickness;
        self.fill(Rect::new(r.x, r.y, r.w, t), colour);
        self.fill(Rect::new(r.x, r.y + r.h - t, r.w, t), colour);
        self.fill(Rect::new(r.x, r.y, t, r.h), colour);
        self.fill(Rect::new(r.x + r.w - t, r.y, t, r.h), colour);
    }

    /// Draws `shape` inscribed in `r` (a bar uses the middle third of its height).
    pub(crate) fn shape(&mut self, shape: Shape, r: Rect, colour: Rgb) {
        match shape {
            Shape::Square => self.fill(r, colour),
            Shape::Circle => self.ellipse(r, colour),
            Shape::Triangle => self.triangle(r, colour),
            Shape::Diamond => self.diamond(r, colour),
            Shape::Bar => self.fill(Rect::new(r.x, r.y + r.h / 3, r.w, r.h / 3), colour),
        }
    }

    /// Pixel centres are compared in doubled coordinates so the test stays in integers.
    fn ellipse(&mut self, r: Rect, colour: Rgb) {
        let (a, b) = (i64::from(r.w), i64::from(r.h));
        for y in r.y..r.y + r.h {
            for x in r.x..r.x + r.w {
                let dx = 2 * i64::from(x - r.x) + 1 - a;
                let dy = 2 * i64::from(y - r.y) + 1 - b;
                if dx * dx * b * b + dy * dy * a * a <= a * a * b * b {
                    self.put(x, y, colour);
                }
            }
        }
    }

    /// Apex at the top centre, base along the bottom edge.
    fn triangle(&mut self, r: Rect, colour: Rgb) {
        for row in 0..r.h {
            let half = (r.w * (row + 1)) / (2 * r.h);
            let centre = r.x + r.w / 2;
            self.span(r.y + row, centre - half, centre + half - 1, colour);
        }
    }

    fn diamond(&mut self, r: Rect, colour: Rgb) {
        let half_h = r.h / 2;
        for row in 0..r.h {
            let from_middle = (row - half_h).abs();
            let half = (r.w * (half_h - from_middle)) / (2 * half_h.max(1));
            let centre = r.x + r.w / 2;
            self.span(r.y + row, centre - half, centre + half - 1, colour);
        }
    }

    /// Draws `text` with its first glyph in the cell whose top-left pixel is `(x, y)`; callers
    /// keep `(x, y)` on the patch grid so every glyph fills whole patches.
    pub(crate) fn text(&mut self, x: i32, y: i32, text: &str, colour: Rgb) {
        for (i, c) in text.chars().enumerate() {
            self.glyph(x + i as i32 * CELL_W as i32, y, c, colour);
        }
    }

    fn glyph(&mut self, x: i32, y: i32, c: char, colour: Rgb) {
        debug_assert!(is_renderable(c), "{c:?} is outside the toy alphabet");
        let rows = font8x8::legacy::BASIC_LEGACY[(c as usize) & 0x7f];
        for (row, bits) in rows.iter().enumerate() {
            for col in 0..8 {
                // font8x8 stores the leftmost pixel in bit 0.
                if bits & (1 << col) != 0 {
                    let px = x + (col * GLYPH_SCALE_X) as i32;
                    let py = y + row as i32 * GLYPH_SCALE_Y as i32;
                    let block = Rect::new(px, py, GLYPH_SCALE_X as i32, GLYPH_SCALE_Y as i32);
                    self.fill(block, colour);
                }
            }
        }
    }
}
