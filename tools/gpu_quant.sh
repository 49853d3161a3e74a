#!/usr/bin/env bash
# Issue 19 on the GPU (quantized GGUF weights kept as blocks): tests, then our engine and llama.cpp on
# the same quantized files -> $OUT/QUANT.md (bench/quant_report.py). Run from the repo root, through
# the device tool, after the SmolLM2 parts are staged (`bash tools/gpu_run.sh stage` calls, as for
# `checks`); carry .whl, .peer (llama.cpp.tar.gz, llamacpp-bench.sh) and .stage/sha256.
#
#   bash tools/gpu_quant.sh              # (also: bash tools/gpu_run.sh quant)
#
# Phases, in order (elapsed seconds per phase in $OUT/phases.txt):
#   prep    (background, niced, once per machine): llama.cpp built with llama-bench and llama-quantize;
#           the synthetic Qwen3.5 bf16 files of $MODELS (fixtures.synth, SmolLM2's tokenizer via
#           --vocab-from, /tmp/models/q35-P-bf16.gguf, shared with gpu_run.sh's synth_bg); then each
#           quantized with llama-quantize to $QUANTS (/tmp/models/q35-P-T.gguf). Log: /tmp/quant/prep.log
#   tests   (SKIP_TESTS=1 skips): tests/test_quant_kernels.py + tests/test_quant_weights.py on CUDA
#           (every test, the gpu-marked included), then the quantized engine test of
#           tests/test_batched_engine_gpu.py on SmolLM2 -> $OUT/quant-tests.txt
#   smollm  (SKIP_SMOLLM=1 skips): `python -m bench.gpu engine --quick` on SmolLM2 Q4_1 with
#           --weights quantized and bf16, then llama-bench on the file
#   models  (SKIP_MODELS=1 skips): per model of $MODELS, the bf16 file with --weights bf16 (the
#           reference; BF16_REF=0 skips it) and each $QUANTS file with --weights quantized, each then
#           llama-bench; waits up to WAIT_S (default 300) s for a file the prep has not finished
#   diag    (DIAG=1 runs it): tools/quant_diag.py on SmolLM2 (greedy streams of the quantized, rounded,
#           bf16 and float32 engines, teacher-forced logit errors, per-linear step times)
#           -> $OUT/quant-diag.{txt,json}
#   sweep   (SWEEP=1 runs it): tools/sweep_quant.py $SWEEP_ARGS (default: skinny configs of Q4_K / Q8_0 /
#           Q6_K at decode shapes, tiled configs at prefill-512; SWEEP_ARGS=--smollm: SmolLM2's shapes)
#           -> $OUT/sweep-quant.{txt,json}; SWEEP_BUDGET (360 s)
#   report  always: bench/quant_report.py over everything measured so far -> $OUT/QUANT.md, with the
#           results (JSON) and logs as $OUT/quant.tgz
#
# MODELS (default "4b 9b"; "0.8b" for a quick run; "" for none), QUANTS (default "Q4_K_M Q8_0").
# NO_SMOLLM=1: no SmolLM2 parts staged (carry .stage/tok.gguf instead): tokenizer from tok.gguf, no smollm phase.
# Results are kept in /tmp/quant/res while the machine stays warm, and a result already there is not
# measured again (FORCE=1 measures again), so the work splits over calls, e.g.
#   call 1 (~8 min): MODELS="4b 9b" bash tools/gpu_quant.sh           # tests, SmolLM2, prep in the background;
#                    the models phase measures what is ready and leaves the rest
#   call 2 (~6-8 min): SKIP_TESTS=1 SKIP_SMOLLM=1 bash tools/gpu_quant.sh   # the models left, the report
#   call 3 (optional, ~6 min): SKIP_TESTS=1 SKIP_SMOLLM=1 SKIP_MODELS=1 SWEEP=1 bash tools/gpu_quant.sh
# Disk: 4b + 9b hold ~48 GB in /tmp/models (bf16 26 GB, Q8_0 14, Q4_K_M 8); KEEP_BF16=0 deletes a bf16
# file once its quantized files exist and its own runs are done.
set -uo pipefail
cd "${QUANT_REPO:-$(dirname "$0")/..}"    # the detached prep runs a copy of this script from /tmp/quant
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# (the directories can be moved for a dry run of this script with stubs; the defaults are the machine's)
Q=${QUANT_DIR:-/tmp/quant}; RES=$Q/res; M=${MODELS_DIR:-/tmp/models}; STAGE=${STAGE_DIR:-/tmp/stage}
LL=${LLAMA_DIR:-/root/llamacpp}; PEER=${PEER_DIR:-/tmp/peer}; MARKS=${GPURUN_MARKS:-/tmp}   # gpu_run.sh's markers
mkdir -p "$Q" "$RES" "$M" "$STAGE"
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
MODELS=${MODELS-4b 9b}
QUANTS=${QUANTS:-Q4_K_M Q8_0}
WAIT_S=${WAIT_S:-300}
CALL_S=${CALL_S:-540}          # this call's time: no measurement starts with less than a minute of it left
T0=$(date +%s)
PHASE_T=$T0

