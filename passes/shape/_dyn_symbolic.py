"""Symbolic analysis of ``make-dynamic``: the forward walk over the graph, in the core's size algebra.

A *symbolic size* is a :class:`mograph.shapes.Dim`: an ordered product of factors, ints > 1 and symbol
names; ``Dim()`` is size 1 (the order is the row-major layout a reshape keeps).  :class:`_Analysis`
walks the graph once in order, gives every dynamic tensor's dims a symbolic size through one rule per op, and plans the rewrites (:class:`_Action`) of constants that bake an old
size in.  A static operand that meets a dynamic dim of the same old size stops the walk with
:class:`_NeedTag` (the pass then traces that size back, see ``_dyn_traceback``); anything the walk
cannot vouch for stops it with :class:`_Refuse`, which the pass reports as a ``PassFailedError``.

The pass and its documentation live in :mod:`mograph.passes.shape.make_dynamic`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.irutil import attr_value as _attr
from mograph.shapes import BROADCAST_OPS, REDUCE_OPS, SAME_SHAPE_OPS, Dim

INT64_MAX = int(np.iinfo(np.int64).max)
ONE = Dim()  # the size 1


class _Refuse(Exception):
    def __init__(self, node: ir.Node | None, message: str) -> None:
        super().__init__(message)
        self.node = node


class _NeedTag(Exception):
    """A static dim of ``value`` at ``axis`` has the old size of the dynamic dim ``dim``: trace it back."""

    def __init__(self, node: ir.Node, value: ir.Value, axis: int, dim: Dim) -> None:
        super().__init__(f"{value.name} axis {axis}")
        self.node, self.value, self.axis, self.dim = node, value, axis, dim


@dataclass
class _Action:
    """A planned rewrite: give ``node`` input ``index`` a new value built from ``pieces``."""

    kind: str
    node: ir.Node
    index: int
    pieces: list[Any]  # ints and Dims (1-D shape tensor), or a single Dim (scalar)
    scalar: bool = False
    dtype: ir.DataType = ir.DataType.INT64
    extra: Any = None  # the gathered axis's size, for an all-indices Gather


@dataclass
class _SourceAction:
    """A planned rewrite of a constant ``value`` (an ``arange`` table) into ``Range`` over ``axis``."""

    value: ir.Value
    axis: int
    dim: Dim
    array: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    kind: str = "arange"  # or "uniform": every slice along ``axis`` is the same


#: Shape-preserving ops this pass treats alike: the standard ones and the com.microsoft ones the fusions emit.
_UNARY = SAME_SHAPE_OPS | {"SimplifiedLayerNormalization", "SkipLayerNormalization", "FastGelu", "BiasGelu"}
_BROADCAST = BROADCAST_OPS
_REDUCE = REDUCE_OPS
_POOL = {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"}
_GLOBAL_POOL = {"GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"}


def _const(v: ir.Value | None) -> np.ndarray | None:
    if v is None:
        return None
    t = ir.convenience.get_const_tensor(v)
    return None if t is None else t.numpy()


def _input(node: ir.Node, index: int) -> ir.Value:
    """Input ``index`` of ``node``, one the op requires; refuses when the model leaves it out."""
    v = node.inputs[index] if index < len(node.inputs) else None
    if v is None:
        raise _Refuse(node, f"its required input {index} is missing")
    return v


def _static_shape(v: ir.Value) -> list[int] | None:
    """The shape of ``v`` when every dim is a known integer, else ``None``."""
    if v.shape is None:
        return None
    dims = [int(d) for d in v.shape.dims if isinstance(d, int)]
    return dims if len(dims) == len(v.shape.dims) else None


class _Analysis:
    """One forward walk: symbolic sizes of every dynamic tensor and the rewrites they need."""

    def __init__(self, graph: ir.Graph, seeds: dict[ir.Value, list[Dim]], sizes: dict[str, int],
                 witness: dict[str, tuple[ir.Value, int]], overrides: dict[ir.Value, dict[int, Dim]],
                 source_actions: list[Any]) -> None:
        self.graph = graph
        self.sizes = dict(sizes)
        self.witness = dict(witness)
        self.overrides = overrides
        self.tags: dict[ir.Value, list[Dim]] = {}
        self.elems: dict[ir.Value, list[Any]] = {}  # symbolic contents of small int shape tensors
        self.actions: list[Any] = list(source_actions)
        self._fresh = 0
        for v, dims in seeds.items():
            self.tags[v] = dims
        for v in overrides:
            if v.producer() is None:
                self._overlay(v)

    # ------------------------------------------------------------------ helpers
    def num(self, d: Dim) -> int:
        """The export size of ``d``."""
        return d.evaluate(self.sizes)

    def fresh(self, node: ir.Node, value: ir.Value, axis: int) -> Dim:
        self._fresh += 1
        name = f"_d{self._fresh}"
        shape = self.static(node, value)
        self.sizes[name] = shape[axis]
        self.witness[name] = (value, axis)
        return Dim.sym(name)

    def static(self, node: ir.Node | None, v: ir.Value) -> list[int]:
        shape = _static_shape(v)
        if shape is None:
            raise _Refuse(node, f"the static shape of '{v.name}' is unknown, so its dims cannot be tracked")
        return shape

    def dims(self, node: ir.Node, v: ir.Value) -> list[Dim]:
        if v in self.tags:
            return self.tags[v]
        return [Dim.lit(d) for d in self.static(node, v)]

    def tagged(self, v: ir.Value | None) -> bool:
        return v is not None and (v in self.tags or v in self.elems)

    def set(self, node: ir.Node, v: ir.Value, dims: list[Dim]) -> None:
        static = _static_shape(v)
        if static is not None and len(static) != len(dims):
            raise _Refuse(node, f"internal: rank of '{v.name}' disagrees with inference")
        if static is not None:
            for axis, (d, s) in enumerate(zip(dims, static)):
                if self.num(d) != s:
                    raise _Refuse(node, f"derived size {self.num(d)} of '{v.name}' axis {axis} disagrees with "
                                  f"the inferred {s}")
        if any(d.has_sym for d in dims):
            self.tags[v] = list(dims)
        self._overlay(v)

    def _overlay(self, v: ir.Value) -> None:
        if v in self.overrides:
            dims = list(self.tags.get(v) or [Dim.lit(d) for d in self.static(None, v)])
            for axis, d in self.overrides[v].items():
                dims[axis] = d
            self.tags[v] = dims

    def elem_values(self, v: ir.Value | None) -> list[Any] | None:
        """Symbolic contents of an int tensor (constant or tracked), flattened; ``None`` if unknown.

        An element is a :class:`Dim`, ``None`` (unknown) or ``("#", n)``: a raw constant (0, -1 and negative
        numbers included), which :meth:`_as_dim` reads as a size where it is one."""
        if v is None:
            return None
        if v in self.elems:
            return list(self.elems[v])
        arr = _const(v)
        if arr is None or arr.dtype.kind not in "iu":
            return None
        return [("#", int(x)) for x in arr.reshape(-1)]  # raw ints (may be 0, -1, negative)

    # ------------------------------------------------------------------ walk
    def run(self) -> None:
        for node in list(self.graph):
            ins = [i for i in node.inputs if i is not None]
            sub_uses = self._subgraph_uses(node)
            if not any(self.tagged(i) for i in ins + sub_uses):
                for out in node.outputs:
                    self._overlay(out)
                continue
            if node.domain not in ("", "ai.onnx", "com.microsoft") or sub_uses:
                raise _Refuse(node, "an op the pass has no rule for consumes a dynamic tensor")
            rule = self._rule(node)
            if rule is None:
                raise _Refuse(node, f"no rule for {node.op_type}, which consumes a dynamic tensor")
            rule(node)
            for out in node.outputs:
                if out not in self.tags:
                    self._overlay(out)

    def _subgraph_uses(self, node: ir.Node) -> list[ir.Value]:
        out: list[ir.Value] = []
        for a in node.attributes.values():
            graphs = [a.value] if isinstance(a.value, ir.Graph) else list(a.value) if a.type == ir.AttributeType.GRAPHS else []
            for g in graphs:
                for n in ir.traversal.RecursiveGraphIterator(g):
                    out.extend(i for i in n.inputs if i is not None and i.graph is self.graph)
        return out

    def _rule(self, node: ir.Node) -> Callable[[ir.Node], None] | None:
        op = node.op_type
        if op in _UNARY:
            return self.r_unary
        if op in _BROADCAST:
            return self.r_broadcast
        if op in _REDUCE or op in ("ArgMax", "ArgMin"):
            return self.r_reduce
        if op in _POOL:
            return self.r_pool
        if op in _GLOBAL_POOL:
            return self.r_global_pool
        return getattr(self, f"r_{op.lower()}", None)

    # ------------------------------------------------------------------ broadcasting
    def broadcast(self, node: ir.Node, inputs: list[ir.Value], out_rank: int | None = None) -> list[Dim]:
        all_dims = [self.dims(node, v) for v in inputs]
        rank = max(len(d) for d in all_dims) if out_rank is None else out_rank
        out: list[Dim] = []
        for pos in range(rank):
            cands = []
            for v, ds in zip(inputs, all_dims):
                axis = len(ds) - rank + pos
                if axis >= 0:
                    cands.append((v, axis, ds[axis]))
            out.append(self.merge(node, cands))
        return out

    def merge(self, node: ir.Node, cands: list[tuple[ir.Value, int, Dim]], strict: bool = False) -> Dim:
        """The dim that equal-or-broadcast dims ``cands`` produce; raises on baked sizes and ambiguity.

        ``strict``: the dims must be equal (``Concat``, a ``MatMul`` contraction), so even a static 1 that
        meets a dynamic dim of export size 1 has the size baked in.
        """
        symbolic = [c for c in cands if c[2].has_sym]
        if not symbolic:
            return max((c[2] for c in cands), key=self.num, default=ONE)
        first = symbolic[0][2]
        for v, axis, d in symbolic[1:]:
            if d != first:
                raise _Refuse(node, f"dims {first} and {d} meet here (input '{v.name}' axis {axis}); "
                              "the pass cannot tell whether they agree at other sizes")
        n = self.num(first)
        for v, axis, d in cands:
            if d.has_sym:
                continue
            size = self.num(d)
            if size == 1 and not strict:
                continue
            if size == n:
                raise _NeedTag(node, v, axis, first)
            raise _Refuse(node, f"dynamic dim {first} (size {n} in the export) broadcasts against the static "
                          f"size {size} of '{v.name}' axis {axis}")
        return first

    # ------------------------------------------------------------------ rules
    def r_unary(self, node: ir.Node) -> None:
        src = _input(node, 0)
        if src in self.elems and node.op_type in ("Cast", "Identity", "CastLike"):
            self.elems[node.outputs[0]] = self.elems[src]
        if src in self.elems and node.op_type not in ("Cast", "Identity", "CastLike"):
            self.elems[node.outputs[0]] = [None] * len(self.elems[src])
        dims = self.dims(node, src)
        if node.op_type == "PRelu":
            dims = self.broadcast(node, [_input(node, i) for i in range(len(node.inputs))])
        self.set(node, node.outputs[0], dims)
        if node.op_type in ("LayerNormalization", "SimplifiedLayerNormalization"):
            axis = _attr(node, "axis", -1) % max(len(dims), 1)
            reduced = [d if i < axis else ONE for i, d in enumerate(dims)]
            for out in node.outputs[1:]:
                if out is not None and out.shape is not None:
                    self.set(node, out, reduced)
        elif node.op_type == "Dropout" and len(node.outputs) > 1 and node.outputs[1] is not None:
            self.set(node, node.outputs[1], dims)

    def r_broadcast(self, node: ir.Node) -> None:
        ins = [i for i in node.inputs if i is not None]
        if any(i in self.elems for i in ins):
            self.elems_arith(node)
        self.set(node, node.outputs[0], self.broadcast(node, ins))

    def elems_arith(self, node: ir.Node) -> None:
        out = node.outputs[0]
        vals = [self.elem_values(i) for i in node.inputs]
        n = max(len(v) for v in vals if v is not None)
        known = [v for v in vals if v is not None]
        if node.op_type == "Mul" and len(vals) == 2 and len(known) == 2:
            res: list[Dim | None] = []
            for k in range(n):
                a, b = (v[k] if len(v) > 1 else v[0] for v in known)
                a, b = self._as_dim(a), self._as_dim(b)
                res.append(None if a is None or b is None else Dim(a + b))
            self.elems[out] = res
        else:
            self.elems[out] = [None] * n

    @staticmethod
    def _as_dim(e: Any) -> Dim | None:
        if e is None:
            return None
        if len(e) == 2 and e[0] == "#":
            return Dim.lit(e[1]) if e[1] > 0 else None
        return e

    def r_matmul(self, node: ir.Node) -> None:
        a, b = _input(node, 0), _input(node, 1)
        da, db = self.dims(node, a), self.dims(node, b)
        if len(da) < 2 or len(db) < 2:
            raise _Refuse(node, "MatMul with a 1-D operand on a dynamic tensor is not supported")
        self.merge(node, [(a, len(da) - 1, da[-1]), (b, len(db) - 2, db[-2])], strict=True)
        ra, rb = len(da) - 2, len(db) - 2
        rank = max(ra, rb)
        batch: list[Dim] = []
        for pos in range(rank):
            cands = []
            for v, ds, r in ((a, da, ra), (b, db, rb)):
                axis = r - rank + pos
                if axis >= 0:
                    cands.append((v, axis, ds[axis]))
            batch.append(self.merge(node, cands))
        self.set(node, node.outputs[0], batch + [da[-2], db[-1]])

    def r_gemm(self, node: ir.Node) -> None:
        a, b = _input(node, 0), _input(node, 1)
        da, db = self.dims(node, a), self.dims(node, b)
        if _attr(node, "transA", 0):
            da = da[::-1]
        if _attr(node, "transB", 0):
            db = db[::-1]
        self.merge(node, [(a, 1, da[1]), (b, 0, db[0])], strict=True)
        out = [da[0], db[1]]
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            c = node.inputs[2]
            dc = self.dims(node, c)
            for pos in range(2):
                axis = len(dc) - 2 + pos
                if axis >= 0:
                    out[pos] = self.merge(node, [(node.outputs[0], pos, out[pos]), (c, axis, dc[axis])])
        self.set(node, node.outputs[0], out)

    def r_transpose(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        perm = _attr(node, "perm") or list(range(len(dims)))[::-1]
        self.set(node, node.outputs[0], [dims[p] for p in perm])

    def _axes(self, node: ir.Node, rank: int, input_index: int = 1, attr: str = "axes") -> list[int] | None:
        axes = _attr(node, attr)
        if axes is None and len(node.inputs) > input_index and node.inputs[input_index] is not None:
            arr = _const(node.inputs[input_index])
            if arr is None:
                raise _Refuse(node, "its axes are not constant")
            axes = arr.reshape(-1).tolist()
        return None if axes is None else [int(a) % rank for a in axes]

    def r_unsqueeze(self, node: ir.Node) -> None:
        src, out = _input(node, 0), node.outputs[0]
        dims = self.dims(node, src)
        rank = len(self.static(node, out))
        axes = sorted(self._axes(node, rank) or [])
        it = iter(dims)
        new = [ONE if i in axes else next(it) for i in range(rank)]
        self.set(node, out, new)
        if src in self.elems:
            self.elems[out] = self.elems[src]

    def r_squeeze(self, node: ir.Node) -> None:
        src, out = _input(node, 0), node.outputs[0]
        dims = self.dims(node, src)
        axes = self._axes(node, len(dims))
        if axes is None:
            axes = [i for i, d in enumerate(dims) if self.num(d) == 1]
        for a in axes:
            if dims[a].has_sym:
                raise _Refuse(node, f"it squeezes the dynamic axis {a} ({dims[a]}), which is 1 only in the export")
        self.set(node, out, [d for i, d in enumerate(dims) if i not in axes])
        if src in self.elems:
            self.elems[out] = self.elems[src]

    def r_flatten(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        axis = _attr(node, "axis", 1) % (len(dims) + 1) if dims else 0
        left = Dim(tuple(f for d in dims[:axis] for f in d))
        right = Dim(tuple(f for d in dims[axis:] for f in d))
        self.set(node, node.outputs[0], [left, right])

    def r_concat(self, node: ir.Node) -> None:
        ins = [i for i in node.inputs if i is not None]
        out = node.outputs[0]
        if any(i in self.elems for i in ins):
            vals: list[Any] = []
            for i in ins:
                ev = self.elem_values(i)
                if ev is None:
                    ev = [None] * int(np.prod(self.static(node, i)))
                vals.extend(ev)
            self.elems[out] = vals
        all_dims = [self.dims(node, i) for i in ins]
        rank = len(all_dims[0])
        axis = _attr(node, "axis", 0) % rank
        new: list[Dim] = []
        for pos in range(rank):
            if pos == axis:
                parts = [d[pos] for d in all_dims if self.num(d[pos]) != 0]
                if not any(p.has_sym for p in parts):
                    new.append(Dim.lit(sum(self.num(p) for p in parts)))
                elif len(parts) == 1:
                    new.append(parts[0])
                elif len(set(parts)) == 1:
                    new.append(Dim((len(parts),) + parts[0]))
                else:
                    new.append(self.fresh(node, out, pos))
            else:
                cands = [(i, pos, d[pos]) for i, d in zip(ins, all_dims)]
                new.append(self.merge(node, cands, strict=True))
        self.set(node, out, new)

    def r_split(self, node: ir.Node) -> None:
        src = _input(node, 0)
        dims = self.dims(node, src)
        axis = _attr(node, "axis", 0) % len(dims)
        if dims[axis].has_sym:
            raise _Refuse(node, f"it splits the dynamic axis {axis} ({dims[axis]}) into sizes fixed at export")
        for out in node.outputs:
            if out is not None:
                shape = self.static(node, out)
                self.set(node, out, [Dim.lit(shape[i]) if i == axis else d for i, d in enumerate(dims)])

    def r_shape(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        start, end = _attr(node, "start", 0), _attr(node, "end", None)
        sel = dims[slice(start, end)]
        self.elems[node.outputs[0]] = list(sel)

    def r_size(self, node: ir.Node) -> None:
        self.elems[node.outputs[0]] = [None]

    def r_gather(self, node: ir.Node) -> None:
        data, idx, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        axis = _attr(node, "axis", 0) % len(ddims)
        idims = self.dims(node, idx)
        if ddims[axis].has_sym:
            arr = _const(idx)
            if arr is None:
                raise _Refuse(node, f"it gathers along the dynamic axis {axis} with indices computed at run time")
            n = self.num(ddims[axis])
            if n > 1 and arr.size == n and np.array_equal(arr.reshape(-1), np.arange(n)):
                # Every index once, in order: a reshape of the axis into the indices' shape.
                new_idx = self.assign_reshape(node, [ddims[axis]], [int(s) for s in arr.shape])
                self.set(node, out, ddims[:axis] + new_idx + ddims[axis + 1:])
                pieces = [d if d.has_sym else self.num(d) for d in new_idx]
                self.actions.append(_Action("Gather", node, 1, pieces, extra=ddims[axis]))
                return
            bad = [int(i) for i in arr.reshape(-1) if n == 1 or int(i) == n - 1]
            if bad:
                raise _Refuse(node, f"it gathers index {bad[0]} of the dynamic axis {axis} ({ddims[axis]}, size "
                              f"{n} in the export): a fixed position and 'the last one' cannot be told apart")
        self.set(node, out, ddims[:axis] + idims + ddims[axis + 1:])
        if data in self.elems:
            arr = _const(idx)
            ev = self.elems[data]
            if arr is None:
                self.elems[out] = [None] * max(1, int(np.prod(self.static(node, out))))
            else:
                self.elems[out] = [ev[int(i)] for i in arr.reshape(-1)]

    def r_reshape(self, node: ir.Node) -> None:
        data, target, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        if data in self.elems:
            self.elems[out] = self.elems[data]
        zero_literal = bool(_attr(node, "allowzero", 0))
        if target in self.elems:
            new = []
            for j, e in enumerate(self.elems[target]):
                d = self._as_dim(e)
                if e is not None and len(e) == 2 and e[0] == "#" and e[1] == 0:
                    d = ONE if zero_literal else ddims[j]
                    if zero_literal:
                        raise _Refuse(node, "Reshape with allowzero=1 and a 0 entry on a dynamic tensor")
                if d is None:
                    d = self.fresh(node, out, j)
                new.append(d)
            self.set(node, out, new)
            return
        arr = _const(target)
        if arr is None:
            raise _Refuse(node, "its target shape is computed in a way the pass does not track")
        if not any(d.has_sym for d in ddims):
            self.set(node, out, [Dim.lit(s) for s in self.static(node, out)])
            return
        entries = [int(x) for x in arr.reshape(-1)]
        if zero_literal and 0 in entries:
            raise _Refuse(node, "Reshape with allowzero=1 and a 0 entry on a dynamic tensor")
        new = self.assign_reshape(node, ddims, entries)
        self.set(node, out, new)
        pieces: list[Any] = []
        needs = False
        for entry, d in zip(entries, new):
            if entry in (0, -1):
                pieces.append(entry)
            elif d.has_sym:
                pieces.append(d)
                needs = True
            else:
                pieces.append(entry)
        if needs:
            self.actions.append(_Action("Reshape", node, 1, pieces))

    def assign_reshape(self, node: ir.Node, ddims: list[Dim], entries: list[int]) -> list[Dim]:
        """Place the input's symbols on the target's entries (see the module docstring)."""
        factors = [f for d in ddims for f in d]
        syms = [f for f in factors if isinstance(f, str)]
        runs = [1]
        for f in factors:
            if isinstance(f, str):
                runs.append(1)
            else:
                runs[-1] *= f
        total = math.prod(self.num(d) for d in ddims)
        values: list[int] = []
        wild = [j for j, e in enumerate(entries) if e == -1]
        for j, e in enumerate(entries):
            values.append(self.num(ddims[j]) if e == 0 else e)
        if wild:
            rest = math.prod(v for j, v in enumerate(values) if j != wild[0])
            values[wild[0]] = total // rest if rest else 0
        k, m = len(syms), len(entries)
        results: dict[tuple, int] = {}
        for assign in itertools.combinations_with_replacement(range(m), k):
            res = self._try_assign(syms, runs, values, assign)
            if res is None:
                continue
            if any(e == 0 and res[j] != ddims[j] for j, e in enumerate(entries)):
                continue
            score = sum(1 for d in res if len(d) == 1 and isinstance(d[0], str))
            results[tuple(res)] = score
        if not results:
            raise _Refuse(node, f"its constant target {entries} cannot be matched with the input's dims "
                          f"{[str(d) for d in ddims]}")
        best = max(results.values())
        top = [r for r, s in results.items() if s == best]
        if len(top) > 1 and len({self._without_unit_syms(r) for r in top}) == 1:
            # Only where a size-1 symbol (batch 1) sits among literal 1s differs: take the outermost placement.
            top = top[:1]
        if len(top) > 1:
            shown = " or ".join(str([str(d) for d in r]) for r in top[:3])
            raise _Refuse(node, f"its constant target {entries} is ambiguous for input dims "
                          f"{[str(d) for d in ddims]}: it reads as {shown}")
        return list(top[0])

    def _without_unit_syms(self, dims: tuple) -> tuple:
        return tuple(Dim(tuple(f for f in d if not (isinstance(f, str) and self.sizes[f] == 1))) for d in dims)

    def _try_assign(self, syms: list[str], runs: list[int], values: list[int], assign: tuple[int, ...]) -> list[Dim] | None:
        rem = runs[0]
        out: list[Dim] = []
        s = 0
        for j, v in enumerate(values):
            mine = [i for i in range(s, len(syms)) if assign[i] == j]
            if not mine:
                if v <= 0 or rem % v:
                    return None
                rem //= v
                out.append(Dim.lit(v))
                continue
            p, q = mine[0], mine[-1]
            symprod = math.prod(self.sizes[x] for x in syms[p:q + 1])
            inner = math.prod(runs[p + 1:q + 1])
            if v % (symprod * inner):
                return None
            c = v // (symprod * inner)
            if c % rem:
                return None
            right = c // rem
            if runs[q + 1] % right:
                return None
            factors: list[Any] = [rem]
            for i in range(p, q + 1):
                factors.append(syms[i])
                if i < q:
                    factors.append(runs[i + 1])
            factors.append(right)
            out.append(Dim(factors))
            rem = runs[q + 1] // right
            s = q + 1
        return out if rem == 1 and s == len(syms) else None

    def r_expand(self, node: ir.Node) -> None:
        data, shape, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        if shape in self.elems:
            entries = [self._as_dim(e) for e in self.elems[shape]]
            rank = max(len(entries), len(ddims))
            new = []
            for pos in range(rank):
                cands = []
                ax = len(ddims) - rank + pos
                if ax >= 0:
                    cands.append((data, ax, ddims[ax]))
                ej = len(entries) - rank + pos
                if ej >= 0:
                    e = entries[ej]
                    cands.append((shape, ej, e if e is not None else self.fresh(node, out, pos)))
                new.append(self.merge(node, cands))
            self.set(node, out, new)
            return
        arr = _const(shape)
        if arr is None:
            raise _Refuse(node, "its shape input is computed in a way the pass does not track")
        entries_i = [int(x) for x in arr.reshape(-1)]
        rank = max(len(entries_i), len(ddims))
        new, pieces, needs = [], [], False
        for pos in range(rank):
            ax = len(ddims) - rank + pos
            ej = len(entries_i) - rank + pos
            d = ddims[ax] if ax >= 0 else ONE
            ent = entries_i[ej] if ej >= 0 else 1
            if d.has_sym:
                n = self.num(d)
                if ent == 1:
                    piece = 1
                elif ent == n:
                    piece, needs = 1, True
                else:
                    raise _Refuse(node, f"it expands the dynamic dim {d} (size {n} in the export) to {ent}")
                new.append(d)
            else:
                piece = ent
                new.append(Dim.lit(max(ent, self.num(d))))
            if ej >= 0:
                pieces.append(piece)
        self.set(node, out, new)
        if needs:
            self.actions.append(_Action("Expand", node, 1, pieces))

    def r_resize(self, node: ir.Node) -> None:
        """``Resize``: ``scales`` of 1 keep a dynamic axis (batch, channels),
        other scales give a derived size; constant ``sizes`` entries equal to a dynamic axis's export
        size are rewritten to that axis's run-time size (``Concat(Shape(x)[:2], sizes[2:])``)."""
        data, out = _input(node, 0), node.outputs[0]
        dims = self.dims(node, data)
        rank = len(dims)
        axes = [int(a) % rank for a in _attr(node, "axes", None) or range(rank)]
        if any(self.tagged(v) for v in node.inputs[1:3]):
            raise _Refuse(node, "its roi or scales are computed from a dynamic tensor")
        sizes = node.inputs[3] if len(node.inputs) > 3 else None
        sizes_const = _const(sizes)
        if sizes is not None and (self.tagged(sizes) or sizes_const is not None and sizes_const.size):
            policy = _attr(node, "keep_aspect_ratio_policy", "stretch")
            policy = policy.decode() if isinstance(policy, bytes) else policy
            entries: list[Dim | None]
            if sizes in self.elems:
                entries = [self._as_dim(e) for e in self.elems[sizes]]
                arr = None
            else:
                arr = sizes_const
                if arr is None:
                    raise _Refuse(node, "its sizes are computed in a way the pass does not track")
                entries = [Dim.lit(int(x)) for x in arr.reshape(-1)]
            if len(entries) != len(axes):
                raise _Refuse(node, f"it has {len(entries)} sizes for {len(axes)} axes")
            static_out = self.static(node, out)
            new = list(dims)
            pieces: list[Any] = []
            needs = False
            for ax, e in zip(axes, entries):
                d = dims[ax]
                if not d.has_sym:
                    new[ax] = e if e is not None and e.has_sym else Dim.lit(static_out[ax])
                    pieces.append(self.num(e) if e is not None and not e.has_sym else e)
                    continue
                if policy != "stretch":
                    raise _Refuse(node, f"keep_aspect_ratio_policy={policy} with sizes on the dynamic dim {d}")
                if e is not None and e.has_sym:
                    if e != d:
                        raise _Refuse(node, f"it resizes the dynamic dim {d} to {e}")
                elif e is None or self.num(e) != self.num(d):
                    raise _Refuse(node, f"it resizes the dynamic dim {d} (size {self.num(d)} in the export) "
                                  "to a fixed size")
                else:
                    needs = True  # the export size, baked in: follow the input's run-time size
                new[ax] = d
                pieces.append(d)
            self.set(node, out, new)
            if needs and arr is not None:
                self.actions.append(_Action("Resize", node, 3, pieces))
            return
        opset = self.graph.opset_imports.get("", self.graph.opset_imports.get("ai.onnx", 11))
        scales_at = 1 if opset < 11 else 2  # Resize-10 is (X, scales); from 11 (X, roi, scales, sizes)
        scales_v = node.inputs[scales_at] if len(node.inputs) > scales_at else None
        scales = _const(scales_v) if scales_v is not None else None
        if scales is None or scales.size == 0:
            raise _Refuse(node, "it has neither constant scales nor sizes")
        if scales.size != len(axes):
            raise _Refuse(node, f"it has {scales.size} scales for {len(axes)} axes")
        static_out = self.static(node, out)
        new = list(dims)
        for ax, scale in zip(axes, scales.reshape(-1).tolist()):
            d = dims[ax]
            if not d.has_sym:
                new[ax] = Dim.lit(static_out[ax])
            elif scale == 1.0:
                new[ax] = d  # batch and channels keep their size
            else:
                new[ax] = self.fresh(node, out, ax)  # floor(size * scale): a derived size
        self.set(node, out, new)

    def r_constantofshape(self, node: ir.Node) -> None:
        shape, out = _input(node, 0), node.outputs[0]
        entries = self.elems.get(shape, [])
        new = []
        for j, e in enumerate(entries):
            d = self._as_dim(e)
            new.append(d if d is not None else self.fresh(node, out, j))
        self.set(node, out, new)

    def r_tile(self, node: ir.Node) -> None:
        data, reps, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        ev = self.elem_values(reps)
        if ev is None:
            raise _Refuse(node, "its repeats are computed in a way the pass does not track")
        new = []
        for j, (d, e) in enumerate(zip(ddims, ev)):
            r = self._as_dim(e)
            new.append(Dim(d + r) if r is not None else self.fresh(node, out, j))
        self.set(node, out, new)

    def r_range(self, node: ir.Node) -> None:
        start, limit, delta = (self.elem_values(i) for i in node.inputs[:3])
        out = node.outputs[0]
        size = self._as_dim(limit[0]) if start == [("#", 0)] and delta == [("#", 1)] and limit is not None else None
        if size is not None:
            self.set(node, out, [size])
        else:
            self.set(node, out, [self.fresh(node, out, 0)])

    def r_slice(self, node: ir.Node) -> None:
        data, out = _input(node, 0), node.outputs[0]
        ddims = self.dims(node, data)
        params = [_const(node.inputs[i]) if len(node.inputs) > i and node.inputs[i] is not None else None
                  for i in range(1, 5)]
        starts, ends = params[0], params[1]
        if starts is None or ends is None or (len(node.inputs) > 3 and node.inputs[3] is not None and params[2] is None) \
                or (len(node.inputs) > 4 and node.inputs[4] is not None and params[3] is None):
            raise _Refuse(node, "its bounds are computed in a way the pass does not track")
        starts_l, ends_l = starts.reshape(-1).tolist(), ends.reshape(-1).tolist()
        axes = [int(a) % len(ddims) for a in params[2].reshape(-1)] if params[2] is not None else list(range(len(starts_l)))
        steps = params[3].reshape(-1).tolist() if params[3] is not None else [1] * len(axes)
        new = [Dim.lit(s) for s in self.static(node, out)]
        new_ends, needs = list(ends_l), False
        for i, d in enumerate(ddims):
            if i not in axes:
                new[i] = d
                continue
            if not d.has_sym:
                continue
            k = axes.index(i)
            s, e, st, n = int(starts_l[k]), int(ends_l[k]), int(steps[k]), self.num(d)
            if st != 1:
                raise _Refuse(node, f"it slices the dynamic axis {i} ({d}) with step {st}")
            if s >= n:
                raise _Refuse(node, f"it slices the dynamic axis {i} ({d}) from {s}, past its export size {n}")
            if e >= n:
                if e < INT64_MAX // 2:
                    new_ends[k], needs = INT64_MAX, True
                new[i] = d if s == 0 else self.fresh(node, out, i)
            elif e < 0 or s < 0:
                new[i] = self.fresh(node, out, i)
            else:
                raise _Refuse(node, f"it slices the dynamic axis {i} ({d}) up to {e} (size {n} in the export): "
                              f"a fixed count and 'size - {n - e}' cannot be told apart")
        self.set(node, out, new)
        if data in self.elems and len(ddims) == 1:
            ev = self.elems[data]
            self.elems[out] = ev[slice(int(starts_l[0]), int(ends_l[0]), int(steps[0]))]
        if needs:
            self.actions.append(_Action("Slice", node, 2, [int(x) for x in new_ends], dtype=_input(node, 2).dtype or ir.DataType.INT64))

    def r_reduce(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        keep = _attr(node, "keepdims", 1)
        axes: list[int] | None
        if node.op_type in ("ArgMax", "ArgMin"):
            axes = [_attr(node, "axis", 0) % len(dims)]
        else:
            axes = self._axes(node, len(dims))
            if axes is None:
                axes = [] if _attr(node, "noop_with_empty_axes", 0) else list(range(len(dims)))
        new = [(ONE if i in axes else d) for i, d in enumerate(dims) if keep or i not in axes]
        self.set(node, node.outputs[0], new)

    def r_pool(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        if dims[1].has_sym:
            raise _Refuse(node, "the channel axis is dynamic")
        for w in node.inputs[1:]:
            if w is not None and w in self.tags:
                raise _Refuse(node, "its weights are dynamic")
        out = node.outputs[0]
        static = self.static(node, out)
        new = [dims[0], Dim.lit(static[1])]
        for i in range(2, len(static)):
            new.append(self.fresh(node, out, i) if dims[i].has_sym else Dim.lit(static[i]))
        self.set(node, out, new)
        for extra in node.outputs[1:]:
            if extra is not None:
                self.set(node, extra, new)

    def r_global_pool(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        if dims[1].has_sym:
            raise _Refuse(node, "the channel axis is dynamic")
        self.set(node, node.outputs[0], [dims[0], dims[1]] + [ONE] * (len(dims) - 2))

    def r_pad(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        pads = _const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if pads is None:
            pads = np.asarray(_attr(node, "pads", []) or [])
        out = node.outputs[0]
        static = self.static(node, out)
        axes = self._axes(node, len(dims), input_index=3) or list(range(len(dims)))
        p = pads.reshape(-1).tolist()
        new = []
        for i, d in enumerate(dims):
            if i in axes and d.has_sym:
                k = axes.index(i)
                new.append(d if p[k] == 0 and p[k + len(axes)] == 0 else self.fresh(node, out, i))
            else:
                new.append(d if d.has_sym else Dim.lit(static[i]))
        self.set(node, out, new)

    def r_topk(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        axis = _attr(node, "axis", -1) % len(dims)
        for out in node.outputs:
            static = self.static(node, out)
            self.set(node, out, [Dim.lit(static[i]) if i == axis else d for i, d in enumerate(dims)])

    def r_gathernd(self, node: ir.Node) -> None:
        data, idx, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        arr = _const(idx)
        if arr is None or _attr(node, "batch_dims", 0) != 0 or idx in self.tags:
            raise _Refuse(node, "GatherND with indices computed at run time on a dynamic tensor")
        k = arr.shape[-1]
        lead = [self.num(d) for d in ddims[:k]]
        grid = np.stack(np.unravel_index(np.arange(math.prod(lead)), lead), axis=-1) if lead else None
        if grid is None or arr.reshape(-1, k).shape != grid.shape or not np.array_equal(arr.reshape(-1, k), grid):
            if any(d.has_sym for d in ddims[:k]):
                raise _Refuse(node, "GatherND picks fixed positions along a dynamic axis")
            self.set(node, out, list(self.dims(node, idx)[:-1]) + ddims[k:])
            return
        # Every position once, in order: a reshape of the leading dims into the indices' shape.
        merged = Dim(tuple(f for d in ddims[:k] for f in d))
        new = self.assign_reshape(node, [merged], [int(s) for s in arr.shape[:-1]]) + ddims[k:]
        self.set(node, out, new)
        pieces = [d if d.has_sym else self.num(d) for d in new]
        self.actions.append(_Action("GatherND", node, 0, pieces))

    def r_gatherelements(self, node: ir.Node) -> None:
        self.set(node, node.outputs[0], self.dims(node, _input(node, 1)))

    def r_scatterelements(self, node: ir.Node) -> None:
        self.set(node, node.outputs[0], self.dims(node, _input(node, 0)))

    r_scatternd = r_scatterelements
