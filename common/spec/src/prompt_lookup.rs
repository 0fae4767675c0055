//! Prompt-lookup drafting: when the text being generated repeats something already in the
//! history (copying from the prompt, lists, code), the tokens that followed earlier occurrences
//! of the current suffix are a free guess. The continuations of the few most recent occurrences
//! are merged into one tree (a trie: where they agree they share nodes, where they differ they
//! branch), so one verify pass tries them all. Needs no weights and no tap states, so the
//! verifier runs it in process and drafter-svc can serve it too.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use tch::Tensor;

use crate::session::{
    check_continues, check_root_at, DraftEngine, DraftError, DrafterKind, Handshake, RoundInput, Session,
};
use crate::tree::{TokenId, Tree};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    /// Longest suffix n-gram tried; shorter ones down to 1 are tried after it.
    pub max_ngram: usize,
    /// Most tokens proposed on one path (B−1 for a block of B).
    pub max_draft: usize,
    /// Earlier occurrences whose continuations are merged, the most recent first.
    pub max_branches: usize,
    /// Most nodes of the merged tree (its best-first prefix; `new` makes it `max_draft`, so a
    /// pass is no wider than one chain's).
    pub max_nodes: usize,
}

impl PromptLookup {
    /// Merging the continuations of the four most recent occurrences rather than only the last
    /// one raised the tokens a 15-node proposal accepts by about a seventh in an offline replay of
    /// 300 ShareGPT answers under SmolLM2's tokenizer (`bench_lookup`: 1.01 → 1.15 per matched
    /// position; two occurrences 1.10, eight 1.15).
    pub fn new(max_draft: usize) -> Self {
        Self { max_ngram: 3, max_draft, max_branches: 4, max_nodes: max_draft }
    }

    /// `history`: prompt and committed tokens, ending with the root. Finds the longest suffix
    /// n-gram (n = max_ngram … 1) that occurs earlier and proposes the tokens that followed its
    /// most recent earlier occurrences, merged into a best-first tree ([`lookup_tree`]) of at
    /// most `max_nodes` nodes. Empty when nothing matches.
    pub fn propose(&self, history: &[TokenId]) -> Tree {
        self.find(history).map(|(_, tree)| tree).unwrap_or_default()
    }

    /// What [`PromptLookup::propose`] proposes, with the length of the suffix n-gram that matched
    /// (a longer match is a better guess: the auto policy calibrates each length apart); `None`
    /// when nothing matches.
    ///
    /// Scans the whole history for each n-gram length: a reference, and for one-off proposals.
    /// A caller proposing after every token keeps an [`IndexedHistory`] and asks
    /// [`PromptLookup::find_after`] instead.
    pub fn find(&self, history: &[TokenId]) -> Option<(usize, Tree)> {
        self.find_with(history, |n| {
            let len = history.len();
            // Start positions s < len − n: the occurrence may overlap the suffix but is not it.
            (0..len.saturating_sub(n)).rev().filter(move |&s| history[s..s + n] == history[len - n..])
        })
    }

    /// What [`PromptLookup::find`] finds in `history`'s tokens followed by `root`, in time
    /// independent of the history's length: the suffix's earlier occurrences come from the index.
    pub fn find_after(&self, history: &mut IndexedHistory, root: TokenId) -> Option<(usize, Tree)> {
        // The root is the caller's pending token, not history: it is searched with, then dropped.
        history.tokens.push(root);
        let searched = &*history;
        let found = self.find_with(&searched.tokens, |n| searched.earlier_occurrences(n));
        history.tokens.pop();
        found
    }

    /// The proposal from the most recent earlier occurrences of the longest suffix n-gram that
    /// has any; `starts(n)` yields the start positions of the last `n` tokens' earlier
    /// occurrences (before the suffix itself), the most recent first.
    fn find_with<I: Iterator<Item = usize>>(
        &self,
        history: &[TokenId],
        starts: impl Fn(usize) -> I,
    ) -> Option<(usize, Tree)> {
        if self.max_draft == 0 || self.max_branches == 0 {
            return None;
        }
        let len = history.len();
        (1..=self.max_ngram.min(len.saturating_sub(1))).rev().find_map(|n| {
            let continuations: Vec<&[TokenId]> = starts(n)
                .take(self.max_branches)
                .map(|s| &history[s + n..(s + n + self.max_draft).min(len)])
                .collect();
            (!continuations.is_empty()).then(|| {
                let mut tree = lookup_tree(&continuations);
                tree.truncate(self.max_nodes);
                (n, tree)
            })
        })
    }
}

/// Committed tokens with, for every n-gram length up to a maximum, the positions where each
/// n-gram started, so that prompt lookup after every token costs a few hash probes rather than
/// a scan of the history (auto proposes one before each greedy step it takes).
#[derive(Clone, Debug, Default)]
pub struct IndexedHistory {
    tokens: Vec<TokenId>,
    /// `starts[n − 1]`: n-gram hash → start positions, increasing. A hash may be shared by other
    /// n-grams: a lookup compares the tokens.
    starts: Vec<HashMap<u64, Vec<usize>>>,
}

