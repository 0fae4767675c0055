//! glance-toyworld: the toy world, a deterministic, seeded generator of `(image, prompt, answer)` triples on which
//! a tiny Qwen3-VL-architecture target and its GLANCE draft head can be trained anywhere (no real
//! VLM can be downloaded here). Five tasks span grounding the way the paper's five do, from open
//! (captioning) to grounded (ChartQA):
//!
//! | task | image (px, visual tokens) | answer | entropy given image + prompt |
//! |---|---|---|---|
//! | [`Task::Caption`] | 256 x 128, 32: 1–4 coloured shapes | one sentence; phrasing (4) and order chosen by the seed | real, at the choice points |
//! | [`Task::Sign`] | 256 x 128, 32: a sign or a label with a word or number | copies it, in the form the question asks | none |
//! | [`Task::Doc`] | 256 x 192, 48: a page of 3–5 lines | the transcription, lines joined by `\n` | none |
//! | [`Task::Chart`] | 320 x 192, 60: 3–5 labelled bars, values 1–9 printed above | `label: value, ...` left to right | none |
//! | [`Task::Story`] | 256 x 128, 32: shapes unrelated to the answer | a continuation from a stochastic grammar | high |
//!
//! Images are laid out for Qwen3-VL's vision tower (16-px patches merged 2 x 2, so one visual
//! token is 32 x 32 px): text is the 8x8 font scaled to 16 x 32 px per glyph ([`CELL_W`] x
//! [`CELL_H`]), on the patch grid, so a text line is one row of visual tokens and each token holds
//! two characters. Only [`ALPHABET`] is ever drawn (lowercase, digits, space, `.,:-`). Image sides
//! are multiples of 32 within [`MIN_PIXELS`]..=[`MAX_PIXELS`], so the processor never resizes
//! them. Text moves by whole patches (columns) and token rows, shapes move freely, and colours
//! vary, so the target must look.
//!
//! Determinism: a sample is a pure function of its arguments. Randomness is SplitMix64, drawing is
//! integer-only, and no hash-map order is involved, so the pixels and the text are the same on
//! every machine. ([`png_bytes`] is deterministic too, but its bytes belong to the `png` crate's
//! version; the pixels are the contract.)
//!
//! Splits: [`sample`] derives a candidate seed from `(seed, split, task, index, attempt)` and keeps
//! the first candidate whose *content* (task, pixels, prompt) hashes into the split's bucket
//! (1 in [`HELD_OUT_ONE_IN`] for held-out). So no image + prompt ever appears in both splits, not
//! just no index, and all answers of one caption image + prompt stay in one split.
//!
//! For whoever trains the target on it:
//! - Chat: one user turn `[image, prompt]` ([`Sample::messages`]) rendered by the real Qwen3-VL
//!   template (no system turn), then the assistant turn; supervise the answer tokens plus
//!   `<|im_end|>` ([`tokenizer::answer_ids`]). Tokenizing prompt and answer separately gives the
//!   same ids as tokenizing the whole conversation (the answer starts a new pre-token after
//!   `assistant\n`).
//! - Checkpoint files: [`tokenizer::train_tokenizer`] writes everything but `config.json` and the
//!   weights; the config needs `image_token_id` 12, `video_token_id` 13, `vision_start_token_id` 9,
//!   `vision_end_token_id` 10, `eos_token_id` 2, `bos`/`pad` 0, vision `patch_size` 16,
//!   `spatial_merge_size` 2, `temporal_patch_size` 2, and a `vocab_size` of at least the
//!   tokenizer's (about 840; 896 or 1024 leave room).
//! - Lengths (held-out, with `<|im_end|>`): answers caption 5–22, sign 2–10, doc 21–53 (never
//!   under [`DOC_MIN_ANSWER_TOKENS`]), chart 15–25, story 10–51 tokens; whole training sequences
//!   49–117 tokens. 64 new tokens cover every answer; 128 positions every sequence.
//! - Exact match is meaningful on sign, doc and chart only; caption and story answers are one draw
//!   from a distribution (score them by log-likelihood, or for caption by the set of shapes).

mod canvas;
mod caption;
mod chart;
mod doc;
mod lexicon;
mod sign;
mod story;
pub mod target;
pub mod tokenizer;

use std::fmt;
use std::str::FromStr;

use glance_train::rng;
use image::RgbImage;

use glance_input::{ChatMessage, ContentPart};

pub use self::canvas::{is_renderable, ALPHABET, CELL_H, CELL_W};
pub use self::tokenizer::pre_token_count;

/// Vision patch side (Qwen3-VL).
pub const PATCH_SIZE: u32 = 16;
/// Patches merged per side into one visual token.
pub const MERGE_SIZE: u32 = 2;
/// Frames per temporal patch (an image is repeated to fill it).
pub const TEMPORAL_PATCH_SIZE: u32 = 2;
/// The smallest image area the toy preprocessor keeps unresized (64 x 64).
pub const MIN_PIXELS: u32 = 64 * 64;
/// The largest image area the toy preprocessor keeps unresized (256 x 256).
pub const MAX_PIXELS: u32 = 256 * 256;
/// One held-out content bucket out of this many.
pub const HELD_OUT_ONE_IN: u64 = 8;
/// Doc answers have at least this many tokens (under any BPE on the Qwen2 pre-tokenizer).
pub const DOC_MIN_ANSWER_TOKENS: usize = doc::MIN_ANSWER_TOKENS;

