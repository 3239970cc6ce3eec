"""fix-shapes on the hand-built BERT and CNN (dynamic axes) and on small graphs for every refusal."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from _shape_testing import const, dims, f32, graph_input, i64, make, ops
from mograph.passes.shape import FixShapesPass
from onnx import helper

from models import bert_feeds, bert_tiny, cnn_small
from mograph.errors import OptionError
from mograph.pass_infra import graph_fingerprint
from mograph.testing import run_ort, to_ir

SHAPE_OPS = {"Shape", "Concat", "Slice", "Range"}


def test_bert_fixed_folds_shape_arithmetic():
    proto = bert_tiny(dynamic=True)
    model = to_ir(proto)
    before = ops(model)
    result = FixShapesPass(shape=["input_ids:2x16"]).call(model)
    assert result.modified
    assert result.stats == {"inputs_fixed": 2, "dims_fixed": 4, "nodes_removed": 65}
    after = ops(model)
    assert before["Shape"] > 0 and not SHAPE_OPS & set(after)
    # Left: the model's arithmetic, 8 constant reshape targets, and the mask's Unsqueeze (data, not shape).
    assert after == {"Add": 31, "Constant": 21, "MatMul": 16, "ReduceMean": 10, "Mul": 10, "Div": 9, "Reshape": 8,
                     "Transpose": 8, "Sub": 6, "Pow": 5, "Sqrt": 5, "Softmax": 2, "Erf": 2, "Gather": 1,
                     "Unsqueeze": 1, "Cast": 1}
    assert dims(graph_input(model, "attention_mask")) == [2, 16]  # same symbols, pinned too
    assert dims(model.graph.outputs[0]) == [2, 16, 64]
    feeds = bert_feeds(batch=2, seq=16)
    np.testing.assert_allclose(run_ort(model, feeds)[0], run_ort(proto, feeds)[0], rtol=1e-5, atol=1e-5)
    fp = graph_fingerprint(model)
    again = FixShapesPass(shape=["input_ids:2x16"]).call(model)
    assert not again.modified and graph_fingerprint(model) == fp


def test_dim_pins_one_symbol_only():
    proto = bert_tiny(dynamic=True)
    model = to_ir(proto)
    result = FixShapesPass(dim=["batch=1"]).call(model)
    assert result.stats["inputs_fixed"] == 2 and result.stats["dims_fixed"] == 2
    assert dims(graph_input(model, "input_ids")) == [1, "seq"]
    for seq in (5, 16):
        feeds = bert_feeds(batch=1, seq=seq)
        np.testing.assert_allclose(run_ort(model, feeds)[0], run_ort(proto, feeds)[0], rtol=1e-5, atol=1e-5)


def test_cnn_batch_fixed():
    proto = cnn_small(dynamic_batch=True)
    model = to_ir(proto)
    result = FixShapesPass(dim=["batch=3"]).call(model)
    assert result.modified and result.stats["dims_fixed"] == 1
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(run_ort(model, {"image": x})[0], run_ort(proto, {"image": x})[0], rtol=1e-5, atol=1e-5)


def test_already_static_is_a_near_miss():
    proto = bert_tiny(dynamic=False, batch=1, seq=16)
    model = to_ir(proto)
    fp = graph_fingerprint(model)
    result = FixShapesPass(shape=["input_ids:1x16"]).call(model)
    assert not result.modified and result.stats == {"inputs_fixed": 0, "dims_fixed": 0}
    assert graph_fingerprint(model) == fp


def test_wrong_declared_output_shape_is_replaced():
    proto = make([helper.make_node("Reshape", ["x", "t"], ["y"])],
                 [f32("x", ["n", 6])], [f32("y", [7, 7, 7])], [i64("t", [-1, 3, 2])])
    model = to_ir(proto)
    FixShapesPass(shape=["x:2x6"]).call(model)
    assert dims(model.graph.outputs[0]) == [2, 3, 2]


def test_input_name_with_colons():
    proto = make([helper.make_node("Relu", ["onnx::Flatten_0"], ["y"])],
                 [f32("onnx::Flatten_0", ["n", 4])], [f32("y", ["n", 4])])
    model = to_ir(proto)
    assert FixShapesPass(shape=["onnx::Flatten_0:3x4"]).call(model).modified
    assert dims(graph_input(model, "onnx::Flatten_0")) == [3, 4]
    assert dims(model.graph.outputs[0]) == [3, 4]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"shape": ["nope:1x16"]}, "no input 'nope'"),
        ({"shape": ["input_ids:1x16x2"]}, "input 'input_ids' has rank 3"),
        ({"shape": ["input_ids:0x16"]}, "input 'input_ids' dimension 0: size must be positive"),
        ({"shape": ["input_ids:1x-3"]}, "input 'input_ids' dimension 1"),
        ({"dim": ["heads=2"]}, "no input has a dimension named 'heads'"),
        ({"dim": ["batch=0"]}, "batch: size must be positive"),
        ({"dim": ["batch=2"], "shape": ["input_ids:1x16"]}, "dimension 0 \\('batch'\\) set to 1"),
        ({"shape": ["input_ids:1x16", "attention_mask:1x8"]}, "attention_mask' dimension 1 \\('seq'\\)"),
    ],
)
def test_refusals_name_input_and_dimension(options, words):
    with pytest.raises(OptionError, match=words):
        FixShapesPass(**options).call(to_ir(bert_tiny(dynamic=True)))


def test_refuses_conflict_with_static_dim():
    proto = bert_tiny(dynamic=False, batch=1, seq=16)
    with pytest.raises(OptionError, match="input 'input_ids' dimension 1: the model fixes it to 16, not 8"):
        FixShapesPass(shape=["input_ids:1x8"]).call(to_ir(proto))


def _lstm_in_if(same_names: bool) -> onnx.ModelProto:
    """o = If(c, LSTM(Reshape(Transpose(x), shape from Shape(x)), initial_h = h[0]) per branch) — a VAD-style model."""
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    hid, feat = 4, 8

    def c64(name, arr):  # noqa: ANN001, ANN202
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(arr, np.int64)))

    def branch(tag: str) -> onnx.GraphProto:
        p = "" if same_names else f"{tag}_"
        w = numpy_helper.from_array(rng.standard_normal((1, 4 * hid, feat)).astype(np.float32), f"{p}W")
        r = numpy_helper.from_array(rng.standard_normal((1, 4 * hid, hid)).astype(np.float32), f"{p}R")
        nodes = [
            helper.make_node("Shape", ["x"], [f"{p}s"]), c64(f"{p}zero", 0), c64(f"{p}one", 1), c64(f"{p}ax0", [0]),
            helper.make_node("Gather", [f"{p}s", f"{p}zero"], [f"{p}b"], axis=0),
            helper.make_node("Gather", [f"{p}s", f"{p}one"], [f"{p}t"], axis=0),
            helper.make_node("Unsqueeze", [f"{p}b", f"{p}ax0"], [f"{p}bu"]),
            helper.make_node("Unsqueeze", [f"{p}t", f"{p}ax0"], [f"{p}tu"]), c64(f"{p}feat", [feat]),
            helper.make_node("Concat", [f"{p}tu", f"{p}bu", f"{p}feat"], [f"{p}shape"], axis=0),
            helper.make_node("Transpose", ["x"], [f"{p}xt"], perm=[1, 0, 2]),
            helper.make_node("Reshape", [f"{p}xt", f"{p}shape"], [f"{p}xr"]),
            helper.make_node("Gather", ["h", f"{p}zero"], [f"{p}h0"], axis=0),
            helper.make_node("Unsqueeze", [f"{p}h0", f"{p}ax0"], [f"{p}h0u"]),
            helper.make_node("LSTM", [f"{p}xr", f"{p}W", f"{p}R", "", "", f"{p}h0u"], [f"{p}Y"], hidden_size=hid,
                             name=f"{tag}_lstm"),
            helper.make_node("Squeeze", [f"{p}Y", "ax1"], [f"{p}o"]),
        ]
        return helper.make_graph(nodes, tag, [], [f32(f"{p}o", ["seq", "batch", hid])], [w, r],
                                 value_info=[f32(f"{p}xr", ["seq", "batch", feat])])

    if_node = helper.make_node("If", ["c"], ["o"], then_branch=branch("then"), else_branch=branch("else"))
    return make([if_node],
                [f32("x", ["batch", "seq", feat]), helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
                 f32("h", [2, "batch", hid])],
                [f32("o", ["seq", "batch", hid])], [i64("ax1", [1])])


@pytest.mark.parametrize("same_names", [False, True])
def test_lstm_inside_if_keeps_its_input_rank(same_names):
    """Issue 19 item 2 (an LSTM inside an If lost its input rank): this VAD-like graph did not reproduce it;
    it guards the path, and the pipeline's output check would name fix-shapes if it broke again."""
    from mograph.output_check import check_model_output

    proto = _lstm_in_if(same_names)
    model = to_ir(proto)
    result = FixShapesPass(shape=["x:1x5x8"]).call(model)
    assert result.stats["inputs_fixed"] == 2 and result.stats["nodes_removed"] == 18  # both branches' shape math
    assert check_model_output(model)["onnxruntime"].startswith("passed")
    for cond in (True, False):
        feeds = {"x": np.random.default_rng(1).standard_normal((1, 5, 8)).astype(np.float32), "c": np.array(cond),
                 "h": np.random.default_rng(2).standard_normal((2, 1, 4)).astype(np.float32)}
        np.testing.assert_allclose(run_ort(model, feeds)[0], run_ort(proto, feeds)[0], rtol=1e-5, atol=1e-5)


