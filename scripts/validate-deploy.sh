#!/usr/bin/env bash
# Validates the deployment files without Docker or a cluster (neither exists on the project's
# machines), offline once the tools are installed, in seconds:
#   - renders deploy/k8s/base and every deploy/k8s/overlays/* with kustomize and validates every
#     object strictly against the Kubernetes schemas (kubernetes-validate; versions below), the CRD
#     kinds (ServiceMonitor, PrometheusRule, ScaledObject, Certificate, Issuer) against the strict
#     subsets in deploy/validate/*.schema.json, plus cross-object checks (probes, drain and
#     autoscaling arithmetic, versioned model paths and fingerprints, TLS wiring, Secrets, alerts);
#   - validates docker-compose.yml and deploy/compose/gpu.yml against the Compose specification's
#     JSON schema (as vendored by the pinned check-jsonschema), plus wiring, default model paths
#     (also those the READMEs name), health checks and drain checks;
#   - parses deploy/docker/*.Dockerfile with the BuildKit parser and checks them, and the CUDA pins
#     of deploy/docker/constraints.txt;
#   - checks that deploy/grafana/glance-dashboard.json queries only metrics the services export.
# deploy/README.md ("Validation") lists every check.
# Tools are pinned in deploy/validate/requirements.txt and installed from PyPI into .deploy-venv/
# (never the project's .venv); the renderer is `kubectl kustomize` (kubectl ships on the project's
# machines) or a standalone `kustomize`. Exits non-zero on any failure.
#   GLANCE_K8S_VERSIONS   Kubernetes versions to validate against (default: "1.31.0 1.37.0")
#   GLANCE_DEPLOY_VENV    tool virtualenv (default: .deploy-venv)
#   GLANCE_DEPLOY_STRICT_ENV=1  fail, not warn, on GLANCE_* variables no clap flag declares
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${GLANCE_DEPLOY_VENV:-$ROOT/.deploy-venv}"
K8S_VERSIONS="${GLANCE_K8S_VERSIONS:-1.31.0 1.37.0}"
REQ=deploy/validate/requirements.txt

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "validate-deploy: FAIL: needs Python >= 3.11 (python3 is $(python3 -V 2>&1))" >&2; exit 1; }

# Tools: reinstalled only when the pins change (a second run takes seconds).
stamp="$VENV/.requirements.sha256"
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "validate-deploy: installing the pinned tools ($REQ) into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-input -r "$REQ"
  echo "$want" > "$stamp"
fi

# Renderer: kubectl's built-in kustomize, else a standalone kustomize.
if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
  renderer="kubectl kustomize"
  echo "validate-deploy: $(kubectl version --client 2>/dev/null | tr '\n' ' ')"
elif command -v kustomize >/dev/null 2>&1; then
  renderer="kustomize build"
  echo "validate-deploy: kustomize $(kustomize version 2>/dev/null)"
else
  echo "validate-deploy: FAIL: no kustomize renderer on PATH (kubectl >= 1.27 with its built-in" \
       "kustomize, or kustomize >= 5)" >&2
  exit 1
fi

args=(--root "$ROOT" --renderer "$renderer" --out "$VENV/rendered")
for v in $K8S_VERSIONS; do args+=(--k8s-version "$v"); done
if [ "${GLANCE_DEPLOY_STRICT_ENV:-0}" = 1 ]; then args+=(--strict-env); fi
exec "$VENV/bin/python" deploy/validate/validate.py "${args[@]}"
