"""The ORT attention lowering (``lower --target ort`` of ``mograph.Attention``,
:mod:`mograph.passes.fusion.lowerings.attention`): bert_tiny through each target and ``--mask-format``, and
causal masks, KV caches, padding lengths and rotary tables reaching the kernels' own forms.

Numerics are checked with ONNX Runtime's own optimizations off, on feeds whose attention mask has padded
positions (zeros), so the masked softmax is exercised.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from _fusion_util import lowered, mask_index_inputs
from mograph.passes.fusion.attention import FuseAttentionPass

from models.builders import bert_feeds, bert_tiny
from mograph.testing import assert_close, op_counts, parse, run_ort, run_pass, to_ir, to_proto
from mograph.testing import check_pass as check_fusion

B, S, H, D = 2, 5, 4, 4
UNFUSED = {"Reshape", "Transpose", "Softmax"}  # what the attention core is made of


# ------------------------------------------------------------------ bert_tiny --------------------

BERT_STATS = {"AttentionFusion": 2, "AttentionFusion.div.mask": 2, "lowered.Attention": 2}


def padded_feeds(batch: int = 4, seq: int = 16) -> dict[str, np.ndarray]:
    """bert feeds whose mask has right padding, a fully padded row and left padding."""
    feeds = bert_feeds(batch, seq)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, 5:] = 0
    mask[2, :] = 0  # every key masked: the original gives a uniform softmax over all keys
    mask[3, :3] = 0
    feeds["attention_mask"] = mask
    return feeds


def right_padded_feeds(batch: int = 4, seq: int = 16) -> dict[str, np.ndarray]:
    """bert feeds whose every mask row is ones then zeros (at least one token)."""
    feeds = bert_feeds(batch, seq)
    mask = np.ones((batch, seq), dtype=np.int64)
    for row in range(1, batch):
        mask[row, seq - 3 * row:] = 0
    feeds["attention_mask"] = mask
    return feeds


@pytest.mark.parametrize("dynamic", [True, False])
def test_bert_tiny_ort_default_bias(dynamic: bool) -> None:
    """Default --mask-format bias: Attention with Q/K/V packed into one GEMM and the additive bias, exact for any
    padding (padded_feeds has right, left and full padding); one expansion of the bias when the query lengths are
    known equal."""
    proto = bert_tiny(dynamic=dynamic, batch=4)
    stats = {**BERT_STATS, "bias_expansions": 2 if dynamic else 1}  # no shape inference: two symbolic lengths
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats=stats, feeds=padded_feeds(), rel=1e-5)
    left = op_counts(model)
    assert left["com.microsoft.Attention"] == 2 and left["Expand"] == stats["bias_expansions"]
    assert "com.microsoft.MultiHeadAttention" not in left
    assert left["MatMul"] == 6  # per layer: output projection + 2 FFN; Q/K/V packed into the Attention
    assert not UNFUSED & set(left), left
    assert mask_index_inputs(model) == set()
    for node in model.graph:
        if node.op_type == "Attention":
            assert len(node.inputs) == 6 and node.inputs[5] is not None  # attention_bias
            assert node.inputs[3] is None and node.inputs[4] is None  # no mask_index, no past


@pytest.mark.parametrize("dynamic", [True, False])
def test_bert_tiny_ort_raw(dynamic: bool) -> None:
    """--mask-format raw: (1 - mask) * float32.min is traced to attention_mask: one Cast to int32 is the 2-D
    mask_index of both (packed) Attention nodes."""
    proto = bert_tiny(dynamic=dynamic, batch=4)
    feeds = padded_feeds()
    model = check_fusion(lowered(FuseAttentionPass(mask_format="raw"), "ort"), proto,
                         stats={**BERT_STATS, "mask_index_casts": 1}, feeds=feeds, rel=1e-5)
    left = op_counts(model)
    assert left["com.microsoft.Attention"] == 2
    assert not UNFUSED & set(left), left
    assert left["MatMul"] == 6  # per layer: output projection + 2 FFN; Q/K/V packed into the Attention
    before = op_counts(to_ir(proto))  # the float bias (Unsqueeze, Cast, Sub, Mul) is gone and nothing is expanded
    assert "Expand" not in left and left["Sub"] == before["Sub"] - 1
    assert not any(u.op_type == "Unsqueeze" for u, _ in model.graph.inputs[1].uses())
    (cast,) = [n for n in model.graph if n.op_type == "Cast"]
    assert cast.inputs[0].name == "attention_mask" and cast.attributes["to"].value == ir.DataType.INT32.value
    assert mask_index_inputs(model) == {cast.outputs[0].name}
    for node in model.graph:
        if node.op_type == "Attention":
            assert node.attributes["mask_filter_value"].value == pytest.approx(float(np.finfo(np.float32).min))


def test_bert_tiny_ort_lengths_exact_for_right_padding_only() -> None:
    """--mask-format lengths: ReduceSum of the mask (once) is the packed Attention's 1-D mask_index; equal to
    the original on right-padded masks, and (as documented) not on left-padded ones."""
    proto = bert_tiny(batch=4)
    stats = {**BERT_STATS, "mask_index_casts": 1, "mask_lengths": 1}
    model = check_fusion(lowered(FuseAttentionPass(mask_format="lengths"), "ort"), proto, stats=stats,
                         feeds=right_padded_feeds(), rel=1e-5)
    left = op_counts(model)
    assert left["com.microsoft.Attention"] == 2 and left["ReduceSum"] == 1 and "Expand" not in left
    (red,) = [n for n in model.graph if n.op_type == "ReduceSum"]
    assert mask_index_inputs(model) == {red.outputs[0].name}
    left_padded = bert_feeds(4, 16)
    left_padded["attention_mask"] = np.ones((4, 16), dtype=np.int64)
    left_padded["attention_mask"][1, :5] = 0
    ref, got = run_ort(proto, left_padded), run_ort(to_proto(model), left_padded)
    assert np.abs(ref[0][1] - got[0][1]).max() > 1e-2  # the left-padded row attends to the wrong keys
    np.testing.assert_allclose(got[0][0], ref[0][0], rtol=1e-5, atol=1e-5)  # the unpadded row is unchanged


@pytest.mark.parametrize("fmt", ["bias", "raw"])
def test_bert_tiny_fully_padded_row_matches_original(fmt: str) -> None:
    """bias adds the original bias; raw fills masked scores with the original constant: an all-masked row agrees."""
    proto = bert_tiny(batch=4)
    feeds = padded_feeds()
    model, _ = run_pass(lowered(FuseAttentionPass(mask_format=fmt), "ort"), proto)
    ref, got = run_ort(proto, feeds), run_ort(to_proto(model), feeds)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g[2], r[2], rtol=1e-5, atol=1e-5)  # the fully padded row
    assert_close(ref, got, 1e-5)


def test_bert_tiny_ort_bias_not_a_padding_mask_keeps_bias() -> None:
    """Near miss for the mask index: (1 - mask) * 3 is not a padding mask; even with --mask-format lengths the
    bias stays and is expanded.

    Without shape inference the two layers' query lengths are not known to be equal, so each layer
    expands it (after ``infer-shapes``, as in the ``cleanup`` preset, one expansion is shared).
    """
    proto = bert_tiny(batch=3)
    lowest = float(np.finfo(np.float32).min)
    for init in proto.graph.initializer:
        arr = onnx.numpy_helper.to_array(init)
        if arr.size == 1 and float(arr.reshape(())) == lowest:
            init.CopyFrom(onnx.numpy_helper.from_array(np.array(3.0, dtype=arr.dtype), init.name))
    for node in proto.graph.node:
        for a in node.attribute:
            if node.op_type == "Constant" and a.name == "value":
                arr = onnx.numpy_helper.to_array(a.t)
                if arr.size == 1 and float(arr.reshape(())) == lowest:
                    a.t.CopyFrom(onnx.numpy_helper.from_array(np.array(3.0, dtype=arr.dtype)))
    model = check_fusion(lowered(FuseAttentionPass(mask_format="lengths"), "ort"), proto,
                         stats={**BERT_STATS, "bias_expansions": 2}, feeds=bert_feeds(3, 16))
    left = op_counts(model)
    assert left["Expand"] == 2 and left["com.microsoft.Attention"] == 2, left
    assert mask_index_inputs(model) == set()


def test_mask_format_option_refuses_unknown() -> None:
    from mograph.errors import MographError

    with pytest.raises((MographError, ValueError)):
        FuseAttentionPass(mask_format="padding")


@pytest.mark.parametrize("target,opset,op", [("mograph", 17, "mograph.Attention"), ("onnx", 23, "Attention")])
def test_bert_tiny_other_targets(target: str, opset: int, op: str) -> None:
    proto = bert_tiny(opset=opset)
    stats = {k: v for k, v in BERT_STATS.items() if target == "onnx" or not k.startswith("lowered")}
    if target == "onnx":
        stats["bias_expansions"] = 2  # no shape inference here: the layers' query lengths are not known equal
    model = check_fusion(lowered(FuseAttentionPass(), target), proto, stats=stats, feeds=bert_feeds(3, 16))
    assert op_counts(model)[op] == 2
    assert "Softmax" not in op_counts(model)


def test_tensorrt_target_leaves_attention_unfused() -> None:
    """TensorRT's parser would take a node named Attention for its own op: the lowering gives the decomposition."""
    model = to_ir(bert_tiny(opset=17))
    result = lowered(FuseAttentionPass(), "tensorrt").call(model)
    assert result.stats["lowered.Attention"] == 2
    assert op_counts(model)["Softmax"] == 2 and not any(n.op_type == "Attention" for n in model.graph)


