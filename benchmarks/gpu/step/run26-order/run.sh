# Does the configuration run first after AR pay one-time work? (session 26) The shipped SmolLM2 pair,
# three processes, 8 HumanEval prompts x 128 tokens, one stream: the default tree and tree:16:4 in
# both orders, without (--warmup 0, as every step table before session 26) and with one untimed
# request per configuration (--warmup 1, bench's default from then on). VARIANTS (default below):
# "ORDER:WARMUP" pairs, ORDER a = ar,tree:15:4,tree:16:4, b = ar,tree:16:4,tree:15:4. Run after the
# `gpu_run.sh stage` calls (benchmarks/gpu/concurrency/run25-staging/run.sh's header).
set -u
source tools/gpu_env.sh
smol=$(timed_start) || exit 1
k=0
for v in ${VARIANTS:-a:0 b:0 a:1 b:1 b:0 a:0}; do
  k=$((k + 1)); order=${v%:*} warm=${v#*:}
  if [ "$order" = a ]; then cfgs=ar,tree:15:4,tree:16:4; else cfgs=ar,tree:16:4,tree:15:4; fi
  python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs "$cfgs" \
    --warmup "$warm" --json "$OUT/order-$k-$order-w$warm.json" --out "$OUT/order-$k-$order-w$warm.txt" > /dev/null 2>&1
  echo "== order $order warmup $warm"; grep -E "^(ar|tree)" "$OUT/order-$k-$order-w$warm.txt" | cut -c1-60
done
