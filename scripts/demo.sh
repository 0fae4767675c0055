#!/usr/bin/env bash
# The main job, end to end on this machine: set up (idempotent), start drafter-svc and
# verifier-svc on localhost with the committed toy-world models (models/toy-target, a tiny
# Qwen3-VL-architecture target trained to read its images, and models/toy-head, the GLANCE head
# trained on that target's states), send a held-out `doc` image through the `glance` client —
# autoregressively and with the GLANCE tree — and print the answer, tau and the speed-up over
# greedy measured on that request. GLANCE_MODEL / GLANCE_HEAD / GLANCE_DEMO_TASK /
# GLANCE_DEMO_INDEX choose other models or samples.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
scripts/setup.sh

MODEL="${GLANCE_MODEL:-models/toy-target}"
HEAD="${GLANCE_HEAD:-models/toy-head}"
TASK="${GLANCE_DEMO_TASK:-doc}"
INDEX="${GLANCE_DEMO_INDEX:-3}"

# One libtorch thread per service, as in the benchmark: on a 2-core machine two thread pools per
# process would spin against each other (each service stands for its own device).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

logs="$(mktemp -d)"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$logs"' EXIT

# Starts a service in the background and sets ADDR to the address it reports. (Not called in a
# command substitution: that subshell would keep the pid from the cleanup trap.)
start() {
  local name="$1"; shift
  "$@" >"$logs/$name" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 600); do
    ADDR="$(sed -n "s/^$name listening on //p" "$logs/$name")"
    if [ -n "$ADDR" ]; then return; fi
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "demo: $name did not start" >&2; cat "$logs/$name" >&2; exit 1
}

start drafter-svc ./target/release/drafter-svc serve --kind block-head --head "$HEAD" --target "$MODEL" --listen 127.0.0.1:0
drafter="$ADDR"
start verifier-svc ./target/release/verifier-svc --model "$MODEL" --drafter "http://$drafter" --listen 127.0.0.1:0
verifier="$ADDR"
echo "demo: drafter-svc on $drafter, verifier-svc on $verifier, model $(basename "$MODEL")"
image="$logs/$TASK-$INDEX.png"
sample="$(./target/release/toyworld sample --task "$TASK" --index "$INDEX" --out "$image")"
prompt="$(sed -n 's/^prompt: //p' <<<"$sample")"
echo "demo: held-out $TASK image $INDEX, prompt: $prompt"
echo "demo: the text drawn in the image:"
sed '1,2d' <<<"$sample" | sed 's/^/    /'
# One short request first, so the measured ones run warm.
./target/release/glance --addr "http://$verifier" generate --image "$image" --prompt "$prompt" \
  --max-new-tokens 8 --mode auto >/dev/null
echo "demo: the answer (auto: the cost-aware round policy over GLANCE trees; the same request is also decoded greedily, both 21 times alternated, to time it: one 34-token request varies by tens of percent from one sending to the next on a shared machine):"
./target/release/glance --addr "http://$verifier" compare --image "$image" --prompt "$prompt" \
  --max-new-tokens 64 --repeats 21
