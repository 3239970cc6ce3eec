"""The shape query: what a pass asks about a graph's dims and shape vectors.

:class:`ShapeQuery` sweeps one graph once, in order, and records for every value

- its *dims*: a tuple with one :class:`~mograph.shapes.Dim` (normal form) per axis, where a named input
  dim is the atom ``=name`` (named dims of the same name are equal, as ONNX declares) and a dim no rule
  can tell is a fresh atom of that value alone (an ``unk__`` name is never taken to equal another
  value's);
- for a small int64 vector (a ``Shape`` result, a reshape target), its *values*: ``(is_scalar,
  elements)``, each element a ``Dim`` or ``None``;
- for each dim, a hashable *key* (:meth:`ShapeQuery.dim_key`), equal for dims it proves equal;
- the *witness* of each atom: the first value (graph inputs first) carrying it as a dim, so a pass can
  rebuild a dim as ``Shape(witness)[axis]``.

The dims come from the rule table (:mod:`mograph.shapes._rules`): the rule in force for each node's
``(domain, op_type, version)``; where there is none, or it cannot tell, the dims ONNX inference left on
the value are used.  Inference wins where it has a literal and the rule has a symbol.  Subgraphs and
functions are not entered.

Shape vectors are int64, as ``Reshape``, ``Expand`` and ``Shape`` have them.  Some exporters do the shape
arithmetic in int32 (jax2tf through tf2onnx: ``Cast<to=int64>(Concat(Slice(Cast<to=int32>(Shape(x))), ...))``),
which is exact only while every dim is below 2**31.  A query made with ``int32=True`` takes that on and tracks
int32 vectors too (int32 constants, ``Cast`` to int32, and everything the vector rules compute from them), so the
int64 vector cast back from them has elements, and a ``Reshape``/``Expand`` to it has dims; by default it does
not.
"""

from __future__ import annotations

import itertools
from typing import Union

import numpy as np
import onnx_ir as ir

from mograph.shapes._builtin import builtin_rules, peek_tensor, reshape_dims
from mograph.shapes._dim import Dim
from mograph.shapes._rules import ShapeRule, ShapeRules, node_version

__all__ = ["DimKey", "Dims", "ShapeQuery", "Vector", "as_ir_shape", "holds_dims", "static_dim", "vector_ints"]

#: The dims of one value: one per axis, ``None`` where unknown.
Dims = tuple[Union[Dim, None], ...]
#: The elements of a small int64 vector: ``(is_scalar, elements)``.
Vector = tuple[bool, tuple[Union[Dim, None], ...]]
#: A key of one dim (:meth:`ShapeQuery.dim_key`): ``("dim", normal form)``, ``("unk", name)`` or ``("at", value, axis)``.
DimKey = tuple[object, ...]

_STD = ("", "ai.onnx")
#: Errors a rule may raise on a malformed node; the query then treats the rule as not telling.
_RULE_ERRORS = (IndexError, ValueError, TypeError, ZeroDivisionError)


#: The dims :meth:`ShapeQuery._declared` reads off every value's shape, made once: a literal, and a named dim's atom
#: (``=name``).  A ``Dim`` is an immutable tuple, so one object serves every value that has that dim; at most
#: ``_KEPT_DIMS`` of each are kept (a long-lived process sees many models).
_LITERAL_DIMS: dict[int, Dim] = {}
_NAMED_DIMS: dict[str, Dim] = {}
_KEPT_DIMS = 4096


def _as_dim(d: Dim | int | tuple) -> Dim:
    """A rule's dim as the query keeps it: a registered rule may give an int or a plain factor tuple."""
    if isinstance(d, Dim):
        return d
    return Dim.lit(d) if isinstance(d, int) else Dim(d).normal()


def as_ir_shape(dims: Dims) -> ir.Shape:
    """``dims`` written back as an IR shape, the inverse of how the query reads one: a literal as its number, a
    named input dim (the atom ``=name``) as its name, anything else (a product, an unknown) as an unnamed dim."""
    out: list[int | str | None] = []
    for d in dims:
        name = d.symbol if d is not None else None
        if d is not None and d.is_literal:
            out.append(d.value)
        elif name is not None and name.startswith("="):
            out.append(name[1:])
        else:
            out.append(None)
    return ir.Shape(out)


