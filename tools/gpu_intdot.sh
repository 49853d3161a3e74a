#!/usr/bin/env bash
# Issue 19 on the GPU: the integer-arithmetic kernels (kernels/quant/intdot.py) checked for every type
# they cover, timed per projection, then the 9B Q4_K_M decode with each set of integer types beside
# llama.cpp on the same file. No SmolLM2 staging: the synthetic files take their tokenizer from
# .stage/tok.gguf. Carry .whl, .peer (llama.cpp.tar.gz, llamacpp-bench.sh) and .stage/tok.gguf.
#
#   bash tools/gpu_intdot.sh start    # wheels; the background prep of tools/gpu_quant.sh (llama.cpp with
#                                     # llama-bench + llama-quantize, the synthetic 9B bf16, its Q4_K_M and
#                                     # Q8_0 files); the quant tests with every integer type on
#                                     # -> $OUT/intdot-tests.txt; the dp4a probe -> $OUT/probe.{txt,json}
#                                     # (timed while the prep builds: its timings are checked again in `decode`)
#   bash tools/gpu_intdot.sh q6k      # the prep (if not started); the probe of the several-row Q4_K and Q6_K
#                                     # kernels' launches at M = 16 (DP4A_MMA16); decode with SETS (default
#                                     # "q6k-tuned tuned default"; tuned: the best launch per type as
#                                     # DFLASH_QUANT_MMA_LAUNCH) -> $OUT/probe-mma16.*, mma16-best.txt
#   SYNTH_Q4K=1 bash tools/gpu_intdot.sh start   # the same, but the 9B written by fixtures.synth --dtype q4_k
#                                     # instead of llama.cpp's build and llama-quantize (minutes sooner; no
#                                     # Q6_K, no llama.cpp figure): then QUANTS=SYNTH_Q4_K ... decode
#   PROBE_SETS="default mma2 unpadded" bash tools/gpu_intdot.sh probe   # the probe per set (names as SETS)
#                                     # (no model, no prep: a fresh machine's first call can be this)
#   bash tools/gpu_intdot.sh decode   # per file of $QUANTS (default Q4_K_M): bench.gpu engine --quick
#                                     # --weights quantized with DFLASH_QUANT_INT_DOTS per $SETS, then
#                                     # llama-bench on the file; tools/verify_profile.py (1x1, 1x16) with the
#                                     # default set -> $OUT/decode-*.{txt,json}, $OUT/profile-*.txt
#
# SETS: space-separated settings (default "generic default all"): generic (DFLASH_QUANT_INT_DOTS=0),
# default (nothing set), unfused (DFLASH_QUANT_FUSED_SUM=0), unpadded (Q6_K in the file's 210-byte
# super-blocks: DFLASH_QUANT_Q6K_STRIDE=210), pad212 / pad216 / pad224 (that stride), q6k (Q4_K,Q6_K),
# q6k-unpadded (Q4_K,Q6_K at 210), mma2 / q6k-mma2 (the several-row integer kernels at 2 pipeline
# stages: DFLASH_QUANT_MMA_STAGES=2; without / with Q6_K on them), all (every integer type:
# Q4_K,Q5_K,Q6_K,Q4_0,Q4_1,Q8_0), or a DFLASH_QUANT_INT_DOTS value; SETS_<type> (e.g. SETS_Q8_0) for one file type.
# PROFILE_SET: DFLASH_QUANT_INT_DOTS of the profile (default unset). TESTS_K: a pytest -k filter of the
# tests of `start` (TESTS_S: their time limit, default 330 s: they share the machine with the prep's build); PROBE_S: the probe's time limit (start: default 200 s, probe: 120 s, q6k: 240 s; DP4A_QUICK=1 for its default launches). The machine keeps /tmp while warm, so `decode` follows `start`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; M=/tmp/models; Q=/tmp/quant; mkdir -p "$OUT" "$M" "$Q/res"
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
ALL=Q4_K,Q5_K,Q6_K,Q4_0,Q4_1,Q8_0
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl || exit 1

synth_q4k() {
  # (background) the synthetic 9B written straight as fixtures.synth's Q4_K_M-like mix (random Q4_K
  # blocks, Q8_0 where rows are not whole super-blocks; no Q6_K): no llama.cpp build, a couple of
  # minutes; decode takes it as QUANTS=SYNTH_Q4_K (no llama.cpp figure on it)
  [ -e $M/q35-9b-SYNTH_Q4_K.started ] && return
  touch $M/q35-9b-SYNTH_Q4_K.started; cp .stage/tok.gguf $M/tok.gguf
  setsid nohup bash -c "python3 -m fixtures.synth --arch qwen35 --preset 9b --dtype q4_k --vocab-size 0 \
    --vocab-from $M/tok.gguf --out $M/q35-9b-SYNTH_Q4_K.gguf.part --no-progress --threads 16 > $Q/synth-q4k.log 2>&1 \
    && mv $M/q35-9b-SYNTH_Q4_K.gguf.part $M/q35-9b-SYNTH_Q4_K.gguf && touch $M/q35-9b-SYNTH_Q4_K.done" \
    > /dev/null 2>&1 < /dev/null &
}

