#!/bin/bash
# Before / after of tools/host_per_item.py, interleaved, 3 repeats, on one machine:
#   BASE: a checkout of the commit before (here 048ac76, `git archive 048ac76 | tar -x -C $BASE`)
#         with this branch's tools/host_per_item.py copied into it;
#   this checkout, with the default settings and with --stream-interval-ms 25.
# usage (from the repo root): bash benchmarks/cpu-host-per-item/run.sh BASE OUT
set -e
BASE=$1; OUT=$2; PY=${PY:-python}; HERE=$PWD
mkdir -p "$OUT"
for rep in 1 2 3; do
  (cd "$BASE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --tokens 512 --json "$OUT/base-$rep.jsonl" > "$OUT/base-$rep.txt" 2>&1)
  (cd "$HERE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --tokens 512 --json "$OUT/new-$rep.jsonl" > "$OUT/new-$rep.txt" 2>&1)
  (cd "$HERE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --tokens 512 --stream-interval-ms 25 --json "$OUT/new25-$rep.jsonl" > "$OUT/new25-$rep.txt" 2>&1)
done
PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --summary "before=$OUT/base-*.jsonl" "after=$OUT/new-*.jsonl" \
  "after, --stream-interval-ms 25=$OUT/new25-*.jsonl" > "$OUT/summary.md"
