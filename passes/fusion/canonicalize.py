"""Canonicalization before matching: algebraic rewrites that give exporters' spellings one form.

The fusion rules of ``fuse-layernorm``, ``fuse-rmsnorm`` and ``fuse-gelu`` match one spelling of each
computation, with alternatives for the spellings most exporters share (rsqrt as ``Div`` by ``Sqrt``,
``Reciprocal(Sqrt)``, ``Pow(., -0.5)`` or ``1 / Sqrt``; a mean as ``ReduceMean`` or ``ReduceSum`` by 1/N;
both variance forms; every association of ``0.5 x (1 + t)``; x³ in any grouping ...).  What is left, a
rewrite here puts into one of those forms first (each exact, or exact up to float rounding):

==========================  ===================================================  ==================
rule                        rewrite                                              numbers
==========================  ===================================================  ==================
``identity``                ``Identity(v)`` -> ``v``                             exact
``cast-noop``               ``Cast(v, to=dtype(v))`` -> ``v``; ``Cast(Cast(v))``  exact
                            that widens and narrows back -> ``v``
``cast-cse``                a second ``Cast(v, to=t)`` -> the first (the fp16   exact
                            converter casts a graph input once per reader)
``cast-island``             ``Cast(op(Cast(a, f32), c), to=f16)`` -> ``op(a, c)``  exact
                            for ``Max``/``Min``/``Neg``/``Abs``/``Relu`` (ops the
                            fp16 converter keeps in float32)
``neutral``                 ``v * 1``, ``v / 1``, ``v + 0``, ``v - 0`` -> ``v``  exact (-0 -> +0)
                            (a constant of ones or zeros that does not
                            broadcast ``v`` to a larger shape)
``sub``                     ``a + Neg(b)``, ``a + b * -1``, ``a - Neg(-b)`` ->   exact
                            ``a - b``
``global-average-pool``     ``GlobalAveragePool(x)`` of a rank-3 ``x`` ->        exact
                            ``ReduceMean(x, axes=[2], keepdims=1)``
``const-chain``             ``(a * c1) * c2`` -> ``a * (c1 c2)`` for single      rounding
                            constants, the inner product read once
``factor-norm``             ``x * s + (-m * s + b)`` -> ``(x - m) * r * g + b``  rounding
                            where ``s = r * g`` (``tf.nn.batch_normalization``'s
                            form of a LayerNorm, Keras/TF): the centring is
                            factored out
``scale-out``               ``a * (r * g)`` -> ``(a * r) * g`` for a constant    rounding
                            vector ``g`` (a scale multiplied into the rsqrt:
                            Keras' RMSNormalization, Flax), ``r * g`` read once
``expand-noop``             ``Expand(v, s)`` that leaves v's shape -> ``v``      exact
                            (``s`` constant, or computed from ``Shape`` as
                            below)
``keepdims``                ``Reshape(f(ReduceX(x, keepdims=0)), kept shape)``  exact
                            -> ``f(ReduceX(x, keepdims=1))`` for ``f``
                            elementwise with single constants (jax2tf: the
                            mean and variance reduced without kept dims, then
                            reshaped back); the kept shape may be computed
                            at run time (``Concat(Slice(Shape(x)), .., 1)``
                            with casts: a dynamic batch dim), when it is
                            provably x's dims with the last one 1
``cube``                    ``x * (x * (a * x))`` and every other product of    rounding
                            three x and constants -> ``Pow(x, 3) * a``
``fold-broadcast``          ``Reshape``/``Unsqueeze``/``Expand``/``Squeeze`` of  exact
                            a constant -> the constant (scale and bias written
                            in the normalized shape)
==========================  ===================================================  ==================

Canonicalization changes nothing that no fusion uses.  Every rewrite is an edit that keeps what it
replaced: the replaced nodes stay in the graph, detached (no inputs, a private domain, so no rule
matches them), until the fusion rules have run.  Then each edit is **committed** if a fusion
consumed what it made (the replaced nodes are deleted), or **undone** otherwise (the replaced nodes
get their inputs back, their readers are wired back to them, and what the edit made is removed),
in reverse order, so a graph where nothing fused comes back exactly as it was.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mograph.errors import InternalError
from mograph.patterns import constant_array, remove_dead_producers

__all__ = ["Canonicalizer", "RULES"]

logger = logging.getLogger(__name__)

_DETACHED = "mograph.canonicalize.detached"
_STD = ("", "ai.onnx")
#: Constants folded by ``fold-broadcast`` up to this many elements (scale and bias vectors).
_FOLD_LIMIT = 1 << 16
_WIDEN = {
    (ir.DataType.FLOAT16, ir.DataType.FLOAT),
    (ir.DataType.BFLOAT16, ir.DataType.FLOAT),
    (ir.DataType.FLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.BFLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.FLOAT, ir.DataType.DOUBLE),
}


@dataclass
class _Edit:
    """One rewrite: ``old`` (its root first) replaced by ``new_value`` (made by ``new_nodes``)."""

    rule: str
    old_value: ir.Value
    new_value: ir.Value
    detached: list[tuple[ir.Node, list[ir.Value | None], str]]  # node, its inputs, its domain
    new_nodes: list[ir.Node]
    new_inits: list[ir.Value]
    moved: list[tuple[ir.Node, int]]  # readers rewired from old_value to new_value
    outputs: list[int]  # graph output slots rewired
    direct: list[ir.Node] = field(default_factory=list)  # readers new_value had before the edit
    names: tuple[str | None, str | None] | None = None  # (old, new) names before a swap


@dataclass
class _Build:
    """What a rewrite function returns: the value replacing the root's output, and what it made."""

    value: ir.Value
    nodes: list[ir.Node] = field(default_factory=list)
    inits: list[ir.Value] = field(default_factory=list)


