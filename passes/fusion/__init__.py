"""Built-in plugin ``mograph.passes.fusion``: fusion passes, the ``fuse`` preset and the fused ops.

Passes (preset ``fuse``, in this order): ``fuse-layernorm``, ``fuse-rmsnorm``, ``fuse-embed-layernorm``,
``fuse-skip-layernorm``, ``fuse-gelu``, ``fuse-bias-gelu``, ``fuse-attention``.  Each fuses into ops of the versioned
``mograph`` domain (declared once, in :mod:`.ops` and :mod:`.attention_op`, through
``mograph_add_custom_ops``, with their lowerings from :mod:`.lowerings`); the ``lower`` step
(:mod:`mograph.lowering`) lowers them for ``--target``.
"""

from __future__ import annotations

from mograph.passes.fusion.attention import FuseAttentionPass
from mograph.passes.fusion.bias_gelu import FuseBiasGeluPass
from mograph.passes.fusion.embed_layernorm import FuseEmbedLayerNormPass
from mograph.passes.fusion.gelu import FuseGeluPass
from mograph.passes.fusion.layernorm import FuseLayerNormPass
from mograph.passes.fusion.rmsnorm import FuseRMSNormPass
from mograph.passes.fusion.skip_layernorm import FuseSkipLayerNormPass

from mograph.hookspecs import hookimpl
from mograph.pass_infra import Pass

__all__ = ["FuseAttentionPass", "FuseBiasGeluPass", "FuseEmbedLayerNormPass", "FuseGeluPass", "FuseLayerNormPass", "FuseRMSNormPass", "FuseSkipLayerNormPass", "FUSE"]

FUSE = ["fuse-layernorm", "fuse-rmsnorm", "fuse-embed-layernorm", "fuse-skip-layernorm", "fuse-gelu", "fuse-bias-gelu", "fuse-attention"]


def _passes() -> list[type[Pass]]:
    out: list[type[Pass]] = [FuseLayerNormPass, FuseRMSNormPass, FuseEmbedLayerNormPass, FuseSkipLayerNormPass, FuseGeluPass, FuseBiasGeluPass,
                              FuseAttentionPass]
    return out


@hookimpl
def mograph_add_passes() -> list[type[Pass]]:
    return _passes()


@hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    names = {p.name for p in _passes()}
    return {"fuse": [n for n in FUSE if n in names]}


@hookimpl
def mograph_add_custom_ops() -> list:
    from mograph.passes.fusion._common import fused_ops

    return list(fused_ops().values())
