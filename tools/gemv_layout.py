"""Does the weight layout change how fast ONNX Runtime CUDA reads float16 weights in decode? One run, one GPU.

A decoder's decode step is a chain of GEMVs: every weight is read once per step, so the step cannot be faster
than its weights' bytes over the GPU's memory bandwidth.  This tool times chains of ``L`` float16 projections
(``K -> N -> K``, distinct weights, 2 x L x K x N x 2 bytes) written three ways, as CUDA graphs (no launch gaps)
and plainly, at a few row counts ``M``:

- ``matmul``: ``MatMul(x, W[K, N])`` (what exporters write, and mograph's and ONNX Runtime GenAI's graphs);
- ``gemm_tb``: ``Gemm(x, W[N, K], transB=1)`` (2-D input only);
- ``fused_tb``: ``com.microsoft.FusedMatMul(x, W[N, K], transB=1)``.

It prints median ms per chain and the weights' bytes / time (GB/s), so the layout a decode graph should use is
measured, not guessed.  Usage (onnxruntime-gpu)::

    python tools/gemv_layout.py --k 2048 --n 8192 --layers 16 --m 1,8,512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


def chain(kind: str, k: int, n: int, layers: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    cur = "x"
    for i in range(2 * layers):
        kin, kout = (k, n) if i % 2 == 0 else (n, k)
        w = (rng.standard_normal((kin, kout)) * (1.0 / np.sqrt(kin))).astype(np.float16)
        out = f"h{i}"
        if kind == "matmul":
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("MatMul", [cur, f"w{i}"], [out]))
        elif kind == "gemm_tb":
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"w{i}"))
            nodes.append(helper.make_node("Gemm", [cur, f"w{i}"], [out], transB=1))
        elif kind == "fused_tb":
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"w{i}"))
            nodes.append(helper.make_node("FusedMatMul", [cur, f"w{i}"], [out], domain=MS, transB=1, alpha=1.0))
        else:
            raise ValueError(kind)
        cur = out
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["M", k])],
                              [helper.make_tensor_value_info(cur, TensorProto.FLOAT16, ["M", k])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 9
    return model.SerializeToString()


def time_one(data: bytes, m: int, k: int, cuda_graph: bool, runs: int) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_free_dimension_override_by_name("M", m)
    sess = ort.InferenceSession(data, so, providers=[("CUDAExecutionProvider",
                                                     {"enable_cuda_graph": "1" if cuda_graph else "0"})])
    x = ort.OrtValue.ortvalue_from_numpy(np.random.default_rng(1).standard_normal((m, k)).astype(np.float16), "cuda", 0)
    out = sess.get_outputs()[0]
    y = ort.OrtValue.ortvalue_from_shape_and_type([m, k], np.float16, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x)
    io.bind_ortvalue_output(out.name, y)
    for _ in range(5):
        sess.run_with_iobinding(io)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--m", default="1,8,512")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--kinds", default="matmul,gemm_tb,fused_tb")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch  # noqa: F401  (loads the CUDA libraries ONNX Runtime's provider needs)

    nbytes = 2 * args.layers * args.k * args.n * 2
    rows: list[dict[str, Any]] = []
    print(f"chain of {2 * args.layers} projections {args.k} <-> {args.n}, {nbytes / 1e9:.3f} GB of float16 weights")
    for kind in args.kinds.split(","):
        data = chain(kind, args.k, args.n, args.layers)
        for m in (int(v) for v in args.m.split(",")):
            for graph in (True, False):
                try:
                    ms = time_one(data, m, args.k, graph, args.runs)
                    row = {"kind": kind, "m": m, "cuda_graph": graph, "ms": round(ms, 4),
                           "gb_per_s": round(nbytes / (ms / 1000) / 1e9, 1)}
                except Exception as exc:  # noqa: BLE001 - a form ORT refuses is a row saying so
                    row = {"kind": kind, "m": m, "cuda_graph": graph, "error": str(exc).splitlines()[0][:200]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"k": args.k, "n": args.n, "layers": args.layers, "bytes": nbytes, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
