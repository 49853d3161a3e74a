#!/usr/bin/env bash
# Session 29: why speculation is 0.62-0.92x our AR at 128 streams (../run29-admit), on this tree.
# 1. RUNS (default 2) benches at LEVELS (default 64,128): 8 prompts, ar and the default tree, 2
#    requests per stream; each level's JSON row now carries the scheduler's counters over it
#    (recomputed / given-up drafter sessions, items without a drafter slot, ...); the services'
#    stderr (warnings) -> bench-N.log.
# 2. PYSPY=1: py-spy (carried in .whl) over one more bench at 128 streams, every process, the
#    orchestrator's stacks summarised by tools/pyspy_report.py -> pyspy-128.md.
# Carry: .stage/part-01e, .stage/sha256 after `stage` calls carried .whl and the other parts.
set -u
source tools/gpu_env.sh
smol=$(smollm) || exit 1
for i in $(seq 1 "${RUNS:-2}"); do
  python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs ar,tree:15:4 \
    --concurrency "${LEVELS:-64,128}" --requests-per-stream 2 --json "$OUT/bench-$i.json" --out "$OUT/bench-$i.txt" \
    > "$OUT/bench-$i.log" 2>&1
  echo "== run $i (rc $?)"; grep -E "^(ar|spec) " "$OUT/bench-$i.txt"
  python3 -m bench.concurrency_report "$OUT/bench-$i.json" 2>/dev/null | grep -A12 "What the scheduler counted"
done
if [ "${PYSPY:-1}" = 1 ]; then
  PS=/tmp/site/bin/py-spy
  $PS record -r ${RATE:-250} -f raw --subprocesses --nonblocking -o "$OUT/pyspy-128.txt" -- \
    python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs tree:15:4 \
    --concurrency 128 --requests-per-stream 2 --json "$OUT/pyspy-128.json" > "$OUT/pyspy-128.log" 2>&1
  { python3 tools/pyspy_report.py "$OUT/pyspy-128.txt" --top 30
    for u in Scheduler._tick Scheduler._run _propose_trees propose_batch verify_batch Generate; do
      echo; echo "### under $u"; python3 tools/pyspy_report.py "$OUT/pyspy-128.txt" --top 25 --under $u; done; } > "$OUT/pyspy-128.md"
  gzip -f "$OUT/pyspy-128.txt"
  grep -A3 "^### under Scheduler._run" "$OUT/pyspy-128.md" | head
fi
