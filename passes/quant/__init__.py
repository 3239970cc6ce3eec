"""Built-in plugin ``mograph.passes.quant``: precision passes and the ``int8`` preset.

- ``qdq-int8`` (preset ``int8``): INT8 Q/DQ with calibration, default sensitivity rules, an optional
  accuracy budget and a per-node precision plan;
- ``qdq-fp8``: FP8 E4M3 Q/DQ with per-tensor scales (TensorRT targets; opset 19+);
- ``fp16``: FP16 conversion that keeps FP32 where calibration shows overflow or reductions are deep.
"""

from __future__ import annotations

from mograph.passes.quant.qdq_int8 import QdqInt8Pass

from mograph.hookspecs import hookimpl

__all__ = ["QdqInt8Pass"]

_PASSES: list[type] = [QdqInt8Pass]

try:  # the later passes are optional modules while they are being written
    from mograph.passes.quant.qdq_fp8 import QdqFp8Pass

    _PASSES.append(QdqFp8Pass)
    __all__.append("QdqFp8Pass")
except ImportError:  # pragma: no cover
    pass
try:
    from mograph.passes.quant.fp16 import Fp16Pass

    _PASSES.append(Fp16Pass)
    __all__.append("Fp16Pass")
except ImportError:  # pragma: no cover
    pass


@hookimpl
def mograph_add_passes() -> list[type]:
    return list(_PASSES)


@hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    return {"int8": ["qdq-int8"]}
