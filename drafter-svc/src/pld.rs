//! Prompt-lookup drafting: when the text being generated repeats something already in the
//! history (copying from the prompt, lists, code), the tokens that followed the last occurrence
//! of the current suffix are a free guess. Needs no weights and no tap states.

use crate::tree::TreeNode;

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
    pub fn propose(&self, history: &[i64]) -> Vec<TreeNode> {
        if self.max_draft == 0 {
            return Vec::new();
        }
        (1..=self.max_ngram)
            .rev()
            .find_map(|n| self.continuation(history, n))
            .map(as_chain)
            .unwrap_or_default()
    }

    /// The tokens after the most recent earlier occurrence of the last `n` tokens.
    fn continuation<'h>(&self, history: &'h [i64], n: usize) -> Option<&'h [i64]> {
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

fn as_chain(tokens: &[i64]) -> Vec<TreeNode> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, &token)| TreeNode { token, depth: i + 1, parent: i as i32 - 1, rank: 0, log_prob: 0.0 })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(nodes: &[TreeNode]) -> Vec<i64> {
        nodes.iter().map(|n| n.token).collect()
    }

    #[test]
    fn proposes_what_followed_the_longest_suffix() {
        let pld = PromptLookup::new(4);
        // Suffix [1, 2, 3] occurred at 0; it was followed by 4 5 6 7.
        let history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3];
        let nodes = pld.propose(&history);
        assert_eq!(tokens(&nodes), vec![4, 5, 6, 7]);
        assert_eq!(nodes[0].parent, -1);
        assert_eq!(nodes[3].parent, 2);
        assert_eq!(nodes[3].depth, 4);
        assert!(nodes.iter().all(|n| n.log_prob == 0.0 && n.rank == 0));
    }

    #[test]
    fn prefers_longer_ngrams_then_the_most_recent_occurrence() {
        let pld = PromptLookup::new(2);
        // [7, 3] never recurs, so n = 1 on token 3: last seen at index 4, followed by 9.
        let history = [3, 5, 0, 0, 3, 9, 7, 3];
        assert_eq!(tokens(&pld.propose(&history)), vec![9, 7]);
        // [2, 3] recurs (index 1) even though 3 alone occurs later (index 5).
        let history = [0, 2, 3, 8, 8, 3, 6, 2, 3];
        assert_eq!(tokens(&pld.propose(&history)), vec![8, 8]);
    }

    #[test]
    fn handles_repetition_and_short_tails() {
        let pld = PromptLookup::new(5);
        // The occurrence at 0 overlaps the suffix (at 1): proposes the one token after it.
        assert_eq!(tokens(&pld.propose(&[4, 4, 4, 4])), vec![4]);
        // Continuation truncated by the end of the history.
        assert_eq!(tokens(&pld.propose(&[1, 2, 9, 1, 2])), vec![9, 1, 2]);
    }

    #[test]
    fn empty_when_nothing_matches() {
        let pld = PromptLookup::new(15);
        assert!(pld.propose(&[]).is_empty());
        assert!(pld.propose(&[5]).is_empty());
        assert!(pld.propose(&[1, 2, 3, 4]).is_empty());
        assert!(PromptLookup::new(0).propose(&[1, 1, 1]).is_empty());
    }
}
