"""Helpers for the pruning tests: zero chosen channels of a model, run a pass as the pipeline does,
run models under ONNX Runtime with its graph optimizations off."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from _pass_testing import assert_second_run_changes_nothing, op_types, run_pass  # noqa: F401 - re-exported
from onnx import numpy_helper

from mograph.testing import run_ort, to_ir  # noqa: F401 - to_ir re-exported for the tests


def ort_run(model: onnx.ModelProto | ir.Model, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    pytest.importorskip("onnxruntime")
    return run_ort(model, feeds)


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
