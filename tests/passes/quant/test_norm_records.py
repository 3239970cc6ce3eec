"""The Q/DQ plans and ``fp16`` know a normalization by its foreign-op record (``normalizes``), not a list.

``com.microsoft`` ``SkipSimplifiedLayerNormalization`` is one by its built-in record; ``LpNormalization``
(a standard op no built-in record names) becomes one when a plugin's record says so.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
from mograph.passes.quant import Fp16Pass, QdqInt8Pass
from mograph.passes.quant._qdq import sensitive_nodes
from onnx import helper

from models.builders import make_model
from mograph.foreign_ops import ForeignOp
from mograph.testing import to_ir
from tests.passes.quant._helpers import cosine, run

HIDDEN = 8
LP_RECORD = ForeignOp("LpNormalization", "", normalizes=True)
PLUGIN = SimpleNamespace(custom_ops={}, foreign_ops={LP_RECORD.key: LP_RECORD})


def _model() -> onnx.ModelProto:
    """x -> MatMul -> SkipSimplifiedLayerNormalization (skip x) -> LpNormalization -> MatMul -> y."""
    rng = np.random.default_rng(0)
    inits = {"w1": rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32),
             "w2": rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32),
             "g": np.linspace(0.5, 1.5, HIDDEN).astype(np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("SkipSimplifiedLayerNormalization", ["h", "x", "g"], ["n"], name="skip_rms",
                         domain="com.microsoft", epsilon=1e-5),
        helper.make_node("LpNormalization", ["n"], ["p"], name="lp", axis=-1, p=2),
        helper.make_node("MatMul", ["p", "w2"], ["y"], name="fc2"),
    ]
    return make_model(nodes, [("x", np.float32, [2, 4, HIDDEN])], [("y", np.float32, [2, 4, HIDDEN])], inits,
                      extra_opsets={"com.microsoft": 1})


def _feeds(n: int = 4) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((2, 4, HIDDEN)).astype(np.float32)} for _ in range(n)]


def test_sensitive_nodes_read_the_records():
    model = to_ir(_model())
    assert [(n.name, r) for n, r in sensitive_nodes(model)] == [("skip_rms", "default rule: normalization")]
    assert [(n.name, r) for n, r in sensitive_nodes(model, PLUGIN.foreign_ops)] == [
        ("skip_rms", "default rule: normalization"), ("lp", "default rule: normalization")]


def _plan(result) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    return {e["node"]: e for e in result.details["plan"]["nodes"]}


def test_qdq_plan_lists_a_plugins_normalization():
    proto = _model()
    bare = QdqInt8Pass(calibration_data=_feeds(), accuracy_budget="off").call(to_ir(proto))
    by = _plan(bare)
    assert (by["skip_rms"]["precision"], by["skip_rms"]["reason"]) == ("fp32", "default rule: normalization")
    assert "lp" not in by

    model = to_ir(proto)
    result = QdqInt8Pass(calibration_data=_feeds(), accuracy_budget="off", registry=PLUGIN).call(model)  # type: ignore[arg-type]
    by = _plan(result)
    assert (by["lp"]["precision"], by["lp"]["reason"]) == ("fp32", "default rule: normalization")
    assert result.stats["quantized"] == bare.stats["quantized"] == 1  # fc1; fc2 is the final projection
    feeds = _feeds(1)[0]
    assert cosine(run(proto, feeds)[0], run(model, feeds)[0]) > 0.99


def test_fp16_counts_a_normalizations_reduction_depth():
    proto = _model()
    options = {"calibration_data": _feeds(), "fp16_reduction_limit": HIDDEN, "fp16_budget": "none"}
    bare = Fp16Pass(**options).call(to_ir(proto))
    by = _plan(bare)
    assert by["skip_rms"]["precision"] == "fp32"
    assert by["skip_rms"]["reason"] == f"measured sensitivity: reduces {HIDDEN} elements >= {HIDDEN}"
    assert by["lp"]["precision"] == "fp16"  # no record: not counted as a reduction

    model = to_ir(proto)
    result = Fp16Pass(registry=PLUGIN, **options).call(model)  # type: ignore[arg-type]
    by = _plan(result)
    assert by["lp"]["precision"] == "fp32"
    assert by["lp"]["reason"] == f"measured sensitivity: reduces {HIDDEN} elements >= {HIDDEN}"
    assert result.stats["kept_fp32.reduction"] == bare.stats["kept_fp32.reduction"] + 1 == 2
    feeds = _feeds(1)[0]
    assert cosine(run(proto, feeds)[0], run(model, feeds)[0]) > 0.999
