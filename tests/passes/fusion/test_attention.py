"""fuse-attention on graphs built in code (every variant), on bert_tiny, and on real BERT exports.

Numerics are checked with ONNX Runtime's own optimizations off, on feeds whose attention mask has
padded positions (zeros), so the masked softmax is exercised.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from _fusion_util import lowered, mask_index_inputs
from mograph.passes.fusion import attention_op
from mograph.passes.fusion.attention import FuseAttentionPass

from models.builders import bert_feeds, bert_tiny
from mograph.cuda_graph import cuda_graph_check
from mograph.pass_infra import graph_fingerprint
from mograph.testing import assert_close, assert_untouched, op_counts, parse, run_ort, run_pass, to_ir, to_proto
from mograph.testing import check_pass as check_fusion

B, S, H, D = 2, 5, 4, 4
HID = H * D


def attention_text(*, scale: str = "div", mask: str = "bias", k_form: str = "0231", opset: int = 17,
                   scale_input: bool = False, heads: str = "const", axis: int = -1) -> str:
    """Q, K, V graph inputs [B, S, H*D] through the attention core, one form per argument."""
    lines = [
        "q4 = Reshape(q, shp)", "k4 = Reshape(k, shp)", "v4 = Reshape(v, shp)",
        "qh = Transpose<perm=[0,2,1,3]>(q4)", "vh = Transpose<perm=[0,2,1,3]>(v4)",
    ]
    if k_form == "0231":
        lines.append("kt = Transpose<perm=[0,2,3,1]>(k4)")
    else:
        lines += ["kh = Transpose<perm=[0,2,1,3]>(k4)", "kt = Transpose<perm=[0,1,3,2]>(kh)"]
    c = "sc_in" if scale_input else "sc"
    if scale == "div":
        lines += ["mm = MatMul(qh, kt)", f"s = Div(mm, {c})"]
    elif scale == "mul":
        lines += ["mm = MatMul(qh, kt)", f"s = Mul({c}, mm)"]
    elif scale == "mul-qk":
        lines += ["qs = Mul(qh, qk)", "ks = Mul(qk, kt)", "s = MatMul(qs, ks)"]
    else:
        lines += ["s = MatMul(qh, kt)"]
    if mask == "bias":
        lines.append("sm = Add(bias, s)")
    lines += [f"p = Softmax<axis={axis}>({'sm' if mask == 'bias' else 's'})", "o = MatMul(p, vh)", "ot = Transpose<perm=[0,2,1,3]>(o)",
              "y = Reshape(ot, shp3)"]
    sc = {"div": math.sqrt(D), "mul": 1 / math.sqrt(D)}.get(scale, 1.0)
    inits = [f"float sc = {{{sc}}}", f"float qk = {{{D ** -0.25}}}", "int64[3] shp3 = {0, 0, -1}"]
    inputs = [f"float[{B},{S},{HID}] q", f"float[{B},{S},{HID}] k", f"float[{B},{S},{HID}] v"]
    if heads == "const":
        inits.append(f"int64[4] shp = {{0, 0, {H}, -1}}")
    else:
        inputs.append("int64[4] shp")
    if mask == "bias":
        inputs.append(f"float[{B},1,1,{S}] bias")
    if scale_input:
        inputs.append("float sc_in")
    body = "\n  ".join(lines)
    return (f'<ir_version: 8, opset_import: ["" : {opset}]>\n'
            f"g ({', '.join(inputs)}) => (float[{B},{S},{HID}] y) <{', '.join(inits)}> {{\n  {body}\n}}")


def _feeds(proto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {n: rng.standard_normal((B, S, HID)).astype(np.float32) for n in ("q", "k", "v")}
    names = {i.name for i in proto.graph.input}
    if "bias" in names:
        keep = np.ones((B, S), dtype=np.float32)
        keep[1, 3:] = 0  # padded keys of the second row
        feeds["bias"] = ((1.0 - keep) * np.finfo(np.float32).min)[:, None, None, :]
    if "shp" in names:
        feeds["shp"] = np.array([0, 0, H, -1], dtype=np.int64)
    if "sc_in" in names:
        feeds["sc_in"] = np.array(math.sqrt(D), dtype=np.float32)
    return feeds


def _stats(variant: str, lowered: bool = True) -> dict[str, int]:
    out = {"AttentionFusion": 1, f"AttentionFusion.{variant}": 1}
    if lowered:
        out["lowered.Attention"] = 1
    return out


# ------------------------------------------------------------------ variants, graphs in code -----


@pytest.mark.parametrize("scale", ["div", "mul", "mul-qk", "none"])
@pytest.mark.parametrize("k_form", ["0231", "0213.0132"])
def test_attention_variants_mograph(scale: str, k_form: str) -> None:
    proto = parse(attention_text(scale=scale, k_form=k_form))
    model = check_fusion(FuseAttentionPass(), proto, stats=_stats(f"{scale}.mask", lowered=False),
                         ops_left=["mograph.Attention"], feeds=_feeds(proto))
    node = next(iter(model.graph))
    assert node.attributes["num_heads"].value == H
    expected = {"div": 1 / math.sqrt(D), "mul": 1 / math.sqrt(D), "mul-qk": 1 / math.sqrt(D), "none": 1.0}[scale]
    assert node.attributes["scale"].value == pytest.approx(expected, rel=1e-6)
    assert ("mograph", "Attention", "") in model.functions


def test_attention_without_mask() -> None:
    proto = parse(attention_text(mask="none"))
    check_fusion(FuseAttentionPass(), proto, stats=_stats("div.nomask", lowered=False),
                 ops_left=["mograph.Attention"], feeds=_feeds(proto))
    # ort: no projections to pack -> MultiHeadAttention, no attention_bias input
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats=_stats("div.nomask"),
                         ops_left=["com.microsoft.MultiHeadAttention"], feeds=_feeds(proto))
    assert len(next(iter(model.graph)).inputs) == 3


def test_attention_ort_multihead_with_expanded_bias() -> None:
    """Q/K/V not packable (graph inputs): MultiHeadAttention; the [B,1,1,T] bias is expanded to [B,1,S,T]."""
    proto = parse(attention_text())
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats={**_stats("div.mask"), "bias_expansions": 1},
                         feeds=_feeds(proto))
    assert op_counts(model) == Counter({"com.microsoft.MultiHeadAttention": 1, "Constant": 2, "Shape": 1,
                                        "Gather": 1, "Concat": 1, "Expand": 1})


def test_attention_reference_matches_function_body() -> None:
    proto = parse(attention_text())
    feeds = _feeds(proto)
    model, _ = run_pass(FuseAttentionPass(), proto)
    decl = attention_op.custom_ops()[0]
    (expected,) = decl.reference(feeds["q"], feeds["k"], feeds["v"], feeds["bias"], num_heads=H,
                                 scale=1 / math.sqrt(D))
    (got,) = run_ort(model, feeds)
    assert_close([expected], [got], 1e-5)


def two_layer_text() -> str:
    """Two attention cores reading one [B,1,1,S] bias input; the second takes the first's output as Q, K, V."""
    core = attention_text().split("{\n  ", 1)[1].rsplit("\n}", 1)[0].splitlines()
    second = [line.strip().replace("(q,", "(y,").replace("(k,", "(y,").replace("(v,", "(y,") for line in core]
    names = ("q4", "k4", "v4", "qh", "vh", "kt", "mm", "s", "sm", "p", "o", "ot")
    renamed = []
    for line in second:
        lhs, rhs = line.split(" = ", 1)
        for n in names:
            rhs = rhs.replace(f"({n})", f"({n}2)").replace(f"({n},", f"({n}2,").replace(f", {n})", f", {n}2)")
        renamed.append(f"{lhs}2 = {rhs}" if lhs != "y" else f"y2 = {rhs}")
    head, rest = attention_text().split("{\n  ", 1)
    body = rest.rsplit("\n}", 1)[0]
    head = head.replace(f"float[{B},{S},{HID}] y)", f"float[{B},{S},{HID}] y2)")
    return head + "{\n  " + body + "\n  " + "\n  ".join(renamed) + "\n}"


