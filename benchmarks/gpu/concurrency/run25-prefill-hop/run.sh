# Prefill over the target's same-host hop (session 25): llama-batched-bench on the shipped SmolLM2
# file, then the three services with the orchestrator's Prefill over gRPC (DFLASH_PREFILL_HOP=0: a
# new request's prompt rows go through the orchestrator as bytes, as before) and over the hop (the
# default: they go through the feature ring), alternating, AR and the default tree at each level;
# every request checked against its single-stream AR tokens. ROUNDS (default 1) rounds of ORDER
# (default "grpc hop"; "measured": the hop and --draft-policy measured); LEVELS (default
# 1,8,32,64); LLAMA=0 skips llama-batched-bench; TAG names the files.
# Carry: .stage/part-01c, .stage/sha256 after `gpu_run.sh stage` calls carried .whl, .peer and the
# other parts.
set -u
source <(sed -n '/^OUT=/,/^mkdir -p "\$STAGE"/p' tools/gpu_run.sh)
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
eval "$(sed -n '/^install_wheels()/,/^}/p;/^llamacpp_build_bg()/,/^}/p;/^smollm()/,/^}/p;/^timed_start()/,/^}/p' tools/gpu_run.sh)"
smol=$(timed_start) || exit 1
LEVELS=${LEVELS:-1,8,32,64}
if [ "${LLAMA:-1}" = 1 ]; then
  $LL/build/bin/llama-batched-bench -m "$smol" -ngl 99 -fa on -c $(( 64 * 256 + 1024 )) -npp 128 -ntg 128 \
    -npl "$LEVELS" 2>&1 | grep -E "^\||llama_batched_bench" | tee "$OUT/llama-batched${TAG:-}.txt"
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  for mode in ${ORDER:-grpc hop}; do
    case $mode in grpc) hop=0 args="";; measured) hop=1 args="--draft-policy measured";; *) hop=1 args="";; esac
    DFLASH_PREFILL_HOP=$hop python3 -m client.cli bench --device cuda --model "$smol" --prompts 16 --max-tokens 128 \
      --configs ar,tree:15:4 --concurrency "$LEVELS" --requests-per-stream 2 --orchestrator-args="$args" ${BENCH_ARGS:-} \
      --log-level info --json "$OUT/conc-$mode-$r${TAG:-}.json" --out "$OUT/conc-$mode-$r${TAG:-}.txt" \
      > "$OUT/log-$mode-$r${TAG:-}.txt" 2>&1
    echo "== $mode $r"; tail -12 "$OUT/conc-$mode-$r${TAG:-}.txt"
  done
done
