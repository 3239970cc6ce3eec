"""Smoothing folded into the producer of the smoothed activation (LayerNorm gamma/beta, MatMul/Gemm columns).

Each fold kind gets the five checks of :mod:`mograph.testing` through ``check_pass`` (numbers against FP32 at an INT8
tolerance), the same pass with folding switched off gives the same numbers (the fold is exact up to float
rounding), and in float alone (no Q/DQ) the folded graph computes what the original did.  The float
layers are the default rules' (``accuracy_budget="off"``), so the counts do not depend on a measurement; the measured default is tested in ``test_int8_sensitivity.py``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from mograph.passes.quant import QdqInt8Pass, smoothing
from mograph.passes.quant._qdq import find_candidates
from onnx import helper, numpy_helper

from mograph.testing import assert_close, assert_untouched, check_pass, op_counts, run_ort, to_ir, to_proto

F32 = onnx.TensorProto.FLOAT
D = 16


def _w(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.3).astype(np.float32)


def _model(kind: str, second_reader: bool = False) -> onnx.ModelProto:
    """``h = producer(x)`` with an outlier channel (x40 in channel 3), read by q and k projections;
    ``y = Relu(q + k) @ w_head`` (the head is the final projection, kept float by the rules).

    ``kind``: ``ln`` (LayerNormalization), ``skipln`` (com.microsoft.SkipLayerNormalization), ``matmul``
    (MatMul + bias Add), ``gemm`` (Gemm with transB and bias).  ``second_reader``: h is also added to
    the output (a residual), so the fold would change what that reader sees."""
    rng = np.random.default_rng(0)
    gain = np.ones(D, np.float32)
    gain[3] = 40.0
    inits = [numpy_helper.from_array(_w(rng, D, D), "wq"), numpy_helper.from_array(_w(rng, D, D), "wk"),
             numpy_helper.from_array(_w(rng, D, D), "w_head")]
    inputs = [helper.make_tensor_value_info("x", F32, ["b", "s", D])]
    if kind in ("ln", "skipln"):
        inits += [numpy_helper.from_array(gain, "gamma"),
                  numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "beta")]
        if kind == "ln":
            nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="ln", axis=-1)]
        else:
            inputs.append(helper.make_tensor_value_info("skip", F32, ["b", "s", D]))
            nodes = [helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["h"],
                                      name="skipln", domain="com.microsoft", epsilon=1e-5)]
    elif kind == "matmul":
        inits += [numpy_helper.from_array(_w(rng, D, D) * gain[None, :], "w0"),
                  numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "b0")]
        nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"], name="fc0"),
                 helper.make_node("Add", ["h0", "b0"], ["h"], name="fc0_bias")]
    else:  # gemm, 2-D input
        inputs = [helper.make_tensor_value_info("x", F32, ["n", D])]
        inits += [numpy_helper.from_array(np.ascontiguousarray((_w(rng, D, D) * gain[None, :]).T), "w0"),
                  numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "b0")]
        nodes = [helper.make_node("Gemm", ["x", "w0", "b0"], ["h"], name="fc0", transB=1)]
    nodes += [
        helper.make_node("MatMul", ["h", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["h", "wk"], ["k"], name="k_proj"),
        helper.make_node("Add", ["q", "k"], ["qk"]),
        helper.make_node("Relu", ["qk"], ["r"]),
        helper.make_node("MatMul", ["r", "w_head"], ["y0"], name="head"),
    ]
    if second_reader:
        nodes.append(helper.make_node("Add", ["y0", "h"], ["y"], name="residual"))
    else:
        nodes.append(helper.make_node("Identity", ["y0"], ["y"]))
    out_shape = ["n", D] if kind == "gemm" else ["b", "s", D]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", F32, out_shape)], inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if kind == "skipln" else [])
    return helper.make_model(graph, opset_imports=opsets)


def _feeds(proto: onnx.ModelProto, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        shape = (6, D) if proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "n" else (2, 6, D)
        out.append({i.name: rng.standard_normal(shape).astype(np.float32) for i in proto.graph.input})
    return out


def _pass(proto: onnx.ModelProto) -> QdqInt8Pass:
    return QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds(proto, 6, 1), smoothing="0.5")


# kind -> (smoothed activations folded, left as Mul): the matmul / gemm models' x is a graph input
# (smoothed with a Mul, no producer to fold into); their h is folded into fc0
FOLDS = {"ln": (1, 0), "skipln": (1, 0), "matmul": (1, 1), "gemm": (1, 1)}


@pytest.mark.parametrize("kind", sorted(FOLDS))
def test_fold_five_checks(kind):
    proto = _model(kind)
    folded, mul = FOLDS[kind]
    quantized = 2 + (folded + mul - 1)  # q/k projections, plus fc0 where it is a weight MatMul/Gemm
    acts = folded + mul
    stats = {
        "quantized": quantized, f"quantized.{'Gemm' if kind == 'gemm' else 'MatMul'}": 1 if kind == "gemm" else quantized,
        "kept_float": 1, "skipped_already_quantized": 0, "calibration_samples": 6,
        "q_nodes": acts, "dq_nodes": acts + quantized + (1 if kind == "gemm" else 0),  # Gemm bias: INT32 DQ
        "smoothed": acts, "smoothed.folded": folded, "smoothed.mul": mul,
    }
    if kind == "gemm":
        stats["quantized.MatMul"] = 2
    before = op_counts(to_ir(proto))
    ops = Counter(before)
    ops.update({"QuantizeLinear": acts, "DequantizeLinear": stats["dq_nodes"], "Mul": mul})
    feeds = _feeds(proto, 1, 7)[0]
    model = check_pass(_pass(proto), proto, stats=stats, ops_left=+ops, rel=0.05, feeds=feeds)
    plan = model and _pass(proto).call(to_ir(proto)).details["plan"]
    meta = plan["smoothing"]
    assert (meta["folded"], meta["mul"]) == (folded, mul)
    assert sum("folded_into" in r for r in meta["activations"]) == folded


@pytest.mark.parametrize("kind", sorted(FOLDS))
def test_fold_gives_the_numbers_of_the_mul(kind, monkeypatch):
    proto = _model(kind)
    feeds = _feeds(proto, 3, 1)  # within the calibrated ranges (the first calibration feeds)
    folded = to_ir(proto)
    assert _pass(proto).call(folded).stats["smoothed.folded"] == FOLDS[kind][0]
    monkeypatch.setattr(smoothing, "fold_target", lambda *args: None)
    unfolded = to_ir(proto)
    res = _pass(proto).call(unfolded)
    assert res.stats["smoothed.folded"] == 0 and res.stats["smoothed.mul"] == sum(FOLDS[kind])
    for f in feeds:
        if kind != "gemm":
            # the same Q/DQ ranges on the same tensors: only float rounding of X / s differs (a rare INT8 step)
            assert_close(run_ort(to_proto(unfolded), f), run_ort(to_proto(folded), f), 2e-3)
        else:
            # unfolded, the Gemm's output pair (QGemm) quantizes h and the Mul's output is quantized again;
            # folded, h / s is quantized once: not the same numbers, and no further from FP32
            ref = run_ort(proto, f)
            err_folded = assert_close(ref, run_ort(to_proto(folded), f), 0.05)
            err_mul = assert_close(ref, run_ort(to_proto(unfolded), f), 0.05)
            assert err_folded <= err_mul * 1.05, (err_folded, err_mul)


@pytest.mark.parametrize("kind", sorted(FOLDS))
def test_fold_is_exact_in_float(kind):
    proto = _model(kind)
    model = to_ir(proto)
    cands, _ = find_candidates(model)
    groups = [g for g in smoothing.smoothing_groups(cands) if g.name == "h"]
    assert len(groups) == 1
    amax = np.linspace(0.5, 8.0, D).astype(np.float32)
    assert smoothing.apply_smoothing(model, groups[0], amax, 0.7)
    assert groups[0].folded and groups[0].smoothed is groups[0].value
    assert op_counts(model) == op_counts(to_ir(proto))  # no Mul: the producer computes X / s
    for f in _feeds(proto, 2, 3):
        assert_close(run_ort(proto, f), run_ort(to_proto(model), f), 1e-5)


def test_second_reader_keeps_the_mul():
    """Near miss: h is also read by the residual Add, which must see h itself: the Mul stays."""
    proto = _model("ln", second_reader=True)
    stats = {
        "quantized": 2, "quantized.MatMul": 2, "kept_float": 1, "skipped_already_quantized": 0,
        "calibration_samples": 6, "q_nodes": 1, "dq_nodes": 3, "smoothed": 1, "smoothed.folded": 0, "smoothed.mul": 1,
    }
    ops = Counter(op_counts(to_ir(proto)))
    ops.update({"QuantizeLinear": 1, "DequantizeLinear": 3, "Mul": 1})
    model = check_pass(_pass(proto), proto, stats=stats, ops_left=ops, rel=0.05, feeds=_feeds(proto, 1, 7)[0])
    ln = next(n for n in model.graph if n.op_type == "LayerNormalization")
    assert ln.inputs[1].name == "gamma" and ln.inputs[2].name == "beta"  # not folded
    # and in float alone, fold_target refuses
    m = to_ir(proto)
    g = next(g for g in smoothing.smoothing_groups(find_candidates(m)[0]) if g.name == "h")
    assert smoothing.fold_target(g, D) is None


def test_quantized_model_is_a_no_op_again():
    """The untouched near miss of the five checks: the pass on its own output changes nothing."""
    proto = _model("ln")
    model = to_ir(proto)
    _pass(proto).call(model)
    assert_untouched(_pass(proto), to_proto(model))


def _context_groups(model):  # type: ignore[no-untyped-def]
    cands, _ = find_candidates(model)
    return [g for g in smoothing.smoothing_groups(cands) if g.value.producer().op_type == "Reshape"]


def test_attention_context_fold_is_exact_in_float():
    """bert-tiny's attention contexts: X / s is made by the value projection's columns and bias, no Mul."""
    from models.builders import bert_feeds, bert_tiny

    proto = bert_tiny()
    model = to_ir(proto)
    groups = _context_groups(model)
    assert len(groups) == 2
    rng = np.random.default_rng(5)
    for g in groups:
        n = int(g.cands[0].node.inputs[1].const_value.shape[0])
        assert smoothing.apply_smoothing(model, g, rng.uniform(0.2, 9.0, n).astype(np.float32), 0.8)
        assert g.folded is not None and "value" in g.folded and "through attention" in g.folded
    assert op_counts(model) == op_counts(to_ir(proto))
    for seed in range(2):
        f = bert_feeds(batch=2, seq=12, seed=seed)
        assert_close(run_ort(proto, f), run_ort(to_proto(model), f), 1e-5)


def test_attention_context_not_folded_when_the_values_have_another_reader():
    """Near miss: the value projection's output is a graph output too: dividing it would change that output."""
    from models.builders import bert_tiny

    proto = bert_tiny()
    model = to_ir(proto)
    g = _context_groups(model)[0]
    n = int(g.cands[0].node.inputs[1].const_value.shape[0])
    assert smoothing.fold_target(g, n) is not None
    v = g.value.producer().inputs[0].producer().inputs[0].producer().inputs[1].producer().inputs[0]
    v = v.producer().inputs[0]  # Reshape -> the value projection's output
    model.graph.outputs.append(v)
    assert smoothing.fold_target(g, n) is None
    assert smoothing.fold_target(_context_groups(to_ir(proto))[0], n, observed={v.name}) is None


