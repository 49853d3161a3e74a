#!/usr/bin/env bash
# Session 29: the orchestrator's own part of a tick (its scheduler loop less the Propose and Verify
# exchanges), wall clock against its thread's CPU time, now in SchedulerStatus and the report's
# last table; with the default streaming and with --stream-interval-ms 20 (fewer, larger Generate
# messages: less work for the asyncio server's thread, which shares the GIL with the scheduler),
# alternating ORDER (default "default interval20 interval20 default"). Each run: `dflash-grpc
# bench`, 8 prompts, the sweep at LEVELS (default 8,64,128), 2 requests per stream -> bench-MODE-N.
# {json,txt,md}. Carry: .stage/part-01a, .stage/sha256 after `stage` calls carried .whl and the
# other parts.
set -u
source tools/gpu_env.sh
smol=$(smollm) || exit 1
i=${START:-0}
for mode in ${ORDER:-default interval20 interval20 default}; do
  i=$((i + 1)); oargs=""; [ "$mode" = interval20 ] && oargs="--stream-interval-ms 20"
  python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs ar,tree:15:4 \
    --concurrency "${LEVELS:-8,64,128}" --requests-per-stream 2 --orchestrator-args="$oargs" \
    --json "$OUT/bench-$mode-$i.json" --out "$OUT/bench-$mode-$i.txt" > "$OUT/bench-$mode-$i.log" 2>&1
  echo "== $mode $i (rc $?)"; grep -E "^(ar|spec) " "$OUT/bench-$mode-$i.txt"
  python3 -m bench.concurrency_report "$OUT/bench-$mode-$i.json" > "$OUT/bench-$mode-$i.md"
  grep -E "^\| (ar|spec) \|" "$OUT/bench-$mode-$i.md" | tail -6
done
