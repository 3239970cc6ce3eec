"""Precision passes on what real models contain (issues 27 item 5, 31, 26 item 2).

- weights from ``Constant`` nodes are read like initializers by the default sensitivity analysis, and a
  ``Constant`` weight that is a graph's first node does not break the Q/DQ writer when it is dropped;
- a calibration feed the model rejects is the same one-line exit-2 error in every precision pass;
- fp16's budget judges every output on its own, as ``--verify`` does (a small output in float16's
  subnormal range is not hidden by a large one), and leaves out padded positions (a decoder calibrated on
  left-padded text stays fully float16);
- the INT8 embedding table's ``DequantizeLinear`` is linked to its ``Gather`` in the IR, so a later pass
  that sorts the graph (``simplify-shapes``) keeps it loadable;
- the probe models of the sensitivity analysis have an IR version the installed ONNX Runtime reads.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant import Fp16Pass, QdqFp8Pass, QdqInt8Pass
from mograph.passes.quant._fp16_measure import keep_fp16_rounding
from mograph.passes.quant._qdq import quantize_embeddings
from onnx import helper, numpy_helper

from mograph.errors import OptionError
from mograph.ir_version import fit_ir_version, make_model, needed_ir_version, runtime_max_ir_version
from mograph.output_check import check_model_output
from mograph.testing import op_counts, to_ir
from mograph.validate import compare_outputs, tolerance_for
from tests.passes.quant._helpers import cosine, run

F32 = onnx.TensorProto.FLOAT


# --- Constant weights -----------------------------------------------------------------------------------------


def _constant_weights_model() -> onnx.ModelProto:
    """x -> MatMul(Constant w1) -> Relu -> MatMul(Constant w2) -> Relu -> MatMul(initializer head) -> y.

    The first weight's ``Constant`` is the graph's first node: quantizing that MatMul removes it.
    """
    rng = np.random.default_rng(11)
    w1, w2, wh = (rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((16, 32), (32, 32), (32, 8)))
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["w1"], name="w1_const", value=numpy_helper.from_array(w1)),
         helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
         helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
         helper.make_node("Constant", [], ["w2"], name="w2_const", value=numpy_helper.from_array(w2)),
         helper.make_node("MatMul", ["r1", "w2"], ["h2"], name="mm2"),
         helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
         helper.make_node("MatMul", ["r2", "wh"], ["y"], name="head")],
        "g", [helper.make_tensor_value_info("x", F32, ["n", 16])], [helper.make_tensor_value_info("y", F32, ["n", 8])],
        [numpy_helper.from_array(wh, "wh")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _feeds(n: int = 4) -> list[dict]:
    rng = np.random.default_rng(12)
    return [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("cls", [QdqInt8Pass, QdqFp8Pass])
def test_constant_weight_first_in_the_graph_is_quantized_with_the_rules(cls):
    """Old code: ValueError from ``_insert_at_start`` (the dropped first ``Constant`` was its anchor)."""
    proto = _constant_weights_model()
    model = to_ir(proto)
    result = cls(accuracy_budget="off", calibration_data=_feeds()).call(model)
    assert result.modified
    assert result.stats["quantized"] == 2 and result.stats["kept_float"] == 1  # the head: final projection
    assert result.stats["q_nodes"] == 2 and result.stats["dq_nodes"] == 4
    counts = op_counts(model)
    assert "Constant" not in counts  # both float weights replaced
    assert counts["QuantizeLinear"] == 2 and counts["DequantizeLinear"] == 4 and counts["MatMul"] == 3
    check_model_output(model)
    for f in _feeds(2):
        assert cosine(run(proto, f)[0], run(model, f)[0]) >= 0.99
    assert not cls(accuracy_budget="off", calibration_data=_feeds()).call(model).modified


def test_default_sensitivity_reads_constant_weights():
    """Old code: ``AttributeError: 'NoneType' object has no attribute 'numpy'`` in ``_layer_errors``."""
    proto = _constant_weights_model()
    model = to_ir(proto)
    # default budget: measured per layer; smoothing off, or it would turn the weights into initializers first
    result = QdqInt8Pass(calibration_data=_feeds(), smoothing="off").call(model)
    plan = result.details["plan"]
    assert plan["accuracy_budget"]["met"] is True
    by = {e["node"]: e for e in plan["nodes"]}
    for name in ("mm1", "mm2", "head"):
        assert "measured sensitivity: layer output relative error" in by[name]["reason"]
    assert result.stats["quantized"] + result.stats["kept_float"] == 3
    assert result.stats["quantized"] >= 1
    check_model_output(model)
    for f in _feeds(2):
        assert cosine(run(proto, f)[0], run(model, f)[0]) >= 0.992


@pytest.mark.parametrize("algorithm", ["rtn", "gptq"])
def test_weight_only_reads_constant_weights_like_initializers(algorithm):
    """Old code: a ``Constant`` weight's value has no type of its own, so weight-only skipped every such MatMul
    as 'input not float32/float16' and returned unchanged with no plan (exit 0, nothing said)."""
    from mograph.passes.quant import WeightOnlyPass

    from_constants = _constant_weights_model()
    from_initializers = onnx.ModelProto()
    from_initializers.CopyFrom(from_constants)
    graph = from_initializers.graph
    for node in [n for n in graph.node if n.op_type == "Constant"]:
        tensor = onnx.TensorProto()
        tensor.CopyFrom(node.attribute[0].t)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        graph.node.remove(node)
    plans = []
    for proto in (from_constants, from_initializers):
        model = to_ir(proto)
        result = WeightOnlyPass(algorithm=algorithm, block_size=16, calibration_data=_feeds()).call(model)
        assert result.modified and result.stats["quantized"] == 2 and result.stats["kept_float"] == 1, result.stats
        plans.append({e["node"]: (e["precision"], e["reason"]) for e in result.details["plan"]["nodes"]})
        assert "Constant" not in op_counts(model)
        check_model_output(model)
        for f in _feeds(2):
            assert cosine(run(proto, f)[0], run(model, f)[0]) >= 0.99
    assert plans[0] == plans[1]


# --- a calibration feed the model rejects ----------------------------------------------------------------------


def _concat_model() -> onnx.ModelProto:
    """y = Concat([x @ w @ w2, c], axis 0): with the dynamic ``d`` set to 1 by random feeds, the MatMul refuses."""
    rng = np.random.default_rng(3)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("MatMul", ["h", "w2"], ["h2"], name="mm2"),
         helper.make_node("Concat", ["h2", "c"], ["y"], name="cat", axis=0)],
        "g", [helper.make_tensor_value_info("x", F32, ["n", "d"])], [helper.make_tensor_value_info("y", F32, None)],
        [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w2"),
         numpy_helper.from_array(np.ones((1, 4), np.float32), "c")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("cls", [Fp16Pass, QdqInt8Pass, QdqFp8Pass])
def test_rejected_random_feed_is_one_clear_line_in_every_pass(cls):
    """Old code: fp16 let ONNX Runtime's exception through (exit 1, "a bug"); int8 and fp8 said this."""
    model = to_ir(_concat_model())
    with pytest.raises(OptionError) as err:
        cls(calibration_random=2).call(model)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("the model rejects its random calibration feed (x 1x1 float32)")
    assert "input(s) ['x'] (dynamic dims set to 1)" in message and "--shape NAME:DIMS" in message


