"""Dead-node elimination: remove nodes none of whose outputs reaches a graph output.

Rewrites leave orphans behind (a fused pattern's interior, a folded constant's producers).  Removing
them is what makes the model smaller.  Nodes with side effects do not exist in ONNX's standard
domains; nodes of unknown domains are removed like any other once unused.  Unused initializers are
removed too (they are dead weight in the saved file).
"""

from __future__ import annotations

import onnx_ir as ir
from mograph.passes.cleanup._util import op_histogram, removed_by_op
from onnx_ir.passes import common as irp

from mograph.pass_infra import Pass, PassResult

__all__ = ["EliminateDeadPass"]


class EliminateDeadPass(Pass):
    """Remove nodes and initializers whose values no graph output depends on."""

    name = "eliminate-dead"
    family = "cleanup"

    def call(self, model: ir.Model) -> PassResult:
        before = op_histogram(model)
        inits_before = len(model.graph.initializers)
        result = irp.RemoveUnusedNodesPass()(model)
        after = op_histogram(model)
        stats: dict[str, int | float] = {
            "removed_nodes": sum(before.values()) - sum(after.values()),
            "removed_initializers": inits_before - len(model.graph.initializers),
        }
        stats.update({f"removed.{op}": n for op, n in removed_by_op(before, after).items()})
        return PassResult(modified=bool(result.modified), stats=stats)
