"""``qdq-fp8``: FP8 (E4M3) Q/DQ for TensorRT targets, per-tensor scales.

Same placement, default rules, calibration and plan as ``qdq-int8``, with FP8 E4M3 (``float8e4m3fn``,
largest finite value 448) instead of INT8: each activation and each weight gets one scale,
``amax / 448``, and a zero point of type ``float8e4m3fn`` (value 0), which is what makes
``QuantizeLinear`` produce FP8 (opset 19+).  Weights are stored as FP8 initializers followed by a
``DequantizeLinear``; biases stay in float (TensorRT keeps FP8 GEMM bias in higher precision).

Needs the default opset 19 or later; the pass refuses older models rather than silently bumping the
opset (operators such as ``ReduceMean`` changed form on the way).
"""

from __future__ import annotations

import onnx_ir as ir
from mograph.passes.quant._base import CALIBRATION_OPTIONS, PLAN_OPTIONS, QDQ_OPTIONS, QdqPassBase
from mograph.passes.quant._qdq import FP8_E4M3, Scheme

from mograph.errors import ModelError

__all__ = ["QdqFp8Pass"]


class QdqFp8Pass(QdqPassBase):
    """Insert FP8 E4M3 Q/DQ with per-tensor scales (TensorRT targets; opset 19+)."""

    name = "qdq-fp8"
    family = "quant"
    precision = "fp8"
    options = (*CALIBRATION_OPTIONS, *QDQ_OPTIONS, *PLAN_OPTIONS)

    def scheme(self) -> Scheme:
        return FP8_E4M3

    def check_model(self, model: ir.Model) -> None:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        if opset < 19:
            raise ModelError(
                f"{self.name}: FP8 QuantizeLinear needs opset >= 19 (model has {opset}); re-export with opset 19+"
            )
