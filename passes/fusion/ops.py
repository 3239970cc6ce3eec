"""The fused ops of the ``mograph`` domain: math, numpy references, ONNX function bodies, shapes.

Every op normalises or activates over the **last axis** and computes in float32 (``stash_type``)
whatever the storage dtype; outputs have the dtype of ``X``.

==================  =========================================  ======================================
op                  inputs -> outputs                          math
==================  =========================================  ======================================
``LayerNorm``       X, Scale, B -> Y                           (X - E[X]) / sqrt(Var[X] + eps) * Scale + B
``RMSNorm``         X, Scale -> Y                              X / sqrt(E[X^2] + eps) * Scale
``SkipLayerNorm``   X, Skip, Scale, B, Bias -> Y, Sum?         Sum = X + Bias + Skip; Y = LayerNorm(Sum)
``SkipRMSNorm``     X, Skip, Scale, Bias -> Y, Sum?            Sum = X + Bias + Skip; Y = RMSNorm(Sum)
``EmbedLayerNorm``  InputIds, SegmentIds, PositionIds,         Sum = (Word[InputIds] + Segment[SegmentIds])
                    Word, Segment, Position, Scale, B -> Y       + Position[PositionIds]; Y = LayerNorm(Sum)
``Gelu``            X -> Y                                     X/2 (1 + erf(X / sqrt 2))
``FastGelu``        X -> Y                                     X/2 (1 + tanh(sqrt(2/pi) (X + 0.044715 X^3)))
``QuickGelu``       X -> Y                                     X sigmoid(alpha X), alpha = 1.702
``BiasGelu``        X, Bias -> Y                               Gelu(X + Bias)
``BiasFastGelu``    X, Bias -> Y                               FastGelu(X + Bias)
==================  =========================================  ======================================

``EmbedLayerNorm`` is BERT's embedding layer: three row lookups (``Gather`` on axis 0 of 2-D tables, int32 or
int64 ids that broadcast against each other: position ids are often ``[1, S]``), summed in the tables' dtype
and normalised.  Scale, B and Bias are 1-D (``[hidden]``) or single-element tensors broadcast over the last axis
(a fusion without scale or bias passes a constant 1 or 0).  ``Sum`` is returned only when the
graph reads the residual sum elsewhere.

The function bodies decompose each op into default-domain ops of the model's own opset, so any
ONNX runtime runs a fused model as it is (ONNX Runtime inlines them).  Attributes are passed by
reference (``epsilon``, ``stash_type``, ``alpha``).  At opset >= 15 the body computes in
``stash_type`` and casts back with ``CastLike``; below 15 (no ``CastLike``) it computes in the
input dtype, so the fusions require float32 inputs there (:func:`body_supports`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph._kernels import reference as _reference
from mograph.custom_ops import DOMAIN, DOMAIN_VERSION, CustomOp
from mograph.kernel_plugins import TENSORRT_PLUGINS
from mograph.shapes import Dims, ShapeQuery, broadcast

__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "FUSED_OPS",  # noqa: F822 - module __getattr__, read off the declarations
    "ONNX_STANDARD_OPSET",  # noqa: F822 - module __getattr__
    "TENSORRT_PLUGINS",
    "body_supports",
    "custom_ops",
    "layer_norm",
    "rms_norm",
    "skip_layer_norm",
    "skip_rms_norm",
    "embed_layer_norm",
    "gelu",
    "bias_gelu",
    "quick_gelu",
]

SQRT_2 = math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TANH_COEF = 0.044715
QUICK_GELU_ALPHA = 1.702

FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


# ---------------------------------------------------------------------------------------------
# numpy references: thin calls of the single reference of each op, mograph._kernels.reference
# (float32 arithmetic, result in the input dtype), with this module's argument names and defaults
# ---------------------------------------------------------------------------------------------


def layer_norm(x: np.ndarray, scale: np.ndarray | None = None, bias: np.ndarray | None = None,
               epsilon: float = 1e-5) -> np.ndarray:
    """LayerNorm over the last axis (:func:`mograph._kernels.reference.layer_norm`)."""
    return _reference.layer_norm(x, scale, bias, epsilon)


def rms_norm(x: np.ndarray, scale: np.ndarray | None = None, epsilon: float = 1e-6) -> np.ndarray:
    """RMSNorm over the last axis (:func:`mograph._kernels.reference.rms_norm`)."""
    return _reference.rms_norm(x, scale, epsilon)


def skip_layer_norm(x: np.ndarray, skip: np.ndarray, scale: np.ndarray | None = None,
                    beta: np.ndarray | None = None, bias: np.ndarray | None = None,
                    epsilon: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """LayerNorm of the residual sum and the sum (``x + skip + bias``, rounded to the dtype)."""
    return _reference.skip_layer_norm(x, skip, scale, beta, bias, epsilon, return_sum=True)  # type: ignore[return-value]


def skip_rms_norm(x: np.ndarray, skip: np.ndarray, scale: np.ndarray | None = None,
                  bias: np.ndarray | None = None, epsilon: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """RMSNorm of the residual sum and the sum (``x + skip + bias``, rounded to the dtype)."""
    return _reference.skip_rms_norm(x, skip, scale, bias, epsilon, return_sum=True)  # type: ignore[return-value]


def embed_layer_norm(input_ids: np.ndarray, segment_ids: np.ndarray, position_ids: np.ndarray, word: np.ndarray,
                     segment: np.ndarray, position: np.ndarray, scale: np.ndarray | None = None,
                     beta: np.ndarray | None = None, epsilon: float = 1e-5) -> np.ndarray:
    """LayerNorm of ``(word[input_ids] + segment[segment_ids]) + position[position_ids]`` (sums in the tables'
    dtype, ids broadcast against each other)."""
    s = (np.take(word, input_ids, axis=0) + np.take(segment, segment_ids, axis=0)).astype(word.dtype)
    s = (s + np.take(position, position_ids, axis=0)).astype(word.dtype)
    return layer_norm(s, scale, beta, epsilon)


gelu = _reference.gelu  # "none" (erf), "tanh" or "sigmoid" (quick_gelu)
quick_gelu = _reference.quick_gelu
bias_gelu = _reference.bias_gelu


# ---------------------------------------------------------------------------------------------
# function bodies
# ---------------------------------------------------------------------------------------------


def body_supports(opset: int, dtype: ir.DataType | None) -> bool:
    """Whether the function bodies can run ``dtype`` inputs at the model's default-domain opset."""
    return dtype == ir.DataType.FLOAT or (opset >= 15 and dtype in FLOAT_TYPES)