/// The five tasks, from open to grounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Task {
    Caption,
    Sign,
    Doc,
    Chart,
    Story,
}

impl Task {
    pub const ALL: [Task; 5] = [Task::Caption, Task::Sign, Task::Doc, Task::Chart, Task::Story];

    pub fn name(self) -> &'static str {
        match self {
            Task::Caption => "caption",
            Task::Sign => "sign",
            Task::Doc => "doc",
            Task::Chart => "chart",
            Task::Story => "story",
        }
    }

    /// `(width, height)` of every image of this task.
    pub fn image_size(self) -> (u32, u32) {
        match self {
            Task::Caption | Task::Story => (caption::WIDTH, caption::HEIGHT),
            Task::Sign => (sign::WIDTH, sign::HEIGHT),
            Task::Doc => (doc::WIDTH, doc::HEIGHT),
            Task::Chart => (chart::WIDTH, chart::HEIGHT),
        }
    }

    /// Visual tokens per image: one per 32 x 32 px.
    pub fn visual_tokens(self) -> u32 {
        let (w, h) = self.image_size();
        let token = PATCH_SIZE * MERGE_SIZE;
        (w / token) * (h / token)
    }

    /// Whether the answer is a function of image and prompt (the target's exact-match tasks).
    pub fn is_grounded(self) -> bool {
        matches!(self, Task::Sign | Task::Doc | Task::Chart)
    }

    fn tag(self) -> u64 {
        self as u64 + 1
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A task name that is none of the five.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown toy-world task {0:?} (expected caption, sign, doc, chart or story)")]
pub struct UnknownTask(pub String);

impl FromStr for Task {
    type Err = UnknownTask;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Task::ALL.into_iter().find(|t| t.name() == s).ok_or_else(|| UnknownTask(s.to_string()))
    }
}

/// Training data or evaluation data; their contents never meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    HeldOut,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::HeldOut => "held_out",
        }
    }

    fn tag(self) -> u64 {
        match self {
            Split::Train => 1,
            Split::HeldOut => 2,
        }
    }
}

/// One generated example.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub task: Task,
    /// The per-sample seed it was generated from ([`generate`] reproduces it).
    pub seed: u64,
    pub image: RgbImage,
    pub prompt: String,
    pub answer: String,
}

impl Sample {
    /// The image as PNG bytes.
    pub fn png(&self) -> Vec<u8> {
        png_bytes(&self.image)
    }

    /// The user turn as the services receive it: the image, then the prompt.
    pub fn messages(&self) -> Vec<ChatMessage> {
        vec![ChatMessage {
            role: "user".into(),
            content: vec![
                ContentPart::Image { data: self.png(), mime_type: "image/png".into() },
                ContentPart::Text(self.prompt.clone()),
            ],
        }]
    }

    /// The split this sample's content belongs to.
    pub fn split(&self) -> Split {
        content_split(self.task, &self.image, &self.prompt)
    }
}

/// What a task generator returns.
pub(crate) struct Parts {
    pub image: RgbImage,
    pub prompt: String,
    pub answer: String,
}

/// The `index`-th sample of `task` in `split` of the world `seed`.
pub fn sample(split: Split, task: Task, seed: u64, index: u64) -> Sample {
    (0u64..)
        .map(|attempt| generate(task, rng::combine(&[seed, split.tag(), task.tag(), index, attempt])))
        .find(|s| s.split() == split)
        .expect("some attempt lands in the split's bucket")
}

/// The raw generator: the sample of `task` for one per-sample seed, whatever split its content
/// falls in. Use [`sample`] for data.
pub fn generate(task: Task, seed: u64) -> Sample {
    let mut rng = rng::Rng::new(seed);
    let parts = match task {
        Task::Caption => caption::generate(&mut rng),
        Task::Sign => sign::generate(&mut rng),
        Task::Doc => doc::generate(&mut rng),
        Task::Chart => chart::generate(&mut rng),
        Task::Story => story::generate(&mut rng),
    };
    Sample { task, seed, image: parts.image, prompt: parts.prompt, answer: parts.answer }
}

/// Held-out iff the hash of (task, pixels, prompt) falls in bucket 0. The answer is left out, so
/// all phrasings of one caption belong to one split.
pub fn content_split(task: Task, image: &RgbImage, prompt: &str) -> Split {
    let mut bytes = Vec::with_capacity(image.as_raw().len() + prompt.len() + 16);
    bytes.extend_from_slice(task.name().as_bytes());
    bytes.extend_from_slice(&image.width().to_le_bytes());
    bytes.extend_from_slice(&image.height().to_le_bytes());
    bytes.extend_from_slice(image.as_raw());
    bytes.extend_from_slice(prompt.as_bytes());
    if rng::hash_bytes(&bytes).is_multiple_of(HELD_OUT_ONE_IN) {
        Split::HeldOut
    } else {
        Split::Train
    }
}

/// Encodes an image as PNG (default compression, adaptive filter).
pub fn png_bytes(image: &RgbImage) -> Vec<u8> {
    use image::codecs::png::{CompressionType, FilterType, PngEncoder};
    use image::ImageEncoder;
    let mut out = Vec::new();
    PngEncoder::new_with_quality(&mut out, CompressionType::Default, FilterType::Adaptive)
        .write_image(image.as_raw(), image.width(), image.height(), image::ExtendedColorType::Rgb8)
        .expect("encoding an in-memory RGB image to a Vec cannot fail");
    out
}