left() { echo $((CALL_S - $(date +%s) + T0)); }
room() {
  # room WHAT: whether a minute or more is left for WHAT (else a note: it is left for the next call)
  [ "$(left)" -ge 60 ] && return 0
  echo "[quant] out of this call's time (CALL_S=$CALL_S): $1 left for the next call" | tee -a "$OUT/phases.txt"
  return 1
}

phase() {
  # "=== [elapsed] NAME" and the previous phase's duration, into $OUT/phases.txt
  local now; now=$(date +%s)
  echo "=== [$((now - T0)) s] $* (previous phase $((now - PHASE_T)) s)" | tee -a "$OUT/phases.txt"
  PHASE_T=$now
}

install_wheels() {
  [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
}

smollm() {
  # the staged SmolLM2 file (as gpu_run.sh's smollm)
  local f=$M/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -s "$f" ]; then
    cp .stage/part-* "$STAGE"/ 2>/dev/null
    cat "$STAGE"/part-* > "$f.tmp" 2>/dev/null
    if [ "$(sha256sum "$f.tmp" | cut -d' ' -f1)" != "$(cut -d' ' -f1 .stage/sha256 2>/dev/null)" ]; then
      echo "SmolLM2 parts missing or incomplete: $(ls "$STAGE")" >&2; rm -f "$f.tmp"; return 1
    fi
    mv "$f.tmp" "$f"
  fi
  echo "$f"
}

prep_running() { [ -e $Q/prep.started ] && [ ! -e $Q/prep.done ]; }

# ------------------------------------------------------------------------- background preparation
prep() {
  # (runs detached, from a copy of this script) build, synthesize, quantize; markers in $M and $Q
  local smol=$1 models=$2
  echo "[prep] start $(date +%T); models: $models; quants: $QUANTS"
  # gpu_run.sh builds llama.cpp in the same directory and writes the same bf16 files: wait for its
  # jobs when they run, else take their markers so that it starts none of its own
  local theirs_build=0 theirs_synth=0
  if [ -e $MARKS/llbuild.started ]; then theirs_build=1; else touch $MARKS/llbuild.started; fi
  if [ -e $MARKS/synth.started ]; then theirs_synth=1; else touch $MARKS/synth.started; fi
  (
    if [ $theirs_build = 1 ]; then
      for _ in $(seq 1 120); do [ -e $MARKS/llbuild.done ] && break; sleep 5; done
    fi
    t=$(date +%s)
    if LLAMA_TARGETS="llama-bench llama-quantize" bash $PEER/llamacpp-bench.sh $PEER/llama.cpp.tar.gz; then
      touch $Q/llbuild.done $MARKS/llbuild.done; echo "[prep] llama.cpp built in $(($(date +%s) - t)) s"
    else
      touch $Q/llbuild.failed; echo "[prep] llama.cpp build FAILED"
    fi
  ) &
  local builder=$!
  for p in $models; do
    local f=$M/q35-$p-bf16.gguf t
    [ -e "$M/q35-$p-bf16.done" ] && continue
    if [ $theirs_synth = 1 ]; then
      for _ in $(seq 1 180); do [ -e "$M/q35-$p-bf16.done" ] && break; sleep 5; done
      [ -e "$M/q35-$p-bf16.done" ] && continue
    fi
    t=$(date +%s)
    python3 -m fixtures.synth --arch qwen35 --preset "$p" --dtype bf16 --vocab-size 0 --vocab-from "$smol" \
      --out "$f" --no-progress --threads 8 && touch "$M/q35-$p-bf16.done"
    echo "[prep] synth $p: $(($(date +%s) - t)) s, $(du -h "$f" | cut -f1)"
  done
  wait $builder
  if [ ! -e $Q/llbuild.done ]; then echo "[prep] no llama-quantize: nothing quantized"; touch $Q/prep.done; return; fi
  for p in $models; do
    [ -e "$M/q35-$p-bf16.done" ] || { echo "[prep] no bf16 file for $p"; continue; }
    for T in $QUANTS; do
      local o=$M/q35-$p-$T.gguf t
      [ -e "$M/q35-$p-$T.done" ] && continue
      t=$(date +%s)
      $LL/build/bin/llama-quantize "$M/q35-$p-bf16.gguf" "$o.tmp" "$T" "$(nproc)" > "$Q/quantize-$p-$T.log" 2>&1 \
        && mv "$o.tmp" "$o" && touch "$M/q35-$p-$T.done"
      echo "[prep] llama-quantize $p $T: $(($(date +%s) - t)) s, $(du -h "$o" 2>/dev/null | cut -f1) ($(tail -2 "$Q/quantize-$p-$T.log" | tr '\n' ' '))"
    done
  done
  df -h /tmp | tail -1
  echo "[prep] done $(date +%T)"
  touch $Q/prep.done
}

