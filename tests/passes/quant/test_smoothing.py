"""SmoothQuant-style smoothing in qdq-int8: exact in float, better in INT8, shared by the readers of one tensor.

The float layers are the default rules' (``accuracy_budget="off"``), so the counts do not depend on a
measurement; the measured default is tested in ``test_int8_sensitivity.py``.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from mograph.passes.quant import QdqInt8Pass
from mograph.passes.quant._qdq import INT8_U8, find_candidates
from mograph.passes.quant.smoothing import apply_smoothing, choose_alpha, smoothing_groups, smoothing_scale
from onnx import helper, numpy_helper

from mograph.errors import OptionError
from mograph.testing import op_counts, to_ir, to_proto
from tests.passes.quant._helpers import cosine, run

F32 = onnx.TensorProto.FLOAT


def _outlier_model(shared_act_matmul: bool = False) -> onnx.ModelProto:
    """h = LayerNorm(x) with channel 3 scaled x40 (an outlier channel, as in BERT); q = h @ wq, k = h @ wk,
    y = Relu(q + k) @ w_head + h[:, :, :4] residual-like read.  With ``shared_act_matmul``, h is also read
    by an activation x activation MatMul, so its Q/DQ scale cannot be smoothed."""
    rng = np.random.default_rng(0)
    d = 16
    gamma = np.ones(d, np.float32)
    gamma[3] = 40.0
    inits = [
        numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(d, np.float32), "beta"),
        numpy_helper.from_array(rng.standard_normal((d, d)).astype(np.float32) * 0.3, "wq"),
        numpy_helper.from_array(rng.standard_normal((d, d)).astype(np.float32) * 0.3, "wk"),
        numpy_helper.from_array(rng.standard_normal((d, 4)).astype(np.float32) * 0.3, "w_head"),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="ln", axis=-1),
        helper.make_node("MatMul", ["h", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["h", "wk"], ["k"], name="k_proj"),
        helper.make_node("Add", ["q", "k"], ["s"]),
        helper.make_node("Relu", ["s"], ["r"]),
        helper.make_node("MatMul", ["r", "w_head"], ["y0"], name="head"),
        helper.make_node("Add", ["y0", "h_slice"], ["y"]),
        helper.make_node("Slice", ["h", "starts", "ends", "axes"], ["h_slice"]),
    ]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("starts", [0]), ("ends", [4]), ("axes", [2]))]
    outputs = [helper.make_tensor_value_info("y", F32, ["b", "s", 4])]
    if shared_act_matmul:
        nodes.append(helper.make_node("Transpose", ["h"], ["ht"], perm=[0, 2, 1]))
        nodes.append(helper.make_node("MatMul", ["h", "ht"], ["hh"], name="act_act"))
        outputs.append(helper.make_tensor_value_info("hh", F32, ["b", "s", "s"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["b", "s", d])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 6 + i % 5, 16)).astype(np.float32)} for i in range(n)]


def test_smoothing_is_exact_in_float():
    proto = _outlier_model()
    model = to_ir(proto)
    cands, _ = find_candidates(model)
    groups = smoothing_groups(cands)
    # q and k read h: one group, one scale; head reads r: a group of its own
    assert [sorted(c.key for c in g.cands) for g in groups] == [["k_proj", "q_proj"], ["head"]]
    amax = np.abs(np.concatenate([run(proto, f)[0] for f in _feeds(1)])).max() * np.ones(16, np.float32)
    amax[3] = 40.0
    assert apply_smoothing(model, groups[0], amax, 0.5)
    assert op_counts(model)["Mul"] == 1
    for feeds in _feeds(3, seed=7):
        np.testing.assert_allclose(run(model, feeds)[0], run(proto, feeds)[0], rtol=1e-4, atol=1e-4)


def test_scale_formula():
    s = smoothing_scale(np.array([1.0, 4.0, 0.0]), np.array([1.0, 1.0, 1.0]), 0.5)
    assert s[2] == 1.0  # a channel never seen non-zero is left alone
    assert s[1] / s[0] == pytest.approx(2.0)  # sqrt(4 / 1)
    assert np.exp(np.log(s[:2]).mean()) == pytest.approx(1.0)  # normalised to geometric mean 1


def test_auto_smoothing_beats_no_smoothing_and_is_recorded():
    proto = _outlier_model()
    calib = _feeds(16)
    evals = _feeds(6, seed=9)
    errs = {}
    for mode in ("off", "auto"):
        model = to_ir(proto)
        result = QdqInt8Pass(accuracy_budget="off", calibration_data=calib, smoothing=mode).call(model)
        errs[mode] = max(1 - cosine(run(proto, f)[0], run(model, f)[0]) for f in evals)
        if mode == "auto":
            assert result.stats["smoothed"] == 1 and op_counts(model)["Mul"] == 1
            rec = result.details["plan"]["smoothing"]["activations"][0]
            assert rec["tensor"] == "h" and rec["consumers"] == ["q_proj", "k_proj"] and rec["alpha"] > 0
            assert rec["error_by_alpha"]["0.0"] > rec["error_by_alpha"][str(rec["alpha"])]
            by = {e["node"]: e for e in result.details["plan"]["nodes"]}
            assert "input smoothed (SmoothQuant, alpha" in by["q_proj"]["reason"]
            # one Q/DQ pair still serves both projections
            assert op_counts(model)["QuantizeLinear"] == 1
            assert not QdqInt8Pass(accuracy_budget="off", calibration_data=calib).call(model).modified  # second run: no-op
        else:
            assert "smoothed" not in result.stats and op_counts(model).get("Mul", 0) == 0
    assert errs["auto"] < errs["off"] / 2, errs


def test_activation_also_read_by_an_activation_matmul_is_not_smoothed():
    proto = _outlier_model(shared_act_matmul=True)
    model = to_ir(proto)
    cands, _ = find_candidates(model)
    assert [[c.key for c in g.cands] for g in smoothing_groups(cands)] == [["head"]]  # h is not smoothable


def test_fixed_alpha_and_bad_values():
    proto = _outlier_model()
    model = to_ir(proto)
    result = QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds(8), smoothing="0.5").call(model)
    assert result.stats["smoothed"] == 1
    assert result.details["plan"]["smoothing"]["activations"][0]["alpha"] == 0.5
    for bad in ("2", "-0.1", "strong"):
        with pytest.raises(OptionError, match="--smoothing"):
            QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds(4), smoothing=bad).call(to_ir(proto))


def test_choose_alpha_takes_the_smallest_error_unless_the_gain_is_too_small():
    proto = _outlier_model()
    model = to_ir(proto)
    cands, _ = find_candidates(model)
    g = smoothing_groups(cands)[0]
    xs = [np.random.default_rng(i).uniform(-1, 1, (1, 12, 16)).astype(np.float32) for i in range(4)]
    best = choose_alpha(g, xs, np.ones(16, np.float32), INT8_U8, min_gain=1.0)
    assert best == min(g.errors, key=lambda a: g.errors[a])
    assert choose_alpha(g, xs, np.ones(16, np.float32), INT8_U8, min_gain=100.0) == 0.0


def _bias_model() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(np.abs(rng.standard_normal((16, 8))).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"), helper.make_node("Add", ["m", "b"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["b", "s", 16])],
                              [helper.make_tensor_value_info("y", F32, ["b", "s", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bias_correction_is_opt_in_and_changes_only_the_bias():
    proto = _bias_model()
    rng = np.random.default_rng(4)
    calib = [{"x": (rng.standard_normal((1, 10, 16)) + 2.0).astype(np.float32)} for _ in range(8)]
    plain = to_ir(proto)
    assert "bias_corrected" not in QdqInt8Pass(accuracy_budget="off", calibration_data=calib).call(plain).stats
    model = to_ir(proto)
    result = QdqInt8Pass(accuracy_budget="off", calibration_data=calib, bias_correction="on").call(model)
    assert result.stats["bias_corrected"] == 1
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert "bias corrected" in by["fc"]["reason"]
    assert sorted(model.graph.initializers) != sorted(plain.graph.initializers)
    feeds = calib[0]
    assert cosine(run(proto, feeds)[0], run(model, feeds)[0]) > 0.99


def test_alpha_search_takes_its_inputs_from_the_calibration_run(monkeypatch):
    """issue 31 item 3: the alpha search reads the activations the calibration run kept (no second run of the model),
    and chooses exactly what a separate run of the model (``collect``) gave it: the same errors, alphas and model."""
    from mograph.passes.quant import calibration as cal

    proto = _outlier_model()
    runs = []
    real_collect = cal.collect
    monkeypatch.setattr(cal, "collect", lambda *a, **k: runs.append(a[1]) or real_collect(*a, **k))
    reused = to_ir(proto)
    got = QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds(8)).call(reused)
    assert runs == []  # nothing ran the model again for the search
    real_observe = cal.observe
    monkeypatch.setattr(cal, "observe", lambda *a, **k: real_observe(*a, **{**k, "captured": None}))
    again = to_ir(proto)
    ref = QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds(8)).call(again)
    assert len(runs) == 1  # the old way: one more run for the search's samples
    assert got.stats == ref.stats and got.stats["smoothed"] == 1
    assert got.details["plan"]["smoothing"] == ref.details["plan"]["smoothing"]
    feeds = _feeds(1, seed=9)[0]
    got_y = run(to_proto(reused, with_data=True), feeds)[0]
    np.testing.assert_array_equal(got_y, run(to_proto(again, with_data=True), feeds)[0])


def test_wide_weights_are_judged_on_a_column_subset():
    """A weight wider than ``max_columns`` (an LLM's LM head) is judged on evenly spaced columns: the errors are
    estimates of the full ones (per-channel weights: each column's error is its own), the choice the same here;
    with ``bias_shift`` every column is used (the shift is per column)."""
    rng = np.random.default_rng(3)
    d, n = 16, 600
    gamma = np.ones(d, np.float32)
    gamma[5] = 30.0
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(d, np.float32), "beta"),
             numpy_helper.from_array((rng.standard_normal((d, n)) * 0.2).astype(np.float32), "w_head")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="ln", axis=-1),
             helper.make_node("MatMul", ["h", "w_head"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["b", "s", d])],
                              [helper.make_tensor_value_info("y", F32, ["b", "s", n])], inits)
    model = to_ir(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    cands, _ = find_candidates(model)
    xs = [(rng.standard_normal((1, 32, d)) * gamma).astype(np.float32) for _ in range(4)]
    amax = np.abs(np.concatenate(xs, axis=1)).max(axis=(0, 1))
    full, part = smoothing_groups(cands)[0], smoothing_groups(cands)[0]
    a_full = choose_alpha(full, xs, amax, INT8_U8, bias_shift=False)
    a_part = choose_alpha(part, xs, amax, INT8_U8, max_columns=100, bias_shift=False)
    assert a_full == a_part and a_full > 0
    for a, err in full.errors.items():
        assert abs(part.errors[a] - err) < 0.15 * err, (a, part.errors[a], err)
    assert part.bias_shift == {}  # not asked for
    shifted = smoothing_groups(cands)[0]
    choose_alpha(shifted, xs, amax, INT8_U8, max_columns=100, bias_shift=True)
    assert shifted.errors == full.errors and shifted.bias_shift["head"].shape == (n,)