impl IndexedHistory {
    /// An empty history indexing n-grams of up to `max_ngram` tokens (a [`PromptLookup`]'s).
    pub fn new(max_ngram: usize) -> Self {
        Self { tokens: Vec::new(), starts: vec![HashMap::new(); max_ngram] }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Appends committed tokens, indexing every n-gram they complete.
    pub fn extend(&mut self, tokens: &[TokenId]) {
        for &token in tokens {
            self.push(token);
        }
    }

    /// Appends one committed token, indexing the n-grams it ends.
    pub fn push(&mut self, token: TokenId) {
        self.tokens.push(token);
        let len = self.tokens.len();
        for (n, starts) in (1..=len.min(self.starts.len())).zip(&mut self.starts) {
            starts.entry(ngram_hash(&self.tokens[len - n..])).or_default().push(len - n);
        }
    }

    /// Where the last `n` tokens occurred before (the suffix itself excluded; an occurrence may
    /// overlap it), the most recent first. Only indexed n-grams count: with the pending root
    /// pushed last, every earlier occurrence ends in committed history, which is indexed.
    fn earlier_occurrences(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        let len = self.tokens.len();
        let suffix = &self.tokens[len - n..];
        let indexed = self.starts.get(n - 1).and_then(|starts| starts.get(&ngram_hash(suffix)));
        indexed
            .into_iter()
            .flat_map(|starts| starts.iter().rev().copied())
            .filter(move |&s| s < len - n && self.tokens[s..s + n] == *suffix)
    }
}

fn ngram_hash(tokens: &[TokenId]) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    tokens.hash(&mut hasher);
    hasher.finish()
}

/// The continuations (the most recent first) merged into a tree in best-first order. A lookup
/// says nothing of its own odds, so a node claims half its parent's probability, shared among the
/// continuations by how many of them pass through it: log q = depth·ln ½ + ln(count / total). That
/// is the prior the auto policy calibrates per depth; a single continuation is a chain claiming
/// ½, ¼, ⅛ … Ties keep the order nodes were first met in (the more recent occurrence first).
pub fn lookup_tree(continuations: &[&[TokenId]]) -> Tree {
    struct Node {
        token: TokenId,
        parent: Option<usize>,
        depth: u32,
        count: usize,
    }
    let mut nodes: Vec<Node> = Vec::new();
    let mut children: HashMap<(Option<usize>, TokenId), usize> = HashMap::new();
    for tokens in continuations {
        let mut parent = None;
        for &token in *tokens {
            let index = *children.entry((parent, token)).or_insert_with(|| {
                let depth = parent.map_or(1, |p: usize| nodes[p].depth + 1);
                nodes.push(Node { token, parent, depth, count: 0 });
                nodes.len() - 1
            });
            nodes[index].count += 1;
            parent = Some(index);
        }
    }
    let total = continuations.len().max(1) as f64;
    let log_q: Vec<f64> =
        nodes.iter().map(|n| f64::from(n.depth) * 0.5f64.ln() + (n.count as f64 / total).ln()).collect();
    // A child claims less than its parent, so this order puts parents first.
    let mut order: Vec<usize> = (0..nodes.len()).collect();
    order.sort_by(|&a, &b| log_q[b].total_cmp(&log_q[a]));
    let mut packed = vec![-1i32; nodes.len()];
    let mut tree = Tree::default();
    for i in order {
        let parent = nodes[i].parent.map_or(-1, |p| packed[p]);
        packed[i] = tree.push(nodes[i].token, parent, log_q[i]);
    }
    tree
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
        Box::new(PromptLookupSession {
            lookup: self.lookup.clone(),
            indexed: IndexedHistory::new(self.lookup.max_ngram),
        })
    }
}

struct PromptLookupSession {
    lookup: PromptLookup,
    /// The context as received, indexed for the lookup (its length checks the verifier's
    /// positions).
    indexed: IndexedHistory,
}