prep() {
  # prep QUANTS: tools/gpu_quant.sh's background prep of the 9B (no tests, no models, one second of
  # measuring time); nothing when it has started already (gpu_quant.sh starts it once a machine)
  [ -e $Q/prep.started ] || NO_SMOLLM=1 MODELS=9b QUANTS="$1" SKIP_TESTS=1 SKIP_MODELS=1 CALL_S=1 OUT=$Q/start \
    bash tools/gpu_quant.sh > "$Q/start.log" 2>&1
}

start() {
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
  if [ -n "${SYNTH_Q4K:-}" ]; then
    synth_q4k
  else
    prep "${QUANTS:-Q4_K_M Q8_0}"
  fi
  DFLASH_QUANT_INT_DOTS=$ALL timeout -s INT ${TESTS_S:-330} python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py \
    tests/test_quant_weights.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -30 > "$OUT/intdot-tests.txt"
  echo "pytest rc=${PIPESTATUS[0]} (124: cut at ${TESTS_S:-330} s)" >> "$OUT/intdot-tests.txt"
  tail -5 "$OUT/intdot-tests.txt"
  timeout ${PROBE_S:-200} python3 tools/quant_dp4a_probe.py --out "$OUT/probe.json" > "$OUT/probe.txt" 2>&1
  tail -40 "$OUT/probe.txt"
  tail -5 $Q/prep.log $Q/synth-q4k.log 2>/dev/null || true   # (synth-q4k.log only with SYNTH_Q4K)
}

