#!/usr/bin/env python
"""Build tiny random-weight Qwen3-VL and Qwen2.5-VL checkpoints and dump reference outputs.

Usage:  .venv/bin/python tests/reference/make_reference.py --out DIR [--seed 0]

Python (transformers 5.24, offline) is only the *reference*; the product is Rust. Layout written:

  DIR/tiny-qwen3-vl/, DIR/tiny-qwen2.5-vl/           HF model dirs as `save_pretrained` writes them
      config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json
      chat_template.jinja processor_config.json preprocessor_config.json [video_preprocessor_config.json]
      reference/<case>.json, reference/<case>.safetensors, reference/images/*
  DIR/tiny-qwen3-vl-legacy/, DIR/tiny-qwen2.5-vl-legacy/
      the same weights under transformers 4.x hub names (model.layers.*, model.embed_tokens.weight,
      model.norm.weight, visual.*, lm_head.weight), sharded in two files + model.safetensors.index.json,
      a 4.x-style config.json, and copies of every other non-weight file (no reference/ dir).

Deterministic (seeded) and idempotent: each output dir is rebuilt from scratch on every run.
Attention: "eager" everywhere; all tensors float32; torch threads pinned to 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_common  # noqa: E402  (sets HF offline env vars before transformers is imported)
from hf_common import SPECIAL_TOKENS  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2Tokenizer,
    Qwen3VLConfig,
)
from transformers.image_utils import SizeDict  # noqa: E402
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # noqa: E402
from transformers.vision_utils import get_vision_window_index  # noqa: E402

from corpus import sentences  # noqa: E402
from images import draw_scene, with_transparency  # noqa: E402

TOKENIZER_VOCAB_TARGET = 1000
MAX_NEW_TOKENS = 32
T_START = time.time()
TORCH_THREADS = 1  # tiny matmuls: 1 thread is fastest and immune to CPU contention

# Chat templates (templates/*.jinja) are the hub templates verbatim:
#   qwen3_vl.jinja   = Qwen/Qwen3-VL-8B-Instruct chat_template.json "chat_template" (two independent public
#                      copies compared equal: a file stating it is byte-identical to the one shipped with
#                      Qwen/Qwen3-VL-8B-Instruct, and a C++ test literal of the same template);
#   qwen2_5_vl.jinja = Qwen/Qwen2.5-VL-7B-Instruct chat_template.json "chat_template" (two public copies, one
#                      citing xinference's llm_family json, compared equal). No trailing newline in that one.
FAMILY_SPECS = {
    "qwen3_vl": {
        "dir": "tiny-qwen3-vl",
        "template": "qwen3_vl.jinja",
        "patch": 16,
        "merge": 2,
        "temporal": 2,
        # factor 32 = patch 16 * merge 2
        "min_pixels": 32 * 32 * 4,
        "max_pixels": 32 * 32 * 64,
        # Qwen3-VL hub preprocessor uses mean/std 0.5 (not the CLIP constants)
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "images": {
            "square.png": (64, 64),
            "wide.png": (128, 64),
            "odd.jpg": (150, 97),
            "big.png": (400, 300),
            "alpha.png": (123, 77),
        },
    },
    "qwen2_5_vl": {
        "dir": "tiny-qwen2.5-vl",
        "template": "qwen2_5_vl.jinja",
        "patch": 14,
        "merge": 2,
        "temporal": 2,
        "min_pixels": 28 * 28 * 4,
        "max_pixels": 28 * 28 * 64,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OPENAI_CLIP_MEAN (hub value)
        "image_std": [0.26862954, 0.26130258, 0.27577711],  # OPENAI_CLIP_STD
        "images": {
            "square.png": (56, 56),
            "wide.png": (112, 56),
            "odd.jpg": (150, 97),
            "big.png": (400, 300),
            "alpha.png": (123, 77),
        },
    },
}

SYSTEM = [{"type": "text", "text": "You are a helpful assistant."}]
CASES = {
    "text_only": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "Describe a red square next to a blue circle."}]},
    ],
    "one_image": [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": "images/square.png"},
                {"type": "text", "text": "What shapes are in the picture?"},
            ],
        },
    ],
    "two_images": [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": "images/wide.png"},
                {"type": "text", "text": "Compare the first image"},
                {"type": "image", "path": "images/odd.jpg"},
                {"type": "text", "text": "with the second image."},
            ],
        },
    ],
    "resized": [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": "images/big.png"},
                {"type": "text", "text": "Read the text on the sign."},
            ],
        },
    ],
    "multi_turn": [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "image", "path": "images/square.png"},
                {"type": "text", "text": "What colour is the square?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "The square is red."}]},
        {"role": "user", "content": [{"type": "text", "text": "And the circle?"}]},
    ],
    # RGBA with a black transparent margin, resized on both axes (one shrinks, one grows).
    "alpha": [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": "images/alpha.png"},
                {"type": "text", "text": "Read the text on the transparent sign."},
            ],
        },
    ],
}
# Cases run a second time through the torchvision image processor, as `tv_<case>`: every resize
# kind (strong downscale, odd JPEG, mixed up/down with transparency).
TORCHVISION_CASES = ["two_images", "resized", "alpha"]


def log(*a):
    print(*a, flush=True)


def round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE with the Qwen2 pipeline (NFC, Qwen2 split regex, ByteLevel without regex),
    so that transformers' Qwen2Tokenizer, which rebuilds that pipeline from vocab+merges when it
    loads tokenizer.json, tokenizes exactly like the tokenizer.json the Rust side loads."""
    tok = Tokenizer(
        models.BPE(
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences(), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]]
    hf_tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",  # Qwen2.5-VL-7B-Instruct / Qwen3-VL-8B-Instruct tokenizer_config convention
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        errors="replace",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    ids = hf_tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(len(SPECIAL_TOKENS))), ids
    probe = "Hello <|vision_start|><|image_pad|><|vision_end|> the 42 red squares.<|im_end|>"
    assert hf_tok(probe)["input_ids"] == tok.encode(probe).ids
    return hf_tok


