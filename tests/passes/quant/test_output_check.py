"""The default output check of the lossy precision passes (``passes/quant/_output_check.py``).

``int4`` (weight-only) and ``qdq-fp8`` decide by rules by default and measured nothing: a GNN they wrecked
(issue 27's caustic NMR predictor, output cosine -0.5 / -0.25 against float32) was written with exit 0 and no
word.  The model here fails the same way on purpose: ``y = (x W1 - x W2) W3`` with ``W2 = W1 + 0.01 D``, so the
difference the output reads is far below the quantization error of the two large products (cancellation, as a
message-passing update minus its input).  The last MatMul is the output projection and stays float by rule.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from mograph.passes.quant import QdqFp8Pass, QdqInt8Pass, WeightOnlyPass
from mograph.passes.quant import _output_check as oc
from mograph.passes.quant._fp16_measure import output_value
from mograph.passes.quant.plan import Budget
from onnx import helper, numpy_helper

from mograph.cli import main
from mograph.testing import to_ir
from tests.passes.quant._helpers import cosine, run

F32 = onnx.TensorProto.FLOAT


def _model(cancel: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((32, 32)).astype(np.float32)
    w2 = (w1 + 0.01 * rng.standard_normal((32, 32)) if cancel else -rng.standard_normal((32, 32))).astype(np.float32)
    w3 = rng.standard_normal((32, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"], name="a"),
             helper.make_node("MatMul", ["x", "w2"], ["b"], name="b"),
             helper.make_node("Sub", ["a", "b"], ["d"], name="d"),
             helper.make_node("MatMul", ["d", "w3"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["n", 32])],
                              [helper.make_tensor_value_info("y", F32, ["n", 8])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
                               numpy_helper.from_array(w3, "w3")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n: int = 4, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((8, 32)).astype(np.float32)} for _ in range(n)]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "wrecked" in r.getMessage()]


def test_int4_default_warns_on_a_wrecked_model(caplog):
    """No data (RTN): the check runs on seeded random feeds, says the output, the figure and the ways out."""
    proto = _model()
    model = to_ir(proto)
    with caplog.at_level(logging.WARNING):
        result = WeightOnlyPass().call(model)
    assert result.stats == {"quantized": 2, "kept_float": 1, "quantized.int4": 2, "output_check.below_floor": 1}
    check = result.details["output_check"]
    figure = check["measured"]
    assert figure < 0 and check["samples"] == 4
    assert check["output"] == "y" and check["data"] == "seeded random" and check["passed"] is False
    assert check["floor"] == oc.CHECK_FLOOR
    # the figure is what the written model computes on the check's own feeds
    feeds = list(oc.cal.RandomSource(to_ir(proto), 4))
    ref, out = run(proto, feeds[check["sample"]])[0], run(model, feeds[check["sample"]])[0]
    assert output_value(Budget("cosine", 0.0), ref, out) == pytest.approx(figure, rel=1e-4)  # the kernels' form
    assert np.linalg.norm(out) > 2 * np.linalg.norm(ref)  # the difference read is all quantization noise
    (line,) = _warnings(caplog)
    assert line.startswith("weight-only: output 'y' of the quantized model has cosine ")
    assert "--accuracy-budget cosine>=0.99" in line and "leave weight-only out" in line
    assert result.details["notes"] == [check["warning"]]


def test_fp8_default_warns_on_a_wrecked_model(caplog):
    model = to_ir(_model())
    with caplog.at_level(logging.WARNING):
        result = QdqFp8Pass(calibration_data=_feeds()).call(model)
    assert result.details["output_check"]["measured"] < 0
    assert result.stats == {"quantized": 2, "kept_float": 1, "skipped_already_quantized": 0,
                            "opset_upgrade.from": 17, "opset_upgrade.to": 19, "opset_upgrade.rewritten": 0,
                            "calibration_samples": 4, "quantized.MatMul": 2, "q_nodes": 1, "dq_nodes": 3,
                            "output_check.below_floor": 1}
    assert result.details["output_check"]["data"] == "calibration"
    (line,) = _warnings(caplog)
    assert line.startswith("qdq-fp8: output 'y' of the quantized model has cosine ") and "leave qdq-fp8 out" in line


@pytest.mark.parametrize("make", [lambda: WeightOnlyPass(), lambda: QdqFp8Pass(calibration_data=_feeds())],
                         ids=["int4", "fp8"])
def test_a_healthy_model_passes_the_check_quietly(caplog, make):
    model = to_ir(_model(cancel=False))
    with caplog.at_level(logging.WARNING):
        result = make().call(model)
    assert "output_check.below_floor" not in result.stats and result.details["output_check"]["samples"] == 4
    assert 0.98 < result.details["output_check"]["measured"] <= 1.0
    assert result.details["output_check"]["passed"] is True and "warning" not in result.details["output_check"]
    assert not _warnings(caplog) and "notes" not in result.details


@pytest.mark.parametrize("make", [lambda: WeightOnlyPass(accuracy_budget="off"),
                                  lambda: QdqFp8Pass(calibration_data=_feeds(), accuracy_budget="off"),
                                  lambda: QdqInt8Pass(calibration_data=_feeds(), accuracy_budget="off")],
                         ids=["int4", "fp8", "int8"])
def test_budget_off_skips_the_check(caplog, make, monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the check ran")

    monkeypatch.setattr(oc.OutputCheck, "start", refuse)
    with caplog.at_level(logging.WARNING):
        result = make().call(to_ir(_model()))
    assert result.stats["quantized"] == 2
    assert not any(k.startswith("output_check") for k in result.stats) and "output_check" not in result.details
    assert not _warnings(caplog)


def test_a_measured_budget_is_the_way_out(caplog):
    """The warning's advice works: the budget raises the two cancelling layers, and the budget's own
    measurement stands in for the check (no second figure, no warning)."""
    proto = _model()
    model = to_ir(proto)
    with caplog.at_level(logging.WARNING):
        result = WeightOnlyPass(calibration_data=_feeds(), accuracy_budget="cosine>=0.99").call(model)
    assert result.details["plan"]["accuracy_budget"]["met"] is True
    assert "output_check" not in result.details and not _warnings(caplog)
    f = _feeds(1, 7)[0]
    assert cosine(run(proto, f)[0], run(model, f)[0]) > 0.99


def test_int8_default_budget_needs_no_extra_check(monkeypatch):
    """qdq-int8 measures its result by default (cosine>=0.992): the check does not run again."""
    monkeypatch.setattr(oc.OutputCheck, "start", lambda *a, **k: pytest.fail("the check ran"))
    result = QdqInt8Pass(calibration_data=_feeds()).call(to_ir(_model()))
    assert result.stats["sensitivity_evaluations"] >= 1 and "output_check" not in result.details


def test_a_model_over_the_load_limit_is_not_run(monkeypatch):
    monkeypatch.setattr("mograph.output_check.ORT_MAX_BYTES", 1024)
    result = WeightOnlyPass().call(to_ir(_model()))
    assert "output_check.below_floor" not in result.stats
    check = result.details["output_check"]
    assert check["measured"] is None and check["skipped"].startswith("0.0 GiB of weights, over the ")
    assert "--accuracy-budget cosine>=X" in check["skipped"]


def test_random_feeds_the_model_rejects_skip_the_check_not_the_pass():
    """int4 without data: an integer input drawn at random (here a Reshape's target shape) may not fit; the
    pass still succeeds, and the details say why nothing was measured."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 32)).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["h"], name="view"),
             helper.make_node("MatMul", ["h", "w"], ["m"], name="msg"),
             helper.make_node("MatMul", ["m", "w"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [4, 32]),
                                           helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", F32, [4, 32])], [numpy_helper.from_array(w, "w")])
    model = to_ir(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    result = WeightOnlyPass().call(model)
    assert result.stats == {"quantized": 1, "kept_float": 1, "quantized.int4": 1}
    check = result.details["output_check"]
    assert check["measured"] is None
    assert check["skipped"].startswith("the float model did not run on the check's random feeds: ")


def test_cli_int4_on_a_wrecked_model_exits_0_with_one_warning(tmp_path: Path, caplog):
    """Exit 0 (the pass did its job; the figure comes from 4 feeds, here random ones): a failing exit is
    --verify's (exit 5).  One warning line, and the figure in the report."""
    src, out, report = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(_model(), src)
    with caplog.at_level(logging.WARNING, logger="mograph"):
        code = main(["optimize", str(src), "--passes", "int4", "-o", str(out), "--report", str(report)])
    assert code == 0 and out.exists()
    (line,) = _warnings(caplog)
    assert "output 'y'" in line and "--accuracy-budget cosine>=0.99" in line
    entry = json.loads(report.read_text())["passes"][0]
    assert entry["stats"]["output_check.below_floor"] == 1
    assert entry["details"]["output_check"]["measured"] < 0 and entry["details"]["output_check"]["output"] == "y"


def test_int8_on_a_float16_model_is_checked_too(caplog):
    """qdq-int8's default budget is not measured on a float16 model (the rules decide, said in a note): the
    output check stands in for it, on the written Q/DQ graph."""
    proto = _model()
    for init in proto.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for v in (*proto.graph.input, *proto.graph.output):
        v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    feeds = [{"x": f["x"].astype(np.float16)} for f in _feeds()]
    with caplog.at_level(logging.WARNING):
        result = QdqInt8Pass(calibration_data=feeds, smoothing="off").call(to_ir(proto))
    assert result.stats["quantized"] == 2 and result.stats["output_check.below_floor"] == 1
    check = result.details["output_check"]
    assert check["ran"] == "the written model" and check["output"] == "y" and check["measured"] < oc.CHECK_FLOOR
    assert any(n.startswith("float16/bfloat16 model: the default rules chose") for n in result.details["notes"])
    (line,) = _warnings(caplog)
    assert line.startswith("qdq-int8: output 'y' of the quantized model has cosine ")