# ---------------------------------------------------------------------------------------------
# ort: causal masks and KV caches reach the kernels' own forms
# ---------------------------------------------------------------------------------------------


def causal_text(kv: int = H, *, anti: bool = False, kv_len: str = "seq", d: int = D, end: str = "slice",
                padding: bool = False) -> str:
    """Causal self-attention as the dynamo export writes transformers' mask: one ``Range(0, S)`` read as key
    index (axis 3) and query index (axis 2), ``Where(kv_idx <= q_idx, 0, min)``; ``kv`` K/V heads
    (repeat_kv when fewer than H).  ``anti``: ``q_idx <= kv_idx`` instead (not causal); ``kv_len``: the keys'
    symbolic length (another name: not provably the query length); ``end="gather"``: the Range's end is
    ``Gather(Shape(q), 1)`` and its output's length is left unknown (as TorchScript exports it); ``padding``: And-ed
    with a key-padding term ``Unsqueeze(mask, [1, 2])`` of a bool ``[B, seq]`` mask input."""
    rep = H // kv
    cmp = "LessOrEqual(qi, kvi)" if anti else "LessOrEqual(kvi, qi)"
    kh, vh = ("kh", "vh") if rep > 1 else ("k4", "v4")
    n = "  sh = Shape<start=1,end=2>(q)\n  n = Squeeze(sh, a0)" if end == "slice" else \
        "  sh = Shape(q)\n  n = Gather<axis=0>(sh, c1)"
    keep = "  pk = Unsqueeze(mask, pax)\n  keep = And(causal, pk)\n" if padding else ""
    mask_in = f", bool[{B},seq] mask" if padding else ""
    repeat = """  k5 = Unsqueeze(k4, ax)
  k6 = Expand(k5, big)
  kh = Reshape(k6, merged)
  v5 = Unsqueeze(v4, ax)
  v6 = Expand(v5, big)
  vh = Reshape(v6, merged)""" if rep > 1 else ""
    return f'''<ir_version: 8, opset_import: ["" : 17]>
g (float[{B},seq,{H * d}] q, float[{B},{kv_len},{kv * d}] k, float[{B},{kv_len},{kv * d}] v{mask_in})
  => (float[{B},seq,{H * d}] y)
  <int64[4] qs = {{0, 0, {H}, {d}}}, int64[4] kvs = {{0, 0, {kv}, {d}}}, int64[1] ax = {{2}},
   int64[5] big = {{{B}, {kv}, {rep}, {S}, {d}}}, int64[4] merged = {{{B}, {H}, {S}, {d}}},
   float sc = {{{1 / math.sqrt(d)}}}, int64[3] shp3 = {{0, 0, -1}}, int64 c0 = {{0}}, int64 c1 = {{1}},
   int64[1] a0 = {{0}}, int64[1] a3 = {{3}}, float fz = {{0.0}}, float fmin = {{-3.4028234663852886e+38}},
   int64[2] pax = {{1, 2}}{", int64[seq] r" if end == "slice" else ""}> {{
{n}
  r = Range(c0, n, c1)
  r1 = Unsqueeze(r, a0)
  r2 = Unsqueeze(r1, a0)
  kvi = Unsqueeze(r2, ax)
  qi = Unsqueeze(r2, a3)
  causal = {cmp}
{keep}  bias = Where({"keep" if padding else "causal"}, fz, fmin)
  q4 = Reshape(q, qs)
  qh = Transpose<perm=[0,2,1,3]>(q4)
  k3 = Reshape(k, kvs)
  k4 = Transpose<perm=[0,2,1,3]>(k3)
  v3 = Reshape(v, kvs)
  v4 = Transpose<perm=[0,2,1,3]>(v3)
{repeat}
  kt = Transpose<perm=[0,1,3,2]>({kh})
  mm = MatMul(qh, kt)
  sc2 = Mul(mm, sc)
  sm = Add(sc2, bias)
  p = Softmax<axis=-1>(sm)
  o = MatMul(p, {vh})
  ot = Transpose<perm=[0,2,1,3]>(o)
  y = Reshape(ot, shp3)
}}'''