def test_attention_ort_bias_expanded_once_for_all_layers() -> None:
    """Two layers, one bias: one Shape/Gather/Concat/Expand chain, read by both MultiHeadAttention nodes."""
    proto = parse(two_layer_text())
    stats = {"AttentionFusion": 2, "AttentionFusion.div.mask": 2, "lowered.Attention": 2, "bias_expansions": 1}
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, stats=stats, feeds=_feeds(proto))
    assert op_counts(model) == Counter({"com.microsoft.MultiHeadAttention": 2, "Constant": 2, "Shape": 1,
                                        "Gather": 1, "Concat": 1, "Expand": 1})
    expand = next(n for n in model.graph if n.op_type == "Expand")
    users = {u.op_type for u, _ in expand.outputs[0].uses()}
    assert users == {"MultiHeadAttention"} and len(expand.outputs[0].uses()) == 2


# ------------------------------------------------------------------ near misses ------------------


def test_near_miss_scale_not_constant() -> None:
    proto = parse(attention_text(scale_input=True))
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), proto)
    misses = result.details["rules"]["AttentionFusion"]["near_miss_list"]
    assert [m["reason"] for m in misses] == ["scale is not a constant"]


def test_near_miss_heads_not_constant() -> None:
    proto = parse(attention_text(heads="input"))
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), proto)
    (miss,) = result.details["rules"]["AttentionFusion"]["near_miss_list"]
    assert miss["reason"].startswith("query: num_heads cannot be determined: reshape target")


def test_near_miss_softmax_not_over_keys() -> None:
    proto = parse(attention_text(axis=2))
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), proto)
    (miss,) = result.details["rules"]["AttentionFusion"]["near_miss_list"]
    assert miss["reason"] == "Softmax is over axis 2, not the key axis"


def test_onnx_target_below_opset_23_writes_the_computation_out() -> None:
    """ONNX has no attention op below opset 23: the lower step writes the computation out for the call's
    attributes (no Shape arithmetic, no grouped-head repeat, no NaN guard), no larger than the export's."""
    proto = bert_tiny()
    model, result = run_pass(lowered(FuseAttentionPass(), "onnx"), proto)
    assert result.stats["AttentionFusion"] == 2 and result.stats["lowered.Attention"] == 2
    ops = op_counts(model)
    assert ops["Softmax"] == 2 and not any(n.domain == "mograph" for n in model.graph)
    assert not {"IsNaN", "Where", "Expand", "Concat"} & set(ops), ops
    assert sum(ops.values()) <= len(proto.graph.node), (sum(ops.values()), len(proto.graph.node))
    feeds = bert_feeds(2, 16)
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)


