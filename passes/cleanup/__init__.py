"""Built-in plugin ``mograph.passes.cleanup``: graph clean-up passes and the ``cleanup`` preset.

Preset ``cleanup`` runs, in order: shape inference (so shape computations can fold), constant
folding, identity elimination, common-subexpression elimination, dead-node elimination, and a
topological sort.

Preset ``after-lower`` (run after the ``lower`` step that a pipeline adds, see
:meth:`mograph.plugins.Registry.plan`) runs shape simplification (each dynamic shape computed once,
from the graph inputs), ``lower`` once more (for an op whose lowering needed a dim that only the
simplification exposed), shape simplification again, CSE and dead-node elimination.  Shape simplification is
not in ``cleanup``: run before the fusions, its rewritten ``Reshape`` targets and masks hide patterns
they match (measured on the attention corpus: 76 of 128 attention instances fused instead of 124).
"""

from __future__ import annotations

from mograph.passes.cleanup.cse import CsePass
from mograph.passes.cleanup.eliminate_dead import EliminateDeadPass
from mograph.passes.cleanup.eliminate_identity import EliminateIdentityPass
from mograph.passes.cleanup.fold_constants import FoldConstantsPass
from mograph.passes.cleanup.infer_shapes import InferShapesPass
from mograph.passes.cleanup.simplify_shapes import SimplifyShapesPass
from mograph.passes.cleanup.topo_sort import TopoSortPass

from mograph.hookspecs import hookimpl

__all__ = [
    "CsePass",
    "EliminateDeadPass",
    "EliminateIdentityPass",
    "FoldConstantsPass",
    "InferShapesPass",
    "SimplifyShapesPass",
    "TopoSortPass",
]

CLEANUP = [
    "infer-shapes",
    "fold-constants",
    "eliminate-identity",
    "cse",
    "eliminate-dead",
    "topo-sort",
]

#: Run after an appended ``lower``: the lowered forms' shape computations, computed once.  A fused op the
#: first ``lower`` kept (its lowering needs a dim a removed Reshape hid) is lowered by the second, whose
#: leftovers the second ``simplify-shapes`` tidies; both are no-ops when there is nothing left to do.
AFTER_LOWER = ["simplify-shapes", "lower", "simplify-shapes", "cse", "eliminate-dead"]


@hookimpl
def mograph_add_passes() -> list[type]:
    return [
        InferShapesPass,
        FoldConstantsPass,
        SimplifyShapesPass,
        EliminateIdentityPass,
        CsePass,
        EliminateDeadPass,
        TopoSortPass,
    ]


@hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    return {"cleanup": CLEANUP, "after-lower": AFTER_LOWER}
