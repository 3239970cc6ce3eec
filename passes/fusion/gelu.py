"""``fuse-gelu``: the GELU family written out in primitive ops -> ``mograph.Gelu`` / ``FastGelu`` / ``QuickGelu``.

Forms matched (``x`` any float tensor; constants within 0.1 % so float16 roundings match)::

    exact    0.5 x (1 + erf(x / sqrt(2)))        x / sqrt(2) as Div(x, 1.4142) or Mul(x, 0.7071)
    tanh     0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
             inner also as sqrt(2/pi) x + 0.0356774 x^3, or sqrt(2/pi) x (1 + 0.044715 x^2);
             x^3 as Pow(x, 3), x*x*x in any grouping
    sigmoid  x sigmoid(1.702 x)                  (QuickGelu)

and the outer ``0.5 x (1 + t)`` in every association: ``(x * 0.5) * (1 + t)``, ``x * (0.5 * (1 + t))``,
``(x * (1 + t)) * 0.5``, ``(x * (1 + t)) / 2``; both inputs of every Add/Mul in either order.
The ``lower`` step turns the ops into ``Gelu`` (``onnx`` at opset >= 20), ``com.microsoft``
``Gelu``/``FastGelu``/``QuickGelu`` (``ort``), or the ``Gelu`` plugin (``tensorrt``).
"""

from __future__ import annotations

import math
from typing import Any

import onnx_ir as ir
from mograph.passes.fusion._common import FusionPass, is_float, mograph_op
from mograph.passes.fusion.ops import GELU_TANH_COEF, QUICK_GELU_ALPHA, SQRT_2, SQRT_2_OVER_PI, body_supports

from mograph.patterns import Anchor, MatchResult, OrValue, Rule, const

__all__ = ["GeluFusion", "GeluTanhFusion", "QuickGeluFusion", "FuseGeluPass", "half_x_times"]


def half_x_times(op: Any, x: Any, one_plus: Any) -> Any:
    """``0.5 * x * one_plus`` in each association exporters write (alternatives for the root)."""
    return OrValue(
        [
            op.Mul(op.Mul(x, const(0.5)), one_plus),
            op.Mul(x, op.Mul(one_plus, const(0.5))),
            op.Mul(op.Mul(x, one_plus), const(0.5)),
            op.Div(op.Mul(x, one_plus), const(2.0)),
        ],
        tag_var="assoc",
        tag_values=["(x*0.5)*t", "x*(t*0.5)", "(x*t)*0.5", "(x*t)/2"],
    )


class _GeluRule(Rule):
    min_candidate_nodes = 4
    op_name = "Gelu"

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              x: ir.Value, **_: Any) -> MatchResult:
        if not is_float(x):
            return self.fail(f"input '{x.name}' is not a floating-point tensor", x)
        opset = getattr(self, "model_opset", 17)
        if not body_supports(opset, x.dtype):
            return self.fail(f"a {x.dtype} GELU needs opset >= 15 for its function body (model has {opset})", x)
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> Any:
        return mograph_op(op, self.op_name, x)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        parts = [bindings.get("assoc"), bindings.get("scale"), bindings.get("inner"), bindings.get("cube")]
        return ".".join(str(p) for p in parts if p)


class GeluFusion(_GeluRule):
    """0.5 x (1 + erf(x / sqrt 2)) -> mograph.Gelu(x)."""

    anchors = (Anchor(("Erf",), "gelu"),)

    def pattern(self, op: Any, x: Any) -> Any:
        scaled = OrValue([op.Div(x, const(SQRT_2)), op.Mul(x, const(1.0 / SQRT_2))],
                         tag_var="scale", tag_values=["div-sqrt2", "mul-inv-sqrt2"])
        return half_x_times(op, x, op.Add(op.Erf(scaled), const(1.0)))


class GeluTanhFusion(_GeluRule):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) -> mograph.FastGelu(x)."""

    op_name = "FastGelu"
    min_candidate_nodes = 5
    anchors = (Anchor(("Tanh",), "gelu"),)

    def pattern(self, op: Any, x: Any) -> Any:
        cube = OrValue([op.Pow(x, const(3.0)), op.Mul(op.Mul(x, x), x)], tag_var="cube",
                       tag_values=["pow3", "x*x*x"])
        inner = OrValue(
            [
                op.Mul(op.Add(x, op.Mul(cube, const(GELU_TANH_COEF))), const(SQRT_2_OVER_PI)),
                op.Add(op.Mul(x, const(SQRT_2_OVER_PI)), op.Mul(cube, const(SQRT_2_OVER_PI * GELU_TANH_COEF))),
                op.Mul(op.Mul(x, const(SQRT_2_OVER_PI)),
                       op.Add(op.Mul(op.Mul(x, x), const(GELU_TANH_COEF)), const(1.0))),
            ],
            tag_var="inner",
            tag_values=["c*(x+a*x3)", "c*x+c*a*x3", "c*x*(1+a*x2)"],
        )
        return half_x_times(op, x, op.Add(op.Tanh(inner), const(1.0)))


class QuickGeluFusion(_GeluRule):
    """x sigmoid(1.702 x) -> mograph.QuickGelu(x, alpha=1.702)."""

    op_name = "QuickGelu"
    min_candidate_nodes = 3
    anchors = (Anchor(("Sigmoid",), "gelu"),)

    def pattern(self, op: Any, x: Any) -> Any:
        return op.Mul(x, op.Sigmoid(op.Mul(x, const(QUICK_GELU_ALPHA))))

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> Any:
        return mograph_op(op, "QuickGelu", x, alpha=QUICK_GELU_ALPHA)


class FuseGeluPass(FusionPass):
    """Fuse GELU subgraphs (exact erf, tanh approximation, sigmoid form) into one op each."""

    name = "fuse-gelu"
    canonicalize = True

    def make_rules(self) -> list[Rule]:
        return [GeluFusion(), GeluTanhFusion(), QuickGeluFusion()]


del math
