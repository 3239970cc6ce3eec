"""Dims known at rewrite time, for the rules that must prove two shapes equal (``expand-noop``,
``keepdims``, ``neutral``): read from a value's shape where inference gave one, else derived from its
producers, and the dims a 1-D shape tensor computed at run time provably holds.
"""

from __future__ import annotations

import onnx_ir as ir
from mograph.passes.fusion.canonicalize._base import STD, rank_of

from mograph.patterns import constant_array

__all__ = ["DimKey", "dims_of", "shape_keys", "shape_of_keys"]

#: A dim known at rewrite time: its size, ``("sym", name)`` for a named symbolic dim (one name, one
#: size, as ONNX's ``dim_param`` promises), or ``("at", id(value), axis)`` for an unnamed one.
DimKey = object


def dim_key(value: ir.Value, axis: int) -> DimKey:
    shape = value.shape
    if shape is not None and 0 <= axis < len(shape):
        d = shape[axis]
        if isinstance(d, int):
            return d
        if isinstance(d, ir.SymbolicDim) and d.value:
            return ("sym", d.value)
    return ("at", id(value), axis)


#: Ops whose output is their inputs broadcast together (for :func:`_derived_dims`).
_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Where", "Erf", "Tanh", "Sigmoid", "Sqrt",
                 "Reciprocal", "Neg", "Abs", "Relu", "Exp", "Log", "Cast", "Identity", "CastLike")


