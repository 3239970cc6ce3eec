"""Helpers of the shape-pass tests: models built with ``onnx.helper``, op counts, a value's dims."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper


def ops(model: ir.Model) -> Counter[str]:
    return Counter(n.op_type for n in model.graph)


def dims(value: ir.Value) -> list[int | str | None]:
    assert value.shape is not None
    return [d if isinstance(d, int) else d.value for d in value.shape.dims]


def graph_input(model: ir.Model, name: str) -> ir.Value:
    return next(v for v in model.graph.inputs if v.name == name)


def make(nodes: list, inputs: list, outputs: list, inits: list | None = None, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def f32(name: str, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def i64(name: str, values: list | np.ndarray) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(array), name)
