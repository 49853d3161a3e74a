#!/usr/bin/env bash
# The main job: install, start target + draft + orchestrator on loopback, run one HumanEval prompt
# (default HumanEval/0) through them, print the completion and its acceptance statistics.
# Extra arguments go to `dflash-grpc demo` (e.g. --problem HumanEval/12 --max-tokens 200 --compare-ar).
set -euo pipefail
source "$(dirname "$0")/install.sh"
exec dflash-grpc demo "$@"
