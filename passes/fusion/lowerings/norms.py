"""Lowerings of ``LayerNorm``, ``RMSNorm``, ``SkipLayerNorm`` and ``SkipRMSNorm``.

``onnx``
    ``LayerNormalization`` (opset >= 17), ``RMSNormalization`` (>= 23); a Skip* op becomes its residual
    ``Add`` (and bias ``Add``) and that standard norm, with the sum read from the ``Add``.
``ort``
    ``LayerNormalization`` and ``SimplifiedLayerNormalization`` (ONNX Runtime registers both in the
    default domain at every opset); ``com.microsoft`` ``SkipLayerNormalization`` /
    ``SkipSimplifiedLayerNormalization`` with the sum as output 3 when it is read.  The kernel
    broadcasts ``skip`` over ``input`` but never the other way, so the operands are ordered for it.
``tensorrt``
    ``LayerNormalization`` at opset >= 17 (a native layer); otherwise the op's plugin node: Scale/B/Bias
    as ``[hidden]`` vectors (a one-element constant is widened), a zero B or Bias left off when nothing
    after it is kept (else zeros ``[hidden]``), ``sum_output=1`` only when something reads the sum.

A lowering that cannot apply (dynamic hidden size where a 1-D scale must be built, shapes the kernel
does not take) returns False and the op stays (or is inlined for ``onnx``).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from mograph.custom_ops import Lowering
from mograph.irutil import attr_value, is_zero, value_used
from mograph.lowering import LoweringContext, as_vector, plugin_node, plugin_vectors, replace_node
from mograph.shapes import Dim

__all__ = ["LOWERINGS", "MS_DOMAIN"]

MS_DOMAIN = "com.microsoft"
_ONE = Dim()

Vectors = list[tuple[ir.Value | None, str, bool]]  # (value, base name of a built vector, optional)


def _norm_attrs(node: ir.Node, epsilon: float) -> dict[str, Any]:
    return {"axis": -1, "epsilon": float(attr_value(node, "epsilon", epsilon)),
            "stash_type": int(attr_value(node, "stash_type", 1))}


def _layer_norm_node(node: ir.Node, x: ir.Value, scale: ir.Value, beta: ir.Value | None) -> ir.Node | None:
    graph = node.graph
    assert graph is not None
    s = as_vector(graph, scale, x, "mograph_ln_scale")
    if s is None:
        return None
    inputs = [x, s]
    if not is_zero(beta):
        assert beta is not None
        b = as_vector(graph, beta, x, "mograph_ln_bias")
        if b is None:
            return None
        inputs.append(b)
    return ir.node("LayerNormalization", inputs, attributes=_norm_attrs(node, 1e-5))


def _rms_node(node: ir.Node, x: ir.Value, scale: ir.Value, op_type: str) -> ir.Node | None:
    graph = node.graph
    assert graph is not None
    s = as_vector(graph, scale, x, "mograph_rms_scale")
    if s is None:
        return None
    return ir.node(op_type, [x, s], attributes=_norm_attrs(node, 1e-6))


def _ln_standard(node: ir.Node, ctx: LoweringContext) -> bool:
    x, scale, beta = node.inputs
    assert x is not None and scale is not None
    new = _layer_norm_node(node, x, scale, beta)
    if new is None:
        return False
    replace_node(node, [new], [new.outputs[0]], ctx.target)
    return True


def _ln_onnx(node: ir.Node, ctx: LoweringContext) -> bool:
    return ctx.opset >= 17 and _ln_standard(node, ctx)


def _plugin_fields(node: ir.Node, ctx: LoweringContext, vectors: Vectors, x: ir.Value, extra: list[ir.Value],
                   num_outputs: int = 1, **fields: Any) -> bool:
    """Replace ``node`` by its op's plugin node: ``[*extra, *legal vectors]`` after ``x``."""
    spec = ctx.op.tensorrt_plugin if ctx.op is not None else None
    if spec is None:
        return False
    legal = plugin_vectors(node, x, vectors)
    if legal is None:
        return False
    new = plugin_node(spec, [x, *extra, *legal], domain=node.domain, **fields)
    outs: list[ir.Value | None] = [new.outputs[0]]
    if len(node.outputs) > 1:
        outs.append(new.outputs[1] if len(new.outputs) > 1 else None)
    replace_node(node, [new], outs[:len(node.outputs)], ctx.target)
    return True


