//! The draft vocabulary: the target's tokens ranked by how often they occur in the responses a head
//! was trained on, kept beside the head as `draft_vocab.json`. A drafter serving such a head scores
//! only the most frequent of those tokens (by default as many as cover 98% of the responses'
//! tokens and at least 4,096; the N most frequent with `--draft-vocab N`: FR-Spec's
//! frequency-ranked draft vocabulary; EAGLE-3 heads carry their own as `d2t`). The head's LM-head
//! matmul over the full vocabulary is most of a draft pass on a large-vocabulary target
//! (SmolLM2: 49,152 x 576 for 15 rows), and it shrinks with the tokens scored. A token
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

    /// How many of the most frequent tokens it takes to cover `share` of the counted ones (all of
    /// them when `share` is 1 or more).
    pub fn covering(&self, share: f64) -> usize {
        let total: u64 = self.counts.iter().sum();
        // Counts are integers: the first prefix whose sum reaches ⌈share · total⌉ (less a rounding
        // hair, so that 0.98 of 100 asks for 98, not 99).
        let needed = (share * total as f64 - 1e-9).ceil().max(0.0) as u64;
        let mut covered = 0;
        for (n, &count) in self.counts.iter().enumerate() {
            if covered >= needed {
                return n;
            }
            covered += count;
        }
        self.counts.len()
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

/// The share of its training responses' tokens a head's default draft vocabulary covers. The
/// rarest tokens are a long tail (SmolLM2's head on 928 rows: 8,186 distinct tokens, 6,063 of
/// them cover 98%; on 2,784 rows 14,378 and 9,117), which the head seldom drafts right and which
/// every draft pass pays for; measured served, scoring the tokens covering 94.9% and 97.4% left
/// the tree's acceptance where scoring all of them did.
pub const AUTO_COVERAGE: f64 = 0.98;
/// The fewest tokens the default keeps (all of the file's when it has fewer): a few thousand rows
/// of LM head cost little beside the head's layers (SmolLM2's head: 4.7 ms a tree-15 draft over
/// 4,096 tokens, 5.7 over 8,192), so a small vocabulary such as the toy world's is kept whole.
pub const AUTO_MIN_TOKENS: usize = 4096;

/// Which of the target's tokens a block head scores (`drafter-svc serve --draft-vocab`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum DraftVocabChoice {
    /// The most frequent tokens of the head directory's `draft_vocab.json` covering
    /// [`AUTO_COVERAGE`] of its training responses' tokens, and at least [`AUTO_MIN_TOKENS`], when
    /// it has that file, else the whole vocabulary.
    #[default]
    Auto,
    /// The whole vocabulary, whatever the head directory holds.
    All,
    /// The N most frequent tokens of `draft_vocab.json` (which must exist).
    Top(usize),
    /// The most frequent tokens of `draft_vocab.json` (which must exist) covering this share
    /// (0, 1] of the training responses' tokens.
    Covering(f64),
}

impl DraftVocabChoice {
    /// The tokens to score, most frequent first, and the share of the training responses' tokens
    /// they cover; `None`: the whole vocabulary.
    pub fn resolve(self, head_dir: &Path) -> Result<Option<(Vec<i64>, f64)>, HeadError> {
        let read = || DraftVocab::read(head_dir);
        let covering = |share| read().map(|ranked| (ranked.covering(share), ranked));
        let (n, ranked) = match self {
            Self::All => return Ok(None),
            Self::Auto if !head_dir.join(FILE).exists() => return Ok(None),
            Self::Auto => covering(AUTO_COVERAGE).map(|(n, ranked)| (n.max(AUTO_MIN_TOKENS), ranked))?,
            Self::Covering(share) => covering(share)?,
            Self::Top(n) => (n, read()?),
        };
        Ok(Some((ranked.top(n).to_vec(), ranked.coverage(n))))
    }
}

impl FromStr for DraftVocabChoice {
    type Err = String;

    /// `auto`, `all` (or `0`, its older spelling), a token count, or a share of the training
    /// responses' tokens in percent (`95%`).
    fn from_str(s: &str) -> Result<Self, String> {
        let expected = || format!("{s:?}: expected auto, all, a number of tokens or a share such as 95%");
        match s {
            "auto" => Ok(Self::Auto),
            "all" | "0" => Ok(Self::All),
            _ => match s.strip_suffix('%') {
                Some(percent) => match percent.parse::<f64>() {
                    Ok(p) if p > 0.0 && p <= 100.0 => Ok(Self::Covering(p / 100.0)),
                    _ => Err(expected()),
                },
                None => s.parse().map(Self::Top).map_err(|_| expected()),
            },
        }
    }
}

