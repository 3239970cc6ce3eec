"""Hostile models built in code: tensors whose external data points where it must not.

Each builder returns an ``onnx.ModelProto`` whose only way to produce its output is to read a tensor
with external data at ``location``. The tensor is ``uint8[size]``, so a loader that follows the
location hands the file's bytes to whatever folds or saves it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

__all__ = ["SITES", "external_tensor", "hostile_model"]

OPSET = 17


def external_tensor(location: str, size: int, name: str = "leak") -> onnx.TensorProto:
    """A ``uint8[size]`` tensor with no data of its own, only an external-data reference."""
    tensor = onnx.TensorProto(name=name, data_type=TensorProto.UINT8, dims=[size])
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    return tensor


def _model(nodes, *, functions=(), inputs=(), inits=(), extra_opsets=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "hostile",
        list(inputs),
        [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
        initializer=list(inits),
    )
    opsets = [helper.make_opsetid("", OPSET), *extra_opsets]
    model = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    model.ir_version = 8
    return model


def _constant(location: str, size: int) -> onnx.ModelProto:
    node = helper.make_node("Constant", [], ["c"], value=external_tensor(location, size))
    return _model([node, helper.make_node("Identity", ["c"], ["y"])])


def _sparse_constant(location: str, size: int) -> onnx.ModelProto:
    values = external_tensor(location, size, name="values")
    indices = helper.make_tensor("indices", TensorProto.INT64, [size], np.arange(size, dtype=np.int64))
    sparse = helper.make_sparse_tensor(values, indices, [size])
    node = helper.make_node("Constant", [], ["c"], sparse_value=sparse)
    return _model([node, helper.make_node("Identity", ["c"], ["y"])])


def _tensors_attribute(location: str, size: int) -> onnx.ModelProto:
    node = helper.make_node("Keep", ["c"], ["y"], domain="x.custom", tables=[external_tensor(location, size)])
    const = helper.make_node("Constant", [], ["c"], value=helper.make_tensor("z", TensorProto.UINT8, [1], [0]))
    return _model([const, node], extra_opsets=[helper.make_opsetid("x.custom", 1)])


def _if_model(branch: Callable[[str, onnx.TensorProto], onnx.GraphProto], location: str, size: int) -> onnx.ModelProto:
    """``y = If(True, then, else)``, each branch made by ``branch(name, tensor)``: ``then`` holds the
    external tensor and is the one taken, ``else`` holds zeros."""
    zeros = helper.make_tensor("zeros", TensorProto.UINT8, [size], np.zeros(size, np.uint8))
    node = helper.make_node(
        "If",
        ["cond"],
        ["y"],
        then_branch=branch("then", external_tensor(location, size)),
        else_branch=branch("else", zeros),
    )
    cond = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    return _model([node], inits=[cond])


def _constant_branch(name: str, tensor: onnx.TensorProto) -> onnx.GraphProto:
    node = helper.make_node("Constant", [], [f"{name}_out"], value=tensor)
    return helper.make_graph([node], name, [], [helper.make_tensor_value_info(f"{name}_out", TensorProto.UINT8, None)])


def _initializer_branch(name: str, tensor: onnx.TensorProto) -> onnx.GraphProto:
    node = helper.make_node("Identity", [tensor.name], [f"{name}_out"])
    out = helper.make_tensor_value_info(f"{name}_out", TensorProto.UINT8, None)
    return helper.make_graph([node], name, [], [out], initializer=[tensor])


def _if_branch(location: str, size: int) -> onnx.ModelProto:
    return _if_model(_constant_branch, location, size)


def _subgraph_initializer(location: str, size: int) -> onnx.ModelProto:
    return _if_model(_initializer_branch, location, size)


def _function(location: str, size: int) -> onnx.ModelProto:
    body = [helper.make_node("Constant", [], ["out"], value=external_tensor(location, size))]
    function = helper.make_function(
        "local", "Leak", [], ["out"], body, opset_imports=[helper.make_opsetid("", OPSET)]
    )
    call = helper.make_node("Leak", [], ["y"], domain="local")
    return _model([call], functions=[function], extra_opsets=[helper.make_opsetid("local", 1)])


def _initializer(location: str, size: int) -> onnx.ModelProto:
    return _model([helper.make_node("Identity", ["leak"], ["y"])], inits=[external_tensor(location, size)])


#: Where the hostile tensor sits, by name.
SITES = {
    "initializer": _initializer,
    "constant": _constant,
    "sparse-constant": _sparse_constant,
    "tensors-attribute": _tensors_attribute,
    "if-branch-constant": _if_branch,
    "subgraph-initializer": _subgraph_initializer,
    "function-constant": _function,
}


def hostile_model(site: str, location: str, size: int) -> onnx.ModelProto:
    """The model whose tensor at ``site`` reads ``size`` bytes of external data from ``location``."""
    return SITES[site](location, size)
