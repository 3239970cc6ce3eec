"""``fuse-rmsnorm``: RMSNorm written out in primitive ops -> one ``mograph.RMSNorm``.

The math matched, over the last axis of ``x`` (LLaMA, T5, Mistral ...)::

    ms = E[x^2]                     ReduceMean or ReduceSum / N; square as Mul(x, x) or Pow(x, 2)
    y  = x / sqrt(ms + eps)         Div by Sqrt, Mul by Reciprocal(Sqrt), Mul by Pow(., -0.5)
       | x / sqrt(ms)               (no epsilon inside the root: eps = 0)
    y  = y * scale                  optional, absorbed (see :mod:`._absorb`), as are the Casts to
                                    float32 and back of fp16/bf16 models

Run after ``fuse-layernorm``: a LayerNorm's tail ``d / sqrt(E[d^2] + eps)`` is an RMSNorm of the
centred ``d`` (fusing it is correct, but LayerNorm fusion is the better rewrite).  ``lower`` turns it into
``SimplifiedLayerNormalization`` (``ort``), ``RMSNormalization`` (``onnx``, opset >= 23) or the
``RMSNorm`` plugin (``tensorrt``).

With ``--target ort`` the standard ``RMSNormalization`` an exporter wrote (opset 23: the dynamo exporter
writes one for every RMSNorm) becomes ``mograph.RMSNorm`` too (:class:`StandardRMSNormFusion`), so the
lowering gives it ONNX Runtime's own kernel, ``SimplifiedLayerNormalization`` (the same math, last axis,
``stash_type`` float32); other targets keep the standard op.
"""

from __future__ import annotations

from typing import Any, ClassVar

import onnx_ir as ir
from mograph.passes.fusion._absorb import NormCastFusion, NormScaleFusion
from mograph.passes.fusion._common import (
    EXPLAIN_OPTION,
    NORM_ANCHOR,
    TARGET_OPTION,
    FusionPass,
    adopts_standard_ops,
    check_norm_input,
    divide_by_root,
    is_float,
    mean_last,
    mograph_op,
    placeholder,
    square,
)
from mograph.passes.fusion.ops import body_supports

from mograph.pass_infra import Option
from mograph.patterns import MatchResult, OrValue, Rule

__all__ = ["RMSNormFusion", "StandardRMSNormFusion", "FuseRMSNormPass"]


class RMSNormFusion(Rule):
    """x / sqrt(E[x^2] + eps) over the last axis -> mograph.RMSNorm(x, 1)."""

    anchors = (NORM_ANCHOR,)
    min_candidate_nodes = 3

    def pattern(self, op: Any, x: Any, eps: Any) -> Any:
        ms = mean_last(op, square(op, x), tag="mean")
        ms_eps = OrValue([op.Add(ms, eps), ms], tag_var="eps_form", tag_values=["eps", "no-eps"])
        return divide_by_root(op, x, ms_eps)

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              x: ir.Value, eps: ir.Value | None, **_: Any) -> MatchResult:
        value = check_norm_input(self, x, eps)
        if isinstance(value, MatchResult):
            return value
        self._eps = value
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> Any:
        stash = int(ir.DataType.DOUBLE if x.dtype == ir.DataType.DOUBLE else ir.DataType.FLOAT)
        return mograph_op(op, "RMSNorm", x, placeholder(op, 1.0, x), epsilon=self._eps, stash_type=stash)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        parts = [bindings.get("norm"), bindings.get("eps_form"), bindings.get("mean")]
        return ".".join(p for p in parts if p)


class StandardRMSNormFusion(Rule):
    """The standard RMSNormalization (opset 23) over the last axis -> mograph.RMSNorm(x, scale)."""

    min_candidate_nodes = 1

    def pattern(self, op: Any, x: Any, scale: Any) -> Any:
        return op.RMSNormalization(x, scale, _outputs=["y"])

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              x: ir.Value, scale: ir.Value, y: ir.Value, **_: Any) -> MatchResult:
        node = y.producer()
        assert node is not None
        axis = node.attributes.get("axis")
        ax = -1 if axis is None else int(axis.value)
        rank = len(x.shape) if x.shape is not None else None
        if not (ax == -1 or (rank is not None and ax == rank - 1)):
            return self.fail(f"RMSNormalization '{node.name}' is not over the last axis", node)
        if not is_float(x) or not body_supports(getattr(self, "model_opset", 23), x.dtype):
            return self.fail(f"RMSNormalization '{node.name}' is not over a floating-point input", node)
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, scale: ir.Value, y: ir.Value, **_: Any) -> Any:
        node = y.producer()
        assert node is not None
        eps = node.attributes.get("epsilon")
        stash = node.attributes.get("stash_type")
        return mograph_op(op, "RMSNorm", x, scale, epsilon=1e-5 if eps is None else float(eps.value),  # ONNX default
                          stash_type=1 if stash is None else int(stash.value))


class FuseRMSNormPass(FusionPass):
    """Fuse RMSNorm subgraphs (with or without epsilon, any exporter's form) into one RMSNorm op."""

    name = "fuse-rmsnorm"
    canonicalize = True
    options: ClassVar[tuple[Option, ...]] = (EXPLAIN_OPTION, TARGET_OPTION)

    def make_rules(self) -> list[Rule]:
        rules: list[Rule] = [RMSNormFusion(), NormCastFusion(("RMSNorm",)), NormScaleFusion(("RMSNorm",))]
        if adopts_standard_ops(self.config):  # opset 23's own RMSNormalization -> ORT's kernel
            rules.insert(0, StandardRMSNormFusion())
        return rules