# ------------------------------------------------------------------ real exports -----------------

EXPORTS = [("torchscript", 14), ("torchscript", 17), ("dynamo", 18)]
L = 2


@pytest.mark.torch
@pytest.mark.parametrize("exporter,opset", EXPORTS, ids=[f"{e}-{o}" for e, o in EXPORTS])
def test_bert_export_ort(export_dir: Path, exporter: str, opset: int) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models import export_hf
    from mograph.plugins import get_registry

    path = export_dir / f"bert_{exporter}_{opset}.onnx"  # the same cache as test_exports.py
    if not path.exists():
        export_hf.export("bert", path, exporter=exporter, opset=opset, layers=L)
    proto = onnx.load(str(path))
    feeds = export_hf.sample_feeds("bert", 3, 16, seed=1)
    assert feeds["attention_mask"].min() == 0
    feeds["attention_mask"][2, :] = 0  # a fully padded row too
    # transformers' index-based padding mask (TorchScript: a flat Gather; dynamo: GatherND) is traced to
    # attention_mask: its computation is gone
    stats = {"AttentionFusion": L, "AttentionFusion.mul.mask": L, "lowered.Attention": L, "mask_index_casts": 1}
    model = check_fusion(lowered(FuseAttentionPass(mask_format="raw"), "ort"), proto, stats=stats, feeds=feeds)
    (cast,) = [n for n in model.graph if n.op_type == "Cast" and n.inputs[0].name == "attention_mask"]
    assert mask_index_inputs(model) == {cast.outputs[0].name}
    assert "Flatten" not in op_counts(model) and "GatherND" not in op_counts(model)

    # the whole preset, as deployed: cleanup then fuse, every fusion lowered for ONNX Runtime (default: bias)
    expands = op_counts(to_ir(proto))["Expand"]
    model = to_ir(proto)
    reg = get_registry()
    fused = 0
    for p in reg.instantiate(reg.plan("cleanup,fuse", {"target": "ort"}), {"target": "ort"}):
        fused += int(p.call(model).stats.get("AttentionFusion", 0))
    assert fused == L
    left = op_counts(model)
    assert left["com.microsoft.Attention"] == L and "Softmax" not in left, left  # Q/K/V packed
    assert left["Expand"] <= expands + 1  # at most one [B, 1, S, T] expansion of the bias for both layers
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)
    # the export's shape subgraphs fed device nodes (token type ids, padding lookup); lowered, they are device forms
    assert not cuda_graph_check(to_ir(proto)).capturable
    report = cuda_graph_check(model)
    assert report.capturable, report.blockers
    before = graph_fingerprint(model)
    assert not lowered(FuseAttentionPass(), "ort").call(model).modified
    assert graph_fingerprint(model) == before


