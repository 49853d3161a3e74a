#!/usr/bin/env bash
# Session 29: the services' heap frozen after start-up (serving.freeze_heap) against not
# (DFLASH_GC_FREEZE=0), this tree, alternating ORDER (default "unfrozen frozen frozen unfrozen").
# Each run: `dflash-grpc bench`, 8 prompts, ar and the default tree at one stream, then the sweep at
# LEVELS (default 1,8,64,128), 2 requests per stream, with DFLASH_LOG_LEVEL=info so every service
# logs each garbage collection of 10 ms or more (logger dflash_grpc.gc). Outputs bench-MODE-N.{json,
# txt,log}; the JSON's rows carry the scheduler's counters per level (deadline misses, recomputed
# drafter sessions). Carry: .stage/part-01a, .stage/sha256 after `stage` calls carried .whl and
# the other parts.
set -u
source tools/gpu_env.sh
smol=$(smollm) || exit 1
i=${START:-0}
for mode in ${ORDER:-unfrozen frozen frozen unfrozen}; do
  i=$((i + 1)); freeze=1; [ "$mode" = unfrozen ] && freeze=0
  DFLASH_GC_FREEZE=$freeze DFLASH_LOG_LEVEL=info python3 -m client.cli bench --device cuda --model "$smol" \
    --prompts 8 --max-tokens 128 --configs ar,tree:15:4 --concurrency "${LEVELS:-1,8,64,128}" --requests-per-stream 2 \
    --json "$OUT/bench-$mode-$i.json" --out "$OUT/bench-$mode-$i.txt" > "$OUT/bench-$mode-$i.log" 2>&1
  echo "== $mode $i (rc $?)"; grep -E "^(ar|spec|tree)" "$OUT/bench-$mode-$i.txt" | grep -v "^ar   *1\.0"
  python3 - "$OUT/bench-$mode-$i.log" "$OUT/bench-$mode-$i.json" <<'PY'
import collections, json, sys
pauses = collections.defaultdict(list)
for line in open(sys.argv[1], errors="replace"):
    if '"dflash_grpc.gc"' in line:
        try:
            r = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        pauses[(r.get("service"), r.get("generation"))].append(r.get("ms", 0))
for (svc, gen), ms in sorted(pauses.items(), key=str):
    print(f"gc {svc} gen{gen}: {len(ms)} pauses >= 10 ms, longest {max(ms):.1f} ms")
d = json.load(open(sys.argv[2]))
for mode, rows in d["concurrency"]["modes"].items():
    for r in rows:
        c = r.get("scheduler") or {}
        print(f"{mode} {r['concurrency']}: misses {c.get('draft_deadline_misses')}, recomputed {c.get('refeatures')}")
PY
done
