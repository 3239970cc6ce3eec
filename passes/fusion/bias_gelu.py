"""``fuse-bias-gelu``: ``Gelu(x + bias)`` -> ``mograph.BiasGelu`` / ``BiasFastGelu``.

Runs after ``fuse-gelu`` and matches its output in every lowered form (``mograph`` ``Gelu``/
``FastGelu``, standard ``Gelu``, ``com.microsoft`` ``Gelu``/``FastGelu``, and with ``--target tensorrt``
the ``Gelu`` plugin node).  ``bias`` must be a
constant that broadcasts over the last axis only (the dense layer's bias, ``[hidden]``); the sum
``x + bias`` must not be read elsewhere.  Lowers to ``com.microsoft`` ``BiasGelu``/``FastGelu`` with
bias (``ort``), nothing for ``onnx`` and ``tensorrt`` at opset >= 20 (``Add`` + ``Gelu`` is already standard;
the pass is a no-op there) or the ``BiasGelu`` plugin (``tensorrt`` below opset 20).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from mograph.passes.fusion._common import FusionPass, is_float, mograph_op

from mograph.custom_ops import DOMAIN
from mograph.patterns import MatchResult, OrValue, Rule, Var, constant_array

__all__ = ["BiasGeluFusion", "FuseBiasGeluPass"]

MS = "com.microsoft"


def _constant(context: Any, value: ir.Value) -> MatchResult:
    result = MatchResult()
    return result if constant_array(value) is not None else result.fail("bias is not a constant")


class BiasGeluFusion(Rule):
    """Gelu(x + bias) with a constant 1-D bias -> mograph.BiasGelu(x, bias) (or BiasFastGelu).

    With ``plugins`` (``--target tensorrt``) a ``Gelu`` TensorRT plugin node (what ``fuse-gelu`` left)
    is taken too, its form read from its ``approximate`` attribute; it becomes a ``BiasGelu`` plugin.
    """

    min_candidate_nodes = 2

    def __init__(self, plugins: bool = False) -> None:
        super().__init__()
        self.plugins = plugins

    def pattern(self, op: Any, x: Any) -> Any:
        s = op.Add(x, Var("bias", check=_constant))
        return OrValue(
            [
                op.Gelu(s, _domain=DOMAIN, _outputs=["g"]),
                op.FastGelu(s, _domain=DOMAIN, _outputs=["g"]),
                op.Gelu(s, _outputs=["g"]),
                op.Gelu(s, _domain=MS, _outputs=["g"]),
                op.FastGelu(s, _domain=MS, _outputs=["g"]),
            ],
            tag_var="form",
            tag_values=["exact", "tanh", "onnx", "exact", "tanh"],
        )

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              x: ir.Value, bias: ir.Value, g: ir.Value, form: str, **_: Any) -> MatchResult:
        node = g.producer()
        assert node is not None
        if "plugin_namespace" in node.attributes:
            if not self.plugins or node.op_type != "Gelu":
                return self.fail("the GELU is already a TensorRT plugin node (and the target is not tensorrt)", node)
            form = "onnx"  # the plugin's approximate attribute says which
        if form == "onnx":
            approx = node.attributes.get("approximate")
            form = "tanh" if approx is not None and approx.value == "tanh" else "exact"
        if not is_float(x):
            return self.fail(f"input '{x.name}' is not a floating-point tensor", x)
        arr = constant_array(bias)
        if arr is None:
            return self.fail(f"bias '{bias.name}' is not a constant", bias)
        if arr.ndim != 1 or arr.size < 1:
            return self.fail(f"bias '{bias.name}' is not 1-D (shape {list(arr.shape)})", bias)
        if x.shape is None or len(x.shape) < 1:
            return self.fail(f"the rank of '{x.name}' is unknown", x)
        hidden = x.shape[-1]
        if isinstance(hidden, int) and hidden != arr.size:
            return self.fail(f"bias has {arr.size} elements, the last axis {hidden}", bias)
        if bias.dtype != x.dtype:
            return self.fail("bias dtype differs from the input's", bias)
        self._form = form
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, bias: ir.Value, **_: Any) -> Any:
        return mograph_op(op, "BiasFastGelu" if self._form == "tanh" else "BiasGelu", x, bias)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        return self._form


class FuseBiasGeluPass(FusionPass):
    """Fuse a bias Add feeding a GELU into one BiasGelu op (run after fuse-gelu)."""

    name = "fuse-bias-gelu"
    onnx_noop_opset = 20
    tensorrt_noop_opset = 20  # Add + Gelu: TensorRT's own layers

    def make_rules(self) -> list[Rule]:
        return [BiasGeluFusion(plugins=self.config["target"] == "tensorrt")]
