"""fuse-attention on graphs built in code (every variant), on bert_tiny, and on real BERT exports.

Numerics are checked with ONNX Runtime's own optimizations off, on feeds whose attention mask has
padded positions (zeros), so the masked softmax is exercised.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from _fusion_util import (
    assert_close,
    assert_untouched,
    check_fusion,
    lowered,
    op_counts,
    parse,
    run_ort,
    run_pass,
    to_ir,
    to_proto,
)
from mograph.passes.fusion import attention_op
from mograph.passes.fusion.attention import FuseAttentionPass

from models.builders import bert_feeds, bert_tiny
from mograph.pass_infra import graph_fingerprint

B, S, H, D = 2, 5, 4, 4
HID = H * D
UNFUSED = {"Reshape", "Transpose", "Softmax"}  # what the attention core is made of


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


def _mask_index_inputs(model: ir.Model) -> set[str]:
    """The names of the values every attention node takes as its mask index (input 3 of Attention, 4 of MHA)."""
    out = set()
    for n in model.graph:
        i = {"Attention": 3, "MultiHeadAttention": 4}.get(n.op_type) if n.domain == "com.microsoft" else None
        if i is not None and len(n.inputs) > i and n.inputs[i] is not None:
            out.add(n.inputs[i].name)
    return out


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
    assert _mask_index_inputs(model) == set()
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
    assert _mask_index_inputs(model) == {cast.outputs[0].name}
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
    assert _mask_index_inputs(model) == {red.outputs[0].name}
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
    assert _mask_index_inputs(model) == set()


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


# ------------------------------------------------------------------ real exports -----------------

EXPORTS = [("torchscript", 14), ("torchscript", 17), ("dynamo", 18)]
L = 2


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("MOGRAPH_TEST_EXPORT_DIR")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return Path(env)
    return tmp_path_factory.mktemp("exports")


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
    traced = exporter == "torchscript"  # dynamo writes the padding lookup with GatherND: not traced, stays a bias
    stats = {"AttentionFusion": L, "AttentionFusion.mul.mask": L, "lowered.Attention": L,
             **({"mask_index_casts": 1} if traced else {})}
    model = check_fusion(lowered(FuseAttentionPass(mask_format="raw"), "ort"), proto, stats=stats, feeds=feeds)
    if traced:  # transformers' index-based padding mask is traced to attention_mask: its computation is gone
        (cast,) = [n for n in model.graph if n.op_type == "Cast" and n.inputs[0].name == "attention_mask"]
        assert _mask_index_inputs(model) == {cast.outputs[0].name}
        assert "Flatten" not in op_counts(model)
    else:
        assert _mask_index_inputs(model) == set()

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
    before = graph_fingerprint(model)
    assert not lowered(FuseAttentionPass(), "ort").call(model).modified
    assert graph_fingerprint(model) == before


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
