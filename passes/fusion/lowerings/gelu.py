"""Lowerings of ``Gelu``, ``FastGelu``, ``QuickGelu``, ``BiasGelu`` and ``BiasFastGelu``.

``onnx``
    ``Gelu`` with ``approximate`` (opset >= 20), after an ``Add`` for the bias forms; ``QuickGelu`` has
    no standard op (the step inlines it).
``ort``
    ``com.microsoft`` ``Gelu``, ``FastGelu`` (with bias for ``BiasFastGelu``), ``BiasGelu``, ``QuickGelu``.
``tensorrt``
    ``Gelu`` (opset >= 20, after an ``Add`` for the bias forms) and ``x * sigmoid(alpha x)`` for
    ``QuickGelu``: native layers; below opset 20 the ``Gelu`` / ``BiasGelu`` plugin node with its
    ``approximate`` field.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.custom_ops import Lowering
from mograph.irutil import attr_value
from mograph.lowering import LoweringContext, as_vector, plugin_node, plugin_vectors, replace_node

__all__ = ["LOWERINGS"]

MS_DOMAIN = "com.microsoft"


def _gelu_standard(node: ir.Node, ctx: LoweringContext, approximate: str, with_bias: bool) -> bool:
    if ctx.opset < 20:
        return False
    nodes = []
    x = node.inputs[0]
    assert x is not None
    if with_bias:
        add = ir.node("Add", [x, node.inputs[1]])
        add.outputs[0].type, add.outputs[0].shape = x.type, x.shape
        nodes.append(add)
        x = add.outputs[0]
    gelu = ir.node("Gelu", [x], attributes={"approximate": approximate})
    nodes.append(gelu)
    replace_node(node, nodes, [gelu.outputs[0]], ctx.target)
    return True


def _ms(node: ir.Node, ctx: LoweringContext, op_type: str, inputs: list[ir.Value | None], **attrs: Any) -> bool:
    new = ir.node(op_type, inputs, attributes=attrs, domain=MS_DOMAIN)
    replace_node(node, [new], [new.outputs[0]], ctx.target)
    return True


def _gelu_lowerings(name: str) -> dict[str, Lowering]:
    approximate = "tanh" if "Fast" in name else "none"
    with_bias = name.startswith("Bias")
    ms_name = {"Gelu": "Gelu", "FastGelu": "FastGelu", "BiasGelu": "BiasGelu", "BiasFastGelu": "FastGelu"}[name]

    def ort(node: ir.Node, ctx: LoweringContext) -> bool:
        if with_bias:
            x, bias = node.inputs
            assert node.graph is not None and x is not None and bias is not None
            b = as_vector(node.graph, bias, x, "mograph_gelu_bias")
            return b is not None and _ms(node, ctx, ms_name, [x, b])
        return _ms(node, ctx, ms_name, [node.inputs[0]])

    def onnx(node: ir.Node, ctx: LoweringContext) -> bool:
        return _gelu_standard(node, ctx, approximate, with_bias)

    def trt(node: ir.Node, ctx: LoweringContext) -> bool:
        if _gelu_standard(node, ctx, approximate, with_bias):
            return True
        spec = ctx.op.tensorrt_plugin if ctx.op is not None else None
        x = node.inputs[0]
        assert x is not None
        if spec is None:
            return False
        inputs = [x]
        if with_bias:
            vectors = plugin_vectors(node, x, [(node.inputs[1], "mograph_gelu_bias", False)])
            if vectors is None:
                return False
            inputs += vectors
        new = plugin_node(spec, inputs, domain=node.domain, approximate=approximate)
        replace_node(node, [new], [new.outputs[0]], ctx.target)
        return True

    return {"onnx": onnx, "ort": ort, "tensorrt": trt}


def _quick_ort(node: ir.Node, ctx: LoweringContext) -> bool:
    return _ms(node, ctx, "QuickGelu", [node.inputs[0]], alpha=float(attr_value(node, "alpha", 1.702)))


def _quick_trt(node: ir.Node, ctx: LoweringContext) -> bool:
    x = node.inputs[0]
    assert x is not None
    alpha = np.array(float(attr_value(node, "alpha", 1.702)), dtype=x.dtype.numpy() if x.dtype else np.float32)
    c = ir.node("Constant", [], attributes={"value": ir.tensor(alpha)})
    m = ir.node("Mul", [x, c.outputs[0]])
    s = ir.node("Sigmoid", [m.outputs[0]])
    y = ir.node("Mul", [x, s.outputs[0]])
    replace_node(node, [c, m, s, y], [y.outputs[0]], ctx.target)
    return True


LOWERINGS: dict[str, dict[str, Lowering]] = {
    "Gelu": _gelu_lowerings("Gelu"),
    "FastGelu": _gelu_lowerings("FastGelu"),
    "BiasGelu": _gelu_lowerings("BiasGelu"),
    "BiasFastGelu": _gelu_lowerings("BiasFastGelu"),
    "QuickGelu": {"ort": _quick_ort, "tensorrt": _quick_trt},
}
