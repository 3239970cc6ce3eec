"""Node counts before and after ``simplify-shapes``, side by side with ONNX Runtime's transformers optimizer.

ONNX Runtime's CUDA provider pays a CPU cost per node (and runs shape ops on the CPU), so at small
shapes latency follows the node count.  For each model of :mod:`tools.bench_gpu` (same builders, same
seeded weights, same exports; ``--full`` for the 12-layer sizes, else its 2-layer smoke sizes) this prints:

* nodes of the export, of ORT's transformers optimizer (``optimize_model``, ``use_gpu=False``, float32),
  of mograph ``cleanup,fuse,lower --target ort`` (``before``: no shape simplification) and of the default
  ``cleanup,fuse --target ort`` (``after``: the ``lower`` step is followed by the ``after-lower`` preset,
  ``simplify-shapes``, ``lower``, ``simplify-shapes``, ``cse``, ``eliminate-dead``), plus the shape ops left in each (Shape, Gather,
  Unsqueeze, Squeeze, Concat, Reshape, Slice, Expand, Range, ConstantOfShape, Where, Equal, Constant);
* the max abs difference of ``after`` against ``before`` and against the export, on ONNX Runtime CPU with
  its optimizations off, on several shapes, batch 1 and sequence lengths the export was not traced with;
* with ``--latency``, ONNX Runtime CPU latency (default optimizations, 1 thread, median) at 1x128 of
  the export, ORT-T, before and after.

No fp16 here (the GPU benchmark adds it); counts are of the float32 graphs.

Usage::

    python tools/bench_shape_nodes.py                                    # smoke sizes, every model/export/attn
    python tools/bench_shape_nodes.py --full --models bert,gpt2 --exports torchscript --attn eager --latency
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import bench_gpu as bg  # noqa: E402

SHAPE_OPS = ("Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Reshape", "Slice", "Expand", "Range",
             "ConstantOfShape", "Where", "Equal", "Constant")


def counts(proto: Any) -> tuple[int, int]:
    ops = Counter(n.op_type for n in proto.graph.node)
    return sum(ops.values()), sum(ops[k] for k in SHAPE_OPS)


def session(proto: Any, optimize: bool) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def feeds_for(model: str, kind: str, batch: int, seq: int, dims: bg.Dims) -> dict[str, np.ndarray]:
    feeds = bg.make_feeds(model, kind, batch, seq, dims, seed=batch * 1000 + seq)
    if "attention_mask" in feeds and seq > 2:
        feeds["attention_mask"][0, seq // 2 + 1:] = 0  # right padding on the first row
    return feeds


def max_diff(ra: list[np.ndarray], rb: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x.astype(np.float64) - y))) if x.size else 0.0 for x, y in zip(ra, rb))


def latency(sess: Any, feeds: dict[str, np.ndarray], runs: int) -> float:
    for _ in range(3):
        sess.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(bg.MODELS), help="comma list (default: all)")
    ap.add_argument("--exports", default=",".join(bg.EXPORTS), help="comma list (default: both)")
    ap.add_argument("--attn", default=",".join(bg.ATTNS), help="comma list (default: both)")
    ap.add_argument("--full", action="store_true", help="12-layer models (default: the 2-layer smoke sizes)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/mograph-shape-nodes"), help="export cache")
    ap.add_argument("--latency", action="store_true", help="also ORT CPU latency at 1x128 (1 thread)")
    ap.add_argument("--runs", type=int, default=30, help="timed runs per variant for --latency")
    ap.add_argument("--counts-only", action="store_true",
                    help="node counts only, one model in memory at a time (no numerics, no latency)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()

    import onnx
    import onnx_ir as ir
    from onnxruntime.transformers.optimizer import optimize_model

    import mograph

    dims = bg.FULL if args.full else bg.SMOKE
    smoke = not args.full
    args.cache.mkdir(parents=True, exist_ok=True)
    seq0 = 128 if args.full else 16
    rows = []
    print(f"{'case':34} {'export':>12} {'ort-t':>12} {'before':>12} {'after':>12}  max|after-before| / max|after-export| ...")
    for model in args.models.split(","):
        for export in args.exports.split(","):
            for attn in args.attn.split(","):
                kind = bg.graph_kind(model, bg.Shape.parse(f"1x{seq0}"), dims)
                assert kind is not None
                g = bg.graph_for(args.cache, smoke, model, export, attn, kind)
                g.folder.mkdir(parents=True, exist_ok=True)
                name = f"{model}-{export}-{attn}"
                if args.counts_only:
                    if not g.path("fp32").exists():
                        bg.export_graph(g, dims, args.cache, smoke)
                    row: dict[str, Any] = {"case": name, "full": args.full, "nodes": {}, "shape_ops": {}}
                    for k in ("export", "ort-t", "before", "after"):
                        if k == "export":
                            proto = onnx.load(str(g.path("fp32")), load_external_data=False)
                        elif k == "ort-t":
                            try:
                                proto = optimize_model(str(g.path("fp32")), model_type=bg.ORT_MODEL_TYPE[model],
                                                       num_heads=dims.heads, hidden_size=dims.hidden, use_gpu=False).model
                            except Exception as exc:  # noqa: BLE001 - the peer failing is a result too
                                print(f"{name}: ORT transformers optimizer failed: {type(exc).__name__}: {exc}")
                                continue
                        else:
                            plan = "cleanup,fuse,lower" if k == "before" else "cleanup,fuse"
                            opt, _ = mograph.optimize(str(g.path("fp32")), plan, options={"target": "ort"})
                            ops = Counter(n.op_type for n in opt.graph)
                            row["nodes"][k], row["shape_ops"][k] = sum(ops.values()), sum(ops[o] for o in SHAPE_OPS)
                            del opt
                            continue
                        row["nodes"][k], row["shape_ops"][k] = counts(proto)
                        del proto
                    fmt = "  ".join(f"{row['nodes'][k]:>5}({row['shape_ops'][k]:>4})" if k in row["nodes"] else f"{'-':>11}"
                                    for k in ("export", "ort-t", "before", "after"))
                    print(f"{name:34} {fmt}", flush=True)
                    rows.append(row)
                    continue
                try:
                    if not g.path("fp32").exists():
                        bg.export_graph(g, dims, args.cache, smoke)
                    src = onnx.load(str(g.path("fp32")))
                    try:
                        ort_t = optimize_model(str(g.path("fp32")), model_type=bg.ORT_MODEL_TYPE[model],
                                               num_heads=dims.heads, hidden_size=dims.hidden, use_gpu=False).model
                    except Exception as exc:  # noqa: BLE001 - the peer failing is a result too
                        print(f"{name}: ORT transformers optimizer failed: {type(exc).__name__}: {exc}")
                        ort_t = None
                    before, _ = mograph.optimize(str(g.path("fp32")), "cleanup,fuse,lower", options={"target": "ort"})
                    after, report = mograph.optimize(str(g.path("fp32")), "cleanup,fuse", options={"target": "ort"})
                except Exception as exc:  # noqa: BLE001 - a failed case is a row, the table goes on
                    print(f"{name:34} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                protos = {"export": src, "ort-t": ort_t, "before": ir.serde.serialize_model(before)}
                del before
                protos["after"] = ir.serde.serialize_model(after)
                del after
                protos = {k: p for k, p in protos.items() if p is not None}
                row = {"case": name, "full": args.full,
                                       "nodes": {k: counts(p)[0] for k, p in protos.items()},
                                       "shape_ops": {k: counts(p)[1] for k, p in protos.items()},
                                       "simplify_shapes": next((p.stats for p in report.passes if p.name == "simplify-shapes"), {})}
                if model in ("vit", "whisper"):
                    shapes = [(1, seq0), (3, seq0)]
                else:
                    shapes = [(1, seq0), (1, 5), (3, seq0 + 7), (2, 1)]
                feeds = {f"{b}x{s}": feeds_for(model, kind, b, s, dims) for b, s in shapes}
                # One session at a time (a 12-layer model's weights are held once per session).
                outs = {}
                for k in ("export", "before", "after"):
                    sess = session(protos[k], False)
                    outs[k] = {cell: sess.run(None, f) for cell, f in feeds.items()}
                    del sess
                diffs = {cell: (max_diff(outs["before"][cell], outs["after"][cell]),
                                max_diff(outs["export"][cell], outs["after"][cell])) for cell in feeds}
                del outs
                row["max_abs"] = diffs
                cell = "  ".join(f"{k}:{a:.1e}/{e:.1e}" for k, (a, e) in diffs.items())
                fmt = "  ".join(f"{row['nodes'][k]:>5}({row['shape_ops'][k]:>4})" if k in protos else f"{'-':>11}"
                                for k in ("export", "ort-t", "before", "after"))
                print(f"{name:34} {fmt}  {cell}", flush=True)
                if args.latency:
                    lat_feeds = feeds_for(model, kind, 1, 128, dims)
                    lat = {}
                    for k, p in protos.items():
                        sess = session(p, True)
                        lat[k] = latency(sess, lat_feeds, args.runs)
                        del sess
                    row["ort_cpu_ms_1x128"] = lat
                    print(f"{'':34} ORT CPU 1x128 ms: " + "  ".join(f"{k} {v:.3f}" for k, v in lat.items()), flush=True)
                del protos
                rows.append(row)
    print("nodes(shape ops): export, ORT transformers optimizer, mograph without / with simplify-shapes")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
