"""Algebraic rules: ``neutral``, ``sub``, ``global-average-pool`` (exact); ``const-chain``, ``factor-norm``,
``scale-out``, ``cube`` (exact up to float rounding)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.canonicalize._base import (
    Build,
    CanonRule,
    Miss,
    broadcasts_into,
    keeps_shape,
    one,
    rank_of,
    scalar,
    single_use,
    std,
)

from mograph.patterns import constant_array
from mograph.shapes import Dim

if TYPE_CHECKING:
    from mograph.passes.fusion.canonicalize._engine import Canonicalizer

__all__ = ["CONST_CHAIN", "CUBE", "FACTOR_NORM", "GLOBAL_AVERAGE_POOL", "NEUTRAL", "SCALE_OUT", "SUB"]


def _neutral(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if len(n.inputs) != 2:
        return Miss(f"the {n.op_type} does not have two inputs")
    a, b = n.inputs
    if a is None or b is None:
        return Miss(f"the {n.op_type} has a missing input")
    unit = 1.0 if n.op_type in ("Mul", "Div") else 0.0
    pairs = [(a, b), (b, a)] if n.op_type in ("Mul", "Add") else [(a, b)]
    for v, k in pairs:
        arr = constant_array(k)
        if arr is None:
            if _broadcast_fill(k) == unit and v.dtype == n.outputs[0].dtype and constant_array(v) is None:
                # a constant broadcast to a shape computed at run time (Flax's RMSNorm subtracts
                # zeros of x's shape but the last dim): neutral if its dims go into v's
                kd, vd = c.shapes.dims(k), c.shapes.dims(v)
                if kd is not None and vd is not None and len(kd) <= len(vd) and all(
                        d == Dim() or (d is not None and d == e) for d, e in zip(kd, vd[len(vd) - len(kd):])):
                    return Build(v)
            continue
        if arr.size == 0 or not bool(np.all(arr == unit)) or v.dtype != n.outputs[0].dtype:
            continue
        if constant_array(v) is None and broadcasts_into(c, arr.shape, v):
            return Build(v)
    return Miss(f"no operand is a {'one' if n.op_type in ('Mul', 'Div') else 'zero'} that leaves the other's shape")


def _broadcast_fill(value: ir.Value | None, depth: int = 0) -> float | None:
    """The one value every element of ``value`` holds, when ``value`` is ``Expand``/``Reshape`` (any
    shape) of a constant whose elements are all equal; else None."""
    if value is None or depth > 8:
        return None
    arr = constant_array(value)
    if arr is not None:
        if arr.size == 0 or arr.dtype.kind not in "fiu":
            return None
        first = arr.reshape(-1)[0]
        return float(first) if bool(np.all(arr == first)) else None
    p = value.producer()
    if p is None or not std(p, "Expand", "Reshape") or not p.inputs:
        return None
    return _broadcast_fill(p.inputs[0], depth + 1)


def _cube(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    """A product of exactly three ``x`` and single constants, any grouping -> Pow(x, 3) [* constant]."""
    if len(n.inputs) != 2:
        return Miss("the Mul does not have two inputs")
    leaves: list[ir.Value] = []
    consts: list[np.ndarray] = []
    stack = list(n.inputs)
    inner = 0
    while stack:
        u = stack.pop()
        if u is None:
            return Miss("a missing input in the product")
        arr = constant_array(u)
        if arr is not None:
            if arr.size != 1:
                return Miss("a constant of more than one element in the product")
            consts.append(arr)
            continue
        p = u.producer()
        if std(p, "Mul") and p is not None and len(p.inputs) == 2 and single_use(u):
            stack.extend(p.inputs)
            inner += 1
            continue
        leaves.append(u)
    if len(leaves) != 3 or any(v is not leaves[0] for v in leaves) or inner == 0:
        return Miss("not a product of exactly three of one value (and constants)")
    x = leaves[0]
    if x.dtype is None or x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE,
                                          ir.DataType.BFLOAT16):
        return Miss(f"x is {x.dtype}, not a float type")
    # x*x*x and (x*x*x)*a are forms the GELU rule takes as they are: only a constant inside the product
    # (x * (x * (a * x)), as jax2tf writes it) needs the rewrite
    outer = [u for u in n.inputs if u is not None and constant_array(u) is not None]
    if len(consts) == len(outer):
        return Miss("no constant inside the product: the GELU rule takes it as it is")
    three = c.constant(np.array(3.0, dtype=x.dtype.numpy()), "three")
    out = n.outputs[0]
    cube = c.node("Pow", [x, three], x)
    nodes = [cube]
    value = cube.outputs[0]
    if consts:
        k = np.prod(np.stack([a.reshape(()) for a in consts])).astype(consts[0].dtype)
        if float(k) != 1.0:
            kv = c.constant(np.asarray(k).reshape(consts[0].shape), "cube_coef")
            mul = c.node("Mul", [value, kv], out)
            nodes.append(mul)
            b = Build(mul.outputs[0], nodes, [three, kv])
            return b
    return Build(value, nodes, [three])


def _sub(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if len(n.inputs) != 2 or None in n.inputs:
        return Miss("the Add does not have its two inputs")
    out = n.outputs[0]
    for a, nb in (n.inputs, n.inputs[::-1]):
        p = nb.producer()  # type: ignore[union-attr]
        b = None
        if std(p, "Neg") and p is not None:
            b = p.inputs[0]
        elif std(p, "Mul") and p is not None and len(p.inputs) == 2:
            for v, k in (p.inputs, p.inputs[::-1]):
                if k is not None and v is not None and scalar(k) == -1.0 and keeps_shape(c, v, k):
                    b = v
                    break
        if b is not None and a is not None and constant_array(b) is None:
            return one(c, "Sub", [a, b], out)
    return Miss("neither operand is Neg(b) or b * -1 of a non-constant b")


def _global_average_pool(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if not n.inputs or n.inputs[0] is None:
        return Miss("the GlobalAveragePool has no input")
    x = n.inputs[0]
    rank = rank_of(c, x)
    if rank != 3:
        return Miss(f"the input has rank {rank}, not 3")
    out = n.outputs[0]
    if c.opset >= 18:
        axes = c.constant(np.array([2], dtype=np.int64), "axes")
        b = one(c, "ReduceMean", [x, axes], out, keepdims=1)
        b.inits.append(axes)
        return b
    return one(c, "ReduceMean", [x], out, axes=[2], keepdims=1)


def _const_chain(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if len(n.inputs) != 2 or None in n.inputs:
        return Miss("the Mul does not have its two inputs")
    for inner, k2 in (n.inputs, n.inputs[::-1]):
        c2 = constant_array(k2)
        p = inner.producer()  # type: ignore[union-attr]
        if c2 is None or c2.size != 1 or not std(p, "Mul") or p is None or not single_use(inner):  # type: ignore[arg-type]
            continue
        for a, k1 in (p.inputs, p.inputs[::-1]):
            c1 = constant_array(k1)
            if c1 is None or c1.size != 1 or a is None or constant_array(a) is not None:
                continue
            if c1.dtype != c2.dtype or not (keeps_shape(c, a, k1) and keeps_shape(c, a, k2)):  # type: ignore[arg-type]
                continue
            prod = c.constant(np.asarray(c1 * c2).reshape(c2.shape).astype(c2.dtype), k2.name)  # type: ignore[union-attr]
            b = one(c, "Mul", [a, prod], n.outputs[0])
            b.inits.append(prod)
            return b
    return Miss("not (a * c1) * c2 of single constants of one dtype, the inner product read once")


def _factor_norm(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    """x * s + (-m * s + b)  ->  (x - m) * r * g + b, with s = r * g or s = r."""
    if len(n.inputs) != 2 or None in n.inputs:
        return Miss("the Add does not have its two inputs")
    for ax, rest in (n.inputs, n.inputs[::-1]):
        pa = ax.producer()  # type: ignore[union-attr]
        if not std(pa, "Mul") or pa is None or len(pa.inputs) != 2:
            continue
        # rest = Add(Mul(Neg(m), s), b) | Mul(Neg(m), s) | Sub(b, Mul(m, s))
        pr = rest.producer()  # type: ignore[union-attr]
        cands: list[tuple[ir.Value, ir.Value | None]] = []  # (the Mul(-m, s) value, b) ; sign handled below
        neg = True
        if std(pr, "Add") and pr is not None and len(pr.inputs) == 2:
            cands = [(pr.inputs[0], pr.inputs[1]), (pr.inputs[1], pr.inputs[0])]  # type: ignore[list-item]
        elif std(pr, "Mul"):
            cands = [(rest, None)]  # type: ignore[list-item]
        elif std(pr, "Sub") and pr is not None and len(pr.inputs) == 2:
            cands = [(pr.inputs[1], pr.inputs[0])]  # type: ignore[list-item]
            neg = False
        for ms, b in cands:
            pm = ms.producer() if ms is not None else None
            if not std(pm, "Mul") or pm is None or len(pm.inputs) != 2:
                continue
            if b is not None and constant_array(b) is None:
                continue
            for x, s in (pa.inputs, pa.inputs[::-1]):
                if s is None or x is None or s not in pm.inputs:
                    continue
                mv = pm.inputs[1] if pm.inputs[0] is s else pm.inputs[0]
                if mv is None:
                    continue
                if neg:
                    pneg = mv.producer()
                    if not std(pneg, "Neg") or pneg is None:
                        continue
                    m = pneg.inputs[0]
                else:
                    m = mv
                if m is None or m is x:
                    continue
                return _factored(c, n, x, m, s, b)
    return Miss("not x * s + (-m * s + b) (tf.nn.batch_normalization's form)")


def _factored(c: Canonicalizer, n: ir.Node, x: ir.Value, m: ir.Value, s: ir.Value, b: ir.Value | None) -> Build:
    out = n.outputs[0]
    d = c.node("Sub", [x, m], x)
    nodes = [d]
    ps = s.producer()
    r, g = s, None
    if std(ps, "Mul") and ps is not None and len(ps.inputs) == 2:
        for rr, gg in (ps.inputs, ps.inputs[::-1]):
            if gg is not None and rr is not None and constant_array(gg) is not None and constant_array(rr) is None:
                r, g = rr, gg
                break
    y = c.node("Mul", [d.outputs[0], r], x)
    nodes.append(y)
    if g is not None:
        y = c.node("Mul", [y.outputs[0], g], out if b is None else x)
        nodes.append(y)
    if b is not None:
        y = c.node("Add", [y.outputs[0], b], out)
        nodes.append(y)
    y.outputs[0].type, y.outputs[0].shape = out.type, out.shape
    return Build(y.outputs[0], nodes)


def _scale_out(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if len(n.inputs) != 2 or None in n.inputs:
        return Miss("the Mul does not have its two inputs")
    for a, inner in (n.inputs, n.inputs[::-1]):
        p = inner.producer()  # type: ignore[union-attr]
        if a is None or constant_array(a) is not None or not std(p, "Mul") or p is None or not single_use(inner):  # type: ignore[arg-type]
            continue
        for r, g in (p.inputs, p.inputs[::-1]):
            garr = constant_array(g)
            if r is None or g is None or garr is None or garr.size <= 1 or constant_array(r) is not None:
                continue
            ar = c.node("Mul", [a, r], a)
            out = c.node("Mul", [ar.outputs[0], g], n.outputs[0])
            return Build(out.outputs[0], [ar, out])
    return Miss("not a * (r * g) of a constant vector g, r * g read once")


#: The rewrites, tried in this order at each node.


NEUTRAL = CanonRule("neutral", ("Mul", "Div", "Add", "Sub"), _neutral)
GLOBAL_AVERAGE_POOL = CanonRule("global-average-pool", ("GlobalAveragePool",), _global_average_pool)
SUB = CanonRule("sub", ("Add",), _sub)
CONST_CHAIN = CanonRule("const-chain", ("Mul",), _const_chain, exact=False)
FACTOR_NORM = CanonRule("factor-norm", ("Add",), _factor_norm, exact=False)
SCALE_OUT = CanonRule("scale-out", ("Mul",), _scale_out, exact=False)
CUBE = CanonRule("cube", ("Mul",), _cube, exact=False)
