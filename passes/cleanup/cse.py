"""Common-subexpression elimination: compute each distinct expression once.

Two nodes with the same op, attributes and inputs produce the same values; exporters emit many such
duplicates (the same ``Shape``/``Gather`` chain per attention layer, repeated ``Cast`` s).  Later
duplicates are replaced by the first.  Small constant tensors compare by value (up to
``--cse-size-limit`` elements) so equal literals merge too.
"""

from __future__ import annotations

import onnx_ir as ir
from mograph.passes.cleanup._util import op_histogram, removed_by_op
from onnx_ir.passes import common as irp

from mograph.pass_infra import Option, Pass, PassResult

__all__ = ["CsePass"]


class CsePass(Pass):
    """Merge nodes that compute the same thing from the same inputs."""

    name = "cse"
    family = "cleanup"
    options = (
        Option("cse-size-limit", int, 10, "largest constant (elements) compared by value when merging", metavar="N"),
    )

    def call(self, model: ir.Model) -> PassResult:
        before = op_histogram(model)
        result = irp.CommonSubexpressionEliminationPass(size_limit=int(self.config["cse_size_limit"]))(model)
        after = op_histogram(model)
        stats: dict[str, int | float] = {"merged_nodes": sum(before.values()) - sum(after.values())}
        stats.update({f"merged.{op}": n for op, n in removed_by_op(before, after).items()})
        return PassResult(modified=bool(result.modified), stats=stats)