def _causal_feeds(kv: int, d: int = D) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    feeds = {"q": rng.standard_normal((B, S, H * d)).astype(np.float32)}
    feeds.update({n: rng.standard_normal((B, S, kv * d)).astype(np.float32) for n in ("k", "v")})
    return feeds


def _kernel(model: ir.Model, op_type: str) -> ir.Node:
    (node,) = [n for n in model.graph if n.domain == "com.microsoft" and n.op_type == op_type]
    return node


def test_causal_mask_becomes_unidirectional_multihead_attention() -> None:
    """A provably causal mask (one Range of the query length as key and query index) is the kernel's own
    ``unidirectional=1``: no bias input, no Where/LessOrEqual left, numbers equal on ORT CPU."""
    proto = parse(causal_text())
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=_causal_feeds(H),
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask": 1, "lowered.Attention": 1,
                                "attention.causal": 1})
    node = _kernel(model, "MultiHeadAttention")
    assert node.attributes["unidirectional"].value == 1 and len(node.inputs) == 3
    assert not {"Where", "LessOrEqual", "Range"} & set(op_counts(model))


def test_causal_grouped_heads_become_group_query_attention() -> None:
    """Causal self-attention with 2 K/V heads for 4 query heads: ``GroupQueryAttention`` (causal by itself)
    with ``seqlens_k = S - 1`` per row and ``total_sequence_length = S``: no K/V repeat, no bias."""
    proto = parse(causal_text(kv=2, d=8))  # (the CPU kernel takes head sizes that are multiples of 8)
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=_causal_feeds(2, d=8),
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask.gqa": 1, "lowered.Attention": 1,
                                "gqa_lengths": 1, "attention.causal": 1})
    node = _kernel(model, "GroupQueryAttention")
    assert node.attributes["kv_num_heads"].value == 2 and node.attributes["num_heads"].value == H
    assert "Expand" in op_counts(model) and "Where" not in op_counts(model)  # Expand: seqlens_k over the batch


