#!/usr/bin/env bash
# Session 27: the captured eager appends (draft_service.batched._AppendRunner) against the tree
# before them (.peer/old.tar.gz: `git archive` of c7e6f73), tools/engine_host_probe.py alternating.
# The device tool, carrying .whl and .peer/old.tar.gz:  bash benchmarks/gpu/step/run27-engine-host/ab.sh
set -uo pipefail
source tools/gpu_env.sh
install_wheels || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
rm -rf /tmp/old && mkdir -p /tmp/old && tar -xzf .peer/old.tar.gz -C /tmp/old
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_draft_batched.py 2>&1 | tail -5 > "$OUT/gpu-tests.txt"
cat "$OUT/gpu-tests.txt"
PROBE=$PWD/tools/engine_host_probe.py
for tag in ${ORDER:-new old new old}; do
  dir=$PWD; [ "$tag" = old ] && dir=/tmp/old
  echo "== $tag"
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir:$dir/proto python3 "$PROBE" --sessions ${SESSIONS:-8,64} --turnover ${TURNOVER:-0,37} \
     --ticks ${TICKS:-150} --no-profile --out "$OUT/$tag-$RANDOM") 2>&1 | grep -v -i warn
done | tee "$OUT/ab.txt"
