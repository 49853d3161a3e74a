#!/bin/bash
# Interleaved repeats of tools/host_per_item.py on one checkout (BASE), default settings and with
# the two settings that bound the orchestrator's figure (README.md), 3 repeats each:
#   PY=/work/main/.venv/bin/python bash benchmarks/cpu-host-per-item/run4/run.sh BASE OUT
# BASE: `git archive 8d08d42 | tar -x -C BASE`, with this branch's tools/host_per_item.py copied in.
set -e
BASE=$1; OUT=$2; PY=${PY:-python}; REPS=${REPS:-3}
mkdir -p "$OUT"
declare -A SET=([default]="" [hist0]="--scheduler-set history_bytes=0" [share01]="--scheduler-set stream_host_share=0.1"
                [both]="--scheduler-set history_bytes=0 --scheduler-set stream_host_share=0.1")
for rep in $(seq 1 "$REPS"); do
  for cfg in default hist0 share01 both; do
    (cd "$BASE" && PYTHONPATH=$PWD:$PWD/proto $PY tools/host_per_item.py --streams 1,16,64 --modes ar,spec --tokens 512 \
        --threads ${SET[$cfg]} --json "$OUT/$cfg-$rep.jsonl" > "$OUT/$cfg-$rep.txt" 2>&1)
  done
done
