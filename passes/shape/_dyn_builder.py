"""Graph builder of ``make-dynamic``: carries out the planned rewrites.

Once the whole graph has been checked (``_dyn_symbolic``, ``_dyn_traceback``), :func:`apply_plan` renames
the requested input dims, and :class:`_Builder` replaces every planned constant with a run-time
expression of the sizes: ``Gather(Shape(witness), axis)`` per symbol, products with ``Mul``, shape
tensors with ``Concat``, tables with ``Range`` / ``Expand``; then shapes are re-inferred and the graph
outputs get their dims in the new symbols.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.shape._dyn_base import (
    INT64_MAX,
    _Action,
    _input,
    _SourceAction,
)
from mograph.passes.shape._dyn_symbolic import _Analysis
from mograph.passes.shape._dyn_traceback import _ramp_parts
from mograph.passes.shape._shapes import reinfer_shapes

from mograph.errors import PassFailedError
from mograph.shapes import Dim


def apply_plan(
    model: ir.Model, an: _Analysis, per_input: dict[ir.Value, dict[int, str]], pass_name: str
) -> dict[str, int | float]:
    """Make the requested input dims dynamic, carry out every planned rewrite, re-infer shapes and state the
    graph outputs' shapes in the new symbols; return the pass's stats."""
    graph = model.graph
    builder = _Builder(graph, an, pass_name)
    stats: dict[str, int | float] = {"dims_made_dynamic": sum(len(a) for a in per_input.values())}
    for v, axes in per_input.items():
        if v.shape is None:  # _requests only keeps inputs with a shape
            raise PassFailedError(pass_name, f"internal: input '{v.name}' lost its shape")
        dims = list(v.shape.dims)
        for axis, sym in axes.items():
            dims[axis] = ir.SymbolicDim(sym)
        v.shape = ir.Shape(dims)
    for action in an.actions:
        if isinstance(action, _SourceAction):
            builder.source(action)
            key = f"rewritten.{action.kind}"
        else:
            builder.replace_input(action)
            key = f"rewritten.{action.kind}"
        stats[key] = stats.get(key, 0) + 1
    builder.drop_unused()
    stats["nodes_added"] = builder.added
    # Re-derive every shape from the computation, then state the outputs' shapes in the new symbols.
    reinfer_shapes(model)
    for out in graph.outputs:
        out_dims = an.tags.get(out)
        static = out.shape
        if out_dims is None:
            continue
        new: list[Any] = []
        for i, d in enumerate(out_dims):
            if not d.has_sym:
                new.append(an.num(d))
            elif any(isinstance(f, str) and f.startswith("_d") for f in d):
                new.append(static.dims[i] if static is not None and len(static) == len(out_dims) and not isinstance(static.dims[i], int) else None)
            else:
                new.append(ir.SymbolicDim(str(d)))
        out.shape = ir.Shape(new)
    return stats


class _Builder:
    """Creates the runtime size expressions and swaps them in."""

    def __init__(self, graph: ir.Graph, an: _Analysis, pass_name: str) -> None:
        self.graph = graph
        self.an = an
        self.added = 0
        self.replaced: list[ir.Value] = []
        self._sym_cache: dict[tuple[str, bool], ir.Value] = {}
        self._names = {v.name for v in graph.initializers.values()} | {
            o.name for n in graph for o in n.outputs
        } | {i.name for i in graph.inputs}
        self._first = next(iter(graph), None)

    def _name(self, base: str) -> str:
        base = base.replace("/", "_").strip("_") or "dyn"
        name, k = base, 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def const(self, array: np.ndarray, base: str) -> ir.Value:
        value = ir.Value(name=self._name(base), const_value=ir.tensor(array))
        value.shape = ir.Shape(list(array.shape))
        value.dtype = ir.DataType.from_numpy(array.dtype)
        self.graph.register_initializer(value)
        return value

    def _insert(self, before: ir.Node | None, node: ir.Node) -> None:
        anchor = before if before is not None else self._first
        if anchor is None:
            self.graph.append(node)
        else:
            self.graph.insert_before(anchor, node)
        self.added += 1

    def _op(self, before: ir.Node | None, op: str, inputs: list[ir.Value], base: str, **attrs: Any) -> ir.Value:
        node = ir.node(op, inputs, attributes=attrs or None, name=self._name(f"{base}/{op}"))
        node.outputs[0].name = self._name(f"{base}_{op.lower()}")
        self._insert(before, node)
        return node.outputs[0]

    def sym(self, sym: str, scalar: bool, before: ir.Node | None) -> tuple[ir.Value, ir.Node | None]:
        """The run-time value of ``sym`` (int64 scalar or shape-[1] tensor)."""
        value, axis = self.an.witness[sym]
        fresh = sym.startswith("_d")
        key = (sym, scalar)
        if not fresh and key in self._sym_cache:
            return self._sym_cache[key], None
        anchor = before if fresh else None
        shape = self._op(anchor, "Shape", [value], f"mograph_dyn_{sym}")
        idx = self.const(np.array(axis if scalar else [axis], dtype=np.int64), f"mograph_dyn_{sym}_axis")
        out = self._op(anchor, "Gather", [shape, idx], f"mograph_dyn_{sym}", axis=0)
        if not fresh:
            self._sym_cache[key] = out
        return out, anchor

    def dim_value(self, d: Dim, scalar: bool, before: ir.Node | None, base: str) -> ir.Value:
        coef = math.prod(f for f in d if not isinstance(f, str))
        acc: ir.Value | None = None
        for f in d:
            if not isinstance(f, str):
                continue
            v, _ = self.sym(f, scalar, before)
            acc = v if acc is None else self._op(before, "Mul", [acc, v], base)
        if acc is None:
            return self.const(np.array(coef if scalar else [coef], dtype=np.int64), base)
        if coef != 1:
            c = self.const(np.array(coef if scalar else [coef], dtype=np.int64), f"{base}_coef")
            acc = self._op(before, "Mul", [acc, c], base)
        return acc

    def _shape_tensor(self, pieces: list[Any], before: ir.Node | None, base: str) -> ir.Value:
        """A 1-D int64 tensor: constant runs and run-time sizes, concatenated."""
        parts: list[ir.Value] = []
        run: list[int] = []
        for p in pieces:
            if isinstance(p, int):
                run.append(p)
                continue
            if run:
                parts.append(self.const(np.array(run, dtype=np.int64), f"{base}_const"))
                run = []
            parts.append(self.dim_value(p, False, before, base))
        if run:
            parts.append(self.const(np.array(run, dtype=np.int64), f"{base}_const"))
        return parts[0] if len(parts) == 1 else self._op(before, "Concat", parts, base, axis=0)

    def replace_input(self, action: _Action) -> None:
        node = action.node
        base = f"{node.name or node.op_type}_{action.kind.lower()}_dyn"
        old = node.inputs[action.index]
        if action.kind == "GatherND":  # an all-positions GatherND is a Reshape
            out = node.outputs[0]
            new = self._op(node, "Reshape", [_input(node, 0), self._shape_tensor(action.pieces, node, base)], base)
            out.replace_all_uses_with(new, replace_graph_outputs=True)
            self.graph.remove(node, safe=True)
            return
        if action.kind == "Gather":
            n = self.dim_value(action.extra, True, node, base)
            zero = self.const(np.array(0, dtype=np.int64), f"{base}_zero")
            one = self.const(np.array(1, dtype=np.int64), f"{base}_one")
            rng = self._op(node, "Range", [zero, n, one], base)
            new = self._op(node, "Reshape", [rng, self._shape_tensor(action.pieces, node, base)], base)
            if old is not None and old.dtype not in (None, ir.DataType.INT64):
                new = self._op(node, "Cast", [new], base, to=old.dtype)
            node.replace_input_with(action.index, new)
            if old is not None:
                self.replaced.append(old)
            return
        if not action.scalar and all(isinstance(p, int) for p in action.pieces):
            np_dtype = action.dtype.numpy()
            limit = np.iinfo(np_dtype).max if np.issubdtype(np_dtype, np.integer) else INT64_MAX
            arr = np.array([min(p, limit) for p in action.pieces]).astype(np_dtype)
            node.replace_input_with(action.index, self.const(arr, f"{base}_const"))
            if old is not None:
                self.replaced.append(old)
            return
        if action.scalar:
            new = self.dim_value(action.pieces[0], True, node, base)
        else:
            new = self._shape_tensor(action.pieces, node, base)
        if action.dtype != ir.DataType.INT64:
            new = self._op(node, "Cast", [new], base, to=action.dtype)
        node.replace_input_with(action.index, new)
        if old is not None:
            self.replaced.append(old)

    def source(self, action: _SourceAction) -> None:
        arr, value = action.array, action.value
        anchor = self._first  # depends on graph inputs and constants only
        if action.kind == "uniform":
            base = f"{value.name}_expand_dyn"
            row = self.const(np.ascontiguousarray(np.take(arr, [0], axis=action.axis)), f"{base}_row")
            pieces: list[Any] = [int(s) for s in arr.shape]
            pieces[action.axis] = action.dim
            shape = self._shape_tensor(pieces, anchor, base)
            out = self._op(anchor, "Expand", [row, shape], base)
            self._swap(value, out)
            return
        if action.kind == "ramp":
            base = f"{value.name}_ramp_dyn"
            ramp_first, ramp_step, _ = _ramp_parts(arr, action.axis)
            n = self.dim_value(action.dim, True, anchor, base)
            zero = self.const(np.array(0, dtype=np.int64), f"{base}_zero")
            one = self.const(np.array(1, dtype=np.int64), f"{base}_one")
            k = self._op(anchor, "Range", [zero, n, one], base)
            if arr.dtype != np.int64:
                k = self._op(anchor, "Cast", [k], base, to=ir.DataType.from_numpy(arr.dtype))
            target = [1] * arr.ndim
            target[action.axis] = -1
            k = self._op(anchor, "Reshape", [k, self.const(np.array(target, dtype=np.int64), f"{base}_shape")], base)
            out = self._op(anchor, "Mul", [k, self.const(np.ascontiguousarray(ramp_step), f"{base}_step")], base)
            out = self._op(anchor, "Add", [out, self.const(np.ascontiguousarray(ramp_first), f"{base}_first")], base)
            self._swap(value, out)
            return
        flat = arr.reshape(-1)
        start, step = flat[0], flat[1] - flat[0]
        base = f"{value.name}_range_dyn"
        n = self.dim_value(action.dim, True, anchor, base)
        start_a = np.array(start, dtype=np.int64 if arr.dtype.kind in "iu" else arr.dtype)
        start_v = self.const(start_a, f"{base}_start")
        step_v = self.const(np.array(step, dtype=start_a.dtype), f"{base}_step")
        if arr.dtype.kind in "iu" and start == 0 and step == 1:
            limit = n
        elif arr.dtype.kind in "iu":
            limit = self._op(anchor, "Add", [self._op(anchor, "Mul", [n, step_v], base), start_v], base)
        else:
            nf = self._op(anchor, "Cast", [n], base, to=ir.DataType.from_numpy(arr.dtype))
            limit = self._op(anchor, "Add", [self._op(anchor, "Mul", [nf, step_v], base), start_v], base)
        rng = self._op(anchor, "Range", [start_v, limit, step_v], base)
        target = [1] * arr.ndim
        target[action.axis] = -1
        out = self._op(anchor, "Reshape", [rng, self.const(np.array(target, dtype=np.int64), f"{base}_shape")], base)
        if arr.dtype.kind in "iu" and arr.dtype != np.int64:
            out = self._op(anchor, "Cast", [out], base, to=ir.DataType.from_numpy(arr.dtype))
        self._swap(value, out)

    def _swap(self, value: ir.Value, new: ir.Value) -> None:
        for use in list(value.uses()):
            if use.node is not new.producer():
                use.node.replace_input_with(use.idx, new)
        self.replaced.append(value)

    def drop_unused(self) -> None:
        # A constant shared by several rewritten nodes (one Reshape target after CSE merged equal ones) is listed
        # once per node: it goes once (a second remove raised "does not belong to this graph", exit 1).
        for v in dict.fromkeys(self.replaced):
            if v.uses() or v.is_graph_output() or v.is_graph_input():
                continue
            if v.name is not None and v.name in self.graph.initializers and self.graph.initializers[v.name] is v:
                del self.graph.initializers[v.name]
            node = v.producer()
            if node is not None and node.graph is self.graph and not any(
                    o.uses() or o.is_graph_output() for o in node.outputs):
                self.graph.remove(node, safe=True)
