//! The candidate tree both services agree on: how the drafter builds it from one block-draft
//! pass (glance.md §4: per-offset top-k marginals turned, with no further draft passes, into the
//! prefix-closed set of the `budget` most probable paths under the factorized score Σ log q_j —
//! GLANCE's `build_budget_tree`, reproduced node for node), the validator the
//! verifier applies to every tree it receives, the acceptance walk, and the ancestor-only layout of
//! the verify pass's attention mask.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use tch::{Kind, Tensor};

/// A token id of the target's vocabulary.
pub type TokenId = u32;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TreeError {
    #[error("draft logits of shape {0:?}, expected [offsets, vocab]")]
    LogitsShape(Vec<i64>),
    #[error("tree arrays disagree: {tokens} tokens, {parents} parents, {depths} depths, {log_probs} log-probabilities")]
    LengthMismatch { tokens: usize, parents: usize, depths: usize, log_probs: usize },
    #[error(
        "node {index}: path log-probability {log_prob} is not a finite number at most its parent's (or 0)"
    )]
    BadLogProb { index: usize, log_prob: f64 },
    #[error("tree of {nodes} nodes exceeds the limit of {max}")]
    TooManyNodes { nodes: usize, max: usize },
    #[error("node {index}: token {token} outside the vocabulary of {vocab}")]
    TokenOutOfVocab { index: usize, token: TokenId, vocab: usize },
    #[error("node {index}: parent {parent} is not -1 or an earlier node")]
    BadParent { index: usize, parent: i32 },
    #[error("node {index}: depth {depth}, but its parent's depth + 1 is {expected}")]
    BadDepth { index: usize, depth: u32, expected: u64 },
    #[error("node {index}: depth {depth} exceeds the limit of {max}")]
    TooDeep { index: usize, depth: u32, max: usize },
}

/// A candidate tree in packed order (parents before children), as parallel arrays (the wire's
/// layout). The root is implicit: depth 0, addressed by parent −1.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tree {
    pub tokens: Vec<TokenId>,
    /// Index of each node's parent, −1 for a child of the root.
    pub parents: Vec<i32>,
    /// Block offset of each node: its parent's depth + 1.
    pub depths: Vec<u32>,
    /// Cumulative log-probability of the path root → node under the drafter (0 where unknown).
    pub log_probs: Vec<f64>,
}

/// How far a round could still commit, as the verifier tells the drafter: nothing below a token
/// that ends the generation, nothing deeper than `max_depth`. A drafter that knows it spends its
/// budget on nodes that can be committed; the verifier cuts what arrives the same way
/// ([`Tree::within`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Reach {
    pub max_depth: usize,
    pub ends: Vec<TokenId>,
}

impl Default for Reach {
    fn default() -> Self {
        Self::unbounded()
    }
}

impl Reach {
    /// No limit but the block's.
    pub fn unbounded() -> Self {
        Self { max_depth: usize::MAX, ends: Vec::new() }
    }

    /// Whether committing `token` ends the generation.
    fn ends(&self, token: TokenId) -> bool {
        self.ends.contains(&token)
    }

    /// Whether a node at `depth` holding `token` may have children worth drafting.
    fn extends(&self, depth: usize, token: TokenId) -> bool {
        depth < self.max_depth && !self.ends(token)
    }
}

/// What a received tree must stay within.
#[derive(Clone, Copy, Debug)]
pub struct TreeLimits {
    pub vocab: usize,
    pub max_nodes: usize,
    pub max_depth: usize,
}

impl Tree {
    /// A single path: each node the child of the previous one.
    pub fn chain(tokens: &[TokenId]) -> Self {
        let mut tree = Self::default();
        for &token in tokens {
            tree.push(token, tree.len() as i32 - 1, 0.0);
        }
        tree
    }

    /// Appends a node under `parent` (−1: the root); returns its index.
    pub fn push(&mut self, token: TokenId, parent: i32, log_prob: f64) -> i32 {
        let depth = if parent < 0 { 1 } else { self.depths[parent as usize] + 1 };
        self.tokens.push(token);
        self.parents.push(parent);
        self.depths.push(depth);
        self.log_probs.push(log_prob);
        (self.tokens.len() - 1) as i32
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Keeps the first `n` nodes (still a valid tree: parents precede children).
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.parents.truncate(n);
        self.depths.truncate(n);
        self.log_probs.truncate(n);
    }