start_prep() {
  local smol=$1
  [ -e $Q/prep.started ] && return
  [ -d $PEER ] || { [ -d .peer ] && cp -r .peer $PEER; }
  [ -d $PEER ] || { echo "no .peer carried: no llama.cpp" | tee -a "$OUT/phases.txt"; }
  touch $Q/prep.started
  cp tools/gpu_quant.sh $Q/prep.sh        # bash reads a script as it runs: the next call may replace the tree's copy
  QUANT_REPO=$PWD QUANTS="$QUANTS" MODELS="$MODELS" setsid nohup nice -n 19 bash $Q/prep.sh _prep "$smol" "$MODELS" > $Q/prep.log 2>&1 < /dev/null &
}

# ------------------------------------------------------------------------------------ measurements
wait_for() {
  # wait up to WAIT_S for marker $1; returns 1 if it did not come
  local i
  for i in $(seq 1 $((WAIT_S / 5))); do
    [ -e "$1" ] && return 0
    prep_running && [ "$(left)" -ge 70 ] || break
    sleep 5
  done
  [ -e "$1" ]
}

engine() {
  # engine NAME FILE TYPE WEIGHTS: one quick engine benchmark into $RES (skipped if there, unless FORCE=1)
  local name=$1 file=$2 ftype=$3 weights=$4
  local out=$RES/$name.$ftype.$weights.json
  if [ -s "$out" ] && [ -z "${FORCE:-}" ]; then echo "[quant] have $out"; return 0; fi
  room "engine $name $ftype $weights" || return 0
  local lim=${ENGINE_TIMEOUT:-240}; [ "$lim" -gt $(($(left) - 15)) ] && lim=$(($(left) - 15))
  prep_running && echo "[quant] note: the background prep is running (niced) while $name $ftype $weights is timed" | tee -a "$OUT/phases.txt"
  local t; t=$(date +%s)
  rm -f "$out.tmp"
  timeout "$lim" python3 -m bench.gpu engine --quick --reps 3 --weights "$weights" --model "$file" \
    --name "$name" --out "$out.tmp" > "$RES/$name.$ftype.$weights.log" 2>&1
  grep -v "^\s*$" "$RES/$name.$ftype.$weights.log" | grep -v "it/s\]" | tail -12
  [ -s "$out.tmp" ] && mv "$out.tmp" "$out"
  echo "[quant] engine $name $ftype $weights: $(($(date +%s) - t)) s$([ -s "$out" ] || echo ' (FAILED: see the log in quant.tgz)')" \
    | tee -a "$OUT/phases.txt"
}

llama() {
  # llama-bench on FILE once (appended to $RES/llamacpp.jsonl), if llama.cpp is built
  local file=$1 mark; mark=$RES/llama-$(basename "$file").done
  [ -e "$mark" ] && [ -z "${FORCE:-}" ] && return 0
  [ "${LLAMA:-1}" = 1 ] || return 0
  if ! wait_for $Q/llbuild.done; then
    echo "[quant] llama.cpp not built yet: no llama-bench on $(basename "$file") ($(tail -3 $Q/prep.log 2>/dev/null | tr '\n' ' '))" | tee -a "$OUT/phases.txt"
    return 0
  fi
  room "llama-bench $(basename "$file")" || return 0
  local t; t=$(date +%s)
  timeout $(($(left) - 10)) bash $PEER/llamacpp-bench.sh $PEER/llama.cpp.tar.gz "$file" >> "$RES/llamacpp.jsonl" && touch "$mark"
  echo "[quant] llama-bench $(basename "$file"): $(($(date +%s) - t)) s" | tee -a "$OUT/phases.txt"
}

maybe_drop_bf16() {
  local p=$1 T
  [ "${KEEP_BF16:-1}" = 0 ] || return 0
  for T in $QUANTS; do [ -e "$M/q35-$p-$T.done" ] || return 0; done
  if [ "${BF16_REF:-1}" = 1 ]; then [ -s "$RES/qwen35-$p.BF16.bf16.json" ] || return 0; fi
  rm -f "$M/q35-$p-bf16.gguf" "$M/q35-$p-bf16.done" && echo "[quant] KEEP_BF16=0: deleted q35-$p-bf16.gguf" | tee -a "$OUT/phases.txt"
}

