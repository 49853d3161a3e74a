#!/bin/bash
# Before / after of tools/host_per_item.py, interleaved, 3 repeats, on one machine:
#   BASE: a checkout of main at 2522c1a (`git archive 2522c1a | tar -x -C $BASE`) with this
#         branch's tools/host_per_item.py copied into it;
#   this checkout with its defaults (the adaptive hold on), and with --stream-hold-max-ms 0 (off).
# Each repeat runs the three in another order (a slot's position in the sequence moved its figures
# on this shared machine).
# usage (from the repo root): bash benchmarks/cpu-host-per-item/run2/run.sh BASE OUT
set -e
BASE=$1; OUT=$2; PY=${PY:-python}; HERE=$PWD
ARGS="--streams 1,16,64 --modes spec,ar --tokens 256 --threads"
mkdir -p "$OUT"
one() {   # one -> OUT/NAME-REP.{jsonl,txt}
  case $1 in
    base) (cd "$BASE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py $ARGS --json "$OUT/base-$2.jsonl" > "$OUT/base-$2.txt" 2>&1) ;;
    new) (cd "$HERE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py $ARGS --json "$OUT/new-$2.jsonl" > "$OUT/new-$2.txt" 2>&1) ;;
    nohold) (cd "$HERE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py $ARGS --stream-hold-max-ms 0 \
               --json "$OUT/nohold-$2.jsonl" > "$OUT/nohold-$2.txt" 2>&1) ;;
  esac
}
for name in base new nohold; do one $name 1; done
for name in new nohold base; do one $name 2; done
for name in nohold base new; do one $name 3; done
PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --summary "before=$OUT/base-*.jsonl" "after=$OUT/new-*.jsonl" \
  "after, hold off=$OUT/nohold-*.jsonl" > "$OUT/summary.md"