def _classifier(label: list) -> onnx.ModelProto:
    """The tail of an onnxmltools LightGBM binary classifier: tree scores -> sigmoid -> probabilities, their
    ArgMax picks the class label through ``ai.onnx.ml.ArrayFeatureExtractor`` (ONNX infers no shape for it), and
    the ``label`` output is declared with the dims ``label`` (onnxmltools wrote ``[1]`` whatever the batch)."""
    tree = helper.make_node(
        "TreeEnsembleRegressor", ["X"], ["raw"], domain="ai.onnx.ml", n_targets=1, nodes_treeids=[0, 0, 0],
        nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0], nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
        nodes_values=[0.5, 0.0, 0.0], nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0],
        target_treeids=[0, 0], target_nodeids=[1, 2], target_ids=[0, 0], target_weights=[-1.0, 1.0])
    nodes = [tree, helper.make_node("Sigmoid", ["raw"], ["p1"]), helper.make_node("Sub", ["one", "p1"], ["p0"]),
             helper.make_node("Concat", ["p0", "p1"], ["probabilities"], axis=1),
             helper.make_node("ArgMax", ["probabilities"], ["idx"], axis=1, keepdims=0),
             helper.make_node("ArrayFeatureExtractor", ["classes", "idx"], ["picked"], domain="ai.onnx.ml"),
             helper.make_node("Squeeze", ["picked", "zero"], ["label"])]
    graph = helper.make_graph(
        nodes, "lgbm", [f32("X", ["N", 3])],
        [helper.make_tensor_value_info("label", onnx.TensorProto.INT64, label), f32("probabilities", ["N", 2])],
        [const("one", np.array(1.0, np.float32)), i64("classes", [0, 1]), i64("zero", [0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def test_declared_output_size_a_run_contradicts_is_cleared():
    """onnxmltools' LightGBM classifier: ``label`` declared ``[1]`` stayed ``[1]`` after fix-shapes at batch 4
    (inference derives nothing there), while ONNX Runtime returns 4 rows.  One run at the pinned shapes proves the
    declared size wrong: it is written unknown, counted and detailed; a right declaration is kept."""
    proto = _classifier([1])
    model = to_ir(proto)
    result = FixShapesPass(shape=["X:4x3"]).call(model)
    assert result.stats == {"inputs_fixed": 1, "dims_fixed": 1, "nodes_removed": 0,
                            "outputs_declared_shape_corrected": 1}
    assert [dims(v) if v.shape is not None else None for v in model.graph.outputs] == [[None], [4, 2]]
    entry = result.details["declared_outputs"]["label"]
    assert (entry["declared"], entry["observed"], entry["written"], entry["corrected"]) == ([1], [4], [None], True)
    x = np.random.default_rng(0).random((4, 3)).astype(np.float32)
    got, ref = run_ort(model, {"X": x}), run_ort(proto, {"X": x})
    assert got[0].shape == (4,) and all(np.array_equal(a, b) for a, b in zip(got, ref))
    # a declaration the run agrees with (the symbol, substituted) is kept; a second run changes nothing more
    right = to_ir(_classifier(["N"]))
    result = FixShapesPass(shape=["X:4x3"]).call(right)
    assert result.stats["outputs_declared_shape_kept"] == 1 and "outputs_declared_shape_corrected" not in result.stats
    assert dims(right.graph.outputs[0]) == [4] and result.details["declared_outputs"]["label"]["observed"] == [4]
    assert not FixShapesPass(shape=["X:4x3"]).call(model).modified


def test_declared_output_shapes_are_not_checked_while_inputs_stay_dynamic():
    """A wrong rank is written as the run's rank with every dim unknown (no shape at all was a graph output the
    ONNX checker refuses: CatBoost's regressor, ``[N]`` declared, ``[N, 1]`` computed, exit 4 'wrote a model
    that does not load'); with a dynamic input left, nothing is run and the details say why."""
    model = to_ir(_classifier([1, 1]))
    FixShapesPass(shape=["X:4x3"]).call(model)
    assert dims(model.graph.outputs[0]) == [None]
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    proto = _classifier([1])
    extra = helper.make_tensor_value_info("unused", onnx.TensorProto.FLOAT, ["M"])
    proto.graph.input.append(extra)
    model = to_ir(proto)
    result = FixShapesPass(shape=["X:4x3"]).call(model)
    assert dims(model.graph.outputs[0]) == [1] and result.stats["outputs_declared_shape_kept"] == 1
    assert result.details["declared_outputs"]["label"]["checked"].startswith("no: input(s) ['unused'] still dynamic")
