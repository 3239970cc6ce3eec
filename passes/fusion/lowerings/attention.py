"""Lowerings of ``mograph.Attention``.

``ort``
    self-attention whose Q, K, V are ``x @ W (+ b)`` of one ``x`` with constant weights (and as many K/V heads as
    query heads) becomes ``com.microsoft.Attention`` with the three projections packed into one
    ``[hidden, 3*H*D]`` GEMM inside the op (what ONNX Runtime's transformers optimizer emits: one kernel per
    layer instead of three MatMuls and three bias Adds); anything else (cross-attention, a KV cache, grouped
    query heads, projections read elsewhere) gets ``com.microsoft.MultiHeadAttention`` with separate Q, K, V
    (cuDNN flash attention on CUDA, see ``/work/gpu-results/FACTS.md`` of 2026-12-01).  How a mask gets
    there is the node's :data:`~mograph.passes.fusion.attention_op.MASK_FORMAT_KEY` hint (the
    ``fuse-attention`` option ``--mask-format``):

    ``bias`` (default)
        ``M`` as ``attention_bias`` (of either op), expanded to ``[B|1, H|1, S, T]`` where the kernel needs it (one
        expansion per bias and query length, shared by every layer).  Exact for every mask (left or right
        padding, causal, anything additive), and an additive bias still reaches flash attention on CUDA.
    ``lengths``
        where ``M`` is provably a key-padding bias of a 2-D ``[B, T]`` ``attention_mask`` input (0 where the
        mask is 1, a negative constant ``c`` where it is 0: ``(1 - mask) * c``, ``Where(mask, 0, c)``, or
        ``transformers``' index-based padding lookup as TorchScript exports it), the key lengths
        ``ReduceSum(mask, 1)`` (int32 ``[B]``, built once) go to ``key_padding_mask`` (the 1-D ``mask_index`` of
        the packed ``Attention``) and the float bias is
        dropped: the fastest form, but it equals the original **only for right-padded masks** (ones, then
        zeros); a left-padded row attends to its first ``length`` keys instead.  Other biases stay ``bias``.
    ``raw``
        the traced mask itself, cast once to int32, as a 2-D ``mask_index`` (``com.microsoft.Attention`` with
        the three projections packed into one ``[hidden, 3*H*D]`` GEMM when Q, K, V are ``x @ W + b`` of one
        ``x`` with constant weights, else ``MultiHeadAttention``'s ``key_padding_mask``), with
        ``mask_filter_value = c``: exact for 0/1 masks, even a fully padded row, but ONNX Runtime CUDA runs it
        with its slow unfused ``SoftmaxWithRawMask`` kernel.

    ``nan_to_zero`` adds ``Where(IsNaN(Y), 0, Y)`` after the kernel (a fully ``-inf``-masked row gives NaN
    there, 0 in the original).  Grouped-query attention (``kv_num_heads`` != ``num_heads``): K and V are
    repeated per head in their ``[B, T, Hkv*D]`` layout (Reshape/Expand/Reshape, as ``repeat_kv`` does),
    then ``MultiHeadAttention`` as above (``GroupQueryAttention`` would avoid the copy but takes only
    causal attention with position-indexed rotary caches and ``seqlens_k``; not lowered to yet).
``RotaryEmbedding``
    every target inlines the body (X rotated in its ``[B, S, N, D]`` view; only cos/sin are
    transposed): ONNX Runtime's ``com.microsoft.RotaryEmbedding`` takes position-indexed cos/sin caches,
    not the per-token cos/sin an export computes.
``onnx``
    the standard ``Attention`` (3-D form, ``q_num_heads``, ``kv_num_heads``; ``M`` as ``attn_mask``, expanded
    the same way, since ONNX Runtime does not broadcast its dim -2) at opset >= 23; below that ONNX has no
    attention op: the lowering declines and the ``lower`` step inlines the function body.
``tensorrt``
    the function body, inlined: mograph has no TensorRT plugin for attention yet, and TensorRT's ONNX
    parser would take a node named ``Attention`` for its own op and refuse it; TensorRT fuses the
    decomposed attention itself.

Lowerings of one ``lower`` run share what they build for the same input (the expanded bias, the int32
mask, the key lengths) through :attr:`~mograph.lowering.LoweringContext.shared`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.attention_op import MASK_FORMAT_KEY
from mograph.passes.fusion.ops import FLOAT_TYPES

from mograph.custom_ops import Lowering
from mograph.irutil import add_initializer, attr_value, is_zero, same_dim
from mograph.lowering import LoweringContext, replace_node
from mograph.patterns import constant_array, scalar_value

__all__ = ["is_zero_bias", "LOWERINGS"]

MS_DOMAIN = "com.microsoft"
ONNX_ATTENTION_OPSET = 23

def _projection(value: ir.Value, user: ir.Node) -> tuple[ir.Value, np.ndarray, np.ndarray] | None:
    """``(x, W, b)`` if ``value`` is ``x @ W + b`` (or ``x @ W``: b = 0) with constant 2-D W and 1-D b, read
    only by ``user``."""
    add = value.producer()
    if add is None or add.domain != "" or value.is_graph_output():
        return None
    if any(c is not user for c, _ in value.uses()):
        return None
    if add.op_type == "MatMul":  # a projection without bias (Whisper's k_proj)
        w, x = constant_array(add.inputs[1]), add.inputs[0]
        if w is None or x is None or w.ndim != 2:
            return None
        return x, w, np.zeros(w.shape[1], dtype=w.dtype)
    if add.op_type != "Add":
        return None
    for mm_in, b_in in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mm = mm_in.producer() if mm_in is not None else None
        if mm is None or mm.op_type != "MatMul" or mm.domain != "" or mm_in is None:
            continue
        if mm_in.is_graph_output() or len(mm_in.uses()) != 1:
            continue
        w, b = constant_array(mm.inputs[1]), constant_array(b_in)
        x = mm.inputs[0]
        if w is None or b is None or x is None or w.ndim != 2 or b.ndim != 1 or b.shape[0] != w.shape[1]:
            continue
        return x, w, b
    return None


def _packed(node: ir.Node) -> tuple[ir.Value, np.ndarray, np.ndarray] | None:
    """One ``x`` and the packed ``[W_q | W_k | W_v]``, ``[b_q | b_k | b_v]`` if Q, K, V are its projections."""
    parts = [_projection(v, node) if v is not None else None for v in node.inputs[:3]]
    if any(p is None for p in parts):
        return None
    xs = {id(p[0]) for p in parts if p is not None}
    widths = {p[1].shape[1] for p in parts if p is not None}
    if len(xs) != 1 or len(widths) != 1 or len({id(v) for v in node.inputs[:3]}) != 3:
        return None
    x = parts[0][0]  # type: ignore[index]
    if x.shape is None or len(x.shape) != 3 or x.dtype is None:
        return None
    dtype = x.dtype.numpy()
    w = np.concatenate([p[1] for p in parts], axis=1).astype(dtype)  # type: ignore[index]
    b = np.concatenate([p[2] for p in parts]).astype(dtype)  # type: ignore[index]
    return x, w, b


#: Lowerings of one pass run share what they build for the same input: key -> value.
Shared = dict[tuple[Any, ...], ir.Value]


def _dim_key(dim: Any, owner: ir.Value) -> tuple[Any, ...]:
    """A key equal for two dims known to be equal: the int, the symbolic name, else the owning value."""
    if isinstance(dim, int):
        return ("int", dim)
    name = getattr(dim, "value", None)
    return ("sym", name) if name is not None else ("value", id(owner))


def _bias_for_kernel(bias: ir.Value, seq_of: ir.Value, new_nodes: list[ir.Node],
                     shared: Shared | None = None) -> ir.Value:
    """The additive bias as ONNX Runtime's kernels take it: rank 4 with dim 2 = the query length.

    The kernels broadcast dims 0 and 1 of ``attention_bias`` but not dim 2, so a key-padding bias
    ``[B, 1, 1, T]`` is expanded to ``[B, 1, S, T]`` (exactly the same values).  With ``shared``, an
    expansion of the same bias to a query length known to be equal (same static or symbolic dim)
    is built once and reused by every layer.
    """
    shape = bias.shape
    if shape is not None and len(shape) == 4 and seq_of.shape is not None and same_dim(shape[2], seq_of.shape[1]):
        return bias
    seq_dim = seq_of.shape[1] if seq_of.shape is not None and len(seq_of.shape) >= 2 else None
    key = ("bias_expansions", id(bias), *_dim_key(seq_dim, seq_of))
    if shared is not None and key in shared:
        return shared[key]

    def add(op_type: str, inputs: list[ir.Value], **attrs: Any) -> ir.Value:
        n = ir.node(op_type, inputs, attributes=attrs)
        new_nodes.append(n)
        return n.outputs[0]

    ones = add("Constant", [], value=ir.tensor(np.array([1, 1], dtype=np.int64)))
    one = add("Constant", [], value=ir.tensor(np.array([1], dtype=np.int64)))
    seq = add("Gather", [add("Shape", [seq_of]), one], axis=0)
    target = add("Concat", [ones, seq, one], axis=0)
    out = add("Expand", [bias, target])
    if shared is not None:
        shared[key] = out
    return out


# ---------------------------------------------------------------------------------------------
# key-padding masks: the additive bias traced back to a 2-D attention_mask input
# ---------------------------------------------------------------------------------------------

_INT_TYPES = {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8,
              ir.DataType.BOOL}


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _unsqueeze_axes(node: ir.Node) -> list[int] | None:
    if "axes" in node.attributes:
        return [int(a) for a in node.attributes["axes"].value]
    arr = constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
    return None if arr is None else [int(a) for a in arr.reshape(-1)]


def _mask_input(value: ir.Value | None, layout: tuple[str, ...]) -> ir.Value | None:
    """The 2-D ``[B, T]`` integer/bool graph input ``value`` is, through Cast and Unsqueeze, laid out as ``layout``.

    ``layout`` names the dims of ``value``: ``"b"``, ``"t"`` (the input's two dims) and ``"1"`` (an
    inserted unit dim).  Casts are allowed as the values they carry are 0/1 masks (every cast keeps 0
    and 1 apart).
    """
    dims: list[str] = list(layout)
    while value is not None and not value.is_graph_input():
        node = value.producer()
        if node is None or node.domain != "" or node.op_type not in ("Cast", "Unsqueeze"):
            return None
        if node.op_type == "Unsqueeze":
            axes = _unsqueeze_axes(node)
            if axes is None:
                return None
            axes = sorted(a + len(dims) if a < 0 else a for a in axes)
            if any(a >= len(dims) or dims[a] != "1" for a in axes):
                return None
            for a in reversed(axes):
                del dims[a]
        value = node.inputs[0]
    if value is None or dims != ["b", "t"] or value.dtype not in _INT_TYPES:
        return None
    if value.shape is not None and len(value.shape) != 2:
        return None
    return value


def _is_range_from_zero(value: ir.Value | None) -> ir.Node | None:
    """The ``Range(0, n, 1)`` node ``value`` is (through Unsqueeze only), else None."""
    while (node := _producer(value, "Unsqueeze")) is not None:
        value = node.inputs[0]
    rng = _producer(value, "Range")
    if rng is None or scalar_value(rng.inputs[0]) != 0 or scalar_value(rng.inputs[2]) != 1:
        return None
    return rng


def _all_true(value: ir.Value | None) -> bool:
    """Whether ``value`` is provably all true: a constant, ``And`` of such, ``Range(0, n, 1) >= 0``, an
    ``Expand``/``Unsqueeze``/``Reshape`` of such."""
    arr = constant_array(value)
    if arr is not None:
        return arr.dtype == np.bool_ and bool(arr.all())
    node = value.producer() if value is not None else None
    if node is None or node.domain != "":
        return False
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        return fill is not None and fill.value.dtype == ir.DataType.BOOL and bool(fill.value.numpy().all())
    if node.op_type == "And":
        return _all_true(node.inputs[0]) and _all_true(node.inputs[1])
    if node.op_type in ("Expand", "Unsqueeze", "Reshape"):  # copies of the values (transformers 5.17 ViT's mask)
        return _all_true(node.inputs[0])
    if node.op_type == "Cast" and int(attr_value(node, "to", 0)) == ir.DataType.BOOL.value:
        return _all_true(node.inputs[0])  # true stays true
    if node.op_type == "GreaterOrEqual":
        bound = scalar_value(node.inputs[1])
        return bound is not None and bound <= 0 and _is_range_from_zero(node.inputs[0]) is not None
    return False


def is_zero_bias(value: ir.Value | None) -> bool:
    """Whether the additive bias ``value`` is provably all zero: a float constant of zeros, or
    ``Where(all true, zeros, _)`` (a key mask of only ones turned into a bias, as transformers 5.17 exports ViT)."""
    arr = constant_array(value)
    if arr is not None:
        return arr.dtype.kind == "f" and not np.any(arr)
    node = _producer(value, "Where")
    if node is None or not _all_true(node.inputs[0]):
        return False
    zero = constant_array(node.inputs[1])
    return zero is not None and zero.dtype.kind == "f" and not np.any(zero)


def _dim_of(value: ir.Value | None, axis: int) -> ir.Value | None:
    """The tensor whose dim ``axis`` the scalar ``value`` is (``Gather(Shape(x), axis)``), through Cast."""
    while (cast := _producer(value, "Cast")) is not None:
        value = cast.inputs[0]
    gather = _producer(value, "Gather")
    if gather is None or scalar_value(gather.inputs[1]) != axis or int(attr_value(gather, "axis", 0)) != 0:
        return None
    shape = _producer(gather.inputs[0], "Shape")
    if shape is None or "start" in shape.attributes or "end" in shape.attributes:
        return None
    x = shape.inputs[0]
    while (cast := _producer(x, "Cast")) is not None:
        x = cast.inputs[0]
    return x


def _gathered_padding(value: ir.Value | None) -> ir.Value | None:
    """The mask input of ``transformers``' index-based padding lookup, ``mask[b, t]`` laid out ``[B, 1, 1, T]``.

    ``Reshape(Reshape(Gather(Flatten(Cast(mask, bool), axis=2), b * T + t), [-1]), Shape(b * T + t))``
    where ``b`` is ``Range(0, B, 1)`` on axis 0 and ``t`` is ``Range(0, T, 1)`` on axis 3 of a
    rank-4 index, ``T`` the mask's dim 1 (``Flatten`` makes ``[B*T, 1]``).
    """
    outer = _producer(value, "Reshape")
    inner = _producer(outer.inputs[0], "Reshape") if outer is not None else None
    gather = _producer(inner.inputs[0], "Gather") if inner is not None else None
    if outer is None or inner is None or gather is None or int(attr_value(gather, "axis", 0)) != 0:
        return None
    flat = constant_array(inner.inputs[1])
    target = outer.inputs[1]
    if (concat := _producer(target, "Concat")) is not None and len(concat.inputs) == 1:
        target = concat.inputs[0]  # a Concat of one input is that input
    shape_of = _producer(target, "Shape")
    if flat is None or flat.reshape(-1).tolist() != [-1] or shape_of is None or shape_of.inputs[0] is not gather.inputs[1]:
        return None
    flatten = _producer(gather.inputs[0], "Flatten")
    if flatten is None or int(attr_value(flatten, "axis", 1)) != 2:
        return None
    cast = _producer(flatten.inputs[0], "Cast")
    if cast is None or int(attr_value(cast, "to", 0)) != ir.DataType.BOOL.value:
        return None
    mask = _mask_input(cast.inputs[0], ("b", "t"))
    add = _producer(gather.inputs[1], "Add")
    if mask is None or add is None:
        return None
    for t_idx, bt in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mul = _producer(bt, "Mul")
        if mul is None:
            continue
        for b_idx, t_len in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            t_rng, b_rng = _is_range_from_zero(t_idx), _is_range_from_zero(b_idx)
            if t_rng is None or b_rng is None or _range_axis(t_idx) != 3 or _range_axis(b_idx) != 0:
                continue
            if _dim_of(t_len, 1) is mask and _dim_of(t_rng.inputs[1], 1) is mask:
                return mask
    return None


def _range_axis(value: ir.Value | None) -> int | None:
    """The axis the 1-D ``Range`` under ``value`` lands on after the Unsqueezes between them (rank 4)."""
    unsqueezes = []
    while (node := _producer(value, "Unsqueeze")) is not None:
        unsqueezes.append(node)
        value = node.inputs[0]
    dims = ["r"]
    for node in reversed(unsqueezes):  # innermost first
        axes = _unsqueeze_axes(node)
        if axes is None:
            return None
        rank = len(dims) + len(axes)
        for ax in sorted(x + rank if x < 0 else x for x in axes):
            dims.insert(ax, "1")
    return dims.index("r") if len(dims) == 4 else None


def _keep(value: ir.Value | None) -> ir.Value | None:
    """The mask input if ``value`` (bool, broadcastable to ``[B, 1, S, T]``) is ``mask[b, t] != 0`` for every s."""
    node = value.producer() if value is not None else None
    if node is None or node.domain != "":
        return None
    if node.op_type == "Expand":  # broadcasting copies values; the kernel broadcasts over S and heads itself
        return _keep(node.inputs[0])
    if node.op_type == "And":
        a, b = node.inputs[0], node.inputs[1]
        if _all_true(a):
            return _keep(b)
        if _all_true(b):
            return _keep(a)
        return None
    if node.op_type == "Cast" and int(attr_value(node, "to", 0)) == ir.DataType.BOOL.value:
        # a cast of a keep mask to bool keeps it; a cast of the mask to bool is mask != 0
        return _keep(node.inputs[0]) or _mask_input(node.inputs[0], ("b", "1", "1", "t"))
    if node.op_type == "Unsqueeze" and value is not None and value.dtype == ir.DataType.BOOL:
        return _mask_input(value, ("b", "1", "1", "t"))  # a bool mask input
    return _gathered_padding(value)


def _padding_mask(bias: ir.Value) -> tuple[ir.Value, float] | None:
    """``(mask, c)`` if ``bias[b, :, s, t]`` is 0 where the 2-D input ``mask[b, t]`` is 1 and ``c`` where it is 0.

    The forms traced: ``(1 - float(mask[:, None, None, :])) * c`` (``transformers`` before 4.48) and
    ``Where(keep, 0, c)`` with ``keep`` a bool cast of ``mask[:, None, None, :]`` or ``transformers``'
    index-based padding lookup, possibly And-ed with provably all-true terms and expanded.  ``c`` must
    be a negative scalar.  Exact for 0/1 masks, the contract of ``attention_mask``.
    """
    node = bias.producer()
    if node is None or node.domain != "" or bias.dtype not in FLOAT_TYPES:
        return None
    mask: ir.Value | None = None
    c: float | None = None
    if node.op_type == "Mul":
        for x, k in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            sub = _producer(x, "Sub")
            c = scalar_value(k)
            if sub is None or c is None or scalar_value(sub.inputs[0]) != 1.0:
                continue
            if sub.inputs[1] is not None and sub.inputs[1].dtype == bias.dtype:
                mask = _mask_input(sub.inputs[1], ("b", "1", "1", "t"))
            if mask is not None:
                break
    elif node.op_type == "Where" and scalar_value(node.inputs[1]) == 0.0:
        c = scalar_value(node.inputs[2])
        mask = _keep(node.inputs[0])
    if mask is None or c is None or not c < 0 or not math.isfinite(c):
        return None
    return mask, c


def _mask_index(mask: ir.Value, new_nodes: list[ir.Node], shared: Shared | None) -> ir.Value:
    """``mask`` as the int32 ``mask_index`` ONNX Runtime's Attention takes (built once per mask)."""
    if mask.dtype == ir.DataType.INT32:
        return mask
    key = ("mask_index_casts", id(mask))
    if shared is not None and key in shared:
        return shared[key]
    cast = ir.node("Cast", [mask], attributes={"to": ir.DataType.INT32.value})
    new_nodes.append(cast)
    if shared is not None:
        shared[key] = cast.outputs[0]
    return cast.outputs[0]


