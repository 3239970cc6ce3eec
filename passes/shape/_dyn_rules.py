"""The per-op rules of ``make-dynamic``'s forward walk, one function each.

A rule gets the walk's state (:class:`~mograph.passes.shape._dyn_symbolic._Analysis`) and one node that
consumes a dynamic tensor.  It gives the node's outputs their symbolic sizes (``an.set``), records the
symbolic contents of small int shape tensors (``an.elems``), plans the rewrite of a constant that bakes an
old size in (``an.actions``), and raises :class:`_NeedTag` (a static operand with the old size of a dynamic
dim: trace it back) or :class:`_Refuse` (anything it cannot vouch for).  :func:`rule_for` picks the rule of
an op: a class rule (shape-preserving, broadcasting, reductions, pools) or the one named after the op.

These are rules about *rewriting* sizes, with refusals; what an op's output shape is, in general, is the
core's :mod:`mograph.shapes` table.  Where a rule here would only repeat a registered core rule (the dims move,
nothing is merged, no size is baked in: ``Transpose``, ``GatherElements``, ``Shape``'s elements), the walk asks
the core rule (:func:`_core`, through :class:`_Facts`, which answers what a core rule asks from the walk's
state).  The others stay here because they do what the core's cannot:

- they check sizes against the *export*: the walk knows every symbol's size in the exported model, and a static
  operand of the same size as a dynamic dim (``Add``, ``MatMul``, ``Concat``, ``Gemm``, ``Expand``, ``Tile``, pools)
  is a baked size to trace back (``_NeedTag``), not a broadcast;
- they refuse what holds only at the export size (``Squeeze`` of a dynamic axis that is 1 there, ``Split``/
  ``Slice``/``Gather`` at fixed positions of a dynamic axis, axes computed at run time);
- they plan rewrites of the constants that bake a size in (``Reshape``, ``Expand``, ``Tile``, ``Resize``, ``Range``,
  ``Slice``, ``Gather`` of every index, ``GatherND``, ``Pad``, ``ConstantOfShape``), placing symbols in row-major
  order (ordered :class:`~mograph.shapes.Dim` products, where the core keeps normal forms);
- they track small int shape tensors through raw constants (``0``, ``-1``) that a reshape target holds, and
  read ranks the core would need a version-specific rule for from ONNX inference (``Unsqueeze`` at any opset).

Each rule has a case in ``tests/passes/shape/test_dyn_rules.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir
from mograph.passes.shape._dyn_base import (
    _BROADCAST,
    _GLOBAL_POOL,
    _POOL,
    _REDUCE,
    _UNARY,
    INT64_MAX,
    ONE,
    _Action,
    _attr,
    _const,
    _input,
    _Refuse,
)

from mograph.shapes import Dim, Dims, builtin_rules, node_version

if TYPE_CHECKING:
    from mograph.passes.shape._dyn_symbolic import _Analysis

__all__ = ["RULES", "rule_for"]

Rule = Callable[["_Analysis", ir.Node], None]


def rule_for(op_type: str) -> Rule | None:
    """The rule of ``op_type``: its class's rule, else the one named after it, else ``None``."""
    if op_type in _UNARY:
        return r_unary
    if op_type in _BROADCAST:
        return r_broadcast
    if op_type in _REDUCE or op_type in ("ArgMax", "ArgMin"):
        return r_reduce
    if op_type in _POOL:
        return r_pool
    if op_type in _GLOBAL_POOL:
        return r_global_pool
    return RULES.get(op_type.lower())


_CORE = builtin_rules()


class _Facts:
    """The walk's state as the core shape rules it uses ask it (``dims``, ``ints``): a value's symbolic dims (its
    static ones where it is not dynamic; a refusal where those are unknown), a constant's ints."""

    def __init__(self, an: _Analysis, node: ir.Node) -> None:
        self.an, self.node = an, node

    def dims(self, value: ir.Value | None) -> Dims | None:
        return None if value is None else tuple(self.an.dims(self.node, value))

    def ints(self, value: ir.Value | None) -> list[int] | None:
        arr = _const(value)
        return None if arr is None or arr.dtype.kind not in "iu" or arr.ndim > 1 else [int(x) for x in arr.reshape(-1)]


