"""fp16's measuring groups hand their float32 tensors on instead of each computing the whole model again.

ONNX Runtime runs every node of a graph whatever outputs are asked for, so each of the byte-budget groups
of :func:`measure_local` used to compute the whole float32 model per sample (a 135M decoder: 4 groups, 4
whole models per sample).  Each group now reads the float32 tensors earlier groups computed and runs only
the nodes its outputs need; every figure must be exactly the one a single session over all nodes gives.
The float64 sums of ``_compare`` and ``output_value`` skip copies on all-finite arrays: same numbers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from mograph.passes.quant import Fp16Pass
from mograph.passes.quant import _fp16_measure as fm
from mograph.passes.quant.plan import parse_budget
from onnx import helper, numpy_helper

from mograph.testing import op_counts, to_ir

ROWS, WIDTH, LAYERS = 8, 32, 6
ENV = "MOGRAPH_FP16_MEASURE_BYTES"


def _model() -> onnx.ModelProto:
    """LAYERS x (MatMul, Split into halves, Tanh of one, Concat, Reshape to the input's shape, Mul by a scale
    (3e4 in the middle layer: overflows in float16)), the input's Shape (int64) read by every layer and a
    half of each Split read two layers later: tensors of several kinds cross the groups' borders."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape")]
    inits, prev, skips = [], "x", []
    for i in range(LAYERS):
        w = (rng.standard_normal((WIDTH, WIDTH)) / 5).astype(np.float32)
        s = np.array(3e4 if i == LAYERS // 2 else 1.25, np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(s, f"s{i}")]
        left = skips[-2] if len(skips) >= 2 else f"l{i}"
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Split", [f"m{i}"], [f"l{i}", f"r{i}"], axis=1, num_outputs=2, name=f"split{i}"),
                  helper.make_node("Tanh", [f"r{i}"], [f"t{i}"], name=f"tanh{i}"),
                  helper.make_node("Concat", [left, f"t{i}"], [f"c{i}"], axis=1, name=f"cat{i}"),
                  helper.make_node("Reshape", [f"c{i}", "shape"], [f"z{i}"], name=f"reshape{i}"),
                  helper.make_node("Mul", [f"z{i}", f"s{i}"], [f"h{i}"], name=f"mul{i}")]
        skips.append(f"l{i}")
        prev = f"h{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    graph = helper.make_graph(nodes, "carry", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", WIDTH])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((ROWS, WIDTH)).astype(np.float32)} for _ in range(n)]


def _measure(monkeypatch, budget: int) -> tuple[fm.LocalMeasure, list]:
    """measure_local on the model under ``budget`` bytes; also each group's measuring copy as it ran."""
    monkeypatch.setenv(ENV, str(budget))
    copies: list = []
    real = fm._twin_model

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        copies.append(out[0])
        return out

    monkeypatch.setattr(fm, "_twin_model", spy)
    model = to_ir(_model())
    floats = {"x"} | {v.name for n in model.graph for v in n.outputs if n.op_type != "Shape"}
    floats |= {name for name in model.graph.initializers}
    positions = [p for p, n in enumerate(model.graph) if n.op_type not in ("Shape", "Reshape")]
    return fm.measure_local(model, positions, floats, {}, {}, lambda node: None, _feeds()), copies


def _same(a: fm.LocalMeasure, b: fm.LocalMeasure) -> None:
    assert a.samples == b.samples == 3
    assert a.error == b.error  # exactly: the same float32 tensors, the same sums in the same order
    assert a.overflow == b.overflow
    assert sorted(a.stats) == sorted(b.stats)
    for name in a.stats:
        assert dataclasses.asdict(a.stats[name]) == dataclasses.asdict(b.stats[name]), name


@pytest.mark.parametrize("budget", [3000, 6000, 1])
def test_groups_read_carried_tensors_with_identical_figures(monkeypatch, budget):
    whole, one = _measure(monkeypatch, 2**40)
    assert len(one) == 1
    full = len(one[0].graph)
    grouped, copies = _measure(monkeypatch, budget)
    assert len(copies) >= 4
    _same(whole, grouped)
    assert grouped.overflow and max(grouped.error.values()) > 0  # figures worth comparing
    # every group after the first reads float32 tensors an earlier group computed (the int64 shape, a
    # Split half read two layers later among them) and runs fewer nodes than the whole measuring copy
    later = copies[2:]
    assert all(len(c.graph.inputs) > 1 for c in later)
    assert any("shape" in {v.name for v in c.graph.inputs} for c in later)
    assert any(any(v.name.startswith("l") for v in c.graph.inputs) for c in later)
    model_nodes = len(_model().graph.node)
    assert sum(len(c.graph) for c in copies) < full + model_nodes  # before: each copy held the whole model
    assert max(len(c.graph) for c in copies[1:-1]) < model_nodes


