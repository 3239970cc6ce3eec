"""The TensorRT plugins that mograph's CUDA kernels implement, as declared data.

Each :class:`~mograph.custom_ops.TensorRTPlugin` is the contract between the ``lower`` step, whose
``tensorrt`` lowerings write plugin nodes, and the backend (:mod:`mograph.backends.tensorrt_plugins`,
over :mod:`mograph._kernels`), which builds them: inputs, outputs, fields with their defaults and
limits.  The ops that lower to a plugin name it in their declaration (``CustomOp.tensorrt_plugin``);
the table lives here, in the core, because both sides need it and neither may import the other.
"""

from __future__ import annotations

from mograph.custom_ops import TensorRTPlugin

__all__ = ["TENSORRT_PLUGINS"]

_EPSILON = {"minimum": {"epsilon": 0.0}}
_APPROXIMATE = {"choices": {"approximate": ("none", "tanh")}}

#: The mograph TensorRT plugins (implemented over the CUDA kernels by :mod:`mograph.backends.tensorrt_plugins`).
#: Gelu and FastGelu share the ``Gelu`` plugin (its ``approximate`` field), the bias forms ``BiasGelu``.
TENSORRT_PLUGINS: dict[str, TensorRTPlugin] = {
    p.name: p
    for p in (
        TensorRTPlugin("LayerNorm", ("X", "Scale", "B?"), ("Y",), {"epsilon": 1e-5}, vector_inputs=(1, 2),
                       doc="Y = (X - mean) / sqrt(var + epsilon) * Scale (+ B), over the last axis, var the "
                           "population variance", **_EPSILON),  # type: ignore[arg-type]
        TensorRTPlugin("RMSNorm", ("X", "Scale"), ("Y",), {"epsilon": 1e-6}, vector_inputs=(1,),
                       doc="Y = X / sqrt(mean(X^2) + epsilon) * Scale, over the last axis",
                       **_EPSILON),  # type: ignore[arg-type]
        TensorRTPlugin("SkipLayerNorm", ("X", "Skip", "Scale", "B?", "Bias?"), ("Y", "Sum?"),
                       {"epsilon": 1e-5, "sum_output": 0}, vector_inputs=(2, 3, 4), output_flag="sum_output",
                       choices={"sum_output": (0, 1)}, minimum={"epsilon": 0.0},
                       doc="Sum = X + Skip (+ Bias); Y = LayerNorm(Sum) with Scale (+ B); Sum is output 1 when "
                           "sum_output=1"),
        TensorRTPlugin("SkipRMSNorm", ("X", "Skip", "Scale", "Bias?"), ("Y", "Sum?"),
                       {"epsilon": 1e-6, "sum_output": 0}, vector_inputs=(2, 3), output_flag="sum_output",
                       choices={"sum_output": (0, 1)}, minimum={"epsilon": 0.0},
                       doc="Sum = X + Skip (+ Bias); Y = RMSNorm(Sum) with Scale; Sum is output 1 when sum_output=1"),
        TensorRTPlugin("Gelu", ("X",), ("Y",), {"approximate": "none"},
                       doc="Y = 0.5 X (1 + erf(X / sqrt 2)); approximate='tanh': 0.5 X (1 + tanh(sqrt(2/pi) "
                           "(X + 0.044715 X^3)))", **_APPROXIMATE),  # type: ignore[arg-type]
        TensorRTPlugin("BiasGelu", ("X", "Bias"), ("Y",), {"approximate": "none"}, vector_inputs=(1,),
                       doc="Y = Gelu(X + Bias), the sum kept in fp32; approximate as for Gelu",
                       **_APPROXIMATE),  # type: ignore[arg-type]
    )
}
