"""File sizes of weight-only int4 with the embedding table float or block-quantized, on a random LLaMA
(SmolLM2-135M's widths and vocabulary, 2 layers), with the LM head tied to the table or not.

    python tools/embedding_sizes.py [--layers 2] [--vocab 49152] [--out DIR] [--device cuda]

Prints one row per (head, --embedding-precision, --output-projection): bytes of the written file, and the
largest absolute logit difference to the float export on ONNX Runtime CPU (optimizations off).  Without
``--device`` it runs ``--passes int4 --target ort`` (RTN, float32 elsewhere: minutes on 2 cores); ``--device cuda``
runs the cuda recipe (weight-only then fp16, on 2 random calibration samples; much slower).  Sizes only: GPU
speed is not measured here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import decoder_export as de  # noqa: E402


def run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, feeds)[0], np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default=None, help="cuda: the cuda recipe (weight-only, fp16); default: int4 alone")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="embedding_sizes_"))
    out.mkdir(parents=True, exist_ok=True)
    widths = {k: v for k, v in de.SMOLLM2_135M.items() if k not in ("layers", "vocab")}
    print(f"{'head':7} {'embeddings':10} {'lm head':8} {'bytes':>12}  max|logit diff|")
    for tied in (False, True):
        cfg = de.config("llama", **{**widths, "layers": args.layers, "vocab": args.vocab})
        cfg.tie_word_embeddings = tied
        src = out / f"llama_{'tied' if tied else 'untied'}.onnx"
        if not src.exists():
            de.export(cfg, "prefill", "torchscript", src)
        feeds = de.feeds(cfg, "prefill", batch=1, seq=16)
        ref = run(src, feeds)
        print(f"{'tied' if tied else 'untied':7} {'(float export)':19} {src.stat().st_size:>12,}")
        for emb, head in (("float", "float"), ("bits", "float"), ("float", "bits"), ("bits", "bits")):
            dst = out / f"{src.stem}_{emb}_{head}.onnx"
            cmd = [sys.executable, "-m", "mograph", "optimize", str(src), "-o", str(dst), "--passes", "int4",
                   "--embedding-precision", emb, "--output-projection", head, "-q"]
            cmd += (["--device", args.device, "--calibration-random", "2"] if args.device
                    else ["--target", "ort", "--algorithm", "rtn"])
            subprocess.run(cmd, check=True)
            diff = float(np.abs(run(dst, feeds) - ref).max())
            print(f"{'tied' if tied else 'untied':7} {emb:10} {head:8} {dst.stat().st_size:>12,}  {diff:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
