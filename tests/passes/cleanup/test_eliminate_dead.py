"""``eliminate-dead``: nodes and initializers no graph output depends on are removed."""

from __future__ import annotations

import numpy as np
from _cleanup_testing import assert_same_outputs
from _pass_testing import assert_second_run_changes_nothing, run_pass
from mograph.passes.cleanup import EliminateDeadPass
from onnx import helper

from models.builders import make_model
from mograph.testing import op_types, to_ir

FEEDS = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def test_dead_nodes_and_initializers_are_removed():
    nodes = [
        helper.make_node("Add", ["x", "w"], ["t"]),
        helper.make_node("Relu", ["t"], ["y"]),
        helper.make_node("Sigmoid", ["x"], ["s"]),  # dead
        helper.make_node("Mul", ["s", "v"], ["m"]),  # dead, and with it the initializer v
    ]
    inits = {"w": np.ones((2, 3), np.float32), "v": np.full((2, 3), 2.0, np.float32), "unused": np.zeros(4, np.float32)}
    proto = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], inits)
    model = to_ir(proto)
    entry = run_pass(EliminateDeadPass(), model)
    assert op_types(model) == ["Add", "Relu"]
    assert sorted(model.graph.initializers) == ["w"]
    assert entry.modified is True
    assert entry.stats == {
        "removed_nodes": 2,
        "removed_initializers": 2,
        "removed.Mul": 1,
        "removed.Sigmoid": 1,
    }
    assert_same_outputs(proto, model, FEEDS)
    again = assert_second_run_changes_nothing(EliminateDeadPass(), model)
    assert again.stats == {"removed_nodes": 0, "removed_initializers": 0}


def test_live_graph_is_untouched_even_with_unused_extra_outputs():
    # Near miss: Split's second output is unused, but the node is live through its first output.
    nodes = [
        helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    inits = {"sizes": np.array([2, 1], np.int64)}
    proto = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 2])], inits)
    model = to_ir(proto)
    entry = run_pass(EliminateDeadPass(), model)
    assert entry.modified is False
    assert entry.stats == {"removed_nodes": 0, "removed_initializers": 0}
    assert op_types(model) == ["Split", "Relu"]
    assert_same_outputs(proto, model, FEEDS)