def test_pass_decisions_unchanged_with_carried_groups(monkeypatch):
    results = []
    for budget in (2**40, 4000):
        monkeypatch.setenv(ENV, str(budget))
        model = to_ir(_model())
        result = Fp16Pass(calibration_data=_feeds()).call(model)
        results.append((dict(result.stats), result.details["plan"], op_counts(model)))
    assert results[0] == results[1]
    assert results[0][0]["kept_fp32.overflow"] >= 1


def _compare_float64(ref32, out16):
    """``_compare`` as first written: float64 copies of the finite positions."""
    ref, y16 = np.asarray(ref32, np.float64), np.asarray(out16, np.float64)
    finite = np.isfinite(ref)
    bad = finite & ~np.isfinite(y16)
    if bad.any():
        return ("overflow", float(np.abs(ref[bad]).max()))
    sat = np.clip(ref[finite], -fm.FP16_LIMIT, fm.FP16_LIMIT)
    diff = y16[finite] - sat
    return (float((diff**2).sum()), float((sat**2).sum()))


def _cases():
    rng = np.random.default_rng(5)
    ref = (rng.standard_normal((3, 257, 64)) * 50).astype(np.float32)
    ref[0, 0, :4] = [7e4, -9e4, 65504, 1e-8]
    out = fm.to_half(ref * (1 + 1e-3 * rng.standard_normal(ref.shape)).astype(np.float32))
    with_inf = out.copy()
    with_inf[1, 3, 5] = np.inf
    ref_nan = ref.copy()
    ref_nan[2, 2, 2] = np.nan
    transposed = np.asfortranarray(ref)
    return [(ref, out), (ref, with_inf), (ref_nan, out), (ref_nan, with_inf), (transposed, out)]


@pytest.mark.parametrize("case", range(5))
def test_compare_sums_are_the_float64_ones(case):
    ref, out = _cases()[case]
    result, num, den = fm.LocalMeasure(), {0: 0.0}, {0: 0.0}
    fm._compare(result, num, den, 0, ref, out)
    want = _compare_float64(ref, out)
    got = ("overflow", result.overflow[0]) if 0 in result.overflow else (num[0], den[0])
    assert got == want  # bit for bit


@pytest.mark.parametrize("budget_text", ["cosine>=0.9999", "max-abs<=0.1"])
@pytest.mark.parametrize("case", range(5))
def test_output_value_is_the_float64_one(case, budget_text):
    budget = parse_budget(budget_text)
    ref, out = _cases()[case]
    for r, o in ((ref, out), (ref, ref), (ref * 1e-9, out * np.float16(0)), (ref, out.astype(np.float32) * 2),
                 (ref.ravel()[:0], out.ravel()[:0]), (ref, out.reshape(-1)[:-1])):
        assert fm.output_value(budget, r, o) == fm.output_value_exact(budget, r, o)


@pytest.mark.parametrize("budget", [2**40, 3000])
def test_model_outputs_read_back_equal_a_session_of_the_model(monkeypatch, budget):
    from mograph.passes.quant import calibration as cal

    result, _ = _measure(monkeypatch, budget)
    assert result.outputs is None  # not asked for
    monkeypatch.setenv(ENV, str(budget))
    model = to_ir(_model())
    floats = {"x"} | {v.name for n in model.graph for v in n.outputs if n.op_type != "Shape"}
    floats |= set(model.graph.initializers)
    positions = [p for p, n in enumerate(model.graph) if n.op_type not in ("Shape", "Reshape")]
    result = fm.measure_local(model, positions, floats, {}, {}, lambda node: None, _feeds(), outputs=2)
    plain = list(cal.run_model(to_ir(_model()), _feeds()[:2]))
    assert result.outputs is not None and len(result.outputs) == 2
    for got, want in zip(result.outputs, plain):
        assert len(got) == len(want) == 1
        assert got[0].dtype == want[0].dtype and np.array_equal(got[0], want[0])  # bit for bit


