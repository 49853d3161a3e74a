set -u
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
M=/tmp/models; mkdir -p $M
[ -f $M/smol-shape.gguf ] || python3 -c "
from fixtures.tiny_models import write_tiny_llama
write_tiny_llama('$M/smol-shape.gguf', vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, tied=True, std=0.02)"
python3 tools/step_kernels.py --model $M/smol-shape.gguf --graphs --out $OUT/step-kernels-graphs.txt > $OUT/step-kernels-graphs.log 2>&1; tail -3 $OUT/step-kernels-graphs.log
grep "^##" $OUT/step-kernels-graphs.txt