@pytest.mark.torch
def test_bert_fp16_ort_cuda_graph_prediction_cli(export_dir: Path, tmp_path: Path) -> None:
    """``mograph inspect --device cuda`` on a TorchScript BERT: NO on the export (its blockers named), yes after
    ``cleanup,fuse,fp16 --target ort`` (EmbedLayerNormalization without segment inputs, the padding bias from the
    mask input)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models import export_hf

    path = export_dir / "bert_torchscript_17.onnx"  # the same cache as test_bert_export_ort
    if not path.exists():
        export_hf.export("bert", path, exporter="torchscript", opset=17, layers=L)

    def capture(model: Path) -> dict:
        out = subprocess.run([sys.executable, "-m", "mograph", "inspect", str(model), "--device", "cuda", "--json"],
                             capture_output=True, text=True, check=True).stdout
        data = json.loads(out)
        return data.get("cuda_graph") or data["data"]["cuda_graph"]

    before = capture(path)
    assert not before["capturable"]
    assert {"Gather", "And"} <= {b["op"] for b in before["blockers"]}
    out = tmp_path / "bert_fp16.onnx"
    subprocess.run([sys.executable, "-m", "mograph", "optimize", str(path), "-o", str(out), "--passes",
                    "cleanup,fuse,fp16", "--target", "ort", "--calibration-random", "2"], check=True,
                   capture_output=True)
    after = capture(out)
    assert after["capturable"] and after["blockers"] == [], after
    ops = op_counts(to_ir(onnx.load(str(out))))
    assert ops["com.microsoft.EmbedLayerNormalization"] == 1 and ops["com.microsoft.Attention"] == L
    assert not {"Range", "Flatten", "GreaterOrEqual"} & set(ops), ops


def test_pass_registered() -> None:
    from mograph.plugins import get_registry

    reg = get_registry()
    assert "fuse-attention" in reg.passes
    assert "fuse-attention" in reg.expand("fuse")
    assert ("mograph", "Attention") in reg.custom_ops
    assert set(reg.custom_ops[("mograph", "Attention")].lowerings) == {"ort", "onnx", "tensorrt"}


# ------------------------------------------------------------------ new forms, graphs in code ----


def test_near_miss_mask_added_after_softmax_explained() -> None:
    """A bias added to the probabilities (not the scores) is not attention's math: untouched, and --explain
    names the node after the softmax that is not the expected MatMul."""
    text = attention_text().replace("sm = Add(bias, s)", "sm = Identity(s)").replace(
        "o = MatMul(p, vh)", "pb = Add(p, bias)\n  o = MatMul(pb, vh)")
    proto = parse(text)
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), proto)
    (entry,) = result.details["fuse-attention"]["unfused_softmax"]
    assert "expected MatMul(probabilities, V)" in entry["reason"] and "got Add" in entry["reason"]


def test_explain_names_the_query_side_mismatch() -> None:
    """Q not split by the expected Transpose (a Relu in between): the reason names the node and the expectation."""
    text = attention_text().replace("qh = Transpose<perm=[0,2,1,3]>(q4)", "qt = Transpose<perm=[0,2,1,3]>(q4)\n  qh = Relu(qt)")
    proto = parse(text)
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), proto)
    (entry,) = result.details["fuse-attention"]["unfused_softmax"]
    assert entry["reason"].startswith("query: expected Transpose perm [0, 2, 1, 3] splitting heads, got Relu")


def gqa_text(kv: int = 2) -> str:
    """Grouped-query attention as transformers' repeat_kv writes it: H = 4 query heads, ``kv`` K/V heads."""
    rep = H // kv
    return f'''<ir_version: 8, opset_import: ["" : 17]>
g (float[{B},{S},{HID}] q, float[{B},{S},{kv * D}] k, float[{B},{S},{kv * D}] v, float[{B},1,1,{S}] bias)
  => (float[{B},{S},{HID}] y)
  <int64[4] qs = {{0, 0, {H}, {D}}}, int64[4] kvs = {{0, 0, {kv}, {D}}}, int64[1] ax = {{2}},
   int64[5] big = {{{B}, {kv}, {rep}, {S}, {D}}}, int64[4] merged = {{{B}, {H}, {S}, {D}}},
   float sc = {{{1 / math.sqrt(D)}}}, int64[3] shp3 = {{0, 0, -1}}> {{
  q4 = Reshape(q, qs)
  qh = Transpose<perm=[0,2,1,3]>(q4)
  k3 = Reshape(k, kvs)
  k4 = Transpose<perm=[0,2,1,3]>(k3)
  v3 = Reshape(v, kvs)
  v4 = Transpose<perm=[0,2,1,3]>(v3)
  k5 = Unsqueeze(k4, ax)
  k6 = Expand(k5, big)
  kh = Reshape(k6, merged)
  v5 = Unsqueeze(v4, ax)
  v6 = Expand(v5, big)
  vh = Reshape(v6, merged)
  kt = Transpose<perm=[0,1,3,2]>(kh)
  mm = MatMul(qh, kt)
  sc2 = Mul(mm, sc)
  sm = Add(sc2, bias)
  p = Softmax<axis=-1>(sm)
  o = MatMul(p, vh)
  ot = Transpose<perm=[0,2,1,3]>(o)
  y = Reshape(ot, shp3)
}}'''


def _gqa_feeds(kv: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    feeds = {"q": rng.standard_normal((B, S, HID)).astype(np.float32)}
    feeds.update({n: rng.standard_normal((B, S, kv * D)).astype(np.float32) for n in ("k", "v")})
    bias = np.zeros((B, 1, 1, S), dtype=np.float32)
    bias[1, ..., 3:] = np.finfo(np.float32).min
    feeds["bias"] = bias
    return feeds


def test_grouped_query_attention_fuses_with_kv_num_heads() -> None:
    """repeat_kv is traced: one mograph.Attention(num_heads=4, kv_num_heads=2) whose function body (and the
    numpy reference) equal the original; ort: MultiHeadAttention over K/V repeated per head (one Expand each)."""
    proto = parse(gqa_text())
    feeds = _gqa_feeds()
    stats = {"AttentionFusion": 1, "AttentionFusion.mul.mask.gqa": 1}
    model = check_fusion(FuseAttentionPass(), proto, stats=stats, ops_left=["mograph.Attention"], feeds=feeds)
    node = next(iter(model.graph))
    assert node.attributes["num_heads"].value == H and node.attributes["kv_num_heads"].value == 2
    (ref,) = attention_op.custom_ops()[0].reference(feeds["q"], feeds["k"], feeds["v"], feeds["bias"], num_heads=H,
                                                    scale=1 / math.sqrt(D), kv_num_heads=2)
    assert_close(run_ort(proto, feeds), [ref], 1e-5)
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=feeds,
                         stats={**stats, "lowered.Attention": 1, "bias_expansions": 1, "kv_repeats": 2})
    assert op_counts(model)["com.microsoft.MultiHeadAttention"] == 1 and op_counts(model)["Expand"] == 3
    inlined = check_fusion(lowered(FuseAttentionPass(), "onnx"), proto, stats={**stats, "inlined.Attention": 1},
                           feeds=feeds)
    assert "Softmax" in op_counts(inlined) and "mograph" not in inlined.opset_imports