def _core(an: _Analysis, node: ir.Node, kind: str = "dims") -> Any:
    """What the registered core rule of ``node`` (its domain, op and opset version) concludes from the walk's
    state (:class:`_Facts`); a refusal where there is no such rule or it cannot tell."""
    rule = _CORE.lookup(node.domain, node.op_type, node_version(node, dict(an.graph.opset_imports)))
    fn = getattr(rule, kind) if rule is not None else None
    result = fn(node, _Facts(an, node)) if fn is not None else None  # type: ignore[operator]
    if result is None or (kind == "dims" and any(d is None or any(m is None for m in d) for d in result)):
        raise _Refuse(node, f"the shape rule of {node.op_type} cannot tell its output's dims here")
    return result


def r_unary(an: _Analysis, node: ir.Node) -> None:
    src = _input(node, 0)
    if src in an.elems and node.op_type in ("Cast", "Identity", "CastLike"):
        an.elems[node.outputs[0]] = an.elems[src]
    if src in an.elems and node.op_type not in ("Cast", "Identity", "CastLike"):
        an.elems[node.outputs[0]] = [None] * len(an.elems[src])
    dims = an.dims(node, src)
    if node.op_type == "PRelu":
        dims = an.broadcast(node, [_input(node, i) for i in range(len(node.inputs))])
    an.set(node, node.outputs[0], dims)
    if node.op_type in ("LayerNormalization", "SimplifiedLayerNormalization"):
        axis = _attr(node, "axis", -1) % max(len(dims), 1)
        reduced = [d if i < axis else ONE for i, d in enumerate(dims)]
        for out in node.outputs[1:]:
            if out is not None and out.shape is not None:
                an.set(node, out, reduced)
    elif node.op_type == "Dropout" and len(node.outputs) > 1 and node.outputs[1] is not None:
        an.set(node, node.outputs[1], dims)


def r_broadcast(an: _Analysis, node: ir.Node) -> None:
    ins = [i for i in node.inputs if i is not None]
    if any(i in an.elems for i in ins):
        _elems_arith(an, node)
    an.set(node, node.outputs[0], an.broadcast(node, ins))


def _elems_arith(an: _Analysis, node: ir.Node) -> None:
    out = node.outputs[0]
    vals = [an.elem_values(i) for i in node.inputs]
    n = max(len(v) for v in vals if v is not None)
    known = [v for v in vals if v is not None]
    if node.op_type == "Mul" and len(vals) == 2 and len(known) == 2:
        res: list[Dim | None] = []
        for k in range(n):
            a, b = (v[k] if len(v) > 1 else v[0] for v in known)
            a, b = _as_dim(a), _as_dim(b)
            res.append(None if a is None or b is None else Dim(a + b))
        an.elems[out] = res
    else:
        an.elems[out] = [None] * n


def _as_dim(e: Any) -> Dim | None:
    if e is None:
        return None
    if len(e) == 2 and e[0] == "#":
        return Dim.lit(e[1]) if e[1] > 0 else None
    return e


def r_matmul(an: _Analysis, node: ir.Node) -> None:
    a, b = _input(node, 0), _input(node, 1)
    da, db = an.dims(node, a), an.dims(node, b)
    if len(da) < 2 or len(db) < 2:
        raise _Refuse(node, "MatMul with a 1-D operand on a dynamic tensor is not supported")
    an.merge(node, [(a, len(da) - 1, da[-1]), (b, len(db) - 2, db[-2])], strict=True)
    ra, rb = len(da) - 2, len(db) - 2
    rank = max(ra, rb)
    batch: list[Dim] = []
    for pos in range(rank):
        cands = []
        for v, ds, r in ((a, da, ra), (b, db, rb)):
            axis = r - rank + pos
            if axis >= 0:
                cands.append((v, axis, ds[axis]))
        batch.append(an.merge(node, cands))
    an.set(node, node.outputs[0], batch + [da[-2], db[-1]])


