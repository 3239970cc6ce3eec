"""Q/DQ passes write models that load: fp16 models, old opsets (upgraded or refused), weights in Constant nodes and If branches.

Issue 19 items 2 and 7.  Each model is built here; every converted model must pass the output check (ONNX
checker and an ONNX Runtime load, optimizations off) and agree with the original on seeded feeds.  The
expected counts follow the default rules, so the passes run with ``accuracy_budget="off"`` except on the
float16 model, where qdq-int8's default falls back to the rules by itself (the measured default is tested
in ``test_int8_sensitivity.py``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant import Fp16Pass, QdqFp8Pass, QdqInt8Pass, WeightOnlyPass
from onnx import helper, numpy_helper

from mograph.errors import ModelError
from mograph.output_check import check_model_output
from mograph.testing import op_counts, to_ir
from tests.passes.quant._helpers import cosine, run

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
    assert any("float16/bfloat16 model: the default rules chose the float layers" in n for n in result.details["notes"])
    assert not QdqInt8Pass(calibration_data=_feeds(dtype=np.float16)).call(model).modified


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_int8_on_fp16_weights_in_constant_nodes_upgrades_the_opset(dtype):
    """paddle2onnx's and onnxconverter-common's float16 models keep their weights in ``Constant`` nodes (no
    initializer, no float16 input here either: ``keep_io_types`` casts a float32 input): the opset must still
    go to 19 for the float16 scales.  Before the fix: opset 15 kept, ORT refused the measuring model (exit 1,
    "Type 'tensor(float16)' of input parameter (w_scale) of operator (DequantizeLinear) ... is invalid").
    The float32 twin is the near miss: opset 15 is enough for it and stays."""
    half = dtype == np.float16
    proto = _mlp(opset=15, dtype=dtype, weights="constant")
    if half:  # float32 in and out, as onnxconverter-common's keep_io_types writes
        g = proto.graph
        g.input[0].type.tensor_type.elem_type = F32
        g.output[0].type.tensor_type.elem_type = F32
        g.node[2].input[0] = "x16"
        g.node[4].output[0] = "y16"
        g.node.insert(0, helper.make_node("Cast", ["x"], ["x16"], name="cast_in", to=F16))
        g.node.append(helper.make_node("Cast", ["y16"], ["y"], name="cast_out", to=F32))
    model = to_ir(proto)
    result = QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds()).call(model)
    assert result.stats["quantized"] == 1 and result.stats["q_nodes"] == 1 and result.stats["dq_nodes"] == 2
    extra = {"Cast": 2} if half else {"Mul": 1}  # smoothing's Mul on float32 only
    assert op_counts(model) == {"Constant": 1, "QuantizeLinear": 1, "DequantizeLinear": 2, "MatMul": 2, "Relu": 1,
                                **extra}
    if half:
        assert result.stats["opset_upgrade.from"] == 15 and result.stats["opset_upgrade.to"] == 19
        assert model.opset_imports[""] == 19
        assert model.graph.initializers["w_scale"].const_value.dtype == ir.DataType.FLOAT16  # type: ignore[union-attr]
    else:
        assert "opset_upgrade.to" not in result.stats and model.opset_imports[""] == 15
    _loads_and_matches(proto, model, _feeds(2), 0.99)
    assert not QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds()).call(model).modified


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
    result = QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds()).call(model)
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
        cls(accuracy_budget="off", calibration_data=_feeds()).call(model)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{cls.name}: needs opset >= ")
    assert "cannot be upgraded from 11" in message and "model-local functions (example.local::Twice)" in message
    assert model.opset_imports[""] == 11 and op_counts(model) == {"MatMul": 2, "Relu": 1}


# --- weights in Constant nodes and inside If branches (item 7) ----------------------------------------------


@pytest.mark.parametrize("cls", [QdqInt8Pass, QdqFp8Pass])
def test_weights_in_constant_nodes_are_quantized(cls):
    proto = _mlp(opset=19, weights="constant")
    model = to_ir(proto)
    result = cls(accuracy_budget="off", calibration_data=_feeds()).call(model)
    assert result.modified
    assert result.stats["quantized"] == 1 and result.stats["q_nodes"] == 1 and result.stats["dq_nodes"] == 2
    # the quantized weight's Constant is gone; the final projection keeps its float Constant; INT8 smooths
    # the quantized input (one Mul), FP8 does not
    smooth = {"Mul": 1} if cls is QdqInt8Pass else {}
    assert op_counts(model) == {"Constant": 1, "QuantizeLinear": 1, "DequantizeLinear": 2, "MatMul": 2, "Relu": 1,
                                **smooth}
    assert [n.name for n in model.graph if n.op_type == "Constant"] == ["w2_const"]
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["mm"]["precision"] == cls.precision and by["head"]["reason"] == "default rule: final projection"
    _loads_and_matches(proto, model, _feeds(2), 0.99)
    assert not cls(accuracy_budget="off", calibration_data=_feeds()).call(model).modified


def _if_model() -> onnx.ModelProto:
    """b = If(c, then: Relu(x) @ wt [branch initializer], else: Sigmoid(x) @ we [branch Constant]); y = b @ w_head."""
    rng = np.random.default_rng(3)
    wt, we, wh = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (16, 8), (8, 4)))
    then_g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h_t"], name="then_relu"),
         helper.make_node("MatMul", ["h_t", "wt"], ["t"], name="then_mm")],
        "then", [], [helper.make_tensor_value_info("t", F32, ["n", 8])], [numpy_helper.from_array(wt, "wt")])
    else_g = helper.make_graph(
        [helper.make_node("Constant", [], ["we"], name="we_const", value=numpy_helper.from_array(we)),
         helper.make_node("Sigmoid", ["x"], ["h_e"], name="else_sigmoid"),
         helper.make_node("MatMul", ["h_e", "we"], ["e"], name="else_mm")],
        "else", [], [helper.make_tensor_value_info("e", F32, ["n", 8])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["b"], name="if", then_branch=then_g, else_branch=else_g),
         helper.make_node("MatMul", ["b", "wh"], ["y"], name="head")],
        "g",
        [helper.make_tensor_value_info("x", F32, ["n", 16]), helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", F32, ["n", 4])],
        [numpy_helper.from_array(wh, "wh")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _if_feeds(n: int, conds: list[bool]) -> list[dict]:
    rng = np.random.default_rng(5)
    return [{"x": rng.standard_normal((8, 16)).astype(np.float32), "c": np.array(conds[i % len(conds)])}
            for i in range(n)]


def _ops(graph: ir.Graph) -> Counter:
    return Counter(n.op_type for n in graph)


def _branch(model: ir.Model, which: str) -> ir.Graph:
    node = next(n for n in model.graph if n.op_type == "If")
    return node.attributes[which].as_graph()


@pytest.mark.parametrize("cls", [QdqInt8Pass, QdqFp8Pass])
def test_weights_inside_if_branches_are_quantized(cls):
    proto = _if_model()
    model = to_ir(proto)
    result = cls(accuracy_budget="off", calibration_data=_if_feeds(6, [True, False])).call(model)
    assert result.modified
    assert result.stats["quantized"] == 2 and result.stats["quantized.MatMul"] == 2
    assert result.stats["q_nodes"] == 2 and result.stats["dq_nodes"] == 4  # h_t, h_e; their weights
    assert result.stats["kept_float"] == 1  # the head, the final projection
    assert _ops(_branch(model, "then_branch")) == {"Relu": 1, "QuantizeLinear": 1, "DequantizeLinear": 2,
                                                        "MatMul": 1}
    assert _ops(_branch(model, "else_branch")) == {"Sigmoid": 1, "QuantizeLinear": 1, "DequantizeLinear": 2,
                                                        "MatMul": 1}  # its weight Constant replaced
    assert "wt" not in _branch(model, "then_branch").initializers  # the float weight is gone
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["then_mm"]["precision"] == by["else_mm"]["precision"] == cls.precision
    _loads_and_matches(proto, model, _if_feeds(2, [True, False]), 0.99)
    assert not cls(accuracy_budget="off", calibration_data=_if_feeds(6, [True, False])).call(model).modified


def test_branch_never_taken_in_calibration_stays_float_and_says_so():
    proto = _if_model()
    model = to_ir(proto)
    result = QdqInt8Pass(accuracy_budget="off", calibration_data=_if_feeds(4, [True])).call(model)
    assert result.stats["quantized"] == 1 and result.stats["kept_float"] == 2
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["then_mm"]["precision"] == "int8"
    assert by["else_mm"]["precision"] == "fp32"
    assert by["else_mm"]["reason"] == "no calibrated range for an input (never observed as a float tensor)"
    assert _ops(_branch(model, "else_branch")) == {"Constant": 1, "Sigmoid": 1, "MatMul": 1}
    _loads_and_matches(proto, model, _if_feeds(2, [True, False]), 0.995)


def test_weight_inside_a_loop_body_stays_float_and_says_why():
    """Loop bodies cannot be observed in calibration: their MatMul stays float with that reason, the model loads."""
    rng = np.random.default_rng(7)
    w, wh = rng.standard_normal((16, 16)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("MatMul", ["x_in", "w"], ["m"], name="body_mm"),
         helper.make_node("Tanh", ["m"], ["x_out"])],
        "body",
        [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", F32, ["n", 16])],
        [helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", F32, ["n", 16])],
        [numpy_helper.from_array(w, "w")])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "x"], ["xl"], name="loop", body=body),
         helper.make_node("MatMul", ["xl", "wh"], ["y"], name="head")],
        "g", [helper.make_tensor_value_info("x", F32, ["n", 16])], [helper.make_tensor_value_info("y", F32, ["n", 4])],
        [numpy_helper.from_array(np.array(2, np.int64), "trips"), numpy_helper.from_array(wh, "wh")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model = to_ir(proto)
    result = QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds()).call(model)
    assert not result.modified and result.stats["quantized"] == 0 and result.stats["kept_float"] == 2
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["body_mm"]["reason"] == "inside a Loop/Scan body, whose tensors calibration cannot observe"
    assert by["head"]["reason"] == "default rule: final projection"
    assert check_model_output(model)["onnxruntime"].startswith("passed")


# --- old opsets met on real models (issue 27): weight-only and fp16 write what their opset allows ------------


def test_weight_only_upgrades_opset_12_to_13_for_its_function_body():
    """DNSMOS (keras2onnx, opset 12): the WeightOnlyMatMul body's ``Unsqueeze`` takes its axes as an input
    (opset 13), so ONNX Runtime refused the opset-12 model it wrote (exit 4); the opset is raised now."""
    proto = _mlp(opset=12)
    model = to_ir(proto)
    result = WeightOnlyPass(algorithm="rtn", block_size=32).call(model)
    assert result.modified and result.stats["quantized"] == 1 and result.stats["kept_float"] == 0
    assert result.stats["opset_upgrade.from"] == 12 and result.stats["opset_upgrade.to"] == 13
    assert result.details["opset_upgrade"]["reason"] == "function bodies of the quantized ops (opset 13)"
    assert model.opset_imports[""] == 13
    assert op_counts(model) == {"mograph.WeightOnlyMatMul": 1, "Relu": 1, "MatMul": 1}
    _loads_and_matches(proto, model, _feeds(2), 0.99)
    assert not WeightOnlyPass(algorithm="rtn", block_size=32).call(model).modified


def test_weight_only_at_opset_13_keeps_the_opset():
    proto = _mlp(opset=13)
    model = to_ir(proto)
    result = WeightOnlyPass(algorithm="rtn", block_size=32).call(model)
    assert result.stats["quantized"] == 1 and "opset_upgrade.to" not in result.stats
    assert "opset_upgrade" not in result.details and model.opset_imports[""] == 13


def _saturating(opset: int) -> onnx.ModelProto:
    """y = Sigmoid(x * 1e6) @ w: the Mul overflows float16 (stays float32), so the Sigmoid's input is clipped
    to +-65504 on its way to float16, by the measuring twins and by the written model."""
    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "big"], ["h"], name="scale"),
             helper.make_node("Sigmoid", ["h"], ["s"], name="squash"),
             helper.make_node("MatMul", ["s", "w"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["n", 16])],
                              [helper.make_tensor_value_info("y", F32, ["n", 8])],
                              [numpy_helper.from_array(np.array(1e6, np.float32), "big"), numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [9, 13])
def test_fp16_clips_with_the_clip_of_the_model_opset(opset):
    """AECMOS (PyTorch 1.11, opset 9): the measuring copy's and the written model's saturating ``Clip`` took
    their bounds as inputs, which ``Clip`` reads only from opset 11 (an internal error before the fix)."""
    proto = _saturating(opset)
    model = to_ir(proto)
    result = Fp16Pass(calibration_data=_feeds()).call(model)
    assert result.stats["converted"] == 2 and result.stats["kept_fp32.overflow"] == 1 and result.stats["casts"] == 2
    clip = next(n for n in model.graph if n.op_type == "Clip")
    if opset < 11:
        assert op_counts(model) == {"Mul": 1, "Clip": 1, "Cast": 2, "Sigmoid": 1, "MatMul": 1}
        assert len(clip.inputs) == 1 and clip.attributes["max"].as_float() == 65504.0
    else:  # the bounds are two Constant nodes
        assert op_counts(model) == {"Mul": 1, "Constant": 2, "Clip": 1, "Cast": 2, "Sigmoid": 1, "MatMul": 1}
        assert len(clip.inputs) == 3 and not clip.attributes
    assert model.opset_imports[""] == opset
    _loads_and_matches(proto, model, _feeds(2), 0.9999)
    assert not Fp16Pass(calibration_data=_feeds()).call(model).modified


def _gemm_after(gate: float) -> onnx.ModelProto:
    """y = Gemm(Relu(Gemm(x * gate, w, b)), wh): with ``gate`` 0 the first Gemm's input is calibrated all zeros."""
    rng = np.random.default_rng(3)
    w, b = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    wh = rng.standard_normal((4, 8)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "gate"], ["g"], name="gate"),
             helper.make_node("Gemm", ["g", "w", "b"], ["h"], name="bridge", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "wh"], ["y"], name="head", transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["n", 16])],
                              [helper.make_tensor_value_info("y", F32, ["n", 4])],
                              [numpy_helper.from_array(np.array(gate, np.float32), "gate"),
                               numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
                               numpy_helper.from_array(wh, "wh")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_int8_keeps_a_bias_float_when_its_input_was_calibrated_constant():
    """Arabic name romanizer's encoder (issue 27): a masked mean whose calibration input was all zeros gave the
    bridge Gemm an input scale of 1e-12; its INT32 bias at scale 1e-12 * w_scale was clipped to about 0, so the
    hidden state lost the bias (cosine 0 against the original, exit 0).  Such a bias stays float now."""
    proto = _gemm_after(0.0)
    model = to_ir(proto)
    result = QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds()).call(model)
    assert result.stats["quantized"] == 1 and result.stats["q_nodes"] == 2 and result.stats["dq_nodes"] == 3
    bridge = next(n for n in model.graph if n.name == "bridge")
    assert bridge.inputs[2] is not None and bridge.inputs[2].name == "b" and bridge.inputs[2].is_initializer()
    _loads_and_matches(proto, model, _feeds(2), 0.999)
    assert not QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds()).call(model).modified


