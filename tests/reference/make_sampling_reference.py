#!/usr/bin/env python
"""Dump what transformers' sampling warpers make of random logits, for the Rust sampler's parity test.

Usage:  .venv/bin/python tests/reference/make_sampling_reference.py --out DIR [--seed 0]

Written: DIR/sampling/warpers.json (the configurations) and DIR/sampling/warpers.safetensors with
`logits` (rows, vocab) f32 and `scores_<i>` = the processed scores of configuration i. The
processors are the list `generate` itself assembles (`_get_logits_processor` of a tiny Llama, with
`do_sample=True`), so their order is transformers' own: temperature, top-k, top-p, min-p.
Some rows are rounded to a coarse grid so that ties sit at the cut-offs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_common  # noqa: E402,F401  (sets the offline env vars before transformers is imported)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 1024
ROWS = 8
# (temperature, top_k, top_p, min_p); top_k 0, top_p 1 and min_p 0 are "off", as in the API.
CONFIGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.0, 50, 1.0, 0.0),
    (1.3, 0, 0.9, 0.0),
    (0.8, 0, 1.0, 0.05),
    (0.6, 40, 0.95, 0.1),
    (1.0, 1, 1.0, 0.0),
    (2.0, 0, 0.5, 0.2),
    (0.5, 7, 0.3, 0.0),
]


def processors(model, temperature: float, top_k: int, top_p: float, min_p: float):
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p if min_p > 0 else None,
    )
    return model._get_logits_processor(generation_config=config, device="cpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    logits = torch.randn(ROWS, VOCAB) * 3
    logits[ROWS // 2 :] = (logits[ROWS // 2 :] * 2).round() / 2  # ties on a 0.5 grid
    input_ids = torch.zeros(ROWS, 1, dtype=torch.long)
    tensors = {"logits": logits.contiguous()}
    for i, config in enumerate(CONFIGS):
        warpers = processors(model, *config)
        names = [type(w).__name__ for w in warpers]
        expected = [n for n, on in zip(
            ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"],
            [config[0] != 1.0, config[1] != 0, config[2] < 1.0, config[3] > 0]) if on]
        assert names == expected, (config, names)
        tensors[f"scores_{i}"] = warpers(input_ids, logits.clone()).contiguous()
    out = args.out / "sampling"
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "warpers.safetensors")
    configs = [dict(zip(["temperature", "top_k", "top_p", "min_p"], c)) for c in CONFIGS]
    (out / "warpers.json").write_text(json.dumps({"configs": configs, "vocab": VOCAB, "rows": ROWS}, indent=1) + "\n")
    kept = [int(torch.isfinite(tensors[f"scores_{i}"]).sum()) for i in range(len(CONFIGS))]
    print(f"sampling: {len(CONFIGS)} warper configurations on {ROWS}x{VOCAB} logits, tokens kept {kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
