set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
cd /work 2>/dev/null; cd - >/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto
nvidia-smi -L | tee $OUT/device.txt
mkdir -p /tmp/models
python3 - <<'PY'
from fixtures.tiny_models import write_tiny_llama
write_tiny_llama("/tmp/models/llama-smollm2-shape.gguf", vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536,
                 tied=True, std=0.02, name="llama with SmolLM2-135M shapes, vocab 626")
PY
export DFLASH_MODEL=/tmp/models/llama-smollm2-shape.gguf
python3 -m pytest -q -p no:cacheprovider --timeout 600 tests/test_kernels.py -k pool_attention 2>&1 | tail -3 | tee $OUT/tests.txt
python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 600 tests/test_batched_engine_gpu.py tests/test_qwen3.py 2>&1 | tail -6 | tee -a $OUT/tests.txt
mkdir -p /tmp/old && tar xzf .peer/old.tar.gz -C /tmp/old
for rep in 1 2; do
  python3 -m bench.gpu engine --model $DFLASH_MODEL --name new --reps 3 --max-context 4096 --no-drafter --out $OUT/new-$rep.json 2>&1 | grep -i "ar \|verify\|capture" | head -5
  (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old:/tmp/old/proto python3 -m bench.gpu engine --model $DFLASH_MODEL --name old --reps 3 --max-context 4096 --no-drafter --out $OUT/old-$rep.json 2>&1 | grep -i "ar \|verify\|capture" | head -5)
done
python3 - <<'PY'
import json, os
O = os.environ["OUT"]
for name in ("new-1", "old-1", "new-2", "old-2"):
    d = json.load(open(f"{O}/{name}.json"))
    vw = d["verify_width"]
    print(name, "capture_s %.1f" % d["capture_s"], "graphs", d["graph_captures"], "ar dev %.3f" % d["ar_step_device_ms"]["median"],
          "ar tok/s %.0f" % d["ar_tok_s"]["median"],
          " ".join(f"v{w}:{vw[w][k]['device_ms']['median']:.3f}" for w in vw for k in vw[w] if k == "tree" or w == "1"))
PY
