"""fp16: conversion, measured overflow and deep-reduction rules, graph I/O, plan, numbers (ORT CPU, opts off)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant import Fp16Pass
from onnx import helper, numpy_helper

from models.builders import bert_feeds, bert_tiny
from mograph.errors import OptionError
from tests.passes.quant._helpers import cosine, op_counts, run, to_ir


def _model(scale: float = 1.0, reduce_len: int = 8) -> onnx.ModelProto:
    """x -> MatMul w -> Mul scale -> ReduceSum(last axis) -> y ; and Relu(h) -> z."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((reduce_len, reduce_len)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node("Mul", ["h", "s"], ["hs"], name="scale"),
            helper.make_node("ReduceSum", ["hs", "axes"], ["y"], name="sum", keepdims=0),
            helper.make_node("Relu", ["h"], ["z"], name="relu"),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", reduce_len])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["n", reduce_len])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(scale, np.float32), "s"),
         numpy_helper.from_array(np.array([-1], np.int64), "axes")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _calib(n: int = 4, width: int = 8) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((3, width)).astype(np.float32)} for _ in range(n)]


def test_all_fp16_when_safe():
    proto = _model()
    model = to_ir(proto)
    result = Fp16Pass(calibration_data=_calib()).call(model)
    assert result.modified
    assert result.stats == {"converted": 4, "kept_fp32": 0, "kept_fp32.overflow": 0, "kept_fp32.reduction": 0,
                            "initializers_fp16": 2, "casts": 3}  # x in, y and z out
    assert op_counts(model) == {"Cast": 3, "MatMul": 1, "Mul": 1, "ReduceSum": 1, "Relu": 1}
    assert model.graph.inputs[0].dtype == ir.DataType.FLOAT
    assert [v.dtype for v in model.graph.outputs] == [ir.DataType.FLOAT] * 2
    assert [v.name for v in model.graph.outputs] == ["y", "z"]
    feeds = _calib(1)[0]
    for ref, out in zip(run(proto, feeds), run(model, feeds)):
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    again = Fp16Pass(calibration_data=_calib()).call(model)
    assert not again.modified


def test_measured_overflow_keeps_fp32():
    proto = _model(scale=30000.0)  # |h * s| passes 65504 on the calibration data
    model = to_ir(proto)
    result = Fp16Pass(calibration_data=_calib()).call(model)
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["scale"]["precision"] == "fp32" and by["scale"]["reason"].startswith("measured sensitivity: |x|")
    assert by["sum"]["precision"] == "fp32"
    assert by["mm"]["precision"] == "fp16" and by["relu"]["precision"] == "fp16"
    assert result.stats["kept_fp32.overflow"] == 2 and result.stats["converted"] == 2
    feeds = _calib(1)[0]
    for ref, out in zip(run(proto, feeds), run(model, feeds)):
        assert np.isfinite(out).all()
        assert cosine(ref, out) > 0.9999


def test_deep_reduction_keeps_fp32():
    model = to_ir(_model(reduce_len=64))
    result = Fp16Pass(calibration_data=_calib(width=64), fp16_reduction_limit=32).call(model)
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["sum"]["precision"] == "fp32" and "reduces 64 elements" in by["sum"]["reason"]
    assert result.stats["kept_fp32.reduction"] == 1


def test_fp16_io():
    proto = _model()
    model = to_ir(proto)
    result = Fp16Pass(calibration_data=_calib(), fp16_io="yes").call(model)
    assert result.stats["casts"] == 0
    assert model.graph.inputs[0].dtype == ir.DataType.FLOAT16
    feeds = {"x": _calib(1)[0]["x"].astype(np.float16)}
    outs = run(model, feeds)
    assert all(o.dtype == np.float16 for o in outs)
    np.testing.assert_allclose(outs[1].astype(np.float32), run(proto, _calib(1)[0])[1], rtol=2e-2, atol=2e-2)


def test_bert_tiny_mask_overflow_kept():
    proto = bert_tiny()
    model = to_ir(proto)
    result = Fp16Pass(calibration_data=[bert_feeds(1, 8 + i, seed=100 + i) for i in range(4)]).call(model)
    kept = [e for e in result.details["plan"]["nodes"] if e["precision"] == "fp32"]
    # the attention-mask bias (a very large negative constant) would overflow float16
    assert len(kept) == result.stats["kept_fp32.overflow"] == 2
    feeds = bert_feeds(2, 16, seed=1)
    ref, out = run(proto, feeds)[0], run(model, feeds)[0]
    assert cosine(ref, out) > 0.9999 and np.abs(ref - out).max() < 2e-2


def test_near_miss_and_refusal():
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])], "g",
        [helper.make_tensor_value_info("a", onnx.TensorProto.INT64, [2]),
         helper.make_tensor_value_info("b", onnx.TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("c", onnx.TensorProto.INT64, [2])],
    )
    model = to_ir(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert not Fp16Pass().call(model).modified  # nothing float: no data needed, nothing changes
    with pytest.raises(OptionError, match="needs calibration data"):
        Fp16Pass().call(to_ir(_model()))
