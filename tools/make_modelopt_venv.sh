#!/usr/bin/env bash
# A separate environment for NVIDIA ModelOpt's ONNX quantizers (a peer in tools/bench_int8.py and
# tools/bench_int4.py). nvidia-modelopt[onnx] pins its own onnx and onnxruntime-gpu and pulls CuPy and a CUDA
# torch (about 6.5 GB), which would replace the project's onnxruntime and its torch==2.13.0 pin, so it never
# goes into mograph's environment. Usage: tools/make_modelopt_venv.sh [DIR] (default: .venv-modelopt in the
# project root, where tools/bench_int8.py looks); tools/bench_int4.py reads MOGRAPH_MODELOPT_PYTHON=DIR/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.venv-modelopt}"
python3 -m venv "$dir"
"$dir/bin/python" -m pip install -q "nvidia-modelopt[onnx]"
"$dir/bin/python" -c "import modelopt.onnx.quantization, onnxruntime; print('modelopt ready, onnxruntime', onnxruntime.__version__)"
echo "ModelOpt environment ready: MOGRAPH_MODELOPT_PYTHON=$dir/bin/python"