# --------------------------------------------------------------------------------------------
# Configs and weights
# --------------------------------------------------------------------------------------------


def token_ids(tok) -> dict:
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "bos": ids["<|endoftext|>"],
        "eos": ids["<|im_end|>"],
        "pad": ids["<|endoftext|>"],
        "image": ids["<|image_pad|>"],
        "video": ids["<|video_pad|>"],
        "vision_start": ids["<|vision_start|>"],
        "vision_end": ids["<|vision_end|>"],
    }


def make_config(family: str, vocab_size: int, ids: dict):
    if family == "qwen3_vl":
        return Qwen3VLConfig(
            text_config=dict(
                vocab_size=vocab_size,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                hidden_act="silu",
                max_position_embeddings=4096,
                rms_norm_eps=1e-6,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                },
                attention_bias=False,
                bos_token_id=ids["bos"],
                eos_token_id=ids["eos"],
                pad_token_id=ids["pad"],
            ),
            vision_config=dict(
                depth=3,
                hidden_size=32,
                hidden_act="gelu_pytorch_tanh",
                intermediate_size=64,
                num_heads=2,
                in_channels=3,
                patch_size=16,
                spatial_merge_size=2,
                temporal_patch_size=2,
                out_hidden_size=64,
                num_position_embeddings=64,
                deepstack_visual_indexes=[0, 1],
            ),
            image_token_id=ids["image"],
            video_token_id=ids["video"],
            vision_start_token_id=ids["vision_start"],
            vision_end_token_id=ids["vision_end"],
            tie_word_embeddings=False,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
        )
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_act="silu",
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            use_sliding_window=False,
            max_window_layers=3,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
        ),
        vision_config=dict(
            depth=4,
            hidden_size=32,
            hidden_act="silu",
            intermediate_size=64,
            num_heads=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,  # 56 px = 2 merged units per window side -> windows really partition
            fullatt_block_indexes=[1, 3],
            out_hidden_size=64,
            tokens_per_second=2,
        ),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=True,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )


@torch.no_grad()
def reinit_with_teeth(model: nn.Module, seed: int) -> dict:
    """Re-initialise EVERY parameter so outputs depend strongly on image, positions and weights.

    Base rule (all parameters):
      Linear/Conv weights ~ N(0, 1/fan_in) (std 1/sqrt(fan_in); so lm_head std = 1/sqrt(hidden)),
      Linear/Conv biases ~ N(0, 0.5^2), Embeddings ~ N(0, 1),
      norm weights (RMSNorm incl. q_norm/k_norm, LayerNorm) = 1 + N(0, 0.3^2), LayerNorm biases ~ N(0, 0.3^2).
    Adjustments in the text decoder (found necessary by the sanity checks; with the base rule the tied
    Qwen2.5-VL decoder emits one token 32 times, identical with and without the image):
      q_proj/k_proj weights x3 (sharper attention, so positions and image tokens matter; for Qwen3-VL,
      whose q_norm/k_norm renormalise q and k, the q_norm/k_norm weights are instead (1 + N(0, 0.3^2)) x sqrt(3);
      without it an image early in a multi-turn chat does not change the greedy tokens),
      text-decoder biases std 0.1 (std-0.5 q/k/v biases put
      a position-independent direction into every hidden state), and with tied embeddings the shared
      embedding/lm_head matrix std 0.25 (otherwise the token's own embedding dominates its logits).
    Tied parameters are set once."""
    g = torch.Generator().manual_seed(10_000 + seed)
    seen: set[int] = set()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    rules: dict[str, str] = {}

    def fill(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std + mean)

    for mname, mod in model.named_modules():
        text = mname.startswith("model.language_model")
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mname}.{pname}" if mname else pname
            kind = type(mod).__name__
            if isinstance(mod, nn.Linear):
                if pname == "weight":
                    gain = 3.0 if text and mname.rsplit(".", 1)[-1] in ("q_proj", "k_proj") else 1.0
                    std = gain * mod.in_features**-0.5
                else:
                    std = 0.1 if text else 0.5
                fill(p, std)
            elif isinstance(mod, (nn.Conv3d, nn.Conv2d)):
                std = p[0].numel() ** -0.5 if pname == "weight" else 0.5
                fill(p, std)
            elif isinstance(mod, nn.Embedding):
                std = 0.25 if (tied and mname.endswith("embed_tokens")) else 1.0
                fill(p, std)
            elif isinstance(mod, nn.LayerNorm):
                std = 0.3
                fill(p, std, 1.0 if pname == "weight" else 0.0)
            elif "RMSNorm" in kind and pname == "weight":
                std = 0.3
                fill(p, std, 1.0)
                if text and mname.rsplit(".", 1)[-1] in ("q_norm", "k_norm"):
                    p.mul_(3.0**0.5)  # q.k logits x3, as the q/k projection gain where there is no q/k norm
            else:
                raise RuntimeError(f"no init rule for {full} ({kind})")
            rules[full] = f"std {std:.4g}" + (" mean 1" if "Norm" in kind and pname == "weight" else "")
    n_params = sum(1 for _ in model.parameters())
    assert len(rules) == n_params, (len(rules), n_params)
    return rules


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def build_processor(family: str, tokenizer, template: str):
    spec = FAMILY_SPECS[family]
    image_processor = hf_common.IMAGE_PROCESSOR_CLASSES["pil"](
        min_pixels=spec["min_pixels"],
        max_pixels=spec["max_pixels"],
        patch_size=spec["patch"],
        temporal_patch_size=spec["temporal"],
        merge_size=spec["merge"],
        image_mean=spec["image_mean"],
        image_std=spec["image_std"],
    )
    # The processor insists on a video processor. Qwen2VLVideoProcessor cannot be imported without
    # torchvision, so Qwen2.5-VL gets a Qwen3VLVideoProcessor stand-in with its own patch/mean/std.
    video_processor = hf_common.Qwen3VLVideoProcessor(
        patch_size=spec["patch"],
        temporal_patch_size=spec["temporal"],
        merge_size=spec["merge"],
        image_mean=spec["image_mean"],
        image_std=spec["image_std"],
    )
    hf_common.ensure_video_mixin_exported()
    return hf_common.FAMILIES[family]["processor_cls"](
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor, chat_template=template
    )


def save_model_dir(family: str, model, processor, out_dir: Path, ids: dict) -> None:
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"],
        eos_token_id=[ids["eos"], ids["bos"]],  # hub convention: [<|im_end|>, <|endoftext|>]
        pad_token_id=ids["pad"],
    )
    # save_original_format=False: transformers 5.24 by default reverts Qwen2/2.5-VL weights to the 4.x
    # hub names on save (its conversion mapping is reversible); we want 5.x names in the main dir.
    model.save_pretrained(out_dir, save_original_format=False)
    processor.save_pretrained(out_dir)
    # Hub-style flat files next to the v5 processor_config.json.
    processor.image_processor.save_pretrained(out_dir)
    if family == "qwen3_vl":
        processor.video_processor.save_pretrained(out_dir)  # Qwen3-VL hub repos ship this file
    # chat template: make sure the file is the exact template text
    tpl_path = out_dir / "chat_template.jinja"
    assert tpl_path.read_text() == processor.chat_template, "chat_template.jinja differs from the template"