def test_grouped_query_attention_onnx_23_standard_op() -> None:
    proto = parse(gqa_text().replace('"" : 17', '"" : 23'))
    model = check_fusion(lowered(FuseAttentionPass(), "onnx"), proto, feeds=_gqa_feeds(),
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask.gqa": 1, "lowered.Attention": 1,
                                "bias_expansions": 1})
    (att,) = [n for n in model.graph if n.op_type == "Attention"]
    assert att.attributes["kv_num_heads"].value == 2 and att.attributes["q_num_heads"].value == H


def test_near_miss_repeat_count_wrong() -> None:
    """repeat_kv repeating 2 KV heads 3 times does not give the 4 query heads: untouched, reason given."""
    text = gqa_text().replace(f"{{{B}, 2, 2, {S}, {D}}}", f"{{{B}, 2, 3, {S}, {D}}}").replace(
        f"{{{B}, {H}, {S}, {D}}}", f"{{{B}, 6, {S}, {D}}}")
    text = text.replace(f"float[{B},{S},{HID}] y)", f"float[{B},{S},24] y)")
    proto = onnx.parser.parse_model(text)
    result = assert_untouched(FuseAttentionPass(explain="true"), proto)
    (miss,) = result.details["rules"]["AttentionFusion"]["near_miss_list"]
    assert miss["reason"] == "query has 4 heads, key 2 (repeated 3 times)"


def sdpa_guard_text() -> str:
    """torch's sdpa as TorchScript exports it: Q and K^T each scaled by D^-1/4, a -inf mask, NaN -> 0."""
    return attention_text(scale="mul-qk").replace(
        'y = Reshape(ot, shp3)', 'y = Reshape(ot, shp3)').replace(
        "o = MatMul(p, vh)", "nan = IsNaN(p)\n  pz = Where(nan, zero, p)\n  o = MatMul(pz, vh)").replace(
        "int64[3] shp3", "float zero = {0.0}, int64[3] shp3")


@pytest.mark.parametrize("target", ["mograph", "ort"])
def test_sdpa_nan_guard_fully_masked_row(target: str) -> None:
    """A fully -inf-masked row gives NaN probabilities that sdpa's export turns into 0: the fused op keeps that
    (nan_to_zero), on the function body and after the ORT lowering (Where(IsNaN(Y), 0, Y))."""
    proto = parse(sdpa_guard_text())
    feeds = _feeds(proto)
    bias = np.zeros((B, 1, 1, S), dtype=np.float32)
    bias[0, ..., 2:] = -np.inf
    bias[1] = -np.inf  # every key of batch row 1 masked
    feeds["bias"] = bias
    ref = run_ort(proto, feeds)
    assert np.all(ref[0][1] == 0) and np.all(np.isfinite(ref[0]))
    stats = {"AttentionFusion": 1, "AttentionFusion.mul-qk.mask": 1}
    if target == "ort":
        stats.update({"lowered.Attention": 1, "bias_expansions": 1})
    model = check_fusion(lowered(FuseAttentionPass(), target), proto, stats=stats, feeds=feeds)
    fused = [n for n in model.graph if n.op_type in ("Attention", "MultiHeadAttention")]
    if target == "mograph":
        assert fused[0].attributes["nan_to_zero"].value == 1
    else:
        assert op_counts(model)["IsNaN"] == 1 and op_counts(model)["com.microsoft.MultiHeadAttention"] == 1


