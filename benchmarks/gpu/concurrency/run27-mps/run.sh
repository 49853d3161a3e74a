#!/usr/bin/env bash
# The three services with and without NVIDIA MPS (session 27): `dflash-grpc bench` of the shipped
# SmolLM2 pair (its single-stream rows, then AR and the default tree at LEVELS streams), alternating
# ORDER (default "off on on off"); "on" runs under an MPS control daemon (tools/gpu_run.sh
# mps_start: one GPU context for every process, so the drafter's and the target's kernels may run
# side by side instead of in time slices), "off" without. Every request is checked against its
# single-stream AR tokens. Carry: .stage/part-01e, .stage/sha256 after the `stage` calls carried
# .whl and the other parts (tools/gpu_run.sh); nothing of llama.cpp is needed (LLAMA=0 in effect).
set -u
source tools/gpu_env.sh
eval "$(sed -n '/^mps_start()/,/^}/p;/^mps_stop()/,/^}/p' tools/gpu_run.sh)"
smol=$(timed_start) || exit 1
LEVELS=${LEVELS:-1,8,32,64}
i=0
for mode in ${ORDER:-off on on off}; do
  i=$((i + 1))
  if [ "$mode" = on ]; then mps_start || { echo "MPS did not start"; continue; }; fi
  python3 -m client.cli bench --device cuda --model "$smol" --prompts 16 --max-tokens 128 --configs ar,tree:15:4 \
    --concurrency "$LEVELS" --requests-per-stream 2 --json "$OUT/conc-mps-$mode-$i.json" --out "$OUT/conc-mps-$mode-$i.txt" \
    > "$OUT/log-$mode-$i.txt" 2>&1
  echo "== $mode $i"; grep -E "^(ar|tree|spec)" "$OUT/conc-mps-$mode-$i.txt"
  [ "$mode" = on ] && mps_stop
  rm -f "$OUT/log-$mode-$i.txt"
done