class _Body:
    """A tiny builder of function bodies in the default domain."""

    def __init__(self, opset: int) -> None:
        self.opset = opset
        self.nodes: list[ir.Node] = []

    def __call__(self, op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes=attrs)
        self.nodes.append(node)
        return node.outputs[0]

    def ref(self, attr: str, ref: str, kind: ir.AttributeType) -> ir.Attr:
        return ir.RefAttr(attr, ref, kind)

    def const(self, value: float, like: ir.Value) -> ir.Value:
        if self.opset >= 12:
            c = self("Constant", value_float=float(value))
        else:  # Constant has only ``value`` (a tensor) before opset 12
            c = self("Constant", value=ir.tensor(np.array(value, dtype=np.float32)))
        return self("CastLike", c, like) if self.opset >= 15 else c

    def const_ref(self, ref: str, like: ir.Value) -> ir.Value:
        if self.opset >= 12:
            c = self("Constant", value_float=self.ref("value_float", ref, ir.AttributeType.FLOAT))
        else:
            # Before opset 12 a Constant cannot take a float attribute; Elu<alpha>(-inf) is exactly
            # alpha * (exp(-inf) - 1) = -alpha, so Neg of it is the attribute's value, bit for bit.
            minus_inf = self("Constant", value=ir.tensor(np.array(-np.inf, dtype=np.float32)))
            c = self("Neg", self("Elu", minus_inf, alpha=self.ref("alpha", ref, ir.AttributeType.FLOAT)))
        return self("CastLike", c, like) if self.opset >= 15 else c

    def to_stash(self, x: ir.Value) -> ir.Value:
        if self.opset < 15:
            return x
        return self("Cast", x, to=self.ref("to", "stash_type", ir.AttributeType.INT))

    def like(self, y: ir.Value, x: ir.Value) -> ir.Value:
        return self("CastLike", y, x) if self.opset >= 15 else y

    def mean_last(self, x: ir.Value) -> ir.Value:
        if self.opset >= 18:
            axes = self("Constant", value_ints=[-1])
            return self("ReduceMean", x, axes, keepdims=1)
        return self("ReduceMean", x, axes=[-1], keepdims=1)

    def function(self, name: str, inputs: list[ir.Value], outputs: list[ir.Value],
                 attributes: list[ir.Attr]) -> ir.Function:
        graph = ir.Graph(inputs, outputs, nodes=self.nodes, opset_imports={"": self.opset})
        return ir.Function(DOMAIN, name, "", graph=graph, attributes=attributes)


