//! `build_budget_tree` against the expected trees of a plain-Python heap that mirrors GLANCE's
//! `glance/tree.py` (random marginals for budgets 15/31/63 and branch 8/1, exact ties in the
//! log-probabilities and in their cumulative sums, signed zeros, exhausted budgets).
//!
//! The fixture is committed. Regenerate it (only when the cases change) with
//!   python3 tests/reference/make_tree_reference.py --out common/spec/tests/data/tree_reference.json

use std::path::Path;

use glance_spec::tree::{build_budget_tree, Marginals, Reach, TokenId, TreeLimits};
use serde_json::Value;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tree_reference.json");
    let text = std::fs::read_to_string(&path).expect("committed tree fixture");
    serde_json::from_str(&text).expect("valid JSON")
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array().expect("array").iter().map(|x| x.as_i64().expect("integer")).collect()
}

fn matrix<T>(v: &Value, cell: impl Fn(&Value) -> T) -> Vec<Vec<T>> {
    v.as_array()
        .expect("rows")
        .iter()
        .map(|row| row.as_array().expect("row").iter().map(&cell).collect())
        .collect()
}

#[test]
fn budget_trees_match_the_python_heap() {
    let cases = fixture()["cases"].as_array().expect("cases").clone();
    assert!(cases.len() >= 8);
    for case in &cases {
        let name = case["name"].as_str().expect("name");
        let ids = matrix(&case["top_ids"], |x| x.as_u64().expect("id") as TokenId);
        // Bit patterns, so the f32 values are exactly the generator's.
        let logp = matrix(&case["logp_bits"], |x| f32::from_bits(x.as_u64().expect("bits") as u32));
        let budget = case["budget"].as_u64().expect("budget") as usize;
        let branch_k = case["branch_k"].as_u64().expect("branch_k") as usize;
        let marginals = Marginals { ids, log_probs: logp };
        let tree = build_budget_tree(&marginals, budget, branch_k, &Reach::unbounded());

        let expected = case["expected"].as_array().expect("expected");
        assert_eq!(tree.len(), expected.len(), "{name}: node count");
        for (i, want) in expected.iter().enumerate() {
            let want_shape = ints(&Value::Array(vec![
                want["token"].clone(),
                want["depth"].clone(),
                want["parent"].clone(),
                want["rank"].clone(),
            ]));
            let depth = tree.depths[i] as usize;
            // The rank is the token's place among its offset's candidates (top-k ids are distinct).
            let rank =
                marginals.ids[depth - 1].iter().position(|&t| t == tree.tokens[i]).expect("a candidate");
            let got_shape =
                vec![i64::from(tree.tokens[i]), depth as i64, i64::from(tree.parents[i]), rank as i64];
            assert_eq!(got_shape, want_shape, "{name}: node {i} (token, depth, parent, rank)");
            let want_bits =
                u64::from_str_radix(want["log_prob_bits"].as_str().unwrap(), 16).expect("hex bits");
            assert_eq!(
                tree.log_probs[i].to_bits(),
                want_bits,
                "{name}: node {i} cumulative log-prob {} vs {}",
                tree.log_probs[i],
                f64::from_bits(want_bits)
            );
        }

        let limits = TreeLimits { vocab: 1024, max_nodes: budget, max_depth: marginals.depth() };
        tree.validate(limits).unwrap_or_else(|e| panic!("{name}: built tree fails validation: {e}"));
    }
}
