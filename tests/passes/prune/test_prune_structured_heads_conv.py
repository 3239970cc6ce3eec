"""``prune-structured --scope heads`` and ``--scope conv`` on hand-built BERT and ResNet-like graphs.

Heads whose Q, K, V columns, biases and output-projection rows are all zero contribute exactly nothing
(their scores are 0, their values are 0), so removing them leaves every output bit-identical, at any
sequence length.  Conv channels whose weights and BatchNorm scale and shift are zero output exactly 0.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from _pass_testing import assert_second_run_changes_nothing, run_pass
from _prune_testing import checked, init_shape, zero_slices
from mograph.passes.prune import PruneStructuredPass
from onnx import helper

from models.builders import bert_feeds, bert_tiny, cnn_small, make_model, random_feeds
from mograph.testing import op_types, run_ort, to_ir

HIDDEN, HEADS, HEAD_DIM = 32, 4, 8


def _heads_zeroed(dynamic: bool, heads: tuple[int, ...] = (1, 3)):
    proto = bert_tiny(layers=2, hidden=HIDDEN, heads=HEADS, ffn=64, dynamic=dynamic)
    idx = [h * HEAD_DIM + j for h in heads for j in range(HEAD_DIM)]
    spec = []
    for layer in range(2):
        att = f"encoder.layer.{layer}.attention"
        for proj in ("query", "key", "value"):
            spec += [(f"{att}.self.{proj}.weight", 1, idx), (f"{att}.self.{proj}.bias", 0, idx)]
        spec.append((f"{att}.output.dense.weight", 0, idx))
    return zero_slices(proto, spec)


def _reshape_targets(model: ir.Model) -> list[list[int | None]]:
    """The literal parts of every attention Reshape target (None for run-time parts)."""
    out = []
    for node in model.graph:
        if node.op_type != "Reshape" or "attention/self" not in node.name:
            continue
        target = node.inputs[1]
        producer = target.producer()
        if producer is not None and producer.op_type == "Concat":
            parts = []
            for part in producer.inputs:
                value = ir.convenience.get_const_tensor(part)
                parts += value.numpy().tolist() if value is not None else [None]
            out.append(parts)
        else:
            out.append(ir.convenience.get_const_tensor(target).numpy().tolist())
    return out


def _head_params(heads: int) -> int:
    width = heads * HEAD_DIM
    return 3 * (HIDDEN * width + width) + width * HIDDEN


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_zero_heads_are_removed_and_outputs_are_bit_identical(dynamic):
    proto = _heads_zeroed(dynamic)
    model = to_ir(proto)
    ops = op_types(model)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="heads"), model)

    assert entry.modified is True
    assert op_types(model) == ops
    for layer in range(2):
        att = f"encoder.layer.{layer}.attention"
        assert init_shape(model, f"{att}.self.query.weight") == (HIDDEN, 2 * HEAD_DIM)
        assert init_shape(model, f"{att}.self.value.bias") == (2 * HEAD_DIM,)
        assert init_shape(model, f"{att}.output.dense.weight") == (2 * HEAD_DIM, HIDDEN)
    # Q/K/V targets now split into 2 heads; the merge-back target is 2 x 8 = 16 wide.
    targets = _reshape_targets(model)
    if dynamic:
        assert targets == [[None, None, 2, HEAD_DIM]] * 3 + [[None, None, 2 * HEAD_DIM]] + (
            [[None, None, 2, HEAD_DIM]] * 3 + [[None, None, 2 * HEAD_DIM]]
        )
    else:
        assert targets == ([[1, 16, 2, HEAD_DIM]] * 3 + [[1, 16, 2 * HEAD_DIM]]) * 2
    s = entry.stats
    assert (s["heads.groups"], s["heads.pruned_groups"], s["heads.blocked_groups"], s["heads.removed_units"]) == (
        2, 2, 0, 4
    )
    assert (s["heads.params_before"], s["heads.params_after"]) == (2 * _head_params(4), 2 * _head_params(2))
    assert s["params_before"] - s["params_after"] == 2 * (_head_params(4) - _head_params(2))
    assert {g["group"]: g["status"] for g in entry.details["groups"]} == {
        "/encoder/layer.0/attention/self/Reshape:heads": "pruned",
        "/encoder/layer.1/attention/self/Reshape:heads": "pruned",
    }

    pruned = checked(model)
    for seq in (5, 16, 33) if dynamic else (16,):
        feeds = bert_feeds(batch=2 if dynamic else 1, seq=seq)
        np.testing.assert_array_equal(run_ort(pruned, feeds)[0], run_ort(proto, feeds)[0])
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5, scope="heads"), model)


def test_heads_and_ffn_together_on_random_weights_stay_valid():
    proto = bert_tiny(layers=2, hidden=HIDDEN, heads=HEADS, ffn=64, pooler=True)
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="all"), model)
    s = entry.stats
    assert (s["heads.pruned_groups"], s["ffn.pruned_groups"], s["conv.groups"]) == (2, 2, 0)
    # With heads analysed first, Q/K/V neurons belong to the head groups: ffn sees the FFN dims, the
    # residual stream and the pooler (read by a graph output).
    assert (s["ffn.groups"], s["ffn.blocked_groups"]) == (4, 2)
    assert s["macs_after"] < s["macs_before"] and s["params_after"] < s["params_before"]
    pruned = checked(model)
    for seq in (4, 16):
        outs = run_ort(pruned, bert_feeds(batch=2, seq=seq))
        assert [o.shape for o in outs] == [(2, seq, HIDDEN), (2, HIDDEN)]
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5, scope="all"), model)


def test_shared_reshape_constant_gets_a_private_copy():
    """A target constant shared with a Reshape outside the group is copied, not edited in place."""
    proto = _heads_zeroed(dynamic=False)
    # Make layer 1's Q reshape read layer 0's target constant too (as a deduplicating exporter would).
    nodes = list(proto.graph.node)
    l0 = next(n for n in nodes if n.name == "/encoder/layer.0/attention/self/Reshape")
    l1 = next(n for n in nodes if n.name == "/encoder/layer.1/attention/self/Reshape")
    l1.input[1] = l0.input[1]
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="heads", exclude=["/encoder/layer.1/*"]), model)
    assert (entry.stats["heads.pruned_groups"], entry.stats["heads.excluded_groups"]) == (1, 1)
    feeds = bert_feeds(batch=1, seq=16)
    np.testing.assert_array_equal(run_ort(checked(model), feeds)[0], run_ort(proto, feeds)[0])
    targets = _reshape_targets(model)
    assert targets[0] == [1, 16, 2, HEAD_DIM] and targets[4] == [1, 16, HEADS, HEAD_DIM]


# ----------------------------------------------------------------------------------------------- conv

CONV_CHANNELS = {"stem": 16, "block1.0": 16, "block1.1": 16, "down": 32}


def _conv_zeroed():
    """Zero the upper half of every conv's output channels (weights, BN scale and shift).

    The stem and block1.1 share channels through the residual Add, so they are one group. Trailing
    channels keep the summation order of the surviving ones, so the result is bit-identical.
    """
    proto = cnn_small()
    spec = []
    for name, c in CONV_CHANNELS.items():
        idx = list(range(c // 2, c))
        spec += [(f"{name}.conv.weight", 0, idx), (f"{name}.bn.weight", 0, idx), (f"{name}.bn.bias", 0, idx)]
    return zero_slices(proto, spec)


def test_zero_conv_channels_are_removed_with_bn_and_residual():
    proto = _conv_zeroed()
    model = to_ir(proto)
    ops = op_types(model)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="conv"), model)
    assert entry.modified is True
    assert op_types(model) == ops
    assert init_shape(model, "stem.conv.weight") == (8, 3, 3, 3)
    assert init_shape(model, "block1.0.conv.weight") == (8, 8, 3, 3)
    assert init_shape(model, "block1.1.conv.weight") == (8, 8, 3, 3)  # residual partner of the stem
    assert init_shape(model, "down.conv.weight") == (16, 8, 3, 3)
    assert init_shape(model, "down.bn.running_var") == (16,)
    assert init_shape(model, "fc.weight") == (10, 16)  # Gemm transB=1: input channels are axis 1
    s = entry.stats
    assert (s["conv.groups"], s["conv.pruned_groups"], s["conv.blocked_groups"], s["conv.removed_units"]) == (
        3, 3, 0, 32
    )
    conv_params = {  # weights + BN (4 vectors) per conv, + fc weight columns
        "before": 16 * 3 * 9 + 16 * 16 * 9 * 2 + 32 * 16 * 9 + 4 * (16 * 3 + 32) + 10 * 32,
        "after": 8 * 3 * 9 + 8 * 8 * 9 * 2 + 16 * 8 * 9 + 4 * (8 * 3 + 16) + 10 * 16,
    }
    assert (s["conv.params_before"], s["conv.params_after"]) == (conv_params["before"], conv_params["after"])
    assert s["params_before"] - s["params_after"] == conv_params["before"] - conv_params["after"]
    assert s["conv.macs_before"] == 32 * 32 * 16 * 27 + 2 * 16 * 16 * 16 * 144 + 8 * 8 * 32 * 144 + 10 * 32
    assert s["conv.macs_after"] == 32 * 32 * 8 * 27 + 2 * 16 * 16 * 8 * 72 + 8 * 8 * 16 * 72 + 10 * 16
    pruned = checked(model)
    feeds = random_feeds(proto, {"batch": 3})
    np.testing.assert_array_equal(run_ort(pruned, feeds)[0], run_ort(proto, feeds)[0])
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5, scope="conv"), model)


def test_conv_round_to_keeps_multiples():
    model = to_ir(cnn_small())
    # 25% of 16 -> keep 12 -> rounded up to 16: nothing to prune in the 16-channel groups; 32 -> 24.
    entry = run_pass(PruneStructuredPass(ratio=0.25, scope="conv"), model)
    assert entry.stats["conv.removed_units"] == 8
    assert init_shape(model, "down.conv.weight") == (24, 16, 3, 3)
    statuses = [g["status"] for g in entry.details["groups"]]
    assert statuses == ["kept", "kept", "pruned"]
    run_ort(checked(model), random_feeds(cnn_small(), {"batch": 2}))


def test_conv_near_miss_channel_read_by_graph_output():
    # The block1.0 activation is also a graph output: its group must not shrink.
    proto = _conv_zeroed()
    relu = next(n for n in proto.graph.node if n.name == "/block1.0/Relu")
    proto.graph.output.append(helper.make_tensor_value_info(relu.output[0], 1, ["batch", 16, 16, 16]))
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="conv", exclude=["/stem/*", "/down/*"]), model)
    assert entry.modified is False
    assert init_shape(model, "block1.0.conv.weight") == (16, 16, 3, 3)
    blocked = {b["group"]: b["reasons"] for b in entry.details["blocked"]}
    assert blocked == {"/block1.0/conv/Conv:out": ["'/block1.0/Relu_output_0' is a graph output"]}
    feeds = random_feeds(proto, {"batch": 2})
    for got, want in zip(run_ort(checked(model), feeds), run_ort(proto, feeds)):
        np.testing.assert_array_equal(got, want)


def test_grouped_conv_is_not_a_seed_and_blocks_its_producer():
    rng = np.random.default_rng(0)
    w = {"w1": rng.standard_normal((8, 3, 1, 1)).astype(np.float32),
         "dw": rng.standard_normal((8, 1, 3, 3)).astype(np.float32)}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="pw"),
        helper.make_node("Conv", ["a", "dw"], ["y"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
    ]
    proto = make_model(nodes, [("x", np.float32, [1, 3, 8, 8])], [("y", np.float32, [1, 8, 8, 8])], w)
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="conv", round_to=1), model)
    assert entry.modified is False
    assert entry.details["blocked"] == [
        {"group": "pw:out", "scope": "conv", "reasons": ["Conv 'depthwise': grouped convolution (group=8)"]}
    ]


def test_fused_qkv_split_offsets_and_sizes():
    """One MatMul makes Q, K and V; a Split cuts them apart: each head lives at three offsets of the
    fused weight, and the Split sizes shrink with it."""
    rng = np.random.default_rng(5)
    hidden, head_dim = 16, 8
    w = {
        "w_qkv": rng.standard_normal((hidden, 3 * hidden)).astype(np.float32),
        "b_qkv": rng.standard_normal(3 * hidden).astype(np.float32),
        "w_o": rng.standard_normal((hidden, hidden)).astype(np.float32),
        "sizes": np.array([hidden] * 3, np.int64),
        "split_shape": np.array([1, 4, 2, head_dim], np.int64),
        "merge_shape": np.array([1, 4, hidden], np.int64),
    }
    for base in (0, hidden, 2 * hidden):  # head 1 of Q, K and V
        w["w_qkv"][:, base + 8 : base + 16] = 0
        w["b_qkv"][base + 8 : base + 16] = 0
    w["w_o"][8:16] = 0
    nodes = [
        helper.make_node("MatMul", ["x", "w_qkv"], ["qkv0"], name="qkv"),
        helper.make_node("Add", ["qkv0", "b_qkv"], ["qkv1"]),
        helper.make_node("Split", ["qkv1", "sizes"], ["q0", "k0", "v0"], axis=2, name="split"),
        helper.make_node("Reshape", ["q0", "split_shape"], ["q1"], name="reshape_q"),
        helper.make_node("Reshape", ["k0", "split_shape"], ["k1"], name="reshape_k"),
        helper.make_node("Reshape", ["v0", "split_shape"], ["v1"], name="reshape_v"),
        helper.make_node("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k1"], ["k"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["q", "k"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["c0"]),
        helper.make_node("Transpose", ["c0"], ["c1"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["c1", "merge_shape"], ["c"], name="merge"),
        helper.make_node("MatMul", ["c", "w_o"], ["y"], name="out"),
    ]
    proto = make_model(nodes, [("x", np.float32, [1, 4, hidden])], [("y", np.float32, [1, 4, hidden])], w)
    model = to_ir(proto)
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="heads", round_to=1), model)
    assert (entry.stats["heads.groups"], entry.stats["heads.pruned_groups"]) == (1, 1)
    assert init_shape(model, "w_qkv") == (hidden, 3 * head_dim)
    assert init_shape(model, "w_o") == (head_dim, hidden)
    consts = {n: model.graph.initializers[n].const_value.numpy().tolist() for n in ("sizes", "split_shape", "merge_shape")}
    assert consts == {"sizes": [8, 8, 8], "split_shape": [1, 4, 1, 8], "merge_shape": [1, 4, 8]}
    feeds = {"x": rng.standard_normal((1, 4, hidden)).astype(np.float32)}
    np.testing.assert_array_equal(run_ort(checked(model), feeds)[0], run_ort(proto, feeds)[0])
    assert_second_run_changes_nothing(PruneStructuredPass(ratio=0.5, scope="heads", round_to=1), model)
