"""Helpers for the pruning tests: zero chosen channels of a model, check a pruned model, read a shape."""

from __future__ import annotations

from collections.abc import Iterable

import onnx
import onnx_ir as ir
from onnx import numpy_helper


def checked(model: ir.Model) -> onnx.ModelProto:
    """The model as a proto that passes ``onnx.checker`` (full check, with shape inference)."""
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def zero_slices(proto: onnx.ModelProto, spec: Iterable[tuple[str, int, list[int]]]) -> onnx.ModelProto:
    """Set ``initializer[name]`` to 0 at ``indices`` along ``axis``, for each ``(name, axis, indices)``."""
    inits = {t.name: t for t in proto.graph.initializer}
    for name, axis, indices in spec:
        arr = numpy_helper.to_array(inits[name]).copy()
        index: list[slice | list[int]] = [slice(None)] * arr.ndim
        index[axis] = indices
        arr[tuple(index)] = 0
        inits[name].CopyFrom(numpy_helper.from_array(arr, name))
    return proto


def init_shape(model: ir.Model, name: str) -> tuple[int, ...]:
    return tuple(model.graph.initializers[name].const_value.shape)