def _inputs(*names: str) -> list[ir.Value]:
    return [ir.Value(name=n) for n in names]


def _eps_attrs(default: float) -> list[ir.Attr]:
    return [ir.AttrFloat32("epsilon", default), ir.AttrInt64("stash_type", 1)]


def _layer_norm_core(b: _Body, x: ir.Value, scale: ir.Value, beta: ir.Value) -> ir.Value:
    xs = b.to_stash(x)
    d = b("Sub", xs, b.mean_last(xs))
    var = b.mean_last(b("Mul", d, d))
    y = b("Div", d, b("Sqrt", b("Add", var, b.const_ref("epsilon", xs))))
    y = b("Add", b("Mul", y, b.like(scale, xs)), b.like(beta, xs))
    return b.like(y, x)


def _layer_norm_fn(opset: int) -> ir.Function:
    b = _Body(opset)
    x, scale, beta = _inputs("X", "Scale", "B")
    y = _layer_norm_core(b, x, scale, beta)
    return b.function("LayerNorm", [x, scale, beta], [y], _eps_attrs(1e-5))


def _rms_norm_core(b: _Body, x: ir.Value, scale: ir.Value) -> ir.Value:
    xs = b.to_stash(x)
    ms = b.mean_last(b("Mul", xs, xs))
    y = b("Div", xs, b("Sqrt", b("Add", ms, b.const_ref("epsilon", xs))))
    return b.like(b("Mul", y, b.like(scale, xs)), x)


def _rms_norm_fn(opset: int) -> ir.Function:
    b = _Body(opset)
    x, scale = _inputs("X", "Scale")
    return b.function("RMSNorm", [x, scale], [_rms_norm_core(b, x, scale)], _eps_attrs(1e-6))


def _skip_rms_norm_fn(opset: int) -> ir.Function:
    b = _Body(opset)
    x, skip, scale, bias = _inputs("X", "Skip", "Scale", "Bias")
    s = b("Add", b("Add", x, bias), skip)
    return b.function("SkipRMSNorm", [x, skip, scale, bias], [_rms_norm_core(b, s, scale), s], _eps_attrs(1e-6))


def _skip_layer_norm_fn(opset: int) -> ir.Function:
    b = _Body(opset)
    x, skip, scale, beta, bias = _inputs("X", "Skip", "Scale", "B", "Bias")
    s = b("Add", b("Add", x, bias), skip)
    y = _layer_norm_core(b, s, scale, beta)
    return b.function("SkipLayerNorm", [x, skip, scale, beta, bias], [y, s], _eps_attrs(1e-5))


def _embed_layer_norm_fn(opset: int) -> ir.Function:
    b = _Body(opset)
    ids, seg, pos, word, segment, position, scale, beta = _inputs("InputIds", "SegmentIds", "PositionIds", "WordEmbedding",
                                                                  "SegmentEmbedding", "PositionEmbedding", "Scale", "B")
    s = b("Add", b("Add", b("Gather", word, ids), b("Gather", segment, seg)), b("Gather", position, pos))
    y = _layer_norm_core(b, s, scale, beta)
    return b.function("EmbedLayerNorm", [ids, seg, pos, word, segment, position, scale, beta], [y],
                      _eps_attrs(1e-5))


def _gelu_expr(b: _Body, x: ir.Value, approximate: str) -> ir.Value:
    xs = b.to_stash(x)
    half_x = b("Mul", xs, b.const(0.5, xs))
    if approximate == "tanh":
        cube = b("Mul", b("Mul", xs, xs), xs)
        inner = b("Mul", b("Add", xs, b("Mul", cube, b.const(GELU_TANH_COEF, xs))), b.const(SQRT_2_OVER_PI, xs))
        core = b("Tanh", inner)
    else:
        core = b("Erf", b("Div", xs, b.const(SQRT_2, xs)))
    y = b("Mul", half_x, b("Add", core, b.const(1.0, xs)))
    return b.like(y, x)


