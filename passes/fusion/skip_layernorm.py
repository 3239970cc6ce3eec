"""``fuse-skip-layernorm``: residual ``Add`` (+ optional bias ``Add``) then LayerNorm -> ``mograph.SkipLayerNorm``,
or then RMSNorm -> ``mograph.SkipRMSNorm``.

The math matched::

    s = (a + bias) + skip       bias a constant broadcast over the last axis (the dense layer's bias),
      | a + skip                 in any order of the Adds' inputs
    y = LayerNorm(s)            a ``mograph.LayerNorm`` (from ``fuse-layernorm``) or the standard
                                ``LayerNormalization`` over the last axis that exporters write at opset >= 17

A dense layer written as ``Gemm`` with its bias in ``C`` (GPT-2's ``Conv1D``, exported by TorchScript as
``Reshape(Gemm(Reshape(x, [-1, K]), W, bias), [batch, seq, N])``) gives its bias to the fused op the same
way: the ``Gemm`` loses ``C`` and the bias becomes the Skip op's ``Bias`` input
(:class:`SkipLayerNormGemmBiasFusion`), so ONNX Runtime's CUDA ``Gemm`` does not first broadcast the bias
into its output with a kernel of its own; the Skip kernel adds it on the way.

When something else reads ``s`` (pre-LN transformers: the residual stream goes on to the next
block), the fused op returns it as a second output, so nothing outside the pattern loses a value.

The same with an RMSNorm (``mograph.RMSNorm`` from ``fuse-rmsnorm``, or the standard
``RMSNormalization`` of opset 23): LLaMA-style decoders, where every norm but the first reads a
residual sum; TorchScript's ``Cast`` of the sum to float32 before the norm is taken along.

Only canonical forms are matched (never what a lowering writes for a target); the ``lower`` step
turns the ops into ``com.microsoft.SkipLayerNormalization`` / ``SkipSimplifiedLayerNormalization``
(``ort``), the ``SkipLayerNorm`` / ``SkipRMSNorm`` TensorRT plugins (``tensorrt``), or back into
``Add`` + the standard norm (``onnx``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._common import FusionPass, is_float, mograph_op
from mograph.passes.fusion.ops import body_supports

from mograph.custom_ops import DOMAIN
from mograph.patterns import MatchResult, OrValue, Rule, Var, constant_array

__all__ = ["SkipLayerNormFusion", "SkipLayerNormGemmBiasFusion", "SkipRMSNormFusion", "FuseSkipLayerNormPass",
           "gemm_bias_pattern", "check_gemm_bias", "gemm_without_bias", "check_standard_norm", "ln_attrs", "norm_beta"]


def _is_bias(context: Any, value: ir.Value) -> MatchResult:
    arr = constant_array(value)
    result = MatchResult()
    if arr is None:
        return result.fail("bias is not a constant")
    if arr.ndim > 1 and any(d != 1 for d in arr.shape[:-1]):
        return result.fail("bias does not broadcast over the last axis only")
    return result


def gemm_bias_pattern(op: Any, ga: Any, gw: Any, gshape: Any) -> Any:
    """``Reshape(Gemm(ga, gw, gemm_bias), gshape)``: a dense layer with its bias in ``C`` (binds ``gemm_out``,
    ``proj`` and ``gemm_bias``)."""
    gemm = op.Gemm(ga, gw, Var("gemm_bias"), _outputs=["gemm_out"])
    return op.Reshape(gemm, gshape, _allow_other_inputs=True, _outputs=["proj"])


def check_gemm_bias(rule: Rule, gemm_out: ir.Value, proj: ir.Value, gemm_bias: ir.Value) -> MatchResult:
    """The Gemm's ``C`` is a constant ``[N]`` (or ``[1, N]``) bias that the Reshape keeps on the last axis."""
    gemm = gemm_out.producer()
    assert gemm is not None
    if any(int(gemm.attributes[k].value) for k in ("transA",) if k in gemm.attributes):
        return rule.fail(f"Gemm '{gemm.name}' transposes A", gemm)
    arr = constant_array(gemm_bias)
    if arr is None:
        return rule.fail(f"the bias of Gemm '{gemm.name}' is not a constant", gemm)
    if arr.ndim == 0 or arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        return rule.fail(f"the bias of Gemm '{gemm.name}' is not a vector over the output columns", gemm)
    n = gemm_out.shape[-1] if gemm_out.shape is not None and len(gemm_out.shape) == 2 else None
    last = proj.shape[-1] if proj.shape is not None and len(proj.shape) else None
    if not isinstance(n, int) or n != last or arr.size != n:
        return rule.fail(f"cannot prove the Reshape after Gemm '{gemm.name}' keeps its {n} columns last", proj)
    if gemm_bias.dtype != gemm_out.dtype:
        return rule.fail(f"the bias of Gemm '{gemm.name}' has another dtype", gemm)
    return rule.ok()