def test_int8_bias_of_a_live_input_is_int32():
    """The near miss: an input with a real range keeps the INT32 bias ONNX Runtime's QGemm fusion wants."""
    proto = _gemm_after(1.0)
    model = to_ir(proto)
    result = QdqInt8Pass(accuracy_budget="off", calibration_data=_feeds()).call(model)
    assert result.stats["quantized"] == 1 and result.stats["q_nodes"] == 2 and result.stats["dq_nodes"] == 4
    bridge = next(n for n in model.graph if n.name == "bridge")
    dq = bridge.inputs[2].producer()  # type: ignore[union-attr]
    assert dq is not None and dq.op_type == "DequantizeLinear"
    assert dq.inputs[0].const_value.dtype == ir.DataType.INT32  # type: ignore[union-attr]
    _loads_and_matches(proto, model, _feeds(2), 0.99)


def test_int8_budget_judges_each_output_on_its_own():
    """Two outputs, a large exact one and a small one that quantization wrecks (an activation channel 300x the
    others: uint8 steps of ~7 erase the rest, smoothing off).  The budget used to be one cosine over both
    joined, so the large exact output hid the small one's cosine of 0.14 and the MatMul was quantized
    (issue 27: the romanizer encoder's bridge state, cosine 0, next to its exact memory output)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w[0] = 0.0  # the outlier channel does not reach the output: its range only costs the others their steps
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["small"], name="mm"), helper.make_node("Mul", ["x", "k"], ["big"], name="scale")],
        "g", [helper.make_tensor_value_info("x", F32, ["n", 16])],
        [helper.make_tensor_value_info("big", F32, ["n", 16]), helper.make_tensor_value_info("small", F32, ["n", 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(100.0, np.float32), "k")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])

    def outlier_feeds(n: int, seed: int) -> list[dict]:
        r = np.random.default_rng(seed)
        feeds = [{"x": r.standard_normal((8, 16)).astype(np.float32)} for _ in range(n)]
        for f in feeds:
            f["x"][:, 0] *= 300
        return feeds

    model = to_ir(proto)
    result = QdqInt8Pass(smoothing="off", calibration_data=outlier_feeds(4, 1)).call(model)
    assert not result.modified and result.stats["quantized"] == 0 and result.stats["kept_float"] == 1
    assert op_counts(model) == {"MatMul": 1, "Mul": 1}
    # what the old joined metric let through: quantized alone, the small output is far off
    forced = to_ir(proto)
    QdqInt8Pass(smoothing="off", accuracy_budget="cosine>=0", calibration_data=outlier_feeds(4, 1)).call(forced)
    f = outlier_feeds(1, 9)[0]
    big, small = run(proto, f)
    big_q, small_q = run(forced, f)
    assert cosine(big, big_q) > 0.9999 and cosine(small, small_q) < 0.9


def test_int8_budget_measures_a_gemm_whose_bias_is_computed():
    """An unrolled LSTM exported by PyTorch (captcha CRNN, issue 27) reads each shared bias through an
    ``Identity``: not a constant, so the writer leaves it float, but the per-layer measurement took every
    non-activation input for a constant and failed an assertion (exit 1).  It reads the computed bias now."""
    rng = np.random.default_rng(4)
    w, b = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    wh = rng.standard_normal((4, 8)).astype(np.float32)
    nodes = [helper.make_node("Identity", ["b"], ["b_shared"], name="share"),
             helper.make_node("Gemm", ["x", "w", "b_shared"], ["h"], name="cell", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "wh"], ["y"], name="head", transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["n", 16])],
                              [helper.make_tensor_value_info("y", F32, ["n", 4])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
                               numpy_helper.from_array(wh, "wh")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model = to_ir(proto)
    result = QdqInt8Pass(calibration_data=_feeds()).call(model)
    assert result.stats["quantized"] == 2 and result.stats["sensitivity_evaluations"] == 1
    cell = next(n for n in model.graph if n.name == "cell")
    assert cell.inputs[2] is not None and cell.inputs[2].name == "b_shared"  # left float, as it was
    assert cell.inputs[1] is not None and cell.inputs[1].producer().op_type == "DequantizeLinear"  # type: ignore[union-attr]
    _loads_and_matches(proto, model, _feeds(2), 0.99)


def test_fp16_keeps_float32_a_node_onnx_runtime_cannot_run_in_float16():
    """A GNN's message passing (caustic NMR, issue 27): ``ScatterElements`` with ``reduction='add'`` allows
    float16 by its schema, but ONNX Runtime's CPU kernel refuses it; its float16 twin failed the measuring
    run, reported as 'the model rejects calibration sample 0' (exit 2).  The node stays float32 now."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    idx = np.array([[0, 1, 2, 3], [2, 2, 0, 1], [1, 0, 3, 3]], np.int64)
    nodes = [helper.make_node("Relu", ["x"], ["base"], name="base"),
             helper.make_node("Sigmoid", ["u"], ["msg"], name="message"),
             helper.make_node("ScatterElements", ["base", "idx", "msg"], ["agg"], name="aggregate", axis=0,
                              reduction="add"),
             helper.make_node("MatMul", ["agg", "w"], ["y"], name="readout")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [5, 4]),
                                           helper.make_tensor_value_info("u", F32, [3, 4])],
                              [helper.make_tensor_value_info("y", F32, [5, 3])],
                              [numpy_helper.from_array(idx, "idx"), numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    feeds = [{"x": rng.standard_normal((5, 4)).astype(np.float32), "u": rng.standard_normal((3, 4)).astype(np.float32)}
             for _ in range(4)]
    model = to_ir(proto)
    result = Fp16Pass(calibration_data=feeds).call(model)
    assert result.stats["kept_fp32"] == 1 and result.stats["kept_fp32.no_float16_form"] == 1
    assert result.stats["converted"] == 3
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["aggregate"]["precision"] == "fp32"
    assert by["aggregate"]["reason"].startswith("no float16 form in ONNX Runtime (its float16 twin failed: ")
    assert by["readout"]["precision"] == "fp16"
    assert check_model_output(model)["onnxruntime"].startswith("passed")
    for f in feeds[:2]:
        ref, out = run(proto, f)[0], run(model, f)[0]
        assert cosine(ref, out) > 0.9999


def test_fp16_budget_sees_a_scale_error():
    """y = (100 x) / (1e4 * sum|x|): the divisor overflows float16, stays float32 and reaches the float16
    Div saturated to 65504, so y comes out about twice too large, everywhere alike: cosine 1.  The budget
    was a plain cosine and let it through (a GNN's outputs 24x too small on issue 27's held-out run); the
    norm's relative error now counts like an angle error, and the Div stays float32."""
    nodes = [helper.make_node("Abs", ["x"], ["a"], name="abs"),
             helper.make_node("ReduceSum", ["a", "axes"], ["s"], name="total", keepdims=1),
             helper.make_node("Mul", ["s", "k"], ["c"], name="divisor"),
             helper.make_node("Mul", ["x", "gain"], ["xs"], name="gain"),
             helper.make_node("Div", ["xs", "c"], ["y"], name="normalize")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [1, 16])],
                              [helper.make_tensor_value_info("y", F32, [1, 16])],
                              [numpy_helper.from_array(np.array([1], np.int64), "axes"),
                               numpy_helper.from_array(np.array(1e4, np.float32), "k"),
                               numpy_helper.from_array(np.array(100, np.float32), "gain")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(4)]
    model = to_ir(proto)
    result = Fp16Pass(calibration_data=feeds).call(model)
    assert result.stats["kept_fp32.overflow"] == 1 and result.stats["kept_fp32.budget"] == 1
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["divisor"]["precision"] == "fp32" and by["normalize"]["precision"] == "fp32"
    for f in feeds:
        ref, out = run(proto, f)[0], run(model, f)[0]
        assert np.abs(out - ref).max() <= 1e-3 * np.abs(ref).max()


