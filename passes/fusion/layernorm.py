"""``fuse-layernorm``: LayerNorm written out in primitive ops -> one ``mograph.LayerNorm``.

The math matched, over the last axis of ``x``::

    m   = E[x]                      ReduceMean (axes attribute < opset 18, input >= 18) or ReduceSum / N
    var = E[(x - m)^2]              square as Mul(d, d) or Pow(d, 2)
        | E[x^2] - E[x]^2           (the one-pass form), optionally clamped by Max(var, 0)
    y   = (x - m) / sqrt(var + eps)       Div by Sqrt
        | (x - m) * 1/sqrt(var + eps)     Mul by Reciprocal(Sqrt)
        | (x - m) * (var + eps)^-0.5      Mul by Pow(., -0.5)   (or Div by Pow(., 0.5))
    y   = y * scale + bias          both optional, absorbed by the rules of :mod:`._absorb`

``eps`` must be a non-negative constant (initializer, ``Constant``, ``Cast`` of one ...). fp16/bf16
graphs that ``Cast`` to float32 around the reduction fuse into one op with ``stash_type`` float32
and the model's dtype outside.  Inputs must be float types; below opset 15 only float32 (the function
body has no ``CastLike`` there).  The fused op is :mod:`ops` ``LayerNorm``; the ``lower`` step turns it
into ``LayerNormalization`` (opset >= 17 for ``onnx``/``tensorrt``, any opset for ``ort``) or the
``LayerNorm`` TensorRT plugin.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from mograph.passes.fusion._absorb import NormBiasFusion, NormCastFusion, NormScaleFusion
from mograph.passes.fusion._common import (
    NORM_ANCHOR,
    FusionPass,
    check_norm_input,
    divide_by_root,
    mean_last,
    mograph_op,
    placeholder,
    square,
)

from mograph.patterns import MatchResult, OrValue, Rule, const

__all__ = ["LayerNormFusion", "FuseLayerNormPass"]


class LayerNormFusion(Rule):
    """(x - E[x]) / sqrt(Var[x] + eps) over the last axis -> mograph.LayerNorm(x, 1, 0)."""

    anchors = (NORM_ANCHOR,)
    min_candidate_nodes = 4

    def pattern(self, op: Any, x: Any, eps: Any) -> Any:
        mean = mean_last(op, x, tag="mean")
        d_norm = op.Sub(x, mean)
        d_var = op.Sub(x, mean)
        var = OrValue(
            [mean_last(op, square(op, d_var)), op.Sub(mean_last(op, square(op, x)), square(op, mean))],
            tag_var="var",
            tag_values=["centered", "moments"],
        )
        clamped = OrValue([op.Max(var, const(0.0)), var], tag_var="clamp", tag_values=["max0", ""])
        return divide_by_root(op, d_norm, op.Add(clamped, eps))

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              x: ir.Value, eps: ir.Value, **_: Any) -> MatchResult:
        value = check_norm_input(self, x, eps)
        if isinstance(value, MatchResult):
            return value
        self._eps = value
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> Any:
        stash = int(ir.DataType.DOUBLE if x.dtype == ir.DataType.DOUBLE else ir.DataType.FLOAT)
        return mograph_op(op, "LayerNorm", x, placeholder(op, 1.0, x), placeholder(op, 0.0, x),
                          epsilon=self._eps, stash_type=stash)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        parts = [bindings.get("norm"), bindings.get("var"), bindings.get("mean"), bindings.get("clamp")]
        return ".".join(p for p in parts if p)


class FuseLayerNormPass(FusionPass):
    """Fuse LayerNorm subgraphs (any exporter's form) into one LayerNorm op."""

    name = "fuse-layernorm"
    canonicalize = True

    def make_rules(self) -> list[Rule]:
        return [
            LayerNormFusion(),
            NormCastFusion(("LayerNorm",)),
            NormScaleFusion(("LayerNorm",)),
            NormBiasFusion(),
        ]
