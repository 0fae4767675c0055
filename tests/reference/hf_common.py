"""Shared helpers for the Python *reference* side (make_reference.py, bench_hf.py).

Python is only the reference here: it builds tiny HF checkpoints and dumps what the Rust
implementation must reproduce. Everything runs offline (HF_HUB_OFFLINE=1). Both of transformers'
image processors are references: the PIL one (Pillow resize, numpy normalize) and the torchvision
one (antialiased uint8 resize, torch normalize), each pinned by class rather than left to
AutoProcessor's choice by environment.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLImageProcessorPil,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.video_processing_utils import VideoProcessorMixin  # noqa: E402



def ensure_video_mixin_exported() -> None:
    """transformers 5.24 without torchvision: the top-level `transformers.VideoProcessorMixin` is not
    exported, so ProcessorMixin's class check of the (mandatory) video_processor argument fails with
    "VIDEO_PROCESSOR_MAPPING has no attribute _extra_content". Exporting the real mixin fixes the check.
    (Set right before building a processor: the lazy `transformers` module can drop the attribute.)"""
    from transformers import processing_utils

    # (`processing_utils.transformers_module` can be a different module object than the `transformers`
    # bound at import time: the lazy module gets re-registered in sys.modules, so patch the one it uses.)
    for mod in {id(m): m for m in (processing_utils.transformers_module, sys.modules["transformers"])}.values():
        setattr(mod, "VideoProcessorMixin", VideoProcessorMixin)


# Qwen3VLVideoProcessor's module imports torchvision lazily, so the class can be built without it
# (the top-level `transformers.Qwen3VLVideoProcessor` is a torchvision-requiring dummy). The
# Qwen2-VL video processor module imports torchvision at import time and cannot be used here.
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor  # noqa: E402

# Special tokens, in id order (ids 0..13 of the tiny tokenizer).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The image processor of each backend, pinned by class (`--image-backend` on the Rust side).
IMAGE_PROCESSOR_CLASSES = {
    "pil": Qwen2VLImageProcessorPil,  # PIL bicubic resize, numpy rescale/normalize
    "torchvision": Qwen2VLImageProcessor,  # torch's antialiased uint8 bicubic, fused f32 normalize
}
ATTN_IMPLEMENTATION = "eager"

FAMILIES = {
    "qwen3_vl": {
        "model_cls": Qwen3VLForConditionalGeneration,
        "processor_cls": Qwen3VLProcessor,
    },
    "qwen2_5_vl": {
        "model_cls": Qwen2_5_VLForConditionalGeneration,
        "processor_cls": Qwen2_5_VLProcessor,
    },
}


def model_type_of(model_dir: str | Path) -> str:
    with open(Path(model_dir) / "config.json") as f:
        return json.load(f)["model_type"]


def load_processor(model_dir: str | Path, backend: str = "pil"):
    """Build the processor from a saved tiny model dir, pinning the image processor class of `backend`.

    The pieces are loaded one by one so the image processor is the pinned class, whatever is installed.
    """
    model_dir = Path(model_dir)
    fam = FAMILIES[model_type_of(model_dir)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = IMAGE_PROCESSOR_CLASSES[backend].from_pretrained(model_dir)
    pc_path = model_dir / "processor_config.json"
    video_kwargs = {}
    if pc_path.exists():
        video_kwargs = dict(json.loads(pc_path.read_text()).get("video_processor", {}))
        video_kwargs.pop("video_processor_type", None)
    video_processor = Qwen3VLVideoProcessor(**video_kwargs)
    chat_template = (model_dir / "chat_template.jinja").read_text()
    ensure_video_mixin_exported()
    return fam["processor_cls"](
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template,
    )


def backend_of(case: dict) -> str:
    """The image backend a reference case was made with, from its `image_processor_class`."""
    return "pil" if case.get("image_processor_class", "").endswith("Pil") else "torchvision"


def load_model(model_dir: str | Path, attn_implementation: str = ATTN_IMPLEMENTATION):
    model_dir = Path(model_dir)
    fam = FAMILIES[model_type_of(model_dir)]
    model, info = fam["model_cls"].from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation, output_loading_info=True
    )
    # e.g. a Qwen3-VL dir with 4.x names (transformers 5.24 has no renaming for qwen3_vl) must not load
    # silently with random weights
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise RuntimeError(f"{model_dir}: weights do not match the model: {bad}")
    model.eval()
    return model


def image_paths(messages: list[dict]) -> list[str]:
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            continue
        for part in content:
            if part.get("type") == "image":
                out.append(part["path"])
    return out


def load_images(base_dir: str | Path, messages: list[dict]) -> list[Image.Image]:
    images = []
    for p in image_paths(messages):
        img = Image.open(Path(base_dir) / p)
        img.load()
        images.append(img)
    return images


def prepare_inputs(processor, messages: list[dict], base_dir: str | Path, images=None):
    """Render the chat template (add_generation_prompt=True) and run the processor.

    Returns (prompt_text, BatchFeature). `images` overrides the images loaded from the message paths.
    """
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if images is None:
        images = load_images(base_dir, messages)
    kwargs = {"text": [prompt], "return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    inputs = processor(**kwargs)
    return prompt, inputs


def no_eos_generation_kwargs(model, max_new_tokens: int) -> dict:
    """Greedy decoding with EOS disabled: eos_token_id is set to an id outside the vocab so that
    exactly `max_new_tokens` come out, while the argmax still runs over the whole vocab (no
    min_new_tokens logit masking). Sampling knobs are pinned to neutral values."""
    vocab = model.config.get_text_config().vocab_size
    return dict(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=vocab + 1000,
        pad_token_id=model.config.get_text_config().pad_token_id or 0,
        repetition_penalty=1.0,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
    )
