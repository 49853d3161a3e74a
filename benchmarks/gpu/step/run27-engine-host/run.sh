#!/usr/bin/env bash
# Session 27: the engines' host time per item under load, in one process (tools/engine_host_probe.py).
# The device tool, carrying .whl:  bash benchmarks/gpu/step/run27-engine-host/run.sh
set -uo pipefail
source tools/gpu_env.sh
install_wheels || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
python3 tools/engine_host_probe.py --sessions ${SESSIONS:-1,8,64} --turnover ${TURNOVER:-0,37} --ticks ${TICKS:-150} \
  --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/engine-host.txt"
