"""``fuse-attention``: multi-head scaled dot-product attention -> ``mograph.Attention``.

The math matched, anchored on the softmax (``Qh``, ``Kt``, ``Vh`` are head tensors, ``M`` an additive
bias broadcastable to ``[B, H, S, T]``)::

    P = Softmax(Qh Kt * scale + M, axis=-1)      [optionally Where(IsNaN(P), 0, P): sdpa exports]
    Y = Reshape(Transpose(P Vh, [0, 2, 1, 3]), [B, S, H*Dv])   (or [B*S, H*Dv]; a no-op Reshape may
                                                                 sit before the Transpose)

and each head tensor is traced back to its ``[B, S, N*D]`` projection (exporter variants are
alternatives of the trace, not copies of the rule)::

    Qh = Transpose(Reshape(q, [B, S, H, D]), [0, 2, 1, 3])
    Kt = Transpose(Reshape(k, [B, T, G, D]), [0, 2, 3, 1])  |  Transpose(Kh, [0, 1, 3, 2])
       | Reshape(Transpose(Reshape(Kh, [-1, T, D]), [0, 2, 1]), [B, G, D, T])     (dynamo, sdpa)
    Kh, Vh = Transpose(Reshape(x, [B, T, G, D]), [0, 2, 1, 3]), possibly repeated for grouped-query
       attention: Reshape(Expand(Unsqueeze(., 2), [B, G, H/G, T, D]), [B, H, T, D])  (repeat_kv)

A norm over each head's ``D`` values right after the split (Gemma 3 and Qwen 3's ``q_norm`` / ``k_norm``:
``mograph.RMSNorm`` or ``LayerNorm``, or the standard ``RMSNormalization`` / ``LayerNormalization`` over the last
axis, scale and bias 1-D) may sit between the split and the rotary: it normalizes each position's head on its own,
so the rewrite applies the same norm to ``Reshape(x, [B, S, N, D])`` and merges it back
(:func:`head_norm`), exactly; a per-head scale (``[N, 1, D]``) or a norm after the rotary is a near miss.

``scale`` is any constant: ``Div``/``Mul`` of the scores, and single-element constant factors on
``q``, ``Qh``, ``Kt`` or ``k`` (exporters that split ``1/sqrt(D)`` into ``D^-1/4`` on each side, Whisper's
pre-scaled query) are folded into it.  ``M`` is optional; it is taken as it is, whatever computed it
(``(1 - mask) * min``, ``Where`` over a boolean mask, a causal mask), so masked positions stay exactly as
masked as in the original; a provably all-zero ``M`` (an all-ones mask: a constant, or ``Where`` of an
all-true condition such as ``Range(0, n) >= 0``, expanded) is dropped.  The reshape targets
may be constants or computed from the runtime shape (``Shape``/``Gather``/``Unsqueeze``/``Concat``;
``Shape`` readers that feed only the pattern go with it); ``H`` and ``D`` must be constants.  What the
trace walks over (the split Reshape/Transposes) is left to die: a value still read elsewhere stays.

With a KV cache, ``Kh``/``Vh`` are ``Concat(past, new heads, axis=2)``.  When the new keys are rotated (a
decode step of LLaMA-style models), the rotary becomes a ``mograph.RotaryEmbedding`` on the new keys'
``[B, S, G*D]`` projection and the Concat is built again after it; a graph output (the present) that was
the exporter's Concat is the new Concat, under the same name, and the exporter's Concat and decomposed
rotary die with the pattern.  A partial rotary, ``Concat(rotary(x[..., :R]), x[..., R:], axis=-1)`` with R even and
below ``D`` (Phi-4-mini's ``partial_rotary_factor``; the rotary's halves R/2 apart), is
``mograph.RotaryEmbedding(rotary_dim=R)``; with R provably at least ``D`` (Phi 3) the rotary of the whole head.

Keras' ``MultiHeadAttention`` is written with ``Einsum`` (projections ``abc,cde->abde``, scores
``aecd,abcd->acbe``, context ``acbe,aecd->abcd``, output ``abcd,cde->abe``), which tf2onnx keeps or decomposes into
3-D ``MatMul`` over ``[B*N, ., .]`` reshapes; the pass's canonicalization (:mod:`.canonicalize._layout`) first
puts that into the form above, each rewrite exact (up to the rounding of a summation order for an ``Einsum`` or
``Gemm`` written as ``MatMul``) and undone where no attention fused.  A factor on the split heads between their
Reshape and Transpose (Keras scales the query after the split) is folded into ``scale`` like the others.

The fused op (:mod:`.attention_op`) is lowered by the ``lower`` step
(:mod:`mograph.passes.fusion.lowerings.attention`): for ``ort``, ``com.microsoft.Attention`` with Q/K/V
packed into one GEMM for self-attention over ``x @ W (+ b)`` projections, else ``MultiHeadAttention``
(option ``--mask-format`` says how a padding mask gets there; a provably causal mask becomes
``unidirectional=1`` or ``GroupQueryAttention``, a KV cache the kernel's past/present), the standard
``Attention`` at opset >= 23 for ``onnx`` (below it the function body is inlined), the decomposed
computation for ``tensorrt``.

At opset 23 exporters write the standard ``Attention`` (and ``RotaryEmbedding`` on the heads) themselves.
With ``--target ort`` (the pass reads ``target``) :class:`~.standard_attention.StandardAttentionFusion`
takes such an ``Attention`` into ``mograph.Attention`` too, and the trace follows a standard
``RotaryEmbedding`` on Q/K heads (``Heads.half_rotary``), so ORT gets the same kernels as below 23; for
the other targets both stay as written (a rotated attention is then a near miss that says so).

This module is the rule and the pass; the trace of the heads is :mod:`._attention_trace` (its graph readers
:mod:`._attention_reads`, the rotary forms it follows :mod:`._attention_rotary`).  ``--explain`` lists every
Softmax left where the rule's pattern below the probabilities matches (the rule's declared anchor), with the
first node where the rule stopped, following the pattern from the Softmax to the merge ``Reshape``
(:mod:`mograph.pattern_explain`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._attention_reads import _entries as _entries
from mograph.passes.fusion._attention_reads import _is_dim as _is_dim
from mograph.passes.fusion._attention_reads import _keeps_leading as _keeps_leading
from mograph.passes.fusion._attention_reads import _producer
from mograph.passes.fusion._attention_reads import _reads_own_axis as _reads_own_axis
from mograph.passes.fusion._attention_rotary import _rotary as _rotary
from mograph.passes.fusion._attention_trace import Heads, _keys_transposed
from mograph.passes.fusion._attention_trace import _repeated as _repeated
from mograph.passes.fusion._attention_trace import _split_heads as _split_heads
from mograph.passes.fusion._common import (
    EXPLAIN_OPTION,
    TARGET_OPTION,
    FusionPass,
    GraphShapes,
    adopts_standard_ops,
    mograph_op,
    rule_shapes,
)
from mograph.passes.fusion.attention_op import (
    ATTENTION_OP,
    KV_CACHE_KEY,
    MASK_FORMAT_KEY,
    MASK_FORMATS,
    POSITION_IDS_KEY,
    ROTARY_OP,
    attention,
)
from mograph.passes.fusion.lowerings.attention_proofs import is_zero_bias

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION
from mograph.errors import PassFailedError
from mograph.pass_infra import Option, PassResult
from mograph.patterns import Anchor, MatchResult, OrValue, Rule, Var, constant_array, scalar_value
from mograph.shapes import mul, same_dim

__all__ = ["AttentionFusion", "FuseAttentionPass", "attention", "ATTENTION_OP"]


# ---------------------------------------------------------------------------------------------
# the rule
# ---------------------------------------------------------------------------------------------


class AttentionFusion(Rule):
    """The attention block of a transformer layer -> mograph.Attention(Q, K, V, bias)."""

    min_candidate_nodes = 5
    remove_shape_readers = True
    #: ``--explain``: a Softmax whose scores the pattern matches is an attention; the pattern is followed from its
    #: probabilities to the merge Reshape (the root), so a near miss on the output side is reported too.
    anchors = (Anchor(("Softmax",), "attention", value="probs"),)
    labels = {"probs": "probabilities", "qh": "Q", "kt": "K^T", "vh": "V", "ctx": "P V", "out_shape": "[batch, seq, heads * head_dim]",  # noqa: RUF012
              "noop_shape": "its own shape", "nan_fill": "0", "ctx_same": "P V", "merged_a": "the merged heads",
              "merged_b": "the merged heads"}

    def pattern(self, op: Any, qh: Any, kt: Any, vh: Any, out_shape: Any) -> Any:
        mm = op.MatMul(qh, kt)
        scores = OrValue(
            [op.Div(mm, Var("scale_div")), op.Mul(mm, Var("scale_mul")), mm],
            tag_var="scale_form",
            tag_values=["div", "mul", "none"],
        )
        masked = OrValue([op.Add(scores, Var("mask")), scores], tag_var="mask_form", tag_values=["bias", "none"])
        probs = op.Softmax(masked, _outputs=["probs"])
        guarded = OrValue([op.Where(op.IsNaN(probs), Var("nan_fill"), probs), probs],
                          tag_var="nan_guard", tag_values=["guard", "none"])
        ctx = op.MatMul(guarded, vh, _outputs=["ctx"])
        merged = OrValue([op.Transpose(ctx, perm=[0, 2, 1, 3], _outputs=["merged_a"]),
                          op.Transpose(op.Reshape(ctx, Var("noop_shape"), _outputs=["ctx_same"]), perm=[0, 2, 1, 3],
                                       _outputs=["merged_b"])],
                         tag_var="ctx_form", tag_values=["plain", "reshaped"])
        return op.Reshape(merged, out_shape, _outputs=["y"])

    def _scale(self, kw: dict[str, Any]) -> float | str:
        form = kw["scale_form"]
        if form == "none":
            return 1.0
        c = scalar_value(kw.get(f"scale_{form}"))
        if c is None:
            return "scale is not a constant"
        if form == "div":
            return "scale divisor is 0" if c == 0 else 1.0 / c
        return c

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              qh: ir.Value, kt: ir.Value, vh: ir.Value, y: ir.Value, probs: ir.Value, **kw: Any) -> MatchResult:
        opset = getattr(self, "model_opset", 17)
        if opset < 13:
            return self.fail(f"the function body of mograph.Attention needs opset >= 13 (model has {opset})", qh)
        softmax = probs.producer()
        assert softmax is not None
        axis = softmax.attributes.get("axis")
        if axis is not None and int(axis.value) not in (-1, 3):
            return self.fail(f"Softmax is over axis {int(axis.value)}, not the key axis", softmax)
        shapes = rule_shapes(self, qh)
        q = _split_heads(qh, "query", shapes)
        if isinstance(q, str):
            return self.fail(q, qh)
        k = _keys_transposed(kt, shapes)
        if isinstance(k, str):
            return self.fail(k, kt)
        v = _repeated(vh, "value", shapes)
        if isinstance(v, str):
            return self.fail(v, vh)
        if not (q.x.dtype == k.x.dtype == v.x.dtype):
            return self.fail("query, key and value have different dtypes", q.x)
        if (q.half_rotary is not None or k.half_rotary is not None) and not getattr(self, "adopt_standard", False):
            return self.fail("the heads are rotated by the standard RotaryEmbedding, kept as written for this "
                             "target (--target ort takes it into ONNX Runtime's kernel)", q.x)
        if opset < 15 and q.x.dtype != ir.DataType.FLOAT:
            return self.fail(f"a {q.x.dtype} attention needs opset >= 15 for its function body", q.x)
        if k.dim != q.dim:
            return self.fail(f"key head_dim {k.dim} differs from the query's {q.dim}", k.x)
        if (k.cached is None) != (v.cached is None):
            return self.fail("only one of key and value comes from a cache", k.x)
        if k.heads != v.heads or k.repeat != v.repeat:
            return self.fail(f"key has {k.heads} heads x{k.repeat}, value {v.heads} x{v.repeat}", v.x)
        if k.heads * k.repeat != q.heads:
            return self.fail(f"query has {q.heads} heads, key {k.heads} (repeated {k.repeat} times)", k.x)
        if v.factor != 1.0:
            return self.fail("value is scaled by a constant before the attention", v.x)
        if v.rotary is not None or v.half_rotary is not None:
            return self.fail("value is rotated (a rotary embedding on V is not attention's math)", v.x)
        if kw.get("ctx_form") == "reshaped":
            same = kw["ctx_same"]
            ctx = same.producer().inputs[0]
            if ctx.shape is None or same.shape is None or list(same.shape) != list(ctx.shape):
                entries = _entries(kw.get("noop_shape"), shapes)
                if entries is None or len(entries) != 4 or entries[1] not in (-1, q.heads) or not (
                        entries[0] == 0 or _is_dim(entries[0], shapes.dim(ctx, 0)) or _reads_own_axis(kw.get("noop_shape"), 0, shapes)):
                    return self.fail("the reshape of the attention output is not shown to keep its shape", same)
        if kw.get("nan_guard") == "guard" and scalar_value(kw.get("nan_fill")) != 0.0:
            return self.fail("NaN probabilities are replaced by something other than 0", softmax)
        width = q.heads * v.dim
        out_reshape = y.producer()
        assert out_reshape is not None
        entries = _entries(out_reshape.inputs[1], shapes)
        flat = False
        if entries is not None and len(entries) == 2 and entries[-1] in (width,) and entries[0] == -1:
            flat = True  # [B * S, H * Dv] (dynamo's input to a Gemm)
        elif entries is not None and len(entries) == 2 and _flattens(out_reshape, width, shapes):
            flat = True  # [0, H * Dv] where S is 1 (a decode step's merged Reshapes): [B, H * Dv] is [B * S, H * Dv]
        else:
            last = entries[-1] if entries else None
            if y.shape is not None and len(y.shape) == 3 and isinstance(y.shape[2], int):
                last = y.shape[2] if last not in (-1, width) else last
            if entries is not None and len(entries) != 3:
                return self.fail("the output reshape is not to [batch, seq, hidden] or [batch * seq, hidden]", out_reshape)
            if last not in (-1, width) or not _keeps_leading(out_reshape, shapes):
                return self.fail("the output reshape is not to [batch, seq, heads * head_dim]", out_reshape)
        scale = self._scale(kw)
        if isinstance(scale, str):
            return self.fail(scale, softmax)
        mask = kw.get("mask")
        if mask is not None and is_zero_bias(mask):
            mask = None  # a provably zero bias (an all-ones mask) is no mask
        if mask is not None:
            if mask.dtype != q.x.dtype:
                return self.fail(f"attention bias '{mask.name}' has dtype {mask.dtype}, the scores {q.x.dtype}", mask)
            if mask.shape is None or len(mask.shape) > 4:
                return self.fail(f"attention bias '{mask.name}' is not of rank <= 4 (shape {mask.shape})", mask)
            dim1 = mask.shape[1] if len(mask.shape) == 4 else 1
            if isinstance(dim1, int) and dim1 not in (1, q.heads):
                return self.fail(f"attention bias '{mask.name}' has {dim1} heads, the attention {q.heads}", mask)
        layouts: dict[int, str] = {id(kw[n]): "BSHV" for n in ("merged_a", "merged_b") if kw.get(n) is not None}
        layouts.update({id(kw[n]): "BHSV" for n in ("ctx", "ctx_same") if kw.get(n) is not None})
        cur = kw["ctx"].producer().inputs[0]
        for _ in range(6):  # guarded probabilities, probabilities, masked and scaled scores: [B, H, S, T]
            layouts[id(cur)] = "BHST"
            node = cur.producer()
            if node is None or node.op_type == "MatMul":
                break
            if node.op_type == "Where":
                layouts[id(node.inputs[0])] = "BHST"
                cur = node.inputs[2]
            elif node.op_type == "Add":
                cur = node.inputs[1] if node.inputs[0] is kw.get("mask") else node.inputs[0]
            else:
                cur = node.inputs[0]
        self._found: dict[str, Any] = {"q": q, "k": k, "v": v, "scale": float(scale) * q.factor * k.factor, "mask": mask,
                       "flat": flat, "width": width, "nan": int(kw.get("nan_guard") == "guard"), "layouts": layouts}
        return self.ok()

    def shape_of(self, value: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
        """The shape of a value inside the matched attention, computed from Q and K (for Shape readers)."""
        f = self._found
        layout = f["layouts"].get(id(value))
        if layout is None:
            return None
        nodes: list[ir.Node] = []
        opset = getattr(self, "model_opset", 17)

        def add(op_type: str, inputs: list[ir.Value], **attrs: Any) -> ir.Value:
            nodes.append(ir.node(op_type, inputs, attributes=attrs))
            return nodes[-1].outputs[0]

        def const(vals: list[int]) -> ir.Value:
            return add("Constant", [], value=ir.tensor(np.array(vals, dtype=np.int64)))

        def dim(x: ir.Value, i: int) -> ir.Value:
            if opset >= 15:
                return add("Shape", [x], start=i, end=i + 1)
            return add("Slice", [add("Shape", [x]), const([i]), const([i + 1])])

        q, k, v = f["q"].x, f["k"].x, f["v"]
        cached = f["k"].cached

        def keys() -> ir.Value:
            return dim(k, 1) if cached is None else dim(cached, 2)

        parts = {"B": lambda: dim(q, 0), "S": lambda: dim(q, 1), "T": keys,
                 "H": lambda: const([f["q"].heads]), "V": lambda: const([v.dim])}
        return nodes, add("Concat", [parts[c]() for c in layout], axis=0)

    def rewrite(self, op: Any, **_: Any) -> Any:
        f = self._found
        q, k, v, mask = f["q"], f["k"], f["v"], f["mask"]
        if mask is None:
            dtype = q.x.dtype.numpy() if q.x.dtype is not None else np.float32
            mask = op.initializer(ir.tensor(np.zeros((), dtype=dtype)), name="mograph_zero_bias")
        attrs: dict[str, Any] = {"num_heads": q.heads, "scale": f["scale"]}
        if k.heads != q.heads:
            attrs["kv_num_heads"] = k.heads
        if f["nan"] and not _finite_bias(mask):
            attrs["nan_to_zero"] = 1
        q_tables, k_tables = full_rotary_tables(op, q), full_rotary_tables(op, k)
        qx, kx = head_norm(op, q), head_norm(op, k)
        qx = qx if q_tables is None else mograph_op(op, ROTARY_OP, qx, *q_tables, **_rotary_attrs(q))
        kx = kx if k_tables is None else mograph_op(op, ROTARY_OP, kx, *k_tables, **_rotary_attrs(k))
        if k.cached is not None and k.rotary is not None:
            # the new keys rotated by a fused rotary embedding, then the cache's Concat again (the present
            # output, name kept); the exporter's Concat and its decomposed rotary are left unused
            cat = k.cached.producer()
            assert cat is not None and cat.inputs[0] is not None
            split = op.initializer(ir.tensor(np.array([0, 0, k.heads, k.dim], dtype=np.int64)),
                                   name="mograph_split_kv_heads")
            new_heads = op.Transpose(op.Reshape(kx, split), perm=[0, 2, 1, 3])
            present = op.Concat(cat.inputs[0], new_heads, axis=int(cat.attributes["axis"].value))
            graph = cat.graph
            assert graph is not None
            name, old = k.cached.name, k.cached
            for i, out in enumerate(graph.outputs):
                if out is old:
                    old.name = f"{name}_unfused"
                    graph.outputs[i] = present
                    present.name = name
                    present.type, present.shape = old.type, old.shape  # a graph output keeps its declared type
            k.cached = present
        flat = None
        for heads in (k, v):
            if heads.cached is not None:  # the cache's [B, N, P+T, D] present as [B, P+T, N*D]
                if flat is None:
                    flat = op.initializer(ir.tensor(np.array([0, 0, -1], dtype=np.int64)), name="mograph_merge_heads")
                merged = op.Reshape(op.Transpose(heads.cached, perm=[0, 2, 1, 3]), flat)
                kx, vx = (merged, None) if heads is k else (kx, merged)
        vx = head_norm(op, v) if v.cached is None else vx  # type: ignore[possibly-undefined]
        y = mograph_op(op, ATTENTION_OP, qx, kx, vx, mask, **attrs)
        fmt = getattr(self, "mask_format", None)
        if fmt and fmt != "bias" and f["mask"] is not None:
            y.producer().metadata_props[MASK_FORMAT_KEY] = fmt
        if getattr(self, "kv_cache", None) == "shared":
            y.producer().metadata_props[KV_CACHE_KEY] = "shared"
        positions = getattr(self, "position_ids", None)
        # auto: where the graph already assumes right padding (lengths, the shared buffer), a position_ids input is
        # read as what such a loop feeds, each token's cache position; otherwise as given
        if positions == "cache" or (positions == "auto" and (getattr(self, "kv_cache", None) == "shared" or (
                fmt == "lengths" and f["mask"] is not None))):
            y.producer().metadata_props[POSITION_IDS_KEY] = "cache"
        if f["flat"]:
            y = op.Reshape(y, op.initializer(ir.tensor(np.array([-1, f["width"]], dtype=np.int64)),
                                             name="mograph_flat_shape"))
        return y

    def variant(self, bindings: dict[str, Any]) -> str | None:
        f = self._found
        form = bindings.get("scale_form")
        if form == "none" and (f["q"].factor != 1.0 or f["k"].factor != 1.0):
            form = "mul-qk"
        parts = [str(form), "mask" if f["mask"] is not None else "nomask"]
        if f["k"].heads != f["q"].heads:
            parts.append("gqa")
        if any(h.rotary is not None or h.half_rotary is not None for h in (f["q"], f["k"])):
            parts.append("rotary")
        if f["k"].cached is not None:
            parts.append("cache")
        return ".".join(parts)


def _flattens(reshape: ir.Node, width: int, shapes: GraphShapes) -> bool:
    """Whether the shape query proves that ``reshape`` turns its ``[B, S, H, Dv]`` input into ``[B * S, width]``
    (its output's dims, as the query reads them from the target, equal those for every input)."""
    dx, dy = shapes.dims(reshape.inputs[0]), shapes.dims(reshape.outputs[0])
    if dx is None or dy is None or len(dx) != 4 or len(dy) != 2 or dy[1] is None or dy[1].value != width:
        return False
    return same_dim(dy[0], mul(dx[0], dx[1]))


def head_norm(op: Any, heads: Heads) -> Any:
    """``heads.x`` ``[B, S, N*D]`` with the heads' own norm (``Heads.norm``: Gemma 3's ``q_norm``) applied:
    ``Reshape(Norm(Reshape(x, [0, 0, N, D])), [0, 0, N*D])``.  The norm is over each head's ``D`` values of one
    position, so it gives on ``[B, S, N, D]`` exactly what it gave on the split ``[B, N, S, D]`` heads (its scale
    and bias are 1-D, checked by the trace); the same op, attributes, scale and bias."""
    norm = heads.norm
    if norm is None:
        return heads.x
    split = op.initializer(ir.tensor(np.array([0, 0, heads.heads, heads.dim], dtype=np.int64)),
                           name="mograph_head_norm_split")
    merge = op.initializer(ir.tensor(np.array([0, 0, heads.heads * heads.dim], dtype=np.int64)),
                           name="mograph_head_norm_merge")
    attrs = {k: a.value for k, a in norm.attributes.items()}
    domain = {"_domain": norm.domain, "_version": DOMAIN_VERSION} if norm.domain == DOMAIN else {}
    y = getattr(op, norm.op_type)(op.Reshape(heads.x, split), *norm.inputs[1:], **domain, **attrs)
    return op.Reshape(y, merge)


def _rotary_attrs(heads: Heads) -> dict[str, int]:
    """``mograph.RotaryEmbedding``'s attributes for ``heads``: ``rotary_dim`` only for a partial rotary."""
    return {"num_heads": heads.heads, **({"rotary_dim": heads.rotary_dim} if heads.rotary_dim else {})}


def full_rotary_tables(op: Any, heads: Heads) -> tuple[ir.Value, ir.Value] | None:
    """The (cos, sin) ``[B, 1, S, D]`` that ``mograph.RotaryEmbedding`` takes: the decomposed rotary's own, or
    a standard RotaryEmbedding's half tables doubled (``Cos(Concat(f, f))`` where they are ``Cos(f)``, the form
    the ``ort`` lowering reads back into ONNX Runtime's kernel)."""
    if heads.half_rotary is None:
        return heads.rotary
    axes = op.initializer(ir.tensor(np.array([1], dtype=np.int64)), name="mograph_axis_1")
    cos, sin = heads.half_rotary
    cos_src, sin_src = _producer(cos, "Cos"), _producer(sin, "Sin")
    if cos_src is not None and sin_src is not None and cos_src.inputs[0] is sin_src.inputs[0]:
        f = cos_src.inputs[0]
        both = op.Concat(f, f, axis=-1)
        return op.Unsqueeze(op.Cos(both), axes), op.Unsqueeze(op.Sin(both), axes)
    return (op.Unsqueeze(op.Concat(cos, cos, axis=-1), axes), op.Unsqueeze(op.Concat(sin, sin, axis=-1), axes))


def _finite_bias(mask: ir.Value) -> bool:
    """Whether the bias provably holds no -inf: a constant, or ``Where(c, a, b)`` of finite constants."""
    arr = constant_array(mask)
    if arr is not None:
        return bool(np.all(np.isfinite(arr)))
    node = _producer(mask, "Where")
    if node is not None:
        vals = [scalar_value(node.inputs[i]) for i in (1, 2)]
        return all(x is not None and math.isfinite(x) for x in vals)
    return False


def _mask_format(raw: object) -> str:
    text = str(raw).strip().lower()
    if text not in MASK_FORMATS:
        raise ValueError(f"expected one of {', '.join(MASK_FORMATS)}")
    return text


MASK_FORMAT_OPTION = Option(
    "mask-format", _mask_format, "bias",
    "how --target ort passes a key-padding mask to attention, and what each form assumes: "
    "bias (default; exact for every mask, assumes nothing): the additive attention_bias, built once and shared by "
    "the layers (Attention with packed QKV for self-attention, else MultiHeadAttention; on the H200 an additive "
    "(1,1,S,S) bias ran cuDNN flash attention, (B,1,S,S) is not yet measured); for a LLaMA/Qwen-style decoder's "
    "causal attention with rotary and an attention_mask: GroupQueryAttention (rotary inside, packed QKV) behind a "
    "check computed on the device in every run (an If per layer: every mask row ones then zeros with at least one "
    "key; a decode step: every key present, and one new token or one row), the MultiHeadAttention/bias form when "
    "the check fails, so left padding is exact too (an If cannot be captured as a CUDA graph: see --kv-cache "
    "shared); "
    "lengths (ASSUMES RIGHT PADDING, ones then zeros, no check): 1-D key lengths, ReduceSum of the 0/1 "
    "attention_mask, and for such decoders GroupQueryAttention without the check: measured fastest, but a "
    "left-padded row attends to its first keys instead and gives other numbers; masks not traced to an "
    "attention_mask input stay bias; "
    "raw (exact for 0/1 masks): the 2-D mask as mask_index, but ONNX Runtime CUDA's slow unfused kernel",
    metavar="bias|lengths|raw",
)


def _kv_cache_layout(raw: object) -> str:
    text = str(raw).strip().lower()
    if text not in ("concat", "shared"):
        raise ValueError("expected concat or shared")
    return text


KV_CACHE_OPTION = Option(
    "kv-cache", _kv_cache_layout, "concat",
    "KV cache of a decoder's decode step for --target ort: concat (default: present = Concat(past, new), shapes "
    "grow every step) or shared (GroupQueryAttention over one static buffer per layer that past_key and "
    "present_key are both bound to, [batch, kv_heads, max_sequence_length, head_dim], with a [batch, "
    "max_sequence_length] attention_mask of ones then zeros: shapes fixed between steps, so the step can be "
    "captured as a CUDA graph; implies --mask-format lengths for these attentions, i.e. RIGHT padding; a cached "
    "attention that cannot become GroupQueryAttention fails the lower step)",
    metavar="concat|shared",
)


def _position_ids_mode(raw: object) -> str:
    text = str(raw).strip().lower()
    if text not in ("auto", "as-given", "cache"):
        raise ValueError("expected auto, as-given or cache")
    return text


POSITION_IDS_OPTION = Option(
    "position-ids", _position_ids_mode, "auto",
    "a decoder export's position_ids input (optimum's exports take one) for --target ort's GroupQueryAttention: "
    "auto (default): cache where the graph already ASSUMES right padding (--mask-format lengths, --kv-cache "
    "shared: a loop feeding such masks feeds each token's cache position), else as-given; as-given (exact): "
    "behind the default mask format's run-time check, which then also checks position_ids[b, s] == past + s, "
    "GroupQueryAttention computes the rotary itself and other positions take the exact branch; without the "
    "check the export's own angles, one ONNX Runtime RotaryEmbedding kernel before GroupQueryAttention "
    "(1.10-1.25x the builder's graphs on the H200, session 14); cache (ASSUMES position_ids[b, s] is each "
    "token's cache position, past length + s: GroupQueryAttention computes the rotary from its cache lengths "
    "and position_ids is not read; left padding, offsets or packed sequences give other numbers)",
    metavar="auto|as-given|cache",
)


class FuseAttentionPass(FusionPass):
    """Fuse multi-head self-/cross-attention (Q/K/V split, scaled scores, mask bias, softmax, merge) into one op."""

    name = "fuse-attention"
    #: Keras/tf2onnx's Einsum attention into the MatMul form the rule reads (:mod:`.canonicalize._layout`)
    canonicalize = ("unit-axes", "shape-unit-axes", "squeeze-reshape", "gemm-rows", "batched-matmul", "bias-split",
                    "matmul-transpose", "einsum-matmul", "head-slice",
                    "group-slice", "heads-reshape")
    options: ClassVar[tuple[Option, ...]] = (EXPLAIN_OPTION, MASK_FORMAT_OPTION, KV_CACHE_OPTION, POSITION_IDS_OPTION,
                                             TARGET_OPTION)
    rules: ClassVar[tuple[type[Rule], ...]] = (AttentionFusion,)

    def make_rules(self) -> list[Rule]:
        rules = super().make_rules()
        if adopts_standard_ops(self.config):  # opset 23's own Attention -> the target's kernel (--target ort)
            from mograph.passes.fusion.standard_attention import StandardAttentionFusion

            rules.append(StandardAttentionFusion())
        fmt = self.config.get("mask_format")
        kv = self.config.get("kv_cache")
        for rule in rules:
            rule.mask_format = fmt  # type: ignore[attr-defined]
            rule.kv_cache = kv  # type: ignore[attr-defined]
            rule.position_ids = self.config.get("position_ids")  # type: ignore[attr-defined]
            rule.adopt_standard = adopts_standard_ops(self.config)  # type: ignore[attr-defined]
        return rules

    explain_key = "unfused_softmax"

    def call(self, model: ir.Model) -> PassResult:
        result = super().call(model)
        if self.config.get("kv_cache") == "shared":
            _shared_caches_fused(model, self.name)
        return result

    def explained(self, regions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every Softmax left that the rule's pattern below the probabilities matches, and why it did not fuse."""
        return [{"softmax": r["anchor"], "reason": r.get("reason") or "",
                 "failed_at": r.get("failed_at"), "failed_at_op": r.get("failed_at_op")} for r in regions]


def _shared_caches_fused(model: ir.Model, pass_name: str) -> None:
    """``--kv-cache shared``: refuse a decode step whose exporter cache Concats (a rank-4 graph input joined
    with the new keys or values into a graph output) outnumber what the fused attentions tagged ``shared`` take
    (two each: K and V). Such a cache keeps growing by Concat, so a generation loop that binds one static buffer
    as past and present would fail at run time (or read garbage), while the pass reported success."""
    graph = model.graph
    inputs = {id(v) for v in graph.inputs if v.shape is not None and len(v.shape) == 4}
    outputs = {id(v) for v in graph.outputs}
    caches = [n for n in graph if n.op_type == "Concat" and n.domain in ("", "ai.onnx") and n.inputs
              and n.inputs[0] is not None and id(n.inputs[0]) in inputs and id(n.outputs[0]) in outputs]
    tagged = sum(1 for n in graph if n.metadata_props.get(KV_CACHE_KEY) == "shared")
    if caches and 2 * tagged < len(caches):
        first = caches[0].inputs[0]
        assert first is not None
        raise PassFailedError(pass_name, f"--kv-cache shared: {len(caches)} KV caches grow by Concat (the first: "
                              f"'{first.name}') but {tagged} fused attention(s) take a cache "
                              f"({2 * tagged} caches): the rest cannot share one static buffer; run with --explain "
                              "to see why those attentions did not fuse, or drop --kv-cache shared")