def r_gemm(an: _Analysis, node: ir.Node) -> None:
    a, b = _input(node, 0), _input(node, 1)
    da, db = an.dims(node, a), an.dims(node, b)
    if _attr(node, "transA", 0):
        da = da[::-1]
    if _attr(node, "transB", 0):
        db = db[::-1]
    an.merge(node, [(a, 1, da[1]), (b, 0, db[0])], strict=True)
    out = [da[0], db[1]]
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        c = node.inputs[2]
        dc = an.dims(node, c)
        for pos in range(2):
            axis = len(dc) - 2 + pos
            if axis >= 0:
                out[pos] = an.merge(node, [(node.outputs[0], pos, out[pos]), (c, axis, dc[axis])])
    an.set(node, node.outputs[0], out)


def r_transpose(an: _Analysis, node: ir.Node) -> None:
    """The core's ``Transpose`` rule: the dims permuted."""
    an.set(node, node.outputs[0], list(_core(an, node)[0]))


def _axes(an: _Analysis, node: ir.Node, rank: int, input_index: int = 1, attr: str = "axes") -> list[int] | None:
    axes = _attr(node, attr)
    if axes is None and len(node.inputs) > input_index and node.inputs[input_index] is not None:
        arr = _const(node.inputs[input_index])
        if arr is None:
            raise _Refuse(node, "its axes are not constant")
        axes = arr.reshape(-1).tolist()
    return None if axes is None else [int(a) % rank for a in axes]


def r_unsqueeze(an: _Analysis, node: ir.Node) -> None:
    src, out = _input(node, 0), node.outputs[0]
    dims = an.dims(node, src)
    rank = len(an.static(node, out))
    axes = sorted(_axes(an, node, rank) or [])
    it = iter(dims)
    new = [ONE if i in axes else next(it) for i in range(rank)]
    an.set(node, out, new)
    if src in an.elems:
        an.elems[out] = an.elems[src]


def r_squeeze(an: _Analysis, node: ir.Node) -> None:
    src, out = _input(node, 0), node.outputs[0]
    dims = an.dims(node, src)
    axes = _axes(an, node, len(dims))
    if axes is None:
        axes = [i for i, d in enumerate(dims) if an.num(d) == 1]
    for a in axes:
        if dims[a].has_sym:
            raise _Refuse(node, f"it squeezes the dynamic axis {a} ({dims[a]}), which is 1 only in the export")
    an.set(node, out, [d for i, d in enumerate(dims) if i not in axes])
    if src in an.elems:
        an.elems[out] = an.elems[src]


def r_flatten(an: _Analysis, node: ir.Node) -> None:
    dims = an.dims(node, _input(node, 0))
    axis = _attr(node, "axis", 1) % (len(dims) + 1) if dims else 0
    left = Dim(tuple(f for d in dims[:axis] for f in d))
    right = Dim(tuple(f for d in dims[axis:] for f in d))
    an.set(node, node.outputs[0], [left, right])


def r_concat(an: _Analysis, node: ir.Node) -> None:
    ins = [i for i in node.inputs if i is not None]
    out = node.outputs[0]
    if any(i in an.elems for i in ins):
        vals: list[Any] = []
        for i in ins:
            ev = an.elem_values(i)
            if ev is None:
                ev = [None] * int(np.prod(an.static(node, i)))
            vals.extend(ev)
        an.elems[out] = vals
    all_dims = [an.dims(node, i) for i in ins]
    rank = len(all_dims[0])
    axis = _attr(node, "axis", 0) % rank
    new: list[Dim] = []
    for pos in range(rank):
        if pos == axis:
            parts = [d[pos] for d in all_dims if an.num(d[pos]) != 0]
            if not any(p.has_sym for p in parts):
                new.append(Dim.lit(sum(an.num(p) for p in parts)))
            elif len(parts) == 1:
                new.append(parts[0])
            elif len(set(parts)) == 1:
                new.append(Dim((len(parts),) + parts[0]))
            else:
                new.append(an.fresh(node, out, pos))
        else:
            cands = [(i, pos, d[pos]) for i, d in zip(ins, all_dims)]
            new.append(an.merge(node, cands, strict=True))
    an.set(node, out, new)


