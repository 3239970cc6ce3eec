"""Shape inference: give every value the dtype and shape ONNX's inference can derive.

Fusion checks (is the reduction over the last axis?), quantization and pruning need shapes.  This runs
ONNX's shape inference with data propagation through onnx-ir (which keeps large initializers out of
the protobuf it builds, so big models work) and merges the results back.  Declared shapes that the
inference contradicts are replaced by the inferred ones: exporters sometimes declare wrong output
shapes, and inference is derived from the computation itself.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as irp

from mograph.pass_infra import Pass, PassResult

__all__ = ["InferShapesPass"]


def _typed_values(model: ir.Model) -> dict[int, tuple[object, object]]:
    out = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for v in node.outputs:
            out[id(v)] = (v.type, None if v.shape is None else tuple(v.shape))
    for v in model.graph.outputs:
        out[id(v)] = (v.type, None if v.shape is None else tuple(v.shape))
    return out


class InferShapesPass(Pass):
    """Infer dtypes and shapes of every value (ONNX shape inference with data propagation)."""

    name = "infer-shapes"
    family = "cleanup"

    def call(self, model: ir.Model) -> PassResult:
        before = _typed_values(model)
        irp.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
        after = _typed_values(model)
        changed = sum(1 for k, v in after.items() if before.get(k) != v)
        known = sum(1 for t, s in after.values() if t is not None and s is not None)
        return PassResult(modified=changed > 0, stats={"values_changed": changed, "values_with_shape": known})
