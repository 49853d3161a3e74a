#!/usr/bin/env bash
# One device call: the GPU tests and the GPU benchmarks, results under $OUT.
# Run through the device tool from the repo root, carrying .whl (gguf, fla-core wheels):
#   bash tools/gpu_checks.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'grpc', grpc.__version__)" | tee -a "$OUT/device.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qwen35_gpu.py 2>&1 | tee "$OUT/gpu-tests.txt"
python3 -m target_service.bench_rollback --device cuda --out "$OUT/rollback-cuda.txt" 2>&1 | tail -3
