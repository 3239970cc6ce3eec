"""Built-in plugin ``mograph.passes.quant``: precision passes and the ``int8`` preset.

- ``qdq-int8`` (preset ``int8``): INT8 Q/DQ with calibration, default sensitivity rules, an optional
  accuracy budget and a per-node precision plan;
- ``qdq-fp8``: FP8 E4M3 Q/DQ with per-tensor scales (TensorRT targets; opset 19+, older models upgraded);
- ``kv-cache-fp8``: FP8 E4M3 Q/DQ on a decoder's KV-cache inputs/outputs (``past_*``/``present_*``), per-head
  scales from calibration, simulated (float I/O) or stored (``float8e4m3fn`` I/O, ``--kv-cache-io fp8``);
- ``fp16``: FP16 conversion that keeps FP32 where calibration shows overflow or reductions are deep;
- ``weight-only`` (preset ``int4``): block-wise INT4/INT8 weights of MatMul/Gemm (RTN, AWQ- or GPTQ-style)
  as ``mograph.WeightOnlyMatMul``, with a per-layer 4/8/float plan; the op is declared here too.

With a device (``--device cuda|cpu``, ``optimize(device=...)``) the presets follow the precision recipe of
:mod:`mograph.passes.quant.recipe` (``int4``/``int8`` on ONNX Runtime CUDA: weight-only ``MatMulNBits`` then
``fp16``), chosen from a table of measured kernel times.
"""

from __future__ import annotations

from mograph.passes.quant.fp16 import Fp16Pass
from mograph.passes.quant.kv_cache_fp8 import KvCacheFp8Pass
from mograph.passes.quant.qdq_fp8 import QdqFp8Pass
from mograph.passes.quant.qdq_int8 import QdqInt8Pass
from mograph.passes.quant.weight_only import WeightOnlyPass

from mograph.hookspecs import hookimpl
from mograph.pass_infra import Pass

__all__ = ["QdqInt8Pass", "QdqFp8Pass", "Fp16Pass", "WeightOnlyPass", "KvCacheFp8Pass"]


@hookimpl
def mograph_add_passes() -> list[type[Pass]]:
    return [QdqInt8Pass, QdqFp8Pass, Fp16Pass, WeightOnlyPass, KvCacheFp8Pass]


@hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    return {"int8": ["qdq-int8"], "int4": ["weight-only"]}


@hookimpl
def mograph_add_custom_ops() -> list:
    from mograph.passes.quant.gather_block_op import block_quantized_gather_op
    from mograph.passes.quant.weight_only_op import weight_only_matmul_op

    return [weight_only_matmul_op(), block_quantized_gather_op()]


@hookimpl
def mograph_precision_recipe(passes: list[str], options: dict, device: str) -> dict | None:
    """``int4`` / ``int8`` for the device named (:mod:`mograph.passes.quant.recipe`)."""
    from mograph.passes.quant.recipe import device_kind, resolve

    from mograph.errors import OptionError

    try:
        device_kind(device)
        recipe = resolve(passes, options, device)
    except ValueError as exc:
        raise OptionError(f"--device {device}: {exc}") from None
    return {"passes": recipe.passes, "options": recipe.options, "record": recipe.to_dict()}
