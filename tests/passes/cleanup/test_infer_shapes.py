"""``infer-shapes``: every value gets its dtype and shape; wrong declared shapes are corrected."""

from __future__ import annotations

import numpy as np
from _cleanup_testing import assert_same_outputs
from _pass_testing import assert_second_run_changes_nothing, run_pass
from mograph.passes.cleanup import InferShapesPass
from onnx import helper

from models.builders import make_model, tensor_info
from mograph.testing import op_types, to_ir

FEEDS = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def _chain(y_shape=None):
    # x[2,3] -> Add w -> Relu -> Reshape to [3, 2] -> y
    nodes = [
        helper.make_node("Add", ["x", "w"], ["t"]),
        helper.make_node("Relu", ["t"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["y"]),
    ]
    inits = {"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "shape": np.array([3, 2], np.int64)}
    return make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, y_shape)], inits)


def _shapes(model):
    return {v.name: (v.dtype, None if v.shape is None else list(v.shape)) for n in model.graph for v in n.outputs}


def test_every_value_gets_dtype_and_shape():
    proto = _chain()
    model = to_ir(proto)
    entry = run_pass(InferShapesPass(), model)
    assert op_types(model) == ["Add", "Relu", "Reshape"]
    f32 = model.graph.inputs[0].dtype
    assert _shapes(model) == {"t": (f32, [2, 3]), "r": (f32, [2, 3]), "y": (f32, [3, 2])}
    assert entry.modified is True
    # t and r were untyped; y had a dtype but no shape.
    assert entry.stats == {"values_changed": 3, "values_with_shape": 3, "declared_shapes_corrected": 0}
    assert_same_outputs(proto, model, FEEDS)
    again = assert_second_run_changes_nothing(InferShapesPass(), model)
    assert again.stats == {"values_changed": 0, "values_with_shape": 3, "declared_shapes_corrected": 0}


def test_declared_shape_contradicted_by_the_computation_is_corrected():
    proto = _chain(y_shape=[5])
    proto.graph.value_info.append(tensor_info("r", np.float32, [7]))  # an exporter's wrong guess
    model = to_ir(proto)
    entry = run_pass(InferShapesPass(), model)
    assert _shapes(model)["r"][1] == [2, 3]
    assert _shapes(model)["y"][1] == [3, 2]
    assert entry.stats == {"values_changed": 3, "values_with_shape": 3, "declared_shapes_corrected": 2}
    assert_same_outputs(proto, model, FEEDS)
    assert_second_run_changes_nothing(InferShapesPass(), model)


def test_declared_symbolic_names_survive():
    # Inference knows the batch only as an unknown dim of x; the declared output names it.
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    proto = make_model(nodes, [("x", np.float32, [None, 3])], [("y", np.float32, ["batch", None])])
    model = to_ir(proto)
    entry = run_pass(InferShapesPass(), model)
    assert str(model.graph.outputs[0].shape) == "[batch,3]"
    assert entry.stats["values_changed"] == 1


def test_fully_typed_model_is_left_alone():
    # The near miss: nothing to add, so nothing changes.
    nodes = [helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["y"])]
    proto = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])
    proto.graph.value_info.append(tensor_info("t", np.float32, [2, 3]))
    model = to_ir(proto)
    entry = run_pass(InferShapesPass(), model)
    assert entry.modified is False
    assert entry.stats == {"values_changed": 0, "values_with_shape": 2, "declared_shapes_corrected": 0}
    assert op_types(model) == ["Relu", "Neg"]


def test_custom_op_outputs_keep_their_declared_shape():
    nodes = [helper.make_node("Mystery", ["x"], ["t"], domain="example.custom"), helper.make_node("Relu", ["t"], ["y"])]
    proto = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, None)], extra_opsets={"example.custom": 1})
    proto.graph.value_info.append(tensor_info("t", np.float32, [4, 5]))
    model = to_ir(proto)
    run_pass(InferShapesPass(), model)
    assert _shapes(model)["t"][1] == [4, 5]
    assert _shapes(model)["y"][1] == [4, 5]


def test_untouched_model_keeps_its_initializer_order():
    """The near miss with a large initializer first: inference sends it without its data and put it back last, so a
    pass that changed nothing (modified False) still reordered the initializers (seen on a jax2onnx export: the
    graph's fingerprint moved).  Now the order is the model's."""
    from onnx import numpy_helper

    from mograph.testing import graph_fingerprint

    big = numpy_helper.from_array(np.ones((16, 48), np.float32), "w_big")  # 3 KB: sent without its data
    small = numpy_helper.from_array(np.ones((48,), np.float32), "b_small")
    nodes = [helper.make_node("MatMul", ["x", "w_big"], ["t"]), helper.make_node("Add", ["t", "b_small"], ["y"])]
    proto = make_model(nodes, [("x", np.float32, [2, 16])], [("y", np.float32, [2, 48])], initializers=[big, small])
    proto.graph.value_info.append(tensor_info("t", np.float32, [2, 48]))
    model = to_ir(proto)
    before = graph_fingerprint(model)
    entry = run_pass(InferShapesPass(), model)
    assert entry.modified is False
    assert list(model.graph.initializers) == ["w_big", "b_small"]
    assert graph_fingerprint(model) == before
