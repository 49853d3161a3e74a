#!/usr/bin/env bash
# The target's same-host hop polling for its next Verify under a light load (session 28, issue 18
# goals 2 and 5): this tree ("new") against .peer/old.tar.gz ("old": a git archive of 8685e65,
# whose target hop blocks at once), alternating ORDER (default "old new new old"). Each run:
# `dflash-grpc bench` with 8 prompts, ar and the default tree at one stream (the step table), then
# the sweep at LEVELS (default 1,8,32,64) streams, 2 requests per stream. Modes: old, new, new-b8
# (this tree with DFLASH_HOP_SPIN_BATCH=8: the orchestrator also polls for ticks of up to 8
# requests), new-always (DFLASH_HOP_SPIN_US=3000: every hop polls, the target's at any load); a
# "-mps" suffix adds `--mps`. LLAMA=1 (default) runs llama-bench and llama-batched-bench on the same
# file afterwards (the build a `stage` call started). Outputs e2e-MODE-N.{json,txt} (one JSON per
# run: the step table and the sweep), llamacpp.jsonl, llama-batched.txt.
# Carry: .stage/part-01e, .stage/sha256 after `stage` calls carried .whl, .peer (llama.cpp.tar.gz,
# llamacpp-bench.sh, old.tar.gz) and the other parts.
set -u
source tools/gpu_env.sh
smol=$(timed_start) || exit 1
if [ ! -d /tmp/old ]; then
  mkdir -p /tmp/old && tar xzf .peer/old.tar.gz -C /tmp/old && mkdir -p /tmp/old/draft_service/data \
    && cp draft_service/data/*.gguf /tmp/old/draft_service/data/
fi
here=$PWD; i=${START:-0}
for mode in ${ORDER:-old new new old}; do
  i=$((i + 1))
  base=${mode%-mps}; flag=""; [ "$base" != "$mode" ] && flag=--mps
  dir=$here; extra=""
  case $base in
    old) dir=/tmp/old ;;
    new-b8) extra="DFLASH_HOP_SPIN_BATCH=8" ;;
    new-always) extra="DFLASH_HOP_SPIN_US=3000" ;;
  esac
  (cd "$dir" && env $extra PYTHONPATH=/tmp/site:$dir:$dir/proto python3 -m client.cli bench --device cuda --model "$smol" \
    --prompts 8 --max-tokens 128 --configs ar,tree:15:4 --concurrency "${LEVELS:-1,8,32,64}" --requests-per-stream 2 $flag \
    --json "$OUT/e2e-$mode-$i.json" --out "$OUT/e2e-$mode-$i.txt" > "$OUT/log.txt" 2>&1)
  echo "== $mode $i (rc $?)"; grep -E "^(ar|tree|spec) |rror" "$OUT/e2e-$mode-$i.txt" "$OUT/log.txt" | head -16
done
rm -f "$OUT/log.txt"
if [ "${LLAMA:-1}" = 1 ] && [ -x $LL/build/bin/llama-bench ]; then
  bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz "$smol" > "$OUT/llamacpp.jsonl"; grep -o '"avg_ts": [0-9.]*' "$OUT/llamacpp.jsonl"
  $LL/build/bin/llama-batched-bench -m "$smol" -ngl 99 -fa on -c $(( 64 * 256 + 1024 )) -npp 128 -ntg 128 \
    -npl "${LEVELS:-1,8,32,64}" 2>&1 | grep -E "^\||llama_batched_bench" | tee "$OUT/llama-batched.txt"
fi
