#!/usr/bin/env bash
# Make .venv-modelopt: NVIDIA ModelOpt's ONNX quantization for tools/bench_int8.py, kept out of the main venv
# (it brings onnxruntime-gpu, CuPy and a CUDA torch, which would replace the project's onnxruntime and its
# torch==2.13.0 pin). About 6.5 GB. Usage: bash tools/make_modelopt_venv.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
"$PY" -m venv .venv-modelopt
.venv-modelopt/bin/python -m pip install -q 'nvidia-modelopt[onnx]'
.venv-modelopt/bin/python -c "import modelopt.onnx.quantization, onnxruntime; print('modelopt ready, onnxruntime', onnxruntime.__version__)"
