"""The ``ort`` attention lowering builds transformers' key-padding bias on the device.

transformers (5.x) builds BERT's bias from index comparisons: ``Range``s over the mask's dims, ``Range >= 0`` And-ed
with the padding lookup ``mask[b, t]`` (TorchScript: a flat ``Gather`` at ``b * T + t``; dynamo: ``GatherND`` of
``[b, t]`` pairs), then ``Where(keep, 0, min)``.  The Ranges and index arithmetic run on the host in ONNX Runtime's
CUDA provider and the result is copied to the device (a ``Memcpy``: no CUDA graph).  The lowering rebuilds the
same bias as ``Where(Unsqueeze(bool(mask)), 0, min)`` from the mask input (stat ``device_padding_bias``).
"""

from __future__ import annotations

import numpy as np
import pytest
from _fusion_util import lowered
from mograph.passes.fusion.attention import FuseAttentionPass
from test_attention import HID, B, S, attention_text

from mograph.cuda_graph import cuda_graph_check
from mograph.testing import assert_close, parse, run_ort, run_pass, to_proto
from mograph.testing import check_pass as check_fusion

MIN = float(np.finfo(np.float32).min)


def _index_lines(lookup: str, query_bound: int) -> list[str]:
    """The bias ``[B, 1, S, T]`` from ``attention_mask`` as transformers 5 traces it (see the module docstring)."""
    lines = ["msh = Shape(attention_mask)", "nb = Gather<axis=0>(msh, zero_s)", "nt = Gather<axis=0>(msh, one_s)",
             "rb = Range(zero_s, nb, one_s)", "rt = Range(zero_s, nt, one_s)",
             "bi = Unsqueeze(rb, ax123)", "ti = Unsqueeze(rt, ax012)", "qi = Unsqueeze(rt, ax013)",
             f"ge = GreaterOrEqual(qi, {'zero_s' if query_bound == 0 else 'one_s'})",
             "mb = Cast<to=9>(attention_mask)"]
    if lookup == "flat":  # TorchScript
        lines += ["tlen = Shape<start=1>(attention_mask)", "bt = Mul(bi, tlen)", "idx = Add(ti, bt)",
                  "flat = Flatten<axis=2>(mb)", "g = Gather<axis=0>(flat, idx)", "g1 = Reshape(g, minus1)",
                  "ish = Shape(idx)", "pad = Reshape(g1, ish)"]
    elif lookup.startswith("flat-merged"):  # TorchScript after simplify-shapes: one Reshape to [0, 1, 1, 0]
        target = "keep4" if lookup == "flat-merged" else "other4"
        lines += ["tlen = Shape<start=1>(attention_mask)", "bt = Mul(bi, tlen)", "idx = Add(ti, bt)",
                  "flat = Flatten<axis=2>(mb)", "g = Gather<axis=0>(flat, idx)", f"pad = Reshape(g, {target})"]
    else:  # dynamo
        lines += ["sh4 = Concat<axis=0>(nb1, ones2, nt1)", "be = Expand(bi, sh4)", "te = Expand(ti, sh4)",
                  "bu = Unsqueeze(be, last)", "tu = Unsqueeze(te, last)", "pairs = Concat<axis=-1>(bu, tu)",
                  "pad = GatherND(mb, pairs)"]
        lines[1:3] += ["nb1 = Unsqueeze(nb, zero1)", "nt1 = Unsqueeze(nt, zero1)"]
    lines += ["keep = And(ge, pad)", "bias = Where(keep, fzero, fmin)"]
    return lines


def masked_text(lookup: str = "flat", query_bound: int = 0) -> str:
    """The attention core of :func:`test_attention.attention_text` with transformers' index-built padding bias
    (``query_bound`` 1: ``Range >= 1`` is not all true, a near miss)."""
    text = attention_text()
    text = text.replace(f", float[{B},1,1,{S}] bias)", ", int64[batch,seq] attention_mask)")
    text = text.replace(f"float[{B},{S},{HID}] ", f"float[batch,seq,{HID}] ")
    inits = ["int64 zero_s = {0}", "int64 one_s = {1}", "int64[3] ax123 = {1,2,3}", "int64[3] ax012 = {0,1,2}",
             "int64[3] ax013 = {0,1,3}", "int64[1] minus1 = {-1}", "int64[1] zero1 = {0}", "int64[2] ones2 = {1,1}",
             "int64[1] last = {-1}", "int64[4] keep4 = {0,1,1,0}", "int64[4] other4 = {0,1,0,-1}",
             "float fzero = {0}", f"float fmin = {{{MIN!r}}}"]
    text = text.replace("> {\n", f", {', '.join(inits)}> {{\n  " + "\n  ".join(_index_lines(lookup, query_bound)) + "\n", 1)
    return text


def _feeds(batch: int = 3, seq: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((batch, seq, HID)).astype(np.float32) for n in ("q", "k", "v")}
    mask = np.ones((batch, seq), np.int64)
    mask[1:2, seq - 2:] = 0  # right padding (where there is a second row)
    mask[2:3, :3] = 0  # left padding
    return {**feeds, "attention_mask": mask}


@pytest.mark.parametrize("lookup", ["flat", "flat-merged", "gather-nd"])
def test_index_built_padding_bias_built_on_the_device(lookup: str) -> None:
    """TorchScript's and dynamo's lookups: the bias becomes Cast/Unsqueeze/Where of the mask input (expanded to the
    query length through a host shape, which the CUDA kernel reads on the host): capturable, the same numbers."""
    proto = parse(masked_text(lookup))
    before = run_pass(lowered(FuseAttentionPass(), "onnx"), proto)[0]  # the export's bias, as it was lowered before
    assert not cuda_graph_check(before).capturable
    stats = {"AttentionFusion": 1, "AttentionFusion.div.mask": 1, "lowered.Attention": 1, "device_padding_bias": 1,
             "bias_expansions": 1}
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats=stats, feeds=_feeds(),
                         ops_left=["Cast", "Constant", "Unsqueeze", "Where", "Constant", "Constant", "Shape", "Gather",
                                   "Concat", "Expand", "com.microsoft.MultiHeadAttention"])
    report = cuda_graph_check(model)
    assert report.capturable, report.blockers
    for batch, seq in ((1, 4), (4, 9)):
        feeds = _feeds(batch, seq)
        assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), rel=1e-5)


def test_padding_bias_not_provably_the_mask_stays_and_blocks() -> None:
    """Near miss: ``Range >= 1`` hides query 0 (not all true): the export's bias stays as it is, and the capture
    check names the host value it reads (never a false yes)."""
    proto = parse(masked_text(query_bound=1))
    stats = {"AttentionFusion": 1, "AttentionFusion.div.mask": 1, "lowered.Attention": 1}
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats=stats, feeds=_feeds())
    assert "Flatten" in [n.op_type for n in model.graph]
    report = cuda_graph_check(model)
    assert not report.capturable
    assert {b["op"] for b in report.blockers} >= {"And", "Gather"}


def test_merged_lookup_reshape_not_provably_the_index_shape_stays() -> None:
    """Near miss: the one Reshape after the lookup has a target with a -1 (``[0, 1, 0, -1]``: the same layout here,
    but not provably the index's shape entry by entry): the export's bias stays and the check names its blockers."""
    proto = parse(masked_text("flat-merged-other"))
    stats = {"AttentionFusion": 1, "AttentionFusion.div.mask": 1, "lowered.Attention": 1}
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats=stats, feeds=_feeds())
    assert "Flatten" in [n.op_type for n in model.graph]
    assert not cuda_graph_check(model).capturable