def _ln_trt(node: ir.Node, ctx: LoweringContext) -> bool:
    if ctx.opset >= 17 and _ln_standard(node, ctx):
        return True
    x, scale, beta = node.inputs
    assert x is not None
    return _plugin_fields(node, ctx, [(scale, "mograph_ln_scale", False), (beta, "mograph_ln_bias", True)], x, [],
                          epsilon=float(attr_value(node, "epsilon", 1e-5)))


def _rms_to(op_type: str, min_opset: int = 1) -> Lowering:
    def lower(node: ir.Node, ctx: LoweringContext) -> bool:
        if ctx.opset < min_opset:
            return False
        x, scale = node.inputs
        assert x is not None and scale is not None
        new = _rms_node(node, x, scale, op_type)
        if new is None:
            return False
        replace_node(node, [new], [new.outputs[0]], ctx.target)
        return True

    return lower


def _rms_trt(node: ir.Node, ctx: LoweringContext) -> bool:
    x, scale = node.inputs
    assert x is not None
    return _plugin_fields(node, ctx, [(scale, "mograph_rms_scale", False)], x, [],
                          epsilon=float(attr_value(node, "epsilon", 1e-6)))


# ---------------------------------------------------------------------------------------------
# residual + norm
# ---------------------------------------------------------------------------------------------


def _skip_order(x: ir.Value, skip: ir.Value, ctx: LoweringContext) -> tuple[ir.Value, ir.Value] | None:
    """(input, skip) as ORT's SkipLayerNormalization needs them, or None if it cannot take them.

    The kernel broadcasts ``skip`` (``[1, S, H]`` or ``[S, H]``) over ``input`` ``[B, S, H]`` but
    never the other way, and gives a wrong shape if ``input`` is the smaller one.  A 1 in a dim of one
    operand where the other has a different dim makes that operand the skip; other symbolic dims of the
    two operands are taken to be equal (both are residual-stream activations).  The dims are the core
    shape query's (:meth:`LoweringContext.dims`), so a 1 spelled as a shape computation counts.
    """
    x_dims, s_dims = ctx.dims(x), ctx.dims(skip)
    if x_dims is None or s_dims is None:
        return None
    if len(x_dims) < len(s_dims):
        x, skip = skip, x
        x_dims, s_dims = s_dims, x_dims
    if len(x_dims) not in (2, 3) or len(s_dims) not in (2, 3):
        return None
    last = x_dims[-1]
    if last is None or not last.is_literal or last != s_dims[-1]:
        return None
    if len(x_dims) == len(s_dims):
        x_ones = any(d == _ONE and e != _ONE for d, e in zip(x_dims, s_dims))
        s_ones = any(e == _ONE and d != _ONE for d, e in zip(x_dims, s_dims))
        if x_ones and s_ones:
            return None
        if x_ones:
            x, skip = skip, x
    return x, skip


def _skip_ln_vectors(node: ir.Node) -> Vectors:
    _x, _skip, scale, beta, bias = node.inputs
    return [(scale, "mograph_ln_scale", False), (beta, "mograph_ln_bias", True), (bias, "mograph_skip_bias", True)]


def _skip_rms_vectors(node: ir.Node) -> Vectors:
    _x, _skip, scale, bias = node.inputs
    return [(scale, "mograph_rms_scale", False), (bias, "mograph_skip_bias", True)]


def _wants_sum(node: ir.Node) -> bool:
    return len(node.outputs) > 1 and value_used(node.outputs[1])


