"""Opset 23's standard fused ops, as the dynamo exporter writes them, built in code: ``Attention`` between a head
split and merge, ``RMSNormalization`` alone and after a residual ``Add``.

``--target ort``: they become ``mograph.Attention`` / ``mograph.RMSNorm`` (:mod:`.standard_attention`,
:class:`~mograph.passes.fusion.rmsnorm.StandardRMSNormFusion`) and are lowered to ONNX Runtime's
``com.microsoft`` kernels; ``--target onnx`` keeps them standard.  The five checks for each, on ORT CPU with
its optimizations off (ONNX Runtime 1.31.1 and 1.32.0 both have CPU kernels of their own for Attention-23 and
RMSNormalization-23, so the original runs as written).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph.pass_infra import graph_fingerprint
from mograph.plugins import get_registry
from mograph.testing import assert_close, op_counts, run_ort, to_ir, to_proto

pytest.importorskip("onnxruntime")

HIDDEN, HEADS, DIM = 64, 4, 16


def _model(*, kv_heads: int = HEADS, mask: str = "bool", softcap: float = 0.0, rms_axis: int = -1,
           eps: float | None = 1e-6, rotary: bool = False) -> onnx.ModelProto:
    """x [B, S, 64] -> q/k/v projections -> heads (``rotary``: Q and K heads through the standard
    RotaryEmbedding, angles ``pos [B, S] x inv_freq``) -> Attention-23 -> merge -> + x -> RMSNormalization;
    and a second output RMSNormalization(x) with no residual."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(arr, name))
        return name

    def node(op: str, inputs: list[str], out: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    heads = {"q": HEADS, "k": kv_heads, "v": kv_heads}
    split = {}
    for r, n in heads.items():
        w = const(f"w{r}", (0.2 * rng.standard_normal((HIDDEN, n * DIM))).astype(np.float32))
        b = const(f"b{r}", (0.1 * rng.standard_normal(n * DIM)).astype(np.float32))
        proj = node("Add", [node("MatMul", ["x", w], f"mm_{r}"), b], f"proj_{r}")
        shape = const(f"shape_{r}", np.array([0, 0, n, DIM], np.int64))
        split[r] = node("Transpose", [node("Reshape", [proj, shape], f"split_{r}")], f"heads_{r}", perm=[0, 2, 1, 3])
    if rotary:  # the dynamo exporter's form at 23: cos/sin [B, S, D/2] of one angle table
        inv = const("inv_freq", (1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM)).astype(np.float32))
        f = node("Mul", [node("Unsqueeze", ["pos", const("last", np.array([-1], np.int64))], "pos3"), inv], "angles")
        cos, sin = node("Cos", [f], "cos"), node("Sin", [f], "sin")
        for r in ("q", "k"):
            split[r] = node("RotaryEmbedding", [split[r], cos, sin], f"rot_{r}")
    att_inputs = [split["q"], split["k"], split["v"]]
    if mask == "bool":
        att_inputs.append("m")
    elif mask == "float":
        att_inputs.append(node("Where", ["m", const("zero", np.zeros((), np.float32)),
                                         const("ninf", np.array(-1e9, np.float32))], "bias"))
    att_attrs: dict[str, object] = {"scale": 0.25}
    if softcap:
        att_attrs["softcap"] = softcap
    att = node("Attention", att_inputs, "att", **att_attrs)
    merged = node("Transpose", [att], "merged", perm=[0, 2, 1, 3])
    y = node("Reshape", [merged, const("out_shape", np.array([0, 0, HIDDEN], np.int64))], "attn_out")
    res = node("Add", [y, "x"], "residual")
    gamma = const("gamma", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    rms_attrs: dict[str, object] = {"axis": rms_axis} if rms_axis != -1 else {}
    if eps is not None:
        rms_attrs["epsilon"] = eps
    if rms_axis != -1:
        gamma = const("gamma_full", (1 + 0.1 * rng.standard_normal((5, HIDDEN))).astype(np.float32))
    node("RMSNormalization", [res, gamma], "y", **rms_attrs)
    node("RMSNormalization", ["x", gamma], "z", **rms_attrs)
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 5, HIDDEN]),
         helper.make_tensor_value_info("m", TensorProto.BOOL, ["b", 1, 5, 5])]
        + ([helper.make_tensor_value_info("pos", TensorProto.FLOAT, ["b", 5])] if rotary else []),
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["b", 5, HIDDEN]) for o in ("y", "z")],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(rotary: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    m = np.ones((2, 1, 5, 5), bool)  # ORT's Attention-23 kernel wants the query axis spelled out
    m[1, ..., 3:] = False  # right padding in the second row
    pos = np.stack([np.arange(5), np.arange(3, 8)]).astype(np.float32)  # the second row starts at 3
    feeds = {"x": rng.standard_normal((2, 5, HIDDEN)).astype(np.float32), "m": m}
    return {**feeds, "pos": pos} if rotary else feeds


def _fuse(model, target: str, explain: bool = False):  # type: ignore[no-untyped-def]
    reg = get_registry()
    options = {"target": target, "explain": explain}
    stats: dict[str, int] = {}
    details: dict = {}
    modified = False
    for p in reg.instantiate(reg.plan("fuse", options), options):
        result = p.call(model)
        modified = modified or result.modified
        if not p.name.startswith("fuse-") and p.name != "lower":
            continue  # the clean-up after the lowering: shape simplification, CSE (no fusion)
        for k, v in result.stats.items():
            if v and (k.startswith(("lowered.", "inlined.")) or "." not in k):
                stats[k] = stats.get(k, 0) + int(v)
        details[p.name] = result.details
    return stats, modified, details


ORT_FORMS = {"com.microsoft.SkipSimplifiedLayerNormalization": 1, "SimplifiedLayerNormalization": 1}


@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["bool", "float", "none"])
def test_ort_takes_the_standard_ops(kv_heads: int, mask: str) -> None:
    proto = _model(kv_heads=kv_heads, mask=mask)
    feeds = _feeds() if mask != "none" else {"x": _feeds()["x"]}
    if mask == "none":
        del proto.graph.input[1]  # no mask input
    reference = run_ort(proto, feeds)
    model = to_ir(proto)
    stats, modified, _ = _fuse(model, "ort")
    ops = op_counts(model)
    # 1. ops left: ORT's kernels, no standard Attention / RMSNormalization, no mograph op
    for op, n in ORT_FORMS.items():
        assert ops[op] == n, ops
    kernels = {k: v for k, v in ops.items() if k.startswith("com.microsoft.") and "Attention" in k}
    assert sum(kernels.values()) == 1, ops
    if kv_heads == HEADS:  # self-attention over x @ W + b: Q/K/V packed into one GEMM
        assert kernels == {"com.microsoft.Attention": 1}, ops
    assert not {"Attention", "RMSNormalization", "Softmax"} & set(ops), ops
    assert not any(k.startswith("mograph.") for k in ops), ops
    # 2. exact stats
    assert stats["StandardAttentionFusion"] == 1 and stats["StandardRMSNormFusion"] == 2, stats
    assert stats["SkipRMSNormFusion"] == 1 and stats["lowered.Attention"] == 1, stats
    assert stats["lowered.RMSNorm"] == 1 and stats["lowered.SkipRMSNorm"] == 1, stats
    assert "AttentionFusion" not in stats and "RMSNormFusion" not in stats, stats
    assert modified
    # 3. numbers (ORT CPU, optimizations off): the kernels' own rounding only
    got = run_ort(to_proto(model), feeds)
    err = assert_close(reference, got, rel=1e-5)
    assert err < 1e-5
    # 5. a second run changes nothing
    before = graph_fingerprint(model)
    again, modified, _ = _fuse(model, "ort")
    assert not again and not modified, again
    assert graph_fingerprint(model) == before


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_standard_rotary_on_the_heads(target: str) -> None:
    """LLaMA at 23: RotaryEmbedding-23 on the Q and K heads.  ``ort``: into the attention's trace, then ORT's
    ``RotaryEmbedding`` kernel over the export's own angle table (GQA-shaped heads); ``onnx``: kept as written."""
    proto = _model(kv_heads=2, rotary=True)
    feeds = _feeds(rotary=True)
    reference = run_ort(proto, feeds)
    model = to_ir(proto)
    stats, modified, details = _fuse(model, target, explain=True)
    ops = op_counts(model)
    if target == "ort":
        assert ops["com.microsoft.RotaryEmbedding"] == 2 and ops["com.microsoft.MultiHeadAttention"] == 1, ops
        assert not {"Attention", "RotaryEmbedding", "RMSNormalization", "Softmax"} & set(ops), ops
        assert stats["StandardAttentionFusion"] == 1 and stats["lowered.RotaryEmbedding"] == 2, stats
    else:
        assert ops["RotaryEmbedding"] == 2 and ops["Attention"] == 1, ops
        assert "StandardAttentionFusion" not in stats and not any("Rotary" in k for k in stats), stats
    assert modified
    assert_close(reference, run_ort(to_proto(model), feeds), rel=1e-5)
    before = graph_fingerprint(model)
    again, modified, _ = _fuse(model, target)
    assert not again and not modified, again
    assert graph_fingerprint(model) == before


