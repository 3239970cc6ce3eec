"""``sparsity-2to4``: 2 of every 4 consecutive weights along the reduction axis are zeroed by magnitude.

Numbers: the sparsified model must equal the original model whose weights were masked by an
independent, loop-based reference of the rule (ONNX Runtime, optimizations off).
"""

from __future__ import annotations

import numpy as np
from _pass_testing import assert_second_run_changes_nothing, run_pass
from _prune_testing import checked
from mograph.passes.prune import Sparsity2to4Pass
from onnx import helper, numpy_helper

from models.builders import make_model
from mograph.testing import op_types, run_ort, to_ir

RNG = np.random.default_rng(0)
W = {
    "w_mm": RNG.standard_normal((8, 12)).astype(np.float32),  # MatMul [K=8, N=12]
    "w_gemm": RNG.standard_normal((6, 12)).astype(np.float32),  # Gemm transB: [N=6, K=12]
    "w_conv": RNG.standard_normal((4, 8, 3, 3)).astype(np.float32),  # Conv [O, I=8, 3, 3]
    "w_odd": RNG.standard_normal((6, 5)).astype(np.float32),  # MatMul K=6: does not qualify
}


def _model(odd_only: bool = False):
    if odd_only:
        nodes = [helper.make_node("MatMul", ["v", "w_odd"], ["z"], name="odd")]
        return make_model(nodes, [("v", np.float32, [2, 6])], [("z", np.float32, [2, 5])], {"w_odd": W["w_odd"]})
    nodes = [
        helper.make_node("MatMul", ["x", "w_mm"], ["h"], name="mm"),
        helper.make_node("Gemm", ["h", "w_gemm"], ["y"], name="gemm", transB=1),
        helper.make_node("Conv", ["img", "w_conv"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("MatMul", ["v", "w_odd"], ["z"], name="odd"),
    ]
    inputs = [("x", np.float32, [3, 8]), ("img", np.float32, [1, 8, 5, 5]), ("v", np.float32, [2, 6])]
    outputs = [("y", np.float32, [3, 6]), ("c", np.float32, [1, 4, 5, 5]), ("z", np.float32, [2, 5])]
    return make_model(nodes, inputs, outputs, W)


FEEDS = {
    "x": RNG.standard_normal((3, 8)).astype(np.float32),
    "img": RNG.standard_normal((1, 8, 5, 5)).astype(np.float32),
    "v": RNG.standard_normal((2, 6)).astype(np.float32),
}


def _reference_mask(w: np.ndarray, axis: int) -> np.ndarray:
    """Loop over every run of 4 along ``axis``; zero its 2 smallest |w| (earlier index wins ties)."""
    moved = np.moveaxis(w.copy(), axis, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    for row in flat:
        for start in range(0, row.size, 4):
            group = row[start : start + 4]
            ranked = sorted(range(4), key=lambda i: (-abs(float(group[i])), i))
            for i in ranked[2:]:
                group[i] = 0
    return np.moveaxis(flat.reshape(moved.shape), -1, axis)


def test_two_of_four_masked_along_reduction_axis():
    proto = _model()
    model = to_ir(proto)
    ops = op_types(model)
    entry = run_pass(Sparsity2to4Pass(), model)
    assert entry.modified is True
    assert op_types(model) == ops == ["MatMul", "Gemm", "Conv", "MatMul"]
    qualifying = 8 * 12 + 6 * 12 + 4 * 8 * 9
    assert entry.stats == {
        "layers": 3,
        "layers_skipped": 1,
        "weights_qualifying": qualifying,
        "weights_masked": qualifying // 2,  # random normal weights: no zeros to start with
    }
    assert entry.details["layers"] == [
        {"node": "mm", "weight": "w_mm", "qualifying": 96, "masked": 48},
        {"node": "gemm", "weight": "w_gemm", "qualifying": 72, "masked": 36},
        {"node": "conv", "weight": "w_conv", "qualifying": 288, "masked": 144},
    ]
    assert entry.details["skipped"] == [
        {"node": "odd", "weight": "w_odd", "reason": "reduction size 6 is not a multiple of 4"}
    ]
    got = {name: model.graph.initializers[name].const_value.numpy() for name in W}
    want = {"w_mm": _reference_mask(W["w_mm"], 0), "w_gemm": _reference_mask(W["w_gemm"], 1),
            "w_conv": _reference_mask(W["w_conv"], 1), "w_odd": W["w_odd"]}
    for name in W:
        np.testing.assert_array_equal(got[name], want[name])
    # Numbers: same as the original graph with reference-masked weights.
    masked = proto
    for t in masked.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(want[t.name], t.name))
    for g, w in zip(run_ort(checked(model), FEEDS), run_ort(masked, FEEDS)):
        np.testing.assert_array_equal(g, w)
    again = assert_second_run_changes_nothing(Sparsity2to4Pass(), model)
    assert again.stats["weights_masked"] == 0 and again.stats["weights_qualifying"] == qualifying


def test_near_miss_reduction_not_multiple_of_four():
    proto = _model(odd_only=True)
    model = to_ir(proto)
    entry = run_pass(Sparsity2to4Pass(), model)
    assert entry.modified is False
    assert entry.stats == {"layers": 0, "layers_skipped": 1, "weights_qualifying": 0, "weights_masked": 0}
    np.testing.assert_array_equal(run_ort(checked(model), FEEDS)[0], run_ort(proto, FEEDS)[0])


def test_exclude_and_constant_node_weights():
    w = RNG.standard_normal((4, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w, "w")),
        helper.make_node("MatMul", ["x4", "w"], ["a"], name="keep_me"),
        helper.make_node("Constant", [], ["u"], value=numpy_helper.from_array(w.copy(), "u")),
        helper.make_node("MatMul", ["a", "u"], ["b"], name="mask_me"),
    ]
    proto = make_model(nodes, [("x4", np.float32, [2, 4])], [("b", np.float32, [2, 4])])
    model = to_ir(proto)
    entry = run_pass(Sparsity2to4Pass(exclude=["keep_*"]), model)
    assert entry.stats["weights_masked"] == 8 and entry.stats["layers"] == 1
    assert entry.details["skipped"] == [{"node": "keep_me", "weight": "w", "reason": "excluded"}]
    consts = {n.outputs[0].name: n.attributes["value"].value.numpy() for n in model.graph if n.op_type == "Constant"}
    np.testing.assert_array_equal(consts["w"], w)
    np.testing.assert_array_equal(consts["u"], _reference_mask(w, 0))
    feeds = {"x4": RNG.standard_normal((2, 4)).astype(np.float32)}
    np.testing.assert_allclose(
        run_ort(checked(model), feeds)[0], feeds["x4"] @ w @ _reference_mask(w, 0), rtol=1e-5, atol=1e-5
    )
    assert_second_run_changes_nothing(Sparsity2to4Pass(exclude=["keep_*"]), model)


def test_output_figure_is_reported_not_judged(caplog, monkeypatch):
    """sparsity-2to4 is lossy by design (fine-tuning follows): its output cosine against the original is in
    the details, with no floor, warning or stat; ``--accuracy-budget off`` skips it; nothing masked, no run."""
    import logging

    from mograph.passes.quant import _output_check as oc

    proto = _model()
    model = to_ir(proto)
    with caplog.at_level(logging.WARNING):
        entry = run_pass(Sparsity2to4Pass(), model)
    check = entry.details["output_check"]
    assert check["judged"] is False and check["note"] == oc.UNJUDGED_NOTE and "floor" not in check
    assert check["samples"] == 4 and check["data"] == "seeded random" and check["output"] in ("y", "c")
    assert set(entry.stats) == {"layers", "layers_skipped", "weights_qualifying", "weights_masked"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # the figure is what the masked model computes on those feeds
    feeds = list(oc.cal.RandomSource(to_ir(proto), 4))[check["sample"]]
    names = ["y", "c", "z"]
    ref, out = run_ort(proto, feeds), run_ort(model, feeds)
    i = names.index(check["output"])
    got = oc.output_value(oc._COSINE, ref[i], out[i])
    assert abs(got - check["measured"]) < 1e-5 and -1.0 <= got < 1.0

    def refuse(*_a, **_k):
        raise AssertionError("the check ran")

    monkeypatch.setattr(oc.OutputCheck, "start", refuse)
    assert "output_check" not in run_pass(Sparsity2to4Pass(accuracy_budget="off"), to_ir(_model())).details
    assert "output_check" not in run_pass(Sparsity2to4Pass(), model).details  # the second run masks nothing