def _gelu_fn(name: str, approximate: str, with_bias: bool) -> Callable[[int], ir.Function]:
    def build(opset: int) -> ir.Function:
        b = _Body(opset)
        if with_bias:
            x, bias = _inputs("X", "Bias")
            xin = b("Add", b.to_stash(x), b.like(bias, b.to_stash(x))) if opset >= 15 else b("Add", x, bias)
            y = b.like(_gelu_expr(b, xin, approximate), x)
            inputs = [x, bias]
        else:
            (x,) = _inputs("X")
            y = _gelu_expr(b, x, approximate)
            inputs = [x]
        attrs = [ir.AttrInt64("stash_type", 1)]
        return b.function(name, inputs, [y], attrs)

    return build


def _quick_gelu_fn(opset: int) -> ir.Function:
    b = _Body(opset)
    (x,) = _inputs("X")
    xs = b.to_stash(x)
    y = b("Mul", xs, b("Sigmoid", b("Mul", xs, b.const_ref("alpha", xs))))
    return b.function("QuickGelu", [x], [b.like(y, x)], [ir.AttrFloat32("alpha", QUICK_GELU_ALPHA),
                                                         ir.AttrInt64("stash_type", 1)])


# ---------------------------------------------------------------------------------------------
# shape inference
# ---------------------------------------------------------------------------------------------


def _same_as_first(node: ir.Node) -> None:
    """Every output has the type and shape of input 0."""
    x = node.inputs[0]
    if x is None:
        return
    for out in node.outputs:
        if x.type is not None:
            out.type = x.type
        if x.shape is not None:
            out.shape = x.shape


def _embed_shape(node: ir.Node) -> None:
    """Y: the broadcast shape of the three id tensors (when known and equal in rank), then the hidden size."""
    ids = [v for v in node.inputs[:3] if v is not None]
    word = node.inputs[3]
    if word is None or len(ids) != 3:
        return
    if word.type is not None:
        node.outputs[0].type = word.type
    shapes = [v.shape for v in ids]
    if word.shape is None or len(word.shape) != 2 or any(s is None for s in shapes):
        return
    ranks = {len(s) for s in shapes if s is not None}
    if len(ranks) != 1:
        return
    dims: list[Any] = []
    for column in zip(*shapes):  # type: ignore[misc]
        wide = [d for d in column if d != 1]
        dims.append(wide[0] if wide else 1)
    node.outputs[0].shape = ir.Shape([*dims, word.shape[1]])


# symbolic shape rules (the core's shape query asks them: ``CustomOp.shape_dims``)
# ---------------------------------------------------------------------------------------------


def _dims_of_x(node: ir.Node, q: ShapeQuery) -> list[Dims | None]:
    """Every output has input 0's dims."""
    return [q.dims(node.inputs[0])] * len(node.outputs)


def _dims_of_x_plus_1(node: ir.Node, q: ShapeQuery) -> list[Dims | None]:
    """Every output has the broadcast dims of inputs 0 and 1 (``X + Skip``, ``X + Bias``)."""
    y = broadcast(q.dims(node.inputs[0]), q.dims(node.inputs[1]) if len(node.inputs) > 1 else None)
    return [y] * len(node.outputs)