def r_split(an: _Analysis, node: ir.Node) -> None:
    src = _input(node, 0)
    dims = an.dims(node, src)
    axis = _attr(node, "axis", 0) % len(dims)
    if dims[axis].has_sym:
        raise _Refuse(node, f"it splits the dynamic axis {axis} ({dims[axis]}) into sizes fixed at export")
    for out in node.outputs:
        if out is not None:
            shape = an.static(node, out)
            an.set(node, out, [Dim.lit(shape[i]) if i == axis else d for i, d in enumerate(dims)])


def r_shape(an: _Analysis, node: ir.Node) -> None:
    """The core's ``Shape`` elements rule: the input's dims from ``start`` to ``end``."""
    an.elems[node.outputs[0]] = list(_core(an, node, "values")[1])


def r_size(an: _Analysis, node: ir.Node) -> None:
    an.elems[node.outputs[0]] = [None]


def r_gather(an: _Analysis, node: ir.Node) -> None:
    data, idx, out = _input(node, 0), _input(node, 1), node.outputs[0]
    ddims = an.dims(node, data)
    axis = _attr(node, "axis", 0) % len(ddims)
    idims = an.dims(node, idx)
    if ddims[axis].has_sym:
        arr = _const(idx)
        if arr is None:
            raise _Refuse(node, f"it gathers along the dynamic axis {axis} with indices computed at run time")
        n = an.num(ddims[axis])
        if n > 1 and arr.size == n and np.array_equal(arr.reshape(-1), np.arange(n)):
            # Every index once, in order: a reshape of the axis into the indices' shape.
            new_idx = _assign_reshape(an, node, [ddims[axis]], [int(s) for s in arr.shape])
            an.set(node, out, ddims[:axis] + new_idx + ddims[axis + 1:])
            pieces = [d if d.has_sym else an.num(d) for d in new_idx]
            an.actions.append(_Action("Gather", node, 1, pieces, extra=ddims[axis]))
            return
        bad = [int(i) for i in arr.reshape(-1) if n == 1 or int(i) == n - 1]
        if bad:
            raise _Refuse(node, f"it gathers index {bad[0]} of the dynamic axis {axis} ({ddims[axis]}, size "
                          f"{n} in the export): a fixed position and 'the last one' cannot be told apart")
    an.set(node, out, ddims[:axis] + idims + ddims[axis + 1:])
    if data in an.elems:
        arr = _const(idx)
        ev = an.elems[data]
        if arr is None:
            an.elems[out] = [None] * max(1, int(np.prod(an.static(node, out))))
        else:
            an.elems[out] = [ev[int(i)] for i in arr.reshape(-1)]


def r_reshape(an: _Analysis, node: ir.Node) -> None:
    data, target, out = _input(node, 0), _input(node, 1), node.outputs[0]
    ddims = an.dims(node, data)
    if data in an.elems:
        an.elems[out] = an.elems[data]
    zero_literal = bool(_attr(node, "allowzero", 0))
    if target in an.elems:
        new = []
        for j, e in enumerate(an.elems[target]):
            d = _as_dim(e)
            if e is not None and len(e) == 2 and e[0] == "#" and e[1] == 0:
                d = ONE if zero_literal else ddims[j]
                if zero_literal:
                    raise _Refuse(node, "Reshape with allowzero=1 and a 0 entry on a dynamic tensor")
            if d is None:
                d = an.fresh(node, out, j)
            new.append(d)
        an.set(node, out, new)
        return
    arr = _const(target)
    if arr is None:
        raise _Refuse(node, "its target shape is computed in a way the pass does not track")
    if not any(d.has_sym for d in ddims):
        an.set(node, out, [Dim.lit(s) for s in an.static(node, out)])
        return
    entries = [int(x) for x in arr.reshape(-1)]
    if zero_literal and 0 in entries:
        raise _Refuse(node, "Reshape with allowzero=1 and a 0 entry on a dynamic tensor")
    new = _assign_reshape(an, node, ddims, entries)
    an.set(node, out, new)
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
        an.actions.append(_Action("Reshape", node, 1, pieces))


