#!/usr/bin/env bash
# Make the venvs the exporter corpus is built in (tools/corpus/make_corpus.py), apart from the core venv:
# their frameworks pin numpy/protobuf versions that do not agree with each other or with mograph's.
#
#   bash tools/corpus/setup_venv.sh [DIR] [FAMILY ...]     DIR default .venv-corpus; families: torch tf jax paddle jax2tf
#
# Each family gets DIR/<family>; all install from PyPI.  torch is pinned (torch==2.13.0: a looser pin
# pulls a multi-GB CUDA build).  The corpus itself is committed (tests/data/corpus), so neither CI nor
# the tests need these venvs: only remaking the corpus does.
set -euo pipefail
DIR=${1:-.venv-corpus}
shift || true
FAMILIES=${*:-torch tf jax paddle jax2tf}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
for fam in $FAMILIES; do
  case $fam in
    torch)  pkgs=("torch==2.13.0" "onnx>=1.17" "onnxscript>=0.7.2" "onnxconverter-common" "numpy") ;;
    tf)     pkgs=("tensorflow-cpu" "tf2onnx" "keras>=3" "jax[cpu]" "flax" "onnxconverter-common") ;;
    jax)    pkgs=("jax[cpu]" "flax" "jax2onnx" "onnxconverter-common") ;;
    # jax2tf's graph serialization (native_serialization=False, which tf2onnx can convert) is gone from
    # current JAX; this family keeps the last JAX that has it, with a TensorFlow of its time.
    jax2tf) pkgs=("jax[cpu]==0.4.30" "flax==0.8.5" "tensorflow-cpu==2.17.1" "tf2onnx" "onnx==1.17.0" "onnxconverter-common") ;;
    paddle) pkgs=("paddlepaddle" "paddle2onnx" "onnxconverter-common" "onnx-graphsurgeon" "sympy") ;;
    *) echo "unknown family '$fam' (torch tf jax paddle jax2tf)" >&2; exit 2 ;;
  esac
  if [ ! -x "$DIR/$fam/bin/python" ]; then
    "$PY" -m venv "$DIR/$fam"
  fi
  echo "== $fam: ${pkgs[*]}"
  "$DIR/$fam/bin/python" -m pip install -q --upgrade pip
  "$DIR/$fam/bin/python" -m pip install -q "${pkgs[@]}"
  "$DIR/$fam/bin/python" -m pip freeze > "$DIR/$fam/freeze.txt"
done