def test_rejected_calibration_sample_names_the_sample_in_fp16():
    model = to_ir(_concat_model())
    bad = [{"x": np.ones((2, 8), np.float32)}, {"x": np.ones((2, 5), np.float32)}]
    with pytest.raises(OptionError, match=r"^the model rejects calibration sample 1 from .*x 2x5 float32"):
        Fp16Pass(calibration_data=bad).call(model)


def _wide_concat_model() -> onnx.ModelProto:
    """:func:`_concat_model` with 64-wide weights, wide enough for weight-only's blocks."""
    rng = np.random.default_rng(3)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("MatMul", ["h", "w2"], ["h2"], name="mm2"),
         helper.make_node("Concat", ["h2", "c"], ["y"], name="cat", axis=0)],
        "g", [helper.make_tensor_value_info("x", F32, ["n", "d"])], [helper.make_tensor_value_info("y", F32, None)],
        [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal((64, 4)).astype(np.float32), "w2"),
         numpy_helper.from_array(np.ones((1, 4), np.float32), "c")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("options", [{"algorithm": "gptq"}, {"algorithm": "gptq", "sequential": False},
                                     {"algorithm": "awq"}, {"algorithm": "rtn", "accuracy_budget": "cosine>=0.99"}])
def test_rejected_random_feed_is_the_same_line_in_weight_only(options):
    """Old code: sequential GPTQ took the graph input as the first layer's input without running anything, and
    its 1-wide Hessian failed in the quantizer (IndexError: exit 1, 'a bug')."""
    from mograph.passes.quant import WeightOnlyPass

    model = to_ir(_wide_concat_model())
    with pytest.raises(OptionError) as err:
        WeightOnlyPass(calibration_random=2, block_size=32, **options).call(model)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("the model rejects its random calibration feed (x 1x1 float32)")
    assert "input(s) ['x'] (dynamic dims set to 1)" in message and "--shape NAME:DIMS" in message