def _assign_reshape(an: _Analysis, node: ir.Node, ddims: list[Dim], entries: list[int]) -> list[Dim]:
    """Place the input's symbols on the target's entries (see the module docstring)."""
    factors = [f for d in ddims for f in d]
    syms = [f for f in factors if isinstance(f, str)]
    runs = [1]
    for f in factors:
        if isinstance(f, str):
            runs.append(1)
        else:
            runs[-1] *= f
    total = math.prod(an.num(d) for d in ddims)
    values: list[int] = []
    wild = [j for j, e in enumerate(entries) if e == -1]
    for j, e in enumerate(entries):
        values.append(an.num(ddims[j]) if e == 0 else e)
    if wild:
        rest = math.prod(v for j, v in enumerate(values) if j != wild[0])
        values[wild[0]] = total // rest if rest else 0
    k, m = len(syms), len(entries)
    results: dict[tuple, int] = {}
    for assign in itertools.combinations_with_replacement(range(m), k):
        res = _try_assign(an, syms, runs, values, assign)
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
    if len(top) > 1 and len({_without_unit_syms(an, r) for r in top}) == 1:
        # Only where a size-1 symbol (batch 1) sits among literal 1s differs: take the outermost placement.
        top = top[:1]
    if len(top) > 1:
        shown = " or ".join(str([str(d) for d in r]) for r in top[:3])
        raise _Refuse(node, f"its constant target {entries} is ambiguous for input dims "
                      f"{[str(d) for d in ddims]}: it reads as {shown}")
    return list(top[0])


def _without_unit_syms(an: _Analysis, dims: tuple) -> tuple:
    """``dims`` with every dim that is a literal 1 apart from size-1 symbols read as 1: placements that
    differ there alone tie.  A size-1 symbol inside a larger dim stays: ``[3 * batch, 4, 2]`` and
    ``[3, 4 * batch, 2]`` (PyTorch's multi-head attention reshaping ``[L, batch, 8]`` to ``[L, batch *
    heads, 2]``, exported at batch 1 as ``[3, 4, 2]``) are different models at batch 2, not a tie."""
    def unit(d: Dim) -> bool:
        return all(an.sizes[f] == 1 if isinstance(f, str) else f == 1 for f in d)
    return tuple(ONE if unit(d) else d for d in dims)


def _try_assign(an: _Analysis, syms: list[str], runs: list[int], values: list[int], assign: tuple[int, ...]) -> list[Dim] | None:
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
        symprod = math.prod(an.sizes[x] for x in syms[p:q + 1])
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


def r_expand(an: _Analysis, node: ir.Node) -> None:
    data, shape, out = _input(node, 0), _input(node, 1), node.outputs[0]
    ddims = an.dims(node, data)
    if shape in an.elems:
        entries = [_as_dim(e) for e in an.elems[shape]]
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
                cands.append((shape, ej, e if e is not None else an.fresh(node, out, pos)))
            new.append(an.merge(node, cands))
        an.set(node, out, new)
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
            n = an.num(d)
            if ent == 1:
                piece = 1
            elif ent == n:
                piece, needs = 1, True
            else:
                raise _Refuse(node, f"it expands the dynamic dim {d} (size {n} in the export) to {ent}")
            new.append(d)
        else:
            piece = ent
            new.append(Dim.lit(max(ent, an.num(d))))
        if ej >= 0:
            pieces.append(piece)
    an.set(node, out, new)
    if needs:
        an.actions.append(_Action("Expand", node, 1, pieces))


