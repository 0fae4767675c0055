#!/usr/bin/env bash
# Sets up (idempotent) and runs every test: Rust unit tests, HF parity tests against the reference
# dumps, and the end-to-end gRPC tests that start verifier-svc as a process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
scripts/setup.sh
echo "test: set up in ${SECONDS}s"
export GLANCE_REQUIRE_FIXTURES=1
cargo test --release --workspace ${GLANCE_CARGO_TIMINGS:+--timings} 2>&1
