"""Shape simplification: compute each dynamic shape once, from the graph inputs, with as few nodes as possible.

Exported transformers carry a ``Shape → Gather → Unsqueeze → Concat`` chain in front of nearly every
``Reshape``, ``Expand`` and ``Range``, one per layer, each reading the shape of a different activation
(``Shape(h_3)[0]`` is the batch size as much as ``Shape(input_ids)[0]`` is).  ONNX Runtime runs all of
them on the CPU, one kernel call each, so at small batch sizes latency follows the node count.  ONNX's
own shape inference cannot tell that these dims are the same once a dim flows through a fused
``com.microsoft`` op or an ``Expand`` to a computed shape, so constant folding and CSE leave them.

This pass asks the core's shape facility (:class:`mograph.shapes.ShapeQuery`, one sweep over the main
graph with the rule of each op's ``(domain, op, since_version)``) for:

- every tensor's dims, each a *monomial* ``c * a1 * a2 ...`` of atoms (a :class:`mograph.shapes.Dim`),
  where an atom is a named input dim (``batch``) or an unknown dim of one value; the rules are exact
  (``Reshape`` with ``0``/``-1``, broadcasting, ``Gather``, ``Gemm``/``MatMul``, ``Split``, ``Transpose``,
  shape-preserving ops including the fused ``com.microsoft`` ones); where no rule applies the dims ONNX
  inference left on the value are used (an ``unk__`` name is never taken to equal another value's);
- every small int64 vector's elements (``Shape``, ``Gather``, ``Slice``, ``Concat``, ``Unsqueeze``,
  ``Squeeze``, ``Reshape``, ``Cast`` to int64, ``Add``/``Sub``/``Mul``/``Div``, ``Equal``, ``Where``,
  ``ConstantOfShape``), again as monomials.

Then, each exact for every input the model accepts (named dims of the same name are equal, as ONNX
declares):

- a ``Reshape`` or ``Expand`` whose output dims equal its input's is removed;
- a ``Reshape`` of a ``Reshape`` whose result the second alone determines reads the first's input;
- a ``Reshape`` target (``allowzero=0``) gets ``0`` where it repeats the input dim at the same index,
  and a single ``-1`` only where every other entry is a positive literal (so a zero-size dim cannot
  make ``-1`` ambiguous); with ``allowzero=1`` a target is only replaced when it is fully constant;
- any other int64 shape vector whose value is fully known becomes an initializer, and one known in
  terms of input dims is rebuilt from the first value carrying each dim (``Shape(input_ids, 0, 2)``),
  so the per-layer copies become one computation shared by all layers.  A dim no graph input carries is
  read from the first value carrying it whose shape the graph already reads (and that something else
  reads too), before the first value carrying it at all: that one may lie inside a computation a fusion
  takes whole (BERT's embedding sum before its LayerNorm), where a new ``Shape`` reader would block it.
  The shape constants are made once, those of an earlier run included (one ``[0, 0, -1]``, so that CSE
  merges what reads it).

Nodes left unused are removed.  Subgraphs and functions are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from mograph.passes.cleanup._util import op_histogram
from onnx_ir.passes import common as irp

from mograph._traverse import iter_nodes
from mograph.irutil import attr_value, fresh_name, unique_initializer_name
from mograph.pass_infra import Option, Pass, PassResult
from mograph.shapes import Dim, Dims, ShapeQuery, reshape_entries, rules_for, shape_range

__all__ = ["SimplifyShapesPass"]

_STD = ("", "ai.onnx")
#: the name of the shape constants this pass makes (``mograph_shape``, ``mograph_shape_1``, ...)
_CONST_PREFIX = "mograph_shape"


def _shape_ops(query: ShapeQuery) -> frozenset[str]:
    """Standard ops with a shape-vector rule: they only compute shape vectors here, so a value read only by
    them is not a frontier."""
    return frozenset(r.op_type for r in query.rules if r.domain in _STD and r.values is not None)


class _Builder:
    """Builds canonical shape vectors, once each, before their first reader."""

    def __init__(self, model: ir.Model, analysis: ShapeQuery) -> None:
        self.model = model
        self.graph = model.graph
        self.an = analysis
        self.opset = model.opset_imports.get("", 1)
        self.cache: dict[tuple, ir.Value] = {}
        self.built = 0
        self.names = {n.name for n in iter_nodes(self.graph) if n.name}
        self.name_cursors: dict[str, int] = {}  # fresh_name: names only join self.names
        self.read = _shape_read_witnesses(model.graph, analysis)
        #: values read in place of the query's witness (:meth:`_source`): their gathered reads are rebuilt
        self.moved: set[ir.Value] = set()
        for value in self.graph.initializers.values():  # the constants an earlier round or run made: made once
            if value.name is not None and value.name.startswith(_CONST_PREFIX) and not value.is_graph_input():
                vec = self._const_vector(value)
                made = (vec, False) if vec is not None else self._const_scalar(value)
                if made is not None:
                    self.cache.setdefault(("const", *made), value)

    def plan(self, scalar: bool, elems: Sequence[Dim | None], reader: ir.Node) -> list[tuple] | None:
        """Pieces (``("const", ints)`` / ``("shape", value, start, end)``) that make ``elems`` for ``reader``.

        None if some element cannot be made from literals and dims of values computed before ``reader``
        (a dim of the reader's own output, or of anything after it, would make a cycle).
        """
        limit = self.an.position.get(reader.outputs[0], 1 << 62) if reader.outputs else 1 << 62
        pieces: list[tuple] = []
        for m in elems:
            if m is None:
                return None
            if m.is_literal:
                if pieces and pieces[-1][0] == "const":
                    pieces[-1] = ("const", pieces[-1][1] + (m.coef,))
                else:
                    pieces.append(("const", (m.coef,)))
                continue
            source = self._source(m.symbol, limit)
            if source is None:
                return None
            value, axis = source
            last = pieces[-1] if pieces else None
            if last is not None and last[0] == "shape" and last[1] is value and last[3] == axis:
                pieces[-1] = ("shape", value, last[2], axis + 1)
            else:
                pieces.append(("shape", value, axis, axis + 1))
        if scalar and (len(pieces) != 1 or len(elems) != 1):
            return None
        return pieces

    def _source(self, symbol: str | None, limit: int) -> tuple[ir.Value, int] | None:
        """Where a dim is read from for a reader at position ``limit``: the query's witness when it is a graph input,
        else the first value carrying the dim whose shape the graph already reads (see :func:`_shape_read_witnesses`),
        else the witness; None when the one chosen comes at or after the reader."""
        if symbol is None or symbol not in self.an.witness:
            return None
        first = self.an.witness[symbol]
        if first[0] not in self.an.position:  # a graph input
            return first
        read = self.read.get(symbol)
        if read is not None and self.an.position.get(read[0], -1) < limit:
            if read[0] is not first[0]:
                self.moved.add(read[0])
            return read
        return first if self.an.position.get(first[0], -1) < limit else None

    def matches(self, value: ir.Value, pieces: list[tuple], scalar: bool) -> bool:
        if scalar:
            return self._matches_scalar(value, pieces[0])
        if len(pieces) == 1:
            return self._matches_piece(value, pieces[0])
        node = value.producer()
        if node is None or node.op_type != "Concat" or node.domain not in _STD or len(node.inputs) != len(pieces):
            return False
        return all(v is not None and self._matches_piece(v, p) for v, p in zip(node.inputs, pieces))

    @staticmethod
    def _const_scalar(value: ir.Value) -> tuple[tuple[int, ...], bool] | None:
        """``((n,), True)`` for an int64 scalar constant ``n``."""
        t = ir.convenience.get_const_tensor(value)
        if t is None or t.dtype != ir.DataType.INT64 or t.shape.rank() != 0:
            return None
        return (int(t.numpy()),), True

    @staticmethod
    def _const_vector(value: ir.Value) -> tuple[int, ...] | None:
        t = ir.convenience.get_const_tensor(value)
        if t is None or t.dtype != ir.DataType.INT64 or t.shape.rank() != 1:
            return None
        return tuple(int(x) for x in np.asarray(t.numpy()).reshape(-1))

    def _matches_piece(self, value: ir.Value, piece: tuple) -> bool:
        if piece[0] == "const":
            return self._const_vector(value) == piece[1]
        if self._matches_gathered(value, piece):
            return True
        node = value.producer()
        if node is None or node.domain not in _STD or node.inputs[0] is not piece[1]:
            return False
        rank = len(self.an.dims(piece[1]) or ())
        if node.op_type == "Shape":
            return shape_range(node, rank) == (piece[2], piece[3])
        return False

    def _matches_gathered(self, value: ir.Value, piece: tuple) -> bool:
        """``Gather(Shape(w), [start .. end-1])``: the form built below opset 15.  From opset 15 on, not where ``w``
        stands in for the query's witness (:meth:`_source`): read from the witness, the read would be rebuilt as one
        ``Shape(witness, start, end)``, and reading ``w`` instead must not cost a node more."""
        if self.opset >= 15 and piece[1] in self.moved:
            return False
        node = value.producer()
        if node is None or node.op_type != "Gather" or node.domain not in _STD or int(attr_value(node, "axis", 0)) != 0:  # type: ignore[call-overload]
            return False
        shape = node.inputs[0].producer() if node.inputs[0] is not None else None
        if shape is None or shape.op_type != "Shape" or shape.domain not in _STD or shape.inputs[0] is not piece[1]:
            return False
        start, _ = shape_range(shape, len(self.an.dims(piece[1]) or ()))
        return self.an.ints(node.inputs[1]) == [start + i for i in range(piece[2], piece[3])] and node.inputs[1] is not None and len(node.inputs[1].shape or [0]) == 1

    def _matches_scalar(self, value: ir.Value, piece: tuple) -> bool:
        if piece[0] == "const":
            t = ir.convenience.get_const_tensor(value)
            return t is not None and t.dtype == ir.DataType.INT64 and t.shape.rank() == 0 and int(t.numpy()) == piece[1][0]
        node = value.producer()
        if node is None or node.op_type != "Gather" or node.domain not in _STD or int(attr_value(node, "axis", 0)) != 0:  # type: ignore[call-overload]
            return False
        idx = node.inputs[1]
        shape = node.inputs[0].producer() if node.inputs[0] is not None else None
        itensor = None if idx is None else ir.convenience.get_const_tensor(idx)
        if itensor is None or itensor.shape.rank() != 0 or shape is None:
            return False
        if shape.op_type != "Shape" or shape.inputs[0] is not piece[1]:
            return False
        start, _ = shape_range(shape, len(self.an.dims(piece[1]) or ()))
        return start + int(itensor.numpy()) == piece[2]

    def const(self, ints: Sequence[int], scalar: bool = False) -> ir.Value:
        key = ("const", tuple(ints), scalar)
        if key not in self.cache:
            arr = np.asarray(ints[0] if scalar else list(ints), dtype=np.int64)
            value = ir.Value(name=unique_initializer_name(self.graph, _CONST_PREFIX), const_value=ir.tensor(arr))
            value.type = ir.TensorType(ir.DataType.INT64)
            value.shape = ir.Shape(list(arr.shape))
            self.graph.register_initializer(value)
            self.cache[key] = value
            self.built += 1
        return self.cache[key]

    def _node(self, before: ir.Node, op: str, inputs: list[ir.Value], **attrs: object) -> ir.Value:
        node = ir.node(op, inputs, attributes=attrs, name=fresh_name(self.names, f"mograph_shape_{op}", self.name_cursors))  # type: ignore[arg-type]
        self.graph.insert_before(before, node)
        self.built += 1
        out = node.outputs[0]
        out.type = ir.TensorType(ir.DataType.INT64)
        return out

    def _shape(self, before: ir.Node, value: ir.Value, start: int, end: int) -> ir.Value:
        rank = len(self.an.dims(value) or ())
        key = ("shape", id(value), start, end)
        if key not in self.cache:
            if self.opset >= 15 or (start == 0 and end == rank):
                attrs: dict[str, object] = {}
                if start:
                    attrs["start"] = start
                if end != rank:
                    attrs["end"] = end
                out = self._node(before, "Shape", [value], **attrs)
            else:
                full = self._node(before, "Shape", [value])
                out = self._node(before, "Gather", [full, self.const(list(range(start, end)))], axis=0)
            out.shape = ir.Shape([end - start])
            self.cache[key] = out
        return self.cache[key]

    def build(self, before: ir.Node, pieces: list[tuple], scalar: bool) -> ir.Value:
        if scalar:
            piece = pieces[0]
            if piece[0] == "const":
                return self.const(piece[1], scalar=True)
            key = ("scalar", id(piece[1]), piece[2])
            if key not in self.cache:
                full = self._shape(before, piece[1], 0, len(self.an.dims(piece[1]) or ()))
                out = self._node(before, "Gather", [full, self.const([piece[2]], scalar=True)], axis=0)
                out.shape = ir.Shape([])
                self.cache[key] = out
            return self.cache[key]
        values = [self.const(p[1]) if p[0] == "const" else self._shape(before, p[1], p[2], p[3]) for p in pieces]
        if len(values) == 1:
            return values[0]
        ckey = ("concat", tuple(id(v) for v in values))
        if ckey not in self.cache:
            out = self._node(before, "Concat", values, axis=0)
            out.shape = ir.Shape([sum(len(p[1]) if p[0] == "const" else p[3] - p[2] for p in pieces)])
            self.cache[ckey] = out
        return self.cache[ckey]


def _shape_read_witnesses(graph: ir.Graph, analysis: ShapeQuery) -> dict[str, tuple[ir.Value, int]]:
    """Atom -> ``(value, axis)``: the first value (graph order) carrying the atom whose shape a ``Shape`` node
    already reads, and that something other than ``Shape`` reads too (it stays whatever the shapes read).

    A rebuilt dim reads one of these before the query's witness (the first value carrying it at all): the
    witness may be a value no ``Shape`` read, in the middle of a computation a fusion takes whole (the
    embedding sum before BERT's LayerNorm), and a new reader there would keep the fusion from removing it.
    Reading a value whose shape is read already adds no reader to a value that had none."""
    out: dict[str, tuple[ir.Value, int]] = {}
    values = [*graph.inputs, *(v for node in graph for v in node.outputs)]
    for value in values:
        shape = [user.op_type == "Shape" and user.domain in _STD for user, _ in value.uses()]
        if not any(shape) or (all(shape) and not value.is_graph_output()):
            continue  # no Shape reads it, or only Shapes do (it lives for them: read elsewhere, it can go)
        for axis, dim in enumerate(analysis.dims(value) or ()):
            symbol = dim.symbol if dim is not None else None
            if symbol is not None and symbol not in out:
                out[symbol] = (value, axis)
    return out


def _replace_uses(old: ir.Value, new: ir.Value) -> bool:
    if old.is_graph_output():
        return False
    ir.convenience.replace_all_uses_with(old, new)
    return True


class SimplifyShapesPass(Pass):
    """Remove no-op Reshape/Expand and compute each dynamic shape once, from the graph inputs."""

    name = "simplify-shapes"
    family = "cleanup"
    options = (
        Option("shape-rounds", int, 4, "most analysis-and-rewrite rounds simplify-shapes runs", metavar="N"),
    )

    def call(self, model: ir.Model) -> PassResult:
        stats: dict[str, int | float] = {
            "removed_reshapes": 0,
            "removed_expands": 0,
            "merged_reshapes": 0,
            "reshape_targets": 0,
            "shape_constants": 0,
            "shapes_rebuilt": 0,
            "removed_nodes": 0,
        }
        before = sum(op_histogram(model).values())
        for _ in range(max(1, int(self.config["shape_rounds"]))):
            if not self._round(model, stats):
                break
            irp.RemoveUnusedNodesPass()(model)
        changed = any(v for k, v in stats.items() if k != "removed_nodes")
        stats["removed_nodes"] = before - sum(op_histogram(model).values())
        return PassResult(modified=bool(changed), stats=stats)

    def _round(self, model: ir.Model, stats: dict[str, int | float]) -> bool:
        an = ShapeQuery(model.graph, rules_for(self.registry))
        shape_ops = _shape_ops(an)
        builder = _Builder(model, an)
        changed = False
        # One sweep in graph order, so a shared piece is built before its first reader.
        for node in list(model.graph):
            if node.graph is None:
                continue
            std = node.domain in _STD
            if std and node.op_type in ("Reshape", "Expand") and len(node.inputs) == 2 and node.inputs[0] is not None:
                x, y = node.inputs[0], node.outputs[0]
                dx, dy = an.dims(x), an.dims(y)
                if dx is not None and dy is not None and dx == dy and all(m is not None for m in dx):
                    if _replace_uses(y, x):
                        stats["removed_reshapes" if node.op_type == "Reshape" else "removed_expands"] += 1
                        changed = True
                        continue
            if std and node.op_type == "Reshape" and len(node.inputs) == 2:
                changed |= self._reshape(node, an, builder, stats)
            # Other frontier shape vectors (read by a non-shape op): constants, or rebuilt from input dims.
            for index, value in enumerate(node.inputs):
                if value is None or an.values(value) is None or value in an.bools:
                    continue
                if std and node.op_type == "Reshape" and index == 1:
                    continue  # handled above, with the input's dims
                if node.outputs and an.values(node.outputs[0]) is not None:
                    continue  # an intermediate step of a tracked shape computation
                if ir.convenience.get_const_tensor(value) is not None:
                    continue
                producer = value.producer()
                if producer is None or producer.domain not in _STD or producer.op_type not in shape_ops:
                    continue
                scalar, elems = an.values(value)  # type: ignore[misc]
                if value.shape is not None and value.shape.rank() != (0 if scalar else 1):
                    continue
                pieces = builder.plan(scalar, elems, node)
                if pieces is None or builder.matches(value, pieces, scalar):
                    continue
                new = builder.build(node, pieces, scalar)
                node.replace_input_with(index, new)
                stats["shape_constants" if all(p[0] == "const" for p in pieces) else "shapes_rebuilt"] += 1
                changed = True
        return changed

    def _reshape(self, node: ir.Node, an: ShapeQuery, builder: _Builder, stats: dict[str, int | float]) -> bool:
        x, target = node.inputs[0], node.inputs[1]
        if x is None or target is None:
            return False
        allowzero = bool(attr_value(node, "allowzero", 0))
        changed = False
        # Reshape(Reshape(a, s1), s2) -> Reshape(a, s2') when the result's dims are known without s1's.
        inner = x.producer()
        dy = an.dims(node.outputs[0])
        if (inner is not None and inner.op_type == "Reshape" and inner.domain in _STD and inner.inputs[0] is not None
                and dy is not None and all(m is not None for m in dy) and an.dims(inner.inputs[0]) is not None):
            if an.dims(inner.inputs[0]) == dy and _replace_uses(node.outputs[0], inner.inputs[0]):
                stats["removed_reshapes"] += 1
                return True
            plan = self._target(dy, an.dims(inner.inputs[0]), allowzero, builder, node)
            if plan is not None:
                node.replace_input_with(0, inner.inputs[0])
                node.replace_input_with(1, builder.build(node, plan, False))
                stats["merged_reshapes"] += 1
                return True
        vec = an.values(target)
        if vec is None or vec[0]:
            return changed
        elems = vec[1]
        if allowzero:
            if not all(m is not None and m.is_literal for m in elems):
                return changed
            plan = [("const", tuple(m.coef for m in elems))]  # type: ignore[union-attr]
        else:
            dims = an.reshape_dims(an.dims(x), elems, False)
            if dims is None or any(m is None for m in dims):
                # Keep the entries as they are (literal 0 / -1 included), only rebuilt from input dims.
                plan = builder.plan(False, elems, node)
            else:
                plan = self._target(dims, an.dims(x), False, builder, node) or builder.plan(False, elems, node)
        if plan is None or builder.matches(target, plan, False):
            return changed
        node.replace_input_with(1, builder.build(node, plan, False))
        stats["reshape_targets"] += 1
        return True

    @staticmethod
    def _target(out: Dims, data: Dims | None, allowzero: bool, builder: _Builder, reader: ir.Node) -> list[tuple] | None:
        """Pieces of a Reshape target that gives dims ``out`` from input dims ``data`` (exactly)."""
        entries = reshape_entries(out, data, allowzero)
        return None if entries is None else builder.plan(False, entries, reader)
