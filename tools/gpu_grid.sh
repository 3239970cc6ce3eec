#!/usr/bin/env bash
# The three H200 calls that fill issue 15's whole grid (BENCHMARKS-GPU.md, "How to run"), one per argument:
#   bash tools/gpu_grid.sh build   # ~5 min: every export and variant, 12 processes, nothing timed
#   bash tools/gpu_grid.sh time    # ~8 min: builds what is left, then times (dynamo first in each model)
#   bash tools/gpu_grid.sh rest    # ~4 min: what is still left, then torch.compile at 8x512
#   bash tools/gpu_grid.sh list    # what is left, with estimates
# Results: /tmp/grid.jsonl (copied to $OUT when set); cache /tmp/bc. onnxruntime-gpu must be installed on the device
# first (the records in BENCHMARKS-GPU.md start each call with the script that installed it, kept outside this repository).
# BUDGET=seconds overrides a step's --time-budget; JOBS=N the build processes (default 12: up to ~8 GB each); CACHE and RESULTS
# the cache folder and results file.
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-12}
CACHE=${CACHE:-/tmp/bc}
RESULTS=${RESULTS:-/tmp/grid.jsonl}
G=(--cache "$CACHE" --out "$RESULTS" --models bert,gpt2,llama,vit,whisper --exports dynamo,torchscript
   --attn eager,sdpa)
V=(--variants exported,ort-t,onnxscript,mograph,mograph-ortfp16,torch-eager)
T=(--min-time 0.25 --rounds 3 --warmup 5)
bench() { python tools/bench_gpu.py "$@"; }
summary() { bench --list --jobs "$JOBS" "${G[@]}" "${V[@]}" "${T[@]}" | tail -3; df -h "$(dirname "$RESULTS")" | tail -1; }
save() { if [ -n "${OUT:-}" ] && [ -f "$RESULTS" ]; then cp "$RESULTS" "$OUT/"; fi; }
case "${1:-}" in
  build) summary; bench --prepare-only --jobs "$JOBS" "${G[@]}" "${V[@]}" --time-budget "${BUDGET:-450}"; summary;
         free -g | head -2 ;;
  time)  bench --jobs "$JOBS" "${G[@]}" "${V[@]}" "${T[@]}" --time-budget "${BUDGET:-480}"; save; summary ;;
  rest)  bench --jobs "$JOBS" "${G[@]}" "${V[@]}" "${T[@]}" --time-budget "${BUDGET:-240}"; save;
         bench "${G[@]}" --variants torch-compile --shapes 8x512 "${T[@]}" --time-budget "${BUDGET:-240}"; save;
         summary ;;
  list)  summary ;;
  *) echo "usage: tools/gpu_grid.sh build|time|rest|list" >&2; exit 2 ;;
esac
