//! Words and colours of the toy world. Lists are small on purpose: a tiny target must learn every
//! word from pixels, and the tokenizer learns most of them as single tokens.

use super::canvas::Rgb;

/// A colour with the word the captions use for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Named {
    pub name: &'static str,
    pub rgb: Rgb,
}

const fn named(name: &'static str, rgb: Rgb) -> Named {
    Named { name, rgb }
}

/// Saturated colours for shapes and bars; all far from every background below.
pub(crate) const SHAPE_COLOURS: [Named; 6] = [
    named("red", [215, 40, 40]),
    named("green", [40, 155, 60]),
    named("blue", [40, 80, 215]),
    named("yellow", [235, 195, 20]),
    named("purple", [135, 60, 180]),
    named("orange", [240, 125, 20]),
];

/// Plain light backgrounds (caption, story, chart).
pub(crate) const BACKGROUNDS: [Rgb; 4] = [[250, 250, 250], [226, 226, 226], [246, 240, 222], [222, 234, 248]];

/// Dark text colours.
pub(crate) const INKS: [Rgb; 5] = [[20, 20, 20], [25, 35, 110], [115, 20, 20], [20, 80, 35], [70, 70, 70]];

/// Light surfaces that carry text: sign boards, labels, pages.
pub(crate) const PAPERS: [Rgb; 5] =
    [[252, 252, 252], [246, 238, 214], [250, 244, 185], [224, 224, 224], [220, 244, 222]];

/// Scene backgrounds behind signs (sky-like) and the ground below them.
pub(crate) const SKIES: [Rgb; 4] = [[150, 195, 235], [185, 210, 230], [200, 170, 210], [160, 160, 175]];
pub(crate) const GROUNDS: [Rgb; 3] = [[90, 150, 70], [150, 120, 80], [110, 110, 110]];
/// Posts, frames and boxes.
pub(crate) const WOODS: [Rgb; 3] = [[110, 75, 40], [70, 55, 45], [140, 100, 60]];
/// Desks under documents.
pub(crate) const DESKS: [Rgb; 4] = [[125, 95, 70], [85, 105, 125], [95, 120, 95], [120, 120, 120]];

/// Words printed on signs and documents (lowercase, 2–5 letters).
pub(crate) const WORDS: [&str; 64] = [
    "open", "shop", "milk", "bread", "eggs", "tea", "rice", "salt", "soap", "book", "lamp", "door", "room",
    "gate", "park", "road", "exit", "stop", "left", "right", "north", "south", "east", "west", "fish",
    "cake", "apple", "plum", "corn", "jam", "box", "bag", "cup", "desk", "chair", "red", "blue", "green",
    "pink", "gold", "map", "key", "note", "list", "total", "price", "date", "time", "day", "week", "item",
    "sale", "free", "push", "pull", "menu", "bus", "train", "boat", "car", "town", "lake", "hill", "farm",
];

/// Three-letter bar labels.
pub(crate) const LABELS: [&str; 30] = [
    "cat", "dog", "sun", "box", "car", "hat", "pen", "cup", "map", "bee", "owl", "ant", "fox", "egg", "ice",
    "jam", "key", "oak", "pig", "sea", "toy", "van", "web", "zip", "bus", "tea", "pie", "bat", "cow", "hen",
];

pub(crate) const ANIMALS: [&str; 12] =
    ["fox", "cat", "dog", "owl", "bear", "duck", "frog", "mouse", "rabbit", "bird", "goat", "wolf"];
pub(crate) const ADJECTIVES: [&str; 10] =
    ["little", "big", "old", "young", "happy", "sleepy", "brave", "clever", "hungry", "quiet"];
/// What a story character `was very ...`.
pub(crate) const FEELINGS: [&str; 8] =
    ["happy", "sleepy", "hungry", "quiet", "brave", "tired", "sad", "glad"];
pub(crate) const PLACES: [&str; 9] = [
    "the river",
    "the forest",
    "the hill",
    "the old house",
    "the lake",
    "the garden",
    "the town",
    "the farm",
    "the bridge",
];
pub(crate) const FOODS: [&str; 6] =
    ["an apple", "some bread", "a fish", "some berries", "a cake", "a carrot"];
pub(crate) const THINGS: [&str; 8] = [
    "a red ball",
    "a big tree",
    "a small box",
    "a shiny stone",
    "a lost key",
    "an old boat",
    "a blue kite",
    "a tiny door",
];

/// `a` or `an`, by the first letter.
pub(crate) fn article(word: &str) -> &'static str {
    match word.chars().next() {
        Some('a' | 'e' | 'i' | 'o' | 'u') => "an",
        _ => "a",
    }
}

/// Counts `one`..`four`.
pub(crate) fn count_word(n: usize) -> &'static str {
    ["zero", "one", "two", "three", "four", "five"][n]
}

/// Upper-cases the first character.
pub(crate) fn capitalize(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// `x`, `x and y`, `x, y and z`.
pub(crate) fn join_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// A number with `digits` digits and no leading zero (a single digit may be 0).
pub(crate) fn number(rng: &mut glance_train::rng::Rng, digits: u32) -> String {
    let lo = if digits == 1 { 0 } else { 10u32.pow(digits - 1) };
    rng.range(lo, 10u32.pow(digits) - 1).to_string()
}
