"""``topo-sort``: every node after the producers of its inputs; a sorted graph keeps its order."""

from __future__ import annotations

import numpy as np
from _cleanup_testing import assert_same_outputs
from _pass_testing import assert_second_run_changes_nothing, run_pass
from mograph.passes.cleanup import TopoSortPass
from onnx import helper

from models.builders import make_model
from mograph.testing import op_types, to_ir

FEEDS = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
IO = ([("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])


def _is_sorted(model) -> bool:
    seen = set()
    for node in model.graph:
        for v in node.inputs:
            if v is not None and v.producer() is not None and id(v.producer()) not in seen:
                return False
        seen.add(id(node))
    return True


def test_unsorted_graph_is_sorted():
    # Written backwards: y = Relu(t2), t2 = Neg(t1), t1 = Abs(x).
    nodes = [
        helper.make_node("Relu", ["t2"], ["y"]),
        helper.make_node("Neg", ["t1"], ["t2"]),
        helper.make_node("Abs", ["x"], ["t1"]),
    ]
    proto = make_model(nodes, *IO)
    model = to_ir(proto)
    assert not _is_sorted(model)
    entry = run_pass(TopoSortPass(), model)
    assert op_types(model) == ["Abs", "Neg", "Relu"]
    assert _is_sorted(model)
    assert entry.modified is True
    assert entry.stats == {"nodes_moved": 2}  # Abs and Relu swapped places; Neg stayed in the middle
    assert_same_outputs(proto, model, FEEDS)
    again = assert_second_run_changes_nothing(TopoSortPass(), model)
    assert again.stats == {"nodes_moved": 0}


def test_sorted_graph_keeps_its_order():
    # Near miss: two independent branches in a valid but non-canonical order stay as they are.
    nodes = [
        helper.make_node("Neg", ["x"], ["b"]),
        helper.make_node("Abs", ["x"], ["a"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    proto = make_model(nodes, *IO)
    model = to_ir(proto)
    entry = run_pass(TopoSortPass(), model)
    assert entry.modified is False
    assert entry.stats == {"nodes_moved": 0}
    assert op_types(model) == ["Neg", "Abs", "Add"]
    assert_same_outputs(proto, model, FEEDS)
