#!/usr/bin/env python
"""A tiny random EAGLE-3 draft head in the public layout for a tiny target, its outputs over
several context calls sharing one draft cache, and the trees EAGLE-2's dynamic expansion grows.

Usage:  .venv/bin/python tests/reference/make_eagle3_reference.py \
            --target DIR/tiny-llama --out DIR/tiny-llama-eagle3 [--seed 0]

Python is only the reference; the product is drafter-svc's head in Rust. No EAGLE package is
installed, so the forward below is a torch re-statement of SafeAILab/EAGLE `eagle/model/cnets.py`
(`Model`, EAGLE-3) built from transformers' Llama pieces (LlamaRMSNorm, LlamaMLP,
LlamaRotaryEmbedding, rotate_half), with the names EAGLE and SpecForge save:

  x = fc(h) when h is 3*Ht wide (target states), else h (the head's own output); residual = x;
  a = [input_layernorm(embed(token)) ; hidden_norm(x)]  (embedding first, 2*hidden wide);
  q/k/v = proj(a), RoPE (rotate_half) at the position of h; attention over the cache (post-RoPE
  keys) with the given visibility; x = residual + o_proj(.); x = x + mlp(post_attention_layernorm(x));
  the pre-norm x is the output (fed back as the next hidden); logits = lm_head(norm(x)) over the
  draft vocabulary; target id = draft id + d2t[draft id].

The tree is EAGLE-2's `topK_genrate` as cnets.py writes it (flat candidate lists, parents by index
arithmetic, the final top-T of all candidates), stated on this cache: the top-K children of the
last context output, then per depth the K best of the K*K children of the previous depth's
expanded nodes, each expansion one pass with the context and its ancestors visible, at the
position after the root's.

Written to --out:
  config.json, model.safetensors       the head (fc, midlayer.*, norm, lm_head, d2t int64, t2d bool)
  reference/eagle3.json                per call: rows, first position, tokens; the tree settings and,
                                       after calls 1 and 2, each selected node's token path and
                                       cumulative log-probability
  reference/eagle3.safetensors         states_{i} (rows, 3*Ht), out_{i} (rows, H) pre-norm outputs,
                                       log_probs_{i} (rows, draft vocab)

Deterministic (seeded); float32; one torch thread.
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
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    rotate_half,
)

TAPS = [0, 1, 2]
DRAFT_VOCAB = 256
# Not the 10000 default, and Llama 3.1's scaling: the head's RoPE is its own config's.
ROPE_THETA = 50000.0
ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
CALLS = [20, 3, 1]  # new context rows per call; a tree after each of the first two
TREE = {"top_k": 4, "expansions": 3, "budget": 40}


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, a, cos, sin, cache, visible):
        n = a.shape[0]
        q = self.q_proj(a).view(n, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(a).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(a).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache["k"] = torch.cat([cache["k"], k], dim=1)
        cache["v"] = torch.cat([cache["v"], v], dim=1)
        groups = self.heads // self.kv_heads
        keys = cache["k"].repeat_interleave(groups, dim=0)
        values = cache["v"].repeat_interleave(groups, dim=0)
        scores = (q @ keys.transpose(1, 2)) / self.head_dim**0.5
        scores = scores.masked_fill(~visible[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (weights @ values).transpose(0, 1).reshape(n, self.heads * self.head_dim)
        return self.o_proj(out)


class MidLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(c)

    def forward(self, embedded, x, cos, sin, cache, visible):
        residual = x
        a = torch.cat([self.input_layernorm(embedded), self.hidden_norm(x)], dim=-1)
        x = residual + self.self_attn(a, cos, sin, cache, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3(nn.Module):
    """Parameter names exactly as EAGLE / SpecForge save an EAGLE-3 head."""

    def __init__(self, c: LlamaConfig, target_hidden: int, draft_vocab: int):
        super().__init__()
        self.hidden = c.hidden_size
        self.fc = nn.Linear(3 * target_hidden, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, draft_vocab, bias=False)
        self.rotary = LlamaRotaryEmbedding(c)

    def forward(self, hidden, tokens, positions, embed, cache, visible):
        x = self.fc(hidden) if hidden.shape[-1] != self.hidden else hidden
        cos, sin = self.rotary(x, positions[None])
        return self.midlayer(embed[tokens], x, cos[0], sin[0], cache, visible)

    def log_probs(self, out):
        return torch.log_softmax(self.lm_head(self.norm(out)), dim=-1)


def randomize(head: nn.Module) -> None:
    """Weights large enough that every piece visibly moves the outputs (unlike N(0, 0.02))."""
    for name, p in head.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=p.shape[1] ** -0.5)
        else:
            with torch.no_grad():
                p.copy_(1.0 + 0.2 * torch.randn_like(p))


def grow_tree(head, embed, cache, last, position, d2t, top_k, expansions, budget):
    """EAGLE-2's topK_genrate (cnets.py) on this cache; returns [(token path, cumulative log-prob)]."""
    committed = cache["k"].shape[1]
    to_target = lambda ids: ids + d2t[ids]  # noqa: E731
    top = head.log_probs(last)[0].topk(top_k)
    scores = top.values
    scores_list, tokens_list, parents_list = [scores[None]], [to_target(top.indices)[None]], [torch.tensor([0])]
    input_ids = to_target(top.indices)
    input_hidden = last.expand(top_k, -1)
    tree_mask = torch.eye(top_k, dtype=torch.bool)
    topk_cs_index = torch.arange(top_k)
    for i in range(expansions):
        visible = torch.cat([torch.ones(top_k, committed, dtype=torch.bool), tree_mask], dim=1)
        positions = torch.full((top_k,), position + i)
        out = head(input_hidden, input_ids, positions, embed, cache, visible)
        bias = 1 + top_k * top_k * max(0, i - 1) + (top_k if i > 0 else 0)
        parents_list.append(topk_cs_index + bias)
        top = head.log_probs(out).topk(top_k, dim=-1)
        cu_scores = top.values + scores[:, None]
        chosen = cu_scores.view(-1).topk(top_k)
        topk_cs_index, scores = chosen.indices, chosen.values
        out_ids = topk_cs_index // top_k
        input_hidden = out[out_ids]
        input_ids = to_target(top.indices.view(-1)[topk_cs_index])
        tokens_list.append(to_target(top.indices))
        scores_list.append(cu_scores)
        tree_mask = torch.cat([tree_mask[out_ids], torch.eye(top_k, dtype=torch.bool)], dim=1)
    cache["k"], cache["v"] = cache["k"][:, :committed], cache["v"][:, :committed]
    all_scores = torch.cat(scores_list, dim=0).view(-1)
    all_tokens = torch.cat(tokens_list, dim=0).view(-1)
    selected = torch.sort(all_scores.topk(budget).indices).values
    parents = torch.cat(parents_list)[selected // top_k]  # flat index + 1 of each parent; 0 = root
    nodes = {}
    for index, parent in zip(selected.tolist(), parents.tolist()):
        path = (nodes[parent - 1][0] if parent > 0 else ()) + (int(all_tokens[index]),)
        nodes[index] = (path, float(all_scores[index]))
    return [{"path": list(p), "log_prob": s} for p, s in nodes.values()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    target = json.loads((args.target / "config.json").read_text())
    text = target.get("text_config", target)
    weights = load_file(str(args.target / "model.safetensors"))
    embed = weights.get("model.language_model.embed_tokens.weight", weights.get("model.embed_tokens.weight")).float()
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    dims = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        hidden_act="silu",
        max_position_embeddings=2048,
    )
    config = LlamaConfig(**dims, num_hidden_layers=1, rope_theta=ROPE_THETA, rope_scaling=dict(ROPE_SCALING))
    head = Eagle3(config, hidden, DRAFT_VOCAB).eval()
    randomize(head)
    # The draft vocabulary: DRAFT_VOCAB target ids in increasing order, as EAGLE's frequency scan
    # leaves them; d2t the offsets to them, t2d the mask of them.
    used = torch.sort(torch.randperm(vocab)[:DRAFT_VOCAB]).values
    d2t = used - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True

    if args.out.exists():
        shutil.rmtree(args.out)
    (args.out / "reference").mkdir(parents=True)
    saved = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **dims,
        "num_hidden_layers": 1,
        "draft_vocab_size": DRAFT_VOCAB,
        "rope_theta": ROPE_THETA,
        "rope_scaling": ROPE_SCALING,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": TAPS},
    }
    (args.out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    state = {k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    state.update(d2t=d2t.to(torch.int64), t2d=t2d)
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})

    cache = {"k": torch.zeros(config.num_key_value_heads, 0, config.head_dim),
             "v": torch.zeros(config.num_key_value_heads, 0, config.head_dim)}
    tensors, calls = {}, []
    position = 0
    with torch.no_grad():
        for i, rows in enumerate(CALLS):
            states = torch.randn(rows, 3 * hidden)
            tokens = torch.randint(0, vocab, (rows,))  # token p+1 beside the state at p
            positions = torch.arange(position, position + rows)
            visible = torch.ones(rows, position + rows, dtype=torch.bool).tril(position)
            out = head(states, tokens, positions, embed, cache, visible)
            tensors[f"states_{i}"] = states
            tensors[f"out_{i}"] = out
            tensors[f"log_probs_{i}"] = head.log_probs(out)
            call = {"rows": rows, "first_position": position, "tokens": tokens.tolist()}
            position += rows
            if i < 2:
                call["tree"] = grow_tree(head, embed, cache, out[-1:], position, d2t, **TREE)
            calls.append(call)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / "reference" / "eagle3.safetensors"))
    (args.out / "reference" / "eagle3.json").write_text(json.dumps({"calls": calls, "tree": TREE, "taps": TAPS}, indent=1) + "\n")
    print(f"wrote an EAGLE-3 head ({DRAFT_VOCAB}-token draft vocabulary) and {len(CALLS)} calls to {args.out}")


if __name__ == "__main__":
    main()
