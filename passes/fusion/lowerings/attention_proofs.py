"""What the ``mograph.Attention`` lowerings prove about the graph around a node, before they rewrite anything.

Read-only questions, each answered by walking producers and comparing dims: is a bias a key-padding mask of an
``attention_mask`` input (and which), is it provably causal (``Where(kv_idx <= pos, 0, c)`` with the padding lookups
the exporters write, or transformers' legacy ``Trilu`` / ``ScatterND`` spelling: :func:`legacy_causal`), are K and V a KV cache's ``Concat(past, new)``, are the rotary angles ``(P + s) * inv_freq``,
are Q/K/V projections of one tensor, which graph outputs are a prefill's present key and value.  Nothing here
builds a node: the fusion may import it.  What the answers are used for is in
:mod:`mograph.passes.fusion.lowerings.attention`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._attention_rotary import _rotary  # the fusion's proof of transformers' rotate_half form
from mograph.passes.fusion.ops import FLOAT_TYPES

from mograph.irutil import attr_value
from mograph.patterns import constant_array, scalar_value
from mograph.shapes import Dim, DimKey, Dims, Vector, same_dim

logger = logging.getLogger(__name__)

_ZERO, _MINUS_ONE = Dim.lit(0), Dim.lit(-1)


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
Shared = dict[tuple[Any, ...], Any]


class Shapes(Protocol):
    """What the proofs ask about dims: the core's shape query, as :class:`mograph.lowering.LoweringContext` (or a
    :class:`mograph.shapes.ShapeQuery`) answers it."""

    def dims(self, value: ir.Value | None) -> Dims | None: ...

    def values(self, value: ir.Value | None) -> Vector | None: ...

    def dim_key(self, value: ir.Value, axis: int, *, spelled: bool = False) -> DimKey: ...

    def is_shape_of(self, vector: ir.Value | None, value: ir.Value | None) -> bool: ...

    def static_dim(self, value: ir.Value | None, axis: int) -> int | None: ...

    def literals(self, value: ir.Value | None) -> list[int | None] | None: ...


def _reads_dim(shapes: Shapes, scalar: ir.Value | None, x: ir.Value | None, axis: int) -> bool:
    """Whether the one-element shape vector ``scalar`` holds dim ``axis`` of ``x`` for every input (``Gather(Shape(x),
    axis)``, however spelled: the query follows Cast, Squeeze, Unsqueeze, Reshape, Slice, Concat)."""
    vec, dims = shapes.values(scalar), shapes.dims(x)
    return (vec is not None and len(vec[1]) == 1 and vec[1][0] is not None and dims is not None
            and -len(dims) <= axis < len(dims) and vec[1][0] == dims[axis])


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


def _gathered_padding(value: ir.Value | None, shapes: Shapes) -> ir.Value | None:
    """The mask input of ``transformers``' index-based padding lookup, ``mask[b, t]`` laid out ``[B, 1, 1, T]``.

    ``Reshape(Reshape(Gather(Flatten(Cast(mask, bool), axis=2), b * T + t), [-1]), Shape(b * T + t))`` (or the one
    Reshape simplify-shapes merges them into; the outer
    target: any vector the shape query proves holds the index's dims) where ``b`` is ``Range(0, B, 1)`` on axis 0 and ``t`` is ``Range(0, T, 1)`` on axis 3 of a
    rank-4 index, ``T`` the mask's dim 1 (``Flatten`` makes ``[B*T, 1]``).
    """
    outer = _producer(value, "Reshape")
    inner = _producer(outer.inputs[0], "Reshape") if outer is not None else None
    # (simplify-shapes merges the two Reshapes into one: the lookup reshaped straight to its index's shape)
    gather = _producer((inner or outer).inputs[0], "Gather") if outer is not None else None
    if outer is None or gather is None or int(attr_value(gather, "axis", 0)) != 0:
        return None
    flat = constant_array(inner.inputs[1]) if inner is not None else np.array([-1])
    if flat is None or flat.reshape(-1).tolist() != [-1] or not (
            shapes.is_shape_of(outer.inputs[1], gather.inputs[1]) or (inner is None and _copies_index_dims(outer))):
        return None  # the flat lookup reshaped back to its index's shape
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
            if _reads_dim(shapes, t_len, mask, 1) and _reads_dim(shapes, t_rng.inputs[1], mask, 1):
                return mask
    return None


def _copies_index_dims(reshape: ir.Node) -> bool:
    """Whether ``reshape`` of a ``Gather(table [N, 1], index)`` (shape ``index.shape + [1]``) gives ``index.shape``:
    a constant target as long as the index's rank whose every entry is 0 (``allowzero`` 0: the Gather's dim, which
    is the index's) or the index's own static dim there (simplify-shapes writes ``[0, 1, 1, 0]``)."""
    gather = _producer(reshape.inputs[0], "Gather")
    index = gather.inputs[1] if gather is not None else None
    target = constant_array(reshape.inputs[1])
    if index is None or index.shape is None or target is None or int(attr_value(reshape, "allowzero", 0)):
        return False
    dims = list(index.shape)
    entries = target.reshape(-1).tolist()
    return len(entries) == len(dims) and all(e == 0 or (isinstance(d, int) and e == d) for e, d in zip(entries, dims))


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


def _keep(value: ir.Value | None, shapes: Shapes) -> ir.Value | None:
    """The mask input if ``value`` (bool, broadcastable to ``[B, 1, S, T]``) is ``mask[b, t] != 0`` for every s
    (a bool cast of the mask input laid out ``[B, 1, 1, T]``, or transformers' padding lookup: TorchScript's flat
    ``Gather`` or dynamo's ``GatherND`` of ``[b, t]`` pairs; And-ed with provably all-true terms, expanded)."""
    node = value.producer() if value is not None else None
    if node is None or node.domain != "":
        return None
    if node.op_type == "Expand":  # broadcasting copies values; the kernel broadcasts over S and heads itself
        return _keep(node.inputs[0], shapes)
    if node.op_type == "And":
        a, b = node.inputs[0], node.inputs[1]
        if _all_true(a):
            return _keep(b, shapes)
        if _all_true(b):
            return _keep(a, shapes)
        return None
    if node.op_type == "Cast" and int(attr_value(node, "to", 0)) == ir.DataType.BOOL.value:
        # a cast of a keep mask to bool keeps it; a cast of the mask to bool is mask != 0
        return _keep(node.inputs[0], shapes) or _mask_input(node.inputs[0], ("b", "1", "1", "t"))
    if node.op_type == "Unsqueeze" and value is not None and value.dtype == ir.DataType.BOOL:
        return _mask_input(value, ("b", "1", "1", "t"))  # a bool mask input
    if node.op_type == "GatherND":  # dynamo's lookup: its key index a Range(0, T, 1) on axis 3, T the mask's dim 1
        concat = _producer(node.inputs[1], "Concat")
        un = _producer(concat.inputs[-1], "Unsqueeze") if concat is not None and concat.inputs else None
        ex = _producer(un.inputs[0], "Expand") if un is not None else None
        t_idx = ex.inputs[0] if ex is not None else None
        t_rng = _is_range_from_zero(t_idx)
        if t_idx is None or t_rng is None or _range_axis(t_idx) != 3:
            return None
        mask = _gathernd_padding(value, t_idx)
        return mask if mask is not None and _reads_dim(shapes, t_rng.inputs[1], mask, 1) else None
    return _gathered_padding(value, shapes)


def _padding_mask(bias: ir.Value, shapes: Shapes) -> tuple[ir.Value, float] | None:
    """``(mask, c)`` if ``bias[b, :, s, t]`` is 0 where the 2-D input ``mask[b, t]`` is 1 and ``c`` where it is 0.

    The forms traced: ``(1 - float(mask[:, None, None, :])) * c`` (``transformers`` before 4.48) and
    ``Where(keep, 0, c)`` with ``keep`` a bool cast of ``mask[:, None, None, :]`` or ``transformers``'
    index-based padding lookup (TorchScript's flat ``Gather``, dynamo's ``GatherND``), possibly And-ed with
    provably all-true terms and expanded.  ``c`` must
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
        mask = _keep(node.inputs[0], shapes)
    if mask is None or c is None or not c < 0 or not math.isfinite(c):
        return None
    return mask, c


def _key_slice(value: ir.Value | None) -> tuple[ir.Value, ir.Value] | None:
    """``(x, end)`` if ``value`` is ``Slice(x, [0], [end], [3], [1])`` of a rank-4 ``x``: the first ``end`` columns on
    the key axis (transformers 4.5x's sdpa cuts its mask to the key length, ``mask[:, :, :, :k.shape[-2]]``)."""
    node = _producer(value, "Slice")
    if node is None or len(node.inputs) < 4 or node.inputs[0] is None or node.inputs[2] is None:
        return None
    starts, axes = constant_array(node.inputs[1]), constant_array(node.inputs[3])
    steps = constant_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    x = node.inputs[0]
    rank = len(x.shape) if x.shape is not None else None
    if starts is None or axes is None or starts.reshape(-1).tolist() != [0] or rank != 4:
        return None
    if axes.reshape(-1).tolist() not in ([3], [-1]) or (steps is not None and steps.reshape(-1).tolist() != [1]):
        return None
    return x, node.inputs[2]


def _and_leaves(value: ir.Value | None) -> list[ir.Value | None]:
    """The terms of a tree of ``And`` (an ``Expand`` only broadcasts: looked through)."""
    node = value.producer() if value is not None else None
    if node is not None and node.domain == "" and node.op_type == "Expand":
        return _and_leaves(node.inputs[0])
    if node is not None and node.domain == "" and node.op_type == "And":
        return _and_leaves(node.inputs[0]) + _and_leaves(node.inputs[1])
    return [value]


def _seq_dim(value: ir.Value | None, shapes: Shapes, shared: Shared | None = None, axis: int = 1) -> Dim | None:
    """Dim ``axis`` of a ``[B, S, .]`` value (the shape query's), looking through rotary embeddings (which keep the
    shape): a ``mograph.RotaryEmbedding`` node, or one inlined in this run (noted in ``shared``)."""
    for _ in range(8):
        if value is None:
            return None
        x = shared.get(("rotary_outputs", id(value))) if shared is not None else None
        node = value.producer()
        if x is None and node is not None and node.op_type == "RotaryEmbedding":
            x = node.inputs[0]
        if x is None:
            break
        value = x
    dims = shapes.dims(value)
    return dims[axis] if dims is not None and len(dims) == 3 else None


def _is_causal_term(term: ir.Value | None, q: ir.Value, k: ir.Value, shared: Shared | None, shapes: Shapes) -> bool:
    """Whether ``term`` is ``kv_idx <= q_idx`` over ``[1, 1, S, S]``, both ``Range(0, S, 1)`` of one S.

    ``kv_idx`` lies on axis 3, ``q_idx`` on axis 2 (Unsqueezes of a 1-D Range); the two Ranges are one node,
    share their end, or each has a length provably the query length, which is provably the key length (same
    static or symbolic dim), so the term is exactly the lower-triangular mask a causal kernel applies.
    """
    node = term.producer() if term is not None else None
    if node is None or node.domain != "" or node.op_type not in ("LessOrEqual", "GreaterOrEqual"):
        return False
    kv_idx, q_idx = node.inputs[0], node.inputs[1]
    if node.op_type == "GreaterOrEqual":
        kv_idx, q_idx = q_idx, kv_idx
    kv_rng, q_rng = _is_range_from_zero(kv_idx), _is_range_from_zero(q_idx)
    if kv_rng is None or q_rng is None or _range_axis(kv_idx) != 3 or _range_axis(q_idx) != 2:
        return False
    s_q, s_k = _seq_dim(q, shapes, shared), _seq_dim(k, shapes, shared)
    if s_q is None or s_q != s_k or _range_length(q_rng, shapes) != s_q:
        return False
    return kv_rng is q_rng or kv_rng.inputs[1] is q_rng.inputs[1] or _range_length(kv_rng, shapes) == s_q


def _range_length(rng: ir.Node, shapes: Shapes) -> Dim | None:
    """The length of the 1-D ``Range``, as the shape query has it (its output's dim: the limit's value for
    ``Range(0, n, 1)``, through however ``n`` is read from a shape)."""
    dims = shapes.dims(rng.outputs[0])
    return dims[0] if dims is not None and len(dims) == 1 else None


def _causal(bias: ir.Value, q: ir.Value, k: ir.Value, shared: Shared | None, shapes: Shapes
            ) -> tuple[ir.Value | None] | None:
    """``(mask,)`` if ``bias`` is ``Where(causal & keep, 0, c)`` with ``c < 0``: ``mask`` the 2-D key-padding input
    that ``keep`` reads (``None``: causal only, every other term provably all true); else None."""
    node = bias.producer()
    if node is None or node.domain != "" or node.op_type != "Where" or scalar_value(node.inputs[1]) != 0.0:
        return None
    c = scalar_value(node.inputs[2])
    if c is None or not c < 0:
        return None
    leaves = [t for t in _and_leaves(node.inputs[0]) if not _all_true(t)]
    causal = [t for t in leaves if _is_causal_term(t, q, k, shared, shapes)]
    rest = [t for t in leaves if t not in causal]
    if not causal or len(rest) > 1:
        return None
    if not rest:
        return (None,)
    mask = _keep(rest[0], shapes)
    return None if mask is None else (mask,)


def _kv_cache(kv: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(past, new, concat)`` if ``kv`` is ``Reshape(Transpose(Concat(past, new, axis=2), [0, 2, 1, 3]), [0, 0, -1])``:
    a KV cache, ``past`` a ``[B, G, P, D]`` graph input, ``new`` the step's ``[B, G, S, D]`` heads."""
    reshape = _producer(kv, "Reshape")
    transpose = _producer(reshape.inputs[0], "Transpose") if reshape is not None else None
    if reshape is None or transpose is None or list(attr_value(transpose, "perm", [])) != [0, 2, 1, 3]:
        return None
    target = constant_array(reshape.inputs[1])
    if target is None or target.reshape(-1).tolist() != [0, 0, -1]:
        return None
    concat = _producer(transpose.inputs[0], "Concat")
    if concat is None or len(concat.inputs) != 2 or int(attr_value(concat, "axis", 0)) not in (2, -2):
        return None
    past, new = concat.inputs
    if past is None or new is None or not past.is_graph_input() or past.shape is None or len(past.shape) != 4:
        return None
    return past, new, concat.outputs[0]


def _splits_last_dim(x: ir.Value, target: ir.Value | None, shapes: Shapes) -> bool:
    """Whether ``Reshape(x, target)`` of a ``[B, S, G*D]`` ``x`` only splits its last dim: the shape query reads
    ``target`` as ``[b, s, g, d]`` where ``b``/``s`` are each ``0`` or provably ``x``'s own dim at that place (a
    static dim, or read by ``Shape`` however spelled), or one of them ``-1`` then determined, and ``g * d`` is the
    (static) last dim (one of ``g``/``d`` may be ``-1`` when ``b`` and ``s`` are both kept)."""
    vec, dims = shapes.values(target), shapes.dims(x)
    if vec is None or vec[0] or len(vec[1]) != 4 or dims is None or len(dims) != 3 or dims[2] is None:
        return False
    last = dims[2].value
    if last is None or last <= 0:
        return False
    entries = vec[1]
    kept = [t is not None and (t == _ZERO or same_dim(t, dims[i])) for i, t in enumerate(entries[:2])]
    g, d = (None if t is None else t.value for t in entries[2:])
    if g is None or d is None:
        return False
    if g > 0 and d > 0:
        return g * d == last and (all(kept) or (sum(t == _MINUS_ONE for t in entries[:2]) == 1 and any(kept)))
    if all(kept) and sorted([g, d])[0] == -1 and max(g, d) > 0:
        return last % max(g, d) == 0
    return False


def _through_float_casts(value: ir.Value | None) -> ir.Value | None:
    """``value`` before any float-to-float ``Cast``s (fp16 keeps the Cos/Sin of positions in float32 and casts
    their results: the cos/sin values are the same up to the cast)."""
    while (cast := _producer(value, "Cast")) is not None:
        src = cast.inputs[0]
        if src is None or src.dtype is None or not src.dtype.is_floating_point():
            break
        value = src
    return value


def _half_angles(t: ir.Value | None) -> tuple[ir.Value, str, float | None] | None:
    """``(f, "Cos"|"Sin", c)`` if ``t`` is ``Unsqueeze(Cos(Concat(f, f, axis=-1)) [* c], axis 1)``: the rank-3
    ``[Bc, S, D/2]`` angles ``f`` of an export's rotary table laid out ``[Bc, 1, S, D]`` (``c`` a scalar constant,
    transformers' ``attention_scaling``), so ``cos[..., :D/2] == cos[..., D/2:] == Cos(f) * c``."""
    unsq = _producer(t, "Unsqueeze")
    if unsq is None or _unsqueeze_axes(unsq) != [1]:
        return None
    value, c = _through_float_casts(unsq.inputs[0]), None
    if (mul := _producer(value, "Mul")) is not None:
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            k = scalar_value(b)
            a = _through_float_casts(a)
            prod = a.producer() if a is not None else None
            if k is not None and prod is not None and prod.op_type in ("Cos", "Sin"):
                value, c = a, k
                break
        else:
            return None
    trig = value.producer() if value is not None else None
    if trig is None or trig.domain != "" or trig.op_type not in ("Cos", "Sin"):
        return None
    concat = _producer(trig.inputs[0], "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.inputs[0] is not concat.inputs[1]:
        return None
    f = concat.inputs[0]
    if f is None or f.shape is None or len(f.shape) != 3 or int(attr_value(concat, "axis", 0)) not in (-1, 2):
        return None
    return f, trig.op_type, c


def _through_unsqueeze(value: ir.Value | None, base: ir.Value, rank: int) -> int | None:
    """The axis that the 1-D ``base`` lands on in ``value`` (``Unsqueeze``s of ``base``, rank ``rank``), else None."""
    chain = []
    while value is not None and value is not base:
        node = _producer(value, "Unsqueeze")
        if node is None:
            return None
        chain.append(node)
        value = node.inputs[0]
    if value is None:
        return None
    dims = ["r"]
    for node in reversed(chain):
        axes = _unsqueeze_axes(node)
        if axes is None:
            return None
        new_rank = len(dims) + len(axes)
        for ax in sorted(a + new_rank if a < 0 else a for a in axes):
            dims.insert(ax, "1")
    return dims.index("r") if len(dims) == rank else None


#: in-memory note on a past input renamed to ``max_sequence_length`` (``--kv-cache shared``): its dim (the shape
#: query's) before
_PAST_DIM_META = "mograph.past_dim"


def _past_length_of(value: ir.Value | None, past: ir.Value | None, shapes: Shapes) -> bool:
    """Whether the scalar ``value`` is dim 2 (the past length) of the ``[B, G, P, D]`` cache input ``past`` for every
    input: the shape query's element of it (``Gather(Shape(src), 2)``, ``Squeeze(Shape(src, 2, 3))``, through Cast,
    of a tensor whose dim is ``past``'s).  For a cache input whose P a shared-buffer lowering renamed, the dim noted
    before the renaming counts: ``past``'s, and that of the renamed input ``value`` reads."""
    vec = shapes.values(value)
    past_dims = shapes.dims(past)
    if vec is None or len(vec[1]) != 1 or vec[1][0] is None or past is None or past_dims is None or len(past_dims) != 4:
        return False
    read, p = vec[1][0], past.meta.get(_PAST_DIM_META, past_dims[2])
    if p is None:
        return False
    if read == p:
        return True
    graph = past.graph
    renamed = [src for src in graph.inputs if _PAST_DIM_META in src.meta] if graph is not None else []
    return any(src.meta[_PAST_DIM_META] == p and (d := shapes.dims(src)) is not None and len(d) == 4 and d[2] == read
               for src in renamed)


def _positions(pos: ir.Value | None, q: ir.Value, past: ir.Value | None, shapes: Shapes) -> bool:
    """Whether the 1-D ``pos`` is ``P + s`` for every query position ``s``: ``Range(0, S, 1)`` (no cache) or
    ``Range(0, S, 1) + P`` with ``P`` the cache's past length, ``S`` provably the query length; the Range may be
    the constant ``[0, 1, .., S-1]`` where ``S`` is static (an export traced with one new token folds ``arange(1)``
    to ``[0]``)."""
    def steps(value: ir.Value | None) -> bool:
        rng = _producer(value, "Range")
        if rng is not None:
            seq = _seq_dim(q, shapes)
            return scalar_value(rng.inputs[0]) == 0 and scalar_value(rng.inputs[2]) == 1 and seq is not None \
                and _range_length(rng, shapes) == seq
        arr = constant_array(value) if value is not None else None
        n = _seq_dim(q, shapes)
        return (arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu" and n is not None and n.is_literal
                and arr.tolist() == list(range(n.coef)))

    if past is None:
        return steps(pos)
    add = _producer(pos, "Add")
    if add is None:
        return _offset_range(pos, q, past, shapes)
    return any(steps(a) and _past_length_of(b, past, shapes) for a, b in (
        (add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])))


def _offset_range(pos: ir.Value | None, q: ir.Value, past: ir.Value, shapes: Shapes) -> bool:
    """Whether ``pos`` is ``Range(P, P + S, 1)``: the cache position as transformers 4.5x computes it
    (``arange(past_seen_tokens, past_seen_tokens + S)``, as optimum's TorchScript exports hold it), with ``P`` the
    cache's past length and ``S`` the query length (the limit an ``Add`` of the two, casts looked through)."""
    rng = _producer(pos, "Range")
    if rng is None or scalar_value(rng.inputs[2]) != 1 or not _past_length_of(rng.inputs[0], past, shapes):
        return False
    limit = rng.inputs[1]
    while (cast := _producer(limit, "Cast")) is not None:
        limit = cast.inputs[0]
    add = _producer(limit, "Add")
    return add is not None and any(
        _past_length_of(a, past, shapes) and _query_length_of(b, q, shapes)
        for a, b in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])))


def _angle_factors(f: ir.Value) -> list[tuple[ir.Value, np.ndarray, int]]:
    """The ways the angle table ``f`` ``[B, S, D/2]`` may be ``positions x inv_freq``: ``(value, inv_freq, axis)``
    with ``value`` the float positions laid out with S on ``axis``.  Two spellings: ``Mul(pos[B, S, 1], inv[D/2])``
    and the outer product ``Transpose(MatMul(inv[1, D/2, 1], pos[B, 1, S]), perm=[0, 2, 1])`` (transformers 5.17's
    rotary, ``inv`` ``Expand``-ed over the batch: a matrix product over an inner dimension of one, the same values in
    every batch row)."""
    out = []
    mul = _producer(f, "Mul")
    if mul is not None:
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            inv = constant_array(b)
            if a is not None and inv is not None and inv.ndim == 1:
                out.append((a, inv, 1))
    tr = _producer(f, "Transpose")
    if tr is not None and list(attr_value(tr, "perm", [])) == [0, 2, 1]:
        mm = _producer(tr.inputs[0], "MatMul")
        left = mm.inputs[0] if mm is not None else None
        if (ex := _producer(left, "Expand")) is not None:  # inv broadcast over the batch: the same values per row
            left = ex.inputs[0]
        inv = constant_array(left) if left is not None else None
        if mm is not None and mm.inputs[1] is not None and inv is not None and inv.ndim == 3 \
                and inv.shape[0] == 1 and inv.shape[2] == 1:
            out.append((mm.inputs[1], inv.reshape(-1), 2))
    return out


def _rotary_positions(f: ir.Value, q: ir.Value, past: ir.Value | None, shapes: Shapes
                      ) -> tuple[ir.Value, np.ndarray] | None:
    """``(pos, inv_freq)`` if the angle table ``f`` ``[1, S, D/2]`` is ``pos[s] * inv_freq[i]`` (``Cast(pos)`` laid
    out ``[1, S, 1]`` times a constant 1-D ``inv_freq``, or the outer-product spelling of :func:`_angle_factors`)
    with ``pos`` the query positions ``P + s``."""
    for factor, inv, axis in _angle_factors(f):
        if inv.dtype not in (np.float32, np.float16):
            continue
        cast = _producer(factor, "Cast")  # (float16 after the fp16 pass)
        if cast is None or int(attr_value(cast, "to", 0)) not in (ir.DataType.FLOAT.value, ir.DataType.FLOAT16.value):
            continue
        value = cast.inputs[0]
        pos = value
        while (un := _producer(pos, "Unsqueeze")) is not None:
            pos = un.inputs[0]
        if pos is None or _through_unsqueeze(value, pos, 3) != axis or not _positions(pos, q, past, shapes):
            continue
        return pos, inv
    return None


def _gathernd_padding(value: ir.Value | None, kv_idx: ir.Value) -> ir.Value | None:
    """The mask input of dynamo's padding lookup ``GatherND(Cast(mask, bool), [b, t])`` where the index pairs are
    ``Concat(Unsqueeze(Expand(b_idx), -1), Unsqueeze(Expand(kv_idx), -1), axis=-1)``: ``b_idx`` a ``Range(0, B, 1)``
    on axis 0 and ``kv_idx`` the causal term's own key index (axis 3)."""
    node = _producer(value, "GatherND")
    if node is None or int(attr_value(node, "batch_dims", 0)) != 0:
        return None
    cast = _producer(node.inputs[0], "Cast")
    if cast is None or int(attr_value(cast, "to", 0)) != ir.DataType.BOOL.value:
        return None
    mask = _mask_input(cast.inputs[0], ("b", "t"))
    concat = _producer(node.inputs[1], "Concat")
    if mask is None or concat is None or len(concat.inputs) != 2 or int(attr_value(concat, "axis", 0)) != -1:
        return None
    picked = []
    for piece in concat.inputs:
        un = _producer(piece, "Unsqueeze")
        ex = _producer(un.inputs[0], "Expand") if un is not None else None
        if un is None or ex is None or _unsqueeze_axes(un) != [-1]:
            return None
        picked.append(ex.inputs[0])
    b_idx, t_idx = picked
    if t_idx is not kv_idx or _is_range_from_zero(b_idx) is None or _range_axis(b_idx) != 0:
        return None
    return mask


def _query_length_of(value: ir.Value | None, q: ir.Value, shapes: Shapes) -> bool:
    """Whether the scalar ``value`` is the query length for every input: read from a shape (``Gather(Shape(z), 1)``,
    ``Shape(z, start=1, end=2)``, through Cast/Squeeze/Unsqueeze) of a tensor whose dim is the query's, or that
    length as a constant where it is static (an export traced with one new token); the shape query's elements."""
    vec, seq = shapes.values(value), _seq_dim(q, shapes)
    return vec is not None and len(vec[1]) == 1 and seq is not None and vec[1][0] == seq


def _past_plus_query(rng: ir.Node, past: ir.Value | None, q: ir.Value, shapes: Shapes) -> bool:
    """Whether ``Range(0, n, 1)``'s ``n`` is ``P + S``: the cache's past length plus the query length."""
    limit = rng.inputs[1]
    while (cast := _producer(limit, "Cast")) is not None:
        limit = cast.inputs[0]
    add = _producer(limit, "Add")
    if add is None or past is None:
        return False
    a, b = add.inputs[0], add.inputs[1]
    return any(_past_length_of(x, past, shapes)
               and (_query_length_of(y, q, shapes) or _offset_range_length(y, q, past, shapes))
               for x, y in ((a, b), (b, a)))


def _offset_range_length(value: ir.Value | None, q: ir.Value, past: ir.Value, shapes: Shapes) -> bool:
    """Whether the scalar ``value`` is ``Gather(Shape(r), 0)`` of the cache positions ``r = Range(P, P + S, 1)``:
    ``S``, the query length (transformers 4.5x's ``past_seen_tokens + cache_position.shape[0]``)."""
    while (cast := _producer(value, "Cast")) is not None:
        value = cast.inputs[0]
    gather = _producer(value, "Gather")
    shape = _producer(gather.inputs[0], "Shape") if gather is not None else None
    if gather is None or shape is None or scalar_value(gather.inputs[1]) != 0 or int(attr_value(gather, "axis", 0)):
        return False
    if int(attr_value(shape, "start", 0)) != 0:
        return False
    return _offset_range(shape.inputs[0], q, past, shapes)


def _causal_from(bias: ir.Value, pos: ir.Value, keys: Dim | None, shapes: Shapes, past: ir.Value | None = None,
                 q: ir.Value | None = None, window: list[int] | None = None) -> tuple[ir.Value | None] | None:
    """``(mask,)`` if ``bias`` is ``Where(kv_idx <= pos[s] [& mask[b, kv_idx]] [& all true], 0, c)``, ``c < 0``, with
    ``pos`` the query positions (on axis 2) and ``kv_idx`` a ``Range(0, n, 1)`` on axis 3 whose length is provably
    ``keys`` (the key count) or is the same dim; ``mask`` is None when there is no padding term.

    With ``window`` (a list to fill) one more term is accepted: a sliding window ``kv_idx > pos[s] - W`` (transformers'
    sliding-window layers: Mistral, Gemma 2/3), its ``W`` (a positive integer constant) appended to ``window``."""
    node = _producer(bias, "Where")
    if node is None and q is not None:  # transformers' legacy spelling (Trilu, ScatterND): no sliding window there
        return legacy_causal(bias, keys, shapes, past, q)
    if node is None or scalar_value(node.inputs[1]) != 0.0:
        return None
    c = scalar_value(node.inputs[2])
    if c is None or not c < 0:
        return None
    cond = node.inputs[0]
    sliced = _key_slice(cond)
    if sliced is not None:  # mask[..., :keys] (transformers 4.5x's sdpa): the first `keys` columns of the formula
        ends = shapes.values(sliced[1])
        if keys is None or ends is None or len(ends[1]) != 1 or ends[1][0] != keys:
            return None
        cond = sliced[0]
    leaves = [t for t in _and_leaves(cond) if not _all_true(t)]
    kv_idx = None
    rest = []
    for leaf in leaves:
        le = leaf.producer() if leaf is not None else None
        if le is not None and le.domain == "" and le.op_type in ("LessOrEqual", "GreaterOrEqual") and kv_idx is None:
            a, b = le.inputs[0], le.inputs[1]
            if le.op_type == "GreaterOrEqual":
                a, b = b, a
            rng = _is_range_from_zero(a)
            if (rng is not None and _range_axis(a) == 3 and b is not None and _through_unsqueeze(b, pos, 4) == 2
                    and ((keys is not None and _range_length(rng, shapes) == keys)
                         or q is not None and _past_plus_query(rng, past, q, shapes))):
                kv_idx = a
                continue
        rest.append(leaf)
    if kv_idx is None:
        return None
    if window is not None:
        slides = [w for w in (_window_term(t, kv_idx, pos) for t in rest) if w is not None]
        if len(slides) == 1:
            rest = [t for t in rest if _window_term(t, kv_idx, pos) is None]
            window.append(slides[0])
    if len(rest) > 1:
        return None
    if not rest:
        return (None,)
    mask = _keep(rest[0], shapes)
    if mask is None:  # dynamo's GatherND lookup of the key index the causal term uses
        mask = _gathernd_padding(rest[0], kv_idx)
    if mask is None:  # TorchScript's flat lookup, its Reshapes merged by cleanup
        mask = _flat_padding(rest[0], kv_idx, shapes)
    return None if mask is None else (mask,)


def _window_term(term: ir.Value | None, kv_idx: ir.Value, pos: ir.Value) -> int | None:
    """``W`` if ``term`` is ``kv_idx > pos[s] - W`` (or ``pos[s] - W < kv_idx``) with ``kv_idx`` the causal term's own
    key index (axis 3), ``pos`` the query positions on axis 2 and ``W`` a positive integer constant: each query keeps
    the ``W`` keys up to its own position."""
    node = term.producer() if term is not None else None
    if node is None or node.domain != "" or node.op_type not in ("Greater", "Less"):
        return None
    a, b = (node.inputs[0], node.inputs[1]) if node.op_type == "Greater" else (node.inputs[1], node.inputs[0])
    sub = _producer(b, "Sub")
    if a is not kv_idx or sub is None or _through_unsqueeze(sub.inputs[0], pos, 4) != 2:
        return None
    w = scalar_value(sub.inputs[1])
    return int(w) if w is not None and float(w).is_integer() and w > 0 else None


def _flat_padding(value: ir.Value | None, kv_idx: ir.Value, shapes: Shapes) -> ir.Value | None:
    """The mask input of ``Reshape(Gather(Flatten(Cast(mask, bool), axis=2), kv_idx + b_idx * T), [0, 1, 1, 0])``
    (``allowzero`` 0; or TorchScript's ``Reshape(Reshape(., [-1]), Shape(index))``): ``mask[b, t]`` laid out
    ``[B, 1, 1, T]`` with ``kv_idx`` the causal term's key index (axis 3),
    ``b_idx`` a ``Range(0, B, 1)`` on axis 0 and ``T`` the mask's dim 1."""
    reshape = _producer(value, "Reshape")
    if reshape is None or int(attr_value(reshape, "allowzero", 0)):
        return None
    target = constant_array(reshape.inputs[1])
    inner = _producer(reshape.inputs[0], "Reshape")
    flat = constant_array(inner.inputs[1]) if inner is not None else None
    if inner is not None and flat is not None and flat.reshape(-1).tolist() == [-1]:
        gather = _producer(inner.inputs[0], "Gather")  # Reshape(Reshape(g, [-1]), Shape(index)): the index's shape
        if gather is None or not shapes.is_shape_of(reshape.inputs[1], gather.inputs[1]):
            return None
    elif target is not None and target.reshape(-1).tolist() == [0, 1, 1, 0]:
        gather = _producer(reshape.inputs[0], "Gather")  # [B, 1, 1, T, 1] -> [B, 1, 1, T]
    else:
        return None
    flatten = _producer(gather.inputs[0], "Flatten") if gather is not None else None
    cast = _producer(flatten.inputs[0], "Cast") if flatten is not None else None
    if gather is None or flatten is None or cast is None or int(attr_value(gather, "axis", 0)) != 0 \
            or int(attr_value(flatten, "axis", 1)) != 2 or int(attr_value(cast, "to", 0)) != ir.DataType.BOOL.value:
        return None
    mask = _mask_input(cast.inputs[0], ("b", "t"))
    add = _producer(gather.inputs[1], "Add")
    if mask is None or add is None:
        return None
    for t_idx, bt in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mul = _producer(bt, "Mul")
        if t_idx is not kv_idx or mul is None:
            continue
        for b_idx, t_len in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            if _is_range_from_zero(b_idx) is None or _range_axis(b_idx) != 0:
                continue
            if _reads_dim(shapes, t_len, mask, 1):
                return mask
    return None


def _projection_of(x: ir.Value) -> tuple[ir.Value, np.ndarray, np.ndarray | None] | None:
    """``(h, W, b)`` if ``x`` is ``h @ W`` or ``h @ W + b`` with constant 2-D ``W`` (and 1-D ``b``)."""
    node = x.producer()
    if node is None or node.domain != "":
        return None
    bias = None
    if node.op_type == "Add":
        for mm_in, b_in in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            if _producer(mm_in, "MatMul") is not None and constant_array(b_in) is not None:
                bias = constant_array(b_in)
                node = mm_in.producer()  # type: ignore[union-attr]
                break
        else:
            return None
    if node is None or node.op_type != "MatMul" or node.domain != "":
        return None
    w = constant_array(node.inputs[1])
    h = node.inputs[0]
    if w is None or h is None or w.ndim != 2 or (bias is not None and (bias.ndim != 1 or bias.shape[0] != w.shape[1])):
        return None
    return h, w, bias


def _present_value_output(graph: ir.Graph, v: ir.Value, shapes: Shapes) -> ir.Value | None:
    """The graph output that is ``Transpose(Reshape(v, [b, s, G, D]), [0, 2, 1, 3])``: the prefill's present value."""
    return next((out for out in graph.outputs if _is_head_split(out, v, shapes)), None)


def _is_head_split(x: ir.Value, v: ir.Value, shapes: Shapes) -> bool:
    """``x`` is ``Transpose(Reshape(v, [b, s, G, D]), [0, 2, 1, 3])`` with the Reshape only splitting ``v``'s last dim."""
    tr = _producer(x, "Transpose")
    rs = _producer(tr.inputs[0], "Reshape") if tr is not None else None
    if tr is None or rs is None or list(attr_value(tr, "perm", [])) != [0, 2, 1, 3] or rs.inputs[0] is not v:
        return False
    return _splits_last_dim(v, rs.inputs[1], shapes)


def _present_key_output(graph: ir.Graph, k: ir.Value, f: ir.Value, scale: float | None,
                        shapes: Shapes) -> ir.Value | None:
    """The graph output that is the exporter's rotated ``[B, G, S, D]`` keys: ``rotate(Transpose(Reshape(k)))`` with
    cos/sin ``Unsqueeze(Cos/Sin(Concat(f, f)) [* c], 1)`` of the same angle table: the prefill's present key."""
    for out in graph.outputs:
        rot = _rotary(out, shapes) if out.producer() is not None else None
        if rot is None:
            continue
        x, cos, sin = rot
        hc, hs = _half_angles(cos), _half_angles(sin)
        if hc is None or hs is None or hc[0] is not f or hs[0] is not f or (hc[1], hs[1]) != ("Cos", "Sin"):
            continue
        if hc[2] != scale or hs[2] != scale:
            continue
        if _is_head_split(x, k, shapes):
            return out
    return None


def _rotated_split(heads: ir.Value, notes: dict[int, Any], shapes: Shapes) -> ir.Value | None:
    """The rotated ``[B, S, G*D]`` keys ``r`` if ``heads`` is ``Transpose(Reshape(r, [0, 0, G, D]), [0, 2, 1, 3])``
    (as the fusion rebuilds a decode step's new keys) with ``r`` a noted RotaryEmbedding kernel's output."""
    tr = _producer(heads, "Transpose")
    rs = _producer(tr.inputs[0], "Reshape") if tr is not None else None
    if tr is None or rs is None or list(attr_value(tr, "perm", [])) != [0, 2, 1, 3]:
        return None
    r, target = rs.inputs[0], constant_array(rs.inputs[1])
    note = notes.get(id(r)) if r is not None else None
    if note is None or target is None or int(attr_value(rs, "allowzero", 0)):
        return None
    x = note[0]
    width = shapes.static_dim(x, 2) if len(shapes.dims(x) or ()) == 3 else None
    t = target.reshape(-1).tolist()
    if len(t) != 4 or t[:2] != [0, 0] or not isinstance(width, int) or t[2] * t[3] != width or min(t[2:]) <= 0:
        return None
    return r


#: the most a masked position's additive bias may be in the legacy mask below: exp(c + score) is 0 in float32 for any
#: score under 1e4 - 104 in size, so a key with that bias gets no weight, as a key the kernel masks
_MASKED_AT_MOST = -1e4


def _masking(c: float | None) -> bool:
    """Whether ``c`` is finite and at most :data:`_MASKED_AT_MOST` (transformers' dtype minimum is)."""
    return c is not None and math.isfinite(c) and c <= _MASKED_AT_MOST


def _iota(value: ir.Value | None) -> bool:
    """Whether ``value`` holds ``0, 1, 2, ..`` in row-major order: ``Range(0, n, 1)``, a prefix of a 1-D one
    (``Slice(r, [0], [e](, [0](, [1])))``), or a ``Reshape`` of one."""
    for _ in range(4):
        node = value.producer() if value is not None else None
        if node is None or node.domain != "":
            return False
        if node.op_type == "Range":
            return scalar_value(node.inputs[0]) == 0 and scalar_value(node.inputs[2]) == 1
        if node.op_type == "Reshape":
            value = node.inputs[0]
            continue
        if _prefix(node) is None:
            return False
        value = node.inputs[0]
    return False


def _prefix(node: ir.Node) -> ir.Value | None:
    """``e`` if ``node`` is ``Slice(r, [0], [e](, [0](, [1])))`` of a 1-D ``r``: its first ``e`` values."""
    if node.op_type != "Slice" or node.domain != "" or len(node.inputs) < 3:
        return None
    r, starts = node.inputs[0], constant_array(node.inputs[1])
    axes_in = node.inputs[3] if len(node.inputs) > 3 else None
    steps_in = node.inputs[4] if len(node.inputs) > 4 else None
    axes, steps = constant_array(axes_in), constant_array(steps_in)
    if r is None or r.shape is None or len(r.shape) != 1 or starts is None or starts.reshape(-1).tolist() != [0]:
        return None
    if (axes_in is not None and (axes is None or axes.reshape(-1).tolist() not in ([0], [-1]))) or (
            steps_in is not None and (steps is None or steps.reshape(-1).tolist() != [1])):
        return None
    return node.inputs[2]


def _length_is(x: ir.Value, axis: int, dim: Dim, shapes: Shapes) -> Dim | None:
    """The dim the shape query gives ``x`` on ``axis`` if that length is provably ``dim``: the same dim, or ``x`` a prefix
    (:func:`_prefix`) of a 1-D value ``dim`` long that ends at ``dim`` (all of it); else None."""
    dims = shapes.dims(x)
    if dims is None or not -len(dims) <= axis < len(dims) or dims[axis] is None:
        return None
    if dims[axis] == dim:
        return dims[axis]
    node = x.producer()
    end = _prefix(node) if node is not None else None
    src = node.inputs[0] if node is not None and end is not None else None
    ends, src_dims = shapes.values(end), shapes.dims(src)
    if ends is None or len(ends[1]) != 1 or src_dims is None or len(src_dims) != 1:
        return None
    return dims[axis] if ends[1][0] == dim and src_dims[0] == dim else None


def _full_grid(indices: ir.Value | None, grid: Dims, shapes: Shapes) -> bool:
    """Whether the ``[..., 4]`` ScatterND indices hold ``(i0, i1, i2, i3)`` at ``[i0, i1, i2, i3]`` for every index of a
    tensor of dims ``grid``: ``Concat(axis=-1)`` of four ``Unsqueeze(Expand(x_a, shape), [-1])``, ``x_a`` an iota
    (:func:`_iota`) that is 1 long on every axis but ``a`` (right-aligned to rank 4), where it is ``grid[a]`` long
    (:func:`_length_is`), and each ``shape``'s entries ``grid``'s (or the lengths proved equal to them): no entry
    broadcasts an iota, so the Expands are ``grid``-shaped and each piece counts along its own axis."""
    concat = _producer(indices, "Concat")
    if concat is None or len(concat.inputs) != 4 or int(attr_value(concat, "axis", 0)) not in (-1, 4):
        return False
    one = Dim.lit(1)
    same: list[set[Dim | None]] = [{d} for d in grid]  # each axis' dim and the dims proved to be it (None: no dim)
    pieces = []
    for axis, piece in enumerate(concat.inputs):
        un = _producer(piece, "Unsqueeze")
        ex = _producer(un.inputs[0], "Expand") if un is not None else None
        if un is None or ex is None or ex.inputs[0] is None or _unsqueeze_axes(un) not in ([-1], [4]):
            return False
        x = ex.inputs[0]
        dims = shapes.dims(x)
        if dims is None or not 1 <= len(dims) <= 4 or not _iota(x):
            return False
        lead = 4 - len(dims)
        if any(d != one for a, d in enumerate(dims) if a + lead != axis):
            return False
        if axis < lead:  # an iota of one value, 0, on an axis of one
            if grid[axis] != one:
                return False
        else:
            got = _length_is(x, axis - lead, grid[axis], shapes)  # type: ignore[arg-type]
            if got is None:
                return False
            same[axis].add(got)
        pieces.append(ex.inputs[1])
    for shape in pieces:
        vec = shapes.values(shape)
        if vec is None or len(vec[1]) != 4 or any(e is None or e not in same[a] for a, e in enumerate(vec[1])):
            return False
    return True


def _keeps_values(node: ir.Node, shapes: Shapes) -> bool:
    """Whether the ``Reshape`` ``node`` keeps its rank-4 input's shape: each of its first three target entries is 0
    (``allowzero`` 0: the input's dim) or provably the input's dim, so the last is forced to the input's (the element
    count): every value stays at its index."""
    x = node.inputs[0]
    dims, target = shapes.dims(x), shapes.values(node.inputs[1])
    if x is None or dims is None or len(dims) != 4 or target is None or len(target[1]) != 4:
        return False
    if int(attr_value(node, "allowzero", 0)):
        return False
    zero = Dim.lit(0)
    return all(e is not None and (e == zero or (d is not None and e == d)) for e, d in zip(target[1][:3], dims[:3]))


def _legacy_2d(value: ir.Value | None, shapes: Shapes) -> tuple[ir.Value, ir.Value, Dims] | None:
    """``(kv, pos_column, [S, T])`` if the 2-D ``value`` is ``Mul(Trilu(ConstantOfShape([S, T], c), k, upper), Cast(kv >
    pos_column))`` (either order; ``Less(pos_column, kv)`` too; the Trilu may be absent) with ``c`` masking, ``k <= 1``
    and ``kv`` an iota ``T`` long: transformers' ``_prepare_4d_causal_attention_mask_with_cache_position``
    (``triu(full(min), 1) * (arange(T) > cache_position.reshape(-1, 1))``).  Where ``pos[s] >= s``, the Trilu keeps
    ``c`` wherever ``t > pos[s] >= s + k - 1`` (at any row ``r <= s`` a broadcast may read): the value is ``c`` where
    ``t > pos[s]``, else 0 (or -0)."""
    mul = _producer(value, "Mul")
    if mul is None:
        return None
    for full, gate in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        trilu = _producer(full, "Trilu")
        if trilu is not None:
            k = scalar_value(trilu.inputs[1]) if len(trilu.inputs) > 1 and trilu.inputs[1] is not None else 0.0
            if not int(attr_value(trilu, "upper", 1)) or k is None or k > 1:
                continue
            full = trilu.inputs[0]
        const = _producer(full, "ConstantOfShape")
        fill = const.attributes.get("value") if const is not None else None
        size = shapes.values(const.inputs[0]) if const is not None else None
        if fill is None or size is None or len(size[1]) != 2 or any(d is None for d in size[1]):
            continue
        arr = fill.value.numpy()
        if arr.size != 1 or not _masking(float(arr.reshape(()))):
            continue
        cast = _producer(gate, "Cast")
        cmp = cast.inputs[0].producer() if cast is not None and cast.inputs[0] is not None else None
        if cmp is None or cmp.domain != "" or cmp.op_type not in ("Greater", "Less"):
            continue
        kv, col = (cmp.inputs[0], cmp.inputs[1]) if cmp.op_type == "Greater" else (cmp.inputs[1], cmp.inputs[0])
        if kv is None or col is None or kv.shape is None or len(kv.shape) != 1 or not _iota(kv):
            continue
        if _length_is(kv, 0, size[1][1], shapes) is None:  # type: ignore[arg-type]
            continue
        return kv, col, size[1]  # type: ignore[return-value]
    return None


def _column(value: ir.Value | None) -> ir.Value | None:
    """``pos`` if ``value`` is ``Reshape(pos, [-1, 1])`` of a 1-D ``pos`` (one position per row)."""
    reshape = _producer(value, "Reshape")
    target = constant_array(reshape.inputs[1]) if reshape is not None else None
    if reshape is None or target is None or target.reshape(-1).tolist() != [-1, 1]:
        return None
    pos = reshape.inputs[0]
    return pos if pos is not None and pos.shape is not None and len(pos.shape) == 1 else None


def _leading_2d(value: ir.Value | None) -> ir.Value | None:
    """The 2-D ``m`` that the rank-4 ``value`` is, ``m[s, t]`` at every ``[b, 0, s, t]``: ``Unsqueeze`` onto the two
    leading axes, then ``Expand``s (broadcasts: they copy values)."""
    while (ex := _producer(value, "Expand")) is not None:
        value = ex.inputs[0]
    dims: list[str] = ["1", "1", "s", "t"]
    while (un := _producer(value, "Unsqueeze")) is not None:
        axes = _unsqueeze_axes(un)
        if axes is None:
            return None
        axes = sorted(a + len(dims) if a < 0 else a for a in axes)
        if any(a >= len(dims) or dims[a] != "1" for a in axes):
            return None
        for a in reversed(axes):
            del dims[a]
        value = un.inputs[0]
    return value if dims == ["s", "t"] and value is not None and value.shape is not None \
        and len(value.shape) == 2 else None


def _legacy_parts(bias: ir.Value, keys: Dim | None, shapes: Shapes
                  ) -> tuple[ir.Value, ir.Value, ir.Value | None, Dims, Dims] | None:
    """``(kv, pos_column, mask, [S, T], dims of full)`` of transformers' legacy 4-D causal mask (StableLM in
    transformers 4.57, as optimum's TorchScript export spells it), ``bias`` ``[B, 1, S, keys]``::

        full = Expand(m2d[None, None])                             (:func:`_legacy_2d`: c where t > pos[s], else 0)
        upd  = Where(full[..., :L] + float(mask[:, None, None, :]) == 0, c2, full[..., :L])
        bias = ScatterND(full, grid, Reshape(Expand(upd)))[..., :keys]     (or ``full`` alone, without a mask)

    ``grid`` every index of ``full`` in place (:func:`_full_grid`), so the ScatterND writes all of ``full`` (the
    update is ``grid``-shaped: the op asks that) and the Reshape keeps each value's index (:func:`_keeps_values`):
    the result is ``upd``.  Every other op is elementwise over broadcast operands.  For a 0/1 mask and ``c``, ``c2``
    masking, ``upd[b, 0, s, t]`` is 0 where ``t <= pos[s]`` and ``mask[b, t]`` is 1, else ``c`` or ``c2`` (``c + m``
    is not 0 for a 0/1 ``m``; ``0 + m`` is 0 where ``m`` is).  ``keys`` None: the final cut is not checked."""
    value: ir.Value | None = bias
    sliced = _key_slice(value)
    if sliced is not None:
        ends = shapes.values(sliced[1])
        if keys is not None and (ends is None or len(ends[1]) != 1 or ends[1][0] != keys):
            return None
        value = sliced[0]
    scatter = _producer(value, "ScatterND")
    mask = None
    full = scatter.inputs[0] if scatter is not None else value
    grid = shapes.dims(full)
    if full is None or grid is None or len(grid) != 4 or any(d is None for d in grid):
        return None
    if sliced is None and (keys is not None and grid[3] != keys):
        return None
    if scatter is not None:
        if attr_value(scatter, "reduction", "none") != "none" or not _full_grid(scatter.inputs[1], grid, shapes):
            return None
        upd = scatter.inputs[2]
        reshape = _producer(upd, "Reshape")
        if reshape is not None:
            if not _keeps_values(reshape, shapes):
                return None
            upd = reshape.inputs[0]
        while (ex := _producer(upd, "Expand")) is not None:  # broadcasts: each index reads its operand's
            upd = ex.inputs[0]
        where = _producer(upd, "Where")
        eq = _producer(where.inputs[0], "Equal") if where is not None else None
        if where is None or eq is None or not _masking(scalar_value(where.inputs[1])):
            return None
        if scalar_value(eq.inputs[1]) != 0.0:
            return None
        add, part = _producer(eq.inputs[0], "Add"), where.inputs[2]
        if add is None or part is None:
            return None
        for a, b in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            if a is part and b is not None and b.dtype in FLOAT_TYPES:
                mask = _mask_input(b, ("b", "1", "1", "t"))
                if mask is not None:
                    break
        cut = _key_slice(part)  # full[..., :L]: the index t of the cut is t of full
        if mask is None or (part is not full and (cut is None or cut[0] is not full)):
            return None
    m2d = _leading_2d(full)
    got = _legacy_2d(m2d, shapes) if m2d is not None else None
    if got is None:
        return None
    return got[0], got[1], mask, got[2], grid


def legacy_positions(bias: ir.Value, shapes: Shapes) -> ir.Value | None:
    """The query positions ``pos`` (1-D) the legacy causal mask (:func:`_legacy_parts`) compares the keys with, else
    None (not proved to be ``P + s`` here: the caller does)."""
    parts = _legacy_parts(bias, None, shapes)
    return _column(parts[1]) if parts is not None else None


def legacy_causal(bias: ir.Value, keys: Dim | None, shapes: Shapes, past: ir.Value | None, q: ir.Value
                  ) -> tuple[ir.Value | None] | None:
    """``(mask,)`` if ``bias`` is transformers' legacy causal mask (:func:`_legacy_parts`) over query positions ``pos``
    provably ``P + s`` (so ``pos[s] >= s``: the Trilu changes nothing) and keys ``0 .. T-1``: then ``bias[b, 0, s, t]``
    is 0 where ``t <= pos[s]`` and ``mask[b, t]`` is 1, and a masking constant elsewhere, what GroupQueryAttention
    computes from the mask's lengths.  The 2-D part is ``[S, T]`` with ``S`` the query length (``pos`` that long too:
    no row broadcasts) and ``T`` the key count, ``full``'s last dim."""
    parts = _legacy_parts(bias, keys, shapes)
    if parts is None or keys is None:
        return None
    kv, col, mask, (s, t), grid = parts
    pos = _column(col)
    if pos is None or not _positions(pos, q, past, shapes) or s != _seq_dim(q, shapes) or t != grid[3]:
        return None
    return (mask,)
