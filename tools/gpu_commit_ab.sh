#!/usr/bin/env bash
# Issue 18 goal 3 on the GPU machine: the verify step and its commit on a 9B-shaped Qwen3.5, this
# tree against an older commit (`.stage/base.tgz`: `git archive` of its code), back-to-back calls:
#
#   bash tools/gpu_commit_ab.sh prep     # wheels, the synthetic 9B (bf16; tokenizer from .stage/tok.gguf,
#                                        # tools/tokenizer_gguf.py) in the background, GPU tests of the
#                                        # GDN / conv kernels and the hybrid engine -> $OUT/gpu-tests.txt
#   bash tools/gpu_commit_ab.sh ab       # tools/verify_commit_bench.py, twice in turn: after, after with
#                                        # DFLASH_GDN_TREE_WALK=replay, before (REPS each, default 3)
#                                        # -> $OUT/{after,replay,before}-N.{txt,json}
#   bash tools/gpu_commit_ab.sh all      # prep, then ab (one call)
#   MODEL=FILE bash tools/gpu_commit_ab.sh ab   # the same A/B on another GGUF (no synth)
#   bash tools/gpu_commit_ab.sh smoltests       # after `gpu_run.sh stage` x4: the SmolLM2 file joined, then the
#                                               # GPU tests of the kernels and both engines -> $OUT/gpu-tests.txt
#
# Carry: .whl (gguf wheel at least), .stage/base.tgz, .stage/tok.gguf. The machine keeps /tmp while warm.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; M=/tmp/models; mkdir -p "$M" "$OUT"
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl || exit 1
F=$M/q35-9b-bf16.gguf
prep() {
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt"
    cp .stage/tok.gguf $M/tok.gguf
    if [ ! -e /tmp/synth.started ]; then
      touch /tmp/synth.started
      setsid nohup bash -c "python3 -m fixtures.synth --arch qwen35 --preset 9b --dtype bf16 --vocab-size 0 \
        --vocab-from $M/tok.gguf --out $F.part --no-progress --threads 16 > /tmp/synth.log 2>&1 && mv $F.part $F" \
        > /dev/null 2>&1 < /dev/null &
    fi
    timeout 480 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_conv_kernels.py \
      tests/test_batched_engine_gpu.py -k "gated_delta or gdn or conv or qwen35_streams or reused_slot or walks" \
      > "$OUT/gpu-tests.txt" 2>&1
    tail -3 "$OUT/gpu-tests.txt"; cat /tmp/synth.log; ls -la $M
}
smoltests() {
    local smol=$M/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -s $smol ] || { cat /tmp/stage/part-* > $smol.tmp && [ "$(sha256sum $smol.tmp | cut -d' ' -f1)" = "$(cut -d' ' -f1 .stage/sha256)" ] \
      && mv $smol.tmp $smol; } || { echo "SmolLM2 parts missing"; exit 1; }
    nvidia-smi -L > "$OUT/device.txt"
    DFLASH_MODEL=$smol timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_linear_kernels.py tests/test_kernels.py \
      tests/test_batched_engine_gpu.py tests/test_draft_batched.py tests/test_drafter_fused.py tests/test_qwen3.py \
      > "$OUT/gpu-tests.txt" 2>&1
    tail -3 "$OUT/gpu-tests.txt"
}
ab() {
    F=${MODEL:-$F}
    for i in $(seq 1 60); do [ -e $F ] && break; sleep 5; done
    [ -e $F ] || { echo "no $F"; cat /tmp/synth.log; exit 1; }
    rm -rf /tmp/base && mkdir -p /tmp/base && tar -xzf .stage/base.tgz -C /tmp/base
    cp tools/verify_commit_bench.py /tmp/base/tools/
    for n in 1 2; do
      python3 tools/verify_commit_bench.py --model $F --reps "${REPS:-3}" --label "after-$n" \
        --json "$OUT/after-$n.json" > "$OUT/after-$n.txt" 2>&1; tail -6 "$OUT/after-$n.txt"
      [ -z "${MODEL:-}" ] && DFLASH_GDN_TREE_WALK=replay python3 tools/verify_commit_bench.py --model $F --reps "${REPS:-3}" \
        --label "replay-$n" --json "$OUT/replay-$n.json" > "$OUT/replay-$n.txt" 2>&1; tail -6 "$OUT/replay-$n.txt"
      (cd /tmp/base && PYTHONPATH=/tmp/site:$PWD:$PWD/proto python3 tools/verify_commit_bench.py --model $F \
        --reps "${REPS:-3}" --label "before-$n" --json "$OUT/before-$n.json" > "$OUT/before-$n.txt" 2>&1)
      tail -6 "$OUT/before-$n.txt"
    done
}
# everything in one archive (the device tool returns only so many files)
pack() { (cd "$OUT" && tar czf commit-ab.tgz --exclude commit-ab.tgz ./*.txt ./*.json 2>/dev/null && rm -f ./*.json ./replay-*.txt ./before-*.txt); }
trap pack EXIT
case "${1:-}" in
  prep) prep ;;
  ab) ab ;;
  smoltests) smoltests ;;
  all) prep; ab ;;
  *) echo "usage: $0 prep|ab|all|smoltests" >&2; exit 2 ;;
esac
