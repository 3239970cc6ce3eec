"""qdq-fp8: E4M3 Q/DQ structure, per-tensor scales, numerics (ORT CPU and a numpy emulation), refusals."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant import QdqFp8Pass
from onnx import helper, numpy_helper

from models.builders import bert_feeds, bert_tiny
from mograph.testing import op_counts, to_ir
from tests.passes.quant._helpers import cosine, run

FP8 = ml_dtypes.float8_e4m3fn


def _mlp(opset: int = 19) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w2 = rng.standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="head"),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), w, w2


def test_fp8_structure_and_exact_numerics():
    proto, w, w2 = _mlp()
    rng = np.random.default_rng(1)
    calib = [{"x": rng.standard_normal((32, 16)).astype(np.float32)} for _ in range(4)]
    model = to_ir(proto)
    result = QdqFp8Pass(calibration_data=calib).call(model)
    assert result.modified
    assert result.stats == {
        "quantized": 1, "quantized.MatMul": 1, "kept_float": 1, "skipped_already_quantized": 0,
        "calibration_samples": 4, "q_nodes": 1, "dq_nodes": 2,
    }
    assert op_counts(model) == {"QuantizeLinear": 1, "DequantizeLinear": 2, "MatMul": 2, "Relu": 1}
    inits = {k: v.const_value for k, v in model.graph.initializers.items()}
    assert inits["w_quantized"].dtype == ir.DataType.FLOAT8E4M3FN
    assert inits["x_zero_point"].dtype == ir.DataType.FLOAT8E4M3FN
    assert inits["x_scale"].shape == () and inits["w_scale"].shape == ()  # per-tensor scales
    # numpy emulation of Q/DQ in E4M3 (scale = amax / 448), compared with ORT CPU (optimizations off)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    amax = max(max(abs(c["x"].min()), abs(c["x"].max())) for c in calib)
    sx, sw = amax / 448.0, np.abs(w).max() / 448.0
    xq = np.clip(x / sx, -448, 448).astype(FP8).astype(np.float32) * sx
    wq = (w / sw).astype(FP8).astype(np.float32) * sw
    expected = np.maximum(xq @ wq, 0) @ w2
    out = run(model, {"x": x})[0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert cosine(out, run(proto, {"x": x})[0]) > 0.999
    # the ONNX reference evaluator agrees
    from onnx.reference import ReferenceEvaluator

    ref = ReferenceEvaluator(ir.serde.serialize_model(model)).run(None, {"x": x})[0]
    np.testing.assert_allclose(ref, out, rtol=1e-5, atol=1e-5)
    assert not QdqFp8Pass(calibration_data=calib).call(model).modified


def test_fp8_bert_tiny():
    proto = bert_tiny(opset=19)
    model = to_ir(proto)
    result = QdqFp8Pass(calibration_data=[bert_feeds(1, 8 + i, seed=100 + i) for i in range(8)]).call(model)
    assert result.stats["quantized"] == 11 and result.stats["q_nodes"] == 7
    assert {e["precision"] for e in result.details["plan"]["nodes"] if e["op"] == "MatMul"} == {"fp8", "fp32"}
    feeds = bert_feeds(2, 16, seed=1)
    assert cosine(run(proto, feeds)[0], run(model, feeds)[0]) > 0.999


def test_fp8_refuses_missing_data():
    """(An opset below 19 is upgraded or refused: tests/passes/quant/test_quant_validity.py.)"""
    from mograph.errors import OptionError

    with pytest.raises(OptionError, match="needs calibration data"):
        QdqFp8Pass().call(to_ir(_mlp()[0]))
