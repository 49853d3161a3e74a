#!/usr/bin/env bash
# Issue 23's sweep from one run on this tree (session 28), 1-256 streams, then issue 18's one-stream
# step table in four layouts, in the same machine session:
#   1. `CONCURRENCY=1,4,8,16,32,64,128,256 REQUESTS_PER_STREAM=2 bash tools/gpu_run.sh concurrency`:
#      llama-batched-bench on the shipped SmolLM2 file at the same levels, then our AR and default
#      tree (16 prompts x 128 tokens, every request checked against its single-stream AR run)
#      -> concurrency.{txt,json,md}, llama-batched.txt;
#   2. `ENGINE=0 CONFIGS=ar,tree:15:4 LAYOUTS="3proc colocated 3proc-mps colocated-mps" REPS=1
#      bash tools/gpu_run.sh step`: 8 prompts, one stream, three processes and the target in the
#      orchestrator's process, each without and with a machine-wide MPS daemon, and llama-bench
#      -> STEP.md, step.tgz.
# Carry: .stage/part-01e, .stage/sha256 after `LLAMA_TARGETS="llama-bench llama-batched-bench" bash
# tools/gpu_run.sh stage` calls carried .whl, .peer (llama.cpp.tar.gz, llamacpp-bench.sh) and the
# other parts.
set -u
CONCURRENCY=1,4,8,16,32,64,128,256 REQUESTS_PER_STREAM=2 bash tools/gpu_run.sh concurrency > "${OUT:-/tmp/out}/sweep.log" 2>&1
tail -40 "${OUT:-/tmp/out}/sweep.log"
[ "${STEP:-1}" = 1 ] && ENGINE=0 CONFIGS=ar,tree:15:4 LAYOUTS="3proc colocated 3proc-mps colocated-mps" REPS=1 \
  bash tools/gpu_run.sh step 2>&1 | tail -30
