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
    ``M`` goes to ``attention_bias``, expanded to ``[B|1, H|1, S, T]`` where the kernel needs it.
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


def _bias_for_kernel(bias: ir.Value, seq_of: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
    """The additive bias as ONNX Runtime's kernels take it: rank 4 with dim 2 = the query length.

    The kernels broadcast dims 0 and 1 of ``attention_bias`` but not dim 2, so a key-padding bias
    ``[B, 1, 1, T]`` is expanded to ``[B, 1, S, T]`` (exactly the same values).
    """
    shape = bias.shape
    if shape is not None and len(shape) == 4 and seq_of.shape is not None and _same_dim(shape[2], seq_of.shape[1]):
        return bias

    def add(op_type: str, inputs: list[ir.Value], **attrs: Any) -> ir.Value:
        n = ir.node(op_type, inputs, attributes=attrs)
        new_nodes.append(n)
        return n.outputs[0]

    ones = add("Constant", [], value=ir.tensor(np.array([1, 1], dtype=np.int64)))
    one = add("Constant", [], value=ir.tensor(np.array([1], dtype=np.int64)))
    seq = add("Gather", [add("Shape", [seq_of]), one], axis=0)
    target = add("Concat", [ones, seq, one], axis=0)
    return add("Expand", [bias, target])


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


def _lower_ort(node: ir.Node, model: ir.Model) -> bool:
    """``com.microsoft.Attention`` (packed projections) or ``MultiHeadAttention``."""
    q, k, v, bias = node.inputs
    graph = node.graph
    assert graph is not None and q is not None and k is not None and v is not None
    attrs = {"num_heads": int(_attr(node, "num_heads", 1)), "scale": float(_attr(node, "scale", 1.0))}
    new_nodes: list[ir.Node] = []
    packed = _packed(node)
    seq_of = packed[0] if packed is not None else q
    ab = None if _is_zero(bias) else _bias_for_kernel(bias, seq_of, new_nodes)  # type: ignore[arg-type]
    if packed is not None:
        x, w, b = packed
        wv = _initializer(graph, "mograph_qkv_weight", w)
        bv = _initializer(graph, "mograph_qkv_bias", b)
        inputs: list[ir.Value | None] = [x, wv, bv, None, None, ab]
        op_type = "Attention"
    else:
        inputs = [q, k, v, None, None, ab]
        op_type = "MultiHeadAttention"
    while inputs[-1] is None:
        inputs.pop()
    new_nodes.append(ir.node(op_type, inputs, attributes=attrs, domain=MS_DOMAIN))
    _replace(node, new_nodes, model)
    return True


def _lower_onnx(node: ir.Node, model: ir.Model) -> bool:
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
        inputs.append(_bias_for_kernel(bias, q, new_nodes))  # type: ignore[arg-type]
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
        for node in _attention_nodes(model):
            if node in before or lower is None:
                continue
            if lower(node, model):
                stats[f"lowered.{ATTENTION_OP}"] = int(stats.get(f"lowered.{ATTENTION_OP}", 0)) + 1
            else:
                logger.debug("%s: mograph.Attention stays for target %s", node.name, target)
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
