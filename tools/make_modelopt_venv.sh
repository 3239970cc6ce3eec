#!/usr/bin/env bash
# A separate environment for NVIDIA ModelOpt's ONNX quantizer (a peer in tools/bench_int4.py).
# nvidia-modelopt[onnx] pins its own onnx and onnxruntime-gpu (and pulls torch and cupy), so it never goes
# into mograph's environment. Usage: tools/make_modelopt_venv.sh [DIR]; then
#   MOGRAPH_MODELOPT_PYTHON=DIR/bin/python python tools/bench_int4.py
set -euo pipefail
dir="${1:-.venv-modelopt}"
python3 -m venv "$dir"
"$dir/bin/python" -m pip install -q "nvidia-modelopt[onnx]"
echo "ModelOpt environment ready: MOGRAPH_MODELOPT_PYTHON=$dir/bin/python"
