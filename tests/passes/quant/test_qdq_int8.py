"""qdq-int8: placement, exact stats, numbers (ORT optimizations off), ORT integer kernels, plan, refusal.

These tests check the placement and the default rules, so they run with ``accuracy_budget="off"`` (the
rules decide); the default, float layers chosen by measured sensitivity, is tested in
``test_int8_sensitivity.py``.
"""

from __future__ import annotations

import logging
import sys
import textwrap

import numpy as np
import onnx
import pytest
import yaml
from mograph.passes.quant import QdqInt8Pass
from onnx import helper, numpy_helper

from models.builders import bert_feeds, bert_tiny, cnn_small
from mograph.errors import OptionError
from mograph.pass_infra import PassManager
from mograph.testing import op_counts, to_ir
from tests.passes.quant._helpers import cosine, optimized_ops, run


def calib_feeds(n: int = 12) -> list[dict]:
    """Token feeds of different lengths (seed apart from the evaluation feeds)."""
    return [bert_feeds(batch=1, seq=8 + (i % 4) * 4, seed=100 + i) for i in range(n)]


def eval_feeds() -> list[dict]:
    return [bert_feeds(batch=2, seq=16, seed=s) for s in range(3)]


RULES = {"accuracy_budget": "off"}


def quantize(proto: onnx.ModelProto, **options):  # type: ignore[no-untyped-def]
    model = to_ir(proto)
    result = QdqInt8Pass(**{**RULES, **options}).call(model)
    return model, result


def test_bert_tiny_ops_stats_numbers_second_run(tmp_path):
    proto = bert_tiny()
    model, result = quantize(proto, calibration_data=calib_feeds())
    assert result.modified
    # 2 layers x (Q, K, V, attention output, FFN in, FFN out) weight MatMuls = 12, the last is the final
    # projection (kept); 2 x 2 attention MatMuls of two activations are kept.
    assert result.stats == {
        "quantized": 11,
        "quantized.MatMul": 11,
        "kept_float": 5,
        "skipped_already_quantized": 0,
        "calibration_samples": 12,
        # shared activations: embeddings LN -> Q/K/V (1), attention context (1), attention LN (1), GELU (1)
        # in layer 0; layer 1 the same minus the final projection's input = 4 + 3
        "q_nodes": 7,
        "dq_nodes": 7 + 11,
        # every quantized activation feeds weight MatMuls only: each is smoothed (alpha measured); the two
        # attention contexts are folded into the value projections' columns; the LayerNorm outputs are read
        # by the residual Adds too and the FFN's second input comes from GELU: 5 Muls
        "smoothed": 7,
        "smoothed.folded": 2,
        "smoothed.mul": 5,
    }
    ops = op_counts(model)
    assert ops["QuantizeLinear"] == 7 and ops["DequantizeLinear"] == 18 and ops["MatMul"] == 16
    assert ops["Mul"] == op_counts(to_ir(proto)).get("Mul", 0) + 5
    # numbers: ORT optimizations off, quantization tolerance
    for feeds in eval_feeds():
        ref = run(proto, feeds)[0]
        out = run(model, feeds)[0]
        assert cosine(ref, out) > 0.995
        assert np.abs(ref - out).max() < 0.25
    # ONNX Runtime CPU turns DQ -> MatMul into integer kernels (optimizations on)
    optimized = optimized_ops(model, tmp_path)
    assert optimized["MatMulIntegerToFloat"] == 11
    # second run: everything quantized is skipped, nothing changes
    again = QdqInt8Pass(calibration_data=calib_feeds(), **RULES).call(model)
    assert not again.modified
    assert again.stats["quantized"] == 0 and again.stats["skipped_already_quantized"] == 11


def test_plan_in_report_and_yaml(tmp_path):
    out = tmp_path / "plan.yaml"
    _, result = quantize(bert_tiny(), calibration_data=calib_feeds(), precision_plan_out=str(out))
    plan = yaml.safe_load(out.read_text())
    assert plan == result.details["plan"]
    by = {e["node"]: e for e in plan["nodes"]}
    assert by["/encoder/layer.1/output/dense/MatMul"]["precision"] == "fp32"
    assert by["/encoder/layer.1/output/dense/MatMul"]["reason"] == "default rule: final projection"
    assert by["/encoder/layer.0/attention/self/query/MatMul"]["precision"] == "int8"
    assert by["/encoder/layer.0/attention/self/query/MatMul"]["reason"].startswith("default rule")
    gathers = [e for e in plan["nodes"] if e["op"] == "Gather"]
    assert gathers and all(e["reason"] == "default rule: embedding lookup" for e in gathers)
    softmax = [e for e in plan["nodes"] if e["op"] == "Softmax"]
    assert len(softmax) == 2 and all(e["precision"] == "fp32" for e in softmax)
    assert plan["calibration"]["random"] is False and plan["calibration"]["samples"] == 12