def _replace(node: ir.Node, new_nodes: list[ir.Node], ctx: LoweringContext) -> None:
    """The last new node gives the op's output (the ones before it build its inputs)."""
    for i, n in enumerate(new_nodes[:-1]):
        n.name = f"{node.name or node.op_type}/{i}"
    last = new_nodes[-1]
    replace_node(node, new_nodes, [last.outputs[0]], ctx.target)
    last.name = node.name or node.op_type


def _key_lengths(mask: ir.Value, new_nodes: list[ir.Node], shared: Shared | None) -> ir.Value:
    """``ReduceSum(mask, axis 1)`` as int32 ``[B]``: the key lengths of a right-padded 0/1 mask (built once)."""
    key = ("mask_lengths", id(mask))
    if shared is not None and key in shared:
        return shared[key]
    as_int = _mask_index(mask, new_nodes, shared)
    axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([1], dtype=np.int64))})
    red = ir.node("ReduceSum", [as_int, axes.outputs[0]], attributes={"keepdims": 0})
    new_nodes.extend([axes, red])
    if shared is not None:
        shared[key] = red.outputs[0]
    return red.outputs[0]


def _nan_to_zero(y: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
    """``Where(IsNaN(y), 0, y)``: a query row whose every key is masked with -inf gives 0, as in the original.

    The zero has ``y``'s element type (float16 after the ``fp16`` pass), so ``y.dtype`` must be set.
    """
    dtype = y.dtype.numpy() if y.dtype is not None else np.float32
    zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, dtype=dtype))})
    isnan = ir.node("IsNaN", [y])
    where = ir.node("Where", [isnan.outputs[0], zero.outputs[0], y])
    new_nodes.extend([zero, isnan, where])
    return where.outputs[0]