    /// The subtree of the nodes `keep` (ascending, each node's parent kept too: a set the auto
    /// policy chose by acceptance), re-indexed, in the same order.
    pub fn select(&self, keep: &[usize]) -> Tree {
        let mut index = vec![-1i32; self.len()];
        let mut kept = Tree::default();
        for &i in keep {
            let parent = usize::try_from(self.parents[i]).map_or(-1, |p| index[p]);
            debug_assert!(self.parents[i] < 0 || parent >= 0, "node {i} kept without its parent");
            index[i] = kept.len() as i32;
            kept.tokens.push(self.tokens[i]);
            kept.parents.push(parent);
            kept.depths.push(self.depths[i]);
            kept.log_probs.push(self.log_probs[i]);
        }
        kept
    }

    /// The nodes a round could still commit within `reach`: none below a node whose token ends
    /// the generation (the committer stops there) and none deeper than `reach.max_depth` (the
    /// generation's length or context limit stops it first). Ancestor-closed and in order, so a
    /// best-first tree stays best-first; the tree itself when nothing is cut.
    pub fn within(self, reach: &Reach) -> Tree {
        // open[i]: node i can be committed and so can a child of it.
        let mut open = vec![false; self.len()];
        let mut keep = Vec::with_capacity(self.len());
        for i in 0..self.len() {
            let reachable = usize::try_from(self.parents[i]).map_or(true, |p| open[p]);
            if reachable && self.depths[i] as usize <= reach.max_depth {
                keep.push(i);
                open[i] = !reach.ends(self.tokens[i]);
            }
        }
        if keep.len() == self.len() {
            self
        } else {
            self.select(&keep)
        }
    }

    /// Checks a tree as it arrives over the wire: the arrays agree, every parent is −1 or an
    /// earlier node, every depth is its parent's + 1, tokens are in the vocabulary, every
    /// log-probability is one (the auto policy reads them), and the tree is within the node and
    /// depth limits.
    pub fn validate(&self, limits: TreeLimits) -> Result<(), TreeError> {
        let (tokens, parents, depths) = (&self.tokens, &self.parents, &self.depths);
        let n = tokens.len();
        if parents.len() != n || depths.len() != n || self.log_probs.len() != n {
            return Err(TreeError::LengthMismatch {
                tokens: n,
                parents: parents.len(),
                depths: depths.len(),
                log_probs: self.log_probs.len(),
            });
        }
        if tokens.len() > limits.max_nodes {
            return Err(TreeError::TooManyNodes { nodes: tokens.len(), max: limits.max_nodes });
        }
        let nodes = tokens.iter().zip(parents).zip(depths).zip(&self.log_probs).enumerate();
        for (index, (((&token, &parent), &depth), &log_prob)) in nodes {
            if token as usize >= limits.vocab {
                return Err(TreeError::TokenOutOfVocab { index, token, vocab: limits.vocab });
            }
            // The root has depth 0 and path log-probability 0.
            let (parent_depth, parent_log_prob) = match parent {
                -1 => (0, 0.0),
                p if p >= 0 && (p as usize) < index => {
                    (u64::from(depths[p as usize]), self.log_probs[p as usize])
                }
                _ => return Err(TreeError::BadParent { index, parent }),
            };
            if u64::from(depth) != parent_depth + 1 {
                return Err(TreeError::BadDepth { index, depth, expected: parent_depth + 1 });
            }
            if depth as usize > limits.max_depth {
                return Err(TreeError::TooDeep { index, depth, max: limits.max_depth });
            }
            // A path's probability never grows downwards; NaN fails the comparison, and infinities
            // are refused (`descend` subtracts a node's value from its descendants').
            if !(log_prob.is_finite() && log_prob <= parent_log_prob) {
                return Err(TreeError::BadLogProb { index, log_prob });
            }
        }
        Ok(())
    }

    /// The acceptance walk: follows the target's choice from the root through children carrying
    /// that token. `choice_per_row[0]` is the target's choice after the root, `choice_per_row[i+1]`
    /// after node i. Returns the accepted node indices and the bonus token (the choice where no
    /// child matches). The tree must be valid.
    pub fn accepted_path(&self, choice_per_row: &[TokenId]) -> (Vec<usize>, TokenId) {
        let mut path = Vec::new();
        let mut cursor: i32 = -1;
        loop {
            let wanted = choice_per_row[(cursor + 1) as usize];
            let next = self.child(cursor, wanted);
            match next {
                Some(i) => {
                    path.push(i);
                    cursor = i as i32;
                }
                None => return (path, wanted),
            }
        }
    }

