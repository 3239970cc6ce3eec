"""Dependency analysis for structured pruning: which tensor dimensions must shrink together.

Removing output channel ``j`` of a layer is only correct if every tensor that carries channel ``j``
loses it too: the bias added to it, the BatchNorm statistics applied to it, the activations computed
from it, the other operand of a residual ``Add``, the input rows of every layer that reads it, the
``Reshape`` constants that split it into heads.  This module computes that set — a **group** — as the
closure of one seed dimension over the graph, op by op.

A dimension is a :class:`Dim`: ``(value, axis)`` plus the layout of the prunable units along the axis.
A group has ``units`` units; unit ``u`` occupies indices ``offset + u*inner ... offset + (u+1)*inner - 1``
of the axis.  ``inner`` is 1 for single neurons and channels, and ``head_dim`` for the flat hidden axis
of an attention projection whose heads are the units; ``offset`` is non-zero behind a ``Concat``.

Each operator has a rule mapping a dimension on one of its ports to the coupled dimensions on its other
ports (:func:`op_rules`: the standard ops' and, from their records, the foreign ops').  Constants (initializers and ``Constant`` node outputs) end the walk: they are
the weights that get sliced.  The walk never stops early; every obstacle is collected as a reason, and
a group with any reason is *blocked* — left alone — because the dimension is:

- read by an operator with no rule (unknown op, custom domain, control flow), or an operator that mixes
  the axis (a reduction or normalisation over it, a Softmax along it, a Gather, a Slice, ...);
- a graph input or output (the model's interface never changes);
- reshaped in a way that does not keep units contiguous, or whose target shape is computed at run time;

A weight also read outside the group (exporters share equal tensors, often through ``Identity``) does
not block: the group gets a private, sliced copy and the other readers keep the original.

Sizes come from the core's shape facility (:class:`mograph.shapes.ShapeQuery`, read as numbers through
:class:`mograph.shapes.Sizes`): its per-op rules follow run-time shape arithmetic (an attention mask built
by ``Expand`` keeps its broadcast 1 on the head axis), completed with what ONNX inference left on the
values; the analysed model is neither serialized nor mutated here.  An unknown size is taken as possibly
coupled (never as a broadcast 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mograph.foreign_ops import ForeignOp, elementwise_ops, normalization_ops
from mograph.shapes import (
    BROADCAST_OPS,
    REDUCE_OPS,
    DimSize,
    ShapeQuery,
    ShapeRules,
    Sizes,
    const_tensor,
    int_vector,
    owns_tensor,
    shape_literals,
)
from mograph.shapes import ShapeLiteral as _Literal

#: The sizes the analysis reads (the shape facility's query, as numbers).
ShapeInfo = Sizes


def shape_info(model: ir.Model, rules: ShapeRules | None = None) -> ShapeInfo:
    """The sizes of ``model``'s main graph: one :class:`~mograph.shapes.ShapeQuery` sweep with ``rules`` (the
    run's table, :func:`mograph.shapes.rules_for`; by default the built-in rules)."""
    return Sizes(ShapeQuery(model.graph, rules))

__all__ = [
    "ConstSlice",
    "Dim",
    "Group",
    "ShapeEdit",
    "ShapeInfo",
    "SplitEdit",
    "analyze",
    "const_tensor",
    "int_vector",
    "op_rules",
    "owns_tensor",
    "reshape_plan",
    "shape_info",
]



# ------------------------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class Dim:
    """One coupled dimension: ``units`` blocks of ``inner`` indices at ``offset`` along ``value``'s ``axis``."""

    value: ir.Value
    axis: int
    offset: int = 0
    inner: int = 1


@dataclass
class ConstSlice:
    """A constant (initializer or ``Constant`` output) sliced along ``axis``; ``role`` says what it is.

    Roles: ``weight`` (MatMul/Gemm/Conv operand), ``bias`` (elementwise operand), ``norm`` (BatchNorm
    scale or shift), ``stat`` (BatchNorm running statistics, not counted in importance).
    """

    value: ir.Value
    axis: int
    offset: int
    inner: int
    role: str


@dataclass
class ShapeEdit:
    """A literal of a Reshape target (or of a Split's sizes) that shrinks by ``inner`` per removed unit."""

    const: ir.Value  # the constant holding the literal
    index: int  # position inside that constant
    inner: int
    readers: list[tuple[ir.Node, int]] = field(default_factory=list)  # who reads ``const`` for this group


@dataclass
class SplitEdit:
    """A ``split`` attribute entry (opset < 13) that shrinks by ``inner`` per removed unit."""

    node: ir.Node
    index: int
    inner: int


