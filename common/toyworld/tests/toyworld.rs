//! The toy world: the generator is deterministic and its splits never share content, every task's
//! images go through the real input pipeline unresized, and the trained tokenizer has the Qwen
//! special tokens at ids 0..=13, round-trips all text and loads as a checkpoint directory.

use std::borrow::Cow;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use glance_input::{
    resize_for_model, ChatTemplate, PromptBuilder, PromptOptions, TemplateMessage, TemplatePart,
};
use glance_toyworld::tokenizer::{
    answer_ids, train_tokenizer, IMAGE_PAD_ID, IM_END_ID, QWEN3_VL_CHAT_TEMPLATE, SPECIAL_TOKENS,
};
use glance_toyworld::{
    generate, is_renderable, png_bytes, pre_token_count, sample, Sample, Split, Task, DOC_MIN_ANSWER_TOKENS,
    MAX_PIXELS, MIN_PIXELS,
};
use tokenizers::Tokenizer;

const SEED: u64 = 0;

/// The tokenizer is trained once per test binary (about 2 s) into the target's test tmp dir.
fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("toyworld-model");
        train_tokenizer(&dir, SEED).expect("toy tokenizer trains");
        std::fs::write(dir.join("config.json"), toy_config()).expect("write config.json");
        dir
    })
}

/// The `config.json` the trainer writes for a default-sized toy target.
fn toy_config() -> String {
    glance_toyworld::target::config_json(&glance_toyworld::target::TargetSpec::default(), 896).to_string()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(model_dir().join("tokenizer.json")).expect("tokenizer.json loads")
}

fn content_hash(s: &Sample) -> u64 {
    let mut h = DefaultHasher::new();
    (s.task, s.image.as_raw(), &s.prompt).hash(&mut h);
    h.finish()
}

#[test]
fn same_arguments_give_the_same_bytes() {
    for task in Task::ALL {
        for index in 0..20 {
            let a = sample(Split::Train, task, SEED, index);
            let b = sample(Split::Train, task, SEED, index);
            assert_eq!(a, b, "{task} {index}");
            assert_eq!(a.png(), b.png(), "{task} {index}");
            assert_eq!(generate(task, a.seed), a, "{task} {index}: seed reproduces");
        }
    }
}

#[test]
fn different_indices_and_seeds_give_different_samples() {
    for task in Task::ALL {
        let hashes: HashSet<u64> =
            (0..300).map(|i| content_hash(&sample(Split::Train, task, SEED, i))).collect();
        assert_eq!(hashes.len(), 300, "{task}: repeated samples");
        let other_world = sample(Split::Train, task, SEED + 1, 0);
        assert_ne!(other_world, sample(Split::Train, task, SEED, 0), "{task}");
    }
}

#[test]
fn train_and_held_out_never_share_content() {
    for task in Task::ALL {
        let train: HashSet<u64> = (0..3000)
            .map(|i| sample(Split::Train, task, SEED, i))
            .inspect(|s| assert_eq!(s.split(), Split::Train))
            .map(|s| content_hash(&s))
            .collect();
        for i in 0..400 {
            let s = sample(Split::HeldOut, task, SEED, i);
            assert_eq!(s.split(), Split::HeldOut);
            assert!(!train.contains(&content_hash(&s)), "{task} held-out {i} is in train");
        }
    }
}

#[test]
fn images_have_their_task_size_on_the_token_grid() {
    for task in Task::ALL {
        let (w, h) = task.image_size();
        assert!(w % 32 == 0 && h % 32 == 0, "{task}: {w}x{h}");
        assert!((MIN_PIXELS..=MAX_PIXELS).contains(&(w * h)), "{task}: {w}x{h}");
        for i in 0..50 {
            let s = sample(Split::Train, task, SEED, i);
            assert_eq!(s.image.dimensions(), (w, h), "{task} {i}");
        }
    }
}

#[test]
fn grounded_text_uses_only_renderable_characters() {
    for task in [Task::Doc, Task::Chart] {
        for i in 0..500 {
            let s = sample(Split::Train, task, SEED, i);
            let bad: Vec<char> = s.answer.chars().filter(|&c| c != '\n' && !is_renderable(c)).collect();
            assert!(bad.is_empty(), "{task} {i}: {bad:?} in {:?}", s.answer);
        }
    }
}

#[test]
fn doc_answers_are_long_enough_to_speculate_on() {
    for i in 0..500 {
        let s = sample(Split::Train, Task::Doc, SEED, i);
        let lines = s.answer.lines().count();
        assert!((3..=5).contains(&lines), "{i}: {lines} lines");
        assert!(pre_token_count(&s.answer) >= DOC_MIN_ANSWER_TOKENS, "{i}");
    }
}

