"""``fuse-attention``: multi-head scaled dot-product attention -> ``mograph.Attention``.

The math matched (``Q``, ``K``, ``V`` are ``[B, S, H*D]`` / ``[B, T, H*D]``, the projections with
their biases already added; ``M`` an additive bias broadcastable to ``[B, H, S, T]``)::

    Qh = Transpose(Reshape(Q, [B, S, H, D]), [0, 2, 1, 3])          [B, H, S, D]
    Kt = Transpose(Reshape(K, [B, T, H, D]), [0, 2, 3, 1])          [B, H, D, T]
         (or [0, 2, 1, 3] then [0, 1, 3, 2])
    Vh = Transpose(Reshape(V, [B, T, H, D]), [0, 2, 1, 3])          [B, H, T, D]
    P  = Softmax(Qh Kt * scale + M, axis=-1)
    Y  = Reshape(Transpose(P Vh, [0, 2, 1, 3]), [B, S, H*D])

``scale`` is any constant, written as ``Div(Qh Kt, c)`` or ``Mul(Qh Kt, c)`` (TorchScript and dynamo
exports of ``transformers`` eager attention), as ``(Qh * a)(Kt * b)`` (``scale = a b``; exporters that
split ``1/sqrt(D)`` into ``D^-1/4`` on each side), or absent (``scale = 1``).  ``M`` is optional; it
is taken as it is, whatever computed it (``(1 - mask) * min`` in older ``transformers``, a
``Where`` over a boolean ``[B, 1, S, T]`` mask in newer ones), so masked positions stay exactly as
masked as in the original.  The reshape targets may be constants or computed from the runtime shape
(``Shape``/``Gather``/``Unsqueeze``/``Concat``); ``H`` and ``D`` must be constants (one may be -1).

Lowering per ``--target``:

``ort``
    ``com.microsoft.Attention`` when ``Q``, ``K`` and ``V`` are ``x @ W + b`` of one ``x`` with
    constant weights (the three projections are packed into one ``[hidden, 3*H*D]`` GEMM, which is
    what ONNX Runtime's CPU kernel is fastest with), else ``com.microsoft.MultiHeadAttention``;
    ``M`` goes to ``attention_bias``, expanded to ``[B|1, H|1, S, T]`` where the kernel needs it (one
    expansion per bias and query length, shared by every layer).  Where ``Attention`` is used and
    ``M`` is provably a key-padding bias of a 2-D ``[B, T]`` ``attention_mask`` input (0 where the
    mask is 1, a negative constant ``c`` where it is 0: ``(1 - mask) * c``, ``Where(mask, 0, c)``, or
    ``transformers``' index-based padding lookup as TorchScript exports it), the mask itself, cast
    once to int32, goes to ``mask_index`` with ``mask_filter_value = c`` and the float bias is
    dropped.  The kernel fills masked scores with ``c`` exactly as the original adds it, so even a
    fully padded row (uniform softmax) agrees.  Exact for 0/1 masks, the contract of
    ``attention_mask`` (other values are not checked to give the same result).
``onnx``
    the standard ``Attention`` (3-D form, ``q_num_heads``; ``M`` as ``attn_mask``, expanded the same
    way, since ONNX Runtime does not broadcast its dim -2) at opset >= 23; below that ONNX has no
    attention op and the pass does nothing (the unfused graph is the onnx form).  The opset is never
    changed.
``mograph``
    ``mograph.Attention`` with its function body in standard ops.
``tensorrt``
    nothing: mograph has no TensorRT plugin for attention yet, and TensorRT's ONNX parser would take a
    node named ``Attention`` for its own op and refuse it; TensorRT fuses the unfused attention
    subgraph itself.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._common import FusionPass, is_float, mograph_op

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION, CustomOp
from mograph.pass_infra import PassResult
from mograph.patterns import MatchResult, OrValue, Rule, Var, constant_array, remove_dead_producers, scalar_value

__all__ = ["AttentionFusion", "FuseAttentionPass", "attention", "custom_ops", "ATTENTION_OP"]

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
#: The fused op's type in the ``mograph`` domain.
ATTENTION_OP = "Attention"
#: First default-domain opset with a standard ``Attention`` op.
ONNX_ATTENTION_OPSET = 23


# ---------------------------------------------------------------------------------------------
# the op: numpy reference, function body, shapes
# ---------------------------------------------------------------------------------------------


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None = None, *,
              num_heads: int, scale: float | None = None) -> np.ndarray:
    """Multi-head attention over ``[B, S, H*D]`` inputs (float32 arithmetic, result in q's dtype)."""
    dt: Any = np.float64 if q.dtype == np.float64 else np.float32
    b, s, hidden = q.shape
    t = k.shape[1]
    d = hidden // num_heads
    dv = v.shape[2] // num_heads
    qh: np.ndarray = q.astype(dt).reshape(b, s, num_heads, d).transpose(0, 2, 1, 3)
    kh: np.ndarray = k.astype(dt).reshape(k.shape[0], t, num_heads, d).transpose(0, 2, 3, 1)
    vh: np.ndarray = v.astype(dt).reshape(v.shape[0], t, num_heads, dv).transpose(0, 2, 1, 3)
    scores: np.ndarray = np.matmul(qh, kh) * np.asarray(1.0 / math.sqrt(d) if scale is None else scale, dtype=dt)
    if bias is not None:
        scores = scores + bias.astype(dt)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(axis=-1, keepdims=True)
    y = np.matmul(p, vh).transpose(0, 2, 1, 3).reshape(b, s, num_heads * dv)
    return y.astype(q.dtype)


def _attention_fn(opset: int) -> ir.Function:
    """Function body: the unfused computation in default-domain ops (needs opset >= 13)."""
    nodes: list[ir.Node] = []

    def add(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes=attrs)
        nodes.append(node)
        return node.outputs[0]

    q, k, v, bias = (ir.Value(name=n) for n in ("Q", "K", "V", "AttentionBias"))
    heads = add("Constant", value_int=ir.RefAttr("value_int", "num_heads", ir.AttributeType.INT))
    heads = add("Reshape", heads, add("Constant", value_ints=[1]))
    shape4 = add("Concat", add("Constant", value_ints=[0, 0]), heads, add("Constant", value_ints=[-1]), axis=0)
    qh = add("Transpose", add("Reshape", q, shape4), perm=[0, 2, 1, 3])
    kt = add("Transpose", add("Reshape", k, shape4), perm=[0, 2, 3, 1])
    vh = add("Transpose", add("Reshape", v, shape4), perm=[0, 2, 1, 3])
    scale = add("Constant", value_float=ir.RefAttr("value_float", "scale", ir.AttributeType.FLOAT))
    if opset >= 15:
        scale = add("CastLike", scale, q)
    scores = add("Add", add("Mul", add("MatMul", qh, kt), scale), bias)
    probs = add("Softmax", scores, axis=-1)
    ctx = add("Transpose", add("MatMul", probs, vh), perm=[0, 2, 1, 3])
    y = add("Reshape", ctx, add("Constant", value_ints=[0, 0, -1]))
    graph = ir.Graph([q, k, v, bias], [y], nodes=nodes, opset_imports={"": opset})
    return ir.Function(DOMAIN, ATTENTION_OP, "", graph=graph,
                       attributes=[ir.AttrInt64("num_heads", 1), ir.AttrFloat32("scale", 1.0)])


def _infer_shapes(node: ir.Node) -> None:
    q, _, v = node.inputs[:3]
    out = node.outputs[0]
    if q is None or v is None:
        return
    if q.type is not None:
        out.type = q.type
    if q.shape is not None and v.shape is not None and len(q.shape) == 3 and len(v.shape) == 3:
        out.shape = ir.Shape([q.shape[0], q.shape[1], v.shape[2]])


def custom_ops() -> list[CustomOp]:
    """The ``mograph.Attention`` declaration (contributed through ``mograph_add_custom_ops``)."""
    return [
        CustomOp(
            name=ATTENTION_OP,
            domain=DOMAIN,
            version=DOMAIN_VERSION,
            doc="Multi-head attention: Y = concat_h(softmax(Q_h K_h^T * scale + AttentionBias) V_h); Q, K, V "
                "[B, S|T, H*D], AttentionBias broadcastable to [B, H, S, T] (a zero scalar when there is none).",
            inputs=("Q", "K", "V", "AttentionBias"),
            outputs=("Y",),
            attributes={"num_heads": 1, "scale": 1.0},
            reference=lambda q, k, v, bias, num_heads=1, scale=1.0: (
                attention(q, k, v, bias, num_heads=num_heads, scale=scale),),
            function=_attention_fn,
            infer_shapes=_infer_shapes,
            lowerings={"ort": _lower_ort, "onnx": _lower_onnx},
        )
    ]


# ---------------------------------------------------------------------------------------------
# reshape targets
# ---------------------------------------------------------------------------------------------

#: An entry of a reshape target: a constant, ("dim", i) for "dim i of a runtime shape", or None.
Entry = Any


def _runtime_dim(value: ir.Value | None) -> tuple[str, int] | None:
    """``("dim", i)`` if ``value`` is a 1-element tensor holding dim ``i`` of some tensor's runtime shape."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type in ("Unsqueeze", "Cast", "Reshape", "Squeeze") and node.domain == "":
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None:
        return None
    if node.op_type == "Shape":
        start = node.attributes.get("start")
        end = node.attributes.get("end")
        if start is None or end is None or int(end.value) != int(start.value) + 1 or int(start.value) < 0:
            return None
        return ("dim", int(start.value))
    if node.op_type == "Gather" and node.inputs[0] is not None:
        shape_node = node.inputs[0].producer()
        idx = constant_array(node.inputs[1])
        if shape_node is None or shape_node.op_type != "Shape" or idx is None or idx.size != 1:
            return None
        start = shape_node.attributes.get("start")
        if shape_node.attributes.get("end") is not None or int(idx.reshape(())) < 0:
            return None
        return ("dim", int(idx.reshape(())) + (int(start.value) if start is not None else 0))
    return None


def _entries(value: ir.Value | None) -> list[Entry] | None:
    """The entries of a reshape target, each resolved as far as it can be; None if even its length is unknown."""
    if value is None:
        return None
    arr = constant_array(value)
    if arr is not None:
        return [int(a) for a in arr.reshape(-1)]
    node = value.producer()
    if node is None or node.op_type != "Concat":
        return None
    out: list[Entry] = []
    for inp in node.inputs:
        part = constant_array(inp)
        if part is not None:
            out.extend(int(a) for a in part.reshape(-1))
            continue
        dim = _runtime_dim(inp)
        if dim is not None:
            out.append(dim)
        elif inp is not None and inp.shape is not None and list(inp.shape) == [1]:
            out.append(None)
        else:
            return None
    return out


def _same_dim(a: Any, b: Any) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    va, vb = getattr(a, "value", None), getattr(b, "value", None)
    return va is not None and va == vb


def _keeps_leading(reshape: ir.Node) -> bool:
    """Whether a Reshape keeps dims 0 and 1 of its input (its target starts with ``B, S``)."""
    x, target = reshape.inputs[0], reshape.inputs[1]
    out = reshape.outputs[0]
    if x is None or x.shape is None or len(x.shape) < 2:
        return False
    if out.shape is not None and len(out.shape) >= 2 and all(_same_dim(out.shape[i], x.shape[i]) for i in (0, 1)):
        return True
    entries = _entries(target)
    if entries is None or len(entries) < 2:
        return False
    allowzero = reshape.attributes.get("allowzero")
    zero_copies = allowzero is None or int(allowzero.value) == 0
    for i in (0, 1):
        e = entries[i]
        if e == ("dim", i) or (e == 0 and zero_copies):
            continue
        if isinstance(e, int) and isinstance(x.shape[i], int) and x.shape[i] == e:
            continue
        return False
    return True


def _heads_and_dim(reshape: ir.Node, hidden: int) -> tuple[int, int] | str:
    """``(H, D)`` of a ``[B, S, H*D] -> [B, S, H, D]`` Reshape, or why they cannot be determined."""
    entries = _entries(reshape.inputs[1])
    out = reshape.outputs[0]
    h: Any = None
    d: Any = None
    if entries is not None and len(entries) == 4:
        h, d = entries[2], entries[3]
    elif entries is not None:
        return f"reshape '{reshape.name}' is not to 4 dims"
    if not (isinstance(h, int) and isinstance(d, int)) and out.shape is not None and len(out.shape) == 4:
        h, d = out.shape[2], out.shape[3]
    if not (isinstance(h, int) and isinstance(d, int)):
        return f"num_heads cannot be determined: reshape target of '{reshape.name}' is not constant"
    if h == -1 and d > 0 and hidden % d == 0:
        h = hidden // d
    elif d == -1 and h > 0 and hidden % h == 0:
        d = hidden // h
    if h <= 0 or d <= 0 or h * d != hidden:
        return f"reshape '{reshape.name}' splits {hidden} into {h} x {d}"
    if not _keeps_leading(reshape):
        return f"reshape '{reshape.name}' does not keep the batch and sequence dims"
    return h, d


# ---------------------------------------------------------------------------------------------
# the rule
# ---------------------------------------------------------------------------------------------


def _split(op: Any, x: Any, name: str, perm: list[int]) -> Any:
    return op.Transpose(op.Reshape(x, Var(f"{name}_shape"), _outputs=[f"{name}_4d"]), perm=perm)


class AttentionFusion(Rule):
    """The attention block of a transformer layer -> mograph.Attention(Q, K, V, bias)."""

    min_candidate_nodes = 5

    def pattern(self, op: Any, q: Any, k: Any, v: Any, out_shape: Any) -> Any:
        qh = _split(op, q, "q", [0, 2, 1, 3])
        kt = OrValue(
            [_split(op, k, "k", [0, 2, 3, 1]),
             op.Transpose(_split(op, k, "k", [0, 2, 1, 3]), perm=[0, 1, 3, 2])],
        )
        vh = _split(op, v, "v", [0, 2, 1, 3])
        scores = OrValue(
            [
                op.Div(op.MatMul(qh, kt), Var("scale_div")),
                op.Mul(op.MatMul(qh, kt), Var("scale_mul")),
                op.MatMul(op.Mul(qh, Var("scale_q")), op.Mul(kt, Var("scale_k"))),
                op.MatMul(qh, kt),
            ],
            tag_var="scale_form",
            tag_values=["div", "mul", "mul-qk", "none"],
        )
        masked = OrValue([op.Add(scores, Var("mask")), scores], tag_var="mask_form", tag_values=["bias", "none"])
        probs = op.Softmax(masked, _outputs=["probs"])
        ctx = op.Transpose(op.MatMul(probs, vh), perm=[0, 2, 1, 3])
        return op.Reshape(ctx, out_shape, _outputs=["y"])

    def _scale(self, kw: dict[str, Any]) -> float | str:
        form = kw["scale_form"]
        if form == "none":
            return 1.0
        if form == "mul-qk":
            a, b = scalar_value(kw.get("scale_q")), scalar_value(kw.get("scale_k"))
            if a is None or b is None:
                return "scale is not a constant (Q or K is multiplied by a non-constant)"
            return a * b
        c = scalar_value(kw.get(f"scale_{form}"))
        if c is None:
            return "scale is not a constant"
        if form == "div":
            return "scale divisor is 0" if c == 0 else 1.0 / c
        return c

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              q: ir.Value, k: ir.Value, v: ir.Value, y: ir.Value, probs: ir.Value, **kw: Any) -> MatchResult:
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not is_float(t):
                return self.fail(f"{name} '{t.name}' is not a floating-point tensor", t)
            if t.shape is None or len(t.shape) != 3 or not isinstance(t.shape[2], int):
                return self.fail(f"{name} '{t.name}' is not [batch, seq, hidden] with a static hidden size", t)
        if not (q.dtype == k.dtype == v.dtype):
            return self.fail("query, key and value have different dtypes", q)
        opset = getattr(self, "model_opset", 17)
        if opset < 13:
            return self.fail(f"the function body of mograph.Attention needs opset >= 13 (model has {opset})", q)
        if opset < 15 and q.dtype != ir.DataType.FLOAT:
            return self.fail(f"a {q.dtype} attention needs opset >= 15 for its function body", q)
        split = {}
        for name, t in (("q", q), ("k", k), ("v", v)):
            reshape = kw[f"{name}_4d"].producer()
            assert t.shape is not None
            hd = _heads_and_dim(reshape, t.shape[2])  # type: ignore[arg-type]  # static: checked above
            if isinstance(hd, str):
                return self.fail(hd, reshape)
            split[name] = hd
        heads, head_dim = split["q"]
        if split["k"] != split["q"]:
            return self.fail(f"key is split as {split['k']}, query as {split['q']} (heads, head_dim)", k)
        if split["v"][0] != heads:
            return self.fail(f"value has {split['v'][0]} heads, query {heads}", v)
        softmax = probs.producer()
        assert softmax is not None
        axis = softmax.attributes.get("axis")
        if axis is None and opset < 13:
            return self.fail("Softmax uses the opset < 13 default axis", softmax)
        if axis is not None and int(axis.value) not in (-1, 3):
            return self.fail(f"Softmax is over axis {int(axis.value)}, not the key axis", softmax)
        out_reshape = y.producer()
        assert out_reshape is not None
        entries = _entries(out_reshape.inputs[1])
        width = heads * split["v"][1]
        last = entries[-1] if entries else None
        if y.shape is not None and len(y.shape) == 3 and isinstance(y.shape[2], int):
            last = y.shape[2] if last not in (-1, width) else last
        if entries is not None and len(entries) != 3:
            return self.fail("the output reshape is not to [batch, seq, hidden]", out_reshape)
        if last not in (-1, width) or not _keeps_leading(out_reshape):
            return self.fail("the output reshape is not to [batch, seq, heads * head_dim]", out_reshape)
        scale = self._scale(kw)
        if isinstance(scale, str):
            return self.fail(scale, softmax)
        mask = kw.get("mask")
        if mask is not None:
            if mask.dtype != q.dtype:
                return self.fail(f"attention bias '{mask.name}' has dtype {mask.dtype}, the scores {q.dtype}", mask)
            if mask.shape is None or len(mask.shape) > 4:
                return self.fail(f"attention bias '{mask.name}' is not of rank <= 4 (shape {mask.shape})", mask)
            dim1 = mask.shape[1] if len(mask.shape) == 4 else 1
            if isinstance(dim1, int) and dim1 not in (1, heads):
                return self.fail(f"attention bias '{mask.name}' has {dim1} heads, the attention {heads}", mask)
        self._found = {"num_heads": heads, "scale": float(scale), "head_dim": head_dim}
        return self.ok()

    def rewrite(self, op: Any, q: ir.Value, k: ir.Value, v: ir.Value, mask: ir.Value | None = None,
                **_: Any) -> Any:
        if mask is None:
            dtype = q.dtype.numpy() if q.dtype is not None else np.float32
            mask = op.initializer(ir.tensor(np.zeros((), dtype=dtype)), name="mograph_zero_bias")
        return mograph_op(op, ATTENTION_OP, q, k, v, mask, num_heads=self._found["num_heads"],
                          scale=self._found["scale"])

    def variant(self, bindings: dict[str, Any]) -> str | None:
        return f"{bindings.get('scale_form')}.{'mask' if bindings.get('mask') is not None else 'nomask'}"


# ---------------------------------------------------------------------------------------------
# lowering
# ---------------------------------------------------------------------------------------------


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _is_zero(value: ir.Value | None) -> bool:
    if value is None:
        return True
    arr = constant_array(value)
    return arr is not None and not np.any(arr)


def _initializer(graph: ir.Graph, base: str, arr: np.ndarray) -> ir.Value:
    name, i = base, 0
    while name in graph.initializers:
        i += 1
        name = f"{base}_{i}"
    value = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                     const_value=ir.tensor(arr, name=name))
    graph.register_initializer(value)
    return value


def _projection(value: ir.Value, user: ir.Node) -> tuple[ir.Value, np.ndarray, np.ndarray] | None:
    """``(x, W, b)`` if ``value`` is ``x @ W + b`` with constant 2-D W and 1-D b, read only by ``user``."""
    add = value.producer()
    if add is None or add.op_type != "Add" or add.domain != "" or value.is_graph_output():
        return None
    if any(c is not user for c, _ in value.uses()):
        return None
    for mm_in, b_in in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mm = mm_in.producer() if mm_in is not None else None
        if mm is None or mm.op_type != "MatMul" or mm.domain != "" or mm_in is None:
            continue
        if mm_in.is_graph_output() or len(mm_in.uses()) != 1:
            continue
        w, b = constant_array(mm.inputs[1]), constant_array(b_in)
        x = mm.inputs[0]
        if w is None or b is None or x is None or w.ndim != 2 or b.ndim != 1 or b.shape[0] != w.shape[1]:
            continue
        return x, w, b
    return None


def _packed(node: ir.Node) -> tuple[ir.Value, np.ndarray, np.ndarray] | None:
    """One ``x`` and the packed ``[W_q | W_k | W_v]``, ``[b_q | b_k | b_v]`` if Q, K, V are its projections."""
    parts = [_projection(v, node) if v is not None else None for v in node.inputs[:3]]
    if any(p is None for p in parts):
        return None
    xs = {id(p[0]) for p in parts if p is not None}
    widths = {p[1].shape[1] for p in parts if p is not None}
    if len(xs) != 1 or len(widths) != 1 or len({id(v) for v in node.inputs[:3]}) != 3:
        return None
    x = parts[0][0]  # type: ignore[index]
    if x.shape is None or len(x.shape) != 3 or x.dtype is None:
        return None
    dtype = x.dtype.numpy()
    w = np.concatenate([p[1] for p in parts], axis=1).astype(dtype)  # type: ignore[index]
    b = np.concatenate([p[2] for p in parts]).astype(dtype)  # type: ignore[index]
    return x, w, b


#: Lowerings of one pass run share what they build for the same input: key -> value.
Shared = dict[tuple[Any, ...], ir.Value]


def _dim_key(dim: Any, owner: ir.Value) -> tuple[Any, ...]:
    """A key equal for two dims known to be equal: the int, the symbolic name, else the owning value."""
    if isinstance(dim, int):
        return ("int", dim)
    name = getattr(dim, "value", None)
    return ("sym", name) if name is not None else ("value", id(owner))


def _bias_for_kernel(bias: ir.Value, seq_of: ir.Value, new_nodes: list[ir.Node],
                     shared: Shared | None = None) -> ir.Value:
    """The additive bias as ONNX Runtime's kernels take it: rank 4 with dim 2 = the query length.

    The kernels broadcast dims 0 and 1 of ``attention_bias`` but not dim 2, so a key-padding bias
    ``[B, 1, 1, T]`` is expanded to ``[B, 1, S, T]`` (exactly the same values).  With ``shared``, an
    expansion of the same bias to a query length known to be equal (same static or symbolic dim)
    is built once and reused by every layer.
    """
    shape = bias.shape
    if shape is not None and len(shape) == 4 and seq_of.shape is not None and _same_dim(shape[2], seq_of.shape[1]):
        return bias
    seq_dim = seq_of.shape[1] if seq_of.shape is not None and len(seq_of.shape) >= 2 else None
    key = ("bias_expansions", id(bias), *_dim_key(seq_dim, seq_of))
    if shared is not None and key in shared:
        return shared[key]

    def add(op_type: str, inputs: list[ir.Value], **attrs: Any) -> ir.Value:
        n = ir.node(op_type, inputs, attributes=attrs)
        new_nodes.append(n)
        return n.outputs[0]

    ones = add("Constant", [], value=ir.tensor(np.array([1, 1], dtype=np.int64)))
    one = add("Constant", [], value=ir.tensor(np.array([1], dtype=np.int64)))
    seq = add("Gather", [add("Shape", [seq_of]), one], axis=0)
    target = add("Concat", [ones, seq, one], axis=0)
    out = add("Expand", [bias, target])
    if shared is not None:
        shared[key] = out
    return out


# ---------------------------------------------------------------------------------------------
# key-padding masks: the additive bias traced back to a 2-D attention_mask input
# ---------------------------------------------------------------------------------------------

_INT_TYPES = {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8,
              ir.DataType.BOOL}


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _unsqueeze_axes(node: ir.Node) -> list[int] | None:
    if "axes" in node.attributes:
        return [int(a) for a in node.attributes["axes"].value]
    arr = constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
    return None if arr is None else [int(a) for a in arr.reshape(-1)]


def _mask_input(value: ir.Value | None, layout: tuple[str, ...]) -> ir.Value | None:
    """The 2-D ``[B, T]`` integer/bool graph input ``value`` is, through Cast and Unsqueeze, laid out as ``layout``.

    ``layout`` names the dims of ``value``: ``"b"``, ``"t"`` (the input's two dims) and ``"1"`` (an
    inserted unit dim).  Casts are allowed as the values they carry are 0/1 masks (every cast keeps 0
    and 1 apart).
    """
    dims: list[str] = list(layout)
    while value is not None and not value.is_graph_input():
        node = value.producer()
        if node is None or node.domain != "" or node.op_type not in ("Cast", "Unsqueeze"):
            return None
        if node.op_type == "Unsqueeze":
            axes = _unsqueeze_axes(node)
            if axes is None:
                return None
            axes = sorted(a + len(dims) if a < 0 else a for a in axes)
            if any(a >= len(dims) or dims[a] != "1" for a in axes):
                return None
            for a in reversed(axes):
                del dims[a]
        value = node.inputs[0]
    if value is None or dims != ["b", "t"] or value.dtype not in _INT_TYPES:
        return None
    if value.shape is not None and len(value.shape) != 2:
        return None
    return value


def _is_range_from_zero(value: ir.Value | None) -> ir.Node | None:
    """The ``Range(0, n, 1)`` node ``value`` is (through Unsqueeze only), else None."""
    while (node := _producer(value, "Unsqueeze")) is not None:
        value = node.inputs[0]
    rng = _producer(value, "Range")
    if rng is None or scalar_value(rng.inputs[0]) != 0 or scalar_value(rng.inputs[2]) != 1:
        return None
    return rng


def _all_true(value: ir.Value | None) -> bool:
    """Whether ``value`` is provably all true: a constant, ``And`` of such, ``Range(0, n, 1) >= 0``."""
    arr = constant_array(value)
    if arr is not None:
        return arr.dtype == np.bool_ and bool(arr.all())
    node = value.producer() if value is not None else None
    if node is None or node.domain != "":
        return False
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        return fill is not None and fill.value.dtype == ir.DataType.BOOL and bool(fill.value.numpy().all())
    if node.op_type == "And":
        return _all_true(node.inputs[0]) and _all_true(node.inputs[1])
    if node.op_type == "Cast" and int(_attr(node, "to", 0)) == ir.DataType.BOOL.value:
        return _all_true(node.inputs[0])  # true stays true
    if node.op_type == "GreaterOrEqual":
        bound = scalar_value(node.inputs[1])
        return bound is not None and bound <= 0 and _is_range_from_zero(node.inputs[0]) is not None
    return False


def _dim_of(value: ir.Value | None, axis: int) -> ir.Value | None:
    """The tensor whose dim ``axis`` the scalar ``value`` is (``Gather(Shape(x), axis)``), through Cast."""
    while (cast := _producer(value, "Cast")) is not None:
        value = cast.inputs[0]
    gather = _producer(value, "Gather")
    if gather is None or scalar_value(gather.inputs[1]) != axis or int(_attr(gather, "axis", 0)) != 0:
        return None
    shape = _producer(gather.inputs[0], "Shape")
    if shape is None or "start" in shape.attributes or "end" in shape.attributes:
        return None
    x = shape.inputs[0]
    while (cast := _producer(x, "Cast")) is not None:
        x = cast.inputs[0]
    return x


def _gathered_padding(value: ir.Value | None) -> ir.Value | None:
    """The mask input of ``transformers``' index-based padding lookup, ``mask[b, t]`` laid out ``[B, 1, 1, T]``.

    ``Reshape(Reshape(Gather(Flatten(Cast(mask, bool), axis=2), b * T + t), [-1]), Shape(b * T + t))``
    where ``b`` is ``Range(0, B, 1)`` on axis 0 and ``t`` is ``Range(0, T, 1)`` on axis 3 of a
    rank-4 index, ``T`` the mask's dim 1 (``Flatten`` makes ``[B*T, 1]``).
    """
    outer = _producer(value, "Reshape")
    inner = _producer(outer.inputs[0], "Reshape") if outer is not None else None
    gather = _producer(inner.inputs[0], "Gather") if inner is not None else None
    if outer is None or inner is None or gather is None or int(_attr(gather, "axis", 0)) != 0:
        return None
    flat = constant_array(inner.inputs[1])
    target = outer.inputs[1]
    if (concat := _producer(target, "Concat")) is not None and len(concat.inputs) == 1:
        target = concat.inputs[0]  # a Concat of one input is that input
    shape_of = _producer(target, "Shape")
    if flat is None or flat.reshape(-1).tolist() != [-1] or shape_of is None or shape_of.inputs[0] is not gather.inputs[1]:
        return None
    flatten = _producer(gather.inputs[0], "Flatten")
    if flatten is None or int(_attr(flatten, "axis", 1)) != 2:
        return None
    cast = _producer(flatten.inputs[0], "Cast")
    if cast is None or int(_attr(cast, "to", 0)) != ir.DataType.BOOL.value:
        return None
    mask = _mask_input(cast.inputs[0], ("b", "t"))
    add = _producer(gather.inputs[1], "Add")
    if mask is None or add is None:
        return None
    for t_idx, bt in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mul = _producer(bt, "Mul")
        if mul is None:
            continue
        for b_idx, t_len in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            t_rng, b_rng = _is_range_from_zero(t_idx), _is_range_from_zero(b_idx)
            if t_rng is None or b_rng is None or _range_axis(t_idx) != 3 or _range_axis(b_idx) != 0:
                continue
            if _dim_of(t_len, 1) is mask and _dim_of(t_rng.inputs[1], 1) is mask:
                return mask
    return None


def _range_axis(value: ir.Value | None) -> int | None:
    """The axis the 1-D ``Range`` under ``value`` lands on after the Unsqueezes between them (rank 4)."""
    unsqueezes = []
    while (node := _producer(value, "Unsqueeze")) is not None:
        unsqueezes.append(node)
        value = node.inputs[0]
    dims = ["r"]
    for node in reversed(unsqueezes):  # innermost first
        axes = _unsqueeze_axes(node)
        if axes is None:
            return None
        rank = len(dims) + len(axes)
        for ax in sorted(x + rank if x < 0 else x for x in axes):
            dims.insert(ax, "1")
    return dims.index("r") if len(dims) == 4 else None


def _keep(value: ir.Value | None) -> ir.Value | None:
    """The mask input if ``value`` (bool, broadcastable to ``[B, 1, S, T]``) is ``mask[b, t] != 0`` for every s."""
    node = value.producer() if value is not None else None
    if node is None or node.domain != "":
        return None
    if node.op_type == "Expand":  # broadcasting copies values; the kernel broadcasts over S and heads itself
        return _keep(node.inputs[0])
    if node.op_type == "And":
        a, b = node.inputs[0], node.inputs[1]
        if _all_true(a):
            return _keep(b)
        if _all_true(b):
            return _keep(a)
        return None
    if node.op_type == "Cast" and int(_attr(node, "to", 0)) == ir.DataType.BOOL.value:
        # a cast of a keep mask to bool keeps it; a cast of the mask to bool is mask != 0
        return _keep(node.inputs[0]) or _mask_input(node.inputs[0], ("b", "1", "1", "t"))
    if node.op_type == "Unsqueeze" and value is not None and value.dtype == ir.DataType.BOOL:
        return _mask_input(value, ("b", "1", "1", "t"))  # a bool mask input
    return _gathered_padding(value)


def _padding_mask(bias: ir.Value) -> tuple[ir.Value, float] | None:
    """``(mask, c)`` if ``bias[b, :, s, t]`` is 0 where the 2-D input ``mask[b, t]`` is 1 and ``c`` where it is 0.

    The forms traced: ``(1 - float(mask[:, None, None, :])) * c`` (``transformers`` before 4.48) and
    ``Where(keep, 0, c)`` with ``keep`` a bool cast of ``mask[:, None, None, :]`` or ``transformers``'
    index-based padding lookup, possibly And-ed with provably all-true terms and expanded.  ``c`` must
    be a negative scalar.  Exact for 0/1 masks, the contract of ``attention_mask``.
    """
    node = bias.producer()
    if node is None or node.domain != "" or not is_float(bias):
        return None
    mask: ir.Value | None = None
    c: float | None = None
    if node.op_type == "Mul":
        for x, k in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            sub = _producer(x, "Sub")
            c = scalar_value(k)
            if sub is None or c is None or scalar_value(sub.inputs[0]) != 1.0:
                continue
            if sub.inputs[1] is not None and sub.inputs[1].dtype == bias.dtype:
                mask = _mask_input(sub.inputs[1], ("b", "1", "1", "t"))
            if mask is not None:
                break
    elif node.op_type == "Where" and scalar_value(node.inputs[1]) == 0.0:
        c = scalar_value(node.inputs[2])
        mask = _keep(node.inputs[0])
    if mask is None or c is None or not c < 0 or not math.isfinite(c):
        return None
    return mask, c


def _mask_index(mask: ir.Value, new_nodes: list[ir.Node], shared: Shared | None) -> ir.Value:
    """``mask`` as the int32 ``mask_index`` ONNX Runtime's Attention takes (built once per mask)."""
    if mask.dtype == ir.DataType.INT32:
        return mask
    key = ("mask_index_casts", id(mask))
    if shared is not None and key in shared:
        return shared[key]
    cast = ir.node("Cast", [mask], attributes={"to": ir.DataType.INT32.value})
    new_nodes.append(cast)
    if shared is not None:
        shared[key] = cast.outputs[0]
    return cast.outputs[0]


def _replace(node: ir.Node, new_nodes: list[ir.Node], model: ir.Model) -> None:
    graph = node.graph
    assert graph is not None
    for n in new_nodes:
        if n.domain and n.domain not in model.opset_imports:
            model.opset_imports[n.domain] = 1
        n.metadata_props.update(node.metadata_props)
    base = node.name or node.op_type
    for i, n in enumerate(new_nodes):
        n.name = base if i == len(new_nodes) - 1 else f"{base}/{i}"
    inputs = list(node.inputs)
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, [node.outputs[0]],
                                            [new_nodes[-1].outputs[0]])
    remove_dead_producers(graph, inputs)