# 5.x names -> 4.x hub names
def legacy_name(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.visual."):
        return "visual." + name[len("model.visual.") :]
    if name == "lm_head.weight":
        return name
    raise ValueError(f"unexpected weight name {name}")


def legacy_config(family: str, cfg: dict) -> dict:
    """4.x hub-style config.json (as on Qwen/Qwen2.5-VL-7B-Instruct and Qwen/Qwen3-VL-8B-Instruct)."""
    text = dict(cfg["text_config"])
    vision = dict(cfg["vision_config"])
    rope = dict(text.pop("rope_parameters"))
    rope_theta = rope.pop("rope_theta")
    for k in ("dtype", "transformers_version", "architectures", "output_hidden_states", "return_dict"):
        text.pop(k, None)
    if family == "qwen2_5_vl":
        # Flat text config at the top level, rope_scaling {"type": "mrope", ...}, "in_chans".
        rope_scaling = {"type": "mrope", "mrope_section": rope["mrope_section"]}
        out = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl"}
        for k in (
            "attention_dropout",
            "bos_token_id",
            "eos_token_id",
            "hidden_act",
            "hidden_size",
            "initializer_range",
            "intermediate_size",
            "max_position_embeddings",
            "max_window_layers",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "rms_norm_eps",
            "sliding_window",
            "use_cache",
            "use_sliding_window",
            "vocab_size",
        ):
            if k in text:
                out[k] = text[k]
        out.update(
            {
                "vision_start_token_id": cfg["vision_start_token_id"],
                "vision_end_token_id": cfg["vision_end_token_id"],
                "vision_token_id": SPECIAL_TOKENS.index("<|vision_pad|>"),
                "image_token_id": cfg["image_token_id"],
                "video_token_id": cfg["video_token_id"],
                "rope_theta": rope_theta,
                "rope_scaling": rope_scaling,
                "tie_word_embeddings": cfg["tie_word_embeddings"],
                "torch_dtype": "float32",
                "transformers_version": "4.49.0",
            }
        )
        if out.get("sliding_window") is None:
            out["sliding_window"] = 4096
        vision_keys = (
            "depth",
            "hidden_act",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "out_hidden_size",
            "patch_size",
            "spatial_merge_size",
            "temporal_patch_size",
            "window_size",
            "fullatt_block_indexes",
            "tokens_per_second",
        )
        v = {k: vision[k] for k in vision_keys}
        v["in_chans"] = vision["in_channels"]
        v["spatial_patch_size"] = vision["patch_size"]
        out["vision_config"] = v
        return dict(sorted(out.items()))
    # qwen3_vl: nested text_config with rope_scaling + rope_theta (4.57 style), vision model_type "qwen3_vl"
    text["rope_scaling"] = {
        "mrope_interleaved": rope["mrope_interleaved"],
        "mrope_section": rope["mrope_section"],
        "rope_type": rope["rope_type"],
    }
    text["rope_theta"] = rope_theta
    text["dtype"] = "float32"
    vision.pop("rope_parameters", None)
    for k in ("dtype", "transformers_version", "architectures", "output_hidden_states", "return_dict"):
        vision.pop(k, None)
    vision["model_type"] = "qwen3_vl"
    out = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "image_token_id": cfg["image_token_id"],
        "video_token_id": cfg["video_token_id"],
        "vision_start_token_id": cfg["vision_start_token_id"],
        "vision_end_token_id": cfg["vision_end_token_id"],
        "tie_word_embeddings": cfg["tie_word_embeddings"],
        "text_config": dict(sorted(text.items())),
        "vision_config": dict(sorted(vision.items())),
        "transformers_version": "4.57.0",
    }
    return dict(sorted(out.items()))


def write_legacy_dir(family: str, src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copyfile(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(legacy_config(family, cfg), indent=2) + "\n")
    tensors = load_file(src / "model.safetensors")
    renamed = {legacy_name(k): v.contiguous() for k, v in tensors.items()}
    names = sorted(renamed)
    total = sum(renamed[n].numel() * renamed[n].element_size() for n in names)
    shard1, acc = [], 0
    for n in names:
        if acc >= total / 2:
            break
        shard1.append(n)
        acc += renamed[n].numel() * renamed[n].element_size()
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for i, group in enumerate([shard1, names[len(shard1) :]]):
        assert group, "empty shard"
        save_file({n: renamed[n] for n in group}, dst / files[i], metadata={"format": "pt"})
        weight_map.update({n: files[i] for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return renamed


# --------------------------------------------------------------------------------------------
# Reference dumps
# --------------------------------------------------------------------------------------------


def is_torchvision(processor) -> bool:
    return type(processor.image_processor) is hf_common.IMAGE_PROCESSOR_CLASSES["torchvision"]


def resized_images(processor, images) -> list[np.ndarray]:
    """The images after the processor's resize step, HWC float32 0..255, obtained by calling the
    image processor's own functions in the order its `_preprocess` uses them (the torchvision one
    on a batch of one CHW uint8 tensor)."""
    ip = processor.image_processor
    size = SizeDict(**ip.size) if isinstance(ip.size, dict) else ip.size
    factor = ip.patch_size * ip.merge_size
    out = []
    for img in images:
        arr = ip.process_image(img, do_convert_rgb=ip.do_convert_rgb)  # CHW uint8
        if is_torchvision(processor):
            arr = ip.resize(arr[None], size=size, resample=ip.resample, factor=factor)[0].numpy()
        else:
            arr = ip.resize(arr, size=size, resample=ip.resample, factor=factor)
        out.append(np.ascontiguousarray(np.moveaxis(np.asarray(arr), 0, -1).astype(np.float32)))
    return out


def check_pixel_values(processor, resized: list[np.ndarray], pixel_values: torch.Tensor) -> None:
    ip = processor.image_processor
    patch_kwargs = dict(patch_size=ip.patch_size, merge_size=ip.merge_size, temporal_patch_size=ip.temporal_patch_size)
    chunks = []
    for hwc in resized:
        chw = np.moveaxis(hwc, -1, 0)
        if is_torchvision(processor):
            batch = torch.from_numpy(np.ascontiguousarray(chw)).to(torch.uint8)[None]
            x = ip.rescale_and_normalize(
                batch, ip.do_rescale, ip.rescale_factor, ip.do_normalize, tuple(ip.image_mean), tuple(ip.image_std)
            )
            p, _, _ = ip.patchify(x, **patch_kwargs)
            chunks.append(p[0].numpy())
            continue
        x = ip.rescale(chw, ip.rescale_factor)
        x = ip.normalize(x, ip.image_mean, ip.image_std)
        p, _, _ = ip.patchify(x, **patch_kwargs)
        chunks.append(p)
    mine = torch.from_numpy(np.concatenate(chunks, 0))
    assert mine.shape == pixel_values.shape and torch.equal(mine.float(), pixel_values.float()), "resized_k mismatch"


def get_rope_index(model, inputs):
    kwargs = dict(
        input_ids=inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        attention_mask=inputs["attention_mask"],
    )
    pos, delta = model.model.get_rope_index(**kwargs)
    return pos, delta


def model_inputs(inputs) -> dict:
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")
    return {k: inputs[k] for k in keys if k in inputs}


@torch.no_grad()
def generate(model, inputs, n: int):
    out = model.generate(
        **model_inputs(inputs),
        **hf_common.no_eos_generation_kwargs(model, n),
        output_logits=True,
        return_dict_in_generate=True,
    )
    prompt_len = inputs["input_ids"].shape[1]
    tokens = out.sequences[0, prompt_len:].tolist()
    assert len(tokens) == n, f"expected {n} new tokens, got {len(tokens)}"
    logits = torch.stack([lg[0] for lg in out.logits], 0).float()
    return tokens, logits


@torch.no_grad()
def teacher_forced_check(model, inputs, tokens: list[int]):
    """Cache-free cross-check of generate(): one full forward over prompt + generated tokens (M-RoPE
    positions recomputed by the model from mm_token_type_ids, extended with text type 0). With causal
    attention the logits at position j only see tokens <= j, so this equals a step-by-step argmax loop
    without KV cache. Returns (argmax per generated step, logits per generated step)."""
    n = inputs["input_ids"].shape[1]
    gen = torch.tensor([tokens[:-1]], dtype=inputs["input_ids"].dtype)
    ids = torch.cat([inputs["input_ids"], gen], 1)
    mm = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(gen, dtype=inputs["mm_token_type_ids"].dtype)], 1)
    extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    model.model.rope_deltas = None
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm, use_cache=False, **extra)
    model.model.rope_deltas = None
    lg = out.logits[0, n - 1 :].float()
    return lg.argmax(-1).tolist(), lg


