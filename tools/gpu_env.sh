# Sourced (from the repo root) by the run scripts under benchmarks/gpu/: tools/gpu_run.sh's
# variables (OUT, STAGE, M, LL) and helpers (install_wheels, llamacpp_build_bg, smollm,
# timed_start), and the PYTHONPATH of the carried wheels. A run script then takes the SmolLM2 file
# with `smol=$(timed_start) || exit 1` (which also waits for a llama.cpp build that `stage` started).
source <(sed -n '/^OUT=/,/^mkdir -p "\$STAGE"/p' tools/gpu_run.sh)
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
eval "$(sed -n '/^install_wheels()/,/^}/p;/^llamacpp_build_bg()/,/^}/p;/^smollm()/,/^}/p;/^timed_start()/,/^}/p' tools/gpu_run.sh)"
