"""``cse``: two nodes computing the same thing from the same inputs become one."""

from __future__ import annotations

import numpy as np
from _cleanup_testing import assert_same_outputs
from _pass_testing import assert_second_run_changes_nothing, run_pass
from mograph.passes.cleanup import CsePass
from onnx import helper, numpy_helper

from models.builders import make_model
from mograph.testing import op_types, to_ir

FEEDS = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
IO = ([("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])


def _const(name: str, value) -> helper.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32), ""))


def test_duplicates_are_merged():
    # Two Relu(x), two equal small Constants feeding two equal Muls.
    nodes = [
        helper.make_node("Relu", ["x"], ["r1"]),
        helper.make_node("Relu", ["x"], ["r2"]),
        _const("c1", [2.0, 3.0, 4.0]),
        _const("c2", [2.0, 3.0, 4.0]),
        helper.make_node("Mul", ["r1", "c1"], ["m1"]),
        helper.make_node("Mul", ["r2", "c2"], ["m2"]),
        helper.make_node("Add", ["m1", "m2"], ["y"]),
    ]
    proto = make_model(nodes, *IO)
    model = to_ir(proto)
    entry = run_pass(CsePass(), model)
    assert op_types(model) == ["Relu", "Constant", "Mul", "Add"]
    assert entry.modified is True
    assert entry.stats == {"merged_nodes": 3, "merged.Constant": 1, "merged.Mul": 1, "merged.Relu": 1}
    add = model.graph.node(3)
    assert add.inputs[0] is add.inputs[1]
    assert_same_outputs(proto, model, FEEDS)
    again = assert_second_run_changes_nothing(CsePass(), model)
    assert again.stats == {"merged_nodes": 0}


def test_different_attributes_or_values_are_not_merged():
    # Near misses: same op, different attribute; equal-looking constants that differ in one element.
    nodes = [
        helper.make_node("LeakyRelu", ["x"], ["a"], alpha=0.1),
        helper.make_node("LeakyRelu", ["x"], ["b"], alpha=0.2),
        _const("c1", [2.0, 3.0, 4.0]),
        _const("c2", [2.0, 3.0, 5.0]),
        helper.make_node("Mul", ["a", "c1"], ["m1"]),
        helper.make_node("Mul", ["b", "c2"], ["m2"]),
        helper.make_node("Add", ["m1", "m2"], ["y"]),
    ]
    proto = make_model(nodes, *IO)
    model = to_ir(proto)
    entry = run_pass(CsePass(), model)
    assert entry.modified is False
    assert entry.stats == {"merged_nodes": 0}
    assert op_types(model) == [n.op_type for n in proto.graph.node]
    assert_same_outputs(proto, model, FEEDS)


def test_constants_above_the_size_limit_are_not_compared_by_value():
    big = np.arange(3, dtype=np.float32)
    nodes = [
        _const("c1", big),
        _const("c2", big),
        helper.make_node("Mul", ["x", "c1"], ["m1"]),
        helper.make_node("Mul", ["x", "c2"], ["m2"]),
        helper.make_node("Add", ["m1", "m2"], ["y"]),
    ]
    proto = make_model(nodes, *IO)
    limited = to_ir(proto)
    entry = run_pass(CsePass(cse_size_limit=2), limited)
    assert entry.modified is False
    assert op_types(limited) == ["Constant", "Constant", "Mul", "Mul", "Add"]

    default = to_ir(proto)
    entry = run_pass(CsePass(), default)
    assert op_types(default) == ["Constant", "Mul", "Add"]
    assert entry.stats == {"merged_nodes": 2, "merged.Constant": 1, "merged.Mul": 1}
    assert_same_outputs(proto, default, FEEDS)
