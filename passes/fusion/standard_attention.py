"""The standard ``Attention`` of opset 23, as an exporter writes it -> ``mograph.Attention`` (``--target ort``).

``torch.onnx.export(dynamo=True, opset_version=23)`` writes attention as the standard op itself, between the
head split and merge the rule of :mod:`.attention` matches::

    Qh = Transpose(Reshape(q, [B, S, H, D]), [0, 2, 1, 3])        (Kh, Vh alike, maybe repeated or rotated)
    A  = Attention(Qh, Kh, Vh[, attn_mask])                        [B, H, S, Dv]
    Y  = Reshape(Transpose(A, [0, 2, 1, 3]), [B, S, H*Dv])         (or [B*S, H*Dv])

The standard op is already one fused computation, and ONNX Runtime runs it on CPU (a kernel of its own,
checked with 1.31.1 and 1.32.0), but not as fast as its ``com.microsoft`` kernels, which take the
projections packed, a key-padding mask as lengths, the rotary inside (``GroupQueryAttention``).  So for
``--target ort`` this rule gives it the canonical form, ``mograph.Attention`` over the ``[B, S, H*D]``
projections, and the one ``lower`` step picks the kernel as for every other attention.  For the other
targets it stays as written (``--target onnx`` keeps standard ops; the rule is not even run).

The semantics kept exactly (ONNX's Attention-23): a boolean ``attn_mask`` (True: attend) is the additive
bias ``Where(mask, 0, -inf)``; a float mask is added as it is; ``scale`` defaults to ``1/sqrt(D)``; a query
whose every key is masked gives 0 (``nan_to_zero``).  Not converted (a near miss that says which): the
causal flag, ``softcap``, a KV cache through the op's own ``past_key``/``past_value``, and a read of its
other outputs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._common import rule_shapes
from mograph.passes.fusion.attention import (
    AttentionFusion,
    _entries,
    _keeps_leading,
    _repeated,
    _split_heads,
)
from mograph.passes.fusion.attention_op import ONNX_ATTENTION_OPSET

from mograph.patterns import MatchResult

__all__ = ["StandardAttentionFusion"]


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


class StandardAttentionFusion(AttentionFusion):
    """Standard ``Attention`` (opset 23) between a head split and merge -> mograph.Attention(Q, K, V, bias)."""

    min_candidate_nodes = 3

    def pattern(self, op: Any, qh: Any, kh: Any, vh: Any, out_shape: Any) -> Any:  # type: ignore[override]
        att = op.Attention(qh, kh, vh, _allow_other_inputs=True, _outputs=["att"])
        merged = op.Transpose(att, perm=[0, 2, 1, 3], _outputs=["merged_a"])
        return op.Reshape(merged, out_shape, _outputs=["y"])

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              qh: ir.Value, kh: ir.Value, vh: ir.Value, y: ir.Value, att: ir.Value, **kw: Any) -> MatchResult:
        opset = getattr(self, "model_opset", 17)
        node = att.producer()
        assert node is not None
        if opset < ONNX_ATTENTION_OPSET:
            return self.fail(f"'{node.name}' is not the standard Attention (the model's opset is {opset})", node)
        if len(node.inputs) > 4 and any(v is not None for v in node.inputs[4:]):
            return self.fail(f"Attention '{node.name}' takes a KV cache (past_key/past_value) of its own", node)
        if int(_attr(node, "is_causal", 0)):
            return self.fail(f"Attention '{node.name}' is causal (is_causal=1): not converted", node)
        if float(_attr(node, "softcap", 0.0)) != 0.0:
            return self.fail(f"Attention '{node.name}' caps its scores (softcap)", node)
        shapes = rule_shapes(self, qh)
        q = _split_heads(qh, "query", shapes)
        if isinstance(q, str):
            return self.fail(q, qh)
        k = _repeated(kh, "key", shapes)
        if isinstance(k, str):
            return self.fail(k, kh)
        v = _repeated(vh, "value", shapes)
        if isinstance(v, str):
            return self.fail(v, vh)
        if not (q.x.dtype == k.x.dtype == v.x.dtype):
            return self.fail("query, key and value have different dtypes", q.x)
        if k.dim != q.dim:
            return self.fail(f"key head_dim {k.dim} differs from the query's {q.dim}", k.x)
        if k.cached is not None or v.cached is not None:
            return self.fail("key or value comes from a cache Concat before the standard Attention", k.x)
        if k.heads != v.heads or k.repeat != v.repeat:
            return self.fail(f"key has {k.heads} heads x{k.repeat}, value {v.heads} x{v.repeat}", v.x)
        if q.heads % (k.heads * k.repeat):
            return self.fail(f"query has {q.heads} heads, key {k.heads} (repeated {k.repeat} times)", k.x)
        if v.factor != 1.0 or v.rotary is not None or v.half_rotary is not None:
            return self.fail("value is scaled or rotated before the attention", v.x)
        if k.repeat != 1 and k.heads * k.repeat != q.heads:
            return self.fail(f"key heads repeated to {k.heads * k.repeat}, the query has {q.heads}", k.x)
        width = q.heads * v.dim
        out_reshape = y.producer()
        assert out_reshape is not None
        entries = _entries(out_reshape.inputs[1], shapes)
        flat = entries is not None and len(entries) == 2 and entries[0] == -1 and entries[1] == width
        if not flat:
            if entries is not None and len(entries) != 3:
                return self.fail("the output reshape is not to [batch, seq, hidden] or [batch * seq, hidden]",
                                 out_reshape)
            last = entries[-1] if entries else None
            if y.shape is not None and len(y.shape) == 3 and isinstance(y.shape[2], int) and last not in (-1, width):
                last = y.shape[2]
            if last not in (-1, width) or not _keeps_leading(out_reshape, shapes):
                return self.fail("the output reshape is not to [batch, seq, heads * head_dim]", out_reshape)
        scale = _attr(node, "scale", None)
        scale = 1.0 / math.sqrt(q.dim) if scale is None else float(scale)
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        if mask is not None:
            if mask.dtype not in (ir.DataType.BOOL, q.x.dtype):
                return self.fail(f"attn_mask '{mask.name}' has dtype {mask.dtype}, the query {q.x.dtype}", mask)
            if mask.shape is None or len(mask.shape) > 4:
                return self.fail(f"attn_mask '{mask.name}' is not of rank <= 4 (shape {mask.shape})", mask)
            dim1 = mask.shape[1] if len(mask.shape) == 4 else 1
            if isinstance(dim1, int) and dim1 not in (1, q.heads):
                return self.fail(f"attn_mask '{mask.name}' has {dim1} heads, the attention {q.heads}", mask)
            t = mask.shape[-1] if len(mask.shape) else None
            kt = kh.shape[2] if kh.shape is not None and len(kh.shape) == 4 else None
            if not (isinstance(t, int) and t == 1) and not (t is not None and kt is not None and t == kt) and \
                    not _same_keys(mask, kh):
                # Attention-23 pads a shorter mask's key axis; the fused op only broadcasts it
                return self.fail(f"cannot prove attn_mask '{mask.name}' spans every key", mask)
        self._found = {"q": q, "k": k, "v": v, "scale": scale * q.factor * k.factor, "mask": mask, "flat": flat,
                       "width": width, "nan": 1, "layouts": {id(att): "BHSV", id(kw["merged_a"]): "BSHV"}}
        return self.ok()

    def rewrite(self, op: Any, **kw: Any) -> Any:
        f = self._found
        mask = f["mask"]
        if mask is not None and mask.dtype == ir.DataType.BOOL:  # Attention-23: True attends, False is -inf
            dtype = f["q"].x.dtype.numpy()
            zero = op.initializer(ir.tensor(np.zeros((), dtype=dtype)), name="mograph_zero")
            ninf = op.initializer(ir.tensor(np.array(-np.inf, dtype=dtype)), name="mograph_neg_inf")
            f["mask"] = op.Where(mask, zero, ninf)
        y = super().rewrite(op, **kw)  # grouped K/V: kv_num_heads is the key's head count
        f["mask"] = mask
        return y

    def variant(self, bindings: dict[str, Any]) -> str | None:
        f = self._found
        parts = ["standard", "mask" if f["mask"] is not None else "nomask"]
        if f["k"].heads != f["q"].heads:
            parts.append("gqa")
        if any(h.rotary is not None or h.half_rotary is not None for h in (f["q"], f["k"])):
            parts.append("rotary")
        return ".".join(parts)


def _same_keys(mask: ir.Value, kh: ir.Value) -> bool:
    """Whether the mask's last dim and the keys' dim 2 are the same symbolic dim."""
    a = mask.shape[-1] if mask.shape is not None and len(mask.shape) else None
    b = kh.shape[2] if kh.shape is not None and len(kh.shape) == 4 else None
    return a is not None and b is not None and not isinstance(a, int) and str(a) == str(b)
