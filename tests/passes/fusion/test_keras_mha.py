"""fuse-attention on Keras' MultiHeadAttention as tf2onnx writes it (issue 27).

No TensorFlow here, so the graphs are written with ``onnx.helper`` node for node as tf2onnx 1.9.3 wrote the
g2p_id BERT (``g2p_id_py`` 0.4.2): projections ``Gemm`` over flattened rows, reshaped to ``[B, S, N, D, 1]``
and squeezed, a ``[N, D]`` bias; the ``Einsum`` batched products decomposed into ``Unsqueeze`` / ``Transpose`` /
``Reshape`` to ``[B*N, ., .]`` (shapes read at run time), 3-D ``MatMul``, ``Reshape`` to ``[B, N, ., ., 1]``,
``Squeeze``; the output projection an ``Einsum`` ``abcd,cde->abe`` (layer 0) or the same decomposition through
``Gemm`` (layer 1).  The real export is checked too where the file is present.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from _fusion_util import lowered
from mograph.passes.fusion.attention import FuseAttentionPass
from onnx import TensorProto, helper, numpy_helper

from mograph.testing import assert_close, assert_untouched, check_pass, feeds_for, run_ort, to_proto

B, S = 2, 4
G2P = os.environ.get("MOGRAPH_G2P_BERT", "/tmp/heldout/models/g2p_bert.onnx")


def keras_mha(*, hidden: int = 16, heads: int = 4, key_dim: int = 4, value_dim: int | None = None,
              bias: bool = True, mask: str = "none", out: str = "einsum", proj: str = "gemm",
              seed: int = 0) -> onnx.ModelProto:
    """One Keras MultiHeadAttention (self-attention) in tf2onnx's spelling; ``mask``: none, bias (Keras'
    ``(1 - m) * -1e9`` added to the scores) or after-softmax (a near miss: the mask multiplies the probabilities)."""
    rng = np.random.default_rng(seed)
    vd = value_dim or key_dim
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def const(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def ints(name: str, vals: list[int]) -> str:
        return const(name, np.array(vals, dtype=np.int64))

    def n(op: str, ins: list[str], out_name: str, **attrs: Any) -> str:
        nodes.append(helper.make_node(op, ins, [out_name], name=out_name, **attrs))
        return out_name

    def weight(name: str, shape: tuple[int, ...]) -> str:
        return const(name, (rng.standard_normal(shape) * 0.3).astype(np.float32))

    if proj == "gemm":  # the rows Gemm reads, and the [B, S] its output is reshaped with
        xu = n("Unsqueeze", ["x", ints("ax23", [2, 3])], "xu")
        bs = n("Gather", [n("Shape", [xu], "sx"), ints("i01", [0, 1])], "bs")
        xf = n("Reshape", [xu, ints("flat", [-1, hidden])], "xf")

    def project(p: str, d: int) -> str:
        if proj == "einsum":  # the Einsum kept as Keras wrote it (the heads inside the weight)
            y = n("Einsum", ["x", weight(f"W{p}", (hidden, heads, d))], f"e{p}", equation="abc,cde->abde")
        else:
            g = n("Gemm", [xf, weight(f"W{p}", (heads * d, hidden))], f"g{p}", alpha=1.0, beta=0.0, transB=1)
            t5 = n("Concat", [bs, ints(f"nd{p}", [heads, d, 1])], f"t5{p}", axis=0)
            y = n("Squeeze", [n("Reshape", [g, t5], f"r{p}"), ints(f"ax4{p}", [4])], f"s{p}")
        if bias:
            y = n("Add", [y, weight(f"b{p}", (heads, d))], f"{p}_add")
        return y

    q = n("Mul", [project("q", key_dim), const("scale", np.array(key_dim ** -0.5, dtype=np.float32))], "q_scaled")
    k, v = project("k", key_dim), project("v", vd)

    def merged(name: str, t: str, last: int) -> tuple[str, str]:
        """Reshape(t, [prod(shape[0:2]), -1, shape[last]]) as tf2onnx reads it, and the Shape it reads."""
        sh = n("Shape", [t], f"{name}_shape")
        lead = n("ReduceProd", [n("Gather", [sh, ints(f"{name}_01", [0, 1])], f"{name}_bn")], f"{name}_prod", keepdims=1)
        tail = n("Gather", [sh, ints(f"{name}_last", [last])], f"{name}_tail")
        target = n("Concat", [lead, ints(f"{name}_m1", [-1]), tail], f"{name}_target", axis=0)
        return n("Reshape", [t, target], f"{name}_r"), sh

    qt = n("Transpose", [n("Unsqueeze", [q, ints("ax1", [1])], "qu")], "qt", perm=[0, 3, 1, 2, 4])
    qr, sq = merged("q3", qt, 4)
    kt = n("Transpose", [n("Unsqueeze", [k, ints("ax2", [2])], "ku")], "kt", perm=[0, 3, 1, 2, 4])
    kr, sk = merged("k3", kt, 4)
    mm = n("MatMul", [kr, n("Transpose", [qr], "qT", perm=[0, 2, 1])], "kq")
    bn = n("Max", [n("Gather", [sk, ints("k01", [0, 1])], "kbn"), n("Gather", [sq, ints("q01", [0, 1])], "qbn")], "bn")
    t5s = n("Concat", [bn, n("Gather", [sk, ints("i2", [2])], "kt_len"), n("Gather", [sq, ints("i3", [3])], "qs_len"),
                       ints("one", [1])], "t5s", axis=0)
    scores = n("Transpose", [n("Squeeze", [n("Reshape", [mm, t5s], "sr"), ints("ax4s", [4])], "ss")], "st",
               perm=[0, 1, 3, 2])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", S, hidden])]
    if mask != "none":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", S, S]))
        m4 = n("Unsqueeze", ["mask", ints("axm", [1])], "m4")
    if mask == "bias":
        adder = n("Mul", [n("Sub", [const("f1", np.array(1.0, np.float32)), m4], "inv"),
                          const("neg", np.array(-1e9, np.float32))], "adder")
        scores = n("Add", [scores, adder], "masked")
    probs = n("Softmax", [scores], "probs")
    if mask == "after-softmax":
        probs = n("Mul", [probs, m4], "probs_masked")
    pr, sp = merged("p3", n("Unsqueeze", [probs, ints("ax3", [3])], "pu"), 4)
    vt = n("Transpose", [n("Unsqueeze", [v, ints("ax2v", [2])], "vu")], "vt", perm=[0, 3, 2, 4, 1])
    vr, sv = merged("v3", vt, 4)
    ctx = n("MatMul", [pr, n("Transpose", [vr], "vT", perm=[0, 2, 1])], "ctx3")
    bn2 = n("Max", [n("Gather", [sp, ints("p01", [0, 1])], "pbn"), n("Gather", [sv, ints("v01", [0, 1])], "vbn")], "bn2")
    t5c = n("Concat", [bn2, n("Gather", [sp, ints("i2p", [2])], "p_len"), n("Gather", [sv, ints("i3v", [3])], "v_dim"),
                       ints("one2", [1])], "t5c", axis=0)
    ctx4 = n("Squeeze", [n("Reshape", [ctx, t5c], "cr"), ints("ax4c", [4])], "ctx4")
    if out == "einsum":
        y = n("Einsum", [n("Transpose", [ctx4], "ctx_t", perm=[0, 2, 1, 3]), weight("Wo", (heads, vd, hidden))],
              "proj", equation="abcd,cde->abe")
    else:
        ct = n("Transpose", [n("Unsqueeze", [ctx4, ints("ax1c", [1])], "cu")], "ctt", perm=[0, 3, 1, 2, 4])
        sc = n("Shape", [ct], "sc")
        tf = n("Concat", [ints("m1o", [-1]), n("ReduceProd", [n("Gather", [sc, ints("i34", [3, 4])], "hd")], "hdp",
                                                  keepdims=1)], "tf", axis=0)
        g = n("Gemm", [n("Reshape", [ct, tf], "cf"), weight("Wo2", (hidden, heads * vd))], "go", alpha=1.0, beta=0.0,
              transB=1)
        t5o = n("Concat", [n("Gather", [sc, ints("i01o", [0, 1])], "bso"), ints("h11", [hidden, 1, 1])], "t5o", axis=0)
        y = n("Squeeze", [n("Reshape", [g, t5o], "ro"), ints("ax34", [3, 4])], "proj")
    y = n("Add", [y, weight("bo", (hidden,))], "y")
    graph = helper.make_graph(nodes, "keras_mha", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", S, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], producer_name="tf2onnx")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _feeds(proto: onnx.ModelProto, hidden: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((B, S, hidden)).astype(np.float32)}
    if len(proto.graph.input) > 1:
        m = (rng.random((B, S, S)) > 0.4).astype(np.float32)
        m[..., 0] = 1.0  # every query sees a key
        feeds["mask"] = m
    return feeds


_GEMM_OUT = {"Gemm": 1, "Reshape": 2, "Squeeze": 1, "Shape": 2, "Gather": 2, "Slice": 2, "Concat": 3, "Constant": 6}
CONFIGS: dict[str, tuple[dict[str, object], str, dict[str, int], dict[str, int]]] = {
    # name: (builder kwargs, stats variant, ops left for mograph, for ort beside the fused op).  Left: the Q/K/V
    # projections as MatMul (+ bias Add), the output projection (an Einsum becomes MatMul; the Gemm form keeps its
    # Reshape, whose target the rule computes again from Q), the mask's adder; ort packs Q/K/V when it can.
    "heads4-bias-einsum": ({}, "mul-qk.nomask", {"MatMul": 4, "Add": 4}, {"com.microsoft.Attention": 1, "MatMul": 1,
                                                                             "Add": 1}),
    "heads2-einsum-proj": ({"heads": 2, "key_dim": 8, "proj": "einsum"}, "mul-qk.nomask", {"MatMul": 4, "Add": 4},
                           {"com.microsoft.Attention": 1, "MatMul": 1, "Add": 1}),
    "heads1-nobias-gemm": ({"heads": 1, "key_dim": 16, "bias": False, "out": "gemm"}, "mul-qk.nomask",
                           {"MatMul": 3, "Add": 1, **_GEMM_OUT}, {"com.microsoft.MultiHeadAttention": 1, "MatMul": 3,
                                                                  "Add": 1, **_GEMM_OUT}),
    "heads4-mask-valuedim": ({"value_dim": 6, "mask": "bias", "out": "gemm"}, "mul-qk.mask",
                             {"MatMul": 3, "Add": 4, "Sub": 1, "Mul": 1, "Unsqueeze": 1, **_GEMM_OUT},
                             {"com.microsoft.MultiHeadAttention": 1, "MatMul": 3, "Add": 4, "Sub": 1, "Mul": 1,
                              "Unsqueeze": 1, **_GEMM_OUT}),
}


@pytest.mark.parametrize("target", ["mograph", "ort"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_keras_mha_fuses(name: str, target: str) -> None:
    """Ops left, exact stats, numbers (ORT optimizations off) and a no-op second run, per config and target."""
    kwargs, variant, left, left_ort = CONFIGS[name]
    proto = keras_mha(**kwargs)  # type: ignore[arg-type]
    stats = {"AttentionFusion": 1, f"AttentionFusion.{variant}": 1}
    if target == "ort":
        stats["lowered.Attention"] = 1
    ops = Counter({"mograph.Attention": 1, **left}) if target == "mograph" else Counter(left_ort)
    model = check_pass(lowered(FuseAttentionPass(), target), proto, stats=stats, ops_left=ops, feeds=_feeds(proto))
    att = next(n for n in model.graph if n.op_type in ("Attention", "MultiHeadAttention"))
    assert att.attributes["num_heads"].value == kwargs.get("heads", 4)
    if target == "mograph":
        assert att.attributes["scale"].value == pytest.approx(float(kwargs.get("key_dim", 4)) ** -0.5)  # type: ignore[arg-type]


def test_keras_mha_mask_after_softmax_is_a_near_miss_explained() -> None:
    """The mask multiplying the probabilities (not added to the scores) is not attention's math: the graph is left
    exactly as it was (every canonical edit undone), and --explain names the Softmax and the node after it."""
    proto = keras_mha(mask="after-softmax")
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), proto)
    (entry,) = result.details["fuse-attention"]["unfused_softmax"]
    assert entry["softmax"] == "probs"
    assert "expected MatMul(probabilities, V)" in entry["reason"] and "got Mul" in entry["reason"]


@pytest.mark.skipif(not os.path.exists(G2P), reason=f"the real export is not here ({G2P})")
@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_real_g2p_bert_export(target: str) -> None:
    """The real tf2onnx 1.9.3 export (two encoder layers, no mask): both attentions fuse, numbers agree."""
    from mograph import api

    proto = onnx.load(G2P)
    feeds = {"input_1": np.random.default_rng(0).integers(0, 32, size=(1, 32)).astype(np.int64)}
    model, report = api.optimize(proto, "cleanup,fuse", options={"target": target})
    stats = next(p for p in report.passes if p.name == "fuse-attention").stats
    assert stats == {"AttentionFusion": 2, "AttentionFusion.mul-qk.nomask": 2}
    out = model if isinstance(model, onnx.ModelProto) else to_proto(model)
    ops = Counter(n.op_type for n in out.graph.node)
    if target == "ort":
        # ONNX Runtime's kernels (packed QKV Attention where the projections pack); the classifier's Softmax stays
        assert ops["Attention"] + ops["MultiHeadAttention"] == 2 and ops["Softmax"] == 1
    assert_close(run_ort(proto, feeds), run_ort(out, feeds), rel=1e-5)


# ------------------------------------------------------------- real Keras 3 exports of the corpus -----

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
#: keras.layers.MultiHeadAttention(num_heads=1, key_dim=16) exported by tf2onnx 1.17 (tools/corpus/make_corpus.py):
#: one head, so tf2onnx writes the head transposes as Reshapes (or leaves them out); the scale on the scores.
KERAS3 = ["keras_tf2onnx13_ln-tanh", "keras_tf2onnx17_ln-tanh", "keras_tf2onnx17_ln-tanh_fp16"]


@pytest.mark.parametrize("target", ["mograph", "ort"])
@pytest.mark.parametrize("name", KERAS3)
def test_keras3_corpus_export_fuses(name: str, target: str) -> None:
    proto = onnx.load(str(CORPUS / f"{name}.onnx"))
    stats = {"AttentionFusion": 1, "AttentionFusion.mul.nomask": 1}
    fused = "mograph.Attention"
    if target == "ort":
        stats["lowered.Attention"] = 1
        fused = "com.microsoft.Attention"  # x @ W projections of one input: packed QKV
    left = {"Softmax": 0, "Einsum": 0, "Squeeze": 0, fused: 1}
    model = check_pass(lowered(FuseAttentionPass(), target), proto, stats=stats, feeds=feeds_for(proto))
    ops = Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in model.graph)
    assert {k: ops[k] for k in left} == left, ops


def test_keras3_export_softmax_over_queries_is_a_near_miss_explained() -> None:
    """The real export with its Softmax over the query axis (2): not attention; untouched, and --explain says so."""
    proto = onnx.load(str(CORPUS / "keras_tf2onnx17_ln-tanh.onnx"))
    softmax = next(n for n in proto.graph.node if n.op_type == "Softmax")
    del softmax.attribute[:]
    softmax.attribute.append(helper.make_attribute("axis", 2))
    result = assert_untouched(FuseAttentionPass(explain="true"), proto)
    (entry,) = result.details["unfused_softmax"]
    assert entry["softmax"] == softmax.name and "Softmax is over axis 2, not the key axis" in entry["reason"]
