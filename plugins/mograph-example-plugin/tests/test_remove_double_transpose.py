"""Tests of ``remove-double-transpose``: op types left, exact stats, numbers (ONNX Runtime with its own
optimizations off), near misses left alone, and a second run that changes nothing."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph_example_plugin import RemoveDoubleTransposePass
from onnx import TensorProto, helper

import mograph
from mograph.pass_infra import PROVENANCE_PASS, PROVENANCE_RULE, PassManager
from mograph.testing import run_ort

SHAPE = [2, 3, 4, 5]


def _model(nodes, outputs=("y",), x_shape=SHAPE, out_shapes=None) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    graph = helper.make_graph(nodes, "g", [x], outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _t(src: str, dst: str, perm=None, name=None) -> onnx.NodeProto:
    attrs = {} if perm is None else {"perm": perm}
    return helper.make_node("Transpose", [src], [dst], name=name or dst, **attrs)


def _run(proto: onnx.ModelProto, **options) -> tuple[ir.Model, mograph.PassResult]:
    """Run the pass through the manager with the 'modified' honesty check on."""
    model = ir.serde.deserialize_model(proto)
    report = PassManager([RemoveDoubleTransposePass(**options)], check_modified=True).run(model)
    entry = report.passes[0]
    return model, mograph.PassResult(entry.modified, entry.stats, entry.details)


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _outputs(model: onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    pytest.importorskip("onnxruntime")
    return run_ort(model, feeds)  # mograph.testing: ONNX Runtime with its optimizations off


def _assert_same_numbers(original: onnx.ModelProto, optimized: ir.Model) -> None:
    feeds = {"x": np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)}
    want, got = _outputs(original, feeds), _outputs(optimized, feeds)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.shape == g.shape
        np.testing.assert_array_equal(g, w)  # a transpose moves elements: exact


def _assert_second_run_changes_nothing(model: ir.Model, **options) -> None:
    again, result = _run(ir.serde.serialize_model(model), **options)
    assert result.modified is False
    assert result.stats == {"cancelled_pairs": 0, "merged_pairs": 0}
    assert _ops(again) == _ops(model)


def test_cancelling_pair_is_removed():
    proto = _model([_t("x", "a", [0, 2, 3, 1]), _t("a", "b", [0, 3, 1, 2]), helper.make_node("Relu", ["b"], ["y"])])
    model, result = _run(proto)
    assert _ops(model) == ["Relu"]
    assert result.modified is True
    assert result.stats == {"cancelled_pairs": 1, "merged_pairs": 0}
    assert model.graph.node(0).inputs[0] is model.graph.inputs[0]
    _assert_same_numbers(proto, model)
    _assert_second_run_changes_nothing(model)


def test_non_cancelling_pair_becomes_one_transpose_with_the_composed_perm():
    p1, p2 = [1, 0, 2, 3], [0, 2, 3, 1]
    proto = _model([_t("x", "a", p1), _t("a", "b", p2), helper.make_node("Relu", ["b"], ["y"])])
    model, result = _run(proto)
    assert _ops(model) == ["Transpose", "Relu"]
    assert result.stats == {"cancelled_pairs": 0, "merged_pairs": 1}
    merged = model.graph.node(0)
    assert list(merged.attributes["perm"].as_ints()) == [p1[k] for k in p2] == [1, 2, 3, 0]
    assert merged.metadata_props[PROVENANCE_PASS] == "remove-double-transpose"
    assert merged.metadata_props[PROVENANCE_RULE] == "TransposePair"
    _assert_same_numbers(proto, model)
    _assert_second_run_changes_nothing(model)


def test_chain_of_three_collapses_and_graph_output_keeps_its_name():
    # Relu -> T -> T -> T -> y (graph output): the three compose to the identity.
    proto = _model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            _t("r", "a", [1, 0, 2, 3]),
            _t("a", "b", [0, 2, 1, 3]),
            _t("b", "y", [2, 0, 1, 3]),
        ]
    )
    model, result = _run(proto)
    assert _ops(model) == ["Relu"]
    assert result.stats == {"cancelled_pairs": 1, "merged_pairs": 1}
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert model.graph.outputs[0].producer() is model.graph.node(0)
    _assert_same_numbers(proto, model)
    _assert_second_run_changes_nothing(model)


def test_default_perm_takes_its_rank_from_the_other_transpose():
    proto = _model([_t("x", "a", [1, 2, 3, 0]), _t("a", "b"), helper.make_node("Relu", ["b"], ["y"])], x_shape=None)
    model, result = _run(proto)
    assert _ops(model) == ["Transpose", "Relu"]
    assert result.stats == {"cancelled_pairs": 0, "merged_pairs": 1}
    assert list(model.graph.node(0).attributes["perm"].as_ints()) == [0, 3, 2, 1]
    _assert_same_numbers(proto, model)
    _assert_second_run_changes_nothing(model)


def test_two_default_perms_cancel_whatever_the_rank():
    proto = _model([_t("x", "a"), _t("a", "b"), helper.make_node("Relu", ["b"], ["y"])], x_shape=None)
    model, result = _run(proto)
    assert _ops(model) == ["Relu"]
    assert result.stats == {"cancelled_pairs": 1, "merged_pairs": 0}
    _assert_same_numbers(proto, model)


@pytest.mark.parametrize(
    ("nodes", "reason"),
    [
        # x is a graph input: it cannot be renamed to the graph output 'y'.
        ([_t("x", "a", [0, 2, 3, 1]), _t("a", "y", [0, 3, 1, 2])], "cannot be renamed"),
        # Not back to back: a Relu between them.
        ([_t("x", "a", [0, 2, 3, 1]), helper.make_node("Relu", ["a"], ["r"]), _t("r", "y", [0, 3, 1, 2])], None),
        # Merging would remove nothing: the first Transpose is also a graph output.
        ([_t("x", "a", [1, 0, 2, 3]), _t("a", "y", [0, 2, 3, 1])], "other readers"),
    ],
    ids=["input-to-output", "not-adjacent", "first-shared"],
)
def test_near_misses_are_left_alone(nodes, reason):
    outputs = ("y", "a") if reason == "other readers" else ("y",)
    proto = _model(nodes, outputs=outputs)
    model, result = _run(proto)
    assert result.modified is False
    assert result.stats == {"cancelled_pairs": 0, "merged_pairs": 0}
    assert _ops(model) == [n.op_type for n in proto.graph.node]
    if reason is not None:
        assert reason in result.details["near_misses"][0]["reason"]
    _assert_same_numbers(proto, model)


def test_merge_can_be_switched_off_and_bad_option_values_are_refused():
    proto = _model([_t("x", "a", [1, 0, 2, 3]), _t("a", "b", [0, 2, 3, 1]), helper.make_node("Relu", ["b"], ["y"])])
    model, result = _run(proto, transpose_merge="no")
    assert result.modified is False
    assert _ops(model) == ["Transpose", "Transpose", "Relu"]
    with pytest.raises(mograph.OptionError, match="transpose-merge"):
        RemoveDoubleTransposePass(transpose_merge="maybe")
