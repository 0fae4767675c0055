#!/usr/bin/env python
"""Expected candidate trees for drafter-svc's `build_budget_tree`, from a plain-Python heap.

Usage:  python3 tests/reference/make_tree_reference.py --out common/spec/tests/data/tree_reference.json

Pure Python (heapq, no torch). The output is small, committed, and only needs regenerating when
the cases below change. The procedure mirrors GLANCE's `glance/tree.py` `build_budget_tree`
(js-lee-AI/GLANCE@59ea1c6) semantically: a min-heap of Python tuples
(neg_cum, depth, parent, rank, order) compared lexicographically, cumulative sums in Python
floats (f64) of f32 log-probabilities, `branch_k` clamped to the row width.

Log-probabilities are f32 values; the JSON carries their bit patterns (`logp_bits`, u32) next to
the readable values so nothing depends on decimal float parsing. Each expected node carries the
bit pattern of its cumulative log-probability as a hex u64 (`log_prob_bits`).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import struct
from pathlib import Path

VOCAB = 1024
OFFSETS = 15
WIDTH = 8


def f32(x: float) -> float:
    """Round a Python float to the nearest f32 value (still a Python float)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f64_bits_hex(x: float) -> str:
    return f"{struct.unpack('<Q', struct.pack('<d', x))[0]:016x}"


def budget_tree(ids, logp, budget, branch_k):
    """Best-first expansion on cumulative log-probability (the GLANCE procedure)."""
    depth_max = len(ids)
    width = min(len(row) for row in ids) if depth_max else 0
    k = min(branch_k, width)
    heap = []
    order = 0
    for r in range(k if depth_max else 0):
        heapq.heappush(heap, (-logp[0][r], 1, -1, r, order))
        order += 1
    nodes = []
    while heap and len(nodes) < budget:
        neg_cum, depth, parent, rank, _ = heapq.heappop(heap)
        here = len(nodes)
        nodes.append({
            "token": ids[depth - 1][rank],
            "depth": depth,
            "parent": parent,
            "rank": rank,
            "log_prob_bits": f64_bits_hex(-neg_cum),
        })
        if depth < depth_max:
            for r in range(k):
                heapq.heappush(heap, (neg_cum - logp[depth][r], depth + 1, here, r, order))
                order += 1
    return nodes


def softmax_marginals(rng: random.Random, offsets: int, width: int, temperature: float):
    """Top-`width` of a log-softmax over random logits, as f32, sorted descending."""
    ids, logp = [], []
    for _ in range(offsets):
        logits = [rng.gauss(0.0, 1.0) / temperature for _ in range(VOCAB)]
        top = max(logits)
        log_z = top + math.log(sum(math.exp(x - top) for x in logits))
        ranked = sorted(range(VOCAB), key=lambda i: (-logits[i], i))[:width]
        ids.append(ranked)
        logp.append([f32(logits[i] - log_z) for i in ranked])
    return ids, logp


def tied_marginals(rng: random.Random, offsets: int, width: int, levels):
    """Log-probabilities drawn from a few exactly representable levels: many equal values and
    many equal cumulative sums, so the later tuple fields decide the order."""
    ids, logp = [], []
    for _ in range(offsets):
        ids.append(rng.sample(range(VOCAB), width))
        logp.append(sorted((rng.choice(levels) for _ in range(width)), reverse=True))
    return ids, logp


def case(name, ids, logp, budget, branch_k):
    return {
        "name": name,
        "budget": budget,
        "branch_k": branch_k,
        "top_ids": ids,
        "top_logp": logp,
        "logp_bits": [[f32_bits(x) for x in row] for row in logp],
        "expected": budget_tree(ids, logp, budget, branch_k),
    }


def build_cases():
    rng = random.Random(20260912)
    cases = []
    for budget in (15, 31, 63):
        ids, logp = softmax_marginals(rng, OFFSETS, WIDTH, temperature=0.35)
        cases.append(case(f"random_budget{budget}_k8", ids, logp, budget, 8))
    ids, logp = softmax_marginals(rng, OFFSETS, WIDTH, temperature=0.2)
    cases.append(case("random_budget63_k1", ids, logp, 63, 1))
    ids, logp = softmax_marginals(rng, OFFSETS, WIDTH, temperature=1.0)
    cases.append(case("flat_budget63_k8", ids, logp, 63, 8))
    ids, logp = tied_marginals(rng, OFFSETS, WIDTH, [-0.5, -1.0, -1.5, -2.0])
    cases.append(case("ties_quarter_levels_budget63_k8", ids, logp, 63, 8))
    ids, logp = tied_marginals(rng, OFFSETS, WIDTH, [-0.25, -0.75])
    cases.append(case("ties_two_levels_budget31_k4", ids, logp, 31, 4))
    # Every log-probability equal: the order is decided by depth, parent and rank alone.
    ids = [rng.sample(range(VOCAB), WIDTH) for _ in range(OFFSETS)]
    cases.append(case("all_equal_budget63_k8", ids, [[-1.0] * WIDTH for _ in range(OFFSETS)], 63, 8))
    # Zeros (certain tokens): Python compares -0.0 and 0.0 as equal.
    ids = [rng.sample(range(VOCAB), 4) for _ in range(4)]
    logp = [[0.0, -0.0, -1.0, -2.0], [-0.0, 0.0, -0.5, -0.5], [0.0, -1.0, -1.0, -3.0], [-0.0, -0.0, -0.0, -0.0]]
    cases.append(case("signed_zeros_budget31_k4", ids, logp, 31, 4))
    # A budget larger than the whole tree (2 + 4 + 8 nodes), and branch_k wider than the rows.
    ids, logp = softmax_marginals(rng, 3, 2, temperature=0.5)
    cases.append(case("exhausted_budget63_k8_width2", ids, logp, 63, 8))
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "generator": "tests/reference/make_tree_reference.py",
        "cases": build_cases(),
    }
    args.out.write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    print(f"wrote {len(payload['cases'])} cases to {args.out}")


if __name__ == "__main__":
    main()
