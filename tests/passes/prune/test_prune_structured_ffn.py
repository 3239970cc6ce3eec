"""``prune-structured --scope ffn``: FFN neurons and the weights, biases and activations coupled to them.

The exactness tests zero some neurons' parameters (first-layer columns, biases, second-layer rows):
such neurons contribute exactly nothing, so removing them must leave every output bit-identical
(ONNX Runtime, graph optimizations off).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from _pass_testing import assert_second_run_changes_nothing, run_pass
from _prune_testing import checked, init_shape, zero_slices
from mograph.passes.prune import PruneStructuredPass
from onnx import helper, numpy_helper

from models.builders import bert_feeds, bert_tiny, make_model
from mograph.testing import op_types, run_ort, to_ir

HIDDEN, FFN = 32, 64
ZERO = sorted(np.random.default_rng(1).choice(FFN, 16, replace=False).tolist())  # 16 of 64 neurons, scattered


def _ffn_zeroed(dynamic: bool = True):
    proto = bert_tiny(layers=2, hidden=HIDDEN, heads=2, ffn=FFN, dynamic=dynamic)
    spec = []
    for layer in range(2):
        prefix = f"encoder.layer.{layer}"
        spec += [
            (f"{prefix}.intermediate.dense.weight", 1, ZERO),
            (f"{prefix}.intermediate.dense.bias", 0, ZERO),
            (f"{prefix}.output.dense.weight", 0, ZERO),
        ]
    return zero_slices(proto, spec)


def _ffn_params(units: int) -> int:
    return HIDDEN * units + units + units * HIDDEN


@pytest.mark.parametrize("criterion", ["l1", "l2"])
def test_zero_neurons_are_removed_and_outputs_are_bit_identical(criterion):
    proto = _ffn_zeroed()
    model = to_ir(proto)
    ops_before = op_types(model)
    entry = run_pass(PruneStructuredPass(ratio=0.25, criterion=criterion), model)

    assert entry.modified is True
    assert op_types(model) == ops_before  # pruning shrinks tensors, it adds or removes no node
    for layer in range(2):
        prefix = f"encoder.layer.{layer}"
        assert init_shape(model, f"{prefix}.intermediate.dense.weight") == (HIDDEN, 48)
        assert init_shape(model, f"{prefix}.intermediate.dense.bias") == (48,)
        assert init_shape(model, f"{prefix}.output.dense.weight") == (48, HIDDEN)
        # The surviving neurons are exactly the non-zero ones, in their original order.
        kept = [j for j in range(FFN) if j not in ZERO]
        original = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
        np.testing.assert_array_equal(
            model.graph.initializers[f"{prefix}.output.dense.weight"].const_value.numpy(),
            original[f"{prefix}.output.dense.weight"][kept],
        )
    s = entry.stats
    # Q, K, V neurons of both layers (6, split into heads by a Reshape), the residual stream (1 group running
    # through every decomposed LayerNorm) and the two FFN intermediate dims.
    assert (s["ffn.groups"], s["ffn.pruned_groups"], s["ffn.blocked_groups"]) == (9, 2, 7)
    assert (s["ffn.excluded_groups"], s["ffn.removed_units"]) == (0, 32)
    assert (s["ffn.params_before"], s["ffn.params_after"]) == (2 * _ffn_params(64), 2 * _ffn_params(48))
    # Symbolic batch and sequence count as 1: two MatMuls of HIDDEN x units per layer.
    assert (s["ffn.macs_before"], s["ffn.macs_after"]) == (2 * 2 * HIDDEN * 64, 2 * 2 * HIDDEN * 48)
    assert s["params_before"] - s["params_after"] == 2 * (_ffn_params(64) - _ffn_params(48))
    assert s["macs_before"] - s["macs_after"] == 2 * 2 * HIDDEN * 16

    pruned = checked(model)
    for seq in (3, 16):
        feeds = bert_feeds(batch=2, seq=seq)
        np.testing.assert_array_equal(run_ort(pruned, feeds)[0], run_ort(proto, feeds)[0])
    again = assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.25, criterion=criterion), model)
    assert again.stats["ffn.pruned_groups"] == 0 and again.stats["ffn.removed_units"] == 0


def test_blocked_groups_are_explained():
    model = to_ir(_ffn_zeroed())
    entry = run_pass(PruneStructuredPass(ratio=0.25), model)
    blocked = {b["group"]: b["reasons"] for b in entry.details["blocked"]}
    assert blocked["/encoder/layer.0/attention/self/query/MatMul:out"] == [
        "Reshape '/encoder/layer.0/attention/self/Reshape' splits the channel axis into [2, 16]: "
        "units of 1 do not fit one axis"
    ]
    residual = blocked["/encoder/layer.0/attention/output/dense/MatMul:out"]
    assert any("ReduceMean" in r and "reduces over the channel axis" in r for r in residual)
    assert any("'last_hidden_state' is a graph output" in r for r in residual)
    statuses = {g["group"]: g["status"] for g in entry.details["groups"]}
    assert statuses["/encoder/layer.1/intermediate/dense/MatMul:out"] == "pruned"


def test_static_export_shapes_and_ratio_rounding():
    proto = bert_tiny(layers=1, hidden=HIDDEN, heads=2, ffn=FFN, dynamic=False)
    model = to_ir(proto)
    # 30% of 64 is 19.2 -> remove 19, keep 45 -> rounded up to 48 (multiple of 8).
    entry = run_pass(PruneStructuredPass(ratio=0.3, criterion="l2"), model)
    assert entry.stats["ffn.removed_units"] == 16
    assert init_shape(model, "encoder.layer.0.intermediate.dense.weight") == (HIDDEN, 48)
    groups = {g["group"]: g for g in entry.details["groups"]}
    assert groups["/encoder/layer.0/intermediate/dense/MatMul:out"]["target_units"] == 48
    pruned = checked(model)
    feeds = bert_feeds(batch=1, seq=16)
    out = run_ort(pruned, feeds)[0]
    assert out.shape == (1, 16, HIDDEN) and np.isfinite(out).all()
    # With --round-to 1 the 30% is exact (19 removed) on an unpruned copy.
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.3, round_to=1), model)
    assert entry.stats["ffn.removed_units"] == 19
    run_ort(checked(model), feeds)


def test_ratio_is_relative_to_the_original_size():
    """A second run with the same options is a no-op; a larger ratio prunes further, from the original size."""
    model = to_ir(_ffn_zeroed())
    run_pass(PruneStructuredPass(ratio=0.25), model)
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.25), model)
    entry = run_pass(PruneStructuredPass(ratio=0.5), model)
    assert entry.stats["ffn.removed_units"] == 2 * 16  # 48 -> 32, i.e. half of the original 64
    assert init_shape(model, "encoder.layer.0.intermediate.dense.weight") == (HIDDEN, 32)
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5), model)


def test_exclude_by_node_or_weight_name():
    proto = _ffn_zeroed()
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.25, exclude=["/encoder/layer.0/*"]), model)
    assert (entry.stats["ffn.pruned_groups"], entry.stats["ffn.excluded_groups"]) == (1, 1)
    assert init_shape(model, "encoder.layer.0.intermediate.dense.weight") == (HIDDEN, FFN)
    assert init_shape(model, "encoder.layer.1.intermediate.dense.weight") == (HIDDEN, 48)
    feeds = bert_feeds()
    np.testing.assert_array_equal(run_ort(checked(model), feeds)[0], run_ort(proto, feeds)[0])
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.25, exclude=["*layer.1.output.dense.weight"]), model)
    assert (entry.stats["ffn.pruned_groups"], entry.stats["ffn.excluded_groups"]) == (1, 1)


def test_ratio_zero_changes_nothing():
    model = to_ir(_ffn_zeroed())
    entry = run_pass(PruneStructuredPass(ratio=0.0), model)
    assert entry.modified is False and entry.stats["ffn.removed_units"] == 0


# ----------------------------------------------------------------------------------------- small graphs


def _mlp(read_hidden_by: str | None = None, constants: bool = False):
    """x[2, 8] -> MatMul W1[8, 16] -> Add b1 -> Relu -> MatMul W2[16, 4] -> y; neurons 8..15 zeroed.

    ``read_hidden_by``: also read the hidden activation by a graph output (``"output"``) or by an op
    with no pruning rule (``"CumSum"``).  ``constants``: weights in Constant nodes, not initializers.
    """
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 16)).astype(np.float32)
    b1 = rng.standard_normal(16).astype(np.float32)
    w2 = rng.standard_normal((16, 4)).astype(np.float32)
    w1[:, 8:] = 0
    b1[8:] = 0
    w2[8:] = 0
    weights = {"w1": w1, "b1": b1, "w2": w2}
    nodes, inits = [], {}
    if constants:
        nodes += [helper.make_node("Constant", [], [k], name=f"const_{k}", value=numpy_helper.from_array(v, k))
                  for k, v in weights.items()]
    else:
        inits = weights
    nodes += [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["h"], name="act"),
        helper.make_node("MatMul", ["h", "w2"], ["y"], name="fc2"),
    ]
    outputs = [("y", np.float32, [2, 4])]
    if read_hidden_by == "output":
        outputs.append(("h", np.float32, [2, 16]))
    elif read_hidden_by == "CumSum":
        nodes.append(helper.make_node("Constant", [], ["axis"], value=numpy_helper.from_array(np.array(1, np.int64))))
        nodes.append(helper.make_node("CumSum", ["h", "axis"], ["c"], name="probe"))
        outputs.append(("c", np.float32, [2, 16]))
    return make_model(nodes, [("x", np.float32, [2, 8])], outputs, inits)


X = {"x": np.random.default_rng(2).standard_normal((2, 8)).astype(np.float32)}


def test_weights_in_constant_nodes_are_pruned():
    proto = _mlp(constants=True)
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5), model)
    assert entry.modified is True
    assert op_types(model) == ["Constant"] * 3 + ["MatMul", "Add", "Relu", "MatMul"]
    shapes = {n.outputs[0].name: tuple(n.attributes["value"].value.shape) for n in model.graph if n.op_type == "Constant"}
    assert shapes == {"w1": (8, 8), "b1": (8,), "w2": (8, 4)}
    assert entry.stats["ffn.removed_units"] == 8
    assert (entry.stats["params_before"], entry.stats["params_after"]) == (8 * 16 + 16 + 16 * 4, 8 * 8 + 8 + 8 * 4)
    assert (entry.stats["macs_before"], entry.stats["macs_after"]) == (2 * 16 * 8 + 2 * 4 * 16, 2 * 8 * 8 + 2 * 4 * 8)
    np.testing.assert_array_equal(run_ort(checked(model), X)[0], run_ort(proto, X)[0])
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5), model)


@pytest.mark.parametrize(
    ("reader", "reason"),
    [("output", "'h' is a graph output"), ("CumSum", "CumSum 'probe' (ai.onnx) has no pruning rule")],
)
def test_near_miss_channel_also_read_elsewhere_is_left_alone(reader, reason):
    proto = _mlp(read_hidden_by=reader)
    model = to_ir(proto)
    ops = op_types(model)
    entry = run_pass(PruneStructuredPass(ratio=0.5), model)
    assert entry.modified is False
    assert op_types(model) == ops and init_shape(model, "w1") == (8, 16)
    assert entry.stats["ffn.blocked_groups"] == 2 and entry.stats["ffn.pruned_groups"] == 0
    blocked = {b["group"]: b["reasons"] for b in entry.details["blocked"]}
    assert reason in blocked["fc1:out"]
    assert "'y' is a graph output" in blocked["fc2:out"]
    assert entry.stats["params_after"] == entry.stats["params_before"]
    for got, want in zip(run_ort(checked(model), X), run_ort(proto, X)):
        np.testing.assert_array_equal(got, want)


def test_shared_weight_gets_a_private_copy():
    # w1 is also read by a MatMul outside the group: the group gets a cut copy, 'other' keeps w1 whole.
    proto = _mlp()
    proto.graph.node.append(helper.make_node("MatMul", ["x", "w1"], ["z"], name="other"))
    proto.graph.output.append(helper.make_tensor_value_info("z", 1, [2, 16]))
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5), model)
    assert entry.modified is True and entry.stats["ffn.removed_units"] == 8
    assert init_shape(model, "w1") == (8, 16) and init_shape(model, "w1_pruned") == (8, 8)
    assert [n.inputs[1].name for n in model.graph if n.op_type == "MatMul"] == ["w1_pruned", "w2", "w1"]
    assert entry.stats["params_after"] - entry.stats["params_before"] == 8 * 8 - 8 - 8 * 4  # copy - cuts
    for got, want in zip(run_ort(checked(model), X), run_ort(proto, X)):
        np.testing.assert_array_equal(got, want)
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5), model)


def test_concat_offsets():
    """Two branches concatenated along the channels: each is a group; W3's rows are cut at both offsets."""
    rng = np.random.default_rng(3)
    w = {k: rng.standard_normal(s).astype(np.float32) for k, s in
         {"wa": (8, 16), "wb": (8, 16), "ba": (16,), "bb": (16,), "w3": (32, 4)}.items()}
    w["wa"][:, :8] = 0
    w["ba"][:8] = 0
    w["w3"][:8] = 0  # branch a: neurons 0..7
    w["wb"][:, 8:] = 0
    w["bb"][8:] = 0
    w["w3"][24:] = 0  # branch b: neurons 8..15 (rows 24..31 of W3)
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["a0"], name="fca"),
        helper.make_node("Add", ["a0", "ba"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["a"]),
        helper.make_node("MatMul", ["x", "wb"], ["b0"], name="fcb"),
        helper.make_node("Add", ["b0", "bb"], ["b1"]),
        helper.make_node("Tanh", ["b1"], ["b"]),
        helper.make_node("Concat", ["a", "b"], ["c"], axis=-1),
        helper.make_node("MatMul", ["c", "w3"], ["y"], name="fc3"),
    ]
    proto = make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [2, 4])], w)
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5), model)
    assert entry.stats["ffn.pruned_groups"] == 2 and entry.stats["ffn.removed_units"] == 16
    assert init_shape(model, "w3") == (16, 4)
    np.testing.assert_array_equal(model.graph.initializers["w3"].const_value.numpy(), np.concatenate([w["w3"][8:16], w["w3"][16:24]]))
    assert op_types(model) == ["MatMul", "Add", "Relu", "MatMul", "Add", "Tanh", "Concat", "MatMul"]
    np.testing.assert_array_equal(run_ort(checked(model), X)[0], run_ort(proto, X)[0])
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5), model)


