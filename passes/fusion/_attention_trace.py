"""The trace of ``fuse-attention`` (:mod:`.attention`): Q, K and V from the 4-D head tensors back to ``[B, S, N*D]``.

Each head tensor is followed through its head split (``Transpose(Reshape(x, [B, S, N, D]), [0, 2, 1, 3])``),
scalar factors on either side, a rotary embedding (:mod:`._attention_rotary`), a KV cache's ``Concat`` and
grouped-query attention's ``repeat_kv``, and K through each exporter's transpose.  The result is a
:class:`Heads`, or a string that says why the trace stopped (the rule's near-miss reason).  Read-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._attention_reads import (
    _entries,
    _heads_and_dim,
    _is_dim,
    _perm,
    _producer,
    _reads_own_axis,
    _scaled,
    _what,
)
from mograph.passes.fusion._attention_rotary import _rotary, _slice_of, _standard_rotary
from mograph.passes.fusion._common import GraphShapes, is_float

from mograph.patterns import constant_array
from mograph.shapes import Dim, mul

# ---------------------------------------------------------------------------------------------
# tracing Q, K, V from the 4-D head tensors back to [batch, seq, hidden]
# ---------------------------------------------------------------------------------------------


@dataclass
class Heads:
    """A ``[B, N, S, D]`` head tensor traced back: ``x`` is ``[B, S, N*D]``, times ``factor``."""

    x: ir.Value
    heads: int
    dim: int
    factor: float = 1.0
    #: K/V heads repeated this many times (grouped-query attention's ``repeat_kv``)
    repeat: int = 1
    #: (cos, sin) of a rotary embedding applied to the heads, broadcastable to [B, N, S, D]
    rotary: tuple[ir.Value, ir.Value] | None = None
    #: K/V with a cache: ``Concat(past, new heads, axis=2)`` ``[B, N, P+T, D]`` (the present, a graph output)
    cached: ir.Value | None = None
    #: (cos, sin) ``[B, S, D/2]`` of opset 23's standard ``RotaryEmbedding`` on the heads (not interleaved)
    half_rotary: tuple[ir.Value, ir.Value] | None = None
    #: a norm over each head's ``D`` values applied right after the split, before any rotary (Gemma 3 and Qwen 3's
    #: ``q_norm`` / ``k_norm``): ``mograph.RMSNorm`` / ``mograph.LayerNorm`` (or the standard ``RMSNormalization`` /
    #: ``LayerNormalization`` over the last axis) with 1-D or single-element scale and bias
    norm: ir.Node | None = None
    #: the rotary's width R where it rotates only each head's first R of D values (a partial rotary), else 0
    rotary_dim: int = 0


#: Norms over the last axis that ``fuse-attention`` follows on the split heads: (domain, op type).
HEAD_NORMS = {("mograph", "RMSNorm"), ("mograph", "LayerNorm"), ("", "RMSNormalization"), ("", "LayerNormalization")}


def _head_norm(v: ir.Value) -> ir.Node | str | None:
    """The norm over the last axis (:data:`HEAD_NORMS`) that produces ``v``, a string when it is one that
    cannot move to the ``[B, S, N, D]`` layout (a scale or bias of more than one axis, another axis), else None."""
    node = v.producer()
    if node is None or (node.domain if node.domain != "ai.onnx" else "", node.op_type) not in HEAD_NORMS:
        return None
    if node.outputs[0] is not v or node.inputs[0] is None:
        return None
    axis = node.attributes.get("axis")
    if axis is not None and int(axis.value) not in (-1, 3):
        return f"{node.op_type} '{node.name}' on the heads normalizes from axis {int(axis.value)}, not the head's last"
    for extra in node.inputs[1:]:
        if extra is not None and (extra.shape is None or len(extra.shape) > 1):
            return f"{node.op_type} '{node.name}' on the heads has a scale or bias that is not 1-D"
    return node


def _partial_rotary(v: ir.Value, shapes: GraphShapes) -> tuple[ir.Value, ir.Value, ir.Value, int] | None:
    """``(x, cos, sin, R)`` if ``v`` is transformers' partial-rotary spelling ``Concat(rotary(x[..., :r]), x[..., r:],
    axis=-1)`` (Phi 3 / Phi-4-mini, StableLM, Phi): ``R = 0`` where ``r`` is provably at least the head's ``D``
    (``x[..., :r]`` is ``x``, ``x[..., r:]`` empty: the rotary of ``x`` itself), else ``R = r`` (even, below ``D``):
    the first ``R`` values of each head rotated (their halves ``R / 2`` apart), the other ``D - R`` passed on."""
    cat = _producer(v, "Concat")
    if cat is None or len(cat.inputs) != 2 or int(cat.attributes["axis"].value) not in (-1, 3):
        return None
    rot = _rotary(cat.inputs[0], shapes) if cat.inputs[0] is not None else None
    head = _slice_of(rot[0], shapes) if rot is not None else None
    if rot is None or head is None:
        return None
    x = head[0]
    rest = _slice_of(cat.inputs[1], shapes, x)
    d = shapes.static_dim(x, 3) if len(shapes.dims(x) or ()) == 4 else None
    if rest is None or d is None or head[1] != 0:
        return None
    if head[2] >= d and rest[1] >= d:
        return x, rot[1], rot[2], 0
    r = head[2]
    if 0 < r < d and r % 2 == 0 and rest[1] == r and rest[2] >= d and shapes.static_dim(rot[0], 3) == r:
        return x, rot[1], rot[2], r
    return None


def _split_heads(v4: ir.Value, role: str, shapes: GraphShapes) -> Heads | str:
    """``v4 = Transpose(Reshape(x, [B, S, N, D]), [0, 2, 1, 3])`` (with scalar factors on either side),
    possibly rotated (:func:`_rotary`) after the split."""
    v, f1 = _scaled(v4, shapes)
    std = _standard_rotary(v)
    if std is not None:  # opset 23's RotaryEmbedding (the dynamo exporter's) on the split heads
        inner = _split_heads(std[0], role, shapes)
        if isinstance(inner, Heads):
            if inner.rotary is not None or inner.half_rotary is not None:
                return f"{role}: two rotary embeddings"
            half = std[1].shape[-1] if std[1].shape is not None and len(std[1].shape) == 3 else None
            if half != inner.dim // 2 or inner.dim % 2:
                return f"{role}: the cos/sin of RotaryEmbedding '{v.producer().name}' are not [batch, seq, {inner.dim // 2}]"  # type: ignore[union-attr]
            inner.half_rotary = (std[1], std[2])
            inner.factor *= f1
        return inner
    rot = _rotary(v, shapes)
    rot4 = (*rot, 0) if rot is not None else _partial_rotary(v, shapes)
    if rot4 is not None:
        inner = _split_heads(rot4[0], role, shapes)
        if isinstance(inner, Heads):
            if inner.rotary is not None:
                return f"{role}: two rotary embeddings"
            inner.rotary = (rot4[1], rot4[2])
            inner.rotary_dim = rot4[3]
            inner.factor *= f1
        return inner
    norm = _head_norm(v)
    if isinstance(norm, str):
        return f"{role}: {norm}"
    if norm is not None:  # RMSNorm(heads) over D is RMSNorm over D of [B, S, N, D]: the rewrite applies it there
        inner = _split_heads(norm.inputs[0], role, shapes)  # type: ignore[arg-type]
        if isinstance(inner, Heads):
            if inner.norm is not None or inner.rotary is not None or inner.half_rotary is not None:
                return f"{role}: {norm.op_type} '{norm.name}' follows another norm or a rotary embedding on the heads"
            if inner.factor != 1.0:
                return f"{role}: the heads are scaled before {norm.op_type} '{norm.name}' (not linear through a norm)"
            inner.norm = norm
            inner.factor = f1
        return inner
    tr = _producer(v, "Transpose")
    if tr is None or _perm(tr) != [0, 2, 1, 3]:
        return f"{role}: expected Transpose perm [0, 2, 1, 3] splitting heads, got {_what(v)}"
    split, f3 = _scaled(tr.inputs[0], shapes)  # type: ignore[arg-type]  # a factor on the split heads (Keras' query)
    pre = _head_norm(split)  # Qwen 3's q_norm / k_norm on [B, S, N, D], before the transpose: the same per-head norm
    if isinstance(pre, str):
        return f"{role}: {pre}"
    if pre is not None:
        split, f4 = _scaled(pre.inputs[0], shapes)  # type: ignore[arg-type]
        if f4 != 1.0:
            return f"{role}: the heads are scaled before {pre.op_type} '{pre.name}' (not linear through a norm)"
    rs = _producer(split, "Reshape")
    if rs is None:
        return f"{role}: expected Reshape to [batch, seq, heads, head_dim], got {_what(split)}"
    x, f2 = _scaled(rs.inputs[0], shapes)  # type: ignore[arg-type]
    if not is_float(x):
        return f"{role} '{x.name}' is not a floating-point tensor"
    if x.shape is None or len(x.shape) != 3 or not isinstance(x.shape[2], int):
        return f"{role} '{x.name}' is not [batch, seq, hidden] with a static hidden size"
    hd = _heads_and_dim(rs, x.shape[2], shapes)
    if isinstance(hd, str):
        return f"{role}: {hd}"
    if pre is not None and f2 != 1.0:
        return f"{role}: the projection is scaled before {pre.op_type} '{pre.name}' (not linear through a norm)"
    return Heads(x, hd[0], hd[1], f1 * f2 * f3, norm=pre)


def _cached_or_split(kh: ir.Value, role: str, shapes: GraphShapes) -> Heads | str:
    """K/V heads, possibly after a KV cache: ``Concat(past [B, N, P, D], new heads, axis=2)``."""
    cat = _producer(kh, "Concat")
    if cat is None:
        return _split_heads(kh, role, shapes)
    axis = int(cat.attributes["axis"].value) if "axis" in cat.attributes else None
    if axis not in (2, -2) or len(cat.inputs) != 2 or cat.inputs[0] is None or cat.inputs[1] is None:
        return f"{role}: Concat '{cat.name}' is not a KV cache (past, new) on the sequence axis"
    new = _split_heads(cat.inputs[1], role, shapes)
    if isinstance(new, str):
        return new
    past = cat.inputs[0]
    if past.dtype != new.x.dtype or past.shape is None or len(past.shape) != 4:
        return f"{role}: the past '{past.name}' of Concat '{cat.name}' is not a 4-D tensor of the new heads' dtype"
    if isinstance(past.shape[1], int) and past.shape[1] != new.heads or (
            isinstance(past.shape[3], int) and past.shape[3] != new.dim):
        return f"{role}: the past '{past.name}' is not [batch, {new.heads}, past, {new.dim}]"
    if new.factor != 1.0:
        return f"{role}: the new heads are scaled before the cache (the past is not)"
    if new.half_rotary is not None:
        return f"{role}: a standard RotaryEmbedding before a KV cache Concat is not taken (yet)"
    # a rotary embedding on the new heads (LLaMA's decode step): fused, the rewrite then builds the cache's
    # Concat again for the present output; other readers of the exporter's Concat keep it (they are shape
    # reads of the repeat_kv the fusion replaces, so it dies with them)
    # (the heads' own norm, Gemma 3's k_norm, stays with them: the rewrite applies it before the rotary)
    return Heads(new.x, new.heads, new.dim, 1.0, rotary=new.rotary, cached=kh, norm=new.norm,
                 rotary_dim=new.rotary_dim)


def _repeated(kh: ir.Value, role: str, shapes: GraphShapes) -> Heads | str:
    """K or V heads, possibly repeated for grouped-query attention:
    ``Reshape(Expand(Unsqueeze(h, 2), [B, G, n, T, D]), [B, G*n, T, D])``."""
    rs = _producer(kh, "Reshape")
    ex = _producer(rs.inputs[0], "Expand") if rs is not None else None
    un = _producer(ex.inputs[0], "Unsqueeze") if ex is not None else None
    if rs is None or ex is None or un is None:
        return _cached_or_split(kh, role, shapes)
    axes = constant_array(un.inputs[1]) if len(un.inputs) > 1 else None
    if axes is None and "axes" in un.attributes:
        axes = np.array(un.attributes["axes"].value)
    if axes is None or axes.reshape(-1).tolist() != [2]:
        return f"{role}: Unsqueeze '{un.name}' of a repeat_kv is not on axis 2"
    inner = _cached_or_split(un.inputs[0], role, shapes)  # type: ignore[arg-type]
    if isinstance(inner, str):
        return inner
    rep_entries = _entries(ex.inputs[1], shapes)
    out_entries = _entries(rs.inputs[1], shapes)
    rep = rep_entries[2] if rep_entries is not None and len(rep_entries) == 5 else None
    if not isinstance(rep, int) or rep < 1:
        return f"{role}: the repeat count of Expand '{ex.name}' is not a constant"
    kv = shapes.dims(un.inputs[0])  # the [B, G, T, D] heads repeated
    kv_dim = (lambda i: kv[i] if kv is not None and len(kv) == 4 else None)  # noqa: E731
    merged_ok = out_entries is not None and len(out_entries) == 4 and (
        out_entries[1] in (inner.heads * rep, -1)
        or _is_dim(out_entries[1], mul(kv_dim(1), Dim.lit(rep)))  # G * rep, G read from the heads' shape
        # [B, ?, T, D] of the [B, G, rep, T, D] expansion: by the element count, ? is G * rep
        or (out_entries[1] is None and all(_is_dim(out_entries[i], kv_dim(i)) or _reads_own_axis(rs.inputs[1], i, shapes)
                                           for i in (2, 3))))
    if not (rep_entries[1] == inner.heads or _is_dim(rep_entries[1], kv_dim(1))  # type: ignore[index]
            or _reads_own_axis(ex.inputs[1], 1, shapes)) or (  # type: ignore[index]
            out_entries is not None and len(out_entries) == 4 and not merged_ok):
        return f"{role}: Expand '{ex.name}' / Reshape '{rs.name}' do not repeat {inner.heads} heads {rep} times"
    if out_entries is None or len(out_entries) != 4:
        return f"{role}: Reshape '{rs.name}' of a repeat_kv is not to 4 dims"
    inner.repeat = rep
    return inner


def _keys_transposed(kt: ir.Value, shapes: GraphShapes) -> Heads | str:
    """``K^T`` ``[B, N, D, T]``: ``Transpose(Reshape(k), [0, 2, 3, 1])``, ``Transpose(K_h, [0, 1, 3, 2])``, or
    the dynamo export of sdpa's transpose (``Reshape(Transpose(Reshape(K_h, [-1, T, D]), [0, 2, 1]), [B, N, D, T])``)."""
    v, f = _scaled(kt, shapes)
    tr = _producer(v, "Transpose")
    if tr is not None and _perm(tr) == [0, 2, 3, 1]:
        # the same split as the others, with the transpose folded in: check it on a [0, 2, 1, 3] view
        split, f3 = _scaled(tr.inputs[0], shapes)  # type: ignore[arg-type]
        rs = _producer(split, "Reshape")
        if rs is None:
            return f"key: expected Reshape to [batch, seq, heads, head_dim], got {_what(split)}"
        x, f2 = _scaled(rs.inputs[0], shapes)  # type: ignore[arg-type]
        f2 *= f3
        if not is_float(x) or x.shape is None or len(x.shape) != 3 or not isinstance(x.shape[2], int):
            return f"key '{x.name}' is not a floating-point [batch, seq, hidden] with a static hidden size"
        hd = _heads_and_dim(rs, x.shape[2], shapes)
        if isinstance(hd, str):
            return f"key: {hd}"
        return Heads(x, hd[0], hd[1], f * f2)
    if tr is not None and _perm(tr) == [0, 1, 3, 2]:
        heads = _repeated(tr.inputs[0], "key", shapes)  # type: ignore[arg-type]
    elif (outer := _producer(v, "Reshape")) is not None:
        heads = _flat_transposed(outer, shapes)
    else:
        return f"key: expected K transposed (Transpose perm [0, 2, 3, 1] or [0, 1, 3, 2]), got {_what(v)}"
    if isinstance(heads, Heads):
        heads.factor *= f
    return heads


