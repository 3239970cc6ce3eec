#!/usr/bin/env bash
# On the lent H200: start tools/bench_llm.py's builds in the background during the onnxruntime-gpu carry
# (a carry done by a script kept outside this repository), so they overlap the five carry calls.
#   bash tools/gpu_llm.sh start MODELS [extra prepare args]   # in carry call 1 (after .gpu/whl is there)
#   bash tools/gpu_llm.sh wait [MODEL]                         # later: block until the builds are done, print the log
# `start` may be called again for other models with other args (e.g. --variant lists); the checkout is copied once.
#   bash tools/gpu_llm.sh time --models M --out $OUT/r.jsonl ...    # later call: onnxruntime-gpu, then bench_llm time
# CPUS=4-15 pins the builds to those cores (taskset), leaving the others quiet for timing in a later call.
# Threads: `--jobs N` gives each mograph run cores/N threads, per model process; with several models started at once
# set MOGRAPH_ORT_THREADS=cores/(N x models) yourself. Session 7 started 3 models x 4 jobs unthrottled on 14 cores
# (load average 60-84): no mograph graph of any model finished in 20 minutes, and the lease was lost.
# Carry: the wheels' folder (with onnxruntime-genai) and a 50 MB part do not fit one 64 MiB call: carry .gpu/whl
# (plus assemble.sh, ort.wheelname, ort.sha256) in its own call, then the five parts one per call.
# The builds use the image's CPU onnxruntime and torch; a copy of this checkout in /tmp/repo; cache /tmp/llm.
set -u
case "$1" in
start)
  models=$2; shift 2
  if [ ! -e /tmp/repo/.copied ]; then
    rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r . /tmp/repo/ && rm -rf /tmp/repo/.gpu
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pre .gpu/whl/onnx_ir-*.whl \
        .gpu/whl/onnxruntime_genai-*.whl .gpu/whl/polygraphy-*.whl >/dev/null 2>&1
    (cd /tmp/repo && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/pm . >/dev/null 2>&1)
    touch /tmp/repo/.copied
  fi
  cd /tmp/repo
  pin=""; [ -n "${CPUS:-}" ] && pin="taskset -c $CPUS"
  for m in ${models//,/ }; do  # one process per model, so the models build side by side on the 16 cores
    PYTHONPATH=/tmp/pm:/tmp/pre setsid nohup $pin python3 tools/bench_llm.py prepare --models "$m" \
        --cache /tmp/llm "$@" > "/tmp/llm-prepare-$m.log" 2>&1 < /dev/null &
  done
  sleep 2; echo started; tail -n 2 /tmp/llm-prepare-*.log ;;
time)  # time [bench_llm time args]: in a later call of the lease; installs the carried onnxruntime-gpu first
  shift
  rm -rf .gpu && ln -s /tmp/g .gpu && . .gpu/assemble.sh >/tmp/assemble.log 2>&1 || { tail -5 /tmp/assemble.log; exit 1; }
  cd /tmp && python3 /tmp/repo/tools/bench_llm.py time --cache /tmp/llm "$@" ;;
wait)  # wait [MODEL] [SECONDS]: until that model's build (default: every build) is done, at most SECONDS (default
  # 420: a call has 600 s, and a call that runs out loses its output; session 15 lost a lease that way)
  end=$((SECONDS + ${3:-420}))
  while pgrep -f "bench_llm.py prepare --models ${2:-}" >/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
  pgrep -f "bench_llm.py prepare --models ${2:-}" >/dev/null && echo "still building after ${3:-420} s"
  grep -h -E "bench_llm" /tmp/llm-prepare-${2:-*}.log | tail -40 ;;
esac