def _skip_to_ort(op_type: str, vectors_of: Any, epsilon: float) -> Lowering:
    """``com.microsoft`` ``op_type``: input, skip, then the vectors as ``[hidden]`` tensors (a zero optional
    one left empty); the sum, when read, as output 3."""

    def lower(node: ir.Node, ctx: LoweringContext) -> bool:
        x, skip = node.inputs[0], node.inputs[1]
        graph = node.graph
        assert graph is not None and x is not None and skip is not None
        order = _skip_order(x, skip, ctx)
        if order is None:
            return False
        x, skip = order
        inputs: list[ir.Value | None] = [x, skip]
        for value, base, optional in vectors_of(node):
            if optional and is_zero(value):
                inputs.append(None)
                continue
            assert value is not None
            vec = as_vector(graph, value, x, base)
            if vec is None:
                return False
            inputs.append(vec)
        while inputs[-1] is None:
            inputs.pop()
        want_sum = _wants_sum(node)
        new = ir.node(op_type, inputs, attributes={"epsilon": float(attr_value(node, "epsilon", epsilon))},
                      domain=MS_DOMAIN, num_outputs=4 if want_sum else 1)
        if want_sum:
            for i in (1, 2):
                new.outputs[i].name = ""
        outs: list[ir.Value | None] = [new.outputs[0]]
        if len(node.outputs) > 1:
            outs.append(new.outputs[3] if want_sum else None)
        replace_node(node, [new], outs, ctx.target)
        return True

    return lower


def _skip_to_plugin(vectors_of: Any, epsilon: float) -> Lowering:
    """The op's plugin node: ``Sum`` as a second output (``sum_output=1``) only when it is read."""

    def lower(node: ir.Node, ctx: LoweringContext) -> bool:
        x, skip = node.inputs[0], node.inputs[1]
        assert x is not None and skip is not None
        if x.shape is None or skip.shape is None or len(x.shape) != len(skip.shape):
            return False  # the plugin broadcasts Skip over leading axes of the same rank only
        return _plugin_fields(node, ctx, vectors_of(node), x, [skip], epsilon=float(attr_value(node, "epsilon", epsilon)),
                              sum_output=int(_wants_sum(node)))

    return lower


def _skip_to_standard(norm: str) -> Lowering:
    """The residual ``Add`` (bias first, as fused) and the standard norm: ``onnx`` where the opset has it."""
    min_opset = 17 if norm == "LayerNorm" else 23

    def lower(node: ir.Node, ctx: LoweringContext) -> bool:
        if ctx.opset < min_opset:
            return False
        x, skip = node.inputs[0], node.inputs[1]
        bias = node.inputs[4] if norm == "LayerNorm" else node.inputs[3]
        assert x is not None and skip is not None
        nodes: list[ir.Node] = []
        a = x
        if not is_zero(bias):
            add_bias = ir.node("Add", [x, bias])
            nodes.append(add_bias)
            a = add_bias.outputs[0]
        add = ir.node("Add", [a, skip])
        nodes.append(add)
        s = add.outputs[0]
        s.type, s.shape = (node.outputs[1].type, node.outputs[1].shape) if len(node.outputs) > 1 else (x.type, x.shape)
        if s.type is None:
            s.type, s.shape = x.type, x.shape
        if norm == "LayerNorm":
            scale, beta = node.inputs[2], node.inputs[3]
            assert scale is not None
            new = _layer_norm_node(node, s, scale, beta)
        else:
            scale = node.inputs[2]
            assert scale is not None
            new = _rms_node(node, s, scale, "RMSNormalization")
        if new is None:
            return False
        nodes.append(new)
        outs: list[ir.Value | None] = [new.outputs[0]]
        if len(node.outputs) > 1:
            outs.append(s if value_used(node.outputs[1]) else None)
        replace_node(node, nodes, outs, ctx.target)
        return True

    return lower


LOWERINGS: dict[str, dict[str, Lowering]] = {
    "LayerNorm": {"onnx": _ln_onnx, "ort": _ln_standard, "tensorrt": _ln_trt},
    "RMSNorm": {"onnx": _rms_to("RMSNormalization", 23), "ort": _rms_to("SimplifiedLayerNormalization"),
                "tensorrt": _rms_trt},
    "SkipLayerNorm": {"onnx": _skip_to_standard("LayerNorm"),
                      "ort": _skip_to_ort("SkipLayerNormalization", _skip_ln_vectors, 1e-5),
                      "tensorrt": _skip_to_plugin(_skip_ln_vectors, 1e-5)},
    "SkipRMSNorm": {"onnx": _skip_to_standard("RMSNorm"),
                    "ort": _skip_to_ort("SkipSimplifiedLayerNormalization", _skip_rms_vectors, 1e-6),
                    "tensorrt": _skip_to_plugin(_skip_rms_vectors, 1e-6)},
}
