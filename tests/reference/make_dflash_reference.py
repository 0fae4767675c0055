#!/usr/bin/env python
"""A tiny random DFlash draft head for a tiny target (the Qwen3-VL one, or a text-only Llama),
and its draft logits.

Usage:  .venv/bin/python tests/reference/make_dflash_reference.py \
            --target DIR/tiny-qwen3-vl --out DIR/tiny-qwen3-vl-dflash [--seed 0]

Python is only the reference; the product is drafter-svc's head in Rust. The `dflash` package is
not installed, so the forward below is a small torch re-statement of z-lab/dflash
`DFlashDraftModel` (model/dflash.py@a3516f8, dflash/model.py at HEAD) built from transformers'
own Qwen3 pieces (Qwen3RMSNorm, Qwen3MLP, Qwen3RotaryEmbedding, rotate_half), as DFlash is:

  ctx = hidden_norm(fc(target_hidden)); h = target embedding of [root, MASK x (B-1)];
  per layer: x = input_layernorm(h); q = q_norm(q_proj(x)) with RoPE at the last B positions;
  k = k_norm(k_proj([ctx; x])), v = v_proj([ctx; x]) with RoPE at all C+B positions, appended to
  the draft cache; attention with no mask over the whole cache; o_proj; residual;
  post_attention_layernorm + MLP; residual. Logits = target lm_head(norm(h))[-(B-1):].
  After each call the cache is cropped back to the root position.

Written to --out:
  config.json, model.safetensors        the head, as DFlash saves it (DFlash tensor names, f32)
  reference/draft_calls.json            per call: rows, root_token, root_position
  reference/draft_calls.safetensors     context_{i} (rows, taps*hidden) and logits_{i} (B-1, vocab)

Three calls share one draft cache: 20 prompt rows, then 3, then 1 (a round with nothing accepted).
Deterministic (seeded); float32; eager attention; one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import (  # noqa: E402
    Qwen3Config,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

LAYERS = 2
BLOCK = 16
TAPS = [0, 1, 2]
MASK_ID = 11  # <|vision_pad|> of the tiny tokenizer: reserved, never produced by the processor
ROPE_THETA = 500000.0  # deliberately not the target's 10000: the head has its own RoPE
CALLS = [(20, 57), (3, 301), (1, 999)]  # (new context rows, root token)


class DraftAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache):
        block, rows = x.shape[0], ctx.shape[0] + x.shape[0]
        q = self.q_norm(self.q_proj(x).view(block, self.heads, self.head_dim)).transpose(0, 1)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=0).view(rows, self.kv_heads, self.head_dim)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=0).view(rows, self.kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(0, 1)
        v = v.transpose(0, 1)
        q = q * cos[-block:] + rotate_half(q) * sin[-block:]
        k = k * cos + rotate_half(k) * sin
        cache["k"] = torch.cat([cache["k"], k], dim=1)
        cache["v"] = torch.cat([cache["v"], v], dim=1)
        groups = self.heads // self.kv_heads
        keys = cache["k"].repeat_interleave(groups, dim=0)
        values = cache["v"].repeat_interleave(groups, dim=0)
        scores = (q @ keys.transpose(1, 2)) * self.head_dim**-0.5  # no mask: non-causal
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (weights @ values).transpose(0, 1).reshape(block, self.heads * self.head_dim)
        return self.o_proj(out)


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, cache):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    """Parameter names exactly as DFlashDraftModel's state dict."""

    def __init__(self, config: Qwen3Config, taps: int):
        super().__init__()
        self.layers = nn.ModuleList([DraftLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, target_hidden, noise_embedding, positions, caches):
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, positions[None])
        cos, sin = cos[0], sin[0]
        h = noise_embedding
        for layer, cache in zip(self.layers, caches):
            h = layer(h, ctx, cos, sin, cache)
        return self.norm(h)


def randomize(head: DraftHead) -> None:
    """Weights large enough that every piece visibly moves the logits (unlike N(0, 0.02))."""
    for name, p in head.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=p.shape[1] ** -0.5)
        else:
            with torch.no_grad():
                p.copy_(1.0 + 0.2 * torch.randn_like(p))


def head_config(target_text: dict) -> tuple[Qwen3Config, dict]:
    hidden = target_text["hidden_size"]
    dims = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=target_text["num_attention_heads"],
        num_key_value_heads=target_text["num_key_value_heads"],
        head_dim=target_text["head_dim"],
        rms_norm_eps=target_text["rms_norm_eps"],
        vocab_size=target_text["vocab_size"],
        hidden_act="silu",
        attention_bias=False,
    )
    config = Qwen3Config(**dims, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA})
    # config.json in the spelling of the public DFlash heads (z-lab / SpecForge configs).
    saved = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **dims,
        "attention_dropout": 0.0,
        "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS},
        "dtype": "float32",
        "layer_types": ["full_attention"] * LAYERS,
        "max_position_embeddings": 4096,
        "num_target_layers": target_text["num_hidden_layers"],
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    }
    return config, saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    target_config = json.loads((args.target / "config.json").read_text())
    text = target_config.get("text_config", target_config)
    target_weights = load_file(str(args.target / "model.safetensors"))
    # A VLM's 5.x names, else a text model's; a tied LM head is the embedding itself.
    embed = target_weights.get("model.language_model.embed_tokens.weight", target_weights.get("model.embed_tokens.weight"))
    embed = embed.float()
    lm_head = target_weights["lm_head.weight"].float() if "lm_head.weight" in target_weights else embed

    config, saved_config = head_config(text)
    head = DraftHead(config, len(TAPS)).eval()
    randomize(head)

    if args.out.exists():
        shutil.rmtree(args.out)
    (args.out / "reference").mkdir(parents=True)
    (args.out / "config.json").write_text(json.dumps(saved_config, indent=2) + "\n")
    state = {k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary_emb")}
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})

    caches = [
        {"k": torch.zeros(config.num_key_value_heads, 0, config.head_dim),
         "v": torch.zeros(config.num_key_value_heads, 0, config.head_dim)}
        for _ in range(LAYERS)
    ]
    tensors, calls, cached = {}, [], 0
    with torch.no_grad():
        for i, (rows, root) in enumerate(CALLS):
            context = torch.randn(rows, len(TAPS) * config.hidden_size)
            root_position = cached + rows
            block_ids = torch.tensor([root] + [MASK_ID] * (BLOCK - 1))
            positions = torch.arange(cached, root_position + BLOCK)
            hidden = head(context, embed[block_ids], positions, caches)
            logits = hidden[-(BLOCK - 1):] @ lm_head.T
            for cache in caches:  # crop back to the root: only context rows persist
                cache["k"] = cache["k"][:, :root_position]
                cache["v"] = cache["v"][:, :root_position]
            cached = root_position
            tensors[f"context_{i}"] = context.contiguous()
            tensors[f"logits_{i}"] = logits.contiguous()
            calls.append({"rows": rows, "root_token": root, "root_position": root_position})
    save_file(tensors, str(args.out / "reference" / "draft_calls.safetensors"))
    (args.out / "reference" / "draft_calls.json").write_text(
        json.dumps({"target": args.target.name, "calls": calls}, indent=2) + "\n")
    print(f"wrote a {LAYERS}-layer head and {len(calls)} draft calls to {args.out}")


if __name__ == "__main__":
    main()
