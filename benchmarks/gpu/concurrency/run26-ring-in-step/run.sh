# The feature ring's copies inside the captured steps (session 26, kernels.ring.gather_rows / store_rows_meta): llama-batched-bench
# on the shipped SmolLM2 file, then the three services of this tree ("new") and of .peer/old.tar.gz
# ("old": a git archive of 3290d33, the ring read and store launched from the host each step; the drafter
# GGUF is taken from here), alternating, AR and the default tree at each level; every request checked
# against its single-stream AR tokens. ROUNDS (default 1) rounds of ORDER (default "old new");
# LEVELS (default 1,8,32,64); LLAMA=0 skips llama-batched-bench; TAG names the files.
# Carry: .stage/part-01c, .stage/sha256 after `LLAMA_TARGETS="llama-bench llama-batched-bench"
# bash tools/gpu_run.sh stage` calls carried .whl, .peer (llama.cpp.tar.gz, llamacpp-bench.sh,
# old.tar.gz) and the other parts.
set -u
source <(sed -n '/^OUT=/,/^mkdir -p "\$STAGE"/p' tools/gpu_run.sh)
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
eval "$(sed -n '/^install_wheels()/,/^}/p;/^llamacpp_build_bg()/,/^}/p;/^smollm()/,/^}/p;/^timed_start()/,/^}/p' tools/gpu_run.sh)"
smol=$(timed_start) || exit 1
LEVELS=${LEVELS:-1,8,32,64}
if [ ! -d /tmp/old ]; then
  mkdir -p /tmp/old && tar xzf .peer/old.tar.gz -C /tmp/old && mkdir -p /tmp/old/draft_service/data \
    && cp draft_service/data/*.gguf /tmp/old/draft_service/data/
fi
if [ "${LLAMA:-1}" = 1 ]; then
  $LL/build/bin/llama-batched-bench -m "$smol" -ngl 99 -fa on -c $(( 64 * 256 + 1024 )) -npp 128 -ntg 128 \
    -npl "$LEVELS" 2>&1 | grep -E "^\||llama_batched_bench" | tee "$OUT/llama-batched${TAG:-}.txt"
fi
here=$PWD
for r in $(seq 1 "${ROUNDS:-1}"); do
  for mode in ${ORDER:-old new}; do
    if [ "$mode" = old ]; then dir=/tmp/old; else dir=$here; fi
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir:$dir/proto python3 -m client.cli bench --device cuda --model "$smol" \
      --prompts 16 --max-tokens 128 --configs ar,tree:15:4 --concurrency "$LEVELS" --requests-per-stream 2 ${BENCH_ARGS:-} \
      --json "$OUT/conc-$mode-$r${TAG:-}.json" --out "$OUT/conc-$mode-$r${TAG:-}.txt" > "$OUT/log-$mode-$r${TAG:-}.txt" 2>&1)
    echo "== $mode $r"; tail -12 "$OUT/conc-$mode-$r${TAG:-}.txt"
    rm -f "$OUT/log-$mode-$r${TAG:-}.txt"
  done
done