def _exported_attention(swap_dims: bool = False) -> onnx.ModelProto:
    """The context of one attention as torch exports it: ``Reshape(v, Concat(B, S, -1, D))`` with B and S
    from ``Shape(x)``, merged back by ``Reshape(.., Concat(B, S, -1))``; ``y = context @ w_o``, then a float head.
    ``swap_dims``: the split's leading entries are (S, B), which splits rows, not channels."""
    rng = np.random.default_rng(3)
    h, d = 2, 8
    n = h * d
    i64 = [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in
           (("i0", 0), ("i1", 1), ("ax0", [0]), ("m1_d", [-1, d]), ("m1", [-1]))]
    inits = [numpy_helper.from_array(_w(rng, n, n), "wv"), numpy_helper.from_array(_w(rng, n), "bv"),
             numpy_helper.from_array(_w(rng, n, n), "wo"), numpy_helper.from_array(_w(rng, n, n), "w_head"), *i64]
    first, second = ("i1", "i0") if swap_dims else ("i0", "i1")
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        helper.make_node("Gather", ["shp", first], ["g0"], axis=0),
        helper.make_node("Gather", ["shp", second], ["g1"], axis=0),
        helper.make_node("Unsqueeze", ["g0", "ax0"], ["u0"]),
        helper.make_node("Unsqueeze", ["g1", "ax0"], ["u1"]),
        helper.make_node("Concat", ["u0", "u1", "m1_d"], ["split"], axis=0),
        helper.make_node("Concat", ["u0", "u1", "m1"], ["merge"], axis=0),
        helper.make_node("MatMul", ["x", "wv"], ["v0"], name="value"),
        helper.make_node("Add", ["bv", "v0"], ["v"]),
        helper.make_node("Reshape", ["v", "split"], ["v4"]),
        helper.make_node("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["x", "split"], ["v4_scores"]),
        helper.make_node("Transpose", ["v4_scores"], ["vs"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v4_scores"], ["qt"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["qt", "vs"], ["sc"]),
        helper.make_node("Softmax", ["sc"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vt"], ["ctx4"], name="context"),
        helper.make_node("Transpose", ["ctx4"], ["ctx4t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx4t", "merge"], ["ctx"]),
        helper.make_node("MatMul", ["ctx", "wo"], ["o"], name="out_proj"),
        helper.make_node("Relu", ["o"], ["r"]),
        helper.make_node("MatMul", ["r", "w_head"], ["y"], name="head"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [2, 5, n])],
                              [helper.make_tensor_value_info("y", F32, [2, 5, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("swap", [False, True])
def test_exported_attention_split_by_minus_one(swap):
    proto = _exported_attention(swap_dims=swap)
    onnx.checker.check_model(proto)
    model = to_ir(proto)
    cands, _ = find_candidates(model)
    g = next(g for g in smoothing.smoothing_groups(cands) if g.name == "ctx")
    if swap:  # (S, B, -1, D) does not split the channels into heads: no fold, the Mul stays
        assert smoothing.fold_target(g, 16) is None
        return
    assert smoothing.fold_target(g, 16) is not None
    assert smoothing.apply_smoothing(model, g, np.linspace(0.3, 7.0, 16).astype(np.float32), 0.8)
    assert g.folded is not None and g.folded.startswith("MatMul value weight columns and bias, through attention")
    assert op_counts(model) == op_counts(to_ir(proto))
    f = {"x": np.random.default_rng(4).standard_normal((2, 5, 16)).astype(np.float32)}
    assert_close(run_ort(proto, f), run_ort(to_proto(model), f), 1e-5)