def _broadcast(a: list[DimKey], b: list[DimKey]) -> list[DimKey] | None:
    if len(a) < len(b):
        a, b = b, a
    out = list(a[: len(a) - len(b)])
    for x, y in zip(a[len(a) - len(b):], b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None  # two dims not provably equal (either could be 1 at run time)
    return out


def dims_of(value: ir.Value | None, cache: dict[int, list[DimKey] | None] | None = None,
             depth: int = 0) -> list[DimKey] | None:
    """``value``'s dims: from its shape where inference gave one, else derived from its producer.

    Shape inference stops at a ``Reshape`` to a shape computed at run time, so every value after the
    first jax2tf LayerNorm of a dynamic-batch model has no shape; the dims are then derived through
    broadcasting elementwise ops, ``MatMul`` by a constant matrix, ``Reshape``/``Expand`` to a shape
    :func:`shape_keys` can read, and reductions over the last axis.
    """
    if value is None:
        return None
    rank = rank_of(value)
    if rank is not None:
        return [dim_key(value, i) for i in range(rank)]
    arr = constant_array(value)
    if arr is not None:
        return [int(d) for d in arr.shape]
    if cache is None:
        cache = {}
    if id(value) in cache:
        return cache[id(value)]
    if depth > 64:  # too deep from this start (not cached: from another start it may be reachable)
        return None
    cache[id(value)] = None  # while deriving: a cycle reads unknown
    cache[id(value)] = _derived_dims(value, cache, depth)
    return cache[id(value)]


def _derived_dims(value: ir.Value, cache: dict[int, list[DimKey] | None], depth: int) -> list[DimKey] | None:
    p = value.producer()
    if p is None or p.domain not in STD or len(p.outputs) != 1:
        return None
    ins = [u for u in p.inputs if u is not None]
    if not ins:
        return None
    if p.op_type in _BROADCASTING:
        out = dims_of(ins[0], cache, depth + 1)
        for u in ins[1:]:
            other = dims_of(u, cache, depth + 1)
            if out is None or other is None:
                return None
            out = _broadcast(out, other)
        return out
    if p.op_type == "MatMul" and len(ins) == 2:
        a, w = dims_of(ins[0], cache, depth + 1), constant_array(ins[1])
        if a is None or w is None or w.ndim != 2 or len(a) < 2 or a[-1] != int(w.shape[0]):
            return None
        return a[:-1] + [int(w.shape[1])]
    if p.op_type in ("Reshape", "Expand") and len(ins) == 2:
        keys = shape_keys(ins[1])
        if keys is None:
            return None
        if p.op_type == "Expand":
            v = dims_of(ins[0], cache, depth + 1)
            return _broadcast(v, keys) if v is not None else None
        allowzero = p.attributes.get("allowzero")
        ok = all(not isinstance(k, int) or k >= 1 for k in keys) and not (allowzero is not None and int(allowzero.value))
        return keys if ok else None
    if p.op_type in ("ReduceSum", "ReduceMean"):
        x = dims_of(ins[0], cache, depth + 1)
        attr = p.attributes.get("axes")
        arr = constant_array(p.inputs[1]) if len(p.inputs) > 1 and p.inputs[1] is not None else None
        axes = [int(a) for a in attr.value] if attr is not None else (
            [int(a) for a in arr.reshape(-1)] if arr is not None else None)
        if x is None or axes not in ([-1], [len(x) - 1]):
            return None
        keep = p.attributes.get("keepdims")
        return x[:-1] + ([1] if keep is None or int(keep.value) else [])
    return None


def shape_keys(value: ir.Value | None, depth: int = 0) -> list[DimKey] | None:
    """The dims a 1-D shape tensor provably holds at run time, or None.

    Constants, ``Shape(t)`` (with ``start``/``end``), integer ``Cast``, ``Concat`` on axis 0 and
    ``Slice`` with constant bounds and step 1 of those: how exporters write ``x.shape[:-1] + [1]``
    when the batch dim is dynamic (jax2tf through tf2onnx: ``Cast(Concat(Slice(Cast(Shape(x))), 4, 1))``).
    """
    if value is None or depth > 8:
        return None
    arr = constant_array(value)
    if arr is not None:
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            return None
        return [int(d) for d in arr]
    p = value.producer()
    if p is None or p.domain not in STD:
        return None
    if p.op_type == "Shape" and p.inputs and p.inputs[0] is not None:
        t = p.inputs[0]
        rank = rank_of(t)
        if rank is None:
            return None
        start_attr, end_attr = p.attributes.get("start"), p.attributes.get("end")
        start = int(start_attr.value) if start_attr is not None else 0
        end = int(end_attr.value) if end_attr is not None else rank
        return [dim_key(t, i) for i in range(rank)][start:end]
    if p.op_type == "Cast":
        to = p.attributes.get("to")
        return shape_keys(p.inputs[0], depth + 1) if to is not None and int(to.value) in (7, 6) else None
    if p.op_type == "Concat":
        axis = p.attributes.get("axis")
        if axis is None or int(axis.value) not in (0, -1):
            return None
        out: list[DimKey] = []
        for u in p.inputs:
            part = shape_keys(u, depth + 1)
            if part is None:
                return None
            out += part
        return out
    if p.op_type == "Slice" and len(p.inputs) >= 3:
        data = shape_keys(p.inputs[0], depth + 1)
        bounds = [constant_array(u) if u is not None else None for u in p.inputs[1:5]]
        if data is None or bounds[0] is None or bounds[1] is None or bounds[0].size != 1 or bounds[1].size != 1:
            return None
        axes, steps = (bounds + [None, None])[2:4]
        if (axes is not None and [int(a) for a in axes.reshape(-1)] not in ([0], [-1])) or (
                steps is not None and [int(a) for a in steps.reshape(-1)] != [1]):
            return None
        start, end = int(bounds[0].reshape(())), int(bounds[1].reshape(()))
        return data[start:end]  # Python's slice clamps as ONNX's Slice does for step 1
    return None


def shape_of_keys(keys: list[DimKey]) -> ir.Shape:
    """An IR shape for ``keys``: sizes, named dims, and unnamed dims as None."""
    dims: list[int | str | None] = []
    for k in keys:
        if isinstance(k, int):
            dims.append(k)
        elif isinstance(k, tuple) and k[0] == "sym":
            dims.append(str(k[1]))
        else:
            dims.append(None)
    return ir.Shape(dims)
