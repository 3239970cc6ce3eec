"""Where ONNX Runtime puts its Memcpy nodes: the graph a CUDA session really runs, after partitioning.

    python tools/ort_memcpy.py a.onnx [b.onnx ...] [--device cuda] [--json out.json]

For each model, a session (all graph optimizations, CUDA then CPU provider) saves the graph it runs
(``optimized_model_filepath``, initializers to a side file), and this prints every ``MemcpyToHost`` /
``MemcpyFromHost`` node with the node that produces its input and the nodes that read its output, plus the
nodes assigned to the CPU provider (by op type).  That answers "which edge does this Memcpy sit on" where
ONNX Runtime's profile only counts them.  Needs onnxruntime-gpu for ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any


def memcpy_edges(path: str, device: str = "cuda") -> dict[str, Any]:
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="ort-memcpy-") as tmp:
        opt = str(Path(tmp) / "optimized.onnx")
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = opt
        so.log_severity_level = 3
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        ort.InferenceSession(path, so, providers=providers)
        model = onnx.load(opt, load_external_data=False)
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    graph_inputs = {i.name for i in model.graph.input}
    graph_outputs = {o.name for o in model.graph.output}

    def who(name: str) -> str:
        if name in graph_inputs:
            return f"graph input {name}"
        n = producer.get(name)
        return f"{n.op_type} {n.name}" if n is not None else f"initializer {name}"

    copies = []
    for n in nodes:
        if n.op_type.startswith("Memcpy"):
            out = n.output[0]
            copies.append({"op": n.op_type, "name": n.name, "tensor": n.input[0], "from": who(n.input[0]),
                           "to": [f"{r.op_type} {r.name}" for r in readers.get(out, [])]
                           + (["graph output"] if out in graph_outputs else [])})
    # ORT >= 1.17 records the provider of each node in the saved graph only implicitly; count by op type
    return {"model": path, "nodes": len(nodes), "memcpy": copies,
            "ops": dict(Counter(n.op_type for n in nodes).most_common())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON too")
    args = ap.parse_args(argv)
    results = []
    for path in args.models:
        try:
            r = memcpy_edges(path, args.device)
        except Exception as exc:  # noqa: BLE001 - one line per model that fails; the others go on
            r = {"model": path, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        results.append(r)
        if "error" in r:
            print(f"{path}: ERROR {r['error']}")
            continue
        print(f"{path}: {r['nodes']} nodes, {len(r['memcpy'])} Memcpy")
        for c in r["memcpy"]:
            print(f"  {c['op']} of {c['tensor']!r}: from {c['from']} -> {', '.join(c['to']) or '-'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
