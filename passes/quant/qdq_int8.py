"""``qdq-int8``: INT8 Q/DQ at the inputs of MatMul, Gemm and Conv, calibrated on the user's data.

Weights are symmetric INT8 with one scale per output channel; activations are per-tensor, asymmetric
UINT8 by default (``--activation-type int8`` for symmetric INT8).  UINT8 activations with INT8 weights
(U8S8) is the combination ONNX Runtime's CPU kernels run fastest: with graph optimizations on, its QDQ
transformer turns ``DQ → MatMul`` into ``MatMulIntegerToFloat`` (bias ``Add`` folded in),
``DQ → Conv → Q`` into ``QLinearConv`` and ``DQ → Gemm → Q`` into ``QGemm``; TensorRT consumes the same
explicit Q/DQ graph.  Placement, default precision rules and the plan are described in
:mod:`mograph.passes.quant._qdq` and :mod:`mograph.passes.quant.plan`; calibration in
:mod:`mograph.passes.quant.calibration`.

Needs opset 13 or later (per-channel ``DequantizeLinear``).
"""

from __future__ import annotations

import onnx_ir as ir
from mograph.passes.quant._base import CALIBRATION_OPTIONS, PLAN_OPTIONS, QDQ_OPTIONS, QdqPassBase
from mograph.passes.quant._qdq import INT8_S8, INT8_U8, Scheme

from mograph.errors import ModelError
from mograph.pass_infra import Option

__all__ = ["QdqInt8Pass"]


class QdqInt8Pass(QdqPassBase):
    """Insert INT8 Q/DQ (per-channel weights, per-tensor activations) calibrated on --calibration-data."""

    name = "qdq-int8"
    family = "quant"
    precision = "int8"
    options = (
        *CALIBRATION_OPTIONS,
        *QDQ_OPTIONS,
        *PLAN_OPTIONS,
        Option(
            "activation-type",
            str,
            "uint8",
            "activation element type: uint8 (asymmetric, fastest on ORT CPU) or int8 (symmetric)",
            choices=("uint8", "int8"),
        ),
    )

    def scheme(self) -> Scheme:
        return INT8_S8 if self.config.get("activation_type") == "int8" else INT8_U8

    def check_model(self, model: ir.Model) -> None:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        if opset < 13:
            raise ModelError(f"{self.name}: needs opset >= 13 for per-channel DequantizeLinear (model has {opset})")