def rotary_gqa_text(rot_k: bool = True, half: int = D // 2) -> str:
    """LLaMA-style: rotary on Q and K heads (transformers' apply_rotary_pos_emb), then repeat_kv and attention."""
    body = gqa_text()
    rot = []
    for name, src in (("q", "qh0"), ("k", "k40")) if rot_k else (("q", "qh0"),):
        rot += [f"r{name}a = Slice({src}, zero1, halfd, ax3)", f"r{name}b = Slice({src}, halfd, big1, ax3)",
                f"r{name}n = Neg(r{name}b)", f"r{name}r = Concat<axis=-1>(r{name}n, r{name}a)",
                f"r{name}c = Mul({src}, cos)", f"r{name}s = Mul(r{name}r, sin)"]
    body = body.replace("qh = Transpose<perm=[0,2,1,3]>(q4)", "qh0 = Transpose<perm=[0,2,1,3]>(q4)")
    if rot_k:
        body = body.replace("k4 = Transpose<perm=[0,2,1,3]>(k3)", "k40 = Transpose<perm=[0,2,1,3]>(k3)")
    lines = "\n  ".join(rot) + "\n  qh = Add(rqc, rqs)\n  " + ("k4 = Add(rkc, rks)\n  " if rot_k else "")
    body = body.replace("  k5 = Unsqueeze(k4, ax)", "  " + lines + "k5 = Unsqueeze(k4, ax)")
    body = body.replace(f"float[{B},1,1,{S}] bias)",
                        f"float[{B},1,1,{S}] bias, float[1,1,{S},{D}] cos, float[1,1,{S},{D}] sin)")
    return body.replace("float sc =", f"int64[1] zero1 = {{0}}, int64[1] halfd = {{{half}}}, int64[1] big1 = "
                        f"{{1000}}, int64[1] ax3 = {{3}}, float sc =")


def _rotary_feeds() -> dict[str, np.ndarray]:
    feeds = _gqa_feeds()
    pos = np.arange(S, dtype=np.float32)[:, None] * (1.0 / 10000 ** (np.arange(0, D, 2) / D))[None, :]
    emb = np.concatenate([pos, pos], axis=-1)
    feeds["cos"], feeds["sin"] = np.cos(emb)[None, None].astype(np.float32), np.sin(emb)[None, None].astype(np.float32)
    return feeds


@pytest.mark.parametrize("target", ["mograph", "ort", "onnx"])
def test_rotary_grouped_query_attention(target: str) -> None:
    """Rotary Q and K + repeat_kv: mograph.RotaryEmbedding x2 feeding mograph.Attention(kv_num_heads=2); ort:
    the rotary bodies inlined and MultiHeadAttention over repeated K/V; numbers equal on ORT CPU."""
    proto = parse(rotary_gqa_text())
    feeds = _rotary_feeds()
    stats = {"AttentionFusion": 1, "AttentionFusion.mul.mask.gqa.rotary": 1}
    if target == "ort":
        stats.update({"lowered.Attention": 1, "lowered.RotaryEmbedding": 2, "bias_expansions": 1, "kv_repeats": 2,
                      "rotary_outputs": 2})
    if target == "onnx":
        stats.update({"inlined.Attention": 1, "lowered.RotaryEmbedding": 2})
    model = check_fusion(lowered(FuseAttentionPass(), target), proto, stats=stats, feeds=feeds)
    left = op_counts(model)
    if target == "mograph":
        assert left == Counter({"mograph.RotaryEmbedding": 2, "mograph.Attention": 1}), left
        rope = attention_op.rotary_embedding(feeds["q"], feeds["cos"], feeds["sin"], num_heads=H)
        (got,) = run_ort(parse(rotary_gqa_text().replace("y = Reshape(ot, shp3)", "y = Identity(qh)").replace(
            f"float[{B},{S},{HID}] y)", "float y)")), feeds)
        np.testing.assert_allclose(got.transpose(0, 2, 1, 3).reshape(B, S, HID), rope, rtol=1e-5, atol=1e-6)
    elif target == "ort":
        assert left["com.microsoft.MultiHeadAttention"] == 1 and "Softmax" not in left and "Neg" in left, left
    else:
        assert not any(k.startswith("mograph.") for k in left) and "Softmax" in left


def test_near_miss_rotary_wrong_half() -> None:
    """rotate_half splitting at D/4 is not a rotary embedding: the query side stops at the Add, untouched."""
    proto = parse(rotary_gqa_text(half=D // 4))
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), proto)
    (entry,) = result.details["fuse-attention"]["unfused_softmax"]
    assert entry["reason"].startswith("query: expected Transpose perm [0, 2, 1, 3] splitting heads, got Add")


@pytest.mark.torch
@pytest.mark.parametrize("mask_format", ["bias", "lengths"])
def test_bert_export_packs_qkv_into_one_gemm_per_layer(export_dir: Path, mask_format: str) -> None:
    """cleanup,fuse --target ort on a 2-layer BERT export: per layer one com.microsoft.Attention whose weights are
    [W_q | W_k | W_v] ([hidden, 3*hidden]), no Q/K/V MatMul or bias Add left (3 MatMuls per layer: the output
    projection and the two FFN ones, as ONNX Runtime's transformers optimizer leaves them); equal to the
    original on ORT CPU with left, right and no padding for ``bias``, right padding for ``lengths``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models import export_hf
    from mograph.plugins import get_registry

    path = export_dir / "bert_torchscript_17.onnx"  # the same cache as test_bert_export_ort
    if not path.exists():
        export_hf.export("bert", path, exporter="torchscript", opset=17, layers=L)
    proto = onnx.load(str(path))
    before = op_counts(to_ir(proto))
    model = to_ir(proto)
    reg = get_registry()
    options = {"target": "ort", "mask_format": mask_format}
    for p in reg.instantiate(reg.plan("cleanup,fuse", options), options):
        p.call(model)
    left = op_counts(model)
    assert left["com.microsoft.Attention"] == L and "com.microsoft.MultiHeadAttention" not in left, left
    assert before["MatMul"] == 6 * L + 2 * L  # Q, K, V, QK^T, PV, output, 2 FFN per layer
    assert left["MatMul"] == 3 * L, left
    hidden = 64
    for node in model.graph:
        if node.op_type != "Attention":
            continue
        x, w, b = node.inputs[:3]
        assert w is not None and w.const_value is not None and w.const_value.shape == (hidden, 3 * hidden)
        assert b is not None and b.const_value is not None and b.const_value.shape == (3 * hidden,)
        assert not any(u.op_type in ("MatMul", "Add") and u.domain == "" for u, _ in x.uses()), \
            "a Q/K/V projection of the attention input is left"
    assert not any(n.op_type == "Add" and n.domain == "" and n.inputs[0] is not None
                   and (p := n.inputs[0].producer()) is not None and p.op_type == "MatMul" for n in model.graph)
    feeds = export_hf.sample_feeds("bert", 3, 16, seed=1)
    mask = np.ones((3, 16), dtype=np.int64)
    mask[1, 11:] = 0  # right padding
    if mask_format == "bias":
        mask[2, :6] = 0  # left padding: exact only with the additive bias
    feeds["attention_mask"] = mask
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)


def rotary_table_text(same_halves: bool = True) -> str:
    """:func:`rotary_gqa_text` with its cos/sin computed in the graph as transformers' rotary_emb writes them:
    ``Unsqueeze(Cos(Concat(f, f, axis=-1)), 1)`` of per-token angles ``f`` ``[1, S, D/2]`` (an input here);
    ``same_halves=False`` concatenates ``f`` with another table ``g`` (halves not provably equal)."""
    second = "f" if same_halves else "g"
    body = rotary_gqa_text().replace(
        f"float[1,1,{S},{D}] cos, float[1,1,{S},{D}] sin)",
        f"float[1,{S},{D // 2}] f" + ("" if same_halves else f", float[1,{S},{D // 2}] g") + ")")
    table = (f"ff = Concat<axis=-1>(f, {second})\n  c3 = Cos(ff)\n  s3 = Sin(ff)\n  cos = Unsqueeze(c3, one1)\n"
             "  sin = Unsqueeze(s3, one1)\n  ")
    body = body.replace("  q4 = Reshape(q, qs)", "  " + table + "q4 = Reshape(q, qs)", 1)
    return body.replace("float sc =", "int64[1] one1 = {1}, float sc =")


def _table_feeds(same_halves: bool = True) -> dict[str, np.ndarray]:
    feeds = _gqa_feeds()
    feeds["f"] = (np.arange(S, dtype=np.float32)[:, None] * (1.0 / 10000 ** (np.arange(0, D, 2) / D))[None, :])[None]
    if not same_halves:
        feeds["g"] = (feeds["f"] * 0.5 + 0.1).astype(np.float32)
    return {k: v.astype(np.float32) for k, v in feeds.items()}


def test_rotary_table_becomes_ort_rotary_embedding() -> None:
    """cos/sin provably ``Cos/Sin(Concat(f, f))``: ``com.microsoft.RotaryEmbedding`` with caches ``Cos(f)``,
    ``Sin(f)`` reshaped to ``[Bc*S, D/2]`` (built once for Q and K) and each token's row as its position id;
    no Neg/Slice rotation left; numbers equal on ORT CPU."""
    proto = parse(rotary_table_text())
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=_table_feeds(),
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask.gqa.rotary": 1, "lowered.Attention": 1,
                                "lowered.RotaryEmbedding": 2, "bias_expansions": 1, "kv_repeats": 2,
                                "rotary_outputs": 2, "rotary_caches": 1, "rotary.kernel": 2})
    left = op_counts(model)
    assert left["com.microsoft.RotaryEmbedding"] == 2 and "Neg" not in left, left
    assert left["Cos"] == 1 and left["Sin"] == 1, left  # the caches, shared by Q and K (the Concat'ed table is gone)


def test_near_miss_rotary_table_halves_differ_inlined() -> None:
    """``Concat(f, g)``: the two halves of cos may differ, which ORT's kernel cannot express: the body is inlined."""
    proto = parse(rotary_table_text(same_halves=False))
    model = check_fusion(lowered(FuseAttentionPass(), "ort"), proto, feeds=_table_feeds(False),
                         stats={"AttentionFusion": 1, "AttentionFusion.mul.mask.gqa.rotary": 1, "lowered.Attention": 1,
                                "lowered.RotaryEmbedding": 2, "bias_expansions": 1, "kv_repeats": 2,
                                "rotary_outputs": 2})
    left = op_counts(model)
    assert "com.microsoft.RotaryEmbedding" not in left and "Neg" in left, left


def test_heads_from_a_computed_target_are_the_shape_querys() -> None:
    """The head count of a target computed as ``[Shape(x)[:2], Shape(x)[2:] / D, D]``: ONNX's inference leaves that
    entry (a ``Div``) and the reshape's head dim unknown, the shape query computes it (``HID / D``), so the split is
    proven and the attention fused (before the readers asked the query: "num_heads cannot be determined")."""
    text = attention_text()
    split = ("sq = Shape(q)\n  lead = Slice(sq, z1, two1)\n  hid = Slice(sq, two1, three1)\n"
             "  heads = Div(hid, d1)\n  shp = Concat<axis=0>(lead, heads, d1)\n  q4 = Reshape(q, shp)")
    text = text.replace("q4 = Reshape(q, shp)", split, 1).replace(
        f"int64[4] shp = {{0, 0, {H}, -1}}",
        f"int64[4] shp = {{0, 0, {H}, -1}}, int64[1] z1 = {{0}}, int64[1] two1 = {{2}}, int64[1] three1 = {{3}}, "
        f"int64[1] d1 = {{{D}}}")
    text = text.replace("k4 = Reshape(k, shp)", "k4 = Reshape(k, shpk)").replace(
        "v4 = Reshape(v, shp)", "v4 = Reshape(v, shpk)").replace("int64[4] shp = ", "int64[4] shpk = ")
    proto = parse(text)
    model = check_fusion(FuseAttentionPass(), proto, stats=_stats("div.mask", lowered=False),
                         ops_left=["mograph.Attention"], feeds=_feeds(proto))
    node = next(n for n in model.graph if n.op_type == "Attention")
    assert node.attributes["num_heads"].value == H


# ------------------------------------------------------------------ reshape targets, read by the shape query ----
_TARGETS = """<ir_version: 8, opset_import: ["" : 17]>
m (float[batch, seq, 64] x, int64[batch, seq] ids) => (float[batch, seq, 4, 16] a, float[batch, seq, 4, 16] b,
                                                     float[batch, seq, 4, 16] c) <int64[2] hd = {4, 16},
                                                     int64 zero = {0}, int64 one = {1}, int64[1] ax = {0}> {
  s = Shape(x)
  s0 = Gather<axis=0>(s, zero)
  s1 = Gather<axis=0>(s, one)
  u0 = Unsqueeze(s0, ax)
  u1 = Unsqueeze(s1, ax)
  t_own = Concat<axis=0>(u0, u1, hd)
  a = Reshape(x, t_own)
  i = Shape(ids)
  j1 = Gather<axis=0>(i, one)
  v1 = Unsqueeze(j1, ax)
  t_ids = Concat<axis=0>(u0, v1, hd)
  b = Reshape(x, t_ids)
  t_swapped = Concat<axis=0>(v1, u0, hd)
  c = Reshape(x, t_swapped)
}"""


@pytest.mark.parametrize(("target", "entries", "dim1_is_x", "own_axes"), [
    ("t_own", ["=batch", "=seq", 4, 16], True, [0, 1]),  # x's own dims: equal by the query
    ("t_ids", ["=batch", "=seq", 4, 16], True, [0, 1]),  # seq read from the ids: named dims of one name are equal
    ("t_swapped", ["=seq", "=batch", 4, 16], False, []),  # dims read, each at the other's place: not kept
])
def test_reshape_target_entries_come_from_the_shape_query(target: str, entries: list, dim1_is_x: bool,
                                                          own_axes: list[int]) -> None:
    """``_entries`` reads a target through the query (ints where it knows a number, the symbolic dim elsewhere);
    ``_is_dim`` compares an entry with a dim, ``_reads_own_axis`` says whether entry ``i`` is read from axis ``i`` of a
    run-time shape."""
    from mograph.passes.fusion._attention_reads import _entries, _is_dim, _keeps_leading, _reads_own_axis
    from mograph.passes.fusion._common import GraphShapes

    from mograph.shapes import Dim

    model = to_ir(parse(_TARGETS))
    shapes = GraphShapes(model.graph)
    values = {v.name: v for n in model.graph for v in n.outputs}
    got = _entries(values[target], shapes)
    assert got == [Dim.sym(e) if isinstance(e, str) else e for e in entries]
    x = model.graph.inputs[0]
    assert _is_dim(got[1], shapes.dim(x, 1)) is dim1_is_x and _is_dim(got[2], Dim.lit(4)) and not _is_dim(got[2], None)
    assert [i for i in (0, 1) if _reads_own_axis(values[target], i, shapes)] == own_axes
    reshape = next(iter(values[target].uses()))[0]
    assert _keeps_leading(reshape, shapes) is dim1_is_x


def _shape_scaled_text(source: str) -> str:
    """Q and K^T each scaled by ``sqrt(1 / sqrt(d))`` with ``d`` computed at run time (optimum's StableLM sdpa export:
    ``d`` = the last dim of the query's shape, cast to float); ``source`` is what ``d`` is read from."""
    text = attention_text(scale="mul-qk").replace(f"float qk = {{{D ** -0.25}}}, ", "")
    reads = {"shape": "dq = Shape(qh)\n  dl = Slice(dq, last, big)\n  df = Cast<to=1>(dl)",
             "input": "df = Identity(sc_in)"}[source]
    text = text.replace("qs = Mul(qh, qk)", f"{reads}\n  rt = Sqrt(df)\n  inv = Div(one, rt)\n  qk = Sqrt(inv)\n"
                                            "  qs = Mul(qh, qk)")
    text = text.replace("float sc =", "int64[1] last = {-1}, int64[1] big = {9223372036854775807}, "
                                      "float[1] one = {1.0}, float sc =")
    if source == "input":
        text = text.replace(f"float[{B},1,1,{S}] bias)", f"float[{B},1,1,{S}] bias, float sc_in)")
    return text


def test_query_key_factor_computed_from_a_literal_dim_folds_into_the_scale() -> None:
    """A factor on Q and K^T computed from the query's static head size (``Sqrt(1 / Sqrt(Cast(Shape(q)[-1])))``) is
    one number for every input: it folds into ``scale`` (optimum's StableLM export stayed unfused)."""
    proto = parse(_shape_scaled_text("shape"))
    model = check_fusion(FuseAttentionPass(), proto, stats=_stats("mul-qk.mask", lowered=False),
                         ops_left=["mograph.Attention"], feeds=_feeds(proto))
    node = next(iter(model.graph))
    assert node.attributes["scale"].value == pytest.approx(1 / math.sqrt(D), rel=1e-6)


def test_near_miss_query_key_factor_computed_from_an_input() -> None:
    """The same arithmetic over a graph input is no constant: untouched, the reason names the scaled query."""
    proto = onnx.parser.parse_model(_shape_scaled_text("input"))
    result = assert_untouched(FuseAttentionPass(explain="true"), proto)
    (miss,) = result.details["rules"]["AttentionFusion"]["near_miss_list"]
    assert "splitting heads, got Mul" in miss["reason"], miss
