"""Helpers the shape passes share: shape inference as they run it, and a value's dims as plain Python.

Inference runs with ``data_prop`` (so shapes computed from ``Shape`` / ``Gather`` / ``Concat`` chains
become known) and without type checks or strict mode (a model ONNX cannot fully infer is still a model
to work on: unknown shapes stay unknown).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as irp

__all__ = ["infer_shapes", "reinfer_shapes", "value_dims"]


def infer_shapes(model: ir.Model) -> None:
    """Fill in the shapes ONNX inference can derive, in place."""
    irp.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)


def reinfer_shapes(model: ir.Model) -> None:
    """Forget every derived shape (graph inputs keep theirs), then infer them again from the inputs.

    Stale shapes — ones derived from input dims that have since changed — must not survive a rewrite of
    the inputs, and inference does not overwrite a shape that is already there.
    """
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for out in node.outputs:
            if not out.is_graph_input():
                out.shape = None
    infer_shapes(model)


def value_dims(value: ir.Value) -> list[int | str | None] | None:
    """Dims of ``value``: ints for static, the symbol for named, ``None`` for unnamed; ``None`` if unranked."""
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else d.value if isinstance(d.value, str) else None for d in value.shape.dims]
