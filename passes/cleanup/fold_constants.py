"""Constant folding: evaluate nodes whose inputs are all constant and store the result.

Exporters leave many computations on constants — shape arithmetic (``Shape → Gather → Concat``
once shapes are known), transposed or reshaped weights, ``Cast`` of literals.  Folding them makes the
graph smaller and unblocks pattern matching.  The evaluation is onnxscript's constant folder (it runs
the reference ONNX evaluator on small inputs); this pass bounds the tensor sizes it will fold so a
model never balloons: a folded output larger than ``--fold-limit`` elements is left as computation.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.optimizer import _constant_folding as cf

from mograph.pass_infra import Option, Pass, PassResult
from mograph.passes.cleanup._util import op_histogram, removed_by_op

__all__ = ["FoldConstantsPass"]


class FoldConstantsPass(Pass):
    """Fold nodes whose inputs are all constants into initializers (bounded by --fold-limit)."""

    name = "fold-constants"
    family = "cleanup"
    options = (
        Option(
            "fold-limit",
            int,
            1 << 20,
            "largest folded output, in elements; bigger results stay as computation",
            metavar="ELEMENTS",
        ),
    )

    def call(self, model: ir.Model) -> PassResult:
        limit = int(self.config["fold_limit"])
        if limit < 0:
            from mograph.errors import OptionError

            raise OptionError(f"{self.name}: --fold-limit must be >= 0, not {limit}")
        before = op_histogram(model)
        result = cf.FoldConstantsPass(
            shape_inference=True,
            input_size_limit=max(limit, 1),
            output_size_limit=limit,
        )(model)
        after = op_histogram(model)
        removed = removed_by_op(before, after)
        stats: dict[str, int | float] = {"folded_nodes": sum(removed.values())}
        stats.update({f"removed.{op}": n for op, n in removed.items()})
        return PassResult(modified=bool(result.modified), stats=stats)
