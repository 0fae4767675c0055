#!/usr/bin/env python
"""Build tiny random-weight text-only Llama and Qwen3 checkpoints and dump reference outputs.

Usage:  .venv/bin/python tests/reference/make_text_reference.py --out DIR [--seed 0]

Python (transformers 5.24, offline) is only the *reference*; the product is Rust. Written:

  DIR/tiny-llama/, DIR/tiny-qwen3/       HF model dirs as `save_pretrained` writes them (config.json,
      generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
      chat_template.jinja), plus reference/<case>.json and reference/<case>.safetensors in the
      layout of make_reference.py (input_ids, 1-D position_ids on three equal rows, 32 greedy
      tokens; tensors logits and hidden_<i> = hidden_states[i+1]).

The configs are chosen so that each thing a loader could get wrong changes the tokens:
  tiny-llama  tied embeddings (as SmolLM2), attention_bias and mlp_bias on, Llama 3.1 `llama3`
              rope scaling with a 16-token original context (the prompts run past it), theta 10000;
  tiny-qwen3  untied LM head, q/k RMSNorm, head_dim 24 != hidden/heads (16), theta 1000.
Weights get a strong init (see `init_with_teeth`) and the script checks that a wrong theta, a
missing rope scaling, a dropped norm weight and a dropped bias each change the greedy tokens.

Deterministic (seeded); float32; eager attention; one torch thread.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_common  # noqa: E402  (sets the offline env vars before transformers is imported)
import torch  # noqa: E402
from make_reference import round_up, train_tokenizer  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

MAX_NEW_TOKENS = 32
SYSTEM = "You are a terse assistant that describes shapes."

# A text model's template reads `message['content']` as a string (SmolLM2's, with its default
# system turn) or tests for it (Qwen3's); neither sees typed parts.
LLAMA_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

LONG = " ".join(
    f"The {c} {s} sits {p} the {c2} {s2}." for c, s, p, c2, s2 in [
        ("red", "square", "left of", "blue", "circle"),
        ("green", "triangle", "above", "yellow", "square"),
        ("blue", "circle", "below", "red", "triangle"),
        ("yellow", "star", "right of", "green", "circle"),
    ]
)

# Messages as the service receives them: typed text parts (the case loader reads these).
CASES = {
    "single_turn": [{"role": "user", "content": [{"type": "text", "text": "Describe a red square."}]}],
    "with_system": [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [{"type": "text", "text": "What is next to the blue circle?"}]},
    ],
    "multi_turn": [
        {"role": "user", "content": [{"type": "text", "text": "What colour is the square?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The square is red."}]},
        {"role": "user", "content": [{"type": "text", "text": "And the circle?"}]},
    ],
    "long": [{"role": "user", "content": [{"type": "text", "text": LONG + " Which shape is in the middle?"}]}],
}

# What both tiny families share: the shape, and the special tokens of the shared tokenizer.
def shared_config(vocab: int, ids: dict) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["eos"],
    )


FAMILIES = {
    # A tied LM head, every bias, and llama3 rope scaling with a 16-token original context.
    "tiny-llama": dict(
        cls=LlamaForCausalLM,
        template=LLAMA_TEMPLATE,
        config=lambda vocab, ids: LlamaConfig(
            **shared_config(vocab, ids),
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    # q/k norm and a head_dim (24) that is not hidden / heads (16).
    "tiny-qwen3": dict(
        cls=Qwen3ForCausalLM,
        template=QWEN3_TEMPLATE,
        config=lambda vocab, ids: Qwen3Config(
            **shared_config(vocab, ids),
            head_dim=24,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
            tie_word_embeddings=False,
        ),
    ),
}


def log(*a):
    print(*a, flush=True)


@torch.no_grad()
def init_with_teeth(model: nn.Module, seed: int) -> None:
    """Every parameter redrawn so the tokens depend on each of them: Linear weights N(0, 1/fan_in)
    with q/k x3 (sharper attention, so positions matter; for Qwen3 the q/k norm weights carry the
    x sqrt(3) instead), biases N(0, 0.1^2), the embedding N(0, 1) (0.25 when tied to the LM head,
    else the token's own embedding dominates its logits), RMSNorm weights 1 + N(0, 0.3^2)."""
    g = torch.Generator().manual_seed(20_000 + seed)
    tied = model.config.tie_word_embeddings
    qk_norm = any(n.endswith("q_norm") for n, _ in model.named_modules())
    seen: set[int] = set()

    def fill(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=g) * std + mean)

    for mname, mod in model.named_modules():
        leaf = mname.rsplit(".", 1)[-1]
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(mod, nn.Linear) and pname == "weight":
                gain = 3.0 if leaf in ("q_proj", "k_proj") and not qk_norm else 1.0
                fill(p, gain * mod.in_features**-0.5)
            elif isinstance(mod, nn.Linear):
                fill(p, 0.1)
            elif isinstance(mod, nn.Embedding):
                fill(p, 0.25 if tied else 1.0)
            elif "RMSNorm" in type(mod).__name__:
                fill(p, 0.3, 1.0)
                if leaf in ("q_norm", "k_norm"):
                    p.mul_(3.0**0.5)
            else:
                raise RuntimeError(f"no init rule for {mname}.{pname}")


