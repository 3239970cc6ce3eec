"""Fusions per export of the attention corpus: ``cleanup,fuse`` against ``cleanup,simplify-shapes,fuse``.

``simplify-shapes`` runs after ``lower`` by default; this measures what running it before the fusions too
costs them.  For each case of ``tests/passes/fusion/test_attention_exports.py`` (:mod:`models.attention_corpus`;
exported into ``--exports`` when missing) it prints the fusions each pipeline makes (the per-rule counts of the
``fuse-*`` passes' stats, ``--target ort``), the rules whose counts differ, and the node count of both results;
then the totals (fusions, of them attention).

Usage::

    python tools/fusions_after_simplify.py --exports /tmp/exports            # every case
    python tools/fusions_after_simplify.py --exports /tmp/exports whisper-dec  # cases whose name contains it
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import onnx
import onnx_ir as ir

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = {"A": "cleanup,fuse", "B": "cleanup,simplify-shapes,fuse"}


def fusions(model: ir.Model, passes: str) -> tuple[dict[str, int], int]:
    """Per-rule fusion counts of ``passes`` on ``model`` (rewritten in place) and the nodes left."""
    from mograph.plugins import get_registry

    reg = get_registry()
    config = {"target": "ort"}
    counts: dict[str, int] = {}
    for p in reg.instantiate(reg.plan(passes, config), config):
        stats = p.call(model).stats
        if p.name.startswith("fuse-"):
            for key, n in stats.items():
                if "." not in key:
                    counts[key] = counts.get(key, 0) + int(n)
    return counts, sum(1 for _ in model.graph.all_nodes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exports", type=Path, required=True, help="folder of the exports (written when missing)")
    parser.add_argument("only", nargs="*", help="cases whose name contains one of these")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "passes" / "fusion")]
    from test_attention_exports import CASES

    from models import attention_corpus as corpus
    from mograph.testing import to_ir

    args.exports.mkdir(parents=True, exist_ok=True)
    totals = {k: [0, 0] for k in PIPELINES}
    for case in CASES:
        if args.only and not any(o in case.name for o in args.only):
            continue
        path = args.exports / f"{case.name}.onnx"
        if not path.exists():
            corpus.export(case, path)
        proto = onnx.load(str(path))
        runs = {k: fusions(to_ir(proto), p) for k, p in PIPELINES.items()}
        (a, na), (b, nb) = runs["A"], runs["B"]
        for k, (c, _) in runs.items():
            totals[k][0] += sum(c.values())
            totals[k][1] += c.get("AttentionFusion", 0)
        diff = {r: b.get(r, 0) - a.get(r, 0) for r in sorted(set(a) | set(b)) if a.get(r, 0) != b.get(r, 0)}
        print(f"{case.name:36s} A {sum(a.values()):3d} B {sum(b.values()):3d}  attention "
              f"{a.get('AttentionFusion', 0)}/{b.get('AttentionFusion', 0)}  nodes {na}/{nb}  {diff or ''}", flush=True)
    for k, p in PIPELINES.items():
        print(f"{k} {p}: {totals[k][0]} fusions ({totals[k][1]} attention)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
