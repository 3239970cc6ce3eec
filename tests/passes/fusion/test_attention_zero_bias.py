"""fuse-attention drops a bias that is provably zero though computed: transformers 5.17's ViT mask.

ViT has no padding, but transformers 5.17 still builds a key mask of ones, ``Range(0, n) >= 0`` expanded to
``[B, 1, S, T]``, and turns it into the additive bias ``Where(keep, 0, min)``: all zero.  ONNX Runtime's transformers
optimizer drops it; passed on, it sends every layer down the attention-bias path on CUDA.
"""

from __future__ import annotations

import pytest
from _fusion_util import lowered
from mograph.passes.fusion.attention import FuseAttentionPass
from test_attention import B, S, _feeds, attention_text

from mograph.testing import check_pass as check_fusion
from mograph.testing import op_types, parse

_MASK = [
    "n = Gather<axis=0>(kshape, one)", "r = Range(zero, n, one)", "r1 = Unsqueeze(r, ax0)", "r2 = Unsqueeze(r1, ax0)",
    "r3 = Unsqueeze(r2, ax0)", "keep1 = GreaterOrEqual(r3, lo)", "keep = Expand(keep1, full)",
    "bias = Where(keep, fzero, fmin)",
]


def _vit_masked(*, zero: str = "0.0", bound: int = 0) -> str:
    text = attention_text()
    text = text.replace(f", float[{B},1,1,{S}] bias", "")
    inits = (f"int64 zero = {{0}}, int64 lo = {{{bound}}}, int64 one = {{1}}, int64[1] ax0 = {{0}}, int64[4] full = {{{B},1,{S},{S}}}, "
             f"float fzero = {{{zero}}}, float fmin = {{-3.4e38}}, ")
    text = text.replace("<float sc", f"<{inits}float sc", 1)
    lines = ["kshape = Shape(k)", *_MASK]
    return text.replace("{\n  q4 = ", "{\n  " + "\n  ".join(lines) + "\n  q4 = ", 1)


def test_computed_all_true_mask_bias_dropped():
    proto = parse(_vit_masked())
    stats = {"AttentionFusion": 1, "AttentionFusion.div.nomask": 1, "lowered.Attention": 1}
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats=stats, feeds=_feeds(proto),
                         ops_left=["com.microsoft.MultiHeadAttention"])  # the mask computation is gone too
    assert len(next(iter(model.graph)).inputs) == 3


@pytest.mark.parametrize("change", ["not zero where kept", "key 0 masked (>= 1)"])
def test_near_miss_bias_not_provably_zero_kept(change):
    proto = parse(_vit_masked(zero="0.5") if change.startswith("not") else _vit_masked(bound=1))
    stats = {"AttentionFusion": 1, "AttentionFusion.div.mask": 1, "lowered.Attention": 1}  # [B, 1, S, T]: no expansion
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats=stats, feeds=_feeds(proto))
    assert "Where" in op_types(model)  # the bias stays, with its computation
