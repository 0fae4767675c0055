#!/usr/bin/env python
"""Dump transformers' per-token log-probabilities of `generate`, for the Rust logprobs parity test.

Usage:  .venv/bin/python tests/reference/make_logprob_reference.py --fixtures DIR

For each tiny model made by make_reference.py / make_text_reference.py (DIR/<family>), one case's
prompt is generated from with `generate(output_scores=True, return_dict_in_generate=True)`, EOS
disabled, greedily and with two sampling settings (torch's own draws, seeded). Written:
DIR/<family>/logprobs.json (beside reference/, whose JSON files are all
parity cases) with, per setting, the sampling options, the generated
tokens, `compute_transition_scores(normalize_logits=True)` (the chosen tokens' log-probabilities
under the processed scores) and the top-5 of `log_softmax(scores)` per step (finite ones only).
The Rust test decodes the greedy setting itself and compares tokens and values; the sampled
settings' tokens come from torch's RNG, so there it scores transformers' tokens (teacher-forced)
with the same readout the decoders use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_common  # noqa: E402  (sets the offline env vars before transformers is imported)
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

NEW_TOKENS = 16
TOP = 5
# family dir -> the case whose prompt is generated from
CASES = {
    "tiny-qwen3-vl": "one_image",
    "tiny-qwen2.5-vl": "one_image",
    "tiny-llama": "single_turn",
    "tiny-qwen3": "single_turn",
}
# (name, temperature, top_k, top_p, min_p, torch seed); temperature 0 is greedy.
SETTINGS = [
    ("greedy", 0.0, 0, 1.0, 0.0, 0),
    ("t07_k20_p095", 0.7, 20, 0.95, 0.0, 1),
    ("t13_minp005", 1.3, 0, 1.0, 0.05, 2),
]


def load(model_dir: Path):
    if hf_common.model_type_of(model_dir) in hf_common.FAMILIES:
        return hf_common.load_model(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def generate_inputs(case: dict, tensors: dict) -> dict:
    ids = torch.tensor([case["input_ids"]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "pixel_values" in tensors:
        inputs["pixel_values"] = tensors["pixel_values"]
        inputs["image_grid_thw"] = torch.tensor(case["image_grid_thw"])
        inputs["mm_token_type_ids"] = torch.tensor([case["mm_token_type_ids"]])
    return inputs


@torch.no_grad()
def run_setting(model, inputs: dict, name, temperature, top_k, top_p, min_p, seed) -> dict:
    kwargs = hf_common.no_eos_generation_kwargs(model, NEW_TOKENS)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p if min_p > 0 else None)
    torch.manual_seed(seed)
    out = model.generate(**inputs, **kwargs, output_scores=True, return_dict_in_generate=True)
    prompt_len = inputs["input_ids"].shape[1]
    tokens = out.sequences[0, prompt_len:].tolist()
    assert len(tokens) == NEW_TOKENS
    chosen = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    log_probs = torch.stack([s[0] for s in out.scores]).float().log_softmax(-1)
    values, ids = log_probs.topk(TOP, -1)
    top = [[(int(i), float(v)) for i, v in zip(row_ids, row_values) if torch.isfinite(v)]
           for row_ids, row_values in zip(ids, values)]
    assert torch.isfinite(chosen).all(), f"{name}: a chosen token of probability 0"
    return {
        "name": name, "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
        "tokens": tokens, "logprobs": chosen.tolist(),
        "top_ids": [[i for i, _ in row] for row in top], "top_logprobs": [[v for _, v in row] for row in top],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", required=True, type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for family, case_name in CASES.items():
        model_dir = args.fixtures / family
        reference = model_dir / "reference"
        case = json.loads((reference / f"{case_name}.json").read_text())
        tensors = load_file(reference / f"{case_name}.safetensors")
        model = load(model_dir)
        inputs = generate_inputs(case, tensors)
        settings = [run_setting(model, inputs, *s) for s in SETTINGS]
        greedy = settings[0]["tokens"]
        assert greedy == case["greedy_tokens"][:NEW_TOKENS], f"{family}: generate() left the case's greedy tokens"
        assert all(s["tokens"] != greedy for s in settings[1:]), f"{family}: a sampled setting drew the greedy tokens"
        out = {"case": case_name, "new_tokens": NEW_TOKENS, "top": TOP, "settings": settings}
        (model_dir / "logprobs.json").write_text(json.dumps(out, indent=1) + "\n")
        print(f"logprobs: {family}/{case_name}: {len(settings)} settings of {NEW_TOKENS} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
