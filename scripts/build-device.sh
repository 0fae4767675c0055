#!/usr/bin/env bash
# The device build: the release binaries linked against libtorch 2.11 (tch/torch-sys 0.24, the
# release built for the GPU machine's PyTorch 2.11.0+cu130), stripped and packed with the tiny
# reference fixtures and the device check into `build-device/` (git-ignored), ready to `carry`.
#
# The normal build stays on tch 0.26 / torch 2.13 untouched: this script builds a copy of the
# working tree (target/device-src) whose only change is the two pins and its lock file, in the
# shared target directory (the registry crates are compiled once for both builds), with the
# second venv .venv-device (torch==2.11.0) as its libtorch. The uplifted binaries the copy's
# build leaves in target/release are the normal build's again afterwards (cargo re-links them).
#
# Nothing on the device machine is fetched: the binaries find libtorch*.so through
# LD_LIBRARY_PATH, which build-device/run.sh sets from that machine's torch.
#   scripts/build-device.sh            build and pack (prints the folder's size; fails over the limit)
#   scripts/build-device.sh --prepare  only the venv (CI runs this in the background, early)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$GLANCE_ROOT"

DEVICE_TORCH=2.11.0
DEVICE_TCH=0.24.0
DEVICE_VENV="$GLANCE_ROOT/.venv-device"
SRC="$GLANCE_ROOT/target/device-src"
OUT_DIR="$GLANCE_ROOT/build-device"
# What travels is the working tree plus the carried folder, 64 MiB in all.
LIMIT_BYTES=$((64 << 20))
# The binaries the device check runs: both services, the two benchmarks, and the test suites it
# runs on the device (cargo names test executables with a hash: found below by their prefix).
BINS=(verifier-svc drafter-svc bench_round bench_toyworld)
TESTS=(model_parity text_model_parity spec_lossless device_crossings)

if ! "$DEVICE_VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$DEVICE_TORCH')" 2>/dev/null; then
  echo "build-device: installing torch==$DEVICE_TORCH into .venv-device (about 2.6 GB, a few minutes)"
  python3 -m venv "$DEVICE_VENV"
  "$DEVICE_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "torch==$DEVICE_TORCH"
fi
[ "${1:-}" = --prepare ] && exit 0
scripts/setup.sh >/dev/null # the fixtures, and the normal build to restore at the end

echo "build-device: copying the working tree to target/device-src"
mkdir -p "$SRC"
# Only what the build reads (sources, manifests, protos, build scripts), mtimes kept: cargo
# rebuilds only what changed since the last device build.
git ls-files -z --cached --others --exclude-standard \
  | grep -zv '^models/\|^docs/\|^deploy/\|^data/' \
  | tar --null -T - -cf - | tar -xf - -C "$SRC"
sed -i -e "s/^tch = \"=0.26.0\"/tch = \"=$DEVICE_TCH\"/" -e "s/^torch-sys = \"=0.26.0\"/torch-sys = \"=$DEVICE_TCH\"/" \
  "$SRC/Cargo.toml"
grep -q "^tch = \"=$DEVICE_TCH\"" "$SRC/Cargo.toml" || { echo "build-device: the tch pin was not found in Cargo.toml" >&2; exit 1; }

echo "build-device: building against torch $DEVICE_TORCH (tch $DEVICE_TCH)"
(
  cd "$SRC"
  export VIRTUAL_ENV="$DEVICE_VENV" PATH="$DEVICE_VENV/bin:$PATH" CARGO_TARGET_DIR="$GLANCE_ROOT/target"
  cargo update --quiet -p tch --precise "$DEVICE_TCH"
  cargo update --quiet -p torch-sys --precise "$DEVICE_TCH"
  cargo build --release --quiet -p verifier-svc -p drafter-svc -p glance-tests --bins ${GLANCE_CARGO_TIMINGS:+--timings}
  # The test executables, listed by cargo (their names carry a hash).
  cargo test --release --quiet -p glance-tests --no-run --message-format=json ${GLANCE_CARGO_TIMINGS:+--timings} \
    $(printf -- '--test %s ' "${TESTS[@]}") 2>/dev/null \
    | "$DEVICE_VENV/bin/python" -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])' > "$GLANCE_ROOT/target/device-tests.txt"
  for bin in "${BINS[@]}"; do cp "$GLANCE_ROOT/target/release/$bin" "$GLANCE_ROOT/target/device-$bin"; done
)

echo "build-device: packing build-device/"
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR/bin"
for bin in "${BINS[@]}"; do
  strip -o "$OUT_DIR/bin/$bin" "target/device-$bin"
  rm "target/device-$bin"
done
while read -r name exe; do strip -o "$OUT_DIR/bin/$name" "$exe"; done < target/device-tests.txt
for name in "${TESTS[@]}"; do [ -x "$OUT_DIR/bin/$name" ] || { echo "build-device: no test executable $name" >&2; exit 1; }; done
# Binaries travel as one solid archive (run.sh unpacks it): they share most of their code (tch,
# the model library), so a dictionary larger than any one binary packs all eight into about what
# two take packed one by one (9.9 MB against 25.7 MB).
tar -cf - -C "$OUT_DIR/bin" . | xz -T1 --lzma2=preset=9,dict=192MiB > "$OUT_DIR/bin.tar.xz"
rm -r "$OUT_DIR/bin"
# The tiny reference models and dumps the parity and losslessness suites read (about 10 MB
# packed): not the torchvision parity cases (device-check.sh checks the PIL ones; theirs differ only
# in host-side preprocessing, and they would not fit), nor what no device step reads.
tar -cJf "$OUT_DIR/fixtures.tar.xz" -C "$GLANCE_FIXTURES" --exclude .stamp --exclude '*-dflash' --exclude '*-eagle3' \
  --exclude 'tv_*' --exclude sampling --exclude logprobs.json .
cp scripts/device-check.sh "$OUT_DIR/run.sh"
chmod +x "$OUT_DIR/run.sh"
echo "torch $DEVICE_TORCH, tch $DEVICE_TCH, built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes')" \
  > "$OUT_DIR/BUILD"

# The normal binaries back in target/release (fresh units are re-linked, not rebuilt).
cargo build --release --quiet --workspace --bins

tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
folder_bytes=$(du -sb "$OUT_DIR" | cut -f1)
total=$((tree_bytes + folder_bytes))
awk -v f="$folder_bytes" -v t="$total" 'BEGIN { printf "build-device: build-device/ is %.1f MiB; with the working tree %.1f MiB of the 64 MiB that travel\n", f / 1048576, t / 1048576 }'
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "build-device: over the 64 MiB limit" >&2
  exit 1
fi
