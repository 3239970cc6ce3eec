"""Shared pieces of ``make-dynamic``'s analysis: its refusals, planned rewrites, op classes and readers.

:class:`_Refuse` (anything the walk cannot vouch for), :class:`_NeedTag` (a static dim with the old size of a
dynamic one: trace it back), :class:`_Action` / :class:`_SourceAction` (the rewrites planned for after the
walk), the op classes each rule covers and the small readers of constants and static shapes.  The walk is
in ``_dyn_symbolic``, the per-op rules in ``_dyn_rules``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.foreign_ops import BUILTIN_FOREIGN_OPS, MS_DOMAIN
from mograph.irutil import attr_value as _attr
from mograph.shapes import BROADCAST_OPS, REDUCE_OPS, SAME_SHAPE_OPS, Dim

__all__ = ["INT64_MAX", "ONE", "_Action", "_BROADCAST", "_GLOBAL_POOL", "_NeedTag", "_POOL", "_REDUCE", "_Refuse",
           "_SourceAction", "_UNARY", "_attr", "_const", "_input", "_static_shape"]

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


#: Shape-preserving ops this pass treats alike (output 0 has input 0's shape, read off input 0 alone): the
#: standard ones and the ``com.microsoft`` (or default-domain contrib) ones whose foreign-op record lists
#: output 0 in ``same_shape_outputs`` and says ``elementwise`` or ``normalizes`` (their other inputs are
#: parameters or tensors of input 0's shape).  ``RotaryEmbedding`` keeps input 0's shape too but reads position rows of
#: its cos/sin caches, whose length may be the old sequence size: this rule would not see it, so no rule.
_UNARY = SAME_SHAPE_OPS | {op.name for op in BUILTIN_FOREIGN_OPS if op.domain in ("", MS_DOMAIN)
                           and 0 in op.same_shape_outputs and (op.elementwise or op.normalizes)}
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
