"""Symbolic analysis of ``make-dynamic``: the forward walk over the graph, in the core's size algebra.

A *symbolic size* is a :class:`mograph.shapes.Dim`: an ordered product of factors, ints > 1 and symbol
names; ``Dim()`` is size 1 (the order is the row-major layout a reshape keeps).  :class:`_Analysis`
walks the graph once in order, gives every dynamic tensor's dims a symbolic size through one rule per op
(``_dyn_rules``), and plans the rewrites (``_Action``) of constants that bake an old size in.  A static operand that meets a dynamic dim of the same old size stops the walk with
:class:`_NeedTag` (the pass then traces that size back, see ``_dyn_traceback``); anything the walk
cannot vouch for stops it with :class:`_Refuse`, which the pass reports as a ``PassFailedError``.

The pass and its documentation live in :mod:`mograph.passes.shape.make_dynamic`.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from mograph.passes.shape._dyn_base import ONE, _const, _NeedTag, _Refuse, _static_shape
from mograph.passes.shape._dyn_rules import rule_for

from mograph.shapes import Dim


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
        numbers included), which ``_dyn_rules._as_dim`` reads as a size where it is one."""
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
            rule = rule_for(node.op_type)
            if rule is None:
                raise _Refuse(node, f"no rule for {node.op_type}, which consumes a dynamic tensor")
            rule(self, node)
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
