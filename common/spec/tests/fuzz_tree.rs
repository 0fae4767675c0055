//! Fuzzing tree validation (property tests on stable Rust): any tree a drafter can send is either
//! refused or safe to verify — the acceptance walk, the mask, `descend` and `truncate` never panic
//! on a tree that passed `validate`, and what they return stays inside the tree.
//! `GLANCE_FUZZ_CASES` sets the number of cases.

use glance_spec::tree::{Tree, TreeLimits};
use proptest::prelude::*;

fn cases(default: u32) -> u32 {
    std::env::var("GLANCE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

const VOCAB: u32 = 64;

/// Trees as a drafter might send them: well formed half of the time (built node by node, path
/// log-probabilities falling downwards), or arrays with any lengths, parents, depths and values.
fn tree() -> impl Strategy<Value = Tree> {
    let node = (0..VOCAB + 4, any::<prop::sample::Index>(), -5.0f64..=0.0);
    let built = prop::collection::vec(node, 0..40).prop_map(|nodes| {
        let mut tree = Tree::default();
        for (token, parent, step) in nodes {
            let parent = parent.index(tree.len() + 1) as i32 - 1;
            let above = usize::try_from(parent).map_or(0.0, |p| tree.log_probs[p]);
            tree.push(token, parent, above + step);
        }
        tree
    });
    let raw = (
        prop::collection::vec(0..VOCAB + 4, 0..40),
        prop::collection::vec(prop_oneof![-3i32..40, Just(i32::MIN), Just(i32::MAX)], 0..40),
        prop::collection::vec(prop_oneof![0u32..20, Just(u32::MAX)], 0..40),
        prop::collection::vec(any::<f64>(), 0..40),
    )
        .prop_map(|(tokens, parents, depths, log_probs)| Tree { tokens, parents, depths, log_probs });
    prop_oneof![built, raw]
}

fn limits() -> impl Strategy<Value = TreeLimits> {
    (0usize..45, 0usize..20).prop_map(|(max_nodes, max_depth)| TreeLimits {
        vocab: VOCAB as usize,
        max_nodes,
        max_depth,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(20_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn a_tree_is_refused_or_safe_to_verify(
        tree in tree(),
        limits in limits(),
        choices in prop::collection::vec(0..VOCAB, 41),
        path in prop::collection::vec(0..VOCAB, 0..6),
        keep in 0usize..45,
    ) {
        if tree.validate(limits).is_err() {
            return Ok(());
        }
        let n = tree.len();
        let (accepted, bonus) = tree.accepted_path(&choices[..n + 1]);
        prop_assert!(accepted.iter().all(|&i| i < n));
        prop_assert!(accepted.windows(2).all(|w| w[0] < w[1]), "a path goes down the packed order");
        prop_assert!(bonus < VOCAB);
        prop_assert_eq!(tree.ancestor_visibility().len(), (n + 1) * (n + 1));
        if let Some(below) = tree.clone().descend(&path) {
            prop_assert!(below.len() <= n);
            prop_assert!(below.validate(limits).is_ok(), "a subtree of a valid tree is valid");
        }
        let mut prefix = tree.clone();
        prefix.truncate(keep);
        prop_assert!(prefix.validate(limits).is_ok(), "a prefix of a valid tree is valid");
    }
}
