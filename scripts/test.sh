#!/usr/bin/env bash
# Install with the test and train extras and run the CPU test suite (GPU tests are skipped without CUDA).
# Extra arguments go to pytest.
set -euo pipefail
DFLASH_EXTRAS=test,train source "$(dirname "$0")/install.sh"
exec python -m pytest -q "$@"
