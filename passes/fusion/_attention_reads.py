"""The graph readers of ``fuse-attention`` (:mod:`.attention`): typed producers, scalar factors and reshape targets.

A reshape target is read entry by entry by the shape query (:func:`_entries`, ``GraphShapes.values``): a number,
the symbolic dim it holds (a runtime ``Shape`` read), or None where only its place is known; an entry is compared
with a tensor's dim by the query's dims (:func:`_is_dim`), and where the query cannot tell, an entry read from dim
``i`` of a run-time shape at place ``i`` is taken to keep that dim (:func:`_reads_own_axis`).
:func:`_heads_and_dim` proves a ``[B, S, H*D] -> [B, S, H, D]`` split from them, and :func:`_keeps_leading` a kept
``B, S``; where the targets do not tell, they ask the shape query (:class:`~mograph.passes.fusion._common.GraphShapes`).
Read-only: nothing here changes the graph.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from mograph.patterns import constant_array, scalar_value
from mograph.shapes import Dim

if TYPE_CHECKING:
    from mograph.passes.fusion._common import GraphShapes


def _producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in op_types:
        return None
    return node


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return None if attr is None else [int(p) for p in attr.value]


#: the float arithmetic :func:`_shape_scalar` evaluates (one element each)
_ARITH = {"Sqrt": math.sqrt, "Reciprocal": lambda x: 1.0 / x, "Neg": lambda x: -x}
_BINARY = {"Mul": lambda a, b: a * b, "Div": lambda a, b: a / b, "Add": lambda a, b: a + b, "Sub": lambda a, b: a - b,
           "Pow": lambda a, b: a ** b}


def _shape_scalar(value: ir.Value | None, shapes: GraphShapes | None, depth: int = 0) -> float | None:
    """The one number a single-element ``value`` holds for every input, where it is a constant, or arithmetic
    (``Cast``, ``Sqrt``, ``Reciprocal``, ``Neg``, ``Mul``, ``Div``, ``Add``, ``Sub``, ``Pow``) over constants and
    dims the shape query proves literal (``Cast(Slice(Shape(q), -1))``: the head size an sdpa export reads from the
    query's shape, as optimum's StableLM export scales by ``sqrt(1 / sqrt(D))`` on each side); else None.  A
    division by zero or a root of a negative is None (the export's own value is then no number to fold)."""
    c = scalar_value(value) if value is not None else None
    if c is not None or value is None or shapes is None or depth > 8:
        return None if c is None else float(c)
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if value.dtype is not None and value.dtype.is_integer():
        vec = shapes.values(value)
        if vec is None or len(vec[1]) != 1 or vec[1][0] is None or not vec[1][0].is_literal:
            return None
        return float(vec[1][0].value)  # type: ignore[arg-type]
    args = [_shape_scalar(v, shapes, depth + 1) for v in node.inputs]
    if any(a is None for a in args):
        return None
    try:
        if node.op_type == "Cast" and len(args) == 1:
            return args[0]
        if node.op_type in _ARITH and len(args) == 1:
            return float(_ARITH[node.op_type](args[0]))
        if node.op_type in _BINARY and len(args) == 2:
            return float(_BINARY[node.op_type](args[0], args[1]))
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def _scaled(value: ir.Value, shapes: GraphShapes | None = None) -> tuple[ir.Value, float]:
    """``value`` as ``base * factor`` through ``Mul``/``Div`` by single-element constants (with ``shapes``: or by
    numbers computed from literal dims, :func:`_shape_scalar`)."""
    factor = 1.0
    for _ in range(4):
        node = _producer(value, "Mul", "Div")
        if node is None or node.inputs[0] is None or node.inputs[1] is None:
            break
        a, b = node.inputs[0], node.inputs[1]
        cb, ca = _one(b, shapes), _one(a, shapes) if node.op_type == "Mul" else None
        if cb is not None and (node.op_type == "Mul" or cb != 0):
            factor *= cb if node.op_type == "Mul" else 1.0 / cb
            value = a
        elif ca is not None:
            factor *= ca
            value = b
        else:
            break
    return value, factor


def _one(value: ir.Value, shapes: GraphShapes | None) -> float | None:
    """A single-element factor's number: a constant, or (``shapes`` given) one computed from literal dims."""
    c = scalar_value(value)
    if c is not None or shapes is None:
        return c
    return _shape_scalar(value, shapes)  # (its leaves are single elements: so is it)


def _what(value: ir.Value | None) -> str:
    node = value.producer() if value is not None else None
    return "a graph input" if node is None else f"{node.op_type} '{node.name}'"


# ---------------------------------------------------------------------------------------------
# reshape targets
# ---------------------------------------------------------------------------------------------

#: An entry of a reshape target: an int where the shape query knows it as a number (``0`` and ``-1`` included), the
#: query's :class:`~mograph.shapes.Dim` where it is symbolic (a runtime dim), or None where only its place is known.
Entry = Any


def _entries(value: ir.Value | None, shapes: GraphShapes) -> list[Entry] | None:
    """The entries of a reshape target as the shape query reads them (:meth:`GraphShapes.values`: constants, ``Shape``
    through ``Gather``/``Slice``/``Unsqueeze``/``Concat``/``Cast``, ``Where(r == -1, 1, r)``, ...); None if the query
    does not track it (not even its length is known)."""
    vec = shapes.values(value)
    if vec is None or vec[0]:
        return None
    return [None if e is None else (e.value if e.is_literal else e) for e in vec[1]]


def _is_dim(entry: Entry, dim: Dim | None) -> bool:
    """Whether a target entry is ``dim`` for every input (the number of a literal dim, or the same symbolic dim)."""
    if dim is None or entry is None:
        return False
    return entry == dim.value if dim.is_literal else entry == dim


def _shape_axes(value: ir.Value | None, n: int, shapes: GraphShapes) -> list[int] | None:
    """The axes ``[i, .., i+n-1]`` when the ``n``-element ``value`` is read at run time from a ``Shape``:
    ``Gather(Shape(t), i)`` / ``Gather(Shape(t), [i, ..])``, or ``Shape(t, start=i, end=i+n)`` (``start`` and
    ``end`` may be left out, as ``simplify-shapes`` writes them: ``Shape(t, end=2)`` is axes 0 and 1), through
    ``Unsqueeze``/``Cast``/``Reshape``/``Squeeze``.  How the target was built, not what it holds (that is the
    query's)."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type in ("Unsqueeze", "Cast", "Reshape", "Squeeze") and node.domain == "":
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape":
        start_attr, end_attr = node.attributes.get("start"), node.attributes.get("end")
        start = 0 if start_attr is None else int(start_attr.value)
        if end_attr is None:  # to the end: the rank must be known
            dims = shapes.dims(node.inputs[0])
            if dims is None:
                return None
            end = len(dims)
        else:
            end = int(end_attr.value)
        if start < 0 or end < 0 or end - start != n:
            return None
        return list(range(start, end))
    if node.op_type == "Gather" and node.inputs[0] is not None:
        shape_node = node.inputs[0].producer()
        idx = constant_array(node.inputs[1])
        if shape_node is None or shape_node.op_type != "Shape" or idx is None or idx.size != n:
            return None
        offset = shape_node.attributes.get("start")
        if shape_node.attributes.get("end") is not None or (idx < 0).any():
            return None
        base = int(offset.value) if offset is not None else 0
        return [int(i) + base for i in idx.reshape(-1)]
    return None


def _read_axes(value: ir.Value | None, shapes: GraphShapes) -> list[int | None] | None:
    """For each entry of a reshape target, the axis of the run-time ``Shape`` it is read from (:func:`_shape_axes`),
    else None; the pieces of a ``Concat`` are sized by the shape query.  ``Where(r == -1, 1, r)`` (equal to ``r``
    for the query) and ``Reshape(r, [-1])`` are read through."""
    node = value.producer() if value is not None else None
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Where" and len(node.inputs) == 3 and shapes.values(value) == shapes.values(node.inputs[2]):
        return _read_axes(node.inputs[2], shapes)
    if node.op_type == "Reshape":
        return _read_axes(node.inputs[0], shapes)
    if node.op_type != "Concat":
        return None
    out: list[int | None] = []
    for piece in node.inputs:
        vec = shapes.values(piece)
        if vec is None:
            return None
        n = len(vec[1])
        axes = _shape_axes(piece, n, shapes) if n else None
        out.extend([None] * n if axes is None else axes)
    return out


def _reads_own_axis(target: ir.Value | None, i: int, shapes: GraphShapes) -> bool:
    """Whether entry ``i`` of a reshape target is read at run time from axis ``i`` of a ``Shape``.

    The exporters write ``Reshape(x, [Shape(ids)[0], Shape(ids)[1], -1])`` where the query cannot tell that ``x``'s
    leading dims are the ids' (they come through a broadcast with the mask, or through ops it has no exact rule
    for); a target that reads dim ``i`` at place ``i`` is taken to keep it, as the ``fuse-attention`` readers
    always have."""
    axes = _read_axes(target, shapes)
    return axes is not None and i < len(axes) and axes[i] == i


def _keeps_leading(reshape: ir.Node, shapes: GraphShapes, rest_is_last: bool = False) -> bool:
    """Whether a Reshape keeps dims 0 and 1 of its input (the shape query says so, or its target starts with ``B, S``).

    ``rest_is_last``: the caller proved that the target's entries after the first two multiply to the
    input's last dim (a ``[B, S, N]`` -> ``[B, ?, H, D]`` split with ``H * D = N``), so a -1 in place of
    ``S`` can only be ``S``."""
    x, target = reshape.inputs[0], reshape.inputs[1]
    out = reshape.outputs[0]
    dx = shapes.dims(x)
    if x is None or dx is None or len(dx) < 2:
        return False
    if all(shapes.same_dim(out, i, x, i) for i in (0, 1)):
        return True
    entries = _entries(target, shapes)
    if entries is None or len(entries) < 2:
        return False
    allowzero = reshape.attributes.get("allowzero")
    zero_copies = allowzero is None or int(allowzero.value) == 0
    for i in (0, 1):
        e = entries[i]
        if (e == 0 and zero_copies) or _is_dim(e, dx[i]) or _reads_own_axis(target, i, shapes):
            continue
        if i == 1 and e == -1 and rest_is_last and len(dx) == 3 and -1 not in entries[2:]:
            continue
        return False
    return True


def _heads_and_dim(reshape: ir.Node, hidden: int, shapes: GraphShapes) -> tuple[int, int] | str:
    """``(H, D)`` of a ``[B, S, H*D] -> [B, S, H, D]`` Reshape (from its target, else the shape query's dims of its
    output), or why they cannot be determined."""
    entries = _entries(reshape.inputs[1], shapes)
    out = reshape.outputs[0]
    h: Any = None
    d: Any = None
    if entries is not None and len(entries) == 4:
        h, d = entries[2], entries[3]
    elif entries is not None:
        return f"reshape '{reshape.name}' is not to 4 dims"
    dims = shapes.dims(out) if not (isinstance(h, int) and isinstance(d, int)) else None
    if dims is not None and len(dims) == 4:
        h, d = (m.value if m is not None else None for m in dims[2:])
    if not (isinstance(h, int) and isinstance(d, int)):
        return f"num_heads cannot be determined: reshape target of '{reshape.name}' is not constant"
    if h == -1 and d > 0 and hidden % d == 0:
        h = hidden // d
    elif d == -1 and h > 0 and hidden % h == 0:
        d = hidden // h
    if h <= 0 or d <= 0 or h * d != hidden:
        return f"reshape '{reshape.name}' splits {hidden} into {h} x {d}"
    if not _keeps_leading(reshape, shapes, rest_is_last=entries is not None and len(entries) == 4 and -1 not in entries[2:]):
        return f"reshape '{reshape.name}' does not keep the batch and sequence dims"
    return h, d