def _repeat_heads(x: ir.Value, groups: int, rep: int, new_nodes: list[ir.Node],
                  shared: Shared | None) -> ir.Value | None:
    """``[B, T, G*D]`` -> ``[B, T, G*rep*D]``, each head repeated ``rep`` times in place."""
    key = ("kv_repeats", id(x), rep)
    if shared is not None and key in shared:
        return shared[key]

    def const(vals: list[int]) -> ir.Value:
        n = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(vals, dtype=np.int64))})
        new_nodes.append(n)
        return n.outputs[0]

    def add(op_type: str, inputs: list[ir.Value], **attrs: Any) -> ir.Value:
        n = ir.node(op_type, inputs, attributes=attrs)
        new_nodes.append(n)
        return n.outputs[0]

    x5 = add("Reshape", [x, const([0, 0, groups, 1, -1])])  # [B, T, G, 1, D]
    shape5 = add("Shape", [x5])
    lead = add("Slice", [shape5, const([0]), const([2])])
    dim = add("Slice", [shape5, const([4]), const([5])])
    big = add("Expand", [x5, add("Concat", [lead, const([groups, rep]), dim], axis=0)])
    out = add("Reshape", [big, const([0, 0, -1])])
    if shared is not None:
        shared[key] = out
    return out


def _lower_ort(node: ir.Node, ctx: LoweringContext) -> bool:
    """``com.microsoft.MultiHeadAttention`` (or ``Attention`` with packed projections for ``raw`` masks)."""
    q, k, v, bias = node.inputs
    graph = node.graph
    assert graph is not None and q is not None and k is not None and v is not None
    heads = int(attr_value(node, "num_heads", 1))
    kv_heads = int(attr_value(node, "kv_num_heads", 0)) or heads
    new_nodes: list[ir.Node] = []
    if kv_heads != heads:  # MultiHeadAttention has one K/V head per query head: repeat them (as repeat_kv does)
        rk = _repeat_heads(k, kv_heads, heads // kv_heads, new_nodes, ctx.shared)
        rv = _repeat_heads(v, kv_heads, heads // kv_heads, new_nodes, ctx.shared)
        if rk is None or rv is None:
            return False
        k, v = rk, rv
    attrs: dict[str, Any] = {"num_heads": heads, "scale": float(attr_value(node, "scale", 1.0))}
    fmt = node.metadata_props.get(MASK_FORMAT_KEY, "bias")
    padding = None if is_zero(bias) or fmt == "bias" else _padding_mask(bias)  # type: ignore[arg-type]
    packed = _packed(node) if kv_heads == heads else None
    if packed is not None:  # self-attention: one [hidden, 3*H*D] GEMM for Q, K and V inside the kernel
        x, w, b = packed
        wv = add_initializer(graph, "mograph_qkv_weight", w)
        bv = add_initializer(graph, "mograph_qkv_bias", b)
        mask_index: ir.Value | None = None
        ab_packed: ir.Value | None = None
        if padding is not None:  # raw: the [B, T] mask, masked scores filled with mask_filter_value;
            mask, attrs["mask_filter_value"] = padding  # lengths: the 1-D [B] right-padding key lengths
            mask_index = (_key_lengths(mask, new_nodes, ctx.shared) if fmt == "lengths"
                          else _mask_index(mask, new_nodes, ctx.shared))
        elif not is_zero(bias):
            ab_packed = _bias_for_kernel(bias, x, new_nodes, ctx.shared)  # type: ignore[arg-type]
        inputs: list[ir.Value | None] = [x, wv, bv, mask_index, None, ab_packed]
        op_type = "Attention"
    else:
        key_padding = None
        if padding is not None:
            mask, attrs["mask_filter_value"] = padding
            key_padding = (_key_lengths(mask, new_nodes, ctx.shared) if fmt == "lengths"
                           else _mask_index(mask, new_nodes, ctx.shared))
        ab = None
        if not is_zero(bias) and padding is None:
            ab = _bias_for_kernel(bias, q, new_nodes, ctx.shared)  # type: ignore[arg-type]
        inputs = [q, k, v, None, key_padding, ab]
        op_type = "MultiHeadAttention"
    while inputs[-1] is None:
        inputs.pop()
    mha = ir.node(op_type, inputs, attributes=attrs, domain=MS_DOMAIN)
    if q.dtype is not None:  # ONNX's inference does not know contrib ops; the Where after it needs it
        mha.outputs[0].dtype = q.dtype
    new_nodes.append(mha)
    if int(attr_value(node, "nan_to_zero", 0)):
        _nan_to_zero(mha.outputs[0], new_nodes)
    _replace(node, new_nodes, ctx)
    return True


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
        n = ir.node(op_type, list(inputs), attributes=attrs)
        new_nodes.append(n)
        return n.outputs[0]

    def const(arr: np.ndarray) -> ir.Value:
        return add("Constant", value=ir.tensor(arr))

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
        inputs.append(_bias_for_kernel(bias, q, new_nodes, ctx.shared))  # type: ignore[arg-type]
    kv_heads = int(attr_value(node, "kv_num_heads", 0)) or heads
    att = ir.node("Attention", inputs, attributes={"q_num_heads": heads, "kv_num_heads": kv_heads,
                                                   "scale": float(attr_value(node, "scale", 1.0))})
    if q.dtype is not None:
        att.outputs[0].dtype = q.dtype
    new_nodes.append(att)
    if int(attr_value(node, "nan_to_zero", 0)):
        _nan_to_zero(att.outputs[0], new_nodes)
    _replace(node, new_nodes, ctx)
    return True


def _lower_trt(node: ir.Node, ctx: LoweringContext) -> bool:
    return ctx.inline(node)


def _inline(node: ir.Node, ctx: LoweringContext) -> bool:
    return ctx.inline(node)


LOWERINGS: dict[str, dict[str, Lowering]] = {
    "Attention": {"ort": _lower_ort, "onnx": _lower_onnx, "tensorrt": _lower_trt},
    # ONNX Runtime's RotaryEmbedding takes position-indexed cos/sin caches, not the per-token cos/sin an
    # export computes: every target gets the body (rotating X in its [B, S, N, D] view, no transpose of X)
    "RotaryEmbedding": {"ort": _inline, "onnx": _inline, "tensorrt": _inline},
}
