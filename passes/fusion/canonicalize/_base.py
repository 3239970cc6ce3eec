"""What a canonical rewrite is: a rule (name, root op types, rewrite) whose rewrite returns a build or a miss.

A rule is tried at one node, the *root*: the last node of the spelling it rewrites.  Its rewrite either
returns a :class:`Build` (the value that replaces the root's output and the nodes and initializers made
for it) or a :class:`Miss` that says, in one line, why the rule does not apply there.  A miss is a value,
not an exception: the engine goes on with the next rule, and a diagnostic (``Canonicalizer.why_not``)
can show a person why a spelling was left as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx_ir as ir

from mograph.patterns import constant_array
from mograph.shapes import Dim

if TYPE_CHECKING:
    from mograph.passes.fusion.canonicalize._engine import Canonicalizer

__all__ = ["Build", "CanonRule", "Miss", "Rewrite", "shape_entries"]

#: The default ONNX domain, as a node may spell it.
STD = ("", "ai.onnx")


@dataclass
class Build:
    """What a rewrite returns when it applies: the value replacing the root's output, and what it made."""

    value: ir.Value
    nodes: list[ir.Node] = field(default_factory=list)
    inits: list[ir.Value] = field(default_factory=list)


@dataclass(frozen=True)
class Miss:
    """Why a rule did not apply at a node (one line, for diagnostics)."""

    reason: str


Rewrite = Callable[["Canonicalizer", ir.Node], "Build | Miss"]


@dataclass(frozen=True)
class CanonRule:
    """One canonical rewrite: its name (counted in the pass's details), the default-domain op types its
    root may be, whether its numbers are exact or exact up to float rounding, and the rewrite."""

    name: str
    ops: tuple[str, ...]
    rewrite: Rewrite
    exact: bool = True

    def apply(self, c: Canonicalizer, node: ir.Node) -> Build | Miss:
        """The rewrite of ``node``, or why there is none (a root of another op type included)."""
        if node.domain not in STD or node.op_type not in self.ops:
            return Miss(f"applies to {'/'.join(self.ops)} nodes, not {node.op_type}")
        return self.rewrite(c, node)


# -- helpers the rules share ----------------------------------------------------------------------


def std(node: ir.Node | None, *ops: str) -> bool:
    """Whether ``node`` is a default-domain node of one of ``ops``."""
    return node is not None and node.domain in STD and node.op_type in ops


def scalar(value: ir.Value | None) -> float | None:
    arr = constant_array(value)
    if arr is None or arr.size != 1:
        return None
    return float(arr.reshape(()))


def rank_of(c: Canonicalizer, value: ir.Value | None) -> int | None:
    """``value``'s rank, as the canonicalizer's shape query knows it; None if unknown."""
    dims = c.shapes.dims(value)
    return None if dims is None else len(dims)


def keeps_shape(c: Canonicalizer, v: ir.Value, k: ir.Value) -> bool:
    """``v op k`` has v's shape when k is one element of rank <= v's."""
    arr = constant_array(k)
    if arr is None or arr.size != 1:
        return False
    rv = rank_of(c, v)
    return rv is not None and arr.ndim <= rv


def single_use(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


def one(c: Canonicalizer, op: str, inputs: list[ir.Value], like: ir.Value, **attrs: object) -> Build:
    """A build of one new node ``op(inputs)`` shaped like ``like``."""
    node = c.node(op, inputs, like, **attrs)
    return Build(node.outputs[0], [node])


def broadcasts_into(c: Canonicalizer, shape: tuple[int, ...], v: ir.Value) -> bool:
    """Whether a constant of ``shape`` broadcast against ``v`` leaves v's shape as it is: each of its dims 1, or
    the literal dim of ``v`` the shape query knows at that place."""
    dims = c.shapes.dims(v)
    if dims is None or len(shape) > len(dims):
        return False
    tail = dims[len(dims) - len(shape):]
    return all(s == 1 or (d is not None and d.value == s) for s, d in zip(shape, tail))


def shape_entries(c: Canonicalizer, value: ir.Value | None) -> list[Dim] | None:
    """The elements of the 1-D shape vector ``value``, each known, as the canonicalizer's shape query reads them
    (a constant, or one computed at run time: ``Shape`` with ``start``/``end``, ``Cast``, ``Concat``, ``Slice``,
    ``Gather``, ...: how exporters write ``x.shape[:-1] + [1]`` when the batch dim is dynamic); else None."""
    vec = c.shapes.values(value)
    if vec is None or vec[0] or any(e is None for e in vec[1]):
        return None
    return list(vec[1])  # type: ignore[arg-type]
