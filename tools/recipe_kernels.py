"""Per-kernel timings behind the precision recipe (``mograph.passes.quant.recipe``): one-node graphs, ONNX Runtime.

Each lowering of a low-precision MatMul ``[M, K] x [K, N]`` is timed alone against the device's float MatMul
(float32 on the CPU, float16 on CUDA), median wall milliseconds per ``run`` over ``--runs`` runs:

- ``float``: ``MatMul``;
- ``nbits4_b32`` / ``nbits4_b128`` / ``nbits8_b32`` / ``nbits8_b128``: ``com.microsoft.MatMulNBits`` (weight-only,
  float activations, no zero points); with ``--fpa`` also ``nbits4_b32+fpa`` / ``nbits8_b32+fpa``: the same graphs
  with the session config entry ``ep.cuda.fpa_intb_gemm=1`` (ONNX Runtime's CUTLASS weight-only GEMM and GEMV,
  which take blocks of 32 without zero points or bias; off by default in onnxruntime-gpu 1.31);
- ``matmulinteger``: ``DynamicQuantizeLinear`` + ``MatMulInteger`` + rescale (INT8 activations and weights);
- ``qdq_a8w8``: ``QuantizeLinear``/``DequantizeLinear`` on the activation and an INT8 weight's
  ``DequantizeLinear`` before ``MatMul`` (ONNX Runtime's optimizations on, so it may fuse them to ``QLinearMatMul``).

The CPU table in the recipe was made with::

    OMP_NUM_THREADS=2 python tools/recipe_kernels.py --device cpu --k 2048 --n 2048 --m 1,128 --runs 30

(on the 2-core development machine, other work running: ratios, not absolute figures, are what the recipe uses).
With ``--device cuda`` (onnxruntime-gpu) the feeds and outputs are bound on the GPU (IO binding).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

MS = "com.microsoft"


def _model(nodes: list[Any], inits: list[Any], a_type: int, k: int, n: int) -> bytes:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", a_type, ["M", k])],
                              [helper.make_tensor_value_info("Y", a_type, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model.SerializeToString()


def graphs(k: int, n: int, half: bool) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    ft = np.float16 if half else np.float32
    a_type = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    w = (rng.standard_normal((k, n)) * 0.02).astype(ft)
    out: dict[str, bytes] = {}
    out["float"] = _model([helper.make_node("MatMul", ["A", "W"], ["Y"])],
                          [onnx.numpy_helper.from_array(w, "W")], a_type, k, n)
    for bits, bs in ((4, 32), (4, 128), (8, 32), (8, 128)):
        blocks = k // bs
        b = rng.integers(0, 256, (n, blocks, bs * bits // 8), dtype=np.uint8)
        s = (rng.random((n, blocks)) * 0.01).astype(ft)
        node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain=MS, K=k, N=n, bits=bits, block_size=bs)
        out[f"nbits{bits}_b{bs}"] = _model([node], [onnx.numpy_helper.from_array(b, "B"),
                                                    onnx.numpy_helper.from_array(s, "S")], a_type, k, n)
    wq = rng.integers(-127, 128, (k, n), dtype=np.int8)
    ws = np.full((n,), 0.001, ft)
    # INT8 activations through MatMulInteger: y = (qa - za) @ qw * (sa * sw)
    a32 = ["A"] if not half else ["A32"]
    nodes = [] if not half else [helper.make_node("Cast", ["A"], ["A32"], to=TensorProto.FLOAT)]
    nodes += [helper.make_node("DynamicQuantizeLinear", a32, ["qa", "sa", "za"]),
              helper.make_node("MatMulInteger", ["qa", "WQ", "za"], ["acc"]),
              helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
              helper.make_node("Mul", ["sa", "WS32"], ["sc"]),
              helper.make_node("Mul", ["accf", "sc"], ["Y32" if half else "Y"])]
    if half:
        nodes.append(helper.make_node("Cast", ["Y32"], ["Y"], to=TensorProto.FLOAT16))
    out["matmulinteger"] = _model(nodes, [onnx.numpy_helper.from_array(wq, "WQ"),
                                          onnx.numpy_helper.from_array(ws.astype(np.float32), "WS32")], a_type, k, n)
    sa = np.array(0.02, ft)
    nodes = [helper.make_node("QuantizeLinear", ["A", "SA"], ["qa"]),
             helper.make_node("DequantizeLinear", ["qa", "SA"], ["da"]),
             helper.make_node("DequantizeLinear", ["WQ", "WS"], ["dw"], axis=1),
             helper.make_node("MatMul", ["da", "dw"], ["Y"])]
    out["qdq_a8w8"] = _model(nodes, [onnx.numpy_helper.from_array(sa, "SA"), onnx.numpy_helper.from_array(wq, "WQ"),
                                     onnx.numpy_helper.from_array(ws, "WS")], a_type, k, n)
    return out


def time_all(models: dict[str, bytes], ms: list[int], k: int, device: str, runs: int,
             configs: dict[str, tuple[str, dict[str, str]]] | None = None) -> dict[str, list[float]]:
    """Median wall ms per label; ``configs`` adds labels: ``label -> (graph label, session config entries)``."""
    import onnxruntime as ort

    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    half = device == "cuda"
    result: dict[str, list[float]] = {}
    runs_of = {label: (data, {}) for label, data in models.items()}
    runs_of |= {label: (models[base], cfg) for label, (base, cfg) in (configs or {}).items()}
    for label, (data, cfg) in runs_of.items():
        so = ort.SessionOptions()
        so.log_severity_level = 3
        for key, value in cfg.items():
            so.add_session_config_entry(key, value)
        try:
            sess = ort.InferenceSession(data, so, providers=providers)
        except Exception as exc:  # noqa: BLE001 - a lowering the runtime lacks is a row saying so
            print(f"{label}: no session ({str(exc).splitlines()[0][:120]})")
            continue
        row = []
        for m in ms:
            a = np.random.default_rng(1).standard_normal((m, k)).astype(np.float16 if half else np.float32)
            if device == "cuda":
                binding = sess.io_binding()
                binding.bind_ortvalue_input("A", ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0))
                binding.bind_output("Y", "cuda")
                run = functools.partial(sess.run_with_iobinding, binding)
            else:
                run = functools.partial(sess.run, None, {"A": a})
            for _ in range(3):
                run()
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            row.append(round(statistics.median(times) * 1000, 4))
        result[label] = row
        print(f"{label:<16}" + "".join(f"{v:>10.4f}" for v in row), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--m", default="1,128", help="comma-separated row counts")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", help="also write the table here")
    ap.add_argument("--fpa", action="store_true",
                    help="also time the 32-blocks with ep.cuda.fpa_intb_gemm=1 (CUDA: ONNX Runtime's CUTLASS kernels)")
    args = ap.parse_args(argv)
    ms = [int(x) for x in args.m.split(",")]
    print(f"device {args.device}, [M, {args.k}] x [{args.k}, {args.n}], median wall ms for M = {ms}")
    fpa = {f"{g}+fpa": (g, {"ep.cuda.fpa_intb_gemm": "1"}) for g in ("nbits4_b32", "nbits8_b32")} if args.fpa else {}
    table = time_all(graphs(args.k, args.n, args.device == "cuda"), ms, args.k, args.device, args.runs, fpa)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "k": args.k, "n": args.n, "m": ms, "ms": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
