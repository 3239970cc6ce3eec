"""The built-in shape rules: standard ONNX ops and the ``com.microsoft`` ops the fusions emit or meet.

Each rule is exact: it concludes a dim only where that dim holds for every input the model accepts, and
returns ``None`` (or ``None`` for a dim) where it cannot tell.  The ``since_version`` of a rule is where
the input layout it reads begins; where that layout changed, each layout has its rule, or one rule reads both
(``Unsqueeze``/``Squeeze`` take ``axes`` as an attribute below opset 13 and as an input from 13 on, ``Split``
its ``split`` sizes likewise); an op with no rule in force falls back to what ONNX inference wrote on the value.

The op-class tables (:data:`SAME_SHAPE_OPS`, :data:`BROADCAST_OPS`, :data:`REDUCE_OPS`) are the one place
that says which standard ops keep their input's shape, broadcast, or reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from mograph.foreign_ops import BUILTIN_FOREIGN_OPS
from mograph.shapes._dim import Dim, add, div, mul, prod, sub

if TYPE_CHECKING:
    from mograph.shapes._query import Dims, ShapeQuery, Vector

from mograph.shapes._rules import ShapeRules, shape_rule

__all__ = ["BROADCAST_OPS", "MS_DOMAIN", "REDUCE_OPS", "SAME_SHAPE_OPS", "builtin_rules", "broadcast", "reshape_dims", "reshape_entries",
           "same_shape_rule", "shape_range"]

MS_DOMAIN = "com.microsoft"

#: Standard ops whose output 0 has input 0's shape.
SAME_SHAPE_OPS = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Elu", "Erf", "Exp",
    "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Log", "Mish",
    "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus",
    "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu", "Cast", "CastLike", "Softmax", "LogSoftmax",
    "Hardmax", "Clip", "Dropout", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
    "LpNormalization", "Trilu", "CumSum", "Shrink", "Celu", "QuantizeLinear", "DequantizeLinear",
    "LayerNormalization",
})
#: Standard ops whose output broadcasts all their inputs (numpy rules).
BROADCAST_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "And", "Or", "Xor", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Max", "Min", "Sum",
    "Mean", "PRelu", "BitShift",
})
#: Standard reductions (``axes`` and ``keepdims``).
REDUCE_OPS = frozenset({
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
})

#: ``com.microsoft`` ops whose listed outputs have input 0's shape: their records' ``same_shape_outputs``
#: (:mod:`mograph.foreign_ops`, one record per foreign op).
MS_SAME_SHAPE = {op.name: op.same_shape_outputs for op in BUILTIN_FOREIGN_OPS
                 if op.domain == MS_DOMAIN and op.same_shape_outputs}
#: ONNX Runtime's contrib ops in the default domain (``SimplifiedLayerNormalization``) whose listed outputs
#: have input 0's shape: their records' ``same_shape_outputs``.
CONTRIB_SAME_SHAPE = {op.name: op.same_shape_outputs for op in BUILTIN_FOREIGN_OPS
                      if op.domain == "" and op.same_shape_outputs}
#: ``com.microsoft`` attention ops whose output 0 is ``[batch, sequence, hidden]``: the records whose
#: ``shape_rule`` is ``"attention"``.
MS_ATTENTION = tuple(op.name for op in BUILTIN_FOREIGN_OPS if op.domain == MS_DOMAIN and op.shape_rule == "attention")

ONE = Dim()
ZERO = Dim.lit(0)
MINUS_ONE = Dim.lit(-1)


# --- helpers shared with the passes --------------------------------------------------------------
def broadcast(a: Dims | None, b: Dims | None) -> Dims | None:
    """Numpy broadcasting of two dim tuples; a dim is ``None`` where the two differ and neither is 1."""
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    a = (ONE,) * (n - len(a)) + a
    b = (ONE,) * (n - len(b)) + b
    out: list[Dim | None] = []
    for x, y in zip(a, b):
        if x == ONE:
            out.append(y)
        elif y == ONE or x == y:
            out.append(x)
        else:
            out.append(None)
    return tuple(out)


def reshape_dims(data: Dims | None, target: tuple[Dim | None, ...], allowzero: bool) -> Dims | None:
    """The output dims of ``Reshape(data, target)``: ``0`` copies (unless ``allowzero``), one ``-1`` takes the rest."""
    out: list[Dim | None] = []
    minus = None
    for i, t in enumerate(target):
        if t == ZERO and not allowzero:
            out.append(data[i] if data is not None and i < len(data) else None)
        elif t == MINUS_ONE:
            if minus is not None:
                return None
            minus = i
            out.append(None)
        else:
            out.append(t)
    if minus is not None:
        known = [m for j, m in enumerate(out) if j != minus]
        if data is not None and all(m is not None for m in known) and all(m is not None for m in data):
            rest = prod(known)
            if rest is not None and rest.coef > 0:
                out[minus] = div(prod(data), rest)
    return tuple(out)


def reshape_entries(out: Dims, data: Dims | None, allowzero: bool) -> list[Dim] | None:
    """The entries of a ``Reshape`` target that gives ``data`` the dims ``out``, exactly; ``None`` if none is known.

    With ``allowzero`` only a fully literal ``out`` qualifies.  Otherwise an entry is ``0`` where ``out``
    repeats ``data``'s dim at that index (and that dim is not a positive literal), and a single symbolic
    entry becomes ``-1`` when every other entry is a positive literal (so a zero-size dim cannot make
    ``-1`` ambiguous).  A literal 0 in ``out`` has no entry (``0`` would copy, not make a zero-size dim).
    """
    if allowzero:
        return list(out) if all(m is not None and m.is_literal for m in out) else None  # type: ignore[arg-type]
    entries: list[Dim] = []
    for i, m in enumerate(out):
        if m is None:
            return None
        if data is not None and i < len(data) and data[i] == m and not (m.is_literal and m.coef > 0):
            entries.append(ZERO)  # copy the input dim at this index
        elif m.is_literal and m.coef == 0:
            return None
        else:
            entries.append(m)
    symbolic = [i for i, m in enumerate(entries) if not m.is_literal]
    if len(symbolic) == 1 and all(m.is_literal and m.coef > 0 for j, m in enumerate(entries) if j != symbolic[0]):
        entries[symbolic[0]] = MINUS_ONE
    return entries


def shape_range(node: ir.Node, rank: int) -> tuple[int, int]:
    """``Shape``'s ``start`` and ``end`` attributes, clamped to ``[0, rank]``."""
    start = int(_attr(node, "start", 0))
    end = _attr(node, "end")
    stop = rank if end is None else int(end)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    stop = min(max(stop + rank if stop < 0 else stop, 0), rank)
    return start, stop


