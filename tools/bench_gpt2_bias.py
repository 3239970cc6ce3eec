"""Bias adds left on GPT-2 after fusion: mograph ``cleanup,fuse --target ort`` vs ONNX Runtime's transformers optimizer.

A small GPT-2 (``transformers.GPT2Config``, seeded random weights, ``--layers`` layers, hidden ``--hidden``,
TorchScript export, opset 18; :func:`models.export_hf.export`) is optimized by both tools in one run.
Counted in each graph: ``Add`` nodes with a constant input (a bias or a constant added on its own),
``Gemm`` nodes that still carry a bias ``C`` (ONNX Runtime's CUDA ``Gemm`` first broadcasts ``C`` into its
output with a kernel of its own), the fused ops that took a bias in (``SkipLayerNormalization`` with its
bias input, ``FastGelu``/``BiasGelu`` with a bias), and every op outside the default domain (all must be
ops ONNX Runtime's CUDA provider implements, or the CUDA graph gets Memcpy nodes;
``tools/ort_memcpy.py --device cuda`` lists those on the device).  Numbers: the largest difference of each
optimized graph from the exported one on seeded feeds (ONNX Runtime CPU, optimizations off).

Run: ``python tools/bench_gpt2_bias.py [--layers 2] [--hidden 64] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnx  # noqa: E402


def counts(proto: onnx.ModelProto) -> dict[str, object]:
    nodes = list(proto.graph.node)
    consts = {t.name for t in proto.graph.initializer} | {o for n in nodes if n.op_type == "Constant" for o in n.output}
    present = {name for n in nodes for name in n.input if name}

    def has(n: onnx.NodeProto, i: int) -> bool:
        return len(n.input) > i and bool(n.input[i]) and n.input[i] in present

    return {
        "bias_add": sum(1 for n in nodes if n.op_type == "Add" and any(i in consts for i in n.input)),
        "gemm_c": sum(1 for n in nodes if n.op_type == "Gemm" and has(n, 2)),
        "skip_bias": sum(1 for n in nodes if n.op_type == "SkipLayerNormalization" and has(n, 4)),
        "gelu_bias": sum(1 for n in nodes if n.op_type in ("FastGelu", "BiasGelu") and has(n, 1)),
        "contrib": dict(Counter(f"{n.domain}.{n.op_type}" for n in nodes if n.domain not in ("", "ai.onnx"))),
    }


def run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", default="/tmp/mograph_bench_gpt2_bias")
    args = ap.parse_args(argv)
    from onnxruntime.transformers.optimizer import optimize_model

    import mograph
    from models import export_hf

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = export_hf.export("gpt2", out / "gpt2.onnx", opset=18, layers=args.layers, hidden=args.hidden).path
    graphs = {"exported": onnx.load(str(src))}
    opt = optimize_model(str(src), model_type="gpt2", num_heads=export_hf.HEADS, hidden_size=args.hidden)
    graphs["ORT transformers optimizer"] = opt.model
    fused, _ = mograph.optimize(str(src), "cleanup,fuse", options={"target": "ort"})
    mograph.save(fused, str(out / "gpt2.mograph.onnx"), overwrite=True)
    graphs["mograph cleanup,fuse --target ort"] = onnx.load(str(out / "gpt2.mograph.onnx"))
    feeds = export_hf.sample_feeds("gpt2", 2, 16, seed=1)
    ref = run(graphs["exported"], feeds)
    print(f"GPT-2 ({args.layers} layers, hidden {args.hidden}, random weights, TorchScript opset 18)\n")
    print(f"{'graph':36} {'bias Add':>8} {'Gemm+C':>7} {'bias kernels':>12} {'Skip+bias':>9} {'Gelu+bias':>9} "
          f"{'max|diff|':>10}")
    for label, proto in graphs.items():
        c = counts(proto)
        diff = float(np.abs(run(proto, feeds) - ref).max())
        print(f"{label:36} {c['bias_add']:8d} {c['gemm_c']:7d} {c['bias_add'] + c['gemm_c']:12d} "  # type: ignore[operator]
              f"{c['skip_bias']:9d} {c['gelu_bias']:9d} {diff:10.2e}")
    print("\nops outside the default domain:")
    for label, proto in graphs.items():
        print(f"  {label}: {counts(proto)['contrib']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