def _computed_weights() -> onnx.ModelProto:
    """h = x @ Transpose(w) (PyTorch's Linear as its dynamo exporter writes it, unfolded), y = h @ h^T over
    rows (attention-like, two activations)."""
    w = np.random.default_rng(6).standard_normal((8, 16)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], name="w_t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["h"], name="linear"),
             helper.make_node("Transpose", ["h"], ["ht"], name="h_t", perm=[1, 0]),
             helper.make_node("MatMul", ["h", "ht"], ["y"], name="scores")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["n", 16])],
                              [helper.make_tensor_value_info("y", F32, ["n", "n"])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_a_weight_computed_from_constants_is_named_with_the_way_out(caplog):
    """A PyTorch MiniLM (issue 27) reads every Linear weight through an in-graph dequantization: int4 changed
    nothing and fp8 listed the 36 projections as 'activation x activation matmul (attention)'.  They are
    named as weights computed from constants now, with 'run cleanup first'; the real attention keeps its reason."""
    proto = _computed_weights()
    model = to_ir(proto)
    result = QdqFp8Pass(calibration_data=_feeds()).call(model)
    by = {e["node"]: e["reason"] for e in result.details["plan"]["nodes"]}
    assert by["linear"].startswith("default rule: its weight is computed at run time from constants")
    assert by["scores"] == "default rule: activation x activation matmul (attention); sensitive, little gain"
    assert result.details["notes"] == ["1 MatMul(s) read a weight computed at run time from constants (a Transpose "
                                       "or an in-graph dequantization of a stored weight), not quantized as "
                                       "weights: run 'cleanup' (fold-constants) before this pass"]
    model = to_ir(proto)
    with caplog.at_level("WARNING"):
        result = WeightOnlyPass(algorithm="rtn").call(model)
    assert not result.modified and result.details["notes"][0].startswith("1 MatMul(s) read a weight computed")
    assert "run 'cleanup' (fold-constants) before this pass" in caplog.text
