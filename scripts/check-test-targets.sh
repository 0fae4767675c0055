#!/usr/bin/env bash
# Fails when a target built without a test harness (`test = false` in its Cargo.toml: the binaries,
# glance-telemetry, glance-toyworld's library) holds a test: `cargo test` would skip it silently.
# A library's files are those under its directory but the crate's binaries; a binary's are its
# file (and a folder of the same name beside it, if it has one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Prints "lib|bin PATH" for each [lib] / [[bin]] of a manifest that says `test = false`.
untested_targets() {
  awk '
    function flush() {
      if (kind != "" && untested) print kind, (path != "" ? path : (kind == "lib" ? "src/lib.rs" : "src/main.rs"))
      kind = ""; path = ""; untested = 0
    }
    /^\[/ { flush(); if ($0 == "[lib]") kind = "lib"; else if ($0 == "[[bin]]") kind = "bin" }
    kind != "" && /^path *=/ { path = $0; sub(/^path *= *"/, "", path); sub(/".*/, "", path) }
    kind != "" && /^test *= *false/ { untested = 1 }
    END { flush() }
  ' "$1"
}

# Every binary root of a crate: its [[bin]] paths, src/main.rs and src/bin/.
binary_roots() {
  local crate="$1"
  awk '/^\[/ { bin = ($0 == "[[bin]]") } bin && /^path *=/ { p = $0; sub(/^path *= *"/, "", p); sub(/".*/, "", p); print p }' \
    "$crate/Cargo.toml"
  echo src/main.rs
  echo src/bin
}

has_tests() {
  grep -lE '^[[:space:]]*#\[(tokio::)?test|#\[cfg\(test\)\]' "$@" 2>/dev/null || true
}

failed=0
checked=0
while read -r manifest; do
  crate="$(dirname "$manifest")"
  while read -r kind path; do
    checked=$((checked + 1))
    if [ "$kind" = lib ]; then
      mapfile -t skip < <(binary_roots "$crate" | sed "s|^|$crate/|")
      mapfile -t files < <(find "$crate/$(dirname "$path")" -name '*.rs' | grep -vxF -f <(printf '%s\n' "${skip[@]}") |
        grep -vE "^$crate/src/bin/" || true)
    else
      mapfile -t files < <(find "$crate/$path" "$crate/${path%.rs}" -name '*.rs' 2>/dev/null || true)
    fi
    found="$(has_tests "${files[@]}")"
    if [ -n "$found" ]; then
      echo "test targets: $crate's $kind $path has test = false, but tests in: $(echo "$found" | tr '\n' ' ')" >&2
      failed=1
    fi
  done < <(untested_targets "$manifest")
done < <(git ls-files '*Cargo.toml' | grep -v '^Cargo.toml$')
[ "$failed" = 0 ] && echo "test targets: the $checked targets without a test harness hold no tests"
exit "$failed"