def test_budget_search_reuses_the_measured_outputs(monkeypatch):
    """The accuracy budget's float32 reference is the measuring runs' read-back, not another session of the
    whole float32 model; the search's figures are the same as with that session."""
    from mograph.passes.quant import calibration as cal

    sessions: list[int] = []
    real = cal._session

    def spy(model_bytes, folder=None):
        sessions.append(1)
        return real(model_bytes, folder)

    results = []
    for keep_outputs in (False, True):
        if not keep_outputs:  # the old path: no read-back, a session of the float32 model for the reference
            real_measure = fm.measure_local
            monkeypatch.setattr("mograph.passes.quant.fp16.measure_local",
                                lambda *a, _m=real_measure, **k: _m(*a, **{**k, "outputs": 0}))
        else:
            monkeypatch.undo()
        monkeypatch.setenv(ENV, "4000")
        monkeypatch.setattr(cal, "_session", spy)
        sessions.clear()
        model = to_ir(_model())
        result = Fp16Pass(calibration_data=_feeds(), fp16_budget="cosine>=0.99999999").call(model)
        results.append((dict(result.stats), result.details["plan"], op_counts(model), len(sessions)))
    (old_stats, old_plan, old_ops, old_sessions), (stats, plan, ops, new_sessions) = results
    assert (stats, plan, ops) == (old_stats, old_plan, old_ops)
    assert stats["accuracy.evaluations"] >= 2  # a search, not one all-float16 check
    assert new_sessions == old_sessions - 1  # the float32 model's session is not made


def test_model_with_float16_tensors_keeps_its_own_reference_session(monkeypatch):
    """A model with float16 tensors of its own (a float16 block between Casts): the measuring copy keeps
    their rounding, a session of the model does not (ORT's CPU provider drops the Cast pairs), so the
    reference is still that session's, and the records are the old path's exactly."""
    from pathlib import Path

    from mograph.passes.quant import calibration as cal

    path = Path(__file__).parents[2] / "data" / "corpus" / "torch_ts17_rms_fp16_keepio.onnx"
    sessions: list[int] = []
    real = cal._session

    def spy(model_bytes, folder=None):
        sessions.append(1)
        return real(model_bytes, folder)

    results = []
    for old_path in (True, False):
        if old_path:
            real_measure = fm.measure_local
            monkeypatch.setattr("mograph.passes.quant.fp16.measure_local",
                                lambda *a, _m=real_measure, **k: _m(*a, **{**k, "outputs": 0}))
        else:
            monkeypatch.undo()
        monkeypatch.setattr(cal, "_session", spy)
        sessions.clear()
        model = to_ir(onnx.load(path))
        result = Fp16Pass(calibration_random=4, fp16_budget="cosine>=0.9999999").call(model)
        results.append((dict(result.stats), result.details["plan"], op_counts(model), len(sessions)))
    assert results[0] == results[1]
    assert results[0][0]["accuracy.evaluations"] >= 1


def _sequence_model() -> onnx.ModelProto:
    """A tensor sequence (SplitToSequence) written first and read last, across every group."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("SplitToSequence", ["x"], ["seq"], axis=1, name="tosequence")]
    inits, prev = [], "x"
    for i in range(4):
        inits.append(numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 5).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}")]
        prev = f"t{i}"
    inits.append(numpy_helper.from_array(np.array(0, np.int64), "zero"))
    nodes += [helper.make_node("SequenceAt", ["seq", "zero"], ["first"], name="at"),
              helper.make_node("Mul", [prev, "first"], ["y"], name="out")]
    graph = helper.make_graph(nodes, "seq", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [ROWS, WIDTH])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [ROWS, WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_sequence_crossing_groups_is_computed_again(monkeypatch):
    figures = []
    for budget in (2**40, 1500):
        monkeypatch.setenv(ENV, str(budget))
        model = to_ir(_sequence_model())
        floats = {"x", "first", "y"} | {v.name for n in model.graph for v in n.outputs if n.op_type in ("MatMul", "Tanh")}
        floats |= {name for name in model.graph.initializers if name != "zero"}
        positions = [p for p, n in enumerate(model.graph) if n.op_type in ("MatMul", "Tanh", "Mul")]
        figures.append(fm.measure_local(model, positions, floats, {}, {}, lambda node: None, _feeds(), outputs=3))
    whole, grouped = figures
    _same(whole, grouped)
    assert whole.outputs is not None and grouped.outputs is not None
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(whole.outputs, grouped.outputs))


def test_model_outputs_not_held_beyond_the_bytes(monkeypatch):
    monkeypatch.setattr(fm, "CARRY_BYTES", 2 * ROWS * WIDTH * 4)  # two samples' outputs, not three
    monkeypatch.setenv(ENV, "1")
    model = to_ir(_model())
    floats = {"x"} | {v.name for n in model.graph for v in n.outputs if n.op_type != "Shape"}
    floats |= set(model.graph.initializers)
    positions = [p for p, n in enumerate(model.graph) if n.op_type not in ("Shape", "Reshape")]
    assert fm.measure_local(model, positions, floats, {}, {}, lambda node: None, _feeds(), outputs=2).outputs is not None
    assert fm.measure_local(model, positions, floats, {}, {}, lambda node: None, _feeds(), outputs=3).outputs is None