@pytest.mark.parametrize("variant", ["anti", "other-length"])
def test_near_miss_not_provably_causal_keeps_the_bias(variant: str) -> None:
    """``q_idx <= kv_idx`` is no causal mask; keys of another symbolic length are not provably the query's:
    both keep the dense bias (MultiHeadAttention ``attention_bias``, no ``unidirectional``)."""
    text = causal_text(anti=True) if variant == "anti" else causal_text(kv_len="keys")
    proto = parse(text)
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=_causal_feeds(H),
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask": 1, "lowered.Attention": 1})
    node = _kernel(model, "MultiHeadAttention")
    assert "unidirectional" not in node.attributes and len(node.inputs) == 6


PAST = 6


def cached_text(kv: int = H, q_len: str = "1", d: int = D) -> str:
    """One decode step over a KV cache: the step's K/V heads concatenated after ``past_key``/``past_value``
    ``[B, kv, PAST, D]`` (the Concats are the ``present_*`` outputs), a dense additive bias input over the
    ``P + 1`` keys, repeat_kv when ``kv < H``."""
    rep = H // kv
    kh, vh = ("kh", "vh") if rep > 1 else ("kc", "vc")
    repeat = """  k5 = Unsqueeze(kc, ax)
  k6 = Expand(k5, big)
  kh = Reshape(k6, merged)
  v5 = Unsqueeze(vc, ax)
  v6 = Expand(v5, big)
  vh = Reshape(v6, merged)""" if rep > 1 else ""
    return f'''<ir_version: 8, opset_import: ["" : 17]>
g (float[{B},{q_len},{H * d}] q, float[{B},{q_len},{kv * d}] k, float[{B},{q_len},{kv * d}] v,
   float[{B},{kv},{PAST},{d}] past_key, float[{B},{kv},{PAST},{d}] past_value, float[{B},1,{q_len},{PAST + 1}] bias)
  => (float[{B},{q_len},{H * d}] y, float[{B},{kv},{PAST + 1},{d}] present_key,
      float[{B},{kv},{PAST + 1},{d}] present_value)
  <int64[4] qs = {{0, 0, {H}, {d}}}, int64[4] kvs = {{0, 0, {kv}, {d}}}, int64[1] ax = {{2}},
   int64[5] big = {{{B}, {kv}, {rep}, {PAST + 1}, {d}}}, int64[4] merged = {{{B}, {H}, {PAST + 1}, {d}}},
   float sc = {{{1 / math.sqrt(d)}}}, int64[3] shp3 = {{0, 0, -1}}> {{
  q4 = Reshape(q, qs)
  qh = Transpose<perm=[0,2,1,3]>(q4)
  k3 = Reshape(k, kvs)
  k4 = Transpose<perm=[0,2,1,3]>(k3)
  v3 = Reshape(v, kvs)
  v4 = Transpose<perm=[0,2,1,3]>(v3)
  kc = Concat<axis=2>(past_key, k4)
  vc = Concat<axis=2>(past_value, v4)
  present_key = Identity(kc)
  present_value = Identity(vc)
{repeat}
  kt = Transpose<perm=[0,1,3,2]>({kh})
  mm = MatMul(qh, kt)
  sc2 = Mul(mm, sc)
  sm = Add(sc2, bias)
  p = Softmax<axis=-1>(sm)
  o = MatMul(p, {vh})
  ot = Transpose<perm=[0,2,1,3]>(o)
  y = Reshape(ot, shp3)
}}'''


