#!/usr/bin/env bash
# The device check: the one prepared script that runs on the GPU machine (about 8 minutes), from
# the repository root, with build-device/ (scripts/build-device.sh) carried. Copied there as
# build-device/run.sh:
#
#   build-device/run.sh                         on cuda:0, with that machine's torch (/opt/torch/.venv)
#   build-device/run.sh --device cpu --python .venv-device/bin/python --peer-python .venv/bin/python --quick
#                                               the CPU fallback here: the same binaries and checks
#                                               (torch 2.11's libraries from .venv-device; the
#                                               transformers peer from the project's venv)
#
# Steps, each with a time limit, its log and JSON in results.tar.gz under $OUT (default
# build-device/out; re-packed after every step, so a run cut short still brings back what it did),
# beside device-check.log and summary.json (which steps passed, how long each took):
#   parity     both VLM families (the six PIL-processor cases) and both text families against the
#              committed reference dumps, f32 within 1e-4 and bf16/f16 close (model_parity,
#              text_model_parity)
#   crossings  the whole pipeline in one process on the device (verifier rounds, wire codec, the
#              toy head's session): identical to greedy, host syncs per round as counted
#   lossless   the losslessness suite (random head, oracle, slow oracle, garbage drafter, prompt
#              lookup, auto) with verifier and drafter on the device in f32: identical to greedy
#   round      bench_round on the 2B- and 8B-shaped random layers in bf16: verify(n)/step for n up
#              to 64, the draft pass / step, and transformers on the same shapes (the peer)
#   toyworld   bench_toyworld on the device in f32, and in bf16 (the services' default on CUDA):
#              the identical-output rate, and the target's top-2 margin at every divergence
set -uo pipefail

DEVICE=cuda:0
PYTHON=/opt/torch/.venv/bin/python
PEER_PYTHON=
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --peer-python) PEER_PYTHON="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "device-check: unknown argument $1" >&2; exit 2 ;;
  esac
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$HERE/out}"
# The device tool brings back at most 8 files from $OUT: the steps write here, packed after each.
RESULTS="${TMPDIR:-/tmp}/glance-device-check"
rm -rf "$RESULTS" && mkdir -p "$OUT" "$RESULTS"
exec > >(tee "$OUT/device-check.log") 2>&1

# The binaries find libtorch*.so (and through it CUDA) in the machine's own torch: nothing fetched.
TORCH_LIB="$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')" \
  || { echo "device-check: no torch in $PYTHON" >&2; exit 1; }
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The peers' python (bench_round runs `python`): the machine's own unless told otherwise.
PEER_PYTHON="$(cd "$(dirname "${PEER_PYTHON:-$PYTHON}")" && pwd)"
export PATH="$PEER_PYTHON:$PATH"
BIN="${TMPDIR:-/tmp}/glance-device-bin"
rm -rf "$BIN" && mkdir -p "$BIN"
tar -xJf "$HERE/bin.tar.xz" -C "$BIN"
chmod +x "$BIN"/*
FIXTURES="${TMPDIR:-/tmp}/glance-device-fixtures"
rm -rf "$FIXTURES" && mkdir -p "$FIXTURES" && tar -xJf "$HERE/fixtures.tar.xz" -C "$FIXTURES"

echo "device-check: $(cat "$HERE/BUILD"); device $DEVICE; torch $("$PYTHON" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# The tests and the services they start all run on the device, and the tests compute their
# references there too. In f32 (the services would take bf16 on CUDA by default), except where a
# step says otherwise.
export GLANCE_FIXTURES="$FIXTURES" GLANCE_REQUIRE_FIXTURES=1 GLANCE_TEST_DEVICE="$DEVICE"
# The VLM parity cases through transformers' PIL processor; the torchvision ones differ only in
# their host-side preprocessing and stay home (build-device.sh leaves them out of what travels).
export GLANCE_PARITY_CASES=text_only,one_image,two_images,resized,multi_turn,alpha
export GLANCE_DEVICE="$DEVICE" GLANCE_DRAFTER_DEVICE="$DEVICE" GLANCE_DTYPE=f32 GLANCE_DRAFTER_DTYPE=f32
export RUST_BACKTRACE=1 OMP_NUM_THREADS=1

declare -a SUMMARY=()
# step NAME LIMIT_S COMMAND...: runs it with a time limit, its output in NAME.log of the results.
step() {
  local name="$1" limit="$2"
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local started=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - started))
  grep -E "max\|Δ\||identical|test result|speed-up|geomean|verify\(|panicked|error" "$RESULTS/$name.log" | head -40
  echo "=== $name: exit $rc after ${took}s"
  SUMMARY+=("{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $took}")
  write_summary
}

write_summary() {
  (IFS=,; echo "{\"device\": \"$DEVICE\", \"build\": \"$(cat "$HERE/BUILD")\", \"steps\": [${SUMMARY[*]}]}") > "$OUT/summary.json"
  tar -czf "$OUT/results.tar.gz" -C "$RESULTS" .
}

# Sized to end in about 7 minutes on the GPU machine (the CPU fallback's --quick: about 2 here).
if [ "$QUICK" = 1 ]; then
  LOSSLESS_PROMPTS=4
  ROUND_ARGS=(--shapes toy --rows 1,4,16 --repeats 1 --hop-rounds 20)
  TOY_F32=(--prompts 2 --budgets 15 --text-tokens 32)
  TOY_BF16=(--prompts 1 --budgets 15 --text-tokens 0)
else
  LOSSLESS_PROMPTS=8
  ROUND_ARGS=(--shapes 2b,8b --rows 1,4,8,16,32,64 --hop-rounds 200)
  TOY_F32=(--prompts 20 --budgets 15,31)
  TOY_BF16=(--prompts 5 --budgets 15,31 --text-tokens 0)
fi

step parity 150 sh -c "'$BIN/model_parity' --nocapture --test-threads 1 && '$BIN/text_model_parity' --nocapture --test-threads 1"
step crossings 60 "$BIN/device_crossings" --nocapture
step lossless 200 env GLANCE_LOSSLESS_PROMPTS="$LOSSLESS_PROMPTS" "$BIN/spec_lossless" --nocapture --test-threads 1
step round 120 "$BIN/bench_round" --device "$DEVICE" --dtypes bf16 "${ROUND_ARGS[@]}" \
  --json "$RESULTS/bench_round.json" --markdown "$RESULTS/bench_round.md"
toyworld() {
  local dtype="$1" limit="$2"
  shift 2
  step "toyworld-$dtype" "$limit" "$BIN/bench_toyworld" --dtype "$dtype" "$@" --json "$RESULTS/bench_toyworld-$dtype.json" \
    --markdown "$RESULTS/bench_toyworld-$dtype.md" --plot "$RESULTS/bench_toyworld-$dtype-law.png"
}
toyworld f32 200 "${TOY_F32[@]}"
toyworld bf16 90 "${TOY_BF16[@]}"

cat "$OUT/summary.json"
failed=$(grep -o '"exit": [1-9][0-9]*' "$OUT/summary.json" | wc -l)
echo "device-check: $failed step(s) failed"
[ "$failed" = 0 ]
