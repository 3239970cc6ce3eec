"""Print the corpus table: per exporter and op kind, instances (by construction), fused, numerically equal.

    python tools/corpus/report.py [--markdown]

Runs the ``fuse`` preset (``--target mograph``) on every model of tests/data/corpus/manifest.json, counts
the fused ops per kind in the result (a standard ``LayerNormalization``/``RMSNormalization``/``Gelu``
the exporter wrote counts as fused), and compares the outputs with the original's under ONNX Runtime,
optimizations off (1e-4 of the output scale for float32, 2e-3 for float16).  Near misses (no
instances) are listed with whether they were left untouched.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "corpus"

KINDS = {
    "layernorm": {"mograph.LayerNorm", "mograph.SkipLayerNorm", "LayerNormalization"},
    "rmsnorm": {"mograph.RMSNorm", "mograph.SkipRMSNorm", "RMSNormalization"},
    "skipnorm": {"mograph.SkipLayerNorm", "mograph.SkipRMSNorm"},
    "gelu": {"mograph.Gelu", "mograph.FastGelu", "mograph.QuickGelu", "mograph.BiasGelu", "mograph.BiasFastGelu",
             "Gelu"},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()
    from mograph.pass_infra import graph_fingerprint
    from mograph.plugins import get_registry
    from mograph.testing import assert_close, feeds_for, op_counts, run_ort, to_ir, to_proto

    reg = get_registry()
    options = {"target": "mograph"}
    table: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # instances, fused, equal
    near = []
    for entry in json.loads((CORPUS / "manifest.json").read_text())["models"]:
        proto = onnx.load(str(CORPUS / entry["file"]))
        model = to_ir(proto)
        before = graph_fingerprint(model)
        for p in reg.instantiate(reg.plan("fuse", options), options):
            p.call(model)
        ops = op_counts(model)
        feeds = feeds_for(proto)
        try:
            assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 2e-3 if entry.get("fp16") else 1e-4)
            equal = True
        except AssertionError:
            equal = False
        want = entry["instances"]
        if not any(want.values()) or entry.get("limitation"):
            near.append((entry["file"], entry.get("limitation") or "near miss", graph_fingerprint(model) == before))
            continue
        for kind, names in KINDS.items():
            if want[kind]:
                row = table[(entry["exporter"], kind)]
                got = sum(v for k, v in ops.items() if k in names)
                row[0] += want[kind]
                row[1] += min(got, want[kind])
                row[2] += want[kind] if equal and got == want[kind] else 0
    head = ("exporter", "op", "instances", "fused", "numerically equal")
    rows = [(ex, kind, *map(str, v)) for (ex, kind), v in sorted(table.items())]
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head, *rows]:
            print(f"{r[0]:<26} {r[1]:<10} {r[2]:>9} {r[3]:>6} {r[4]:>18}")
    print()
    for name, why, untouched in near:
        print(f"{name}: {why}; {'left untouched' if untouched else 'CHANGED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
