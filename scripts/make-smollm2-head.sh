#!/usr/bin/env bash
# Regenerates a draft head for the real SmolLM2-135M-Instruct from its seed (same figures within
# noise; multithreaded CPU kernels are not bit-exact). Both kinds train on ShareGPT's first human
# turns with the target's own greedy responses (128 tokens, regenerated 32 at a time by batched
# greedy decoding and cached in regenerated.jsonl beside the head), the same seed and held-out
# split (24 conversations by id). About 16 minutes of regeneration on 2 CPU cores (1.0 s a row, the
# tap states read from the batched decoding itself), then about an hour of training for the block
# head (0.25 s a step on two Zen 4 threads, 2026-12-05), 15 minutes for the EAGLE-3 head. Figures:
# README "A real model". GLANCE_HEAD_ROWS=2784 trains on three times the rows (README, session 28).
#
#   scripts/make-smollm2-head.sh          the committed GLANCE head, models/smollm2-head: a fresh
#       2-layer DFlash head reading target layer 15 (final norm starting at 0.1, so the first loss
#       is ~ln V rather than ~50), a sampled softmax over 4,096 frequent tokens plus the head's own
#       top predictions and 512 random negatives (the full 49,152-way softmax made a step 2-3x
#       dearer); 12,000 steps of 16 anchors, held-out acceptance every 3,000; saved in bf16
#       (14.8 MB; in f32 it would weigh 29.7 MB, over the 20 MB a committed head may).
#   scripts/make-smollm2-head.sh eagle3   the matched EAGLE-3 head, models/smollm2-eagle3 (not
#       committed: 30 MB in f32, and the device build's 64 MiB must hold the working tree): taps 1,
#       14, 26 of 30 layers, a draft vocabulary of the 4,096 most frequent response tokens (94.9%
#       of them), EAGLE-3's training-time test (7 unrolled steps, loss weighted 0.8^k); 1,200
#       steps of one whole row each, held-out acceptance every 400.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
case "${1:-block-head}" in
  block-head)
    OUT=models/smollm2-head
    KIND=(--kind block-head --layers 2 --taps 15 --save-dtype bf16 --loss-vocab 4096 --loss-negatives 512
      --output-norm-init 0.1 --steps "${GLANCE_HEAD_STEPS:-12000}" --eval-every 3000 --checkpoint-every 1000) ;;
  eagle3)
    OUT=models/smollm2-eagle3
    KIND=(--kind eagle3 --draft-vocab 4096 --eval-depth 6
      --steps "${GLANCE_HEAD_STEPS:-1200}" --eval-every 400 --checkpoint-every 400) ;;
  *) echo "usage: $0 [block-head|eagle3]" >&2; exit 2 ;;
esac
scripts/setup-real-model.sh
cargo build --release --workspace --bins --quiet
rm -rf "$OUT"
./target/release/drafter-svc train "${KIND[@]}" --target models/smollm2-135m-instruct --out "$OUT" \
  --data sharegpt:data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json --seed "${GLANCE_HEAD_SEED:-0}" \
  --rows "${GLANCE_HEAD_ROWS:-928}" --held-out-rows 24 --max-new-tokens 128 --regen-batch 32 --threads 2
rm -rf "$OUT/init" "$OUT/train_state.safetensors" "$OUT/regenerated.jsonl" "$OUT"/tap_states.*.safetensors
