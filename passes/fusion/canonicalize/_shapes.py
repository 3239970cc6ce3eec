"""Rules on shapes: ``expand-noop``, ``keepdims`` and ``fold-broadcast`` (all exact).

The dims they compare and the elements of shape vectors computed at run time come from the canonicalizer's
shape query (:attr:`Canonicalizer.shapes`, the core's :class:`~mograph.shapes.ShapeQuery`): a dim is a
:class:`~mograph.shapes.Dim`, equal to another only where it is for every input the model accepts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.canonicalize._base import STD, Build, CanonRule, Miss, broadcasts_into, shape_entries

from mograph.patterns import constant_array
from mograph.shapes import Dim, Dims, as_ir_shape

if TYPE_CHECKING:
    from mograph.passes.fusion.canonicalize._engine import Canonicalizer

__all__ = ["EXPAND_NOOP", "FOLD_BROADCAST", "KEEPDIMS"]

#: Constants folded by ``fold-broadcast`` up to this many elements (scale and bias vectors).
_FOLD_LIMIT = 1 << 16
_ONE = Dim()
#: Elementwise ops ``keepdims`` carries a kept dim through.
_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Max", "Min", "Neg", "Sqrt", "Reciprocal", "Pow", "Abs", "Relu")


def _expand_noop(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if len(n.inputs) != 2 or None in n.inputs:
        return Miss("the Expand does not have its two inputs")
    v, shp = n.inputs
    arr = constant_array(shp)
    if v is None or constant_array(v) is not None:
        return Miss("expands a constant (fold-broadcast's case)")
    if arr is not None:
        shape = tuple(int(d) for d in arr.reshape(-1))
        if broadcasts_into(c, shape, v):
            return Build(v)
        return Miss(f"the shape {list(shape)} is not provably '{v.name}'s own")
    # a shape computed at run time: a no-op if every dim is 1 or provably v's own
    keys, dims = shape_entries(c, shp), c.shapes.dims(v)
    if keys is None or dims is None or len(keys) > len(dims):
        return Miss(f"the shape computed at run time is not provably '{v.name}'s own")
    tail = dims[len(dims) - len(keys):]
    if all(k == _ONE or k == d for k, d in zip(keys, tail)):
        return Build(v)
    return Miss(f"the shape computed at run time is not provably '{v.name}'s own")


def _keepdims(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    """Reshape/Unsqueeze adding a trailing 1 to f(reduction without kept dims) -> f(reduction with kept dims).

    The Reshape's shape may be computed at run time (a dynamic batch dim): it must provably be the
    reduced input's dims with the last one 1 (:func:`shape_entries`)."""
    if not n.inputs or n.inputs[0] is None:
        return Miss(f"the {n.op_type} has no data input")
    v = n.inputs[0]
    if not _reductions_below(v, 0):  # before any dim is asked: most Reshapes are not this, and need no sweep
        return Miss(f"'{v.name}' is not elementwise ops of last-axis reductions without kept dims")
    target: list[Dim] | None
    if n.op_type == "Reshape":
        allowzero = n.attributes.get("allowzero")
        target = shape_entries(c, n.inputs[1]) if len(n.inputs) > 1 else None
        literal_zero = allowzero is not None and int(allowzero.value)
        if target is not None and not literal_zero:
            target = _resolved(target, c.shapes.dims(v))
        if (target is None or not target or target[-1] != _ONE or literal_zero
                or any(k.is_literal and k.coef < 1 for k in target)):
            return Miss("the Reshape's shape is not provably dims ending in a 1")
    else:
        attr = n.attributes.get("axes")
        arr = constant_array(n.inputs[1]) if len(n.inputs) > 1 else None
        axes = [int(a) for a in attr.value] if attr is not None else (
            [int(a) for a in arr.reshape(-1)] if arr is not None else None)
        dims = c.shapes.dims(v)
        if dims is None or axes not in ([-1], [len(dims)]) or any(d is None for d in dims):
            return Miss("the Unsqueeze does not provably add a trailing axis")
        target = [*dims, _ONE]  # type: ignore[list-item]
    made: list[ir.Node] = []
    value = _hoist(c, v, target, made, 0)
    if value is None:
        return Miss(f"'{v.name}' is not elementwise ops of last-axis reductions without kept dims")
    return Build(value, made)


def _resolved(target: list[Dim], dims: Dims | None) -> list[Dim] | None:
    """A Reshape target (``allowzero`` 0) with its ``0`` entries (the input's dim at that place) and its one
    ``-1`` (the dim left over) read against ``dims``, the dims of the value reshaped, when that target is
    ``dims`` with a 1 appended (``view(-1, S, 1)`` of a reduction without kept dims); ``target`` itself when
    it has no such entry; ``None`` when it has them and is not that."""
    special = [i for i, k in enumerate(target) if k.is_literal and k.coef in (0, -1)]
    if not special:
        return target
    if dims is None or len(target) != len(dims) + 1 or any(d is None for d in dims) or target[-1] != _ONE:
        return None
    if sum(1 for i in special if target[i].coef == -1) > 1:
        return None
    # every entry but the -1 must be the input's dim at its place (a 0 is that by definition); the -1 is
    # then the one dim left, since the element count is the same on both sides
    for i, k in enumerate(target[:-1]):
        if i not in special and k != dims[i]:
            return None
    return [*dims, _ONE]  # type: ignore[list-item]


