# A/B of this tree against .stage/base.tgz (git archive of 1ea43fb), SmolLM2-shaped synthetic target,
# then the GPU tests and a tiny end-to-end run. Carry: .whl, .stage/base.tgz.
set -u
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
nvidia-smi -L > $OUT/device.txt
M=/tmp/models; mkdir -p $M /tmp/base
[ -f $M/smol-shape.gguf ] || python3 -c "
from fixtures.tiny_models import write_tiny_llama
write_tiny_llama('$M/smol-shape.gguf', vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, tied=True, std=0.02)"
tar xzf .stage/base.tgz -C /tmp/base
HERE=$PWD
for n in 1 2; do
  python3 tools/verify_commit_bench.py --model $M/smol-shape.gguf --reps 3 --label after-$n > $OUT/after-$n.txt 2>&1; grep -E "^  (w1|tree16)" $OUT/after-$n.txt
  (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base:/tmp/base/proto python3 tools/verify_commit_bench.py --model $M/smol-shape.gguf --reps 3 --label before-$n > $OUT/before-$n.txt 2>&1); grep -E "^  (w1|tree16)" $OUT/before-$n.txt
  python3 tools/step_kernels.py --model $M/smol-shape.gguf --graphs --out $OUT/kernels-after-$n.txt > /dev/null 2>&1; grep "^#\|^##" $OUT/kernels-after-$n.txt | tail -6
  (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base:/tmp/base/proto python3 $HERE/tools/step_kernels.py --model $M/smol-shape.gguf --graphs --out $OUT/kernels-before-$n.txt > /dev/null 2>&1); grep "^#\|^##" $OUT/kernels-before-$n.txt | tail -6
done
export DFLASH_MODEL=$M/smol-shape.gguf
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_sampler_kernels.py tests/test_pdl.py \
  tests/test_drafter_fused.py tests/test_drafter_window.py > $OUT/gpu-tests.txt 2>&1; tail -3 $OUT/gpu-tests.txt
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_batched_engine_gpu.py tests/test_draft_batched.py \
  tests/test_qwen35_gpu.py tests/test_qwen3.py >> $OUT/gpu-tests.txt 2>&1; tail -8 $OUT/gpu-tests.txt
cd $OUT && tar czf ab.tgz *.txt && rm -f after-*.txt before-*.txt kernels-*.txt
