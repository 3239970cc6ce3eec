"""Small helpers shared by the cleanup passes."""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from mograph._traverse import iter_nodes


def op_histogram(model: ir.Model) -> Counter[str]:
    """Count nodes by ``domain::op_type`` (plain ``op_type`` for the default domain), subgraphs included."""
    hist: Counter[str] = Counter()
    for node in iter_nodes(model.graph):
        hist[f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type] += 1
    return hist


def removed_by_op(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    """Per op type, how many nodes fewer there are after than before (only positive counts)."""
    return {op: n - after.get(op, 0) for op, n in sorted(before.items()) if n - after.get(op, 0) > 0}
