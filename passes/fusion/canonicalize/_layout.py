"""Layout rules: the attention of an Einsum graph written back as 4-D MatMuls over ``[B, S, N, D]`` splits.

Keras' ``MultiHeadAttention`` computes with ``Einsum`` (projections ``abc,cde->abde`` with the heads inside the
weight, scores ``aecd,abcd->acbe``, context ``acbe,aecd->abcd``, output ``abcd,cde->abe``).  tf2onnx writes some
of them as ``Einsum`` and decomposes the others: a projection becomes ``Gemm`` over the flattened rows, reshaped
to ``[B, S, N, D, 1]`` and squeezed; a batched product becomes ``Unsqueeze`` / ``Transpose`` / ``Reshape`` to
``[B*N, ., .]``, a 3-D ``MatMul``, a ``Reshape`` to ``[B, N, ., ., 1]`` and a ``Squeeze``, its shapes computed from
``Shape`` at run time.  These rewrites give that spelling the form ``fuse-attention`` reads (each one exact:
the same elements in the same order, or the same dot products; ``einsum-matmul`` and ``gemm-rows`` up to the
float rounding of another summation order)::

    unit-axes        Reshape(Transpose(Unsqueeze(x, a), p), t) -> Reshape(Transpose(x, p'), t)   (p' is p
                     without the unit axes; also without the Transpose) -- a Reshape reads elements in order,
                     and unit axes do not change it.  ``t`` must hold no literal 0 (a copied dim would move).
    shape-unit-axes  Shape(Transpose(Unsqueeze(x, a), p)) -> Gather(Concat(Shape(x), [1]), idx): the shape those
                     Reshapes' targets read at run time, read from ``x``.
    squeeze-reshape  Squeeze(Reshape(y, t), axes) -> Reshape(y, Gather(t, kept)) where t's entries at ``axes``
                     are provably 1.
    gemm-rows        Reshape(Gemm(Reshape(x, [P, K]), W), t) -> Reshape(MatMul(x, W) (+ C), t) where ``x`` is
                     ``[B, S, K]`` with ``P = B*S``, and ``t`` splits the output (more dims than ``x``: a plain
                     linear layer is left as written; a merge of heads ``[B, S, N, D]`` into rows too).
    bias-split       Add(Reshape(y, t), c) -> Reshape(Add(y, c.flatten()), t) where the Reshape only splits y's
                     last dim into c's dims (the bias of ``abc,cde->abde`` is ``[d, e]``).
    batched-matmul   Reshape(MatMul(Reshape(A, [B*N, M, K]), Reshape(Bm, [B*N, K, L])), [B, N, M, L]) ->
                     MatMul(A, Bm) for 4-D ``A`` ``[B, N, M, K]`` and ``Bm`` ``[B, N, K, L]`` (either side may be
                     ``Transpose(Reshape(X, [B*N, K, M]), [0, 2, 1])``: then it is ``Transpose(X, [0, 1, 3, 2])``);
                     every dim proved by the shape query.  One head: ``A`` may be ``[B, S, 1, K]`` read as
                     its ``Transpose(A, [0, 2, 1, 3])`` (the exporter left out a transpose of a unit axis), or a
                     Reshape of a 4-D tensor that only moves unit axes (read through).
    matmul-transpose Transpose(MatMul(a, b), swap last two) -> MatMul(Transpose(b), Transpose(a)):
                     ``(a b)^T = b^T a^T``, the same sums.
    einsum-matmul    Einsum(x, W) contracting x's trailing letters with W's leading ones (``abc,cde->abde``,
                     ``abcd,cde->abe``), W a constant -> Reshape(MatMul(Reshape(x, [0, .., K]), W[K, L]), [0, .., out]).
    head-slice       Slice(Transpose(Reshape(x @ W (+ b), [B, S, H, E]), [0, 2, 1, 3]), a, c, axis=-1) ->
                     Transpose(Reshape(x @ W' (+ b'), [0, 0, H, c-a]), [0, 2, 1, 3]) with ``W'`` the columns
                     ``h*E + a .. h*E + c`` of every head ``h`` (``b'`` likewise; also without the Transpose):
                     GPT-NeoX's ``query_key_value``, laid out per head as ``[q_h | k_h | v_h]`` and cut by
                     ``chunk(3, -1)``, becomes three projections of ``x`` (each column the same dot product).
                     ``W`` and ``b`` constants (the exporter's); the Slice's bounds literal (computed from
                     the shape included); the heads read only by Slices that cut ``E`` into three equal parts.
    group-slice      Reshape(Slice(Reshape(x @ W (+ b), [B, S, G, n+2, D]), 0, n, axis=3), [B, S, G*n, D]) and
                     Reshape(Expand(Gather(that, [n] | [n+1], axis=3), [B, S, G, n, D]), [B, S, G*n, D]) ->
                     Reshape(x @ W' (+ b'), [0, 0, G*n, D]): Falcon's new decoder architecture, one fused
                     ``query_key_value`` laid out per K/V group as ``[q_1 .. q_n | k | v]``, the key and value
                     broadcast to the group's n query heads; ``W'`` holds the query columns of each group, or the
                     group's key (value) columns once per query head (copies: the same dot products).  The 5-D
                     heads read only by that Slice and the two Gathers.
    heads-reshape    Reshape(Transpose(h, [0, 2, 1, 3]), t) -> Transpose(h, [0, 2, 1, 3]) where the shape query
                     proves ``t`` the Transpose's own dims (Falcon's ``.transpose(1, 2).reshape(B, H, S, D)``).

Consecutive Transposes a rewrite builds are composed into one (an identity one disappears).  The rules run
only where a pass names them (``fuse-attention``); like every canonical rewrite, an edit no fusion consumes
is undone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.canonicalize._base import (
    Build,
    CanonRule,
    Miss,
    rank_of,
    shape_entries,
    single_use,
    std,
)

from mograph.patterns import constant_array
from mograph.shapes import Dim, Dims, as_ir_shape, mul, prod

if TYPE_CHECKING:
    from mograph.passes.fusion.canonicalize._engine import Canonicalizer

__all__ = ["BATCHED_MATMUL", "BIAS_SPLIT", "EINSUM_MATMUL", "GEMM_ROWS", "GROUP_SLICE", "HEADS_RESHAPE", "HEAD_SLICE", "LAYOUT_RULES",
           "MATMUL_TRANSPOSE", "SHAPE_UNIT_AXES", "SQUEEZE_RESHAPE", "UNIT_AXES"]

_ONE = Dim()


def _producer(v: ir.Value | None, *ops: str) -> ir.Node | None:
    node = v.producer() if v is not None else None
    return node if std(node, *ops) else None


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return None if attr is None else [int(p) for p in attr.value]


def _axes(node: ir.Node) -> list[int] | None:
    """The constant axes of an Unsqueeze/Squeeze (attribute below opset 13, input from 13)."""
    attr = node.attributes.get("axes")
    if attr is not None:
        return [int(a) for a in attr.value]
    arr = constant_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    return None if arr is None else [int(a) for a in arr.reshape(-1)]


def _like(v: ir.Value, dims: Dims | None) -> ir.Value:
    """A template for a new node's output: ``v``'s type, ``dims`` as its shape (unknown if None)."""
    return ir.Value(name=v.name, type=v.type, shape=None if dims is None else as_ir_shape(dims))


def _known(dims: Dims | None, rank: int | None = None) -> bool:
    return dims is not None and all(d is not None for d in dims) and (rank is None or len(dims) == rank)


def _transposed(c: Canonicalizer, v: ir.Value, perm: list[int], made: list[ir.Node]) -> ir.Value:
    """``Transpose(v, perm)``, composed with a Transpose that produces ``v``; ``v`` itself for the identity."""
    base, full = v, perm
    inner = _producer(v, "Transpose")
    inner_perm = _perm(inner) if inner is not None else None
    if inner is not None and inner_perm is not None and len(inner_perm) == len(perm) and inner.inputs[0] is not None:
        base, full = inner.inputs[0], [inner_perm[j] for j in perm]
    if full == list(range(len(full))):
        return base
    dims = c.shapes.dims(base)
    node = c.node("Transpose", [base], _like(v, None if dims is None else tuple(dims[j] for j in full)), perm=full)
    made.append(node)
    return node.outputs[0]


def _no_zero(entries: list[Dim] | None) -> bool:
    return entries is not None and not any(e.is_literal and e.value == 0 for e in entries)


# -- unit-axes -----------------------------------------------------------------------------------


def _unit_axes(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    x = n.inputs[0]
    tr = _producer(x, "Transpose")
    un = _producer(tr.inputs[0] if tr is not None else x, "Unsqueeze")
    if un is None or un.inputs[0] is None or (tr is not None and _perm(tr) is None):
        return Miss("reads no Unsqueeze (or Transpose of one)")
    axes = _axes(un)
    src = un.inputs[0]
    src_dims = c.shapes.dims(src)
    if axes is None or src_dims is None:
        return Miss("the Unsqueeze's axes or its input's rank are not known")
    rank = len(src_dims) + len(axes)
    units = sorted({a % rank for a in axes})
    if not _no_zero(shape_entries(c, n.inputs[1])):
        return Miss("the Reshape's target is not known, or holds a 0 (a copied dim)")
    made: list[ir.Node] = []
    new_in = src
    if tr is not None:
        perm = _perm(tr)
        assert perm is not None
        index = {a: a - sum(u < a for u in units) for a in range(rank) if a not in units}
        new_in = _transposed(c, src, [index[a] for a in perm if a not in units], made)
    attrs = {k: a.value for k, a in n.attributes.items()}
    node = c.node("Reshape", [new_in, n.inputs[1]], n.outputs[0], **attrs)  # type: ignore[list-item]
    return Build(node.outputs[0], [*made, node])


def _shape_unit_axes(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    """``Shape(Transpose(Unsqueeze(x, a), p))`` (or of the Unsqueeze) -> ``Gather(Concat(Shape(x), [1]), idx)``:
    the same vector, read from ``x`` (so the unit axes ``unit-axes`` took out of a Reshape leave no reader of
    ``x`` behind them but a ``Shape``, which a fusion computes again from what survives)."""
    if "start" in n.attributes or "end" in n.attributes:
        return Miss("reads part of the shape (start/end)")
    v = n.inputs[0]
    tr = _producer(v, "Transpose")
    un = _producer(tr.inputs[0] if tr is not None else v, "Unsqueeze")
    perm = _perm(tr) if tr is not None else None
    if un is None or un.inputs[0] is None or (tr is not None and perm is None):
        return Miss("reads no Unsqueeze (or Transpose of one)")
    axes, src = _axes(un), un.inputs[0]
    src_dims = c.shapes.dims(src)
    if axes is None or src_dims is None:
        return Miss("the Unsqueeze's axes or its input's rank are not known")
    r = len(src_dims)
    rank = r + len(axes)
    units = sorted({a % rank for a in axes})
    order = perm if perm is not None else list(range(rank))
    index = {a: a - sum(u < a for u in units) for a in range(rank) if a not in units}
    idx = [r if a in units else index[a] for a in order]  # position r: the appended 1
    vec = ir.Value(name="s", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([r]))
    shape = c.node("Shape", [src], vec)
    inits: list[ir.Value] = []
    made = [shape]
    base = shape.outputs[0]
    if units:
        one = c.constant(np.array([1], dtype=np.int64), "mograph_unit_dim")
        inits.append(one)
        cat = c.node("Concat", [base, one], _like(vec, None), axis=0)
        cat.outputs[0].shape = ir.Shape([r + 1])
        made.append(cat)
        base = cat.outputs[0]
    pick = c.constant(np.array(idx, dtype=np.int64), "mograph_unit_order")
    inits.append(pick)
    gather = c.node("Gather", [base, pick], n.outputs[0], axis=0)
    made.append(gather)
    return Build(gather.outputs[0], made, inits)


# -- squeeze-reshape ------------------------------------------------------------------------------


def _squeeze_reshape(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    rs = _producer(n.inputs[0], "Reshape")
    if rs is None or rs.inputs[0] is None or not single_use(rs.outputs[0]):
        return Miss("does not squeeze a Reshape read only here")
    axes = _axes(n)
    entries = shape_entries(c, rs.inputs[1])
    if axes is None or not _no_zero(entries):
        return Miss("the axes, or the Reshape's target, are not known (or it holds a 0)")
    assert entries is not None
    dropped = {a % len(entries) for a in axes}
    if any(entries[a] != _ONE for a in dropped):
        return Miss("the squeezed entries of the Reshape's target are not provably 1")
    kept = [i for i in range(len(entries)) if i not in dropped]
    made: list[ir.Node] = []
    inits: list[ir.Value] = []
    shape_in = rs.inputs[1]
    target = constant_array(shape_in)
    if target is not None and shape_in is not None:
        new_target = c.constant(np.asarray(target.reshape(-1)[kept], dtype=np.int64), shape_in.name)
        inits.append(new_target)
    else:
        idx = c.constant(np.array(kept, dtype=np.int64), "mograph_kept_axes")
        inits.append(idx)
        vec = ir.Value(name="t", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([len(kept)]))
        gather = c.node("Gather", [rs.inputs[1], idx], vec, axis=0)  # type: ignore[list-item]
        made.append(gather)
        new_target = gather.outputs[0]
    attrs = {k: a.value for k, a in rs.attributes.items()}
    node = c.node("Reshape", [rs.inputs[0], new_target], n.outputs[0], **attrs)
    made.append(node)
    return Build(node.outputs[0], made, inits)


# -- gemm-rows ----------------------------------------------------------------------------------


def _gemm_rows(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    g = _producer(n.inputs[0], "Gemm")
    if g is None or not single_use(g.outputs[0]):
        return Miss("reads no Gemm read only here")
    flat = _producer(g.inputs[0], "Reshape")
    if flat is None or flat.inputs[0] is None:
        return Miss("the Gemm's rows are not a Reshape")
    at = {k: a.value for k, a in g.attributes.items()}
    if float(at.get("alpha", 1.0)) != 1.0 or int(at.get("transA", 0)):  # type: ignore[arg-type]
        return Miss("the Gemm scales or transposes its rows")
    x = flat.inputs[0]
    xd, fd, od = c.shapes.dims(x), c.shapes.dims(flat.outputs[0]), c.shapes.dims(n.outputs[0])
    if not _known(xd, 3) or not _known(fd, 2) or od is None or xd is None or fd is None:
        return Miss("the rows' dims are not known, or not flattened from a [batch, seq, hidden] tensor")
    if fd[1] != xd[-1] or fd[0] != prod(xd[:-1]):
        return Miss("the Reshape does not flatten all but the last dim of its input")
    if len(od) <= len(xd):
        return Miss("the output is not split into more dims than the rows had (a plain linear layer)")
    cvec = g.inputs[2] if len(g.inputs) > 2 else None
    beta = float(at.get("beta", 1.0))  # type: ignore[arg-type]
    if cvec is not None:  # (tf2onnx writes beta=0 without a C)
        arr = constant_array(cvec)
        if beta != 1.0 or arr is None or arr.ndim > 1:
            return Miss("the Gemm's C is not a 1-D constant added once")
    made: list[ir.Node] = []
    inits: list[ir.Value] = []
    w = g.inputs[1]
    assert w is not None
    if int(at.get("transB", 0)):  # type: ignore[arg-type]
        warr = constant_array(w)
        if warr is not None and w.const_value is not None:
            w = c.constant(np.ascontiguousarray(warr.T), w.name)
            inits.append(w)
        else:
            w = _transposed(c, w, [1, 0], made)
    wd = c.shapes.dims(w) if not inits else tuple(Dim.lit(s) for s in constant_array(w).shape)  # type: ignore[union-attr]
    ydims = (*xd[:-1], wd[-1] if wd else None)
    y = c.node("MatMul", [x, w], _like(g.outputs[0], ydims))
    made.append(y)
    out = y.outputs[0]
    if cvec is not None:
        add = c.node("Add", [out, cvec], _like(g.outputs[0], ydims))
        made.append(add)
        out = add.outputs[0]
    attrs = {k: a.value for k, a in n.attributes.items()}
    node = c.node("Reshape", [out, n.inputs[1]], n.outputs[0], **attrs)  # type: ignore[list-item]
    made.append(node)
    return Build(node.outputs[0], made, inits)


# -- bias-split ---------------------------------------------------------------------------------


def _bias_split(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    a, b = n.inputs[0], n.inputs[1]
    side = 0 if _producer(a, "Reshape") is not None else 1
    rs = _producer(n.inputs[side], "Reshape")
    bias = n.inputs[1 - side]
    arr = constant_array(bias)
    if rs is None or arr is None or arr.ndim < 1 or rs.inputs[0] is None or not single_use(rs.outputs[0]):
        return Miss("is not a constant added to a Reshape read only here")
    y = rs.inputs[0]
    yd, od = c.shapes.dims(y), c.shapes.dims(rs.outputs[0])
    k = arr.ndim
    if not _known(yd) or not _known(od) or yd is None or od is None or len(od) - k != len(yd) - 1 or len(yd) < 1:
        return Miss("the Reshape does not split its input's last dim into the bias's dims")
    if list(od[:-k]) != list(yd[:-1]) or [d.value if d.is_literal else None for d in od[-k:]] != list(arr.shape):  # type: ignore[union-attr]
        return Miss("the Reshape does not split its input's last dim into the bias's dims")
    if not (yd[-1] is not None and yd[-1].is_literal and yd[-1].value == arr.size):
        return Miss("the Reshape does not split its input's last dim into the bias's dims")
    flat = c.constant(np.ascontiguousarray(arr.reshape(-1)), bias.name if bias is not None else None)
    ins = [y, flat] if side == 0 else [flat, y]
    add = c.node("Add", ins, _like(y, yd))
    attrs = {k: at.value for k, at in rs.attributes.items()}
    node = c.node("Reshape", [add.outputs[0], rs.inputs[1]], n.outputs[0], **attrs)  # type: ignore[list-item]
    del b
    return Build(node.outputs[0], [add, node], [flat])


# -- batched-matmul -----------------------------------------------------------------------------


def _operand(c: Canonicalizer, v: ir.Value | None) -> tuple[ir.Value | _HeadsFirst, bool] | str:
    """A 3-D MatMul operand as ``(X, swapped)``: ``Reshape(X, [B*N, p, q])`` (X ``[B, N, p, q]``), or
    ``Transpose`` ``[0, 2, 1]`` of one (swapped)."""
    tr = _producer(v, "Transpose")
    swapped = tr is not None and _perm(tr) == [0, 2, 1]
    inner = tr.inputs[0] if swapped and tr is not None else v
    rs = _producer(inner, "Reshape")
    if rs is None or rs.inputs[0] is None:
        return "an operand is not a Reshape (or its Transpose [0, 2, 1]) of a 4-D tensor"
    x = rs.inputs[0]
    unit = _producer(x, "Reshape")
    if unit is not None and unit.inputs[0] is not None and _no_zero(shape_entries(c, rs.inputs[1])):
        x4 = unit.inputs[0]  # Reshape(Reshape(X, a), b) is Reshape(X, b): tf2onnx writes a Transpose that moves
        if rank_of(c, x4) == 4 and rank_of(c, x) != 4:  # only unit axes as a Reshape (one head)
            x = x4
    d4, d3 = c.shapes.dims(x), c.shapes.dims(rs.outputs[0])
    if not _known(d4, 4) or not _known(d3, 3) or d4 is None or d3 is None:
        return "an operand's dims are not known"
    if d3[1] == d4[2] and d3[2] == d4[3] and d3[0] == mul(d4[0], d4[1]):
        return x, swapped
    if d4[2] == _ONE and d3[0] == d4[0] and d3[1] == d4[1] and d3[2] == d4[3]:
        # [B, S, 1, D] merged as [B*1, S, D]: one head, whose [0, 2, 1, 3] transpose moves a unit axis only
        return _HeadsFirst(x), swapped
    return "an operand's Reshape does not merge the two leading dims of a 4-D tensor"


class _HeadsFirst:
    """An operand ``[B, S, 1, D]`` that stands for its ``Transpose(., [0, 2, 1, 3])`` (one head)."""

    def __init__(self, x: ir.Value) -> None:
        self.x = x


def _view(c: Canonicalizer, x: ir.Value | _HeadsFirst) -> Dims | None:
    """The ``[B, N, p, q]`` dims an operand stands for."""
    if isinstance(x, _HeadsFirst):
        d = c.shapes.dims(x.x)
        return None if d is None else (d[0], d[2], d[1], d[3])
    return c.shapes.dims(x)


def _side(c: Canonicalizer, x: ir.Value | _HeadsFirst, swapped: bool, made: list[ir.Node]) -> ir.Value:
    """The 4-D operand: ``x`` (a ``[B, S, 1, D]`` one through ``[0, 2, 1, 3]``), its last two dims swapped if so."""
    if isinstance(x, _HeadsFirst):
        return _transposed(c, x.x, [0, 2, 3, 1] if swapped else [0, 2, 1, 3], made)
    return _transposed(c, x, [0, 1, 3, 2], made) if swapped else x


def _batched_matmul(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    mm = _producer(n.inputs[0], "MatMul")
    if mm is None or not single_use(mm.outputs[0]):
        return Miss("reads no MatMul read only here")
    left, right = (_operand(c, v) for v in mm.inputs)
    if isinstance(left, str) or isinstance(right, str):
        return Miss(left if isinstance(left, str) else right)  # type: ignore[arg-type]
    (a, sa), (b, sb) = left, right
    da, db, od = _view(c, a), _view(c, b), c.shapes.dims(n.outputs[0])
    assert da is not None and db is not None
    if da[0] != db[0] or da[1] != db[1]:
        return Miss("the operands' two leading dims are not provably the same")
    rows = da[3] if sa else da[2]
    cols = db[2] if sb else db[3]
    if not _known(od, 4) or od is None or list(od) != [da[0], da[1], rows, cols]:
        return Miss("the Reshape is not provably to [batch, heads, rows, columns] of the product")
    made: list[ir.Node] = []  # (built only once the rule applies: a node made reads its inputs)
    a4, b4 = _side(c, a, sa, made), _side(c, b, sb, made)
    node = c.node("MatMul", [a4, b4], n.outputs[0])
    made.append(node)
    return Build(node.outputs[0], made)


# -- matmul-transpose ---------------------------------------------------------------------------


def _matmul_transpose(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    perm = _perm(n)
    mm = _producer(n.inputs[0], "MatMul")
    if mm is None or perm is None or len(perm) < 2 or not single_use(mm.outputs[0]):
        return Miss("does not transpose a MatMul read only here")
    r = len(perm)
    swap = [*range(r - 2), r - 1, r - 2]
    if perm != swap:
        return Miss("does not swap the last two dims only")
    a, b = mm.inputs
    da, db = c.shapes.dims(a), c.shapes.dims(b)
    if a is None or b is None or da is None or db is None or len(da) != r or len(db) != r:
        return Miss("the MatMul's operands are not of the Transpose's rank")
    made: list[ir.Node] = []
    bt, at = _transposed(c, b, swap, made), _transposed(c, a, swap, made)
    node = c.node("MatMul", [bt, at], n.outputs[0])
    made.append(node)
    return Build(node.outputs[0], made)


# -- einsum-matmul ------------------------------------------------------------------------------


def _einsum_matmul(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    eq = n.attributes.get("equation")
    if eq is None or len(n.inputs) != 2 or n.inputs[0] is None or n.inputs[1] is None:
        return Miss("is not a two-operand Einsum")
    text = str(eq.value).replace(" ", "")
    if "..." in text or "->" not in text or text.count(",") != 1:
        return Miss(f"equation '{text}' is not 'lhs,rhs->out' without ellipsis")
    lhs_rhs, out = text.split("->")
    lhs, rhs = lhs_rhs.split(",")
    x, w = n.inputs
    warr = constant_array(w)
    if x is None or w is None or warr is None or w.const_value is None:
        return Miss("the second operand is not a constant weight")
    con = [ch for ch in lhs if ch in rhs]
    k = len(con)
    if (not k or len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs) or lhs[len(lhs) - k:] != rhs[:k]
            or out != lhs[:len(lhs) - k] + rhs[k:] or len(lhs) == k or len(rhs) == k or warr.ndim != len(rhs)):
        return Miss(f"equation '{text}' does not contract x's trailing axes with the weight's leading ones")
    xd = c.shapes.dims(x)
    if xd is None or len(xd) != len(lhs) or x.dtype != w.dtype:
        return Miss("x's rank is not the equation's, or x and the weight differ in dtype")
    pre = len(lhs) - k
    kdim, post = math.prod(warr.shape[:k]), list(warr.shape[k:])
    if [d.value if d is not None and d.is_literal else None for d in xd[pre:]] != list(warr.shape[:k]):
        return Miss("x's contracted dims are not the weight's")
    made: list[ir.Node] = []
    inits: list[ir.Value] = []
    xin = x
    if k > 1:
        shape = c.constant(np.array([0] * pre + [kdim], dtype=np.int64), "mograph_einsum_rows")
        inits.append(shape)
        node = c.node("Reshape", [x, shape], _like(x, (*xd[:pre], Dim.lit(kdim))))
        made.append(node)
        xin = node.outputs[0]
    wm = c.constant(np.ascontiguousarray(warr.reshape(kdim, math.prod(post))), w.name)
    inits.append(wm)
    if len(post) == 1:
        node = c.node("MatMul", [xin, wm], n.outputs[0])
        made.append(node)
        return Build(node.outputs[0], made, inits)
    mm = c.node("MatMul", [xin, wm], _like(n.outputs[0], (*xd[:pre], Dim.lit(math.prod(post)))))
    made.append(mm)
    shape = c.constant(np.array([0] * pre + post, dtype=np.int64), "mograph_einsum_split")
    inits.append(shape)
    node = c.node("Reshape", [mm.outputs[0], shape], n.outputs[0])
    made.append(node)
    return Build(node.outputs[0], made, inits)



# -- head-slice ---------------------------------------------------------------------------------


def _literal_int(c: Canonicalizer, value: ir.Value | None) -> int | None:
    """The one integer a constant or a shape-computed scalar/1-element vector holds (None if not provably one)."""
    arr = constant_array(value) if value is not None else None
    if arr is not None:
        return int(arr.reshape(-1)[0]) if arr.size == 1 and arr.dtype.kind in "iu" else None
    vec = c.shapes.values(value)
    if vec is None or len(vec[1]) != 1:
        return None
    e = vec[1][0]
    return e.value if e is not None and e.is_literal else None  # type: ignore[return-value]


def _slice_bounds(c: Canonicalizer, n: ir.Node) -> tuple[int, int, int, int] | None:
    """``(start, end, axis, step)`` of a Slice whose bounds are literal (computed from the shape included)."""
    got = [_literal_int(c, n.inputs[i]) if i < len(n.inputs) and n.inputs[i] is not None else d
           for i, d in ((1, None), (2, None), (3, -1), (4, 1))]
    return None if any(b is None for b in got) else tuple(got)  # type: ignore[return-value]


def _parts(c: Canonicalizer, heads: ir.Value | None, e: int) -> list[tuple[int, int]] | None:
    """The ``[start, end)`` ranges of the last axis (``e`` wide) that the Slices reading ``heads`` cut, besides
    ``Shape`` readers; None if something else reads it."""
    if heads is None:
        return None
    got: list[tuple[int, int]] = []
    for user, i in heads.uses():
        if std(user, "Shape") and i == 0:
            continue
        bounds = _slice_bounds(c, user) if std(user, "Slice") and i == 0 else None
        if bounds is None or bounds[2] not in (-1, 3) or bounds[3] != 1:
            return None
        got.append(tuple(min(max(v + e if v < 0 else v, 0), e) for v in bounds[:2]))  # type: ignore[arg-type]
    return got


def _projection(y: ir.Value | None) -> tuple[ir.Value, np.ndarray, np.ndarray | None] | Miss:
    """``(x, W, b)`` of ``y = x @ W (+ b)``, ``W`` a 2-D constant and ``b`` a 1-D constant as wide."""
    add = _producer(y, "Add")
    bias = None
    if add is not None:
        for side in (0, 1):
            mm, arr = _producer(add.inputs[side], "MatMul"), constant_array(add.inputs[1 - side])
            if mm is not None and arr is not None:
                y, bias = add.inputs[side], arr
                break
        else:
            return Miss("the heads are not split from a MatMul (+ a constant bias)")
    mm = _producer(y, "MatMul")
    w = constant_array(mm.inputs[1]) if mm is not None else None
    if mm is None or mm.inputs[0] is None or w is None or w.ndim != 2:
        return Miss("the heads are not split from x @ W with W a 2-D constant")
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != w.shape[1] or bias.dtype != w.dtype):
        return Miss("the projection's bias is not one value per column")
    for v in (y, add.outputs[0] if add is not None else None):  # (a Shape reads the same dims from the new one)
        if v is not None and (v.is_graph_output() or sum(not std(u, "Shape") for u, _ in v.uses()) != 1):
            return Miss("the projection is read elsewhere too")
    return mm.inputs[0], w, bias


def _head_slice(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    """See the module docstring (``head-slice``)."""
    src = n.inputs[0]
    tr = _producer(src, "Transpose")
    if tr is not None and _perm(tr) != [0, 2, 1, 3]:
        return Miss("the Slice reads a Transpose other than [0, 2, 1, 3]")
    rs = _producer(tr.inputs[0] if tr is not None else src, "Reshape")
    if rs is None or rs.inputs[0] is None:
        return Miss("the Slice does not read heads split by a Reshape")
    if (tr is not None and rs.outputs[0].is_graph_output()) or (src is not None and src.is_graph_output()):
        return Miss("the split heads are a graph output")
    bounds = _slice_bounds(c, n)
    if bounds is None:
        return Miss("the Slice's bounds are not literal")
    start, end, axis, step = bounds
    mm = _producer(rs.inputs[0], "MatMul", "Add")
    if mm is None or mm not in c.original:
        return Miss("the heads are not split from an exporter's projection")
    proj = _projection(rs.inputs[0])
    if isinstance(proj, Miss):
        return proj
    x, w, bias = proj
    ydims, hdims = c.shapes.dims(rs.inputs[0]), c.shapes.dims(rs.outputs[0])
    if not _known(ydims, 3) or not _known(hdims, 4) or ydims is None or hdims is None:
        return Miss("the projection is not [B, S, N] split into [B, S, H, E] with known dims")
    heads, width = hdims[2], hdims[3]
    if not (heads.is_literal and width.is_literal) or ydims[0] != hdims[0] or ydims[1] != hdims[1]:  # type: ignore[union-attr]
        return Miss("the Reshape does not split only the last dim into literal heads")
    h, e = int(heads.value), int(width.value)  # type: ignore[union-attr,arg-type]
    if h * e != w.shape[1] or h < 2:
        return Miss("the Reshape does not split the projection's columns into heads (or there is one head)")
    if axis not in (-1, 3) or step != 1:  # type: ignore[operator]
        return Miss("the Slice does not cut the last axis with step 1")
    start, end = (min(max(v + e if v < 0 else v, 0), e) for v in (start, end))  # type: ignore[operator]
    key = (id(src), ("head-slice", e))
    hit = c.memo.get(key)
    if hit is None or hit[0] is not src:  # (a sibling Slice rewritten first is detached: proved before it was)
        parts = _parts(c, src, e)
        if e % 3 or parts is None or sorted(parts) != [(0, e // 3), (e // 3, 2 * e // 3), (2 * e // 3, e)]:
            return Miss("the heads are not cut into three equal parts [q | k | v] (and read by nothing else)")
        c.memo[key] = (src, src)  # type: ignore[assignment]
    cols = (np.arange(h)[:, None] * e + np.arange(start, end)[None, :]).reshape(-1)
    inits = [c.constant(np.ascontiguousarray(w[:, cols]), "mograph_head_slice_weight")]
    ylike = _like(rs.inputs[0], (ydims[0], ydims[1], Dim.lit(h * (end - start))))
    made = [c.node("MatMul", [x, inits[0]], ylike)]
    out = made[-1].outputs[0]
    if bias is not None:
        inits.append(c.constant(np.ascontiguousarray(bias[cols]), "mograph_head_slice_bias"))
        made.append(c.node("Add", [out, inits[-1]], ylike))
        out = made[-1].outputs[0]
    inits.append(c.constant(np.array([0, 0, h, end - start], dtype=np.int64), "mograph_head_slice_shape"))
    part = Dim.lit(end - start)
    made.append(c.node("Reshape", [out, inits[-1]], _like(rs.outputs[0], (hdims[0], hdims[1], heads, part))))
    out = made[-1].outputs[0]
    if tr is not None:
        made.append(c.node("Transpose", [out], _like(n.outputs[0], (hdims[0], heads, hdims[1], part)),
                           perm=[0, 2, 1, 3]))
    return Build(made[-1].outputs[0], made, inits)



# -- group-slice --------------------------------------------------------------------------------


def _group_part(c: Canonicalizer, a: ir.Value | None, slots: int) -> tuple[ir.Node, int | None] | None:
    """``(R5, None)`` where ``a`` is the query Slice ``[0, slots-2)`` of axis 3 of a 5-D Reshape, ``(R5, j)`` where it is
    ``Expand(Gather(R5, [j], axis=3))`` (``j`` = ``slots``-2 or -1: the key, the value); else None."""
    sl = _producer(a, "Slice")
    if sl is not None:
        bounds = _slice_bounds(c, sl)
        rs = _producer(sl.inputs[0], "Reshape")
        if bounds is None or rs is None or bounds[2] not in (3, -2) or bounds[3] != 1:
            return None
        start, end = (min(max(v + slots if v < 0 else v, 0), slots) for v in bounds[:2])
        return (rs, None) if (start, end) == (0, slots - 2) else None
    ex = _producer(a, "Expand")
    g = _producer(ex.inputs[0], "Gather") if ex is not None else None
    idx = constant_array(g.inputs[1]) if g is not None else None
    axis = g.attributes.get("axis") if g is not None else None
    if g is None or idx is None or idx.shape != (1,) or (0 if axis is None else int(axis.value)) not in (3, -2):
        return None
    rs = _producer(g.inputs[0], "Reshape")
    j = int(idx[0]) + (slots if int(idx[0]) < 0 else 0)
    return (rs, j) if rs is not None and j in (slots - 2, slots - 1) else None


def _part_value(user: ir.Node) -> ir.Value | None:
    """What a reader of the 5-D heads makes of them: a Slice's output, or the Expand of a Gather read only there."""
    if std(user, "Slice"):
        return user.outputs[0]
    uses = list(user.outputs[0].uses()) if std(user, "Gather") else []
    return uses[0][0].outputs[0] if len(uses) == 1 and std(uses[0][0], "Expand") else None


