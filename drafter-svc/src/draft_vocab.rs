//! The draft vocabulary: the target's tokens ranked by how often they occur in the responses a head
//! was trained on, kept beside the head as `draft_vocab.json`. A drafter serving such a head scores
//! only those tokens (all of them by default, the N most frequent with `--draft-vocab N`:
//! FR-Spec's frequency-ranked draft vocabulary; EAGLE-3 heads carry their own as `d2t`). The
//! head's LM-head matmul over the full vocabulary is most of a draft pass on a large-vocabulary
//! target (SmolLM2: 49,152 x 576 for 15 rows), and it shrinks with the tokens scored. A token
//! outside them can never be drafted, so acceptance can only fall where the target would choose
//! one; the output is unchanged either way, since the verifier checks every drafted token.

use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::head::{read_json, HeadError};

/// The file a head directory keeps its ranked vocabulary in.
pub const FILE: &str = "draft_vocab.json";

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DraftVocab {
    /// Token ids, most frequent first (ties: the lower id first). Only tokens that occurred.
    pub ranked: Vec<i64>,
    /// How often each occurred, in the order of `ranked`.
    pub counts: Vec<u64>,
}

impl DraftVocab {
    /// Ranks the tokens of `responses` by frequency.
    pub fn from_responses<'a>(responses: impl IntoIterator<Item = &'a [i64]>) -> Self {
        let mut counts: std::collections::HashMap<i64, u64> = Default::default();
        for &token in responses.into_iter().flatten() {
            *counts.entry(token).or_default() += 1;
        }
        let mut ranked: Vec<(i64, u64)> = counts.into_iter().collect();
        ranked.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let (ranked, counts) = ranked.into_iter().unzip();
        Self { ranked, counts }
    }

    /// The `n` most frequent tokens (all of them when fewer occurred).
    pub fn top(&self, n: usize) -> &[i64] {
        &self.ranked[..n.min(self.ranked.len())]
    }

    /// The share of the counted tokens that the `n` most frequent cover.
    pub fn coverage(&self, n: usize) -> f64 {
        let total: u64 = self.counts.iter().sum();
        let covered: u64 = self.counts.iter().take(n).sum();
        covered as f64 / total.max(1) as f64
    }

    pub fn read(head_dir: &Path) -> Result<Self, HeadError> {
        let path = head_dir.join(FILE);
        let err = |reason: String| HeadError::Config { path: path.display().to_string(), reason };
        let vocab: Self = serde_json::from_value(read_json(&path)?).map_err(|e| err(e.to_string()))?;
        if vocab.ranked.len() != vocab.counts.len() {
            return Err(err(format!(
                "{} ranked tokens but {} counts",
                vocab.ranked.len(),
                vocab.counts.len()
            )));
        }
        Ok(vocab)
    }

    pub fn write(&self, head_dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(head_dir)?;
        let text = serde_json::to_string(self).map_err(std::io::Error::other)?;
        std::fs::write(head_dir.join(FILE), text)
    }
}

/// Which of the target's tokens a block head scores (`drafter-svc serve --draft-vocab`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftVocabChoice {
    /// Every token of the head directory's `draft_vocab.json` when it has one (the tokens its
    /// training responses used), else the whole vocabulary.
    #[default]
    Auto,
    /// The whole vocabulary, whatever the head directory holds.
    All,
    /// The N most frequent tokens of `draft_vocab.json` (which must exist).
    Top(usize),
}

impl DraftVocabChoice {
    /// The tokens to score, most frequent first, and the share of the training responses' tokens
    /// they cover; `None`: the whole vocabulary.
    pub fn resolve(self, head_dir: &Path) -> Result<Option<(Vec<i64>, f64)>, HeadError> {
        let n = match self {
            Self::All => return Ok(None),
            Self::Auto if !head_dir.join(FILE).exists() => return Ok(None),
            Self::Auto => usize::MAX,
            Self::Top(n) => n,
        };
        let ranked = DraftVocab::read(head_dir)?;
        Ok(Some((ranked.top(n).to_vec(), ranked.coverage(n))))
    }
}

impl FromStr for DraftVocabChoice {
    type Err = String;

    /// `auto`, `all` (or `0`, its older spelling), or a token count.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "all" | "0" => Ok(Self::All),
            n => n
                .parse()
                .map(Self::Top)
                .map_err(|_| format!("{s:?}: expected auto, all or a number of tokens")),
        }
    }
}

impl std::fmt::Display for DraftVocabChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::All => f.write_str("all"),
            Self::Top(n) => write!(f, "{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_by_frequency_then_id_and_measures_coverage() {
        let responses: [&[i64]; 2] = [&[5, 3, 5, 9], &[3, 5, 7]];
        let vocab = DraftVocab::from_responses(responses);
        assert_eq!(vocab.ranked, vec![5, 3, 7, 9]);
        assert_eq!(vocab.counts, vec![3, 2, 1, 1]);
        assert_eq!(vocab.top(2), &[5, 3]);
        assert_eq!(vocab.top(10).len(), 4);
        assert!((vocab.coverage(2) - 5.0 / 7.0).abs() < 1e-12);
        assert_eq!(vocab.coverage(10), 1.0);
    }

    #[test]
    fn round_trips_and_refuses_a_torn_file() {
        let dir = std::env::temp_dir().join(format!("draft-vocab-{}", std::process::id()));
        let vocab = DraftVocab { ranked: vec![4, 1], counts: vec![9, 2] };
        vocab.write(&dir).unwrap();
        assert_eq!(DraftVocab::read(&dir).unwrap(), vocab);
        std::fs::write(dir.join(FILE), r#"{"ranked":[4,1],"counts":[9]}"#).unwrap();
        assert!(DraftVocab::read(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_choice_parses_and_resolves_against_the_head_directory() {
        let parse = |s: &str| s.parse::<DraftVocabChoice>();
        assert_eq!(parse("auto"), Ok(DraftVocabChoice::Auto));
        assert_eq!(parse("all"), Ok(DraftVocabChoice::All));
        assert_eq!(parse("0"), Ok(DraftVocabChoice::All));
        assert_eq!(parse("8192"), Ok(DraftVocabChoice::Top(8192)));
        assert!(parse("most").is_err());
        for choice in [DraftVocabChoice::Auto, DraftVocabChoice::All, DraftVocabChoice::Top(7)] {
            assert_eq!(parse(&choice.to_string()), Ok(choice));
        }

        let dir = std::env::temp_dir().join(format!("draft-vocab-choice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // No file: auto and all score the whole vocabulary; a count needs the file.
        assert_eq!(DraftVocabChoice::Auto.resolve(&dir).unwrap(), None);
        assert_eq!(DraftVocabChoice::All.resolve(&dir).unwrap(), None);
        assert!(DraftVocabChoice::Top(2).resolve(&dir).is_err());
        DraftVocab { ranked: vec![4, 1, 6], counts: vec![5, 3, 2] }.write(&dir).unwrap();
        assert_eq!(DraftVocabChoice::Auto.resolve(&dir).unwrap(), Some((vec![4, 1, 6], 1.0)));
        assert_eq!(DraftVocabChoice::Top(2).resolve(&dir).unwrap(), Some((vec![4, 1], 0.8)));
        assert_eq!(DraftVocabChoice::All.resolve(&dir).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
