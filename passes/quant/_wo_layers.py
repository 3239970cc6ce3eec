"""The records of ``weight-only`` (:mod:`mograph.passes.quant.weight_only`): a weight layer and a layer
input's statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import _blockwise as bw

__all__ = ["_FLOAT_DTYPES", "_InputStats", "_Layer", "gemm_alpha"]

#: The weight dtypes the pass quantizes.
_FLOAT_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


@dataclass
class _Layer:
    node: ir.Node
    key: str
    weight: np.ndarray  # [K, N] float32, transB and alpha applied
    act: ir.Value
    bias: np.ndarray | None = None  # Gemm C (times beta), added after
    bias_value: ir.Value | None = None
    dtype: ir.DataType = ir.DataType.FLOAT
    quant: dict[int, tuple[bw.BlockQuantized, np.ndarray | None]] = field(default_factory=dict)  # bits -> (q, awq scale)

    def effective(self, bits: int) -> np.ndarray:
        """The weight the kernel multiplies by, in float (AWQ's input scale folded back)."""
        q, a = self.quant[bits]
        w = q.dequantize()
        return w / a[:, None] if a is not None else w


@dataclass
class _InputStats:
    hessian: np.ndarray
    abs_sum: np.ndarray
    rows: int = 0
    sample: np.ndarray | None = None
    keys: np.ndarray | None = None


def gemm_alpha(layer: _Layer) -> float:
    """The ``alpha`` a Gemm layer multiplies by (1 for a MatMul)."""
    if layer.node.op_type != "Gemm":
        return 1.0
    a = layer.node.attributes.get("alpha")
    return float(a.value) if a is not None else 1.0