def _flat_transposed(outer: ir.Node, shapes: GraphShapes) -> Heads | str:
    """dynamo's sdpa: ``Reshape(Transpose(Reshape(K_h, [-1, T, D]), [0, 2, 1]), [B, N, D, T])``."""
    tr = _producer(outer.inputs[0], "Transpose")
    inner = _producer(tr.inputs[0], "Reshape") if tr is not None else None
    if tr is None or inner is None or _perm(tr) != [0, 2, 1]:
        return f"key: expected Transpose perm [0, 2, 1] of flattened key heads, got {_what(outer.inputs[0])}"
    kh = inner.inputs[0]
    mid, out = inner.outputs[0], outer.outputs[0]
    ra, rb, rc = (len(d) if d is not None else None for d in (shapes.dims(kh), shapes.dims(mid), shapes.dims(out)))
    ok = (ra == 4 and rb == 3 and rc == 4
          and all(shapes.same_dim(v, i, kh, j) for v, i, j in ((mid, 1, 2), (mid, 2, 3), (out, 0, 0), (out, 1, 1),
                                                                (out, 2, 3), (out, 3, 2))))
    kd = shapes.dims(kh)
    if not ok and kd is not None and len(kd) == 4:  # the reshapes' dims disagree: read their targets (dynamo, opset 17)
        got_inner, got_outer = shapes.values(inner.inputs[1]), shapes.values(outer.inputs[1])
        ok = (got_inner is not None and got_outer is not None
              and got_inner[1] == (Dim.lit(-1), kd[2], kd[3])  # [-1 (= B*N), T, D]
              and got_outer[1] == (kd[0], kd[1], kd[3], kd[2]))  # [B, N, D, T]
    if not ok:
        return (f"key: cannot prove Reshape '{inner.name}' / Transpose / Reshape '{outer.name}' swap the last two dims: "
                "their shapes are not known statically and their targets are not read from the key heads' own shape")
    return _repeated(kh, "key", shapes)  # type: ignore[arg-type]
