"""weight-only: the five checks, the three algorithms' accuracy, the lowerings (MatMulNBits, blocked DQ-21), the plan."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import yaml
from mograph.passes.quant import WeightOnlyPass
from mograph.passes.quant import _blockwise as bw
from mograph.passes.quant.weight_only_op import dequantize, reference
from onnx import helper, numpy_helper

from models.builders import bert_feeds, bert_tiny
from mograph.errors import OptionError
from mograph.lowering import lower_model
from mograph.plugins import get_registry
from mograph.testing import assert_close, assert_untouched, check_pass, op_types, run_ort, to_ir, to_proto

K, N1, N2 = 256, 128, 64


def representable(rng: np.random.Generator, k: int, n: int, bs: int = 128, bits: int = 4) -> np.ndarray:
    """Weights every block of which RTN stores exactly: (q - z) * s with codes 0 and 2^bits - 1 present."""
    qmax = (1 << bits) - 1
    nb = -(-k // bs)
    q = rng.integers(0, qmax + 1, size=(nb * bs, n))
    q[0::bs] = 0
    q[1::bs] = qmax
    z = rng.integers(1, qmax, size=(nb, n))
    s = rng.uniform(0.01, 0.05, size=(nb, n))
    w = (q - np.repeat(z, bs, axis=0)) * np.repeat(s, bs, axis=0)
    return w[:k].astype(np.float32)


def mlp(w1: np.ndarray, w2: np.ndarray, *, gemm: bool = False) -> onnx.ModelProto:
    k = w1.shape[0]
    first = (helper.make_node("Gemm", ["xn", "W1t", "c1"], ["h"], transB=1) if gemm
             else helper.make_node("MatMul", ["xn", "W1"], ["h"]))
    inits = [numpy_helper.from_array(np.ones(k, np.float32), "g"), numpy_helper.from_array(np.zeros(k, np.float32), "b"),
             numpy_helper.from_array(w2, "W2")]
    if gemm:
        inits += [numpy_helper.from_array(np.ascontiguousarray(w1.T), "W1t"),
                  numpy_helper.from_array(np.linspace(-1, 1, w1.shape[1]).astype(np.float32), "c1")]
    else:
        inits.append(numpy_helper.from_array(w1, "W1"))
    x_shape: list = [2, k] if gemm else ["B", "S", k]
    y_shape: list = [2, w2.shape[1]] if gemm else ["B", "S", w2.shape[1]]
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "g", "b"], ["xn"], axis=-1), first,
         helper.make_node("Relu", ["h"], ["hr"], name="relu"), helper.make_node("MatMul", ["hr", "W2"], ["y"], name="out")],
        "mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, y_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def calib(rng: np.random.Generator, n: int = 8, k: int = K, shape: tuple = (1, 12)) -> list[dict]:
    return [{"x": rng.standard_normal((*shape, k)).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("algorithm", ["rtn", "awq", "gptq"])
def test_five_checks_on_representable_weights(algorithm):
    rng = np.random.default_rng(0)
    proto = mlp(representable(rng, K, N1), representable(rng, N1, N2))
    options = {"algorithm": algorithm, "output_projection": "bits"}
    if algorithm != "rtn":
        options["calibration_data"] = calib(rng)
    stats = {"quantized": 2, "kept_float": 0, "quantized.int4": 2}
    if algorithm != "rtn":
        stats["calibration_samples"] = 8
    if algorithm == "gptq":
        stats["sequential_runs"] = 16  # 2 layer groups x 8 samples
    # exactly representable weights: every algorithm finds them (alpha 0, clip ratio 1, no GPTQ error)
    model = check_pass(WeightOnlyPass(**options), proto, stats=stats,
                       ops_left=["LayerNormalization", "mograph.WeightOnlyMatMul", "Relu", "mograph.WeightOnlyMatMul"],
                       feeds={"x": rng.standard_normal((2, 3, K)).astype(np.float32)})
    # 4 bits on disk: the packed codes are K*N/2 bytes
    b = model.graph.node(1).inputs[1].const_value
    assert b.dtype == ir.DataType.UINT8 and b.nbytes == K * N1 // 2


def test_default_plan_keeps_output_projection_float():
    rng = np.random.default_rng(1)
    proto = mlp(representable(rng, K, N1), representable(rng, N1, N2))
    model = check_pass(WeightOnlyPass(algorithm="rtn"), proto, stats={"quantized": 1, "kept_float": 1, "quantized.int4": 1},
                       ops_left=["LayerNormalization", "mograph.WeightOnlyMatMul", "Relu", "MatMul"])
    assert model is not None


def test_gemm_transb_bias():
    rng = np.random.default_rng(2)
    proto = mlp(representable(rng, K, N1), representable(rng, N1, N2), gemm=True)
    check_pass(WeightOnlyPass(algorithm="rtn", output_projection="bits"), proto,
               stats={"quantized": 2, "kept_float": 0, "quantized.int4": 2},
               ops_left=["LayerNormalization", "mograph.WeightOnlyMatMul", "Add", "Relu", "mograph.WeightOnlyMatMul"],
               feeds={"x": rng.standard_normal((2, K)).astype(np.float32)})


def test_near_misses_untouched():
    rng = np.random.default_rng(3)
    # activation x activation MatMul: no weight
    a = helper.make_graph([helper.make_node("MatMul", ["x", "y"], ["z"])], "g",
                          [helper.make_tensor_value_info("x", 1, [2, 32, 32]), helper.make_tensor_value_info("y", 1, [2, 32, 32])],
                          [helper.make_tensor_value_info("z", 1, [2, 32, 32])])
    assert_untouched(WeightOnlyPass(algorithm="rtn", output_projection="bits"),
                     helper.make_model(a, opset_imports=[helper.make_opsetid("", 17)]))
    # K = 8 < 16: too small to block-quantize
    w = rng.standard_normal((8, 32)).astype(np.float32)
    small = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["z"])], "g",
                              [helper.make_tensor_value_info("x", 1, [2, 8])], [helper.make_tensor_value_info("z", 1, [2, 32])],
                              [numpy_helper.from_array(w, "W")])
    assert_untouched(WeightOnlyPass(algorithm="rtn", output_projection="bits"),
                     helper.make_model(small, opset_imports=[helper.make_opsetid("", 17)]))
    # a 3-D weight (batched MatMul)
    w3 = rng.standard_normal((2, 32, 32)).astype(np.float32)
    batched = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["z"])], "g",
                                [helper.make_tensor_value_info("x", 1, [2, 4, 32])], [helper.make_tensor_value_info("z", 1, [2, 4, 32])],
                                [numpy_helper.from_array(w3, "W")])
    assert_untouched(WeightOnlyPass(algorithm="rtn", output_projection="bits"),
                     helper.make_model(batched, opset_imports=[helper.make_opsetid("", 17)]))


def _correlated(rng: np.random.Generator, rows: int, k: int, mix: np.ndarray, gain: np.ndarray) -> np.ndarray:
    return ((rng.standard_normal((rows, k)) @ mix) * gain).astype(np.float32)


def test_awq_and_gptq_beat_rtn_on_held_out_inputs():
    """Inputs with a few loud channels and correlated features: the calibrated algorithms cut the output error."""
    rng = np.random.default_rng(4)
    k, n = 256, 128
    gain = np.ones(k)
    gain[rng.choice(k, 8, replace=False)] = 12.0
    mix = np.eye(k) + 0.3 * rng.standard_normal((k, k)) / np.sqrt(k)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    x_cal = _correlated(rng, 4096, k, mix, gain)
    x_test = _correlated(rng, 2048, k, mix, gain)
    spec = bw.QuantSpec(4, 128, False)
    ref = x_test @ w

    def err(w_hat: np.ndarray, xs: np.ndarray = x_test) -> float:
        return float(np.linalg.norm(xs @ w_hat - ref) / np.linalg.norm(ref))

    e_rtn = err(bw.rtn(w, spec).dequantize())
    h = x_cal.T.astype(np.float64) @ x_cal / len(x_cal)
    e_gptq = err(bw.gptq(w, h, spec).dequantize())
    e_gptq_ao = err(bw.gptq(w, h, spec, act_order=True).dequantize())
    a, alpha = bw.awq_scales([w], x_cal[:1024], spec)
    s, z = bw.search_params(w * a[:, None], spec, np.diag(h) / a**2)
    e_awq = err(bw.quantize(w * a[:, None], s, z, spec).dequantize(), x_test / a)
    assert alpha > 0
    print(e_rtn, e_awq, e_gptq, e_gptq_ao)
    assert e_awq < 0.85 * e_rtn, (e_awq, e_rtn)
    assert e_gptq < 0.85 * e_rtn, (e_gptq, e_rtn)
    assert e_gptq_ao < 0.85 * e_rtn, (e_gptq_ao, e_rtn)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, False), (8, True)])
def test_lowerings_match_the_function_body(bits, symmetric):
    rng = np.random.default_rng(5)
    proto = mlp((rng.standard_normal((200, N1)) * 0.05).astype(np.float32), (rng.standard_normal((N1, N2)) * 0.05).astype(np.float32))
    model = to_ir(proto)
    WeightOnlyPass(algorithm="rtn", bits=bits, symmetric=symmetric, block_size=64, output_projection="bits").call(model)
    feeds = {"x": rng.standard_normal((2, 3, 200)).astype(np.float32)}
    canonical = run_ort(to_proto(model), feeds)[0]
    # the numpy reference agrees with the function body
    node = model.graph.node(1)
    consts = [v.const_value.numpy() for v in node.inputs[1:]]
    xn = run_ort(proto, feeds)  # noqa: F841 - the float model still runs
    attrs = {k: a.as_int() for k, a in node.attributes.items()}
    w_ref = dequantize(*consts, attrs["K"], attrs["bits"], attrs["block_size"])
    assert w_ref.shape == (200, N1)
    x = rng.standard_normal((5, 200)).astype(np.float32)
    np.testing.assert_allclose(reference(x, *consts, **attrs)[0], x @ w_ref, rtol=1e-5)
    for target, ops in (("ort", ["com.microsoft.MatMulNBits"]), ("onnx", ["DequantizeLinear", "MatMul"])):
        m = ir.serde.deserialize_model(ir.serde.serialize_model(model))
        result = lower_model(m, target, registry=get_registry(), upgrade="auto" if target == "onnx" else None)
        assert result.stats["lowered.WeightOnlyMatMul"] == 2
        p = to_proto(m)
        onnx.checker.check_model(p)
        got = op_types(m)
        assert got == ["LayerNormalization", *ops, "Relu", *ops], got
        assert "mograph" not in {o.domain for o in p.opset_import}
        np.testing.assert_allclose(run_ort(p, feeds)[0], canonical, rtol=1e-4, atol=1e-5)
        if target == "onnx":
            dq = m.graph.node(1)
            w = dq.inputs[0].const_value
            want = {(4, True): ir.DataType.INT4, (4, False): ir.DataType.UINT4, (8, True): ir.DataType.INT8,
                    (8, False): ir.DataType.UINT8}[(bits, symmetric)]
            assert w.dtype == want and dq.attributes["block_size"].as_int() == 64
            assert len(dq.inputs) == (2 if symmetric else 3)
            raw = ir.serde.serialize_tensor(w).raw_data
            assert len(raw) == 200 * N1 * bits // 8  # packed on disk


def test_tensorrt_keeps_asymmetric_as_canonical():
    rng = np.random.default_rng(6)
    proto = mlp((rng.standard_normal((K, N1)) * 0.05).astype(np.float32), (rng.standard_normal((N1, N2)) * 0.05).astype(np.float32))
    model = to_ir(proto)
    WeightOnlyPass(algorithm="rtn", output_projection="bits").call(model)
    from mograph.opset import upgrade_opset

    upgrade_opset(model, 21, ops=get_registry().custom_ops)
    result = lower_model(model, "tensorrt", registry=get_registry())
    assert result.stats == {"kept.WeightOnlyMatMul": 2}


def test_plan_budget_and_roundtrip(tmp_path):
    proto = bert_tiny()
    feeds = [bert_feeds(batch=1, seq=8 + (i % 4) * 4, seed=100 + i) for i in range(8)]
    plan_path = tmp_path / "plan.yaml"
    model = to_ir(proto)
    result = WeightOnlyPass(algorithm="rtn", calibration_data=feeds, accuracy_budget="cosine>=0.999999",
                            precision_plan_out=str(plan_path), block_size=32).call(model)
    plan = yaml.safe_load(plan_path.read_text())
    budget = plan["accuracy_budget"]
    assert budget["met"] and budget["measured"] >= 0.999999
    entries = {e["node"]: e for e in plan["nodes"]}
    precisions = [e["precision"] for e in plan["nodes"] if e["op"] == "MatMul" and e["reason"].startswith("measured")]
    assert precisions and {"int8", "float"} & set(precisions)  # a budget this tight raises some layers
    assert any(e["op"] == "Gather" and e["precision"] == "float" and "embedding" in e["reason"] for e in entries.values())
    # the output projection stays float by rule (not measured)
    assert any(e["op"] == "MatMul" and e["precision"] == "float" and "output projection" in e["reason"]
               for e in entries.values())
    assert result.stats["quantized"] == sum(1 for p in precisions if p != "float")
    # the measured figure is the model's: check it on the calibration samples used
    worst = 1.0
    for f in feeds[:8]:
        r, o = run_ort(proto, f)[0].ravel(), run_ort(to_proto(model), f)[0].ravel()
        worst = min(worst, float(r @ o / np.linalg.norm(r) / np.linalg.norm(o)))
    assert worst >= 0.999999 - 2e-6
    # the plan applies as it is: same decisions, no measurement
    again = to_ir(proto)
    r2 = WeightOnlyPass(algorithm="rtn", precision_plan=str(plan_path), block_size=32).call(again)
    assert r2.stats.get("quantized.int4", 0) == result.stats.get("quantized.int4", 0)
    assert r2.stats.get("quantized.int8", 0) == result.stats.get("quantized.int8", 0)


def test_refusals():
    rng = np.random.default_rng(7)
    proto = mlp(representable(rng, K, N1), representable(rng, N1, N2))
    with pytest.raises(OptionError, match="calibration data"):
        WeightOnlyPass(algorithm="gptq").call(to_ir(proto))
    with pytest.raises(OptionError, match="block-size"):
        WeightOnlyPass(block_size="100")
    bad = {"pass": "weight-only", "nodes": [{"node": "MatMul->h", "precision": "int3"}]}
    with pytest.raises(OptionError, match="int4, int8 or float"):
        WeightOnlyPass(algorithm="rtn", precision_plan=bad).call(to_ir(proto))


def test_awq_scales_fold_into_layernorm_and_cut_the_error():
    """Loud LayerNorm channels: AWQ's input scale goes into the LayerNorm's scale and bias (no extra node there),
    the second layer gets a Mul, and the output error on held-out feeds is below RTN's."""
    rng = np.random.default_rng(8)
    proto = mlp((rng.standard_normal((K, N1)) * 0.05).astype(np.float32), (rng.standard_normal((N1, N2)) * 0.05).astype(np.float32))
    gamma = np.ones(K, np.float32)
    gamma[rng.choice(K, 6, replace=False)] = 20.0
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(gamma, "g"))
    test = {"x": rng.standard_normal((4, 16, K)).astype(np.float32)}
    ref = run_ort(proto, test)[0]
    errs = {}
    for algorithm in ("rtn", "awq"):
        model = to_ir(proto)
        result = WeightOnlyPass(algorithm=algorithm, output_projection="bits", calibration_data=calib(rng, 16)).call(model)
        out = run_ort(to_proto(model), test)[0]
        errs[algorithm] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        if algorithm == "awq":
            assert result.stats["awq.folded"] == 1
            ops = op_types(model)
            assert ops[:2] == ["LayerNormalization", "mograph.WeightOnlyMatMul"], ops
            assert ops.count("Mul") == result.stats.get("awq.mul", 0)
    assert errs["awq"] < 0.9 * errs["rtn"], errs


