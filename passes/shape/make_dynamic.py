"""Make static input axes dynamic again, rewriting the constants that baked the old size in.

A model exported at batch 1 and sequence 128 is full of 1s and 128s: reshape targets ``[1, 128, 12, 64]``,
slice ends, expand shapes, position-id tables.  Renaming the input's dim is not enough; every constant
that holds the old size must become an expression of the size the model gets at run time.  This pass
does that, and refuses when it cannot tell what a constant means.

**How it decides.**  It walks the graph in order and gives every tensor dimension a *symbolic size*: an
ordered product of factors, each an integer or a symbol (``batch``, ``seq``, or a fresh symbol for a size
derived in a way the pass does not model, such as ``seq - 1``).  The static shapes that ONNX inference
derives for the original model give every factor its old numeric value.  Each op's rule derives its
outputs' symbolic sizes and checks its inputs:

- elementwise ops broadcast: a dynamic dim meeting a static dim of the same old size means the static
  operand baked the size in.  The pass traces that operand back (through casts, unsqueezes, gathers,
  elementwise ops) to where the size was made — a ``Slice`` end, an ``Expand``/``ConstantOfShape``/``Tile``
  shape, a ``Range`` limit, an ``arange`` table — and rewrites it; if the trail ends anywhere else it
  refuses.
- ``Reshape`` with a constant target: the input's factors, in order, are matched to the target's entries
  (row-major reshapes keep factor order).  Every symbol goes to one entry, and the integer runs between
  symbols must divide exactly.  When several placements fit, the one that leaves the most symbols alone
  in an entry is taken (with batch 1, ``[1*128] -> [1, 128]`` reads as ``[batch, 128]``); a tie is refused.
  The rewritten target is ``Concat`` of constants and ``Gather(Shape(witness), axis) * c`` entries.
- ``Expand`` entries equal to a dynamic dim become 1 (which keeps the input's dim); ``Slice`` ends that
  cover a dynamic axis become INT64_MAX; positive partial ends of a dynamic axis are refused (a fixed
  count and ``size - k`` read the same); ``Gather`` along a dynamic axis at index ``size - 1`` or on a size
  1 axis is refused.
- Ops without a rule (custom domains, control flow, RNNs, ``Einsum`` ...) consuming a dynamic tensor are
  refused.

Before the walk, integer and boolean computations on constants (how exporters compute shapes) are
folded and shapes are inferred, so every static size is known; boolean masks and float tensors are
kept so a baked size can still be traced to its origin.  The rewrites themselves are applied only once
the whole graph has been checked, so a refusal leaves a model equivalent to the input (folded, not
rewritten).  The refusal is a ``PassFailedError`` naming the node.

With a batch of 1 in the export, a reshape target such as ``[1, 1, 16]`` for a ``[batch * 16]`` input
fits ``[batch, 1, 16]`` and ``[1, batch, 16]`` alike; where candidates differ only in where a size-1
symbol sits among literal 1s, the outermost placement is taken (batch leads).  This is a heuristic, not
a proof; ties involving symbols of other sizes are refused.

Limits: inputs must be fully static (make other dynamic dims static first with ``fix-shapes``); sizes
derived in ways the pass does not model (``seq - 1``, a concat of two dynamic dims) get fresh symbols and
their graph outputs an unnamed dim.

Option ``--dynamic NAME:AXIS=SYMBOL`` (repeatable; NAME may contain ``:``).  Give the same symbol to axes
that must agree (``input_ids:0=batch --dynamic attention_mask:0=batch``).  An axis already dynamic is left
as it is.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.shape._spec import find_input, parse_dynamic
from onnx_ir.passes import common as irp
from onnxscript.optimizer import _constant_folding as cf

from mograph.errors import OptionError, PassFailedError
from mograph.pass_infra import Option, Pass, PassResult

__all__ = ["MakeDynamicPass"]

logger = logging.getLogger(__name__)

INT64_MAX = int(np.iinfo(np.int64).max)
FOLD_INPUT_LIMIT = 1 << 20
FOLD_OUTPUT_LIMIT = 1 << 16

Factor = "int | str"
Dim = tuple  # ordered factors: ints > 1 and symbol names; () is the size 1


def canon(factors: tuple | list) -> Dim:
    """Merge adjacent integer factors and drop 1s."""
    out: list[Any] = []
    for f in factors:
        if isinstance(f, str):
            out.append(f)
        elif f != 1:
            if out and not isinstance(out[-1], str):
                out[-1] *= f
            else:
                out.append(int(f))
    return tuple(out)


def const_dim(n: int) -> Dim:
    return canon((int(n),))


def has_sym(d: Dim) -> bool:
    return any(isinstance(f, str) for f in d)


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


_UNARY = {
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Elu", "Erf", "Exp",
    "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Log", "Mish",
    "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus",
    "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu", "Cast", "CastLike", "Softmax", "LogSoftmax",
    "Hardmax", "Clip", "Dropout", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
    "LpNormalization", "Trilu", "CumSum", "Shrink", "Celu", "QuantizeLinear", "DequantizeLinear",
    "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization", "FastGelu", "BiasGelu",
}
_BROADCAST = {
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "And", "Or", "Xor", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Max", "Min", "Sum",
    "Mean", "PRelu", "BitShift",
}
_REDUCE = {
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
}
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


def _attr(node: ir.Node, name: str, default: Any = None) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


class _Analysis:
    """One forward walk: symbolic sizes of every dynamic tensor and the rewrites they need."""

    def __init__(self, graph: ir.Graph, seeds: dict[ir.Value, list[Dim]], sizes: dict[str, int],
                 witness: dict[str, tuple[ir.Value, int]], overrides: dict[ir.Value, dict[int, Dim]],
                 source_actions: list[Any]) -> None:
        self.graph = graph
        self.sizes = dict(sizes)
        self.witness = dict(witness)
        self.overrides = overrides
        self.tags: dict[ir.Value, list[Dim]] = {}
        self.elems: dict[ir.Value, list[Dim | None]] = {}  # symbolic contents of small int shape tensors
        self.actions: list[Any] = list(source_actions)
        self._fresh = 0
        for v, dims in seeds.items():
            self.tags[v] = dims
        for v in overrides:
            if v.producer() is None:
                self._overlay(v)

    # ------------------------------------------------------------------ helpers
    def num(self, d: Dim) -> int:
        return math.prod(self.sizes[f] if isinstance(f, str) else f for f in d)

    def fresh(self, node: ir.Node, value: ir.Value, axis: int) -> Dim:
        self._fresh += 1
        name = f"_d{self._fresh}"
        shape = self.static(node, value)
        self.sizes[name] = shape[axis]
        self.witness[name] = (value, axis)
        return (name,)

    def static(self, node: ir.Node | None, v: ir.Value) -> list[int]:
        shape = _static_shape(v)
        if shape is None:
            raise _Refuse(node, f"the static shape of '{v.name}' is unknown, so its dims cannot be tracked")
        return shape

    def dims(self, node: ir.Node, v: ir.Value) -> list[Dim]:
        if v in self.tags:
            return self.tags[v]
        return [const_dim(d) for d in self.static(node, v)]

    def tagged(self, v: ir.Value | None) -> bool:
        return v is not None and (v in self.tags or v in self.elems)

    def set(self, node: ir.Node, v: ir.Value, dims: list[Dim]) -> None:
        static = _static_shape(v)
        if static is not None and len(static) != len(dims):
            raise _Refuse(node, f"internal: rank of '{v.name}' disagrees with inference")
        if static is not None:
            for axis, (d, s) in enumerate(zip(dims, static)):
                if self.num(d) != s:
                    raise _Refuse(node, f"derived size {self.num(d)} of '{v.name}' axis {axis} disagrees with "
                                  f"the inferred {s}")
        if any(has_sym(d) for d in dims):
            self.tags[v] = list(dims)
        self._overlay(v)

    def _overlay(self, v: ir.Value) -> None:
        if v in self.overrides:
            dims = list(self.tags.get(v) or [const_dim(d) for d in self.static(None, v)])
            for axis, d in self.overrides[v].items():
                dims[axis] = d
            self.tags[v] = dims

    def elem_values(self, v: ir.Value | None) -> list[Dim | None] | None:
        """Symbolic contents of an int tensor (constant or tracked), flattened; ``None`` if unknown."""
        if v is None:
            return None
        if v in self.elems:
            return list(self.elems[v])
        arr = _const(v)
        if arr is None or arr.dtype.kind not in "iu":
            return None
        return [("#", int(x)) for x in arr.reshape(-1)]  # raw ints (may be 0, -1, negative)

    # ------------------------------------------------------------------ walk
    def run(self) -> None:
        for node in list(self.graph):
            ins = [i for i in node.inputs if i is not None]
            sub_uses = self._subgraph_uses(node)
            if not any(self.tagged(i) for i in ins + sub_uses):
                for out in node.outputs:
                    self._overlay(out)
                continue
            if node.domain not in ("", "ai.onnx", "com.microsoft") or sub_uses:
                raise _Refuse(node, "an op the pass has no rule for consumes a dynamic tensor")
            rule = self._rule(node)
            if rule is None:
                raise _Refuse(node, f"no rule for {node.op_type}, which consumes a dynamic tensor")
            rule(node)
            for out in node.outputs:
                if out not in self.tags:
                    self._overlay(out)

    def _subgraph_uses(self, node: ir.Node) -> list[ir.Value]:
        out: list[ir.Value] = []
        for a in node.attributes.values():
            graphs = [a.value] if isinstance(a.value, ir.Graph) else list(a.value) if a.type == ir.AttributeType.GRAPHS else []
            for g in graphs:
                for n in ir.traversal.RecursiveGraphIterator(g):
                    out.extend(i for i in n.inputs if i is not None and i.graph is self.graph)
        return out

    def _rule(self, node: ir.Node) -> Callable[[ir.Node], None] | None:
        op = node.op_type
        if op in _UNARY:
            return self.r_unary
        if op in _BROADCAST:
            return self.r_broadcast
        if op in _REDUCE or op in ("ArgMax", "ArgMin"):
            return self.r_reduce
        if op in _POOL:
            return self.r_pool
        if op in _GLOBAL_POOL:
            return self.r_global_pool
        return getattr(self, f"r_{op.lower()}", None)

    # ------------------------------------------------------------------ broadcasting
    def broadcast(self, node: ir.Node, inputs: list[ir.Value], out_rank: int | None = None) -> list[Dim]:
        all_dims = [self.dims(node, v) for v in inputs]
        rank = max(len(d) for d in all_dims) if out_rank is None else out_rank
        out: list[Dim] = []
        for pos in range(rank):
            cands = []
            for v, ds in zip(inputs, all_dims):
                axis = len(ds) - rank + pos
                if axis >= 0:
                    cands.append((v, axis, ds[axis]))
            out.append(self.merge(node, cands))
        return out

    def merge(self, node: ir.Node, cands: list[tuple[ir.Value, int, Dim]], strict: bool = False) -> Dim:
        """The dim that equal-or-broadcast dims ``cands`` produce; raises on baked sizes and ambiguity.

        ``strict``: the dims must be equal (``Concat``, a ``MatMul`` contraction), so even a static 1 that
        meets a dynamic dim of export size 1 has the size baked in.
        """
        symbolic = [c for c in cands if has_sym(c[2])]
        if not symbolic:
            return max((c[2] for c in cands), key=self.num, default=())
        first = symbolic[0][2]
        for v, axis, d in symbolic[1:]:
            if d != first:
                raise _Refuse(node, f"dims {_fmt(first)} and {_fmt(d)} meet here (input '{v.name}' axis {axis}); "
                              "the pass cannot tell whether they agree at other sizes")
        n = self.num(first)
        for v, axis, d in cands:
            if has_sym(d):
                continue
            size = self.num(d)
            if size == 1 and not strict:
                continue
            if size == n:
                raise _NeedTag(node, v, axis, first)
            raise _Refuse(node, f"dynamic dim {_fmt(first)} (size {n} in the export) broadcasts against the static "
                          f"size {size} of '{v.name}' axis {axis}")
        return first

    # ------------------------------------------------------------------ rules
    def r_unary(self, node: ir.Node) -> None:
        src = _input(node, 0)
        if src in self.elems and node.op_type in ("Cast", "Identity", "CastLike"):
            self.elems[node.outputs[0]] = self.elems[src]
        if src in self.elems and node.op_type not in ("Cast", "Identity", "CastLike"):
            self.elems[node.outputs[0]] = [None] * len(self.elems[src])
        dims = self.dims(node, src)
        if node.op_type == "PRelu":
            dims = self.broadcast(node, [_input(node, i) for i in range(len(node.inputs))])
        self.set(node, node.outputs[0], dims)
        if node.op_type in ("LayerNormalization", "SimplifiedLayerNormalization"):
            axis = _attr(node, "axis", -1) % max(len(dims), 1)
            reduced = [d if i < axis else () for i, d in enumerate(dims)]
            for out in node.outputs[1:]:
                if out is not None and out.shape is not None:
                    self.set(node, out, reduced)
        elif node.op_type == "Dropout" and len(node.outputs) > 1 and node.outputs[1] is not None:
            self.set(node, node.outputs[1], dims)

    def r_broadcast(self, node: ir.Node) -> None:
        ins = [i for i in node.inputs if i is not None]
        if any(i in self.elems for i in ins):
            self.elems_arith(node)
        self.set(node, node.outputs[0], self.broadcast(node, ins))

    def elems_arith(self, node: ir.Node) -> None:
        out = node.outputs[0]
        vals = [self.elem_values(i) for i in node.inputs]
        n = max(len(v) for v in vals if v is not None)
        known = [v for v in vals if v is not None]
        if node.op_type == "Mul" and len(vals) == 2 and len(known) == 2:
            res: list[Dim | None] = []
            for k in range(n):
                a, b = (v[k] if len(v) > 1 else v[0] for v in known)
                a, b = self._as_dim(a), self._as_dim(b)
                res.append(None if a is None or b is None else canon(a + b))
            self.elems[out] = res
        else:
            self.elems[out] = [None] * n

    @staticmethod
    def _as_dim(e: Any) -> Dim | None:
        if e is None:
            return None
        if len(e) == 2 and e[0] == "#":
            return const_dim(e[1]) if e[1] > 0 else None
        return e

    def r_matmul(self, node: ir.Node) -> None:
        a, b = _input(node, 0), _input(node, 1)
        da, db = self.dims(node, a), self.dims(node, b)
        if len(da) < 2 or len(db) < 2:
            raise _Refuse(node, "MatMul with a 1-D operand on a dynamic tensor is not supported")
        self.merge(node, [(a, len(da) - 1, da[-1]), (b, len(db) - 2, db[-2])], strict=True)
        ra, rb = len(da) - 2, len(db) - 2
        rank = max(ra, rb)
        batch: list[Dim] = []
        for pos in range(rank):
            cands = []
            for v, ds, r in ((a, da, ra), (b, db, rb)):
                axis = r - rank + pos
                if axis >= 0:
                    cands.append((v, axis, ds[axis]))
            batch.append(self.merge(node, cands))
        self.set(node, node.outputs[0], batch + [da[-2], db[-1]])

    def r_gemm(self, node: ir.Node) -> None:
        a, b = _input(node, 0), _input(node, 1)
        da, db = self.dims(node, a), self.dims(node, b)
        if _attr(node, "transA", 0):
            da = da[::-1]
        if _attr(node, "transB", 0):
            db = db[::-1]
        self.merge(node, [(a, 1, da[1]), (b, 0, db[0])], strict=True)
        out = [da[0], db[1]]
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            c = node.inputs[2]
            dc = self.dims(node, c)
            for pos in range(2):
                axis = len(dc) - 2 + pos
                if axis >= 0:
                    out[pos] = self.merge(node, [(node.outputs[0], pos, out[pos]), (c, axis, dc[axis])])
        self.set(node, node.outputs[0], out)

    def r_transpose(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        perm = _attr(node, "perm") or list(range(len(dims)))[::-1]
        self.set(node, node.outputs[0], [dims[p] for p in perm])

    def _axes(self, node: ir.Node, rank: int, input_index: int = 1, attr: str = "axes") -> list[int] | None:
        axes = _attr(node, attr)
        if axes is None and len(node.inputs) > input_index and node.inputs[input_index] is not None:
            arr = _const(node.inputs[input_index])
            if arr is None:
                raise _Refuse(node, "its axes are not constant")
            axes = arr.reshape(-1).tolist()
        return None if axes is None else [int(a) % rank for a in axes]

    def r_unsqueeze(self, node: ir.Node) -> None:
        src, out = _input(node, 0), node.outputs[0]
        dims = self.dims(node, src)
        rank = len(self.static(node, out))
        axes = sorted(self._axes(node, rank) or [])
        it = iter(dims)
        new = [() if i in axes else next(it) for i in range(rank)]
        self.set(node, out, new)
        if src in self.elems:
            self.elems[out] = self.elems[src]

    def r_squeeze(self, node: ir.Node) -> None:
        src, out = _input(node, 0), node.outputs[0]
        dims = self.dims(node, src)
        axes = self._axes(node, len(dims))
        if axes is None:
            axes = [i for i, d in enumerate(dims) if self.num(d) == 1]
        for a in axes:
            if has_sym(dims[a]):
                raise _Refuse(node, f"it squeezes the dynamic axis {a} ({_fmt(dims[a])}), which is 1 only in the export")
        self.set(node, out, [d for i, d in enumerate(dims) if i not in axes])
        if src in self.elems:
            self.elems[out] = self.elems[src]

    def r_flatten(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        axis = _attr(node, "axis", 1) % (len(dims) + 1) if dims else 0
        left = canon(tuple(f for d in dims[:axis] for f in d))
        right = canon(tuple(f for d in dims[axis:] for f in d))
        self.set(node, node.outputs[0], [left, right])

    def r_concat(self, node: ir.Node) -> None:
        ins = [i for i in node.inputs if i is not None]
        out = node.outputs[0]
        if any(i in self.elems for i in ins):
            vals: list[Any] = []
            for i in ins:
                ev = self.elem_values(i)
                if ev is None:
                    ev = [None] * int(np.prod(self.static(node, i)))
                vals.extend(ev)
            self.elems[out] = vals
        all_dims = [self.dims(node, i) for i in ins]
        rank = len(all_dims[0])
        axis = _attr(node, "axis", 0) % rank
        new: list[Dim] = []
        for pos in range(rank):
            if pos == axis:
                parts = [d[pos] for d in all_dims if self.num(d[pos]) != 0]
                if not any(has_sym(p) for p in parts):
                    new.append(const_dim(sum(self.num(p) for p in parts)))
                elif len(parts) == 1:
                    new.append(parts[0])
                elif len(set(parts)) == 1:
                    new.append(canon((len(parts),) + parts[0]))
                else:
                    new.append(self.fresh(node, out, pos))
            else:
                cands = [(i, pos, d[pos]) for i, d in zip(ins, all_dims)]
                new.append(self.merge(node, cands, strict=True))
        self.set(node, out, new)

    def r_split(self, node: ir.Node) -> None:
        src = _input(node, 0)
        dims = self.dims(node, src)
        axis = _attr(node, "axis", 0) % len(dims)
        if has_sym(dims[axis]):
            raise _Refuse(node, f"it splits the dynamic axis {axis} ({_fmt(dims[axis])}) into sizes fixed at export")
        for out in node.outputs:
            if out is not None:
                shape = self.static(node, out)
                self.set(node, out, [const_dim(shape[i]) if i == axis else d for i, d in enumerate(dims)])

    def r_shape(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        start, end = _attr(node, "start", 0), _attr(node, "end", None)
        sel = dims[slice(start, end)]
        self.elems[node.outputs[0]] = list(sel)

    def r_size(self, node: ir.Node) -> None:
        self.elems[node.outputs[0]] = [None]

    def r_gather(self, node: ir.Node) -> None:
        data, idx, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        axis = _attr(node, "axis", 0) % len(ddims)
        idims = self.dims(node, idx)
        if has_sym(ddims[axis]):
            arr = _const(idx)
            if arr is None:
                raise _Refuse(node, f"it gathers along the dynamic axis {axis} with indices computed at run time")
            n = self.num(ddims[axis])
            if n > 1 and arr.size == n and np.array_equal(arr.reshape(-1), np.arange(n)):
                # Every index once, in order: a reshape of the axis into the indices' shape.
                new_idx = self.assign_reshape(node, [ddims[axis]], [int(s) for s in arr.shape])
                self.set(node, out, ddims[:axis] + new_idx + ddims[axis + 1:])
                pieces = [d if has_sym(d) else self.num(d) for d in new_idx]
                self.actions.append(_Action("Gather", node, 1, pieces, extra=ddims[axis]))
                return
            bad = [int(i) for i in arr.reshape(-1) if n == 1 or int(i) == n - 1]
            if bad:
                raise _Refuse(node, f"it gathers index {bad[0]} of the dynamic axis {axis} ({_fmt(ddims[axis])}, size "
                              f"{n} in the export): a fixed position and 'the last one' cannot be told apart")
        self.set(node, out, ddims[:axis] + idims + ddims[axis + 1:])
        if data in self.elems:
            arr = _const(idx)
            ev = self.elems[data]
            if arr is None:
                self.elems[out] = [None] * max(1, int(np.prod(self.static(node, out))))
            else:
                self.elems[out] = [ev[int(i)] for i in arr.reshape(-1)]

    def r_reshape(self, node: ir.Node) -> None:
        data, target, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        if data in self.elems:
            self.elems[out] = self.elems[data]
        zero_literal = bool(_attr(node, "allowzero", 0))
        if target in self.elems:
            new = []
            for j, e in enumerate(self.elems[target]):
                d = self._as_dim(e)
                if e is not None and len(e) == 2 and e[0] == "#" and e[1] == 0:
                    d = () if zero_literal else ddims[j]
                    if zero_literal:
                        raise _Refuse(node, "Reshape with allowzero=1 and a 0 entry on a dynamic tensor")
                if d is None:
                    d = self.fresh(node, out, j)
                new.append(d)
            self.set(node, out, new)
            return
        arr = _const(target)
        if arr is None:
            raise _Refuse(node, "its target shape is computed in a way the pass does not track")
        if not any(has_sym(d) for d in ddims):
            self.set(node, out, [const_dim(s) for s in self.static(node, out)])
            return
        entries = [int(x) for x in arr.reshape(-1)]
        if zero_literal and 0 in entries:
            raise _Refuse(node, "Reshape with allowzero=1 and a 0 entry on a dynamic tensor")
        new = self.assign_reshape(node, ddims, entries)
        self.set(node, out, new)
        pieces: list[Any] = []
        needs = False
        for entry, d in zip(entries, new):
            if entry in (0, -1):
                pieces.append(entry)
            elif has_sym(d):
                pieces.append(d)
                needs = True
            else:
                pieces.append(entry)
        if needs:
            self.actions.append(_Action("Reshape", node, 1, pieces))

    def assign_reshape(self, node: ir.Node, ddims: list[Dim], entries: list[int]) -> list[Dim]:
        """Place the input's symbols on the target's entries (see the module docstring)."""
        factors = [f for d in ddims for f in d]
        syms = [f for f in factors if isinstance(f, str)]
        runs = [1]
        for f in factors:
            if isinstance(f, str):
                runs.append(1)
            else:
                runs[-1] *= f
        total = math.prod(self.num(d) for d in ddims)
        values: list[int] = []
        wild = [j for j, e in enumerate(entries) if e == -1]
        for j, e in enumerate(entries):
            values.append(self.num(ddims[j]) if e == 0 else e)
        if wild:
            rest = math.prod(v for j, v in enumerate(values) if j != wild[0])
            values[wild[0]] = total // rest if rest else 0
        k, m = len(syms), len(entries)
        results: dict[tuple, int] = {}
        for assign in itertools.combinations_with_replacement(range(m), k):
            res = self._try_assign(syms, runs, values, assign)
            if res is None:
                continue
            if any(e == 0 and res[j] != ddims[j] for j, e in enumerate(entries)):
                continue
            score = sum(1 for d in res if len(d) == 1 and isinstance(d[0], str))
            results[tuple(res)] = score
        if not results:
            raise _Refuse(node, f"its constant target {entries} cannot be matched with the input's dims "
                          f"{[_fmt(d) for d in ddims]}")
        best = max(results.values())
        top = [r for r, s in results.items() if s == best]
        if len(top) > 1 and len({self._without_unit_syms(r) for r in top}) == 1:
            # Only where a size-1 symbol (batch 1) sits among literal 1s differs: take the outermost placement.
            top = top[:1]
        if len(top) > 1:
            shown = " or ".join(str([_fmt(d) for d in r]) for r in top[:3])
            raise _Refuse(node, f"its constant target {entries} is ambiguous for input dims "
                          f"{[_fmt(d) for d in ddims]}: it reads as {shown}")
        return list(top[0])

    def _without_unit_syms(self, dims: tuple) -> tuple:
        return tuple(canon(tuple(f for f in d if not (isinstance(f, str) and self.sizes[f] == 1))) for d in dims)

    def _try_assign(self, syms: list[str], runs: list[int], values: list[int], assign: tuple[int, ...]) -> list[Dim] | None:
        rem = runs[0]
        out: list[Dim] = []
        s = 0
        for j, v in enumerate(values):
            mine = [i for i in range(s, len(syms)) if assign[i] == j]
            if not mine:
                if v <= 0 or rem % v:
                    return None
                rem //= v
                out.append(const_dim(v))
                continue
            p, q = mine[0], mine[-1]
            symprod = math.prod(self.sizes[x] for x in syms[p:q + 1])
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
            out.append(canon(factors))
            rem = runs[q + 1] // right
            s = q + 1
        return out if rem == 1 and s == len(syms) else None

    def r_expand(self, node: ir.Node) -> None:
        data, shape, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        if shape in self.elems:
            entries = [self._as_dim(e) for e in self.elems[shape]]
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
                    cands.append((shape, ej, e if e is not None else self.fresh(node, out, pos)))
                new.append(self.merge(node, cands))
            self.set(node, out, new)
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
            d = ddims[ax] if ax >= 0 else ()
            ent = entries_i[ej] if ej >= 0 else 1
            if has_sym(d):
                n = self.num(d)
                if ent == 1:
                    piece = 1
                elif ent == n:
                    piece, needs = 1, True
                else:
                    raise _Refuse(node, f"it expands the dynamic dim {_fmt(d)} (size {n} in the export) to {ent}")
                new.append(d)
            else:
                piece = ent
                new.append(const_dim(max(ent, self.num(d))))
            if ej >= 0:
                pieces.append(piece)
        self.set(node, out, new)
        if needs:
            self.actions.append(_Action("Expand", node, 1, pieces))

    def r_constantofshape(self, node: ir.Node) -> None:
        shape, out = _input(node, 0), node.outputs[0]
        entries = self.elems.get(shape, [])
        new = []
        for j, e in enumerate(entries):
            d = self._as_dim(e)
            new.append(d if d is not None else self.fresh(node, out, j))
        self.set(node, out, new)

    def r_tile(self, node: ir.Node) -> None:
        data, reps, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        ev = self.elem_values(reps)
        if ev is None:
            raise _Refuse(node, "its repeats are computed in a way the pass does not track")
        new = []
        for j, (d, e) in enumerate(zip(ddims, ev)):
            r = self._as_dim(e)
            new.append(canon(d + r) if r is not None else self.fresh(node, out, j))
        self.set(node, out, new)

    def r_range(self, node: ir.Node) -> None:
        start, limit, delta = (self.elem_values(i) for i in node.inputs[:3])
        out = node.outputs[0]
        size = self._as_dim(limit[0]) if start == [("#", 0)] and delta == [("#", 1)] and limit is not None else None
        if size is not None:
            self.set(node, out, [size])
        else:
            self.set(node, out, [self.fresh(node, out, 0)])

    def r_slice(self, node: ir.Node) -> None:
        data, out = _input(node, 0), node.outputs[0]
        ddims = self.dims(node, data)
        params = [_const(node.inputs[i]) if len(node.inputs) > i and node.inputs[i] is not None else None
                  for i in range(1, 5)]
        starts, ends = params[0], params[1]
        if starts is None or ends is None or (len(node.inputs) > 3 and node.inputs[3] is not None and params[2] is None) \
                or (len(node.inputs) > 4 and node.inputs[4] is not None and params[3] is None):
            raise _Refuse(node, "its bounds are computed in a way the pass does not track")
        starts_l, ends_l = starts.reshape(-1).tolist(), ends.reshape(-1).tolist()
        axes = [int(a) % len(ddims) for a in params[2].reshape(-1)] if params[2] is not None else list(range(len(starts_l)))
        steps = params[3].reshape(-1).tolist() if params[3] is not None else [1] * len(axes)
        new = [const_dim(s) for s in self.static(node, out)]
        new_ends, needs = list(ends_l), False
        for i, d in enumerate(ddims):
            if i not in axes:
                new[i] = d
                continue
            if not has_sym(d):
                continue
            k = axes.index(i)
            s, e, st, n = int(starts_l[k]), int(ends_l[k]), int(steps[k]), self.num(d)
            if st != 1:
                raise _Refuse(node, f"it slices the dynamic axis {i} ({_fmt(d)}) with step {st}")
            if s >= n:
                raise _Refuse(node, f"it slices the dynamic axis {i} ({_fmt(d)}) from {s}, past its export size {n}")
            if e >= n:
                if e < INT64_MAX // 2:
                    new_ends[k], needs = INT64_MAX, True
                new[i] = d if s == 0 else self.fresh(node, out, i)
            elif e < 0 or s < 0:
                new[i] = self.fresh(node, out, i)
            else:
                raise _Refuse(node, f"it slices the dynamic axis {i} ({_fmt(d)}) up to {e} (size {n} in the export): "
                              f"a fixed count and 'size - {n - e}' cannot be told apart")
        self.set(node, out, new)
        if data in self.elems and len(ddims) == 1:
            ev = self.elems[data]
            self.elems[out] = ev[slice(int(starts_l[0]), int(ends_l[0]), int(steps[0]))]
        if needs:
            self.actions.append(_Action("Slice", node, 2, [int(x) for x in new_ends], dtype=_input(node, 2).dtype or ir.DataType.INT64))

    def r_reduce(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        keep = _attr(node, "keepdims", 1)
        axes: list[int] | None
        if node.op_type in ("ArgMax", "ArgMin"):
            axes = [_attr(node, "axis", 0) % len(dims)]
        else:
            axes = self._axes(node, len(dims))
            if axes is None:
                axes = [] if _attr(node, "noop_with_empty_axes", 0) else list(range(len(dims)))
        new = [(() if i in axes else d) for i, d in enumerate(dims) if keep or i not in axes]
        self.set(node, node.outputs[0], new)

    def r_pool(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        if has_sym(dims[1]):
            raise _Refuse(node, "the channel axis is dynamic")
        for w in node.inputs[1:]:
            if w is not None and w in self.tags:
                raise _Refuse(node, "its weights are dynamic")
        out = node.outputs[0]
        static = self.static(node, out)
        new = [dims[0], const_dim(static[1])]
        for i in range(2, len(static)):
            new.append(self.fresh(node, out, i) if has_sym(dims[i]) else const_dim(static[i]))
        self.set(node, out, new)
        for extra in node.outputs[1:]:
            if extra is not None:
                self.set(node, extra, new)

    def r_global_pool(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        if has_sym(dims[1]):
            raise _Refuse(node, "the channel axis is dynamic")
        self.set(node, node.outputs[0], [dims[0], dims[1]] + [()] * (len(dims) - 2))

    def r_pad(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        pads = _const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if pads is None:
            pads = np.asarray(_attr(node, "pads", []) or [])
        out = node.outputs[0]
        static = self.static(node, out)
        axes = self._axes(node, len(dims), input_index=3) or list(range(len(dims)))
        p = pads.reshape(-1).tolist()
        new = []
        for i, d in enumerate(dims):
            if i in axes and has_sym(d):
                k = axes.index(i)
                new.append(d if p[k] == 0 and p[k + len(axes)] == 0 else self.fresh(node, out, i))
            else:
                new.append(d if has_sym(d) else const_dim(static[i]))
        self.set(node, out, new)

    def r_topk(self, node: ir.Node) -> None:
        dims = self.dims(node, _input(node, 0))
        axis = _attr(node, "axis", -1) % len(dims)
        for out in node.outputs:
            static = self.static(node, out)
            self.set(node, out, [const_dim(static[i]) if i == axis else d for i, d in enumerate(dims)])

    def r_gathernd(self, node: ir.Node) -> None:
        data, idx, out = _input(node, 0), _input(node, 1), node.outputs[0]
        ddims = self.dims(node, data)
        arr = _const(idx)
        if arr is None or _attr(node, "batch_dims", 0) != 0 or idx in self.tags:
            raise _Refuse(node, "GatherND with indices computed at run time on a dynamic tensor")
        k = arr.shape[-1]
        lead = [self.num(d) for d in ddims[:k]]
        grid = np.stack(np.unravel_index(np.arange(math.prod(lead)), lead), axis=-1) if lead else None
        if grid is None or arr.reshape(-1, k).shape != grid.shape or not np.array_equal(arr.reshape(-1, k), grid):
            if any(has_sym(d) for d in ddims[:k]):
                raise _Refuse(node, "GatherND picks fixed positions along a dynamic axis")
            self.set(node, out, list(self.dims(node, idx)[:-1]) + ddims[k:])
            return
        # Every position once, in order: a reshape of the leading dims into the indices' shape.
        merged = canon(tuple(f for d in ddims[:k] for f in d))
        new = self.assign_reshape(node, [merged], [int(s) for s in arr.shape[:-1]]) + ddims[k:]
        self.set(node, out, new)
        pieces = [d if has_sym(d) else self.num(d) for d in new]
        self.actions.append(_Action("GatherND", node, 0, pieces))

    def r_gatherelements(self, node: ir.Node) -> None:
        self.set(node, node.outputs[0], self.dims(node, _input(node, 1)))

    def r_scatterelements(self, node: ir.Node) -> None:
        self.set(node, node.outputs[0], self.dims(node, _input(node, 0)))

    r_scatternd = r_scatterelements


def _ramp_parts(arr: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``first``, ``step`` (size 1 along ``axis``) and ``first + k * step`` for k along ``axis``."""
    first = np.take(arr, [0], axis=axis)
    step = np.take(arr, [1], axis=axis) - first
    shape = [1] * arr.ndim
    shape[axis] = arr.shape[axis]
    k = np.arange(arr.shape[axis]).reshape(shape).astype(arr.dtype)
    return first, step, first + k * step