def test_onnx_keeps_the_standard_ops() -> None:
    proto = _model()
    feeds = _feeds()
    reference = run_ort(proto, feeds)
    model = to_ir(proto)
    stats, _, _ = _fuse(model, "onnx")
    ops = op_counts(model)
    # 1./2. the standard ops stay (the residual Add goes into SkipRMSNorm and comes back out for onnx)
    assert ops["Attention"] == 1 and ops["RMSNormalization"] == 2, ops
    assert not any(k.startswith(("mograph.", "com.microsoft.")) for k in ops), ops
    assert "StandardAttentionFusion" not in stats and "StandardRMSNormFusion" not in stats, stats
    assert stats == {"SkipRMSNormFusion": 1, "lowered.SkipRMSNorm": 1}, stats
    # 3. numbers
    assert_close(reference, run_ort(to_proto(model), feeds), rel=1e-6)
    # 5. a second run changes nothing
    before = graph_fingerprint(model)
    again, modified, _ = _fuse(model, "onnx")
    assert not again and not modified, again
    assert graph_fingerprint(model) == before


def test_standard_rmsnorm_default_epsilon_is_onnx_default() -> None:
    """RMSNormalization without ``epsilon`` means 1e-5 (ONNX's default), also inside a SkipRMSNorm."""
    proto = _model(eps=None)
    feeds = _feeds()
    x = feeds["x"] * 1e-3  # small inputs: 1e-5 vs 1e-6 inside the root shows
    feeds["x"] = x
    reference = run_ort(proto, feeds)
    for target in ("ort", "onnx"):
        model = to_ir(proto)
        _fuse(model, target)
        assert_close(reference, run_ort(to_proto(model), feeds), rel=1e-5)


