"""Rules on casts and copies: ``identity``, ``cast-noop``, ``cast-cse``, ``cast-island`` (all exact)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx_ir as ir
from mograph.passes.fusion.canonicalize._base import Build, CanonRule, Miss, one, single_use, std

from mograph.patterns import constant_array

if TYPE_CHECKING:
    from mograph.passes.fusion.canonicalize._engine import Canonicalizer

__all__ = ["CAST_CSE", "CAST_ISLAND", "CAST_NOOP", "IDENTITY"]

#: (narrow, wide) pairs: a cast to ``wide`` and back to ``narrow`` gives every value back.
WIDEN = {
    (ir.DataType.FLOAT16, ir.DataType.FLOAT),
    (ir.DataType.BFLOAT16, ir.DataType.FLOAT),
    (ir.DataType.FLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.BFLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.FLOAT, ir.DataType.DOUBLE),
}
#: Ops the fp16 converter keeps in float32 whose result is exact in the narrow type too.
_EXACT_OPS = ("Max", "Min", "Neg", "Abs", "Relu")


def _identity(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if n.inputs and n.inputs[0] is not None:
        return Build(n.inputs[0])
    return Miss("the Identity has no input")


def _cast_noop(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if not n.inputs or n.inputs[0] is None:
        return Miss("the Cast has no input")
    to = n.attributes.get("to")
    if to is None:
        return Miss("the Cast has no 'to'")
    target = ir.DataType(to.value)
    x = n.inputs[0]
    if x.dtype == target:
        return Build(x)
    p = x.producer()
    if std(p, "Cast") and p is not None and p.inputs and p.inputs[0] is not None:
        x0 = p.inputs[0]
        if x0.dtype == target and (target, x.dtype) in WIDEN:
            return Build(x0)
        return Miss(f"Cast({x0.dtype} -> {x.dtype} -> {target}) does not widen and narrow back")
    return Miss(f"casts {x.dtype} to {target}, not a no-op")


def _cast_cse(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if not n.inputs or n.inputs[0] is None:
        return Miss("the Cast has no input")
    to = n.attributes.get("to")
    here = c.position.get(id(n))
    if to is None or here is None:
        return Miss("the Cast has no 'to'" if to is None else "the Cast was not in the graph when rewriting began")
    best: tuple[int, ir.Node] | None = None
    for user, _ in n.inputs[0].uses():
        at = c.position.get(id(user))
        if user is n or at is None or at >= here or not std(user, "Cast"):
            continue
        t = user.attributes.get("to")
        if t is not None and t.value == to.value and (best is None or at < best[0]):
            best = (at, user)
    if best is None:
        return Miss("no earlier Cast of the same value to the same type")
    return Build(best[1].outputs[0])


def _cast_island(c: Canonicalizer, n: ir.Node) -> Build | Miss:
    if not n.inputs or n.inputs[0] is None:
        return Miss("the Cast has no input")
    to = n.attributes.get("to")
    mid = n.inputs[0]
    p = mid.producer()
    if to is None or not std(p, *_EXACT_OPS) or p is None or not single_use(mid):
        return Miss(f"the Cast's input is not read once, from one of {'/'.join(_EXACT_OPS)}")
    target = ir.DataType(to.value)
    args: list[ir.Value] = []
    inits: list[ir.Value] = []
    for v in p.inputs:
        if v is None:
            return Miss(f"the {p.op_type} has a missing input")
        q = v.producer()
        if std(q, "Cast") and q is not None and q.inputs and q.inputs[0] is not None and q.inputs[0].dtype == target \
                and (target, v.dtype) in WIDEN:
            args.append(q.inputs[0])
            continue
        arr = constant_array(v)
        if arr is None or arr.size > 1 or arr.astype(target.numpy()).astype(arr.dtype).tolist() != arr.tolist():
            return Miss(f"'{v.name}' is neither a widening Cast from {target} nor a single constant exact in it")
        k = c.constant(arr.astype(target.numpy()), v.name)
        inits.append(k)
        args.append(k)
    if not any(a.producer() is not None or a.is_graph_input() for a in args):
        return Miss("every operand is a constant")
    b = one(c, p.op_type, args, n.outputs[0], **{k: a.value for k, a in p.attributes.items()})
    b.inits.extend(inits)
    return b


IDENTITY = CanonRule("identity", ("Identity",), _identity)
CAST_NOOP = CanonRule("cast-noop", ("Cast",), _cast_noop)
CAST_CSE = CanonRule("cast-cse", ("Cast",), _cast_cse)
CAST_ISLAND = CanonRule("cast-island", ("Cast",), _cast_island)