def _cached_feeds(kv: int, q_len: int = 1, past: int = PAST, d: int = D) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    feeds = {"q": rng.standard_normal((B, q_len, H * d)).astype(np.float32)}
    feeds.update({n: rng.standard_normal((B, q_len, kv * d)).astype(np.float32) for n in ("k", "v")})
    feeds.update({n: rng.standard_normal((B, kv, past, d)).astype(np.float32) for n in ("past_key", "past_value")})
    bias = np.zeros((B, 1, q_len, past + q_len), dtype=np.float32)
    bias[1, ..., :2] = np.finfo(np.float32).min  # row 1 left-padded by 2
    feeds["bias"] = bias
    return feeds


@pytest.mark.parametrize("kv,d,op,bias", [(H, D, "MultiHeadAttention", True), (2, 8, "GroupQueryAttention", False)])
def test_kv_cache_goes_into_the_kernel(kv: int, d: int, op: str, bias: bool) -> None:
    """A decode step: past_key/past_value are the kernel's inputs, its present outputs replace the exporter's
    Concats (same output names), the dense bias stays as ``attention_bias`` (exact, left padding included);
    grouped heads without a bias: GroupQueryAttention (one query token: its causal mask hides nothing)."""
    text = cached_text(kv=kv, d=d)
    if not bias:
        text = text.replace(f", float[{B},1,1,{PAST + 1}] bias)", ")").replace("sm = Add(sc2, bias)\n  p = Softmax<axis=-1>(sm)", "p = Softmax<axis=-1>(sc2)")
    proto = parse(text)
    rule = "AttentionFusion.mul." + ("mask.cache" if bias else "nomask.gqa.cache")
    stats = {"AttentionFusion": 1, rule: 1, "lowered.Attention": 1, "attention.kv_cache": 1}
    if kv < H:
        stats["gqa_lengths"] = 1
    feeds = _cached_feeds(kv, d=d)
    if not bias:
        del feeds["bias"]
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=feeds, stats=stats)
    node = _kernel(model, op)
    assert node.inputs[3 if kv < H else 6].name == "past_key"
    assert [o.name for o in model.graph.outputs] == ["y", "present_key", "present_value"]
    for out, kernel_out in zip(model.graph.outputs[1:], node.outputs[1:]):  # (through the test graph's Identity)
        assert out is kernel_out or out.producer().inputs[0] is kernel_out
    assert "Concat" not in op_counts(model)


