"""The ``mograph.Attention`` op: numpy reference, ONNX function body, shape function, declaration.

``Attention(Q, K, V, AttentionBias) -> Y``: ``Q``, ``K``, ``V`` are ``[B, S|T, H*D]``, ``AttentionBias``
broadcastable to ``[B, H, S, T]`` (a zero scalar when there is none)::

    Y = concat_h(softmax(Q_h K_h^T * scale + AttentionBias) V_h)

Attributes ``num_heads`` and ``scale``.  The function body is the unfused computation in default-domain
ops (opset >= 13); its lowerings are in :mod:`mograph.passes.fusion.lowerings.attention`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION, CustomOp

__all__ = ["ATTENTION_OP", "ONNX_ATTENTION_OPSET", "attention", "attention_function", "custom_ops"]

#: The fused op's type in the ``mograph`` domain.
ATTENTION_OP = "Attention"
#: First default-domain opset with a standard ``Attention`` op.
ONNX_ATTENTION_OPSET = 23


# ---------------------------------------------------------------------------------------------
# the op: numpy reference, function body, shapes
# ---------------------------------------------------------------------------------------------


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None = None, *,
              num_heads: int, scale: float | None = None) -> np.ndarray:
    """Multi-head attention over ``[B, S, H*D]`` inputs (float32 arithmetic, result in q's dtype)."""
    dt: Any = np.float64 if q.dtype == np.float64 else np.float32
    b, s, hidden = q.shape
    t = k.shape[1]
    d = hidden // num_heads
    dv = v.shape[2] // num_heads
    qh: np.ndarray = q.astype(dt).reshape(b, s, num_heads, d).transpose(0, 2, 1, 3)
    kh: np.ndarray = k.astype(dt).reshape(k.shape[0], t, num_heads, d).transpose(0, 2, 3, 1)
    vh: np.ndarray = v.astype(dt).reshape(v.shape[0], t, num_heads, dv).transpose(0, 2, 1, 3)
    scores: np.ndarray = np.matmul(qh, kh) * np.asarray(1.0 / math.sqrt(d) if scale is None else scale, dtype=dt)
    if bias is not None:
        scores = scores + bias.astype(dt)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(axis=-1, keepdims=True)
    y = np.matmul(p, vh).transpose(0, 2, 1, 3).reshape(b, s, num_heads * dv)
    return y.astype(q.dtype)


def attention_function(opset: int) -> ir.Function:
    """Function body: the unfused computation in default-domain ops (needs opset >= 13)."""
    nodes: list[ir.Node] = []

    def add(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes=attrs)
        nodes.append(node)
        return node.outputs[0]

    q, k, v, bias = (ir.Value(name=n) for n in ("Q", "K", "V", "AttentionBias"))
    heads = add("Constant", value_int=ir.RefAttr("value_int", "num_heads", ir.AttributeType.INT))
    heads = add("Reshape", heads, add("Constant", value_ints=[1]))
    shape4 = add("Concat", add("Constant", value_ints=[0, 0]), heads, add("Constant", value_ints=[-1]), axis=0)
    qh = add("Transpose", add("Reshape", q, shape4), perm=[0, 2, 1, 3])
    kt = add("Transpose", add("Reshape", k, shape4), perm=[0, 2, 3, 1])
    vh = add("Transpose", add("Reshape", v, shape4), perm=[0, 2, 1, 3])
    scale = add("Constant", value_float=ir.RefAttr("value_float", "scale", ir.AttributeType.FLOAT))
    if opset >= 15:
        scale = add("CastLike", scale, q)
    scores = add("Add", add("Mul", add("MatMul", qh, kt), scale), bias)
    probs = add("Softmax", scores, axis=-1)
    ctx = add("Transpose", add("MatMul", probs, vh), perm=[0, 2, 1, 3])
    y = add("Reshape", ctx, add("Constant", value_ints=[0, 0, -1]))
    graph = ir.Graph([q, k, v, bias], [y], nodes=nodes, opset_imports={"": opset})
    return ir.Function(DOMAIN, ATTENTION_OP, "", graph=graph,
                       attributes=[ir.AttrInt64("num_heads", 1), ir.AttrFloat32("scale", 1.0)])


def _infer_shapes(node: ir.Node) -> None:
    q, _, v = node.inputs[:3]
    out = node.outputs[0]
    if q is None or v is None:
        return
    if q.type is not None:
        out.type = q.type
    if q.shape is not None and v.shape is not None and len(q.shape) == 3 and len(v.shape) == 3:
        out.shape = ir.Shape([q.shape[0], q.shape[1], v.shape[2]])


def custom_ops() -> list[CustomOp]:
    """The ``mograph.Attention`` declaration (contributed through ``mograph_add_custom_ops``)."""
    from mograph.passes.fusion.lowerings import lowerings_for

    return [
        CustomOp(
            name=ATTENTION_OP,
            domain=DOMAIN,
            version=DOMAIN_VERSION,
            doc="Multi-head attention: Y = concat_h(softmax(Q_h K_h^T * scale + AttentionBias) V_h); Q, K, V "
                "[B, S|T, H*D], AttentionBias broadcastable to [B, H, S, T] (a zero scalar when there is none).",
            inputs=("Q", "K", "V", "AttentionBias"),
            outputs=("Y",),
            attributes={"num_heads": 1, "scale": 1.0},
            reference=lambda q, k, v, bias, num_heads=1, scale=1.0: (
                attention(q, k, v, bias, num_heads=num_heads, scale=scale),),
            function=attention_function,
            infer_shapes=_infer_shapes,
            lowerings=lowerings_for(ATTENTION_OP),
            onnx_opset=ONNX_ATTENTION_OPSET,
        )
    ]