def static_dim(dims: Dims | None, axis: int) -> int | None:
    """Dim ``axis`` of ``dims`` (negative counts from the end) as a number, where it is a literal; else ``None``."""
    if dims is None or not -len(dims) <= axis < len(dims):
        return None
    d = dims[axis]
    return None if d is None else d.value


def vector_ints(vec: Vector | None) -> list[int | None] | None:
    """The elements of a tracked shape vector as numbers (``None`` for an element that is not a literal);
    ``None`` if ``vec`` is ``None``."""
    return None if vec is None else [None if e is None else e.value for e in vec[1]]


def holds_dims(vec: Vector | None, dims: Dims | None) -> bool:
    """Whether the 1-D vector ``vec`` holds exactly ``dims``, element by element, for every input (what
    ``Shape(x)`` holds for ``x`` of those dims: a ``Reshape`` to it gives its data ``x``'s shape)."""
    return (vec is not None and not vec[0] and dims is not None and len(vec[1]) == len(dims)
            and all(e is not None and e == d for e, d in zip(vec[1], dims)))


class ShapeReads:
    """The reads built on :meth:`dims` and :meth:`values`, one definition for the query and its wrappers (the
    lowering context and the fusion's graph shapes refresh the query before they read, then read the same way)."""

    def dims(self, value: ir.Value | None) -> Dims | None:
        raise NotImplementedError

    def values(self, value: ir.Value | None) -> Vector | None:
        raise NotImplementedError

    def static_dim(self, value: ir.Value | None, axis: int) -> int | None:
        """Dim ``axis`` of ``value`` as a number, where the query proves it a literal; ``None`` otherwise."""
        return static_dim(self.dims(value), axis)

    def literals(self, value: ir.Value | None) -> list[int | None] | None:
        """The elements of a tracked shape vector as numbers, ``None`` for each one that is not a literal (a
        ``Concat`` of ``Shape`` entries and constants: the constants); ``None`` if the query does not track it."""
        return vector_ints(self.values(value))

    def is_shape_of(self, vector: ir.Value | None, value: ir.Value | None) -> bool:
        """Whether the shape vector ``vector`` holds ``value``'s dims for every input, however it is spelled
        (``Shape(value)``, a ``Concat`` of its entries, a constant where they are static)."""
        return holds_dims(self.values(vector), self.dims(value))