def _lower_ort(node: ir.Node, model: ir.Model, shared: Shared | None = None) -> bool:
    """``com.microsoft.Attention`` (packed projections) or ``MultiHeadAttention``."""
    q, k, v, bias = node.inputs
    graph = node.graph
    assert graph is not None and q is not None and k is not None and v is not None
    attrs: dict[str, Any] = {"num_heads": int(_attr(node, "num_heads", 1)), "scale": float(_attr(node, "scale", 1.0))}
    new_nodes: list[ir.Node] = []
    packed = _packed(node)
    padding = None if packed is None or _is_zero(bias) else _padding_mask(bias)  # type: ignore[arg-type]
    ab = None
    if not _is_zero(bias) and padding is None:
        seq_of = packed[0] if packed is not None else q
        ab = _bias_for_kernel(bias, seq_of, new_nodes, shared)  # type: ignore[arg-type]
    if packed is not None:
        x, w, b = packed
        wv = _initializer(graph, "mograph_qkv_weight", w)
        bv = _initializer(graph, "mograph_qkv_bias", b)
        mask_index = None
        if padding is not None:  # the raw [B, T] mask; the kernel fills masked scores with mask_filter_value
            mask_index = _mask_index(padding[0], new_nodes, shared)
            attrs["mask_filter_value"] = padding[1]
        inputs: list[ir.Value | None] = [x, wv, bv, mask_index, None, ab]
        op_type = "Attention"
    else:
        inputs = [q, k, v, None, None, ab]
        op_type = "MultiHeadAttention"
    while inputs[-1] is None:
        inputs.pop()
    new_nodes.append(ir.node(op_type, inputs, attributes=attrs, domain=MS_DOMAIN))
    _replace(node, new_nodes, model)
    return True


