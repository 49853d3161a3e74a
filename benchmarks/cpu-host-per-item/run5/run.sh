#!/bin/bash
# Before / after of tools/host_per_item.py, interleaved, REPS (3) repeats, on one machine:
#   BASE: a checkout of the commit before (`git archive 8d08d42 | tar -x -C $BASE`) with this
#         branch's tools/host_per_item.py copied into it; this checkout after.
# usage (from the repo root): PY=/work/main/.venv/bin/python bash benchmarks/cpu-host-per-item/run5/run.sh BASE OUT
set -e
BASE=$1; OUT=$2; PY=${PY:-python}; HERE=$PWD; REPS=${REPS:-3}
mkdir -p "$OUT"
run() {   # $1: label, $2: checkout, $3: repeat
  (cd "$2" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --streams 1,16,64 --modes spec,ar --tokens 512 \
     --threads --json "$OUT/$1-$3.jsonl" > "$OUT/$1-$3.txt" 2>&1)
}
for rep in $(seq 1 "$REPS"); do
  if [ $((rep % 2)) = 1 ]; then run base "$BASE" "$rep"; run new "$HERE" "$rep"
  else run new "$HERE" "$rep"; run base "$BASE" "$rep"; fi
done
PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --summary "before=$OUT/base-*.jsonl" "after=$OUT/new-*.jsonl" > "$OUT/summary.md"