class ShapeQuery(ShapeReads):
    """Symbolic dims of every value of ``graph`` and elements of its small int64 vectors, in one sweep.

    ``rules``: the table to consult (by default :func:`~mograph.shapes.builtin_rules`); a caller that
    holds the plugin registry passes the built-in table merged with the registered custom-op rules.
    ``int32``: also track int32 shape vectors (the module docstring says when that is exact).
    """

    #: Longest int64 vector whose elements are tracked.
    max_vector = 64

    def __init__(self, graph: ir.Graph, rules: ShapeRules | None = None, *, int32: bool = False) -> None:
        self.graph = graph
        self.rules = rules if rules is not None else builtin_rules()
        #: whether int32 shape vectors are tracked (and ``Cast`` to int32 has a vector rule)
        self.int32 = int32
        self._opsets = dict(graph.opset_imports)
        self._rule_of: dict[tuple[str, str, int | None], ShapeRule | None] = {}  # (domain, op_type, version) -> rule or None
        self._dims: dict[ir.Value, Dims | None] = {}
        self._vec: dict[ir.Value, Vector] = {}
        #: atom -> (value, axis): the first value carrying it (graph inputs first)
        self.witness: dict[str, tuple[ir.Value, int]] = {}
        #: tracked vectors that hold booleans (``Equal``), not int64
        self.bools: set[ir.Value] = set()
        #: graph position of each node output (graph inputs and initializers: absent), for witness order
        self.position: dict[ir.Value, int] = {}
        self._fresh = itertools.count()
        for value in graph.inputs:
            self._set_dims(value, self._declared(value))
        for value in graph.initializers.values():
            self._set_dims(value, None)
            self._constant(value)
        for index, node in enumerate(graph):
            for value in node.outputs:
                self.position[value] = index
            self._visit(node)

    def copy(self, rules: ShapeRules | None = None) -> ShapeQuery:
        """A query with what this one knows now, as a sweep of the same graph in the same state would make it
        (the next fresh atom included); later visits to either do not show in the other.  ``rules``: the table
        the copy consults from now on (by default this one's)."""
        out = object.__new__(type(self))
        out.graph, out.rules, out.int32 = self.graph, self.rules if rules is None else rules, self.int32
        out._opsets, out._rule_of = dict(self._opsets), dict(self._rule_of)
        out._dims, out._vec, out.witness = dict(self._dims), dict(self._vec), dict(self.witness)
        out.bools, out.position = set(self.bools), dict(self.position)
        following = next(self._fresh)
        self._fresh, out._fresh = itertools.count(following), itertools.count(following)
        return out

    # --- what passes ask -----------------------------------------------------------------------
    def dims(self, value: ir.Value | None) -> Dims | None:
        """The symbolic dims of ``value``; ``None`` if its rank is unknown."""
        return None if value is None else self._dims.get(value)

    def refresh(self) -> None:
        """Visit the nodes written into the graph since the sweep (in graph order), keeping what is known: for a
        caller that rewrites the graph as it goes (the ``lower`` step) without changing the values already swept."""
        for value in self.graph.inputs:
            if value not in self._dims:
                self._set_dims(value, self._declared(value))
        for value in self.graph.initializers.values():
            if value not in self._dims:
                self._set_dims(value, None)
                self._constant(value)
        for index, node in enumerate(self.graph):
            if all(out in self._dims for out in node.outputs):
                continue
            for value in node.outputs:
                self.position[value] = index
            self._visit(node)

    def knows(self, value: ir.Value) -> bool:
        """Whether the sweep met ``value`` (a graph input, initializer or node output of the graph then)."""
        return value in self._dims

    def values(self, value: ir.Value | None) -> Vector | None:
        """``(is_scalar, elements)`` of a tracked int64 shape vector (or int32, with ``int32=True``); ``None`` if it
        is not one."""
        return None if value is None else self._vec.get(value)

    def dim(self, value: ir.Value | None, axis: int) -> Dim | None:
        """Dim ``axis`` of ``value`` (negative counts from the end); ``None`` where unknown."""
        dims = self.dims(value)
        if dims is None or not -len(dims) <= axis < len(dims):
            return None
        return dims[axis]

    def same_dim(self, a: ir.Value | None, axis_a: int, b: ir.Value | None, axis_b: int) -> bool:
        """Whether dim ``axis_a`` of ``a`` and dim ``axis_b`` of ``b`` are equal for every input the model accepts."""
        da, db = self.dim(a, axis_a), self.dim(b, axis_b)
        return da is not None and da == db

    def dim_key(self, value: ir.Value, axis: int, *, spelled: bool = False) -> DimKey:
        """A hashable key of dim ``axis`` of ``value``, equal for two dims known to be equal: for a pass that builds
        something once per size (a bias expanded to a query length) and shares it where that size recurs.

        By default the query's proof: ``("dim", d)``, ``d`` the dim in normal form, so dims the rules derive equal
        share a key; ``("at", value, axis)``, a key of that dim alone, where the rank is unknown.  With ``spelled``
        only the shape written on ``value`` counts: a literal and a named dim key as themselves, an ``unk__`` name
        by its name (ONNX inference names each dim it cannot tell once per graph and copies that name to the
        values carrying it; the rules never take it as equal to another value's), an unnamed dim or an unknown
        rank as ``("at", value, axis)``.
        """
        if spelled:
            shape = value.shape
            if shape is None or not -len(shape) <= axis < len(shape):
                return ("at", value, axis)
            axis %= len(shape)
            spelt = shape[axis]
            if isinstance(spelt, int):
                return ("dim", Dim.lit(spelt))
            name = spelt.value
            if name is None:
                return ("at", value, axis)
            return ("unk", name) if name.startswith("unk__") else ("dim", Dim.sym(f"={name}"))
        dims = self.dims(value)
        if dims is None or not -len(dims) <= axis < len(dims):
            return ("at", value, axis)
        axis %= len(dims)
        d = dims[axis]
        return ("at", value, axis) if d is None else ("dim", d.normal())


    def ints(self, value: ir.Value | None) -> list[int] | None:
        """The values of a constant int32/int64 scalar or 1-D tensor of at most :attr:`max_vector` elements."""
        tensor = None if value is None else peek_tensor(value)
        if tensor is None:
            return None
        if tensor.dtype not in (ir.DataType.INT64, ir.DataType.INT32) or tensor.size > self.max_vector:
            return None
        arr = np.asarray(tensor.numpy())
        if arr.ndim > 1:
            return None
        return [int(x) for x in arr.reshape(-1)]

    def reshape_dims(self, data: Dims | None, target: tuple[Dim | None, ...], allowzero: bool) -> Dims | None:
        """The dims ``Reshape`` gives ``data`` for a target with elements ``target``."""
        return reshape_dims(data, target, allowzero)

    def declared(self, value: ir.Value) -> Dims | None:
        """The dims ONNX inference left on ``value`` (a value the sweep did not meet), read the query's way:
        named dims as their atoms, other unknowns as fresh atoms."""
        return self._declared(value)

    # --- the sweep -------------------------------------------------------------------------------
    def _declared(self, value: ir.Value) -> Dims | None:
        shape = value.shape
        if shape is None:
            if value.const_value is not None:
                return tuple(Dim.lit(int(d)) for d in value.const_value.shape.numpy())
            return None
        out: list[Dim | None] = []
        for axis, d in enumerate(shape):
            if isinstance(d, int):
                dim = _LITERAL_DIMS.get(d)
                if dim is None:
                    dim = Dim.lit(d)
                    if len(_LITERAL_DIMS) < _KEPT_DIMS:
                        _LITERAL_DIMS[d] = dim
                out.append(dim)
                continue
            name = d.value
            if name is not None and not name.startswith("unk__"):
                dim = _NAMED_DIMS.get(name)
                if dim is None:
                    dim = Dim.sym(f"={name}")
                    if len(_NAMED_DIMS) < _KEPT_DIMS:
                        _NAMED_DIMS[name] = dim
                out.append(dim)
            else:
                out.append(Dim.sym(f"?{next(self._fresh)}:{value.name}:{axis}"))
        return tuple(out)

    def _set_dims(self, value: ir.Value, dims: Dims | None) -> None:
        declared = self._declared(value)
        if dims is None:
            dims = declared
        elif declared is not None and len(declared) == len(dims):
            # A literal from inference beats a symbol; an unknown is filled from inference.
            dims = tuple(d if (dec is None or (d is not None and dec.has_sym)) else dec
                         for d, dec in zip(dims, declared))
        if dims is not None:
            # One loop (this runs for every value of every sweep): an unknown dim becomes a fresh atom, in axis
            # order; a dim that is exactly one symbol names its first witness.
            fresh, witness, out = self._fresh, self.witness, []
            for axis, d in enumerate(dims):
                if d is None:
                    d = Dim.sym(f"?{next(fresh)}:{value.name}")
                elif type(d) is not Dim:
                    d = _as_dim(d)
                out.append(d)
                if len(d) == 1:
                    name = d[0]
                    if isinstance(name, str) and name not in witness:
                        witness[name] = (value, axis)
            dims = tuple(out)
        self._dims[value] = dims

    def _constant(self, value: ir.Value) -> None:
        tensor = peek_tensor(value)
        if tensor is not None and self._dims.get(value) is None:
            self._dims[value] = tuple(Dim.lit(int(d)) for d in tensor.shape.numpy())
        ints = self.ints(value)
        if ints is not None and tensor is not None and (
                tensor.dtype == ir.DataType.INT64 or (self.int32 and tensor.dtype == ir.DataType.INT32)):
            self._vec[value] = (tensor.shape.rank() == 0, tuple(Dim.lit(i) for i in ints))

    def _visit(self, node: ir.Node) -> None:
        outs = list(node.outputs)
        key = (node.domain, node.op_type, node.version)
        if key in self._rule_of:  # looked up once per op: the table and the graph's opsets do not change under a query
            rule = self._rule_of[key]
        else:
            rule = self._rule_of[key] = self.rules.lookup(node.domain, node.op_type, node_version(node, self._opsets))
        result = None
        if rule is not None and rule.dims is not None:
            try:
                result = rule.dims(node, self)
            except _RULE_ERRORS:
                result = None
        results: list[Dims | None] = list(result) if result is not None else []
        results += [None] * (len(outs) - len(results))
        for value, dims in zip(outs, results):
            self._set_dims(value, dims)
        if node.domain in _STD and node.op_type == "Constant" and outs:
            self._constant(outs[0])
        elif outs and rule is not None and rule.values is not None:
            try:
                vec = rule.values(node, self)
            except _RULE_ERRORS:
                vec = None
            if vec is not None and len(vec[1]) <= self.max_vector:
                self._vec[outs[0]] = vec
                if node.op_type == "Equal" or (node.op_type in ("Where", "Identity") and node.inputs[-1] in self.bools):
                    self.bools.add(outs[0])
