"""``fuse-bias-gelu``: ``Gelu(x + bias)`` -> ``mograph.BiasGelu`` / ``BiasFastGelu``.

Runs after ``fuse-gelu`` and matches its canonical output (``mograph`` ``Gelu``/``FastGelu``) or the
standard ``Gelu`` of opset 20 that an exporter wrote; never what a lowering writes for a target.
``bias`` must be a constant that broadcasts over the last axis only (the dense layer's bias,
``[hidden]``); the sum ``x + bias`` must not be read elsewhere.  A dense layer written as ``Gemm`` with its
bias in ``C`` and reshaped back to ``[batch, seq, N]`` (GPT-2's ``Conv1D`` in TorchScript exports) gives
its bias to the GELU the same way (:class:`GemmBiasGeluFusion`): the ``Gemm`` loses ``C``, so ONNX
Runtime's CUDA ``Gemm`` launches no bias-broadcast kernel and the fused GELU adds the bias.  The ``lower`` step turns the op into
``com.microsoft`` ``BiasGelu``/``FastGelu`` with bias (``ort``), ``Add`` + ``Gelu`` (``onnx`` and
``tensorrt`` at opset >= 20), or the ``BiasGelu`` TensorRT plugin (``tensorrt`` below opset 20).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from mograph.passes.fusion._common import FusionPass, is_float, mograph_op
from mograph.passes.fusion.skip_layernorm import check_gemm_bias, gemm_bias_pattern, gemm_without_bias

from mograph.custom_ops import DOMAIN
from mograph.patterns import MatchResult, OrValue, Rule, Var, constant_array

__all__ = ["BiasGeluFusion", "GemmBiasGeluFusion", "FuseBiasGeluPass"]


def _constant(context: Any, value: ir.Value) -> MatchResult:
    result = MatchResult()
    return result if constant_array(value) is not None else result.fail("bias is not a constant")


class BiasGeluFusion(Rule):
    """Gelu(x + bias) with a constant 1-D bias -> mograph.BiasGelu(x, bias) (or BiasFastGelu)."""

    min_candidate_nodes = 2

    def pattern(self, op: Any, x: Any) -> Any:
        s = op.Add(x, Var("bias", check=_constant))
        return OrValue(
            [
                op.Gelu(s, _domain=DOMAIN, _outputs=["g"]),
                op.FastGelu(s, _domain=DOMAIN, _outputs=["g"]),
                op.Gelu(s, _outputs=["g"]),
            ],
            tag_var="form",
            tag_values=["exact", "tanh", "onnx"],
        )

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              x: ir.Value, bias: ir.Value, g: ir.Value, form: str, **_: Any) -> MatchResult:
        node = g.producer()
        assert node is not None
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


class GemmBiasGeluFusion(Rule):
    """Gelu(Reshape(Gemm(x, W, bias))) -> mograph.BiasGelu(Reshape(Gemm(x, W)), bias) (or BiasFastGelu)."""

    min_candidate_nodes = 3

    def pattern(self, op: Any, ga: Any, gw: Any, gshape: Any) -> Any:
        s = gemm_bias_pattern(op, ga, gw, gshape)
        return OrValue(
            [
                op.Gelu(s, _domain=DOMAIN, _outputs=["g"]),
                op.FastGelu(s, _domain=DOMAIN, _outputs=["g"]),
                op.Gelu(s, _outputs=["g"]),
            ],
            tag_var="form",
            tag_values=["exact", "tanh", "onnx"],
        )

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              gemm_out: ir.Value, proj: ir.Value, gemm_bias: ir.Value, g: ir.Value, form: str,
              **_: Any) -> MatchResult:
        node = g.producer()
        assert node is not None
        if form == "onnx":
            approx = node.attributes.get("approximate")
            form = "tanh" if approx is not None and approx.value == "tanh" else "exact"
        if not is_float(proj):
            return self.fail(f"input '{proj.name}' is not a floating-point tensor", proj)
        self._form = form
        return check_gemm_bias(self, gemm_out, proj, gemm_bias)

    def rewrite(self, op: Any, gemm_out: ir.Value, proj: ir.Value, gemm_bias: ir.Value, **_: Any) -> Any:
        x, bias = gemm_without_bias(op, gemm_out, proj, gemm_bias)
        return mograph_op(op, "BiasFastGelu" if self._form == "tanh" else "BiasGelu", x, bias)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        return self._form


class FuseBiasGeluPass(FusionPass):
    """Fuse a bias Add feeding a GELU into one BiasGelu op (run after fuse-gelu)."""

    name = "fuse-bias-gelu"
    rules = (BiasGeluFusion, GemmBiasGeluFusion)