def gemm_without_bias(op: Any, gemm_out: ir.Value, proj: ir.Value, gemm_bias: ir.Value) -> tuple[Any, Any]:
    """The dense layer again without ``C``, and its bias as a 1-D initializer (scaled by ``beta``)."""
    gemm = gemm_out.producer()
    reshape = proj.producer()
    assert gemm is not None and reshape is not None
    attrs = {k: v.value for k, v in gemm.attributes.items() if k in ("alpha", "transA", "transB")}
    beta = float(gemm.attributes["beta"].value) if "beta" in gemm.attributes else 1.0
    arr = constant_array(gemm_bias)
    assert arr is not None  # checked by check_gemm_bias
    arr = arr.reshape(-1)
    if beta != 1.0:
        arr = (arr * beta).astype(arr.dtype)
    bias = gemm_bias if beta == 1.0 and gemm_bias.const_value is not None and len(gemm_bias.shape or ()) == 1 \
        else op.initializer(ir.tensor(arr), name="mograph_gemm_bias")
    y = op.Gemm(gemm.inputs[0], gemm.inputs[1], **attrs)
    rattrs = {k: v.value for k, v in reshape.attributes.items()}
    return op.Reshape(y, *reshape.inputs[1:], **rattrs), bias


def ln_attrs(node: ir.Node) -> dict[str, Any]:
    """The fused op's ``epsilon`` / ``stash_type`` from a LayerNorm node (``epsilon`` 1e-5 when unset)."""
    attrs = {k: v.value for k, v in node.attributes.items() if k in ("epsilon", "stash_type")}
    attrs.setdefault("epsilon", 1e-5)
    return attrs


def norm_beta(op: Any, node: ir.Node, sum: ir.Value) -> Any:
    """The LayerNorm ``node``'s bias input, or a zero of ``sum``'s dtype when it has none."""
    beta = node.inputs[2] if len(node.inputs) > 2 else None
    return beta if beta is not None else _zero(op, sum)


def check_standard_norm(rule: Rule, node: ir.Node, std_op: str, extras: str, sum: ir.Value) -> MatchResult | None:
    """A failure if the norm is the standard/ORT op ``std_op`` not over the last axis or with its extra
    outputs (``extras``: what they are, for the message) read; None otherwise."""
    if node.op_type != std_op:
        return None
    axis = node.attributes.get("axis")
    rank = len(sum.shape) if sum.shape is not None else None
    ax = -1 if axis is None else int(axis.value)
    if not (ax == -1 or (rank is not None and ax == rank - 1)):
        return rule.fail(f"{std_op} '{node.name}' is not over the last axis", node)
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return rule.fail(f"{extras} of '{node.name}' is read elsewhere", node)
    return None


def _check_residual(rule: Rule, a: ir.Value, skip: ir.Value, sum: ir.Value, what: str) -> MatchResult:
    """The checks on the residual Add shared by both rules (``what`` names the norm in the messages)."""
    if not is_float(sum):
        return rule.fail("the residual sum is not a floating-point tensor", sum)
    if a.dtype != skip.dtype or a.dtype != sum.dtype:
        return rule.fail("the residual Add mixes dtypes", sum)
    if not body_supports(getattr(rule, "model_opset", 17), sum.dtype):
        return rule.fail(f"an fp16/bf16 skip {what} needs opset >= 15", sum)
    if sum.shape is not None and a.shape is not None and len(a.shape) != len(sum.shape):
        return rule.fail("the residual Add broadcasts a lower-rank input", sum)
    return rule.ok()


def _zero(op: Any, sum: ir.Value) -> ir.Value:
    dtype = sum.dtype.numpy() if sum.dtype is not None else np.float32
    return op.initializer(ir.tensor(np.zeros(1, dtype=dtype)), name="mograph_zero")


