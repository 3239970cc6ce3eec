"""Built-in plugin ``mograph.passes.cleanup``: graph clean-up passes and the ``cleanup`` preset.

Preset ``cleanup`` runs, in order: shape inference (so shape computations can fold), constant
folding, identity elimination, common-subexpression elimination, dead-node elimination, and a
topological sort.

Preset ``after-lower`` (run after the ``lower`` step that a pipeline adds, see
:meth:`mograph.plugins.Registry.plan`) runs shape simplification (each dynamic shape computed once,
from the graph inputs), CSE and dead-node elimination.  ``lower`` runs once: the lowerings read dims through
the core's shape query (:class:`mograph.shapes.ShapeQuery`), which sees through the spelled shape
computations that only the simplification used to expose.  Shape simplification is
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

#: Run after an appended ``lower``: the lowered forms' shape computations, computed once.  No second
#: ``lower``: a lowering that needs a dim asks the shape query, which reads it through the shape
#: computations as they stand (``Gather(Shape(x), i)``, ``Range`` lengths, reshape targets).
AFTER_LOWER = ["simplify-shapes", "cse", "eliminate-dead"]


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