def test_split_straddled_by_a_group_is_explained():
    rng = np.random.default_rng(4)
    w = {"w": rng.standard_normal((8, 32)).astype(np.float32), "sizes": np.array([16, 16], np.int64),
         "wa": rng.standard_normal((16, 4)).astype(np.float32), "wb": rng.standard_normal((16, 4)).astype(np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
        helper.make_node("Split", ["h", "sizes"], ["p", "q"], axis=1, name="split"),
        helper.make_node("MatMul", ["p", "wa"], ["ya"]),
        helper.make_node("MatMul", ["q", "wb"], ["yb"]),
        helper.make_node("Add", ["ya", "yb"], ["y"]),
    ]
    proto = make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [2, 4])], w)
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5), model)
    assert entry.modified is False
    reasons = {b["group"]: b["reasons"] for b in entry.details["blocked"]}["fc:out"]
    assert reasons == ["Split 'split': channels straddle two outputs"]


def test_registered_as_builtin_plugin():
    from mograph import plugins

    registry = plugins.get_registry()
    assert registry.passes["prune-structured"] is PruneStructuredPass
    assert registry.expand(["prune"]) == ["prune-structured", "eliminate-dead"]
    assert isinstance(PruneStructuredPass().config["ratio"], float)
    _ = ir  # onnx_ir is imported for type clarity in helpers


def test_output_figure_is_reported_not_judged():
    """The pruned model's smallest output cosine against the original is in the details (reported only)."""
    from mograph.passes.quant import _output_check as oc

    entry = run_pass(PruneStructuredPass(ratio=0.5, round_to=1), to_ir(_mlp()))
    check = entry.details["output_check"]
    assert check["judged"] is False and check["note"] == oc.UNJUDGED_NOTE and "passed" not in check
    assert check["samples"] == 4 and -1.0 <= check["measured"] <= 1.0
    assert not any(k.startswith("output_check") for k in entry.stats)
    off = run_pass(PruneStructuredPass(ratio=0.5, round_to=1, accuracy_budget="off"), to_ir(_mlp()))
    assert "output_check" not in off.details and off.stats == entry.stats
