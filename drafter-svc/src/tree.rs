//! Candidate trees from one block-draft pass (glance.md §4): per-offset top-k marginals turned,
//! with no further draft passes, into the prefix-closed set of the `budget` most probable paths
//! under the factorized score Σ log q_j — GLANCE's `build_budget_tree`, reproduced node for node —
//! plus the chain ablation and the validator the verifier applies to every tree it receives.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use tch::{Kind, Tensor};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TreeError {
    #[error("draft logits of shape {0:?}, expected [offsets, vocab]")]
    LogitsShape(Vec<i64>),
    #[error("tree arrays disagree: {tokens} tokens, {parents} parents, {depths} depths")]
    LengthMismatch { tokens: usize, parents: usize, depths: usize },
    #[error("tree of {nodes} nodes exceeds the limit of {max}")]
    TooManyNodes { nodes: usize, max: usize },
    #[error("node {index}: token {token} outside the vocabulary of {vocab}")]
    TokenOutOfVocab { index: usize, token: u32, vocab: usize },
    #[error("node {index}: parent {parent} is not -1 or an earlier node")]
    BadParent { index: usize, parent: i32 },
    #[error("node {index}: depth {depth}, but its parent's depth + 1 is {expected}")]
    BadDepth { index: usize, depth: u32, expected: u64 },
    #[error("node {index}: depth {depth} exceeds the limit of {max}")]
    TooDeep { index: usize, depth: u32, max: usize },
}

/// One candidate token. Depth 0 is the pending root (implicit, parent −1 addresses it).
#[derive(Clone, Debug, PartialEq)]
pub struct TreeNode {
    pub token: i64,
    /// Block offset, 1..B−1.
    pub depth: usize,
    /// Index of the parent node, or −1 for a child of the root.
    pub parent: i32,
    /// Rank of `token` among the top-k at its depth.
    pub rank: usize,
    /// Cumulative log-probability of the path root → this node, under the drafter.
    pub log_prob: f64,
}

/// Per offset: the `k` most probable tokens and their log-probabilities (float32 log-softmax,
/// then `torch.topk`, sorted descending, ties as torch orders them). `logits`: (L, V), any dtype
/// and device. `k` is clamped to V.
#[allow(clippy::type_complexity)]
pub fn top_k_log_probs(logits: &Tensor, k: usize) -> Result<(Vec<Vec<i64>>, Vec<Vec<f32>>), TreeError> {
    let size = logits.size();
    let [offsets, vocab] = size[..] else {
        return Err(TreeError::LogitsShape(size));
    };
    let k = (k as i64).min(vocab);
    let (values, indices) =
        tch::no_grad(|| logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float).topk(k, -1, true, true));
    let values = Vec::<f32>::try_from(values.to_device(tch::Device::Cpu).flatten(0, -1))
        .map_err(|_| TreeError::LogitsShape(size.clone()))?;
    let indices = Vec::<i64>::try_from(indices.to_device(tch::Device::Cpu).flatten(0, -1))
        .map_err(|_| TreeError::LogitsShape(size.clone()))?;
    let k = k as usize;
    Ok((split_rows(&indices, offsets as usize, k), split_rows(&values, offsets as usize, k)))
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
/// `top_ids[d]`/`top_logp[d]` hold offset d+1's candidates, best first. Cumulative sums are f64
/// from the f32 log-probabilities, as the Python floats are. NaN log-probabilities count as −∞.
/// Nodes come in pop order: parents before children. The caller bounds `budget`.
pub fn build_budget_tree(
    top_ids: &[Vec<i64>],
    top_logp: &[Vec<f32>],
    budget: usize,
    branch_k: usize,
) -> Vec<TreeNode> {
    let depth_max = top_ids.len().min(top_logp.len());
    let width = (0..depth_max).map(|d| top_ids[d].len().min(top_logp[d].len())).min().unwrap_or(0);
    let k = branch_k.min(width);
    let logp = |depth: usize, rank: usize| -> f64 {
        let value = f64::from(top_logp[depth][rank]);
        if value.is_nan() {
            f64::NEG_INFINITY
        } else {
            value
        }
    };
    let mut heap = BinaryHeap::new();
    let mut order = 0u64;
    let mut push = |heap: &mut BinaryHeap<Candidate>, neg_cum, depth, parent, rank| {
        heap.push(Candidate { neg_cum, depth, parent, rank, order });
        order += 1;
    };
    if depth_max > 0 {
        for r in 0..k {
            push(&mut heap, -logp(0, r), 1, -1, r);
        }
    }
    let mut nodes: Vec<TreeNode> = Vec::with_capacity(budget.min(4096));
    while nodes.len() < budget {
        let Some(best) = heap.pop() else { break };
        let here = nodes.len() as i32;
        nodes.push(TreeNode {
            token: top_ids[best.depth - 1][best.rank],
            depth: best.depth,
            parent: best.parent,
            rank: best.rank,
            log_prob: -best.neg_cum,
        });
        if best.depth < depth_max {
            for r in 0..k {
                push(&mut heap, best.neg_cum - logp(best.depth, r), best.depth + 1, here, r);
            }
        }
    }
    nodes
}