def peek_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """``ir.convenience.get_const_tensor`` without its one write: it names a ``Constant`` node's ``value`` tensor
    after the node's output (and putting the old name back would still mark the field as set), and a query only
    reads.  That tensor is returned as it is held."""
    node = value.producer()
    if value.const_value is None and node is not None and node.op_type == "Constant" and node.domain == "" \
            and len(node.attributes) == 1 and len(node.outputs) == 1:
        attr = node.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR and not attr.is_ref():
            return attr.value
    return ir.convenience.get_const_tensor(value)


def _windows(node: ir.Node, d0: Dims, kernel: list[int | None]) -> list[Dim | None]:
    """The spatial dims of a Conv or pool over ``d0`` (``[N, C, *spatial]``): a literal where the input's dim
    and the kernel are literals and the pads explicit (or ``VALID``), else unknown."""
    n = len(d0) - 2
    pads = list(_attr(node, "pads") or [0] * 2 * n)
    strides = list(_attr(node, "strides") or [1] * n)
    dilations = list(_attr(node, "dilations") or [1] * n)
    auto_pad = _attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    spatial: list[Dim | None] = []
    for i in range(n):
        dim, k = d0[2 + i], kernel[i]
        size = dim.value if dim is not None else None
        if size is None or k is None or auto_pad not in ("NOTSET", "VALID"):
            spatial.append(None)
            continue
        pad = pads[i] + pads[i + n] if auto_pad == "NOTSET" else 0
        spatial.append(Dim.lit((size + pad - dilations[i] * (k - 1) - 1) // strides[i] + 1))
    return spatial


def _attr(node: ir.Node, name: str, default: Any = None) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _iattr(node: ir.Node, name: str, default: int) -> int:
    return int(_attr(node, name, default))  # type: ignore[call-overload]


def _axes(node: ir.Node, q: ShapeQuery) -> list[int] | None:
    """The constant ``axes`` of an ``Unsqueeze`` or ``Squeeze``: input 1 (opset 13 on), else the attribute (below
    13); ``None`` where neither holds constant ints."""
    if len(node.inputs) > 1:
        return q.ints(node.inputs[1])
    axes = _attr(node, "axes")
    return None if axes is None else [int(a) for a in axes]


def builtin_rules() -> ShapeRules:
    """A fresh table holding every built-in rule (callers may register more into it)."""
    table = ShapeRules()
    _register_dims(table)
    _register_values(table)
    _register_ms(table)
    return table


# --- dims of standard ops --------------------------------------------------------------------------
def _register_dims(t: ShapeRules) -> None:  # noqa: C901 - one short rule per op, registered in a row
    @shape_rule(t, "", sorted(SAME_SHAPE_OPS))
    def same_shape(node: ir.Node, q: ShapeQuery) -> list[Dims | None]:
        return [q.dims(node.inputs[0])]

    @shape_rule(t, "", sorted(BROADCAST_OPS))
    def broadcasting(node: ir.Node, q: ShapeQuery) -> list[Dims | None]:
        acc = q.dims(node.inputs[0])
        for value in node.inputs[1:]:
            acc = broadcast(acc, q.dims(value))
        return [acc]

    @shape_rule(t, "", "Reshape", 5)
    def reshape(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        target = q.values(node.inputs[1])
        if target is None or target[0]:
            return None
        return [reshape_dims(q.dims(node.inputs[0]), target[1], bool(_attr(node, "allowzero", 0)))]

    @shape_rule(t, "", "Expand", 8)
    def expand(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        target = q.values(node.inputs[1])
        if target is None or target[0]:
            return None
        return [broadcast(q.dims(node.inputs[0]), target[1])]

    @shape_rule(t, "", "Transpose")
    def transpose(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0 = q.dims(node.inputs[0])
        if d0 is None:
            return None
        perm = _attr(node, "perm")
        order: list[int] = list(perm) if perm is not None else list(reversed(range(len(d0))))  # type: ignore[call-overload]
        return [tuple(d0[p] for p in order)]

    @shape_rule(t, "", "Unsqueeze", 13)
    @shape_rule(t, "", "Unsqueeze", 1)  # axes an attribute below 13
    def unsqueeze(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0, axes = q.dims(node.inputs[0]), _axes(node, q)
        if d0 is None or axes is None:
            return None
        rank = len(d0) + len(axes)
        norm = sorted(a % rank for a in axes)
        it = iter(d0)
        return [tuple(ONE if i in norm else next(it) for i in range(rank))]

    @shape_rule(t, "", "Squeeze", 13)
    @shape_rule(t, "", "Squeeze", 1)  # axes an attribute below 13
    def squeeze(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0, axes = q.dims(node.inputs[0]), _axes(node, q)
        if d0 is None or axes is None:
            return None
        drop = {a % len(d0) for a in axes}
        return [tuple(m for i, m in enumerate(d0) if i not in drop)]

    @shape_rule(t, "", "Gather")
    def gather(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0, di = q.dims(node.inputs[0]), q.dims(node.inputs[1])
        if d0 is None or di is None:
            return None
        axis = _iattr(node, "axis", 0) % len(d0)
        return [d0[:axis] + di + d0[axis + 1:]]

    @shape_rule(t, "", "MatMul")
    def matmul(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0, d1 = q.dims(node.inputs[0]), q.dims(node.inputs[1])
        if d0 is None or d1 is None or len(d0) < 2 or len(d1) < 2:
            return None
        batch = broadcast(d0[:-2], d1[:-2])
        return None if batch is None else [batch + (d0[-2], d1[-1])]

    @shape_rule(t, "", "Gemm")
    def gemm(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0, d1 = q.dims(node.inputs[0]), q.dims(node.inputs[1])
        if d0 is None or d1 is None or len(d0) != 2 or len(d1) != 2:
            return None
        m = d0[1] if _attr(node, "transA", 0) else d0[0]
        n = d1[0] if _attr(node, "transB", 0) else d1[1]
        return [(m, n)]

    @shape_rule(t, "", "Split", 13)
    @shape_rule(t, "", "Split", 2)  # sizes the attribute ``split`` from 2 to 12
    def split(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0 = q.dims(node.inputs[0])
        if len(node.inputs) > 1:
            sizes = q.ints(node.inputs[1])
        else:
            given = _attr(node, "split")
            sizes = [int(s) for s in given] if given is not None else None
        if d0 is None or sizes is None or len(sizes) != len(node.outputs):
            return None
        axis = _iattr(node, "axis", 0) % len(d0)
        return [d0[:axis] + (Dim.lit(s),) + d0[axis + 1:] for s in sizes]

    @shape_rule(t, "", "Range", 11)
    def range_(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        start, limit, delta = (q.values(v) for v in node.inputs[:3])
        if start is None or limit is None or delta is None or not (start[0] and limit[0] and delta[0]):
            return None
        s, n, d = start[1][0], limit[1][0], delta[1][0]
        if s == ZERO and d == ONE and n is not None and n.coef >= 0:
            return [(n,)]  # a dim (or a literal >= 0): the length is the limit itself
        if s is not None and n is not None and d is not None and s.is_literal and n.is_literal and d.is_literal \
                and d.coef != 0:
            return [(Dim.lit(max(-(-(n.coef - s.coef) // d.coef), 0)),)]
        return None

    @shape_rule(t, "", "Slice", 10)
    def slice_(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        """Constant starts/ends/axes/steps: literal dims exactly, a dim kept whole where the slice is [0:big].  A
        start or end computed from shapes counts where the value sweep proves every element a literal (TorchScript's
        ``q[..., :cos.shape[-1]]`` of a static head size: Phi 3's rotary)."""
        d0 = q.dims(node.inputs[0])
        ins = node.inputs

        def bound(v: ir.Value | None) -> list[int] | None:
            got = q.ints(v)
            if got is None:
                lits = q.literals(v)
                got = None if lits is None or any(x is None for x in lits) else [int(x) for x in lits]  # type: ignore[arg-type]
            return got

        starts, ends = bound(ins[1]), bound(ins[2])
        axes = q.ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
        steps = q.ints(ins[4]) if len(ins) > 4 and ins[4] is not None else None
        if d0 is None:
            return None
        if starts is None or ends is None:  # bounds computed at run time: the rank is kept, the sliced dims unknown
            cut = {a % len(d0) for a in axes} if axes is not None else set(range(len(d0)))
            return [tuple(None if i in cut else m for i, m in enumerate(d0))]
        axes = axes if axes is not None else list(range(len(starts)))
        steps = steps if steps is not None else [1] * len(starts)
        out = list(d0)
        for s0, e0, a0, st in zip(starts, ends, axes, steps):
            axis = a0 % len(d0)
            dim = d0[axis]
            if dim is not None and dim.is_literal:
                out[axis] = Dim.lit(len(range(dim.coef)[slice(s0, e0, st)]))
            elif s0 == 0 and st == 1 and e0 >= 1 << 62:
                out[axis] = dim
            else:
                out[axis] = None
        return [tuple(out)]

    @shape_rule(t, "", "Concat")
    def concat(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        parts = [q.dims(v) for v in node.inputs]
        if any(p is None for p in parts) or len({len(p) for p in parts}) != 1:  # type: ignore[arg-type]
            return None
        first = parts[0]
        assert first is not None
        axis = _iattr(node, "axis", 0) % len(first)
        along = [p[axis] for p in parts]  # type: ignore[index]
        lits = [m.coef for m in along if m is not None and m.is_literal]
        if len(lits) != len(along):
            return None
        return [first[:axis] + (Dim.lit(sum(lits)),) + first[axis + 1:]]

    @shape_rule(t, "", "Shape")
    def shape(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0 = q.dims(node.inputs[0])
        if d0 is None:
            return None
        return [(Dim.lit(len(d0[slice(*shape_range(node, len(d0)))])),)]

    @shape_rule(t, "", "ConstantOfShape", 9)
    def constant_of_shape(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        vec = q.values(node.inputs[0])
        return None if vec is None or vec[0] else [vec[1]]

    @shape_rule(t, "", "Flatten")
    def flatten(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0 = q.dims(node.inputs[0])
        if d0 is None:
            return None
        axis = _iattr(node, "axis", 1)
        axis = axis + len(d0) if axis < 0 else axis
        if not 0 <= axis <= len(d0):
            return None
        return [(prod(d0[:axis]), prod(d0[axis:]))]

    @shape_rule(t, "", "GatherElements", 11)
    def gather_elements(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        return [q.dims(node.inputs[1])]

    @shape_rule(t, "", "Conv")
    def conv(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        """Batch and output channels; a spatial dim as a literal where its input's is one (explicit pads)."""
        d0, dw = q.dims(node.inputs[0]), q.dims(node.inputs[1])
        if d0 is None or dw is None or len(d0) != len(dw) or len(d0) < 3:
            return None
        return [(d0[0], dw[0], *_windows(node, d0, [m.value if m is not None else None for m in dw[2:]]))]

    @shape_rule(t, "", ["AveragePool", "LpPool", "MaxPool"])
    def pool(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        """Batch and channels kept; a spatial dim as a literal where its input's is one (floor mode, explicit pads)."""
        d0 = q.dims(node.inputs[0])
        kernel = _attr(node, "kernel_shape")
        if d0 is None or len(d0) < 3 or kernel is None or _iattr(node, "ceil_mode", 0):
            return None
        return [(d0[0], d0[1], *_windows(node, d0, list(kernel)))] + [None] * (len(node.outputs) - 1)

    @shape_rule(t, "", ["GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool"])
    def global_pool(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0 = q.dims(node.inputs[0])
        return None if d0 is None or len(d0) < 3 else [(d0[0], d0[1], *[ONE] * (len(d0) - 2))]

    def reduce_dims(node: ir.Node, q: ShapeQuery, axes: list[int] | None) -> list[Dims | None] | None:
        d0 = q.dims(node.inputs[0])
        if d0 is None:
            return None
        if not axes:
            if _iattr(node, "noop_with_empty_axes", 0):
                return [d0]
            axes = list(range(len(d0)))
        drop = {a % len(d0) for a in axes}
        if _iattr(node, "keepdims", 1):
            return [tuple(ONE if i in drop else m for i, m in enumerate(d0))]
        return [tuple(m for i, m in enumerate(d0) if i not in drop)]

    @shape_rule(t, "", sorted(REDUCE_OPS))
    def reduce_attr(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        axes = _attr(node, "axes")
        return reduce_dims(node, q, list(axes) if axes is not None else None)

    def reduce_input(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        given = len(node.inputs) > 1 and node.inputs[1] is not None
        axes = q.ints(node.inputs[1]) if given else []
        return None if axes is None else reduce_dims(node, q, axes)

    shape_rule(t, "", "ReduceSum", 13)(reduce_input)
    shape_rule(t, "", sorted(REDUCE_OPS - {"ReduceSum"}), 18)(reduce_input)


# --- elements of int64 shape vectors -----------------------------------------------------------------
def _register_values(t: ShapeRules) -> None:  # noqa: C901 - one short rule per op, registered in a row
    @shape_rule(t, "", "Shape", kind="values")
    def shape(node: ir.Node, q: ShapeQuery) -> Vector | None:
        d0 = q.dims(node.inputs[0])
        if d0 is None:
            return None
        return False, d0[slice(*shape_range(node, len(d0)))]

    @shape_rule(t, "", "Identity", kind="values")
    def identity(node: ir.Node, q: ShapeQuery) -> Vector | None:
        return q.values(node.inputs[0])

    @shape_rule(t, "", "Cast", kind="values")
    def cast(node: ir.Node, q: ShapeQuery) -> Vector | None:
        """Cast to int64 keeps the elements; to int32 too, for a query that tracks int32 vectors."""
        to = _attr(node, "to")
        return q.values(node.inputs[0]) if to == ir.DataType.INT64 or (q.int32 and to == ir.DataType.INT32) else None

    @shape_rule(t, "", "ConstantOfShape", 9, kind="values")
    def constant_of_shape(node: ir.Node, q: ShapeQuery) -> Vector | None:
        shape = q.values(node.inputs[0])
        value = node.attributes.get("value")
        if shape is None or shape[0] or not all(m is not None and m.is_literal for m in shape[1]) or value is None:
            return None  # (no value: float32 zeros, not an int64 vector)
        fill_tensor = value.as_tensor()
        if fill_tensor.dtype != ir.DataType.INT64:
            return None
        fill = int(np.asarray(fill_tensor.numpy()).reshape(-1)[0])
        n = prod(shape[1])
        if n is None or len(shape[1]) != 1 or n.coef > q.max_vector:
            return None
        return False, tuple(Dim.lit(fill) for _ in range(n.coef))

    @shape_rule(t, "", "Gather", kind="values")
    def gather(node: ir.Node, q: ShapeQuery) -> Vector | None:
        x, idx = q.values(node.inputs[0]), q.ints(node.inputs[1])
        if x is None or x[0] or idx is None or _iattr(node, "axis", 0) != 0:
            return None
        itensor = peek_tensor(node.inputs[1]) if node.inputs[1] is not None else None
        scalar = itensor is not None and itensor.shape.rank() == 0
        size = len(x[1])
        if any(not -size <= i < size for i in idx):
            return None
        return scalar, tuple(x[1][i] for i in idx)

    @shape_rule(t, "", "Slice", 10, kind="values")
    def slice_(node: ir.Node, q: ShapeQuery) -> Vector | None:
        ins = node.inputs
        x = q.values(ins[0])
        starts, ends = q.ints(ins[1]), q.ints(ins[2])
        axes = q.ints(ins[3]) if len(ins) > 3 and ins[3] is not None else [0]
        steps = q.ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1]
        if x is None or x[0] or starts is None or ends is None or axes not in ([0], [-1]) or steps is None:
            return None
        if len(starts) != 1 or len(ends) != 1 or steps[0] <= 0:
            return None
        return False, x[1][starts[0]:ends[0]:steps[0]]

    @shape_rule(t, "", "Unsqueeze", 13, kind="values")
    @shape_rule(t, "", "Unsqueeze", 1, kind="values")
    def unsqueeze(node: ir.Node, q: ShapeQuery) -> Vector | None:
        x = q.values(node.inputs[0])
        return (False, x[1]) if x is not None and x[0] and _axes(node, q) in ([0], [-1]) else None

    @shape_rule(t, "", "Squeeze", 13, kind="values")
    @shape_rule(t, "", "Squeeze", 1, kind="values")  # axes an attribute below 13
    def squeeze(node: ir.Node, q: ShapeQuery) -> Vector | None:
        x = q.values(node.inputs[0])
        if x is None or x[0] or len(x[1]) != 1:
            return None
        if (len(node.inputs) > 1 or "axes" in node.attributes) and _axes(node, q) not in ([0], [-1]):
            return None
        return True, x[1]

    @shape_rule(t, "", "ReduceProd", 18, kind="values")  # axes an input
    @shape_rule(t, "", "ReduceProd", 1, kind="values")
    def reduce_prod(node: ir.Node, q: ShapeQuery) -> Vector | None:
        """The product of a 1-D vector's elements (tf2onnx's merged batch dims: ``ReduceProd(Shape(x)[0:2])``)."""
        x = q.values(node.inputs[0])
        if x is None or x[0] or _iattr(node, "noop_with_empty_axes", 0):
            return None
        axes = q.ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if axes is None and "axes" in node.attributes:
            axes = [int(a) for a in node.attributes["axes"].value]
        if axes not in (None, [0], [-1]):
            return None
        n = prod(x[1])
        return None if n is None else (not _iattr(node, "keepdims", 1), (n,))

    @shape_rule(t, "", "Reshape", 5, kind="values")
    def reshape(node: ir.Node, q: ShapeQuery) -> Vector | None:
        x, target = q.values(node.inputs[0]), q.ints(node.inputs[1])
        if x is None or target is None or len(target) > 1:
            return None
        if target == [] and len(x[1]) == 1:
            return True, x[1]
        if target in ([-1], [len(x[1])]):
            return False, x[1]
        return None

    @shape_rule(t, "", "Concat", kind="values")
    def concat(node: ir.Node, q: ShapeQuery) -> Vector | None:
        parts = [q.values(v) for v in node.inputs]
        if _iattr(node, "axis", 0) not in (0, -1) or any(p is None or p[0] for p in parts):
            return None
        return False, tuple(m for p in parts for m in p[1])  # type: ignore[index]

    @shape_rule(t, "", ("Add", "Sub", "Mul", "Div", "Equal", "Where", "Max", "Min"), kind="values")
    def elementwise(node: ir.Node, q: ShapeQuery) -> Vector | None:
        parts = [q.values(v) for v in node.inputs]
        if any(p is None for p in parts):
            return None
        lens = {len(p[1]) for p in parts if not p[0]}  # type: ignore[index]
        if len(lens) > 1 and not (len(lens) == 2 and 1 in lens):
            return None
        width = max([len(p[1]) for p in parts] or [0])  # type: ignore[index]
        cols = [[p[1][0]] * width if len(p[1]) == 1 else list(p[1]) for p in parts]  # type: ignore[index]
        scalar = all(p[0] for p in parts)  # type: ignore[index]
        return scalar, tuple(_elementwise(node.op_type, [c[i] for c in cols]) for i in range(width))


def _elementwise(op: str, args: list[Dim | None]) -> Dim | None:
    """One element of an int64 ``Add``/``Sub``/``Mul``/``Div``/``Equal``/``Where``/``Max``/``Min`` on shape vectors
    (``Max``/``Min`` of equal elements is that element: tf2onnx's broadcast batch dims of a batched MatMul)."""
    if any(a is None for a in args):
        return None
    if op in ("Max", "Min"):
        if all(a == args[0] for a in args):
            return args[0]
        if all(a is not None and a.is_literal for a in args):
            pick = max if op == "Max" else min
            return Dim.lit(pick(a.coef for a in args))  # type: ignore[union-attr]
        return None
    if op == "Where":
        cond, a, b = args
        if cond is None or not cond.is_literal:
            return None
        return a if cond.coef else b
    a, b = args
    assert a is not None and b is not None
    if op == "Mul":
        return mul(a, b)
    if op == "Div":
        if a.is_literal and b.is_literal:
            x, y = a.coef, b.coef
            return None if y == 0 else Dim.lit(int(np.floor_divide(x, y)) if x * y >= 0 else -(-x // y))
        return div(a, b) if a.coef >= 0 and b.coef > 0 else None
    if op == "Add":
        return add(a, b)
    if op == "Sub":
        return sub(a, b)
    if op == "Equal":
        if a == b:
            return ONE
        if a.is_literal and b.is_literal:
            return Dim.lit(int(a.coef == b.coef))
        # A monomial of dims with a positive coefficient is >= 0: it never equals a negative literal.
        sym, other = (a, b) if b.is_literal else (b, a)
        if other.is_literal and not sym.is_literal and sym.coef > 0 and other.coef < 0:
            return ZERO
        return None
    return None


def same_shape_rule(outputs: tuple[int, ...]) -> Callable[[ir.Node, ShapeQuery], list[Dims | None]]:
    """The dims rule of an op whose ``outputs`` have input 0's dims (a foreign op's ``same_shape_outputs``)."""
    def same(node: ir.Node, q: ShapeQuery) -> list[Dims | None]:
        out: list[Dims | None] = [None] * len(node.outputs)
        for i in outputs:
            if i < len(out):
                out[i] = q.dims(node.inputs[0])
        return out

    return same


# --- com.microsoft ----------------------------------------------------------------------------------
def _register_ms(t: ShapeRules) -> None:
    for op, outputs in MS_SAME_SHAPE.items():
        shape_rule(t, MS_DOMAIN, op)(same_shape_rule(outputs))
    for op, outputs in CONTRIB_SAME_SHAPE.items():
        shape_rule(t, "", op)(same_shape_rule(outputs))

    @shape_rule(t, MS_DOMAIN, "EmbedLayerNormalization")
    def embed_layer_norm(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0 = q.dims(node.inputs[0])
        if d0 is None or len(d0) != 2:
            return None
        dw = q.dims(node.inputs[2]) if len(node.inputs) > 2 else None
        hidden = dw[1] if dw is not None and len(dw) == 2 else None
        return [d0 + (hidden,), (d0[0],), d0 + (hidden,)]

    @shape_rule(t, MS_DOMAIN, MS_ATTENTION)
    def attention(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
        d0 = q.dims(node.inputs[0])
        if d0 is None or len(d0) != 3:
            return None
        return [(d0[0], d0[1], _attention_hidden(node, q, d0))]


def _attention_hidden(node: ir.Node, q: ShapeQuery, d0: Dims) -> Dim | None:
    """The last output dim of a com.microsoft attention op (query [B, S, *] in), where its inputs say it."""
    ins = node.inputs
    if node.op_type == "MultiHeadAttention":
        dv = q.dims(ins[2]) if len(ins) > 2 else None
        return dv[2] if dv is not None and len(dv) == 3 else None
    if node.op_type == "Attention":
        sizes = _attr(node, "qkv_hidden_sizes")
        if sizes is not None:
            return Dim.lit(list(sizes)[2])  # type: ignore[call-overload]
        dw = q.dims(ins[1]) if len(ins) > 1 else None
        return div(dw[1], Dim.lit(3)) if dw is not None and len(dw) == 2 else None
    if node.op_type == "GroupQueryAttention":
        heads, kv = _iattr(node, "num_heads", 0), _iattr(node, "kv_num_heads", 0)
        if len(ins) > 1 and ins[1] is not None:
            return d0[2]  # separate query: its hidden is num_heads * head_size
        head = div(d0[2], Dim.lit(heads + 2 * kv)) if heads > 0 else None
        return mul(head, Dim.lit(heads))
    return None
