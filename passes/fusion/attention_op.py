"""The ``mograph.Attention`` op: numpy reference, ONNX function body, shape function, declaration.

``Attention(Q, K, V, AttentionBias) -> Y``: ``Q`` is ``[B, S, H*D]``, ``K`` ``[B, T, Hkv*D]``, ``V``
``[B, T, Hkv*Dv]``, ``AttentionBias`` broadcastable to ``[B, H, S, T]`` (a zero scalar when there is none)::

    P_h = softmax(Q_h K_g(h)^T * scale + AttentionBias)      g(h) = h // (H / Hkv)
    Y   = concat_h(P_h V_g(h))

Attributes: ``num_heads`` (``H``), ``scale``, ``kv_num_heads`` (``Hkv``; 0 means ``H``: grouped-query
attention shares each K/V head among ``H / Hkv`` query heads, as ``repeat_kv`` does), ``nan_to_zero``
(1: a probability that is NaN becomes 0, i.e. a query whose every key is masked with ``-inf`` gives 0,
as the exports of ``torch.nn.functional.scaled_dot_product_attention`` write it).  The function body is
the unfused computation in default-domain ops (opset >= 13); its lowerings are in
:mod:`mograph.passes.fusion.lowerings.attention`.

Hints for the lowering (not part of the math) travel in the node's metadata:
:data:`MASK_FORMAT_KEY` (how ONNX Runtime gets a key-padding mask, see :data:`MASK_FORMATS`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION, CustomOp
from mograph.shapes import Dim, Dims, ShapeQuery, mul

__all__ = ["ATTENTION_OP", "ROTARY_OP", "rotary_embedding", "rotary_function", "MASK_FORMATS", "MASK_FORMAT_KEY", "KV_CACHE_KEY", "POSITION_IDS_KEY", "ONNX_ATTENTION_OPSET", "attention", "attention_function",
           "custom_ops"]

#: The fused op's type in the ``mograph`` domain.
ATTENTION_OP = "Attention"
#: First default-domain opset with a standard ``Attention`` op.
ONNX_ATTENTION_OPSET = 23
#: Node metadata key: how the ``ort`` lowering passes a key-padding mask (one of :data:`MASK_FORMATS`).
MASK_FORMAT_KEY = "mograph.attention.mask_format"
#: Node metadata: ``shared`` where ``--kv-cache shared`` asks a decode step's cache to be one static buffer.
KV_CACHE_KEY = "mograph.attention.kv_cache"
#: Node metadata: ``cache`` where ``--position-ids cache`` lets a decoder's ``position_ids`` input stand for each
#: token's cache position (the rotary then goes inside GroupQueryAttention; an assumption, see the option).
POSITION_IDS_KEY = "mograph.attention.position_ids"
#: ``bias``: the additive bias itself (``attention_bias`` of Attention / MultiHeadAttention), exact for every mask;
#: ``lengths``: a 1-D ``[B]`` key-length ``mask_index`` (ReduceSum of a 0/1 ``attention_mask``), exact for
#: right-padded masks only; ``raw``: the 2-D ``[B, T]`` mask as ``mask_index``, exact for every 0/1 mask.
MASK_FORMATS = ("bias", "lengths", "raw")


# ---------------------------------------------------------------------------------------------
# the op: numpy reference, function body, shapes
# ---------------------------------------------------------------------------------------------


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None = None, *,
              num_heads: int, scale: float | None = None, kv_num_heads: int = 0,
              nan_to_zero: int = 0) -> np.ndarray:
    """Multi-head (grouped-query) attention over ``[B, S, H*D]`` inputs (float32 arithmetic, result in q's dtype)."""
    dt: Any = np.float64 if q.dtype == np.float64 else np.float32
    kvh = kv_num_heads or num_heads
    b, s, hidden = q.shape
    t = k.shape[1]
    d = hidden // num_heads
    dv = v.shape[2] // kvh
    rep = num_heads // kvh
    qh: np.ndarray = q.astype(dt).reshape(b, s, num_heads, d).transpose(0, 2, 1, 3)
    kh: np.ndarray = k.astype(dt).reshape(k.shape[0], t, kvh, d).transpose(0, 2, 3, 1).repeat(rep, axis=1)
    vh: np.ndarray = v.astype(dt).reshape(v.shape[0], t, kvh, dv).transpose(0, 2, 1, 3).repeat(rep, axis=1)
    scores: np.ndarray = np.matmul(qh, kh) * np.asarray(1.0 / math.sqrt(d) if scale is None else scale, dtype=dt)
    if bias is not None:
        scores = scores + bias.astype(dt)
    with np.errstate(invalid="ignore"):
        scores = scores - scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p = p / p.sum(axis=-1, keepdims=True)
    if nan_to_zero:
        p = np.where(np.isnan(p), 0.0, p).astype(dt)
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
    one = add("Constant", value_ints=[1])
    heads = add("Constant", value_int=ir.RefAttr("value_int", "num_heads", ir.AttributeType.INT))
    heads = add("Reshape", heads, one)
    kv_attr = add("Constant", value_int=ir.RefAttr("value_int", "kv_num_heads", ir.AttributeType.INT))
    kv_attr = add("Reshape", kv_attr, one)
    zero = add("Constant", value_ints=[0])
    kv_heads = add("Where", add("Equal", kv_attr, zero), heads, kv_attr)  # kv_num_heads 0 means num_heads
    rep = add("Div", heads, kv_heads)
    qh = add("Transpose", add("Reshape", q, add("Concat", add("Constant", value_ints=[0, 0]), heads,
                                                  add("Constant", value_ints=[-1]), axis=0)), perm=[0, 2, 1, 3])
    kv_shape = add("Concat", add("Constant", value_ints=[0, 0]), kv_heads, add("Constant", value_ints=[-1]), axis=0)

    def grouped(x: ir.Value, perm: list[int]) -> ir.Value:
        """[B, T, Hkv*d] -> [B, H, ., .] with each K/V head repeated H/Hkv times (repeat_kv)."""
        xh = add("Transpose", add("Reshape", x, kv_shape), perm=perm)  # [B, Hkv, a, b]
        shape = add("Shape", xh)
        lead = add("Slice", shape, zero, add("Constant", value_ints=[2]))  # [B, Hkv]
        tail = add("Slice", shape, add("Constant", value_ints=[2]), add("Constant", value_ints=[4]))  # [a, b]
        big = add("Expand", add("Unsqueeze", xh, add("Constant", value_ints=[2])), add("Concat", lead, rep, tail, axis=0))
        bsz = add("Slice", shape, zero, one)
        return add("Reshape", big, add("Concat", bsz, heads, tail, axis=0))

    kt = grouped(k, [0, 2, 3, 1])
    vh = grouped(v, [0, 2, 1, 3])
    scale = add("Constant", value_float=ir.RefAttr("value_float", "scale", ir.AttributeType.FLOAT))
    if opset >= 15:
        scale = add("CastLike", scale, q)
    scores = add("Add", add("Mul", add("MatMul", qh, kt), scale), bias)
    probs = add("Softmax", scores, axis=-1)
    flag = add("Constant", value_int=ir.RefAttr("value_int", "nan_to_zero", ir.AttributeType.INT))
    flag = add("Cast", flag, to=ir.DataType.BOOL.value)
    zero_p = add("Constant", value_float=0.0)
    if opset >= 15:
        zero_p = add("CastLike", zero_p, probs)
    probs = add("Where", add("And", add("IsNaN", probs), flag), zero_p, probs)
    ctx = add("Transpose", add("MatMul", probs, vh), perm=[0, 2, 1, 3])
    y = add("Reshape", ctx, add("Constant", value_ints=[0, 0, -1]))
    graph = ir.Graph([q, k, v, bias], [y], nodes=nodes, opset_imports={"": opset})
    return ir.Function(DOMAIN, ATTENTION_OP, "", graph=graph,
                       attributes=[ir.AttrInt64("num_heads", 1), ir.AttrFloat32("scale", 1.0),
                                   ir.AttrInt64("kv_num_heads", 0), ir.AttrInt64("nan_to_zero", 0)])


def _infer_shapes(node: ir.Node) -> None:
    q, _, v = node.inputs[:3]
    out = node.outputs[0]
    if q is None or v is None:
        return
    if q.type is not None:
        out.type = q.type
    if q.shape is not None and v.shape is not None and len(q.shape) == 3 and len(v.shape) == 3:
        heads = int(node.attributes["num_heads"].value) if "num_heads" in node.attributes else 1
        kv = int(node.attributes["kv_num_heads"].value) if "kv_num_heads" in node.attributes else 0
        width = v.shape[2]
        if kv and isinstance(width, int):
            width = width * heads // kv
        out.shape = ir.Shape([q.shape[0], q.shape[1], width])


# ---------------------------------------------------------------------------------------------
# mograph.RotaryEmbedding
# ---------------------------------------------------------------------------------------------

#: The rotary embedding op's type in the ``mograph`` domain.
ROTARY_OP = "RotaryEmbedding"


def rotary_embedding(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, num_heads: int,
                     rotary_dim: int = 0) -> np.ndarray:
    """``X`` ``[B, S, N*D]`` rotated per head: ``X_h * cos + rotate_half(X_h) * sin`` (cos, sin broadcastable
    to the head layout ``[B, N, S, D]``; ``rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])``).  With
    ``rotary_dim`` R (0 < R < D: a partial rotary, Phi-4-mini / StableLM's ``partial_rotary_factor``) only each
    head's first R values are rotated (as above, with R for D and cos, sin ``[..., R]``); the rest pass as they are."""
    dt: Any = np.float64 if x.dtype == np.float64 else np.float32
    b, s, hidden = x.shape
    d = hidden // num_heads
    r = rotary_dim or d
    xh: np.ndarray = x.astype(dt).reshape(b, s, num_heads, d).transpose(0, 2, 1, 3)
    xr = xh[..., :r]
    half = np.concatenate([-xr[..., r // 2:], xr[..., : r // 2]], axis=-1)
    y = np.concatenate([xr * cos.astype(dt) + half * sin.astype(dt), xh[..., r:]], axis=-1)
    return y.transpose(0, 2, 1, 3).reshape(b, s, hidden).astype(x.dtype)


def rotary_function(opset: int) -> ir.Function:
    """Function body, in the ``[B, S, N, D]`` layout (only cos and sin are transposed, not X)."""
    nodes: list[ir.Node] = []

    def add(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes=attrs)
        nodes.append(node)
        return node.outputs[0]

    x, cos, sin = (ir.Value(name=n) for n in ("X", "Cos", "Sin"))
    heads = add("Constant", value_int=ir.RefAttr("value_int", "num_heads", ir.AttributeType.INT))
    heads = add("Reshape", heads, add("Constant", value_ints=[1]))
    x4 = add("Reshape", x, add("Concat", add("Constant", value_ints=[0, 0]), heads, add("Constant", value_ints=[-1]),
                               axis=0))  # [B, S, N, D]

    def to_bsnd(t: ir.Value) -> ir.Value:  # broadcastable [b, n, s, D] -> [b, s, n, D]
        shape4 = add("Concat", add("Constant", value_ints=[1, 1, 1, 1]), add("Shape", t), axis=0)
        t4 = add("Reshape", t, add("Slice", shape4, add("Constant", value_ints=[-4]),
                                   add("Constant", value_ints=[2**62])))
        return add("Transpose", t4, perm=[0, 2, 1, 3])

    d = add("Shape", x4, start=3) if opset >= 15 else add("Slice", add("Shape", x4), add("Constant", value_ints=[3]),
                                                            add("Constant", value_ints=[4]))
    # the rotated width R: rotary_dim, or D where it is 0 (the whole head); the D - R values after it pass
    rd = add("Reshape", add("Constant", value_int=ir.RefAttr("value_int", "rotary_dim", ir.AttributeType.INT)),
             add("Constant", value_ints=[1]))
    r = add("Where", add("Equal", rd, add("Constant", value_ints=[0])), d, rd)
    h = add("Div", r, add("Constant", value_ints=[2]))
    axes, zero, end = add("Constant", value_ints=[3]), add("Constant", value_ints=[0]), add("Constant", value_ints=[2**62])
    xr = add("Slice", x4, zero, r, axes)
    first = add("Slice", xr, zero, h, axes)
    second = add("Slice", xr, h, end, axes)
    half = add("Concat", add("Neg", second), first, axis=-1)
    y = add("Add", add("Mul", xr, to_bsnd(cos)), add("Mul", half, to_bsnd(sin)))
    y = add("Concat", y, add("Slice", x4, r, end, axes), axis=-1)
    y = add("Reshape", y, add("Constant", value_ints=[0, 0, -1]))
    graph = ir.Graph([x, cos, sin], [y], nodes=nodes, opset_imports={"": opset})
    return ir.Function(DOMAIN, ROTARY_OP, "", graph=graph,
                       attributes=[ir.AttrInt64("num_heads", 1), ir.AttrInt64("rotary_dim", 0)])


def _attention_dims(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
    """Y ``[B, S, H*Dv]``: Q's first two dims, then V's width (times ``num_heads / kv_num_heads`` for GQA)."""
    dq, dv = q.dims(node.inputs[0]), q.dims(node.inputs[2])
    if dq is None or dv is None or len(dq) != 3 or len(dv) != 3:
        return None
    heads = int(node.attributes["num_heads"].value) if "num_heads" in node.attributes else 1
    kv = int(node.attributes["kv_num_heads"].value) if "kv_num_heads" in node.attributes else 0
    width = dv[2]
    if kv and heads % kv == 0:
        width = mul(width, Dim.lit(heads // kv))
    elif kv:
        width = None
    return [(dq[0], dq[1], width)]


def _dims_of_x(node: ir.Node, q: ShapeQuery) -> list[Dims | None]:
    return [q.dims(node.inputs[0])]


def _same_as_x(node: ir.Node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    if x is not None:
        out.type, out.shape = x.type, x.shape


def custom_ops() -> list[CustomOp]:
    """The ``mograph.Attention`` and ``mograph.RotaryEmbedding`` declarations (``mograph_add_custom_ops``)."""
    from mograph.passes.fusion.lowerings import lowerings_for

    return [
        CustomOp(
            name=ATTENTION_OP,
            domain=DOMAIN,
            version=DOMAIN_VERSION,
            doc="Multi-head / grouped-query attention: Y = concat_h(softmax(Q_h K_g(h)^T * scale + AttentionBias) "
                "V_g(h)), g(h) = h // (num_heads / kv_num_heads); Q [B, S, H*D], K, V [B, T, Hkv*D], AttentionBias "
                "broadcastable to [B, H, S, T] (a zero scalar when there is none); nan_to_zero=1 turns NaN "
                "probabilities (fully -inf-masked rows) into 0.",
            inputs=("Q", "K", "V", "AttentionBias"),
            outputs=("Y",),
            attributes={"num_heads": 1, "scale": 1.0, "kv_num_heads": 0, "nan_to_zero": 0},
            reference=lambda q, k, v, bias, num_heads=1, scale=1.0, kv_num_heads=0, nan_to_zero=0: (
                attention(q, k, v, bias, num_heads=num_heads, scale=scale, kv_num_heads=kv_num_heads,
                          nan_to_zero=nan_to_zero),),
            function=attention_function,
            infer_shapes=_infer_shapes,
            shape_dims=_attention_dims,
            lowerings=lowerings_for(ATTENTION_OP),
            onnx_opset=ONNX_ATTENTION_OPSET,
            computes="attention",
            float_generic_opset=15,  # the body's CastLike of the scale and zero
        ),
        CustomOp(
            name=ROTARY_OP,
            domain=DOMAIN,
            version=DOMAIN_VERSION,
            doc="Rotary position embedding of X [B, S, N*D] per head: X_h * Cos + rotate_half(X_h) * Sin, Cos and "
                "Sin broadcastable to [B, N, S, D], rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2]); "
                "rotary_dim R > 0 (a partial rotary): the same on each head's first R values (Cos, Sin [..., R]), "
                "the other D - R passed through.",
            inputs=("X", "Cos", "Sin"),
            outputs=("Y",),
            attributes={"num_heads": 1, "rotary_dim": 0},
            reference=lambda x, cos, sin, num_heads=1, rotary_dim=0: (
                rotary_embedding(x, cos, sin, num_heads=num_heads, rotary_dim=rotary_dim),),
            function=rotary_function,
            infer_shapes=_same_as_x,
            shape_dims=_dims_of_x,
            lowerings=lowerings_for(ROTARY_OP),
        ),
    ]

