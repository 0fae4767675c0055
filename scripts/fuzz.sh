#!/usr/bin/env bash
# The long fuzz run: each fuzz target (property tests on stable Rust, proptest) for MINUTES
# minutes (default 10) with a fresh random seed per run, stopping at the first failure, which
# proptest prints shrunk to a minimal input. The CI-sized run of the same targets is part of
# `scripts/test.sh` (GLANCE_FUZZ_CASES unset: thousands of cases each).
#   scripts/fuzz.sh [MINUTES]        (GLANCE_FUZZ_SECONDS overrides, for a quick try)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
seconds="${GLANCE_FUZZ_SECONDS:-$(( ${1:-10} * 60 ))}"
# package, test target (--test NAME or --lib), name filter
targets=(
  "glance-codec --test fuzz_codec decoding"
  "glance-spec --test fuzz_tree a_tree"
  "glance-input --test fuzz_inputs mutated_images"
  "glance-input --test fuzz_inputs any_conversation"
  "drafter-svc --lib fuzz::"
  "verifier-svc --lib fuzz::"
)
failed=0
for target in "${targets[@]}"; do
  read -r package kind name filter <<<"$target"
  [[ "$kind" == "--lib" ]] && { filter="$name"; name=""; }
  cargo test --release -p "$package" "$kind" $name --no-run --quiet || exit 1
  echo "fuzz: $package $kind $name $filter for $seconds s"
  started=$SECONDS
  # Runs of a million cases each, until the time is up; `timeout` ends the last one.
  while (( SECONDS - started < seconds )); do
    left=$(( seconds - (SECONDS - started) ))
    GLANCE_FUZZ_CASES=1000000 timeout "$left" cargo test --release --quiet -p "$package" "$kind" $name -- "$filter" >/tmp/glance-fuzz.log 2>&1
    status=$?
    if (( status != 0 && status != 124 )); then
      tail -40 /tmp/glance-fuzz.log
      echo "fuzz: FAILED: $package $kind $name $filter"
      failed=1
      break
    fi
  done
done
exit $failed