def r_resize(an: _Analysis, node: ir.Node) -> None:
    """``Resize``: ``scales`` of 1 keep a dynamic axis (batch, channels),
    other scales give a derived size; constant ``sizes`` entries equal to a dynamic axis's export
    size are rewritten to that axis's run-time size (``Concat(Shape(x)[:2], sizes[2:])``)."""
    data, out = _input(node, 0), node.outputs[0]
    dims = an.dims(node, data)
    rank = len(dims)
    axes = [int(a) % rank for a in _attr(node, "axes", None) or range(rank)]
    if any(an.tagged(v) for v in node.inputs[1:3]):
        raise _Refuse(node, "its roi or scales are computed from a dynamic tensor")
    sizes = node.inputs[3] if len(node.inputs) > 3 else None
    sizes_const = _const(sizes)
    if sizes is not None and (an.tagged(sizes) or sizes_const is not None and sizes_const.size):
        policy = _attr(node, "keep_aspect_ratio_policy", "stretch")
        policy = policy.decode() if isinstance(policy, bytes) else policy
        entries: list[Dim | None]
        if sizes in an.elems:
            entries = [_as_dim(e) for e in an.elems[sizes]]
            arr = None
        else:
            arr = sizes_const
            if arr is None:
                raise _Refuse(node, "its sizes are computed in a way the pass does not track")
            entries = [Dim.lit(int(x)) for x in arr.reshape(-1)]
        if len(entries) != len(axes):
            raise _Refuse(node, f"it has {len(entries)} sizes for {len(axes)} axes")
        static_out = an.static(node, out)
        new = list(dims)
        pieces: list[Any] = []
        needs = False
        for ax, e in zip(axes, entries):
            d = dims[ax]
            if not d.has_sym:
                new[ax] = e if e is not None and e.has_sym else Dim.lit(static_out[ax])
                pieces.append(an.num(e) if e is not None and not e.has_sym else e)
                continue
            if policy != "stretch":
                raise _Refuse(node, f"keep_aspect_ratio_policy={policy} with sizes on the dynamic dim {d}")
            if e is not None and e.has_sym:
                if e != d:
                    raise _Refuse(node, f"it resizes the dynamic dim {d} to {e}")
            elif e is None or an.num(e) != an.num(d):
                raise _Refuse(node, f"it resizes the dynamic dim {d} (size {an.num(d)} in the export) "
                              "to a fixed size")
            else:
                needs = True  # the export size, baked in: follow the input's run-time size
            new[ax] = d
            pieces.append(d)
        an.set(node, out, new)
        if needs and arr is not None:
            an.actions.append(_Action("Resize", node, 3, pieces))
        return
    opset = an.graph.opset_imports.get("", an.graph.opset_imports.get("ai.onnx", 11))
    scales_at = 1 if opset < 11 else 2  # Resize-10 is (X, scales); from 11 (X, roi, scales, sizes)
    scales_v = node.inputs[scales_at] if len(node.inputs) > scales_at else None
    scales = _const(scales_v) if scales_v is not None else None
    if scales is None or scales.size == 0:
        raise _Refuse(node, "it has neither constant scales nor sizes")
    if scales.size != len(axes):
        raise _Refuse(node, f"it has {scales.size} scales for {len(axes)} axes")
    static_out = an.static(node, out)
    new = list(dims)
    for ax, scale in zip(axes, scales.reshape(-1).tolist()):
        d = dims[ax]
        if not d.has_sym:
            new[ax] = Dim.lit(static_out[ax])
        elif scale == 1.0:
            new[ax] = d  # batch and channels keep their size
        else:
            new[ax] = an.fresh(node, out, ax)  # floor(size * scale): a derived size
    an.set(node, out, new)


def r_constantofshape(an: _Analysis, node: ir.Node) -> None:
    shape, out = _input(node, 0), node.outputs[0]
    entries = an.elems.get(shape, [])
    new = []
    for j, e in enumerate(entries):
        d = _as_dim(e)
        new.append(d if d is not None else an.fresh(node, out, j))
    an.set(node, out, new)


