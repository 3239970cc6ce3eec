"""``eliminate-identity``: readers of an Identity read its input; the graph's interface never changes."""

from __future__ import annotations

import numpy as np
from _cleanup_testing import assert_same_outputs
from _pass_testing import assert_second_run_changes_nothing, run_pass
from mograph.passes.cleanup import EliminateIdentityPass
from onnx import helper

from models.builders import make_model
from mograph.testing import op_types, to_ir

FEEDS = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}


def test_identities_are_removed_and_output_names_kept():
    # x -> Identity -> Relu -> Identity -> y (graph output); the weight is also exposed through an Identity.
    nodes = [
        helper.make_node("Identity", ["x"], ["xi"]),
        helper.make_node("Identity", ["w"], ["wi"]),
        helper.make_node("Add", ["xi", "wi"], ["t"]),
        helper.make_node("Relu", ["t"], ["r"]),
        helper.make_node("Identity", ["r"], ["y"]),
    ]
    w = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    proto = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], {"w": w})
    model = to_ir(proto)
    entry = run_pass(EliminateIdentityPass(), model)
    assert op_types(model) == ["Add", "Relu"]
    assert entry.modified is True
    assert entry.stats == {"removed_identities": 3}
    # Interface kept: same input and output names; Relu now produces the output 'y' itself.
    assert [v.name for v in model.graph.inputs] == ["x"]
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert model.graph.outputs[0].producer().op_type == "Relu"
    assert model.graph.node(0).inputs[0] is model.graph.inputs[0]
    assert_same_outputs(proto, model, FEEDS)
    again = assert_second_run_changes_nothing(EliminateIdentityPass(), model)
    assert again.stats == {"removed_identities": 0}


def test_identity_from_graph_input_to_graph_output_is_kept():
    # The near miss: removing it would make 'x' a graph output under another name (or rename an input).
    nodes = [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["z"])]
    proto = make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3]), ("z", np.float32, [2, 3])])
    model = to_ir(proto)
    entry = run_pass(EliminateIdentityPass(), model)
    assert entry.modified is False
    assert entry.stats == {"removed_identities": 0}
    assert op_types(model) == ["Identity", "Relu"]
    assert [v.name for v in model.graph.outputs] == ["y", "z"]
    assert_same_outputs(proto, model, FEEDS)


def test_identity_whose_input_is_also_a_graph_output_is_kept():
    # r is an output already; y = Identity(r) is a second output. Merging them would lose a name.
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
    proto = make_model(nodes, [("x", np.float32, [2, 3])], [("r", np.float32, [2, 3]), ("y", np.float32, [2, 3])])
    model = to_ir(proto)
    entry = run_pass(EliminateIdentityPass(), model)
    assert entry.modified is False
    assert op_types(model) == ["Relu", "Identity"]
    assert [v.name for v in model.graph.outputs] == ["r", "y"]
    assert_same_outputs(proto, model, FEEDS)


def test_identities_inside_subgraphs():
    # then: Identity(x) of the outer x -> kept (an outer value cannot take the branch output's name);
    # else: Identity(Neg(x)) -> removed, Neg now produces the branch output.
    out = helper.make_tensor_value_info("out_then", 1, [2, 3])
    then_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["out_then"])], "then", [], [out])
    out = helper.make_tensor_value_info("out_else", 1, [2, 3])
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Identity", ["n"], ["out_else"])], "else", [], [out]
    )
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch),
    ]
    proto = make_model(
        nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])], {"zero": np.array(0.0, np.float32)}
    )
    model = to_ir(proto)
    entry = run_pass(EliminateIdentityPass(), model)
    assert entry.stats == {"removed_identities": 1}
    branches = model.graph.node(2).attributes
    assert [n.op_type for n in branches["then_branch"].as_graph()] == ["Identity"]
    assert [n.op_type for n in branches["else_branch"].as_graph()] == ["Neg"]
    assert branches["else_branch"].as_graph().outputs[0].name == "out_else"
    for sign in (1.0, -1.0):
        assert_same_outputs(proto, model, {"x": sign * np.abs(FEEDS["x"])})
    assert_second_run_changes_nothing(EliminateIdentityPass(), model)
