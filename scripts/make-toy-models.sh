#!/usr/bin/env bash
# Regenerates the committed toy-world models from their seed (same figures within noise;
# multithreaded CPU kernels are not bit-exact):
#   models/toy-target  the tiny Qwen3-VL-architecture target trained on the toy world
#   models/toy-head    the GLANCE draft head trained on that target's own states
#   models/toy-eagle3  the matched peer: an EAGLE-3 head trained on the same rows (same seed)
# The target trains until sign, doc and chart all reach 96% exact match on 32 held-out prompts
# each at an evaluation (or for the full schedule), the heads for a fixed number of steps. Times and
# figures: models/README.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
cargo build --release --workspace --bins --quiet
SEED="${GLANCE_TOY_SEED:-0}"
# Deletes what `train` leaves in a head's directory besides the head: its initial weights, optimizer state,
# regenerated rows and tap states (gigabytes); only config, weights and draft vocabulary are kept.
drop_training_scratch() {
  rm -rf "$1/init" "$1/train_state.safetensors" "$1/regenerated.jsonl" "$1"/tap_states.*.safetensors
}
if [ "${1:-}" != "--head-only" ]; then
  rm -rf models/toy-target
  ./target/release/toyworld train-target --out models/toy-target --seed "$SEED" \
    --steps "${GLANCE_TOY_TARGET_STEPS:-16000}" --eval-every 1000 --eval-samples 32 --stop-at 0.96 --threads 2
fi
rm -rf models/toy-head
./target/release/drafter-svc train --target models/toy-target --out models/toy-head --seed "$SEED" \
  --rows "${GLANCE_TOY_HEAD_ROWS:-20000}" --held-out-rows 50 --steps "${GLANCE_TOY_HEAD_STEPS:-64000}" \
  --layers 2 --taps 0,1,2,3 --eval-every 8000 --checkpoint-every 8000 --threads 2
drop_training_scratch models/toy-head
rm -rf models/toy-eagle3
# The matched peer: the block head's very rows (same seed, the regenerated responses and their
# tap states) and steps.
./target/release/drafter-svc train --kind eagle3 --target models/toy-target --out models/toy-eagle3 \
  --seed "$SEED" --rows "${GLANCE_TOY_HEAD_ROWS:-20000}" --held-out-rows 50 \
  --steps "${GLANCE_TOY_HEAD_STEPS:-64000}" --taps 0,1,3 --eval-every 8000 --checkpoint-every 8000 \
  --eval-depth 6 --threads 2
drop_training_scratch models/toy-eagle3
./target/release/toyworld eval --model models/toy-target --seed "$SEED" --samples 100