main() {
  phase "start: MODELS='$MODELS' QUANTS='$QUANTS' SKIP_TESTS=${SKIP_TESTS:-} SKIP_SMOLLM=${SKIP_SMOLLM:-} SKIP_MODELS=${SKIP_MODELS:-} DIAG=${DIAG:-} SWEEP=${SWEEP:-} SWEEP_ARGS=${SWEEP_ARGS:-}"
  install_wheels
  nvidia-smi -L | tee "$OUT/device.txt"
  df -h /tmp | tail -1 | tee -a "$OUT/device.txt"
  local smol
  if [ -n "${NO_SMOLLM:-}" ]; then
    # no SmolLM2 staged: the synthetic files take their tokenizer from .stage/tok.gguf
    # (tools/tokenizer_gguf.py, 1.7 MB); the SmolLM2 phase and tests are left out
    smol=$M/tok.gguf; cp .stage/tok.gguf "$smol" || exit 1; SKIP_SMOLLM=1
  else
    smol=$(smollm) || exit 1
    export DFLASH_MODEL=$smol
  fi
  start_prep "$smol"
  [ -s $RES/env.json ] || python3 -m bench.gpu env --out $RES/env.json

  if [ -z "${SKIP_TESTS:-}" ]; then
    phase "tests"
    local lim=${TEST_TIMEOUT:-420}; [ "$lim" -gt $(($(left) - 90)) ] && lim=$(($(left) - 90))
    timeout "$lim" python3 -m pytest -q -p no:cacheprovider --durations=15 tests/test_quant_kernels.py \
      tests/test_quant_weights.py 2>&1 | tail -40 | tee "$OUT/quant-tests.txt"
    lim=240; [ "$lim" -gt $(($(left) - 60)) ] && lim=$(($(left) - 60))
    [ "$lim" -gt 30 ] && timeout "$lim" python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_batched_engine_gpu.py -k quantized 2>&1 \
      | grep -E "quantized vs bf16|passed|failed|error|Error|assert" | tail -30 | tee -a "$OUT/quant-tests.txt"
  fi

  if [ -z "${SKIP_SMOLLM:-}" ]; then
    phase "smollm"
    engine smollm2-135m "$smol" Q4_1 quantized
    engine smollm2-135m "$smol" Q4_1 bf16
    llama "$smol"
  fi

  if [ -z "${SKIP_MODELS:-}" ]; then
    for p in $MODELS; do
      phase "models: $p"
      if [ "${BF16_REF:-1}" = 1 ]; then
        if wait_for "$M/q35-$p-bf16.done" && [ -s "$M/q35-$p-bf16.gguf" ]; then
          engine "qwen35-$p" "$M/q35-$p-bf16.gguf" BF16 bf16
          llama "$M/q35-$p-bf16.gguf"
        else
          echo "[quant] q35-$p-bf16 not ready: skipped (run again)" | tee -a "$OUT/phases.txt"
        fi
      fi
      for T in $QUANTS; do
        if wait_for "$M/q35-$p-$T.done"; then
          engine "qwen35-$p" "$M/q35-$p-$T.gguf" "$T" quantized
          llama "$M/q35-$p-$T.gguf"
        else
          echo "[quant] q35-$p-$T not ready: skipped (run again; prep: $(tail -2 $Q/prep.log | tr '\n' ' '))" | tee -a "$OUT/phases.txt"
        fi
      done
      maybe_drop_bf16 "$p"
    done
  fi

  if [ -n "${DIAG:-}" ] && room "the diagnostic"; then
    phase "diag"
    timeout $(($(left) - 15)) python3 tools/quant_diag.py --model "$smol" --out "$OUT/quant-diag.json" 2>&1 \
      | tee "$OUT/quant-diag.txt" | tail -60
  fi

  if [ -n "${SWEEP:-}" ] && room "the sweep"; then
    phase "sweep"
    local b=${SWEEP_BUDGET:-360}; [ "$b" -gt $(($(left) - 60)) ] && b=$(($(left) - 60))
    # shellcheck disable=SC2086
    timeout $(($(left) - 15)) python3 tools/sweep_quant.py ${SWEEP_ARGS:-} --budget-s "$b" --out "$OUT/sweep-quant.json" 2>&1 \
      | tee "$OUT/sweep-quant.txt" | tail -40
  fi

  phase "report"
  python3 -m bench.quant_report --dir $RES --out "$OUT/QUANT.md" \
    --command "MODELS='$MODELS' QUANTS='$QUANTS' bash tools/gpu_quant.sh (over one or more calls)" | tail -40
  cp $Q/prep.log "$OUT"/ 2>/dev/null
  tail -20 $LL/build.log > "$OUT/llbuild-tail.log" 2>/dev/null
  tar -czf "$OUT/quant.tgz" -C $Q res prep.log $(cd $Q && ls quantize-*.log 2>/dev/null)   # results, engine logs
  ls -la $M | tee -a "$OUT/device.txt" > /dev/null
  phase "end"
}

if [ "${1:-}" = _prep ]; then
  shift; prep "$@"
else
  main
fi
