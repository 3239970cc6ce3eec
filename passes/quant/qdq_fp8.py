"""``qdq-fp8``: FP8 (E4M3) Q/DQ for TensorRT targets, per-tensor scales.

Same placement, default rules, calibration and plan as ``qdq-int8``, with FP8 E4M3 (``float8e4m3fn``,
largest finite value 448) instead of INT8: each activation and each weight gets one scale,
``amax / 448``, and a zero point of type ``float8e4m3fn`` (value 0), which is what makes
``QuantizeLinear`` produce FP8 (opset 19+).  Weights are stored as FP8 initializers followed by a
``DequantizeLinear``; biases stay in float (TensorRT keeps FP8 GEMM bias in higher precision).

Needs the default opset 19 or later: an older model's opset is raised with ``onnx.version_converter``
(operators such as ``ReduceMean`` change form on the way; the report lists what was rewritten), and a
model whose ops do not convert cleanly is refused in one line.
"""

from __future__ import annotations

from mograph.passes.quant._base import CALIBRATION_OPTIONS, PLAN_OPTIONS, QDQ_OPTIONS, QdqPassBase
from mograph.passes.quant._qdq import FP8_E4M3, Scheme

__all__ = ["QdqFp8Pass"]


class QdqFp8Pass(QdqPassBase):
    """Insert FP8 E4M3 Q/DQ with per-tensor scales (TensorRT targets; raises the opset to 19 if needed)."""

    name = "qdq-fp8"
    family = "quant"
    precision = "fp8"
    options = (*CALIBRATION_OPTIONS, *QDQ_OPTIONS, *PLAN_OPTIONS)
    min_opset = 19
    min_opset_reason = "FP8 QuantizeLinear (19)"

    def scheme(self) -> Scheme:
        return FP8_E4M3