@pytest.mark.parametrize("broken", ["softcap", "rms-axis"])
def test_near_misses_untouched(broken: str) -> None:
    """4. A capped attention (softcap) and an RMSNormalization over axis 1 stay as they are, each a near miss
    that says why (and never that a step should be run first)."""
    proto = _model(softcap=30.0) if broken == "softcap" else _model(rms_axis=1)
    reg = get_registry()
    options = {"target": "ort", "explain": True}
    name = "fuse-attention" if broken == "softcap" else "fuse-rmsnorm"
    (p,) = reg.instantiate([name], options)
    model = to_ir(proto)
    before = graph_fingerprint(model)
    result = p.call(model)
    assert not result.modified and not any(result.stats.values()), result.stats
    assert graph_fingerprint(model) == before
    rule = "StandardAttentionFusion" if broken == "softcap" else "StandardRMSNormFusion"
    misses = result.details["rules"][rule]["near_miss_list"]
    want = "caps its scores" if broken == "softcap" else "is not over the last axis"
    assert len(misses) == (1 if broken == "softcap" else 2) and all(want in m["reason"] for m in misses), misses
    assert not any("run " in m["reason"] for m in misses), misses


def test_ort_runs_the_standard_ops_on_cpu() -> None:
    """The fact the docstring states: ONNX Runtime (the installed version) runs Attention-23 and
    RMSNormalization-23 on CPU with kernels of its own (not an inlined function body)."""
    import json
    import os
    import tempfile

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "p")
    session = ort.InferenceSession(_model().SerializeToString(), so, providers=["CPUExecutionProvider"])
    session.run(None, _feeds())
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    ran = {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}
    assert {"Attention", "RMSNormalization"} <= ran, ran