@dataclass
class Group:
    """The closure of one seed: everything that shrinks with it, or the reasons it cannot."""

    name: str
    scope: str
    seed: ir.Node
    units: int
    #: keyed by (id(value), axis, offset): a fused QKV projection holds one group at three offsets.
    dims: dict[tuple[int, int, int], Dim] = field(default_factory=dict)
    consts: dict[tuple[int, int, int], ConstSlice] = field(default_factory=dict)
    shape_edits: dict[tuple[int, int], ShapeEdit] = field(default_factory=dict)
    split_edits: dict[tuple[int, int], SplitEdit] = field(default_factory=dict)
    nodes: dict[int, ir.Node] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    #: (id(node), input index) of every read of a sliced constant that the group accounts for.
    const_ports: dict[tuple[int, int, int], set[tuple[int, int]]] = field(default_factory=dict)

    @property
    def blocked(self) -> bool:
        return bool(self.reasons)

    def names(self) -> Iterable[str]:
        """Node and value names the group touches (matched by ``--exclude``)."""
        for node in self.nodes.values():
            if node.name:
                yield node.name
        for d in self.dims.values():
            if d.value.name:
                yield d.value.name
        for c in self.consts.values():
            if c.value.name:
                yield c.value.name


# ------------------------------------------------------------------------------------------- rules

# A rule's answer: coupled dims as (value, axis, offset, inner, role, node input index or -1), or a reason.
Coupling = tuple[ir.Value, int, int, int, str, int]
RuleResult = list[Coupling] | str


@dataclass
class _Ctx:
    shapes: ShapeInfo
    opset: int
    group: Group
    rules: Mapping[tuple[str, str], Rule]


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _is_one(size: DimSize) -> bool:
    return isinstance(size, int) and size == 1


def _role(value: ir.Value, role: str) -> str:
    return role if const_tensor(value) is not None else ""