    /// The subtree below the node reached from the root by `path` (a token per depth), as a tree
    /// of its own rooted at that node: its descendants in the same order (so a best-first tree
    /// stays best-first and every prefix stays prefix-closed), depths shortened by the path's
    /// length, log-probabilities conditional on the path. `None` when the tree has no such path.
    /// This is a tree drafted at an earlier root, once greedy steps have committed `path` past it.
    pub fn descend(self, path: &[TokenId]) -> Option<Tree> {
        let mut node: i32 = -1;
        for &token in path {
            node = self.child(node, token)? as i32;
        }
        if node < 0 {
            return Some(self);
        }
        let (base_depth, base_log_prob) = (self.depths[node as usize], self.log_probs[node as usize]);
        // New index of every kept node; the new root stands in for `node`.
        let mut index: Vec<Option<i32>> = vec![None; self.len()];
        let mut below = Tree::default();
        for i in node as usize + 1..self.len() {
            let parent = self.parents[i];
            let new_parent =
                if parent == node { Some(-1) } else { usize::try_from(parent).ok().and_then(|p| index[p]) };
            if let Some(new_parent) = new_parent {
                index[i] = Some(below.len() as i32);
                below.tokens.push(self.tokens[i]);
                below.parents.push(new_parent);
                below.depths.push(self.depths[i] - base_depth);
                below.log_probs.push(self.log_probs[i] - base_log_prob);
            }
        }
        Some(below)
    }

    /// How many tokens of `path` (a token per depth, from the root) the tree holds as a path:
    /// what verifying it would have accepted had `path` been the target's choice.
    pub fn followed(&self, path: &[TokenId]) -> usize {
        self.nodes_along(path).len()
    }

    /// The nodes that spell `path` (a token per depth, from the root), as far as the tree holds it.
    pub fn nodes_along(&self, path: &[TokenId]) -> Vec<usize> {
        let mut nodes = Vec::new();
        let mut node: i32 = -1;
        for &token in path {
            match self.child(node, token) {
                Some(child) => {
                    nodes.push(child);
                    node = child as i32;
                }
                None => break,
            }
        }
        nodes
    }

    /// This tree with `other`, drafted at the same root, grafted on: every path of either, this
    /// tree's nodes first with their indices unchanged, then the nodes of `other` it lacks in
    /// `other`'s order (so parents still precede children). Returns the union and, for each node
    /// of `other`, its index there. A node both hold keeps this tree's log-probability, and one
    /// only `other` holds its own, capped at its new parent's (the union stays a valid tree).
    pub fn graft(&self, other: &Tree) -> (Tree, Vec<usize>) {
        let mut union = self.clone();
        let mut index: Vec<usize> = Vec::with_capacity(other.len());
        for i in 0..other.len() {
            let parent = usize::try_from(other.parents[i]).map_or(-1, |p| index[p] as i32);
            let node = match union.child(parent, other.tokens[i]) {
                Some(node) => node,
                None => {
                    // Never above the parent's, which may be this tree's own (lower) score.
                    let ceiling = usize::try_from(parent).map_or(0.0, |p| union.log_probs[p]);
                    union.push(other.tokens[i], parent, other.log_probs[i].min(ceiling)) as usize
                }
            };
            index.push(node);
        }
        (union, index)
    }

    /// The child of `parent` (−1: the root) carrying `token`, if the tree has one.
    fn child(&self, parent: i32, token: TokenId) -> Option<usize> {
        (0..self.len()).find(|&i| self.parents[i] == parent && self.tokens[i] == token)
    }

    /// Which rows of the packed `[root, node 0, node 1, …]` each row may attend to: itself and its
    /// ancestors, nothing else. Row-major (1+N)×(1+N). The tree must be valid.
    pub fn ancestor_visibility(&self) -> Vec<bool> {
        let pack = self.len() + 1;
        let mut visible = vec![false; pack * pack];
        visible[0] = true;
        for (i, &parent) in self.parents.iter().enumerate() {
            let (row, parent_row) = (i + 1, (parent + 1) as usize);
            let (from, to) = (parent_row * pack, row * pack);
            visible.copy_within(from..from + pack, to);
            visible[to + row] = true;
        }
        visible
    }
}

/// Per offset: the `k` most probable tokens and their log-probabilities, best first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Marginals {
    /// ids[d][r]: rank-r token at offset d+1.
    pub ids: Vec<Vec<TokenId>>,
    /// log_probs[d][r]: its log-probability (f32, as computed).
    pub log_probs: Vec<Vec<f32>>,
}