# --- fp16's budget judged like --verify --------------------------------------------------------------------------


def _two_outputs_model() -> onnx.ModelProto:
    """big = x * 100, small = x * 5e-7: ``small`` lives in float16's subnormal range (below 6.1e-5)."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "kb"], ["big"], name="mul_big"),
         helper.make_node("Mul", ["x", "ks"], ["small"], name="mul_small")],
        "g", [helper.make_tensor_value_info("x", F32, ["n", 64])],
        [helper.make_tensor_value_info("big", F32, ["n", 64]), helper.make_tensor_value_info("small", F32, ["n", 64])],
        [numpy_helper.from_array(np.array(100.0, np.float32), "kb"),
         numpy_helper.from_array(np.array(5e-7, np.float32), "ks")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_fp16_budget_sees_a_small_output_beside_a_large_one():
    """Old code: the outputs were concatenated, ``big`` hid ``small`` (cosine ~0.9994 alone) and all went fp16."""
    proto = _two_outputs_model()
    rng = np.random.default_rng(0)
    calib = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(4)]
    model = to_ir(proto)
    result = Fp16Pass(calibration_data=calib).call(model)
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["mul_small"]["precision"] == "fp32" and "cosine>=0.9999 needs it float32" in by["mul_small"]["reason"]
    assert by["mul_big"]["precision"] == "fp16"
    assert result.stats["kept_fp32.budget"] == 1 and result.stats["converted"] == 1
    assert result.details["plan"]["accuracy_budget"]["met"] is True
    # what --verify would say with the budget as its cosine bound: every output passes
    feeds = {"x": rng.standard_normal((4, 64)).astype(np.float32)}
    ref = dict(zip(["big", "small"], run(proto, feeds)))
    got = dict(zip(["big", "small"], run(model, feeds)))
    tol = {k: tolerance_for(np.float32, "quant", min_cosine=0.9999) for k in ref}
    verdict = compare_outputs(ref, got, tol)
    assert all(v["passed"] for v in verdict.values()), verdict
    # all float16 (stored as a GPU stores it: ORT's CPU provider would compute it in float32), the small
    # output is what fails, and the concatenation the old metric took does not show it
    loose = to_ir(proto)
    Fp16Pass(calibration_data=calib, fp16_budget="none").call(loose)
    keep_fp16_rounding(loose)
    got16 = dict(zip(["big", "small"], run(loose, feeds)))
    assert cosine(ref["small"], got16["small"]) < 0.9999
    assert cosine(np.concatenate([ref["big"], ref["small"]]), np.concatenate([got16["big"], got16["small"]])) > 0.9999


# --- fp16 on a decoder calibrated on left-padded text ------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_proto(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models.export_hf import export

    path = tmp_path_factory.mktemp("llama") / "llama.onnx"
    export("llama", path, layers=2, hidden=64)
    return onnx.load(str(path))


def _left_padded(n: int, seq: int = 16, pad: int = 10) -> list[dict]:
    rng = np.random.default_rng(4)
    out = []
    for _ in range(n):
        ids = rng.integers(0, 100, (2, seq)).astype(np.int64)
        mask = np.ones((2, seq), np.int64)
        mask[1, :pad] = 0  # row 1 is left-padded: its first query rows attend to nothing real
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def test_fp16_decoder_calibrated_on_padded_text_converts_every_weight(llama_proto):
    """Old code: padded rows (float32 and float16 garbage differ there) failed the budget, and the search kept
    most nodes float32 (here 135 of 202; on a 4-layer LlamaForCausalLM export 260 of 373, every weight)."""
    model = to_ir(llama_proto)
    weights = sum(1 for v in model.graph.initializers.values() if v.dtype == ir.DataType.FLOAT)
    result = Fp16Pass(calibration_data=_left_padded(4)).call(model)
    # only the rotary angle computation stays float32 (Cos/Sin of the integer positions, session 12's rule)
    assert result.stats["kept_fp32"] == result.stats["kept_fp32.position_angle"] == 6, result.details["kept_fp32"]
    assert {k["op"] for k in result.details["kept_fp32"]} <= {"Constant", "Cast", "Unsqueeze", "MatMul", "Mul", "Transpose",
                                                                 "Concat", "Expand", "Cos", "Sin"}
    assert result.stats["initializers_fp16"] == weights
    assert result.details["plan"]["accuracy_budget"]["met"] is True
    assert not any(v.dtype == ir.DataType.FLOAT for v in model.graph.initializers.values())
    check_model_output(model)
    for f in _left_padded(2):
        keep = f["attention_mask"].astype(bool)
        ref, got = run(llama_proto, f)[0], run(model, f)[0]
        assert cosine(ref[keep], got[keep]) >= 0.999


# --- INT8 embeddings, then a pass that sorts the graph -----------------------------------------------------------


def test_int8_embeddings_then_simplify_shapes_stays_sorted_and_loadable(llama_proto):
    """Old code: the DequantizeLinear read a look-alike of the Gather's output (same name, no producer), and
    ``simplify-shapes`` wrote it before the Gather: "Nodes in a graph must be topologically sorted"."""
    from mograph.passes.cleanup.simplify_shapes import SimplifyShapesPass

    model = to_ir(llama_proto)
    feeds = [{"input_ids": np.random.default_rng(i).integers(0, 100, (1, 8)).astype(np.int64),
              "attention_mask": np.ones((1, 8), np.int64)} for i in range(4)]
    QdqInt8Pass(accuracy_budget="off", calibration_data=feeds, embeddings="float").call(model)
    # the tiny export's table (100 x 64) is below the pass's size threshold: convert it directly
    assert len(quantize_embeddings(model, min_elements=1)) == 1
    gather = next(n for n in model.graph if n.op_type == "Gather" and n.inputs[0].const_value is not None
                  and n.inputs[0].const_value.dtype == ir.DataType.INT8)
    dq = gather.outputs[0].uses()[0].node
    assert dq.op_type == "DequantizeLinear" and dq.inputs[0] is gather.outputs[0]  # linked, not by name
    SimplifyShapesPass().call(model)
    order = {id(n): i for i, n in enumerate(model.graph)}
    for node in model.graph:
        for v in node.inputs:
            if v is not None and v.producer() is not None and v.producer().graph is model.graph:
                assert order[id(v.producer())] < order[id(node)], node.name
    check_model_output(model)
    onnx.checker.check_model(ir.serde.serialize_model(model))
    f = feeds[0]
    assert cosine(run(llama_proto, f)[0], run(model, f)[0]) >= 0.99


# --- IR versions ------------------------------------------------------------------------------------------------


def test_ir_version_rule():
    cap = runtime_max_ir_version()
    assert cap is not None and cap >= 10  # measured from the installed onnxruntime
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F32, [1])], [helper.make_tensor_value_info("y", F32, [1])])
    made = make_model(graph, {"": 17})
    assert made.ir_version == needed_ir_version({"": 17}) == 8  # not onnx's newest
    newest = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=onnx.IR_VERSION + 1)
    assert fit_ir_version(newest) == cap  # never newer than the runtime reads
    old = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=3)
    assert fit_ir_version(old) == needed_ir_version({"": 21}) == 10  # never older than the opsets need


def test_sensitivity_probe_models_load_in_the_runtime(monkeypatch):
    """The probe models are built by :func:`mograph.ir_version.make_model`: at most the runtime's IR version,
    so a runtime one IR version behind onnx (onnxruntime-gpu 1.31.1: 13 against onnx's 14) still loads them."""
    import mograph.passes.quant.sensitivity as sens

    seen: list[int] = []
    real = sens.make_model_proto

    def spy(graph, opsets, **kw):  # type: ignore[no-untyped-def]
        proto = real(graph, opsets, **kw)
        seen.append(proto.ir_version)
        return proto

    monkeypatch.setattr(sens, "make_model_proto", spy)
    QdqInt8Pass(calibration_data=_feeds()).call(to_ir(_constant_weights_model()))
    assert seen and max(seen) <= runtime_max_ir_version() and max(seen) <= onnx.IR_VERSION - 1


# --- the CLI: exit codes and what is written ---------------------------------------------------------------------


@pytest.mark.parametrize("passes", ["fp16", "int8", "qdq-fp8"])
def test_cli_rejected_random_feed_is_exit_2(tmp_path, capsys, passes):
    from mograph.cli import main

    src = tmp_path / "m.onnx"
    onnx.save(_concat_model(), str(src))
    out = tmp_path / "o.onnx"
    code = main(["optimize", str(src), "-o", str(out), "--passes", passes, "--calibration-random", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the model rejects its random calibration feed" in err and "a bug" not in err
    assert not out.exists()


def test_cli_writes_an_ir_version_the_runtime_reads(tmp_path, capsys):
    """A model stamped with onnx's newest IR version (``onnx.helper.make_model``'s default) comes out at what
    the installed ONNX Runtime reads, and ONNX Runtime loads it; the calibration progress is on stderr."""
    import onnxruntime as ort

    from mograph.cli import main

    proto = _constant_weights_model()
    proto.ir_version = onnx.IR_VERSION
    src = tmp_path / "m.onnx"
    onnx.save(proto, str(src))
    out = tmp_path / "o.onnx"
    code = main(["optimize", str(src), "-o", str(out), "--passes", "int8", "--calibration-random", "4"])
    err = capsys.readouterr().err
    assert code == 0, err
    # progress shown (mograph.progress: plain lines, stderr not being a terminal here)
    assert re.search(r"\[1/\d+\] qdq-int8 \.\.\.\n  qdq-int8 \[#{6}\.{18}\] 1/4 \(\d+s\)\n", err), err
    assert re.search(r"  qdq-int8 \[#{24}\] 4/4 \(\d+s\)\n", err), err
    written = onnx.load(str(out))
    assert needed_ir_version({"": 19}) <= written.ir_version <= runtime_max_ir_version()
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])


# --- float64 models (skl2onnx with double inputs) ----------------------------------------------------------------


def _double_computed_weight_model() -> onnx.ModelProto:
    """skl2onnx's float64 Gaussian process kernel, small: ``(x / c) @ Transpose(ConstantOfShape(shape))`` and an
    initializer MatMul, in float64, with no ``value_info`` (the first MatMul's two operands have no type in the IR)."""
    rng = np.random.default_rng(5)
    zero = numpy_helper.from_array(np.zeros(1, np.float64))
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["zeros"], name="cos", value=zero),
         helper.make_node("Transpose", ["zeros"], ["zt"], name="tr", perm=[1, 0]),
         helper.make_node("Div", ["x", "c"], ["xs"], name="scale"),
         helper.make_node("MatMul", ["xs", "zt"], ["k"], name="kernel"),
         helper.make_node("Add", ["k", "c"], ["kc"], name="add"),
         helper.make_node("MatMul", ["kc", "w"], ["y"], name="mean")],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, ["n", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, ["n", 2])],
        [numpy_helper.from_array(np.array([3, 4], np.int64), "shape"),
         numpy_helper.from_array(np.array([0.5], np.float64), "c"),
         numpy_helper.from_array(rng.standard_normal((3, 2)), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("cls", [QdqInt8Pass, QdqFp8Pass])
def test_float64_matmul_with_untyped_operands_is_no_candidate(cls):
    """Old code: the float64 MatMul of two untyped values was a candidate, its operands observed as float32
    graph outputs, and ONNX Runtime refused the calibration model (internal error on skl2onnx's float64 GPR)."""
    proto = _double_computed_weight_model()
    model = to_ir(proto)
    feeds = [{"x": np.random.default_rng(i).standard_normal((2, 4))} for i in range(2)]
    result = cls(calibration_data=feeds).call(model)
    assert not result.modified and result.stats["quantized"] == 0
    check_model_output(model)
    np.testing.assert_array_equal(run(proto, feeds[0])[0], run(model, feeds[0])[0])


def test_cli_int8_on_a_float64_model_is_exit_0_and_unchanged(tmp_path, capsys):
    from mograph.cli import main

    src = tmp_path / "m.onnx"
    onnx.save(_double_computed_weight_model(), str(src))
    out = tmp_path / "o.onnx"
    code = main(["optimize", str(src), "-o", str(out), "--passes", "int8", "--calibration-random", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "a bug" not in err
