#!/usr/bin/env bash
# Regenerates the committed draft head for the real SmolLM2-135M-Instruct from its seed (same
# figures within noise; multithreaded CPU kernels are not bit-exact): a fresh 1-layer DFlash head
# trained on ShareGPT's first human turns with the target's own greedy responses (128 tokens,
# regenerated 16 at a time by batched greedy decoding and cached in regenerated.jsonl), held-out
# acceptance by conversation id every 250 steps. About 45 minutes on 2 CPU cores. Figures: README
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
  --rows "${GLANCE_HEAD_ROWS:-320}" --held-out-rows 24 --max-new-tokens 128 \
  --steps "${GLANCE_HEAD_STEPS:-1500}" --eval-every 250 --checkpoint-every 250 --regen-batch 16 --threads 2
rm -rf "$OUT/init" "$OUT/train_state.safetensors" "$OUT/regenerated.jsonl"
