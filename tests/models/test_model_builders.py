"""The hand-built test models are valid ONNX, run in ONNX Runtime with its optimizations off, and compute
what they claim to (the decomposed LayerNorm is a LayerNorm, padding is masked)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from models import builders
from models.builders import bert_feeds, bert_tiny, cnn_small, make_model, random_feeds, tensor_info

ort = pytest.importorskip("onnxruntime")


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _check(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


@pytest.mark.parametrize("opset", [14, 17, 18, 21])
@pytest.mark.parametrize("dynamic", [True, False])
def test_bert_tiny_is_valid(opset: int, dynamic: bool) -> None:
    _check(bert_tiny(opset=opset, dynamic=dynamic, pooler=True))


@pytest.mark.parametrize("opset", [14, 17, 18])
@pytest.mark.parametrize("position_ids", ["slice", "range"])
def test_bert_tiny_runs_at_several_sizes(opset: int, position_ids: str) -> None:
    model = bert_tiny(opset=opset, position_ids=position_ids, pooler=True)
    sess = _session(model)
    for batch, seq in [(1, 1), (2, 7), (3, 16), (1, 128)]:
        hidden, pooled = sess.run(None, bert_feeds(batch, seq, seed=batch + seq))
        assert hidden.shape == (batch, seq, 64) and pooled.shape == (batch, 64)
        assert np.isfinite(hidden).all() and np.isfinite(pooled).all()
        # Each position is LayerNorm'd with gamma ~ 1: unit-ish spread, far from the 0.02 weight scale.
        assert 0.5 < hidden.std() < 2.0


def test_bert_tiny_static_shapes() -> None:
    model = bert_tiny(dynamic=False)
    dims = [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input]
    assert dims == [[1, 16], [1, 16]]
    assert not any(n.op_type == "Shape" for n in model.graph.node)
    (hidden,) = _session(model).run(None, bert_feeds(1, 16))
    assert hidden.shape == (1, 16, 64) and np.isfinite(hidden).all()


def test_bert_tiny_reduce_mean_form_follows_opset() -> None:
    for opset, n_inputs, has_axes_attr in [(17, 1, True), (18, 2, False)]:
        means = [n for n in bert_tiny(opset=opset).graph.node if n.op_type == "ReduceMean"]
        assert len(means) == 2 * (1 + 2 * 2)  # two per LayerNorm: embeddings + two per layer
        assert all(len(n.input) == n_inputs for n in means)
        assert all(any(a.name == "axes" for a in n.attribute) == has_axes_attr for n in means)


def test_bert_tiny_position_variants_agree() -> None:
    feeds = bert_feeds(2, 9, seed=3)
    (by_slice,) = _session(bert_tiny(position_ids="slice")).run(None, feeds)
    (by_range,) = _session(bert_tiny(position_ids="range")).run(None, feeds)
    np.testing.assert_array_equal(by_slice, by_range)


def test_bert_tiny_masks_padding() -> None:
    """Changing the tokens under mask 0 must not change any attended position's output."""
    feeds = bert_feeds(2, 10, seed=1, pad=False)
    feeds["attention_mask"][1, 6:] = 0
    sess = _session(bert_tiny())
    (before,) = sess.run(None, feeds)
    feeds["input_ids"][1, 6:] = (feeds["input_ids"][1, 6:] + 1) % 100
    (after,) = sess.run(None, feeds)
    np.testing.assert_allclose(after[1, :6], before[1, :6], atol=1e-6)
    np.testing.assert_array_equal(after[0], before[0])


@pytest.mark.parametrize("opset", [17, 18])
def test_bert_tiny_layer_norms_equal_numpy(opset: int) -> None:
    """Every decomposed LayerNorm subgraph computes LayerNorm of its input (read back as extra outputs)."""
    model = bert_tiny(opset=opset)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    scopes: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if "/LayerNorm/" in node.name and node.op_type != "Constant":
            scopes.setdefault(node.name.rsplit("/", 1)[0], []).append(node)
    assert len(scopes) == 5
    probes = []  # (input name, output name, gamma, beta)
    for nodes in scopes.values():
        assert [n.op_type for n in nodes] == [
            "ReduceMean", "Sub", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Add"
        ]  # fmt: skip
        gamma, beta = inits[nodes[7].input[1]], inits[nodes[8].input[1]]
        probes.append((nodes[0].input[0], nodes[-1].output[0], gamma, beta))
    extra = {name for p in probes for name in p[:2]} - {o.name for o in model.graph.output}
    model.graph.output.extend(tensor_info(name, np.float32, None) for name in sorted(extra))
    sess = _session(model)
    names = [o.name for o in sess.get_outputs()]
    values = dict(zip(names, sess.run(None, bert_feeds(2, 11, seed=5))))
    for x_name, y_name, gamma, beta in probes:
        x = values[x_name].astype(np.float64)
        expect = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-12) * gamma + beta
        np.testing.assert_allclose(values[y_name], expect, atol=1e-5, rtol=1e-5)


def test_bert_tiny_is_deterministic() -> None:
    assert bert_tiny(seed=7).SerializeToString() == bert_tiny(seed=7).SerializeToString()
    assert bert_tiny(seed=7).SerializeToString() != bert_tiny(seed=8).SerializeToString()


def test_bert_tiny_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="opset"):
        bert_tiny(opset=12)
    with pytest.raises(ValueError, match="divisible"):
        bert_tiny(hidden=30, heads=4)


@pytest.mark.parametrize("opset", [14, 17, 18])
def test_cnn_small_is_valid_and_runs(opset: int) -> None:
    model = cnn_small(opset=opset)
    _check(model)
    sess = _session(model)
    for batch in (1, 2, 5):
        (logits,) = sess.run(None, random_feeds(model, {"batch": batch}, seed=batch))
        assert logits.shape == (batch, 10) and np.isfinite(logits).all()
    ops = {n.op_type for n in model.graph.node}
    assert {"Conv", "BatchNormalization", "Relu", "Add", "MaxPool", "GlobalAveragePool", "Flatten", "Gemm"} <= ops


def test_cnn_small_static_batch() -> None:
    model = cnn_small(batch=3, dynamic_batch=False)
    _check(model)
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [3, 3, 32, 32]
    (logits,) = _session(model).run(None, random_feeds(model))
    assert logits.shape == (3, 10)
    assert cnn_small(seed=1).SerializeToString() == cnn_small(seed=1).SerializeToString()


def test_make_model_and_random_feeds() -> None:
    node = onnx.helper.make_node("Add", ["x", "b"], ["y"])
    model = make_model(
        [node], [("x", np.float32, ["n", 4])], [("y", np.float32, ["n", 4])], {"b": np.ones(4, np.float32)}, 18
    )
    _check(model)
    assert model.ir_version == 8
    feeds = random_feeds(model, {"n": 3})
    assert list(feeds) == ["x"] and feeds["x"].shape == (3, 4)
    (y,) = _session(model).run(None, feeds)
    np.testing.assert_allclose(y, feeds["x"] + 1)
    assert builders.MIN_OPSET == 13