impl Session for PromptLookupSession {
    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        _: Option<Tensor>,
    ) -> Result<(), DraftError> {
        check_continues(self.indexed.len(), first)?;
        self.indexed.extend(tokens);
        Ok(())
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        check_root_at(self.indexed.len(), round)?;
        let found = self.lookup.find_after(&mut self.indexed, round.root_token);
        let mut tree = found.map(|(_, tree)| tree.within(&round.reach)).unwrap_or_default();
        tree.truncate(round.budget);
        Ok(tree)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Reach;

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
        // One continuation: a chain claiming ½, ¼, ⅛, 1/16.
        let claims: Vec<f64> = tree.log_probs.iter().map(|lp| lp.exp()).collect();
        assert!(
            claims.iter().zip([0.5, 0.25, 0.125, 0.0625]).all(|(c, e)| (c - e).abs() < 1e-12),
            "{claims:?}"
        );
    }

    #[test]
    fn merges_the_recent_occurrences_into_a_best_first_tree() {
        let pld = PromptLookup { max_nodes: 8, ..PromptLookup::new(2) };
        // [6, 1, 2] never occurred before; [1, 2] did at 0, 5 and 10, followed by 7 8, 7 9 and
        // 5 0 (the most recent).
        let history = [1, 2, 7, 8, 3, 1, 2, 7, 9, 4, 1, 2, 5, 0, 6, 1, 2];
        let (ngram, tree) = pld.find(&history).unwrap();
        assert_eq!(ngram, 2);
        // 7 (two of three, ⅓), 5 (⅙), then the depth-2 nodes (1/12 each) in the order met: 0
        // (after 5, the most recent), 9, 8.
        assert_eq!(tree.tokens, vec![7, 5, 0, 9, 8]);
        assert_eq!(tree.parents, vec![-1, -1, 1, 0, 0]);
        assert_eq!(tree.depths, vec![1, 1, 2, 2, 2]);
        let claims: Vec<f64> = tree.log_probs.iter().map(|lp| lp.exp()).collect();
        let expected = [1.0 / 3.0, 1.0 / 6.0, 1.0 / 12.0, 1.0 / 12.0, 1.0 / 12.0];
        assert!(claims.iter().zip(expected).all(|(c, e)| (c - e).abs() < 1e-12), "{claims:?}");
        // Only the most recent occurrence when asked for one branch; no more nodes than one
        // continuation may have.
        let single = PromptLookup { max_branches: 1, ..pld.clone() };
        assert_eq!(single.propose(&history).tokens, vec![5, 0]);
        let narrow = PromptLookup { max_nodes: 3, ..pld };
        assert_eq!(narrow.propose(&history).tokens, vec![7, 5, 0]);
        assert_eq!(PromptLookup::new(2).propose(&history).tokens, vec![7, 5]);
    }

    #[test]
    fn prefers_longer_ngrams_then_the_most_recent_occurrence() {
        let pld = PromptLookup { max_branches: 1, ..PromptLookup::new(2) };
        // [7, 3] never recurs, so n = 1 on token 3: last seen at index 4, followed by 9.
        let history = [3, 5, 0, 0, 3, 9, 7, 3];
        assert_eq!(pld.propose(&history).tokens, vec![9, 7]);
        // Merged with the occurrence before it (index 0, followed by 5 0), the recent one first.
        let merged = PromptLookup { max_nodes: 4, ..PromptLookup::new(2) };
        assert_eq!(merged.propose(&history).tokens, vec![9, 5, 7, 0]);
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
        assert_eq!(pld.find(&[1, 2, 9, 1, 2]).map(|(n, t)| (n, t.tokens)), Some((2, vec![9, 1, 2])));
        assert_eq!(pld.find(&[1, 2, 3, 4]), None);
    }

    proptest::proptest! {
        /// The index finds what the scan finds, token by token, over histories small alphabets
        /// make repetitive (and n-gram lengths past the history's).
        #[test]
        fn the_indexed_history_finds_what_the_scan_finds(
            tokens in proptest::collection::vec(0u32..4, 0..60),
            max_ngram in 1usize..5,
            max_draft in 0usize..6,
            max_branches in 0usize..5,
        ) {
            let lookup = PromptLookup { max_ngram, max_branches, ..PromptLookup::new(max_draft) };
            let mut indexed = IndexedHistory::new(max_ngram);
            for (i, &root) in tokens.iter().enumerate() {
                let scanned = lookup.find(&tokens[..=i]);
                proptest::prop_assert_eq!(lookup.find_after(&mut indexed, root), scanned);
                proptest::prop_assert_eq!(indexed.len(), i);
                indexed.extend(&[root]);
            }
        }
    }

    #[test]
    fn a_session_drafts_within_the_budget_and_checks_the_root() {
        let engine = PromptLookupEngine::new(16, 100);
        let mut session = engine.new_session();
        session.append_context(0, &[1, 2, 3, 4, 5, 1, 2], None).unwrap();
        let round = RoundInput {
            root_token: 3,
            root_position: 7,
            budget: 2,
            branch_k: 1,
            spine: false,
            reach: Reach::unbounded(),
        };
        assert_eq!(session.draft(&round).unwrap().tokens, vec![4, 5]);
        // 4 ends the generation: nothing after it.
        let ending = RoundInput { reach: Reach { max_depth: usize::MAX, ends: vec![4] }, ..round.clone() };
        assert_eq!(session.draft(&ending).unwrap().tokens, vec![4]);
        let late = RoundInput { root_position: 9, ..round };
        assert!(matches!(session.draft(&late), Err(DraftError::RootPosition { .. })));
        assert!(matches!(session.append_context(3, &[1], None), Err(DraftError::ContextGap { .. })));
    }
}
