"""How the fused ``mograph`` ops lower to each target: the lowerings their declarations carry.

One module per op family (:mod:`.norms`, :mod:`.embed`, :mod:`.gelu`, :mod:`.attention`, which packs quantized
Q/K/V projections through :mod:`.packed_nbits`); :func:`lowerings_for`
gives the table of one op, which :func:`mograph.passes.fusion.ops.custom_ops` puts into the op's
:class:`~mograph.custom_ops.CustomOp` declaration.  Nothing calls these functions directly: the one
``lower`` step (:mod:`mograph.lowering`) finds them through the custom-op registry.

Per target, in short (each module's docstring has the details):

``onnx``
    the standard op where the opset has one (``LayerNormalization`` 17, ``Gelu`` 20,
    ``RMSNormalization`` 23, ``Attention`` 23); ``SkipLayerNorm``/``BiasGelu`` become the ``Add`` and
    that standard op.  Otherwise the lowering declines and the step inlines the function body.
``ort``
    ONNX Runtime's kernels: ``LayerNormalization``, ``SimplifiedLayerNormalization`` (default domain,
    every opset), ``com.microsoft`` ``SkipLayerNormalization``, ``SkipSimplifiedLayerNormalization``,
    ``Gelu``, ``FastGelu``, ``QuickGelu``, ``BiasGelu``, ``Attention``/``MultiHeadAttention``,
    ``EmbedLayerNormalization``.
``tensorrt``
    native TensorRT layers where the ONNX parser has them (``LayerNormalization`` at opset >= 17,
    ``Gelu`` at >= 20, pointwise ops for ``QuickGelu``, the decomposed attention), otherwise a node of
    the op's TensorRT plugin (:attr:`~mograph.custom_ops.CustomOp.tensorrt_plugin`) in exactly the form
    the plugin takes, so the backend only validates it.
"""

from __future__ import annotations

from mograph.custom_ops import Lowering

__all__ = ["lowerings_for"]


def lowerings_for(name: str) -> dict[str, Lowering]:
    """The lowerings (target -> function) of the fused op ``name``."""
    from mograph.passes.fusion.lowerings import attention, embed, gelu, norms

    for module in (norms, embed, gelu, attention):
        table = module.LOWERINGS.get(name)
        if table is not None:
            return dict(table)
    return {}
