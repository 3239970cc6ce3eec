"""``prune-structured`` through ops mograph does not own: their rule comes from their foreign-op record.

An op whose record says ``elementwise`` couples a channel like ``Add``; one that ``normalizes`` rows couples
a channel on an axis before the normalized ones, like ``LayerNormalization``
(:mod:`mograph.foreign_ops`).  No table of the pass names them, so a plugin's record counts as a built-in one.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from _pass_testing import assert_second_run_changes_nothing, run_pass
from _prune_testing import init_shape
from mograph.passes.prune import PruneStructuredPass
from mograph.passes.prune._deps import op_rules
from onnx import helper, numpy_helper

from models.builders import make_model
from mograph.foreign_ops import ForeignOp
from mograph.shapes import BROADCAST_OPS, REDUCE_OPS
from mograph.testing import op_types, run_ort, to_ir

RNG = np.random.default_rng(0)


def _conv_norm_conv():
    """x[1, 3, 4, 4] -> Conv (8 channels, 4..7 zero) -> SimplifiedLayerNormalization over W -> Conv -> y."""
    w1 = RNG.standard_normal((8, 3, 1, 1)).astype(np.float32)
    b1 = RNG.standard_normal(8).astype(np.float32)
    w2 = RNG.standard_normal((2, 8, 1, 1)).astype(np.float32)
    w1[4:], b1[4:], w2[:, 4:] = 0, 0, 0
    scale = np.linspace(0.5, 1.5, 4).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv1"),
        # ONNX Runtime's contrib op, registered in the default domain
        helper.make_node("SimplifiedLayerNormalization", ["c", "scale"], ["n"], name="rms", axis=-1, epsilon=1e-5),
        helper.make_node("Conv", ["n", "w2"], ["y"], name="conv2"),
    ]
    return make_model(nodes, [("x", np.float32, [1, 3, 4, 4])], [("y", np.float32, [1, 2, 4, 4])],
                      {"w1": w1, "b1": b1, "w2": w2, "scale": scale})


def test_a_normalization_record_couples_the_channels_before_its_axis():
    proto = _conv_norm_conv()
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="conv", round_to=4), model)
    assert entry.modified is True
    assert op_types(model) == ["Conv", "SimplifiedLayerNormalization", "Conv"]
    assert (init_shape(model, "w1"), init_shape(model, "b1"), init_shape(model, "w2")) == ((4, 3, 1, 1), (4,), (2, 4, 1, 1))
    assert init_shape(model, "scale") == (4,)  # on the normalized axis W: not coupled
    s = entry.stats
    assert (s["conv.groups"], s["conv.pruned_groups"], s["conv.blocked_groups"], s["conv.removed_units"]) == (2, 1, 1, 4)
    x = {"x": RNG.standard_normal((1, 3, 4, 4)).astype(np.float32)}
    np.testing.assert_allclose(run_ort(model, x)[0], run_ort(proto, x)[0], rtol=1e-6, atol=1e-6)
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5, scope="conv", round_to=4), model)


def test_normalizing_over_the_channel_axis_blocks():
    proto = _conv_norm_conv()
    for node in proto.graph.node:
        if node.name == "rms":
            node.attribute[0].i = 1  # axis 1: the channels are normalized together
    for t in proto.graph.initializer:
        if t.name == "scale":
            t.CopyFrom(numpy_helper.from_array(np.ones((8, 4, 4), np.float32), "scale"))
    model = to_ir(proto)
    ops = op_types(model)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="conv", round_to=4), model)
    assert entry.modified is False and op_types(model) == ops and init_shape(model, "w1") == (8, 3, 1, 1)
    blocked = {b["group"]: b["reasons"] for b in entry.details["blocked"]}
    assert "SimplifiedLayerNormalization 'rms' normalizes over the channel axis" in blocked["conv1:out"]


def _mlp_through(op_type: str):
    """x[2, 8] -> MatMul w1 -> ``op_type`` -> MatMul w2 -> y; hidden neurons 8..15 zeroed (w1 columns, w2 rows)."""
    w1 = RNG.standard_normal((8, 16)).astype(np.float32)
    w2 = RNG.standard_normal((16, 4)).astype(np.float32)
    w1[:, 8:], w2[8:] = 0, 0
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        helper.make_node(op_type, ["h0"], ["h"], name="act"),
        helper.make_node("MatMul", ["h", "w2"], ["y"], name="fc2"),
    ]
    return make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [2, 4])], {"w1": w1, "w2": w2})


def test_a_plugins_elementwise_record_is_honoured():
    """``Tan`` has no rule of the pass's own; a plugin's record saying it is elementwise gives it one."""
    registry = SimpleNamespace(custom_ops={}, foreign_ops={("", "Tan"): ForeignOp("Tan", "", elementwise=True)})
    proto = _mlp_through("Tan")
    bare = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5), bare)
    assert entry.modified is False
    assert "Tan 'act' (ai.onnx) has no pruning rule" in {r for b in entry.details["blocked"] for r in b["reasons"]}

    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5, registry=registry), model)  # type: ignore[arg-type]
    assert entry.modified is True
    assert op_types(model) == ["MatMul", "Tan", "MatMul"]
    assert (init_shape(model, "w1"), init_shape(model, "w2")) == ((8, 8), (8, 4))
    assert (entry.stats["ffn.pruned_groups"], entry.stats["ffn.removed_units"]) == (1, 8)
    x = {"x": RNG.standard_normal((2, 8)).astype(np.float32)}
    np.testing.assert_allclose(run_ort(model, x)[0], run_ort(proto, x)[0], rtol=1e-6, atol=1e-6)
    assert run_pass(PruneStructuredPass(ratio=0.5, registry=registry), model).modified is False  # type: ignore[arg-type]


def test_rules_follow_the_records():
    rules = op_rules()
    ms = "com.microsoft"
    for key in ((ms, "FastGelu"), (ms, "BiasGelu"), (ms, "QuickGelu"), (ms, "BiasAdd")):
        assert rules[key].__name__ == "_broadcast", key
    for key in (("", "LayerNormalization"), ("", "RMSNormalization"), ("", "SimplifiedLayerNormalization"),
                (ms, "SkipLayerNormalization"), (ms, "SkipSimplifiedLayerNormalization")):
        assert rules[key].__name__ == "_layernorm", key
    assert rules[("", "Gelu")].__name__ == "_unary"  # a standard op's own rule wins over its record
    assert (ms, "EmbedLayerNormalization") not in rules and (ms, "RotaryEmbedding") not in rules
    # the standard op classes are the core's (mograph.shapes), not tables of the pass
    assert {op for (d, op), r in rules.items() if d == "" and r.__name__ == "_broadcast"} == set(BROADCAST_OPS)
    assert {op for (d, op), r in rules.items() if d == "" and r.__name__ == "_reduce"} == set(REDUCE_OPS)
