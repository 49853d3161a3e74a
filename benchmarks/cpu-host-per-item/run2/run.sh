#!/bin/bash
# Before / after of tools/host_per_item.py, interleaved, 3 repeats, on one machine:
#   BASE: a checkout of main at 2522c1a (`git archive 2522c1a | tar -x -C $BASE`) with this
#         branch's tools/host_per_item.py copied into it;
#   this checkout with its defaults (the adaptive hold on), and with --stream-hold-max-ms 0 (off).
# usage (from the repo root): bash benchmarks/cpu-host-per-item/run2/run.sh BASE OUT
set -e
BASE=$1; OUT=$2; PY=${PY:-python}; HERE=$PWD
ARGS="--streams 1,16,64 --modes spec,ar --tokens 256 --threads"
mkdir -p "$OUT"
for rep in 1 2 3; do
  (cd "$BASE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py $ARGS --json "$OUT/base-$rep.jsonl" > "$OUT/base-$rep.txt" 2>&1)
  (cd "$HERE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py $ARGS --json "$OUT/new-$rep.jsonl" > "$OUT/new-$rep.txt" 2>&1)
  (cd "$HERE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py $ARGS --stream-hold-max-ms 0 \
     --json "$OUT/nohold-$rep.jsonl" > "$OUT/nohold-$rep.txt" 2>&1)
done
PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --summary "before=$OUT/base-*.jsonl" "after=$OUT/new-*.jsonl" \
  "after, hold off=$OUT/nohold-*.jsonl" > "$OUT/summary.md"