def test_edited_plan_is_applied(tmp_path):
    first = tmp_path / "plan.yaml"
    quantize(bert_tiny(), calibration_data=calib_feeds(), precision_plan_out=str(first))
    plan = yaml.safe_load(first.read_text())
    for e in plan["nodes"]:
        if e["node"] == "/encoder/layer.0/intermediate/dense/MatMul":
            e["precision"] = "fp32"
        if e["node"] == "/encoder/layer.1/output/dense/MatMul":
            e["precision"] = "int8"
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(plan))
    model, result = quantize(bert_tiny(), calibration_data=calib_feeds(), precision_plan=str(edited))
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["/encoder/layer.0/intermediate/dense/MatMul"]["precision"] == "fp32"
    assert by["/encoder/layer.0/intermediate/dense/MatMul"]["reason"].startswith("user override")
    assert by["/encoder/layer.1/output/dense/MatMul"]["precision"] == "int8"
    assert by["/encoder/layer.1/output/dense/MatMul"]["reason"].startswith("user override")
    assert result.stats["quantized"] == 11
    node = next(n for n in model.graph if n.name == "/encoder/layer.0/intermediate/dense/MatMul")
    assert all(v.producer() is None or v.producer().op_type != "DequantizeLinear" for v in node.inputs)


def test_keep_fp32_is_a_user_override():
    _, result = quantize(bert_tiny(), calibration_data=calib_feeds(), keep_fp32=["/encoder/layer.0/attention/self/key/MatMul"])
    assert result.stats["quantized"] == 10
    by = {e["node"]: e for e in result.details["plan"]["nodes"]}
    assert by["/encoder/layer.0/attention/self/key/MatMul"]["reason"] == "user override (--keep-fp32)"


def test_refuses_without_calibration_data():
    with pytest.raises(OptionError, match="needs calibration data.*--calibration-random"):
        quantize(bert_tiny())


def test_random_calibration_is_explicit_and_reported(caplog):
    with caplog.at_level(logging.WARNING):
        model, result = quantize(bert_tiny(), calibration_random=4, shape=["input_ids:1x16", "attention_mask:1x16"])
    assert result.modified
    assert result.stats["calibrated_on_random_data"] == 1
    assert "RANDOM" in result.details["WARNING"]
    assert list(result.details)[0] == "WARNING"
    assert result.details["plan"]["calibration"]["random"] is True
    assert any("RANDOM" in r.message for r in caplog.records if r.levelno == logging.WARNING)


def test_near_miss_untouched():
    """Only a MatMul of two activations (attention-like): the default rules quantize nothing."""
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"], name="scores")]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model, result = quantize(proto)  # no data needed: nothing to quantize
    assert not result.modified
    assert result.stats["quantized"] == 0 and result.stats["kept_float"] == 1
    assert op_counts(model) == {"MatMul": 1}


