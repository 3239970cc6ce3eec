"""Shape simplification: compute each dynamic shape once, from the graph inputs, with as few nodes as possible.

Exported transformers carry a ``Shape → Gather → Unsqueeze → Concat`` chain in front of nearly every
``Reshape``, ``Expand`` and ``Range``, one per layer, each reading the shape of a different activation
(``Shape(h_3)[0]`` is the batch size as much as ``Shape(input_ids)[0]`` is).  ONNX Runtime runs all of
them on the CPU, one kernel call each, so at small batch sizes latency follows the node count.  ONNX's
own shape inference cannot tell that these dims are the same once a dim flows through a fused
``com.microsoft`` op or an ``Expand`` to a computed shape, so constant folding and CSE leave them.

This pass runs a small symbolic evaluation over the main graph:

- every tensor's dims, each a *monomial* ``c * a1 * a2 ...`` of atoms, where an atom is a named input
  dim (``batch``) or an unknown dim of one value; the rules are exact (``Reshape`` with ``0``/``-1``,
  broadcasting, ``Gather``, ``Gemm``/``MatMul``, ``Split``, ``Transpose``, shape-preserving ops
  including the fused ``com.microsoft`` ones); where no rule applies the dims ONNX inference left on
  the value are used (an ``unk__`` name is never taken to equal another value's);
- every small int64 vector's elements (``Shape``, ``Gather``, ``Slice``, ``Concat``, ``Unsqueeze``,
  ``Squeeze``, ``Reshape``, ``Cast`` to int64, ``Add``/``Sub``/``Mul``/``Div``, ``Equal``, ``Where``,
  ``ConstantOfShape``), again as monomials.

Then, each exact for every input the model accepts (named dims of the same name are equal, as ONNX
declares):

- a ``Reshape`` or ``Expand`` whose output dims equal its input's is removed;
- a ``Reshape`` of a ``Reshape`` whose result the second alone determines reads the first's input;
- a ``Reshape`` target (``allowzero=0``) gets ``0`` where it repeats the input dim at the same index,
  and a single ``-1`` only where every other entry is a positive literal (so a zero-size dim cannot
  make ``-1`` ambiguous); with ``allowzero=1`` a target is only replaced when it is fully constant;
- any other int64 shape vector whose value is fully known becomes an initializer, and one known in
  terms of input dims is rebuilt from the first value carrying each dim (``Shape(input_ids, 0, 2)``),
  so the per-layer copies become one computation shared by all layers.

Nodes left unused are removed.  Subgraphs and functions are left alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Union

import numpy as np
import onnx_ir as ir
from mograph.passes.cleanup._util import op_histogram
from onnx_ir.passes import common as irp

from mograph._traverse import iter_nodes
from mograph.foreign_ops import BUILTIN_FOREIGN_OPS, MS_DOMAIN
from mograph.irutil import fresh_name, unique_initializer_name
from mograph.pass_infra import Option, Pass, PassResult

__all__ = ["SimplifyShapesPass"]

#: A dim: (coefficient, sorted atom names); (n, ()) is the literal n.
Mono = tuple[int, tuple[str, ...]]
Dims = tuple[Union[Mono, None], ...]

_STD = ("", "ai.onnx")
_MS = "com.microsoft"

#: Ops that only compute shape vectors here; a value read only by these is not a frontier.
_SHAPE_OPS = frozenset(
    "Shape Gather Slice Concat Unsqueeze Squeeze Cast Reshape Add Sub Mul Div Equal Where ConstantOfShape Identity".split()
)
_UNARY = frozenset(
    "Cast CastLike Relu Sigmoid Tanh Erf Neg Sqrt Exp Log Abs Reciprocal Softmax LogSoftmax Not Identity Dropout "
    "LayerNormalization Gelu Sin Cos IsNaN IsInf Floor Ceil Round Softplus HardSigmoid LeakyRelu Elu Selu Clip "
    "Sign Mish HardSwish".split()
)
_BROADCAST = frozenset(
    "Add Sub Mul Div Pow And Or Xor Equal Less LessOrEqual Greater GreaterOrEqual Where Max Min Mod".split()
)
#: com.microsoft ops whose listed outputs have input 0's shape (their records, :mod:`mograph.foreign_ops`).
_MS_SAME = {op.name: op.same_shape_outputs for op in BUILTIN_FOREIGN_OPS
            if op.domain == MS_DOMAIN and op.same_shape_outputs}
_MS_ATTENTION = frozenset(["Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention"])
#: Longest int64 vector whose elements are tracked.
_MAX_VECTOR = 64


def _lit(n: int) -> Mono:
    return (int(n), ())


def _is_lit(m: Mono | None) -> bool:
    return m is not None and not m[1]


def _mul(a: Mono | None, b: Mono | None) -> Mono | None:
    if a is None or b is None:
        return None
    if a[0] == 0 or b[0] == 0:
        return _lit(0)
    return (a[0] * b[0], tuple(sorted(a[1] + b[1])))


def _div(a: Mono | None, b: Mono | None) -> Mono | None:
    """a / b when b divides a exactly (as monomials); None otherwise."""
    if a is None or b is None or b[0] == 0:
        return None
    atoms = list(a[1])
    for atom in b[1]:
        if atom not in atoms:
            return None
        atoms.remove(atom)
    if a[0] % b[0]:
        return None
    return (a[0] // b[0], tuple(atoms))


def _prod(ms: Sequence[Mono | None]) -> Mono | None:
    out: Mono | None = _lit(1)
    for m in ms:
        out = _mul(out, m)
    return out


def _broadcast(a: Dims | None, b: Dims | None) -> Dims | None:
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    a = (_lit(1),) * (n - len(a)) + a
    b = (_lit(1),) * (n - len(b)) + b
    out: list[Mono | None] = []
    for x, y in zip(a, b):
        if x == _lit(1):
            out.append(y)
        elif y == _lit(1) or x == y:
            out.append(x)
        else:
            out.append(None)
    return tuple(out)


def _ints(value: ir.Value | None) -> list[int] | None:
    """The int values of a constant integer tensor (scalar or 1-D), else None."""
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    if tensor.dtype not in (ir.DataType.INT64, ir.DataType.INT32) or tensor.size > _MAX_VECTOR:
        return None
    arr = np.asarray(tensor.numpy())
    if arr.ndim > 1:
        return None
    return [int(x) for x in arr.reshape(-1)]


def _attr(node: ir.Node, name: str, default: object = None) -> object:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


class _Analysis:
    """Symbolic dims of tensors and symbolic elements of small int64 vectors, in one forward sweep."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.dims: dict[ir.Value, Dims | None] = {}
        #: value -> (is_scalar, elements)
        self.vec: dict[ir.Value, tuple[bool, tuple[Mono | None, ...]]] = {}
        #: atom -> (value, axis): the first value carrying it (graph inputs first)
        self.witness: dict[str, tuple[ir.Value, int]] = {}
        #: tracked vectors that hold booleans (Equal), not int64
        self.bools: set[ir.Value] = set()
        self._fresh = itertools.count()
        #: graph position of each node output (graph inputs and initializers: -1), for witness order
        self.position: dict[ir.Value, int] = {}
        for value in graph.inputs:
            self._set_dims(value, self._declared(value))
        for value in graph.initializers.values():
            self._set_dims(value, None)
            self._constant(value)
        for index, node in enumerate(graph):
            for value in node.outputs:
                self.position[value] = index
            self._visit(node)

    # --- dims -------------------------------------------------------------------------------
    def _declared(self, value: ir.Value) -> Dims | None:
        shape = value.shape
        if shape is None:
            if value.const_value is not None:
                return tuple(_lit(int(d)) for d in value.const_value.shape.numpy())
            return None
        out: list[Mono | None] = []
        for axis, d in enumerate(shape):
            if isinstance(d, int):
                out.append(_lit(d))
            elif d.value is not None and not d.value.startswith("unk__"):
                out.append((1, (f"={d.value}",)))
            else:
                out.append((1, (f"?{next(self._fresh)}:{value.name}:{axis}",)))
        return tuple(out)

    def _set_dims(self, value: ir.Value, dims: Dims | None) -> None:
        declared = self._declared(value)
        if dims is None:
            dims = declared
        elif declared is not None and len(declared) == len(dims):
            # A literal from inference beats a symbol; an unknown is filled from inference.
            dims = tuple(d if (dec is None or (d is not None and not _is_lit(dec))) else dec
                         for d, dec in zip(dims, declared))
        if dims is not None:
            dims = tuple(d if d is not None else (1, (f"?{next(self._fresh)}:{value.name}",)) for d in dims)
            for axis, d in enumerate(dims):
                if d is not None and d[0] == 1 and len(d[1]) == 1 and d[1][0] not in self.witness:
                    self.witness[d[1][0]] = (value, axis)
        self.dims[value] = dims

    def _constant(self, value: ir.Value) -> None:
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is not None and self.dims.get(value) is None:
            self.dims[value] = tuple(_lit(int(d)) for d in tensor.shape.numpy())
        ints = _ints(value)
        if ints is not None and tensor is not None and tensor.dtype == ir.DataType.INT64:
            self.vec[value] = (tensor.shape.rank() == 0, tuple(_lit(i) for i in ints))

    def d(self, value: ir.Value | None) -> Dims | None:
        return None if value is None else self.dims.get(value)

    def v(self, value: ir.Value | None) -> tuple[bool, tuple[Mono | None, ...]] | None:
        return None if value is None else self.vec.get(value)

    def _visit(self, node: ir.Node) -> None:
        outs = list(node.outputs)
        try:
            result = self._rule(node)
        except (IndexError, ValueError, TypeError, ZeroDivisionError):
            result = None
        results: list[Dims | None] = list(result) if result is not None else []
        results += [None] * (len(outs) - len(results))
        for value, dims in zip(outs, results):
            self._set_dims(value, dims)
        if node.domain in _STD and node.op_type == "Constant" and outs:
            self._constant(outs[0])
        elif node.domain in _STD and outs:
            try:
                vec = self._vector(node)
            except (IndexError, ValueError, TypeError, ZeroDivisionError):
                vec = None
            if vec is not None and len(vec[1]) <= _MAX_VECTOR:
                self.vec[outs[0]] = vec
                if node.op_type == "Equal" or (node.op_type in ("Where", "Identity") and node.inputs[-1] in self.bools):
                    self.bools.add(outs[0])

    def _reshape_dims(self, data: Dims | None, target: tuple[Mono | None, ...], allowzero: bool) -> Dims | None:
        out: list[Mono | None] = []
        minus = None
        for i, t in enumerate(target):
            if t == _lit(0) and not allowzero:
                out.append(data[i] if data is not None and i < len(data) else None)
            elif t == _lit(-1):
                if minus is not None:
                    return None
                minus = i
                out.append(None)
            else:
                out.append(t)
        if minus is not None:
            known = [m for j, m in enumerate(out) if j != minus]
            if data is not None and all(m is not None for m in known) and all(m is not None for m in data):
                rest = _prod(known)
                if rest is not None and rest[0] > 0:
                    out[minus] = _div(_prod(data), rest)
        return tuple(out)

    def _rule(self, node: ir.Node) -> list[Dims | None] | None:
        op, ins = node.op_type, node.inputs
        d0 = self.d(ins[0]) if ins else None
        if node.domain == _MS:
            if op in _MS_SAME:
                out: list[Dims | None] = [None] * len(node.outputs)
                for i in _MS_SAME[op]:
                    if i < len(out):
                        out[i] = d0
                return out
            if op == "EmbedLayerNormalization" and d0 is not None and len(d0) == 2:
                dw = self.d(ins[2]) if len(ins) > 2 else None
                hidden = dw[1] if dw is not None and len(dw) == 2 else None
                return [d0 + (hidden,), (d0[0],), d0 + (hidden,)]
            if op in _MS_ATTENTION and d0 is not None and len(d0) == 3:
                return [(d0[0], d0[1], self._attention_hidden(node, d0))]
            return None
        if node.domain not in _STD:
            return None
        if op in _UNARY:
            return [d0]
        if op in _BROADCAST:
            acc = d0
            for value in ins[1:]:
                acc = _broadcast(acc, self.d(value))
            return [acc]
        if op == "Reshape":
            t = self.v(ins[1])
            if t is None or t[0]:
                return None
            return [self._reshape_dims(d0, t[1], bool(_attr(node, "allowzero", 0)))]
        if op == "Expand":
            t = self.v(ins[1])
            if t is None or t[0]:
                return None
            return [_broadcast(d0, t[1])]
        if op == "Transpose" and d0 is not None:
            perm_attr = _attr(node, "perm")
            order: list[int] = list(perm_attr) if perm_attr is not None else list(reversed(range(len(d0))))  # type: ignore[call-overload]
            return [tuple(d0[p] for p in order)]
        if op in ("Unsqueeze", "Squeeze") and d0 is not None:
            axes = _ints(ins[1]) if len(ins) > 1 else None
            if axes is None:
                return None
            if op == "Unsqueeze":
                rank = len(d0) + len(axes)
                norm = sorted(a % rank for a in axes)
                it = iter(d0)
                return [tuple(_lit(1) if i in norm else next(it) for i in range(rank))]
            drop = {a % len(d0) for a in axes}
            return [tuple(m for i, m in enumerate(d0) if i not in drop)]
        if op == "Gather" and d0 is not None:
            di = self.d(ins[1])
            if di is None:
                return None
            axis = int(_attr(node, "axis", 0)) % len(d0)  # type: ignore[call-overload]
            return [d0[:axis] + di + d0[axis + 1:]]
        if op == "MatMul" and d0 is not None:
            d1 = self.d(ins[1])
            if d1 is None or len(d0) < 2 or len(d1) < 2:
                return None
            batch = _broadcast(d0[:-2], d1[:-2])
            return None if batch is None else [batch + (d0[-2], d1[-1])]
        if op == "Gemm" and d0 is not None:
            d1 = self.d(ins[1])
            if d1 is None or len(d0) != 2 or len(d1) != 2:
                return None
            m = d0[1] if _attr(node, "transA", 0) else d0[0]
            n = d1[0] if _attr(node, "transB", 0) else d1[1]
            return [(m, n)]
        if op == "Split" and d0 is not None:
            axis = int(_attr(node, "axis", 0)) % len(d0)  # type: ignore[call-overload]
            sizes = _ints(ins[1]) if len(ins) > 1 else None
            if sizes is None or len(sizes) != len(node.outputs):
                return None
            return [d0[:axis] + (_lit(s),) + d0[axis + 1:] for s in sizes]
        if op == "Range":
            start, limit, delta = (self.v(v) for v in ins[:3])
            if start is None or limit is None or delta is None or not (start[0] and limit[0] and delta[0]):
                return None
            s0, l0, d0_ = start[1][0], limit[1][0], delta[1][0]
            if s0 == _lit(0) and d0_ == _lit(1) and l0 is not None and l0[0] >= 0:
                return [(l0,)]  # a dim (or a literal >= 0): the length is the limit itself
            if _is_lit(s0) and _is_lit(l0) and _is_lit(d0_) and d0_[0] != 0:  # type: ignore[index]
                return [(_lit(max(-(-(l0[0] - s0[0]) // d0_[0]), 0)),)]  # type: ignore[index]
            return None
        if op == "Slice" and d0 is not None:
            return [self._slice_dims(node, d0)]
        if op == "Concat":
            parts = [self.d(v) for v in ins]
            if any(p is None for p in parts) or len({len(p) for p in parts}) != 1:  # type: ignore[arg-type]
                return None
            axis = int(_attr(node, "axis", 0)) % len(parts[0])  # type: ignore[arg-type, call-overload]
            along = [p[axis] for p in parts]  # type: ignore[index]
            if not all(_is_lit(m) for m in along):
                return None
            first = parts[0]
            assert first is not None
            return [first[:axis] + (_lit(sum(m[0] for m in along)),) + first[axis + 1:]]  # type: ignore[index]
        if op == "Shape" and d0 is not None:
            return [(_lit(len(d0[slice(*self._shape_range(node, len(d0)))])),)]
        return None

    def _slice_dims(self, node: ir.Node, d0: Dims) -> Dims | None:
        """Slice with constant starts/ends/axes/steps: literal dims exactly, a dim kept whole where the slice is [0:big]."""
        ins = node.inputs
        starts, ends = _ints(ins[1]), _ints(ins[2])
        axes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
        steps = _ints(ins[4]) if len(ins) > 4 and ins[4] is not None else None
        if starts is None or ends is None:
            return None
        axes = axes if axes is not None else list(range(len(starts)))
        steps = steps if steps is not None else [1] * len(starts)
        out = list(d0)
        for s0, e0, a0, st in zip(starts, ends, axes, steps):
            axis = a0 % len(d0)
            dim = d0[axis]
            if dim is not None and _is_lit(dim):
                out[axis] = _lit(len(range(dim[0])[slice(s0, e0, st)]))
            elif s0 == 0 and st == 1 and e0 >= 1 << 62:
                out[axis] = dim
            else:
                out[axis] = None
        return tuple(out)

    def _attention_hidden(self, node: ir.Node, d0: Dims) -> Mono | None:
        """The last output dim of a com.microsoft attention op (query [B, S, *] in), where its inputs say it."""
        ins = node.inputs
        if node.op_type == "MultiHeadAttention":
            dv = self.d(ins[2]) if len(ins) > 2 else None
            return dv[2] if dv is not None and len(dv) == 3 else None
        if node.op_type == "Attention":
            sizes = _attr(node, "qkv_hidden_sizes")
            if sizes is not None:
                return _lit(list(sizes)[2])  # type: ignore[call-overload]
            dw = self.d(ins[1]) if len(ins) > 1 else None
            return _div(dw[1], _lit(3)) if dw is not None and len(dw) == 2 else None
        if node.op_type == "GroupQueryAttention":
            heads, kv = int(_attr(node, "num_heads", 0)), int(_attr(node, "kv_num_heads", 0))  # type: ignore[call-overload]
            if len(ins) > 1 and ins[1] is not None:
                return d0[2]  # separate query: its hidden is num_heads * head_size
            head = _div(d0[2], _lit(heads + 2 * kv)) if heads > 0 else None
            return _mul(head, _lit(heads))
        return None

    @staticmethod
    def _shape_range(node: ir.Node, rank: int) -> tuple[int, int]:
        start = int(_attr(node, "start", 0))  # type: ignore[call-overload]
        end = _attr(node, "end")
        stop = rank if end is None else int(end)  # type: ignore[call-overload]
        start = min(max(start + rank if start < 0 else start, 0), rank)
        stop = min(max(stop + rank if stop < 0 else stop, 0), rank)
        return start, stop

    # --- int64 vectors ----------------------------------------------------------------------
    def _vector(self, node: ir.Node) -> tuple[bool, tuple[Mono | None, ...]] | None:
        op, ins = node.op_type, node.inputs
        if op == "Shape":
            d0 = self.d(ins[0])
            if d0 is None:
                return None
            return False, d0[slice(*self._shape_range(node, len(d0)))]
        if op == "Identity":
            return self.v(ins[0])
        if op == "Cast":
            if _attr(node, "to") != ir.DataType.INT64:
                return None
            return self.v(ins[0])
        if op == "ConstantOfShape":
            shape = self.v(ins[0])
            value = node.attributes.get("value")
            if shape is None or shape[0] or not all(_is_lit(m) for m in shape[1]) or value is None:
                return None  # (no value: float32 zeros, not an int64 vector)
            fill_tensor = value.as_tensor()
            if fill_tensor.dtype != ir.DataType.INT64:
                return None
            fill = int(np.asarray(fill_tensor.numpy()).reshape(-1)[0])
            n = _prod(shape[1])
            if n is None or len(shape[1]) != 1 or n[0] > _MAX_VECTOR:
                return None
            return False, tuple(_lit(fill) for _ in range(n[0]))
        x = self.v(ins[0]) if ins else None
        if op == "Gather":
            idx = _ints(ins[1])
            if x is None or x[0] or idx is None or int(_attr(node, "axis", 0)) != 0:  # type: ignore[call-overload]
                return None
            itensor = ir.convenience.get_const_tensor(ins[1]) if ins[1] is not None else None
            scalar = itensor is not None and itensor.shape.rank() == 0
            size = len(x[1])
            if any(not -size <= i < size for i in idx):
                return None
            return scalar, tuple(x[1][i] for i in idx)
        if op == "Slice":
            starts, ends = _ints(ins[1]), _ints(ins[2])
            axes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else [0]
            steps = _ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1]
            if x is None or x[0] or starts is None or ends is None or axes not in ([0], [-1]) or steps is None:
                return None
            if len(starts) != 1 or len(ends) != 1 or steps[0] <= 0:
                return None
            return False, x[1][starts[0]:ends[0]:steps[0]]
        if op == "Unsqueeze":
            return (False, x[1]) if x is not None and x[0] and _ints(ins[1]) in ([0], [-1]) else None
        if op == "Squeeze":
            if x is None or x[0] or len(x[1]) != 1:
                return None
            if len(ins) > 1 and ins[1] is not None and _ints(ins[1]) not in ([0], [-1]):
                return None
            return True, x[1]
        if op == "Reshape":
            t = _ints(ins[1])
            if x is None or t is None or len(t) > 1:
                return None
            if t == [] and len(x[1]) == 1:
                return True, x[1]
            if t in ([-1], [len(x[1])]):
                return False, x[1]
            return None
        if op == "Concat":
            parts = [self.v(v) for v in ins]
            if int(_attr(node, "axis", 0)) not in (0, -1) or any(p is None or p[0] for p in parts):  # type: ignore[call-overload]
                return None
            return False, tuple(m for p in parts for m in p[1])  # type: ignore[index]
        if op in ("Add", "Sub", "Mul", "Div", "Equal", "Where"):
            parts = [self.v(v) for v in ins]
            if any(p is None for p in parts):
                return None
            lens = {len(p[1]) for p in parts if not p[0]}  # type: ignore[index]
            if len(lens) > 1 and not (len(lens) == 2 and 1 in lens):
                return None
            width = max([len(p[1]) for p in parts] or [0])  # type: ignore[index]
            cols = [[p[1][0]] * width if len(p[1]) == 1 else list(p[1]) for p in parts]  # type: ignore[index]
            scalar = all(p[0] for p in parts)  # type: ignore[index]
            return scalar, tuple(self._elementwise(op, [c[i] for c in cols]) for i in range(width))
        return None

    @staticmethod
    def _elementwise(op: str, args: list[Mono | None]) -> Mono | None:
        if any(a is None for a in args):
            return None
        if op == "Where":
            cond, a, b = args
            if not _is_lit(cond):
                return None
            return a if cond[0] else b  # type: ignore[index]
        a, b = args
        assert a is not None and b is not None
        if op == "Mul":
            return _mul(a, b)
        if op == "Div":
            if _is_lit(a) and _is_lit(b):
                return None if b[0] == 0 else _lit(int(np.floor_divide(a[0], b[0])) if a[0] * b[0] >= 0 else -(-a[0] // b[0]))
            return _div(a, b) if a[0] >= 0 and b[0] > 0 else None
        if op in ("Add", "Sub"):
            sign = 1 if op == "Add" else -1
            if _is_lit(a) and _is_lit(b):
                return _lit(a[0] + sign * b[0])
            if b == _lit(0):
                return a
            if a[1] == b[1]:
                coef = a[0] + sign * b[0]
                return _lit(0) if coef == 0 else (coef, a[1])
            return None
        if op == "Equal":
            if a == b:
                return _lit(1)
            if _is_lit(a) and _is_lit(b):
                return _lit(int(a[0] == b[0]))
            # A monomial of dims with a positive coefficient is >= 0: it never equals a negative literal.
            sym, other = (a, b) if _is_lit(b) else (b, a)
            if _is_lit(other) and not _is_lit(sym) and sym[0] > 0 and other[0] < 0:
                return _lit(0)
            return None
        return None


class _Builder:
    """Builds canonical shape vectors, once each, before their first reader."""

    def __init__(self, model: ir.Model, analysis: _Analysis) -> None:
        self.model = model
        self.graph = model.graph
        self.an = analysis
        self.opset = model.opset_imports.get("", 1)
        self.cache: dict[tuple, ir.Value] = {}
        self.built = 0
        self.names = {n.name for n in iter_nodes(self.graph) if n.name}

    def plan(self, scalar: bool, elems: Sequence[Mono | None], reader: ir.Node) -> list[tuple] | None:
        """Pieces (``("const", ints)`` / ``("shape", value, start, end)``) that make ``elems`` for ``reader``.

        None if some element cannot be made from literals and dims of values computed before ``reader``
        (a dim of the reader's own output, or of anything after it, would make a cycle).
        """
        limit = self.an.position.get(reader.outputs[0], 1 << 62) if reader.outputs else 1 << 62
        pieces: list[tuple] = []
        for m in elems:
            if m is None:
                return None
            if _is_lit(m):
                if pieces and pieces[-1][0] == "const":
                    pieces[-1] = ("const", pieces[-1][1] + (m[0],))
                else:
                    pieces.append(("const", (m[0],)))
                continue
            if m[0] != 1 or len(m[1]) != 1 or m[1][0] not in self.an.witness:
                return None
            value, axis = self.an.witness[m[1][0]]
            if self.an.position.get(value, -1) >= limit:
                return None
            last = pieces[-1] if pieces else None
            if last is not None and last[0] == "shape" and last[1] is value and last[3] == axis:
                pieces[-1] = ("shape", value, last[2], axis + 1)
            else:
                pieces.append(("shape", value, axis, axis + 1))
        if scalar and (len(pieces) != 1 or len(elems) != 1):
            return None
        return pieces

    def matches(self, value: ir.Value, pieces: list[tuple], scalar: bool) -> bool:
        if scalar:
            return self._matches_scalar(value, pieces[0])
        if len(pieces) == 1:
            return self._matches_piece(value, pieces[0])
        node = value.producer()
        if node is None or node.op_type != "Concat" or node.domain not in _STD or len(node.inputs) != len(pieces):
            return False
        return all(v is not None and self._matches_piece(v, p) for v, p in zip(node.inputs, pieces))

    @staticmethod
    def _const_vector(value: ir.Value) -> tuple[int, ...] | None:
        t = ir.convenience.get_const_tensor(value)
        if t is None or t.dtype != ir.DataType.INT64 or t.shape.rank() != 1:
            return None
        return tuple(int(x) for x in np.asarray(t.numpy()).reshape(-1))

    def _matches_piece(self, value: ir.Value, piece: tuple) -> bool:
        if piece[0] == "const":
            return self._const_vector(value) == piece[1]
        if self._matches_gathered(value, piece):
            return True
        node = value.producer()
        if node is None or node.domain not in _STD or node.inputs[0] is not piece[1]:
            return False
        rank = len(self.an.d(piece[1]) or ())
        if node.op_type == "Shape":
            return _Analysis._shape_range(node, rank) == (piece[2], piece[3])
        return False

    def _matches_gathered(self, value: ir.Value, piece: tuple) -> bool:
        """``Gather(Shape(w), [start .. end-1])``: the form built below opset 15."""
        node = value.producer()
        if node is None or node.op_type != "Gather" or node.domain not in _STD or int(_attr(node, "axis", 0)) != 0:  # type: ignore[call-overload]
            return False
        shape = node.inputs[0].producer() if node.inputs[0] is not None else None
        if shape is None or shape.op_type != "Shape" or shape.domain not in _STD or shape.inputs[0] is not piece[1]:
            return False
        start, _ = _Analysis._shape_range(shape, len(self.an.d(piece[1]) or ()))
        return _ints(node.inputs[1]) == [start + i for i in range(piece[2], piece[3])] and node.inputs[1] is not None and len(node.inputs[1].shape or [0]) == 1

    def _matches_scalar(self, value: ir.Value, piece: tuple) -> bool:
        if piece[0] == "const":
            t = ir.convenience.get_const_tensor(value)
            return t is not None and t.dtype == ir.DataType.INT64 and t.shape.rank() == 0 and int(t.numpy()) == piece[1][0]
        node = value.producer()
        if node is None or node.op_type != "Gather" or node.domain not in _STD or int(_attr(node, "axis", 0)) != 0:  # type: ignore[call-overload]
            return False
        idx = node.inputs[1]
        shape = node.inputs[0].producer() if node.inputs[0] is not None else None
        itensor = None if idx is None else ir.convenience.get_const_tensor(idx)
        if itensor is None or itensor.shape.rank() != 0 or shape is None:
            return False
        if shape.op_type != "Shape" or shape.inputs[0] is not piece[1]:
            return False
        start, _ = _Analysis._shape_range(shape, len(self.an.d(piece[1]) or ()))
        return start + int(itensor.numpy()) == piece[2]

    def const(self, ints: Sequence[int], scalar: bool = False) -> ir.Value:
        key = ("const", tuple(ints), scalar)
        if key not in self.cache:
            arr = np.asarray(ints[0] if scalar else list(ints), dtype=np.int64)
            value = ir.Value(name=unique_initializer_name(self.graph, "mograph_shape"), const_value=ir.tensor(arr))
            value.type = ir.TensorType(ir.DataType.INT64)
            value.shape = ir.Shape(list(arr.shape))
            self.graph.register_initializer(value)
            self.cache[key] = value
            self.built += 1
        return self.cache[key]

    def _node(self, before: ir.Node, op: str, inputs: list[ir.Value], **attrs: object) -> ir.Value:
        node = ir.node(op, inputs, attributes=attrs, name=fresh_name(self.names, f"mograph_shape_{op}"))  # type: ignore[arg-type]
        self.graph.insert_before(before, node)
        self.built += 1
        out = node.outputs[0]
        out.type = ir.TensorType(ir.DataType.INT64)
        return out

    def _shape(self, before: ir.Node, value: ir.Value, start: int, end: int) -> ir.Value:
        rank = len(self.an.d(value) or ())
        key = ("shape", id(value), start, end)
        if key not in self.cache:
            if self.opset >= 15 or (start == 0 and end == rank):
                attrs: dict[str, object] = {}
                if start:
                    attrs["start"] = start
                if end != rank:
                    attrs["end"] = end
                out = self._node(before, "Shape", [value], **attrs)
            else:
                full = self._node(before, "Shape", [value])
                out = self._node(before, "Gather", [full, self.const(list(range(start, end)))], axis=0)
            out.shape = ir.Shape([end - start])
            self.cache[key] = out
        return self.cache[key]

    def build(self, before: ir.Node, pieces: list[tuple], scalar: bool) -> ir.Value:
        if scalar:
            piece = pieces[0]
            if piece[0] == "const":
                return self.const(piece[1], scalar=True)
            key = ("scalar", id(piece[1]), piece[2])
            if key not in self.cache:
                full = self._shape(before, piece[1], 0, len(self.an.d(piece[1]) or ()))
                out = self._node(before, "Gather", [full, self.const([piece[2]], scalar=True)], axis=0)
                out.shape = ir.Shape([])
                self.cache[key] = out
            return self.cache[key]
        values = [self.const(p[1]) if p[0] == "const" else self._shape(before, p[1], p[2], p[3]) for p in pieces]
        if len(values) == 1:
            return values[0]
        ckey = ("concat", tuple(id(v) for v in values))
        if ckey not in self.cache:
            out = self._node(before, "Concat", values, axis=0)
            out.shape = ir.Shape([sum(len(p[1]) if p[0] == "const" else p[3] - p[2] for p in pieces)])
            self.cache[ckey] = out
        return self.cache[ckey]


def _replace_uses(old: ir.Value, new: ir.Value) -> bool:
    if old.is_graph_output():
        return False
    ir.convenience.replace_all_uses_with(old, new)
    return True


class SimplifyShapesPass(Pass):
    """Remove no-op Reshape/Expand and compute each dynamic shape once, from the graph inputs."""

    name = "simplify-shapes"
    family = "cleanup"
    options = (
        Option("shape-rounds", int, 4, "most analysis-and-rewrite rounds simplify-shapes runs", metavar="N"),
    )

    def call(self, model: ir.Model) -> PassResult:
        stats: dict[str, int | float] = {
            "removed_reshapes": 0,
            "removed_expands": 0,
            "merged_reshapes": 0,
            "reshape_targets": 0,
            "shape_constants": 0,
            "shapes_rebuilt": 0,
            "removed_nodes": 0,
        }
        before = sum(op_histogram(model).values())
        for _ in range(max(1, int(self.config["shape_rounds"]))):
            if not self._round(model, stats):
                break
            irp.RemoveUnusedNodesPass()(model)
        changed = any(v for k, v in stats.items() if k != "removed_nodes")
        stats["removed_nodes"] = before - sum(op_histogram(model).values())
        return PassResult(modified=bool(changed), stats=stats)

    def _round(self, model: ir.Model, stats: dict[str, int | float]) -> bool:
        an = _Analysis(model.graph)
        builder = _Builder(model, an)
        changed = False
        # One sweep in graph order, so a shared piece is built before its first reader.
        for node in list(model.graph):
            if node.graph is None:
                continue
            std = node.domain in _STD
            if std and node.op_type in ("Reshape", "Expand") and len(node.inputs) == 2 and node.inputs[0] is not None:
                x, y = node.inputs[0], node.outputs[0]
                dx, dy = an.d(x), an.d(y)
                if dx is not None and dy is not None and dx == dy and all(m is not None for m in dx):
                    if _replace_uses(y, x):
                        stats["removed_reshapes" if node.op_type == "Reshape" else "removed_expands"] += 1
                        changed = True
                        continue
            if std and node.op_type == "Reshape" and len(node.inputs) == 2:
                changed |= self._reshape(node, an, builder, stats)
            # Other frontier shape vectors (read by a non-shape op): constants, or rebuilt from input dims.
            for index, value in enumerate(node.inputs):
                if value is None or value not in an.vec or value in an.bools:
                    continue
                if std and node.op_type == "Reshape" and index == 1:
                    continue  # handled above, with the input's dims
                if node.outputs and node.outputs[0] in an.vec:
                    continue  # an intermediate step of a tracked shape computation
                if ir.convenience.get_const_tensor(value) is not None:
                    continue
                producer = value.producer()
                if producer is None or producer.domain not in _STD or producer.op_type not in _SHAPE_OPS:
                    continue
                scalar, elems = an.vec[value]
                if value.shape is not None and value.shape.rank() != (0 if scalar else 1):
                    continue
                pieces = builder.plan(scalar, elems, node)
                if pieces is None or builder.matches(value, pieces, scalar):
                    continue
                new = builder.build(node, pieces, scalar)
                node.replace_input_with(index, new)
                stats["shape_constants" if all(p[0] == "const" for p in pieces) else "shapes_rebuilt"] += 1
                changed = True
        return changed

    def _reshape(self, node: ir.Node, an: _Analysis, builder: _Builder, stats: dict[str, int | float]) -> bool:
        x, target = node.inputs[0], node.inputs[1]
        if x is None or target is None:
            return False
        allowzero = bool(_attr(node, "allowzero", 0))
        changed = False
        # Reshape(Reshape(a, s1), s2) -> Reshape(a, s2') when the result's dims are known without s1's.
        inner = x.producer()
        dy = an.d(node.outputs[0])
        if (inner is not None and inner.op_type == "Reshape" and inner.domain in _STD and inner.inputs[0] is not None
                and dy is not None and all(m is not None for m in dy) and an.d(inner.inputs[0]) is not None):
            if an.d(inner.inputs[0]) == dy and _replace_uses(node.outputs[0], inner.inputs[0]):
                stats["removed_reshapes"] += 1
                return True
            plan = self._target(dy, an.d(inner.inputs[0]), allowzero, builder, node)
            if plan is not None:
                node.replace_input_with(0, inner.inputs[0])
                node.replace_input_with(1, builder.build(node, plan, False))
                stats["merged_reshapes"] += 1
                return True
        vec = an.v(target)
        if vec is None or vec[0]:
            return changed
        elems = vec[1]
        if allowzero:
            if not all(_is_lit(m) for m in elems):
                return changed
            plan = [("const", tuple(m[0] for m in elems))]  # type: ignore[index]
        else:
            dims = an._reshape_dims(an.d(x), elems, False)
            if dims is None or any(m is None for m in dims):
                # Keep the entries as they are (literal 0 / -1 included), only rebuilt from input dims.
                plan = builder.plan(False, elems, node)
            else:
                plan = self._target(dims, an.d(x), False, builder, node) or builder.plan(False, elems, node)
        if plan is None or builder.matches(target, plan, False):
            return changed
        node.replace_input_with(1, builder.build(node, plan, False))
        stats["reshape_targets"] += 1
        return True

    @staticmethod
    def _target(out: Dims, data: Dims | None, allowzero: bool, builder: _Builder, reader: ir.Node) -> list[tuple] | None:
        """Pieces of a Reshape target that gives dims ``out`` from input dims ``data`` (exactly)."""
        if allowzero:
            return builder.plan(False, out, reader) if all(_is_lit(m) for m in out) else None
        entries: list[Mono | None] = []
        for i, m in enumerate(out):
            if m is None:
                return None
            if data is not None and i < len(data) and data[i] == m and not (_is_lit(m) and m[0] > 0):
                entries.append(_lit(0))  # copy the input dim at this index
            elif _is_lit(m) and m[0] == 0:
                return None  # a literal 0 would copy, not make a zero-size dim
            else:
                entries.append(m)
        symbolic = [i for i, m in enumerate(entries) if not _is_lit(m)]
        if len(symbolic) == 1 and all(m is not None and _is_lit(m) and m[0] > 0
                                        for j, m in enumerate(entries) if j != symbolic[0]):
            entries[symbolic[0]] = _lit(-1)
        return builder.plan(False, entries, reader)