def _bias_1d(op: Any, bias: ir.Value | None, sum: ir.Value) -> ir.Value:
    """The dense bias as the fused op's 1-D Bias input (a zero when there is none)."""
    if bias is None:
        return _zero(op, sum)
    arr = constant_array(bias)
    assert arr is not None  # checked by _is_bias
    if arr.ndim != 1:
        return op.initializer(ir.tensor(arr.reshape(-1)), name="mograph_skip_bias")
    return bias


def _sum_if_read(sum: ir.Value, norm: ir.Node, total: ir.Value) -> ir.Value | None:
    """The fused op's Sum output where something besides the norm reads the residual sum, else None."""
    keep = bool(sum.uses()) and any(c is not norm for c, _ in sum.uses()) or sum.is_graph_output()
    return total if keep else None


def _keeps_sum(s: ir.Value | None, norm_ops: tuple[str, ...]) -> bool:
    return s is not None and (s.is_graph_output() or any(c.op_type not in norm_ops for c, _ in s.uses()))


class SkipLayerNormFusion(Rule):
    """LayerNorm((a + bias) + skip) -> mograph.SkipLayerNorm(a, skip, scale, beta, bias) [+ sum]."""

    min_candidate_nodes = 2

    def pattern(self, op: Any, a: Any, skip: Any, scale: Any, beta: Any) -> Any:
        bias = Var("bias", check=_is_bias)
        s = OrValue([op.Add(op.Add(a, bias), skip), op.Add(a, skip)], name="sum",
                    tag_var="form", tag_values=["bias", "plain"])
        ln = OrValue(
            [
                op.LayerNorm(s, scale, beta, _domain=DOMAIN, _outputs=["ln_out"]),
                op.LayerNormalization(s, scale, _allow_other_inputs=True, _outputs=["ln_out"]),
            ],
        )
        return ln, s

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              a: ir.Value, skip: ir.Value, scale: ir.Value, ln_out: ir.Value, sum: ir.Value, **kw: Any) -> MatchResult:
        node = ln_out.producer()
        assert node is not None
        failed = check_standard_norm(self, node, "LayerNormalization", "mean or inverse std", sum)
        return failed if failed is not None else _check_residual(self, a, skip, sum, "LayerNorm")

    def rewrite(self, op: Any, a: ir.Value, skip: ir.Value, scale: ir.Value, ln_out: ir.Value,
                sum: ir.Value, bias: ir.Value | None = None, **_: Any) -> Any:
        node = ln_out.producer()
        assert node is not None
        attrs = ln_attrs(node)
        beta = norm_beta(op, node, sum)
        y, total = mograph_op(op, "SkipLayerNorm", a, skip, scale, beta, _bias_1d(op, bias, sum), _outputs=2, **attrs)
        return y, _sum_if_read(sum, node, total)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        keep = _keeps_sum(bindings.get("sum"), ("LayerNorm", "LayerNormalization"))
        return f"{bindings.get('form')}{'.sum-output' if keep else ''}"


class SkipLayerNormGemmBiasFusion(Rule):
    """LayerNorm(Reshape(Gemm(x, W, bias)) + skip) -> SkipLayerNorm(Reshape(Gemm(x, W)), skip, ..., bias)."""

    min_candidate_nodes = 10**6  # a near miss here is reported by SkipLayerNormFusion on the same nodes

    def pattern(self, op: Any, ga: Any, gw: Any, gshape: Any, skip: Any, scale: Any, beta: Any) -> Any:
        s = op.Add(gemm_bias_pattern(op, ga, gw, gshape), skip, _outputs=["sum"])
        ln = OrValue(
            [
                op.LayerNorm(s, scale, beta, _domain=DOMAIN, _outputs=["ln_out"]),
                op.LayerNormalization(s, scale, _allow_other_inputs=True, _outputs=["ln_out"]),
            ],
        )
        return ln, s

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              skip: ir.Value, scale: ir.Value, ln_out: ir.Value, sum: ir.Value, gemm_out: ir.Value,
              proj: ir.Value, gemm_bias: ir.Value, **kw: Any) -> MatchResult:
        node = ln_out.producer()
        assert node is not None
        failed = check_standard_norm(self, node, "LayerNormalization", "mean or inverse std", sum)
        if failed is not None:
            return failed
        result = _check_residual(self, proj, skip, sum, "LayerNorm")
        return result if not result else check_gemm_bias(self, gemm_out, proj, gemm_bias)

    def rewrite(self, op: Any, skip: ir.Value, scale: ir.Value, ln_out: ir.Value, sum: ir.Value,
                gemm_out: ir.Value, proj: ir.Value, gemm_bias: ir.Value, **_: Any) -> Any:
        node = ln_out.producer()
        assert node is not None
        attrs = ln_attrs(node)
        beta = norm_beta(op, node, sum)
        a, bias = gemm_without_bias(op, gemm_out, proj, gemm_bias)
        y, total = mograph_op(op, "SkipLayerNorm", a, skip, scale, beta, bias, _outputs=2, **attrs)
        return y, _sum_if_read(sum, node, total)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        return "sum-output" if _keeps_sum(bindings.get("sum"), ("LayerNorm", "LayerNormalization")) else None