decode() {
  local T F s tag
  for T in ${QUANTS:-Q4_K_M}; do
    F=$M/q35-9b-$T.gguf
    for _ in $(seq 1 60); do [ -e $M/q35-9b-$T.done ] && break; sleep 5; done
    [ -e $M/q35-9b-$T.done ] || { echo "no $F: $(tail -3 $Q/prep.log $Q/synth-q4k.log 2>/dev/null)"; continue; }
    local v=SETS_$T
    local -A seen=()
    for s in ${!v:-${SETS:-generic default all}}; do
      tag=$T-${s//,/-}
      seen[$s]=$(( ${seen[$s]:-0} + 1 ))
      [ "${seen[$s]}" -gt 1 ] && tag=$tag-${seen[$s]}   # a set named again: its own files (default, default-2)
      envs=$(set_env "$s") || { echo "unknown set $s: skipped" | tee -a "$OUT/decode-errors.txt"; continue; }
      # shellcheck disable=SC2086
      env $envs timeout 200 python3 -m bench.gpu engine --quick --reps 3 --weights quantized --model $F \
        --name "q35-9b-$tag" --out "$OUT/decode-$tag.json" > "$OUT/decode-$tag.txt" 2>&1
      echo "== $tag ($envs)"; grep -v "^\s*$" "$OUT/decode-$tag.txt" | grep -v "it/s\]" | tail -8
    done
    if [ "${LLAMA:-1}" = 1 ] && [ "$T" != SYNTH_Q4_K ] && [ -x /root/llamacpp/build/bin/llama-bench ]; then
      timeout 200 bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz $F > "$OUT/llama-$T.txt" 2>&1
      tail -4 "$OUT/llama-$T.txt"
    fi
    if [ "${PROFILE:-1}" = 1 ]; then
      DFLASH_QUANT_INT_DOTS=${PROFILE_SET:-${DFLASH_QUANT_INT_DOTS:-1}} timeout 150 python3 tools/verify_profile.py --model $F --weights quantized --shapes 1x1,1x16 --context 128 \
        --out "$OUT/profile-$T.json" > "$OUT/profile-$T.txt" 2>&1
      tail -20 "$OUT/profile-$T.txt"
    fi
  done
  (cd "$OUT" && tar czf intdot.tgz --exclude intdot.tgz ./*.txt ./*.json 2>/dev/null)
}

set_env() {
  # the environment assignments of set $1 (see SETS above); status 1 for a name it does not know
  # (a DFLASH_QUANT_INT_DOTS value must be 0, 1 or a list of the integer types)
  case $1 in
    generic) echo "DFLASH_QUANT_INT_DOTS=0" ;;
    default) echo "" ;;
    unpadded) echo "DFLASH_QUANT_Q6K_STRIDE=210" ;;
    pad212|pad216|pad224) echo "DFLASH_QUANT_Q6K_STRIDE=${1#pad}" ;;
    q6k-unpadded) echo "DFLASH_QUANT_INT_DOTS=Q4_K,Q6_K DFLASH_QUANT_Q6K_STRIDE=210" ;;
    mma2) echo "DFLASH_QUANT_MMA_STAGES=2" ;;
    q6k-mma2) echo "DFLASH_QUANT_INT_DOTS=Q4_K,Q6_K DFLASH_QUANT_MMA_STAGES=2" ;;
    unfused) echo "DFLASH_QUANT_FUSED_SUM=0" ;;
    q6k) echo "DFLASH_QUANT_INT_DOTS=Q4_K,Q6_K" ;;
    all) echo "DFLASH_QUANT_INT_DOTS=$ALL" ;;
    tuned) echo "DFLASH_QUANT_MMA_LAUNCH=${TUNED:?}" ;;
    q6k-tuned) echo "DFLASH_QUANT_INT_DOTS=Q4_K,Q6_K DFLASH_QUANT_MMA_LAUNCH=${TUNED:?}" ;;
    0|1) echo "DFLASH_QUANT_INT_DOTS=$1" ;;
    *)
      local t
      for t in ${1//,/ }; do case ",$ALL," in *",$t,"*) ;; *) return 1 ;; esac; done
      echo "DFLASH_QUANT_INT_DOTS=$1" ;;
  esac
}

probe() {
  # the dp4a / several-row probe (tools/quant_dp4a_probe.py, no model) once per setting of PROBE_SETS
  # (space-separated set names as SETS takes them, e.g. "default unpadded mma2"; the probe forces the
  # generic kernel's baseline itself, so the INT_DOTS sets change nothing there), in that order ->
  # $OUT/probe-set<i>.{txt,json}; DP4A_TYPES / DP4A_QUICK / DP4A_MMA16 as the probe reads them;
  # PROBE_S: each one's time limit (default 120 s)
  local i=0 envs s
  for s in ${PROBE_SETS:-default}; do
    i=$((i + 1))
    envs=$(set_env "$s") || { echo "unknown set $s: skipped"; continue; }
    # shellcheck disable=SC2086
    env $envs timeout ${PROBE_S:-120} python3 tools/quant_dp4a_probe.py --out "$OUT/probe-set$i.json" > "$OUT/probe-set$i.txt" 2>&1
    echo "== probe set $i: $s (${envs:-defaults})"; grep "^| [QS]" "$OUT/probe-set$i.txt" || tail -3 "$OUT/probe-set$i.txt"
  done
}

q6k() {
  # the several-row Q6_K kernel's BLOCK_N x warps at M = 16 (DP4A_MMA16), the best one taken for the
  # 9B decode with Q6_K on the integer kernels (DFLASH_QUANT_MMA_LAUNCH) beside the default set
  prep Q4_K_M
  DP4A_TYPES=${PROBE_TYPES:-Q4_K,Q6_K} DP4A_MMA16=1 timeout ${PROBE_S:-240} python3 tools/quant_dp4a_probe.py --out "$OUT/probe-mma16.json" \
    > "$OUT/probe-mma16.txt" 2>&1
  tail -9 "$OUT/probe-mma16.txt"
  local best
  best=$(python3 - "$OUT/probe-mma16.json" <<'PY'
import json, sys
tot = {}
for r in json.load(open(sys.argv[1])):
    for label, us in r["mma_us"]["16"].items():
        if label != "default":
            tot.setdefault(r["type"], {})[label] = tot.get(r["type"], {}).get(label, 0.0) + us
out = []
for name, t in tot.items():
    label = min(t, key=t.get)
    out.append(f"{name}:{label.split('-')[0][2:]}:{label.split('-')[1][1:]}")
print(",".join(out))
PY
)
  echo "best several-row launches at M = 16: $best" | tee "$OUT/mma16-best.txt"
  [ -n "$best" ] || return
  SETS="${SETS:-q6k-tuned tuned default}" TUNED=$best LLAMA=${LLAMA:-0} PROFILE=${PROFILE:-0} decode
}

case "${1:-}" in
  start) start ;;
  q6k) q6k ;;
  decode) decode ;;
  probe) probe ;;
  *) echo "usage: $0 start|decode|q6k|probe" >&2; exit 2 ;;
esac
