"""Built-in plugin ``mograph.passes.cleanup``: graph clean-up passes and the ``cleanup`` preset.

Preset ``cleanup`` runs, in order: shape inference (so shape computations can fold), constant
folding, identity elimination, common-subexpression elimination, dead-node elimination, and a
topological sort.
"""

from __future__ import annotations

from mograph.passes.cleanup.cse import CsePass
from mograph.passes.cleanup.eliminate_dead import EliminateDeadPass
from mograph.passes.cleanup.eliminate_identity import EliminateIdentityPass
from mograph.passes.cleanup.fold_constants import FoldConstantsPass
from mograph.passes.cleanup.infer_shapes import InferShapesPass
from mograph.passes.cleanup.topo_sort import TopoSortPass

from mograph.hookspecs import hookimpl

__all__ = [
    "CsePass",
    "EliminateDeadPass",
    "EliminateIdentityPass",
    "FoldConstantsPass",
    "InferShapesPass",
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


@hookimpl
def mograph_add_passes() -> list[type]:
    return [InferShapesPass, FoldConstantsPass, EliminateIdentityPass, CsePass, EliminateDeadPass, TopoSortPass]


@hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    return {"cleanup": CLEANUP}
