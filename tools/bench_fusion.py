"""Benchmark mograph's fusion passes against ONNX Runtime's transformers optimizer, side by side.

For each model (BERT and GPT-2 exported with torch from random-weight ``transformers`` configs, at
the given layer counts and hidden size) and in the same run:

* fusion time: mograph's ``fuse`` preset (``--target ort``) vs
  ``onnxruntime.transformers.optimizer.optimize_model`` (``opt_level=0``: its Python fusions only),
  both on the same loaded model, as a ratio;
* instances fused: LayerNorm-family nodes (``LayerNormalization``, ``SkipLayerNormalization``,
  ``SimplifiedLayerNormalization`` ...) and GELU-family nodes (``Gelu``, ``FastGelu``, ``BiasGelu``,
  ``QuickGelu``) in each output;
* ONNX Runtime CPU latency (``--threads`` intra-op threads, graph optimizations as ``--ort-level``)
  of the original, mograph's output and that optimizer's output.

Usage::

    python tools/bench_fusion.py --kinds bert gpt2 --layers 12 48 --hidden 768 --opset 14

Coverage across exporters (``--exports``, each ``EXPORTER:OPSET``): the ORT optimizer expects the
TorchScript opset-14 forms; the dynamo exporter (opset 18) and LLaMA's RMSNorm are where the forms
differ.  For counts only, at small sizes::

    python tools/bench_fusion.py --kinds bert gpt2 llama --layers 4 --exports torchscript:14 dynamo:18 \
        --no-latency --by-op

``--by-op`` prints, per export, how many LayerNorm, SkipLayerNorm, RMSNorm (ORT's
``SimplifiedLayerNormalization``, ONNX ``RMSNormalization``), SkipRMSNorm
(``SkipSimplifiedLayerNormalization``), EmbedLayerNorm and GELU-family (``Gelu``, ``FastGelu``,
``BiasGelu``, ``QuickGelu``) nodes the original, mograph (``--target ort``) and the ORT optimizer
(``model_type`` ``bert`` for BERT, ``gpt2`` for GPT-2 and LLaMA, which it has no type of its own for)
hold.  Combinations the exporter cannot produce (``models.export_hf.SUPPORTED``) are skipped with a note.

Exports are cached in ``--cache`` (default ``/tmp/mograph-bench``).  Prints a table; ``--json`` writes
the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NORM_OPS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "LayerNorm", "RMSNorm", "SkipLayerNorm")
GELU_OPS = ("Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasFastGelu")

#: ``--by-op`` columns: category -> op types (standard, ORT contrib or mograph) counted in it.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "LayerNorm": ("LayerNormalization", "LayerNorm"),
    "SkipLayerNorm": ("SkipLayerNormalization", "SkipLayerNorm"),
    "RMSNorm": ("SimplifiedLayerNormalization", "RMSNormalization", "RMSNorm"),
    "SkipRMSNorm": ("SkipSimplifiedLayerNormalization",),
    "EmbedLayerNorm": ("EmbedLayerNormalization",),
    "GELU": GELU_OPS,
}
#: ``optimize_model``'s ``model_type`` per kind (it has no LLaMA type; its decoder fusions are gpt2's).
ORT_MODEL_TYPE = {"bert": "bert", "gpt2": "gpt2", "llama": "gpt2", "vit": "vit"}


def _by_op(proto: onnx.ModelProto) -> dict[str, int]:
    ops = Counter(n.op_type for n in proto.graph.node)
    return {cat: sum(ops[o] for o in names) for cat, names in CATEGORIES.items()}


def _count(proto: onnx.ModelProto) -> tuple[int, int]:
    ops = Counter(n.op_type for n in proto.graph.node)
    return sum(ops[o] for o in NORM_OPS), sum(ops[o] for o in GELU_OPS)


def _latency(proto: onnx.ModelProto, feeds: dict[str, np.ndarray], threads: int, level: str, repeat: int) -> float:
    from tools.ort_cpu import cpu_session

    sess = cpu_session(proto, threads, level)
    names = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    for _ in range(3):
        sess.run(None, feeds)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_one(kind: str, layers: int, args: argparse.Namespace, exporter: str | None = None,
              opset: int | None = None) -> dict:
    import onnx_ir as ir
    from onnxruntime.transformers.optimizer import optimize_model

    from models import export_hf
    from mograph.plugins import get_registry

    exporter = exporter or args.exporter
    opset = opset or args.opset
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{kind}_{exporter}_{opset}_L{layers}_H{args.hidden}.onnx"
    t = time.perf_counter()
    if not path.exists():
        export_hf.export(kind, path, exporter=exporter, opset=opset, layers=layers, hidden=args.hidden)
    export_s = time.perf_counter() - t
    proto = onnx.load(str(path))

    reg = get_registry()
    model = ir.serde.deserialize_model(proto)
    t = time.perf_counter()
    for p in reg.instantiate(reg.expand("fuse"), {"target": "ort"}):
        p.call(model)
    mograph_s = time.perf_counter() - t
    ours = ir.serde.serialize_model(model)

    t = time.perf_counter()
    theirs_opt = optimize_model(str(path), model_type=ORT_MODEL_TYPE.get(kind, kind), num_heads=export_hf.HEADS,
                                hidden_size=args.hidden, opt_level=0, use_gpu=False)
    ort_s = time.perf_counter() - t
    theirs = theirs_opt.model

    feeds = export_hf.sample_feeds(kind, args.batch, args.seq, seed=0)
    row = {
        "kind": kind, "exporter": exporter, "opset": opset, "layers": layers, "hidden": args.hidden,
        "export_s": round(export_s, 1),
        "mograph_fuse_s": round(mograph_s, 3), "ort_optimizer_s": round(ort_s, 3),
        "time_ratio": round(mograph_s / ort_s, 3),
        "norms": {"original": _count(proto)[0], "mograph": _count(ours)[0], "ort_optimizer": _count(theirs)[0]},
        "gelus": {"original": _count(proto)[1], "mograph": _count(ours)[1], "ort_optimizer": _count(theirs)[1]},
        "by_op": {"original": _by_op(proto), "mograph": _by_op(ours), "ort_optimizer": _by_op(theirs)},
    }
    if not args.no_latency:
        row["latency_ms"] = {
            name: round(_latency(m, feeds, args.threads, args.ort_level, args.repeat), 3)
            for name, m in (("original", proto), ("mograph", ours), ("ort_optimizer", theirs))
        }
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["bert", "gpt2"])
    ap.add_argument("--layers", nargs="+", type=int, default=[12, 48])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--exporter", default="torchscript", choices=["torchscript", "dynamo"])
    ap.add_argument("--opset", type=int, default=14)
    ap.add_argument("--exports", nargs="+", metavar="EXPORTER:OPSET", type=_export_spec,
                    help="run each model for each of these exports (e.g. torchscript:14 dynamo:18); "
                    "default: --exporter at --opset")
    ap.add_argument("--by-op", action="store_true",
                    help="print the per-op-type count table (LayerNorm, SkipLayerNorm, RMSNorm, SkipRMSNorm, "
                    "EmbedLayerNorm, GELU) for the original, mograph and the ORT optimizer")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ort-level", default="disable", choices=["disable", "basic", "all"],
                    help="ONNX Runtime graph optimizations when measuring latency (default: disable, so the "
                    "offline fusions are what is measured)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--cache", default="/tmp/mograph-bench")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    from models import export_hf

    exports = args.exports or [(args.exporter, args.opset)]
    rows = []
    for kind in args.kinds:
        for exporter, opset in exports:
            if opset not in export_hf.SUPPORTED.get((kind, exporter), ()):
                sys.stdout.write(f"{kind:5s} {exporter}:{opset}: skipped (the exporter cannot produce it)\n")
                continue
            for layers in args.layers:
                row = bench_one(kind, layers, args, exporter, opset)
                rows.append(row)
                lat = row.get("latency_ms", {})
                sys.stdout.write(
                    f"{kind:5s} {exporter}:{opset} L={layers:<3d} fuse: mograph {row['mograph_fuse_s']:.3f}s vs "
                    f"ORT optimizer {row['ort_optimizer_s']:.3f}s (ratio {row['time_ratio']:.2f}) | "
                    f"norms {row['norms']} | gelus {row['gelus']} | latency ms {lat}\n"
                )
                sys.stdout.flush()
    if args.by_op:
        sys.stdout.write(_by_op_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _export_spec(text: str) -> tuple[str, int]:
    exporter, _, opset = text.partition(":")
    if exporter not in ("torchscript", "dynamo") or not opset.isdigit():
        raise argparse.ArgumentTypeError(f"expected EXPORTER:OPSET with EXPORTER torchscript or dynamo, not {text!r}")
    return exporter, int(opset)


def _by_op_table(rows: list[dict]) -> str:
    """Markdown table: per export, each category as original / mograph / ORT optimizer."""
    cats = list(CATEGORIES)
    lines = ["", "| model | export | L | " + " | ".join(cats) + " |",
             "|---|---|---|" + "---|" * len(cats),
             ]
    for row in rows:
        by = row["by_op"]
        cells = [f"{by['original'][c]} / {by['mograph'][c]} / {by['ort_optimizer'][c]}" for c in cats]
        lines.append(f"| {row['kind']} | {row['exporter']}:{row['opset']} | {row['layers']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("cells: original / mograph (fuse, --target ort) / ORT transformers optimizer (opt_level 0)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
