"""Layers the precision plan keeps in float are never calibrated (issue 31, item 3).

Calibration observes only the inputs of the layers that may be quantized, so a float-kept final projection
(a decoder's LM head) is never observed; the smoothing strength search reads what calibration captured, and
the per-layer sensitivity analysis reads the layers' inputs from the one run per sample that also gives its
reference outputs.  The ranges of the quantized layers, and so the written model, are those of unpruned copies.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant import QdqInt8Pass, sensitivity
from mograph.passes.quant import calibration as cal
from onnx import helper, numpy_helper

from mograph import _spill, ir_io
from tests.passes.quant._helpers import run


def _decoder_like():  # type: ignore[no-untyped-def]
    """x [b, 8] -> fc1 (MatMul w1) -> Relu -> lm_head (MatMul w_head, the final projection) -> logits."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="act"),
             helper.make_node("MatMul", ["r", "w_head"], ["logits"], name="lm_head")]
    inits = [numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w_head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 8])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, None)], inits)
    return ir_io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _feeds() -> list[dict[str, np.ndarray]]:
    return [{"x": np.random.default_rng(i).standard_normal((2, 8)).astype(np.float32)} for i in range(6)]


class _Spy:
    """Records the tensors each ``observe`` call returned statistics for, and every calibration session's model."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.observed: set[str] = set()
        self.models: list[onnx.ModelProto] = []
        real_observe, real_session = cal.observe, cal._session

        def observe(*args, **kwargs):  # type: ignore[no-untyped-def]
            stats = real_observe(*args, **kwargs)
            self.observed |= {k for k, s in stats.items() if s.samples}
            return stats

        def session(data, *args, **kwargs):  # type: ignore[no-untyped-def]
            if isinstance(data, bytes):
                self.models.append(onnx.load_from_string(data))
            return real_session(data, *args, **kwargs)

        monkeypatch.setattr(cal, "observe", observe)
        monkeypatch.setattr(cal, "_session", session)
        monkeypatch.setattr(sensitivity, "_session", session)  # it holds its own reference


@pytest.mark.parametrize("config", [
    {"accuracy_budget": "off"},  # the default rules keep the final projection float
    {"keep_fp32": ["lm_head"]},  # the default measured search, the user keeps the head float
])
def test_float_kept_head_is_never_observed(monkeypatch, config):
    spy = _Spy(monkeypatch)
    model = _decoder_like()
    result = QdqInt8Pass(calibration_data=_feeds(), smoothing="off", **config).call(model)
    plan = {e["node"]: e["precision"] for e in result.details["plan"]["nodes"]}
    assert plan["fc1"] == "int8" and plan["lm_head"] == "fp32"
    assert result.stats["quantized"] == 1 and result.stats["kept_float"] == 1
    assert "x" in spy.observed  # fc1's input
    assert "r" not in spy.observed  # the head's input: never observed
    for m in spy.models:  # no calibration copy outputs the head's input
        assert "r" not in {o.name for o in m.graph.output}
    if "keep_fp32" in config:
        # the per-layer analysis reads fc1's input from the run that also gives the reference logits (the
        # head runs there once per sample, as the reference needs it), not from another copy of the model
        shared = [m for m in spy.models if [o.name for o in m.graph.output] == ["logits", "x"]]
        assert len(shared) == 2  # calibration's copy and the analysis's
        assert not [m for m in spy.models if [o.name for o in m.graph.output] == ["x"]]


def test_pruned_observation_gives_the_same_model(monkeypatch):
    """Before/after: the pass with the old, unpruned observation copy writes the same numbers."""
    feeds = _feeds()
    ref = _decoder_like()
    after = _decoder_like()
    QdqInt8Pass(calibration_data=feeds, smoothing="off", accuracy_budget="off").call(after)
    monkeypatch.setattr(cal, "_prune_to_outputs", lambda graph, outputs: None)
    before = _decoder_like()
    QdqInt8Pass(calibration_data=feeds, smoothing="off", accuracy_budget="off").call(before)
    scales_a = {k: v.const_value.numpy().tolist() for k, v in after.graph.initializers.items() if "scale" in k}
    scales_b = {k: v.const_value.numpy().tolist() for k, v in before.graph.initializers.items() if "scale" in k}
    assert scales_a and scales_a == scales_b
    for feed in feeds:
        np.testing.assert_array_equal(run(after, feed)[0], run(before, feed)[0])
        assert not np.array_equal(run(after, feed)[0], run(ref, feed)[0])  # it was quantized


def test_pruning_keeps_what_a_subgraph_reads_from_outside():
    """An observed tensor made by an ``If`` whose branch reads an outer value keeps that value's producer."""
    then_g = helper.make_graph([helper.make_node("Neg", ["outer"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["outer"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Relu", ["x"], ["outer"], name="producer"),
             helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="cond"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
             helper.make_node("Exp", ["y"], ["z"], name="after")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                               numpy_helper.from_array(np.ones(3, np.float32), "unused")])
    model = ir_io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    data, mapping = cal._with_outputs_mapped(model, ["y"], only=True)
    pruned = onnx.load_from_string(data)
    assert [o.name for o in pruned.graph.output] == ["y"]
    assert [n.name for n in pruned.graph.node] == ["producer", "sum", "cond", "if"]
    assert [t.name for t in pruned.graph.initializer] == ["zero"]
    x = np.array([1.0, -2.0, 3.0], np.float32)
    np.testing.assert_array_equal(run(pruned, {"x": x})[0], -np.maximum(x, 0))


def test_layer_errors_share_one_session_per_distinct_node(monkeypatch):
    """The per-layer analysis builds one single-node session per distinct node, not one per layer."""
    from mograph.passes.quant._qdq import INT8_U8, find_candidates

    model = _decoder_like()
    cands, _ = find_candidates(model)
    ranges = cal.compute_ranges(cal.observe(model, ["x", "r"], cal.open_source(_feeds(), model)), "minmax")
    built: list[bytes] = []
    real_session = sensitivity._session

    def session(data, *args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(data)
        return real_session(data, *args, **kwargs)

    monkeypatch.setattr(sensitivity, "_session", session)
    errors, cost = sensitivity._layer_errors(model, cands, ranges, INT8_U8, _feeds()[:3])
    assert len(built) == 2  # the observation copy and one MatMul session for both layers
    assert set(errors) == {"fc1", "lm_head"} and all(e > 0 for e in errors.values())
    monkeypatch.setattr(sensitivity, "_session", real_session)
    ref, _ = sensitivity._layer_errors(model, cands, ranges, INT8_U8, _feeds()[:3])
    assert errors == ref


class _Counted:
    """An ONNX Runtime session whose runs are logged as ``kind`` while ``active[0]`` is true."""

    def __init__(self, sess, kind: str, log: list[str], active: list[bool]) -> None:  # type: ignore[no-untyped-def]
        self.sess, self.kind, self.log, self.active = sess, kind, log, active

    def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.active[0]:
            self.log.append(self.kind)
        return self.sess.run(*args, **kwargs)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.sess, name)


def test_sensitivity_runs_the_float_model_once_per_sample(monkeypatch):
    """Issue 31 item 3: the analysis's reference outputs and the layers' inputs come from one run of the float
    model per sample (the old code ran it twice: the reference, then a copy outputting the layers' inputs),
    and the written model is the same."""
    log: list[str] = []
    active = [False]

    def counting(real_session):  # type: ignore[no-untyped-def]
        def session(data, *args, **kwargs):  # type: ignore[no-untyped-def]
            sess = real_session(data, *args, **kwargs)
            if isinstance(data, _spill.Payload):  # the evaluated mixes reach ORT as a payload
                data = data.data if data.data is not None else onnx.load(data.path, load_external_data=False)
            m = (onnx.load_from_string(data) if isinstance(data, bytes)
                 else data if isinstance(data, onnx.ModelProto) else ir.serde.serialize_model(data))
            ops = [n.op_type for n in m.graph.node]
            kind = "layer" if len(ops) == 1 else "qdq" if "QuantizeLinear" in ops else "float"
            return _Counted(sess, kind, log, active)
        return session

    real_analyse = sensitivity.analyse

    def analyse(*args, **kwargs):  # type: ignore[no-untyped-def]
        active[0] = True
        try:
            return real_analyse(*args, **kwargs)
        finally:
            active[0] = False

    model = _decoder_like()
    ref = _decoder_like()
    QdqInt8Pass(calibration_data=_feeds(), smoothing="off").call(ref)
    monkeypatch.setattr(cal, "_session", counting(cal._session))
    monkeypatch.setattr(sensitivity, "_session", counting(sensitivity._session))
    monkeypatch.setattr(sensitivity, "analyse", analyse)
    result = QdqInt8Pass(calibration_data=_feeds(), smoothing="off").call(model)
    samples = result.details["plan"]["accuracy_budget"]["samples"]
    assert samples == len(_feeds())
    assert log.count("float") == samples  # old code: 2 x samples
    assert log.count("layer") == 2 * 2 * samples  # each layer alone, float and quantized, on each sample
    assert log.count("qdq") == result.stats["sensitivity_evaluations"] * samples
    for a, b in zip(model.graph.initializers.values(), ref.graph.initializers.values()):
        assert a.name == b.name
        np.testing.assert_array_equal(a.const_value.numpy(), b.const_value.numpy())
    for feed in _feeds():
        np.testing.assert_array_equal(run(model, feed)[0], run(ref, feed)[0])


def test_layer_errors_quantize_each_weight_once(monkeypatch):
    """Each weight is quantized once for all the samples (old code: once per sample), to the same numbers."""
    from mograph.passes.quant import _qdq
    from mograph.passes.quant._qdq import INT8_U8, find_candidates

    model = _decoder_like()
    cands, _ = find_candidates(model)
    ranges = cal.compute_ranges(cal.observe(model, ["x", "r"], cal.open_source(_feeds(), model)), "minmax")
    ref, _ = sensitivity._layer_errors(model, cands, ranges, INT8_U8, _feeds()[:3])
    calls: list[tuple[int, ...]] = []
    real = _qdq.quantize_weight_array

    def counting(w, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(w.shape)
        return real(w, *args, **kwargs)

    monkeypatch.setattr(_qdq, "quantize_weight_array", counting)
    monkeypatch.setattr(sensitivity, "quantize_weight_array", counting)
    errors, _ = sensitivity._layer_errors(model, cands, ranges, INT8_U8, _feeds()[:3])
    assert sorted(calls) == [(8, 16), (16, 32)]  # old code: each three times
    assert errors == ref


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_kept_quantized_weight_is_fake_quant_weight(axis):
    """What the analysis makes from a weight's kept INT8 values and scales is bit for bit fake_quant_weight's."""
    from mograph.passes.quant._qdq import INT8_S8, INT8_U8, fake_quant_weight

    w = np.random.default_rng(3).standard_normal((24, 40)).astype(np.float32) * 3
    for scheme in (INT8_U8, INT8_S8):
        q, scale = sensitivity._quantized_weight(w, axis, scheme)
        assert q.dtype == np.int8
        np.testing.assert_array_equal(np.multiply(q, scale, dtype=np.float32), fake_quant_weight(w, axis, scheme))


@pytest.mark.parametrize("metric", ["cosine", "max-abs"])
def test_metric_in_reused_buffers_is_the_old_formula(metric):
    """The budget metric computed in buffers made once is bit for bit the one computed on new vectors per sample."""
    from mograph.passes.quant.plan import parse_budget

    budget = parse_budget("cosine>=0.99" if metric == "cosine" else "max-abs<=1")
    rng = np.random.default_rng(5)
    refs, outs = [], []
    for n in (300, 170, 300):  # samples of different lengths: the buffers fit the largest
        ref = [rng.standard_normal((1, n, 7)).astype(np.float32), np.arange(n, dtype=np.int64),
               rng.standard_normal((2, n)).astype(np.float16)]
        refs.append(ref)
        outs.append([ref[0] + np.float32(0.01) * rng.standard_normal(ref[0].shape).astype(np.float32), ref[1],
                     ref[2]])

    def old(r_arrays, o_arrays):  # type: ignore[no-untyped-def]
        r = np.concatenate([np.asarray(a, np.float64).ravel() for a in r_arrays if np.issubdtype(a.dtype, np.floating)])
        o = np.concatenate([np.asarray(a, np.float64).ravel() for a in o_arrays if np.issubdtype(a.dtype, np.floating)])
        if metric == "cosine":
            return float(r @ o / (np.linalg.norm(r) * np.linalg.norm(o) + 1e-30))
        return float(np.abs(r - o).max())

    values = [old(r, o) for r, o in zip(refs, outs)]
    expected = min(values) if metric == "cosine" else max(values)
    assert sensitivity._metric(budget, refs, outs) == expected


def test_per_layer_measurement_reports_progress():
    """Issue 31 item 3: between the calibration bar and the end-to-end evaluations, the per-layer measurement
    (a third of the analysis before the search on a 135M LLaMA) reports each sample done."""
    seen: list[tuple[int, int | None]] = []
    p = QdqInt8Pass(calibration_data=_feeds(), smoothing="off")
    p.progress = lambda done, total: seen.append((done, total))
    result = p.call(_decoder_like())
    n = len(_feeds())
    evaluations = result.stats["sensitivity_evaluations"]
    assert seen == [(i, n) for i in range(1, n + 1)] * 2 + [(i, None) for i in range(1, evaluations + 1)]


def test_layer_errors_fake_quantize_a_shared_input_once_per_sample(monkeypatch):
    """Layers reading one tensor (Q, K and V of a hidden state) share its fake-quantized copy on each sample."""
    from mograph.passes.quant._qdq import INT8_U8, find_candidates

    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"proj{i}") for i in range(3)]
    nodes.append(helper.make_node("Sum", ["y0", "y1", "y2"], ["out"], name="sum"))
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), f"w{i}") for i in range(3)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 8])],
                              [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)], inits)
    model = ir_io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    cands, _ = find_candidates(model)
    ranges = cal.compute_ranges(cal.observe(model, ["x"], cal.open_source(_feeds(), model)), "minmax")
    ref, _ = sensitivity._layer_errors(model, cands, ranges, INT8_U8, _feeds()[:3])
    calls: list[int] = []
    real = sensitivity.fake_quant_activation

    def counting(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(sensitivity, "fake_quant_activation", counting)
    errors, _ = sensitivity._layer_errors(model, cands, ranges, INT8_U8, _feeds()[:3])
    assert len(calls) == 3  # one per sample; old code: one per layer and sample (9)
    assert errors == ref and len(set(errors.values())) == 3


def test_error_terms_are_the_float64_formula():
    """The per-layer error sums made without float64 copies are bit for bit the old float64 expressions."""
    rng = np.random.default_rng(7)
    for shape in [(3, 257, 33), (1, 4099), (5,)]:
        y = (rng.standard_normal(shape) * 40).astype(np.float32)
        yq = y + (rng.standard_normal(shape) * 0.3).astype(np.float32)
        y64, yq64 = y.astype(np.float64), yq.astype(np.float64)
        assert sensitivity._error_terms(y, yq) == (float(((yq64 - y64) ** 2).sum()), float((y64**2).sum()))
