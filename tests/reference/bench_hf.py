#!/usr/bin/env python
"""Time HF transformers greedy generation on one reference case (the baseline the Rust side is
compared against).

Usage:
  .venv/bin/python tests/reference/bench_hf.py --model DIR --case CASE_JSON \
      [--max-new-tokens 64] [--runs 3] [--threads 2] [--dtype float32]
  .venv/bin/python tests/reference/bench_hf.py --model TEXT_MODEL_DIR --prompt TEXT ...
  .venv/bin/python tests/reference/bench_hf.py --model TEXT_MODEL_DIR --prompts-file PROMPTS_JSON ...

A text-only model (Llama, Qwen3) takes --prompt: one user message through the tokenizer's chat
template, as the Rust side builds it.

Loads the model dir with transformers (float32, sdpa attention by default, PIL image processor), renders the
case's messages through the chat template and the processor (image paths are relative to the case
JSON's directory), warms up once, then per run times
  t_1 = generate(max_new_tokens=1)   (prefill + first token)
  t_N = generate(max_new_tokens=N)
with greedy decoding and EOS disabled (exactly N new tokens). Prints one JSON line:
  {"impl": "hf-transformers", "tokens_per_s_decode": (N-1)/(t_N - t_1), "prefill_ms": t_1*1000,
   "new_tokens": N, ...}
using the median t_1 and t_N over the runs.

--prompts-file (a JSON list of user messages, the peer of bench_chat) instead decodes each prompt
once as a chat would, stopping at EOS: t_1 = generate(max_new_tokens=1), then generate(N) gives
the greedy tokens; prints one JSON line {"tokens": [[...], ...], "decode_tokens": sum(g-1),
"decode_ms": sum(t_N - t_1)}, the decode window pooled over the prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_common  # noqa: E402  (sets HF offline env vars before transformers is imported)

import torch  # noqa: E402
import transformers  # noqa: E402


def model_inputs(inputs) -> dict:
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")
    return {k: inputs[k] for k in keys if k in inputs}


@torch.no_grad()
def timed_generate(model, inputs, n: int) -> tuple[float, int]:
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    t0 = time.perf_counter()
    out = model.generate(**model_inputs(inputs), **hf_common.no_eos_generation_kwargs(model, n))
    dt = time.perf_counter() - t0
    return dt, out.shape[1] - inputs["input_ids"].shape[1]


@torch.no_grad()
def chat_prompts(model, tokenizer, prompts: list[str], n: int) -> dict:
    def generate(inputs, max_new_tokens):
        t0 = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return time.perf_counter() - t0, out[0, inputs["input_ids"].shape[1] :].tolist()

    tokens, decode_tokens, decode_ms = [], 0, 0.0
    for i, prompt in enumerate(prompts):
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        if i == 0:
            generate(inputs, n)  # warm-up
        t1, _ = generate(inputs, 1)
        tn, new = generate(inputs, n)
        tokens.append(new)
        decode_tokens += max(len(new) - 1, 0)
        decode_ms += max(tn - t1, 0.0) * 1000.0
    return {"impl": "hf-transformers", "tokens": tokens, "decode_tokens": decode_tokens, "decode_ms": decode_ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="HF model dir (e.g. .../tiny-qwen3-vl)")
    ap.add_argument("--case", type=Path, help="reference case JSON (messages with image paths)")
    ap.add_argument("--prompt", help="a text model's user message (instead of --case)")
    ap.add_argument("--prompts-file", type=Path, help="a JSON list of user messages (bench_chat's peer)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--attn",
        default="sdpa",
        choices=["sdpa", "eager"],
        help="attention implementation (sdpa: transformers' default and fastest on CPU)",
    )
    args = ap.parse_args(argv)
    if args.max_new_tokens < 2:
        ap.error("--max-new-tokens must be >= 2 (decode rate uses N-1 tokens)")

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    if args.prompts_file is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype), attn_implementation=args.attn
        ).eval()
        prompts = json.loads(args.prompts_file.read_text())
        print(json.dumps(chat_prompts(model, tokenizer, prompts, args.max_new_tokens)), flush=True)
        return 0
    if args.prompt is not None:
        case = {"case": "prompt"}
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype), attn_implementation=args.attn
        ).eval()
        messages = [{"role": "user", "content": args.prompt}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
    else:
        if args.dtype != "float32":
            ap.error("--dtype applies to a text model (--prompt)")
        case = json.loads(args.case.read_text())
        model = hf_common.load_model(args.model, attn_implementation=args.attn)
        processor = hf_common.load_processor(args.model, hf_common.backend_of(case))
        _, inputs = hf_common.prepare_inputs(processor, case["messages"], args.case.parent)
    n = args.max_new_tokens

    # warm-up (also checks that EOS is really disabled)
    _, got = timed_generate(model, inputs, n)
    if got != n:
        raise SystemExit(f"expected {n} new tokens, got {got}")
    timed_generate(model, inputs, 1)

    t1s, tns = [], []
    for _ in range(args.runs):
        t1, g1 = timed_generate(model, inputs, 1)
        tn, gn = timed_generate(model, inputs, n)
        assert g1 == 1 and gn == n, (g1, gn)
        t1s.append(t1)
        tns.append(tn)
    t1, tn = statistics.median(t1s), statistics.median(tns)
    decode = (n - 1) / (tn - t1) if tn > t1 else float("inf")
    print(
        json.dumps(
            {
                "impl": "hf-transformers",
                "tokens_per_s_decode": round(decode, 2),
                "prefill_ms": round(t1 * 1000.0, 3),
                "new_tokens": n,
                "prompt_tokens": int(inputs["input_ids"].shape[1]),
                "runs": args.runs,
                "threads": args.threads,
                "t_first_ms_runs": [round(x * 1000.0, 3) for x in t1s],
                "t_total_ms_runs": [round(x * 1000.0, 3) for x in tns],
                "model": str(args.model),
                "case": case.get("case", args.case.stem if args.case else "prompt"),
                "attn_implementation": args.attn,
                "dtype": args.dtype,
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
