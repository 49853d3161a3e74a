set -u
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
M=/tmp/models; mkdir -p $M
[ -f $M/smol-shape.gguf ] || python3 -c "
from fixtures.tiny_models import write_tiny_llama
write_tiny_llama('$M/smol-shape.gguf', vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, tied=True, std=0.02)"
for t in new; do   # (this tree; its first run on a fresh machine: which kernels compile after start-up)
  export TRITON_CACHE_DIR=/tmp/tc-$t; rm -rf $TRITON_CACHE_DIR
  date +%s.%N > $OUT/t0-$t
  timeout 400 python3 -m client.cli bench --device cuda --model $M/smol-shape.gguf --prompts 4 --max-tokens 64 --configs ar,tree:15:4 \
    --json $OUT/lazy-$t.json --out $OUT/lazy-$t.txt > $OUT/lazy-$t.log 2>&1
  tail -4 $OUT/lazy-$t.txt
  python3 - "$TRITON_CACHE_DIR" "$(cat $OUT/t0-$t)" > $OUT/compiles-$t.txt <<'PY'
import os, sys, glob
root, t0 = sys.argv[1], float(sys.argv[2])
rows = []
for f in glob.glob(os.path.join(root, "*", "*.json")):
    if os.path.basename(f).startswith("__grp__"):
        continue
    rows.append((os.path.getmtime(f) - t0, os.path.basename(f)[:-5]))
rows.sort()
prev = None
for t, n in rows:
    gap = "" if prev is None else f"  (+{t - prev:.1f})"
    print(f"{t:8.1f} s  {n}{gap}")
    prev = t
PY
  tail -40 $OUT/compiles-$t.txt
done