def image_features(model, inputs) -> dict:
    if "pixel_values" not in inputs:
        return {}
    out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    feats = {"image_embeds": torch.cat(list(out.pooler_output), 0)}
    ds = getattr(out, "deepstack_features", None)
    if ds:
        for j, f in enumerate(ds):
            feats[f"deepstack_{j}"] = torch.cat(list(f), 0)
    return feats


def compact_json(obj: dict) -> str:
    lines = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def alt_images(spec, messages) -> list:
    """Different images of the same size (same token count) for the 'image matters' probe."""
    out = []
    for p in hf_common.image_paths(messages):
        w, h = spec["images"][Path(p).name]
        out.append(draw_scene(w, h, variant=1 + len(out)))
    return out


@torch.no_grad()
def run_case(family, name, messages, model, processor, ref_dir: Path, checks: list) -> dict:
    spec = FAMILY_SPECS[family]
    prompt, inputs = hf_common.prepare_inputs(processor, messages, ref_dir)
    # Cross-check: the one-call chat-template path (tokenize=True, images loaded from the paths)
    abs_msgs = json.loads(json.dumps(messages))
    for m in abs_msgs:
        for part in m["content"]:
            if part.get("type") == "image":
                part["path"] = str(ref_dir / part["path"])
    direct = processor.apply_chat_template(abs_msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(direct["input_ids"], inputs["input_ids"]), "apply_chat_template(tokenize=True) differs"
    images = hf_common.load_images(ref_dir, messages)
    # (load_image, which the one-call path uses, drops alpha instead of compositing it)
    if "pixel_values" in inputs and not any(img.has_transparency_data for img in images):
        assert torch.equal(direct["pixel_values"], inputs["pixel_values"])
    elif "pixel_values" in inputs:
        dropped = not torch.equal(direct["pixel_values"], inputs["pixel_values"])
        checks.append((f"{family}/{name}: alpha composited, not dropped as load_image does", dropped, ""))

    n = inputs["input_ids"].shape[1]
    pos, delta = get_rope_index(model, inputs)
    model.model.rope_deltas = None

    # resid_<i>: the residual stream after decoder layer i as the next layer (or the final norm) sees it,
    # i.e. including the Qwen3-VL deepstack add and before the final RMSNorm (debug aid for the Rust side).
    lm = model.model.language_model
    resid: dict[int, torch.Tensor] = {}
    hooks = [
        mod.register_forward_pre_hook(lambda _m, args, i=i: resid.__setitem__(i, args[0][0].detach().clone()))
        for i, mod in enumerate(list(lm.layers[1:]) + [lm.norm])
    ]
    try:
        out = model(**model_inputs(inputs), output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits[0].float()
    hs = out.hidden_states
    n_layers = model.config.get_text_config().num_hidden_layers
    assert len(hs) == n_layers + 1
    # explicit M-RoPE position ids reproduce the natural forward exactly
    out_pos = model(**model_inputs(inputs), position_ids=pos, use_cache=False)
    assert torch.allclose(out_pos.logits[0], logits, atol=1e-5, rtol=0), "position_ids dump mismatch"

    tokens, gen_logits = generate(model, inputs, MAX_NEW_TOKENS)
    model.model.rope_deltas = None
    tf_tokens, tf_logits = teacher_forced_check(model, inputs, tokens)
    assert tf_tokens == tokens, f"{family}/{name}: generate() != cache-free argmax\n{tokens}\n{tf_tokens}"
    dmax = (tf_logits - gen_logits).abs().max().item()
    log(f"    cache vs cache-free: max abs logit diff {dmax:.2e} (max |logit| {gen_logits.abs().max().item():.1f})")
    assert dmax < 1e-3 * max(1.0, gen_logits.abs().max().item()), f"generate logits != cache-free logits ({dmax})"
    assert torch.allclose(gen_logits[0], logits[-1], atol=1e-4, rtol=1e-4), "first-step logits != prefill"

    tensors = {"logits": logits, "inputs_embeds": hs[0][0].float()}
    for i in range(n_layers):
        tensors[f"hidden_{i}"] = hs[i + 1][0].float()
        tensors[f"resid_{i}"] = resid[i].float()
    assert torch.allclose(lm.norm(resid[n_layers - 1]), tensors[f"hidden_{n_layers - 1}"], atol=1e-6, rtol=0)
    tensors["greedy_logits"] = gen_logits
    tensors["greedy_logits_last"] = gen_logits[-1]
    image_meta = []
    if images:
        pv = inputs["pixel_values"].float()
        tensors["pixel_values"] = pv
        resized = resized_images(processor, images)
        check_pixel_values(processor, resized, pv)
        for k, (img, r) in enumerate(zip(images, resized)):
            tensors[f"resized_{k}"] = torch.from_numpy(r)
            path = hf_common.image_paths(messages)[k]
            if path.endswith(".jpg"):
                # PIL/libjpeg decode of the JPEG before resizing (lets the Rust side separate decoder
                # differences from resize differences)
                tensors[f"decoded_{k}"] = torch.from_numpy(np.asarray(img.convert("RGB")).astype(np.float32))
            image_meta.append(
                {"path": path, "orig_hw": [img.height, img.width], "resized_hw": [int(r.shape[0]), int(r.shape[1])]}
            )
        tensors.update({k: v.float() for k, v in image_features(model, inputs).items()})

    # ---- teeth checks -------------------------------------------------------------------------
    if images:
        _, alt_inputs = hf_common.prepare_inputs(processor, messages, ref_dir, images=alt_images(spec, messages))
        assert torch.equal(alt_inputs["input_ids"], inputs["input_ids"])
        model.model.rope_deltas = None
        alt_tokens, _ = generate(model, alt_inputs, MAX_NEW_TOKENS)
        model.model.rope_deltas = None
        differ = [i for i, (a, b) in enumerate(zip(tokens, alt_tokens)) if a != b]
        checks.append((f"{family}/{name}: greedy tokens change with a different image", bool(differ), f"first diff at step {differ[0] if differ else None}, {len(differ)}/32 differ"))
        pos1d = torch.arange(n).view(1, 1, n).expand(3, 1, n)
        out1d = model(**model_inputs(inputs), position_ids=pos1d, use_cache=False)
        d = (out1d.logits[0] - logits).abs().max().item()
        checks.append((f"{family}/{name}: logits change with 1-D instead of M-RoPE positions", d > 1e-2, f"max|dlogits|={d:.3g}"))
        vis = model.model.visual
        if family == "qwen3_vl":
            saved = vis.deepstack_visual_indexes
            vis.deepstack_visual_indexes = []
            o = model(**model_inputs(inputs), use_cache=False)
            vis.deepstack_visual_indexes = saved
            d = (o.logits[0] - logits).abs().max().item()
            checks.append((f"{family}/{name}: deepstack injection matters", d > 1e-2, f"max|dlogits|={d:.3g}"))
            w = vis.pos_embed.weight.data.clone()
            vis.pos_embed.weight.data.zero_()
            o = model(**model_inputs(inputs), use_cache=False)
            vis.pos_embed.weight.data.copy_(w)
            d = (o.logits[0] - logits).abs().max().item()
            checks.append((f"{family}/{name}: learned vision pos-embed matters", d > 1e-2, f"max|dlogits|={d:.3g}"))
        else:
            saved = vis.fullatt_block_indexes
            vis.fullatt_block_indexes = list(range(len(vis.blocks)))
            o = model(**model_inputs(inputs), use_cache=False)
            vis.fullatt_block_indexes = saved
            d = (o.logits[0] - logits).abs().max().item()
            grid = inputs["image_grid_thw"].tolist()
            _, cu_win = get_vision_window_index(
                inputs["image_grid_thw"], vis.spatial_merge_size, vis.window_size, vis.patch_size
            )
            n_windows = len(cu_win) - 1
            if n_windows > len(grid):  # some image is split into several windows
                checks.append((f"{family}/{name}: window attention matters (vs all-full)", d > 1e-2, f"max|dlogits|={d:.3g} grids={grid} windows={n_windows}"))
            else:
                log(f"    {family}/{name}: window check n/a (grids={grid} fit in one window each; max|dlogits|={d:.3g})")
        model.model.rope_deltas = None

    tensors = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, ref_dir / f"{name}.safetensors", metadata={"format": "pt"})
    tok = processor.tokenizer
    meta = {
        "case": name,
        "family": family,
        "model_dir": FAMILY_SPECS[family]["dir"],
        "messages": messages,
        "prompt_text": prompt,
        "input_ids": inputs["input_ids"][0].tolist(),
        "mm_token_type_ids": inputs["mm_token_type_ids"][0].tolist(),
        "image_grid_thw": inputs["image_grid_thw"].tolist() if images else [],
        "images": image_meta,
        "position_ids": pos[:, 0, :].tolist(),
        "rope_delta": int(delta.view(-1)[0]),
        "greedy_tokens": tokens,
        "greedy_text": tok.decode(tokens, skip_special_tokens=False),
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_disabled": True,
        "tap_layers": list(range(n_layers)),
        "hidden_semantics": (
            "hidden_<i> = HF output_hidden_states[i+1] of the prompt forward = output of decoder layer i as "
            "returned by the layer (Qwen3-VL: BEFORE the deepstack add that follows layers 0..len(deepstack)-1); "
            "the last one (i = num_layers-1) is replaced by HF with last_hidden_state, i.e. AFTER the final RMSNorm. "
            "inputs_embeds = output_hidden_states[0] (token embeddings with image features scattered in). "
            "resid_<i> = residual stream after layer i as layer i+1 (or the final norm) receives it: equals hidden_<i> "
            "except at image positions after Qwen3-VL deepstack layers, and except for the last layer (pre-norm). "
            "image_embeds / deepstack_<j> = vision merger / deepstack merger j outputs, image tokens in prompt order."
        ),
        "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())},
        "image_processor_class": type(processor.image_processor).__name__,
        "processor_class": type(processor).__name__,
        "attn_implementation": hf_common.ATTN_IMPLEMENTATION,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    (ref_dir / f"{name}.json").write_text(compact_json(meta))
    log(f"  {family}/{name}: n={n} grids={meta['image_grid_thw']} delta={meta['rope_delta']} tokens[:8]={tokens[:8]}")
    return meta


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def build_family(family: str, tokenizer, out_root: Path, seed: int, checks: list) -> None:
    spec = FAMILY_SPECS[family]
    out_dir = out_root / spec["dir"]
    legacy_dir = out_root / (spec["dir"] + "-legacy")
    for d in (out_dir, legacy_dir):
        if d.exists():
            shutil.rmtree(d)
    out_dir.mkdir(parents=True)

    ids = token_ids(tokenizer)
    vocab_size = round_up(len(tokenizer), 64)
    template = (HERE / "templates" / spec["template"]).read_text()
    processor = build_processor(family, tokenizer, template)

    cfg = make_config(family, vocab_size, ids)
    torch.manual_seed(seed)
    model = hf_common.FAMILIES[family]["model_cls"](cfg).to(torch.float32)
    reinit_with_teeth(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    model.eval()
    save_model_dir(family, model, processor, out_dir, ids)
    # What transformers 5.24 writes by default (save_original_format=True): for Qwen2.5-VL these are
    # the 4.x hub names, which the legacy dir must reproduce exactly.
    with tempfile.TemporaryDirectory() as td:
        model.save_pretrained(td)
        default_names = sorted(load_file(Path(td) / "model.safetensors"))
    del model

    # Everything below uses what was written to disk, as the Rust side will.
    model = hf_common.load_model(out_dir)
    processor = hf_common.load_processor(out_dir)
    assert type(processor.image_processor) is hf_common.IMAGE_PROCESSOR_CLASSES["pil"]
    assert model.config._attn_implementation == "eager"
    assert model.config.vision_config._attn_implementation == "eager"
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()

    ref_dir = out_dir / "reference"
    (ref_dir / "images").mkdir(parents=True)
    for fname, (w, h) in spec["images"].items():
        img = draw_scene(w, h, variant=0)
        if fname.startswith("alpha"):
            img = with_transparency(img)
        if fname.endswith(".jpg"):
            img.save(ref_dir / "images" / fname, quality=95, subsampling=0)  # 4:4:4, no chroma subsampling
        else:
            img.save(ref_dir / "images" / fname, optimize=False)

    for name, messages in CASES.items():
        model.model.rope_deltas = None
        run_case(family, name, messages, model, processor, ref_dir, checks)
    torchvision_cases(family, model, out_dir, ref_dir, checks)

    # Legacy (4.x names, sharded) copy of the same weights.
    renamed = write_legacy_dir(family, out_dir, legacy_dir)
    main = load_file(out_dir / "model.safetensors")
    back = {}
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        back.update(load_file(legacy_dir / f))
    assert set(back) == set(renamed) and all(torch.equal(back[legacy_name(k)], v) for k, v in main.items())
    if family == "qwen2_5_vl":
        assert sorted(back) == default_names, "legacy names differ from transformers' save_original_format names"
    else:  # no conversion mapping for qwen3_vl in 5.24: default save keeps the 5.x names
        assert default_names == sorted(main), "unexpected default save names"
    log(f"  {family}: main names {len(main)} (e.g. {sorted(main)[:2]}), legacy e.g. {sorted(back)[:2]}")
    # transformers 5.24 itself must read the legacy dir (4.x config + 4.x names) back to the same model
    # where it has a conversion mapping (Qwen2.5-VL); for Qwen3-VL it has none (hub ckpts already use
    # model.language_model.*), so only the config is checked there.
    lcfg = transformers.AutoConfig.from_pretrained(legacy_dir)
    mcfg = model.config
    for a, b in ((lcfg.get_text_config(), mcfg.get_text_config()), (lcfg.vision_config, mcfg.vision_config)):
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "rope_parameters", "head_dim",
                    "depth", "num_heads", "patch_size", "window_size", "fullatt_block_indexes", "deepstack_visual_indexes",
                    "num_position_embeddings", "out_hidden_size", "intermediate_size", "rms_norm_eps", "in_channels"):
            if hasattr(b, key):
                va, vb = getattr(a, key, None), getattr(b, key)
                if key == "rope_parameters":  # 4.x spelling keeps the extra legacy "type": "mrope"
                    va = {k: v for k, v in va.items() if k != "type"}
                assert va == vb, (family, key, va, vb)
    assert lcfg.tie_word_embeddings == mcfg.tie_word_embeddings
    if family == "qwen2_5_vl":
        lm = hf_common.load_model(legacy_dir)
        _, inp = hf_common.prepare_inputs(processor, CASES["two_images"], ref_dir)
        a = lm(**model_inputs(inp), use_cache=False).logits
        b = model(**model_inputs(inp), use_cache=False).logits
        ok = torch.equal(a, b)
        checks.append((f"{family}: transformers loads the legacy dir to identical logits", ok, ""))
        del lm
    log(f"  {family}: wrote {out_dir.name} and {legacy_dir.name}")


def torchvision_cases(family: str, model, out_dir: Path, ref_dir: Path, checks: list) -> None:
    """The TORCHVISION_CASES again through the torchvision image processor (`tv_<case>`), and a
    check that its pixels really differ from the PIL processor's (else the parity proves nothing)."""
    processor = hf_common.load_processor(out_dir, "torchvision")
    assert is_torchvision(processor)
    for name in TORCHVISION_CASES:
        model.model.rope_deltas = None
        meta = run_case(family, f"tv_{name}", CASES[name], model, processor, ref_dir, checks)
        pil = load_file(ref_dir / f"{name}.safetensors")["pixel_values"]
        tv = load_file(ref_dir / f"tv_{name}.safetensors")["pixel_values"]
        pil_tokens = json.loads((ref_dir / f"{name}.json").read_text())["greedy_tokens"]
        differ = [i for i, (a, b) in enumerate(zip(pil_tokens, meta["greedy_tokens"])) if a != b]
        checks.append((
            f"{family}/tv_{name}: torchvision pixels differ from PIL's",
            not torch.equal(pil, tv),
            f"max diff {(pil - tv).abs().max().item():.3g}, greedy tokens first differ at {differ[0] if differ else None}",
        ))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = T_START
    torch.set_num_threads(TORCH_THREADS)
    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    log(f"tokenizer: {len(tokenizer)} tokens, model vocab {round_up(len(tokenizer), 64)}")
    checks: list = []
    for family in FAMILY_SPECS:
        build_family(family, tokenizer, args.out, args.seed, checks)

    log("\nsanity checks (weights with teeth):")
    ok_all = True
    for what, ok, detail in checks:
        ok_all &= bool(ok)
        log(f"  [{'PASS' if ok else 'FAIL'}] {what}  {detail}")
    log("\nfiles:")
    for p in sorted(args.out.rglob("*.safetensors")):
        rel = p.relative_to(args.out)
        if rel.parts[0] in [FAMILY_SPECS[f]["dir"] for f in FAMILY_SPECS] + [FAMILY_SPECS[f]["dir"] + "-legacy" for f in FAMILY_SPECS]:
            log(f"  {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}  {rel}")
    log(f"\ndone in {time.time() - t0:.1f}s")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