impl Marginals {
    /// From draft logits (L, V), any dtype and device: float32 log-softmax, then `torch.topk`
    /// (sorted descending, ties as torch orders them). `k` is clamped to V.
    pub fn top_k(logits: &Tensor, k: usize) -> Result<Self, TreeError> {
        let size = logits.size();
        let [offsets, vocab] = size[..] else {
            return Err(TreeError::LogitsShape(size));
        };
        if vocab > 1 << 24 {
            // The ids come back as f32 (below).
            return Err(TreeError::LogitsShape(size));
        }
        let k = (k as i64).min(vocab);
        let (values, indices) =
            tch::no_grad(|| logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float).topk(k, -1, true, true));
        // One host copy: the ids travel as f32 beside the values (exact below 2^24).
        let packed = Tensor::cat(&[values.flatten(0, -1), indices.flatten(0, -1).to_kind(Kind::Float)], 0);
        let packed = Vec::<f32>::try_from(glance_device::read_back(&packed))
            .map_err(|_| TreeError::LogitsShape(size.clone()))?;
        let (values, indices) = packed.split_at(packed.len() / 2);
        let ids: Vec<TokenId> = indices.iter().map(|&i| i as TokenId).collect();
        let (offsets, k) = (offsets as usize, k as usize);
        Ok(Self { ids: split_rows(&ids, offsets, k), log_probs: split_rows(values, offsets, k) })
    }

    /// Offsets with candidates.
    pub fn depth(&self) -> usize {
        self.ids.len().min(self.log_probs.len())
    }

    /// Candidates every offset has.
    fn width(&self) -> usize {
        (0..self.depth()).map(|d| self.ids[d].len().min(self.log_probs[d].len())).min().unwrap_or(0)
    }

    /// Log-probability of rank `rank` at offset `depth`+1; NaN counts as −∞.
    fn log_prob(&self, depth: usize, rank: usize) -> f64 {
        let value = f64::from(self.log_probs[depth][rank]);
        if value.is_nan() {
            f64::NEG_INFINITY
        } else {
            value
        }
    }
}

/// `rows` consecutive rows of `width` from a row-major buffer.
fn split_rows<T: Copy>(flat: &[T], rows: usize, width: usize) -> Vec<Vec<T>> {
    (0..rows).map(|r| flat[r * width..(r + 1) * width].to_vec()).collect()
}

/// A pending expansion, ordered as GLANCE's Python heap tuple
/// `(neg_cum, depth, parent, rank, order)` compares: lexicographically, floats by value (so
/// −0.0 equals 0.0). `order` is unique, so no two entries are equal and the pop order is fully
/// determined.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    neg_cum: f64,
    depth: usize,
    parent: i32,
    rank: usize,
    order: u64,
}

