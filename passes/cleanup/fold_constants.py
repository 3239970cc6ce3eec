"""Constant folding: evaluate nodes whose inputs are all constant and store the result.

Exporters leave many computations on constants — shape arithmetic (``Shape → Gather → Concat``
once shapes are known), transposed or reshaped weights, ``Cast`` of literals.  Folding them makes the
graph smaller and unblocks pattern matching.  The evaluation is onnxscript's constant folder (it runs
the reference ONNX evaluator on small inputs); this pass bounds the tensor sizes it will fold so a
model never balloons: a folded output larger than ``--fold-limit`` elements is left as computation.

One exception comes from the folder itself: a ``Transpose`` of a constant that nothing else reads is
folded whatever its size, since the result replaces its input and the model does not grow.  That
exception never applies to external data: a node reading an external-data tensor larger than the
limit is never folded, because evaluating it would pull the tensor into memory (a model above 2 GB
must be optimizable with memory far below its size).
"""

from __future__ import annotations

import onnx_ir as ir
from mograph.passes.cleanup._util import op_histogram, removed_by_op
from onnxscript.optimizer import _constant_folding as cf

from mograph.pass_infra import Option, Pass, PassResult, graph_fingerprint

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
        def keep_external_lazy(node: ir.Node) -> bool | None:
            for value in node.inputs:
                tensor = None if value is None else value.const_value
                if isinstance(tensor, ir.ExternalTensor) and tensor.size > limit:
                    return False  # never read a large external tensor into memory
            return None  # the folder's own rules (size limits) decide

        before = op_histogram(model)
        fingerprint = graph_fingerprint(model)
        result = cf.FoldConstantsPass(
            shape_inference=True,
            input_size_limit=max(limit, 1),
            output_size_limit=limit,
            should_fold=keep_external_lazy,
        )(model)
        after = op_histogram(model)
        removed = removed_by_op(before, after)
        stats: dict[str, int | float] = {"folded_nodes": sum(removed.values())}
        stats.update({f"removed.{op}": n for op, n in removed.items()})
        # The folder also types the values it visits, but does not always count that as a change.
        modified = bool(result.modified) or graph_fingerprint(model) != fingerprint
        return PassResult(modified=modified, stats=stats)
