//! The toy target's tokenizer and the non-weight files of its checkpoint directory.
//!
//! [`train_tokenizer`] trains a byte-level BPE (the Qwen2 pipeline: NFC, Qwen2's split regex,
//! byte-level without its own regex, so transformers' `Qwen2Tokenizer` rebuilt from vocab + merges
//! tokenizes identically) on the chat texts of training samples of every task, with the Qwen
//! special tokens first (ids 0..=13), and writes what a Hugging Face Qwen3-VL checkpoint holds
//! besides `config.json` and the weights: `tokenizer.json`, `tokenizer_config.json`,
//! `chat_template.jinja` (the real Qwen3-VL template), `preprocessor_config.json`,
//! `processor_config.json`, `video_preprocessor_config.json` and `generation_config.json`, shaped
//! like the files `tests/reference/make_reference.py` writes for the tiny reference models.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{json, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split as SplitPreTokenizer, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, OffsetReferential, OffsetType, PostProcessorWrapper,
    PreTokenizedString, PreTokenizer, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
    TokenizerBuilder, TokenizerImpl,
};

use super::{sample, Split, Task, MAX_PIXELS, MERGE_SIZE, MIN_PIXELS, PATCH_SIZE, TEMPORAL_PATCH_SIZE};
use glance_input::{ChatTemplate, TemplateMessage, TemplatePart};

/// The Qwen special tokens, in id order: they get ids 0..=13.
pub const SPECIAL_TOKENS: [&str; 14] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
];
/// `<|endoftext|>`: bos and pad.
pub const ENDOFTEXT_ID: u32 = 0;
pub const IM_START_ID: u32 = 1;
/// `<|im_end|>`: eos, ends every assistant turn.
pub const IM_END_ID: u32 = 2;
pub const VISION_START_ID: u32 = 9;
pub const VISION_END_ID: u32 = 10;
pub const IMAGE_PAD_ID: u32 = 12;
pub const VIDEO_PAD_ID: u32 = 13;

/// Requested vocabulary size; BPE stops earlier if the corpus runs out of pairs worth merging.
pub const VOCAB_TARGET: usize = 1024;
/// Training samples per task whose chat texts form the corpus.
pub const CORPUS_SAMPLES_PER_TASK: u64 = 2000;
/// Every this-many corpus conversations carry a system turn, so its scaffolding is learned too.
const SYSTEM_TURN_EVERY: u64 = 10;
const SYSTEM_PROMPT: &str = "You are a helpful assistant.";

/// The Qwen3-VL-8B-Instruct chat template, byte for byte.
pub const QWEN3_VL_CHAT_TEMPLATE: &str = include_str!("../../../tests/reference/templates/qwen3_vl.jinja");
/// transformers' `Qwen2Tokenizer` split regex (`PRETOKENIZE_REGEX`).
const QWEN2_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The transformers version the reference files were written with; recorded like HF does.
const TRANSFORMERS_VERSION: &str = "5.24.0";