def r_tile(an: _Analysis, node: ir.Node) -> None:
    data, reps, out = _input(node, 0), _input(node, 1), node.outputs[0]
    ddims = an.dims(node, data)
    ev = an.elem_values(reps)
    if ev is None:
        raise _Refuse(node, "its repeats are computed in a way the pass does not track")
    new = []
    for j, (d, e) in enumerate(zip(ddims, ev)):
        r = _as_dim(e)
        new.append(Dim(d + r) if r is not None else an.fresh(node, out, j))
    an.set(node, out, new)


def r_range(an: _Analysis, node: ir.Node) -> None:
    start, limit, delta = (an.elem_values(i) for i in node.inputs[:3])
    out = node.outputs[0]
    size = _as_dim(limit[0]) if start == [("#", 0)] and delta == [("#", 1)] and limit is not None else None
    if size is not None:
        an.set(node, out, [size])
    else:
        an.set(node, out, [an.fresh(node, out, 0)])


def r_slice(an: _Analysis, node: ir.Node) -> None:
    data, out = _input(node, 0), node.outputs[0]
    ddims = an.dims(node, data)
    params = [_const(node.inputs[i]) if len(node.inputs) > i and node.inputs[i] is not None else None
              for i in range(1, 5)]
    starts, ends = params[0], params[1]
    if starts is None or ends is None or (len(node.inputs) > 3 and node.inputs[3] is not None and params[2] is None) \
            or (len(node.inputs) > 4 and node.inputs[4] is not None and params[3] is None):
        raise _Refuse(node, "its bounds are computed in a way the pass does not track")
    starts_l, ends_l = starts.reshape(-1).tolist(), ends.reshape(-1).tolist()
    axes = [int(a) % len(ddims) for a in params[2].reshape(-1)] if params[2] is not None else list(range(len(starts_l)))
    steps = params[3].reshape(-1).tolist() if params[3] is not None else [1] * len(axes)
    new = [Dim.lit(s) for s in an.static(node, out)]
    new_ends, needs = list(ends_l), False
    for i, d in enumerate(ddims):
        if i not in axes:
            new[i] = d
            continue
        if not d.has_sym:
            continue
        k = axes.index(i)
        s, e, st, n = int(starts_l[k]), int(ends_l[k]), int(steps[k]), an.num(d)
        if st != 1:
            raise _Refuse(node, f"it slices the dynamic axis {i} ({d}) with step {st}")
        if s >= n:
            raise _Refuse(node, f"it slices the dynamic axis {i} ({d}) from {s}, past its export size {n}")
        if e >= n:
            if e < INT64_MAX // 2:
                new_ends[k], needs = INT64_MAX, True
            new[i] = d if s == 0 else an.fresh(node, out, i)
        elif e < 0 or s < 0:
            new[i] = an.fresh(node, out, i)
        else:
            raise _Refuse(node, f"it slices the dynamic axis {i} ({d}) up to {e} (size {n} in the export): "
                          f"a fixed count and 'size - {n - e}' cannot be told apart")
    an.set(node, out, new)
    if data in an.elems and len(ddims) == 1:
        ev = an.elems[data]
        an.elems[out] = ev[slice(int(starts_l[0]), int(ends_l[0]), int(steps[0]))]
    if needs:
        an.actions.append(_Action("Slice", node, 2, [int(x) for x in new_ends], dtype=_input(node, 2).dtype or ir.DataType.INT64))


def r_reduce(an: _Analysis, node: ir.Node) -> None:
    dims = an.dims(node, _input(node, 0))
    keep = _attr(node, "keepdims", 1)
    axes: list[int] | None
    if node.op_type in ("ArgMax", "ArgMin"):
        axes = [_attr(node, "axis", 0) % len(dims)]
    else:
        axes = _axes(an, node, len(dims))
        if axes is None:
            axes = [] if _attr(node, "noop_with_empty_axes", 0) else list(range(len(dims)))
    new = [(ONE if i in axes else d) for i, d in enumerate(dims) if keep or i not in axes]
    an.set(node, node.outputs[0], new)


