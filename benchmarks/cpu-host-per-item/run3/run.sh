#!/bin/bash
# Before / after of tools/host_per_item.py, interleaved, REPS repeats each (default 6), on one machine:
#   BASE: a checkout of main at 3b8c567 (`git archive 3b8c567 | tar -x -C $BASE`; its
#         tools/host_per_item.py is this branch's, unchanged);
#   this checkout (the adaptive hold on in both: the defaults).
# The order alternates per repeat (base new, new base, ...): a slot's position moved its figures on
# this shared machine.
# usage (from the repo root): [REPS=6] bash benchmarks/cpu-host-per-item/run3/run.sh BASE OUT
set -e
BASE=$1; OUT=$2; PY=${PY:-python}; HERE=$PWD
ARGS="--streams 1,16,64 --modes spec,ar --tokens 256 --threads"
mkdir -p "$OUT"
one() {   # one base|new REP -> OUT/NAME-REP.{jsonl,txt}
  case $1 in
    base) (cd "$BASE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py $ARGS --json "$OUT/base-$2.jsonl" > "$OUT/base-$2.txt" 2>&1) ;;
    new) (cd "$HERE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py $ARGS --json "$OUT/new-$2.jsonl" > "$OUT/new-$2.txt" 2>&1) ;;
  esac
}
for rep in $(seq 1 "${REPS:-6}"); do
  if [ $((rep % 2)) = 1 ]; then one base $rep; one new $rep; else one new $rep; one base $rep; fi
done
PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --summary "before=$OUT/base-*.jsonl" "after=$OUT/new-*.jsonl" > "$OUT/summary.md"