def _group_slice(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    """See the module docstring (``group-slice``)."""
    a = n.inputs[0]
    adims, odims = c.shapes.dims(a), c.shapes.dims(n.outputs[0])
    if not _known(adims, 5) or not _known(odims, 4) or adims is None or odims is None:
        return Miss("does not merge two axes of a 5-D tensor with known dims")
    sl, ex = _producer(a, "Slice"), _producer(a, "Expand")
    gather = _producer(ex.inputs[0], "Gather") if ex is not None else None
    src = sl.inputs[0] if sl is not None else (gather.inputs[0] if gather is not None else None)
    r5 = _producer(src, "Reshape")
    r5dims = c.shapes.dims(src) if r5 is not None else None
    if r5 is None or not _known(r5dims, 5) or r5dims is None or not all(d.is_literal for d in r5dims[2:]):  # type: ignore[union-attr]
        return Miss("does not read a Slice or a broadcast Gather of a [B, S, G, n+2, D] Reshape")
    groups, slots, head = (int(d.value) for d in r5dims[2:])  # type: ignore[union-attr,arg-type]
    part = _group_part(c, a, slots)
    if part is None or part[0] is not r5:
        return Miss("not the query Slice [0, n) nor the key/value Gather [n] / [n+1] of axis 3, broadcast")
    per = slots - 2
    if (list(adims[:3]) != list(r5dims[:3]) or adims[3] != Dim.lit(per) or adims[4] != r5dims[4]
            or list(odims[:2]) != list(r5dims[:2]) or odims[2] != Dim.lit(groups * per) or odims[3] != r5dims[4]):
        return Miss("the parts are not [B, S, G, n, D] merged into [B, S, G*n, D]")
    key = (id(src), ("group-slice", slots))
    hit = c.memo.get(key)
    if src is None or src.is_graph_output():
        return Miss("the grouped heads are a graph output")
    if hit is None or hit[0] is not src:
        found: list[int] = []
        for user, i in src.uses():
            if std(user, "Shape"):
                continue
            got = _group_part(c, _part_value(user), slots) if i == 0 else None
            found.append(-2 if got is None else (-1 if got[1] is None else got[1]))
        if sorted(found) != [-1, slots - 2, slots - 1]:
            return Miss("the grouped heads are not read by one query Slice and the key and value Gathers")
        c.memo[key] = (src, src)  # type: ignore[assignment]
    proj = _projection(r5.inputs[0])
    if isinstance(proj, Miss):
        return proj
    x, w, bias = proj
    ydims = c.shapes.dims(r5.inputs[0])
    if not _known(ydims, 3) or ydims is None or w.shape[1] != groups * slots * head:
        return Miss("the projection is not [B, S, G*(n+2)*D]")
    j_of = list(range(per)) if part[1] is None else [part[1]] * per
    cols = ((np.arange(groups)[:, None, None] * slots + np.array(j_of)[None, :, None]) * head
            + np.arange(head)[None, None, :]).reshape(-1)
    inits = [c.constant(np.ascontiguousarray(w[:, cols]), "mograph_group_slice_weight")]
    ylike = _like(r5.inputs[0], (ydims[0], ydims[1], Dim.lit(cols.size)))  # type: ignore[arg-type]
    made = [c.node("MatMul", [x, inits[0]], ylike)]
    out = made[-1].outputs[0]
    if bias is not None:
        inits.append(c.constant(np.ascontiguousarray(bias[cols]), "mograph_group_slice_bias"))
        made.append(c.node("Add", [out, inits[-1]], ylike))
        out = made[-1].outputs[0]
    inits.append(c.constant(np.array([0, 0, groups * per, head], dtype=np.int64), "mograph_group_slice_shape"))
    made.append(c.node("Reshape", [out, inits[-1]], _like(n.outputs[0], tuple(odims))))
    return Build(made[-1].outputs[0], made, inits)



def _heads_reshape(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    """See the module docstring (``heads-reshape``)."""
    x = n.inputs[0]
    tr = _producer(x, "Transpose")
    if tr is None or _perm(tr) != [0, 2, 1, 3] or x is None:
        return Miss("does not reshape heads a Transpose [0, 2, 1, 3] split")
    xd, od = c.shapes.dims(x), c.shapes.dims(n.outputs[0])
    if not _known(xd, 4) or not _known(od, 4) or list(xd) != list(od):  # type: ignore[arg-type]
        return Miss("the Reshape is not provably a no-op")
    return Build(x)


UNIT_AXES = CanonRule("unit-axes", ("Reshape",), _unit_axes)
SHAPE_UNIT_AXES = CanonRule("shape-unit-axes", ("Shape",), _shape_unit_axes)
SQUEEZE_RESHAPE = CanonRule("squeeze-reshape", ("Squeeze",), _squeeze_reshape)
GEMM_ROWS = CanonRule("gemm-rows", ("Reshape",), _gemm_rows, exact=False)
BIAS_SPLIT = CanonRule("bias-split", ("Add",), _bias_split)
BATCHED_MATMUL = CanonRule("batched-matmul", ("Reshape",), _batched_matmul)
MATMUL_TRANSPOSE = CanonRule("matmul-transpose", ("Transpose",), _matmul_transpose)
EINSUM_MATMUL = CanonRule("einsum-matmul", ("Einsum",), _einsum_matmul, exact=False)
HEAD_SLICE = CanonRule("head-slice", ("Slice",), _head_slice)
GROUP_SLICE = CanonRule("group-slice", ("Reshape",), _group_slice)
HEADS_RESHAPE = CanonRule("heads-reshape", ("Reshape",), _heads_reshape)

#: The layout rewrites, tried in this order (after the algebraic ones) where a pass names them.
LAYOUT_RULES: tuple[CanonRule, ...] = (UNIT_AXES, SHAPE_UNIT_AXES, SQUEEZE_RESHAPE, GEMM_ROWS, BATCHED_MATMUL, BIAS_SPLIT,
                                       MATMUL_TRANSPOSE, EINSUM_MATMUL, HEAD_SLICE,
                                       GROUP_SLICE, HEADS_RESHAPE)