/// The entropy controls: caption phrasings vary for the same facts; stories hardly repeat.
#[test]
fn caption_and_story_answers_keep_their_entropy() {
    let openings: HashSet<String> = (0..200)
        .map(|i| sample(Split::Train, Task::Caption, SEED, i).answer)
        .map(|a| a.split(' ').take(2).collect::<Vec<_>>().join(" "))
        .collect();
    assert!(openings.len() >= 4, "caption openings: {openings:?}");
    let stories: HashSet<String> =
        (0..200).map(|i| sample(Split::Train, Task::Story, SEED, i).answer).collect();
    assert!(stories.len() >= 190, "only {} distinct stories of 200", stories.len());
}

#[test]
fn png_round_trips_the_pixels() {
    for task in Task::ALL {
        let s = sample(Split::HeldOut, task, SEED, 0);
        let decoded = image::load_from_memory(&png_bytes(&s.image)).expect("png decodes").to_rgb8();
        assert_eq!(decoded, s.image, "{task}");
    }
}

#[test]
fn special_tokens_have_ids_0_to_13() {
    let tokenizer = tokenizer();
    for (id, token) in (0u32..).zip(SPECIAL_TOKENS) {
        assert_eq!(tokenizer.token_to_id(token), Some(id), "{token}");
    }
    let vocab = tokenizer.get_vocab_size(true);
    assert!((512..=1024).contains(&vocab), "vocabulary {vocab}");
}

#[test]
fn tokenizer_round_trips_every_prompt_and_answer() {
    let tokenizer = tokenizer();
    for split in [Split::Train, Split::HeldOut] {
        for task in Task::ALL {
            for i in 0..200 {
                let s = sample(split, task, SEED, i);
                for text in [&s.prompt, &s.answer] {
                    let ids = tokenizer.encode(text.as_str(), false).expect("encodes");
                    let back = tokenizer.decode(ids.get_ids(), false).expect("decodes");
                    assert_eq!(&back, text, "{task} {i}");
                }
                let ids = answer_ids(&tokenizer, &s.answer).expect("answer ids");
                assert_eq!(ids.last(), Some(&IM_END_ID));
                assert!(ids[..ids.len() - 1].iter().all(|&id| id > 13), "{task} {i}");
            }
        }
    }
}

#[test]
fn tokenizer_training_is_deterministic() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("toyworld-model-again");
    train_tokenizer(&dir, SEED).expect("trains again");
    for file in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        let again = std::fs::read(dir.join(file)).expect("read");
        let first = std::fs::read(model_dir().join(file)).expect("read");
        assert!(again == first, "{file} differs between two trainings");
    }
    let template = std::fs::read_to_string(dir.join("chat_template.jinja")).expect("read");
    assert_eq!(template, QWEN3_VL_CHAT_TEMPLATE);
}

#[test]
fn every_task_goes_through_the_input_pipeline_unresized() {
    let builder = PromptBuilder::from_model_dir(model_dir(), PromptOptions::default())
        .expect("the toy checkpoint directory loads");
    assert_eq!(builder.eos_token_ids(), [2, 0]);
    for task in Task::ALL {
        let (w, h) = task.image_size();
        for i in 0..5 {
            let s = sample(Split::HeldOut, task, SEED, i);
            let resized = resize_for_model(&s.image, builder.image_config().expect("a VLM")).expect("resize");
            assert!(matches!(resized, Cow::Borrowed(_)), "{task} {i} was resized");
            let prompt = builder.build(&s.messages()).expect("prompt builds");
            let image = &prompt.images[0];
            assert_eq!(image.grid_thw, [1, h as usize / 16, w as usize / 16], "{task}");
            assert_eq!(image.n_tokens, task.visual_tokens() as usize, "{task}");
            let image_tokens = prompt.input_ids.iter().filter(|&&id| id == IMAGE_PAD_ID);
            assert_eq!(image_tokens.count(), task.visual_tokens() as usize, "{task}");
            assert!(prompt.text.ends_with("<|im_end|>\n<|im_start|>assistant\n"));
            assert!(prompt.text.contains(&s.prompt), "{task}");
        }
    }
}

#[test]
fn answer_ids_continue_the_prompt_ids() {
    let tokenizer = tokenizer();
    let template = ChatTemplate::from_source(QWEN3_VL_CHAT_TEMPLATE).expect("template compiles");
    let encode = |text: &str| tokenizer.encode(text, false).expect("encodes").get_ids().to_vec();
    for task in Task::ALL {
        for i in 0..50 {
            let s = sample(Split::Train, task, SEED, i);
            let user = TemplateMessage {
                role: "user".into(),
                content: vec![TemplatePart::Image, TemplatePart::Text { text: s.prompt.clone() }].into(),
            };
            let assistant = TemplateMessage {
                role: "assistant".into(),
                content: vec![TemplatePart::Text { text: s.answer.clone() }].into(),
            };
            let prompt = template.render(&[&user], true).expect("renders");
            let full = template.render(&[&user, &assistant], false).expect("renders");
            assert_eq!(full, format!("{prompt}{}<|im_end|>\n", s.answer));
            let mut joined = encode(&prompt);
            joined.extend(answer_ids(&tokenizer, &s.answer).expect("answer ids"));
            joined.extend(encode("\n"));
            assert_eq!(encode(&full), joined, "{task} {i}");
        }
    }
}