/// Why the tokenizer could not be trained or written.
#[derive(Debug, thiserror::Error)]
pub enum ToyTokenizerError {
    #[error("training the toy tokenizer failed: {0}")]
    Train(String),
    #[error("the toy corpus could not be rendered with the chat template: {0}")]
    Template(String),
    #[error("special token {token} has id {got:?}, expected {expected}")]
    SpecialTokenId { token: &'static str, got: Option<u32>, expected: u32 },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// A trained tokenizer and what went into it.
#[derive(Debug)]
pub struct ToyTokenizer {
    pub tokenizer: Tokenizer,
    /// Entries in the vocabulary, special tokens included.
    pub vocab_size: usize,
    /// Text pieces the BPE was trained on.
    pub corpus_texts: usize,
}

/// Trains the tokenizer on the world `seed`'s training split and writes the checkpoint's
/// non-weight files into `out_dir` (created if missing). Deterministic for a seed.
pub fn train_tokenizer(out_dir: &Path, seed: u64) -> Result<ToyTokenizer, ToyTokenizerError> {
    let corpus = corpus(seed)?;
    let trained = train_bpe(&corpus)?;
    let json = trained.to_string(true).map_err(|e| ToyTokenizerError::Train(e.to_string()))?;
    let tokenizer: Tokenizer =
        json.parse().map_err(|e: tokenizers::Error| ToyTokenizerError::Train(e.to_string()))?;
    check_special_ids(&tokenizer)?;
    std::fs::create_dir_all(out_dir).map_err(|source| io_error(out_dir, source))?;
    write_text(&out_dir.join("tokenizer.json"), &json)?;
    write_checkpoint_files(out_dir)?;
    Ok(ToyTokenizer { vocab_size: tokenizer.get_vocab_size(true), tokenizer, corpus_texts: corpus.len() })
}

/// The assistant turn's target ids: the answer, then `<|im_end|>` (what the template writes after
/// an assistant message; the trailing newline comes after the eos and is never predicted).
pub fn answer_ids(tokenizer: &Tokenizer, answer: &str) -> Result<Vec<u32>, tokenizers::Error> {
    let mut ids = tokenizer.encode(answer, false)?.get_ids().to_vec();
    ids.push(IM_END_ID);
    Ok(ids)
}

/// The text pieces between special tokens of full training conversations (user turn with the
/// image placeholder and prompt, assistant turn with the answer), rendered by the real template.
pub fn corpus(seed: u64) -> Result<Vec<String>, ToyTokenizerError> {
    let template = ChatTemplate::from_source(QWEN3_VL_CHAT_TEMPLATE)
        .map_err(|e| ToyTokenizerError::Template(e.to_string()))?;
    let mut pieces = Vec::new();
    for task in Task::ALL {
        for index in 0..CORPUS_SAMPLES_PER_TASK {
            let s = sample(Split::Train, task, seed, index);
            let messages = conversation(&s.prompt, &s.answer, index % SYSTEM_TURN_EVERY == 0);
            let text =
                template.render(&messages, false).map_err(|e| ToyTokenizerError::Template(e.to_string()))?;
            pieces.extend(between_special_tokens(&text));
        }
    }
    Ok(pieces)
}

fn conversation(prompt: &str, answer: &str, with_system: bool) -> Vec<TemplateMessage> {
    let text = |t: &str| TemplatePart::Text { text: t.into() };
    let mut messages = Vec::new();
    if with_system {
        messages.push(TemplateMessage { role: "system".into(), content: vec![text(SYSTEM_PROMPT)].into() });
    }
    messages.push(TemplateMessage {
        role: "user".into(),
        content: vec![TemplatePart::Image, text(prompt)].into(),
    });
    messages.push(TemplateMessage { role: "assistant".into(), content: vec![text(answer)].into() });
    messages
}

/// Special tokens are matched before BPE ever runs, so the BPE must not see them as text.
fn between_special_tokens(text: &str) -> Vec<String> {
    let marked = SPECIAL_TOKENS.iter().fold(text.to_string(), |t, special| t.replace(special, "\0"));
    marked.split('\0').filter(|piece| !piece.is_empty()).map(str::to_string).collect()
}

type BpeTokenizer =
    TokenizerImpl<BPE, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>;

fn train_bpe(corpus: &[String]) -> Result<BpeTokenizer, ToyTokenizerError> {
    let train_error = |e: tokenizers::Error| ToyTokenizerError::Train(e.to_string());
    let mut tokenizer: BpeTokenizer = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(Some(NFC.into()))
        .with_pre_tokenizer(Some(qwen2_pre_tokenizer().map_err(train_error)?))
        .with_post_processor(Some(single_sequence_processor().map_err(train_error)?))
        .with_decoder(Some(ByteLevelDecoder::default().into()))
        .build()
        .map_err(train_error)?;
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(VOCAB_TARGET)
        .show_progress(false)
        .special_tokens(SPECIAL_TOKENS.iter().map(|t| AddedToken::from(*t, true)).collect())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect::<HashSet<char>>())
        .build();
    tokenizer.train(&mut trainer, corpus.iter()).map_err(train_error)?;
    Ok(tokenizer)
}

/// Qwen2's split regex, then byte-level mapping without a regex of its own.
fn qwen2_pre_tokenizer() -> Result<PreTokenizerWrapper, tokenizers::Error> {
    let split = qwen2_split()?;
    let byte_level = ByteLevel::new(false, true, false);
    Ok(Sequence::new(vec![split.into(), byte_level.into()]).into())
}

fn qwen2_split() -> Result<SplitPreTokenizer, tokenizers::Error> {
    SplitPreTokenizer::new(
        SplitPattern::Regex(QWEN2_SPLIT_REGEX.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
}

/// What transformers writes for Qwen2Tokenizer: the sequence as is, no added tokens.
fn single_sequence_processor() -> Result<PostProcessorWrapper, tokenizers::Error> {
    let processor = TemplateProcessing::builder()
        .try_single("$A")?
        .try_pair("$A $B:1")?
        .build()
        .map_err(|e| e.to_string())?;
    Ok(processor.into())
}

/// The number of pieces Qwen2's split regex cuts `text` into: a lower bound on its token count
/// under any BPE built on that pre-tokenizer (merges never cross pieces), exact for the toy
/// tokenizer whenever every piece is in its vocabulary.
pub fn pre_token_count(text: &str) -> usize {
    static SPLIT: OnceLock<SplitPreTokenizer> = OnceLock::new();
    let split = SPLIT.get_or_init(|| qwen2_split().expect("the Qwen2 split regex compiles"));
    let mut pieces = PreTokenizedString::from(text);
    split.pre_tokenize(&mut pieces).expect("splitting on a regex cannot fail");
    pieces.get_splits(OffsetReferential::Original, OffsetType::Byte).len()
}

fn check_special_ids(tokenizer: &Tokenizer) -> Result<(), ToyTokenizerError> {
    for (expected, token) in (0u32..).zip(SPECIAL_TOKENS) {
        let got = tokenizer.token_to_id(token);
        if got != Some(expected) {
            return Err(ToyTokenizerError::SpecialTokenId { token, got, expected });
        }
    }
    Ok(())
}

fn write_checkpoint_files(dir: &Path) -> Result<(), ToyTokenizerError> {
    write_text(&dir.join("chat_template.jinja"), QWEN3_VL_CHAT_TEMPLATE)?;
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config())?;
    write_json(&dir.join("preprocessor_config.json"), &image_processor())?;
    write_json(&dir.join("video_preprocessor_config.json"), &video_processor())?;
    let processor = json!({
        "image_processor": image_processor(),
        "processor_class": "Qwen3VLProcessor",
        "video_processor": video_processor(),
    });
    write_json(&dir.join("processor_config.json"), &processor)?;
    write_json(&dir.join("generation_config.json"), &generation_config())
}

/// As transformers saves Qwen2Tokenizer for the Qwen-VL checkpoints.
pub fn tokenizer_config() -> Value {
    let extra: Vec<&str> =
        SPECIAL_TOKENS.into_iter().filter(|t| !["<|endoftext|>", "<|im_end|>"].contains(t)).collect();
    json!({
        "add_prefix_space": null,
        "backend": "tokenizers",
        "bos_token": null,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": extra,
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "processor_class": "Qwen3VLProcessor",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    })
}

/// Qwen3-VL's image processor (patch 16, merge 2, temporal 2, mean/std 0.5) with the toy
/// world's pixel bounds, inside which every toy image keeps its size.
pub fn image_processor() -> Value {
    json!({
        "do_convert_rgb": true,
        "do_normalize": true,
        "do_rescale": true,
        "do_resize": true,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": MERGE_SIZE,
        "patch_size": PATCH_SIZE,
        "resample": 3,
        "rescale_factor": 1.0 / 255.0,
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    })
}

/// Shipped by Qwen3-VL hub repos; unused here (no video) but keeps the directory loadable by
/// transformers' `Qwen3VLProcessor`.
fn video_processor() -> Value {
    json!({
        "do_convert_rgb": true,
        "do_normalize": true,
        "do_rescale": true,
        "do_resize": true,
        "do_sample_frames": true,
        "fps": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "max_frames": 768,
        "max_video_tokens": 768,
        "merge_size": MERGE_SIZE,
        "min_frames": 4,
        "patch_size": PATCH_SIZE,
        "resample": 3,
        "rescale_factor": 1.0 / 255.0,
        "return_metadata": false,
        "size": {"longest_edge": 786432, "shortest_edge": 131072},
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "video_processor_type": "Qwen3VLVideoProcessor",
    })
}

/// Greedy by default; generation stops at `<|im_end|>` or `<|endoftext|>` (hub convention).
pub fn generation_config() -> Value {
    json!({
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "transformers_version": TRANSFORMERS_VERSION,
    })
}

fn write_json(path: &Path, value: &Value) -> Result<(), ToyTokenizerError> {
    let text = serde_json::to_string_pretty(value).expect("a JSON value always serializes");
    write_text(path, &format!("{text}\n"))
}

fn write_text(path: &Path, text: &str) -> Result<(), ToyTokenizerError> {
    std::fs::write(path, text).map_err(|source| io_error(path, source))
}

fn io_error(path: &Path, source: std::io::Error) -> ToyTokenizerError {
    ToyTokenizerError::Io { path: path.to_path_buf(), source }
}
