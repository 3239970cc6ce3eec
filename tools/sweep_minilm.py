"""A sweep of real all-MiniLM-L6-v2: fp32 (fused), fp16, int8, int8 with an accuracy budget, pruned.

Exports the trained model from its PyPI package (:mod:`models.minilm`), writes the evaluation set (the
220 sentences of ``models.sentences.EVALUATION``, one ``.npz`` each, unpadded) and the calibration set
(the 80 of ``CALIBRATION``) as folders of ``.npz``, a sweep config, and a task metric (mean cosine of
the mean-pooled sentence embeddings against the fp32 baseline's: what sentence-transformers users
compare), then runs ``mograph sweep`` into a ledger and prints ``mograph ledger list``.

Run: ``python tools/sweep_minilm.py --out DIR [--executor ray --workers 2] [--iterations N]``; the
ledger is ``DIR/ledger.db``.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

METRIC = '''
"""Task metric of the MiniLM sweep: sentence embeddings (attention-masked mean of last_hidden_state)
against the fp32 baseline's, mean cosine over the evaluation sentences."""
import numpy as np


def _embedding(out, sample):
    h = np.asarray(out["last_hidden_state"], np.float64)
    m = np.asarray(sample["attention_mask"], np.float64)[..., None]
    e = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return e / np.linalg.norm(e, axis=-1, keepdims=True)


def embedding_cosine(outputs, samples, reference):
    return float(np.mean([(_embedding(o, s) * _embedding(r, s)).sum() for o, r, s in zip(outputs, reference, samples)]))
'''

CONFIG = """\
# A sweep of all-MiniLM-L6-v2 (written by tools/sweep_minilm.py). Paths are relative to this file.
version: 1
eval_data: eval
calibration_data: calib
task_metric: minilm_metric.py:embedding_cosine
shapes: {{input_ids: [1, 128], attention_mask: [1, 128]}}
provider: CPUExecutionProvider
threads: {threads}
warmup: {warmup}
iterations: {iterations}
configurations:
  - name: fp32-fused
    passes: [cleanup, fuse]
    options: {{target: ort}}
  - name: fp16
    passes: [cleanup, fp16]
  - name: int8
    passes: [cleanup, qdq-int8]
  - name: int8-budget
    passes: [cleanup, qdq-int8]
    options: {{accuracy-budget: "cosine>=0.99"}}
  - name: pruned
    passes: [cleanup, prune-structured]
    options: {{ratio: 0.25}}
"""


def prepare(out: Path, *, threads: int = 2, warmup: int = 10, iterations: int = 100) -> Path:
    """Export MiniLM and write its data, metric and sweep config into ``out``; return the model path."""
    from models import minilm
    from models.sentences import CALIBRATION, EVALUATION

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out.mkdir(parents=True, exist_ok=True)
    model = out / "minilm.onnx"
    if not model.exists():
        t = time.perf_counter()
        minilm.export_minilm(model)
        print(f"exported {model} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    tok = minilm.load_tokenizer()
    for name, sentences in (("eval", EVALUATION), ("calib", CALIBRATION)):
        folder = out / name
        folder.mkdir(exist_ok=True)
        for i, s in enumerate(sentences):
            feed = minilm.tokenize(tok, [s])
            np.savez(folder / f"{i:04d}.npz", **feed)
    (out / "minilm_metric.py").write_text(textwrap.dedent(METRIC).lstrip())
    (out / "sweep.yaml").write_text(CONFIG.format(threads=threads, warmup=warmup, iterations=iterations))
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the model, data, config and ledger")
    ap.add_argument("--executor", default="local", choices=("local", "ray"))
    ap.add_argument("--workers", type=int, help="with --executor ray: CPUs of the local Ray instance")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of the timed sessions (default 2)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--keep-models", action="store_true", help="keep the built models in OUT/models")
    args = ap.parse_args(argv)
    out = Path(args.out)
    model = prepare(out, threads=args.threads, warmup=args.warmup, iterations=args.iterations)
    from mograph.cli import main as mograph

    cmd = ["sweep", str(model), "--config", str(out / "sweep.yaml"), "--ledger", str(out / "ledger.db"),
           "--executor", args.executor]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    if args.keep_models:
        (out / "models").mkdir(exist_ok=True)
        cmd += ["--keep-models", str(out / "models")]
    t = time.perf_counter()
    code = mograph(cmd)
    print(f"sweep took {time.perf_counter() - t:.1f} s (exit {code})", file=sys.stderr)
    mograph(["ledger", "list", "--ledger", str(out / "ledger.db")])
    return code


if __name__ == "__main__":
    raise SystemExit(main())
