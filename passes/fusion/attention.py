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

The fused op (:mod:`.attention_op`) is lowered by the ``lower`` step
(:mod:`mograph.passes.fusion.lowerings.attention`): ``com.microsoft.Attention`` /
``MultiHeadAttention`` for ``ort``, the standard ``Attention`` at opset >= 23 for ``onnx`` (below it
the function body is inlined), the decomposed computation for ``tensorrt``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._common import FusionPass, is_float, mograph_op
from mograph.passes.fusion.attention_op import ATTENTION_OP, attention

from mograph.irutil import same_dim
from mograph.patterns import MatchResult, OrValue, Rule, Var, constant_array, scalar_value

__all__ = ["AttentionFusion", "FuseAttentionPass", "attention", "ATTENTION_OP"]


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


def _keeps_leading(reshape: ir.Node) -> bool:
    """Whether a Reshape keeps dims 0 and 1 of its input (its target starts with ``B, S``)."""
    x, target = reshape.inputs[0], reshape.inputs[1]
    out = reshape.outputs[0]
    if x is None or x.shape is None or len(x.shape) < 2:
        return False
    if out.shape is not None and len(out.shape) >= 2 and all(same_dim(out.shape[i], x.shape[i]) for i in (0, 1)):
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


class FuseAttentionPass(FusionPass):
    """Fuse multi-head self-attention (Q/K/V split, scaled scores, mask bias, softmax, merge) into one op."""

    name = "fuse-attention"
    rules: ClassVar[tuple[type[Rule], ...]] = (AttentionFusion,)
