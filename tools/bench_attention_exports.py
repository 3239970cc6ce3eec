"""Attention fusion over the export corpus: how many attention instances each export has, how many fused.

For every case of :mod:`models.attention_corpus` (family x exporter x transformers attention
implementation x mask) it exports the tiny model (cached in ``--cache``), runs ``cleanup,fuse --target
ort`` (``--target`` to change), and prints one row: attention instances in the model, ``AttentionFusion``
count, the ops the fused attention became, the near-miss reasons (``--explain``), and the cosine
similarity and max abs error of the optimized model against the unfused export, both on ONNX Runtime's
CPU provider with its graph optimizations off, on right-padded feeds.

Usage::

    python tools/bench_attention_exports.py                  # the whole corpus
    python tools/bench_attention_exports.py --family bert gpt2 --exporter dynamo --explain

The export of a case needs torch and transformers; ``--json FILE`` writes the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ATTENTION_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding")


def _run_ort(proto: object, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    from mograph.testing import run_ort

    return run_ort(proto, feeds)  # type: ignore[arg-type]


def _cosine(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    x = np.concatenate([v.astype(np.float64).reshape(-1) for v in a])
    y = np.concatenate([v.astype(np.float64).reshape(-1) for v in b])
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-300))


def run_case(case: Any, cache: Path, target: str, explain: bool) -> dict[str, Any]:
    import onnx
    import onnx_ir as ir

    from models import attention_corpus as corpus
    from mograph.plugins import get_registry

    path = cache / f"{case.name}.onnx"  # type: ignore[attr-defined]
    row: dict[str, Any] = {"case": case.name, "instances": case.attention_count}  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    try:
        if not path.exists():
            with contextlib.redirect_stdout(io.StringIO()):  # torch prints its IR when an export fails
                corpus.export(case, path)
    except Exception as exc:  # noqa: BLE001 - a failed export is a row of the table, not a crash
        row["error"] = f"export failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return row
    proto = onnx.load(str(path))
    model = ir.serde.deserialize_model(proto)
    reg = get_registry()
    config = {"target": target, "explain": explain}
    fused, reasons, lowered = 0, [], Counter[str]()
    for p in reg.instantiate(reg.plan("cleanup,fuse", config), config):
        result = p.call(model)
        fused += int(result.stats.get("AttentionFusion", 0))
        if p.name == "fuse-attention":
            for rule in result.details.get("rules", {}).values():
                reasons += [m["reason"] for m in rule.get("near_miss_list", [])]
    for node in model.graph:
        if node.op_type in ATTENTION_OPS or node.op_type == "Softmax":
            lowered[f"{node.domain + '.' if node.domain else ''}{node.op_type}"] += 1
    row.update(fused=fused, ops=dict(lowered), reasons=sorted(set(reasons)))
    feeds = corpus.feeds(case)  # type: ignore[arg-type]
    try:
        ref = _run_ort(proto, feeds)
        got = _run_ort(ir.serde.serialize_model(model), feeds)
        row["cosine"] = min(_cosine([r], [g]) for r, g in zip(ref, got))
        row["max_abs"] = max(float(np.max(np.abs(r.astype(np.float64) - g))) for r, g in zip(ref, got))
    except Exception as exc:  # noqa: BLE001 - an optimized model ORT cannot run is a finding
        row["error"] = f"ORT failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    from models import attention_corpus as corpus

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="*", choices=corpus.FAMILIES, help="families to run (default: all)")
    ap.add_argument("--exporter", nargs="*", choices=corpus.EXPORTERS, help="exporters (default: both)")
    ap.add_argument("--attn", nargs="*", choices=corpus.ATTNS, help="attention implementations (default: both)")
    ap.add_argument("--mask", nargs="*", choices=corpus.MASKS, help="masks (default: both)")
    ap.add_argument("--target", default="ort", help="lowering target (default: ort)")
    ap.add_argument("--explain", action="store_true", help="print why attention did not fuse")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/mograph-attn-corpus"), help="export cache folder")
    ap.add_argument("--json", type=Path, help="write the rows to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.cache.mkdir(parents=True, exist_ok=True)
    cases = [c for c in corpus.all_cases()
             if (not args.family or c.family in args.family) and (not args.exporter or c.exporter in args.exporter)
             and (not args.attn or c.attn in args.attn) and (not args.mask or c.mask in args.mask)]
    rows: list[dict[str, Any]] = []
    print(f"{'case':40s} {'inst':>4s} {'fused':>5s} {'cosine':>10s} {'max_abs':>9s}  lowered to")
    for case in cases:
        row = run_case(case, args.cache, args.target, args.explain)
        rows.append(row)
        if "fused" not in row:
            print(f"{row['case']:40s} {row['instances']:>4} {'-':>5s} {'-':>10s} {'-':>9s}  {row['error']}")
            continue
        cos = f"{row['cosine']:.7f}" if "cosine" in row else "-"
        mab = f"{row['max_abs']:.2e}" if "max_abs" in row else "-"
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(row["ops"].items()))  # type: ignore[union-attr]
        print(f"{row['case']:40s} {row['instances']:>4} {row['fused']:>5} {cos:>10s} {mab:>9s}  {ops}"
              + (f"  [{row['error']}]" if "error" in row else ""))
        if args.explain:
            for reason in row["reasons"]:  # type: ignore[union-attr]
                print(f"{'':46s}near miss: {reason}")
        sys.stdout.flush()
    total = sum(int(r["instances"]) for r in rows)  # type: ignore[call-overload]
    fused = sum(int(r.get("fused", 0)) for r in rows)  # type: ignore[call-overload]
    print(f"\n{len(rows)} exports, {total} attention instances, {fused} fused")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
