# The same tree with the ring copies inside the captured steps (DFLASH_RING_IN_STEP=1, the default)
# and launched from the host around them (=0, the old path), alternating in one machine session
# (at 6c621cf also "draft" / "target": only that engine's copy inside; from the next commit on the
# switch is the drafter's gather alone, the target's store is always launched after its step):
# the shipped SmolLM2 pair, three processes, AR and the default tree at LEVELS (default 1,8), 16
# HumanEval prompts, 2 requests per stream, every request checked against its single-stream AR run.
# ORDER (default "1 0 1 0"). Run after the `gpu_run.sh stage` calls
# (benchmarks/gpu/concurrency/run25-staging/run.sh's header).
set -u
source tools/gpu_env.sh
smol=$(timed_start) || exit 1
k=0
for mode in ${ORDER:-1 0 1 0}; do
  k=$((k + 1))
  DFLASH_RING_IN_STEP=$mode python3 -m client.cli bench --device cuda --model "$smol" --prompts 16 --max-tokens 128 \
    --configs ar,tree:15:4 --concurrency "${LEVELS:-1,8}" --requests-per-stream 2 ${BENCH_ARGS:-} \
    --json "$OUT/switch-$mode-$k${TAG:-}.json" --out "$OUT/switch-$mode-$k${TAG:-}.txt" > /dev/null 2>&1
  echo "== in_step=$mode ($k)"; grep -E "^(spec|ar|tree)" "$OUT/switch-$mode-$k${TAG:-}.txt"
done