class SkipRMSNormFusion(Rule):
    """RMSNorm((a + bias) + skip) -> mograph.SkipRMSNorm(a, skip, scale, bias) [+ sum]."""

    min_candidate_nodes = 2
    _NORMS = ("RMSNorm", "RMSNormalization")

    def pattern(self, op: Any, a: Any, skip: Any, scale: Any) -> Any:
        bias = Var("bias", check=_is_bias)
        s0 = OrValue([op.Add(op.Add(a, bias), skip), op.Add(a, skip)], name="add_out",
                     tag_var="form", tag_values=["bias", "plain"])
        # TorchScript exports of LLaMA cast the residual sum to float32 before the norm, also when it is
        # float32 already; that Cast's output is then the residual stream the next block reads.
        s = OrValue([op.Cast(s0, _outputs=["cast_out"]), s0], name="sum", tag_var="cast",
                    tag_values=["cast", "no-cast"])
        rms = OrValue(
            [
                op.RMSNorm(s, scale, _domain=DOMAIN, _outputs=["rms_out"]),
                op.RMSNormalization(s, scale, _outputs=["rms_out"]),
            ],
        )
        return rms, s

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              a: ir.Value, skip: ir.Value, scale: ir.Value, rms_out: ir.Value, sum: ir.Value, **kw: Any) -> MatchResult:
        node = rms_out.producer()
        assert node is not None
        failed = check_standard_norm(self, node, "RMSNormalization", "inverse std", sum)
        if failed is not None:
            return failed
        add_out = kw.get("add_out")
        if add_out is not None and add_out is not sum and add_out.dtype != sum.dtype:
            return self.fail("the Cast after the residual Add changes its dtype", sum)
        return _check_residual(self, a, skip, sum, "RMSNorm")

    def rewrite(self, op: Any, a: ir.Value, skip: ir.Value, scale: ir.Value, rms_out: ir.Value,
                sum: ir.Value, bias: ir.Value | None = None, **_: Any) -> Any:
        node = rms_out.producer()
        assert node is not None
        attrs = {k: v.value for k, v in node.attributes.items() if k in ("epsilon", "stash_type")}
        attrs.setdefault("epsilon", 1e-5 if node.op_type == "RMSNormalization" else 1e-6)  # each op's own default
        attrs.setdefault("stash_type", 1)
        y, total = mograph_op(op, "SkipRMSNorm", a, skip, scale, _bias_1d(op, bias, sum), _outputs=2, **attrs)
        return y, _sum_if_read(sum, node, total)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        keep = _keeps_sum(bindings.get("sum"), self._NORMS)
        cast = ".cast" if bindings.get("cast") == "cast" else ""
        return f"{bindings.get('form')}{cast}{'.sum-output' if keep else ''}"


class FuseSkipLayerNormPass(FusionPass):
    """Fuse a residual Add (and bias) with the LayerNorm or RMSNorm after it into one Skip* op."""

    name = "fuse-skip-layernorm"
    canonicalize = ("identity",)  # Identity between the residual Add and the norm (paddle2onnx)

    def make_rules(self) -> list[Rule]:
        return [SkipLayerNormGemmBiasFusion(), SkipLayerNormFusion(), SkipRMSNormFusion()]