def _embed_dims(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
    """Y: the broadcast dims of the three id tensors, then the word table's hidden size."""
    ids = [q.dims(v) for v in node.inputs[:3]]
    word = q.dims(node.inputs[3]) if len(node.inputs) > 3 else None
    if word is None or len(word) != 2 or any(d is None for d in ids) or len({len(d) for d in ids if d}) != 1:
        return None
    y = broadcast(broadcast(ids[0], ids[1]), ids[2])
    return None if y is None else [(*y, word[1])]


# ---------------------------------------------------------------------------------------------
# declarations
# ---------------------------------------------------------------------------------------------

#: Below this opset the bodies have no ``CastLike`` and compute float32 only (module docstring): the fp16
#: pass raises such a model to it (``CustomOp.float_generic_opset``).
FLOAT_GENERIC_OPSET = 15


def custom_ops() -> list[CustomOp]:
    """The declarations contributed through ``mograph_add_custom_ops``: one :class:`CustomOp` per op, with
    everything about it (schema, numpy reference, function body, shapes, lowerings, standard opset,
    TensorRT plugin and the fields that pick it on a shared plugin, the computation it fuses)."""
    from mograph.passes.fusion.lowerings import lowerings_for

    plugins = TENSORRT_PLUGINS
    return [
        CustomOp(
            name="LayerNorm", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET,
            doc="LayerNorm over the last axis: (X - mean) / sqrt(var + epsilon) * Scale + B.",
            inputs=("X", "Scale", "B"), outputs=("Y",), attributes={"epsilon": 1e-5, "stash_type": 1},
            reference=lambda x, scale, b, epsilon=1e-5, stash_type=1: (layer_norm(x, scale, b, epsilon),),
            function=_layer_norm_fn, infer_shapes=_same_as_first, shape_dims=_dims_of_x, lowerings=lowerings_for("LayerNorm"),
            onnx_opset=17, tensorrt_plugin=plugins["LayerNorm"], computes="LayerNorm", affine=(1, 2),
        ),
        CustomOp(
            name="RMSNorm", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET,
            doc="RMSNorm over the last axis: X / sqrt(mean(X^2) + epsilon) * Scale.",
            inputs=("X", "Scale"), outputs=("Y",), attributes={"epsilon": 1e-6, "stash_type": 1},
            reference=lambda x, scale, epsilon=1e-6, stash_type=1: (rms_norm(x, scale, epsilon),),
            function=_rms_norm_fn, infer_shapes=_same_as_first, shape_dims=_dims_of_x, lowerings=lowerings_for("RMSNorm"),
            onnx_opset=23, tensorrt_plugin=plugins["RMSNorm"], computes="RMSNorm",
        ),
        CustomOp(
            name="SkipLayerNorm", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET,
            doc="Residual add and LayerNorm: Sum = X + Bias + Skip, Y = LayerNorm(Sum).",
            inputs=("X", "Skip", "Scale", "B", "Bias"), outputs=("Y", "Sum?"),
            attributes={"epsilon": 1e-5, "stash_type": 1},
            reference=lambda x, skip, scale, b, bias, epsilon=1e-5, stash_type=1: skip_layer_norm(
                x, skip, scale, b, bias, epsilon),
            function=_skip_layer_norm_fn, infer_shapes=_same_as_first, shape_dims=_dims_of_x_plus_1, lowerings=lowerings_for("SkipLayerNorm"),
            onnx_opset=17, tensorrt_plugin=plugins["SkipLayerNorm"], computes="LayerNorm", affine=(2, 3),
        ),
        CustomOp(
            name="SkipRMSNorm", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET,
            doc="Residual add and RMSNorm: Sum = X + Bias + Skip, Y = RMSNorm(Sum).",
            inputs=("X", "Skip", "Scale", "Bias"), outputs=("Y", "Sum?"), attributes={"epsilon": 1e-6, "stash_type": 1},
            reference=lambda x, skip, scale, bias, epsilon=1e-6, stash_type=1: skip_rms_norm(
                x, skip, scale, bias, epsilon),
            function=_skip_rms_norm_fn, infer_shapes=_same_as_first, shape_dims=_dims_of_x_plus_1, lowerings=lowerings_for("SkipRMSNorm"),
            onnx_opset=23, tensorrt_plugin=plugins["SkipRMSNorm"], computes="RMSNorm",
        ),
        CustomOp(
            name="EmbedLayerNorm", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET,
            doc="Embedding layer: LayerNorm(Word[InputIds] + Segment[SegmentIds] + Position[PositionIds]).",
            inputs=("InputIds", "SegmentIds", "PositionIds", "WordEmbedding", "SegmentEmbedding", "PositionEmbedding",
                    "Scale", "B"),
            outputs=("Y",), attributes={"epsilon": 1e-5, "stash_type": 1},
            reference=lambda ids, seg, pos, word, segment, position, scale, b, epsilon=1e-5, stash_type=1: (
                embed_layer_norm(ids, seg, pos, word, segment, position, scale, b, epsilon),),
            function=_embed_layer_norm_fn, infer_shapes=_embed_shape, shape_dims=_embed_dims, lowerings=lowerings_for("EmbedLayerNorm"),
            onnx_opset=17, computes="LayerNorm",
        ),
        CustomOp(
            name="Gelu", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET, doc="Exact GELU: X/2 (1 + erf(X / sqrt(2))).",
            inputs=("X",), outputs=("Y",), attributes={"stash_type": 1},
            reference=lambda x, stash_type=1: (gelu(x, "none"),),
            function=_gelu_fn("Gelu", "none", False), infer_shapes=_same_as_first,
            shape_dims=_dims_of_x, lowerings=lowerings_for("Gelu"),
            onnx_opset=20, tensorrt_plugin=plugins["Gelu"], tensorrt_fields={"approximate": "none"}, computes="GELU",
        ),
        CustomOp(
            name="FastGelu", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET,
            doc="GELU, tanh approximation: X/2 (1 + tanh(sqrt(2/pi) (X + 0.044715 X^3))).",
            inputs=("X",), outputs=("Y",), attributes={"stash_type": 1},
            reference=lambda x, stash_type=1: (gelu(x, "tanh"),),
            function=_gelu_fn("FastGelu", "tanh", False), infer_shapes=_same_as_first, shape_dims=_dims_of_x,
            lowerings=lowerings_for("FastGelu"), onnx_opset=20, tensorrt_plugin=plugins["Gelu"],
            tensorrt_fields={"approximate": "tanh"}, computes="GELU",
        ),
        CustomOp(
            name="QuickGelu", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET, doc="Sigmoid GELU approximation: X sigmoid(alpha X).",
            inputs=("X",), outputs=("Y",), attributes={"alpha": QUICK_GELU_ALPHA, "stash_type": 1},
            reference=lambda x, alpha=QUICK_GELU_ALPHA, stash_type=1: (quick_gelu(x, alpha),),
            function=_quick_gelu_fn, infer_shapes=_same_as_first, shape_dims=_dims_of_x, lowerings=lowerings_for("QuickGelu"), computes="GELU",
        ),
        CustomOp(
            name="BiasGelu", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET, doc="Exact GELU of X + Bias.",
            inputs=("X", "Bias"), outputs=("Y",), attributes={"stash_type": 1},
            reference=lambda x, bias, stash_type=1: (bias_gelu(x, bias, "none"),),
            function=_gelu_fn("BiasGelu", "none", True), infer_shapes=_same_as_first, shape_dims=_dims_of_x_plus_1,
            lowerings=lowerings_for("BiasGelu"), onnx_opset=20, tensorrt_plugin=plugins["BiasGelu"],
            tensorrt_fields={"approximate": "none"}, computes="GELU",
        ),
        CustomOp(
            name="BiasFastGelu", domain=DOMAIN, version=DOMAIN_VERSION, float_generic_opset=FLOAT_GENERIC_OPSET, doc="tanh-approximated GELU of X + Bias.",
            inputs=("X", "Bias"), outputs=("Y",), attributes={"stash_type": 1},
            reference=lambda x, bias, stash_type=1: (bias_gelu(x, bias, "tanh"),),
            function=_gelu_fn("BiasFastGelu", "tanh", True), infer_shapes=_same_as_first, shape_dims=_dims_of_x_plus_1,
            lowerings=lowerings_for("BiasFastGelu"), onnx_opset=20, tensorrt_plugin=plugins["BiasGelu"],
            tensorrt_fields={"approximate": "tanh"}, computes="GELU",
        ),
    ]


@functools.cache
def _declared() -> dict[str, CustomOp]:
    return {op.name: op for op in custom_ops()}


def function_for(name: str, opset: int) -> ir.Function:
    """The function body of op ``name`` for a model whose default-domain opset is ``opset``."""
    function = _declared()[name].function
    assert function is not None
    return function(opset)


def __getattr__(name: str) -> Any:
    """``FUSED_OPS`` (the op names, in declaration order) and ``ONNX_STANDARD_OPSET`` (op -> the opset of its
    standard form), read off the declarations when first asked for (their lowerings import this module)."""
    if name == "FUSED_OPS":
        return tuple(_declared())
    if name == "ONNX_STANDARD_OPSET":
        return {n: op.onnx_opset for n, op in _declared().items() if op.onnx_opset is not None}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