/// The chain ablation: a width-1 tree of the argmax at each of the first `len` offsets.
pub fn chain(top_ids: &[Vec<i64>], top_logp: &[Vec<f32>], len: usize) -> Vec<TreeNode> {
    let mut cumulative = 0.0f64;
    top_ids
        .iter()
        .zip(top_logp)
        .take(len)
        .map_while(|(ids, logp)| Some((*ids.first()?, f64::from(*logp.first()?))))
        .enumerate()
        .map(|(d, (token, lp))| {
            cumulative += lp;
            TreeNode { token, depth: d + 1, parent: d as i32 - 1, rank: 0, log_prob: cumulative }
        })
        .collect()
}

/// Checks a tree as it arrives over the wire (parallel arrays, packed order): every parent is −1
/// or an earlier node, every depth is its parent's + 1 (children of the root have depth 1), tokens
/// are in the vocabulary, and the tree is within `max_nodes` and `max_depth`.
pub fn validate_tree(
    tokens: &[u32],
    parents: &[i32],
    depths: &[u32],
    vocab: usize,
    max_nodes: usize,
    max_depth: usize,
) -> Result<(), TreeError> {
    if tokens.len() != parents.len() || tokens.len() != depths.len() {
        return Err(TreeError::LengthMismatch {
            tokens: tokens.len(),
            parents: parents.len(),
            depths: depths.len(),
        });
    }
    if tokens.len() > max_nodes {
        return Err(TreeError::TooManyNodes { nodes: tokens.len(), max: max_nodes });
    }
    for (index, ((&token, &parent), &depth)) in tokens.iter().zip(parents).zip(depths).enumerate() {
        if token as usize >= vocab {
            return Err(TreeError::TokenOutOfVocab { index, token, vocab });
        }
        let parent_depth = match parent {
            -1 => 0,
            p if p >= 0 && (p as usize) < index => u64::from(depths[p as usize]),
            _ => return Err(TreeError::BadParent { index, parent }),
        };
        if u64::from(depth) != parent_depth + 1 {
            return Err(TreeError::BadDepth { index, depth, expected: parent_depth + 1 });
        }
        if depth as usize > max_depth {
            return Err(TreeError::TooDeep { index, depth, max: max_depth });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(nodes: &[TreeNode]) -> Vec<(i64, usize, i32, usize)> {
        nodes.iter().map(|n| (n.token, n.depth, n.parent, n.rank)).collect()
    }

    #[test]
    fn best_first_and_prefix_closed() {
        let ids = vec![vec![10, 11], vec![20, 21], vec![30, 31]];
        let logp = vec![vec![-0.1, -2.0], vec![-0.5, -0.7], vec![-3.0, -4.0]];
        let nodes = build_budget_tree(&ids, &logp, 4, 2);
        // 10 (-0.1), 10>20 (-0.6), 10>21 (-0.8), 11 (-2.0)
        assert_eq!(shape(&nodes), vec![(10, 1, -1, 0), (20, 2, 0, 0), (21, 2, 0, 1), (11, 1, -1, 1)]);
        assert!((nodes[1].log_prob - (-0.1f32 as f64 + -0.5f32 as f64)).abs() < 1e-12);
        let v = |n: &[TreeNode]| {
            let tokens: Vec<u32> = n.iter().map(|n| n.token as u32).collect();
            let parents: Vec<i32> = n.iter().map(|n| n.parent).collect();
            let depths: Vec<u32> = n.iter().map(|n| n.depth as u32).collect();
            validate_tree(&tokens, &parents, &depths, 100, 64, 15)
        };
        assert_eq!(v(&nodes), Ok(()));
        // Budget beyond the whole tree: all 2 + 4 + 8 nodes.
        assert_eq!(build_budget_tree(&ids, &logp, 100, 2).len(), 14);
        assert!(build_budget_tree(&ids, &logp, 10, 0).is_empty());
        assert!(build_budget_tree(&[], &[], 10, 8).is_empty());
    }

    #[test]
    fn signed_zeros_tie_like_python() {
        // The sibling's key is -(-0.0) = +0.0, the child's -0.0 - 0.0 = -0.0. Python sees equal
        // keys and lets the smaller depth win; a total float order would pick the child.
        let ids = vec![vec![1, 2], vec![3, 4]];
        let logp = vec![vec![0.0, -0.0], vec![0.0, -1.0]];
        let nodes = build_budget_tree(&ids, &logp, 3, 2);
        assert_eq!(shape(&nodes), vec![(1, 1, -1, 0), (2, 1, -1, 1), (3, 2, 0, 0)]);
    }

    #[test]
    fn chain_takes_the_argmax_spine() {
        let ids = vec![vec![5, 6], vec![7, 8], vec![9, 1]];
        let logp = vec![vec![-0.5, -1.0], vec![-0.25, -2.0], vec![-1.0, -3.0]];
        let nodes = chain(&ids, &logp, 2);
        assert_eq!(shape(&nodes), vec![(5, 1, -1, 0), (7, 2, 0, 0)]);
        assert_eq!(nodes[1].log_prob, -0.75);
        assert_eq!(chain(&ids, &logp, 10).len(), 3);
    }

    #[test]
    fn validator_rejects_malformed_trees() {
        let ok = validate_tree(&[1, 2, 3], &[-1, 0, 0], &[1, 2, 2], 10, 3, 2);
        assert_eq!(ok, Ok(()));
        let cases = [
            validate_tree(&[1, 2], &[-1], &[1, 2], 10, 8, 8),
            validate_tree(&[1, 2, 3], &[-1, 0, 1], &[1, 2, 3], 10, 2, 8),
            validate_tree(&[1, 10], &[-1, 0], &[1, 2], 10, 8, 8),
            validate_tree(&[1, 2], &[-1, 1], &[1, 2], 10, 8, 8),
            validate_tree(&[1, 2], &[-1, -2], &[1, 2], 10, 8, 8),
            validate_tree(&[1, 2], &[-1, 0], &[1, 3], 10, 8, 8),
            validate_tree(&[1], &[-1], &[0], 10, 8, 8),
            validate_tree(&[1, 2, 3], &[-1, 0, 1], &[1, 2, 3], 10, 8, 2),
        ];
        for (i, result) in cases.iter().enumerate() {
            assert!(result.is_err(), "case {i} accepted");
        }
    }

    #[test]
    fn top_k_matches_torch() {
        let logits = Tensor::from_slice(&[1.0f32, 3.0, 2.0, 3.0, 0.0, 0.0]).view([2, 3]);
        let (ids, logp) = top_k_log_probs(&logits, 2).unwrap();
        assert_eq!(ids[0][0], 1);
        assert_eq!(ids[1][0], 0);
        let expected = 3.0 - (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
        assert!((f64::from(logp[0][0]) - expected).abs() < 1e-6);
        assert_eq!(top_k_log_probs(&logits, 10).unwrap().0[0].len(), 3);
        assert!(top_k_log_probs(&Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)), 2).is_err());
    }
}
