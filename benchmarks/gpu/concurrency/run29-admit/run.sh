#!/usr/bin/env bash
# Session 29: session 28's unmeasured changes on a GPU, this tree ("new") against .peer/old.tar.gz
# ("old": `git archive 0f978ea`, before the admission rule where no tree fits (dbf34bc, f637278) and
# the target's host cuts in verify_batch (b0ba146, afa2906, 819aa30, bff0345)), alternating ORDER.
# Each run is run28-target-spin/run.sh's: `dflash-grpc bench` with 8 prompts at one stream (ar and
# the default tree), then the sweep at LEVELS (here default 1,8,64,128,256), 2 requests per stream.
# Then (LLAMA=1) llama-bench and llama-batched-bench on the same file, its context sized for the
# largest level. Outputs e2e-MODE-N.{json,txt}, llamacpp.jsonl, llama-batched.txt.
# Carry: .stage/part-01e, .stage/sha256 after `LLAMA_TARGETS="llama-bench llama-batched-bench"
# bash tools/gpu_run.sh stage` calls carried .whl, .peer (llama.cpp.tar.gz, llamacpp-bench.sh,
# old.tar.gz) and the other parts.
set -u
export LEVELS=${LEVELS:-1,8,64,128,256}
LLAMA=0 bash benchmarks/gpu/step/run28-target-spin/run.sh
source tools/gpu_env.sh
if [ "${LLAMA:-1}" = 1 ] && [ -x $LL/build/bin/llama-bench ]; then
  smol=$(smollm) || exit 1
  top=$(echo "$LEVELS" | tr , '\n' | sort -n | tail -1)
  bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz "$smol" > "$OUT/llamacpp.jsonl"; grep -o '"avg_ts": [0-9.]*' "$OUT/llamacpp.jsonl"
  $LL/build/bin/llama-batched-bench -m "$smol" -ngl 99 -fa on -c $(( top * 256 + 1024 )) -npp 128 -ntg 128 \
    -npl "$LEVELS" 2>&1 | grep -E "^\||llama_batched_bench" | tee "$OUT/llama-batched.txt"
fi
