"""Trace-back of ``make-dynamic``: from a static dim that has a dynamic size baked in, to where that size
was made.

When the forward walk (``_dyn_symbolic``) finds a static operand whose dim has the old size of a dynamic
one, :func:`trace_back` follows that operand back — through casts, unsqueezes, transposes, gathers,
matmuls, concats and elementwise ops — to the constant or op that made the size: a ``Slice`` end, an
``Expand`` / ``ConstantOfShape`` / ``Tile`` shape, a ``Range`` limit, or an ``arange`` / uniform / ramp
table.  It records an override (the dim's symbolic size) and the rewrite to plan; a trail that ends
anywhere else is a refusal (:class:`_Refuse`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.shape._dyn_base import (
    _BROADCAST,
    _UNARY,
    _Action,
    _attr,
    _const,
    _input,
    _NeedTag,
    _Refuse,
    _SourceAction,
)
from mograph.passes.shape._dyn_symbolic import _Analysis

from mograph.shapes import Dim

logger = logging.getLogger("mograph.passes.shape.make_dynamic")  # the pass's logger, as before the split


def trace_back(an: _Analysis, need: _NeedTag, overrides: dict, sources: list) -> None:
    """Find where the size ``need`` reports was made; add its override to ``overrides`` and its rewrite to
    ``sources`` (merged with a planned rewrite of the same input).  Raises :class:`_Refuse` when it cannot."""
    if any(isinstance(f, str) and f.startswith("_d") for f in need.dim):
        raise _Refuse(need.node, f"'{need.value.name}' axis {need.axis} has the size of the derived dim "
                          f"{need.dim} baked in")
    found = find_source(an, need.value, need.axis, need.dim, depth=0)
    if found is None:
        raise _Refuse(
            need.node,
            f"'{need.value.name}' axis {need.axis} has the export size {an.num(need.dim)} of the dynamic dim "
            f"{need.dim} baked in, and the pass cannot trace where that size comes from",
        )
    for value, axis, action in found:
        if axis in overrides.get(value, {}):
            raise _Refuse(need.node, f"internal: '{value.name}' axis {axis} traced twice")
        overrides.setdefault(value, {})[axis] = need.dim
        same = [a for a in sources if isinstance(a, _Action) and isinstance(action, _Action)
                and a.node is action.node and a.index == action.index]
        if same:  # a second dynamic axis of the same shape input: merge into the first rewrite
            same[0].pieces = [n if not isinstance(o, int) else n if not isinstance(n, int) else o
                              for o, n in zip(same[0].pieces, action.pieces)]
        else:
            sources.append(action)

def find_source(an: _Analysis, v: ir.Value, axis: int, dim: Dim, depth: int) -> list | None:
    """``(value, axis, rewrite)`` triples that make ``v``'s ``axis`` follow ``dim``, or ``None`` where the trail ends
    somewhere the pass does not model."""
    if depth > 32:
        return None
    n = an.num(dim)
    node = v.producer()
    arr = _const(v)
    if arr is None and node is not None and node.op_type == "GatherElements":
        data, idx = _const(node.inputs[0]), _const(node.inputs[1])
        if data is not None and idx is not None:  # a constant the folder left (its evaluator fails on it)
            arr = np.take_along_axis(data, idx.astype(np.int64) % data.shape[_attr(node, "axis", 0)],
                                     axis=_attr(node, "axis", 0))
            node = None
    if arr is not None and (node is None or node.op_type == "Constant"):
        if arr.dtype.kind in "iuf" and arr.ndim > axis and arr.shape[axis] == n and all(
            s == 1 for i, s in enumerate(arr.shape) if i != axis
        ):
            flat = arr.reshape(-1)
            step = flat[1] - flat[0] if flat.size > 1 else 1
            if flat.size > 1 and np.array_equal(flat, flat[0] + step * np.arange(flat.size, dtype=flat.dtype)) and step != 0:
                return [(v, axis, _SourceAction(v, axis, dim, arr))]
        if arr.ndim > axis and arr.shape[axis] == n:
            first = np.take(arr, [0], axis=axis)
            if np.array_equal(np.broadcast_to(first, arr.shape), arr):
                return [(v, axis, _SourceAction(v, axis, dim, arr, kind="uniform"))]
            if n > 1 and arr.dtype.kind in "iuf" and _is_ramp(arr, axis):
                return [(v, axis, _SourceAction(v, axis, dim, arr, kind="ramp"))]
        return None
    if node is None:
        return None
    op = node.op_type
    ins = node.inputs
    if op == "Slice" and v is node.outputs[0]:
        params = [_const(ins[i]) if len(ins) > i and ins[i] is not None else None for i in range(1, 5)]
        if params[0] is None or params[1] is None:
            return None
        rank = len(an.static(node, v))
        axes = [int(a) % rank for a in params[2].reshape(-1)] if params[2] is not None else list(range(params[0].size))
        if axis not in axes:
            return find_source(an, _input(node, 0), axis, dim, depth + 1)
        k = axes.index(axis)
        steps = params[3].reshape(-1) if params[3] is not None else np.ones(len(axes), np.int64)
        if int(params[0].reshape(-1)[k]) == 0 and int(steps[k]) == 1 and int(params[1].reshape(-1)[k]) == n:
            ends = params[1].reshape(-1).tolist()
            pieces: list[Any] = [int(e) for e in ends]
            pieces[k] = dim
            return [(v, axis, _Action("Slice", node, 2, pieces, dtype=_input(node, 2).dtype or ir.DataType.INT64))]
        return None
    if op in ("Expand", "ConstantOfShape", "Tile"):
        sidx = 1 if op != "ConstantOfShape" else 0
        shape = _const(ins[sidx])
        if shape is None:
            return None
        entries = [int(x) for x in shape.reshape(-1)]
        rank = len(an.static(node, v))
        j = len(entries) - rank + axis
        if j < 0:
            return None
        if op != "ConstantOfShape":
            ddims = an.static(node, _input(node, 0))
            dax = len(ddims) - rank + axis
            if dax >= 0 and ddims[dax] != 1:
                return None
        if entries[j] != n:
            return None
        pieces = list(entries)
        pieces[j] = dim
        return [(v, axis, _Action(op, node, sidx, pieces))]
    if op == "Range":
        start, limit, delta = (_const(ins[i]) if i < len(ins) else None for i in range(3))
        if start is None or limit is None or delta is None or start.item() != 0 or delta.item() != 1 \
                or limit.item() != n:
            return None
        return [(v, axis, _Action("Range", node, 1, [dim], scalar=True, dtype=_input(node, 1).dtype or ir.DataType.INT64))]
    if op in _UNARY and op not in ("Softmax", "LogSoftmax", "Hardmax", "CumSum"):
        return find_source(an, _input(node, 0), axis, dim, depth + 1)
    if op == "Transpose":
        rank = len(an.static(node, v))
        perm = _attr(node, "perm") or list(range(rank))[::-1]
        return find_source(an, _input(node, 0), perm[axis], dim, depth + 1)
    if op in ("Unsqueeze", "Squeeze"):
        out_rank = len(an.static(node, v))
        in_rank = len(an.static(node, _input(node, 0)))
        axes_v = _attr(node, "axes")
        if axes_v is None:
            a = _const(ins[1]) if len(ins) > 1 and ins[1] is not None else None
            if a is None:
                return None
            axes_v = a.reshape(-1).tolist()
        if op == "Unsqueeze":
            axes_n = sorted(int(x) % out_rank for x in axes_v)
            if axis in axes_n:
                return None
            src = [i for i in range(out_rank) if i not in axes_n].index(axis)
        else:
            axes_n = sorted(int(x) % in_rank for x in axes_v)
            src = [i for i in range(in_rank) if i not in axes_n][axis]
        return find_source(an, _input(node, 0), src, dim, depth + 1)
    if op == "Gather":
        rank_d = len(an.static(node, _input(node, 0)))
        g = _attr(node, "axis", 0) % rank_d
        rank_i = len(an.static(node, _input(node, 1)))
        if g <= axis < g + rank_i:
            return find_source(an, _input(node, 1), axis - g, dim, depth + 1)
        return None
    if op == "MatMul":
        rank = len(an.static(node, v))
        ra, rb = len(an.static(node, _input(node, 0))), len(an.static(node, _input(node, 1)))
        if ra < 2 or rb < 2:
            return None
        if axis == rank - 2:
            return find_source(an, _input(node, 0), ra - 2, dim, depth + 1)
        if axis == rank - 1:
            return find_source(an, _input(node, 1), rb - 1, dim, depth + 1)
        return None
    if op == "Concat":
        rank = len(an.static(node, v))
        if _attr(node, "axis", 0) % rank == axis:
            return None
        found_c: list = []
        for i in ins:
            if i is None or (i in an.tags and an.tags[i][axis].has_sym):
                continue
            sub = find_source(an, i, axis, dim, depth + 1)
            if sub is None:
                return None
            found_c.extend(sub)
        return found_c or None
    if op in _BROADCAST:
        rank = len(an.static(node, v))
        found: list = []
        for i in ins:
            if i is None:
                continue
            shape_i = an.static(node, i)
            ax = len(shape_i) - rank + axis
            if ax >= len(shape_i):
                logger.debug("make-dynamic: %s %s: rank of %s exceeds its output's", op, node.name, i.name)
                return None
            if ax < 0 or shape_i[ax] == 1:
                continue
            if i in an.tags and an.tags[i][ax].has_sym:
                continue
            sub = find_source(an, i, ax, dim, depth + 1)
            if sub is None:
                return None
            found.extend(sub)
        return found or None
    return None


def _ramp_parts(arr: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``first``, ``step`` (size 1 along ``axis``) and ``first + k * step`` for k along ``axis``."""
    first = np.take(arr, [0], axis=axis)
    step = np.take(arr, [1], axis=axis) - first
    shape = [1] * arr.ndim
    shape[axis] = arr.shape[axis]
    k = np.arange(arr.shape[axis]).reshape(shape).astype(arr.dtype)
    return first, step, first + k * step


def _is_ramp(arr: np.ndarray, axis: int) -> bool:
    """Every slice along ``axis`` is ``first + k * step`` (``arange`` times a vector, as rotary tables are)."""
    _, step, ramp = _ramp_parts(arr, axis)
    if arr.dtype.kind in "iu":
        return bool(np.array_equal(ramp, arr))
    scale = float(np.abs(arr).max()) or 1.0
    return bool(np.allclose(ramp, arr, rtol=1e-6, atol=1e-6 * scale))
