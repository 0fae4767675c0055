#!/usr/bin/env bash
# Fails when the crate graph says something false about the system (see README, Layout):
#   1. the two services are independent programs: neither depends on the other;
#   2. the client CLI (and the transport security it shares with the services) builds without
#      libtorch;
#   3. the model library (glance-models, glance-input) needs neither tonic, the toy world nor
#      training.
# Normal (non-dev) dependencies only, each package resolved on its own as `cargo build -p` would.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

failed=0
forbid() {
  local package="$1"
  shift
  local tree found
  # A failing `cargo tree` (say, a stale Cargo.lock) stops the script here.
  tree="$(cargo tree --quiet --locked -p "$package" -e normal --prefix none --format '{p}')"
  found="$(awk '{print $1}' <<<"$tree" | sort -u | grep -xF -f <(printf '%s\n' "$@") || true)"
  if [ -n "$found" ]; then
    echo "crate graph: $package must not depend on: $(echo "$found" | tr '\n' ' ')" >&2
    failed=1
  else
    echo "crate graph: $package depends on none of: $*"
  fi
}

forbid verifier-svc drafter-svc
forbid drafter-svc verifier-svc
forbid glance-client tch torch-sys glance-codec glance-models glance-spec
forbid glance-proto tch torch-sys
forbid glance-security tch torch-sys
forbid glance-models tonic glance-proto glance-toyworld glance-train glance-input
forbid glance-input tonic glance-proto glance-toyworld glance-train
exit "$failed"
