"""Finding decomposed LayerNorm / RMSNorm / GELU / attention subgraphs by structure, for the profile.

:func:`mograph.profile.profile_model` sums the profiled time of the nodes found here, so a user sees
what a fusion pass would replace before running it ("decomposed LayerNorm: 12 instances, 18% of
time").  This is a light structural heuristic, not the fusion rules (those live in ``passes/``, which
the core does not import): it follows the usual exporter spellings and says nothing about whether a
rule would accept the subgraph (constants, dtypes, axes); ``mograph optimize --explain`` does that.

Forms looked for (top-level graph only; ``Cast`` nodes in a chain are stepped over):

* **LayerNorm** — ``d = x - ReduceMean(x)``; ``Pow(d, 2)`` or ``Mul(d, d)`` -> ``ReduceMean`` ->
  ``Add(eps)`` -> ``Sqrt`` -> ``Div(d, .)`` (or ``Reciprocal`` + ``Mul``), then an optional ``Mul``
  by a constant (scale) and ``Add`` of a constant (bias);
* **RMSNorm** — the same without the mean: ``Pow(x, 2)`` -> ``ReduceMean`` -> ``Add`` -> ``Sqrt`` ->
  ``Div`` / ``Reciprocal`` + ``Mul`` with ``x``, then an optional scale ``Mul``;
* **GELU** — an ``Erf`` fed by ``x / sqrt(2)`` (``Div`` or ``Mul`` by a constant) and followed by
  ``Add(1)`` and the ``Mul``s of ``0.5 x``; a ``Tanh`` whose input chain holds a cube of ``x``
  (``Pow(x, 3)`` or ``x*x*x``), with the same tail; ``x * Sigmoid(1.702 x)``;
* **attention** — a ``Softmax`` fed (through scale ``Div``/``Mul``, mask ``Add``/``Where``) by a
  ``MatMul`` and feeding (through ``Cast``/``Dropout``) the first input of a ``MatMul``; with the
  head split / merge ``Transpose``/``Reshape`` nodes beside the two MatMuls.

Already fused ops are counted by op type in the profile itself, from the declarations (the custom ops'
``computes`` and the foreign ops' records, :func:`mograph.foreign_ops.fused_kinds`), so ONNX Runtime's
own fusions show up as "fused", not as decomposed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.patterns import attr_constant

__all__ = ["find_decomposed", "KINDS"]

#: Candidate kinds, in the order they are reported.
KINDS = ("LayerNorm", "RMSNorm", "GELU", "attention")

def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        try:
            return np.asarray(value.const_value.numpy())
        except Exception:  # noqa: BLE001 - external data that cannot be read: not a constant here
            return None
    node = value.producer()
    if node is not None and node.op_type == "Constant":
        return attr_constant(node)
    return None


def _scalar(value: ir.Value | None) -> float | None:
    arr = _const(value)
    if arr is None or arr.size != 1:
        return None
    return float(arr.reshape(-1)[0])


def _op(value: ir.Value | None) -> str | None:
    """The op type of the node producing ``value`` (``None``: an input, initializer or missing)."""
    node = value.producer() if value is not None else None
    return node.op_type if node is not None else None


def _users(value: ir.Value | None) -> list[ir.Node]:
    if value is None:
        return []
    return [use.node for use in value.uses()]


def _skip_casts_down(value: ir.Value, chain: list[ir.Node]) -> ir.Value:
    """Step over single ``Cast`` consumers of ``value``, adding them to ``chain``."""
    while True:
        users = _users(value)
        if len(users) == 1 and users[0].op_type == "Cast":
            chain.append(users[0])
            value = users[0].outputs[0]
        else:
            return value


def _skip_casts_up(value: ir.Value | None, chain: list[ir.Node]) -> ir.Value | None:
    while value is not None:
        node = value.producer()
        if node is not None and node.op_type == "Cast":
            chain.append(node)
            value = node.inputs[0]
        else:
            return value
    return None


def _only(users: Iterable[ir.Node], op_types: tuple[str, ...]) -> ir.Node | None:
    found = [u for u in users if u.op_type in op_types]
    return found[0] if len(found) == 1 else None


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    ins = list(node.inputs)
    if len(ins) != 2:
        return None
    return ins[1] if ins[0] is value else ins[0] if ins[1] is value else None


def _square_of(node: ir.Node) -> ir.Value | None:
    """``x`` when ``node`` is ``Pow(x, 2)`` or ``Mul(x, x)``."""
    if node.op_type == "Pow" and _scalar(node.inputs[1]) == 2.0:
        return node.inputs[0]
    if node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def _norm_tail(d: ir.Value, square: ir.Node, nodes: list[ir.Node], *, scale_and_bias: bool) -> bool:
    """From ``square`` (``d**2``): ReduceMean -> Add(eps) -> Sqrt -> Div(d, .) | Reciprocal -> Mul(d, .),
    then the optional scale Mul (and bias Add); appends to ``nodes``; False when the chain is not there."""
    nodes.append(square)
    mean = _only(_users(_skip_casts_down(square.outputs[0], nodes)), ("ReduceMean",))
    if mean is None:
        return False
    nodes.append(mean)
    v = _skip_casts_down(mean.outputs[0], nodes)
    add = _only(_users(v), ("Add",))
    if add is not None and _other(add, v) is not None and _const(_other(add, v)) is not None:
        nodes.append(add)
        v = add.outputs[0]
    sqrt = _only(_users(v), ("Sqrt",))
    if sqrt is None:
        return False
    nodes.append(sqrt)
    v = _skip_casts_down(sqrt.outputs[0], nodes)
    div = _only(_users(v), ("Div",))
    if div is not None:
        nodes.append(div)
    else:
        rec = _only(_users(v), ("Reciprocal",))
        if rec is None:
            return False
        nodes.append(rec)
        div = _only(_users(rec.outputs[0]), ("Mul",))
        if div is None:
            return False
        nodes.append(div)
    if not any(i is d or (_op(i) == "Cast" and i is not None and i.producer().inputs[0] is d)  # type: ignore[union-attr]
               for i in div.inputs):
        return False
    out = _skip_casts_down(div.outputs[0], nodes)
    users = _users(out)
    if len(users) == 1 and users[0].op_type == "Mul" and _const(_other(users[0], out)) is not None:
        nodes.append(users[0])
        out = users[0].outputs[0]
        users = _users(out)
        if scale_and_bias and len(users) == 1 and users[0].op_type == "Add" and _const(_other(users[0], out)) is not None:
            nodes.append(users[0])
    return True


def _layernorm(mean: ir.Node) -> list[ir.Node] | None:
    x = mean.inputs[0]
    for sub in _users(mean.outputs[0]):
        if sub.op_type != "Sub" or sub.inputs[0] is not x or sub.inputs[1] is not mean.outputs[0]:
            continue
        d = sub.outputs[0]
        for user in _users(d):
            if _square_of(user) is d:
                nodes = [mean, sub]
                if _norm_tail(d, user, nodes, scale_and_bias=True):
                    return nodes
    return None


def _rmsnorm(square: ir.Node) -> list[ir.Node] | None:
    x = _square_of(square)
    if x is None:
        return None
    producer = x.producer()
    if producer is not None and producer.op_type == "Sub" and any(_op(i) == "ReduceMean" for i in producer.inputs):
        return None  # a LayerNorm's variance
    nodes: list[ir.Node] = []
    return nodes if _norm_tail(x, square, nodes, scale_and_bias=False) else None


def _gelu_tail(t: ir.Value, x: ir.Value, nodes: list[ir.Node]) -> bool:
    """``Add(t, 1)`` then the Muls of ``0.5 * x`` (any association; ``/ 2`` too)."""
    add = _only(_users(t), ("Add",))
    if add is None or _scalar(_other(add, t)) != 1.0:
        return False
    nodes.append(add)
    v = add.outputs[0]
    mul = _only(_users(v), ("Mul",))
    if mul is None:
        return False
    nodes.append(mul)
    other = _other(mul, v)
    half = other.producer() if other is not None else None
    if half is not None and half.op_type == "Mul" and x in list(half.inputs):
        nodes.append(half)  # (x * 0.5) * (1 + t)
        return True
    if other is x:  # (x * (1 + t)) * 0.5  or  / 2
        nxt = _only(_users(mul.outputs[0]), ("Mul", "Div"))
        if nxt is not None and _scalar(_other(nxt, mul.outputs[0])) in (0.5, 2.0):
            nodes.append(nxt)
        return True
    if _scalar(other) == 0.5:  # x * ((1 + t) * 0.5)
        nxt = _only(_users(mul.outputs[0]), ("Mul",))
        if nxt is not None and x in list(nxt.inputs):
            nodes.append(nxt)
            return True
    return False


def _gelu_erf(erf: ir.Node) -> list[ir.Node] | None:
    pre = erf.inputs[0].producer() if erf.inputs[0] is not None else None
    if pre is None or pre.op_type not in ("Div", "Mul") or _scalar(pre.inputs[1]) is None:
        return None
    x = pre.inputs[0]
    if x is None:
        return None
    nodes = [pre, erf]
    return nodes if _gelu_tail(erf.outputs[0], x, nodes) else None


def _gelu_tanh(tanh: ir.Node) -> list[ir.Node] | None:
    # Walk the inner polynomial back (Mul/Add/Pow only, a few steps) and look for a cube of x.
    inner: list[ir.Node] = []
    frontier = [tanh.inputs[0]]
    cube_of: ir.Value | None = None
    for _ in range(5):
        nxt: list[ir.Value | None] = []
        for v in frontier:
            node = v.producer() if v is not None else None
            if node is None or node.op_type not in ("Mul", "Add", "Pow") or node in inner:
                continue
            inner.append(node)
            if node.op_type == "Pow" and _scalar(node.inputs[1]) == 3.0:
                cube_of = node.inputs[0]
            if node.op_type == "Mul" and len(node.inputs) == 2:
                a, b = node.inputs
                for one, two in ((a, b), (b, a)):
                    sq = two.producer() if two is not None else None
                    if sq is not None and sq.op_type == "Mul" and list(sq.inputs) == [one, one]:
                        cube_of = one
            nxt.extend(i for i in node.inputs if _const(i) is None)
        frontier = nxt
    if cube_of is None:
        return None
    # Keep only the inner nodes between x and tanh (x's own producer is not part of the GELU).
    inner = [n for n in inner if n is not cube_of.producer()]
    nodes = [*inner, tanh]
    return nodes if _gelu_tail(tanh.outputs[0], cube_of, nodes) else None


def _quick_gelu(sig: ir.Node) -> list[ir.Node] | None:
    pre = sig.inputs[0].producer() if sig.inputs[0] is not None else None
    if pre is None or pre.op_type != "Mul":
        return None
    alpha = [_scalar(i) for i in pre.inputs]
    if not any(a is not None and abs(a - 1.702) < 1e-2 for a in alpha):
        return None
    x = pre.inputs[0] if alpha[1] is not None else pre.inputs[1]
    mul = _only(_users(sig.outputs[0]), ("Mul",))
    if mul is None or x not in list(mul.inputs):
        return None
    return [pre, sig, mul]


_HEAD_OPS = ("Transpose", "Reshape")


def _heads(value: ir.Value | None, nodes: list[ir.Node], depth: int = 3) -> None:
    """Head split / merge nodes feeding ``value`` (Transpose/Reshape, and a scale Mul by a constant)."""
    for _ in range(depth):
        node = value.producer() if value is not None else None
        if node is None:
            return
        if node.op_type in _HEAD_OPS or (node.op_type in ("Mul", "Div") and _const(node.inputs[1]) is not None):
            nodes.append(node)
            value = node.inputs[0]
        else:
            return


def _attention(softmax: ir.Node) -> list[ir.Node] | None:
    nodes = [softmax]
    v: ir.Value | None = softmax.inputs[0]
    qk = None
    for _ in range(5):  # back through scale / mask / casts to the Q.K^T MatMul
        node = v.producer() if v is not None else None
        if node is None:
            return None
        if node.op_type == "MatMul":
            qk = node
            break
        if node.op_type not in ("Add", "Div", "Mul", "Where", "Cast", "Sub"):
            return None
        nodes.append(node)
        if node.op_type == "Where":
            v = node.inputs[2] if _const(node.inputs[2]) is None else node.inputs[1]
        else:
            v = next((i for i in node.inputs if _const(i) is None
                      and _op(i) in ("MatMul", "Add", "Div", "Mul", "Cast", "Where")), node.inputs[0])
    if qk is None:
        return None
    out = softmax.outputs[0]
    pv = None
    for _ in range(3):  # on through casts / dropout to the P.V MatMul
        users = _users(out)
        if len(users) != 1:
            return None
        node = users[0]
        if node.op_type == "MatMul" and node.inputs[0] is out:
            pv = node
            break
        if node.op_type not in ("Cast", "Dropout"):
            return None
        nodes.append(node)
        out = node.outputs[0]
    if pv is None:
        return None
    nodes += [qk, pv]
    _heads(qk.inputs[0], nodes)
    _heads(qk.inputs[1], nodes)
    _heads(pv.inputs[1], nodes)
    merged = pv.outputs[0]
    for _ in range(2):  # merge heads: Transpose then Reshape
        users = _users(merged)
        if len(users) == 1 and users[0].op_type in _HEAD_OPS:
            nodes.append(users[0])
            merged = users[0].outputs[0]
    return nodes


def find_decomposed(graph: ir.Graph) -> list[dict[str, Any]]:
    """The decomposed subgraphs of ``graph``: ``[{"kind": "LayerNorm", "nodes": [node names]}]``, each node
    in at most one instance."""
    taken: set[int] = set()
    found: list[dict[str, Any]] = []

    def add(kind: str, nodes: list[ir.Node] | None) -> None:
        if not nodes or any(id(n) in taken for n in nodes):
            return
        taken.update(id(n) for n in nodes)
        found.append({"kind": kind, "nodes": [str(n.name) for n in nodes]})

    order = list(graph)
    for node in order:
        if node.op_type == "ReduceMean" and node.domain in ("", "ai.onnx"):
            add("LayerNorm", _layernorm(node))
    for node in order:
        if node.op_type in ("Pow", "Mul") and node.domain in ("", "ai.onnx"):
            add("RMSNorm", _rmsnorm(node))
    for node in order:
        if node.op_type == "Erf":
            add("GELU", _gelu_erf(node))
        elif node.op_type == "Tanh":
            add("GELU", _gelu_tanh(node))
        elif node.op_type == "Sigmoid":
            add("GELU", _quick_gelu(node))
    for node in order:
        if node.op_type == "Softmax":
            add("attention", _attention(node))
    return found
