#!/usr/bin/env bash
# Regenerates the committed draft head for the real SmolLM2-135M-Instruct from its seed (same
# figures within noise; multithreaded CPU kernels are not bit-exact): a fresh 1-layer DFlash head
# (final norm starting at 0.1, so the first loss is ~ln V rather than ~50) trained on ShareGPT's
# first human turns with the target's own greedy responses (128 tokens, regenerated 32 at a time by
# batched greedy decoding and cached in regenerated.jsonl), with a sampled softmax over 4,096
# frequent tokens plus the head's own top predictions and 512 random negatives (the full
# 49,152-way softmax made a step 2-3x dearer), held-out acceptance by conversation id every 500
# steps. About 25 minutes of regeneration and 40 of training on 2 CPU cores. Figures: README
# "A real model".
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
scripts/setup-real-model.sh
cargo build --release --workspace --bins --quiet
OUT=models/smollm2-head
rm -rf "$OUT"
./target/release/drafter-svc train --target models/smollm2-135m-instruct --out "$OUT" \
  --data sharegpt:data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json --seed "${GLANCE_HEAD_SEED:-0}" \
  --rows "${GLANCE_HEAD_ROWS:-928}" --held-out-rows 24 --max-new-tokens 128 \
  --steps "${GLANCE_HEAD_STEPS:-2000}" --eval-every 500 --checkpoint-every 250 --regen-batch 32 --threads 2 \
  --loss-vocab 4096 --loss-negatives 512 --output-norm-init 0.1
rm -rf "$OUT/init" "$OUT/train_state.safetensors" "$OUT/regenerated.jsonl" "$OUT"/tap_states.*.safetensors