Rewrite = Callable[["Canonicalizer", ir.Node], "_Build | None"]


def _std(node: ir.Node | None, *ops: str) -> bool:
    return node is not None and node.domain in _STD and node.op_type in ops


def _scalar(value: ir.Value | None) -> float | None:
    arr = constant_array(value)
    if arr is None or arr.size != 1:
        return None
    return float(arr.reshape(()))


def _rank(value: ir.Value | None) -> int | None:
    return len(value.shape) if value is not None and value.shape is not None else None


def _keeps_shape(v: ir.Value, c: ir.Value) -> bool:
    """``v op c`` has v's shape when c is one element of rank <= v's."""
    arr = constant_array(c)
    rv = _rank(v)
    return arr is not None and arr.size == 1 and rv is not None and arr.ndim <= rv


def _single_use(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


class Canonicalizer:
    """Apply the rewrites to a graph (:meth:`apply`), then keep those a fusion used (:meth:`resolve`)."""

    def __init__(self, graph: ir.Graph, opset: int, rules: tuple[str, ...] | None = None) -> None:
        self.graph = graph
        self.opset = opset
        self.rules = [(name, fn) for name, fn in RULES if rules is None or name in rules]
        self.edits: list[_Edit] = []
        self.position: dict[int, int] = {}
        self.original: set[ir.Node] = set()
        self.memo: dict[tuple[int, tuple[object, ...]], tuple[ir.Value, ir.Value]] = {}
        self.dims_cache: dict[int, list[object] | None] = {}  # _dims_of's derived dims (values stay alive)
        self._n = 0

    # -- building blocks ------------------------------------------------------------------
    def node(self, op: str, inputs: list[ir.Value], like: ir.Value, **attrs: object) -> ir.Node:
        """A new default-domain node whose output has ``like``'s dtype and shape."""
        node = ir.node(op, inputs, attributes=attrs)  # type: ignore[arg-type]
        self._n += 1
        node.name = f"mograph_canon_{self._n}"
        out = node.outputs[0]
        out.name = f"{like.name or 'v'}_canon{self._n}"
        out.type, out.shape = like.type, like.shape
        return node

    def constant(self, arr: np.ndarray, like_name: str | None) -> ir.Value:
        self._n += 1
        name = f"{like_name or 'c'}_canon{self._n}"
        while name in self.graph.initializers:
            self._n += 1
            name = f"{like_name or 'c'}_canon{self._n}"
        value = ir.Value(name=name, const_value=ir.tensor(arr, name=name))
        value.dtype = ir.DataType.from_numpy(arr.dtype)
        value.shape = ir.Shape(list(arr.shape))
        return value

    # -- applying ------------------------------------------------------------------------
    def apply(self) -> Counter:
        """Rewrite every node of the graph (in order) until no rule applies to it; counts per rule."""
        counts: Counter = Counter()
        self.position = {id(n): i for i, n in enumerate(self.graph)}
        self.original = set(self.graph)  # (held, so ids of removed nodes are not reused meanwhile)
        for node in list(self.graph):
            current: ir.Node | None = node
            for _ in range(8):  # a node's rewrites chain (a + Neg(b) -> a - b -> ...); bounded
                if current is None or current.graph is not self.graph or current.domain not in _STD:
                    break
                if len(current.outputs) != 1:
                    break
                done = None
                for rule, fn in self.rules:
                    build = fn(self, current)
                    if build is not None and self._commit_edit(rule, current, build):
                        counts[rule] += 1
                        done = build
                        break
                if done is None:
                    break
                current = done.value.producer() if done.nodes else None
        return counts

    def _commit_edit(self, rule: str, root: ir.Node, build: _Build) -> bool:
        graph, old = self.graph, root.outputs[0]
        new = build.value
        if old.is_graph_output() and not build.nodes:
            return False  # a graph output needs a node of its own to keep its name
        if build.nodes:
            graph.insert_before(root, build.nodes)
        for init in build.inits:
            graph.register_initializer(init)
        if new.type is None:
            new.type = old.type
        if new.shape is None:
            new.shape = old.shape
        edit = _Edit(rule, old, new, [], list(build.nodes), list(build.inits), [], [])
        edit.moved = [(user, i) for user, i in old.uses()]
        edit.direct = [user for user, _ in new.uses() if user is not root]
        edit.outputs = [i for i, v in enumerate(graph.outputs) if v is old]
        if edit.outputs:
            edit.names = (old.name, new.name)
            name = old.name
            old.name = f"{name}__mograph_canon_replaced"
            new.name = name
        for user, i in edit.moved:
            user.replace_input_with(i, new)
        for i in edit.outputs:
            graph.outputs[i] = new
        self._detach(root, edit)
        self.edits.append(edit)
        return True

    def _detach(self, root: ir.Node, edit: _Edit) -> None:
        """Detach ``root`` and every producer that only it read (so no rule sees a reader that is gone)."""
        stack = [root]
        while stack:
            node = stack.pop()
            inputs = list(node.inputs)
            edit.detached.append((node, inputs, node.domain))
            for i in range(len(inputs)):
                node.replace_input_with(i, None)
            node.domain = _DETACHED
            for v in inputs:
                p = v.producer() if v is not None else None
                if (p is not None and p.graph is self.graph and p.domain in _STD
                        and not any(o.uses() or o.is_graph_output() for o in p.outputs)):
                    stack.append(p)

    def origin(self, node: ir.Node) -> str | None:
        """The name of the exporter's node a node made here stands for (None for any other node)."""
        for edit in self.edits:
            if any(n is node for n in edit.new_nodes):
                root = edit.detached[0][0]
                return root.name or edit.old_value.name or root.op_type
        return None

    # -- resolving -----------------------------------------------------------------------
    def resolve(self) -> tuple[Counter, Counter]:
        """Commit the edits a fusion consumed, undo the others (newest first); (committed, undone) per rule."""
        kept: Counter = Counter()
        undone: Counter = Counter()
        graph = self.graph
        for edit in reversed(self.edits):
            if edit.new_nodes or edit.new_value in edit.new_inits:
                # what the edit made, or a reader it rewired, went into a fusion
                used = any(n.graph is not graph for n in edit.new_nodes) or any(
                    u.graph is not graph for u, _ in edit.moved)
            else:
                # an existing value stands in for the node (Identity, no-op Cast ...): the edit was used
                # only if that value itself went into a fusion; a fusion that merely reads it (its
                # input) is rewired to the original node on undo
                used = self._stand_in_used(edit)
            if used:
                self._keep(edit)
                kept[edit.rule] += 1
            else:
                self._undo(edit)
                undone[edit.rule] += 1
        self.edits.clear()
        self._check()
        return kept, undone

    def _stand_in_used(self, edit: _Edit) -> bool:
        """Whether an edit that let an existing value stand in for a node went into a fusion.

        Yes if that value's producer was fused away, or if the fusion consumed both a reader the edit
        rewired and a reader the value had anyway (the fusion needed the two paths to be one value:
        ``x - 0`` and ``x * x``, two Casts of one input).  Otherwise the fusion merely reads the value
        as its input, and the node (an Identity, a no-op Cast) goes back in front of it.
        """
        graph, value = self.graph, edit.new_value
        p = value.producer()
        if p is not None and p.graph is not graph:
            return True
        moved_gone = any(u.graph is not graph for u, _ in edit.moved)
        return moved_gone and any(u.graph is not graph for u in edit.direct)

    def _keep(self, edit: _Edit) -> None:
        graph = self.graph
        inputs = [v for _, ins, _ in edit.detached for v in ins]
        for node, _, _ in edit.detached:
            if node.graph is graph:
                graph.remove(node)
        if edit.names is not None:  # the replaced value is gone: give it its name back for the record
            edit.old_value.name = edit.names[0] + "__mograph_canon_removed" if edit.names[0] else None
        remove_dead_producers(graph, inputs)

    def _undo(self, edit: _Edit) -> None:
        graph = self.graph
        for node, inputs, domain in reversed(edit.detached):
            node.domain = domain
            for i, v in enumerate(inputs):
                p = v.producer() if v is not None else None
                if (v is not None and p is None and v.const_value is not None and v.name
                        and v.name not in graph.initializers and not v.is_graph_input()):
                    graph.register_initializer(v)  # a fusion dropped it once nothing else read it
                elif p is not None and p.graph is None and p.op_type == "Constant" and not p.inputs:
                    graph.insert_before(node, p)  # likewise a Constant node (e.g. a shared 1.0 a norm took)
                node.replace_input_with(i, v)
        for user, i in edit.moved:
            if user.graph is graph and user.inputs[i] is edit.new_value:
                user.replace_input_with(i, edit.old_value)
        if not edit.new_nodes and edit.new_value not in edit.new_inits:
            for user, i in list(edit.new_value.uses()):  # fused ops made since, reading the stand-in
                if user.graph is graph and user not in self.original and user.domain != _DETACHED:
                    user.replace_input_with(i, edit.old_value)
        for i in edit.outputs:
            graph.outputs[i] = edit.old_value
        if edit.names is not None:
            edit.new_value.name, edit.old_value.name = edit.names[1], edit.names[0]
        if edit.new_nodes:
            live = [n for n in edit.new_nodes if n.graph is graph]
            for n in live:
                for i in range(len(n.inputs)):
                    n.replace_input_with(i, None)
            graph.remove(live)
        for init in edit.new_inits:
            name = init.name
            if name is not None and not init.uses() and graph.initializers.get(name) is init:
                del graph.initializers[name]

    def _check(self) -> None:
        """Every input is produced in the graph, an initializer, a graph input or an outer value."""
        for node in self.graph:
            if node.domain == _DETACHED:
                raise InternalError("canonicalize", f"node '{node.name}' was left detached")


# ---------------------------------------------------------------------------------------------
# rewrites: each takes a node and returns a _Build or None
# ---------------------------------------------------------------------------------------------


def _identity(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if _std(n, "Identity") and n.inputs and n.inputs[0] is not None:
        return _Build(n.inputs[0])
    return None


def _cast_noop(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Cast") or not n.inputs or n.inputs[0] is None:
        return None
    to = n.attributes.get("to")
    if to is None:
        return None
    target = ir.DataType(to.value)
    x = n.inputs[0]
    if x.dtype == target:
        return _Build(x)
    p = x.producer()
    if _std(p, "Cast") and p is not None and p.inputs and p.inputs[0] is not None:
        x0 = p.inputs[0]
        if x0.dtype == target and (target, x.dtype) in _WIDEN:
            return _Build(x0)
    return None


def _cast_cse(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Cast") or not n.inputs or n.inputs[0] is None:
        return None
    to = n.attributes.get("to")
    here = c.position.get(id(n))
    if to is None or here is None:
        return None
    best: tuple[int, ir.Node] | None = None
    for user, _ in n.inputs[0].uses():
        at = c.position.get(id(user))
        if user is n or at is None or at >= here or not _std(user, "Cast"):
            continue
        t = user.attributes.get("to")
        if t is not None and t.value == to.value and (best is None or at < best[0]):
            best = (at, user)
    return _Build(best[1].outputs[0]) if best is not None else None


_EXACT_OPS = ("Max", "Min", "Neg", "Abs", "Relu")


def _cast_island(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Cast") or not n.inputs or n.inputs[0] is None:
        return None
    to = n.attributes.get("to")
    mid = n.inputs[0]
    p = mid.producer()
    if to is None or not _std(p, *_EXACT_OPS) or p is None or not _single_use(mid):
        return None
    target = ir.DataType(to.value)
    args: list[ir.Value] = []
    inits: list[ir.Value] = []
    for v in p.inputs:
        if v is None:
            return None
        q = v.producer()
        if _std(q, "Cast") and q is not None and q.inputs and q.inputs[0] is not None and q.inputs[0].dtype == target \
                and (target, v.dtype) in _WIDEN:
            args.append(q.inputs[0])
            continue
        arr = constant_array(v)
        if arr is None or arr.size > 1 or arr.astype(target.numpy()).astype(arr.dtype).tolist() != arr.tolist():
            return None  # not a constant, or not exactly representable in the narrow type
        k = c.constant(arr.astype(target.numpy()), v.name)
        inits.append(k)
        args.append(k)
    if not any(a.producer() is not None or a.is_graph_input() for a in args):
        return None
    b = _one(c, p.op_type, args, n.outputs[0], **{k: a.value for k, a in p.attributes.items()})
    b.inits.extend(inits)
    return b


def _neutral(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Mul", "Div", "Add", "Sub") or len(n.inputs) != 2:
        return None
    a, b = n.inputs
    if a is None or b is None:
        return None
    unit = 1.0 if n.op_type in ("Mul", "Div") else 0.0
    pairs = [(a, b), (b, a)] if n.op_type in ("Mul", "Add") else [(a, b)]
    for v, k in pairs:
        arr = constant_array(k)
        if arr is None:
            if _broadcast_fill(k) == unit and v.dtype == n.outputs[0].dtype and constant_array(v) is None:
                # a constant broadcast to a shape computed at run time (Flax's RMSNorm subtracts
                # zeros of x's shape but the last dim): neutral if its dims go into v's
                kd, vd = _dims_of(k, c.dims_cache), _dims_of(v, c.dims_cache)
                if kd is not None and vd is not None and len(kd) <= len(vd) and all(
                        d == 1 or d == e for d, e in zip(kd, vd[len(vd) - len(kd):])):
                    return _Build(v)
            continue
        if arr.size == 0 or not bool(np.all(arr == unit)) or v.dtype != n.outputs[0].dtype:
            continue
        if constant_array(v) is None and _broadcasts_into(arr.shape, v):
            return _Build(v)
    return None


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
    if p is None or not _std(p, "Expand", "Reshape") or not p.inputs:
        return None
    return _broadcast_fill(p.inputs[0], depth + 1)


def _broadcasts_into(shape: tuple[int, ...], v: ir.Value) -> bool:
    """Whether a constant of ``shape`` broadcast against ``v`` leaves v's (static) shape as it is."""
    if v.shape is None or len(shape) > len(v.shape):
        return False
    dims = list(v.shape)[len(v.shape) - len(shape):]
    return all(c == 1 or (isinstance(d, int) and c == d) for c, d in zip(shape, dims))


#: A dim known at rewrite time: its size, ``("sym", name)`` for a named symbolic dim (one name, one
#: size, as ONNX's ``dim_param`` promises), or ``("at", id(value), axis)`` for an unnamed one.
DimKey = object
_INT_TYPES = (ir.DataType.INT64, ir.DataType.INT32)


def _dim_key(value: ir.Value, axis: int) -> DimKey:
    shape = value.shape
    if shape is not None and 0 <= axis < len(shape):
        d = shape[axis]
        if isinstance(d, int):
            return d
        if isinstance(d, ir.SymbolicDim) and d.value:
            return ("sym", d.value)
    return ("at", id(value), axis)


#: Ops whose output is their inputs broadcast together (for :func:`_derived_dims`).
_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Where", "Erf", "Tanh", "Sigmoid", "Sqrt",
                 "Reciprocal", "Neg", "Abs", "Relu", "Exp", "Log", "Cast", "Identity", "CastLike")


def _broadcast(a: list[DimKey], b: list[DimKey]) -> list[DimKey] | None:
    if len(a) < len(b):
        a, b = b, a
    out = list(a[: len(a) - len(b)])
    for x, y in zip(a[len(a) - len(b):], b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None  # two dims not provably equal (either could be 1 at run time)
    return out


def _dims_of(value: ir.Value | None, cache: dict[int, list[DimKey] | None] | None = None,
             depth: int = 0) -> list[DimKey] | None:
    """``value``'s dims: from its shape where inference gave one, else derived from its producer.

    Shape inference stops at a ``Reshape`` to a shape computed at run time, so every value after the
    first jax2tf LayerNorm of a dynamic-batch model has no shape; the dims are then derived through
    broadcasting elementwise ops, ``MatMul`` by a constant matrix, ``Reshape``/``Expand`` to a shape
    :func:`_shape_keys` can read, and reductions over the last axis.
    """
    if value is None:
        return None
    rank = _rank(value)
    if rank is not None:
        return [_dim_key(value, i) for i in range(rank)]
    arr = constant_array(value)
    if arr is not None:
        return [int(d) for d in arr.shape]
    if cache is None:
        cache = {}
    if id(value) in cache:
        return cache[id(value)]
    if depth > 64:  # too deep from this start (not cached: from another start it may be reachable)
        return None
    cache[id(value)] = None  # while deriving: a cycle reads unknown
    cache[id(value)] = _derived_dims(value, cache, depth)
    return cache[id(value)]


def _derived_dims(value: ir.Value, cache: dict[int, list[DimKey] | None], depth: int) -> list[DimKey] | None:
    p = value.producer()
    if p is None or p.domain not in _STD or len(p.outputs) != 1:
        return None
    ins = [u for u in p.inputs if u is not None]
    if not ins:
        return None
    if p.op_type in _BROADCASTING:
        out = _dims_of(ins[0], cache, depth + 1)
        for u in ins[1:]:
            other = _dims_of(u, cache, depth + 1)
            if out is None or other is None:
                return None
            out = _broadcast(out, other)
        return out
    if p.op_type == "MatMul" and len(ins) == 2:
        a, w = _dims_of(ins[0], cache, depth + 1), constant_array(ins[1])
        if a is None or w is None or w.ndim != 2 or len(a) < 2 or a[-1] != int(w.shape[0]):
            return None
        return a[:-1] + [int(w.shape[1])]
    if p.op_type in ("Reshape", "Expand") and len(ins) == 2:
        keys = _shape_keys(ins[1])
        if keys is None:
            return None
        if p.op_type == "Expand":
            v = _dims_of(ins[0], cache, depth + 1)
            return _broadcast(v, keys) if v is not None else None
        allowzero = p.attributes.get("allowzero")
        ok = all(not isinstance(k, int) or k >= 1 for k in keys) and not (allowzero is not None and int(allowzero.value))
        return keys if ok else None
    if p.op_type in ("ReduceSum", "ReduceMean"):
        x = _dims_of(ins[0], cache, depth + 1)
        attr = p.attributes.get("axes")
        arr = constant_array(p.inputs[1]) if len(p.inputs) > 1 and p.inputs[1] is not None else None
        axes = [int(a) for a in attr.value] if attr is not None else (
            [int(a) for a in arr.reshape(-1)] if arr is not None else None)
        if x is None or axes not in ([-1], [len(x) - 1]):
            return None
        keep = p.attributes.get("keepdims")
        return x[:-1] + ([1] if keep is None or int(keep.value) else [])
    return None


def _shape_keys(value: ir.Value | None, depth: int = 0) -> list[DimKey] | None:
    """The dims a 1-D shape tensor provably holds at run time, or None.

    Constants, ``Shape(t)`` (with ``start``/``end``), integer ``Cast``, ``Concat`` on axis 0 and
    ``Slice`` with constant bounds and step 1 of those: how exporters write ``x.shape[:-1] + [1]``
    when the batch dim is dynamic (jax2tf through tf2onnx: ``Cast(Concat(Slice(Cast(Shape(x))), 4, 1))``).
    """
    if value is None or depth > 8:
        return None
    arr = constant_array(value)
    if arr is not None:
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            return None
        return [int(d) for d in arr]
    p = value.producer()
    if p is None or p.domain not in _STD:
        return None
    if p.op_type == "Shape" and p.inputs and p.inputs[0] is not None:
        t = p.inputs[0]
        rank = _rank(t)
        if rank is None:
            return None
        start_attr, end_attr = p.attributes.get("start"), p.attributes.get("end")
        start = int(start_attr.value) if start_attr is not None else 0
        end = int(end_attr.value) if end_attr is not None else rank
        return [_dim_key(t, i) for i in range(rank)][start:end]
    if p.op_type == "Cast":
        to = p.attributes.get("to")
        return _shape_keys(p.inputs[0], depth + 1) if to is not None and int(to.value) in (7, 6) else None
    if p.op_type == "Concat":
        axis = p.attributes.get("axis")
        if axis is None or int(axis.value) not in (0, -1):
            return None
        out: list[DimKey] = []
        for u in p.inputs:
            part = _shape_keys(u, depth + 1)
            if part is None:
                return None
            out += part
        return out
    if p.op_type == "Slice" and len(p.inputs) >= 3:
        data = _shape_keys(p.inputs[0], depth + 1)
        bounds = [constant_array(u) if u is not None else None for u in p.inputs[1:5]]
        if data is None or bounds[0] is None or bounds[1] is None or bounds[0].size != 1 or bounds[1].size != 1:
            return None
        axes, steps = (bounds + [None, None])[2:4]
        if (axes is not None and [int(a) for a in axes.reshape(-1)] not in ([0], [-1])) or (
                steps is not None and [int(a) for a in steps.reshape(-1)] != [1]):
            return None
        start, end = int(bounds[0].reshape(())), int(bounds[1].reshape(()))
        return data[start:end]  # Python's slice clamps as ONNX's Slice does for step 1
    return None


def _expand_noop(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Expand") or len(n.inputs) != 2 or None in n.inputs:
        return None
    v, shp = n.inputs
    arr = constant_array(shp)
    if v is None or constant_array(v) is not None:
        return None
    if arr is not None:
        return _Build(v) if _broadcasts_into(tuple(int(d) for d in arr.reshape(-1)), v) else None
    # a shape computed at run time: a no-op if every dim is 1 or provably v's own
    keys, dims = _shape_keys(shp), _dims_of(v, c.dims_cache)
    if keys is None or dims is None or len(keys) > len(dims):
        return None
    tail = dims[len(dims) - len(keys):]
    return _Build(v) if all(k == 1 or k == d for k, d in zip(keys, tail)) else None


_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Max", "Min", "Neg", "Sqrt", "Reciprocal", "Pow", "Abs", "Relu")


def _static(v: ir.Value | None) -> list[int] | None:
    if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape):
        return None
    return [int(d) for d in v.shape]  # type: ignore[arg-type]


def _keepdims(c: Canonicalizer, n: ir.Node) -> _Build | None:
    """Reshape/Unsqueeze adding a trailing 1 to f(reduction without kept dims) -> f(reduction with kept dims).

    The Reshape's shape may be computed at run time (a dynamic batch dim): it must provably be the
    reduced input's dims with the last one 1 (:func:`_shape_keys`)."""
    if not _std(n, "Reshape", "Unsqueeze") or not n.inputs or n.inputs[0] is None:
        return None
    v = n.inputs[0]
    target: list[DimKey] | None
    if n.op_type == "Reshape":
        allowzero = n.attributes.get("allowzero")
        target = _shape_keys(n.inputs[1]) if len(n.inputs) > 1 else None
        if (target is None or not target or target[-1] != 1 or (allowzero is not None and int(allowzero.value))
                or any(isinstance(k, int) and k < 1 for k in target)):
            return None
    else:
        attr = n.attributes.get("axes")
        arr = constant_array(n.inputs[1]) if len(n.inputs) > 1 else None
        axes = [int(a) for a in attr.value] if attr is not None else (
            [int(a) for a in arr.reshape(-1)] if arr is not None else None)
        dims = _dims_of(v, c.dims_cache)
        if dims is None or axes not in ([-1], [len(dims)]):
            return None
        target = dims + [1]
    made: list[ir.Node] = []
    value = _hoist(c, v, target, made, 0)
    if value is None:
        return None
    return _Build(value, made)


def _shape_of_keys(keys: list[DimKey]) -> ir.Shape:
    dims: list[int | str | None] = []
    for k in keys:
        if isinstance(k, int):
            dims.append(k)
        elif isinstance(k, tuple) and k[0] == "sym":
            dims.append(str(k[1]))
        else:
            dims.append(None)
    return ir.Shape(dims)


def _hoist(c: Canonicalizer, v: ir.Value, target: list[DimKey], made: list[ir.Node], depth: int) -> ir.Value | None:
    """``v`` computed with a trailing kept dim (dims ``target``), or None; built nodes appended to ``made``.

    ``v`` is elementwise ops (single-element constants as the other operands) of reductions over the
    last axis without kept dims, each of an input whose dims are ``target`` but the last: that is what
    proves ``v``'s dims are ``target[:-1]``, whatever shapes inference gave (or did not give) it."""
    key = (id(v), tuple(target))
    hit = c.memo.get(key)
    if hit is not None and hit[0] is v:
        p = hit[1].producer()
        # in the graph, or made earlier in this same build (``x*x`` of one hoisted mean: one value, twice)
        if p is not None and (p.graph is c.graph or any(p is m for m in made)) and p.domain in _STD:
            return hit[1]
    p = v.producer()
    if p is None or p.domain not in _STD or depth > 12 or len(p.outputs) != 1:
        return None
    like = ir.Value(name=v.name, shape=_shape_of_keys(target), type=v.type)
    if p.op_type in ("ReduceSum", "ReduceMean"):
        x = p.inputs[0]
        keep = p.attributes.get("keepdims")
        xs = _dims_of(x, c.dims_cache)
        if x is None or keep is None or int(keep.value) != 0 or xs is None or xs[:-1] + [1] != target:
            return None
        attr = p.attributes.get("axes")
        arr = constant_array(p.inputs[1]) if len(p.inputs) > 1 and p.inputs[1] is not None else None
        axes = [int(a) for a in attr.value] if attr is not None else (
            [int(a) for a in arr.reshape(-1)] if arr is not None else None)
        if axes not in ([-1], [len(xs) - 1]):
            return None
        if x.shape is None:  # derived (inference stopped upstream): the rules' checks read x's rank and last dim
            x.shape = _shape_of_keys(xs)
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


def _cube(c: Canonicalizer, n: ir.Node) -> _Build | None:
    """A product of exactly three ``x`` and single constants, any grouping -> Pow(x, 3) [* constant]."""
    if not _std(n, "Mul") or len(n.inputs) != 2:
        return None
    leaves: list[ir.Value] = []
    consts: list[np.ndarray] = []
    stack = list(n.inputs)
    inner = 0
    while stack:
        u = stack.pop()
        if u is None:
            return None
        arr = constant_array(u)
        if arr is not None:
            if arr.size != 1:
                return None
            consts.append(arr)
            continue
        p = u.producer()
        if _std(p, "Mul") and p is not None and len(p.inputs) == 2 and _single_use(u):
            stack.extend(p.inputs)
            inner += 1
            continue
        leaves.append(u)
    if len(leaves) != 3 or any(v is not leaves[0] for v in leaves) or inner == 0:
        return None
    x = leaves[0]
    if x.dtype is None or x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE,
                                          ir.DataType.BFLOAT16):
        return None
    # x*x*x and (x*x*x)*a are forms the GELU rule takes as they are: only a constant inside the product
    # (x * (x * (a * x)), as jax2tf writes it) needs the rewrite
    outer = [u for u in n.inputs if u is not None and constant_array(u) is not None]
    if len(consts) == len(outer):
        return None
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
            b = _Build(mul.outputs[0], nodes, [three, kv])
            return b
    return _Build(value, nodes, [three])


def _sub(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Add") or len(n.inputs) != 2 or None in n.inputs:
        return None
    out = n.outputs[0]
    for a, nb in (n.inputs, n.inputs[::-1]):
        p = nb.producer()  # type: ignore[union-attr]
        b = None
        if _std(p, "Neg") and p is not None:
            b = p.inputs[0]
        elif _std(p, "Mul") and p is not None and len(p.inputs) == 2:
            for v, k in (p.inputs, p.inputs[::-1]):
                if k is not None and v is not None and _scalar(k) == -1.0 and _keeps_shape(v, k):
                    b = v
                    break
        if b is not None and a is not None and constant_array(b) is None:
            return _one(c, "Sub", [a, b], out)
    return None


def _one(c: Canonicalizer, op: str, inputs: list[ir.Value], like: ir.Value, **attrs: object) -> _Build:
    node = c.node(op, inputs, like, **attrs)
    return _Build(node.outputs[0], [node])


def _global_average_pool(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "GlobalAveragePool") or not n.inputs or n.inputs[0] is None:
        return None
    x = n.inputs[0]
    if _rank(x) != 3:
        return None
    out = n.outputs[0]
    if c.opset >= 18:
        axes = c.constant(np.array([2], dtype=np.int64), "axes")
        b = _one(c, "ReduceMean", [x, axes], out, keepdims=1)
        b.inits.append(axes)
        return b
    return _one(c, "ReduceMean", [x], out, axes=[2], keepdims=1)


def _const_chain(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Mul") or len(n.inputs) != 2 or None in n.inputs:
        return None
    for inner, k2 in (n.inputs, n.inputs[::-1]):
        c2 = constant_array(k2)
        p = inner.producer()  # type: ignore[union-attr]
        if c2 is None or c2.size != 1 or not _std(p, "Mul") or p is None or not _single_use(inner):  # type: ignore[arg-type]
            continue
        for a, k1 in (p.inputs, p.inputs[::-1]):
            c1 = constant_array(k1)
            if c1 is None or c1.size != 1 or a is None or constant_array(a) is not None:
                continue
            if c1.dtype != c2.dtype or not (_keeps_shape(a, k1) and _keeps_shape(a, k2)):  # type: ignore[arg-type]
                continue
            prod = c.constant(np.asarray(c1 * c2).reshape(c2.shape).astype(c2.dtype), k2.name)  # type: ignore[union-attr]
            b = _one(c, "Mul", [a, prod], n.outputs[0])
            b.inits.append(prod)
            return b
    return None


def _fold_broadcast(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Reshape", "Unsqueeze", "Squeeze", "Expand") or not n.inputs or n.inputs[0] is None:
        return None
    out = n.outputs[0]
    if out.is_graph_output() or n.inputs[0].is_graph_input():
        return None
    src = constant_array(n.inputs[0])
    if src is None or src.size > _FOLD_LIMIT or n.inputs[0].const_value is None:
        return None
    try:
        if n.op_type == "Reshape":
            shape = constant_array(n.inputs[1]) if len(n.inputs) > 1 else None
            if shape is None or 0 in shape.tolist():
                return None
            arr = src.reshape([int(d) for d in shape.tolist()])
        elif n.op_type == "Expand":
            shape = constant_array(n.inputs[1]) if len(n.inputs) > 1 else None
            if shape is None:
                return None
            arr = src * np.ones([int(d) for d in shape.tolist()], dtype=src.dtype)
            if arr.size != src.size:
                return None  # a real broadcast: would grow the model
        else:
            attr = n.attributes.get("axes")
            axes_arr = constant_array(n.inputs[1]) if len(n.inputs) > 1 and n.inputs[1] is not None else None
            axes = [int(a) for a in attr.value] if attr is not None else (
                [int(a) for a in axes_arr.reshape(-1)] if axes_arr is not None else None)
            if n.op_type == "Unsqueeze":
                if axes is None:
                    return None
                rank = src.ndim + len(axes)
                shape_out = list(src.shape)
                for ax in sorted(a % rank for a in axes):
                    shape_out.insert(ax, 1)
                arr = src.reshape(shape_out)
            else:
                arr = np.squeeze(src, axis=tuple(axes)) if axes is not None else np.squeeze(src)
    except (ValueError, TypeError):
        return None
    value = c.constant(np.ascontiguousarray(arr), n.inputs[0].name)
    return _Build(value, [], [value])


def _factor_norm(c: Canonicalizer, n: ir.Node) -> _Build | None:
    """x * s + (-m * s + b)  ->  (x - m) * r * g + b, with s = r * g or s = r."""
    if not _std(n, "Add") or len(n.inputs) != 2 or None in n.inputs:
        return None
    for ax, rest in (n.inputs, n.inputs[::-1]):
        pa = ax.producer()  # type: ignore[union-attr]
        if not _std(pa, "Mul") or pa is None or len(pa.inputs) != 2:
            continue
        # rest = Add(Mul(Neg(m), s), b) | Mul(Neg(m), s) | Sub(b, Mul(m, s))
        pr = rest.producer()  # type: ignore[union-attr]
        cands: list[tuple[ir.Value, ir.Value | None]] = []  # (the Mul(-m, s) value, b) ; sign handled below
        neg = True
        if _std(pr, "Add") and pr is not None and len(pr.inputs) == 2:
            cands = [(pr.inputs[0], pr.inputs[1]), (pr.inputs[1], pr.inputs[0])]  # type: ignore[list-item]
        elif _std(pr, "Mul"):
            cands = [(rest, None)]  # type: ignore[list-item]
        elif _std(pr, "Sub") and pr is not None and len(pr.inputs) == 2:
            cands = [(pr.inputs[1], pr.inputs[0])]  # type: ignore[list-item]
            neg = False
        for ms, b in cands:
            pm = ms.producer() if ms is not None else None
            if not _std(pm, "Mul") or pm is None or len(pm.inputs) != 2:
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
                    if not _std(pneg, "Neg") or pneg is None:
                        continue
                    m = pneg.inputs[0]
                else:
                    m = mv
                if m is None or m is x:
                    continue
                return _factored(c, n, x, m, s, b)
    return None


def _factored(c: Canonicalizer, n: ir.Node, x: ir.Value, m: ir.Value, s: ir.Value, b: ir.Value | None) -> _Build:
    out = n.outputs[0]
    d = c.node("Sub", [x, m], x)
    nodes = [d]
    ps = s.producer()
    r, g = s, None
    if _std(ps, "Mul") and ps is not None and len(ps.inputs) == 2:
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
    return _Build(y.outputs[0], nodes)


def _scale_out(c: Canonicalizer, n: ir.Node) -> _Build | None:
    if not _std(n, "Mul") or len(n.inputs) != 2 or None in n.inputs:
        return None
    for a, inner in (n.inputs, n.inputs[::-1]):
        p = inner.producer()  # type: ignore[union-attr]
        if a is None or constant_array(a) is not None or not _std(p, "Mul") or p is None or not _single_use(inner):  # type: ignore[arg-type]
            continue
        for r, g in (p.inputs, p.inputs[::-1]):
            garr = constant_array(g)
            if r is None or g is None or garr is None or garr.size <= 1 or constant_array(r) is not None:
                continue
            ar = c.node("Mul", [a, r], a)
            out = c.node("Mul", [ar.outputs[0], g], n.outputs[0])
            return _Build(out.outputs[0], [ar, out])
    return None


#: The rewrites, tried in this order at each node.
RULES: list[tuple[str, Rewrite]] = [
    ("identity", _identity),
    ("cast-noop", _cast_noop),
    ("cast-cse", _cast_cse),
    ("cast-island", _cast_island),
    ("neutral", _neutral),
    ("expand-noop", _expand_noop),
    ("keepdims", _keepdims),
    ("fold-broadcast", _fold_broadcast),
    ("global-average-pool", _global_average_pool),
    ("sub", _sub),
    ("const-chain", _const_chain),
    ("factor-norm", _factor_norm),
    ("scale-out", _scale_out),
    ("cube", _cube),
]
