#!/usr/bin/env bash
# Train the default drafter (SmolLM2-135M-Instruct) on the GPU machine and evaluate it, in device
# calls made back to back (the machine stays warm 30 s). The target GGUF (98 MB) travels in three
# parts under .model1..3 (split -b 33000000 -d), the prompts file in runs/ (python -m
# training.data export ... --num-code 9000), the gguf wheel in .whl:
#   call 1, carry .model1:           bash tools/train_drafter_gpu.sh stage
#   call 2, carry .model2:           bash tools/train_drafter_gpu.sh stage
#   call 3, carry .model3 .whl runs: bash tools/train_drafter_gpu.sh train    generate the data, train (part 1)
#   call 4, carry .whl runs:         bash tools/train_drafter_gpu.sh finish   resume, train (part 2), evaluate
# or, after the stage calls, fine-tune the shipped drafter on greedy + sampled responses, then evaluate:
#   carry .model3 .whl runs:         bash tools/train_drafter_gpu.sh finetune
#   carry .whl runs:                 bash tools/train_drafter_gpu.sh evaluate
# Every GPU of the machine is used (torchrun, one rank per GPU). Results under $OUT.
set -uo pipefail
STAGE=/tmp/stage RUN=/tmp/run MODEL=/tmp/model/s.gguf
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$STAGE"
TRAIN1_MIN=${TRAIN1_MIN:-9.0} TRAIN2_MIN=${TRAIN2_MIN:-7.0} SCHEDULE_MIN=${SCHEDULE_MIN:-10}
case "${1:-}" in
stage)
    cp .model*/* "$STAGE"/ && ls -la "$STAGE"; exit 0 ;;
train|finish|finetune|evaluate) ;;
*) echo "usage: $0 stage|train|finish|finetune|evaluate" >&2; exit 2 ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ ! -f "$MODEL" ]; then
    [ -d .model3 ] && cp .model3/* "$STAGE"/
    mkdir -p /tmp/model && cat "$STAGE"/smol.part0* > "$MODEL" && (cd /tmp/model && sha256sum -c "$STAGE"/sha256.txt) || exit 1
fi
NGPU=$(nvidia-smi -L | wc -l)
if [ "$1" = train ] || [ "$1" = finetune ]; then nvidia-smi -L | tee "$OUT/device.txt"; else nvidia-smi -L; fi  # at most 8 files come back
COMMON=(--target "$MODEL" --prompts-file runs/prompts.json --out-dir "$RUN"
        --num-prompts 8735 --num-code-prompts 8876 --max-new-tokens 256 --gen-batch-size 1536 --gen-batch-tokens 600000 --steps 100000
        --layers 3 --seq-per-step 16 --batch-anchors 64 --group-seqs 8 --lr 1e-3 --schedule-train-min "$SCHEDULE_MIN"
        --eval-source unused --eval-prompts 64 --eval-every 1500 --keep-best --checkpoint-every 1000
        --final-reserve-s 75 --no-progress --log-every 250)
RUNNER=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU")
FILTER="gguf_writer\|^W1\|OMP_NUM_THREADS\|^\*\*\*\|Converting\|Loading weights"
EVAL=(python3 -m training.evaluate --drafter "$RUN/drafter.gguf" --target "$MODEL" --prompts-file runs/prompts.json
      --num-prompts 0 --max-new-tokens 256 --modes chain,tree --tree-budget 31 --tree-top-k 4 --method both --engine-prompts 6)
evaluate() {  # HumanEval and held-out ShareGPT on two GPUs at once
    CUDA_VISIBLE_DEVICES=0 "${EVAL[@]}" --datasets humaneval --out "$OUT/eval-humaneval.json" > /tmp/eval-humaneval.txt 2>&1 &
    CUDA_VISIBLE_DEVICES=$((NGPU > 1 ? 1 : 0)) "${EVAL[@]}" --datasets sharegpt --out "$OUT/eval-sharegpt.json" > /tmp/eval-sharegpt.txt 2>&1 &
    wait
    grep -hv "Convert\|Loading" /tmp/eval-humaneval.txt /tmp/eval-sharegpt.txt | tee "$OUT/eval.txt"
}
case "$1" in
train)
    "${RUNNER[@]}" -m training.train "${COMMON[@]}" --time-budget-min "$TRAIN1_MIN" --gen-budget-frac 0.5 2>&1 \
        | grep -v "$FILTER" | tee "$OUT/train1-log.txt"
    cp "$RUN/summary.json" "$OUT/train1-summary.json" ;;
finish)
    "${RUNNER[@]}" -m training.train "${COMMON[@]}" --resume --time-budget-min "$TRAIN2_MIN" 2>&1 \
        | grep -v "$FILTER" | tee "$OUT/train2-log.txt"
    cp "$RUN/summary.json" "$OUT/train2-summary.json"
    evaluate ;;
finetune)
    FT_MIN=${FT_MIN:-9.2}
    "${RUNNER[@]}" -m training.train "${COMMON[@]}" --init-from draft_service/data/smollm2-135m-instruct-dflash.gguf \
        --sampled-responses 1 --sample-temperature 0.8 --lr 5e-4 --schedule-train-min 3.5 --eval-every 500 \
        --time-budget-min "$FT_MIN" --gen-budget-frac 0.45 2>&1 | grep -v "$FILTER" | tee "$OUT/finetune-log.txt"
    cp "$RUN/summary.json" "$OUT/finetune-summary.json" ;;
evaluate)
    evaluate ;;
esac
split -b 15000000 -d "$RUN/drafter.gguf" "$OUT/drafter.gguf.part"
sha256sum "$RUN/drafter.gguf" | tee "$OUT/drafter.sha256"
