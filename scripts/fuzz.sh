#!/usr/bin/env bash
# The long fuzz run: each fuzz target (property tests on stable Rust, proptest) for MINUTES
# minutes (default 10), in batches of GLANCE_FUZZ_BATCH cases (default 10000) each with a fresh
# random seed, stopping at the first failure, which proptest prints shrunk to a minimal input.
# Prints the cases each target completed. The CI-sized run of the same targets is part of
# `scripts/test.sh` (GLANCE_FUZZ_CASES unset: thousands of cases each).
#   scripts/fuzz.sh [MINUTES]        (GLANCE_FUZZ_SECONDS overrides, for a quick try)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"
seconds="${GLANCE_FUZZ_SECONDS:-$(( ${1:-10} * 60 ))}"
batch="${GLANCE_FUZZ_BATCH:-10000}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# package, test target (--test NAME or --lib), name filter
targets=(
  "glance-codec --test fuzz_codec decoding"
  "glance-spec --test fuzz_tree a_tree"
  "glance-input --test fuzz_inputs mutated_images"
  "glance-input --test fuzz_inputs any_conversation"
  "glance-input --test fuzz_inputs resizes"
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
  batches=0
  # Batches until the time is up; `timeout` ends the last one, which is not counted.
  while (( SECONDS - started < seconds )); do
    left=$(( seconds - (SECONDS - started) ))
    GLANCE_FUZZ_CASES="$batch" timeout "$left" cargo test --release --quiet -p "$package" "$kind" $name -- "$filter" >"$log" 2>&1
    status=$?
    if (( status == 0 )) && ! grep -q "test result: ok. [1-9]" "$log"; then
      echo "fuzz: FAILED: no test of $package $kind $name matches $filter"
      failed=1
      break
    elif (( status == 0 )); then
      batches=$(( batches + 1 ))
    elif (( status != 124 )); then
      tail -40 "$log"
      echo "fuzz: FAILED: $package $kind $name $filter"
      failed=1
      break
    fi
  done
  echo "fuzz: $package ${name:-lib} $filter: $(( batches * batch )) cases per test in $(( SECONDS - started )) s"
done
exit $failed