def _residual(rng: np.random.Generator, exact: bool = False) -> onnx.ModelProto:
    """LayerNorm -> fc1 -> Relu -> fc2 -> + x (a residual across the layer groups) -> head; ``exact``: weights
    4-bit blocks store exactly (else random ones, which GPTQ's error compensation changes)."""
    shapes = ((K, N1), (N1, K), (K, N2))
    if exact:
        w1, w2, w3 = (representable(rng, *s) for s in shapes)
    else:
        w1, w2, w3 = (rng.standard_normal(s).astype(np.float32) * 0.05 for s in shapes)
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "g", "b"], ["xn"], axis=-1, name="ln"),
         helper.make_node("MatMul", ["xn", "W1"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["hr"], name="relu"),
         helper.make_node("MatMul", ["hr", "W2"], ["o"], name="fc2"), helper.make_node("Add", ["o", "x"], ["r"], name="res"),
         helper.make_node("MatMul", ["r", "W3"], ["y"], name="head")],
        "res", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", "S", K])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", "S", N2])],
        [numpy_helper.from_array(np.ones(K, np.float32), "g"), numpy_helper.from_array(np.zeros(K, np.float32), "b"),
         numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2"), numpy_helper.from_array(w3, "W3")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sequential_gptq_segments_equal_whole_model_runs(monkeypatch):
    """Cut at each layer group and run once per sample: the same codes as one whole-model run per group and sample."""
    rng = np.random.default_rng(7)
    model = to_ir(_residual(rng))
    samples = calib(rng, n=4)
    p = WeightOnlyPass(calibration_data=samples)
    layers, _ = p._layers(model)
    whole = WeightOnlyPass._sequential_gptq_whole
    with monkeypatch.context() as m:  # the graph (no recorded intermediate types) must be cut, not run whole
        m.setattr(WeightOnlyPass, "_sequential_gptq_whole", lambda *a, **k: pytest.fail("fell back to whole runs"))
        assert p._sequential_gptq(model, layers, 4, samples, set()) == 3 * 4  # 3 segments x 4 samples
    assert WeightOnlyPass._sequential_gptq_whole is whole
    seg = {la.key: (la.quant[4][0].q.copy(), la.quant[4][0].scale.copy()) for la in layers}
    for la in layers:
        la.quant = {}
    assert p._sequential_gptq_whole(model, layers, 4, samples, set()) == 3 * 4  # 3 groups x 4 whole-model runs
    for la in layers:
        assert np.array_equal(seg[la.key][0], la.quant[4][0].q), la.key
        np.testing.assert_allclose(seg[la.key][1], la.quant[4][0].scale, rtol=1e-6)
    # layers kept float by the plan (the head) are neither quantized nor reached when no budget needs them
    for la in layers:
        la.quant = {}
    assert p._sequential_gptq(model, layers, 4, samples, {layers[-1].key}, quantize_kept=False) == 2 * 4
    assert [bool(la.quant) for la in layers] == [True, True, False]


def test_default_gptq_five_checks_on_a_residual_graph():
    rng = np.random.default_rng(8)
    proto = _residual(rng, exact=True)
    check_pass(WeightOnlyPass(calibration_data=calib(rng)), proto,
               stats={"quantized": 2, "kept_float": 1, "quantized.int4": 2, "calibration_samples": 8,
                      "sequential_runs": 16},
               ops_left=["LayerNormalization", "mograph.WeightOnlyMatMul", "Relu", "mograph.WeightOnlyMatMul", "Add",
                         "MatMul"],
               feeds={"x": rng.standard_normal((2, 3, K)).astype(np.float32)})


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_factor_made_once_in_place_gives_the_same_codes(act_order: bool) -> None:
    """One factor per layer group, made in the Hessian's own buffer (less memory), quantizes every layer
    exactly as each layer's own factor did (a dead input row included)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 96))
    x[:, 7] = 0.0  # a dead input channel: diag H = 0
    h = x.T @ x / 64
    spec = bw.QuantSpec(4, 32, False)
    perm = rng.permutation(96)
    assert np.array_equal(bw._permute(h.copy(), perm), h[np.ix_(perm, perm)])
    given = h.copy()
    factor = bw.gptq_factor(given, damp=0.1, act_order=act_order, consume=True)
    for _ in range(2):
        w = rng.standard_normal((96, 40)).astype(np.float32)
        own = bw.gptq(w, h, spec, damp=0.1, act_order=act_order, importance=np.diag(h))
        shared = bw.gptq(w, None, spec, damp=0.1, act_order=act_order, importance=np.diag(h), factor=factor)
        for field in ("q", "scale", "zero"):
            assert np.array_equal(getattr(own, field), getattr(shared, field))
    assert not np.array_equal(given, h)  # consumed: changed in place, not copied


def _decode_step() -> onnx.ModelProto:
    """A decode step's inputs and their constraint: ``past_key_values.0.key`` ``[batch, 2, past, 16]``, ``input_ids``
    ``[batch, seq]`` and an ``attention_mask`` ``[batch, total]`` the model needs to be ``past + seq`` long (it is
    concatenated under the rows of the ``[B, 2, seq, past + seq]`` scores of the new tokens against the cache and
    themselves); a weight MatMul on the embedded tokens and one after the mask is read."""
    rng = np.random.default_rng(0)
    f = onnx.TensorProto.FLOAT
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
        helper.make_node("MatMul", ["x", "Wk"], ["k_flat"], name="k_proj"),
        helper.make_node("Reshape", ["k_flat", "heads_shape"], ["k_heads"]),
        helper.make_node("Transpose", ["k_heads"], ["k_new"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["past_key_values.0.key", "k_new"], ["present.0.key"], axis=2),
        helper.make_node("Transpose", ["present.0.key"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["k_new", "k_t"], ["scores"]),  # [B, 2, seq, past + seq]
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=f),
        helper.make_node("Flatten", ["scores"], ["rows"], axis=3),  # [B * 2 * seq, past + seq]
        helper.make_node("Concat", ["rows", "mask_f"], ["both"], axis=0),  # needs total == past + seq
        helper.make_node("ReduceMean", ["both"], ["pooled"], keepdims=0),
        helper.make_node("Add", ["x", "pooled"], ["h"]),
        helper.make_node("MatMul", ["h", "Wo"], ["logits"], name="out_proj"),
    ]
    inits = [numpy_helper.from_array(rng.standard_normal((50, 32)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "Wk"),
             numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "Wo"),
             numpy_helper.from_array(np.array([0, 0, 2, 16], np.int64), "heads_shape")]
    i64 = onnx.TensorProto.INT64
    graph = helper.make_graph(
        nodes, "decode_step",
        [helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", i64, ["batch", "total"]),
         helper.make_tensor_value_info("past_key_values.0.key", f, ["batch", 2, "past", 16])],
        [helper.make_tensor_value_info("logits", f, ["batch", "seq", 32]),
         helper.make_tensor_value_info("present.0.key", f, ["batch", 2, "total", 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_random_calibration_of_a_decode_step_sizes_the_mask_past_plus_new(algorithm):
    """``--calibration-random`` on a decode step: every dynamic dim is 1, except the mask's own ``total``, which is
    the cache's past length plus the new tokens (sized 1 too, the model rejected the feed: an internal error)."""
    from mograph.passes.quant.calibration import RandomSource

    model = _decode_step()
    feed = next(iter(RandomSource(to_ir(model), 1)))
    assert {k: v.shape for k, v in feed.items()} == {
        "input_ids": (1, 1), "attention_mask": (1, 2), "past_key_values.0.key": (1, 2, 1, 16)}
    result = WeightOnlyPass(calibration_random=2, algorithm=algorithm, output_projection="bits").call(to_ir(model))
    assert result.modified and result.stats["quantized"] == 2 and result.stats["calibrated_on_random_data"] == 1

    # a mask the user sizes against the cache is not resized: the model's rejection is one line, exit 2
    with pytest.raises(OptionError) as info:
        WeightOnlyPass(calibration_random=2, algorithm=algorithm, output_projection="bits",
                       shape=["attention_mask:1x3"]).call(to_ir(model))
    assert info.value.exit_code == 2 and len(str(info.value).splitlines()) == 1
    assert "rejects its random calibration feed" in str(info.value)


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq"])
def test_a_chain_of_quantized_matmuls_reads_the_rewritten_producer(algorithm: str) -> None:
    """MatMul -> MatMul (here a layer feeding the LM head directly): the second layer's new node reads the first
    layer's new output, not the value the first rewrite replaced (before: a producer-less input, which
    ``eliminate-dead`` then pruned, and a model the checker refuses)."""
    rng = np.random.default_rng(0)
    f = onnx.TensorProto.FLOAT
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["x"]),
             helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("MatMul", ["h", "H"], ["logits"], name="lm_head")]
    inits = [numpy_helper.from_array(rng.standard_normal((64, 128)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((128, 128)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((128, 64)).astype(np.float32), "H")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("logits", f, ["b", "s", 64])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = to_ir(proto)
    result = WeightOnlyPass(calibration_random=2, algorithm=algorithm, output_projection="bits").call(model)
    assert result.modified and result.stats["quantized"] == 2
    mm, head = [n for n in model.graph if n.op_type == "WeightOnlyMatMul"]
    assert head.inputs[0] is not None and head.inputs[0].producer() is not None
    assert head.inputs[0].producer().op_type in ("WeightOnlyMatMul", "Mul")  # Mul: AWQ's scale on the input
    out = to_proto(model)
    onnx.checker.check_model(out)
    lower_model(model, "ort", registry=get_registry())
    feeds = {"ids": rng.integers(0, 64, (2, 5)).astype(np.int64)}
    got = run_ort(to_proto(model), feeds)[0]
    want = run_ort(proto, feeds)[0]
    cos = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    assert cos > 0.98  # 4-bit blocks of random weights on random calibration


def _fp16_mlp(w1: np.ndarray, w2: np.ndarray, opset: int) -> onnx.ModelProto:
    """float16 activations and weights, ``x @ W1 -> Relu -> @ W2``, at ``opset``."""
    k, n = w1.shape[0], w2.shape[1]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["hr"], name="relu"),
         helper.make_node("MatMul", ["hr", "W2"], ["y"], name="out")],
        "mlp16", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, ["B", "S", k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, ["B", "S", n])],
        [numpy_helper.from_array(w1.astype(np.float16), "W1"), numpy_helper.from_array(w2.astype(np.float16), "W2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("opset", [14, 17])
def test_five_checks_on_float16_activations(opset: int) -> None:
    """A float16 model's function bodies meet float16 activations: below opset 15 (no ``CastLike``) the body's
    float32 weight met them in its MatMul and ONNX Runtime refused the model ("B has inconsistent type
    tensor(float)"); the pass now raises such a model to opset 15.  Numbers within 2e-3 of the float16 model's
    output scale (the default 16-bit tolerance: representable weights, the scales rounded to float16), with
    ONNX Runtime's graph optimizations off (check_pass) and on."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(7)
    proto = _fp16_mlp(representable(rng, K, N1), representable(rng, N1, N2), opset)
    feeds = {"x": rng.standard_normal((2, 3, K)).astype(np.float16)}
    stats: dict[str, int] = {"quantized": 2, "kept_float": 0, "quantized.int4": 2}
    if opset < 15:
        stats.update({"opset_upgrade.from": opset, "opset_upgrade.to": 15, "opset_upgrade.rewritten": 0})
    model = check_pass(WeightOnlyPass(algorithm="rtn", output_projection="bits"), proto, stats=stats,
                       ops_left=["mograph.WeightOnlyMatMul", "Relu", "mograph.WeightOnlyMatMul"], feeds=feeds)
    assert model.opset_imports[""] >= 15
    assert model.graph.node(0).inputs[2].const_value.dtype == ir.DataType.FLOAT16  # scales in A's dtype
    ref = run_ort(proto, feeds)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(to_proto(model).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    assert got[0].dtype == np.float16
    assert_close(ref, got, 2e-3)


def test_budget_met_when_outputs_are_silent_on_both_sides():
    """A zero-initialised head (an untrained torchvision classifier) writes zeros whatever the layers before it
    do: the float and quantized outputs agree.  Their cosine, 0 / 0, read 0: the budget was never met and every
    measured layer stayed float."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.2, (64, 64)).astype(np.float32)
    w2 = rng.normal(0, 0.2, (64, 64)).astype(np.float32)
    head = np.zeros((64, 8), np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], "fc1"), helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w2"], ["h2"], "fc2"), helper.make_node("Relu", ["h2"], ["r2"]),
             helper.make_node("MatMul", ["r2", "head"], ["y"], "head")]
    graph = helper.make_graph(
        nodes, "zero_head", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (head, "head"))])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [{"x": np.random.default_rng(s).normal(0, 1, (4, 64)).astype(np.float32)} for s in range(4)]
    result = WeightOnlyPass(algorithm="rtn", calibration_data=feeds, accuracy_budget="cosine>=0.999",
                            block_size=32).call(to_ir(proto))
    budget = result.details["plan"]["accuracy_budget"]
    assert budget["met"] and budget["measured"] == 1.0
    assert result.stats["quantized"] >= 2
