#!/usr/bin/env bash
# Session 29: who holds the orchestrator's GIL under load. py-spy (carried in .whl) samples, in
# every process of one `dflash-grpc bench` at LEVEL (default 64) streams (the default tree only,
# REQUESTS_PER_STREAM, default 3), only the thread holding the GIL (--gil), with thread ids (-t):
# -> gil.txt.gz (raw stacks) and gil-orchestrator.md (tools/pyspy_report.py of the whole run and
# under the scheduler's loop, the asyncio server's loop and the prefill threads).
# Carry: .stage/part-01a, .stage/sha256 after `stage` calls carried .whl and the other parts.
set -u
source tools/gpu_env.sh
smol=$(smollm) || exit 1
PS=/tmp/site/bin/py-spy
$PS record -r ${RATE:-500} --gil -t -f raw --subprocesses --nonblocking -o "$OUT/gil.txt" -- \
  python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs tree:15:4 \
  --concurrency "${LEVEL:-64}" --requests-per-stream "${REQUESTS_PER_STREAM:-3}" --json "$OUT/gil.json" > "$OUT/gil.log" 2>&1
grep -E "^(spec|ar) " "$OUT/gil.log"
{ python3 tools/pyspy_report.py "$OUT/gil.txt" --top 30
  for u in Scheduler._run run_forever HopFuture _prefill hop_unary Generate; do
    echo; echo "### under $u"; python3 tools/pyspy_report.py "$OUT/gil.txt" --top 15 --under $u; done; } > "$OUT/gil-orchestrator.md" 2>&1
gzip -f "$OUT/gil.txt"
grep -A12 "^## orchestrator" "$OUT/gil-orchestrator.md" | head -40