def _is_ramp(arr: np.ndarray, axis: int) -> bool:
    """Every slice along ``axis`` is ``first + k * step`` (``arange`` times a vector, as rotary tables are)."""
    _, step, ramp = _ramp_parts(arr, axis)
    if arr.dtype.kind in "iu":
        return bool(np.array_equal(ramp, arr))
    scale = float(np.abs(arr).max()) or 1.0
    return bool(np.allclose(ramp, arr, rtol=1e-6, atol=1e-6 * scale))


def _is_shape_arithmetic(node: ir.Node) -> bool:
    """Fold integer and boolean computations on constants only: they are how exporters compute shapes.

    Float results and boolean masks stay, so a baked size keeps its origin (a ``Gather`` of a position table by an
    ``arange``) for tracing back.
    """
    if node.op_type == "Constant":
        return False
    for out in node.outputs:
        if out.dtype is None or out.dtype.is_floating_point():
            return False
        if out.dtype == ir.DataType.BOOL and (out.shape is None or len(out.shape) >= 2):
            return False  # a mask (causal, padding): its comparisons show where its sizes come from
    return True


def _fmt(d: Dim) -> str:
    if not d:
        return "1"
    return "*".join(str(f) for f in d)


class MakeDynamicPass(Pass):
    """Turn static input axes into named dynamic ones (--dynamic NAME:AXIS=SYMBOL), rewriting baked-in sizes."""

    name = "make-dynamic"
    family = "shape"
    options = (
        Option(
            "dynamic",
            str,
            None,
            "input axis to make dynamic, NAME:AXIS=SYMBOL (e.g. input_ids:0=batch); repeatable",
            multiple=True,
            metavar="NAME:AXIS=SYMBOL",
        ),
    )

    def _requests(self, graph: ir.Graph) -> tuple[dict[ir.Value, dict[int, str]], dict[str, int], dict[str, tuple[ir.Value, int]]]:
        per_input: dict[ir.Value, dict[int, str]] = {}
        sizes: dict[str, int] = {}
        witness: dict[str, tuple[ir.Value, int]] = {}
        for spec in self.config["dynamic"]:
            name, axis, sym = parse_dynamic(spec, self.name)
            v = find_input(graph, name, self.name)
            if v.shape is None:
                raise OptionError(f"{self.name}: input '{name}' has no shape; give it one first (fix-shapes --shape)")
            rank = len(v.shape)
            if not -rank <= axis < rank:
                raise OptionError(f"{self.name}: input '{name}' has rank {rank}, so it has no dimension {axis}")
            axis %= rank
            dim = v.shape.dims[axis]
            if not isinstance(dim, int):
                logger.info("make-dynamic: input %s dimension %d is already dynamic (%s)", name, axis, dim)
                continue
            prev = per_input.setdefault(v, {}).get(axis)
            if prev is not None and prev != sym:
                raise OptionError(f"{self.name}: input '{name}' dimension {axis} given two names, '{prev}' and '{sym}'")
            if sym in sizes and sizes[sym] != dim:
                raise OptionError(
                    f"{self.name}: input '{name}' dimension {axis} is {dim}, but '{sym}' is {sizes[sym]} "
                    f"elsewhere; one name means one size"
                )
            sizes[sym] = dim
            witness.setdefault(sym, (v, axis))
            per_input[v][axis] = sym
        return {v: a for v, a in per_input.items() if a}, sizes, witness

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        per_input, sizes, witness = self._requests(graph)
        if not per_input:
            return PassResult(modified=False, stats={"dims_made_dynamic": 0})
        # Exporters compute static shapes with arithmetic on constants; fold it so every shape is known.
        cf.FoldConstantsPass(
            shape_inference=True, input_size_limit=FOLD_INPUT_LIMIT, output_size_limit=FOLD_OUTPUT_LIMIT,
            should_fold=_is_shape_arithmetic,
        )(model)
        irp.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
        seeds: dict[ir.Value, list[Dim]] = {}
        for v, axes in per_input.items():
            static = _static_shape(v)
            if static is None:
                raise OptionError(f"{self.name}: input '{v.name}' mixes static and dynamic dims; only fully static inputs "
                                  "are supported")
            dims = [const_dim(d) for d in static]
            for axis, sym in axes.items():
                dims[axis] = (sym,)
            seeds[v] = dims
        overrides: dict[ir.Value, dict[int, Dim]] = {}
        sources: list[Any] = []
        for _ in range(64):
            analysis = _Analysis(graph, seeds, sizes, witness, overrides, sources)
            try:
                analysis.run()
                break
            except _NeedTag as need:
                self._trace_back(analysis, need, overrides, sources)
            except _Refuse as r:
                raise self._error(r.node, str(r)) from None
        else:  # pragma: no cover - every round adds an override, graphs are finite
            raise PassFailedError(self.name, "too many baked sizes to trace")
        stats = self._apply(model, analysis, per_input)
        return PassResult(modified=True, stats=stats, details={"symbols": dict(sizes)})

    def _error(self, node: ir.Node | None, message: str) -> PassFailedError:
        where = f"node '{node.name}' ({node.op_type})" if node is not None else "the model"
        return PassFailedError(self.name, f"{where}: {message}; refusing rather than risk a model that runs but "
                               "computes the wrong thing")

    # ------------------------------------------------------------------ tracing baked sizes back
    def _trace_back(self, an: _Analysis, need: _NeedTag, overrides: dict, sources: list) -> None:
        if any(isinstance(f, str) and f.startswith("_d") for f in need.dim):
            raise self._error(need.node, f"'{need.value.name}' axis {need.axis} has the size of the derived dim "
                              f"{_fmt(need.dim)} baked in")
        found = self._find_source(an, need.value, need.axis, need.dim, depth=0)
        if found is None:
            raise self._error(
                need.node,
                f"'{need.value.name}' axis {need.axis} has the export size {an.num(need.dim)} of the dynamic dim "
                f"{_fmt(need.dim)} baked in, and the pass cannot trace where that size comes from",
            )
        for value, axis, action in found:
            if axis in overrides.get(value, {}):
                raise self._error(need.node, f"internal: '{value.name}' axis {axis} traced twice")
            overrides.setdefault(value, {})[axis] = need.dim
            same = [a for a in sources if isinstance(a, _Action) and isinstance(action, _Action)
                    and a.node is action.node and a.index == action.index]
            if same:  # a second dynamic axis of the same shape input: merge into the first rewrite
                same[0].pieces = [n if not isinstance(o, int) else n if not isinstance(n, int) else o
                                  for o, n in zip(same[0].pieces, action.pieces)]
            else:
                sources.append(action)

    def _find_source(self, an: _Analysis, v: ir.Value, axis: int, dim: Dim, depth: int) -> list | None:
        if depth > 32:
            return None
        n = an.num(dim)
        node = v.producer()
        arr = _const(v)
        if arr is None and node is not None and node.op_type == "GatherElements":
            data, idx = _const(node.inputs[0]), _const(node.inputs[1])
            if data is not None and idx is not None:  # a constant the folder left (its evaluator fails on it)
                arr = np.take_along_axis(data, idx.astype(np.int64) % data.shape[_attr(node, "axis", 0)],
                                         axis=_attr(node, "axis", 0))
                node = None
        if arr is not None and (node is None or node.op_type == "Constant"):
            if arr.dtype.kind in "iuf" and arr.ndim > axis and arr.shape[axis] == n and all(
                s == 1 for i, s in enumerate(arr.shape) if i != axis
            ):
                flat = arr.reshape(-1)
                step = flat[1] - flat[0] if flat.size > 1 else 1
                if flat.size > 1 and np.array_equal(flat, flat[0] + step * np.arange(flat.size, dtype=flat.dtype)) and step != 0:
                    return [(v, axis, _SourceAction(v, axis, dim, arr))]
            if arr.ndim > axis and arr.shape[axis] == n:
                first = np.take(arr, [0], axis=axis)
                if np.array_equal(np.broadcast_to(first, arr.shape), arr):
                    return [(v, axis, _SourceAction(v, axis, dim, arr, kind="uniform"))]
                if n > 1 and arr.dtype.kind in "iuf" and _is_ramp(arr, axis):
                    return [(v, axis, _SourceAction(v, axis, dim, arr, kind="ramp"))]
            return None
        if node is None:
            return None
        op = node.op_type
        ins = node.inputs
        if op == "Slice" and v is node.outputs[0]:
            params = [_const(ins[i]) if len(ins) > i and ins[i] is not None else None for i in range(1, 5)]
            if params[0] is None or params[1] is None:
                return None
            rank = len(an.static(node, v))
            axes = [int(a) % rank for a in params[2].reshape(-1)] if params[2] is not None else list(range(params[0].size))
            if axis not in axes:
                return self._find_source(an, _input(node, 0), axis, dim, depth + 1)
            k = axes.index(axis)
            steps = params[3].reshape(-1) if params[3] is not None else np.ones(len(axes), np.int64)
            if int(params[0].reshape(-1)[k]) == 0 and int(steps[k]) == 1 and int(params[1].reshape(-1)[k]) == n:
                ends = params[1].reshape(-1).tolist()
                pieces: list[Any] = [int(e) for e in ends]
                pieces[k] = dim
                return [(v, axis, _Action("Slice", node, 2, pieces, dtype=_input(node, 2).dtype or ir.DataType.INT64))]
            return None
        if op in ("Expand", "ConstantOfShape", "Tile"):
            sidx = 1 if op != "ConstantOfShape" else 0
            shape = _const(ins[sidx])
            if shape is None:
                return None
            entries = [int(x) for x in shape.reshape(-1)]
            rank = len(an.static(node, v))
            j = len(entries) - rank + axis
            if j < 0:
                return None
            if op != "ConstantOfShape":
                ddims = an.static(node, _input(node, 0))
                dax = len(ddims) - rank + axis
                if dax >= 0 and ddims[dax] != 1:
                    return None
            if entries[j] != n:
                return None
            pieces = list(entries)
            pieces[j] = dim
            return [(v, axis, _Action(op, node, sidx, pieces))]
        if op == "Range":
            start, limit, delta = (_const(ins[i]) if i < len(ins) else None for i in range(3))
            if start is None or limit is None or delta is None or start.item() != 0 or delta.item() != 1 \
                    or limit.item() != n:
                return None
            return [(v, axis, _Action("Range", node, 1, [dim], scalar=True, dtype=_input(node, 1).dtype or ir.DataType.INT64))]
        if op in _UNARY and op not in ("Softmax", "LogSoftmax", "Hardmax", "CumSum"):
            return self._find_source(an, _input(node, 0), axis, dim, depth + 1)
        if op == "Transpose":
            rank = len(an.static(node, v))
            perm = _attr(node, "perm") or list(range(rank))[::-1]
            return self._find_source(an, _input(node, 0), perm[axis], dim, depth + 1)
        if op in ("Unsqueeze", "Squeeze"):
            out_rank = len(an.static(node, v))
            in_rank = len(an.static(node, _input(node, 0)))
            axes_v = _attr(node, "axes")
            if axes_v is None:
                a = _const(ins[1]) if len(ins) > 1 and ins[1] is not None else None
                if a is None:
                    return None
                axes_v = a.reshape(-1).tolist()
            if op == "Unsqueeze":
                axes_n = sorted(int(x) % out_rank for x in axes_v)
                if axis in axes_n:
                    return None
                src = [i for i in range(out_rank) if i not in axes_n].index(axis)
            else:
                axes_n = sorted(int(x) % in_rank for x in axes_v)
                src = [i for i in range(in_rank) if i not in axes_n][axis]
            return self._find_source(an, _input(node, 0), src, dim, depth + 1)
        if op == "Gather":
            rank_d = len(an.static(node, _input(node, 0)))
            g = _attr(node, "axis", 0) % rank_d
            rank_i = len(an.static(node, _input(node, 1)))
            if g <= axis < g + rank_i:
                return self._find_source(an, _input(node, 1), axis - g, dim, depth + 1)
            return None
        if op == "MatMul":
            rank = len(an.static(node, v))
            ra, rb = len(an.static(node, _input(node, 0))), len(an.static(node, _input(node, 1)))
            if ra < 2 or rb < 2:
                return None
            if axis == rank - 2:
                return self._find_source(an, _input(node, 0), ra - 2, dim, depth + 1)
            if axis == rank - 1:
                return self._find_source(an, _input(node, 1), rb - 1, dim, depth + 1)
            return None
        if op == "Concat":
            rank = len(an.static(node, v))
            if _attr(node, "axis", 0) % rank == axis:
                return None
            found_c: list = []
            for i in ins:
                if i is None or (i in an.tags and has_sym(an.tags[i][axis])):
                    continue
                sub = self._find_source(an, i, axis, dim, depth + 1)
                if sub is None:
                    return None
                found_c.extend(sub)
            return found_c or None
        if op in _BROADCAST:
            rank = len(an.static(node, v))
            found: list = []
            for i in ins:
                if i is None:
                    continue
                shape_i = an.static(node, i)
                ax = len(shape_i) - rank + axis
                if ax >= len(shape_i):
                    logger.debug("make-dynamic: %s %s: rank of %s exceeds its output's", op, node.name, i.name)
                    return None
                if ax < 0 or shape_i[ax] == 1:
                    continue
                if i in an.tags and has_sym(an.tags[i][ax]):
                    continue
                sub = self._find_source(an, i, ax, dim, depth + 1)
                if sub is None:
                    return None
                found.extend(sub)
            return found or None
        return None

    # ------------------------------------------------------------------ applying the plan
    def _apply(self, model: ir.Model, an: _Analysis, per_input: dict[ir.Value, dict[int, str]]) -> dict[str, int | float]:
        graph = model.graph
        builder = _Builder(graph, an, self.name)
        stats: dict[str, int | float] = {"dims_made_dynamic": sum(len(a) for a in per_input.values())}
        for v, axes in per_input.items():
            if v.shape is None:  # _requests only keeps inputs with a shape
                raise PassFailedError(self.name, f"internal: input '{v.name}' lost its shape")
            dims = list(v.shape.dims)
            for axis, sym in axes.items():
                dims[axis] = ir.SymbolicDim(sym)
            v.shape = ir.Shape(dims)
        for action in an.actions:
            if isinstance(action, _SourceAction):
                builder.source(action)
                key = f"rewritten.{action.kind}"
            else:
                builder.replace_input(action)
                key = f"rewritten.{action.kind}"
            stats[key] = stats.get(key, 0) + 1
        builder.drop_unused()
        stats["nodes_added"] = builder.added
        # Re-derive every shape from the computation, then state the outputs' shapes in the new symbols.
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for out in node.outputs:
                if not out.is_graph_input():
                    out.shape = None
        irp.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
        for out in graph.outputs:
            out_dims = an.tags.get(out)
            static = out.shape
            if out_dims is None:
                continue
            new: list[Any] = []
            for i, d in enumerate(out_dims):
                if not has_sym(d):
                    new.append(an.num(d))
                elif any(isinstance(f, str) and f.startswith("_d") for f in d):
                    new.append(static.dims[i] if static is not None and len(static) == len(out_dims) and not isinstance(static.dims[i], int) else None)
                else:
                    new.append(ir.SymbolicDim(_fmt(d)))
            out.shape = ir.Shape(new)
        return stats


