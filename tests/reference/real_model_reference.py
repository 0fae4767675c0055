#!/usr/bin/env python
"""transformers' greedy decoding of a real text model on a few chat prompts, for the parity test
of the Rust engine on real weights (tests/tests/real_model.rs).

Usage:  .venv/bin/python tests/reference/real_model_reference.py --model DIR

Writes DIR/reference/greedy.json: per dtype (float32, bfloat16) and prompt, the prompt's token ids
(the tokenizer's apply_chat_template), the first TOKENS greedy tokens with EOS disabled, and the
top-2 logit margin at each step (a bf16 divergence must fall on a near-tie to be excused).
Python is only the reference; one torch thread; eager attention.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_common  # noqa: E402  (offline env before transformers)
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a product launch formula is.",
    "List three uses of a paperclip.",
]


@torch.no_grad()
def greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        output_logits=True,
        return_dict_in_generate=True,
        **hf_common.no_eos_generation_kwargs(model, TOKENS),
    )
    tokens = out.sequences[0, len(ids):].tolist()
    margins = []
    for step in out.logits:
        top = step[0].float().topk(2).values
        margins.append(round(float(top[0] - top[1]), 5))
    return tokens, margins


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    result = {"tokens": TOKENS, "runs": {}}
    for dtype in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
        runs = []
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            tokens, margins = greedy(model, ids)
            runs.append({"prompt": prompt, "input_ids": ids, "greedy_tokens": tokens, "top2_margins": margins})
            print(f"{dtype}: {prompt!r} -> {tokenizer.decode(tokens)!r}", flush=True)
        result["runs"][dtype] = runs
        del model
    out = args.model / "reference"
    out.mkdir(exist_ok=True)
    (out / "greedy.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