impl Candidate {
    fn python_order(&self, other: &Self) -> Ordering {
        // NaN never gets here (sanitized on input), so `partial_cmp` is total.
        self.neg_cum
            .partial_cmp(&other.neg_cum)
            .unwrap_or(Ordering::Equal)
            .then(self.depth.cmp(&other.depth))
            .then(self.parent.cmp(&other.parent))
            .then(self.rank.cmp(&other.rank))
            .then(self.order.cmp(&other.order))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    /// Reversed, so std's max-heap pops the smallest tuple first, as `heapq` does.
    fn cmp(&self, other: &Self) -> Ordering {
        other.python_order(self)
    }
}

/// GLANCE's `build_budget_tree`: best-first expansion on cumulative log-probability, keeping at
/// most `budget` nodes, each node offering `branch_k` children (clamped to the narrowest row).
/// Cumulative sums are f64 from the f32 log-probabilities, as the Python floats are. Nodes come
/// in pop order: parents before children. The caller bounds `budget`. Within `reach` (GLANCE's
/// tree when unbounded): a node that ends the generation or sits at the deepest committable
/// depth offers no children, so the budget goes to nodes a round could commit.
pub fn build_budget_tree(marginals: &Marginals, budget: usize, branch_k: usize, reach: &Reach) -> Tree {
    let depth_max = marginals.depth().min(reach.max_depth);
    let k = branch_k.min(marginals.width());
    let mut heap = BinaryHeap::new();
    let mut order = 0u64;
    let mut push = |heap: &mut BinaryHeap<Candidate>, neg_cum, depth, parent, rank| {
        heap.push(Candidate { neg_cum, depth, parent, rank, order });
        order += 1;
    };
    if depth_max > 0 {
        for r in 0..k {
            push(&mut heap, -marginals.log_prob(0, r), 1, -1, r);
        }
    }
    let mut tree = Tree::default();
    while tree.len() < budget {
        let Some(best) = heap.pop() else { break };
        let token = marginals.ids[best.depth - 1][best.rank];
        let here = tree.push(token, best.parent, -best.neg_cum);
        // depth_max already holds the reach's depth.
        if best.depth < depth_max && !reach.ends(token) {
            for r in 0..k {
                push(&mut heap, best.neg_cum - marginals.log_prob(best.depth, r), best.depth + 1, here, r);
            }
        }
    }
    tree
}

/// `tree` (built from `marginals`) with its spine, the path of every offset's top token, carried
/// to the block's last offset: the spine nodes the budget left out, appended in depth order. A
/// best-first tree ends its spine where a sibling's path outscores it, though the head may be
/// right far deeper than its marginals claim (on the toy world's charts it is); the auto policy,
/// which chooses the nodes to verify from its own calibration, is offered the whole spine.
/// Stops at an offset whose top token has no finite log-probability, and where `reach` ends.
pub fn extend_spine(tree: &mut Tree, marginals: &Marginals, reach: &Reach) {
    let mut tip: i32 = -1;
    for depth in 0..marginals.depth() {
        let Some(&token) = marginals.ids[depth].first() else { return };
        if let Some(child) = tree.child(tip, token) {
            tip = child as i32;
        } else {
            let log_prob =
                tree.log_probs.get(tip as usize).copied().unwrap_or(0.0) + marginals.log_prob(depth, 0);
            if !log_prob.is_finite() {
                return;
            }
            tip = tree.push(token, tip, log_prob);
        }
        if !reach.extends(depth + 1, token) {
            return;
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests build and read host tensors freely
mod tests {
    use super::*;

    #[test]
    fn descending_keeps_the_subtree_in_order_with_conditional_scores() {
        // root ─ a(1) ─ c(3) ─ e(5)
        //      │      └ d(4)
        //      └ b(2) ─ f(6)
        let mut tree = Tree::default();
        let a = tree.push(1, -1, -0.1);
        let b = tree.push(2, -1, -1.0);
        let c = tree.push(3, a, -0.3);
        let _d = tree.push(4, a, -1.5);
        let _f = tree.push(6, b, -2.0);
        let _e = tree.push(5, c, -0.6);
        let below_a = tree.clone().descend(&[1]).unwrap();
        assert_eq!(shape(&below_a), vec![(3, 1, -1), (4, 1, -1), (5, 2, 0)]);
        let scores: Vec<f64> = below_a.log_probs.iter().map(|p| (p * 10.0).round() / 10.0).collect();
        assert_eq!(scores, vec![-0.2, -1.4, -0.5]);
        assert!(below_a.validate(TreeLimits { vocab: 8, max_nodes: 8, max_depth: 2 }).is_ok());
        assert_eq!(shape(&tree.clone().descend(&[1, 3]).unwrap()), vec![(5, 1, -1)]);
        assert!(tree.clone().descend(&[1, 3, 5]).unwrap().is_empty());
        assert_eq!(tree.clone().descend(&[]).unwrap(), tree);
        // Off the tree: the greedy steps left it.
        assert_eq!(tree.clone().descend(&[2, 3]), None);
        // How far steps followed it before leaving (or passing its depth).
        assert_eq!([tree.followed(&[2, 3]), tree.followed(&[7]), tree.followed(&[1, 3, 5, 9])], [1, 0, 3]);
        assert_eq!([tree.followed(&[1, 4]), tree.followed(&[])], [2, 0]);
        assert_eq!(tree.descend(&[7]), None);
    }

    #[test]
    fn nodes_past_the_end_of_the_generation_are_cut() {
        // root ─ a(1) ─ eos(2) ─ c(3)
        //      │      └ d(4) ─ e(5)
        //      └ eos(2) ─ f(6)
        let mut tree = Tree::default();
        let a = tree.push(1, -1, -0.1);
        let end = tree.push(2, a, -0.2);
        let other_end = tree.push(2, -1, -0.5);
        let d = tree.push(4, a, -0.7);
        tree.push(3, end, -0.8);
        tree.push(6, other_end, -0.9);
        tree.push(5, d, -1.0);
        let reach = |max_depth| Reach { max_depth, ends: vec![2] };
        // An end token is kept (committing it ends the generation), nothing below it.
        let cut = tree.clone().within(&reach(16));
        assert_eq!(shape(&cut), vec![(1, 1, -1), (2, 2, 0), (2, 1, -1), (4, 2, 0), (5, 3, 3)]);
        assert_eq!(cut.log_probs, vec![-0.1, -0.2, -0.5, -0.7, -1.0]);
        // A length limit cuts by depth; with none reached and no end token the tree is unchanged.
        assert_eq!(shape(&tree.clone().within(&reach(1))), vec![(1, 1, -1), (2, 1, -1)]);
        assert!(tree.clone().within(&reach(0)).is_empty());
        assert_eq!(tree.clone().within(&Reach { max_depth: 3, ends: Vec::new() }), tree);
    }

    #[test]
    fn grafting_unites_the_paths_of_two_trees_at_one_root() {
        // Drafted: root ─ a(1) ─ c(3)      Lookup: root ─ a(1) ─ c(3) ─ e(5)
        //               └ b(2)                          └ g(7)
        let mut drafted = Tree::default();
        let a = drafted.push(1, -1, -0.1);
        drafted.push(2, -1, -1.0);
        drafted.push(3, a, -0.3);
        let mut lookup = Tree::default();
        let la = lookup.push(1, -1, -0.7);
        let lc = lookup.push(3, la, -1.4);
        lookup.push(7, -1, -0.7);
        lookup.push(5, lc, -2.1);
        let (union, index) = drafted.graft(&lookup);
        // The drafted nodes keep their places and scores; the lookup's new ones follow, parents first.
        assert_eq!(shape(&union), vec![(1, 1, -1), (2, 1, -1), (3, 2, 0), (7, 1, -1), (5, 3, 2)]);
        assert_eq!(&union.log_probs[..3], &drafted.log_probs[..]);
        assert_eq!(index, vec![0, 2, 3, 4]);
        assert!(union.validate(TreeLimits { vocab: 8, max_nodes: 8, max_depth: 3 }).is_ok());
        assert_eq!(union.nodes_along(&[1, 3, 5, 6]), vec![0, 2, 4]);
        assert_eq!(union.nodes_along(&[7]), vec![3]);
        assert!(union.nodes_along(&[4]).is_empty());
        // Nothing to add: the union is the tree itself.
        assert_eq!(drafted.graft(&Tree::chain(&[1, 3])), (drafted.clone(), vec![0, 2]));
    }

    fn marginals(ids: Vec<Vec<TokenId>>, log_probs: Vec<Vec<f32>>) -> Marginals {
        Marginals { ids, log_probs }
    }

    /// (token, depth, parent) of every node.
    fn shape(tree: &Tree) -> Vec<(TokenId, u32, i32)> {
        (0..tree.len()).map(|i| (tree.tokens[i], tree.depths[i], tree.parents[i])).collect()
    }

    const LIMITS: TreeLimits = TreeLimits { vocab: 10, max_nodes: 8, max_depth: 8 };
    const ALL: Reach = Reach { max_depth: usize::MAX, ends: Vec::new() };

    #[test]
    fn best_first_and_prefix_closed() {
        let m = marginals(
            vec![vec![10, 11], vec![20, 21], vec![30, 31]],
            vec![vec![-0.1, -2.0], vec![-0.5, -0.7], vec![-3.0, -4.0]],
        );
        let tree = build_budget_tree(&m, 4, 2, &ALL);
        // 10 (-0.1), 10>20 (-0.6), 10>21 (-0.8), 11 (-2.0)
        assert_eq!(shape(&tree), vec![(10, 1, -1), (20, 2, 0), (21, 2, 0), (11, 1, -1)]);
        assert!((tree.log_probs[1] - (-0.1f32 as f64 + -0.5f32 as f64)).abs() < 1e-12);
        assert_eq!(tree.validate(TreeLimits { vocab: 100, max_nodes: 64, max_depth: 15 }), Ok(()));
        // Budget beyond the whole tree: all 2 + 4 + 8 nodes.
        assert_eq!(build_budget_tree(&m, 100, 2, &ALL).len(), 14);
        assert!(build_budget_tree(&m, 10, 0, &ALL).is_empty());
        assert!(build_budget_tree(&Marginals::default(), 10, 8, &ALL).is_empty());
    }

    #[test]
    fn the_spine_reaches_the_last_offset_and_a_selection_stays_a_tree() {
        // Offset 2's top token (20, -2.0) loses to the sibling 11 (-0.3) at a budget of 2.
        let m = marginals(
            vec![vec![10, 11], vec![20, 21], vec![30, 31]],
            vec![vec![-0.1, -0.3], vec![-2.0, -2.5], vec![-0.2, -4.0]],
        );
        let mut tree = build_budget_tree(&m, 2, 2, &ALL);
        assert_eq!(shape(&tree), vec![(10, 1, -1), (11, 1, -1)]);
        extend_spine(&mut tree, &m, &ALL);
        assert_eq!(shape(&tree), vec![(10, 1, -1), (11, 1, -1), (20, 2, 0), (30, 3, 2)]);
        assert!((tree.log_probs[3] - (-0.1f32 as f64 + -2.0f32 as f64 + -0.2f32 as f64)).abs() < 1e-12);
        assert_eq!(tree.validate(TreeLimits { vocab: 100, ..LIMITS }), Ok(()));
        // A tree that holds its whole spine already is left as it is.
        let whole = build_budget_tree(&m, 14, 2, &ALL);
        let mut extended = whole.clone();
        extend_spine(&mut extended, &m, &ALL);
        assert_eq!(extended, whole);
        // A top token of probability 0 ends the spine (the verifier refuses infinite scores).
        let mut tree = build_budget_tree(&m, 1, 2, &ALL);
        let dead =
            marginals(m.ids.clone(), vec![vec![-0.1, -0.3], vec![f32::NEG_INFINITY, -2.5], vec![-0.2, -4.0]]);
        extend_spine(&mut tree, &dead, &ALL);
        assert_eq!(tree.len(), 1);

        let mut tree = build_budget_tree(&m, 2, 2, &ALL);
        extend_spine(&mut tree, &m, &ALL);
        let kept = tree.select(&[0, 2, 3]);
        assert_eq!(shape(&kept), vec![(10, 1, -1), (20, 2, 0), (30, 3, 1)]);
        assert_eq!(kept.validate(TreeLimits { vocab: 100, ..LIMITS }), Ok(()));
        assert_eq!(shape(&tree.select(&[1])), vec![(11, 1, -1)]);
    }

    #[test]
    fn the_budget_goes_to_nodes_within_reach() {
        // Unbounded: 10 (-0.1), 10>20 (-0.2), 10>20>30 (-0.3), 11 (-1.0).
        let m = marginals(
            vec![vec![10, 11], vec![20, 21], vec![30, 31]],
            vec![vec![-0.1, -1.0], vec![-0.1, -2.0], vec![-0.1, -3.0]],
        );
        let tree = build_budget_tree(&m, 4, 2, &ALL);
        assert_eq!(shape(&tree), vec![(10, 1, -1), (20, 2, 0), (30, 3, 1), (11, 1, -1)]);
        // 20 ends the generation: nothing below it, the budget goes to 11's child and 21.
        let ends = Reach { max_depth: usize::MAX, ends: vec![20] };
        let tree = build_budget_tree(&m, 4, 2, &ends);
        assert_eq!(shape(&tree), vec![(10, 1, -1), (20, 2, 0), (11, 1, -1), (20, 2, 2)]);
        // Two tokens deep at most.
        let shallow = Reach { max_depth: 2, ends: Vec::new() };
        let tree = build_budget_tree(&m, 4, 2, &shallow);
        assert_eq!(shape(&tree), vec![(10, 1, -1), (20, 2, 0), (11, 1, -1), (20, 2, 2)]);
        // The spine stops at an end token (kept) and at the reach's depth.
        let mut tree = build_budget_tree(&m, 1, 2, &ends);
        extend_spine(&mut tree, &m, &ends);
        assert_eq!(shape(&tree), vec![(10, 1, -1), (20, 2, 0)]);
        let mut tree = build_budget_tree(&m, 1, 2, &shallow);
        extend_spine(&mut tree, &m, &shallow);
        assert_eq!(shape(&tree), vec![(10, 1, -1), (20, 2, 0)]);
        // A tree drafted blind to the reach loses what lies past it.
        let blind = build_budget_tree(&m, 4, 2, &ALL).within(&ends);
        assert_eq!(shape(&blind), vec![(10, 1, -1), (20, 2, 0), (11, 1, -1)]);
    }

    #[test]
    fn signed_zeros_tie_like_python() {
        // The sibling's key is -(-0.0) = +0.0, the child's -0.0 - 0.0 = -0.0. Python sees equal
        // keys and lets the smaller depth win; a total float order would pick the child.
        let m = marginals(vec![vec![1, 2], vec![3, 4]], vec![vec![0.0, -0.0], vec![0.0, -1.0]]);
        let tree = build_budget_tree(&m, 3, 2, &ALL);
        assert_eq!(shape(&tree), vec![(1, 1, -1), (2, 1, -1), (3, 2, 0)]);
    }

    #[test]
    fn a_chain_is_one_path() {
        assert_eq!(shape(&Tree::chain(&[4, 5])), vec![(4, 1, -1), (5, 2, 0)]);
    }

    #[test]
    fn validator_rejects_malformed_trees() {
        let tree = |tokens: &[TokenId], parents: &[i32], depths: &[u32]| Tree {
            tokens: tokens.to_vec(),
            parents: parents.to_vec(),
            depths: depths.to_vec(),
            log_probs: vec![0.0; tokens.len()],
        };
        let ok = tree(&[1, 2, 3], &[-1, 0, 0], &[1, 2, 2]);
        assert_eq!(ok.validate(TreeLimits { max_nodes: 3, max_depth: 2, ..LIMITS }), Ok(()));
        let with = |max_nodes, max_depth| TreeLimits { max_nodes, max_depth, ..LIMITS };
        let cases = [
            (tree(&[1, 2], &[-1], &[1, 2]), LIMITS),
            (tree(&[1, 2, 3], &[-1, 0, 1], &[1, 2, 3]), with(2, 8)),
            (tree(&[1, 10], &[-1, 0], &[1, 2]), LIMITS),
            (tree(&[1, 2], &[-1, 1], &[1, 2]), LIMITS),
            (tree(&[1, 2], &[-1, -2], &[1, 2]), LIMITS),
            (tree(&[1, 2], &[1, -1], &[2, 1]), LIMITS),
            (tree(&[1, 2], &[-1, 0], &[1, 3]), LIMITS),
            (tree(&[1], &[-1], &[0]), LIMITS),
            (tree(&[1, 2, 3], &[-1, 0, 1], &[1, 2, 3]), with(8, 2)),
        ];
        for (i, (tree, limits)) in cases.iter().enumerate() {
            assert!(tree.validate(*limits).is_err(), "case {i} accepted");
        }
        // Found writing fuzz_tree: a drafter that sent fewer log-probabilities than nodes made the
        // verifier's `descend` and the auto policy index past them (a panic in the engine).
        let mut short = ok.clone();
        short.log_probs.pop();
        assert!(matches!(short.validate(LIMITS), Err(TreeError::LengthMismatch { log_probs: 2, .. })));
        for bad in [f64::NAN, 0.5, f64::INFINITY, f64::NEG_INFINITY, -0.5] {
            let mut odd = ok.clone();
            odd.log_probs = vec![-1.0, -2.0, -3.0];
            odd.log_probs[1] = bad;
            assert!(matches!(odd.validate(LIMITS), Err(TreeError::BadLogProb { index: 1, .. })), "{bad}");
        }
    }

    #[test]
    fn walk_follows_matching_children_and_returns_the_bonus() {
        // root → a(0) → c(2); root → b(1)
        let mut tree = Tree::default();
        tree.push(10, -1, 0.0);
        tree.push(11, -1, 0.0);
        tree.push(12, 0, 0.0);
        // rows: root, a, b, c
        assert_eq!(tree.accepted_path(&[10, 12, 99, 7]), (vec![0, 2], 7));
        assert_eq!(tree.accepted_path(&[11, 0, 5, 0]), (vec![1], 5));
        assert_eq!(tree.accepted_path(&[42, 0, 0, 0]), (vec![], 42));
    }

    #[test]
    fn each_row_sees_itself_and_its_ancestors_only() {
        let tree = Tree {
            parents: vec![-1, -1, 0],
            depths: vec![1, 1, 2],
            tokens: vec![1, 2, 3],
            log_probs: vec![0.0; 3],
        };
        let visible = tree.ancestor_visibility();
        let row = |r: usize| visible[r * 4..(r + 1) * 4].to_vec();
        assert_eq!(row(0), [true, false, false, false]);
        assert_eq!(row(1), [true, true, false, false]);
        assert_eq!(row(2), [true, false, true, false]);
        assert_eq!(row(3), [true, true, false, true]);
    }

    #[test]
    fn top_k_matches_torch() {
        let logits = Tensor::from_slice(&[1.0f32, 3.0, 2.0, 3.0, 0.0, 0.0]).view([2, 3]);
        let m = Marginals::top_k(&logits, 2).unwrap();
        assert_eq!(m.ids[0][0], 1);
        assert_eq!(m.ids[1][0], 0);
        let expected = 3.0 - (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
        assert!((f64::from(m.log_probs[0][0]) - expected).abs() < 1e-6);
        assert_eq!(Marginals::top_k(&logits, 10).unwrap().ids[0].len(), 3);
        assert!(Marginals::top_k(&Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)), 2).is_err());
    }
}
