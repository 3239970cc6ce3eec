"""Benchmark INT8 quantization of all-MiniLM-L6-v2 on ONNX Runtime CPU: mograph vs onnxruntime.quantization.

One run, side by side, on the same exported FP32 model (real trained weights):

- ``fp32``: the exported model;
- ``mograph int8``: ``qdq-int8`` with its default rules (MinMax, calibration sentences);
- ``mograph int8 budget``: ``qdq-int8 --accuracy-budget cosine>=0.99``;
- ``ort static``: ``quantize_static`` (QDQ, per-channel, UINT8 activations / INT8 weights, MinMax) on the
  same calibration sentences;
- ``ort dynamic``: ``quantize_dynamic`` (INT8 weights, activations quantized at run time).

Latency: ONNX Runtime CPU, all graph optimizations on, 2 intra-op threads, batch 1 and 8 at sequence 128
(real sentences padded to 128 tokens), median of timed runs after warm-up.  Accuracy: mean-pooled sentence
embeddings of every sentence of ``models.sentences.EVALUATION`` (batch 1, no padding) against FP32: mean and
minimum cosine similarity.  Size: the saved ``.onnx`` file.

Run: ``python tools/bench_quant.py [--out DIR] [--runs N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import minilm  # noqa: E402
from models.sentences import CALIBRATION, EVALUATION  # noqa: E402


def _session(path: Path, optimize: bool = True, threads: int = 2):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _embeddings(sess, tok) -> np.ndarray:  # type: ignore[no-untyped-def]
    out = []
    for s in EVALUATION:
        feed = minilm.tokenize(tok, [s])
        out.append(minilm.mean_pool(sess.run(None, feed)[0], feed["attention_mask"])[0])
    return np.array(out)


def _latency(sess, feed: dict, runs: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        sess.run(None, feed)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the models (default: a temporary folder)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per configuration and batch")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import onnx_ir as ir
    from mograph.passes.quant.qdq_int8 import QdqInt8Pass
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    out = Path(args.out or tempfile.mkdtemp(prefix="bench_quant_"))
    out.mkdir(parents=True, exist_ok=True)
    tok = minilm.load_tokenizer()
    fp32 = minilm.export_minilm(out / "minilm.fp32.onnx")
    calib = [minilm.tokenize(tok, [s]) for s in CALIBRATION]
    paths = {"fp32": fp32}
    seconds = {}

    for label, extra in (("mograph int8", {}), ("mograph int8 budget", {"accuracy_budget": "cosine>=0.99"})):
        model = ir.load(str(fp32))
        t = time.perf_counter()
        QdqInt8Pass(calibration_data=calib, **extra).call(model)
        seconds[label] = time.perf_counter() - t
        path = out / f"minilm.{label.replace(' ', '_')}.onnx"
        ir.save(model, str(path))
        paths[label] = path

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(calib)

        def get_next(self):  # type: ignore[no-untyped-def]
            return next(self.it, None)

    t = time.perf_counter()
    quantize_static(
        str(fp32),
        str(out / "minilm.ort_static.onnx"),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    seconds["ort static"] = time.perf_counter() - t
    paths["ort static"] = out / "minilm.ort_static.onnx"
    t = time.perf_counter()
    quantize_dynamic(str(fp32), str(out / "minilm.ort_dynamic.onnx"), weight_type=QuantType.QInt8)
    seconds["ort dynamic"] = time.perf_counter() - t
    paths["ort dynamic"] = out / "minilm.ort_dynamic.onnx"

    ref = _embeddings(_session(fp32, optimize=False), tok)
    pad = {b: minilm.tokenize(tok, list(EVALUATION[:b]), pad_to=128) for b in (1, 8)}
    rows = []
    for label, path in paths.items():
        sess = _session(path)
        cos = minilm.cosine_rows(ref, _embeddings(sess, tok))
        lat = {b: _latency(sess, pad[b], args.runs if b == 1 else max(args.runs // 2, 5)) for b in (1, 8)}
        rows.append((label, lat, cos, path.stat().st_size / 2**20))
    base = rows[0][1]
    print(f"all-MiniLM-L6-v2, ONNX Runtime CPU, 2 threads, seq 128, {len(EVALUATION)} evaluation sentences, "
          f"{len(CALIBRATION)} calibration sentences")
    print(f"{'model':<22}{'b1 ms':>8}{'x fp32':>8}{'b8 ms':>9}{'x fp32':>8}{'cos mean':>10}{'cos min':>9}"
          f"{'MiB':>7}{'quant s':>9}")
    for label, lat, cos, mib in rows:
        q = f"{seconds[label]:.1f}" if label in seconds else "-"
        print(f"{label:<22}{lat[1]:>8.2f}{lat[1] / base[1]:>8.2f}{lat[8]:>9.2f}{lat[8] / base[8]:>8.2f}"
              f"{cos.mean():>10.5f}{cos.min():>9.5f}{mib:>7.1f}{q:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