def _write_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_calib.py").write_text(textwrap.dedent(
        """
        from models.builders import bert_feeds

        def feeds():
            for i in range(5):
                yield bert_feeds(batch=1, seq=6 + 3 * i, seed=200 + i)
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_calib", None)
    return "my_calib:feeds"


def test_calibration_sources(tmp_path, monkeypatch):
    folder = tmp_path / "feeds"
    folder.mkdir()
    for i, f in enumerate(calib_feeds(6)):
        np.savez(folder / f"{i:03d}.npz", **f)
    _, r1 = quantize(bert_tiny(), calibration_data=str(folder))
    assert r1.stats["calibration_samples"] == 6
    stacked = tmp_path / "stacked.npz"
    feeds = [bert_feeds(batch=1, seq=16, seed=300 + i) for i in range(7)]
    np.savez(stacked, **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    _, r2 = quantize(bert_tiny(), calibration_data=str(stacked))
    assert r2.stats["calibration_samples"] == 7
    _, r3 = quantize(bert_tiny(), calibration_data=_write_module(tmp_path, monkeypatch))
    assert r3.stats["calibration_samples"] == 5
    _, r4 = quantize(bert_tiny(), calibration_data=str(folder), calibration_samples=3)
    assert r4.stats["calibration_samples"] == 3
    with pytest.raises(OptionError, match="not a folder"):
        quantize(bert_tiny(), calibration_data="no/such/thing")
    with pytest.raises(OptionError, match="lacks model input"):
        quantize(bert_tiny(), calibration_data=[{"input_ids": feeds[0]["input_ids"]}])


def test_progress_is_reported(caplog):
    seen = []
    p = QdqInt8Pass(calibration_data=calib_feeds(10), **RULES, smoothing="off")
    p.progress = lambda done, total: seen.append((done, total))
    with caplog.at_level(logging.INFO, logger="mograph.passes.quant.calibration"):
        p.call(to_ir(bert_tiny()))
    assert seen[-1] == (10, 10) and len(seen) == 10
    assert any("calibration: 10/10" in r.message for r in caplog.records)


def test_smoothing_search_reports_progress():
    # issue 31 item 3: the alpha search (about 70 s on a 135M LLM) showed nothing after the calibration bar
    seen = []
    p = QdqInt8Pass(calibration_data=calib_feeds(10), **RULES)  # --smoothing auto, the default
    p.progress = lambda done, total: seen.append((done, total))
    p.call(to_ir(bert_tiny()))
    assert seen[:10] == [(i, 10) for i in range(1, 11)]  # calibration first
    groups = seen[-1][1]
    assert groups is not None and groups >= 4  # bert-tiny: the weight-MatMul inputs of its 2 layers
    assert seen[10:] == [(i, groups) for i in range(groups + 1)]  # then one step per smoothing group


@pytest.mark.parametrize("calibrator", ["percentile", "entropy"])
def test_other_calibrators(calibrator):
    proto = bert_tiny()
    model, result = quantize(proto, calibration_data=calib_feeds(), calibrator=calibrator)
    assert result.stats["quantized"] == 11
    for feeds in eval_feeds():
        assert cosine(run(proto, feeds)[0], run(model, feeds)[0]) > 0.99


def test_symmetric_int8_activations():
    proto = bert_tiny()
    model, result = quantize(proto, calibration_data=calib_feeds(), activation_type="int8")
    zps = [n.inputs[2].const_value.numpy() for n in model.graph if n.op_type == "QuantizeLinear"]
    assert zps and all(z.dtype == np.int8 and int(z) == 0 for z in zps)
    feeds = eval_feeds()[0]
    assert cosine(run(proto, feeds)[0], run(model, feeds)[0]) > 0.995


def test_cnn_conv_and_gemm(tmp_path):
    proto = cnn_small()
    rng = np.random.default_rng(0)
    calib = [{"image": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(8)]
    model, result = quantize(proto, calibration_data=calib)
    # 4 Convs quantized (inputs, weights, outputs); the Gemm head is the final projection
    assert result.stats["quantized"] == 4 and result.stats["quantized.Conv"] == 4
    assert result.stats["kept_float"] == 1
    feeds = {"image": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)}
    assert cosine(run(proto, feeds)[0], run(model, feeds)[0]) > 0.99
    assert optimized_ops(model, tmp_path)["QLinearConv"] == 4
    assert not QdqInt8Pass(calibration_data=calib, **RULES).call(model).modified


def test_gemm_with_bias_quantized_when_not_final(tmp_path):
    rng = np.random.default_rng(1)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 4])], [w1, b1, w2],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    calib = [{"x": rng.standard_normal((16, 16)).astype(np.float32)} for _ in range(6)]
    model, result = quantize(proto, calibration_data=calib)
    assert result.stats == {
        "quantized": 1, "quantized.Gemm": 1, "kept_float": 1, "skipped_already_quantized": 0,
        "calibration_samples": 6, "q_nodes": 2, "dq_nodes": 4,  # input and output pairs, weight, bias
        "smoothed": 1,  # the Gemm input: a Mul in front of its QuantizeLinear (alpha measured)
        "smoothed.folded": 0, "smoothed.mul": 1,  # a graph input: no producer to fold into
    }
    dq_types = sorted(n.inputs[0].const_value.dtype.name for n in model.graph
                      if n.op_type == "DequantizeLinear" and n.inputs[0].const_value is not None)
    assert dq_types == ["INT32", "INT8"]
    feeds = {"x": rng.standard_normal((5, 16)).astype(np.float32)}
    assert cosine(run(proto, feeds)[0], run(model, feeds)[0]) > 0.995
    assert optimized_ops(model, tmp_path)["QGemm"] == 1


def test_accuracy_budget_keeps_fewest_sensitive_layers():
    proto = bert_tiny()
    model, result = quantize(proto, calibration_data=calib_feeds(), accuracy_budget="cosine>=0.9999")
    meta = result.details["plan"]["accuracy_budget"]
    assert meta["met"] is True and meta["measured"] >= 0.9999
    reasons = [e["reason"] for e in result.details["plan"]["nodes"] if e["op"] == "MatMul"]
    assert all(r.startswith("measured sensitivity: layer output relative error") for r in reasons)
    kept = [e for e in result.details["plan"]["nodes"] if e["op"] == "MatMul" and e["precision"] == "fp32"]
    assert len(kept) == meta["kept_float"] == result.stats["kept_float"]
    assert result.stats["quantized"] == 16 - meta["kept_float"]
    loose_model, loose = quantize(proto, calibration_data=calib_feeds(), accuracy_budget="cosine>=0.9")
    assert loose.details["plan"]["accuracy_budget"]["kept_float"] <= meta["kept_float"]
    with pytest.raises(OptionError, match="accuracy-budget"):
        quantize(proto, calibration_data=calib_feeds(), accuracy_budget="cosine<=3")


def test_pass_manager_stamps_provenance():
    model = to_ir(bert_tiny())
    report = PassManager([QdqInt8Pass(calibration_data=calib_feeds(4), **RULES)], check_modified=True).run(model)
    assert report.passes[0].modified
    q = [n for n in model.graph if n.op_type == "QuantizeLinear"]
    assert q and all(n.metadata_props.get("mograph.pass") == "qdq-int8" for n in q)


def embedding_model(vocab: int = 600, hidden: int = 128, tied: bool = False) -> onnx.ModelProto:
    """Gather(table, ids) -> MatMul -> y; with tied=True the table is also the output projection."""
    rng = np.random.default_rng(7)
    table = rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.1
    table[:, 3] *= 30.0  # one large-magnitude dimension, as transformer embeddings have
    w = rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.1
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="/emb/Gather"),
             helper.make_node("MatMul", ["e", "w"], ["h"], name="/proj/MatMul")]
    outputs = [helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [1, 8, hidden])]
    if tied:
        nodes += [helper.make_node("Transpose", ["table"], ["tt"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "tt"], ["logits"], name="/lm_head/MatMul")]
        outputs.append(helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 8, vocab]))
    graph = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 8])],
                              outputs, [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ids(n: int, vocab: int = 600) -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"ids": rng.integers(0, vocab, (1, 8)).astype(np.int64)} for _ in range(n)]


def test_embedding_table_stored_as_int8():
    proto = embedding_model()
    model, result = quantize(proto, calibration_data=_ids(6))
    # the one MatMul is the model's final projection, kept float by the default rules
    assert result.stats["quantized.embeddings"] == 1 and result.stats["quantized"] == 0
    assert result.modified
    assert [n.op_type for n in model.graph] == ["Gather", "DequantizeLinear", "MatMul"]
    table = model.graph.initializers["table_int8"].const_value.numpy()
    assert table.dtype == np.int8 and "table" not in model.graph.initializers
    scale = model.graph.initializers["table_scale"].const_value.numpy()
    assert scale.shape == (128,) and scale[3] > 10 * np.median(scale)  # one scale per column
    entry = next(e for e in result.details["plan"]["nodes"] if e["op"] == "Gather")
    assert entry["precision"] == "int8" and "one scale per column" in entry["reason"]
    # numbers: the gathered rows are within half a step of each column's scale, the output close
    for feeds in _ids(3):
        ref, out = run(proto, feeds)[0], run(model, feeds)[0]
        assert cosine(ref, out) > 0.999
    # 4x smaller table; a second run changes nothing
    assert table.nbytes * 4 == 600 * 128 * 4
    before = model.graph.initializers["table_int8"].const_value.numpy().copy()
    again = QdqInt8Pass(calibration_data=_ids(6), **RULES).call(model)
    assert not again.modified and "quantized.embeddings" not in again.stats
    np.testing.assert_array_equal(model.graph.initializers["table_int8"].const_value.numpy(), before)


def test_embedding_tables_kept_float_when_asked_or_tied():
    _, result = quantize(embedding_model(), calibration_data=_ids(6), embeddings="float")
    assert "quantized.embeddings" not in result.stats
    # a table that is also read by something else than Gather (tied output projection) stays float
    model, result = quantize(embedding_model(tied=True), calibration_data=_ids(6))
    assert "quantized.embeddings" not in result.stats
    assert model.graph.initializers["table"].const_value.numpy().dtype == np.float32
    with pytest.raises(OptionError, match="embeddings"):
        QdqInt8Pass(calibration_data=_ids(2), embeddings="int4")
