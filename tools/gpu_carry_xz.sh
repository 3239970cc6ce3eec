#!/usr/bin/env bash
# Pack onnxruntime-gpu for the lent H200 in 5 carry calls instead of 9 (session 17).
#
# Run here, in the project root, after the lent-GPU preparation script prepare-ort-gpu.sh (not in this repository; it downloads the wheel into
# .gpu/ort.part.* and the small wheels into .gpu/whl; add onnxruntime-genai's wheel there yourself when the
# builder is needed: pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
# --platform manylinux_2_28_x86_64 -d .gpu/whl onnxruntime-genai==0.18.0).
# It unpacks the wheel, packs its tree with xz (256 MB -> 203 MB, about 2 minutes on 2 cores), splits that into a
# 30 MB first part (it travels with .gpu/whl) and 44 MB parts (the tracked tree is ~18 MB of the 64 MiB a call
# carries), and writes .gpu/assemble.sh, which unpacks the tree into .gpu/site on the device.
#
# On the device, calls back to back (a machine goes back 30 s after a call ends; /tmp survives between calls):
#   call 1: carry [.gpu/ort.x.00, .gpu/whl, .gpu/assemble.sh, .gpu/ort.x.sha256], command
#           `mkdir -p /tmp/g && cp -r .gpu/. /tmp/g/` (start long CPU builds here, e.g. tools/gpu_llm.sh start)
#   calls 2-4: carry [.gpu/ort.x.0K], the same command
#   call 5: carry [.gpu/ort.x.04], `mkdir -p /tmp/g && cp -r .gpu/. /tmp/g/ && rm -rf .gpu && ln -s /tmp/g .gpu &&
#           . .gpu/assemble.sh && <your run>`
#   later calls: `rm -rf .gpu && ln -s /tmp/g .gpu && . .gpu/assemble.sh && <your run>`
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
ls .gpu/ort.part.* >/dev/null
tmp=$(mktemp -d)
cat .gpu/ort.part.* > "$tmp/w.whl"
mkdir "$tmp/x" && (cd "$tmp/x" && python3 -m zipfile -e ../w.whl .)
tar -C "$tmp/x" -cf - . | xz -T2 -9 > "$tmp/ort.tar.xz"
rm -f .gpu/ort.x.*
head -c 30000000 "$tmp/ort.tar.xz" > .gpu/ort.x.00
tail -c +30000001 "$tmp/ort.tar.xz" | split -b 44000000 -d - .gpu/ort.x.rest.
for f in .gpu/ort.x.rest.*; do n=${f##*.}; mv "$f" ".gpu/ort.x.$(printf %02d $((10#$n + 1)))"; done
sha256sum "$tmp/ort.tar.xz" | cut -d' ' -f1 > .gpu/ort.x.sha256
rm -rf "$tmp"
chmod u+w .gpu/assemble.sh 2>/dev/null || true
cat > .gpu/assemble.sh <<'EOF'
# Source this ON THE DEVICE from the project root once .gpu -> /tmp/g holds every carried part.
set -e
if [ ! -f .gpu/site/.done ]; then
  cat .gpu/ort.x.0? > /tmp/ort.tar.xz
  echo "$(cat .gpu/ort.x.sha256)  /tmp/ort.tar.xz" | sha256sum -c -
  mkdir -p .gpu/site && python3 -c "import tarfile; tarfile.open('/tmp/ort.tar.xz', 'r:xz').extractall('.gpu/site')"
  python3 -m pip install -q --no-index --no-deps --no-compile --target .gpu/site .gpu/whl/*.whl
  touch .gpu/site/.done
fi
[ -f pyproject.toml ] && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
    --target .gpu/site-mograph . >/dev/null
export PYTHONPATH="$PWD/.gpu/site-mograph:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, onnxruntime as o; o.preload_dlls(); print('onnxruntime', o.__version__, o.get_available_providers())"
set +e
EOF
ls -la .gpu/ort.x.*
