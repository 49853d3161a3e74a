#!/usr/bin/env bash
# `dflash-grpc bench --mps` (client.launcher.private_mps: a private MPS control daemon for the three
# services) against the same bench without it, alternating ORDER (default "off on on off"): the
# single-stream step table (8 prompts, ar and the two 15/16-node trees) and LEVELS streams.
# LLAMA=1: llama-bench on the same file afterwards (needs the build a `stage` call started from a
# carried .peer/llama.cpp.tar.gz and .peer/llamacpp-bench.sh).
# Carry: .stage/part-01e, .stage/sha256 after `stage` calls carried .whl and the other parts.
set -u
source tools/gpu_env.sh
smol=$(timed_start) || exit 1
i=0
for mode in ${ORDER:-off on on off}; do
  i=$((i + 1))
  flag=""; [ "$mode" = on ] && flag=--mps
  python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs ar,tree:15:4,tree:16:4 \
    --concurrency "${LEVELS:-1,8}" --requests-per-stream 2 $flag --json "$OUT/cli-$mode-$i.json" --out "$OUT/cli-$mode-$i.txt" \
    > "$OUT/log-$mode-$i.txt" 2>&1
  echo "== $mode $i (rc $?)"; grep -E "^(ar|tree|spec)|error" "$OUT/cli-$mode-$i.txt" "$OUT/log-$mode-$i.txt" | head -20
done
if [ "${LLAMA:-0}" = 1 ] && [ -x $LL/build/bin/llama-bench ]; then
  bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz "$smol" > "$OUT/llamacpp.jsonl"; grep -o '"avg_ts": [0-9.]*' "$OUT/llamacpp.jsonl"
fi