@pytest.mark.parametrize("q_len", [1, 2])
def test_kv_cache_grouped_heads_with_bias_keeps_repeat(q_len: int) -> None:
    """Grouped heads over a cache with a bias (GroupQueryAttention's CUDA kernel refuses ``attention_bias``), or a
    step of 2 tokens (its own causal mask could hide keys the bias does not): MultiHeadAttention over repeated K/V
    with the past concatenated, exact."""
    proto = parse(cached_text(kv=2, q_len=str(q_len), d=8).replace(f"{PAST + 1}", f"{PAST + q_len}"))
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=_cached_feeds(2, q_len=q_len, d=8),
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask.gqa.cache": 1, "lowered.Attention": 1,
                                "kv_repeats": 2})
    counts = op_counts(model)
    assert "com.microsoft.GroupQueryAttention" not in counts and counts["com.microsoft.MultiHeadAttention"] == 1



def test_causal_mask_torchscript_range_end() -> None:
    """The Range's end read as ``Gather(Shape(q), 1)``, its own length unknown: still provably the query length."""
    proto = parse(causal_text(end="gather"))
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=_causal_feeds(H),
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask": 1, "lowered.Attention": 1,
                                "attention.causal": 1})
    assert _kernel(model, "MultiHeadAttention").attributes["unidirectional"].value == 1


def _padded_causal_feeds(kv: int, d: int = D) -> dict[str, np.ndarray]:
    feeds = _causal_feeds(kv, d)
    mask = np.ones((B, S), dtype=np.bool_)
    mask[1, 3:] = False  # row 1 right-padded to 3 keys
    feeds["mask"] = mask
    return feeds


@pytest.mark.parametrize("kv,d,op", [(H, D, "MultiHeadAttention"), (2, 8, "GroupQueryAttention")])
def test_causal_with_padding_lengths_format(kv: int, d: int, op: str) -> None:
    """Causal + key padding with ``--mask-format lengths``: the kernel's causal mask and the right-padding key
    lengths (``key_padding_mask`` 1-D, or ``seqlens_k = lengths - 1``); exact on right-padded masks."""
    proto = parse(causal_text(kv=kv, d=d, padding=True))
    stats = {"AttentionFusion": 1, "AttentionFusion.mul.mask" + (".gqa" if kv < H else ""): 1,
             "lowered.Attention": 1, "mask_index_casts": 1, "mask_lengths": 1, "attention.causal": 1}
    if kv < H:
        stats["gqa_lengths"] = 1
    model = check_fusion(lowered(FuseAttentionPass(mask_format="lengths"), "ort"), proto,
                         feeds=_padded_causal_feeds(kv, d), stats=stats)
    node = _kernel(model, op)
    assert "ReduceSum" in op_counts(model) and "Where" not in op_counts(model)
    if kv == H:
        assert node.attributes["unidirectional"].value == 1 and node.inputs[4] is not None


