set -u
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
nvidia-smi -L > $OUT/device.txt
M=/tmp/models; mkdir -p $M /tmp/base
python3 -c "
from fixtures.tiny_models import write_tiny_llama
write_tiny_llama('$M/smol-shape.gguf', vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, tied=True, std=0.02)"
tar xzf .stage/base.tgz -C /tmp/base
for n in 1 2; do
  python3 tools/verify_commit_bench.py --model $M/smol-shape.gguf --reps 3 --label after-$n > $OUT/after-$n.txt 2>&1; grep -E "^  (w1|tree16)" $OUT/after-$n.txt
  (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base:/tmp/base/proto python3 tools/verify_commit_bench.py --model $M/smol-shape.gguf --reps 3 --label before-$n > $OUT/before-$n.txt 2>&1); grep -E "^  (w1|tree16)" $OUT/before-$n.txt
done
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_sampler_kernels.py tests/test_batched_engine_gpu.py -k "accept or qwen35_streams or reused_slot" > $OUT/gpu-tests.txt 2>&1; tail -2 $OUT/gpu-tests.txt
cd $OUT && tar czf acc.tgz *.txt && rm -f after-*.txt before-*.txt
