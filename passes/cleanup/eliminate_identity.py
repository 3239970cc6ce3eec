"""Identity elimination: bypass ``Identity`` nodes.

Exporters emit ``Identity`` to rename values or to expose a weight twice.  Each one costs a copy in
some runtimes and breaks pattern matching, so every reader is rewired to the Identity's input.  An
Identity whose output is a graph output keeps the output's name (the graph's interface never
changes): it is removed only where the renaming can be moved onto the producer safely.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as irp

from mograph.pass_infra import Pass, PassResult
from mograph.passes.cleanup._util import op_histogram

__all__ = ["EliminateIdentityPass"]


class EliminateIdentityPass(Pass):
    """Remove Identity nodes, rewiring their readers to the Identity's input."""

    name = "eliminate-identity"
    family = "cleanup"

    def call(self, model: ir.Model) -> PassResult:
        before = op_histogram(model).get("Identity", 0)
        result = irp.IdentityEliminationPass()(model)
        after = op_histogram(model).get("Identity", 0)
        return PassResult(modified=bool(result.modified), stats={"removed_identities": before - after})
