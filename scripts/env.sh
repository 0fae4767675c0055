# Sourced by the other scripts: the project's virtualenv (libtorch + the Python reference) and the
# variables the tch build needs. Keep these stable: torch-sys rebuilds when they change.
GLANCE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export GLANCE_ROOT
export VIRTUAL_ENV="$GLANCE_ROOT/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export GLANCE_FIXTURES="${GLANCE_FIXTURES:-$GLANCE_ROOT/tests/fixtures}"