@pytest.mark.parametrize("fmt", ["bias", "raw"])
def test_causal_with_padding_other_formats_keep_the_bias(fmt: str) -> None:
    """``bias`` and ``raw`` keep the dense causal + padding bias (exact for left padding too)."""
    proto = parse(causal_text(padding=True))
    feeds = _padded_causal_feeds(H)
    feeds["mask"][0, :2] = False  # row 0 left-padded
    model = check_fusion(lowered(FuseAttentionPass(mask_format=fmt), "ort"), proto, feeds=feeds,
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask": 1, "lowered.Attention": 1})
    node = _kernel(model, "MultiHeadAttention")
    assert "unidirectional" not in node.attributes and node.inputs[5] is not None


# ------------------------------------------------------------------ the proofs' reads ------------


@pytest.mark.parametrize(("read", "renamed", "holds"), [
    ("gather", False, True),  # Gather(Shape(past_key_0), 2): P, the dim past_key_1 has too
    ("squeeze", False, True),  # Squeeze(Shape(past_key_0, 2, 3))
    ("cast", False, True),  # Cast(Gather(Shape(past_key_0), 2))
    ("other", False, False),  # dim 2 of a tensor whose dim is another one
    ("head", False, False),  # dim 3 of the cache: D, not P
    ("gather", True, True),  # past_key_0's P renamed to max_sequence_length: the dim noted before counts
    ("other", True, False),
])
def test_past_length_read_through_the_shape_query(read: str, renamed: bool, holds: bool) -> None:
    """``_past_length_of`` asks the shape query whether a scalar is the cache's past length (dim 2 of ``past``),
    and honours the note a shared-buffer lowering leaves on a cache input it renamed."""
    from mograph.passes.fusion.lowerings.attention_proofs import _PAST_DIM_META, _past_length_of

    from mograph.shapes import Dim, ShapeQuery

    f32 = ir.TensorType(ir.DataType.FLOAT)
    k0 = ir.Value(name="past_key_0", shape=ir.Shape(["b", 2, "max_sequence_length" if renamed else "past", 4]), type=f32)
    k1 = ir.Value(name="past_key_1", shape=ir.Shape(["b", 2, "past", 4]), type=f32)
    other = ir.Value(name="other", shape=ir.Shape(["b", 2, "other", 4]), type=f32)
    if renamed:
        k0.meta[_PAST_DIM_META] = Dim.sym("=past")
    nodes: list[ir.Node] = []

    def op(op_type: str, inputs: list, **attrs: Any) -> ir.Value:
        nodes.append(ir.node(op_type, inputs, attributes=attrs))
        return nodes[-1].outputs[0]

    def const(v: int) -> ir.Value:
        return op("Constant", [], value=ir.tensor(np.array(v, dtype=np.int64)))

    reads = {"gather": op("Gather", [op("Shape", [k0]), const(2)]),
             "squeeze": op("Squeeze", [op("Shape", [k0], start=2, end=3)]),
             "cast": op("Cast", [op("Gather", [op("Shape", [k0]), const(2)])], to=ir.DataType.INT64.value),
             "other": op("Gather", [op("Shape", [other]), const(2)]),
             "head": op("Gather", [op("Shape", [k0]), const(3)])}
    graph = ir.Graph([k0, k1, other], [], nodes=nodes, opset_imports={"": 18})
    assert _past_length_of(reads[read], k1, ShapeQuery(graph)) is holds


def test_kv_cache_whose_mask_reads_the_present_length() -> None:
    """optimum's Whisper decoder with past: the mask is cut to the present keys' length, ``Shape(present)``,
    so the kernel depends on a reader of the Concat its own ``present_key`` replaces.  Every reader was moved
    to the kernel's output: a cycle, and the lowered model did not load (exit 4).  The reader the kernel
    depends on keeps the Concat; the present outputs are the kernel's."""
    longer = PAST + 3
    text = cached_text().replace(f"float[{B},1,1,{PAST + 1}] bias)", f"float[{B},1,1,{longer}] bias_all)")
    text = text.replace("sm = Add(sc2, bias)", "kl = Shape<start=2,end=3>(kc)\n  bias = Slice(bias_all, zero1, kl, ax3)\n"
                        "  sm = Add(sc2, bias)")
    text = text.replace("int64[3] shp3 = {0, 0, -1}>", "int64[3] shp3 = {0, 0, -1}, int64[1] zero1 = {0}, "
                        "int64[1] ax3 = {3}>")
    proto = parse(text)
    feeds = _cached_feeds(H)
    pad = np.zeros((B, 1, 1, longer - PAST - 1), np.float32)
    feeds["bias_all"] = np.concatenate([feeds.pop("bias"), pad], axis=-1)
    stats = {"AttentionFusion": 1, "AttentionFusion.mul.mask.cache": 1, "lowered.Attention": 1,
             "attention.kv_cache": 1}
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=feeds, stats=stats)
    node = _kernel(model, "MultiHeadAttention")
    assert node.inputs[6].name == "past_key"
    for out, kernel_out in zip(model.graph.outputs[1:], node.outputs[1:]):
        assert out is kernel_out or out.producer().inputs[0] is kernel_out
    assert op_counts(model)["Concat"] == 1  # the key Concat, for the mask's Shape only
