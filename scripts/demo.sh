#!/usr/bin/env bash
# The main job, end to end on this machine: set up (idempotent), start verifier-svc on localhost
# with the bundled tiny model, send one chat request with an image through the `glance` client,
# print the answer and its timings, and stop the server.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
scripts/setup.sh

MODEL="${GLANCE_MODEL:-$GLANCE_FIXTURES/tiny-qwen3-vl}"
IMAGE="${GLANCE_DEMO_IMAGE:-$MODEL/reference/images/wide.png}"
log="$(mktemp)"
./target/release/verifier-svc --model "$MODEL" --listen 127.0.0.1:0 >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
  addr="$(sed -n 's/^verifier-svc listening on //p' "$log")"
  [ -n "$addr" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { echo "verifier-svc did not start"; cat "$log"; exit 1; }
echo "demo: verifier-svc serving $(basename "$MODEL") on $addr"
echo "demo: asking about $(basename "$IMAGE")"
./target/release/glance --addr "http://$addr" generate --image "$IMAGE" \
  --prompt "Describe the image." --max-new-tokens 48