def _reductions_below(v: ir.Value, depth: int) -> bool:
    """What :func:`_hoist` needs of ``v``'s producers, by op types alone: elementwise ops (single-element
    constants as the other operands) of reductions without kept dims."""
    p = v.producer()
    if p is None or p.domain not in STD or depth > 12 or len(p.outputs) != 1:
        return False
    if p.op_type in ("ReduceSum", "ReduceMean"):
        keep = p.attributes.get("keepdims")
        return keep is not None and int(keep.value) == 0
    if p.op_type not in _ELEMENTWISE:
        return False
    for u in p.inputs:
        if u is None:
            return False
        arr = constant_array(u)
        if not (arr is not None and arr.size == 1) and not _reductions_below(u, depth + 1):
            return False
    return True


def _hoist(c: Canonicalizer, v: ir.Value, target: list[Dim], made: list[ir.Node], depth: int) -> ir.Value | None:
    """``v`` computed with a trailing kept dim (dims ``target``), or None; built nodes appended to ``made``.

    ``v`` is elementwise ops (single-element constants as the other operands) of reductions over the
    last axis without kept dims, each of an input whose dims are ``target`` but the last: that is what
    proves ``v``'s dims are ``target[:-1]``, whatever shapes inference gave (or did not give) it."""
    key = (id(v), tuple(target))
    hit = c.memo.get(key)
    if hit is not None and hit[0] is v:
        p = hit[1].producer()
        # in the graph, or made earlier in this same build (``x*x`` of one hoisted mean: one value, twice)
        if p is not None and (p.graph is c.graph or any(p is m for m in made)) and p.domain in STD:
            return hit[1]
    p = v.producer()
    if p is None or p.domain not in STD or depth > 12 or len(p.outputs) != 1:
        return None
    like = ir.Value(name=v.name, shape=as_ir_shape(tuple(target)), type=v.type)
    if p.op_type in ("ReduceSum", "ReduceMean"):
        x = p.inputs[0]
        keep = p.attributes.get("keepdims")
        xs: Dims | None = c.shapes.dims(x)
        if x is None or keep is None or int(keep.value) != 0 or xs is None or [*xs[:-1], _ONE] != target:
            return None
        attr = p.attributes.get("axes")
        arr = constant_array(p.inputs[1]) if len(p.inputs) > 1 and p.inputs[1] is not None else None
        axes = [int(a) for a in attr.value] if attr is not None else (
            [int(a) for a in arr.reshape(-1)] if arr is not None else None)
        if axes not in ([-1], [len(xs) - 1]):
            return None
        if x.shape is None:  # derived (inference stopped upstream): the rules' checks read x's rank and last dim
            x.shape = as_ir_shape(xs)
        attrs = {k: a.value for k, a in p.attributes.items()}
        attrs["keepdims"] = 1
        node = c.node(p.op_type, list(p.inputs), like, **attrs)  # type: ignore[arg-type]
    elif p.op_type in _ELEMENTWISE:
        args: list[ir.Value] = []
        for u in p.inputs:
            if u is None:
                return None
            arr = constant_array(u)
            if arr is not None and arr.size == 1 and arr.ndim <= len(target) - 1:
                args.append(u)
                continue
            h = _hoist(c, u, target, made, depth + 1)
            if h is None:
                return None
            args.append(h)
        node = c.node(p.op_type, args, like, **{k: a.value for k, a in p.attributes.items()})  # type: ignore[arg-type]
    else:
        return None
    made.append(node)
    c.memo[key] = (v, node.outputs[0])
    return node.outputs[0]


def _fold_broadcast(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if not n.inputs or n.inputs[0] is None:
        return Miss(f"the {n.op_type} has no data input")
    out = n.outputs[0]
    if out.is_graph_output() or n.inputs[0].is_graph_input():
        return Miss("reads a graph input or writes a graph output")
    src = constant_array(n.inputs[0])
    if src is None or src.size > _FOLD_LIMIT or n.inputs[0].const_value is None:
        return Miss(f"the data is not an initializer of at most {_FOLD_LIMIT} elements")
    cant = Miss(f"the {n.op_type}'s shape or axes are not constants it can fold with")
    try:
        if n.op_type == "Reshape":
            shape = constant_array(n.inputs[1]) if len(n.inputs) > 1 else None
            if shape is None or 0 in shape.tolist():
                return cant
            arr = src.reshape([int(d) for d in shape.tolist()])
        elif n.op_type == "Expand":
            shape = constant_array(n.inputs[1]) if len(n.inputs) > 1 else None
            if shape is None:
                return cant
            arr = src * np.ones([int(d) for d in shape.tolist()], dtype=src.dtype)
            if arr.size != src.size:
                return Miss("a real broadcast: folding it would grow the model")
        else:
            attr = n.attributes.get("axes")
            axes_arr = constant_array(n.inputs[1]) if len(n.inputs) > 1 and n.inputs[1] is not None else None
            axes = [int(a) for a in attr.value] if attr is not None else (
                [int(a) for a in axes_arr.reshape(-1)] if axes_arr is not None else None)
            if n.op_type == "Unsqueeze":
                if axes is None:
                    return cant
                rank = src.ndim + len(axes)
                shape_out = list(src.shape)
                for ax in sorted(a % rank for a in axes):
                    shape_out.insert(ax, 1)
                arr = src.reshape(shape_out)
            else:
                arr = np.squeeze(src, axis=tuple(axes)) if axes is not None else np.squeeze(src)
    except (ValueError, TypeError) as exc:
        return Miss(f"numpy cannot fold it: {exc}")
    value = c.constant(np.ascontiguousarray(arr), n.inputs[0].name)
    return Build(value, [], [value])


EXPAND_NOOP = CanonRule("expand-noop", ("Expand",), _expand_noop)
KEEPDIMS = CanonRule("keepdims", ("Reshape", "Unsqueeze"), _keepdims)
FOLD_BROADCAST = CanonRule("fold-broadcast", ("Reshape", "Unsqueeze", "Squeeze", "Expand"), _fold_broadcast)
