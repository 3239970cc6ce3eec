"""Topological sort: order nodes so every node comes after the producers of its inputs.

ONNX requires it and some rewrites append nodes at the end of the graph.  The sort is stable: a graph
that is already sorted keeps its order exactly (and the pass reports no change).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as irp

from mograph._traverse import iter_nodes
from mograph.pass_infra import Pass, PassResult

__all__ = ["TopoSortPass"]


def _order(model: ir.Model) -> list[int]:
    return [id(n) for n in iter_nodes(model.graph)]


class TopoSortPass(Pass):
    """Sort nodes topologically (stable: an already sorted graph is left as it is)."""

    name = "topo-sort"
    family = "cleanup"

    def call(self, model: ir.Model) -> PassResult:
        before = _order(model)
        irp.TopologicalSortPass()(model)
        after = _order(model)
        moved = sum(1 for a, b in zip(before, after) if a != b)
        return PassResult(modified=before != after, stats={"nodes_moved": moved})
