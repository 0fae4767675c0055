#!/usr/bin/env bash
# The main job, end to end on this machine: set up (idempotent), start drafter-svc and
# verifier-svc on localhost with the bundled tiny model, send one chat request with an image
# through the `glance` client — autoregressively and with the GLANCE tree — and print the answer,
# tau and the speed-up measured on that request. Until the toy-world issue lands a trained head,
# the drafter runs a randomly initialized head: tau is about 1 and the "speed-up" is below 1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
scripts/setup.sh

MODEL="${GLANCE_MODEL:-$GLANCE_FIXTURES/tiny-qwen3-vl}"
HEAD="${GLANCE_HEAD:-$GLANCE_FIXTURES/tiny-qwen3-vl-random-head}"
IMAGE="${GLANCE_DEMO_IMAGE:-$MODEL/reference/images/wide.png}"
if [ ! -f "$HEAD/config.json" ]; then
  ./target/release/drafter-svc init --target "$MODEL" --out "$HEAD" --layers 1 --taps 0,1,2
fi

logs="$(mktemp -d)"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$logs"' EXIT

# Starts a service in the background and prints the address it reports.
start() {
  local name="$1"; shift
  "$@" >"$logs/$name" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 600); do
    local addr
    addr="$(sed -n "s/^$name listening on //p" "$logs/$name")"
    if [ -n "$addr" ]; then echo "$addr"; return; fi
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "demo: $name did not start" >&2; cat "$logs/$name" >&2; exit 1
}

drafter="$(start drafter-svc ./target/release/drafter-svc serve --kind block-head --head "$HEAD" --target "$MODEL" --listen 127.0.0.1:0)"
verifier="$(start verifier-svc ./target/release/verifier-svc --model "$MODEL" --drafter "http://$drafter" --listen 127.0.0.1:0)"
echo "demo: drafter-svc on $drafter, verifier-svc on $verifier, model $(basename "$MODEL")"
echo "demo: asking about $(basename "$IMAGE")"
./target/release/glance --addr "http://$verifier" compare --image "$IMAGE" \
  --prompt "Describe the image." --max-new-tokens 64