def _lower_onnx(node: ir.Node, model: ir.Model, shared: Shared | None = None) -> bool:
    """The standard ``Attention`` (opset >= 23), 3-D inputs, additive ``attn_mask``."""
    opset = int(model.opset_imports.get("", 1))
    if opset < ONNX_ATTENTION_OPSET:
        return False
    q, k, v, bias = node.inputs
    assert q is not None
    heads = int(_attr(node, "num_heads", 1))
    new_nodes: list[ir.Node] = []
    inputs: list[ir.Value | None] = [q, k, v]
    if not _is_zero(bias):
        inputs.append(_bias_for_kernel(bias, q, new_nodes, shared))  # type: ignore[arg-type]
    new_nodes.append(ir.node("Attention", inputs, attributes={"q_num_heads": heads, "kv_num_heads": heads,
                                                              "scale": float(_attr(node, "scale", 1.0))}))
    _replace(node, new_nodes, model)
    return True


_LOWERINGS = {"ort": _lower_ort, "onnx": _lower_onnx}


# ---------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------


def _attention_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in ir.traversal.RecursiveGraphIterator(model.graph)
            if n.domain == DOMAIN and n.op_type == ATTENTION_OP and "plugin_namespace" not in n.attributes]


class FuseAttentionPass(FusionPass):
    """Fuse multi-head self-attention (Q/K/V split, scaled scores, mask bias, softmax, merge) into one op."""

    name = "fuse-attention"
    rules: ClassVar[tuple[type[Rule], ...]] = (AttentionFusion,)

    def call(self, model: ir.Model) -> PassResult:
        target = self.config["target"]
        opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))
        if target == "onnx" and opset < ONNX_ATTENTION_OPSET:
            reason = (f"target onnx below opset {ONNX_ATTENTION_OPSET}: ONNX has no attention op, "
                      "the unfused graph is already the onnx form")
            return PassResult(modified=False, details={"skipped": reason, "target": target})
        if target == "tensorrt":
            reason = "target tensorrt: no TensorRT form for attention yet (TensorRT fuses the subgraph itself)"
            return PassResult(modified=False, details={"skipped": reason, "target": target})
        before = set(_attention_nodes(model))
        result = super().call(model)
        if not result.modified:
            return result
        stats = dict(result.stats)
        lower = _LOWERINGS.get(target)
        shared: Shared = {}
        for node in _attention_nodes(model):  # graph order: what is shared is built before its first user
            if node in before or lower is None:
                continue
            if lower(node, model, shared):
                stats[f"lowered.{ATTENTION_OP}"] = int(stats.get(f"lowered.{ATTENTION_OP}", 0)) + 1
            else:
                logger.debug("%s: mograph.Attention stays for target %s", node.name, target)
        for (kind, *_rest) in shared:
            stats[kind] = int(stats.get(kind, 0)) + 1
        key = (DOMAIN, ATTENTION_OP, "")
        if _attention_nodes(model):
            if DOMAIN not in model.opset_imports:
                model.opset_imports[DOMAIN] = DOMAIN_VERSION
            if key not in model.functions:
                model.functions[key] = _attention_fn(opset)
        else:
            model.functions.pop(key, None)
            if DOMAIN in model.opset_imports and not any(
                    n.domain == DOMAIN for n in ir.traversal.RecursiveGraphIterator(model.graph)):
                del model.opset_imports[DOMAIN]
        return PassResult(modified=True, stats=stats, details=result.details)
