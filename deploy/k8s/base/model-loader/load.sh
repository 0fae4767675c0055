#!/bin/sh
# glance model loader: publishes one target model and one draft head on the shared model volume
# under versioned, immutable paths, so that a model update never changes files under live pods:
#
#   /models/<MODEL_NAME>@<MODEL_FINGERPRINT>/   the target (MODEL_FINGERPRINT: 16 hex digits,
#                                               what `verifier-svc --print-fingerprint` prints)
#   /models/<HEAD_NAME>@<HEAD_VERSION>/         the head (HEAD_VERSION: the first 16 hex digits of
#                                               the sha256 of its model.safetensors)
#
# Each directory is written under /models/.partial/, verified, made world-readable and then
# renamed into place (rename(2) on one file system is atomic): a pod sees either no directory or a
# complete, verified one. A directory that already exists is never touched again, so re-running
# the loader is cheap and safe. Old versions are left for the operator to delete once no pod uses
# them.
#
#   load.sh fetch     copy MODEL_SOURCE and HEAD_SOURCE into /models/.partial/ (runs in the
#                     fetch image: the model-bundle image, rclone, busybox, or a Python image
#                     for the Hugging Face hook; POSIX sh only)
#   load.sh publish   verify and rename into place (runs in the verifier-svc image, which has
#                     verifier-svc for the fingerprint, sha256sum and mv)
#
# Sources (MODEL_SOURCE, HEAD_SOURCE):
#   /dir or file:///dir        a directory in the fetch container: the model-bundle image's
#                              /bundle/{target,head}, or a PVC restored from a VolumeSnapshot
#   s3://bucket/prefix         rclone, credentials from the environment (AWS_* / IRSA)
#   gs://bucket/prefix         rclone, credentials from the environment (workload identity)
#   rclone:<remote>:<path>     any rclone remote, e.g. rclone::azureblob,env_auth=true:cont/dir
#   hf://org/repo[@revision]   the Hugging Face hook: `hf download` (or `huggingface-cli
#                              download`) where the cluster has network; HF_TOKEN from a Secret
set -eu

ROOT="${MODELS_ROOT:-/models}"
PARTIAL="$ROOT/.partial"

die() { echo "model-loader: $*" >&2; exit 1; }
say() { echo "model-loader: $*"; }

: "${MODEL_NAME:?}" "${MODEL_FINGERPRINT:?}" "${MODEL_SOURCE:?}"
: "${HEAD_NAME:?}" "${HEAD_VERSION:?}" "${HEAD_SOURCE:?}"
for v in "$MODEL_FINGERPRINT" "$HEAD_VERSION"; do
  case "$v" in
    *[!0-9a-f]*|"") die "'$v' is not 16 lowercase hex digits" ;;
  esac
  [ "${#v}" -eq 16 ] || die "'$v' is not 16 lowercase hex digits"
done

fetch_one() { # fetch_one <source> <dest>
  src="$1"; dest="$2"
  case "$src" in
    file://*) src="${src#file://}" ;;
  esac
  case "$src" in
    /*)
      [ -d "$src" ] || die "source directory $src does not exist in this container"
      cp -R "$src/." "$dest/" ;;
    s3://*) rclone copy --transfers 8 --checksum ":s3,env_auth=true:${src#s3://}" "$dest" ;;
    gs://*) rclone copy --transfers 8 --checksum ":gcs,env_auth=true:${src#gs://}" "$dest" ;;
    rclone:*) rclone copy --transfers 8 --checksum "${src#rclone:}" "$dest" ;;
    hf://*)
      repo="${src#hf://}"; rev=main
      case "$repo" in *@*) rev="${repo#*@}"; repo="${repo%@*}" ;; esac
      if command -v hf >/dev/null 2>&1; then
        hf download "$repo" --revision "$rev" --local-dir "$dest"
      else
        huggingface-cli download "$repo" --revision "$rev" --local-dir "$dest"
      fi
      rm -rf "$dest/.cache" ;;
    *) die "unsupported source '$src' (see the header of this script)" ;;
  esac
}

fetch() {
  mkdir -p "$PARTIAL"
  for kind in target head; do
    if [ "$kind" = target ]; then name="$MODEL_NAME@$MODEL_FINGERPRINT"; src="$MODEL_SOURCE"
    else name="$HEAD_NAME@$HEAD_VERSION"; src="$HEAD_SOURCE"; fi
    if [ -d "$ROOT/$name" ]; then
      say "$ROOT/$name is already published; nothing to fetch"
      continue
    fi
    # A pod killed mid-copy leaves a partial directory: start it over (the Job runs one pod at a
    # time, so nothing else writes here).
    rm -rf "$PARTIAL/$name"
    mkdir -p "$PARTIAL/$name"
    say "fetching $kind from $src into $PARTIAL/$name"
    fetch_one "$src" "$PARTIAL/$name"
  done
}

publish_one() { # publish_one <name@version> <actual version> <what>
  name="$1"; actual="$2"; what="$3"
  expected="${name##*@}"
  if [ "$actual" != "$expected" ]; then
    die "$what in $PARTIAL/$name has version $actual, but the glance-model ConfigMap says $expected: set it to $actual if this is the model you meant (then re-run the Job), or fix the source"
  fi
  # The services run as uid 10001 with a read-only mount: every file world-readable, nothing
  # writable by them.
  chmod -R a+rX,go-w "$PARTIAL/$name"
  # mv within one file system is rename(2): atomic. -T: never move into an existing directory.
  mv -T "$PARTIAL/$name" "$ROOT/$name"
  say "published $ROOT/$name"
}

publish() {
  target="$MODEL_NAME@$MODEL_FINGERPRINT"
  head="$HEAD_NAME@$HEAD_VERSION"
  if [ ! -d "$ROOT/$target" ]; then
    [ -f "$PARTIAL/$target/config.json" ] || die "$PARTIAL/$target has no config.json: the fetch step copied nothing usable"
    fp="$(verifier-svc --print-fingerprint --model "$PARTIAL/$target")" || die "verifier-svc could not read $PARTIAL/$target"
    publish_one "$target" "$fp" "the target model"
  else
    say "$ROOT/$target is already published"
  fi
  if [ ! -d "$ROOT/$head" ]; then
    [ -f "$PARTIAL/$head/model.safetensors" ] || die "$PARTIAL/$head has no model.safetensors"
    v="$(sha256sum "$PARTIAL/$head/model.safetensors" | cut -c1-16)"
    publish_one "$head" "$v" "the draft head"
  else
    say "$ROOT/$head is already published"
  fi
  say "in use: GLANCE_MODEL=$ROOT/$target GLANCE_DRAFTER_HEAD=$ROOT/$head"
  say "published versions on the volume (delete old ones once no pod uses them):"
  ls -1 "$ROOT" | grep -F '@' | sed 's/^/  /' || true
}

case "${1:-}" in
  fetch) fetch ;;
  publish) publish ;;
  *) die "usage: load.sh fetch|publish" ;;
esac
