"""Sizes as numbers, and the constant entries of shape vectors.

The shape facility reasons symbolically (:class:`~mograph.shapes.ShapeQuery`); this module reads its
answers as numbers, for passes that need them (how many channels a weight has, how many entries a
reshape target holds), and says where each constant entry of a shape vector is stored, so it can be edited:

- :class:`Sizes`: the dims of every value as ints or names, read from a :class:`~mograph.shapes.ShapeQuery`;
- :func:`const_tensor` / :func:`int_vector`: constant tensors, seen through ``Constant`` and ``Identity``;
- :func:`shape_literals`: a reshape target entry by entry, with the constant that holds each entry.
"""

from __future__ import annotations

from typing import Union

import onnx_ir as ir

from mograph.shapes._dim import Dim
from mograph.shapes._query import ShapeQuery

__all__ = ["DimSize", "ShapeLiteral", "Sizes", "const_tensor", "int_vector", "owns_tensor", "shape_literals"]

#: A concrete dim: a number, a ``dim_param`` name, or ``None`` (unknown).
DimSize = Union[int, str, None]


def const_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """The tensor of an initializer, of a ``Constant`` node's ``value`` attribute, or of an ``Identity``
    of either (exporters deduplicate equal weights and hand the copies out through Identity nodes)."""
    if value.const_value is not None and (value.is_initializer() or value.producer() is None):
        return value.const_value
    node = value.producer()
    if node is not None and node.domain in ("", "ai.onnx"):
        if node.op_type == "Constant":
            attr = node.attributes.get("value")
            if attr is not None and isinstance(attr.value, ir.TensorProtocol):
                return attr.value
        if node.op_type == "Identity" and node.inputs and node.inputs[0] is not None:
            return const_tensor(node.inputs[0])
    return None


def owns_tensor(value: ir.Value) -> bool:
    """Whether the constant's tensor is stored on ``value`` itself (not behind an Identity)."""
    node = value.producer()
    return node is None or node.op_type == "Constant"


class Sizes:
    """Concrete sizes of one graph's values, read from a :class:`~mograph.shapes.ShapeQuery`.

    A pass that edits weights and shape constants (pruning) needs each dim as a number where it is one: a
    dim is an ``int`` (a literal of the query), a ``str`` (a symbolic dim: the name of a named input dim,
    else the query's product of atoms, ``"*"``-joined), or ``None`` (unknown).  The query's dims are used as
    they are (its rules, and what ONNX inference left on the values where no rule tells); the model is
    neither serialized nor mutated.  A constant's dims are its tensor's (through ``Identity``).  The pass
    may record sizes it derives (:meth:`refine`) or changes (:meth:`set_size`); they are kept here, per value.
    """

    def __init__(self, query: ShapeQuery) -> None:
        self.query = query
        self._known: dict[ir.Value, list[DimSize]] = {}

    def dims(self, value: ir.Value | None) -> list[DimSize] | None:
        if value is None:
            return None
        tensor = const_tensor(value)
        if tensor is not None:
            return [int(d) for d in tensor.shape.numpy()]
        known = self._known.get(value)
        if known is not None:
            return list(known)
        dims = self.query.dims(value) if self.query.knows(value) else self.query.declared(value)
        return None if dims is None else [_size(d) for d in dims]

    def rank(self, value: ir.Value | None) -> int | None:
        dims = self.dims(value)
        return None if dims is None else len(dims)

    def size(self, value: ir.Value, axis: int) -> DimSize:
        dims = self.dims(value)
        return None if dims is None or not 0 <= axis < len(dims) else dims[axis]

    def refine(self, value: ir.Value, dims: list[DimSize]) -> None:
        """Fill unknown sizes of ``value`` with sizes derived by a rule (a Reshape's ``-1``)."""
        known = self.dims(value)
        if known is None or len(known) != len(dims):
            self._known[value] = list(dims)
            return
        self._known[value] = [k if isinstance(k, int) else d for k, d in zip(known, dims)]

    def set_size(self, value: ir.Value, axis: int, size: int) -> None:
        """Record a pruned size (used after pruning to recount multiply-accumulates)."""
        dims = self.dims(value)
        if dims is not None and 0 <= axis < len(dims):
            dims[axis] = size
            self._known[value] = dims


def _size(d: Dim | None) -> DimSize:
    """A query dim as a size: its number, or a name (``=name`` atoms are named input dims)."""
    if d is None:
        return None
    if d.is_literal:
        return d.value
    name = d.symbol
    if name is not None and name.startswith("="):
        return name[1:]
    return "*".join(str(f) for f in d)


def int_vector(value: ir.Value | None) -> list[int] | None:
    """The values of a constant 1-D (or scalar) integer tensor."""
    if value is None:
        return None
    tensor = const_tensor(value)
    if tensor is None:
        return None
    arr = tensor.numpy()
    if arr.dtype.kind not in "iu" or arr.ndim > 1:
        return None
    return [int(x) for x in arr.reshape(-1)]


#: A literal of a shape vector: its value (None when computed at run time) and where it is stored.
ShapeLiteral = tuple[Union[int, None], Union[ir.Value, None], int, Union[ir.Node, None], int]


def shape_literals(value: ir.Value, shapes: Sizes) -> list[ShapeLiteral] | None:
    """A 1-D int64 shape vector element by element: ``(value, holder, index, reader, reader_input)``.

    Handles a constant and a ``Concat`` (axis 0) of constants and run-time parts (``Unsqueeze`` of a
    ``Gather`` of ``Shape`` ...), as exporters write dynamic Reshape targets.
    """
    ints = int_vector(value)
    if ints is not None:
        return [(x, value, i, None, -1) for i, x in enumerate(ints)]
    node = value.producer()
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx"):
        return None
    out: list[ShapeLiteral] = []
    for idx, part in enumerate(node.inputs):
        if part is None:
            return None
        part_ints = int_vector(part)
        if part_ints is not None:
            out.extend((x, part, i, node, idx) for i, x in enumerate(part_ints))
            continue
        dims = shapes.dims(part)
        if dims is None or len(dims) != 1 or not isinstance(dims[0], int):
            return None
        out.extend((None, None, 0, None, -1) for _ in range(dims[0]))
    return out