def _unary(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    """Same axis on the data input and on every output (activations, Cast, Dropout, Clip ...)."""
    if is_input and index != 0:
        return f"{node.op_type} {node.name!r} reads the channel axis as a parameter input"
    x = node.inputs[0]
    assert x is not None
    out: list[Coupling] = [(x, d.axis, d.offset, d.inner, "", 0)]
    out += [(y, d.axis, d.offset, d.inner, "", -1) for y in node.outputs if y.uses() or y.is_graph_output()]
    return out


def _broadcast(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    """Multidirectional broadcasting: inputs whose size on the axis is 1 (or that lack it) are not coupled."""
    y = node.outputs[0]
    out_rank = ctx.shapes.rank(y)
    ranks = [ctx.shapes.rank(v) if v is not None else None for v in node.inputs]
    if out_rank is None:
        known = [r for r in ranks if r is not None]
        if len(known) != len([v for v in node.inputs if v is not None]):
            return f"{node.op_type} {node.name!r}: rank unknown"
        out_rank = max(known)
    here = ranks[index] if is_input else out_rank
    if here is None:
        return f"{node.op_type} {node.name!r}: rank unknown"
    out_axis = d.axis + (out_rank - here)
    full = ctx.shapes.size(d.value, d.axis)
    result: list[Coupling] = [(y, out_axis, d.offset, d.inner, "", -1)]
    for i, (v, r) in enumerate(zip(node.inputs, ranks)):
        if v is None:
            continue
        if r is None:
            return f"{node.op_type} {node.name!r}: rank of input {i} unknown"
        axis = out_axis - (out_rank - r)
        if axis < 0:
            continue
        size = ctx.shapes.size(v, axis)
        if _is_one(size) and not _is_one(full):
            continue
        result.append((v, axis, d.offset, d.inner, _role(v, "bias"), i))
    return result


def _transpose(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    x, y = node.inputs[0], node.outputs[0]
    rank = ctx.shapes.rank(x) if x is not None else None
    if x is None or rank is None:
        return f"Transpose {node.name!r}: rank unknown"
    attr = node.attributes.get("perm")
    perm = list(attr.value) if attr is not None else list(reversed(range(rank)))
    if is_input:
        return [(x, d.axis, d.offset, d.inner, "", 0), (y, perm.index(d.axis), d.offset, d.inner, "", -1)]
    return [(x, perm[d.axis], d.offset, d.inner, "", 0), (y, d.axis, d.offset, d.inner, "", -1)]


def _matmul(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    """``A[..., m, k] @ B[..., k, n]``: k couples A and B; m couples A and Y; n couples B and Y;
    batch axes couple wherever their size is not a broadcast 1."""
    a, b = node.inputs[0], node.inputs[1]
    y = node.outputs[0]
    assert a is not None and b is not None
    ra, rb, ry = ctx.shapes.rank(a), ctx.shapes.rank(b), ctx.shapes.rank(y)
    if ra is None or rb is None:
        return f"MatMul {node.name!r}: rank unknown"
    if ra < 2 or rb < 2:
        return f"MatMul {node.name!r}: 1-D operand"
    ry = ry if ry is not None else max(ra, rb)
    o, i_, n = d.offset, d.inner, ""
    port = (0 if is_input and index == 0 else 1 if is_input else -1)
    here = {0: ra, 1: rb, -1: ry}[port]
    neg = d.axis - here  # negative axis
    if neg == -1 and port == 0 or neg == -2 and port == 1:  # contraction
        return [(a, ra - 1, o, i_, n, 0), (b, rb - 2, o, i_, _role(b, "weight"), 1)]
    if neg == -2 and port in (0, -1):
        return [(a, ra - 2, o, i_, n, 0), (y, ry - 2, o, i_, n, -1)]
    if neg == -1 and port in (1, -1):
        return [(b, rb - 1, o, i_, _role(b, "weight"), 1), (y, ry - 1, o, i_, n, -1)]
    # A batch axis.
    out_axis = d.axis + (ry - here)
    full = ctx.shapes.size(d.value, d.axis)
    result: list[Coupling] = [(y, out_axis, o, i_, n, -1)]
    for idx, (v, r) in enumerate(((a, ra), (b, rb))):
        axis = out_axis - (ry - r)
        if axis < 0 or axis >= r - 2:
            continue
        if _is_one(ctx.shapes.size(v, axis)) and not _is_one(full):
            continue
        result.append((v, axis, o, i_, _role(v, "weight"), idx))
    return result


def _gemm(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    a, b = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    y = node.outputs[0]
    assert a is not None and b is not None
    ta = node.attributes.get("transA")
    tb = node.attributes.get("transB")
    ta_v = ta.value if ta is not None else 0
    tb_v = tb.value if tb is not None else 0
    a_m, a_k = (1, 0) if ta_v else (0, 1)
    b_k, b_n = (1, 0) if tb_v else (0, 1)
    o, i_ = d.offset, d.inner
    if is_input and index == 2:
        assert c is not None
        rc = ctx.shapes.rank(c) or 0
        y_axis = d.axis + (2 - rc)
    elif is_input:
        if (index == 0 and d.axis == a_k) or (index == 1 and d.axis == b_k):
            return [(a, a_k, o, i_, "", 0), (b, b_k, o, i_, _role(b, "weight"), 1)]
        y_axis = 0 if index == 0 else 1
    else:
        y_axis = d.axis
    result: list[Coupling] = [(y, y_axis, o, i_, "", -1)]
    if y_axis == 0:
        result.append((a, a_m, o, i_, "", 0))
    else:
        result.append((b, b_n, o, i_, _role(b, "weight"), 1))
    if c is not None:
        rank_c = ctx.shapes.rank(c)
        if rank_c is None:
            return f"Gemm {node.name!r}: rank of C unknown"
        axis = y_axis - (2 - rank_c)
        if axis >= 0 and not (_is_one(ctx.shapes.size(c, axis)) and not _is_one(ctx.shapes.size(y, y_axis))):
            result.append((c, axis, o, i_, _role(c, "bias"), 2))
    return result


def _conv(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    y = node.outputs[0]
    assert x is not None and w is not None
    group = node.attributes.get("group")
    if group is not None and group.value != 1:
        return f"Conv {node.name!r}: grouped convolution (group={group.value})"
    o, i_ = d.offset, d.inner
    if is_input and index == 0:
        if d.axis == 1:
            return [(x, 1, o, i_, "", 0), (w, 1, o, i_, _role(w, "weight"), 1)]
        if d.axis == 0:
            return [(x, 0, o, i_, "", 0), (y, 0, o, i_, "", -1)]
        return f"Conv {node.name!r}: spatial axis"
    if is_input and index == 1 and d.axis == 1:
        return [(x, 1, o, i_, "", 0), (w, 1, o, i_, _role(w, "weight"), 1)]
    if (is_input and index == 1 and d.axis == 0) or (is_input and index == 2) or (not is_input and d.axis == 1):
        result: list[Coupling] = [(y, 1, o, i_, "", -1), (w, 0, o, i_, _role(w, "weight"), 1)]
        if bias is not None:
            result.append((bias, 0, o, i_, _role(bias, "bias"), 2))
        return result
    if not is_input and d.axis == 0:
        return [(x, 0, o, i_, "", 0), (y, 0, o, i_, "", -1)]
    return f"Conv {node.name!r}: spatial axis"


def _batchnorm(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    if len([v for v in node.outputs if v.uses() or v.is_graph_output()]) > 1:
        return f"BatchNormalization {node.name!r}: training-mode outputs"
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    axis = 1 if is_input and index > 0 else d.axis
    o, i_ = d.offset, d.inner
    result: list[Coupling] = [(x, axis, o, i_, "", 0), (y, axis, o, i_, "", -1)]
    if axis == 1:
        for k in range(1, 5):
            v = node.inputs[k] if k < len(node.inputs) else None
            if v is not None:
                result.append((v, 0, o, i_, _role(v, "norm" if k < 3 else "stat"), k))
    return result


def _layernorm(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    x = node.inputs[0]
    rank = ctx.shapes.rank(x)
    if rank is None:
        return f"{node.op_type} {node.name!r}: rank unknown"
    attr = node.attributes.get("axis")
    first = _norm_axis(attr.value if attr is not None else -1, rank)
    if (is_input and index > 0) or d.axis >= first:
        return f"{node.op_type} {node.name!r} normalizes over the channel axis"
    if (not is_input) and index > 0:
        return f"{node.op_type} {node.name!r}: statistics output is read"
    assert x is not None
    return [(x, d.axis, d.offset, d.inner, "", 0), (node.outputs[0], d.axis, d.offset, d.inner, "", -1)]


def _axis_op(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    """Softmax-like ops with one ``axis``: the channel axis may be any other axis."""
    x = node.inputs[0]
    rank = ctx.shapes.rank(x)
    if rank is None:
        return f"{node.op_type} {node.name!r}: rank unknown"
    attr = node.attributes.get("axis")
    if ctx.opset < 13:
        return f"{node.op_type} {node.name!r}: opset < 13 flattens the input"
    axis = _norm_axis(attr.value if attr is not None else -1, rank)
    if d.axis == axis:
        return f"{node.op_type} {node.name!r} runs along the channel axis"
    return _unary(ctx, node, is_input, index, d)


def _reduce(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    x, y = node.inputs[0], node.outputs[0]
    rank = ctx.shapes.rank(x)
    if x is None or rank is None or (is_input and index != 0):
        return f"{node.op_type} {node.name!r}: rank unknown or axes not constant"
    attr = node.attributes.get("axes")
    axes = list(attr.value) if attr is not None else int_vector(node.inputs[1] if len(node.inputs) > 1 else None)
    if axes is None:
        return f"{node.op_type} {node.name!r} reduces over every axis"
    axes = sorted(_norm_axis(a, rank) for a in axes)
    keep_attr = node.attributes.get("keepdims")
    keepdims = keep_attr.value if keep_attr is not None else 1
    in_axis = d.axis if is_input else None
    if not is_input:
        if keepdims:
            in_axis = d.axis
        else:
            kept = [a for a in range(rank) if a not in axes]
            in_axis = kept[d.axis]
    assert in_axis is not None
    if in_axis in axes:
        return f"{node.op_type} {node.name!r} reduces over the channel axis"
    out_axis = in_axis if keepdims else in_axis - sum(a < in_axis for a in axes)
    return [(x, in_axis, d.offset, d.inner, "", 0), (y, out_axis, d.offset, d.inner, "", -1)]


def _pool(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    """Pooling keeps batch and channel axes (``N, C, spatial...``)."""
    if d.axis > 1:
        return f"{node.op_type} {node.name!r}: spatial axis"
    if len([v for v in node.outputs if v.uses() or v.is_graph_output()]) > 1:
        return f"{node.op_type} {node.name!r}: indices output is read"
    x = node.inputs[0]
    assert x is not None
    return [(x, d.axis, d.offset, d.inner, "", 0), (node.outputs[0], d.axis, d.offset, d.inner, "", -1)]


def _flatten(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    x, y = node.inputs[0], node.outputs[0]
    dims = ctx.shapes.dims(x)
    if x is None or dims is None:
        return f"Flatten {node.name!r}: shape unknown"
    attr = node.attributes.get("axis")
    k = _norm_axis(attr.value if attr is not None else 1, len(dims))

    def prod(ds: list[DimSize]) -> int | None:
        return math.prod(ds) if all(isinstance(s, int) for s in ds) else None  # type: ignore[arg-type]

    if is_input:
        if d.axis < k:
            return f"Flatten {node.name!r}: channel axis merged into the leading axis"
        before, after = prod(dims[k : d.axis]), prod(dims[d.axis + 1 :])
        if before != 1 or after is None:
            return f"Flatten {node.name!r}: units would not stay contiguous"
        return [(x, d.axis, d.offset, d.inner, "", 0), (y, 1, d.offset * after, d.inner * after, "", -1)]
    if d.axis == 0:
        return f"Flatten {node.name!r}: channel axis is the flattened leading axis"
    for a in range(k, len(dims)):
        if _is_one(dims[a]):
            continue
        after = prod(dims[a + 1 :])
        if after is None or d.inner % after or d.offset % after:
            break
        return [(x, a, d.offset // after, d.inner // after, "", 0), (y, 1, d.offset, d.inner, "", -1)]
    return f"Flatten {node.name!r}: units do not map onto one input axis"


def _squeeze_like(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    x, y = node.inputs[0], node.outputs[0]
    if x is None or (is_input and index != 0):
        return f"{node.op_type} {node.name!r}: channel axis read as axes"
    attr = node.attributes.get("axes")
    axes = list(attr.value) if attr is not None else int_vector(node.inputs[1] if len(node.inputs) > 1 else None)
    rx, ry = ctx.shapes.rank(x), ctx.shapes.rank(y)
    if rx is None or ry is None:
        return f"{node.op_type} {node.name!r}: rank unknown"
    if axes is None:
        if node.op_type != "Squeeze":
            return f"{node.op_type} {node.name!r}: axes unknown"
        dims = ctx.shapes.dims(x) or []
        axes = [a for a, s in enumerate(dims) if _is_one(s)]
    if node.op_type == "Unsqueeze":
        inserted = sorted(_norm_axis(a, ry) for a in axes)
        kept = [a for a in range(ry) if a not in inserted]  # output axes that come from the input, in order
        pairs = list(enumerate(kept))
    else:
        removed = sorted(_norm_axis(a, rx) for a in axes)
        pairs = [(a, j) for j, a in enumerate(a for a in range(rx) if a not in removed)]
    mapping = dict(pairs)  # input axis -> output axis
    if is_input:
        if d.axis not in mapping:
            return f"{node.op_type} {node.name!r}: channel axis is squeezed"
        out_axis = mapping[d.axis]
        in_axis = d.axis
    else:
        inverse = {j: a for a, j in mapping.items()}
        if d.axis not in inverse:
            return f"{node.op_type} {node.name!r}: inserted axis"
        in_axis, out_axis = inverse[d.axis], d.axis
    return [(x, in_axis, d.offset, d.inner, "", 0), (y, out_axis, d.offset, d.inner, "", -1)]


def _concat(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    y = node.outputs[0]
    rank = ctx.shapes.rank(y)
    attr = node.attributes.get("axis")
    if rank is None or attr is None:
        return f"Concat {node.name!r}: rank unknown"
    axis = _norm_axis(attr.value, rank)
    o, i_ = d.offset, d.inner
    if d.axis != axis:
        result: list[Coupling] = [(y, d.axis, o, i_, "", -1)]
        result += [(v, d.axis, o, i_, _role(v, "bias"), k) for k, v in enumerate(node.inputs) if v is not None]
        return result
    sizes = [ctx.shapes.size(v, axis) if v is not None else 0 for v in node.inputs]
    if not all(isinstance(s, int) for s in sizes):
        return f"Concat {node.name!r}: input sizes along the axis unknown"
    starts = np.cumsum([0, *sizes]).tolist()
    if is_input:
        v = node.inputs[index]
        assert v is not None
        return [(v, axis, o, i_, _role(v, "bias"), index), (y, axis, starts[index] + o, i_, "", -1)]
    units = ctx.group.units
    for k, v in enumerate(node.inputs):
        if v is not None and starts[k] <= o and o + units * i_ <= starts[k + 1]:
            return [(v, axis, o - starts[k], i_, _role(v, "bias"), k), (y, axis, o, i_, "", -1)]
    return f"Concat {node.name!r}: channels straddle two inputs"


def _split(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    x = node.inputs[0]
    rank = ctx.shapes.rank(x)
    if x is None or rank is None or (is_input and index != 0):
        return f"Split {node.name!r}: rank unknown or channel axis read as sizes"
    attr = node.attributes.get("axis")
    axis = _norm_axis(attr.value if attr is not None else 0, rank)
    o, i_ = d.offset, d.inner
    if d.axis != axis:
        return [(x, d.axis, o, i_, "", 0)] + [(v, d.axis, o, i_, "", -1) for v in node.outputs]
    sizes = [ctx.shapes.size(v, axis) for v in node.outputs]
    if not all(isinstance(s, int) for s in sizes):
        return f"Split {node.name!r}: output sizes unknown"
    split_input = node.inputs[1] if len(node.inputs) > 1 else None
    split_attr = node.attributes.get("split")
    if split_input is None and split_attr is None:
        return f"Split {node.name!r}: equal split (sizes not stored) cannot shrink one output"
    starts = np.cumsum([0, *sizes]).tolist()
    if is_input:
        k = next((k for k in range(len(sizes)) if starts[k] <= o and o + ctx.group.units * i_ <= starts[k + 1]), None)
        if k is None:
            return f"Split {node.name!r}: channels straddle two outputs"
    else:
        k = index
        o = o + starts[k]
    if split_input is not None:
        if int_vector(split_input) is None:
            return f"Split {node.name!r}: sizes computed at run time"
        key = (id(split_input), k)
        edit = ctx.group.shape_edits.setdefault(key, ShapeEdit(split_input, k, i_))
        edit.readers.append((node, 1))
    else:
        ctx.group.split_edits[(id(node), k)] = SplitEdit(node, k, i_)
    return [(x, axis, o, i_, "", 0), (node.outputs[k], axis, o - starts[k], i_, "", -1)]


def _shape(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    """``Shape`` may read a pruned value if nothing downstream uses the channel axis's size."""
    rank = ctx.shapes.rank(node.inputs[0])
    if rank is None:
        return f"Shape {node.name!r}: rank unknown"
    start = node.attributes.get("start")
    end = node.attributes.get("end")
    lo = _norm_axis(start.value, rank) if start is not None else 0
    hi = _norm_axis(end.value, rank) if end is not None else rank
    if not lo <= d.axis < hi:
        return []
    pos = d.axis - lo
    for use in node.outputs[0].uses():
        reader = use.node
        if reader.op_type == "Gather" and use.idx == 0:
            idx = int_vector(reader.inputs[1])
            if idx is not None and all(_norm_axis(i, hi - lo) != pos for i in idx):
                continue
        if reader.op_type == "Slice" and use.idx == 0:
            starts, ends = int_vector(reader.inputs[1]), int_vector(reader.inputs[2])
            axes = int_vector(reader.inputs[3]) if len(reader.inputs) > 3 else [0]
            steps = int_vector(reader.inputs[4]) if len(reader.inputs) > 4 else [1]
            if starts and ends and axes == [0] and steps in ([1], None) and len(starts) == len(ends) == 1:
                n = hi - lo
                s = max(0, min(n, _norm_axis(starts[0], n)))
                e = max(0, min(n, _norm_axis(ends[0], n) if ends[0] < 2**62 else n))
                if not s <= pos < e:
                    continue
        return f"Shape {node.name!r}: the channel axis's size is read by {reader.op_type} {reader.name!r}"
    return []


def _reshape_groups(in_dims: list[DimSize], out_dims: list[DimSize]) -> list[tuple[list[int], list[int]]] | None:
    """Pair up input and output axes of a Reshape: runs of static axes with equal products, and
    unknown (symbolic) axes one to one."""
    groups: list[tuple[list[int], list[int]]] = []
    i = o = 0
    while i < len(in_dims) or o < len(out_dims):
        if i < len(in_dims) and o < len(out_dims) and not isinstance(in_dims[i], int) and not isinstance(
            out_dims[o], int
        ):
            groups.append(([i], [o]))
            i, o = i + 1, o + 1
            continue
        ins: list[int] = []
        outs: list[int] = []
        pi = po = 1
        while True:
            if (not ins or pi < po) and i < len(in_dims):
                in_dim = in_dims[i]
                if not isinstance(in_dim, int):
                    return None
                pi *= in_dim
                ins.append(i)
                i += 1
            elif (not outs or po < pi) and o < len(out_dims):
                out_dim = out_dims[o]
                if not isinstance(out_dim, int):
                    return None
                po *= out_dim
                outs.append(o)
                o += 1
            else:
                break
            if ins and outs and pi == po:
                break
        if pi != po:
            return None
        groups.append((ins, outs))
    return groups


ReshapePlan = tuple[list[DimSize], list[DimSize], list[_Literal], list[tuple[list[int], list[int]]]]


def reshape_plan(node: ir.Node, shapes: ShapeInfo) -> ReshapePlan | str:
    """Input dims, output dims, target literals and paired axis runs of a Reshape, or why not known."""
    x, target, y = node.inputs[0], node.inputs[1], node.outputs[0]
    if x is None or target is None:
        return f"Reshape {node.name!r}: missing input"
    in_dims = shapes.dims(x)
    literals = shape_literals(target, shapes)
    if in_dims is None or literals is None:
        return f"Reshape {node.name!r}: input shape or target unknown"
    inferred = shapes.dims(y) or [None] * len(literals)
    out_dims: list[DimSize] = []
    minus_one = None
    for k, (lit, *_rest) in enumerate(literals):
        if lit is None:
            out_dims.append(inferred[k] if k < len(inferred) else None)
        elif lit == 0:
            out_dims.append(in_dims[k] if k < len(in_dims) else None)
        elif lit == -1:
            minus_one = k
            out_dims.append(inferred[k] if k < len(inferred) and isinstance(inferred[k], int) else None)
        else:
            out_dims.append(lit)
    if minus_one is not None and not isinstance(out_dims[minus_one], int):
        known_in = [s for s in in_dims if isinstance(s, int)]
        known_out = [s for k, s in enumerate(out_dims) if isinstance(s, int) and k != minus_one]
        if len(in_dims) - len(known_in) == len(out_dims) - 1 - len(known_out):
            q, r = divmod(math.prod(known_in), math.prod(known_out) or 1)
            if r == 0:
                out_dims[minus_one] = q
    groups = _reshape_groups(in_dims, out_dims)
    if groups is None:
        return f"Reshape {node.name!r}: cannot pair input and output axes"
    shapes.refine(y, out_dims)
    return in_dims, out_dims, literals, groups


def _reshape(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim) -> RuleResult:
    x, y = node.inputs[0], node.outputs[0]
    if is_input and index == 1:
        return f"Reshape {node.name!r}: channel axis flows into the target shape"
    plan = reshape_plan(node, ctx.shapes)
    if isinstance(plan, str):
        return plan
    in_dims, out_dims, literals, groups = plan
    assert x is not None
    src_dims, dst_dims = (in_dims, out_dims) if is_input else (out_dims, in_dims)
    for ins, outs in groups:
        src_axes, dst_axes = (ins, outs) if is_input else (outs, ins)
        if d.axis not in src_axes:
            continue
        pos = src_axes.index(d.axis)
        outer = math.prod(src_dims[a] for a in src_axes[:pos])  # type: ignore[misc]
        after = math.prod(src_dims[a] for a in src_axes[pos + 1 :])  # type: ignore[misc]
        if outer != 1:
            return f"Reshape {node.name!r}: units would not stay contiguous"
        flat_inner, flat_offset = d.inner * after, d.offset * after
        for j, b in enumerate(dst_axes):
            if math.prod(dst_dims[a] for a in dst_axes[:j]) != 1:  # type: ignore[misc]
                break
            dst_after = math.prod(dst_dims[a] for a in dst_axes[j + 1 :])  # type: ignore[misc]
            if _is_one(dst_dims[b]) and len(dst_axes) > 1:
                continue
            if flat_inner % dst_after or flat_offset % dst_after:
                continue
            inner, offset = flat_inner // dst_after, flat_offset // dst_after
            in_axis, in_off, in_inner = (d.axis, d.offset, d.inner) if is_input else (b, offset, inner)
            out_axis, out_off, out_inner = (b, offset, inner) if is_input else (d.axis, d.offset, d.inner)
            lit, holder, hidx, reader, ridx = literals[out_axis]
            if lit is None:
                return f"Reshape {node.name!r}: target size of axis {out_axis} is computed at run time"
            if lit > 0:
                assert holder is not None
                key = (id(holder), hidx)
                edit = ctx.group.shape_edits.setdefault(key, ShapeEdit(holder, hidx, out_inner))
                edit.readers.append((reader, ridx) if reader is not None else (node, 1))
            elif lit == 0 and in_axis != out_axis:
                return f"Reshape {node.name!r}: target copies axis {out_axis} from a different input axis"
            return [(x, in_axis, in_off, in_inner, "", 0), (y, out_axis, out_off, out_inner, "", -1)]
        shown = [dst_dims[a] for a in dst_axes]
        return f"Reshape {node.name!r} splits the channel axis into {shown}: units of {flat_inner} do not fit one axis"
    return f"Reshape {node.name!r}: channel axis not found"


_UNARY = {
    "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Erf", "Gelu", "Elu", "Selu", "Celu", "Softplus", "Softsign",
    "HardSigmoid", "HardSwish", "Mish", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Cast", "CastLike",
    "Identity", "Dropout", "Clip", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Not", "IsNaN", "IsInf",
    "ThresholdedRelu", "Shrink",
}  # fmt: skip
# the standard ops that broadcast and those that reduce: the core's op classes (mograph.shapes)
_BROADCAST = BROADCAST_OPS
_REDUCE = REDUCE_OPS

Rule = Callable[[_Ctx, ir.Node, bool, int, Dim], RuleResult]
_RULES: dict[tuple[str, str], Rule] = {}
for _op in _UNARY:
    _RULES[("", _op)] = _unary
for _op in _BROADCAST:
    _RULES[("", _op)] = _broadcast
for _op in _REDUCE:
    _RULES[("", _op)] = _reduce
for _op in ("Softmax", "LogSoftmax", "Hardmax"):
    _RULES[("", _op)] = _axis_op
for _op in ("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"):
    _RULES[("", _op)] = _pool
_RULES.update(
    {
        ("", "Transpose"): _transpose,
        ("", "MatMul"): _matmul,
        ("", "Gemm"): _gemm,
        ("", "Conv"): _conv,
        ("", "BatchNormalization"): _batchnorm,
        ("", "Flatten"): _flatten,
        ("", "Squeeze"): _squeeze_like,
        ("", "Unsqueeze"): _squeeze_like,
        ("", "Concat"): _concat,
        ("", "Split"): _split,
        ("", "Shape"): _shape,
        ("", "Reshape"): _reshape,
    }
)


def op_rules(foreign: Mapping[tuple[str, str], ForeignOp] | None = None) -> dict[tuple[str, str], Rule]:
    """The rule of each op: the standard ops' above, then the foreign ops' from their records
    (:mod:`mograph.foreign_ops`; ``foreign``: the registry's, default the built-in ones): an ``elementwise``
    op broadcasts (:func:`_broadcast`), one that ``normalizes`` rows is a LayerNorm (:func:`_layernorm`)."""
    rules = dict(_RULES)
    for key in sorted(elementwise_ops(foreign)):
        rules.setdefault(key, _broadcast)
    for key in sorted(normalization_ops(foreign)):
        rules.setdefault(key, _layernorm)
    return rules


_BUILTIN_RULES = op_rules()

# ------------------------------------------------------------------------------------------- closure


def analyze(seed_node: ir.Node, seed: Dim, units: int, scope: str, name: str, shapes: ShapeInfo, opset: int,
            rules: Mapping[tuple[str, str], Rule] | None = None) -> Group:
    """The group of every dimension coupled to ``seed`` (``units`` prunable units), with its obstacles.

    ``rules``: the rule of each ``(domain, op type)`` (:func:`op_rules`; default: with the built-in records)."""
    group = Group(name=name, scope=scope, seed=seed_node, units=units)
    ctx = _Ctx(shapes, opset, group, _BUILTIN_RULES if rules is None else rules)
    work: list[tuple[Dim, str]] = [(seed, "")]
    while work:
        d, role = work.pop()
        key = (id(d.value), d.axis, d.offset)
        seen = group.dims.get(key)
        if seen is not None:
            if seen.inner != d.inner:
                group.reasons.append(f"{d.value.name!r} axis {d.axis} is reached with two different layouts")
            continue
        group.dims[key] = d
        rank = shapes.rank(d.value)
        size = shapes.size(d.value, d.axis)
        if rank is None or not 0 <= d.axis < rank:
            group.reasons.append(f"{d.value.name!r}: rank unknown")
            continue
        if isinstance(size, int) and size < d.offset + units * d.inner:
            group.reasons.append(f"{d.value.name!r} axis {d.axis}: size {size} does not hold {units} units")
            continue
        if const_tensor(d.value) is not None:
            group.consts[key] = ConstSlice(d.value, d.axis, d.offset, d.inner, role or "bias")
            producer = d.value.producer()
            if producer is not None:
                group.nodes[id(producer)] = producer
            if d.value.is_graph_output():
                group.reasons.append(f"weight {d.value.name!r} is a graph output")
            continue
        if d.value.is_graph_output():
            group.reasons.append(f"{d.value.name!r} is a graph output")
        producer = d.value.producer()
        if producer is None:
            group.reasons.append(f"{d.value.name!r} is a graph input")
        else:
            _visit(ctx, producer, False, producer.outputs.index(d.value), d, work)
        for use in d.value.uses():
            _visit(ctx, use.node, True, use.idx, d, work)
    return group


def _visit(ctx: _Ctx, node: ir.Node, is_input: bool, index: int, d: Dim, work: list[tuple[Dim, str]]) -> None:
    group = ctx.group
    group.nodes[id(node)] = node
    domain = "" if node.domain == "ai.onnx" else node.domain
    rule = ctx.rules.get((domain, node.op_type))
    if rule is None:
        group.reasons.append(f"{node.op_type} {node.name!r} ({domain or 'ai.onnx'}) has no pruning rule")
        return
    if any(isinstance(a.value, ir.Graph) for a in node.attributes.values()):
        group.reasons.append(f"{node.op_type} {node.name!r} holds a subgraph")
        return
    result = rule(ctx, node, is_input, index, d)
    if isinstance(result, str):
        group.reasons.append(result)
        return
    for value, axis, offset, inner, role, port in result:
        if port >= 0 and const_tensor(value) is not None:
            group.const_ports.setdefault((id(value), axis, offset), set()).add((id(node), port))
        work.append((Dim(value, axis, offset, inner), role))
