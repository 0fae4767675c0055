#!/usr/bin/env python
"""The transformers peer of `bench_round`: the same forward passes on the same layer shapes, timed
the same way, so the Rust figures have a reference measured in the same run.

Usage:
  .venv/bin/python tests/reference/bench_round_peer.py --shape JSON

JSON: {"hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers", "vocab", "dtype"
("float32" | "bfloat16"), "device" ("cpu" | "cuda"), "context", "rows": [n, ...], "repeats",
"threads", and optionally "model": a checkpoint directory}.

Builds a random-weight Qwen3ForCausalLM with those shapes (the text decoder of Qwen3-VL without
M-RoPE, which costs the same) or loads "model" with `AutoModelForCausalLM`, fills a DynamicCache
with `context` random K/V rows, and times, as the best of `repeats` after one warm-up:
  step:      one new token, logits of that row, argmax read back;
  verify(n): n new tokens (causal among themselves: the tree mask costs the same), logits of all
             n rows, the n argmaxes read back;
cropping the cache back to `context` after each. Prints one JSON line
  {"step_ms": t, "verify_ms": {"n": t, ...}}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_common  # noqa: E402,F401  (sets HF offline env vars before transformers is imported)

import torch  # noqa: E402
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402


def build(shape: dict) -> Qwen3ForCausalLM:
    if shape.get("model"):
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, shape["dtype"])
        model = AutoModelForCausalLM.from_pretrained(
            shape["model"], dtype=dtype, attn_implementation="sdpa"
        )
        return model.to(device=shape["device"]).eval()
    config = Qwen3Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["context"] + 1024,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    dtype = getattr(torch, shape["dtype"])
    model = Qwen3ForCausalLM(config).to(dtype=dtype, device=shape["device"]).eval()
    return model


def filled_cache(model: Qwen3ForCausalLM, shape: dict) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    dtype = getattr(torch, shape["dtype"])
    size = (1, shape["kv_heads"], shape["context"], shape["head_dim"])
    for layer in range(shape["layers"]):
        k = torch.randn(size, dtype=dtype, device=shape["device"])
        v = torch.randn(size, dtype=dtype, device=shape["device"])
        cache.update(k, v, layer)
    return cache


def timed_pass(model, cache, shape: dict, rows: int) -> float:
    context = shape["context"]
    ids = torch.randint(0, shape["vocab"], (1, rows), device=shape["device"])
    positions = torch.arange(context, context + rows, device=shape["device"]).unsqueeze(0)
    started = time.perf_counter()
    logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits
    _ = logits[0].argmax(-1).tolist()  # the host copy ends the pass (a GPU sync)
    elapsed = time.perf_counter() - started
    cache.crop(-rows)  # transformers 5.x: a negative count removes that many rows
    assert cache.get_seq_length() == context
    return elapsed


def best_of(model, cache, shape: dict, rows: int) -> float:
    timed_pass(model, cache, shape, rows)  # warm-up: kernel selection, allocator
    return min(timed_pass(model, cache, shape, rows) for _ in range(shape["repeats"])) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True, help="JSON, see the module docstring")
    shape = json.loads(parser.parse_args().shape)
    torch.set_num_threads(shape.get("threads", 1))
    torch.manual_seed(0)
    with torch.inference_mode():
        model = build(shape)
        cache = filled_cache(model, shape)
        step = best_of(model, cache, shape, 1)
        verify = {str(n): best_of(model, cache, shape, n) for n in shape["rows"]}
    print(json.dumps({"step_ms": step, "verify_ms": verify}))


if __name__ == "__main__":
    main()
