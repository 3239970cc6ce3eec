#!/usr/bin/env bash
# Remake the exporter corpus (tests/data/corpus) from scratch: venvs, every family, fp16 variants, manifest.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.venv-corpus}
bash tools/corpus/setup_venv.sh "$DIR"
rm -f tests/data/corpus/*.onnx tests/data/corpus/.part-*.json
for f in torch torch-plain tf jax jax2tf jax2tf-plain paddle; do OMP_NUM_THREADS=1 "$DIR/${f%-plain}/bin/python" tools/corpus/make_corpus.py "$f"; done
"$DIR/torch/bin/python" tools/corpus/make_corpus.py fp16
"$DIR/torch/bin/python" tools/corpus/make_corpus.py manifest