def r_pool(an: _Analysis, node: ir.Node) -> None:
    dims = an.dims(node, _input(node, 0))
    if dims[1].has_sym:
        raise _Refuse(node, "the channel axis is dynamic")
    for w in node.inputs[1:]:
        if w is not None and w in an.tags:
            raise _Refuse(node, "its weights are dynamic")
    out = node.outputs[0]
    static = an.static(node, out)
    new = [dims[0], Dim.lit(static[1])]
    for i in range(2, len(static)):
        new.append(an.fresh(node, out, i) if dims[i].has_sym else Dim.lit(static[i]))
    an.set(node, out, new)
    for extra in node.outputs[1:]:
        if extra is not None:
            an.set(node, extra, new)


def r_global_pool(an: _Analysis, node: ir.Node) -> None:
    dims = an.dims(node, _input(node, 0))
    if dims[1].has_sym:
        raise _Refuse(node, "the channel axis is dynamic")
    an.set(node, node.outputs[0], [dims[0], dims[1]] + [ONE] * (len(dims) - 2))


def r_pad(an: _Analysis, node: ir.Node) -> None:
    dims = an.dims(node, _input(node, 0))
    pads = _const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if pads is None:
        pads = np.asarray(_attr(node, "pads", []) or [])
    out = node.outputs[0]
    static = an.static(node, out)
    axes = _axes(an, node, len(dims), input_index=3) or list(range(len(dims)))
    p = pads.reshape(-1).tolist()
    new = []
    for i, d in enumerate(dims):
        if i in axes and d.has_sym:
            k = axes.index(i)
            new.append(d if p[k] == 0 and p[k + len(axes)] == 0 else an.fresh(node, out, i))
        else:
            new.append(d if d.has_sym else Dim.lit(static[i]))
    an.set(node, out, new)


def r_topk(an: _Analysis, node: ir.Node) -> None:
    dims = an.dims(node, _input(node, 0))
    axis = _attr(node, "axis", -1) % len(dims)
    for out in node.outputs:
        static = an.static(node, out)
        an.set(node, out, [Dim.lit(static[i]) if i == axis else d for i, d in enumerate(dims)])


def r_gathernd(an: _Analysis, node: ir.Node) -> None:
    data, idx, out = _input(node, 0), _input(node, 1), node.outputs[0]
    ddims = an.dims(node, data)
    arr = _const(idx)
    if arr is None or _attr(node, "batch_dims", 0) != 0 or idx in an.tags:
        raise _Refuse(node, "GatherND with indices computed at run time on a dynamic tensor")
    k = arr.shape[-1]
    lead = [an.num(d) for d in ddims[:k]]
    grid = np.stack(np.unravel_index(np.arange(math.prod(lead)), lead), axis=-1) if lead else None
    if grid is None or arr.reshape(-1, k).shape != grid.shape or not np.array_equal(arr.reshape(-1, k), grid):
        if any(d.has_sym for d in ddims[:k]):
            raise _Refuse(node, "GatherND picks fixed positions along a dynamic axis")
        an.set(node, out, list(an.dims(node, idx)[:-1]) + ddims[k:])
        return
    # Every position once, in order: a reshape of the leading dims into the indices' shape.
    merged = Dim(tuple(f for d in ddims[:k] for f in d))
    new = _assign_reshape(an, node, [merged], [int(s) for s in arr.shape[:-1]]) + ddims[k:]
    an.set(node, out, new)
    pieces = [d if d.has_sym else an.num(d) for d in new]
    an.actions.append(_Action("GatherND", node, 0, pieces))


def r_gatherelements(an: _Analysis, node: ir.Node) -> None:
    """The core's ``GatherElements`` rule: the indices' dims."""
    an.set(node, node.outputs[0], list(_core(an, node)[0]))


def r_scatterelements(an: _Analysis, node: ir.Node) -> None:
    an.set(node, node.outputs[0], an.dims(node, _input(node, 0)))

r_scatternd = r_scatterelements


#: Every rule by name (``r_<name>``); an op without a class rule takes the one named after it in lower case.
RULES: dict[str, Rule] = {name[2:]: fn for name, fn in list(globals().items()) if name.startswith("r_")}
