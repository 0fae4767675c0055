//! Prompt-lookup drafting: when the text being generated repeats something already in the
//! history (copying from the prompt, lists, code), the tokens that followed the last occurrence
//! of the current suffix are a free guess. Needs no weights and no tap states, so the verifier
//! runs it in process and drafter-svc can serve it too.

use tch::Tensor;

use crate::session::{DraftEngine, DraftError, DrafterKind, Handshake, RoundInput, Session, TokenHistory};
use crate::tree::{TokenId, Tree};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    /// Longest suffix n-gram tried; shorter ones down to 1 are tried after it.
    pub max_ngram: usize,
    /// Most tokens proposed (B−1 for a block of B).
    pub max_draft: usize,
}

impl PromptLookup {
    pub fn new(max_draft: usize) -> Self {
        Self { max_ngram: 3, max_draft }
    }

    /// `history`: prompt and committed tokens, ending with the root. Finds the longest suffix
    /// n-gram (n = max_ngram … 1) that occurs earlier, takes its most recent earlier occurrence,
    /// and proposes the tokens that followed it as a chain (log-probabilities 0). Empty when
    /// nothing matches.
    pub fn propose(&self, history: &[TokenId]) -> Tree {
        self.find(history).map(|(_, tokens)| Tree::chain(tokens)).unwrap_or_default()
    }

    /// What [`PromptLookup::propose`] proposes, as the length of the suffix n-gram that matched
    /// (a longer match is a better guess: the auto policy calibrates each length apart) and the
    /// proposed tokens; `None` when nothing matches.
    pub fn find<'h>(&self, history: &'h [TokenId]) -> Option<(usize, &'h [TokenId])> {
        if self.max_draft == 0 {
            return None;
        }
        (1..=self.max_ngram).rev().find_map(|n| self.continuation(history, n).map(|tokens| (n, tokens)))
    }

    /// The tokens after the most recent earlier occurrence of the last `n` tokens.
    fn continuation<'h>(&self, history: &'h [TokenId], n: usize) -> Option<&'h [TokenId]> {
        let len = history.len();
        if n == 0 || len <= n {
            return None;
        }
        let suffix = &history[len - n..];
        // Start positions s < len − n: the occurrence may overlap the suffix but is not it.
        (0..len - n).rev().find(|&s| &history[s..s + n] == suffix).map(|s| {
            let from = s + n;
            &history[from..(from + self.max_draft).min(len)]
        })
    }
}

/// Prompt lookup as a drafting engine.
pub struct PromptLookupEngine {
    lookup: PromptLookup,
    block_size: usize,
    vocab_size: usize,
}

impl PromptLookupEngine {
    /// Drafts up to `block_size − 1` tokens; `vocab_size` is the target's (for the handshake).
    pub fn new(block_size: usize, vocab_size: usize) -> Self {
        Self { lookup: PromptLookup::new(block_size.saturating_sub(1)), block_size, vocab_size }
    }
}

impl DraftEngine for PromptLookupEngine {
    fn handshake(&self) -> Handshake {
        Handshake::stateless(DrafterKind::PromptLookup, self.block_size, self.vocab_size)
    }

    fn new_session(&self) -> Box<dyn Session> {
        Box::new(PromptLookupSession { lookup: self.lookup.clone(), history: TokenHistory::default() })
    }
}

struct PromptLookupSession {
    lookup: PromptLookup,
    history: TokenHistory,
}

impl Session for PromptLookupSession {
    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        _: Option<Tensor>,
    ) -> Result<(), DraftError> {
        self.history.append(first, tokens)
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.history.check_root(round)?;
        let mut tree = self.lookup.propose(&self.history.with_root(round.root_token));
        tree.truncate(round.budget);
        Ok(tree)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_longest_suffix() {
        let pld = PromptLookup::new(4);
        // Suffix [1, 2, 3] occurred at 0; it was followed by 4 5 6 7.
        let history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3];
        let tree = pld.propose(&history);
        assert_eq!(tree.tokens, vec![4, 5, 6, 7]);
        assert_eq!(tree.parents[0], -1);
        assert_eq!(tree.parents[3], 2);
        assert_eq!(tree.depths[3], 4);
        assert!(tree.log_probs.iter().all(|&lp| lp == 0.0));
    }

    #[test]
    fn prefers_longer_ngrams_then_the_most_recent_occurrence() {
        let pld = PromptLookup::new(2);
        // [7, 3] never recurs, so n = 1 on token 3: last seen at index 4, followed by 9.
        let history = [3, 5, 0, 0, 3, 9, 7, 3];
        assert_eq!(pld.propose(&history).tokens, vec![9, 7]);
        // [2, 3] recurs (index 1) even though 3 alone occurs later (index 5).
        let history = [0, 2, 3, 8, 8, 3, 6, 2, 3];
        assert_eq!(pld.propose(&history).tokens, vec![8, 8]);
    }

    #[test]
    fn handles_repetition_and_short_tails() {
        let pld = PromptLookup::new(5);
        // The occurrence at 0 overlaps the suffix (at 1): proposes the one token after it.
        assert_eq!(pld.propose(&[4, 4, 4, 4]).tokens, vec![4]);
        // Continuation truncated by the end of the history.
        assert_eq!(pld.propose(&[1, 2, 9, 1, 2]).tokens, vec![9, 1, 2]);
    }

    #[test]
    fn empty_when_nothing_matches() {
        let pld = PromptLookup::new(15);
        assert!(pld.propose(&[]).is_empty());
        assert!(pld.propose(&[5]).is_empty());
        assert!(pld.propose(&[1, 2, 3, 4]).is_empty());
        assert!(PromptLookup::new(0).propose(&[1, 1, 1]).is_empty());
        assert_eq!(pld.find(&[1, 2, 9, 1, 2]), Some((2, &[9, 1, 2][..])));
        assert_eq!(pld.find(&[1, 2, 3, 4]), None);
    }

    #[test]
    fn a_session_drafts_within_the_budget_and_checks_the_root() {
        let engine = PromptLookupEngine::new(16, 100);
        let mut session = engine.new_session();
        session.append_context(0, &[1, 2, 3, 4, 5, 1, 2], None).unwrap();
        let round = RoundInput { root_token: 3, root_position: 7, budget: 2, branch_k: 1 };
        assert_eq!(session.draft(&round).unwrap().tokens, vec![4, 5]);
        let late = RoundInput { root_position: 9, ..round };
        assert!(matches!(session.draft(&late), Err(DraftError::RootPosition { .. })));
        assert!(matches!(session.append_context(3, &[1], None), Err(DraftError::ContextGap { .. })));
    }
}
