"""``mograph.Attention`` for ``--target onnx`` (the standard ``Attention`` at opset >= 23, else the body) and the
inlined body for the targets that take the decomposition.  See :mod:`mograph.passes.fusion.lowerings.attention`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.lowerings._attention_ort import _add, _bias_for_kernel, _const, _finish, _replace
from mograph.passes.fusion.ops import FLOAT_TYPES

from mograph.irutil import attr_value, is_zero
from mograph.lowering import LoweringContext

logger = logging.getLogger(__name__)


ONNX_ATTENTION_OPSET = 23


def _decomposed(node: ir.Node, ctx: LoweringContext) -> bool:
    """Below opset 23: the computation written out for this call's attributes (heads split by ``Reshape``
    with 0-copied dims, no grouped-head repeat, no NaN guard unless asked), as small as an exporter's own
    graph; grouped-query calls take the general function body instead."""
    q, k, v, bias = (list(node.inputs) + [None] * 4)[:4]
    heads = int(attr_value(node, "num_heads", 1))
    qdtype = q.dtype if q is not None else None
    if q is None or k is None or v is None or qdtype is None or qdtype not in FLOAT_TYPES:
        return False
    if (int(attr_value(node, "kv_num_heads", 0)) or heads) != heads:
        return False
    dtype = qdtype.numpy()
    new_nodes: list[ir.Node] = []

    def add(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        return _add(new_nodes, op_type, list(inputs), **attrs)

    def const(arr: np.ndarray) -> ir.Value:
        return _const(new_nodes, arr)

    split = const(np.array([0, 0, heads, -1], dtype=np.int64))
    qh = add("Transpose", add("Reshape", q, split), perm=[0, 2, 1, 3])
    kt = add("Transpose", add("Reshape", k, split), perm=[0, 2, 3, 1])
    vh = add("Transpose", add("Reshape", v, split), perm=[0, 2, 1, 3])
    scores = add("MatMul", qh, kt)
    scale = float(attr_value(node, "scale", 1.0))
    if scale != 1.0:
        scores = add("Mul", scores, const(np.array(scale, dtype=dtype)))
    if bias is not None and not is_zero(bias):
        scores = add("Add", scores, bias)
    probs = add("Softmax", scores, axis=-1)
    if int(attr_value(node, "nan_to_zero", 0)):
        probs = add("Where", add("IsNaN", probs), const(np.array(0, dtype=dtype)), probs)
    out = add("Transpose", add("MatMul", probs, vh), perm=[0, 2, 1, 3])
    y = add("Reshape", out, const(np.array([0, 0, -1], dtype=np.int64)))
    y.dtype = qdtype
    _replace(node, new_nodes, ctx)
    return True


def _lower_onnx(node: ir.Node, ctx: LoweringContext) -> bool:
    """The standard ``Attention`` (opset >= 23), 3-D inputs, additive ``attn_mask``; below 23 the
    computation written out (:func:`_decomposed`)."""
    if ctx.opset < ONNX_ATTENTION_OPSET:
        return _decomposed(node, ctx)
    q, k, v, bias = node.inputs
    assert q is not None
    heads = int(attr_value(node, "num_heads", 1))
    new_nodes: list[ir.Node] = []
    inputs: list[ir.Value | None] = [q, k, v]
    if not is_zero(bias):
        inputs.append(_bias_for_kernel(bias, q, new_nodes, ctx, ctx.shared))  # type: ignore[arg-type]
    kv_heads = int(attr_value(node, "kv_num_heads", 0)) or heads
    att = ir.node("Attention", inputs, attributes={"q_num_heads": heads, "kv_num_heads": kv_heads,
                                                   "scale": float(attr_value(node, "scale", 1.0))})
    return _finish(node, att, q, new_nodes, ctx)


def _inline(node: ir.Node, ctx: LoweringContext) -> bool:
    return ctx.inline(node)