def prompt_ids(tokenizer, messages) -> list[int]:
    as_strings = [{"role": m["role"], "content": "\n".join(p["text"] for p in m["content"])} for m in messages]
    ids = tokenizer.apply_chat_template(as_strings, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


@torch.no_grad()
def greedy(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         **hf_common.no_eos_generation_kwargs(model, MAX_NEW_TOKENS))
    return out[0, len(ids):].tolist()


@torch.no_grad()
def run_case(name: str, messages, model, tokenizer, ref_dir: Path) -> list[int]:
    ids = prompt_ids(tokenizer, messages)
    n = len(ids)
    out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    tokens = greedy(model, ids)
    # Cache-free cross-check of generate(): argmax of one forward over prompt + tokens.
    full = model(torch.tensor([ids + tokens[:-1]]), use_cache=False).logits[0, n - 1:]
    assert full.argmax(-1).tolist() == tokens, f"{name}: generate() differs from the cache-free argmax"
    layers = model.config.num_hidden_layers
    tensors = {"logits": out.logits[0].float().contiguous()}
    for i in range(layers):
        tensors[f"hidden_{i}"] = out.hidden_states[i + 1][0].float().contiguous()
    save_file(tensors, str(ref_dir / f"{name}.safetensors"))
    positions = list(range(n))
    case = {
        "case": name,
        "messages": messages,
        "input_ids": ids,
        "image_grid_thw": [],
        "position_ids": [positions, positions, positions],
        "rope_delta": 0,
        "greedy_tokens": tokens,
        "tap_layers": list(range(layers)),
    }
    (ref_dir / f"{name}.json").write_text(json.dumps(case) + "\n")
    log(f"    {name}: {n} prompt tokens, greedy {tokens[:8]}...")
    return tokens


@torch.no_grad()
def check_teeth(family: str, model, tokenizer, expected: list[int]) -> None:
    """Each variation a loader might silently get wrong must change the greedy tokens of `long`."""
    ids = prompt_ids(tokenizer, CASES["long"])
    variants = {"rope_theta x2": lambda c: c.rope_parameters.update(rope_theta=c.rope_parameters["rope_theta"] * 2)}
    if family == "tiny-llama":
        variants["no llama3 rope scaling"] = lambda c: c.rope_parameters.update(rope_type="default")
    for what, change in variants.items():
        config = copy.deepcopy(model.config)
        change(config)
        other = type(model)(config).eval()
        other.load_state_dict(model.state_dict())
        assert greedy(other, ids) != expected, f"{family}: {what} does not change the tokens"
        log(f"    teeth: {what} changes the tokens")
    state = model.state_dict()
    norm = "model.layers.0.self_attn.q_norm.weight" if family == "tiny-qwen3" else "model.layers.0.input_layernorm.weight"
    breaks = {f"{norm} = 1": (norm, torch.ones_like(state[norm]))}
    if family == "tiny-llama":
        for bias in ("model.layers.1.self_attn.o_proj.bias", "model.layers.1.mlp.down_proj.bias"):
            breaks[f"{bias} = 0"] = (bias, torch.zeros_like(state[bias]))
    for what, (key, value) in breaks.items():
        broken = type(model)(model.config).eval()
        broken.load_state_dict({**state, key: value})
        assert greedy(broken, ids) != expected, f"{family}: {what} does not change the tokens"
        log(f"    teeth: {what} changes the tokens")


def build(family: str, spec: dict, tokenizer, out_root: Path, seed: int) -> None:
    out_dir = out_root / family
    if out_dir.exists():
        shutil.rmtree(out_dir)
    ids = {"bos": tokenizer.convert_tokens_to_ids("<|im_start|>"), "eos": tokenizer.convert_tokens_to_ids("<|im_end|>")}
    config = spec["config"](round_up(len(tokenizer), 64), ids)
    torch.manual_seed(seed)
    model = spec["cls"](config).to(torch.float32)
    init_with_teeth(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=ids["eos"], pad_token_id=ids["eos"], bos_token_id=ids["bos"])
    model.save_pretrained(out_dir)
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = spec["template"]
    tok.save_pretrained(out_dir)
    del model
    # Everything below reads what was written, as the Rust side will.
    model = spec["cls"].from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = hf_common.AutoTokenizer.from_pretrained(out_dir)
    ref_dir = out_dir / "reference"
    ref_dir.mkdir()
    log(f"  {family}: {sum(p.numel() for p in model.parameters())} parameters")
    tokens = {name: run_case(name, messages, model, tok, ref_dir) for name, messages in CASES.items()}
    assert len({tuple(t) for t in tokens.values()}) == len(tokens), f"{family}: two cases share their tokens"
    assert all(len(set(t)) > 4 for t in tokens.values()), f"{family}: a degenerate continuation"
    check_teeth(family, model, tok, tokens["long"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    for family, spec in FAMILIES.items():
        build(family, spec, tokenizer, args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
