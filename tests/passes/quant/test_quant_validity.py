"""Q/DQ passes write models that load: fp16 models, old opsets (upgraded or refused), weights in Constant nodes and If branches.

Issue 19 items 2 and 7.  Each model is built here; every converted model must pass the output check (ONNX
checker and an ONNX Runtime load, optimizations off) and agree with the original on seeded feeds.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant import QdqFp8Pass, QdqInt8Pass
from onnx import helper, numpy_helper

from mograph.errors import ModelError
from mograph.output_check import check_model_output
from tests.passes.quant._helpers import cosine, op_counts, run, to_ir

F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


def _weights(dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((16, 8)).astype(dtype), rng.standard_normal((8, 4)).astype(dtype)


def _mlp(opset: int = 17, dtype: type = np.float32, weights: str = "initializer") -> onnx.ModelProto:
    """y = Relu(x @ w) @ w2; the weights are initializers or ``Constant`` nodes."""
    w, w2 = _weights(dtype)
    elem = F16 if dtype == np.float16 else F32
    nodes, inits = [], []
    if weights == "constant":
        nodes += [helper.make_node("Constant", [], ["w"], name="w_const", value=numpy_helper.from_array(w)),
                  helper.make_node("Constant", [], ["w2"], name="w2_const", value=numpy_helper.from_array(w2))]
    else:
        inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")]
    nodes += [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
              helper.make_node("Relu", ["h"], ["r"], name="relu"),
              helper.make_node("MatMul", ["r", "w2"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, ["n", 16])],
                              [helper.make_tensor_value_info("y", elem, ["n", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _feeds(n: int = 4, dtype: type = np.float32) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((8, 16)).astype(dtype)} for _ in range(n)]


def _loads_and_matches(proto: onnx.ModelProto, model: ir.Model, feeds: list[dict], min_cosine: float) -> None:
    assert check_model_output(model)["onnxruntime"].startswith("passed")
    for f in feeds:
        ref, out = run(proto, f)[0], run(model, f)[0]
        assert out.dtype == ref.dtype
        assert cosine(ref, out) > min_cosine


# --- int8 on a float16 model (item 2) ----------------------------------------------------------------------


def test_int8_on_fp16_model_at_opset_15_upgrades_and_uses_fp16_scales():
    proto = _mlp(opset=15, dtype=np.float16)
    model = to_ir(proto)
    result = QdqInt8Pass(calibration_data=_feeds(dtype=np.float16)).call(model)
    assert result.modified
    assert result.stats["quantized"] == 1 and result.stats["q_nodes"] == 1 and result.stats["dq_nodes"] == 2
    assert result.stats["opset_upgrade.from"] == 15 and result.stats["opset_upgrade.to"] == 19
    assert result.details["opset_upgrade"]["reason"] == "float16 tensors are quantized (QuantizeLinear 19)"
    assert model.opset_imports[""] == 19
    inits = {k: v.const_value for k, v in model.graph.initializers.items()}
    assert inits["x_scale"].dtype == ir.DataType.FLOAT16  # QuantizeLinear-19: the scale has x's type
    assert inits["w_scale"].dtype == ir.DataType.FLOAT16  # the weight's DequantizeLinear outputs float16
    assert inits["w_quantized"].dtype == ir.DataType.INT8
    _loads_and_matches(proto, model, _feeds(2, np.float16), 0.99)
    assert not QdqInt8Pass(calibration_data=_feeds(dtype=np.float16)).call(model).modified


def test_fp8_on_fp16_model():
    proto = _mlp(opset=19, dtype=np.float16)
    model = to_ir(proto)
    result = QdqFp8Pass(calibration_data=_feeds(dtype=np.float16)).call(model)
    assert result.stats["quantized"] == 1 and "opset_upgrade.to" not in result.stats
    assert model.graph.initializers["x_scale"].const_value.dtype == ir.DataType.FLOAT16  # type: ignore[union-attr]
    _loads_and_matches(proto, model, _feeds(2, np.float16), 0.98)


# --- opsets: upgraded when the ops convert cleanly, refused in one line when not (item 7) -------------------


def test_int8_upgrades_opset_11_to_13():
    proto = _mlp(opset=11)
    model = to_ir(proto)
    result = QdqInt8Pass(calibration_data=_feeds()).call(model)
    assert model.opset_imports[""] == 13
    assert result.stats["opset_upgrade.from"] == 11 and result.stats["opset_upgrade.to"] == 13
    assert result.details["opset_upgrade"]["reason"] == "per-channel DequantizeLinear (13)"
    assert result.stats["quantized"] == 1
    _loads_and_matches(proto, model, _feeds(2), 0.995)


def test_fp8_upgrades_opset_17_to_19():
    proto = _mlp(opset=17)
    model = to_ir(proto)
    result = QdqFp8Pass(calibration_data=_feeds()).call(model)
    assert model.opset_imports[""] == 19
    assert result.stats["opset_upgrade.from"] == 17 and result.stats["opset_upgrade.to"] == 19
    assert result.stats["quantized"] == 1
    _loads_and_matches(proto, model, _feeds(2), 0.99)


@pytest.mark.parametrize("cls", [QdqInt8Pass, QdqFp8Pass])
def test_opset_upgrade_refused_in_one_line(cls):
    """A model-local function the converter cannot convert: refused before anything changes."""
    proto = _mlp(opset=11)
    fn = helper.make_function("example.local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 11)])
    proto.functions.append(fn)
    proto.opset_import.append(helper.make_opsetid("example.local", 1))
    model = to_ir(proto)
    with pytest.raises(ModelError) as err:
        cls(calibration_data=_feeds()).call(model)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{cls.name}: needs opset >= ")
    assert "cannot be upgraded from 11" in message and "model-local functions (example.local::Twice)" in message
    assert model.opset_imports[""] == 11 and op_counts(model) == {"MatMul": 2, "Relu": 1}