impl std::fmt::Display for DraftVocabChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::All => f.write_str("all"),
            Self::Top(n) => write!(f, "{n}"),
            Self::Covering(share) => write!(f, "{}%", share * 100.0),
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
        // The fewest most frequent tokens reaching a share: 3 of 7 is the first, 5 of 7 the
        // second, 6 of 7 the third, all seven the fourth.
        assert_eq!(vocab.covering(0.4), 1);
        assert_eq!(vocab.covering(5.0 / 7.0), 2);
        assert_eq!(vocab.covering(0.72), 3);
        assert_eq!(vocab.covering(0.98), 4);
        assert_eq!(vocab.covering(1.0), 4);
        let hundred = DraftVocab { ranked: (0..51).collect(), counts: [vec![50], vec![1; 50]].concat() };
        assert_eq!(hundred.covering(0.98), 49, "0.98 of 100 is 98, not 99");
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
        assert_eq!(parse("95%"), Ok(DraftVocabChoice::Covering(0.95)));
        assert_eq!(parse("100%"), Ok(DraftVocabChoice::Covering(1.0)));
        for bad in ["most", "0%", "101%", "-5%", "%", "95.5.1%"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        for choice in [
            DraftVocabChoice::Auto,
            DraftVocabChoice::All,
            DraftVocabChoice::Top(7),
            DraftVocabChoice::Covering(0.5),
            DraftVocabChoice::Covering(0.975),
        ] {
            assert_eq!(parse(&choice.to_string()), Ok(choice));
        }

        let dir = std::env::temp_dir().join(format!("draft-vocab-choice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // No file: auto and all score the whole vocabulary; a count needs the file.
        assert_eq!(DraftVocabChoice::Auto.resolve(&dir).unwrap(), None);
        assert_eq!(DraftVocabChoice::All.resolve(&dir).unwrap(), None);
        assert!(DraftVocabChoice::Top(2).resolve(&dir).is_err());
        assert!(DraftVocabChoice::Covering(0.9).resolve(&dir).is_err());
        // 100 counted tokens: the first covers 90%, the first two 98%, the last two 2%.
        DraftVocab { ranked: vec![4, 1, 6, 8], counts: vec![90, 8, 1, 1] }.write(&dir).unwrap();
        // Auto keeps a vocabulary this small whole.
        assert_eq!(DraftVocabChoice::Auto.resolve(&dir).unwrap(), Some((vec![4, 1, 6, 8], 1.0)));
        assert_eq!(DraftVocabChoice::Covering(0.98).resolve(&dir).unwrap(), Some((vec![4, 1], 0.98)));
        assert_eq!(DraftVocabChoice::Covering(0.9).resolve(&dir).unwrap(), Some((vec![4], 0.9)));
        assert_eq!(DraftVocabChoice::Covering(1.0).resolve(&dir).unwrap(), Some((vec![4, 1, 6, 8], 1.0)));
        assert_eq!(DraftVocabChoice::Top(3).resolve(&dir).unwrap(), Some((vec![4, 1, 6], 0.99)));
        assert_eq!(DraftVocabChoice::All.resolve(&dir).unwrap(), None);
        // 5,000 tokens, a long tail of 1,000 seen once: auto leaves out the part of the tail
        // beyond 98% (41,000 counted, 40,180 covered by the 4,000 frequent ones and 180 of the tail).
        let ranked: Vec<i64> = (0..5000).collect();
        let counts: Vec<u64> = (0..5000).map(|i| if i < 4000 { 10 } else { 1 }).collect();
        DraftVocab { ranked: ranked.clone(), counts }.write(&dir).unwrap();
        let (tokens, coverage) = DraftVocabChoice::Auto.resolve(&dir).unwrap().unwrap();
        assert_eq!((tokens.as_slice(), coverage), (&ranked[..4180], 40_180.0 / 41_000.0));
        // Fewer than AUTO_MIN_TOKENS never.
        DraftVocab { ranked: ranked.clone(), counts: [vec![1_000_000], vec![1; 4999]].concat() }
            .write(&dir)
            .unwrap();
        assert_eq!(DraftVocabChoice::Auto.resolve(&dir).unwrap().unwrap().0, &ranked[..AUTO_MIN_TOKENS]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