class _Builder:
    """Creates the runtime size expressions and swaps them in."""

    def __init__(self, graph: ir.Graph, an: _Analysis, pass_name: str) -> None:
        self.graph = graph
        self.an = an
        self.added = 0
        self.replaced: list[ir.Value] = []
        self._sym_cache: dict[tuple[str, bool], ir.Value] = {}
        self._names = {v.name for v in graph.initializers.values()} | {
            o.name for n in graph for o in n.outputs
        } | {i.name for i in graph.inputs}
        self._first = next(iter(graph), None)

    def _name(self, base: str) -> str:
        base = base.replace("/", "_").strip("_") or "dyn"
        name, k = base, 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def const(self, array: np.ndarray, base: str) -> ir.Value:
        value = ir.Value(name=self._name(base), const_value=ir.tensor(array))
        value.shape = ir.Shape(list(array.shape))
        value.dtype = ir.DataType.from_numpy(array.dtype)
        self.graph.register_initializer(value)
        return value

    def _insert(self, before: ir.Node | None, node: ir.Node) -> None:
        anchor = before if before is not None else self._first
        if anchor is None:
            self.graph.append(node)
        else:
            self.graph.insert_before(anchor, node)
        self.added += 1

    def _op(self, before: ir.Node | None, op: str, inputs: list[ir.Value], base: str, **attrs: Any) -> ir.Value:
        node = ir.node(op, inputs, attributes=attrs or None, name=self._name(f"{base}/{op}"))
        node.outputs[0].name = self._name(f"{base}_{op.lower()}")
        self._insert(before, node)
        return node.outputs[0]

    def sym(self, sym: str, scalar: bool, before: ir.Node | None) -> tuple[ir.Value, ir.Node | None]:
        """The run-time value of ``sym`` (int64 scalar or shape-[1] tensor)."""
        value, axis = self.an.witness[sym]
        fresh = sym.startswith("_d")
        key = (sym, scalar)
        if not fresh and key in self._sym_cache:
            return self._sym_cache[key], None
        anchor = before if fresh else None
        shape = self._op(anchor, "Shape", [value], f"mograph_dyn_{sym}")
        idx = self.const(np.array(axis if scalar else [axis], dtype=np.int64), f"mograph_dyn_{sym}_axis")
        out = self._op(anchor, "Gather", [shape, idx], f"mograph_dyn_{sym}", axis=0)
        if not fresh:
            self._sym_cache[key] = out
        return out, anchor

    def dim_value(self, d: Dim, scalar: bool, before: ir.Node | None, base: str) -> ir.Value:
        coef = math.prod(f for f in d if not isinstance(f, str))
        acc: ir.Value | None = None
        for f in d:
            if not isinstance(f, str):
                continue
            v, _ = self.sym(f, scalar, before)
            acc = v if acc is None else self._op(before, "Mul", [acc, v], base)
        if acc is None:
            return self.const(np.array(coef if scalar else [coef], dtype=np.int64), base)
        if coef != 1:
            c = self.const(np.array(coef if scalar else [coef], dtype=np.int64), f"{base}_coef")
            acc = self._op(before, "Mul", [acc, c], base)
        return acc

    def _shape_tensor(self, pieces: list[Any], before: ir.Node | None, base: str) -> ir.Value:
        """A 1-D int64 tensor: constant runs and run-time sizes, concatenated."""
        parts: list[ir.Value] = []
        run: list[int] = []
        for p in pieces:
            if isinstance(p, int):
                run.append(p)
                continue
            if run:
                parts.append(self.const(np.array(run, dtype=np.int64), f"{base}_const"))
                run = []
            parts.append(self.dim_value(p, False, before, base))
        if run:
            parts.append(self.const(np.array(run, dtype=np.int64), f"{base}_const"))
        return parts[0] if len(parts) == 1 else self._op(before, "Concat", parts, base, axis=0)

    def replace_input(self, action: _Action) -> None:
        node = action.node
        base = f"{node.name or node.op_type}_{action.kind.lower()}_dyn"
        old = node.inputs[action.index]
        if action.kind == "GatherND":  # an all-positions GatherND is a Reshape
            out = node.outputs[0]
            new = self._op(node, "Reshape", [_input(node, 0), self._shape_tensor(action.pieces, node, base)], base)
            out.replace_all_uses_with(new, replace_graph_outputs=True)
            self.graph.remove(node, safe=True)
            return
        if action.kind == "Gather":
            n = self.dim_value(action.extra, True, node, base)
            zero = self.const(np.array(0, dtype=np.int64), f"{base}_zero")
            one = self.const(np.array(1, dtype=np.int64), f"{base}_one")
            rng = self._op(node, "Range", [zero, n, one], base)
            new = self._op(node, "Reshape", [rng, self._shape_tensor(action.pieces, node, base)], base)
            if old is not None and old.dtype not in (None, ir.DataType.INT64):
                new = self._op(node, "Cast", [new], base, to=old.dtype)
            node.replace_input_with(action.index, new)
            if old is not None:
                self.replaced.append(old)
            return
        if not action.scalar and all(isinstance(p, int) for p in action.pieces):
            np_dtype = action.dtype.numpy()
            limit = np.iinfo(np_dtype).max if np.issubdtype(np_dtype, np.integer) else INT64_MAX
            arr = np.array([min(p, limit) for p in action.pieces]).astype(np_dtype)
            node.replace_input_with(action.index, self.const(arr, f"{base}_const"))
            if old is not None:
                self.replaced.append(old)
            return
        if action.scalar:
            new = self.dim_value(action.pieces[0], True, node, base)
        else:
            new = self._shape_tensor(action.pieces, node, base)
        if action.dtype != ir.DataType.INT64:
            new = self._op(node, "Cast", [new], base, to=action.dtype)
        node.replace_input_with(action.index, new)
        if old is not None:
            self.replaced.append(old)

    def source(self, action: _SourceAction) -> None:
        arr, value = action.array, action.value
        anchor = self._first  # depends on graph inputs and constants only
        if action.kind == "uniform":
            base = f"{value.name}_expand_dyn"
            row = self.const(np.ascontiguousarray(np.take(arr, [0], axis=action.axis)), f"{base}_row")
            pieces: list[Any] = [int(s) for s in arr.shape]
            pieces[action.axis] = action.dim
            shape = self._shape_tensor(pieces, anchor, base)
            out = self._op(anchor, "Expand", [row, shape], base)
            self._swap(value, out)
            return
        if action.kind == "ramp":
            base = f"{value.name}_ramp_dyn"
            ramp_first, ramp_step, _ = _ramp_parts(arr, action.axis)
            n = self.dim_value(action.dim, True, anchor, base)
            zero = self.const(np.array(0, dtype=np.int64), f"{base}_zero")
            one = self.const(np.array(1, dtype=np.int64), f"{base}_one")
            k = self._op(anchor, "Range", [zero, n, one], base)
            if arr.dtype != np.int64:
                k = self._op(anchor, "Cast", [k], base, to=ir.DataType.from_numpy(arr.dtype))
            target = [1] * arr.ndim
            target[action.axis] = -1
            k = self._op(anchor, "Reshape", [k, self.const(np.array(target, dtype=np.int64), f"{base}_shape")], base)
            out = self._op(anchor, "Mul", [k, self.const(np.ascontiguousarray(ramp_step), f"{base}_step")], base)
            out = self._op(anchor, "Add", [out, self.const(np.ascontiguousarray(ramp_first), f"{base}_first")], base)
            self._swap(value, out)
            return
        flat = arr.reshape(-1)
        start, step = flat[0], flat[1] - flat[0]
        base = f"{value.name}_range_dyn"
        n = self.dim_value(action.dim, True, anchor, base)
        start_a = np.array(start, dtype=np.int64 if arr.dtype.kind in "iu" else arr.dtype)
        start_v = self.const(start_a, f"{base}_start")
        step_v = self.const(np.array(step, dtype=start_a.dtype), f"{base}_step")
        if arr.dtype.kind in "iu" and start == 0 and step == 1:
            limit = n
        elif arr.dtype.kind in "iu":
            limit = self._op(anchor, "Add", [self._op(anchor, "Mul", [n, step_v], base), start_v], base)
        else:
            nf = self._op(anchor, "Cast", [n], base, to=ir.DataType.from_numpy(arr.dtype))
            limit = self._op(anchor, "Add", [self._op(anchor, "Mul", [nf, step_v], base), start_v], base)
        rng = self._op(anchor, "Range", [start_v, limit, step_v], base)
        target = [1] * arr.ndim
        target[action.axis] = -1
        out = self._op(anchor, "Reshape", [rng, self.const(np.array(target, dtype=np.int64), f"{base}_shape")], base)
        if arr.dtype.kind in "iu" and arr.dtype != np.int64:
            out = self._op(anchor, "Cast", [out], base, to=ir.DataType.from_numpy(arr.dtype))
        self._swap(value, out)

    def _swap(self, value: ir.Value, new: ir.Value) -> None:
        for use in list(value.uses()):
            if use.node is not new.producer():
                use.node.replace_input_with(use.idx, new)
        self.replaced.append(value)

    def drop_unused(self) -> None:
        for v in self.replaced:
            if v.uses() or v.is_graph_output() or v.is_graph_input():
                continue
            if v.name is not None and v.name in self.graph.initializers and self.graph.initializers[v.name] is v:
                del self.graph.initializers[v.name]
            node = v.producer()
            if node is not None and not any(o.uses() or o.is_graph_output() for o in node.outputs):
                self.graph.remove(node, safe=True)
