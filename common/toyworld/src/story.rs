//! `story`: continue a short story. The image is a random shapes scene that carries no
//! information about the answer; the answer comes from a small stochastic grammar, so the
//! target's next-token entropy stays high (the free-text control, where speculation gains least).

use super::canvas::Canvas;
use super::caption::{draw_shapes, HEIGHT, WIDTH};
use super::lexicon::{
    article, capitalize, ADJECTIVES, ANIMALS, BACKGROUNDS, FEELINGS, FOODS, PLACES, THINGS,
};
use super::Parts;
use glance_train::rng::Rng;

const PROMPT_LEADS: [&str; 3] = ["Continue the story:", "Finish the story:", "What happens next?"];
const OPENERS: [&str; 5] = ["", "Then ", "Soon ", "After that, ", "Later "];

/// The cast: the hero from the prompt and, once met, a friend.
struct Cast {
    hero: &'static str,
    friend: Option<&'static str>,
}

pub(crate) fn generate(rng: &mut Rng) -> Parts {
    let mut canvas = Canvas::new(WIDTH, HEIGHT, *rng.pick(&BACKGROUNDS));
    draw_shapes(rng, &mut canvas);
    let hero = *rng.pick(&ANIMALS);
    let mut cast = Cast { hero, friend: None };
    let opening = format!("The {} {} went to {}.", rng.pick(&ADJECTIVES), cast.hero, rng.pick(&PLACES));
    let prompt = format!("{} {opening}", rng.pick(&PROMPT_LEADS));
    let n_sentences = rng.range(2, 4);
    let answer = (0..n_sentences).map(|i| sentence(rng, &mut cast, i == 0)).collect::<Vec<_>>().join(" ");
    Parts { image: canvas.into_image(), prompt, answer }
}

fn sentence(rng: &mut Rng, cast: &mut Cast, first: bool) -> String {
    let opener = if first { "" } else { *rng.pick(&OPENERS) };
    let who = Who::pick(rng, cast);
    let mut text = format!("{opener}{} {}", who.text(cast), action(rng, cast, who));
    if rng.percent(30) {
        text = format!("{text} and {}", action(rng, cast, who));
    }
    format!("{}.", capitalize(&text))
}

/// Who a sentence is about; `it` is always the hero.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Who {
    It,
    Hero,
    Friend,
}

impl Who {
    fn pick(rng: &mut Rng, cast: &Cast) -> Self {
        match (rng.below(3), cast.friend) {
            (0, _) => Who::It,
            (1, Some(_)) => Who::Friend,
            _ => Who::Hero,
        }
    }

    fn text(self, cast: &Cast) -> String {
        match (self, cast.friend) {
            (Who::Friend, Some(friend)) => format!("the {friend}"),
            (Who::It, _) => "it".to_string(),
            _ => format!("the {}", cast.hero),
        }
    }
}

fn action(rng: &mut Rng, cast: &mut Cast, who: Who) -> String {
    match rng.below(10) {
        0 => meet(rng, cast, who),
        1 => format!("saw {}", rng.pick(&THINGS)),
        2 => format!("found {}", rng.pick(&THINGS)),
        3 => format!("ran to {}", rng.pick(&PLACES)),
        4 => format!("ate {}", rng.pick(&FOODS)),
        5 => "sang a song".to_string(),
        6 => "fell asleep".to_string(),
        7 => format!("jumped over {}", rng.pick(&THINGS)),
        8 => "went home".to_string(),
        _ => format!("was very {}", rng.pick(&FEELINGS)),
    }
}

/// Introduces the friend (`met a quiet owl`), or has one meet the other again.
fn meet(rng: &mut Rng, cast: &mut Cast, who: Who) -> String {
    if let Some(friend) = cast.friend {
        let other = if who == Who::Friend { cast.hero } else { friend };
        return format!("met the {other} again");
    }
    let friend = loop {
        let candidate = *rng.pick(&ANIMALS);
        if candidate != cast.hero {
            break candidate;
        }
    };
    cast.friend = Some(friend);
    let adjective = rng.pick(&ADJECTIVES);
    format!("met {} {adjective} {friend}", article(adjective))
}
